"""Lowering: a scheduled `KernelPlan` -> a backend kernel descriptor (backends/desc.py).

Spec names never reach C++: every buffer a plan touches gets a generated identifier (`t0`, `t1`, ...)
and `LoweredPlan.names` maps those back to spec buffer names for the manifest.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from kspec.compiler import AttentionInfo, GemmInfo, KernelPlan, KernelSchedule, op, operands, values_leaving
from kspec.spec_lang.errors import KspecError

from .desc import (Accum, AttentionDesc, Const, EpiExpr, GemmDesc, KernelDesc, Load, Op, Operand,
                   ReductionStore, Store)


class KspecLoweringError(KspecError):
    """A plan the backend cannot express (named with the kernel and arch)."""


@dataclass(frozen=True)
class LoweredPlan:
    plan: KernelPlan
    arch: str
    desc: KernelDesc
    names: dict[str, str]                       # C identifier -> spec buffer name
    dims: tuple[tuple[str, object], ...]        # ABI dim role -> spec symbol / int literal / (symbols..) product
    scalars: dict[str, object]                  # C identifier of a scalar Load -> param name or constant


class _Names:
    def __init__(self):
        self.to_c: dict[str, str] = {}

    def __call__(self, buffer: str) -> str:
        if buffer not in self.to_c:
            self.to_c[buffer] = f"t{len(self.to_c)}"
        return self.to_c[buffer]

    def back(self) -> dict[str, str]:
        return {c: b for b, c in self.to_c.items()}


def _extent_of(sched: KernelSchedule, node, label) -> object:
    o = op(sched.graph, node)
    return dict(zip(o.axes, o.shape))[label]


def _batch_extent(sched: KernelSchedule, node, labels) -> object:
    ext = [_extent_of(sched, node, l) for l in labels]
    if not ext:
        return 1
    if len(ext) == 1:
        return ext[0]
    return tuple(ext)


def _fail(sched: KernelSchedule, plan: KernelPlan, arch: str, msg: str, hint: str | None = None):
    span = op(sched.graph, plan.group.anchor).span
    raise KspecLoweringError(f"kernel {sched.kernel.name} (plan {plan.id}) on {arch}: {msg}", span, hint)


def lower_gemm(sched: KernelSchedule, plan: KernelPlan, arch: str) -> LoweredPlan:
    g = sched.graph
    gi: GemmInfo = plan.info
    grp = plan.group.nodes
    names = _Names()
    scalars: dict[str, object] = {}
    buf = sched.value_buffer

    def operand(node, layout) -> Operand:
        return Operand(names(buf[node]), op(g, node).dtype, layout)

    a = operand(gi.a, gi.a_layout)
    b = operand(gi.b, gi.b_layout)
    memo: dict = {}

    def expr(n) -> EpiExpr:
        if n in memo:
            return memo[n]
        o = op(g, n)
        if n == plan.group.anchor:
            e: EpiExpr = Accum()
        elif o.kind == "const":
            e = Const(float(o.value))
        elif n not in grp:
            if o.kind == "param":
                c = names(o.name)
                scalars[c] = o.name
                e = Load(c, "scalar", o.dtype)
            else:
                e = Load(names(buf[n]), "full", o.dtype)
        elif o.kind == "broadcast":
            (src, labels), = operands(g, n)
            so = op(g, src)
            if len(labels) == 1 and labels[0] == gi.n:
                e = Load(names(buf[src]), "row", so.dtype)
            elif len(labels) == 1 and labels[0] == gi.m:
                e = Load(names(buf[src]), "col", so.dtype)
            else:
                _fail(sched, plan, arch, f"cannot broadcast a [{', '.join(labels)}] value in a GEMM epilogue")
        elif o.kind == "cast":
            (src, _), = operands(g, n)
            e = Op(f"cast:{o.dtype}", (expr(src),))
        elif o.kind == "elementwise":
            e = Op(o.fn, tuple(expr(u) for u, _ in operands(g, n)))
        else:
            _fail(sched, plan, arch, f"{o.kind} op inside a GEMM epilogue")
        memo[n] = e
        return e

    stores: list[Store] = []
    reductions: list[ReductionStore] = []
    leaving = values_leaving(g, plan.group)
    for n in leaving:
        o = op(g, n)
        for t in sched.stores(n):
            b_ = sched.buffers[t]
            if o.kind == "reduction":
                (src, labels), = operands(g, n)
                axis = "n" if o.reduced == (gi.n,) else "m"
                reductions.append(ReductionStore(names(t), o.fn, axis, expr(src), b_.dtype))
                continue
            layout = _store_layout(g, n, t, gi, sched)
            stores.append(Store(names(t), expr(n), b_.dtype, layout))
    if not stores:
        _fail(sched, plan, arch, "a GEMM whose only results are reductions has no output to store",
              "also write the full result to an output")
    main = stores[-1]
    cfg = plan.configs.get(arch)
    acc = op(g, plan.group.anchor).dtype
    desc = GemmDesc(name=f"k_{plan.id.rsplit('_', 1)[-1]}", arch=arch, a=a, b=b, acc_dtype="i32" if acc == "i32" else "f32",
                    output=main, aux_stores=tuple(stores[:-1]), reductions=tuple(reductions),
                    batched=bool(gi.batch), tile=cfg.tile if cfg else None, cluster=cfg.cluster if cfg else None,
                    stages=cfg.stages if cfg else None)
    anchor = plan.group.anchor
    dims = (("M", _extent_of(sched, anchor, gi.m)), ("N", _extent_of(sched, anchor, gi.n)),
            ("K", op(g, anchor).reduced_shape[0]), ("L", _batch_extent(sched, anchor, gi.batch)))
    return LoweredPlan(plan, arch, desc, names.back(), dims, scalars)


def _store_layout(g, n, buffer_name, gi: GemmInfo, sched: KernelSchedule) -> str:
    """row if the stored buffer has n contiguous, col if m is (a transposed output)."""
    for s in g.successors(n):
        so = op(g, s)
        if so.kind == "output" and so.name == buffer_name:
            (_, labels), = [(u, l) for u, l in operands(g, s) if u == n]
            order = list(labels)
            if so.layout == "col":
                order[-2], order[-1] = order[-1], order[-2]
            return "row" if order[-1] == gi.n else "col"
    return "row"


def _attention_scale(g, info: AttentionInfo):
    """The softmax scale as a param name or a folded constant; None if it is not a single factor."""
    consts = 1.0
    param = None
    for n in info.scale:
        o = op(g, n)
        (x, _), (y, _) = operands(g, n)
        scalar = y if op(g, x).kind not in ("param", "const") else x
        so = op(g, scalar)
        if so.kind == "const":
            consts = consts * so.value if o.fn == "mul" else consts / so.value
        elif o.fn == "mul" and param is None:
            param = so.name
        else:
            return None
    if param is not None and consts != 1.0:
        return None
    return param if param is not None else consts


def attention_reason(g: nx.DiGraph, info: AttentionInfo, arch: str) -> str | None:
    """Why the fused attention kernel cannot run this attention on `arch` (None if it can)."""
    from .cutlass.fmha import attention_support
    dts = {op(g, n).dtype for n in (info.q, info.k, info.v)}
    if len(dts) != 1:
        return f"Q, K and V have different dtypes ({', '.join(sorted(dts))})"
    heads = {_label_extent(g, info.qk, info.q, info.head), _label_extent(g, info.qk, info.k, info.head),
             _label_extent(g, info.pv, info.v, info.head)}
    if len(heads) != 1 or not isinstance(next(iter(heads)), int):
        return "the head dimension must be the same integer literal in Q, K and V"
    if len(info.batch) > 2:
        return "more than two batch axes"
    if _attention_scale(g, info) is None:
        return "the score scale must be one param or constant factor"
    for n in (info.q, info.k, info.v):
        if op(g, n).kind != "input" or op(g, n).layout != "row":
            return f"{op(g, n).name or n} must be a row-major kernel input"
    return attention_support(arch, dts.pop(), heads.pop(), info.causal)


def _label_extent(g, consumer, producer, label):
    """The extent of the producer's axis that `consumer` reads under `label`."""
    for u, labels in operands(g, consumer):
        if u == producer and label in labels:
            return op(g, producer).shape[labels.index(label)]
    return None


def attention_veto(archs):
    """The fusion pass's callback: why fused attention cannot be used on every arch in `archs`."""
    def check(g, info):
        for arch in archs:
            why = attention_reason(g, info, arch)
            if why:
                return f"{arch}: {why}"
        return None
    return check


def lower_attention(sched: KernelSchedule, plan: KernelPlan, arch: str) -> LoweredPlan:
    g = sched.graph
    info: AttentionInfo = plan.info
    why = attention_reason(g, info, arch)
    if why:
        _fail(sched, plan, arch, why)
    names = _Names()
    buf = sched.value_buffer
    out_nodes = values_leaving(g, plan.group)
    stores = [b for n in out_nodes for b in sched.stores(n)]
    if len(stores) != 1:
        _fail(sched, plan, arch, "fused attention stores exactly one output O", "compute other values separately")
    o_buf = sched.buffers[stores[0]]
    dtype = op(g, info.q).dtype
    if o_buf.dtype != dtype:
        _fail(sched, plan, arch, f"the output O is {o_buf.dtype} but Q, K, V are {dtype}",
              "declare O with the inputs' dtype")
    ops = {r: Operand(names(buf[n]), op(g, n).dtype) for r, n in (("q", info.q), ("k", info.k), ("v", info.v))}
    o = Operand(names(o_buf.name), o_buf.dtype)
    scale = _attention_scale(g, info)
    scalars: dict[str, object] = {}
    if isinstance(scale, str):
        c = names(scale)
        scalars[c] = scale
        scale_e: Load | Const = Load(c, "scalar", "f32")
    else:
        scale_e = Const(float(scale))
    head = _head_dim(g, info)
    desc = AttentionDesc(name=f"k_{plan.id.rsplit('_', 1)[-1]}", arch=arch, q=ops["q"], k=ops["k"], v=ops["v"], o=o,
                         head_dim=head, scale=scale_e, causal=info.causal)
    qk = plan.group.anchor
    batch = [_extent_of(sched, qk, l) for l in info.batch]
    bdim, hdim = ([1, 1] + batch)[-2:]          # [b, h] -> B, H;  [h] -> 1, H;  [] -> 1, 1
    dims = (("B", bdim), ("H", hdim), ("S", _extent_of(sched, qk, info.query)), ("T", _extent_of(sched, qk, info.key)),
            ("E", head))
    return LoweredPlan(plan, arch, desc, names.back(), dims, scalars)


def _head_dim(g, info: AttentionInfo) -> int:
    return _label_extent(g, info.qk, info.q, info.head)


CUTLASS_OPERANDS = ("f16", "bf16", "tf32", "f8e4m3", "f8e5m2")


def cutlass_can_run(sched: KernelSchedule, plan: KernelPlan) -> str | None:
    """Why a GEMM plan's operands rule out CUTLASS (None if they do not)."""
    g = sched.graph
    a, b = op(g, plan.info.a).dtype, op(g, plan.info.b).dtype
    if a not in CUTLASS_OPERANDS or b not in CUTLASS_OPERANDS:
        return f"operands {a} x {b}: CUTLASS GEMMs take {', '.join(CUTLASS_OPERANDS)}"
    if a != b and not (a in ("f8e4m3", "f8e5m2") and b in ("f8e4m3", "f8e5m2")):
        return f"mixed operands {a} x {b}"
    return None


def lower(sched: KernelSchedule, plan: KernelPlan, arch: str, tensor_core_only: str | None = None) -> LoweredPlan:
    """tensor_core_only: "cute" lets a GEMM that CUTLASS C++ cannot run (e.g. i8 x i8 -> i32) lower to
    a GemmDesc when the CuTe DSL backend can implement it on `arch`."""
    if plan.kind == "gemm":
        why = cutlass_can_run(sched, plan)
        if why is None:
            return lower_gemm(sched, plan, arch)
        if tensor_core_only == "cute":
            from .cute.gemm import can_implement
            lp = lower_gemm(sched, plan, arch)
            if can_implement(lp.desc, arch) is None:
                return lp
        from .generic import lower_generic
        note = f"{plan.id}: {why}; compiled as a plain CUDA kernel"
        if note not in sched.fusion.notes:
            sched.fusion.notes.append(note)
        return lower_generic(sched, plan, arch)
    if plan.kind == "attention":
        return lower_attention(sched, plan, arch)
    from .generic import lower_generic
    return lower_generic(sched, plan, arch)
