"""Epilogue DAG (backends/desc.py expressions) -> the Python source of a CuTe DSL epilogue function.

The generated function is

    def kspec_epilogue(acc, ins, sc, acc1=None):
        v0 = F.mul(sc[0], acc)
        v1 = F.add(v0, ins[0])
        v2 = F.gelu(v1)
        return (v2, v1, v0,)      # D, each auxiliary output, each reduced value

`acc` is the accumulator vector of one epilogue sub-tile (`acc1`: a dual GEMM's second accumulator),
`ins[j]` the matching vector of the j-th tensor input (a row/col broadcast, per batch entry or shared,
or a full M x N tensor, already converted to the accumulator type), `sc[k]` the k-th runtime scalar.
Reduced values (row/column sums and maxima, reduce.py) are returned after the stored ones; the kernel
combines them across the tile.  `F` is `backends/cute/dslops.py` when the kernel is traced,
or its numpy twin in tests.  Shared sub-expressions are computed once.  No user text reaches the
source: inputs and scalars are positional, constants are printed with `repr(float)`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kspec.backends.desc import Accum, Const, EpiExpr, GemmDesc, Load, Op
from kspec.compiler.kir import LOAD_KINDS, VECTOR_AXIS
from kspec.core import DTYPES, KspecInternalError

UNARY = ("neg", "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "exp", "abs", "log", "sqrt", "rsqrt", "not")
BINARY = ("add", "sub", "mul", "div", "maximum", "minimum", "lt", "le", "gt", "ge", "eq", "ne", "and", "or")
# conditions (comparisons, and/or/not) are boolean register vectors that only `where` consumes: the
# derivatives `kspec grad` writes (relu', gelu' at 0, a clamp's range) select in the epilogue
TERNARY = ("where", "clamp")
SUPPORTED_FNS = UNARY + BINARY + TERNARY + ("cast:<dtype>",)
_DSL_NAME = {"and": "land", "or": "lor", "not": "lnot"}
ROW_KINDS = tuple(k for k, axis in VECTOR_AXIS.items() if axis == "n")     # vectors along N, staged per tile
COL_KINDS = tuple(k for k, axis in VECTOR_AXIS.items() if axis == "m")
REDUCTION_OPS = ("sum", "max")


@dataclass(frozen=True)
class EpilogueCode:
    inputs: tuple[Load, ...]      # ins[j]: vector ('row', 'col', per batch '*_batched') / 'full' loads, first use first
    scalars: tuple[Load, ...]     # sc[k]: 'scalar' loads, in first-use order
    source: str                   # the function definition (module-level, named kspec_epilogue)
    reductions: tuple[tuple[str, str], ...] = ()   # (op, axis) of each reduced value, in order

    @property
    def input_kinds(self) -> tuple[str, ...]:
        return tuple(l.kind for l in self.inputs)


def _walk(e: EpiExpr):
    yield e
    if isinstance(e, Op):
        for a in e.args:
            yield from _walk(a)


def unsupported(desc: GemmDesc) -> str | None:
    """Why this backend's epilogue cannot express `desc` (None when it can)."""
    for st in desc.aux_stores:
        if st.dtype != desc.output.dtype or st.layout != desc.output.layout:
            return (f"an auxiliary epilogue output of dtype {st.dtype} ({st.layout}) beside D of "
                    f"{desc.output.dtype} ({desc.output.layout}): the CuTe DSL backend stores aux outputs "
                    "like D only")
    for r in desc.reductions:
        if r.op not in REDUCTION_OPS or r.axis not in ("m", "n"):
            return f"epilogue reduction {r.op} along {r.axis} (the CuTe DSL backend reduces with sum or max along m or n)"
        if r.dtype != "f32" or desc.acc_dtype != "f32":
            return (f"epilogue reduction '{r.name}' of dtype {r.dtype} with a {desc.acc_dtype} accumulator: "
                    "reductions accumulate f32 values with f32 atomics")
    for e in (x for st in (desc.output, *desc.aux_stores, *desc.reductions) for x in _walk(st.value)):
        if isinstance(e, Op):
            fn = e.fn
            if fn.startswith("cast:"):
                if fn[5:] not in DTYPES:
                    return f"cast to unknown dtype {fn[5:]!r}"
            elif fn not in UNARY + BINARY + TERNARY:
                return f"epilogue function '{fn}' is not supported by the CuTe DSL backend"
        elif isinstance(e, Const) and not math.isfinite(e.value):
            return "non-finite constant in the epilogue"
        elif isinstance(e, Load) and e.kind not in LOAD_KINDS:
            return f"epilogue input kind {e.kind!r}"
        elif isinstance(e, Load) and e.kind.endswith("_batched") and not desc.batched:
            return f"a per-batch epilogue vector ({e.kind}) in a GEMM that is not batched"
    if desc.b2 is not None and desc.acc_dtype == "i32":
        return "integer dual GEMMs are not implemented by the CuTe DSL backend"
    if desc.acc_dtype == "i32":
        v = desc.output.value
        while isinstance(v, Op) and v.fn.startswith("cast:"):
            v = v.args[0]
        if not isinstance(v, Accum):
            return "integer GEMMs support only a plain (optionally cast) accumulator store on the CuTe DSL backend"
    return None


def generate(desc: GemmDesc) -> EpilogueCode:
    why = unsupported(desc)
    if why is not None:
        raise KspecInternalError(f"epilogue generation called for an unsupported GEMM {desc.name}: {why}")
    inputs: dict[str, Load] = {}
    scalars: dict[str, Load] = {}
    lines: list[str] = []
    memo: dict[EpiExpr, str] = {}
    acc = desc.acc_dtype

    def emit(e: EpiExpr) -> str:
        if e in memo:
            return memo[e]
        if isinstance(e, Accum):
            if e.index not in ((0, 1) if desc.b2 is not None else (0,)):
                raise KspecInternalError(f"epilogue of {desc.name} reads accumulator {e.index}")
            ref = "acc" if e.index == 0 else "acc1"
        elif isinstance(e, Const):
            ref = repr(float(e.value))
        elif isinstance(e, Load):
            if e.kind == "scalar":
                scalars.setdefault(e.name, e)
                ref = f"sc[{list(scalars).index(e.name)}]"
            else:
                inputs.setdefault(e.name, e)
                ref = f"ins[{list(inputs).index(e.name)}]"
        elif isinstance(e, Op):
            args = [emit(a) for a in e.args]
            if e.fn.startswith("cast:"):
                call = f"F.cast({args[0]}, {e.fn[5:]!r}, {acc!r})"
            else:
                call = f"F.{_DSL_NAME.get(e.fn, e.fn)}({', '.join(args)})"
            ref = f"v{len(lines)}"
            lines.append(f"    {ref} = {call}")
        else:
            raise KspecInternalError(f"unknown epilogue expression {e!r}")
        memo[e] = ref
        return ref

    outs = []
    for st in (desc.output, *desc.aux_stores, *desc.reductions):
        out = emit(st.value)
        if out not in ("acc", "acc1") and not out.startswith("v"):
            # a bare load or constant: broadcast it over the sub-tile
            out = f"F.add(F.mul(acc, 0.0), {out})"
        outs.append(out)
    lines.append(f"    return ({', '.join(outs)},)")
    src = "def kspec_epilogue(acc, ins, sc, acc1=None):\n" + "\n".join(lines) + "\n"
    return EpilogueCode(tuple(inputs.values()), tuple(scalars.values()), src,
                        tuple((r.op, r.axis) for r in desc.reductions))


def run_numpy(code: EpilogueCode, acc, ins, sc, acc1=None):
    """Evaluate a generated epilogue with numpy (tests; same source the kernel traces): a tuple of
    D, the auxiliary outputs and the values to reduce.  acc1: a dual GEMM's second accumulator."""
    from .dslops import numpy_ops
    ns = {"F": numpy_ops()}
    exec(compile(code.source, "<kspec_epilogue>", "exec"), ns)   # noqa: S102  (generated by kspec)
    return ns["kspec_epilogue"](acc, ins, sc, acc1)
