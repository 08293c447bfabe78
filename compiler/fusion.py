"""Fusion passes: group graph nodes into kernels.

Each pass is a small function from the graph and the current groups to new groups:
  fuse_attention  contraction -> (scale) -> softmax over the contracted-out axis -> contraction
  fuse_epilogues  elementwise/broadcast/cast chains and row/column max/sum reductions after a GEMM
  fuse_elementwise  remaining elementwise chains over one iteration space
Every other op node becomes a group of its own.  `legal_group` guards every merge: the group must
not create a cycle between kernels.  Why a node could not join a group is kept in `FusionResult.notes`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import networkx as nx

from .canon import GemmInfo, gemm_info
from .graph import op, operands

OPERATOR_KINDS = ("contraction", "elementwise", "broadcast", "reduction", "softmax", "cast", "gather", "const")
EPILOGUE_FNS = {"add", "sub", "mul", "div", "neg", "maximum", "minimum", "relu", "gelu", "gelu_tanh", "silu",
                "sigmoid", "tanh", "exp", "abs", "clamp", "broadcast"}
EPILOGUE_REDUCTIONS = ("max", "sum")


@dataclass
class Group:
    id: str
    kind: str                          # gemm | attention | elementwise | reduction | softmax | contraction
    nodes: set
    anchor: object = None              # the GEMM contraction / attention's first contraction
    info: object = None                # GemmInfo / AttentionInfo

    def __repr__(self) -> str:
        return f"Group({self.id}, {self.kind}, {sorted(self.nodes, key=_node_order)})"


@dataclass(frozen=True)
class AttentionInfo:
    qk: str                            # first contraction
    softmax: str
    pv: str                            # second contraction
    scale: tuple                       # nodes applying the scale between qk and softmax
    q: str
    k: str
    v: str
    batch: tuple[str, ...]             # labels (b, h)
    query: str                         # i
    key: str                           # j
    head: str                          # e
    causal: bool


@dataclass
class FusionResult:
    groups: list[Group]
    notes: list[str] = field(default_factory=list)     # why things did not fuse

    def group_of(self, n) -> Group | None:
        for grp in self.groups:
            if n in grp.nodes:
                return grp
        return None


def _node_order(n) -> int:
    return int(str(n).lstrip("n")) if str(n).lstrip("n").isdigit() else 0


def is_operator(g: nx.DiGraph, n) -> bool:
    return op(g, n).kind in OPERATOR_KINDS


def is_scalar_expr(g: nx.DiGraph, n) -> bool:
    """n is a scalar computed only from params and constants (evaluated per kernel, not per element)."""
    o = op(g, n)
    if o.kind in ("param", "const"):
        return True
    return o.kind in ("elementwise", "cast") and not o.axes and \
        all(is_scalar_expr(g, u) for u in g.predecessors(n))


def same_point(g: nx.DiGraph, u, labels: tuple[str, ...]) -> bool:
    """A consumer reading u under `labels` reads u's value at its own iteration point (u's axes
    are named the same), so a fused kernel can pass the value in a register."""
    return tuple(labels) == op(g, u).axes or not op(g, u).axes


def legal_group(g: nx.DiGraph, nodes: set) -> str | None:
    """None if `nodes` can run as one kernel, else why not: no path may leave the group and come
    back (that would need another kernel in the middle of this one)."""
    outside_desc: set = set()
    for n in nodes:
        for s in g.successors(n):
            if s not in nodes:
                outside_desc.add(s)
                outside_desc |= nx.descendants(g, s)
    back = outside_desc & nodes
    if back:
        return "fusing would create a cycle between kernels"
    return None


def _consumers(g, n) -> list:
    return list(g.successors(n))


def _scaled_value(g: nx.DiGraph, n):
    """If n multiplies a tensor by a scalar param/const (or divides it by one), that tensor's node."""
    o = op(g, n)
    if o.kind != "elementwise" or o.fn not in ("mul", "div"):
        return None
    ins = operands(g, n)
    scalars = [u for u, _ in ins if op(g, u).kind in ("param", "const")]
    tensors = [u for u, _ in ins if op(g, u).kind not in ("param", "const")]
    if len(ins) != 2 or len(scalars) != 1 or len(tensors) != 1:
        return None
    if o.fn == "div" and ins[0][0] != tensors[0]:
        return None
    return tensors[0]


def fuse_attention(g: nx.DiGraph, res: FusionResult,
                   supported: Callable[[nx.DiGraph, AttentionInfo], str | None] | None = None) -> None:
    """contraction(e) -> [scale] -> softmax(j) -> contraction(j) becomes one attention group."""
    for sm in [n for n in nx.topological_sort(g) if op(g, n).kind == "softmax"]:
        o = op(g, sm)
        axis = o.fn
        ((prev, _),) = operands(g, sm)
        scale: list = []
        chain = prev
        while (tensor := _scaled_value(g, chain)) is not None:
            scale.append(chain)
            chain = tensor
        qk = chain
        if op(g, qk).kind != "contraction":
            continue
        consumers = _consumers(g, sm)
        if len(consumers) != 1 or op(g, consumers[0]).kind != "contraction":
            res.notes.append(f"softmax {sm}: not attention (its result is not consumed by one contraction)")
            continue
        pv = consumers[0]
        po = op(g, pv)
        if po.reduced != (axis,):
            res.notes.append(f"softmax {sm}: not attention (the second contraction does not reduce over '{axis}')")
            continue
        multi = [n for n in [qk, *scale, sm] if len(_consumers(g, n)) != 1 or
                 any(op(g, c).kind == "output" for c in _consumers(g, n))]
        if multi:
            res.notes.append(f"attention at {sm}: not fused: the score matrix ({op(g, multi[0]).name or multi[0]}) "
                             "is used elsewhere, so it must be written to memory")
            continue
        qo = op(g, qk)
        if len(qo.reduced) != 1 or len(qo.axes) < 2 or qo.axes[-1] != axis:
            res.notes.append(f"attention at {sm}: not fused: scores must be [batch.., i, j] with one head index")
            continue
        query, head = qo.axes[-2], qo.reduced[0]
        batch = qo.axes[:-2]
        (uq, lq), (uk, lk) = operands(g, qk)
        if axis in lq:
            (uq, lq), (uk, lk) = (uk, lk), (uq, lq)
        (up, lp), (uv, lv) = operands(g, pv)
        if up != sm:
            (up, lp), (uv, lv) = (uv, lv), (up, lp)
        shapes_ok = (lq == (*batch, query, head) and lk == (*batch, axis, head) and lv == (*batch, axis, head)
                     and po.axes == (*batch, query, head))
        if not shapes_ok:
            res.notes.append(f"attention at {sm}: not fused: Q, K, V and O must be [batch.., seq, head] "
                             f"(got Q{list(lq)}, K{list(lk)}, V{list(lv)}, O{list(po.axes)})")
            continue
        info = AttentionInfo(qk, sm, pv, tuple(scale), uq, uk, uv, tuple(batch), query, axis, head,
                             o.causal == query)
        if o.causal is not None and o.causal != query:
            res.notes.append(f"attention at {sm}: not fused: causal index '{o.causal}' is not the query index")
            continue
        why = supported(g, info) if supported else None
        if why:
            res.notes.append(f"attention at {sm}: not fused ({why}); using the unfused plan")
            continue
        nodes = {qk, sm, pv, *scale}
        # the output cast after PV belongs to the kernel too
        for c in _consumers(g, pv):
            if op(g, c).kind == "cast" and len(_consumers(g, pv)) == 1:
                nodes.add(c)
        if legal_group(g, nodes):
            res.notes.append(f"attention at {sm}: not fused: {legal_group(g, nodes)}")
            continue
        res.groups.append(Group(f"g{len(res.groups)}", "attention", nodes, qk, info))


def _is_full(g, n, gi: GemmInfo, gemm_axes: set) -> bool:
    return set(op(g, n).axes) == gemm_axes


def fuse_epilogues(g: nx.DiGraph, res: FusionResult) -> None:
    """Grow each GEMM's group over the elementwise ops and row/column reductions that consume it."""
    for c in nx.topological_sort(g):
        if op(g, c).kind != "contraction" or res.group_of(c):
            continue
        gi = gemm_info(g, c)
        if isinstance(gi, str):
            res.notes.append(f"contraction {c}: not a GEMM ({gi}); it runs as a separate generic kernel")
            continue
        group = {c}
        axes = set(op(g, c).axes)
        changed = True
        while changed:
            changed = False
            candidates = sorted({s for n in group for s in g.successors(n)} - group, key=_node_order)
            for s in candidates:
                so = op(g, s)
                if so.kind == "output" or res.group_of(s):
                    continue
                why = _epilogue_reject(g, s, group, gi, axes)
                if why:
                    note = f"{so.label()} not fused into the GEMM at {c}: {why}"
                    if note not in res.notes:
                        res.notes.append(note)
                    continue
                trial = group | {s}
                # producers of s from outside must be inputs/params/consts or broadcasts of those
                if legal_group(g, trial):
                    res.notes.append(f"{so.label()} not fused into the GEMM at {c}: {legal_group(g, trial)}")
                    continue
                group = trial | {a for a in nx.ancestors(g, s) if is_scalar_expr(g, a) and is_operator(g, a)}
                changed = True
        # broadcasts feeding the group from inputs are loads of the epilogue
        for n in list(group):
            for u in g.predecessors(n):
                uo = op(g, u)
                if uo.kind == "broadcast" and u not in group and not res.group_of(u):
                    (src, _), = operands(g, u)
                    if op(g, src).kind == "input" and legal_group(g, group | {u}) is None:
                        group.add(u)
        res.groups.append(Group(f"g{len(res.groups)}", "gemm", group, c, gi))


def _epilogue_reject(g, s, group: set, gi: GemmInfo, gemm_axes: set) -> str | None:
    so = op(g, s)
    if so.kind == "reduction":
        if so.fn not in EPILOGUE_REDUCTIONS:
            return f"'{so.fn}' reductions are not fused into epilogues (only max and sum)"
        ((src, labels),) = operands(g, s)
        if set(labels) != gemm_axes:
            return "the reduction's operand is not the full GEMM result"
        if len(so.reduced) != 1 or so.reduced[0] not in (gi.m, gi.n) or \
                labels.index(so.reduced[0]) < len(labels) - 2:
            return "an epilogue reduction must reduce over the GEMM's row or column axis"
        return None
    if so.kind not in ("elementwise", "broadcast", "cast"):
        return f"{so.kind} ops cannot be fused into an epilogue"
    if so.kind == "elementwise" and so.fn not in EPILOGUE_FNS:
        return f"'{so.fn}' has no epilogue implementation"
    if set(so.axes) != gemm_axes:
        return f"its iteration space [{', '.join(so.axes)}] differs from the GEMM's"
    for u, labels in operands(g, s):
        if u in group:
            if op(g, u).kind == "reduction":
                return "it consumes an epilogue reduction, which is only complete after the kernel"
            if not same_point(g, u, labels):
                return f"it reads {op(g, u).name or u} at another element (a transposed or permuted read)"
            continue
        uo = op(g, u)
        if is_scalar_expr(g, u):
            continue
        if uo.kind == "broadcast":
            (src, slabels), = operands(g, u)
            # (a per-batch vector, e.g. s[b], has no epilogue load: the backend loads rows/columns)
            if op(g, src).kind == "input" and len(slabels) == 1 and slabels[0] in (gi.m, gi.n):
                continue
            return "it broadcasts a value that is not a row or column vector input"
        if set(labels) == gemm_axes and tuple(labels[-2:]) == (gi.m, gi.n):
            if uo.kind == "input" and uo.layout == "col":
                return f"operand {uo.name} is column-major; an epilogue reads full tensors row-major"
            continue  # a full tensor (e.g. a residual) read row-major
        return f"operand {uo.name or u} is not a row/column vector, scalar or full [m, n] tensor"
    return None


def fuse_elementwise(g: nx.DiGraph, res: FusionResult) -> None:
    """Group remaining elementwise/broadcast/cast nodes that share one iteration space."""
    for n in nx.topological_sort(g):
        o = op(g, n)
        if o.kind not in ("elementwise", "broadcast", "cast") or res.group_of(n):
            continue
        merged = None
        candidates: list[Group] = []
        for u, labels in operands(g, n):
            grp = res.group_of(u)
            if grp is not None and grp.kind == "elementwise" and set(op(g, grp.anchor).axes) == set(o.axes) \
                    and grp not in candidates and same_point(g, u, labels):
                candidates.append(grp)
        for grp in candidates:
            # n joins its producers' groups; where it reads several (e.g. a chain and a broadcast
            # of an input), they become one kernel when that is legal
            if merged is None:
                if legal_group(g, grp.nodes | {n}) is None:
                    merged = grp
            elif legal_group(g, merged.nodes | grp.nodes | {n}) is None:
                merged.nodes |= grp.nodes
                res.groups.remove(grp)
                for i, other in enumerate(res.groups):
                    other.id = f"g{i}"      # ids stay unique for groups created later
        if merged is not None:
            merged.nodes.add(n)
            merged.anchor = n
        else:
            res.groups.append(Group(f"g{len(res.groups)}", "elementwise", {n}, n))


def fuse_reduction_prologues(g: nx.DiGraph, res: FusionResult) -> None:
    """A standalone reduction or softmax absorbs the elementwise kernel that computes its operand
    (e.g. `mean(c) f32(x[n, c])`), recomputing it per element inside its loops, when nothing else
    needs that kernel's values."""
    for grp in [x for x in res.groups if x.kind in ("reduction", "softmax")]:
        (r,) = grp.nodes
        ((u, labels),) = operands(g, r)
        prologue = res.group_of(u)
        if prologue is None or prologue.kind != "elementwise" or not same_point(g, u, labels):
            continue
        if any(s not in prologue.nodes and s != r for n in prologue.nodes for s in g.successors(n)):
            res.notes.append(f"{op(g, r).label()}: its operand's kernel is not fused in: other kernels "
                             "read its values too")
            continue
        if any(set(op(g, n).axes) - set(op(g, u).axes) for n in prologue.nodes):
            continue
        merged = prologue.nodes | {r}
        if legal_group(g, merged):
            continue
        grp.nodes = merged
        res.groups.remove(prologue)


def fuse_softmax_epilogues(g: nx.DiGraph, res: FusionResult) -> None:
    """A standalone softmax absorbs the elementwise kernels that consume its result element by
    element over the same axes (e.g. the cast to a f16 output), so the probabilities are stored once."""
    for grp in [x for x in res.groups if x.kind == "softmax"]:
        sm = next(n for n in grp.nodes if op(g, n).kind == "softmax")
        axes = set(op(g, sm).axes)
        changed = True
        while changed:
            changed = False
            for s in sorted({c for n in grp.nodes for c in g.successors(n)} - grp.nodes, key=_node_order):
                other = res.group_of(s)
                if other is None or other.kind != "elementwise":
                    continue
                if any(set(op(g, n).axes) != axes for n in other.nodes if op(g, n).kind != "const"):
                    continue
                reads = [(u, l) for n in other.nodes for u, l in operands(g, n) if u in grp.nodes]
                if not all(same_point(g, u, l) for u, l in reads):
                    continue
                merged = grp.nodes | other.nodes
                if legal_group(g, merged):
                    continue
                grp.nodes = merged
                res.groups.remove(other)
                changed = True
                break


def fuse(g: nx.DiGraph, attention_supported=None) -> FusionResult:
    """Run every fusion pass; every operator node ends in exactly one group, in topological order."""
    res = FusionResult([])
    fuse_attention(g, res, attention_supported)
    fuse_epilogues(g, res)
    from .rowwise import fuse_rowwise      # row reductions, softmax, norms: one kernel per row chain
    fuse_rowwise(g, res)
    fuse_elementwise(g, res)
    for n in nx.topological_sort(g):
        o = op(g, n)
        if o.kind in ("contraction", "reduction", "softmax") and not res.group_of(n):
            res.groups.append(Group(f"g{len(res.groups)}", o.kind, {n}, n))
    fuse_reduction_prologues(g, res)
    fuse_softmax_epilogues(g, res)
    # constants are folded into whichever kernel reads them
    for n in g.nodes:
        if op(g, n).kind == "const":
            for s in g.successors(n):
                grp = res.group_of(s)
                if grp is not None:
                    grp.nodes.add(n)
                    break
    order = _group_order(g, res.groups)
    for i, grp in enumerate(order):
        grp.id = f"g{i}"
    res.groups = order
    return res


def quotient(g: nx.DiGraph, groups: list[Group]) -> nx.DiGraph:
    """The kernel graph: one node per group, an edge where one group reads another's value."""
    where = {n: grp.id for grp in groups for n in grp.nodes}
    q = nx.DiGraph()
    for grp in groups:
        q.add_node(grp.id)
    for u, v in g.edges:
        gu, gv = where.get(u), where.get(v)
        if gu and gv and gu != gv:
            q.add_edge(gu, gv)
    return q


def _group_order(g: nx.DiGraph, groups: list[Group]) -> list[Group]:
    by_id = {grp.id: grp for grp in groups}
    q = quotient(g, groups)
    if not nx.is_directed_acyclic_graph(q):
        from kspec.spec_lang.errors import KspecInternalError
        raise KspecInternalError("fusion produced a cycle between kernels")
    return [by_id[i] for i in nx.lexicographical_topological_sort(q, key=lambda i: min(
        _node_order(n) for n in by_id[i].nodes))]
