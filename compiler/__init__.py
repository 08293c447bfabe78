"""Compiler: typed AST -> dataflow graph -> fused groups -> scheduled `KernelPlan`s, each with its
`KernelIR` (kir.py), the contract with the backends.

    build_graph(kernel)            networkx.DiGraph, one node per tensor op   (graph.py)
    canonicalize(g)                copies, constants, CSE, dead code          (canon.py)
    fuse(g)                        FusionResult: groups + notes               (fusion.py)
    schedule(kernel, g, fusion)    KernelSchedule: plans, buffers, liveness   (schedule.py)
    cost(schedule, sizes)          CostReport: FLOPs, modelled DRAM bytes     (cost.py)
"""
from __future__ import annotations

from kspec.spec_lang.check import CheckedKernel

from kspec.core import ARCHS, KspecError

from .canon import GemmInfo, canonicalize, gemm_info
from .cost import CostReport, cost
from .fusion import AttentionInfo, FusionContext, FusionResult, Group, fuse
from .graph import OpNode, build_graph, op, operands, validate
from .kir import BackendChoice, KernelIR, Oracle, format_ir, ir_from_json, ir_to_json, verify
from .schedule import Buffer, KernelPlan, KernelSchedule, schedule, schedule_hints, values_leaving


def plan_kernel(kernel: CheckedKernel, archs: tuple[str, ...] = ARCHS, oracle: Oracle | None = None,
                fuse_ops: bool = True) -> KernelSchedule:
    """The whole compiler pipeline for one kernel.  oracle (backends.registry.Planner) answers what
    the backends can implement: which epilogue ops fuse, whether a fused attention kernel exists,
    and which backend builds each kernel on each arch.  Without one, fusion is purely structural
    and no backend is chosen.  fuse_ops=False gives one kernel per op (the unfused baseline)."""
    g = build_graph(kernel)
    canonicalize(g)
    validate(g)
    hints = schedule_hints(kernel, archs)       # once: the candidates fusion asks about carry the same
    fusion = fuse(g, FusionContext(oracle, tuple(archs), kernel.name, hints)) if fuse_ops else unfused(g)
    if fusion.unfused_attention and getattr(oracle, "strict", False):
        span, why = fusion.unfused_attention[0]
        raise KspecError(f"kernel {kernel.name}: this attention is not fused into one kernel: {why}", span,
                         "--strict forbids unfused attention (see `kspec graph` for the plan); change the spec, "
                         "or drop --strict")
    return schedule(kernel, g, fusion, archs, oracle, hints)


def unfused(g) -> FusionResult:
    """One group per operator node (constants and scalar expressions ride with their consumer)."""
    import networkx as nx

    from .canon import is_recomputed
    from .fusion import _group_order, is_operator, is_scalar_expr
    res = FusionResult([])
    taken: set = set()
    for n in nx.topological_sort(g):
        o = op(g, n)
        if not is_operator(g, n) or o.kind in ("const", "index", "size") or (is_scalar_expr(g, n) and n not in taken and
                                                          any(op(g, s).axes for s in g.successors(n))):
            continue
        if is_recomputed(g, n) and not any(op(g, s).kind == "output" for s in g.successors(n)):
            continue    # index arithmetic and conditions ride with the op that reads them
        if n in taken:
            continue
        if o.kind == "broadcast" and any(op(g, s).kind != "output" for s in g.successors(n)):
            continue    # a view: it rides with its consumer below, as the cost model's baseline assumes
        kind = "gemm" if o.kind == "contraction" and isinstance(gemm_info(g, n), GemmInfo) else \
            o.kind if o.kind in ("contraction", "reduction", "softmax") else "elementwise"
        nodes = {n} | {a for a in nx.ancestors(g, n) if (is_scalar_expr(g, a) or is_recomputed(g, a)) and
                       is_operator(g, a) and op(g, a).kind != "const" and a not in taken}
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
                if op(g, u).kind in ("const", "index", "size") and u not in taken:
                    grp.nodes.add(u)
                    taken.add(u)
    res.groups = _group_order(g, res.groups)
    return res


__all__ = ["ARCHS", "AttentionInfo", "BackendChoice", "Buffer", "CostReport", "FusionContext", "FusionResult",
           "GemmInfo", "Group", "KernelIR", "KernelPlan", "KernelSchedule", "OpNode", "Oracle", "build_graph",
           "canonicalize", "cost", "format_ir", "fuse", "gemm_info", "ir_from_json", "ir_to_json", "op", "operands",
           "plan_kernel", "schedule", "schedule_hints", "unfused", "validate", "values_leaving", "verify"]
