"""Plain CUDA C++ for plans that are not GEMMs or fused attention: elementwise chains, reductions,
softmax, and contractions CUTLASS cannot take (several reduced indices, mixed or f32 operands).

One thread per output element (per row for softmax); every node's value is rounded to its dtype,
exactly as the numpy reference does, so these kernels match the reference to function accuracy.
A pure elementwise kernel (gathers and index arithmetic included) also has a vector path (`_Vector`):
VEC consecutive elements along the innermost axis per thread, indices decoded once per thread, and
the tensors read or written contiguously along that axis moved as 128-bit loads and stores; the host
glue takes it when the innermost extent is a multiple of VEC and those pointers are 16-byte aligned,
else the one-element-per-thread path runs.  Literal extents are constants in the device code.
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
# an elementwise kernel of more ops keeps one element per thread: its vector path is instantiated four
# times (two widths, 32- and 64-bit indices) and unrolled, which would multiply nvcc's time on it
VECTOR_MAX_OPS = 1000


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
    threads: str                      # C expression for the number of elements (threads of the scalar path)
    arg_bytes: tuple[int, ...] = ()   # element size of each argument: the alignment the scalar path needs
    vec: tuple[int, ...] = ()         # elements per thread of the vector path, widest first (): none)
    vec_dim: str = ""                 # the d<i> it runs along (its extent a multiple of the width taken)
    vec_args: tuple[str, ...] = ()    # arguments it moves 16 bytes at a time (their pointers 16-byte aligned)
    vec_body: str = ""                # the body of `template <int VEC, typename I> kspec_vector(const Params& p)`


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


def _elem(dtype: str, ref: str) -> str:
    """The value of element `ref` of a local array of `dtype` (the vector path's loaded words)."""
    return f"(long long){ref}" if dtype in _INT else f"(float)({ref})"


def _assign(dtype: str, lvalue: str, value: str) -> str:
    if dtype in _INT:
        return f"{lvalue} = ({_CTYPE[dtype]}){value};"
    return f"{lvalue} = {_CTYPE[dtype]}((float)({value}));"


def _store(dtype: str, ptr: str, offset: str, value: str) -> str:
    return _assign(dtype, f"(({_CTYPE[dtype]}*){ptr})[{offset}]", value)


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
        self.iover: dict[str, str] = {}     # d<i> -> the variable holding that index (the vector loop's own)
        self.vector: _Vector | None = None  # set while the vector path's element body is generated

    def dim(self, label: str, extent) -> str:
        if label not in self.dim_of:
            d = f"d{len(self.dim_of)}"
            self.dim_of[label] = d
            self.dim_values.append((d, extent))
        return self.dim_of[label]

    def ptr(self, buffer: str) -> str:
        return self.names(buffer)

    def ivar(self, d: str) -> str:
        """The C variable holding index d<i> where an element's value is computed."""
        return self.iover.get(d, f"i_{d}")

    def dimx(self, d: str) -> str:
        """Extent of d<i> in device code: a literal extent is a constant (`% 128` compiles to a mask),
        a symbolic one is read from the parameters."""
        ext = dict(self.dim_values)[d]
        return f"{ext}LL" if isinstance(ext, int) and not isinstance(ext, bool) else f"p.dim[{d[1:]}]"

    def storage_last(self, buffer: str, labels: tuple[str, ...]) -> str | None:
        """The label of buffer[labels]'s contiguous (storage-innermost) axis."""
        if not labels:
            return None
        b = self.ir.buffer(buffer)
        return labels[-2] if b.layout == "col" and len(labels) >= 2 else labels[-1]

    def offset(self, buffer: str, labels: tuple[str, ...]) -> str:
        """Element offset of buffer[labels] from the index variables i_<d>."""
        b = self.ir.buffer(buffer)
        order = list(range(len(labels)))
        if b.layout == "col" and len(order) >= 2:
            order[-1], order[-2] = order[-2], order[-1]
        terms, stride = [], "1LL"
        for axis in reversed(order):
            d = self.dim_of[labels[axis]]
            terms.append(f"{self.ivar(d)} * {stride}")
            stride = f"{stride} * {self.dimx(d)}"
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
            return self.ivar(self.dim_of[labels[0]])
        if o.kind == "size":
            return self.dimx(self.dim(f'#size:{o.fn}', o.fn))
        if o.kind != "input":
            raise KspecInternalError(f"value {n} is neither computed in the kernel nor loaded")
        buf = o.buffer
        if self.vector is not None and self.vector.contiguous(buf, labels):
            return _elem(self.ir.buffer(buf).dtype, self.vector.load(buf, labels))
        return _load(self.ir.buffer(buf).dtype, f"p.ptr[{{{self.ptr(buf)}}}]", self.offset(buf, labels))

    def node_expr(self, n, local: dict) -> str:
        o = op(self.g, n)
        if o.kind == "gather":
            return self.gather_expr(n, local)
        if o.kind == "index":
            return self.ivar(self.dim_of[o.axes[0]])
        if o.kind == "size":
            return self.dimx(self.dim(f'#size:{o.fn}', o.fn))
        args = [self.value(u, labels, local) for u, labels in operands(self.g, n)]
        if o.kind in ("broadcast", "cast") or o.fn == "copy":
            return args[0]
        if o.fn not in _FN:
            raise KspecLoweringError(f"the CUDA backend has no implementation of '{o.fn}'", o.span)
        return _FN[o.fn].format(*args)


    def gather_expr(self, n, local: dict) -> str:
        """source[subscripts]: index names use the loop indices, literals and integer tensor values
        select directly; a value outside its dimension gives NaN (no out-of-bounds read)."""
        if self.vector is not None and n in self.vector.gathered:
            return self.vector.gathered[n]
        buf, offset, conds, _ = self.gather_parts(n, local)
        load = _load(self.ir.buffer(buf).dtype, f"p.ptr[{{{self.ptr(buf)}}}]", offset)
        if not conds:
            return load
        return f"(({' && '.join(conds)}) ? {load} : NAN)"

    def gather_parts(self, n, local: dict) -> tuple[str, str, list[str], list[str]]:
        """(source buffer, element offset, conditions for the subscripts being in range, the
        subscripts' values) of a gather."""
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
                conds.append(f"{v} >= 0 && {v} < {self.dimx(d)}")
            else:
                idx.append(self.ivar(self.dim_of[x]))
        order = list(range(len(idx)))
        if b.layout == "col" and len(order) >= 2:
            order[-1], order[-2] = order[-2], order[-1]
        terms, stride = [], "1LL"
        for axis in reversed(order):
            terms.append(f"{idx[axis]} * {stride}")
            stride = f"{stride} * {self.dimx(dims[axis])}"
        return buf, " + ".join(reversed(terms)) or "0", conds, idx


def _index_decode(gen: _Gen, labels: tuple[str, ...], linear: str, itype: str | None = None) -> list[str]:
    """Index variables i_<d> of the row-major linear index `linear` over `labels`, decoded once per
    thread, the outermost without a division (linear < count), literal extents as constants: in
    32-bit arithmetic when the host says the element count fits (`p.idx32`), or, given `itype`, in
    that type (the vector path's template parameter `I`: the index variables are of that type too)."""
    if not labels:
        return []
    ds = [gen.dim_of[label] for label in labels]
    out = [f"{itype or 'long long'} {', '.join(f'i_{d}' for d in ds)};"]
    for head, t in ((("{", itype),) if itype else (("if (p.idx32) {", "unsigned int"), ("} else {", "long long"))):
        out.append(head)
        out.append(f"  {t} r_ = ({t})({linear});")
        for d in reversed(ds[1:]):
            x = gen.dimx(d) if t == "long long" else f"({t}){gen.dimx(d)}"
            out.append(f"  i_{d} = r_ % {x}; r_ /= {x};")
        out.append(f"  i_{ds[0]} = r_;")
    out.append("}")
    # what the decode guarantees, for the compiler's index arithmetic (floor %, bounds of gathers)
    out += [f"KSPEC_ASSUME((long long)i_{d} >= 0 && (long long)i_{d} < {gen.dimx(d)});" for d in ds]
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
    body.append("if (tid >= p.count) return;")
    body += _index_decode(gen, space, "tid")
    kinds = {op(g, n).kind for n in nodes}
    loop_nodes = [n for n in nodes if op(g, n).kind in ("softmax", "reduction")]
    after = [n for n in nodes if loop_nodes and n in nx.descendants(g, loop_nodes[0])]
    if loop_nodes and (len(loop_nodes) > 1 or (op(g, loop_nodes[0]).kind == "reduction" and after)):
        raise KspecLoweringError(f"plan {plan_id}: the CUDA backend runs one reduction or softmax per kernel, "
                                 "and a reduction as the kernel's only result", op(g, loop_nodes[0]).span)
    # elementwise nodes feeding a reduction/softmax are recomputed inside its loops
    gen.inline = set(nodes) - set(loop_nodes) - set(after) if loop_nodes else set()
    vector, vbody = None, []
    if loop_nodes and op(g, loop_nodes[0]).kind == "softmax":
        root = loop_nodes[0]
        ro = op(g, root)
        _softmax_body(gen, root, body, after, [n for n in leaving if n == root or n in after])
    elif loop_nodes:
        body.extend(_reduce_into(gen, root, "v0"))
        _stores(gen, root, "v0", body)
    else:
        body += _element(gen, nodes, leaving, space, kinds)
        if space and "contraction" not in kinds and len(nodes) <= VECTOR_MAX_OPS:
            vector = _vector_path(gen, nodes, leaving, space, kinds)
            if vector is not None:
                vbody = vector[0]
                body = [f"if (p.vec == {w}) {{ if (p.idx32) kspec_vector<{w}, unsigned int>(p); "
                        f"else kspec_vector<{w}, long long>(p); return; }}" for w in vector[1].widths] + body
    names = gen.names
    split = "\n//--vector--\n"
    text, args, scalars = number_placeholders("\n".join("    " + line for line in body) + split
                                              + "\n".join("  " + line for line in vbody), names, gen.scalars)
    text, vtext = text.split(split)
    back = names.back()
    vec, vec_dim, vec_args = (), "", ()
    if vector is not None:
        vec, vec_dim, vec_args = vector[1].widths, vector[1].d, tuple(a for a in args if a in vector[1].ptrs)
    desc = GenericDesc(name=f"k_{plan_id.rsplit('_', 1)[-1]}", arch=arch, body=text, args=args, scalars=scalars,
                       dims=tuple(d for d, _ in gen.dim_values), threads=threads,
                       arg_bytes=tuple(dtype_bytes(ir.buffer(back[a]).dtype) for a in args),
                       vec=vec, vec_dim=vec_dim, vec_args=vec_args, vec_body=vtext)
    return LoweredPlan(ir, arch, "generic", desc, names.back(), tuple(gen.dim_values), dict(gen.scalars))


def _element(gen: _Gen, nodes, leaving, space, kinds) -> list[str]:
    """The code computing every node of an elementwise kernel at the current index and storing
    the kernel's results there."""
    g = gen.g
    lines: list[str] = []
    local: dict = {}
    raw: dict = {}            # node -> its value before rounding (a store of its own dtype rounds once)
    for n in nodes:
        o = op(g, n)
        v = f"v{len(local)}"
        ctype = _ctype(o.dtype)
        if o.kind in ("reduction", "contraction") and set(o.axes) == set(space):
            lines.extend(_reduce_into(gen, n, v))
        elif o.kind in ("elementwise", "broadcast", "cast", "gather", "index", "size") and set(o.axes) <= set(space):
            # (a value over fewer axes, e.g. a cast bias vector, is recomputed per element)
            expr = gen.node_expr(n, local)
            if o.kind == "gather" and o.dtype == gen.ir.buffer(op(g, operands(g, n)[0][0]).buffer).dtype:
                lines.append(f"{ctype} {v} = {expr};")     # an element of its own dtype: exact
            else:
                lines.append(f"{ctype} {v} = {_round(o.dtype, expr)};")
                raw[n] = expr
        else:
            raise KspecLoweringError(f"plan {gen.ir.id}: the CUDA backend cannot run a "
                                     f"{'+'.join(sorted(kinds))} group", o.span)
        local[n] = v
    for n in leaving:
        _stores(gen, n, local[n], lines, raw.get(n))
    return lines


class _Vector:
    """The vector path of an elementwise kernel: each thread computes VEC consecutive elements along
    the innermost iteration axis (`label`).  An input read, or an output written, at the thread's own
    positions with that axis contiguous in memory (a row tensor indexed by it last, broadcast or not)
    is moved as 128-bit loads and stores through a local array; every other access (a transposed
    read, a strided one) stays a scalar access at the element's own index.  A gather is read for the
    VEC elements first (`_gather_block`): where its contiguous subscript is an affine function of
    the vector index (`e + 1`, `e / 2`, `2 * i`, rotate-half's `(e + 64) % 128`: `_affine`), as the
    16-byte words of a window each element is taken from at a compile-time position; otherwise as
    one 128-bit load where its VEC offsets turn out consecutive, in range and aligned, else as VEC
    scalar loads.  VEC is
    two 16-byte words of the narrowest tensor moved (at most 16 elements), or one word where the
    innermost extent is no multiple of that: each tensor moves whole 16-byte words."""

    def __init__(self, gen: _Gen, label: str):
        self.gen, self.label, self.d = gen, label, gen.dim_of[label]
        self.loads: dict[tuple, str] = {}        # (buffer, labels) -> local array
        self.stores: dict[str, tuple] = {}       # buffer -> (local array, labels)
        self.ptrs: set[str] = set()              # arguments the path moves 16 bytes at a time
        self.sizes: list[int] = []               # element bytes of those
        self.gathered: dict = {}                 # gather node -> its element in the gathered array
        self.widths: tuple[int, ...] = ()        # VEC values the path is instantiated for, widest first

    def contiguous(self, buffer: str, labels: tuple[str, ...]) -> bool:
        b = self.gen.ir.buffer(buffer)
        return (b.packed is None and b.dtype in _CTYPE and tuple(labels).count(self.label) == 1
                and self.gen.storage_last(buffer, labels) == self.label)

    def _use(self, buffer: str) -> None:
        self.ptrs.add(self.gen.ptr(buffer))
        self.sizes.append(dtype_bytes(self.gen.ir.buffer(buffer).dtype))

    def load(self, buffer: str, labels: tuple[str, ...]) -> str:
        key = (buffer, tuple(labels))
        if key not in self.loads:
            self.loads[key] = f"x{len(self.loads)}"
            self._use(buffer)
        return f"{self.loads[key]}[j_]"

    def store(self, buffer: str, labels: tuple[str, ...]) -> str:
        if buffer not in self.stores:
            self.stores[buffer] = (f"y{len(self.stores)}", tuple(labels))
            self._use(buffer)
        return f"{self.stores[buffer][0]}[j_]"


def _vector_path(gen: _Gen, nodes, leaving, space, kinds) -> tuple[list[str], _Vector] | None:
    """The vector path's code, the body of `kspec_vector<VEC>` (run when the host glue sets `p.vec`
    to VEC), or None when no tensor is read or written contiguously along the innermost axis, or its
    literal extent is no multiple of a vector."""
    label = space[-1]
    d = gen.dim_of[label]
    vec = _Vector(gen, label)
    g = gen.g
    # the index variables are of the template's type I: read as long long (integer values are)
    gen.vector, gen.iover = vec, {**{gen.dim_of[x]: f"(long long)i_{gen.dim_of[x]}" for x in space},
                                  d: f"(long long)i_{d}j"}
    try:
        blocks = []
        for n in nodes:
            if op(g, n).kind == "gather" and _vector_gather(gen, n, nodes):
                lines, elem, nbytes = _gather_block(gen, n, nodes, f"g{len(vec.gathered)}")
                blocks += lines
                vec.gathered[n] = elem
                vec.sizes.append(nbytes)
        element = _element(gen, nodes, leaving, space, kinds)
    finally:
        gen.vector, gen.iover = None, {}
    if not vec.ptrs and not vec.gathered:
        return None
    smallest = min(vec.sizes)
    ext = dict(gen.dim_values)[d]
    vec.widths = tuple(w for w in sorted({min(16, 32 // smallest), 16 // smallest}, reverse=True)
                       if not (isinstance(ext, int) and ext % w))
    if not vec.widths:
        return None
    ir = gen.ir
    lines = [f"// the vector axis: i_{d}",
             "long long lin = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;",
             "if (lin >= p.count) return;"]
    lines += _index_decode(gen, space, "lin", "I")
    lines.append(f"KSPEC_ASSUME(i_{d} % VEC == 0);")
    for (buf, labels), a in vec.loads.items():
        ct = _CTYPE[ir.buffer(buf).dtype]
        lines.append(f"alignas(16) {ct} {a}[VEC];")
        lines.append(f"kspec_ld128({a}, (const {ct}*)p.ptr[{{{gen.ptr(buf)}}}] + ({gen.offset(buf, labels)}));")
    lines += blocks
    for buf, (a, _) in vec.stores.items():
        lines.append(f"alignas(16) {_CTYPE[ir.buffer(buf).dtype]} {a}[VEC];")
    lines += _unrolled(d, element)
    for buf, (a, labels) in vec.stores.items():
        ct = _CTYPE[ir.buffer(buf).dtype]
        lines.append(f"kspec_st128(({ct}*)p.ptr[{{{gen.ptr(buf)}}}] + ({gen.offset(buf, labels)}), {a});")
    return lines, vec


def _unrolled(d: str, inner: list[str]) -> list[str]:
    """`inner` for each of the thread's VEC elements, i_<d>j its index along the vector axis."""
    return (["#pragma unroll", "for (int j_ = 0; j_ < VEC; ++j_) {", f"  [[maybe_unused]] const I i_{d}j = i_{d} + (I)j_;"]
            + ["  " + x for x in inner] + ["}"])


def _gather_sources(gen: _Gen, n, nodes) -> set:
    """The kernel's nodes a gather's subscripts are computed from."""
    return nx.ancestors(gen.g, n) & set(nodes)


def _vector_gather(gen: _Gen, n, nodes) -> bool:
    """A gather the vector path reads for its VEC elements at once: its source is a plain tensor and
    its subscripts are computed without another gather."""
    buf = op(gen.g, operands(gen.g, n)[0][0]).buffer
    b = gen.ir.buffer(buf)
    return (b.dtype in _CTYPE and b.packed is None
            and not any(op(gen.g, m).kind == "gather" for m in _gather_sources(gen, n, nodes)))


def _gather_block(gen: _Gen, n, nodes, name: str) -> tuple[list[str], str, int]:
    """The code reading gather n for the thread's VEC elements into the array `name`: the VEC offsets
    and range conditions first, then one 128-bit load where the offsets are consecutive, all in range
    and the address 16-byte aligned, else a scalar load per element in range.  Returns the lines, the
    element's value expression (NaN where out of range) and the source's element bytes."""
    g = gen.g
    srcs = _gather_sources(gen, n, nodes)
    local: dict = {}
    inner: list[str] = []
    for m in nodes:
        if m in srcs:
            o = op(g, m)
            v = f"v{len(local)}"
            inner.append(f"{_ctype(o.dtype)} {v} = {_round(o.dtype, gen.node_expr(m, local))};")
            local[m] = v
    buf, offset, conds, idx = gen.gather_parts(n, local)
    dims = [gen.dim(src_label if not src_label.startswith("~") else f"{buf}{src_label}", ext)
            for src_label, ext in zip(operands(g, n)[0][1], gen.ir.buffer(buf).shape)]
    b = gen.ir.buffer(buf)
    ct = _CTYPE[b.dtype]
    src = f"((const {ct}*)p.ptr[{{{gen.ptr(buf)}}}])"
    # where every subscript but the contiguous one is the same for the VEC elements (a literal, or an
    # index other than the vector's) and that axis has a literal extent, the offsets are consecutive
    # iff those subscripts are: compared in 32 bits, exact where all are in range (the mask)
    subs = op(g, n).subscripts
    ax = len(subs) - 2 if b.layout == "col" and len(subs) >= 2 else len(subs) - 1
    narrow = (subs[ax].startswith("@") and bool(conds) and isinstance(b.shape[ax], int) and b.shape[ax] < 2 ** 31
              and all(k == ax or x.startswith("#") or (not x.startswith("@") and x != gen.vector.label)
                      for k, x in enumerate(subs)))
    inner.append(f"{name}o[j_] = {offset};")
    if narrow:
        inner.append(f"{name}x[j_] = (unsigned int){idx[ax]};")
    if conds:
        inner.append(f"if ({' && '.join(conds)}) {name}m |= 1u << j_;")
    lines = [f"// gather {name}: consecutive, aligned offsets are one 128-bit load",
             f"alignas(16) {ct} {name}[VEC];",
             f"unsigned int {name}m = {'0u' if conds else '(1u << VEC) - 1u'};"]
    d = gen.dim_of[gen.vector.label]
    window = _window(gen, n, b, ax, subs, idx, dims) if conds else None
    if window is not None:
        # the element read for vector index j is floor((A j + C) / D) past a base that is a whole
        # number of 16-byte words (A * VEC a multiple of D words): the words covering those elements
        # are read whole, each where one of its elements is in range (so within the tensor), and
        # each element taken from them at a compile-time position
        (a_, c_, d_), cond, base = window
        w_ = 16 // dtype_bytes(b.dtype)
        lines[0] = f"// gather {name}: element floor(({a_} j + {c_}) / {d_}) of a window of 16-byte words"
        lines += [f"constexpr int {name}A = {a_}, {name}C = {c_}, {name}D = {d_}, {name}W = {w_};",
                  f"if constexpr ({cond}) {{"]
        lines += ["  " + x for x in _unrolled(d, [x for x in inner if not x.startswith(f"{name}o[") and
                                                  not x.startswith(f"{name}x[")])]
        lines += [f"  constexpr int r0 = kspec_fdiv({name}C, {name}D), r1 = kspec_fdiv({name}A * (VEC - 1) + {name}C, {name}D);",
                  f"  constexpr int k0 = kspec_fdiv(r0 < r1 ? r0 : r1, {name}W), k1 = kspec_fdiv(r0 < r1 ? r1 : r0, {name}W);",
                  f"  const long long b_ = {base};",
                  f"  alignas(16) {ct} w_[(k1 - k0 + 1) * {name}W];",
                  "  #pragma unroll",
                  "  for (int k = 0; k <= k1 - k0; ++k)",
                  f"    if ({name}m & kspec_word_mask(VEC, {name}A, {name}C, {name}D, {name}W, k0 + k)) "
                  f"kspec_ldw(w_ + k * {name}W, {src} + b_ + (k0 + k) * {name}W);",
                  "  #pragma unroll",
                  f"  for (int j_ = 0; j_ < VEC; ++j_) {name}[j_] = w_[kspec_fdiv({name}A * j_ + {name}C, {name}D) - k0 * {name}W];",
                  "} else {"]
    body = [f"long long {name}o[VEC];"]
    if narrow:
        body.append(f"unsigned int {name}x[VEC];        // the contiguous axis' subscripts")
    body += _unrolled(d, inner)
    same = (f"{name}x[j_] == {name}x[0] + (unsigned int)j_" if narrow else f"{name}o[j_] == {name}o[0] + j_")
    body += [f"bool {name}v = {name}m == (1u << VEC) - 1u && ((uintptr_t)({src} + {name}o[0]) & 15) == 0;",
             "#pragma unroll",
             f"for (int j_ = 1; j_ < VEC; ++j_) {name}v &= {same};     // (no short circuit: no branches)",
             f"if ({name}v) {{",
             f"  kspec_ld128({name}, {src} + {name}o[0]);",
             "} else {",
             "  #pragma unroll",
             f"  for (int j_ = 0; j_ < VEC; ++j_) if ({name}m >> j_ & 1u) {name}[j_] = {src}[{name}o[j_]];",
             "}"]
    if window is not None:
        lines += ["  " + x for x in body] + ["}"]
        gen.vector.ptrs.add(gen.ptr(buf))       # the window's base: 16-byte aligned at launch
    else:
        lines += body
    elem = _elem(b.dtype, f"{name}[j_]")
    if conds:
        elem = f"(({name}m >> j_ & 1u) ? {elem} : NAN)"
    return lines, elem, dtype_bytes(b.dtype)


def _affine(gen: _Gen, u, labels, label: str, ext: int) -> tuple[int, int, int, int] | None:
    """(A, C, D, M) where integer value u, read under `labels`, is floor((A * i + C) / D) for the index
    i along `label` (of literal extent `ext`), taken modulo M > 0 where M is not 0 (a modulus only
    last, of a D = 1 value: rotate-half's `(e + 64) % 128`), every value on the way within 32 bits (no
    saturation); None where it is not (another index, a tensor value, ..)."""
    g = gen.g
    o = op(g, u)
    if o.kind == "index":
        return (1, 0, 1, 0) if labels and labels[0] == label else None
    if o.kind == "const":
        return (0, int(o.value), 1, 0) if o.dtype in _INT else None
    if o.kind not in ("cast", "elementwise") or o.dtype not in _INT or tuple(labels) != tuple(o.axes) and o.axes:
        return None
    ins = [_affine(gen, x, lab, label, ext) for x, lab in operands(g, u)]
    if None in ins:
        return None
    if o.kind == "cast" or o.fn == "copy":
        return ins[0]
    if any(m for *_, m in ins):
        return None                                   # nothing but a cast after a modulus
    (a0, c0, d0, _), *rest = ins
    if o.fn in ("add", "sub") and d0 == rest[0][2] == 1:
        sign = 1 if o.fn == "add" else -1
        out = (a0 + sign * rest[0][0], c0 + sign * rest[0][1], 1, 0)
    elif o.fn == "mul" and d0 == rest[0][2] == 1 and (a0 == 0 or rest[0][0] == 0):
        a1, c1 = rest[0][:2]
        out = (a0 * c1 + a1 * c0, c0 * c1, 1, 0)
    elif o.fn == "floordiv" and rest[0][0] == 0 and rest[0][2] == 1 and rest[0][1] > 0:
        out = (a0, c0, d0 * rest[0][1], 0)
    elif o.fn == "mod" and d0 == 1 and a0 > 0 and rest[0][0] == 0 and rest[0][2] == 1 and rest[0][1] > 0:
        out = (a0, c0, 1, rest[0][1])
    else:
        return None
    a, c, d, _ = out
    return out if abs(a) * ext + abs(c) < 2 ** 31 and d < 2 ** 16 else None


def _window(gen: _Gen, n, b, ax: int, subs, idx, dims) -> tuple[tuple[int, int, int], str, str] | None:
    """((A, C, D), the condition on VEC, the element offset of the window's base) for a gather whose
    contiguous subscript is floor((A j + C) / D) for vector index j past a base set by the thread's
    first index (`_affine`; a modulus that no vector straddles when the condition holds), every
    other subscript the same for the vector, in a row tensor whose contiguous extent is a literal
    multiple of a 16-byte word; None otherwise."""
    v = gen.vector
    ext = dict(gen.dim_values)[v.d]
    w = 16 // dtype_bytes(b.dtype)
    if b.layout == "col" or not isinstance(ext, int) or not subs[ax].startswith("@"):
        return None
    if not (isinstance(b.shape[ax], int) and b.shape[ax] % w == 0):
        return None
    if not all(k == ax or x.startswith("#") or (not x.startswith("@") and x != v.label) for k, x in enumerate(subs)):
        return None
    u, labels = operands(gen.g, n)[int(subs[ax][1:])]
    aff = _affine(gen, u, labels, v.label, ext)
    if aff is None:
        return None
    a, c, d, m = aff
    first = list(idx)
    if m:
        # the A * VEC values of a vector start at a multiple of A * VEC, as do C and M: no vector
        # wraps around M, so element j is the first one's + A j
        cond = f"{m} % ({a} * VEC) == 0 && {c} % ({a} * VEC) == 0 && ({a} * VEC) % {w} == 0"
        first[ax] = f"kspec_mod({a}LL * (long long)i_{v.d} + {c}LL, {m}LL)"
        a, c, d = a, 0, 1
    else:
        cond = f"({a} * VEC) % ({d} * {w}) == 0"
        first[ax] = f"({a}LL * (long long)i_{v.d} / {d}LL)"     # exact: A * VEC is a multiple of D
    terms, stride = [], "1LL"
    for axis in reversed(range(len(first))):
        terms.append(f"{first[axis]} * {stride}")
        stride = f"{stride} * {gen.dimx(dims[axis])}"
    return (a, c, d), cond, " + ".join(reversed(terms))


def _stores(gen: _Gen, n, value: str, body: list[str], raw: str | None = None) -> None:
    """Store node n's value (variable `value`; `raw`: its expression before rounding) to each of its
    buffers."""
    for t in gen.ir.stores_of(n):
        labels = gen.ir.store_labels(n, t)
        b = gen.ir.buffer(t)
        if raw is not None and b.dtype == op(gen.g, n).dtype and b.dtype not in _INT:
            value = raw
        if gen.vector is not None and gen.vector.contiguous(t, labels):
            body.append(_assign(b.dtype, gen.vector.store(t, labels), value))
        else:
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
            head = f"for (long long i_{d} = 0; i_{d} < {gen.dimx(d)}; ++i_{d}) {{"
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
        count = " * ".join(f"(float){gen.dimx(gen.dim_of[l])}" for l in o.reduced)
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
    loop = f"for (long long i_{d} = 0; i_{d} < {gen.dimx(d)}; ++i_{d}) {{ "
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
  long long count;   // elements of the iteration space
  int vec;           // elements per thread of the vector path (%(vec)s), 0: one element per thread
  int idx32;         // 1: count fits 32 bits, indices are decoded in 32-bit arithmetic
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
#ifndef KSPEC_ASSUME
#if defined(__CUDA_ARCH__)
#define KSPEC_ASSUME(c) __builtin_assume(c)
#else
#define KSPEC_ASSUME(c) ((void)0)
#endif
#endif
// the vector path's 128-bit moves between a 16-byte aligned array and 16-byte aligned memory
template <typename T, int N> __device__ __forceinline__ void kspec_ld128(T (&dst)[N], const T* src) {
  static_assert(sizeof(dst) %% 16 == 0, "whole 16-byte words");
  KSPEC_ASSUME(((uintptr_t)src & 15) == 0);
#pragma unroll
  for (int k = 0; k < (int)(sizeof(dst) / 16); ++k) reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(src)[k];
}
// one 16-byte word (a gather's window)
template <typename T> __device__ __forceinline__ void kspec_ldw(T* dst, const T* src) {
  KSPEC_ASSUME(((uintptr_t)src & 15) == 0);
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
// floor division and, for a window gather reading element floor((a j + c) / d) for j < n in words
// of w elements, the elements j that lie in word k (compile-time constants once unrolled)
__host__ __device__ constexpr int kspec_fdiv(int a, int b) { return a / b - ((a %% b != 0) && ((a < 0) != (b < 0))); }
__host__ __device__ constexpr unsigned int kspec_word_mask(int n, int a, int c, int d, int w, int k) {
  unsigned int m = 0;
  for (int j = 0; j < n; ++j) if (kspec_fdiv(kspec_fdiv(a * j + c, d), w) == k) m |= 1u << j;
  return m;
}
template <typename T, int N> __device__ __forceinline__ void kspec_st128(T* dst, const T (&src)[N]) {
  static_assert(sizeof(src) %% 16 == 0, "whole 16-byte words");
  KSPEC_ASSUME(((uintptr_t)dst & 15) == 0);
#pragma unroll
  for (int k = 0; k < (int)(sizeof(src) / 16); ++k) {
    const uint4 w = reinterpret_cast<const uint4*>(src)[k];
#if defined(__CUDA_ARCH__)
    // spelt out: nvcc 13 splits a plain uint4 store of a local array into 32-bit stores on sm_90a
    asm volatile("st.global.v4.b32 [%%0], {%%1, %%2, %%3, %%4};" :: "l"(__cvta_generic_to_global(reinterpret_cast<uint4*>(dst) + k)),
                 "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w) : "memory");
#else
    reinterpret_cast<uint4*>(dst)[k] = w;
#endif
  }
}

%(vector)s
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
  p.count = %(threads)s;
  p.idx32 = p.count <= 4294967295LL ? 1 : 0;
  // the widest vector path (%(vec)s elements per thread) the innermost extent is a multiple of, where
  // every pointer it moves 16 bytes at a time is 16-byte aligned; otherwise one element per thread
  p.vec = 0;
%(vec_pick)s  std::memcpy(params, &p, sizeof(Params));
  *params_size = sizeof(Params);
  long long threads = p.vec ? p.count / p.vec : p.count;
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


def _vector_pick(desc: GenericDesc) -> str:
    """The host's choice of the vector width (C statements over the filled `p`)."""
    if not desc.vec:
        return ""
    aligned = " && ".join(f"((uintptr_t)p.ptr[{desc.args.index(a)}] & 15) == 0" for a in desc.vec_args) or "true"
    out = f"  if ({aligned}) {{\n"
    for k, w in enumerate(desc.vec):
        out += f"    {'if' if k == 0 else 'else if'} (p.dim[{desc.vec_dim[1:]}] % {w} == 0) p.vec = {w};\n"
    return out + "  }\n"


_VECTOR = r"""
// the vector path: VEC consecutive elements along the innermost axis per thread, 128-bit moves;
// index variables of type I (unsigned int where the element count fits 32 bits)
template <int VEC, typename I> __device__ __forceinline__ void kspec_vector(const Params& p) {
%s
}
"""


def emit_generic(desc: GenericDesc) -> EmittedKernel:
    for name in (desc.name, *desc.args, *desc.scalars, *desc.dims):
        check_ident(name, "generated kernel")
    sizes = {"nptr": max(1, len(desc.args)), "ndim": max(1, len(desc.dims)), "nscalar": max(1, len(desc.scalars)),
             "nptr_real": len(desc.args), "ndim_real": len(desc.dims), "nscalar_real": len(desc.scalars),
             "block": BLOCK, "body": desc.body, "threads": desc.threads, "abi": ABI_VERSION,
             "vec": " or ".join(map(str, desc.vec)) or "none", "vec_pick": _vector_pick(desc),
             "vector": _VECTOR % desc.vec_body if desc.vec else ""}
    source = (f"// Generated by kspec: plain CUDA kernel '{desc.name}' for {desc.arch}. Do not edit.\n"
              + _PRELUDE % sizes + _DEVICE % sizes + _HOST % sizes)
    return EmittedKernel(name=desc.name, arch=desc.arch, source=source, include_dirs=(),
                         flags=("-std=c++17", "-O3"), dims=desc.dims, args=desc.args, scalars=desc.scalars,
                         alignment=tuple(zip(desc.args, desc.arg_bytes or (1,) * len(desc.args))),
                         config=(("kind", "generic"), ("block", str(BLOCK)),
                                 ("vec", ",".join(map(str, desc.vec)) or "-")))


class GenericBackend(NvccBuilt):
    """Plain CUDA loop kernels for every kernel IR: the backend of last resort.  Elementwise kernels
    are what it is for; any other kind it runs is reported as a fallback (and refused by --strict)."""
    name = "generic"
    capabilities = Capabilities(archs=ARCHS, kinds=("elementwise",),
                                fallback_kinds=tuple(k for k in KINDS if k != "elementwise"))

    def identity(self) -> str:
        return "kspec-generic 2"

    def can_implement(self, ir: KernelIR, arch: str) -> str | None:
        if arch not in ARCHS:
            return f"the generic backend does not target {arch}"
        if ir.kind == "attention":
            return "fused attention has no loop-kernel form (the unfused plan is used instead)"
        if ir.kind == "gemm" and ir.epilogue.reductions:
            return (f"it cannot fuse the epilogue reduction into {ir.epilogue.reductions[0].name} (use operand "
                    "dtypes a tensor-core backend takes, or reduce a stored result in a statement of its own)")
        loops = [o for o in ir.internal if o.kind in ("softmax", "reduction")]
        if len(loops) > 1:
            return "it runs one reduction or softmax per kernel"
        # what its code generator cannot express is refused here, when the kernel is planned, so
        # `kspec graph` never plans a kernel that `kspec compile` then rejects (generation is cheap)
        try:
            self._remember(ir, arch, lower_generic(ir, arch))
        except KspecLoweringError as e:
            return e.message.split(": ", 1)[1] if e.message.startswith(f"plan {ir.id}: ") else e.message
        return None

    def _remember(self, ir: KernelIR, arch: str, lowered: LoweredPlan) -> None:
        """The vector widths of a kernel just lowered, for default_config (which the registry asks
        right after can_implement: the kernel is not generated twice)."""
        memo = self.__dict__.setdefault("_widths", {})
        if len(memo) > 256:
            memo.clear()
        memo[(id(ir), arch)] = (ir, lowered.desc.vec)

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
        """The block size, and for an elementwise kernel with a vector path its widths (`vec`: what
        `kspec graph` prints is what the kernel does; the host glue picks one at launch)."""
        if ir.kind != "elementwise":
            return (("block", str(BLOCK)),)
        hit = self.__dict__.get("_widths", {}).get((id(ir), arch))
        if hit is None or hit[0] is not ir:
            try:
                self._remember(ir, arch, lower_generic(ir, arch))
            except KspecLoweringError:
                return (("block", str(BLOCK)),)
            hit = self._widths[(id(ir), arch)]
        vec = hit[1]
        return (("block", str(BLOCK)),) + ((("vec", ",".join(map(str, vec))),) if vec else ())

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
