"""Split reductions in the generic backend: a sum, mean or dot product whose reduced elements are
the contiguous ones in what it reads and whose kept elements are few and strided: ALiBi's slope
gradient `dslope[h] = sum(b, i, j) ds[b, h, i, j] * (j - i)`, a loss summed over batch and
sequence (two or more reduced axes: one is a row kernel's shape, and a gemv the row backend
declines stays a loud loop).  Row kernels take a reduction over one contiguous axis per row; this is the case they
do not (several reduced axes around a kept one), which the loop path would run with one thread
per output element looping over all of its reduced elements (a handful of threads for a whole GPU).

Each CTA takes one output element and a share of its reduced elements (the share chosen at launch
so that about SPLIT_TARGET_CTAS CTAs run, and each thread has at least SPLIT_MIN_PER_THREAD
elements); its threads read consecutive reduced elements (contiguous in memory, so coalesced),
combine through a shared-memory tree, and thread 0 adds the CTA's partial to the output with one
f32 atomic (the output is zeroed before the launch: EmittedKernel.init).  max/min (no float
atomic) and outputs stored in another dtype than f32 are not split: they keep the loop path.
"""
from __future__ import annotations

from kspec.backends.api import LoweredPlan
from kspec.backends.generic.column import _decode, begin_lowering, finish_lowering, sole_reduction
from kspec.backends.generic.gen import BLOCK, _Gen
from kspec.compiler.graph import op, operands
from kspec.compiler.kir import KernelIR

SPLIT_TARGET_CTAS = 1024        # split each output's elements until about this many CTAs are in flight
SPLIT_MIN_PER_THREAD = 8        # ... but give each thread at least this many elements


def split_reduction(ir: KernelIR):
    """The reduction node of a kernel the split strategy runs (module docstring), or None."""
    hit = sole_reduction(ir)
    if hit is None:
        return None
    r, loads = hit
    g = ir.graph()
    o = op(g, r)
    if not (o.kind == "contraction" or o.fn in ("sum", "mean")):
        return None
    if len(o.reduced) < 2:
        return None                           # one reduced axis: a row kernel's shape (or a loop, said loudly)
    if any(ir.buffer(t).dtype != "f32" for t in ir.stores_of(r)):
        return None
    rows = 0
    for _buf, labels, last in loads:
        if not labels:
            continue
        if last not in o.reduced:
            return None                       # reads along a kept axis: a column reduction's pattern
        rows += 1
    return r if rows else None


def lower_split(gen: _Gen, r, space, plan_id) -> LoweredPlan:
    g, ir = gen.g, gen.ir
    o, stores = begin_lowering(gen, r)
    nout = " * ".join(gen.dimx(gen.dim_of[l]) for l in space) or "1LL"
    nred = " * ".join(gen.dimx(gen.dim_of[l]) for l in o.reduced)
    want = f"(({nred}) + {BLOCK * SPLIT_MIN_PER_THREAD - 1}LL) / {BLOCK * SPLIT_MIN_PER_THREAD}LL"
    room = f"({SPLIT_TARGET_CTAS}LL + ({nout}) - 1LL) / ({nout})"
    splits = f"(({want}) < ({room}) ? ({want}) : ({room}))"
    threads = f"({nout}) * {BLOCK}LL * ({splits} > 0 ? {splits} : 1LL)"
    if o.kind == "contraction":
        (ua, la), (ub, lb) = operands(g, r)
        term = f"{gen.value(ua, la, {})} * {gen.value(ub, lb, {})}"
    else:
        ((u, labels),) = operands(g, r)
        term = gen.value(u, labels, {})
    body = ["if ((long long)blockIdx.x * blockDim.x + threadIdx.x >= p.count) return;",
            f"const long long nout_ = {nout}, nred_ = {nred};",
            "const long long out_ = (long long)blockIdx.x % nout_, split_ = (long long)blockIdx.x / nout_;",
            "const long long nsplit_ = (long long)gridDim.x / nout_;",
            "const long long chunk_ = (nred_ + nsplit_ - 1) / nsplit_;",
            "const long long r0_ = split_ * chunk_, r1_ = r0_ + chunk_ < nred_ ? r0_ + chunk_ : nred_;",
            "float acc_ = 0.0f;",
            "{"]
    body += ["  " + x for x in _decode(gen, space, "out_", "c_")]
    body.append(f"  for (long long q_ = r0_ + threadIdx.x; q_ < r1_; q_ += {BLOCK}) {{")
    body += ["    " + x for x in _decode(gen, o.reduced, "q_", "s_")]
    body.append(f"    acc_ += (float)({term});")
    body.append("  }")
    body.append("}")
    body.append(f"__shared__ float kspec_split_[{BLOCK}];")
    body.append("kspec_split_[threadIdx.x] = acc_;")
    body.append("__syncthreads();")
    body.append(f"for (int s_ = {BLOCK // 2}; s_ > 0; s_ >>= 1) {{")
    body.append("  if ((int)threadIdx.x < s_) kspec_split_[threadIdx.x] += kspec_split_[threadIdx.x + s_];")
    body.append("  __syncthreads();")
    body.append("}")
    body.append("if (threadIdx.x == 0) {")
    body.append("  acc_ = kspec_split_[0];")
    if o.kind == "reduction" and o.fn == "mean":
        body.append("  acc_ = acc_ / (float)nred_;")
    body += ["  " + x for x in _decode(gen, space, "out_", "c_")]
    for t in stores:
        off = gen.offset(t, ir.store_labels(r, t))
        body.append(f"  atomicAdd(((float*)p.ptr[{{{gen.ptr(t)}}}]) + ({off}), acc_);")
    body.append("}")
    return finish_lowering(gen, body, threads, plan_id, stores)
