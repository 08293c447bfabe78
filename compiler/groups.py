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
    kind: str                          # gemm | attention | elementwise | reduction | softmax | contraction
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
