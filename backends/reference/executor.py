"""Execute a scheduled kernel on numpy, plan by plan.

Semantics (shared with every GPU backend): each graph node's value is computed in f32 (int64 for
integers) and rounded to the node's dtype; contractions accumulate in f32 (i32) over operands in
their storage precision (tf32 operands rounded to tf32).  Because rounding is per node, a fused and
an unfused schedule of the same graph give bit-identical results.
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import networkx as nx
import numpy as np

from kspec.compiler import KernelSchedule, op, operands, plan_kernel
from kspec.core import KspecRuntimeError, extent_value, split_quotient_dim
from kspec.spec_lang import CheckedKernel, CheckedProgram, KspecError, load_spec

from . import varlen
from .varlen import KspecReferenceError
from kspec.numerics import FUNCTIONS, divide, floordiv, is_int, mod, round_tf32, storage_dtype, to_compute, to_storage

# Nodes without operands, computed wherever they are read (compiler.graph.GENERATED_KINDS).
_GENERATED = ("const", "index", "size")


def _align(value: np.ndarray, labels: tuple[str, ...], axes: tuple[str, ...]) -> np.ndarray:
    """View `value` (axes named `labels`) with axes ordered as `axes`, size-1 for missing ones."""
    if not labels:
        return value
    perm = sorted(range(len(labels)), key=lambda i: axes.index(labels[i]))
    v = np.transpose(value, perm)
    present = [labels[i] for i in perm]
    shape = [v.shape[present.index(a)] if a in present else 1 for a in axes]
    return v.reshape(shape)


def _softmax(x: np.ndarray, axis: int, causal_axis: int | None) -> np.ndarray:
    x = x.astype(np.float32)
    if causal_axis is not None:
        q = np.arange(x.shape[causal_axis]).reshape([-1 if d == causal_axis else 1 for d in range(x.ndim)])
        k = np.arange(x.shape[axis]).reshape([-1 if d == axis else 1 for d in range(x.ndim)])
        x = np.where(k > q, np.float32(-np.inf), x)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(x - m)
    s = np.sum(e, axis=axis, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(s > 0, e / s, 0).astype(np.float32)


def _logsumexp(x: np.ndarray, axis: tuple[int, ...]) -> np.ndarray:
    """log(sum(exp(x))) over `axis`, natural log, max-shifted: -inf where every element is -inf or
    the axis is empty, +inf where one is +inf, NaN where one is NaN."""
    x = x.astype(np.float32)
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, np.float32(0))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        s = np.sum(np.exp(x - m), axis=axis, keepdims=True)
        out = np.where(s == 0, np.float32(-np.inf), m + np.log(s))
    return np.squeeze(out, axis=axis).astype(np.float32)


def _letters(labels) -> dict[str, str]:
    return {l: string.ascii_letters[i] for i, l in enumerate(labels)}


def eval_node(g: nx.DiGraph, n, values: Mapping, sizes: Mapping[str, int],
              poison: dict | None = None) -> np.ndarray:
    """The value of node n (in its dtype's storage) from its operands' values."""
    o = op(g, n)
    ins = operands(g, n)
    if o.kind == "const":
        return to_storage(np.asarray(o.value), o.dtype) if not is_int(o.dtype) else np.asarray(o.value)
    if o.kind == "index":
        (extent,) = o.shape
        return np.arange(extent_value(extent, sizes), dtype=np.int32)
    if o.kind == "size":
        return np.asarray(sizes[o.fn], dtype=np.int32)
    if o.kind == "contraction":
        (ua, la), (ub, lb) = ins
        letters = _letters(list(dict.fromkeys(la + lb + o.axes)))
        a, b = values[ua], values[ub]
        prep = []
        for x, u in ((a, ua), (b, ub)):
            x = to_compute(x)
            if op(g, u).dtype == "tf32":
                x = round_tf32(x)
            # sums depend on memory order; contiguous operands make the rounding a function of the
            # values alone, so fused and unfused schedules (different buffer layouts) agree bitwise
            prep.append(np.ascontiguousarray(x))
        spec = f"{''.join(letters[l] for l in la)},{''.join(letters[l] for l in lb)}->" \
               f"{''.join(letters[l] for l in o.axes)}"
        return to_storage(np.einsum(spec, *prep, optimize=True), o.dtype)
    if o.kind == "reduction":
        (u, labels), = ins
        x = to_compute(values[u])
        x = np.ascontiguousarray(_align(x, labels, o.axes + o.reduced))
        red = tuple(range(len(o.axes), len(o.axes) + len(o.reduced)))
        if o.fn in ("max", "min") and any(x.shape[a] == 0 for a in red):
            # over nothing: max is -inf and min +inf (as logsumexp is -inf and sum 0); the compiled
            # kernels refuse such a call (kspec.runtime.emptycheck)
            if is_int(o.dtype):
                raise KspecReferenceError(f"{o.fn} over an empty axis of integers has no value")
            return to_storage(np.full(x.shape[:len(o.axes)], -np.inf if o.fn == "max" else np.inf), o.dtype)
        fn = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.mean, "logsumexp": _logsumexp}[o.fn]
        out = fn(x, axis=red)
        return to_storage(out, o.dtype)
    if o.kind == "partial":
        # column partials [slot, n] (compiler/rowwise.py): slot s sums the rows m with m % P == s of
        # the product of the operands (rows numbered over the reduced labels in their order)
        order = o.reduced + o.axes[1:]
        x = np.ones((), np.float32)
        for u, labels in ins:
            x = x * _align(to_compute(values[u]), labels, order)
        x = np.broadcast_to(x, tuple(extent_value(d, sizes) for d in o.reduced_shape + o.shape[1:]))
        x = x.reshape(-1, *x.shape[len(o.reduced):])
        slots = extent_value(o.shape[0], sizes)
        x = np.concatenate([x, np.zeros(((-x.shape[0]) % slots, *x.shape[1:]), x.dtype)])
        return to_storage(x.reshape(-1, slots, *x.shape[1:]).sum(axis=0), o.dtype)
    if o.kind == "softmax":
        (u, labels), = ins
        x = np.ascontiguousarray(_align(to_compute(values[u]), labels, o.axes))
        causal = o.axes.index(o.causal) if o.causal else None
        return to_storage(_softmax(x, o.axes.index(o.fn), causal), o.dtype)
    if o.kind == "gather":
        return _gather(g, n, values, sizes, poison)
    if o.kind in ("elementwise", "broadcast", "cast"):
        args = [_align(to_compute(values[u]), labels, o.axes) for u, labels in ins]
        if o.kind == "broadcast" or o.fn == "copy" or o.kind == "cast":
            out = args[0]
        elif o.fn == "div":
            with np.errstate(divide="ignore", invalid="ignore"):    # inf and NaN, as on the GPU
                out = divide(*args)
        elif o.fn in ("floordiv", "mod"):
            if np.any(np.asarray(args[1]) == 0):
                raise KspecRuntimeError(f"integer division by zero in an index expression ('{o.fn}' over "
                                        f"[{', '.join(o.axes)}])", o.span,
                                        "check the integer params and sizes the expression divides by")
            out = (floordiv if o.fn == "floordiv" else mod)(*args)
        else:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                out = FUNCTIONS[o.fn](*args)
        if o.axes:
            out = np.broadcast_to(out, tuple(extent_value(d, sizes) for d in o.shape))
        return to_storage(out, o.dtype)
    raise KspecError(f"the reference backend cannot execute {o.kind} nodes")


class _Poison:
    """Points of a node's value that hold an out-of-range gather's (discarded-so-far) read: one entry
    per gather reaching it, each a mask over the node's axes, the gather's axes as the node names
    them (None where lost), and the located error of a point of the gather.  Using such a point in an
    output or a reduction raises that error."""
    __slots__ = ("parts",)

    def __init__(self, parts: list):
        self.parts = parts           # [(mask, names, at)]

    @property
    def mask(self) -> np.ndarray:
        m = self.parts[0][0]
        for p in self.parts[1:]:
            m = m | p[0]
        return m

    def fail(self, axes: tuple) -> None:
        """Raise the located error of the first poisoned point (axes: the node's own axes)."""
        for mask, names, at in self.parts:
            if mask.any():
                point = tuple(int(i) for i in np.argwhere(mask)[0])
                if all(x in axes for x in names):
                    raise at(tuple(point[axes.index(x)] for x in names))
                raise at(None)
        raise KspecRuntimeError("index out of range")  # unreachable: fail is called for a set mask


def _gather(g: nx.DiGraph, n, values: Mapping, sizes: Mapping[str, int],
            poison: dict | None = None) -> np.ndarray:
    """source[subscripts] at every point of the node's axes.  An index outside its dimension reads
    nothing: the point is poisoned (recorded in `poison`), an error only if a computation uses it,
    so a gather under where(c, ..) is read only where its branch is taken (as every kernel does)."""
    o = op(g, n)
    ins = operands(g, n)
    src_node = ins[0][0]
    src = np.asarray(values[src_node])
    shape = tuple(extent_value(d, sizes) for d in o.shape)
    index: list[np.ndarray] = []
    bad_all = np.zeros(shape, dtype=bool)
    error = None
    checks: list = []
    for axis, x in enumerate(o.subscripts):
        if x.startswith("#"):
            ix = np.full(shape, int(x[1:]), dtype=np.int64)
        elif x.startswith("@"):
            u, labels = ins[int(x[1:])]
            ix = np.broadcast_to(_align(np.asarray(values[u]).astype(np.int64), labels, o.axes), shape)
            bad = (ix < 0) | (ix >= src.shape[axis])
            if bad.any():
                text = o.subscript_text[axis] if len(o.subscript_text) > axis else \
                    f"{op(g, u).name or u}[{', '.join(labels)}]"

                def located(where, ix=ix, axis=axis, text=text):
                    at = ", ".join(f"{a}={i}" for a, i in zip(o.axes, where))
                    return KspecRuntimeError(
                        f"index out of range: subscript {text} of '{op(g, src_node).name or src_node}' (axis "
                        f"{axis}) is {int(ix[where])} at {at}, but that axis has size {src.shape[axis]} "
                        f"(valid: 0 to {src.shape[axis] - 1})", o.span)
                error = error or located(tuple(int(i) for i in np.argwhere(bad)[0]))
                checks.append((bad, located))
                bad_all |= bad
                ix = np.where(bad, 0, ix) if src.shape[axis] else ix
        else:
            pos = o.axes.index(x)
            ix = np.arange(shape[pos]).reshape([-1 if i == pos else 1 for i in range(len(shape))])
            ix = np.broadcast_to(ix, shape)
        index.append(ix)
    if error is not None:
        if poison is None or 0 in src.shape:
            raise error

        def at(where):
            if where is None:
                return error
            return next(located(where) for bad, located in checks if bad[where])
        poison[n] = _Poison([(bad_all, tuple(o.axes), at)])
        out = to_compute(src[tuple(index)])
        if out.dtype.kind == "f":
            out = np.where(bad_all, np.float32(np.nan), out)
        return to_storage(out, o.dtype)
    return to_storage(to_compute(src[tuple(index)]), o.dtype)


def _propagate(g: nx.DiGraph, n, values: Mapping, sizes: Mapping[str, int], poison: dict) -> None:
    """Carry the poisoned points of n's operands to n: through elementwise ops point by point, through
    where(c, a, b) only from the branch taken; a reduction, contraction, softmax or gather using a
    poisoned point raises the gather's error."""
    ins = operands(g, n)
    hit = [(i, u, labels) for i, (u, labels) in enumerate(ins) if u in poison]
    if not hit:
        return
    o = op(g, n)
    shape = tuple(extent_value(d, sizes) for d in o.shape)
    if not (o.kind in ("broadcast", "cast", "elementwise")):
        for _, u, labels in hit:
            if poison[u].mask.any():
                poison[u].fail(op(g, u).axes)
        return
    keep = None
    if o.kind == "elementwise" and o.fn == "where":
        (uc, lc), _, _ = ins
        c = np.broadcast_to(_align(np.asarray(values[uc]).astype(bool), lc, o.axes), shape)
        keep = {1: c, 2: ~c}
    parts = []
    for i, u, labels in hit:
        uax = op(g, u).axes
        for mask, names, at in poison[u].parts:
            m = np.broadcast_to(_align(mask, labels, o.axes), shape)
            if keep is not None and i in keep:
                m = m & keep[i]
            if m.any():
                parts.append((m, tuple(labels[uax.index(x)] if x in uax else "~" for x in names), at))
    if parts:
        poison[n] = _Poison(parts)


def execute(sched: KernelSchedule, inputs: Mapping[str, np.ndarray], params: Mapping[str, float],
            sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
    """Run every plan in order; return the outputs by name."""
    g = sched.graph
    buffers: dict[str, np.ndarray] = {}
    poison: dict = {}           # node -> _Poison: points holding a discarded out-of-range gather
    for b in sched.buffers.values():
        if b.kind == "input":
            a = inputs[b.name]
            squeezed = op(g, b.node).squeezed if b.node is not None else ()
            # an input read only as a view without its extent-1 axes (canon.squeeze_unit_reads)
            buffers[b.name] = np.squeeze(a, axis=squeezed) if squeezed else a
        elif b.kind == "param":
            buffers[b.name] = np.asarray(params[b.name], dtype=storage_dtype(b.dtype))
    for plan in sched.plans:
        values: dict = {}
        for n in plan.group.nodes:
            for u in g.predecessors(n):
                if u not in plan.group.nodes and op(g, u).kind not in _GENERATED:
                    values[u] = buffers[sched.value_buffer[u]]
        sub = g.subgraph(plan.group.nodes)
        for n in nx.topological_sort(sub):
            for u in g.predecessors(n):
                if op(g, u).kind in _GENERATED and u not in values:
                    values[u] = eval_node(g, u, values, sizes)
            _propagate(g, n, values, sizes, poison)
            values[n] = eval_node(g, n, values, sizes, poison)
        for n in plan.group.nodes:
            name = sched.value_buffer.get(n)
            if name is not None and sched.buffers[name].kind in ("output", "intermediate"):
                buffers[name] = values[n]
            for s in g.successors(n):
                so = op(g, s)
                if so.kind == "output":
                    if n in poison and poison[n].mask.any():
                        poison[n].fail(tuple(op(g, n).axes))
                    buffers[so.name] = np.ascontiguousarray(to_storage(values[n], so.dtype))
    return {t.name: buffers[t.name] for t in sched.kernel.outputs}


@dataclass
class ReferenceKernel:
    """A spec kernel as a numpy callable: `fn(A=a, B=b, alpha=2.0) -> {"D": d}`."""
    kernel: CheckedKernel
    fused: bool = True

    def __post_init__(self):
        self.schedule = plan_kernel(self.kernel, fuse_ops=self.fused)

    def __repr__(self) -> str:
        ins = ", ".join(t.describe() for t in self.kernel.inputs + self.kernel.params)
        outs = ", ".join(t.describe() for t in self.kernel.outputs)
        return f"<kspec reference kernel {self.kernel.name}({ins}) -> ({outs})>"

    def bind(self, arrays: Mapping[str, object]) -> tuple[dict, dict, dict]:
        """Check the arguments; return (inputs in storage dtype, params, sizes)."""
        k = self.kernel
        known = {t.name for t in k.inputs + k.params}
        for name in arrays:
            if name not in known:
                raise KspecReferenceError(f"{k.name}: unknown argument '{name}'",
                                          hint=f"arguments: {', '.join(sorted(known))}")
        sizes: dict[str, int] = dict(k.bindings)
        where: dict[str, str] = {s: "the spec" for s in sizes}
        inputs: dict[str, np.ndarray] = {}
        quotients: list[tuple[str, str, int]] = []
        # packed (varlen) tensors after the offsets they are packed by
        for t in sorted(k.inputs, key=lambda t: t.packed is not None):
            if t.name not in arrays:
                raise KspecReferenceError(f"{k.name}: missing input '{t.name}' ({t.describe()})")
            a = np.asarray(arrays[t.name])
            rank = t.rank - (t.packed is not None)
            if a.ndim != rank:
                raise KspecReferenceError(f"argument '{t.name}': expected rank {rank} ({t.describe()}"
                                          f"{': [rows, ...]' if t.packed else ''}), got shape {a.shape}")
            if is_int(t.dtype) != (a.dtype.kind in "iub"):
                raise KspecReferenceError(f"argument '{t.name}': expected {t.dtype} values, got a {a.dtype} array")
            dims, extents = t.shape, a.shape
            if t.packed is not None:
                cu = varlen.check_offsets(t.packed, inputs[t.packed], a.shape[0], t.name)
                longest = int(np.diff(cu).max(initial=0))
                dims, extents = t.shape, (cu.size - 1, longest) + a.shape[1:]
            for dim, extent in zip(dims, extents):
                if varlen.bind_offsets(dim, extent, sizes, where, t.name):
                    continue
                if split_quotient_dim(dim) is not None:
                    quotients.append((t.name, dim, extent))     # checked once every size is bound
                    continue
                if isinstance(dim, int):
                    if extent != dim:
                        raise KspecReferenceError(f"argument '{t.name}': expected shape "
                                                  f"[{', '.join(map(str, t.shape))}], got {list(a.shape)}")
                elif dim in sizes and sizes[dim] != extent:
                    raise KspecReferenceError(f"argument '{t.name}': {dim} = {extent}, but {dim} = {sizes[dim]} "
                                              f"from {where[dim]}")
                else:
                    sizes[dim] = extent
                    where[dim] = f"argument '{t.name}'"
            inputs[t.name] = to_storage(a, t.dtype) if a.dtype != storage_dtype(t.dtype) else a
            if t.packed is not None:
                inputs[t.name] = varlen.unpack(inputs[t.name], cu, longest)
        for t in k.outputs:      # a packed output needs its sizes from the inputs
            if t.packed is not None and t.shape[1] not in sizes:
                cu = varlen.check_offsets(t.packed, inputs[t.packed], int(np.asarray(inputs[t.packed])[-1]), t.name)
                sizes[t.shape[1]] = int(np.diff(cu).max(initial=0))
                where[t.shape[1]] = f"argument '{t.packed}'"
        for name, dim, extent in quotients:
            sym, q = split_quotient_dim(dim)
            if sym not in sizes:
                raise KspecReferenceError(f"argument '{name}': {dim} needs {sym}, which no other argument gives")
            if sizes[sym] % q:
                raise KspecReferenceError(f"argument '{name}': {dim}: {sym} = {sizes[sym]} (from {where[sym]}) is not a "
                                          f"multiple of {q}", hint=f"block scales cover whole blocks of {q}: pad {sym}")
            if extent != sizes[sym] // q:
                raise KspecReferenceError(f"argument '{name}': {dim} must be {sizes[sym] // q} ({sym} = {sizes[sym]} "
                                          f"from {where[sym]}), got {extent}")
        unbound = [s for s in k.symbols if s not in sizes]
        if unbound:
            raise KspecReferenceError(f"{k.name}: size {', '.join(unbound)} cannot be inferred from the inputs",
                                      hint="every size symbol of an output must also size an input")
        params: dict[str, float] = {}
        for t in k.params:
            v = arrays.get(t.name, t.default)
            if v is None:
                raise KspecReferenceError(f"{k.name}: missing param '{t.name}' ({t.dtype}, no default)")
            if not np.isscalar(v) and np.ndim(v) != 0:
                raise KspecReferenceError(f"param '{t.name}' is a scalar, got shape {np.shape(v)}")
            params[t.name] = float(v) if not is_int(t.dtype) else int(v)
        return inputs, params, sizes

    def count_ranges(self) -> tuple:
        """The per-sequence key-count ranges (kv_len in [0, T]) the runtime checks before a launch
        (compiler.indices), found on the fused plan whatever this reference's schedule, so the
        reference refuses exactly the key counts the compiled kernels refuse."""
        if not hasattr(self, "_counts"):
            from kspec.compiler.indices import index_ranges, merge_index_ranges
            sched = self.schedule if self.fused else plan_kernel(self.kernel)
            self._counts = tuple(r for r in merge_index_ranges(x for p in sched.plans for x in index_ranges(p.ir))
                                 if r.inclusive and not r.ends)
        return self._counts

    def __call__(self, **arrays) -> dict[str, np.ndarray]:
        inputs, params, sizes = self.bind(arrays)
        if self.count_ranges():
            from kspec.runtime.indexcheck import check_index_values
            check_index_values(self.kernel.name, self.count_ranges(), sizes,
                               {r.tensor: np.asarray(inputs[r.tensor]) for r in self.count_ranges()})
        out = execute(self.schedule, inputs, params, sizes)
        for t in self.kernel.outputs:      # packed outputs store their present rows only
            if t.packed is not None:
                out[t.name] = varlen.pack(out[t.name], np.asarray(inputs[t.packed]).astype(np.int64))
        return out


class ReferenceModule:
    """Every kernel of a spec as a `ReferenceKernel` attribute."""

    def __init__(self, program: CheckedProgram, fused: bool = True):
        self.program = program
        self.kernels = {k.name: ReferenceKernel(k, fused) for k in program.kernels}

    def __getattr__(self, name):
        try:
            return self.__dict__["kernels"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return f"<kspec reference module {self.program.file}: {', '.join(self.kernels)}>"


def reference(spec_or_path, kernel: str | None = None, *, fused: bool = True):
    """`kspec.reference(path_or_program, kernel=None)`: a numpy callable for one kernel of a spec
    (the only one, or `kernel`), taking arrays by name and returning outputs by name.  A spec with
    several kernels and no `kernel=` gives a module with one callable per kernel."""
    if isinstance(spec_or_path, CheckedProgram):
        program = spec_or_path
    elif isinstance(spec_or_path, Path) or (isinstance(spec_or_path, str) and _looks_like_path(spec_or_path)):
        program = load_spec(spec_or_path)
    elif isinstance(spec_or_path, str):
        program = load_spec(spec_or_path, is_text=True)
    else:
        raise KspecError(f"kspec.reference takes a spec path, spec text or CheckedProgram, "
                         f"not {type(spec_or_path).__name__}")
    if kernel is not None:
        return ReferenceKernel(program.kernel(kernel), fused)
    if len(program.kernels) == 1:
        return ReferenceKernel(program.kernels[0], fused)
    return ReferenceModule(program, fused)


def _looks_like_path(text: str) -> bool:
    """A spec path rather than spec text (text has a `{`; long text is not a legal file name)."""
    if "{" in text or "\n" in text:
        return False
    try:
        return Path(text).suffix == ".kspec" or Path(text).exists()
    except (OSError, ValueError):
        return False
