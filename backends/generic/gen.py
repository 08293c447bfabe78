"""The plain-CUDA generator's core (backends/generic): per-element code over sanitized names — values
rounded to their dtype as the numpy reference rounds them, loads and stores, index decoding, gathers,
the elementwise body, reductions and softmax loops.  The vector path is backends/generic/vector.py,
the kernel source and host glue backends/generic/source.py."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kspec.backends.names import Names
from kspec.compiler.graph import op, operands
from kspec.compiler.kir import KernelIR
from kspec.core import INT_DTYPES, KspecError, KspecInternalError

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
    init: tuple[tuple[str, str], ...] = ()   # outputs filled before launch (column sums added atomically)


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
        self.vector = None                  # vector._Vector while the vector path's element code is generated

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
