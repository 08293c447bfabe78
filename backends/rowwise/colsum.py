"""The finishing kernel of column partials (kind "colsum", planned by compiler/rowwise.py's
`fuse_column_partials`): every result `c[n] = sum(slot) cp[slot, n]` of a row kernel's partials
buffers, and the maps over the columns that follow it (the output casts), in one launch.

A CTA takes COLSUM_TX adjacent columns (a warp reads 32 consecutive floats of a partial row); its
COLSUM_TY thread rows split the partial rows, and fold through shared memory in a fixed order, so
the result does not depend on timing.
"""
from __future__ import annotations

import networkx as nx

from kspec.backends.api import LoweredPlan
from kspec.backends.generic import _CTYPE, _round
from kspec.backends.irview import ScheduleView, plan_view
from kspec.backends.names import number_placeholders
from kspec.compiler.graph import op, operands
from kspec.compiler.kir import KernelIR

from .desc import _FLOAT, _ITEMSIZE, RowwiseDesc
from .gen import _apply, _RowGen


def lower_colsum(ir: KernelIR, arch: str) -> LoweredPlan:
    sched, plan = ScheduleView(ir), plan_view(ir)
    gen = _RowGen(sched, plan, arch)
    g, info = gen.g, gen.info
    slots = info.extent(info.axis)
    if not isinstance(slots, int):
        gen.fail("the partial rows of a column sum must be a literal count")
    body: list[str] = []
    emit = body.append
    emit("const int tx = threadIdx.x, TX = blockDim.x, ty = threadIdx.y, TY = blockDim.y;")
    emit("const long long N = p.n;")
    emit("const long long e = (long long)blockIdx.x * TX + tx;")
    emit("const bool live = e < N;")
    emit("float* const red_ = reinterpret_cast<float*>(kspec_smem);")
    sums = [n for n in gen.nodes if op(g, n).kind == "reduction"]
    for j, n in enumerate(sums):
        o = op(g, n)
        ((u, labels),) = operands(g, n)
        if o.fn != "sum" or o.reduced != (info.axis,) or u in gen.group or tuple(labels) != (info.axis, info.outer[0]):
            gen.fail("a column sum adds the rows of a [slot, column] partials buffer", n)
        buf = gen.s.value_buffer[u]
        if gen.s.buffers[buf].dtype != "f32":
            gen.fail("column partials are f32", n)
        emit(f"float a{j} = 0.0f;")
        emit(f"if (live) for (long long s = ty; s < {slots}LL; s += TY) a{j} += "
             f"((const float*)p.ptr[{{{gen.arg(buf)}}}])[s * N + e];")
        emit(f"red_[({j} * TY + ty) * TX + tx] = a{j};")
    emit("__syncthreads();")
    emit("if (ty == 0 && live) {")
    var: dict = {}
    for j, n in enumerate(sums):
        emit(f"  a{j} = 0.0f;")
        emit(f"  for (int y = 0; y < TY; ++y) a{j} += red_[({j} * TY + y) * TX + tx];")
        v = f"v{len(var)}"
        emit(f"  const float {v} = {_round(op(g, n).dtype, f'a{j}')};")
        var[n] = v

    def operand(u) -> str:
        x = gen.leaf(u, var)
        if x is None:
            gen.fail("a column sum's epilogue reads only the sums, constants and scalars", u)
        return x

    for n in nx.topological_sort(g.subgraph(gen.group)):
        o = op(g, n)
        if n in var or o.kind == "const":
            continue
        if o.kind not in ("elementwise", "cast") or o.axes != (info.outer[0],):
            gen.fail(f"a column sum's epilogue holds maps over the columns, not {o.kind} ops", n)
        v = f"v{len(var)}"
        emit(f"  const float {v} = {_round(o.dtype, _apply(gen, n, [operand(u) for u, _ in operands(g, n)]))};")
        var[n] = v
    for n in gen.nodes:
        for t in gen.s.stores(n):
            bt = gen.s.buffers[t]
            if bt.dtype not in _FLOAT or tuple(bt.shape) != (info.extent(info.outer[0]),):
                gen.fail(f"a column sum stores floating-point [{info.outer[0]}] vectors", n)
            ct = _CTYPE[bt.dtype]
            emit(f"  (({ct}*)p.ptr[{{{gen.arg(t)}}}])[e] = kspec_to<{ct}>({var[n]});")
    emit("}")
    names = gen.names
    text, args, scalars = number_placeholders("\n".join("  " + line for line in body), names, gen.scalars)
    desc = RowwiseDesc(name=f"k_{plan.id.rsplit('_', 1)[-1]}", arch=arch, body=text, args=args, scalars=scalars,
                       dims=tuple(d for d, _ in gen.dims), n_outer=1, vec_checks=(), cache_bytes=0, n_passes=1,
                       n_slots=len(sums),
                       arg_bytes=tuple(_ITEMSIZE[gen.s.buffers[names.back()[a]].dtype] for a in args),
                       slots=slots, kind="colsum")
    return LoweredPlan(ir, arch, "rowwise", desc, names.back(), tuple(gen.dims), dict(gen.scalars))
