"""The functions a generated CuTe DSL epilogue calls (`F.add(x, y)`, `F.gelu(x)`, ...).

Generated epilogues (see `epilogue.py`) never call the DSL directly: they call these, with values
that are register vectors (`cute.TensorSSA`, f32 or i32) or scalars (Python floats for constants,
`cutlass.Float32` for runtime parameters).  Keeping the vocabulary here lets a test run the very
same generated function with numpy (`numpy_ops()`), so the epilogue's semantics are checked
without compiling.  Every function is plain Python, inlined when the DSL traces the kernel.
"""
from __future__ import annotations

import math

_SQRT_HALF = 0.7071067811865476
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _cute():
    import cutlass.cute as cute
    return cute


def _is_vec(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "to") and not isinstance(x, (int, float))


def _vec(x, like):
    """x as a vector shaped like `like` (a scalar is broadcast)."""
    if _is_vec(x):
        return x
    return _cute().full_like(like, x)


def _binary(a, b, op):
    if _is_vec(a) or _is_vec(b):
        ref = a if _is_vec(a) else b
        return op(_vec(a, ref), _vec(b, ref))
    return op(a, b)


def add(a, b):
    return _binary(a, b, lambda x, y: x + y)


def sub(a, b):
    return _binary(a, b, lambda x, y: x - y)


def mul(a, b):
    return _binary(a, b, lambda x, y: x * y)


def div(a, b):
    return _binary(a, b, lambda x, y: x / y)


def neg(a):
    return mul(a, -1.0)


def maximum(a, b):
    return _binary(a, b, lambda x, y: _cute().math.max(x, y) if _is_vec(x) else max(x, y))


def minimum(a, b):
    return _binary(a, b, lambda x, y: _cute().math.min(x, y) if _is_vec(x) else min(x, y))


def relu(x):
    return maximum(x, 0.0)


def clamp(x, lo, hi):
    return minimum(maximum(x, lo), hi)


def abs(x):  # noqa: A001  (the name the epilogue vocabulary uses)
    return maximum(x, neg(x))


def exp(x):
    return _cute().math.exp(x)


def tanh(x):
    return _cute().math.tanh(x)


def erf(x):
    return _cute().math.erf(x)


def sigmoid(x):
    return div(1.0, add(1.0, exp(neg(x))))


def silu(x):
    return mul(x, sigmoid(x))


def gelu(x):
    return mul(mul(x, 0.5), add(1.0, erf(mul(x, _SQRT_HALF))))


def gelu_tanh(x):
    inner = mul(add(x, mul(mul(mul(x, x), x), 0.044715)), _SQRT_2_OVER_PI)
    return mul(mul(x, 0.5), add(1.0, tanh(inner)))


# ---- attention score_mod / mask_mod vocabulary (backends/cute/attnmods.py) ------------------
# Values are length-1 register vectors (FA4 calls a generated mod with `__vec_size__ = 1`): f32
# scores, i32 indices, booleans; or scalars (seqlen_info fields, Python constants).

def log(x):
    return _cute().math.log(x)


def sqrt(x):
    return _cute().math.sqrt(x)


def rsqrt(x):
    return _cute().math.rsqrt(x)


def floordiv(a, b):
    return _binary(a, b, lambda x, y: x // y)


def mod(a, b):
    return _binary(a, b, lambda x, y: x % y)


def lt(a, b):
    return _binary(a, b, lambda x, y: x < y)


def le(a, b):
    return _binary(a, b, lambda x, y: x <= y)


def gt(a, b):
    return _binary(a, b, lambda x, y: x > y)


def ge(a, b):
    return _binary(a, b, lambda x, y: x >= y)


def eq(a, b):
    return _binary(a, b, lambda x, y: x == y)


def ne(a, b):
    return _binary(a, b, lambda x, y: x != y)


def where(c, a, b):
    ref = next((x for x in (a, b) if _is_vec(x)), None)
    if ref is None:
        if _is_vec(c):              # two scalar branches: cute.where broadcasts them over c's shape
            return _cute().where(c, a, b)
        return a if c else b
    return _cute().where(c, _vec(a, ref), _vec(b, ref))


def land(a, b):
    return where(a, b, False)


def lor(a, b):
    return where(a, True, b)


def lnot(a):
    return where(a, False, True)


def to_f32(x):
    import cutlass
    return x.to(cutlass.Float32) if _is_vec(x) else float(x) if isinstance(x, int) else x


def to_i32(x):
    """A scalar (seqlen_info field, Python int) as a length-1 i32 vector, so integer arithmetic stays
    in registers."""
    import cutlass
    if _is_vec(x):
        return x
    t = _cute().make_rmem_tensor(1, cutlass.Int32)
    t[0] = x
    return t.load()


def gather(tensor, *index):
    """tensor[index...] as a length-1 f32 vector; each index a length-1 i32 vector or an int."""
    import cutlass
    idx = tuple(i[0] if _is_vec(i) else i for i in index)
    t = _cute().make_rmem_tensor(1, tensor.element_type)
    t[0] = tensor[idx]
    return t.load().to(cutlass.Float32)


_DSL_TYPES = {"f16": "Float16", "bf16": "BFloat16", "f32": "Float32", "tf32": "Float32",
              "f8e4m3": "Float8E4M3FN", "f8e5m2": "Float8E5M2", "i8": "Int8", "i32": "Int32",
              "f8e8m0": "Float8E8M0FNU", "f4e2m1": "Float4E2M1FN"}


def dsl_type(dtype: str):
    import cutlass
    return getattr(cutlass, _DSL_TYPES[dtype])


def cast(x, dtype: str, acc: str = "f32"):
    """Round x to `dtype` and continue computing in the accumulator type."""
    if not _is_vec(x):
        return x
    return x.to(dsl_type(dtype)).to(dsl_type(acc))


def numpy_ops():
    """The same vocabulary over numpy arrays (float32 semantics), for testing generated epilogues."""
    import types

    import numpy as np

    from kspec.numerics import erf as _erf

    ns = types.SimpleNamespace()
    f32 = np.float32
    ns.add = lambda a, b: np.add(a, b, dtype=f32)
    ns.sub = lambda a, b: np.subtract(a, b, dtype=f32)
    ns.mul = lambda a, b: np.multiply(a, b, dtype=f32)
    ns.div = lambda a, b: np.divide(a, b, dtype=f32)
    ns.neg = lambda a: np.negative(np.asarray(a, f32))
    ns.maximum = lambda a, b: np.maximum(a, b).astype(f32)
    ns.minimum = lambda a, b: np.minimum(a, b).astype(f32)
    ns.relu = lambda x: np.maximum(x, 0).astype(f32)
    ns.clamp = lambda x, lo, hi: np.minimum(np.maximum(x, lo), hi).astype(f32)
    ns.abs = lambda x: np.abs(x).astype(f32)
    ns.exp = lambda x: np.exp(np.asarray(x, f32))
    ns.tanh = lambda x: np.tanh(np.asarray(x, f32))
    ns.erf = lambda x: _erf(x).astype(f32)
    ns.sigmoid = lambda x: (1.0 / (1.0 + np.exp(-np.asarray(x, f32)))).astype(f32)
    ns.silu = lambda x: (np.asarray(x, f32) * ns.sigmoid(x)).astype(f32)
    ns.gelu = lambda x: (0.5 * np.asarray(x, f32) * (1.0 + ns.erf(np.asarray(x, f32) * f32(_SQRT_HALF)))).astype(f32)
    ns.gelu_tanh = lambda x: (0.5 * x * (1.0 + np.tanh(f32(_SQRT_2_OVER_PI) * (x + f32(0.044715) * x ** 3)))).astype(f32)

    def _cast(x, dtype, acc="f32"):
        import ml_dtypes
        to = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "f8e4m3": ml_dtypes.float8_e4m3fn,
              "f8e5m2": ml_dtypes.float8_e5m2, "i8": np.int8}.get(dtype)
        if to is None:
            return np.asarray(x, f32)
        return np.asarray(x, f32).astype(to).astype(f32)
    ns.cast = _cast
    # attention mods: integer indices are int64 arrays, booleans bool arrays
    ns.log = lambda x: np.log(np.asarray(x, f32))
    ns.sqrt = lambda x: np.sqrt(np.asarray(x, f32))
    ns.rsqrt = lambda x: (1.0 / np.sqrt(np.asarray(x, f32))).astype(f32)
    ns.floordiv = lambda a, b: np.floor_divide(a, b)
    ns.mod = lambda a, b: np.mod(a, b)
    ns.lt, ns.le, ns.gt, ns.ge = np.less, np.less_equal, np.greater, np.greater_equal
    ns.eq, ns.ne = np.equal, np.not_equal
    ns.where = np.where
    ns.land, ns.lor, ns.lnot = np.logical_and, np.logical_or, np.logical_not
    ns.to_f32 = lambda x: np.asarray(x, f32)
    ns.to_i32 = lambda x: np.asarray(x, np.int64)
    ns.gather = lambda t, *idx: np.asarray(t[tuple(np.asarray(i, np.int64) for i in idx)], f32)
    return ns
