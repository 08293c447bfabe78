"""Fused group + buffer assignment -> `KernelIR` (compiler/kir.py).

This is where the compiler's graph stops: everything a backend needs is copied into the IR, with
buffers named as the schedule names them.  GEMM epilogues become expression DAGs; attention groups
get their structure (operands, axes, scale, head dims) so backends decide what they can run.
"""
from __future__ import annotations

from typing import Callable

import networkx as nx

from kspec.core import KspecError, KspecInternalError, packed_rows_symbol

from .attention import attention_scale, is_top_left_causal, lift_mods, output_scale, score_path
from .canon import GemmInfo
from .graph import op, operands
from .kir import (Accum, ArchHint, AttentionBwdStructure, AttentionStructure, Const, EpiExpr, Epilogue, GemmStructure, IRBuffer, IROp,
                  key_length_bound,
                  KernelIR, Load, Op, ReductionStore, RowStructure, Store)


def _order(n) -> int:
    s = str(n)
    return int(s[1:]) if s[1:].isdigit() else 0


def build_ir(plan_id: str, spec_kernel: str, g: nx.DiGraph, group, buffer_of: Callable[[object], str],
             buffer_info: Callable[[str], IRBuffer], stores: list[tuple[object, str]],
             hints: tuple[tuple[str, ArchHint], ...] = ()) -> KernelIR:
    """group: a fusion Group; buffer_of(node) -> the buffer holding an outside value;
    buffer_info(name) -> its IRBuffer; stores: (node, buffer) for the values leaving the group."""
    nodes = set(group.nodes)
    topo = list(nx.lexicographical_topological_sort(g.subgraph(nodes), key=_order))
    sig = list(dict.fromkeys(u for n in topo for u, _ in operands(g, n)
                             if u not in nodes and op(g, u).kind not in ("const", "index", "size")))
    ident = _canonical_ids(g, nodes, stores, sig)   # every op id below goes through it
    ops: list[IROp] = []
    made: set = set()
    bufs: dict[str, IRBuffer] = {}

    def use_buffer(name: str) -> None:
        if name not in bufs:
            bufs[name] = buffer_info(name)

    def external(u) -> None:
        if u in made:
            return
        o = op(g, u)
        made.add(u)
        if o.kind in ("const", "index", "size"):
            ops.append(IROp(ident(u), o.kind, o.dtype, o.axes, tuple(o.shape), fn=o.fn, value=o.value, span=o.span))
            return
        name = buffer_of(u)
        use_buffer(name)
        b = bufs[name]
        kind = "param" if b.role == "param" else "input"
        ops.append(IROp(ident(u), kind, b.dtype, o.axes, tuple(o.shape), name=o.name, layout=b.layout, buffer=name,
                        span=o.span))

    order = list(nx.lexicographical_topological_sort(g.subgraph(nodes), key=_order))
    for n in order:
        for u, _ in operands(g, n):
            if u not in nodes:
                external(u)
    for n in order:
        o = op(g, n)
        ops.append(IROp(ident(n), o.kind, o.dtype, o.axes, tuple(o.shape),
                        args=tuple((ident(u), tuple(l)) for u, l in operands(g, n)), fn=o.fn, name=o.name,
                        reduced=o.reduced, reduced_shape=tuple(o.reduced_shape), value=o.value, causal=o.causal,
                        layout=o.layout, subscripts=tuple(o.subscripts), span=o.span))
    for _, b in stores:
        use_buffer(b)
    for b in list(bufs.values()):
        if b.packed is not None:          # a packed buffer's offsets travel with it
            use_buffer(b.packed)
    gemm = epilogue = attention = attention_bwd = None
    ops.sort(key=lambda o: _order(o.id))
    if group.kind == "gemm":
        gemm, epilogue = _gemm(g, group, buffer_of, stores, bufs, use_buffer, ident)
    elif group.kind == "attention":
        attention = _attention(g, group, buffer_of, stores, bufs, ident)
    elif group.kind == "attention_bwd":
        attention_bwd = _attention_bwd(g, group, buffer_of, stores)
    anchor = group.anchor if group.anchor is not None else order[-1]
    row = None
    if group.kind in ("rowwise", "colsum"):
        info = group.info
        row = RowStructure(tuple(info.outer), info.axis, tuple(info.extents))
    return KernelIR(plan_id, group.kind, spec_kernel, tuple(bufs.values()), tuple(ops),
                    tuple((ident(n), b, _store_labels(g, n, b)) for n, b in stores), gemm, epilogue, attention, hints,
                    row, ident(anchor), op(g, anchor).span, attention_bwd)


def _canonical_ids(g: nx.DiGraph, nodes: set, stores, sig: list) -> Callable[[object], str]:
    """Op ids of one kernel in a structural order: the buffers it reads (sig, in their first-read
    order), then post-order from the stored values (operands in position order), so two spellings
    that canonicalise to the same ops give the same kernel IR, ids included, whatever order the
    graph builder made their nodes in."""
    order: list = list(sig)
    seen: set = set(sig)
    roots = [n for n, _ in stores] + sorted(nodes, key=_order)
    for root in roots:
        stack = [(root, False)]
        while stack:
            n, done = stack.pop()
            if done:
                order.append(n)
                continue
            if n in seen:
                continue
            seen.add(n)
            stack.append((n, True))
            if n in nodes:
                for u, _ in reversed(operands(g, n)):
                    if u not in seen:
                        stack.append((u, False))
    ids = {n: f"n{k}" for k, n in enumerate(order)}
    return lambda n: ids[n] if n in ids else str(n)


def _store_labels(g, n, buffer_name: str) -> tuple[str, ...]:
    """The labels under which the buffer's axes hold n's value: an output node may read n under
    permuted labels (a transposed output); any other buffer holds n in its own axis order."""
    for s in g.successors(n):
        so = op(g, s)
        if so.kind == "output" and so.name == buffer_name:
            (_, labels), = [(u, l) for u, l in operands(g, s) if u == n]
            return tuple(labels)
    return tuple(op(g, n).axes)


def _extent(g, node, label):
    o = op(g, node)
    return dict(zip(o.axes, o.shape))[label]


def _batch_extent(g, node, labels):
    ext = [_extent(g, node, l) for l in labels]
    if not ext:
        return 1
    return ext[0] if len(ext) == 1 else tuple(ext)


def _gemm(g, group, buffer_of, stores, bufs, use_buffer, ident=str):
    gi: GemmInfo = group.info
    anchor = group.anchor
    nodes = group.nodes
    memo: dict = {}

    def fail(msg: str, node=None, hint: str | None = None):
        raise KspecError(f"kernel {g.graph.get('kernel', '?')}: {msg}", op(g, node or anchor).span, hint)

    def expr(n) -> EpiExpr:
        if n in memo:
            return memo[n]
        o = op(g, n)
        if n == anchor:
            e: EpiExpr = Accum()
        elif gi.anchor2 is not None and n == gi.anchor2:
            e = Accum(1)
        elif o.kind == "const":
            e = Const(float(o.value))
        elif n not in nodes:
            name = buffer_of(n)
            use_buffer(name)
            e = Load(name, "scalar" if bufs[name].role == "param" else "full", o.dtype)
        elif o.kind == "broadcast":
            (src, labels), = operands(g, n)
            kind = gi.vector_kind(labels)
            if kind is not None:
                e = vector(src, kind)
            else:
                raise KspecInternalError(f"kernel {g.graph.get('kernel', '?')}: cannot broadcast a "
                                         f"[{', '.join(labels)}] value in a GEMM epilogue")
        elif o.kind == "cast":
            (src, _), = operands(g, n)
            e = Op(f"cast:{o.dtype}", (expr(src),))
        elif o.kind == "elementwise":
            e = Op(o.fn, tuple(expr(u) for u, _ in operands(g, n)))
        else:
            raise KspecInternalError(f"kernel {g.graph.get('kernel', '?')}: {o.kind} op inside a GEMM epilogue")
        memo[n] = e
        return e

    def vector(n, kind) -> EpiExpr:
        """A row/column vector load: an input, or casts (computed in the epilogue) of one."""
        o = op(g, n)
        if n in nodes and o.kind == "cast":
            (src, _), = operands(g, n)
            return Op(f"cast:{o.dtype}", (vector(src, kind),))
        if n in nodes:
            raise KspecInternalError(f"a {o.kind} op on a broadcast vector inside a GEMM epilogue")
        name = buffer_of(n)
        use_buffer(name)
        return Load(name, kind, o.dtype)

    out_stores: list[Store] = []
    reductions: list[ReductionStore] = []
    for n, b in stores:
        o = op(g, n)
        dtype = bufs[b].dtype
        if o.kind == "broadcast":       # a full reduction stored through its view (fusion.is_reduction_store_view)
            (n, _), = operands(g, n)
            o = op(g, n)
        if o.kind == "reduction":
            (src, _), = operands(g, n)
            axis = "mn" if len(o.reduced) == 2 else "n" if o.reduced == (gi.n,) else "m"
            reductions.append(ReductionStore(b, o.fn, axis, expr(src), dtype))
            continue
        out_stores.append(Store(b, expr(n), dtype, _store_layout(g, n, b, gi)))
    if not out_stores:
        fail("a GEMM whose only results are reductions has no output to store",
             hint="also write the full result to an output")
    a_buf, b_buf = buffer_of(gi.a), buffer_of(gi.b)
    rows_buf = buffer_of(gi.gather[1]) if gi.gather else None
    m_buf = rows_buf if rows_buf is not None else a_buf
    acc = op(g, anchor).dtype
    structure = GemmStructure(
        anchor=ident(anchor), a=ident(gi.a), b=ident(gi.b), a_buffer=a_buf, b_buffer=b_buf,
        a_dtype=op(g, gi.a).dtype, b_dtype=op(g, gi.b).dtype, acc_dtype="i32" if acc == "i32" else "f32",
        a_layout=gi.a_layout, b_layout=gi.b_layout, m=gi.m, n=gi.n, k=gi.k, batch=tuple(gi.batch),
        m_fold=tuple(gi.m_fold), k_fold=tuple(gi.k_fold),
        anchor2=None if gi.anchor2 is None else ident(gi.anchor2), b2=None if gi.b2 is None else ident(gi.b2),
        b2_buffer=None if gi.b2 is None else buffer_of(gi.b2),
        scales=tuple((buffer_of(sc.source), sc.operand, op(g, sc.source).dtype, sc.block_k, sc.block_mn, sc.order)
                     for sc in gi.scales),
        a_rows=rows_buf,
        # a grouped GEMM (A, or the index its rows are gathered by, packed by group, `packed(off)`):
        # M is the packed array's row count; a gathered A's own row count is R
        dims=(("M", packed_rows_symbol(bufs[m_buf].packed) if bufs[m_buf].packed and len(gi.batch) == 1
               else _batch_extent(g, anchor, gi.m_labels)), ("N", _extent(g, anchor, gi.n)),
              ("K", _reduced_extent(g, anchor, gi.k_labels)), ("L", _batch_extent(g, anchor, gi.batch)),
              *((("R", op(g, gi.a).shape[0]),) if gi.gather else ())))
    return structure, Epilogue(tuple(out_stores), tuple(reductions))


def _reduced_extent(g, anchor, labels):
    """The extent of a contraction's reduced labels: one, or the product of several (folded K)."""
    o = op(g, anchor)
    ext = dict(zip(o.reduced, o.reduced_shape))
    return ext[labels[0]] if len(labels) == 1 else tuple(ext[l] for l in labels)


def _store_layout(g, n, buffer_name, gi: GemmInfo) -> str:
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


def _label_extent(g, consumer, producer, label):
    """The extent of the producer's axis that `consumer` reads under `label`."""
    for u, labels in operands(g, consumer):
        if u == producer and label in labels:
            return op(g, producer).shape[labels.index(label)]
    return None


def _attention(g, group, buffer_of, stores, bufs, ident=str) -> AttentionStructure:
    info = group.info
    qk = info.qk
    batch = [_extent(g, qk, l) for l in info.batch]
    bdim, hdim = ([1, 1] + batch)[-2:]          # [b, h] -> B, H;  [h] -> 1, H;  [] -> 1, 1
    k_read = info.k_read if info.k_read is not None else info.k
    v_read = info.v_read if info.v_read is not None else info.v
    heads = (_label_extent(g, info.qk, info.q, info.head), _label_extent(g, info.qk, k_read, info.head),
             _label_extent(g, info.pv, v_read, info.head))
    row_major = all(op(g, n).kind == "input" and op(g, n).layout == "row" for n in (info.q, info.k, info.v))
    score_mod = mask = None
    aux: tuple[str, ...] = ()
    if info.mods is not None and (info.mods.score_mod is not None or info.mods.mask is not None):
        sp = score_path(g, info.softmax)
        mods = lift_mods(g, info.softmax, sp, (*info.batch, info.query, info.key), buffer_of,
                         frozenset([info.lse] if info.lse is not None else []))
        score_mod, mask = mods.score_mod, mods.mask
        if info.causal and is_top_left_causal(mask, info.query, info.key):
            mask = None                # `where(j <= i, s, -inf)` with S = T: the causal flag says it
        aux = tuple(dict.fromkeys(buffer_of(n) for n in mods.aux))
    o_scale = None
    if info.o_scale is not None:
        found = output_scale(g, info.pv, tuple(info.batch), buffer_of)
        if found is None or found[0] != info.o_scale:
            raise KspecInternalError(f"kernel {g.graph.get('kernel', '?')}: the attention's output scale changed "
                                     "between fusion and the kernel IR")
        o_scale = found[1]
        aux = tuple(dict.fromkeys((*aux, *(buffer_of(n) for n in found[2]))))
    return AttentionStructure(
        qk=ident(qk), softmax=ident(info.softmax), pv=ident(info.pv), q=ident(info.q), k=ident(info.k), v=ident(info.v),
        q_buffer=buffer_of(info.q), k_buffer=buffer_of(info.k), v_buffer=buffer_of(info.v),
        dtypes=(op(g, info.q).dtype, op(g, info.k).dtype, op(g, info.v).dtype), batch=tuple(info.batch),
        query=info.query, key=info.key, head=info.head, causal=bool(info.causal),
        scale=attention_scale(g, info.scale), head_dims=heads,
        dims=(("B", bdim), ("H", hdim), ("S", _extent(g, qk, info.query)), ("T", _extent(g, qk, info.key)),
              ("E", heads[0])),
        inputs_row_major=row_major, out_buffers=tuple(b for n, b in stores if n != info.lse),
        kv_shared=tuple(x for x in info.batch if info.kv_batch is not None and x not in info.kv_batch),
        p_dtypes=tuple(op(g, n).dtype for n in info.p_cast),
        score_mod=score_mod, mask=mask, aux=aux,
        kv_group=info.kv_group, kv_head=info.kv_head if info.kv_group is not None else None,
        page_table=buffer_of(info.page_table) if info.page_table is not None else None,
        page_size=info.page_size, kv_len=key_length_bound(mask, info.key, tuple(info.batch)),
        orders=tuple(info.orders),
        lse=next((b for n, b in stores if n == info.lse), None) if info.lse is not None else None,
        o_scale=o_scale)


def _attention_bwd(g, group, buffer_of, stores) -> AttentionBwdStructure:
    """The FlashAttention-4 view of a matched attention backward (compiler.fusion.AttentionBwdInfo)."""
    info = group.info
    qk = info.qk
    stored = dict(stores)
    batch = [_extent(g, qk, l) for l in info.batch]
    bdim, hdim = ([1, 1] + batch)[-2:]
    e = _label_extent(g, qk, info.q, info.head)
    mods = _attention_bwd_mods(g, info, buffer_of)
    return AttentionBwdStructure(
        q_buffer=buffer_of(info.q), k_buffer=buffer_of(info.k), v_buffer=buffer_of(info.v), o_buffer=buffer_of(info.o),
        do_buffer=buffer_of(info.do), lse_buffer=buffer_of(info.lse), dq_buffer=stored[info.dq],
        dk_buffer=stored[info.dk], dv_buffer=stored[info.dv], dtype=op(g, info.q).dtype,
        out_dtypes=tuple(op(g, n).dtype for n in (info.dq, info.dk, info.dv)), batch=tuple(info.batch),
        query=info.query, key=info.key, head=info.head, causal=bool(info.causal),
        scale=op(g, info.scale).name if info.scale is not None else None, head_dim=e,
        dims=(("B", bdim), ("H", hdim), ("S", _extent(g, qk, info.query)), ("T", _extent(g, qk, info.key)), ("E", e)),
        bottom_right=bool(info.bottom_right), layouts=_bwd_layouts(info), kv_group=info.kv_group,
        kv_head=info.kv_head, seqused_q=info.seqused_q, seqused_k=info.seqused_k, **mods)


def _bwd_layouts(info) -> tuple[tuple[str, ...], ...]:
    """The storage orders of a matched attention backward's tensors as roles; () when canonical."""
    b = info.batch
    role = {**({b[0]: "B"} if len(b) > 1 else {}), b[-1]: "H", info.query: "S", info.key: "T", info.head: "E"}
    out = tuple(tuple(role[x] for x in order) for order in info.orders)
    canon = tuple(("B", "H", s, "E")[:4] for s in ("S", "T", "T", "S", "S")) + (("B", "H", "S"),) + \
        tuple(("B", "H", s, "E") for s in ("S", "T", "T"))
    return () if out == canon else out


def _attention_bwd_mods(g, info, buffer_of) -> dict:
    """An attention backward's score modification, its derivative and the buffers they read (named by
    buffer_of), as AttentionBwdStructure fields; {} when there is none."""
    if info.mods is None:
        return {}
    from .attention_grad import bwd_scores, derivative
    found = bwd_scores(g, info.mods.root, buffer_of)
    if isinstance(found, str) or found.score_mod is None or found.qk != info.qk:
        raise KspecInternalError(f"kernel {g.graph.get('kernel', '?')}: the attention backward's score "
                                 "modification changed between fusion and the kernel IR")
    return {"score_mod": found.score_mod, "score_mod_grad": derivative(found.score_mod),
            "aux": tuple(dict.fromkeys(buffer_of(n) for n in found.aux))}


def candidate_ir(g: nx.DiGraph, group, spec_kernel: str, hints=()) -> KernelIR:
    """The IR a group would become, with provisional buffer names (inputs, params and outputs keep
    their spec names; other values are `tmp_<node>`): what fusion asks backends about."""
    infos: dict[str, IRBuffer] = {}

    def buffer_of(u) -> str:
        o = op(g, u)
        if o.kind in ("input", "param"):
            infos.setdefault(o.name, IRBuffer(o.name, o.kind, o.dtype, () if o.kind == "param" else tuple(o.shape),
                                              o.layout, packed=o.packed))
            return o.name
        name = f"tmp_{u}"
        infos.setdefault(name, IRBuffer(name, "intermediate", o.dtype, tuple(o.shape)))
        return name

    stores: list[tuple[object, str]] = []
    for n in sorted(group.nodes, key=_order):
        outside = [s for s in g.successors(n) if s not in group.nodes]
        for s in outside:
            so = op(g, s)
            if so.kind == "output":
                infos.setdefault(so.name, IRBuffer(so.name, "output", so.dtype, tuple(so.shape), so.layout,
                                                   packed=so.packed))
                stores.append((n, so.name))
        if any(op(g, s).kind != "output" for s in outside):
            stores.append((n, buffer_of(n)))
    def info(name: str) -> IRBuffer:
        if name not in infos:             # an input no op of the group reads (a packed buffer's offsets)
            buffer_of(next(n for n in g.nodes if op(g, n).kind == "input" and op(g, n).name == name))
        return infos[name]
    return build_ir(f"{spec_kernel}_candidate", spec_kernel, g, group, buffer_of, info, stores, hints)
