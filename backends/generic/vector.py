"""The vector path of a pure elementwise kernel (backends/generic): VEC consecutive elements along the
innermost axis per thread, tensors contiguous along it moved as 128-bit words, gathers read as
windows of words or checked for contiguity at run time.  Generated as the body of
`template <int VEC, typename I> kspec_vector(const Params& p)` (backends/generic/source.py)."""
from __future__ import annotations

import networkx as nx

from kspec.backends.generic.gen import _CTYPE, _INT, _ctype, _elem, _element, _Gen, _index_decode, _round
from kspec.compiler.graph import op, operands
from kspec.core import dtype_bytes


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
    return (["#pragma unroll", "for (int j_ = 0; j_ < VEC; ++j_) {",
             f"  [[maybe_unused]] const I i_{d}j = i_{d} + (I)j_;"]
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
        lines += [f"  constexpr int r0 = kspec_fdiv({name}C, {name}D), "
                  f"r1 = kspec_fdiv({name}A * (VEC - 1) + {name}C, {name}D);",
                  f"  constexpr int k0 = kspec_fdiv(r0 < r1 ? r0 : r1, {name}W), "
                  f"k1 = kspec_fdiv(r0 < r1 ? r1 : r0, {name}W);",
                  f"  const long long b_ = {base};",
                  f"  alignas(16) {ct} w_[(k1 - k0 + 1) * {name}W];",
                  "  #pragma unroll",
                  "  for (int k = 0; k <= k1 - k0; ++k)",
                  f"    if ({name}m & kspec_word_mask(VEC, {name}A, {name}C, {name}D, {name}W, k0 + k)) "
                  f"kspec_ldw(w_ + k * {name}W, {src} + b_ + (k0 + k) * {name}W);",
                  "  #pragma unroll",
                  f"  for (int j_ = 0; j_ < VEC; ++j_) "
                  f"{name}[j_] = w_[kspec_fdiv({name}A * j_ + {name}C, {name}D) - k0 * {name}W];",
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
