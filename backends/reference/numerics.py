"""numpy storage types and rounding for kspec dtypes (f16/bf16/fp8 through ml_dtypes)."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

STORAGE = {
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f32": np.dtype(np.float32),
    "tf32": np.dtype(np.float32),            # stored as f32; rounded to tf32 where the MMA reads it
    "f8e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "f8e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "i8": np.dtype(np.int8),
    "i32": np.dtype(np.int32),
    "bool": np.dtype(np.bool_),              # a condition: only ever a value inside a kernel
}
INT_LIMITS = {"i8": (-128, 127), "i32": (-(1 << 31), (1 << 31) - 1)}


def storage_dtype(dtype: str) -> np.dtype:
    return STORAGE[dtype]


def is_int(dtype: str) -> bool:
    return dtype in INT_LIMITS


def round_tf32(x: np.ndarray) -> np.ndarray:
    """Round f32 values to tf32 (10 explicit mantissa bits), nearest-even, as the tensor cores read them."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = (bits >> 13) & 1
    rounded = (bits + 0x0FFF + lsb) & np.uint32(0xFFFFE000)
    finite = np.isfinite(x)
    return np.where(finite, rounded.view(np.float32), x).astype(np.float32)


def to_storage(x, dtype: str) -> np.ndarray:
    """Round/convert a computed value to the storage of `dtype` (ints: round to nearest, saturate)."""
    x = np.asarray(x)
    if is_int(dtype):
        lo, hi = INT_LIMITS[dtype]
        if x.dtype.kind == "f":
            x = np.rint(x)
        return np.clip(x, lo, hi).astype(STORAGE[dtype])
    if dtype in ("f8e4m3",):
        # e4m3fn has no infinity: saturate to the largest finite value like the hardware's satfinite
        x = np.clip(np.asarray(x, dtype=np.float32), -448.0, 448.0)
    with np.errstate(over="ignore"):      # out-of-range values become inf, as on the GPU
        return np.asarray(x).astype(STORAGE[dtype])


def to_compute(x) -> np.ndarray:
    """Values as the hardware computes with them: f32 for floats, int64 for integers."""
    x = np.asarray(x)
    if x.dtype.kind in "iu":
        return x.astype(np.int64)
    if x.dtype.kind == "b":
        return x
    return x.astype(np.float32)


_SQRT_HALF = 1.0 / math.sqrt(2.0)


def erf(x: np.ndarray) -> np.ndarray:
    """erf to 1.5e-7 absolute (Abramowitz & Stegun 7.1.26), enough for f32 results."""
    x = np.asarray(x, dtype=np.float64)
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t \
        * np.exp(-a * a)
    return s * y


def gelu(x):
    x64 = np.asarray(x, dtype=np.float64)
    return (0.5 * x64 * (1.0 + erf(x64 * _SQRT_HALF))).astype(np.float32)


def gelu_tanh(x):
    x = np.asarray(x, dtype=np.float32)
    return 0.5 * x * (1.0 + np.tanh(np.float32(math.sqrt(2.0 / math.pi)) * (x + np.float32(0.044715) * x ** 3)))


def sigmoid(x):
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


FUNCTIONS = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "neg": np.negative,
    "maximum": np.maximum, "minimum": np.minimum, "abs": np.abs,
    "relu": lambda x: np.maximum(x, 0), "gelu": gelu, "gelu_tanh": gelu_tanh, "sigmoid": sigmoid,
    "silu": lambda x: np.asarray(x, dtype=np.float32) * sigmoid(x), "tanh": np.tanh, "exp": np.exp,
    "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "clamp": lambda x, lo, hi: np.minimum(np.maximum(x, lo), hi),
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
    "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or, "not": np.logical_not,
    "where": lambda c, a, b: np.where(np.asarray(c, dtype=bool), a, b),
}


def floordiv(a, b):
    """Integer `/`: floor division (rounds toward -inf, as Python's //)."""
    return np.floor_divide(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))


def mod(a, b):
    """Integer `%`: the modulo matching floor division, a - b * (a / b): non-negative for b > 0."""
    return np.mod(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))


def divide(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":
        # C semantics: truncate toward zero; division by zero gives 0 rather than a trap
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(b != 0, np.trunc(a / np.where(b == 0, 1, b)), 0)
        return q.astype(np.int64)
    return np.divide(a, b)
