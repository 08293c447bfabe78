"""Cost model: FLOPs and modelled DRAM bytes per kernel plan, against the unfused graph (one kernel
per op).  Each kernel reads each of its inputs once and writes each of its outputs once."""
from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx

from .graph import op, operands
from .schedule import DTYPE_BYTES, Buffer, KernelSchedule

DEFAULT_SIZE = 1024


@dataclass(frozen=True)
class PlanCost:
    plan: str
    kind: str
    flops: int
    bytes_read: int
    bytes_written: int

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass(frozen=True)
class CostReport:
    sizes: dict
    plans: tuple[PlanCost, ...]
    unfused_kernels: int
    unfused_bytes: int
    unfused_flops: int

    @property
    def fused_bytes(self) -> int:
        return sum(p.bytes for p in self.plans)

    @property
    def fused_flops(self) -> int:
        return sum(p.flops for p in self.plans)

    @property
    def bytes_ratio(self) -> float:
        return self.fused_bytes / self.unfused_bytes if self.unfused_bytes else 1.0


def _extent(d, sizes: dict) -> int:
    return d if isinstance(d, int) else int(sizes.get(d, DEFAULT_SIZE))


def _numel(shape, sizes) -> int:
    return math.prod(_extent(d, sizes) for d in shape)


def _node_flops(g: nx.DiGraph, n, sizes) -> int:
    o = op(g, n)
    if o.kind == "contraction":
        return 2 * _numel(o.shape, sizes) * _numel(o.reduced_shape, sizes)
    if o.kind == "reduction":
        return _numel(o.shape, sizes) * _numel(o.reduced_shape, sizes)
    if o.kind == "softmax":
        return 5 * _numel(o.shape, sizes)
    if o.kind == "elementwise":
        return _numel(o.shape, sizes)
    return 0


def _buffer_bytes(b: Buffer, sizes) -> int:
    if b.kind == "param":
        return 0     # scalars are passed by value in the launch parameters, not read from DRAM
    return _numel(b.shape, sizes) * DTYPE_BYTES[b.dtype]


def _source(g, u):
    """Broadcasts and views are free in an unfused execution: read the value they expand."""
    while op(g, u).kind == "broadcast":
        (u, _), = operands(g, u)
    return u


def cost(sched: KernelSchedule, sizes: dict | None = None) -> CostReport:
    sizes = dict(sizes or {})
    for s in sched.kernel.symbols:
        sizes.setdefault(s, DEFAULT_SIZE)
    for s, v in sched.kernel.bindings:
        sizes[s] = v
    g = sched.graph
    plans = []
    for p in sched.plans:
        flops = sum(_node_flops(g, n, sizes) for n in p.group.nodes)
        rd = sum(_buffer_bytes(sched.buffers[b], sizes) for b in p.reads)
        wr = sum(_buffer_bytes(sched.buffers[b], sizes) for b in p.writes)
        plans.append(PlanCost(p.id, p.kind, flops, rd, wr))
    # unfused: every op (not a broadcast, constant or scalar-only expression) is one kernel
    n_kernels = ubytes = uflops = 0
    for n in nx.topological_sort(g):
        o = op(g, n)
        if o.kind in ("input", "param", "const", "output", "broadcast") or not o.axes:
            continue
        n_kernels += 1
        uflops += _node_flops(g, n, sizes)
        # each kernel reads each of its inputs once (x * x reads x once)
        for src in {_source(g, u): None for u, _ in operands(g, n)}:
            src = op(g, src)
            if src.kind in ("param", "const") or not src.axes:
                continue
            ubytes += _numel(src.shape, sizes) * DTYPE_BYTES[src.dtype]
        ubytes += _numel(o.shape, sizes) * DTYPE_BYTES[o.dtype]
    return CostReport(sizes, tuple(plans), n_kernels, ubytes, uflops)
