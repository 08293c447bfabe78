"""Read-only, schedule-shaped views of a `KernelIR`, for code generators written against the
compiler's graph conventions (op(g, n), operands(g, n), a plan's group and a schedule's buffers).
Everything here is derived from the IR alone: such a generator still reads nothing else."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from kspec.compiler.kir import IRBuffer, KernelIR


@dataclass(frozen=True)
class BufferView:
    name: str
    kind: str          # input | output | param | intermediate
    dtype: str
    shape: tuple
    layout: str


class ScheduleView:
    """`sched.graph`, `sched.buffers[name]`, `sched.value_buffer[op]` (values loaded from outside
    the kernel), `sched.stores(op)` and `sched.kernel.name` of one kernel IR."""

    def __init__(self, ir: KernelIR):
        self.ir = ir
        self.graph = ir.graph()
        self.buffers = {b.name: _buffer(b) for b in ir.buffers}
        self.value_buffer = {o.id: o.buffer for o in ir.ops if o.kind in ("input", "param")}
        self.kernel = SimpleNamespace(name=ir.spec_kernel)

    def stores(self, op_id) -> list[str]:
        return self.ir.stores_of(op_id)


def plan_view(ir: KernelIR):
    """`plan.id`, `plan.kind`, `plan.info` (the row structure), `plan.group.nodes` (the ops computed
    inside the kernel) and `plan.group.anchor`."""
    group = SimpleNamespace(nodes={o.id for o in ir.internal}, anchor=ir.anchor)
    return SimpleNamespace(id=ir.id, kind=ir.kind, info=ir.row, group=group)


def _buffer(b: IRBuffer) -> BufferView:
    return BufferView(b.name, b.role, b.dtype, b.shape, b.layout)
