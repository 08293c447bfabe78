"""Fused groups: the unit fusion passes build (a set of graph nodes that runs as one kernel), the
fusion result, and the legality rule every merge obeys.  Shared by compiler/fusion.py and the pass
modules it runs (compiler/rowwise.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from .graph import op


@dataclass
class Group:
    id: str
    kind: str                          # one of compiler/kir.py KINDS (gemm, attention, rowwise, colsum, ..)
    nodes: set
    anchor: object = None              # the GEMM contraction / attention's first contraction
    info: object = None                # GemmInfo / AttentionInfo

    def __repr__(self) -> str:
        return f"Group({self.id}, {self.kind}, {sorted(self.nodes, key=_node_order)})"


@dataclass
class FusionResult:
    groups: list[Group]
    notes: list[str] = field(default_factory=list)     # why things did not fuse
    # attentions (contraction -> softmax -> contraction) left as several kernels: (span of the
    # softmax, reason); `--strict` makes each an error
    unfused_attention: list = field(default_factory=list)

    def group_of(self, n) -> Group | None:
        for grp in self.groups:
            if n in grp.nodes:
                return grp
        return None


def _node_order(n) -> int:
    return int(str(n).lstrip("n")) if str(n).lstrip("n").isdigit() else 0


def same_point(g: nx.DiGraph, u, labels: tuple[str, ...]) -> bool:
    """A consumer reading u under `labels` reads u's value at its own iteration point (u's axes
    are named the same), so a fused kernel can pass the value in a register."""
    return tuple(labels) == op(g, u).axes or not op(g, u).axes


def legal_group(g: nx.DiGraph, nodes: set) -> str | None:
    """None if `nodes` can run as one kernel, else why not: no path may leave the group and come
    back (that would need another kernel in the middle of this one).

    Such a path runs through an outside node reachable from the group that reaches the group: it
    is found both forwards from the group's outside successors and backwards from its outside
    predecessors.  The two searches advance in turn and the first to finish answers, so a merge
    costs the smaller of the two regions (a long chain grows one node at a time in linear time)."""
    def search(step):
        frontier = [x for n in nodes for x in step(n) if x not in nodes]
        seen = set(frontier)
        while frontier:
            x = frontier.pop()
            for y in step(x):
                if y in nodes:
                    yield True
                    return
                if y not in seen:
                    seen.add(y)
                    frontier.append(y)
            yield None
        yield False

    forward, backward = search(g.successors), search(g.predecessors)
    while True:
        for s in (forward, backward):
            found = next(s)
            if found is True:
                return "fusing would create a cycle between kernels"
            if found is False:
                return None


CYCLE = "fusing would create a cycle between kernels"


def legal_addition(g: nx.DiGraph, base: set, added: set, order: dict, bounds: tuple[int, int],
                   witness: list | None = None) -> str | None:
    """legal_group(g, base | added) for a `base` that is already legal, in time that does not grow
    with `base`: a path that leaves the union and comes back must start or end in `added` (one
    from base to base would make base illegal), and it only passes nodes that lie, in the
    topological `order`, between the union's first and last node (`bounds`, the union's).
    witness: a list that receives the outside nodes of the path found when the answer is a cycle,
    nearest to `added` first (while none of them joins the group, adding `added` stays a cycle:
    base and bounds only grow; when one joins, the path up to it is still one if it keeps a node)."""
    lo, hi = bounds

    def hits(start, step, inside) -> bool:
        frontier = [x for n in added for x in step(n) if x not in base and x not in added and inside(x)]
        parent = dict.fromkeys(frontier)
        while frontier:
            x = frontier.pop()
            for y in step(x):
                if y in base or y in added:
                    if witness is not None:
                        while x is not None:
                            witness.append(x)
                            x = parent[x]
                        witness.reverse()
                    return True
                if y not in parent and inside(y):
                    parent[y] = x
                    frontier.append(y)
        return False

    if hits(added, g.successors, lambda x: order[x] < hi) or hits(added, g.predecessors, lambda x: order[x] > lo):
        return CYCLE
    return None
