"""Index ranges: which integer input tensors a kernel uses as subscripts, and the range their values
must lie in (kspec.core.IndexRange).  The compile step records them in the artifact manifest and
the runtime checks them before a launch, so an out-of-range label or block-table entry is an error
that names the tensor, the position and the value instead of a NaN (or a wrong row) on the GPU.

Computed from the kernel IR only, in one walk over what selects an element by a tensor's value:
- a gather op's subscripts (`IROp.subscripts`): "@<pos>" is the value of operand <pos>, which
  selects along that axis of operand 0 (a label or "#<int>" selects by position, not by value);
- an attention mod's `AuxLoad` whose subscript is itself an `AuxLoad` (`K[table[b, i], ...]`: a
  block table, a per-batch offset).
Only tensors the kernel loads from its own inputs can be checked before the launch; an index
computed inside the kernel, or by an earlier plan, is left to the kernel's own guard.  Every
element of an index tensor is checked, so a block table's unused entries must hold valid values
too (or the range must allow negatives as a "no block" sentinel: `negative`).  Offsets that mark
an end (cumulative sequence lengths) are ranges with `inclusive` and `monotonic` set, added here
where the IR names them (the offsets of packed buffers, also `ends`: the last offset is the row
count); so are per-sequence key counts (`AttentionStructure.kv_len`, in
[0, keys], `inclusive`), whose extent may be a product (a paged cache's pages * page size).
"""
from __future__ import annotations

from dataclasses import replace

from kspec.core import IndexRange, packed_rows_symbol

from .kir import AuxLoad, IROp, KernelIR, epi_nodes


def index_ranges(ir: KernelIR) -> tuple[IndexRange, ...]:
    """Every (index tensor, indexed tensor, axis) of one kernel, with its valid range."""
    found: list[IndexRange] = []

    def add(tensor: str | None, target: str, axis: int, extent) -> None:
        if tensor is None:
            return
        r = IndexRange(tensor, target, axis, extent, negative=False, plans=(ir.id,))
        if r not in found:
            found.append(r)

    for o in ir.ops:
        if o.kind != "gather":
            continue
        src = ir.op(o.args[0][0])
        for axis, sub in enumerate(o.subscripts):
            if sub.startswith("@"):
                idx = ir.op(o.args[int(sub[1:])][0])
                add(_input_buffer(ir, idx), _name(src), axis, _extent(ir, src, axis))
    # the offsets of packed (varlen) buffers: cu[b] .. cu[b + 1] - 1 are sequence b's rows, so the
    # offsets lie in [0, rows], never decrease, and the last one is the row count
    for b in ir.buffers:
        if b.packed is not None and _is_input(ir, b.packed) and not any(r.tensor == b.packed for r in found):
            found.append(IndexRange(b.packed, b.name, 0, packed_rows_symbol(b.packed), inclusive=True,
                                    monotonic=True, ends=True, plans=(ir.id,)))
    a = ir.attention
    if a is not None and a.kv_len is not None and _is_input(ir, a.kv_len):
        # per-sequence key counts: a kernel reads keys 0 .. kv_len[b] - 1, which must exist
        key_extent = dict(a.dims)["T"]
        # the key axis of K as stored: [.., T, d] canonically, anywhere in another storage order
        key_axis = a.orders[1].index(a.key) if a.orders else len(ir.buffer(a.k_buffer).shape) - 2
        target, axis = (a.page_table, 1) if a.page_table is not None else (a.k_buffer, key_axis)
        r = IndexRange(a.kv_len, target, axis, key_extent, inclusive=True, plans=(ir.id,))
        if r not in found:
            found.append(r)
    for e in (() if a is None else (a.score_mod, a.mask)):
        for x in (epi_nodes(e) if e is not None else ()):
            if isinstance(x, AuxLoad):
                for axis, sub in enumerate(x.index):
                    if isinstance(sub, AuxLoad) and _is_input(ir, sub.buffer):
                        add(sub.buffer, x.buffer, axis, ir.buffer(x.buffer).shape[axis])
    return tuple(found)


def guarded_sentinels(g) -> dict[tuple[str, str, int], int]:
    """(index tensor, target, axis) -> k where every gather of `target` by `tensor` along `axis` in the
    dataflow graph `g` is used only under where(tensor == k, .., gathered) or where(tensor != k,
    gathered, ..) (an ignore index: the value k is never read, by the reference or the kernels).
    Conservative: any other use (a reduction, an output, the condition itself), a different k, or a
    condition over other labels leaves the range as it is."""
    from .graph import op, operands

    def cond_value(c, tensor: str, labels) -> int | None:
        co = op(g, c)
        if co.kind != "elementwise" or co.fn not in ("eq", "ne"):
            return None
        ins = operands(g, c)
        if len(ins) != 2:
            return None
        for (a, la), (b, _) in (ins, ins[::-1]):
            ao, bo = op(g, a), op(g, b)
            if ao.kind == "input" and ao.name == tensor and tuple(la) == tuple(labels) and bo.kind == "const" \
                    and isinstance(bo.value, int) and not isinstance(bo.value, bool):
                return int(bo.value)
        return None

    def guard(n, tensor: str, labels, axes) -> set | None:
        """The sentinels guarding every use of n's value (None: some use is unguarded)."""
        found: set = set()
        for s in g.successors(n):
            so = op(g, s)
            ins = operands(g, s)
            slots = [i for i, (u, _) in enumerate(ins) if u == n]
            if so.kind == "elementwise" and so.fn == "where" and 0 not in slots and tuple(so.axes) == tuple(axes):
                k = cond_value(ins[0][0], tensor, labels)
                if k is None or (slots != [2] if op(g, ins[0][0]).fn == "eq" else slots != [1]):
                    return None
                found.add(k)
            elif so.kind in ("elementwise", "cast", "broadcast") and so.fn != "where" \
                    and tuple(so.axes) == tuple(axes):
                more = guard(s, tensor, labels, axes)
                if more is None:
                    return None
                found |= more
            else:
                return None
        return found

    seen: dict[tuple[str, str, int], set | None] = {}
    for n in g.nodes:
        o = op(g, n)
        if o.kind != "gather":
            continue
        ins = operands(g, n)
        src = op(g, ins[0][0])
        for axis, sub in enumerate(o.subscripts):
            if not sub.startswith("@"):
                continue
            u, labels = ins[int(sub[1:])]
            uo = op(g, u)
            if uo.kind != "input" or src.kind != "input":
                continue
            key = (uo.name, src.name, axis)
            ks = guard(n, uo.name, labels, o.axes)
            if key in seen and seen[key] is None:
                continue
            seen[key] = None if ks is None or len(ks) != 1 or (key in seen and seen[key] != ks) else ks
    return {key: next(iter(ks)) for key, ks in seen.items() if ks}


def with_sentinels(ranges, sentinels: dict) -> tuple[IndexRange, ...]:
    """`ranges` with the ignore index of each gather only guarded reads (guarded_sentinels)."""
    return tuple(replace(r, ignore=sentinels[(r.tensor, r.target, r.axis)])
                 if (r.tensor, r.target, r.axis) in sentinels and not (r.inclusive or r.ends) else r for r in ranges)


def merge_index_ranges(ranges) -> tuple[IndexRange, ...]:
    """The ranges of a spec kernel's plans as one list: a range read by several plans once, with
    every plan that reads it."""
    out: dict[IndexRange, IndexRange] = {}
    for r in ranges:
        key = replace(r, plans=())
        old = out.get(key)
        plans = r.plans if old is None else old.plans + tuple(p for p in r.plans if p not in old.plans)
        out[key] = replace(r, plans=plans)
    return tuple(out.values())


def _is_input(ir: KernelIR, name: str) -> bool:
    return any(b.name == name and b.role == "input" for b in ir.buffers)


def _input_buffer(ir: KernelIR, o: IROp) -> str | None:
    """The kernel input an index operand loads, None when its value is computed.  An element
    gathered from an input (`Kc[bt[b, j / P], ..]`: the page index is an element of bt) is that
    input's value too."""
    if o.kind == "input" and o.buffer is not None and _is_input(ir, o.buffer):
        return o.buffer
    if o.kind == "gather":
        return _input_buffer(ir, ir.op(o.args[0][0]))
    return None


def _name(o: IROp) -> str:
    return o.buffer if o.kind in ("input", "param") and o.buffer else (o.name or o.id)


def _extent(ir: KernelIR, src: IROp, axis: int):
    if src.kind == "input" and src.buffer is not None:
        return ir.buffer(src.buffer).shape[axis]
    return src.shape[axis]
