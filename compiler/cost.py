"""Cost model: FLOPs and modelled DRAM bytes per kernel plan, against the ideal and the unfused graph.

Modelled bytes.  A tiled kernel (a tensor-core GEMM, fused attention) streams each buffer it reads once
and writes each output once.  A loop kernel (the generic backend: one thread per output element, or
per row for a softmax) re-reads: a value loaded at a loop point is fetched once per point of the
kernel's iteration space (threads times the trip count of the reduction or softmax loop around the
load) that does not index it, and a softmax's operand once per pass (three: max, sum, store).  A
buffer of at most `L2_RESIDENT_BYTES` stays in L2 and is fetched from DRAM once, however often it is
re-read.  Writes are counted once.

Ideal bytes.  Per kernel: each buffer it touches read or written once.  Per spec (`minimum_bytes`):
each spec input the computation reads read once and each output written once, with no
intermediate at all (an input nothing reads, such as a backward's copy of a forward output it
recomputes instead, costs nothing).
Unfused: one kernel per op, each reading its operands once (views and scalars free).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx

from kspec.core import split_offset_dim, split_quotient_dim

from .canon import block_scale_nodes, is_recomputed, tensor_bytes
from .graph import op, operands
from .schedule import Buffer, KernelSchedule

DEFAULT_SIZE = 1024
L2_RESIDENT_BYTES = 24 * 2 ** 20   # about half the L2 of an H100 (50 MB)
TILED_KINDS = ("gemm", "attention", "rowwise", "colsum")


@dataclass(frozen=True)
class PlanCost:
    plan: str
    kind: str
    flops: int
    bytes_read: int                    # modelled (re-reads of a loop kernel included)
    bytes_written: int
    ideal_read: int | None = None      # each buffer read once (None: the same as bytes_read)
    tiled: bool = True                 # False: a loop kernel, whose re-reads are modelled

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def ideal_bytes(self) -> int:
        return (self.bytes_read if self.ideal_read is None else self.ideal_read) + self.bytes_written

    @property
    def ratio(self) -> float:
        return self.bytes / self.ideal_bytes if self.ideal_bytes else 1.0


@dataclass(frozen=True)
class CostReport:
    sizes: dict
    plans: tuple[PlanCost, ...]
    unfused_kernels: int
    unfused_bytes: int
    unfused_flops: int
    minimum_bytes: int = 0             # spec inputs read once, outputs written once

    @property
    def fused_bytes(self) -> int:
        return sum(p.bytes for p in self.plans)

    @property
    def ideal_bytes(self) -> int:
        return sum(p.ideal_bytes for p in self.plans)

    @property
    def ideal_ratio(self) -> float:
        return self.fused_bytes / self.ideal_bytes if self.ideal_bytes else 1.0

    @property
    def fused_flops(self) -> int:
        return sum(p.flops for p in self.plans)

    @property
    def bytes_ratio(self) -> float:
        return self.fused_bytes / self.unfused_bytes if self.unfused_bytes else 1.0


def _extent(d, sizes: dict) -> int:
    if isinstance(d, tuple):            # a product extent (a paged key axis: pages * page size)
        return math.prod(_extent(x, sizes) for x in d)
    off = split_offset_dim(d)
    if off is not None and d not in sizes:   # `B+1` offsets
        return _extent(off[0], sizes) + off[1]
    quo = split_quotient_dim(d)
    if quo is not None and d not in sizes:   # `K/32` block scales
        return max(1, _extent(quo[0], sizes) // quo[1])
    return d if isinstance(d, int) else int(sizes.get(d, DEFAULT_SIZE))


def _numel(shape, sizes) -> int:
    return math.prod(_extent(d, sizes) for d in shape)


def _node_flops(g: nx.DiGraph, n, sizes) -> int:
    o = op(g, n)
    if o.kind == "contraction":
        return 2 * _numel(o.shape, sizes) * _numel(o.reduced_shape, sizes)
    if o.kind == "reduction":
        return _numel(o.shape, sizes) * _numel(o.reduced_shape, sizes)
    if o.kind == "partial":    # column partials [slot, n]: the slots split the rows, so each row once
        return len(operands(g, n)) * _numel(o.shape[1:], sizes) * _numel(o.reduced_shape, sizes)
    if o.kind == "softmax":
        return 5 * _numel(o.shape, sizes)
    if o.kind == "elementwise":
        return _numel(o.shape, sizes)
    return 0


def _buffer_bytes(b: Buffer, sizes) -> int:
    if b.kind == "param":
        return 0     # scalars are passed by value in the launch parameters, not read from DRAM
    return tensor_bytes(b.dtype, _numel(b.shape, sizes))


def _source(g, u):
    """Broadcasts and views are free in an unfused execution: read the value they expand."""
    while op(g, u).kind == "broadcast":
        (u, _), = operands(g, u)
    return u


def _read_sources(g, u, memo: dict | None = None) -> list:
    """The values in memory a kernel reads for operand u: u itself, through broadcasts, or what the
    index arithmetic and conditions it recomputes read (memo: canon.is_recomputed's, graph unchanged)."""
    u = _source(g, u)
    if not is_recomputed(g, u, memo):
        return [u]
    return [x for w in g.predecessors(u) for x in _read_sources(g, w, memo)]


def _loop_reads(sched: KernelSchedule, plan, sizes) -> dict[str, int]:
    """Modelled bytes a loop kernel reads, per buffer (the generic backend's loop structure)."""
    g = sched.graph
    grp = plan.group.nodes
    nodes = [n for n in nx.topological_sort(g.subgraph(grp)) if op(g, n).kind != "const"]
    if not nodes:
        return {}
    ext: dict[str, object] = {}
    for n in nodes:
        o = op(g, n)
        ext.update(zip(o.axes, o.shape))
        ext.update(zip(o.reduced, o.reduced_shape))
    leaving = [n for n in nodes if any(s not in grp for s in g.successors(n))]
    loops = [n for n in nodes if op(g, n).kind in ("softmax", "reduction")]
    root = loops[0] if loops else (leaving[-1] if leaving else nodes[-1])
    ro = op(g, root)
    space = set(ro.axes)
    passes = 1
    inner = set()                     # nodes evaluated inside the loop of `root`
    loop_axes: set = set()
    if loops and ro.kind == "softmax":
        loop_axes, passes = {ro.fn}, 3
        space -= loop_axes
        after = nx.descendants(g, root) & set(nodes)
        inner = set(nodes) - after
    elif loops:
        loop_axes = set(ro.reduced)
        inner = set(nodes)

    reads: dict[str, int] = {}
    for n in nodes:
        o = op(g, n)
        domain = set(space)
        times = 1
        if n in inner:
            domain |= loop_axes
            times = passes
        elif loops and ro.kind == "softmax":
            domain |= loop_axes            # the softmax's consumers run in its last pass
        if o.kind in ("contraction", "reduction") and not (n in inner and n == root):
            domain |= set(o.reduced)
        if n == root and o.kind == "reduction":
            domain |= set(o.reduced)
        for u, labels in operands(g, n):
            if u in grp or op(g, u).kind in ("param", "const"):
                continue
            b = sched.buffers[sched.value_buffer[u]]
            size = _buffer_bytes(b, sizes)
            factor = times * math.prod(_extent(ext.get(d, DEFAULT_SIZE), sizes) for d in domain - set(labels))
            reads[b.name] = reads.get(b.name, 0) + (size if size <= L2_RESIDENT_BYTES else size * factor)
    return reads


def cost(sched: KernelSchedule, sizes: dict | None = None, tiled=None) -> CostReport:
    """The cost report of a schedule at `sizes` (symbols not given default to DEFAULT_SIZE).
    tiled(plan) -> bool says which plans run as tiled kernels; by default a plan whose backend was
    chosen runs tiled unless it is a loop-kernel fallback on some arch, and an unplanned one (no
    backend chosen) when it is a GEMM or attention plan."""
    sizes = dict(sizes or {})
    for s in sched.kernel.symbols:
        sizes.setdefault(s, DEFAULT_SIZE)
    for s, v in sched.kernel.bindings:
        sizes[s] = v
    g = sched.graph
    plans = []
    for p in sched.plans:
        # a block-scaled GEMM's product nodes are the MMA's operands, not [M, K, N] elementwise work
        inside = block_scale_nodes(g, p.group.info) if p.kind == "gemm" and p.group.info is not None else set()
        flops = sum(_node_flops(g, n, sizes) for n in p.group.nodes if n not in inside)
        ideal = sum(_buffer_bytes(sched.buffers[b], sizes) for b in p.reads)
        wr = sum(_buffer_bytes(sched.buffers[b], sizes) for b in p.writes)
        if tiled is not None:
            is_tiled = tiled(p)
        elif p.choices:
            is_tiled = not any(ch.fallback for ch in p.choices.values())
        else:
            is_tiled = p.kind in TILED_KINDS
        if is_tiled:
            plans.append(PlanCost(p.id, p.kind, flops, ideal, wr, ideal, True))
        else:
            loop = _loop_reads(sched, p, sizes)
            rd = sum(max(loop.get(b, 0), _buffer_bytes(sched.buffers[b], sizes)) for b in p.reads)
            plans.append(PlanCost(p.id, p.kind, flops, rd, wr, ideal, False))
    offsets = {op(g, n).packed for n in g.nodes}          # a packed tensor's offsets are read by its kernels
    unread = {op(g, n).name for n in g.nodes
              if op(g, n).kind == "input" and not g.out_degree(n) and op(g, n).name not in offsets}
    minimum = sum(_buffer_bytes(b, sizes) for b in sched.buffers.values()
                  if b.kind == "output" or (b.kind == "input" and b.name not in unread))
    # unfused: every op (not a constant, a scalar-only expression or a broadcast no output stores) is
    # one kernel (a reduction to a scalar is one)
    n_kernels = ubytes = uflops = 0
    memo: dict = {}
    for n in nx.topological_sort(g):
        o = op(g, n)
        if o.kind in ("input", "param", "const", "output") or (not o.axes and o.kind != "reduction"):
            continue
        if o.kind == "broadcast" and not any(op(g, v).kind == "output" for v in g.successors(n)):
            continue            # a broadcast is read where it is needed, unless an output stores it
        if any(op(g, u).kind == "partial" for u in g.predecessors(n)):
            continue            # column partials: the sum over the rows, counted at its partial node
        uflops += _node_flops(g, n, sizes)
        if is_recomputed(g, n, memo):
            continue            # index arithmetic and conditions are computed by the kernel that reads them
        n_kernels += 1
        # each kernel reads each of its inputs once (x * x reads x once)
        for node in {x: None for u, _ in operands(g, n) for x in _read_sources(g, u, memo)}:
            src = op(g, node)
            if src.kind in ("param", "const") or (not src.axes and src.kind != "reduction"):
                continue
            ubytes += tensor_bytes(src.dtype, _numel(src.shape, sizes))
        # (a column partial stands for the sum over the rows it was made from: an [n] result)
        ubytes += tensor_bytes(o.dtype, _numel(o.shape[1:] if o.kind == "partial" else o.shape, sizes))
    return CostReport(sizes, tuple(plans), n_kernels, ubytes, uflops, minimum)
