"""Scheduling: fused groups -> `KernelPlan`s in dependency order, with the buffers each reads and
writes, global intermediates with liveness (and buffer reuse), each plan's `KernelIR`, and, when
an oracle (backends.registry.Planner) is given, the backend that builds it on each arch.

Tile, cluster and stage choices belong to the backends (their `default_config`); the spec's
`schedule` hints travel in the IR.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from kspec.core import ARCHS, KspecInternalError
from kspec.spec_lang.check import CheckedKernel, DimValue

from .fusion import FusionResult, Group
from .graph import op, operands
from .ir_build import build_ir
from .kir import ArchHint, BackendChoice, IRBuffer, KernelIR, verify

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


@dataclass
class KernelPlan:
    id: str
    kind: str                     # one of compiler/kir.py KINDS (gemm, attention, rowwise, colsum, ..)
    group: Group
    reads: tuple[str, ...]        # buffer names
    writes: tuple[str, ...]
    ir: KernelIR | None = None
    choices: dict[str, BackendChoice] = field(default_factory=dict)     # arch -> backend choice

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


def schedule_hints(kernel: CheckedKernel, archs) -> tuple[tuple[str, ArchHint], ...]:
    """The spec's schedule hint per arch, as the kernel IR carries it (computed once per kernel by
    `plan_kernel`: fusion's candidate kernels and the scheduled ones carry the same hints)."""
    out = []
    for arch in archs:
        h = kernel.schedule_for(arch)
        out.append((arch, ArchHint(h.tile, h.cluster, h.stages, h.backend, h.spans)))
    return tuple(out)


def schedule(kernel: CheckedKernel, g: nx.DiGraph, fusion: FusionResult,
             archs: tuple[str, ...] = ARCHS, oracle=None, hints=None) -> KernelSchedule:
    """hints: `schedule_hints(kernel, archs)`, as fusion saw them (computed here when not given)."""
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
                    raise KspecInternalError(f"plan {i} reads node {u}, which no kernel stores")
                if b not in reads:
                    reads.append(b)
        plans.append(KernelPlan(f"{kernel.name}_{i}", grp.kind, grp, tuple(reads), tuple(writes)))
    liveness = {}
    for b in buffers.values():
        if b.kind != "intermediate":
            continue
        first = min(i for i, p in enumerate(plans) if b.name in p.writes)
        last = max([i for i, p in enumerate(plans) if b.name in p.reads] or [first])
        liveness[b.name] = (first, last)
    reuse = _assign_slots(buffers, liveness)
    sched = KernelSchedule(kernel, g, fusion, plans, buffers, value_buffer, liveness, reuse)
    if hints is None:
        hints = schedule_hints(kernel, archs)
    for plan in plans:
        plan.ir = verify(plan_ir(sched, plan, hints))
        if oracle is not None:
            plan.choices = {a: oracle.choose(plan.ir, a) for a in archs}
    return sched


def plan_ir(sched: "KernelSchedule", plan: "KernelPlan", hints=()) -> KernelIR:
    """The plan as a self-contained kernel IR, buffers named as the schedule names them."""
    g = sched.graph

    packed = {t.name: t.packed for t in sched.kernel.tensors if t.packed}

    def info(name: str) -> IRBuffer:
        b = sched.buffers[name]
        role = b.kind
        return IRBuffer(b.name, role, b.dtype, () if role == "param" else tuple(b.shape), b.layout,
                        packed=packed.get(b.name) if role in ("input", "output") else None)

    stores = [(n, b) for n in values_leaving(g, plan.group) for b in sched.stores(n)]
    return build_ir(plan.id, sched.kernel.name, g, plan.group, lambda u: sched.value_buffer[u], info, stores, hints)


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
