"""Scheduling: fused groups -> `KernelPlan`s in dependency order, with the buffers each reads and
writes, global intermediates with liveness (and buffer reuse), and per-arch tile/cluster/stages.

Tile heuristic (when the spec gives no `schedule` hint), by arch and operand width:
  sm90a  16-bit: 128x128x64 on a 2x1x1 cluster (TMA multicast of B across the pair)
         8-bit:  128x128x128;  tf32: 128x128x32
         M literal <= 64: tile M 64
  sm100a 16-bit: 256x128x64 on a 2x1x1 cluster (2-SM tcgen05 MMA); 8-bit 256x128x128; tf32 256x128x32
         M literal <= 128: tile M 128 on one SM (cluster 1x1x1)
  stages: None (the backend derives the deepest pipeline that fits shared memory)
Hints are taken as given (the checker bounded them); the backend validates every choice against
CUTLASS's configuration list for that arch and dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from kspec.spec_lang.check import CheckedKernel, DimValue, ScheduleHint, schedule_parts

from .canon import GemmInfo
from .fusion import FusionResult, Group
from .graph import op, operands

ARCHS = ("sm90a", "sm100a")
DTYPE_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "tf32": 4, "f8e4m3": 1, "f8e5m2": 1, "i8": 1, "i32": 4}


@dataclass(frozen=True)
class Buffer:
    name: str
    kind: str                     # input | output | param | intermediate
    dtype: str
    shape: tuple[DimValue, ...]
    layout: str = "row"
    node: object = None           # the graph node whose value it holds (None for inputs' graph nodes)

    def describe(self) -> str:
        shape = f"[{', '.join(map(str, self.shape))}]" if self.kind != "param" else ""
        return f"{self.name}: {self.dtype}{shape}" + (" col" if self.layout == "col" else "")


@dataclass(frozen=True)
class ArchConfig:
    tile: tuple[int, int, int] | None
    cluster: tuple[int, int, int] | None
    stages: int | None
    source: str                   # "hint" | "heuristic" | "n/a"

    def describe(self) -> str:
        if self.tile is None and self.cluster is None:
            return "default"
        return ", ".join(schedule_parts(self.tile, self.cluster, self.stages, " ")) + f" ({self.source})"


@dataclass
class KernelPlan:
    id: str
    kind: str                     # gemm | attention | elementwise | reduction | softmax | contraction
    group: Group
    reads: tuple[str, ...]        # buffer names
    writes: tuple[str, ...]
    configs: dict[str, ArchConfig] = field(default_factory=dict)

    @property
    def info(self):
        return self.group.info


@dataclass
class KernelSchedule:
    kernel: CheckedKernel
    graph: nx.DiGraph
    fusion: FusionResult
    plans: list[KernelPlan]
    buffers: dict[str, Buffer]
    value_buffer: dict[object, str]              # graph node -> buffer holding its value
    liveness: dict[str, tuple[int, int]]         # intermediate -> (first plan writing, last plan reading)
    reuse: dict[str, str]                        # intermediate -> storage slot name

    def stores(self, n) -> list[str]:
        return stores_of(self.graph, self.value_buffer, n)

    @property
    def intermediates(self) -> list[Buffer]:
        return [b for b in self.buffers.values() if b.kind == "intermediate"]


def stores_of(g: nx.DiGraph, value_buffer: dict, n) -> list[str]:
    """Every buffer node n's value is written to: its own buffer (if any) and each output it feeds."""
    out = [value_buffer[n]] if n in value_buffer else []
    for s in g.successors(n):
        so = op(g, s)
        if so.kind == "output" and so.name not in out:
            out.append(so.name)
    return out


def values_leaving(g: nx.DiGraph, grp: Group) -> list:
    """Nodes of the group whose value is needed outside it (by an output or another group)."""
    out = []
    for n in sorted(grp.nodes, key=lambda x: int(str(x)[1:])):
        if any(s not in grp.nodes for s in g.successors(n)):
            out.append(n)
    return out


def _heuristic(plan: KernelPlan, dtype: str, arch: str, g) -> ArchConfig:
    if plan.kind != "gemm":
        return ArchConfig(None, None, None, "n/a")
    width = DTYPE_BYTES.get(dtype, 2)
    k_tile = {1: 128, 2: 64, 4: 32}[width]
    anchor = op(g, plan.group.anchor)
    m_extent = dict(zip(anchor.axes, anchor.shape))[plan.info.m]
    small = isinstance(m_extent, int) and not getattr(plan.info, "m_fold", ())   # folded M: a product
    if arch == "sm90a":
        tile_m = 64 if small and m_extent <= 64 else 128
        return ArchConfig((tile_m, 128, k_tile), (2, 1, 1), None, "heuristic")
    if small and m_extent <= 128:
        return ArchConfig((128, 128, k_tile), (1, 1, 1), None, "heuristic")
    return ArchConfig((256, 128, k_tile), (2, 1, 1), None, "heuristic")


def _config(kernel: CheckedKernel, plan: KernelPlan, arch: str, g) -> ArchConfig:
    hint: ScheduleHint = kernel.schedule_for(arch)
    dtype = op(g, plan.info.a).dtype if isinstance(plan.info, GemmInfo) else ""
    base = _heuristic(plan, dtype, arch, g)
    if plan.kind not in ("gemm",) or not (hint.tile or hint.cluster or hint.stages):
        return base
    return ArchConfig(hint.tile or base.tile, hint.cluster or base.cluster, hint.stages, "hint")


def schedule(kernel: CheckedKernel, g: nx.DiGraph, fusion: FusionResult,
             archs: tuple[str, ...] = ARCHS) -> KernelSchedule:
    buffers: dict[str, Buffer] = {}
    value_buffer: dict = {}
    for n in nx.topological_sort(g):
        o = op(g, n)
        if o.kind in ("input", "param"):
            buffers[o.name] = Buffer(o.name, o.kind, o.dtype, o.shape, o.layout, n)
            value_buffer[n] = o.name
    # values stored by outputs
    for n in g.nodes:
        o = op(g, n)
        if o.kind == "output":
            (src, _), = operands(g, n)
            buffers[o.name] = Buffer(o.name, "output", o.dtype, o.shape, o.layout, src)
            # later kernels read a value from its output only when that holds it in the value's own
            # axis order (a col-layout or transposed output gets a row-major intermediate as well)
            if o.layout == "row" and tuple(operands(g, n)[0][1]) == op(g, src).axes:
                value_buffer.setdefault(src, o.name)
    plans: list[KernelPlan] = []
    for i, grp in enumerate(fusion.groups):
        writes = []
        for n in values_leaving(g, grp):
            read_later = any(s not in grp.nodes and op(g, s).kind != "output" for s in g.successors(n))
            if n not in value_buffer and read_later:
                o = op(g, n)
                name = _fresh(f"{o.name or 'tmp'}_{n}", buffers)
                buffers[name] = Buffer(name, "intermediate", o.dtype, o.shape, "row", n)
                value_buffer[n] = name
            for b in stores_of(g, value_buffer, n):
                if b not in writes:
                    writes.append(b)
        reads = []
        for n in sorted(grp.nodes, key=lambda x: int(str(x)[1:])):
            for u in g.predecessors(n):
                if u in grp.nodes or op(g, u).kind == "const":
                    continue
                b = value_buffer.get(u)
                if b is None:
                    # a value of an earlier group that stayed inside it cannot be read: fusion bug
                    from kspec.spec_lang.errors import KspecInternalError
                    raise KspecInternalError(f"plan {i} reads node {u}, which no kernel stores")
                if b not in reads:
                    reads.append(b)
        plan = KernelPlan(f"{kernel.name}_{i}", grp.kind, grp, tuple(reads), tuple(writes))
        plan.configs = {a: _config(kernel, plan, a, g) for a in archs}
        plans.append(plan)
    liveness = {}
    for b in buffers.values():
        if b.kind != "intermediate":
            continue
        first = min(i for i, p in enumerate(plans) if b.name in p.writes)
        last = max([i for i, p in enumerate(plans) if b.name in p.reads] or [first])
        liveness[b.name] = (first, last)
    reuse = _assign_slots(buffers, liveness)
    return KernelSchedule(kernel, g, fusion, plans, buffers, value_buffer, liveness, reuse)


def _fresh(name: str, taken) -> str:
    out, i = name, 1
    while out in taken:
        i += 1
        out = f"{name}_{i}"
    return out


def _assign_slots(buffers: dict[str, Buffer], liveness: dict[str, tuple[int, int]]) -> dict[str, str]:
    """Greedy interval colouring: an intermediate reuses the storage of one that is dead before it
    is first written and has the same dtype and shape."""
    slots: list[tuple[str, tuple, int]] = []          # (slot name, (dtype, shape), busy until plan)
    out: dict[str, str] = {}
    for name, (first, last) in sorted(liveness.items(), key=lambda kv: kv[1]):
        b = buffers[name]
        key = (b.dtype, b.shape)
        for i, (slot, skey, busy) in enumerate(slots):
            if skey == key and busy < first:
                slots[i] = (slot, skey, last)
                out[name] = slot
                break
        else:
            slots.append((name, key, last))
            out[name] = name
    return out
