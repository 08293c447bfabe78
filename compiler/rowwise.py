"""Row-wise fusion: a chain of reductions and elementwise maps over the same rows is one kernel.

A *row space* is a set of outer labels O (which row) and one row label r (the position in a row).
The rule starts at a reduction over r (sum, max, min, mean, logsumexp), a row dot product (a contraction
`sum(n) x[m, n] * y[m, n]` that is no GEMM) or a non-causal softmax over r whose operand covers O
and r, and grows the group over connected operators whose values live in that space: element
values (axes that include r, e.g. `x[m, n] - mu[m]`, `gamma[n]`), row values (axes within O, e.g.
`rsqrt(var[m] + eps)`), further reductions and softmaxes over r, scalars, and gathers that pick
one element per row (`logits[m, label[m]]`).  The group runs as one kernel (backends/
rowwise/): the row's inputs are read once, every intermediate stays on chip, and only the
group's results are written, so the cost model's bytes are each input once plus each output once.
Sums over the rows of the group's values (a norm backward's dγ/dβ) become column partials of the
row kernel and one finishing "colsum" kernel (`fuse_column_partials`, below).

Guards (each rejection is noted in `FusionResult.notes`):
  - every label has one extent throughout the group;
  - a row's elements are contiguous: r is the innermost storage axis of every full-row buffer the
    group reads or writes (a column-major or transposed row falls back to the generic kernels);
  - a gather picks within a row (its result has no r axis) and reads its tensor and its integer
    indices from memory;
  - `legal_group`: no path leaves the group and comes back.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from .groups import CYCLE, FusionResult, Group, _node_order, legal_addition, legal_group, same_point
from .graph import op, operands

ROW_REDUCTIONS = ("sum", "max", "min", "mean", "logsumexp")
MEMBER_KINDS = ("elementwise", "broadcast", "cast", "reduction", "contraction", "softmax", "gather", "const")
FLOAT = ("f16", "bf16", "f32", "tf32", "f8e4m3", "f8e5m2")


@dataclass(frozen=True)
class RowInfo:
    """The row space of a row-wise group: `outer` labels (one kernel row per combination, in the
    order of the anchor's axes) and the row label `axis`, with their extents."""
    outer: tuple[str, ...]
    axis: str
    extents: tuple[tuple[str, object], ...]       # label -> extent (symbol or literal)

    def extent(self, label: str):
        return dict(self.extents)[label]


def row_space(g: nx.DiGraph, n) -> RowInfo | None:
    """The row space a reduction or softmax node starts, or None if it cannot anchor a row kernel."""
    o = op(g, n)
    if o.kind == "reduction":
        if o.fn not in ROW_REDUCTIONS or len(o.reduced) != 1:
            return None
        ((u, labels),) = operands(g, n)
        if op(g, u).dtype not in FLOAT or o.dtype not in FLOAT:
            return None
        r = o.reduced[0]
        if set(labels) != set(o.axes) | {r}:
            return None      # e.g. `sum(n) x[n]` broadcast over m: not a row of the operand
        extents = tuple(zip(o.axes, o.shape)) + ((r, o.reduced_shape[0]),)
        return RowInfo(tuple(o.axes), r, extents)
    if o.kind == "softmax":
        if o.causal is not None or o.dtype not in FLOAT:
            return None
        return RowInfo(tuple(a for a in o.axes if a != o.fn), o.fn, tuple(zip(o.axes, o.shape)))
    if o.kind == "contraction":
        # a row dot product `sum(n) x[m, n] * y[m, n]` (both operands cover the whole row): what is
        # left of contractions once GEMMs have been recognised
        if o.fn != "sum" or len(o.reduced) != 1:
            return None
        r = o.reduced[0]
        ins = operands(g, n)
        if any(set(labels) != set(o.axes) | {r} or op(g, u).dtype not in FLOAT for u, labels in ins):
            return None
        return RowInfo(tuple(o.axes), r, tuple(zip(o.axes, o.shape)) + ((r, o.reduced_shape[0]),))
    return None


def _storage_last(g: nx.DiGraph, node, labels: tuple[str, ...]) -> str | None:
    """The label of the innermost storage axis of a buffer read or written under `labels`."""
    if not labels:
        return None
    order = list(labels)
    if op(g, node).layout == "col" and len(order) >= 2:
        order[-2], order[-1] = order[-1], order[-2]
    return order[-1]


class _Grower:
    def __init__(self, g: nx.DiGraph, res: FusionResult, info: RowInfo, order: dict | None = None):
        self.g, self.res, self.info = g, res, info
        # topological positions (the graph does not change while groups grow): legality checks
        # then cost what a node adds, not the size of the group
        self.order = order if order is not None else {x: i for i, x in enumerate(nx.topological_sort(g))}
        self.ext = dict(info.extents)
        self.full = set(info.outer) | {info.axis}

    def consistent(self, n) -> bool:
        o = op(self.g, n)
        pairs = list(zip(o.axes, o.shape)) + list(zip(o.reduced, o.reduced_shape))
        return all(self.ext.get(a) == d for a, d in pairs)

    def reject(self, n, group: set) -> str | None:
        """Why node n cannot join the group (None if it can)."""
        g, info = self.g, self.info
        o = op(g, n)
        if o.kind not in MEMBER_KINDS:
            return f"{o.kind} ops do not run in a row kernel"
        if o.kind == "const":
            return None
        if not set(o.axes) <= self.full or not self.consistent(n):
            return "its axes or extents are not those of the rows"
        if o.kind in ("reduction", "contraction"):
            if row_space(g, n) is None or o.reduced != (info.axis,):
                return f"it reduces over another axis than the row axis '{info.axis}'"
        if o.kind == "softmax" and (o.causal is not None or o.fn != info.axis):
            return "a causal softmax, or one over another axis, is not a row softmax"
        if o.kind == "gather":
            if info.axis in o.axes:
                return "a gather of whole rows is an elementwise kernel, not a row reduction"
            if any(u in group for u, _ in operands(g, n)):
                return "a gather's tensor and indices must come from memory"
        if o.dtype not in FLOAT:
            return f"integer ({o.dtype}) values are not computed in row kernels"
        for pos, (u, labels) in enumerate(operands(g, n)):
            uo = op(g, u)
            if u in group:
                if not same_point(g, u, labels):
                    return f"it reads {uo.name or u} at another element (a transposed read)"
                continue
            if uo.kind in ("param", "const"):
                continue
            if uo.dtype not in FLOAT and not (o.kind == "gather" and pos > 0):
                return (f"it reads integer ({uo.dtype}) values of {uo.name or u}; "
                        "row kernels read integers only as subscripts")
            if o.kind == "gather" and pos == 0:
                if _storage_last(g, u, tuple(labels)) is None:
                    return "it gathers from a scalar"
                continue
            if info.axis in labels and _storage_last(g, u, tuple(labels)) != info.axis:
                return (f"it reads {uo.name or u} with the row axis '{info.axis}' not innermost in memory "
                        "(a column-major or transposed row)")
        for s in g.successors(n):
            so = op(g, s)
            if so.kind == "output":
                (_, labels), = [(u, l) for u, l in operands(g, s) if u == n]
                if info.axis in labels and _storage_last(g, s, tuple(labels)) != info.axis:
                    return f"output {so.name} stores rows with '{info.axis}' not innermost in memory"
            elif s not in group and info.axis in o.axes and o.axes[-1] != info.axis:
                return "its value would leave the kernel with the row axis not innermost"
        return None

    def grow(self, seed) -> set:
        """The row group grown from `seed`: in passes, each over the nodes next to the group (in
        node order), adding every one that may join, until a pass adds none.  Long chains take a
        pass per node, so what a pass re-checks is remembered: a node's own verdict depends on the
        group only through which of its neighbours are in it, and a cycle found by a path s -> x1
        .. xk -> (group) stays one while none of x1..xk joins, or, once xi joins first, by the
        path up to it when i > 1 (groups.legal_addition's witness)."""
        g, res = self.g, self.res
        group = {seed}
        members = [seed]                    # group, in the order nodes joined
        notes: dict = {}
        if self.reject(seed, set()):
            return set()
        lo = hi = self.order[seed]
        near = set(g.predecessors(seed)) | set(g.successors(seed))
        verdicts: dict = {}                 # (node, its neighbours in the group) -> reason or None
        cycles: dict = {}                   # node -> [len(members) when checked, {path node: position}, length]
        changed = True
        while changed:
            changed = False
            for s in sorted(near - group, key=_node_order):
                so = op(g, s)
                if so.kind in ("input", "param", "output") or res.group_of(s) is not None:
                    continue
                key = (s, frozenset(x for x in (*g.predecessors(s), *g.successors(s)) if x in group))
                if key in verdicts:
                    why = verdicts[key]
                else:
                    why = self.reject(s, group)
                    if why is None:
                        # an in-group consumer of s must read it at the same point too
                        for c in g.successors(s):
                            if c in group and not all(same_point(g, s, l) for u, l in operands(g, c) if u == s):
                                why = f"{op(g, c).label()} reads it at another element"
                    verdicts[key] = why
                if why is None:
                    c = cycles.get(s)
                    if c is not None:
                        for x in members[c[0]:]:
                            i = c[1].get(x)
                            if i is not None and i < c[2]:
                                c[2] = i            # the path now ends at x, which joined
                        c[0] = len(members)
                        if c[2] > 0:
                            why = CYCLE
                    if why is None:
                        pos, path = self.order[s], []
                        why = legal_addition(g, group, {s}, self.order, (min(lo, pos), max(hi, pos)), path)
                        if why == CYCLE:
                            cycles[s] = [len(members), {x: i for i, x in enumerate(path)}, len(path)]
                if why:
                    notes[s] = f"{so.label()} not fused into the row kernel at {seed}: {why}"
                    continue
                group.add(s)
                members.append(s)
                near.update(g.predecessors(s), g.successors(s))
                lo, hi = min(lo, self.order[s]), max(hi, self.order[s])
                changed = True
        for s, note in sorted(notes.items(), key=lambda kv: _node_order(kv[0])):
            if s not in group and note not in res.notes and op(g, s).kind != "const":
                res.notes.append(note)
        return group


def fuse_rowwise(g: nx.DiGraph, res: FusionResult) -> None:
    """Form row-wise groups (kind "rowwise", info RowInfo) from the reductions and softmaxes not yet
    fused; then give each remaining gather an elementwise group of its own, which the elementwise
    pass extends over its consumers."""
    order = {x: i for i, x in enumerate(nx.topological_sort(g))}
    for n in order:
        if res.group_of(n) is not None:
            continue
        info = row_space(g, n)
        if info is None:
            continue
        nodes = _Grower(g, res, info, order).grow(n)
        if not nodes:
            continue
        res.groups.append(Group(f"g{len(res.groups)}", "rowwise", nodes, n, info))
    for n in nx.topological_sort(g):
        if op(g, n).kind == "gather" and res.group_of(n) is None:
            res.groups.append(Group(f"g{len(res.groups)}", "elementwise", {n}, n))


# Column partials.  A sum over the rows (`dgamma[n] = sum(m) dy[m, n] * xhat[m, n]`, the reduction
# over the row kernel's *outer* axes) of values the row kernel computes or reads is accumulated by
# the row kernel itself: it runs COLUMN_SLOTS row slots (slot s takes rows s, s + P, s + 2P, ..), a
# thread keeps one f32 partial per column it owns, and each slot writes its partials as row s of an
# f32 [P, n] intermediate.  One small kernel (kind "colsum") then sums the P partial rows of every
# such column result and applies what follows it (the output casts): two kernels where the generic
# plan wrote the [M, n] operand to memory and ran a column reduction and a cast per result.
COLUMN_SLOTS = 256
COLUMN_SLOT_LABEL = "slot"


def _column_operand_ok(g: nx.DiGraph, grower: _Grower, group: set, u, labels) -> bool:
    """A column reduction's operand the row kernel can supply: an element value of the group read at
    its own point, or a floating-point tensor from memory with the row axis innermost."""
    info = grower.info
    if set(labels) != set(info.outer) | {info.axis}:
        return False
    uo = op(g, u)
    if u in group:
        return info.axis in uo.axes and same_point(g, u, labels)
    return uo.kind == "input" and uo.dtype in FLOAT and _storage_last(g, u, tuple(labels)) == info.axis


def _column_candidate(g: nx.DiGraph, res: FusionResult, grower: _Grower, group: set, c) -> set | None:
    """The nodes to add to a row group so that it can accumulate column reduction c's partials (c
    itself excluded; possibly none), or None when c is not such a reduction.  An ungrouped operand
    cast or elementwise map of inputs (`f32(dy[m, n])`) joins the row group first."""
    info = grower.info
    o = op(g, c)
    if res.group_of(c) is not None or o.kind not in ("reduction", "contraction") or o.fn != "sum":
        return None
    if sorted(o.reduced) != sorted(info.outer) or o.axes != (info.axis,) or o.dtype not in FLOAT:
        return None
    if not grower.consistent(c):
        return None
    added: set = set()
    for u, labels in operands(g, c):
        if _column_operand_ok(g, grower, group | added, u, labels):
            continue
        uo = op(g, u)
        if res.group_of(u) is not None or uo.kind not in ("cast", "elementwise") or tuple(labels) != uo.axes:
            return None
        if grower.reject(u, group | added) is not None:
            return None
        if not all(x in group or op(g, x).kind in ("input", "param", "const") for x, _ in operands(g, u)):
            return None
        added.add(u)
    if legal_group(g, group | added) is not None:
        return None
    return added


def fuse_column_partials(g: nx.DiGraph, res: FusionResult, ctx=None) -> None:
    """Give each row group the column reductions over its rows (see COLUMN_SLOTS): rewrite every
    such `c[n] = sum(m) X[m, n] (* Y[m, n])` into a partial node `cp[slot, n]` in the row group and
    `c[n] = sum(slot) cp[slot, n]`, then group the row group's column results, with the ungrouped
    maps over the columns that follow them, into one finishing kernel (kind "colsum").  ctx
    (fusion.FusionContext): with an oracle, a row group whose kernels no backend would build with
    the partials keeps its sums over the rows as separate kernels (the rewrite is undone)."""
    labels_used = {a for n in g.nodes for a in (*op(g, n).axes, *op(g, n).reduced)}
    slot = COLUMN_SLOT_LABEL
    while slot in labels_used:
        slot += "_"
    order = {x: i for i, x in enumerate(nx.topological_sort(g))}
    for grp in [x for x in res.groups if x.kind == "rowwise"]:
        info: RowInfo = grp.info
        grower = _Grower(g, res, info, order)
        rewrites: list = []
        for c in sorted(g.nodes, key=_node_order):
            added = _column_candidate(g, res, grower, grp.nodes, c)
            if added is not None:
                rewrites.append(_split_column_sum(g, grp, c, added, slot))
        if not rewrites:
            continue
        fin = {r[0] for r in rewrites}
        changed = True
        while changed:            # the maps over the columns that follow (casts to the output dtype)
            changed = False
            for n in sorted({s for x in fin for s in g.successors(x)} - fin, key=_node_order):
                so = op(g, n)
                if res.group_of(n) is not None or so.kind not in ("cast", "elementwise") or so.axes != (info.axis,):
                    continue
                if all(u in fin or op(g, u).kind in ("param", "const") for u, _ in operands(g, n)) and \
                        legal_group(g, fin | {n}) is None:
                    fin.add(n)
                    changed = True
        ext = ((info.axis, info.extent(info.axis)), (slot, COLUMN_SLOTS))
        colsum = Group(f"g{len(res.groups)}", "colsum", fin, rewrites[0][0], RowInfo((info.axis,), slot, ext))
        why = _refused(g, ctx, grp) or _refused(g, ctx, colsum)
        if why:
            for r in reversed(rewrites):
                _undo_split(g, grp, r)
            res.notes.append(f"the sums over the rows of the row kernel at {grp.anchor} stay separate kernels: {why}")
            continue
        for c, old, *_ in rewrites:
            # what earlier passes said about c no longer holds: it runs in these two kernels
            stale = (f"{old.kind} {c}: ", f"{old.label()} not fused into the row kernel at ")
            res.notes[:] = [x for x in res.notes if not x.startswith(stale)]
        res.groups.append(colsum)


def _split_column_sum(g: nx.DiGraph, grp: Group, c, added: set, slot: str) -> tuple:
    """Rewrite column sum c into a partial node in row group grp and a sum over the slots; returns
    what `_undo_split` needs: (c, its op, its operand edges, the partial node, the nodes added)."""
    from .graph import OpNode
    info: RowInfo = grp.info
    o = op(g, c)
    edges = {u: g.edges[u, c]["uses"] for u in g.predecessors(c)}
    cp = f"n{max(_node_order(x) for x in g.nodes) + 1}"
    # the slots split the kernel's rows, numbered over the outer labels in row order
    g.add_node(cp, op=OpNode("partial", "f32", (slot, info.axis), (COLUMN_SLOTS, info.extent(info.axis)), fn="sum",
                             reduced=info.outer, reduced_shape=tuple(map(info.extent, info.outer)), span=o.span))
    for u, uses in edges.items():
        g.add_edge(u, cp, uses=uses)
        g.remove_edge(u, c)
    g.add_edge(cp, c, uses=((0, (slot, info.axis)),))
    g.nodes[c]["op"] = OpNode("reduction", o.dtype, o.axes, o.shape, fn="sum", name=o.name, reduced=(slot,),
                              reduced_shape=(COLUMN_SLOTS,), span=o.span)
    grp.nodes |= added | {cp}
    return c, o, edges, cp, added


def _undo_split(g: nx.DiGraph, grp: Group, rewrite: tuple) -> None:
    c, o, edges, cp, added = rewrite
    g.remove_node(cp)
    for u, uses in edges.items():
        g.add_edge(u, c, uses=uses)
    g.nodes[c]["op"] = o
    grp.nodes -= added | {cp}


def _refused(g: nx.DiGraph, ctx, grp: Group) -> str | None:
    """Why no backend would build this group as one kernel (None without an oracle to ask)."""
    if ctx is None or ctx.oracle is None:
        return None
    from .ir_build import candidate_ir
    return ctx.oracle.can_fuse(candidate_ir(g, grp, ctx.kernel, ctx.hints), ctx.archs)
