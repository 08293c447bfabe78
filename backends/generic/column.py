"""Column reductions in the generic backend: a reduction (sum, mean, max, min) or a dot product
`sum(m) x[m, n] * y[m, n]` over outer axes whose kept innermost axis is contiguous in what it reads
(a norm backward's dγ/dβ, a bias gradient).

Each CTA takes 32 adjacent columns (a warp reads 32 consecutive elements of a row) and a share of
the rows, which its 8 warps split; the warps combine through shared memory and a CTA adds its column
partials to the output with one f32 atomic each (the output is zeroed before the launch:
EmittedKernel.init).  max/min (no float atomic) and non-f32 outputs take every row in one CTA per
column block.  An outer product (a load holding some kept axes but not all: a GEMM's shape) and a
reduction over the contiguous axis (a row kernel's) are not column reductions.
"""
from __future__ import annotations

import networkx as nx

from kspec.backends.api import LoweredPlan
from kspec.backends.generic.gen import _INT, BLOCK, GenericDesc, _Gen, _round, _store
from kspec.backends.names import number_placeholders
from kspec.compiler.graph import op, operands
from kspec.compiler.kir import KernelIR
from kspec.core import dtype_bytes

# A reduction (or a dot product `sum(m) x[m, n] * y[m, n]`) over outer axes whose kept innermost axis
# is contiguous in what it reads: the norm backward's dγ/dβ, a bias gradient, a sum over heads.
# Each CTA takes 32 adjacent columns (a warp reads 32 consecutive elements of a row) and a share of
# the rows, which its 8 warps split; the warps combine through shared memory and a CTA adds its
# column partials to the output with one f32 atomic each (the output is zeroed before the launch:
# EmittedKernel.init).  max/min (no float atomic) and non-f32 outputs use one CTA per column block.
COL_WARPS = BLOCK // 32
COL_TARGET_CTAS = 1024          # split the rows until about this many CTAs are in flight


def sole_reduction(ir: KernelIR):
    """(r, loads) when the kernel's one loop is a reduction or contraction r, the kernel's only
    stored value, over a float value with kept axes, reading only input buffers (no gathers):
    loads [(buffer, labels)] as r's operand reads them.  None otherwise.  Column (here) and split
    (split.py) reductions are both of this shape and differ in which axis the reads are contiguous."""
    g = ir.graph()
    nodes = [o.id for o in ir.internal if o.kind != "const"]
    loops = [n for n in nodes if op(g, n).kind in ("reduction", "contraction", "softmax")]
    if len(loops) != 1:
        return None
    r = loops[0]
    o = op(g, r)
    if o.kind == "softmax" or (o.kind == "reduction" and o.fn not in ("sum", "mean", "max", "min")):
        return None
    if any(r in nx.ancestors(g, n) for n in nodes) or [n for n in nodes if ir.stores_of(n)] != [r]:
        return None
    if not o.axes or o.dtype in _INT:
        return None
    loads = []

    def visit(u, labels):
        uo = op(g, u)
        if uo.kind == "input":
            loads.append((uo.buffer, tuple(labels)))
        elif uo.kind == "gather":
            loads.append(None)
        elif u in nodes and uo.kind not in ("const", "index", "size", "param"):
            for x, l in operands(g, u):
                visit(x, l)
    for u, labels in operands(g, r):
        visit(u, labels)
    if not loads or None in loads:
        return None
    # each load with the label of its axis that is contiguous in memory (None for a scalar read)
    out = []
    for buf, labels in loads:
        b = ir.buffer(buf)
        last = len(labels) - 1 if not (b.layout == "col" and len(labels) >= 2) else len(labels) - 2
        out.append((buf, labels, labels[last] if labels else None))
    return r, out


def begin_lowering(gen: _Gen, r):
    """The shared start of a column or split reduction's lowering: every op of the operand is
    computed per element (inlined), the reduced labels get their dims; returns (op, stores)."""
    ir = gen.ir
    o = op(gen.g, r)
    gen.inline = {x.id for x in ir.internal if x.kind != "const"} - {r}   # the operand's ops, per element
    for label, ext in zip(o.reduced, o.reduced_shape):
        gen.dim(label, ext)
    # every buffer the reduction is stored to (an output may alias another: `t2[l] = t1[l]`)
    return o, ir.stores_of(r)


def column_reduction(ir: KernelIR):
    """The reduction node of a kernel the column strategy runs (module comment), or None."""
    hit = sole_reduction(ir)
    if hit is None:
        return None
    r, loads = hit
    o = op(ir.graph(), r)
    inner = o.axes[-1]
    contiguous = 0
    for _buf, labels, last in loads:
        if not labels:
            continue
        if set(labels) & set(o.axes) not in (set(), set(o.axes)):
            return None                      # an outer product (a GEMM's shape), not a column reduction
        if last in o.reduced:
            return None                      # a row reduction: the rows are contiguous (row kernels)
        if last == inner:
            contiguous += 1
    return r if contiguous else None


def lower_column(gen: _Gen, r, space, plan_id) -> LoweredPlan:
    g, ir = gen.g, gen.ir
    o, stores = begin_lowering(gen, r)
    atomic = o.kind == "contraction" or o.fn in ("sum", "mean")
    atomic = atomic and all(ir.buffer(t).dtype == "f32" for t in stores)
    ncols = " * ".join(gen.dimx(gen.dim_of[l]) for l in space)
    nred = " * ".join(gen.dimx(gen.dim_of[l]) for l in o.reduced)
    blocks = f"(({ncols}) + 31LL) / 32LL"
    if atomic:
        want = f"(({nred}) + {COL_WARPS * 32 - 1}LL) / {COL_WARPS * 32}LL"
        room = f"({COL_TARGET_CTAS}LL + {blocks} - 1LL) / ({blocks})"
        splits = f"(({want}) < ({room}) ? ({want}) : ({room}))"
        threads = f"({blocks}) * {BLOCK}LL * ({splits} > 0 ? {splits} : 1LL)"
    else:
        threads = f"({blocks}) * {BLOCK}LL"
    if o.kind == "contraction":
        (ua, la), (ub, lb) = operands(g, r)
        term = f"{gen.value(ua, la, {})} * {gen.value(ub, lb, {})}"
        combine, init = "{a} += {t};", "0.0f"
    else:
        ((u, labels),) = operands(g, r)
        term = gen.value(u, labels, {})
        combine = {"sum": "{a} += {t};", "mean": "{a} += {t};", "max": "{a} = fmaxf({a}, {t});",
                   "min": "{a} = fminf({a}, {t});"}[o.fn]
        init = {"sum": "0.0f", "mean": "0.0f", "max": "-INFINITY", "min": "INFINITY"}[o.fn]
    body = ["long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;",
            "if (tid >= p.count) return;",
            f"const long long ncols_ = {ncols}, nred_ = {nred}, cblocks_ = {blocks};",
            "const long long cb_ = (long long)blockIdx.x % cblocks_, split_ = (long long)blockIdx.x / cblocks_;",
            "const long long nsplit_ = (long long)gridDim.x / cblocks_;",
            "const long long col_ = cb_ * 32 + (threadIdx.x & 31);",
            "const int warp_ = threadIdx.x >> 5;",
            "const long long chunk_ = (nred_ + nsplit_ - 1) / nsplit_;",
            "const long long r0_ = split_ * chunk_, r1_ = r0_ + chunk_ < nred_ ? r0_ + chunk_ : nred_;",
            f"float acc_ = {init};",
            "if (col_ < ncols_) {"]
    body += ["  " + x for x in _decode(gen, space, "col_", "c_")]
    body.append("  #pragma unroll 4")
    body.append(f"  for (long long q_ = r0_ + warp_; q_ < r1_; q_ += {COL_WARPS}) {{")
    body += ["    " + x for x in _decode(gen, o.reduced, "q_", "s_")]
    body.append("    " + combine.format(a="acc_", t=f"(float)({term})"))
    body.append("  }")
    body.append("}")
    body.append(f"__shared__ float kspec_col_[{COL_WARPS}][33];")
    body.append("kspec_col_[warp_][threadIdx.x & 31] = acc_;")
    body.append("__syncthreads();")
    body.append("if (warp_ == 0 && col_ < ncols_) {")
    body.append(f"  for (int w_ = 1; w_ < {COL_WARPS}; ++w_) {{ const float t_ = kspec_col_[w_][threadIdx.x & 31]; "
                + combine.format(a="acc_", t="t_") + " }")
    if o.kind == "reduction" and o.fn == "mean":
        body.append("  acc_ = acc_ / (float)nred_;")
    # the column's own indices again (the decode above is scoped to the accumulation)
    body += ["  " + x for x in _decode(gen, space, "col_", "c_")]
    for t in stores:
        off = gen.offset(t, ir.store_labels(r, t))
        if atomic:
            body.append(f"  atomicAdd(((float*)p.ptr[{{{gen.ptr(t)}}}]) + ({off}), acc_);")
        else:
            body.append("  " + _store(ir.buffer(t).dtype, f"p.ptr[{{{gen.ptr(t)}}}]", off, _round(o.dtype, "acc_")))
    body.append("}")
    return finish_lowering(gen, body, threads, plan_id, stores if atomic else ())


def finish_lowering(gen: _Gen, body: list[str], threads: str, plan_id: str, zeroed) -> LoweredPlan:
    """The shared end of a column or split reduction's lowering: the kernel body with its buffer and
    scalar placeholders numbered, as a LoweredPlan whose `zeroed` buffers are cleared before launch."""
    ir = gen.ir
    names = gen.names
    text, args, scalars = number_placeholders("\n".join("    " + line for line in body), names, gen.scalars)
    back = names.back()
    desc = GenericDesc(name=f"k_{plan_id.rsplit('_', 1)[-1]}", arch=gen.arch, body=text, args=args, scalars=scalars,
                       dims=tuple(d for d, _ in gen.dim_values), threads=threads,
                       arg_bytes=tuple(dtype_bytes(ir.buffer(back[a]).dtype) for a in args),
                       init=tuple((gen.ptr(t), "zero") for t in zeroed))
    return LoweredPlan(ir, gen.arch, "generic", desc, names.back(), tuple(gen.dim_values), dict(gen.scalars))


def _decode(gen: _Gen, labels, linear: str, tmp: str) -> list[str]:
    """long long i_<d> for `labels` from the row-major linear index `linear`."""
    out = [f"long long {tmp} = {linear};"]
    for label in reversed(labels):
        d = gen.dim_of[label]
        out.append(f"long long i_{d} = {tmp} % {gen.dimx(d)}; {tmp} /= {gen.dimx(d)};")
    return out
