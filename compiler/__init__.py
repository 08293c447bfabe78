"""Compiler: typed AST -> dataflow graph -> fused groups -> scheduled `KernelPlan`s.

    build_graph(kernel)            networkx.DiGraph, one node per tensor op   (graph.py)
    canonicalize(g)                copies, constants, CSE, dead code          (canon.py)
    fuse(g)                        FusionResult: groups + notes               (fusion.py)
    schedule(kernel, g, fusion)    KernelSchedule: plans, buffers, liveness   (schedule.py)
    cost(schedule, sizes)          CostReport: FLOPs, modelled DRAM bytes     (cost.py)
"""
from __future__ import annotations

from kspec.spec_lang.check import CheckedKernel

from .canon import GemmInfo, canonicalize, gemm_info
from .cost import CostReport, cost
from .fusion import AttentionInfo, FusionResult, Group, fuse
from .graph import OpNode, build_graph, op, operands, validate
from .schedule import ARCHS, ArchConfig, Buffer, KernelPlan, KernelSchedule, schedule, values_leaving


def plan_kernel(kernel: CheckedKernel, archs: tuple[str, ...] = ARCHS, attention_supported=None,
                fuse_ops: bool = True) -> KernelSchedule:
    """The whole compiler pipeline for one kernel.  attention_supported(graph, AttentionInfo) -> reason
    or None lets a backend veto fused attention (the unfused plan is used, with the reason noted).
    fuse_ops=False gives one kernel per op (the unfused baseline)."""
    g = build_graph(kernel)
    canonicalize(g)
    validate(g)
    fusion = fuse(g, attention_supported) if fuse_ops else unfused(g)
    return schedule(kernel, g, fusion, archs)


def unfused(g) -> FusionResult:
    """One group per operator node (constants and scalar expressions ride with their consumer)."""
    import networkx as nx

    from .fusion import _group_order, is_operator, is_scalar_expr
    res = FusionResult([])
    taken: set = set()
    for n in nx.topological_sort(g):
        o = op(g, n)
        if not is_operator(g, n) or o.kind == "const" or (is_scalar_expr(g, n) and n not in taken and
                                                          any(op(g, s).axes for s in g.successors(n))):
            continue
        if n in taken:
            continue
        if o.kind == "broadcast" and any(op(g, s).kind != "output" for s in g.successors(n)):
            continue    # a view: it rides with its consumer below, as the cost model's baseline assumes
        kind = "gemm" if o.kind == "contraction" and isinstance(gemm_info(g, n), GemmInfo) else \
            o.kind if o.kind in ("contraction", "reduction", "softmax") else "elementwise"
        nodes = {n} | {a for a in nx.ancestors(g, n) if is_scalar_expr(g, a) and is_operator(g, a)
                       and op(g, a).kind != "const" and a not in taken}
        taken |= nodes
        info = gemm_info(g, n) if kind == "gemm" else None
        res.groups.append(Group(f"g{len(res.groups)}", kind, nodes, n, info))
    for n in reversed(list(nx.topological_sort(g))):
        if op(g, n).kind == "broadcast" and n not in taken:
            consumer = next(s for s in sorted(g.successors(n), key=lambda s: int(str(s)[1:])) if op(g, s).kind != "output")
            grp = next(grp for grp in res.groups if consumer in grp.nodes)
            grp.nodes.add(n)
            taken.add(n)
    for grp in res.groups:
        for n in list(grp.nodes):
            for u in g.predecessors(n):
                if op(g, u).kind == "const" and u not in taken:
                    grp.nodes.add(u)
                    taken.add(u)
    res.groups = _group_order(g, res.groups)
    return res


__all__ = ["ARCHS", "ArchConfig", "AttentionInfo", "Buffer", "CostReport", "FusionResult", "GemmInfo", "Group",
           "KernelPlan", "KernelSchedule", "OpNode", "build_graph", "canonicalize", "cost", "fuse", "gemm_info",
           "op", "operands", "plan_kernel", "schedule", "unfused", "validate", "values_leaving"]
