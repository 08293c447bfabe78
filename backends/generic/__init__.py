"""Plain CUDA C++ for plans that are not GEMMs or fused attention: elementwise chains, reductions,
softmax, and contractions CUTLASS cannot take (several reduced indices, mixed or f32 operands).

One thread per output element (per row for softmax); every node's value is rounded to its dtype,
exactly as the numpy reference does, so these kernels match the reference to function accuracy.
The source follows backends/ABI.md: a `Params` struct by value, `kspec_kernel`, and host glue.
Spec names never appear: buffers are `t0`, `t1`, ... and values `v0`, `v1`, ...
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx

from kspec.backends.api import Capabilities, LoweredPlan
from kspec.backends.build import NvccBuilt
from kspec.backends.desc import EmittedKernel
from kspec.backends.names import Names, number_placeholders
from kspec.compiler.graph import op, operands
from kspec.compiler.kir import KINDS, KernelIR
from kspec.core import ABI_VERSION, ARCHS, INT_DTYPES, KspecError, KspecInternalError, check_ident, dtype_bytes

BLOCK = 256


class KspecLoweringError(KspecError):
    """A kernel the plain-CUDA generator cannot express (named with the kernel and arch)."""


_CTYPE = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float", "tf32": "float", "f8e4m3": "__nv_fp8_e4m3",
          "f8e5m2": "__nv_fp8_e5m2", "i8": "int8_t", "i32": "int32_t"}
_INT = INT_DTYPES


@dataclass(frozen=True)
class GenericDesc:
    """A generated plain-CUDA kernel: `body` is the per-thread code over sanitized names."""
    name: str
    arch: str
    body: str
    args: tuple[str, ...]             # buffer identifiers in pointer order
    scalars: tuple[str, ...]
    dims: tuple[str, ...]             # d0, d1, ...: extents of the iteration space, then reduced axes
    threads: str                      # C expression for the number of threads needed
    arg_bytes: tuple[int, ...] = ()   # element size of each argument: the kernel's loads and stores are scalar


def _round(dtype: str, expr: str) -> str:
    """The C expression rounding a float/long long value to `dtype` and back (reference semantics)."""
    if dtype == "bool":
        return f"(({expr}) ? 1LL : 0LL)"
    if dtype in ("f32", "tf32"):
        return f"(float)({expr})"
    if dtype in _INT:
        lo, hi = (-128, 127) if dtype == "i8" else (-2147483648, 2147483647)
        return f"kspec_sat({expr}, {lo}LL, {hi}LL)"
    return f"(float)({_CTYPE[dtype]}((float)({expr})))"


def _load(dtype: str, ptr: str, offset: str) -> str:
    if dtype in _INT:
        return f"(long long)(({_CTYPE[dtype]}*){ptr})[{offset}]"
    return f"(float)(((const {_CTYPE[dtype]}*){ptr})[{offset}])"


def _store(dtype: str, ptr: str, offset: str, value: str) -> str:
    if dtype in _INT:
        return f"(({_CTYPE[dtype]}*){ptr})[{offset}] = ({_CTYPE[dtype]}){value};"
    return f"(({_CTYPE[dtype]}*){ptr})[{offset}] = {_CTYPE[dtype]}((float)({value}));"


_FN = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "kspec_div({0}, {1})", "neg": "(-{0})",
    "relu": "kspec_max({0}, 0)", "gelu": "(0.5f * {0} * (1.0f + erff({0} * 0.70710678118654752f)))",
    "gelu_tanh": "(0.5f * {0} * (1.0f + tanhf(0.7978845608028654f * ({0} + 0.044715f * {0} * {0} * {0}))))",
    "silu": "({0} / (1.0f + expf(-{0})))", "sigmoid": "(1.0f / (1.0f + expf(-{0})))", "tanh": "tanhf({0})",
    "exp": "expf({0})", "log": "logf({0})", "sqrt": "sqrtf({0})", "rsqrt": "rsqrtf({0})", "abs": "kspec_abs({0})",
    "maximum": "kspec_max({0}, {1})", "minimum": "kspec_min({0}, {1})",
    "clamp": "kspec_min(kspec_max({0}, {1}), {2})",
    # integer index arithmetic (floor semantics, as the reference) and conditions (0/1 as long long)
    "floordiv": "kspec_floordiv({0}, {1})", "mod": "kspec_mod({0}, {1})",
    "lt": "(({0}) < ({1}))", "le": "(({0}) <= ({1}))", "gt": "(({0}) > ({1}))", "ge": "(({0}) >= ({1}))",
    "eq": "(({0}) == ({1}))", "ne": "(({0}) != ({1}))",
    "and": "(({0}) && ({1}))", "or": "(({0}) || ({1}))", "not": "(!({0}))",
    "where": "(({0}) ? ({1}) : ({2}))",
}


def _ctype(dtype: str) -> str:
    """The C type a value of `dtype` is computed in: integers and conditions as long long, else float."""
    return "long long" if dtype in _INT or dtype == "bool" else "float"


class _Gen:
    def __init__(self, ir: KernelIR, arch: str):
        self.ir, self.arch, self.g = ir, arch, ir.graph()
        self.names = Names()
        self.scalars: dict[str, object] = {}
        self.dim_of: dict[str, str] = {}          # label -> d<i>
        self.dim_values: list[tuple[str, object]] = []
        self.lines: list[str] = []
        self.inline: set = set()            # in-group nodes recomputed where they are read

    def dim(self, label: str, extent) -> str:
        if label not in self.dim_of:
            d = f"d{len(self.dim_of)}"
            self.dim_of[label] = d
            self.dim_values.append((d, extent))
        return self.dim_of[label]

    def ptr(self, buffer: str) -> str:
        return self.names(buffer)

    def offset(self, buffer: str, labels: tuple[str, ...]) -> str:
        """Element offset of buffer[labels] from the index variables i_<d>."""
        b = self.ir.buffer(buffer)
        order = list(range(len(labels)))
        if b.layout == "col" and len(order) >= 2:
            order[-1], order[-2] = order[-2], order[-1]
        terms, stride = [], "1LL"
        for axis in reversed(order):
            d = self.dim_of[labels[axis]]
            terms.append(f"i_{d} * {stride}")
            stride = f"{stride} * p.dim[{d[1:]}]"
        return " + ".join(reversed(terms)) or "0"

    def value(self, n, labels: tuple[str, ...], local: dict) -> str:
        """C expression of node n's value read under `labels` (in-group values are locals)."""
        if n in local:
            return local[n]
        if n in self.inline:
            return _round(op(self.g, n).dtype, self.node_expr(n, local))
        o = op(self.g, n)
        if o.kind == "const":
            v = o.value
            if o.dtype in _INT:
                return f"{int(v)}LL"
            if isinstance(v, float) and not math.isfinite(v):
                return "(-INFINITY)" if v < 0 else ("INFINITY" if v > 0 else "NAN")
            return f"{float(v)!r}f"
        if o.kind == "param":
            c = self.names(o.buffer)
            self.scalars[c] = o.buffer
            return f"(float)p.scalar[{{{c}}}]" if o.dtype not in _INT else f"(long long)p.scalar[{{{c}}}]"
        if o.kind == "index":
            # the integer value of the loop index the reader names this axis by
            return f"i_{self.dim_of[labels[0]]}"
        if o.kind == "size":
            return f"p.dim[{self.dim(f'#size:{o.fn}', o.fn)[1:]}]"
        if o.kind != "input":
            raise KspecInternalError(f"value {n} is neither computed in the kernel nor loaded")
        buf = o.buffer
        return _load(self.ir.buffer(buf).dtype, f"p.ptr[{{{self.ptr(buf)}}}]", self.offset(buf, labels))

    def node_expr(self, n, local: dict) -> str:
        o = op(self.g, n)
        if o.kind == "gather":
            return self.gather_expr(n, local)
        if o.kind == "index":
            return f"i_{self.dim_of[o.axes[0]]}"
        if o.kind == "size":
            return f"p.dim[{self.dim(f'#size:{o.fn}', o.fn)[1:]}]"
        args = [self.value(u, labels, local) for u, labels in operands(self.g, n)]
        if o.kind in ("broadcast", "cast") or o.fn == "copy":
            return args[0]
        if o.fn not in _FN:
            raise KspecLoweringError(f"the CUDA backend has no implementation of '{o.fn}'", o.span)
        return _FN[o.fn].format(*args)


    def gather_expr(self, n, local: dict) -> str:
        """source[subscripts]: index names use the loop indices, literals and integer tensor values
        select directly; a value outside its dimension gives NaN (no out-of-bounds read)."""
        o = op(self.g, n)
        ins = operands(self.g, n)
        src, src_labels = ins[0]
        buf = op(self.g, src).buffer
        b = self.ir.buffer(buf)
        dims: list[str] = []
        idx: list[str] = []
        conds: list[str] = []
        for axis, x in enumerate(o.subscripts):
            label = src_labels[axis] if not src_labels[axis].startswith("~") else f"{buf}{src_labels[axis]}"
            d = self.dim(label, b.shape[axis])
            dims.append(d)
            if x.startswith("#"):
                idx.append(f"{int(x[1:])}LL")
            elif x.startswith("@"):
                u, labels = ins[int(x[1:])]
                v = f"({self.value(u, labels, local)})"
                idx.append(v)
                conds.append(f"{v} >= 0 && {v} < p.dim[{d[1:]}]")
            else:
                idx.append(f"i_{self.dim_of[x]}")
        order = list(range(len(idx)))
        if b.layout == "col" and len(order) >= 2:
            order[-1], order[-2] = order[-2], order[-1]
        terms, stride = [], "1LL"
        for axis in reversed(order):
            terms.append(f"{idx[axis]} * {stride}")
            stride = f"{stride} * p.dim[{dims[axis][1:]}]"
        load = _load(b.dtype, f"p.ptr[{{{self.ptr(buf)}}}]", " + ".join(reversed(terms)) or "0")
        if not conds:
            return load
        return f"(({' && '.join(conds)}) ? {load} : NAN)"


def _index_decode(gen: _Gen, labels: tuple[str, ...], linear: str) -> list[str]:
    out = [f"long long r_ = {linear};"]
    for label in reversed(labels):
        d = gen.dim_of[label]
        out.append(f"long long i_{d} = r_ % p.dim[{d[1:]}]; r_ /= p.dim[{d[1:]}];")
    return out


def lower_generic(ir: KernelIR, arch: str) -> LoweredPlan:
    try:
        return _lower_generic(ir, arch)
    except RecursionError:
        # values feeding a loop are inlined into one C expression: a chain of thousands of ops is
        # more than the generator (or nvcc) takes
        raise KspecLoweringError(f"plan {ir.id}: the CUDA backend cannot inline an expression this deep (split the chain "
                                 "with a stored intermediate)", ir.span) from None


def _lower_generic(ir: KernelIR, arch: str) -> LoweredPlan:
    for b in ir.buffers:
        if b.dtype not in _CTYPE:
            # FP4 data (two values a byte) and E8M0 scales: block-scaled GEMMs on tensor cores only
            raise KspecLoweringError(f"plan {ir.id}: {b.name} is {b.dtype}, which the plain CUDA kernels do not "
                                     "read or write (block-scaled formats: tensor-core GEMMs only)", ir.span)
    for o in ir.ops:
        if o.dtype not in _CTYPE and o.dtype != "bool":
            raise KspecLoweringError(f"plan {ir.id}: a {o.dtype} value, which the plain CUDA kernels do not "
                                     "compute with", ir.span)
    gen = _Gen(ir, arch)
    g = gen.g
    plan_id = ir.id
    nodes = [o.id for o in ir.internal if o.kind != "const"]
    leaving = [n for n in nodes if ir.stores_of(n)]
    softmaxes = [n for n in nodes if op(g, n).kind == "softmax"]
    root = softmaxes[0] if softmaxes else (leaving[-1] if leaving else nodes[-1])
    ro = op(g, root)
    space = ro.axes if ro.kind != "softmax" else tuple(a for a in ro.axes if a != ro.fn)
    # the iteration space; a contraction/reduction/softmax adds its loop axes after it
    for label, ext in zip(ro.axes, ro.shape):
        gen.dim(label, ext)
    body: list[str] = []
    threads = " * ".join(f"p.dim[{gen.dim_of[l][1:]}]" for l in space) or "1LL"
    body.append("long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;")
    body.append(f"if (tid >= {threads}) return;")
    body += _index_decode(gen, space, "tid")
    kinds = {op(g, n).kind for n in nodes}
    loop_nodes = [n for n in nodes if op(g, n).kind in ("softmax", "reduction")]
    after = [n for n in nodes if loop_nodes and n in nx.descendants(g, loop_nodes[0])]
    if loop_nodes and (len(loop_nodes) > 1 or (op(g, loop_nodes[0]).kind == "reduction" and after)):
        raise KspecLoweringError(f"plan {plan_id}: the CUDA backend runs one reduction or softmax per kernel, "
                                 "and a reduction as the kernel's only result", op(g, loop_nodes[0]).span)
    # elementwise nodes feeding a reduction/softmax are recomputed inside its loops
    gen.inline = set(nodes) - set(loop_nodes) - set(after) if loop_nodes else set()
    if loop_nodes and op(g, loop_nodes[0]).kind == "softmax":
        root = loop_nodes[0]
        ro = op(g, root)
        _softmax_body(gen, root, body, after, [n for n in leaving if n == root or n in after])
    elif loop_nodes:
        body.extend(_reduce_into(gen, root, "v0"))
        _stores(gen, root, "v0", body)
    else:
        local: dict = {}
        for n in nodes:
            o = op(g, n)
            v = f"v{len(local)}"
            ctype = _ctype(o.dtype)
            if o.kind in ("reduction", "contraction") and set(o.axes) == set(space):
                body.extend(_reduce_into(gen, n, v))
            elif o.kind in ("elementwise", "broadcast", "cast", "gather", "index", "size") and set(o.axes) <= set(space):
                # (a value over fewer axes, e.g. a cast bias vector, is recomputed per element)
                body.append(f"{ctype} {v} = {_round(o.dtype, gen.node_expr(n, local))};")
            else:
                raise KspecLoweringError(f"plan {plan_id}: the CUDA backend cannot run a "
                                         f"{'+'.join(sorted(kinds))} group", o.span)
            local[n] = v
        for n in leaving:
            _stores(gen, n, local[n], body)
    names = gen.names
    text, args, scalars = number_placeholders("\n".join("    " + line for line in body), names, gen.scalars)
    back = names.back()
    desc = GenericDesc(name=f"k_{plan_id.rsplit('_', 1)[-1]}", arch=arch, body=text, args=args, scalars=scalars,
                       dims=tuple(d for d, _ in gen.dim_values), threads=threads,
                       arg_bytes=tuple(dtype_bytes(ir.buffer(back[a]).dtype) for a in args))
    return LoweredPlan(ir, arch, "generic", desc, names.back(), tuple(gen.dim_values), dict(gen.scalars))


def _stores(gen: _Gen, n, value: str, body: list[str]) -> None:
    for t in gen.ir.stores_of(n):
        labels = gen.ir.store_labels(n, t)
        b = gen.ir.buffer(t)
        body.append(_store(b.dtype, f"p.ptr[{{{gen.ptr(t)}}}]", gen.offset(t, labels), value))


def _reduce_into(gen: _Gen, n, var: str) -> list[str]:
    """Code computing reduction/contraction node n at the current output index into `var`."""
    g = gen.g
    o = op(g, n)
    for label, ext in zip(o.reduced, o.reduced_shape):
        gen.dim(label, ext)
    ins = operands(g, n)
    acc_t = "long long" if o.dtype in _INT else "float"
    if o.kind == "contraction":
        (ua, la), (ub, lb) = ins
        term = f"{gen.value(ua, la, {})} * {gen.value(ub, lb, {})}"
        init, update = "0", "{a} += {t};"
    else:
        (u, labels), = ins
        term = gen.value(u, labels, {})
        init = {"sum": "0", "mean": "0", "max": "-INFINITY" if acc_t == "float" else "LLONG_MIN",
                "min": "INFINITY" if acc_t == "float" else "LLONG_MAX"}.get(o.fn)
        update = {"sum": "{a} += {t};", "mean": "{a} += {t};", "max": "{a} = kspec_max({a}, {t});",
                  "min": "{a} = kspec_min({a}, {t});"}.get(o.fn)     # logsumexp: below
    acc = f"acc_{var}"

    def loops(inner: list[str]) -> list[str]:
        for label in reversed(o.reduced):
            d = gen.dim_of[label]
            head = f"for (long long i_{d} = 0; i_{d} < p.dim[{d[1:]}]; ++i_{d}) {{"
            inner = [head] + ["  " + x for x in inner] + ["}"]
        return inner

    if o.kind == "reduction" and o.fn == "logsumexp":
        # max-shifted: mx + log(sum exp(x - mx)); an infinite max shifts by 0, so a reduction of
        # -inf values (or of none) is -inf and one holding +inf is +inf; NaN propagates
        mx = f"mx_{var}"
        out = [f"float {mx} = -INFINITY;"] + loops([f"{mx} = fmaxf({mx}, {term});"])
        out.append(f"if (fabsf({mx}) == INFINITY) {mx} = 0.0f;")
        out += [f"float {acc} = 0.0f;"] + loops([f"{acc} += expf({term} - {mx});"])
        out.append(f"float {var} = {_round(o.dtype, f'({acc} == 0.0f) ? -INFINITY : {mx} + logf({acc})')};")
        return out
    out = [f"{acc_t} {acc} = {init};"]
    out += loops([update.format(a=acc, t=term)])
    if o.kind == "reduction" and o.fn == "mean":
        count = " * ".join(f"(float)p.dim[{gen.dim_of[l][1:]}]" for l in o.reduced)
        out.append(f"{acc} = {acc} / ({count});")
    out.append(f"{acc_t} {var} = {_round(o.dtype, acc)};")
    return out


def _softmax_body(gen: _Gen, n, body: list[str], after=(), stored=()) -> None:
    """Three passes over the softmax axis: max, sum of exponentials, then each probability (and
    the elementwise ops fused after it) is computed and stored."""
    g = gen.g
    o = op(g, n)
    (u, labels), = operands(g, n)
    axis = o.fn
    d = gen.dim_of[axis]
    x = gen.value(u, labels, {})
    mask = ""
    if o.causal:
        mask = f"if (i_{d} > i_{gen.dim_of[o.causal]}) continue; "
    loop = f"for (long long i_{d} = 0; i_{d} < p.dim[{d[1:]}]; ++i_{d}) {{ "
    body.append("float mx = -INFINITY, sum = 0.0f;")
    body.append(loop + mask + f"mx = fmaxf(mx, {x}); }}")
    body.append("if (mx == -INFINITY) mx = 0.0f;")
    body.append(loop + mask + f"sum += expf({x} - mx); }}")
    body.append(loop)
    body.append(f"  float e = {'(i_' + d + ' > i_' + gen.dim_of[o.causal] + ') ? 0.0f : ' if o.causal else ''}expf({x} - mx);")
    body.append(f"  float v0 = {_round(o.dtype, 'sum > 0.0f ? e / sum : 0.0f')};")
    local = {n: "v0"}
    for m in after:
        mo = op(g, m)
        v = f"v{len(local)}"
        ctype = _ctype(mo.dtype)
        body.append(f"  {ctype} {v} = {_round(mo.dtype, gen.node_expr(m, local))};")
        local[m] = v
    st: list[str] = []
    for m in (stored or [n]):
        _stores(gen, m, local[m], st)
    body.extend("  " + s for s in st)
    body.append("}")


_PRELUDE = r"""#include <cstdint>
#include <cstdio>
#include <cstring>
#include <climits>
#include <cmath>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

struct Params {
  void* ptr[%(nptr)d];
  long long dim[%(ndim)d];
  double scalar[%(nscalar)d];
};
"""

_DEVICE = r"""
#if defined(KSPEC_DEVICE)
__device__ __forceinline__ float kspec_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float kspec_min(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ long long kspec_max(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ long long kspec_min(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ float kspec_abs(float a) { return fabsf(a); }
__device__ __forceinline__ long long kspec_abs(long long a) { return a < 0 ? -a : a; }
__device__ __forceinline__ float kspec_div(float a, float b) { return a / b; }
__device__ __forceinline__ long long kspec_div(long long a, long long b) { return b == 0 ? 0 : a / b; }
__device__ __forceinline__ long long kspec_floordiv(long long a, long long b) {
  if (b == 0) return 0;
  long long q = a / b;
  return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ long long kspec_mod(long long a, long long b) { return a - b * kspec_floordiv(a, b); }
__device__ __forceinline__ long long kspec_sat(long long v, long long lo, long long hi) { return v < lo ? lo : v > hi ? hi : v; }
__device__ __forceinline__ long long kspec_sat(float v, long long lo, long long hi) {
  return kspec_sat((long long)rintf(fminf(fmaxf(v, (float)lo), (float)hi)), lo, hi);
}

extern "C" __global__ void __launch_bounds__(%(block)d) kspec_kernel(const Params p) {
%(body)s
}
#endif  // KSPEC_DEVICE
"""

# The host glue every plain-CUDA generator shares (backends/ABI.md; `%`-templates over the generator's
# sizes: abi, nptr_real, ndim_real, nscalar_real): the ABI version, an empty workspace, and the
# opening of kspec_prepare that fills a `Params` of pointers, dims and scalars.
GLUE_ABI = r"""extern "C" int kspec_abi_version(void) { return %(abi)d; }

extern "C" int kspec_workspace_size(const int64_t* dims, int32_t device, int32_t sm_count,
                                    uint64_t* bytes, char* err, uint64_t err_cap) {
  (void)dims; (void)device; (void)sm_count; (void)err; (void)err_cap;
  *bytes = 0;
  return 0;
}
"""

GLUE_PREPARE_OPEN = r"""extern "C" int kspec_prepare(const int64_t* dims, void* const* ptrs, const double* scalars,
                             void* workspace, int32_t device, int32_t sm_count,
                             void* params, uint64_t params_cap, uint64_t* params_size,
                             uint32_t grid[3], uint32_t block[3], uint32_t cluster[3],
                             uint32_t* smem_bytes, char* err, uint64_t err_cap) {
  (void)workspace; (void)device; (void)sm_count;
  Params p;
  std::memset(&p, 0, sizeof(p));
  for (int i = 0; i < %(nptr_real)d; ++i) {
    if (ptrs[i] == nullptr) { std::snprintf(err, err_cap, "tensor argument %%d is a null pointer", i); return 1; }
    p.ptr[i] = ptrs[i];
  }
  for (int i = 0; i < %(ndim_real)d; ++i) {
    if (dims[i] < 0) { std::snprintf(err, err_cap, "size %%d is negative", i); return 1; }
    p.dim[i] = dims[i];
  }
  for (int i = 0; i < %(nscalar_real)d; ++i) p.scalar[i] = scalars[i];
"""


_HOST = r"""
#if defined(KSPEC_HOST)
""" + GLUE_ABI + r"""
""" + GLUE_PREPARE_OPEN + r"""  if (params_cap < sizeof(Params)) { std::snprintf(err, err_cap, "parameter buffer too small"); return 1; }
  std::memcpy(params, &p, sizeof(Params));
  *params_size = sizeof(Params);
  long long threads = %(threads)s;
  long long blocks = (threads + %(block)d - 1) / %(block)d;
  if (blocks > 2147483647LL) { std::snprintf(err, err_cap, "problem too large for one launch"); return 1; }
  grid[0] = (uint32_t)(blocks > 0 ? blocks : 0); grid[1] = 1; grid[2] = 1;
  block[0] = %(block)d; block[1] = 1; block[2] = 1;
  cluster[0] = 1; cluster[1] = 1; cluster[2] = 1;
  *smem_bytes = 0;
  return 0;
}
#endif  // KSPEC_HOST
"""


def emit_generic(desc: GenericDesc) -> EmittedKernel:
    for name in (desc.name, *desc.args, *desc.scalars, *desc.dims):
        check_ident(name, "generated kernel")
    sizes = {"nptr": max(1, len(desc.args)), "ndim": max(1, len(desc.dims)), "nscalar": max(1, len(desc.scalars)),
             "nptr_real": len(desc.args), "ndim_real": len(desc.dims), "nscalar_real": len(desc.scalars),
             "block": BLOCK, "body": desc.body, "threads": desc.threads, "abi": ABI_VERSION}
    source = (f"// Generated by kspec: plain CUDA kernel '{desc.name}' for {desc.arch}. Do not edit.\n"
              + _PRELUDE % sizes + _DEVICE % sizes + _HOST % sizes)
    return EmittedKernel(name=desc.name, arch=desc.arch, source=source, include_dirs=(),
                         flags=("-std=c++17", "-O3"), dims=desc.dims, args=desc.args, scalars=desc.scalars,
                         alignment=tuple(zip(desc.args, desc.arg_bytes or (1,) * len(desc.args))),
                         config=(("kind", "generic"), ("block", str(BLOCK))))


class GenericBackend(NvccBuilt):
    """Plain CUDA loop kernels for every kernel IR: the backend of last resort.  Elementwise kernels
    are what it is for; any other kind it runs is reported as a fallback (and refused by --strict)."""
    name = "generic"
    capabilities = Capabilities(archs=ARCHS, kinds=("elementwise",),
                                fallback_kinds=tuple(k for k in KINDS if k != "elementwise"))

    def identity(self) -> str:
        return "kspec-generic 1"

    def can_implement(self, ir: KernelIR, arch: str) -> str | None:
        if arch not in ARCHS:
            return f"the generic backend does not target {arch}"
        if ir.kind == "attention":
            return "fused attention has no loop-kernel form (the unfused plan is used instead)"
        if ir.kind == "gemm" and ir.gemm.a_rows is not None:
            return "a GEMM with gathered A rows has no loop-kernel form (the gather runs as a kernel of its own instead)"
        if ir.kind == "gemm" and ir.gemm.scales:
            return "a block-scaled GEMM has no loop-kernel form (its unfused ops run as separate kernels instead)"
        if ir.kind == "gemm" and ir.epilogue.reductions:
            return (f"it cannot fuse the epilogue reduction into {ir.epilogue.reductions[0].name} (use operand "
                    "dtypes a tensor-core backend takes, or reduce a stored result in a statement of its own)")
        loops = [o for o in ir.internal if o.kind in ("softmax", "reduction")]
        if len(loops) > 1:
            return "it runs one reduction or softmax per kernel"
        # what its code generator cannot express is refused here, when the kernel is planned, so
        # `kspec graph` never plans a kernel that `kspec compile` then rejects (generation is cheap)
        try:
            lower_generic(ir, arch)
        except KspecLoweringError as e:
            return e.message.split(": ", 1)[1] if e.message.startswith(f"plan {ir.id}: ") else e.message
        return None

    def setting_problem(self, ir: KernelIR, arch: str) -> None:
        return None          # loop kernels take no tile, cluster or stage settings: they ignore them

    def is_fallback(self, ir: KernelIR) -> str | None:
        if ir.kind == "elementwise":
            return None
        return {"gemm": "a naive loop GEMM (one thread per output element, no tensor cores)",
                "contraction": "a naive loop contraction (one thread per output element)",
                "reduction": "a loop reduction (one thread per output element)",
                "softmax": "a loop softmax (one thread per row, three passes over memory)"}.get(
                    ir.kind, f"a loop {ir.kind} kernel")

    def default_config(self, ir: KernelIR, arch: str) -> tuple[tuple[str, str], ...]:
        return (("block", str(BLOCK)),)

    def candidates(self, ir: KernelIR, arch: str) -> list[tuple[tuple[str, str], ...]]:
        return [self.default_config(ir, arch)]

    def lower(self, ir: KernelIR, arch: str, config: tuple[tuple[str, str], ...] | None = None) -> LoweredPlan:
        # one configuration (the block size is fixed); a tuned config can only be the default
        if config is not None and dict(config).get("block", str(BLOCK)) != str(BLOCK):
            raise KspecError(f"kernel {ir.id} on {arch}: the generic backend has no configuration {dict(config)}",
                             ir.span, "a tuning database entry may be stale; re-run `kspec tune`")
        return lower_generic(ir, arch)

    def emit(self, lowered: LoweredPlan) -> EmittedKernel:
        return emit_generic(lowered.desc)
