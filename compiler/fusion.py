"""Fusion passes: group graph nodes into kernels.

Each pass is a small function from the graph and the current groups to new groups:
  fuse_attention  contraction -> (scale) -> (score modification, mask) -> softmax over the
                  contracted-out axis -> contraction (compiler/attention.py lifts the modification)
  fuse_epilogues  elementwise/broadcast/cast chains and row/column max/sum reductions after a GEMM
  fuse_elementwise  remaining elementwise chains over one iteration space
Every other op node becomes a group of its own.  `legal_group` guards every merge: the group must
not create a cycle between kernels.  Why a node could not join a group is kept in `FusionResult.notes`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import networkx as nx

from kspec.core import dtype_bytes  # noqa: F401

from .attention import (LiftedMods, NotLiftable, group_of, is_top_left_causal, kv_group_read, lift_mods, output_scale,
                        paged_kv_read, score_path)
from .attention_grad import bwd_scores, match_grad
from .canon import GemmInfo, block_scaled_gemm_info, gathered_a, gemm_info, is_input_view, is_recomputed, is_scalar_value, value_weight
from .graph import op, operands
from .groups import FusionResult, Group, _node_order, legal_addition, legal_group, same_point  # noqa: F401
from .kir import format_epi

OPERATOR_KINDS = ("contraction", "elementwise", "broadcast", "reduction", "softmax", "cast", "gather", "const",
                  "index", "size")


@dataclass(frozen=True)
class FusionContext:
    """What fusion may ask about backends: `oracle` (backends.registry.Planner) for the archs being
    planned.  Without an oracle, fusion is purely structural (every elementwise fn and max/sum
    reduction may join an epilogue; attention always fuses): the reference executor's view."""
    oracle: object = None
    archs: tuple[str, ...] = ()
    kernel: str = "kernel"
    hints: tuple = ()                  # the kernel's schedule hints per arch (a `backend = NAME` pin binds)

    def epilogue_fns(self) -> frozenset[str] | None:
        return None if self.oracle is None else self.oracle.epilogue_fns(self.archs)

    def epilogue_reductions(self) -> frozenset[str]:
        return frozenset(("max", "sum")) if self.oracle is None else self.oracle.epilogue_reductions(self.archs)

    def epilogue_loads(self) -> frozenset[str]:
        from .kir import LOAD_KINDS
        return frozenset(LOAD_KINDS) if self.oracle is None else self.oracle.epilogue_loads(self.archs)


@dataclass(frozen=True)
class AttentionInfo:
    qk: str                            # first contraction
    softmax: str
    pv: str                            # second contraction
    scale: tuple                       # nodes applying the scale between qk and softmax
    q: str                             # the kernel inputs Q, K, V
    k: str
    v: str
    batch: tuple[str, ...]             # labels (b, h)
    query: str                         # i
    key: str                           # j
    head: str                          # e
    causal: bool
    p_cast: tuple = ()                 # casts of the probabilities before PV (e.g. `p : f16`)
    kv_batch: tuple[str, ...] | None = None   # K/V batch labels when they lack some of Q's (MQA)
    mods: LiftedMods | None = None     # the score modification and mask between the scale and softmax
    kv_group: object = None            # GQA: K/V read at head h // kv_group (param name, int or symbol)
    kv_head: object = None             # GQA: the K/V head count
    k_read: object = None              # the nodes QK^T and PV read K and V through (a gather for GQA)
    v_read: object = None
    page_table: object = None          # paged KV: the block-table input (K/V are page pools)
    page_size: object = None           # paged KV: rows per page (int or size symbol)
    orders: tuple = ()                 # Q, K, V, O: the labels in storage order; () = [batch.., seq, head]
    lse: object = None                 # `logsumexp(j)` of the softmax's operand, stored f32 (see attention_lse)
    o_scale: object = None             # `O = d[b, h / G] * PV`: the multiply (compiler.attention.output_scale)


def is_operator(g: nx.DiGraph, n) -> bool:
    return op(g, n).kind in OPERATOR_KINDS


def is_scalar_expr(g: nx.DiGraph, n) -> bool:
    """n is a scalar computed only from params and constants (evaluated per kernel, not per element)."""
    o = op(g, n)
    if o.kind in ("param", "const", "size"):
        return True
    return o.kind in ("elementwise", "cast") and not o.axes and \
        all(is_scalar_expr(g, u) for u in g.predecessors(n))


def _consumers(g, n) -> list:
    return list(g.successors(n))


def _not_fused(res: FusionResult, g: nx.DiGraph, sm, why: str) -> None:
    """An attention that stays several kernels: a note, and an error under --strict."""
    note = f"attention at {sm}: not fused: {why}"
    res.notes.append(note)
    res.unfused_attention.append((op(g, sm).span, why))


@dataclass(frozen=True)
class AttentionBwdInfo:
    """An attention backward as `kspec grad` derives it (what FlashAttention-4's backward computes):
    P = exp(mod(scale * Q K^T) (masked) - LSE), dV = P^T dO, dP = dO V^T, D = rowsum(dO * O),
    dS = scale * mod'(..) * P * (dP - D) (masked), dQ = dS K, dK = dS^T Q; mod (a score
    modification, compiler/attention_grad.py) the identity when `mods` is None.  GQA (K and V read
    at head h / G): dK and dV are the sums over each group's query heads of those per-query-head
    parts."""
    q: object                          # the input nodes
    k: object
    v: object
    o: object
    do: object
    lse: object
    dq: object                         # the stored nodes (the cast or contraction an output stores)
    dk: object
    dv: object
    batch: tuple[str, ...]             # (b, h)
    query: str                         # i
    key: str                           # j
    head: str                          # e
    causal: bool
    scale: object                      # the param node (or None: no scale)
    qk: object                         # the recomputed score contraction
    p: object                          # the exp node
    bottom_right: bool = False         # causal as `key <= query + (len_k - len_q)` (FlashAttention-4's alignment)
    orders: tuple = ()                 # labels of Q, K, V, O, dO, LSE, dQ, dK, dV in storage order
    kv_group: object = None            # GQA: K/V read at head h // kv_group (an int, a param or size name)
    kv_head: object = None             # GQA: the K/V head count (extent of K's head axis)
    mods: object = None                # a score modification (compiler.attention_grad.BwdScores, its grad set)
    seqused_q: str | None = None       # padded sequences: the i32 [B] inputs bounding the query (i < Lq[b]) ..
    seqused_k: str | None = None       # .. and the key (j < Lk[b]) (FlashAttention-4's seqused_q / seqused_k)


def _strip(g, n, kinds=("broadcast",)):
    while op(g, n).kind in kinds and len(operands(g, n)) == 1:
        ((n, _),) = operands(g, n)
    return n


def _is_const(g, n, value) -> bool:
    o = op(g, _strip(g, n))
    return o.kind == "const" and o.value == value


def _causal_cond(g, c, query: str, key: str) -> bool:
    """c is (a broadcast of) `key <= query` over index values."""
    c = _strip(g, c)
    o = op(g, c)
    if o.kind != "elementwise" or o.fn not in ("le", "ge"):
        return False
    (a, _), (b, _) = operands(g, c)
    a, b = op(g, _strip(g, a)), op(g, _strip(g, b))
    if a.kind != "index" or b.kind != "index":
        return False
    return (a.fn, b.fn) == ((key, query) if o.fn == "le" else (query, key))


def _seq_length(g, n, read=None, batch: str | None = None):
    """What n is the length of: ("size", symbol) for a size symbol, ("cu", offsets) for a packed
    sequence's own length `cu[b + 1] - cu[b]` (how the checker writes a packed axis's size), ("used",
    L) for `L[b]`, an i32 input vector read at the batch label `batch` (the labels n is read under:
    `read`; padded sequences' used lengths, FlashAttention-4's seqused); None."""
    while op(g, n).kind == "broadcast" and len(operands(g, n)) == 1:
        ((n, read),) = operands(g, n)
    o = op(g, n)
    if o.kind == "size":
        return ("size", o.fn)
    if o.kind == "input" and o.dtype == "i32" and len(o.shape) == 1 and batch is not None and \
            read is not None and tuple(read) == (batch,):
        return ("used", o.name)
    if o.kind != "elementwise" or o.fn != "sub":
        return None
    (hi, _), (lo, _) = operands(g, n)
    hi, lo = _strip(g, hi), _strip(g, lo)
    if op(g, hi).kind != "gather" or op(g, lo).kind != "gather":
        return None
    hs, ls = operands(g, hi), operands(g, lo)
    if len(hs) != 2 or len(ls) != 1 or hs[0][0] != ls[0][0] or op(g, hs[0][0]).kind != "input":
        return None
    (b, _), (one, _) = operands(g, hs[1][0]) if op(g, hs[1][0]).fn == "add" else ((None, None), (None, None))
    if b is None or op(g, _strip(g, b)).kind != "index" or not _is_const(g, one, 1) or \
            tuple(ls[0][1]) != (op(g, _strip(g, b)).fn,):
        return None
    return ("cu", op(g, hs[0][0]).name)


def _conjuncts(g, c) -> list:
    """The conditions of a conjunction `a and b and ..` (c itself when it is none)."""
    c = _strip(g, c)
    o = op(g, c)
    if o.kind == "elementwise" and o.fn == "and":
        return [x for w, _ in operands(g, c) for x in _conjuncts(g, w)]
    return [c]


def _used_lengths(g, conds, query: str, key: str, batch: str | None) -> tuple:
    """The used lengths (_seq_length's ("used", L)) the conditions bound the query and the key by
    (`query < Lq[b]`, `key < Lk[b]`), each None where none does."""
    found = {query: None, key: None}
    for c in conds:
        o = op(g, c)
        if o.kind == "elementwise" and o.fn == "lt":
            (x, _), (y, ry) = operands(g, c)
            x = _strip(g, x)
            if op(g, x).kind == "index" and op(g, x).fn in found:
                n = _seq_length(g, y, ry, batch)
                if n is not None and n[0] == "used":
                    found[op(g, x).fn] = found[op(g, x).fn] or n
    return found[query], found[key]


def _mask_kind(g, c, query: str, key: str, q_len, k_len, batch: str | None = None) -> str | None:
    """What mask condition c is: "causal" (`key <= query`), "bottom_right" (`key <= query + (k_len - q_len)`,
    FlashAttention-4's causal alignment when the lengths differ), "key_length" (`key < k_len`, the keys
    that exist in a packed sequence), "query_used" / "key_used" (`query < Lq[b]`, `key < Lk[b]`: the
    used lengths of padded sequences, FlashAttention-4's seqused_q / seqused_k); None for anything
    else.  q_len / k_len as _seq_length gives them (the used lengths where the mask bounds by them)."""
    if _causal_cond(g, c, query, key):
        return "causal"
    c = _strip(g, c)
    o = op(g, c)
    if o.kind != "elementwise" or o.fn not in ("le", "lt"):
        return None
    (x, _), (y, ry) = operands(g, c)
    xi = op(g, _strip(g, x))
    if xi.kind != "index" or xi.fn not in (query, key) or (o.fn == "le" and xi.fn != key):
        return None
    if o.fn == "lt":
        n = _seq_length(g, y, ry, batch)
        if xi.fn == query:
            return "query_used" if q_len[0] == "used" and n == q_len else None
        if k_len[0] == "used":
            return "key_used" if n == k_len else None
        return "key_length" if k_len[0] == "cu" and n == k_len else None
    y = _strip(g, y)
    if op(g, y).kind != "elementwise" or op(g, y).fn != "add":
        return None
    (i, _), (d, _) = operands(g, y)
    if op(g, _strip(g, i)).kind != "index":
        i, d = d, i
    d = _strip(g, d)
    if op(g, _strip(g, i)).kind != "index" or op(g, _strip(g, i)).fn != query or op(g, d).fn != "sub":
        return None
    (lk, rk), (lq, rq) = operands(g, d)
    return "bottom_right" if _seq_length(g, lk, rk, batch) == k_len and _seq_length(g, lq, rq, batch) == q_len \
        else None


def _read_labels(g, consumer, producer) -> tuple | None:
    """The labels under which consumer reads producer (its storage order)."""
    return next((tuple(lab) for u, lab in operands(g, consumer) if u == producer), None)


def _input(g, n):
    n = _strip(g, n)
    return n if op(g, n).kind == "input" else None


def _single_output(g, n):
    """The node an output stores: n or the one cast after it (its only consumer)."""
    cs = list(g.successors(n))
    if len(cs) == 1 and op(g, cs[0]).kind == "cast":
        n, cs = cs[0], list(g.successors(cs[0]))
    return n if len(cs) == 1 and op(g, cs[0]).kind == "output" else None


def match_attention_backward(g: nx.DiGraph, p) -> "AttentionBwdInfo | str":
    """The attention backward around the recomputed probabilities p = exp(s - lse): its info, or why
    it is not the backward FlashAttention-4 computes (a str).  Scores modified between QK^T and the
    softmax (soft-capping, ALiBi) are lifted and their dS chain checked against the mod's derivative
    (_modified_scores, compiler.attention_grad.match_grad); the rest is matched structurally."""
    ((u, _),) = operands(g, p)
    (a, _), (m, _) = operands(g, u)
    conds = []                          # where(c, .., -inf) masks on the scores, outermost first
    while op(g, a).kind == "elementwise" and op(g, a).fn == "where":
        (c, _), (x, _), (ninf, _) = operands(g, a)
        if not _is_const(g, ninf, float("-inf")):
            return "the scores are masked by something other than where(.., -inf)"
        conds.append(c)
        a = x
    s = a
    mods = _modified_scores(g, s)
    if isinstance(mods, str):
        return mods
    if mods is not None:
        s = mods.qk
    so = op(g, s)
    scale = mods.scale if mods is not None else None
    if mods is None and so.kind == "elementwise" and so.fn == "mul":
        (x, _), (y, _) = operands(g, s)
        if op(g, x).kind == "contraction":
            x, y = y, x
        if op(g, x).kind != "param":
            return "the scores are scaled by something other than one param"
        scale, s = x, y
        so = op(g, s)
    if so.kind != "contraction" or len(so.reduced) != 1 or len(so.axes) != 4:
        return "a score modification between QK^T and the softmax (FlashAttention-4's backward here takes none)"
    head = so.reduced[0]
    (q, lq), (k, lk) = operands(g, s)
    only_q, only_k = [x for x in lq if x not in lk], [x for x in lk if x not in lq]
    if len(only_q) != 1 or len(only_k) != 1:
        return "Q and K must be inputs [b, h, seq, head], K read at head h or h / G (GQA)"
    query, key = only_q[0], only_k[0]
    if so.axes.index(query) > so.axes.index(key):          # s[.., i, j]: the query axis first
        (q, lq), (k, lk), query, key = (k, lk), (q, lq), key, query
    batch = [x for x in lq if x in lk and x != head]
    k_read, kv = k, _kv_read(g, k, batch)
    if isinstance(kv, str):
        return kv
    k, group, heads = kv
    if op(g, q).kind != "input" or op(g, k).kind != "input" or head not in lq or head not in lk or \
            lq[-1] != head or lk[-1] != head or len(batch) + 2 != len(lq) or len(lq) != len(lk):
        return "Q and K must be inputs [b, h, seq, head], the head dim innermost, K read at head h or h / G (GQA)"
    if group is not None and (tuple(lq) != (*batch, query, head) or tuple(lk) != (*batch, key, head) or
                              op(g, q).packed or op(g, k).packed):
        return "GQA needs [b, h, seq, head] tensors (not another order, not packed sequences)"
    q_len = ("cu", op(g, q).packed) if op(g, q).packed else ("size", dict(zip(so.axes, so.shape))[query])
    k_len = ("cu", op(g, k).packed) if op(g, k).packed else ("size", dict(zip(so.axes, so.shape))[key])
    parts = [x for c in conds for x in _conjuncts(g, c)]          # `where(a and b, ..)` as its conditions
    bl = batch[0] if len(batch) == 2 else None                    # the batch label (used lengths are read at it)
    used_q, used_k = _used_lengths(g, parts, query, key, bl)
    if (used_q or used_k) and (op(g, q).packed or op(g, k).packed or group is not None or mods is not None):
        return ("used lengths of padded sequences (FlashAttention-4's seqused) with packed sequences, GQA or a "
                "score modification (not built yet)")
    q_len, k_len = used_q or q_len, used_k or k_len
    kinds = [_mask_kind(g, c, query, key, q_len, k_len, bl) for c in parts]
    if None in kinds or len(set(kinds)) != len(kinds) or {"causal", "bottom_right"} <= set(kinds):
        return ("the mask is not causal (key <= query, or key <= query + (T - S) aligned bottom-right as "
                "FlashAttention-4's), together with the key bound of packed sequences or the used lengths of "
                "padded ones (query < Lq[b], key < Lk[b])")
    causal = "causal" in kinds or "bottom_right" in kinds
    bottom_right = "bottom_right" in kinds
    if mods is not None and (q_len[0] == "cu" or k_len[0] == "cu"):
        return "a score modification over packed (varlen) sequences (not matched yet)"
    if (used_q or used_k) and "causal" in kinds:
        return ("a causal mask `key <= query` aligned top-left over used lengths (FlashAttention-4 aligns it "
                "bottom-right within each sequence: write `key <= query + (Lk[b] - Lq[b])`)")
    # lse: an input, or where(lse == -inf, 0, lse)
    mo = op(g, _strip(g, m))
    lse = _input(g, m)
    if lse is None and mo.kind == "elementwise" and mo.fn == "where":
        (c2, _), (z, _), (l2, _) = operands(g, _strip(g, m))
        lse = _input(g, l2)
        if lse is None or not _is_const(g, z, 0.0) or op(g, _strip(g, c2)).fn != "eq":
            lse = None
    if lse is None or op(g, lse).dtype != "f32":
        return "the log-sum-exp is not an f32 input"
    # dV = sum(i) dO * cast(p); the other consumer: p * (dP - D)
    users = list(g.successors(p))
    casts = [x for x in users if op(g, x).kind == "cast"]
    dv = dv_c = None
    for x in [*users, *(t for cc in casts for t in g.successors(cc))]:
        xo = op(g, x)
        if xo.kind == "contraction" and xo.reduced == (query,):
            dv_c = x
    if dv_c is None:
        return "no dV contraction of the probabilities"
    do = next((w for w, _ in operands(g, dv_c) if op(g, w).kind == "input"), None)
    if do is None:
        return "dV's other operand is not an input dO"
    dv = _single_output(g, dv_c) if group is None else _head_group_sum(g, dv_c, batch[-1], group, heads)
    muls = [x for x in users if op(g, x).kind == "elementwise" and op(g, x).fn == "mul"]
    if len(muls) != 1 or len(users) != 1 + len(casts) or len(casts) > 1:
        return "the probabilities have other uses than dV and the softmax backward"
    (mul,) = muls
    ((x1, _), (x2, _)) = operands(g, mul)
    sub = x2 if x1 == p else x1
    if op(g, sub).fn != "sub":
        return "the softmax backward is not P * (dP - D)"
    (dp, _), (dsum, _) = operands(g, sub)
    dsum = _strip(g, dsum)
    dpo, dso = op(g, dp), op(g, dsum)
    dp_ops = [w for w, _ in operands(g, dp)]
    v = next((w for w in dp_ops if w != do), None)
    if dpo.kind != "contraction" or dpo.reduced != (head,) or do not in dp_ops or v is None or \
            op(g, v).kind not in ("input", "gather"):
        return "dP is not dO V^T"
    if op(g, v).kind == "gather":
        kv = _kv_read(g, v, batch)
        if isinstance(kv, str) or kv[1:] != (group, heads):
            return kv if isinstance(kv, str) else "K and V are read with different head groupings"
        v = kv[0]
    elif group is not None:
        return "K and V are read with different head groupings"
    ds_ops = [w for w, _ in operands(g, dsum)]
    o_in = next((w for w in ds_ops if w != do), None)
    if dso.kind != "contraction" or dso.reduced != (head,) or do not in ds_ops or o_in is None or \
            op(g, o_in).kind != "input":
        return "D is not the row sum of dO * O (O an input)"
    # mask (causal), scale, cast -> dS; dQ = dS K, dK = dS^T Q
    n = mul
    if mods is not None:
        found = match_grad(g, mul, mods, conds, op(g, scale).name if scale is not None else None,
                           lambda x: op(g, x).name or str(x))
        if isinstance(found, str):
            return found
        n, mods = found
    while mods is None:
        cs = list(g.successors(n))
        if len(cs) != 1:
            break
        co = op(g, cs[0])
        if co.kind == "elementwise" and co.fn == "where":
            (c3, _), (x, _), (z, _) = operands(g, cs[0])
            if x != n or not _is_const(g, z, 0.0) or any(_mask_kind(g, c4, query, key, q_len, k_len, bl) not in kinds
                                                         for c4 in _conjuncts(g, c3)):
                return "dS is masked by something other than the scores' mask"
        elif co.kind == "elementwise" and co.fn == "mul":
            others = [w for w, _ in operands(g, cs[0]) if w != n]
            if others != [scale]:
                return "dS is scaled by something other than the scores' scale"
        elif co.kind != "cast":
            break
        n = cs[0]
    ds_users = list(g.successors(n))
    if len(ds_users) != 2 or not all(op(g, x).kind == "contraction" for x in ds_users):
        return "dS does not feed exactly dQ and dK"
    dq = dk = None
    for x in ds_users:
        other = next((w for w, _ in operands(g, x) if w != n), None)
        if other == k_read and op(g, x).reduced == (key,):
            dq = _single_output(g, x)
        elif other == q and op(g, x).reduced == (query,):
            dk = _single_output(g, x) if group is None else _head_group_sum(g, x, batch[-1], group, heads)
    if None in (dq, dk, dv):
        return ("dQ, dK and dV must each be stored (as computed or cast) to an output" if group is None else
                f"dQ must be stored (as computed or cast) to an output, dK and dV as the sums over each group's "
                f"query heads, sum({batch[-1]}) where({batch[-1]} / G == kh, part, 0), K/V head kh")
    for w in (q, k, v, o_in, do):
        if op(g, w).dtype not in ("f16", "bf16") or op(g, w).dtype != op(g, q).dtype:
            return "Q, K, V, O and dO must be one of f16/bf16"
    # storage orders (labels): the inputs as read, the outputs as stored (GQA: canonical, checked above)
    lse_order = _read_labels(g, next(iter(g.successors(lse))), lse)
    if group is not None and lse_order != (*batch, query):
        return "GQA needs the log-sum-exp stored [b, h, seq]"
    orders = () if group is not None else (
        lq, lk, _read_labels(g, dp, v), _read_labels(g, dsum, o_in), _read_labels(g, dp, do), lse_order,
        *(_read_labels(g, next(iter(g.successors(x))), x) for x in (dq, dk, dv)))
    if None in orders or any(o[-1] != head for i, o in enumerate(orders) if i != 5):
        return "Q, K, V, O, dO, dQ, dK and dV must be stored with the head dim innermost"
    return AttentionBwdInfo(q, k, v, o_in, do, lse, dq, dk, dv, tuple(batch), query, key, head, causal, scale, s, p,
                            bottom_right, tuple(tuple(o) for o in orders), group,
                            heads if group is not None else None, mods, used_q and used_q[1], used_k and used_k[1])


def _kv_read(g, n, batch):
    """K (or V) as an attention backward reads it: (the input node, the GQA group, the K/V head
    count) for K read at head `h / G` (compiler.attention.kv_group_read), (n, None, None) for any other
    node; the reason (a str) for a gather that is not such a read."""
    if op(g, n).kind != "gather":
        return n, None, None
    found = kv_group_read(g, n, batch[-1]) if batch else None
    if found is None:
        return "K and V must be inputs [b, h, seq, head], read at head h or h / G (GQA), not through another gather"
    src, group, heads, _nodes = found
    return src, group, heads


def _head_group_sum(g, part, head: str, group, heads):
    """The node an output stores when dK (dV) of a GQA backward is `part` (one query head's share,
    [b, h, j, e]) summed over the query heads of each K/V head's group, as `kspec grad` writes it:
    `sum(h) where(h / G == kh, part[b, h, j, e], 0)` stored as computed or cast to an output
    [b, kh, j, e] with kh over the K/V heads; None when it is not that."""
    cs = list(g.successors(part))
    if len(cs) != 1 or op(g, cs[0]).kind != "broadcast":
        return None
    bc = cs[0]
    ((_, pl),) = operands(g, bc)
    if head not in op(g, part).axes:
        return None
    hl = pl[op(g, part).axes.index(head)]              # the part's head axis, as the sum names it
    cs = list(g.successors(bc))
    if len(cs) != 1 or op(g, cs[0]).kind != "elementwise" or op(g, cs[0]).fn != "where":
        return None
    (c, _), (x, _), (z, _) = operands(g, cs[0])
    red = list(g.successors(cs[0]))
    if x != bc or not _is_const(g, z, 0.0) or len(red) != 1:
        return None
    (red,) = red
    ro = op(g, red)
    if ro.kind != "reduction" or ro.fn != "sum" or ro.reduced != (hl,):
        return None
    c = _strip(g, c)
    if op(g, c).kind != "elementwise" or op(g, c).fn != "eq":
        return None
    sides = [_strip(g, w) for w, _ in operands(g, c)]
    idx = [w for w in sides if op(g, w).kind == "index"]
    fds = [w for w in sides if op(g, w).kind == "elementwise" and op(g, w).fn == "floordiv"]
    if len(idx) != 1 or len(fds) != 1:
        return None
    kl = op(g, idx[0]).fn                               # the K/V head label of the sum
    found = group_of(g, fds[0], op(g, fds[0]).axes, {a: a for a in op(g, fds[0]).axes}, hl)
    if found is None or found[0] != group or kl not in ro.axes or ro.shape[ro.axes.index(kl)] != heads:
        return None
    stored = _single_output(g, red)
    if stored is None:
        return None
    ((_, ol),) = [(u, l) for s in g.successors(stored) if op(g, s).kind == "output" for u, l in operands(g, s)]
    return stored if tuple(ol) == tuple(kl if l == hl else l for l in pl) else None


def _modified_scores(g: nx.DiGraph, a):
    """None when the recomputed softmax operand `a` (its where(.., -inf) masks taken off) is the plain
    one (`[param *] QK^T`), else its score modification lifted (compiler.attention_grad.BwdScores) or
    why it cannot be (a str)."""
    if op(g, a).kind == "contraction" or (op(g, a).kind == "elementwise" and op(g, a).fn == "mul" and
                                          any(op(g, w).kind == "contraction" for w, _ in operands(g, a))):
        return None
    found = bwd_scores(g, a, lambda n: op(g, n).name or str(n))
    if isinstance(found, str):
        return found
    if found.mask is not None or found.score_mod is None:
        return ("the scores are masked inside the score modification (FlashAttention-4 masks the modified "
                "scores)" if found.mask is not None else "between QK^T and the softmax, no score modification "
                "FlashAttention-4's backward takes")
    return found


def fuse_attention_backward(g: nx.DiGraph, res: FusionResult, ctx: FusionContext = FusionContext()) -> None:
    """An attention backward (what `kspec grad` derives: probabilities recomputed as exp(s - lse) from
    a contraction's scores, multiplied into the dV contraction) becomes one `attention_bwd` group
    when a backend implements it (FlashAttention-4's backward: preprocess, main, postprocess);
    otherwise it is noted, with the reason, and refused by --strict like an unfused forward attention.
    Without an oracle (the reference executor's view) it stays unfused."""
    for n in nx.topological_sort(g):
        o = op(g, n)
        if o.kind != "elementwise" or o.fn != "exp":
            continue
        ((u, _),) = operands(g, n)
        if op(g, u).fn != "sub" or not any(op(g, a).kind == "contraction" for a in nx.ancestors(g, u)):
            continue
        users = [s for s in g.successors(n)]
        users += [t for s in users if op(g, s).kind == "cast" for t in g.successors(s)]
        if not any(op(g, s).kind == "contraction" for s in users):
            continue
        base = ("it is an attention backward (probabilities recomputed as exp(s - lse) feed the dV "
                "contraction); ")
        info = match_attention_backward(g, n)
        if isinstance(info, str):
            _not_fused(res, g, n, base + f"not FlashAttention-4's backward ({info}), so the scores and "
                       "probabilities go through memory")
            return
        ins = {info.q, info.k, info.v, info.o, info.do, info.lse}
        nodes = set()
        for out in (info.dq, info.dk, info.dv):
            nodes |= {out} | {a for a in nx.ancestors(g, out)
                              if a not in ins and op(g, a).kind not in ("input", "param", "const", "index", "size")}
        inside_ok = all(s in nodes or op(g, s).kind == "output" for x in nodes for s in g.successors(x))
        if not inside_ok or legal_group(g, nodes) or any(res.group_of(x) for x in nodes):
            _not_fused(res, g, n, base + "its intermediates are used elsewhere, so the scores and probabilities "
                       "go through memory")
            return
        group = Group(f"g{len(res.groups)}", "attention_bwd", nodes, info.qk, info)
        why = "no backend was asked (structural planning)"
        if ctx.oracle is not None:
            from .ir_build import candidate_ir
            why = ctx.oracle.can_fuse(candidate_ir(g, group, ctx.kernel, ctx.hints), ctx.archs)
        if why:
            _not_fused(res, g, n, base + f"no backend implements it as one kernel ({why}), so the scores and "
                       "probabilities go through memory")
            return
        res.groups.append(group)
        return


def fuse_attention(g: nx.DiGraph, res: FusionResult, ctx: FusionContext = FusionContext()) -> None:
    """contraction(e) -> [scale] -> [score modification] -> softmax(j) -> contraction(j) becomes one
    attention group; the modification (bias, ALiBi, softcap, a `where(.., -inf)` mask) is lifted
    into expressions (compiler/attention.py), and K/V read at head `h / G` into a GQA group."""
    for sm in [n for n in nx.topological_sort(g) if op(g, n).kind == "softmax"]:
        o = op(g, sm)
        axis = o.fn
        sp = score_path(g, sm)
        if isinstance(sp, str):
            res.notes.append(f"softmax {sm}: not attention ({sp})")
            continue
        qk = sp.qk
        p_cast: list = []
        last = sm
        while len(_consumers(g, last)) == 1 and op(g, _consumers(g, last)[0]).kind == "cast":
            last = _consumers(g, last)[0]
            p_cast.append(last)
        consumers = _consumers(g, last)
        if len(consumers) != 1 or op(g, consumers[0]).kind != "contraction":
            res.notes.append(f"softmax {sm}: not attention (its result is not consumed by one contraction)")
            continue
        pv = consumers[0]
        po = op(g, pv)
        if po.reduced != (axis,):
            res.notes.append(f"softmax {sm}: not attention (the second contraction does not reduce over '{axis}')")
            continue
        lse, why_not = attention_lse(g, sm, sp)
        if why_not:
            res.notes.append(f"attention at {sm}: log-sum-exp not fused: {why_not}")
        # the scores are read only inside the kernel: by the scale, the mods and the softmax
        inside = {*sp.scale, *sp.path, sm, *([lse] if lse is not None else [])}
        multi = [n for n in [qk, *sp.scale] if any(c not in inside for c in _consumers(g, n))] + \
                [n for n in [sm, *p_cast] if len(_consumers(g, n)) != 1] + \
                [n for n in [qk, *sp.scale, sm, *p_cast] if any(op(g, c).kind == "output" for c in _consumers(g, n))]
        if multi:
            _not_fused(res, g, sm, f"the score matrix ({op(g, multi[0]).name or multi[0]}) is used elsewhere, "
                       "so it must be written to memory")
            continue
        qo = op(g, qk)
        # the attention's labels are the softmax's: [batch.., i, j]; the QK contraction may hold
        # them in another order (it follows Q's storage order: Q[b, i, h, e] gives [b, i, h, j])
        if len(qo.reduced) != 1 or len(o.axes) < 2 or o.axes[-1] != axis or set(qo.axes) != set(o.axes):
            _not_fused(res, g, sm, "scores must be [batch.., i, j] with one head index")
            continue
        query, head = o.axes[-2], qo.reduced[0]
        batch = o.axes[:-2]
        (uq, lq), (uk, lk) = operands(g, qk)
        if axis in lq:
            (uq, lq), (uk, lk) = (uk, lk), (uq, lq)
        (up, lp), (uv, lv) = operands(g, pv)
        if up != last:
            (up, lp), (uv, lv) = (uv, lv), (up, lp)
        paged = _paged_reads(g, (uk, lk), (uv, lv), axis, head, tuple(batch))
        if isinstance(paged, str):
            _not_fused(res, g, sm, paged)
            continue
        if paged is not None:
            lk = lv = (*batch, axis, head)      # the logical K/V a paged read gives
        # Q, K, V and O in any storage order of their axes ([b, h, s, e] or FlashAttention's
        # [b, s, h, e]) with the head dim innermost; K and V alike
        kv_batch = tuple(x for x in lk if x not in (axis, head))
        # an output scale of the batch labels (`v_descale[b, h / G] * sum(j) p V`) joins the kernel
        osc = output_scale(g, pv, tuple(batch), lambda n: op(g, n).name or str(n))
        o_last = osc[0] if osc is not None else pv
        o_order = _stored_order(g, o_last)
        shapes_ok = (_same_axes(lq, (*batch, query, head)) and _same_axes(lk, (*kv_batch, axis, head))
                     and lv == lk and _is_subsequence(kv_batch, tuple(batch))
                     and set(po.axes) == {*batch, query, head} and _same_axes(o_order, (*batch, query, head)))
        if not shapes_ok:
            _not_fused(res, g, sm, "Q, K, V and O must be [batch.., seq, head] (in any order, the head dim "
                       "innermost), K and V alike, with K/V batch axes among Q's (got "
                       f"Q{list(lq)}, K{list(lk)}, V{list(lv)}, O{list(o_order)})")
            continue
        canonical = ((*batch, query, head), (*kv_batch, axis, head), (*kv_batch, axis, head), (*batch, query, head))
        orders = (tuple(lq), tuple(lk), tuple(lv), tuple(o_order))
        orders = () if orders == canonical else orders
        if o.causal is not None and o.causal != query:
            _not_fused(res, g, sm, f"causal index '{o.causal}' is not the query index")
            continue
        # K and V: kernel inputs, or (GQA) inputs read at head h / G
        # K and V as they are, or (GQA) inputs read at head h / G inside the kernel; another
        # gather (e.g. through a block table) runs as a kernel of its own before the attention
        reads = {}
        for role, u, labels in (("K", uk, lk), ("V", uv, lv)):
            found = kv_group_read(g, u, batch[-1]) if len(batch) >= 1 and len(_consumers(g, u)) == 1 else None
            if paged is not None:
                src, _bt, _page, pnodes, group, heads = paged[role]
                found = (src, group, heads, pnodes)
            reads[role] = found if found is not None else (u, None, None, set())
        (k_in, k_group, k_heads, k_nodes), (v_in, v_group, v_heads, v_nodes) = reads["K"], reads["V"]
        if (k_group, k_heads) != (v_group, v_heads):
            _not_fused(res, g, sm, "K and V are read with different head groupings")
            continue
        try:
            mods = lift_mods(g, sm, sp, (*batch, query, axis), lambda n: op(g, n).name or str(n),
                             frozenset([lse] if lse is not None else []))
        except NotLiftable as e:
            _not_fused(res, g, sm, f"between the QK contraction and the softmax, {e}")
            continue
        top_left = is_top_left_causal(mods.mask, query, axis) and \
            qo.shape[qo.axes.index(axis)] == qo.shape[qo.axes.index(query)]
        if top_left:
            mods = LiftedMods(mods.score_mod, None, mods.aux, mods.nodes)
        info = AttentionInfo(qk, sm, pv, tuple(sp.scale), uq, k_in, v_in, tuple(batch), query, axis, head,
                             o.causal == query or top_left, tuple(p_cast),
                             None if kv_batch == tuple(batch) else kv_batch, mods, k_group, k_heads, uk, uv,
                             *((paged["K"][1], paged["K"][2]) if paged is not None else (None, None)), orders)
        if lse is not None:
            # the log-sum-exp's storage order joins the orders when it or they are not canonical
            lse_order = tuple(op(g, lse).axes)
            if orders or lse_order != (*batch, query):
                orders = (*(orders or canonical), lse_order)
            info = replace(info, lse=lse, orders=orders)
        nodes = {qk, sm, pv, *sp.scale, *p_cast, *mods.nodes, *k_nodes, *v_nodes, *([lse] if lse is not None else [])}
        if osc is not None:
            nodes |= {osc[0], *osc[3]}
            info = replace(info, o_scale=osc[0])
        # the output cast after PV (or after its scale) belongs to the kernel too
        for c in _consumers(g, o_last):
            if op(g, c).kind == "cast" and len(_consumers(g, o_last)) == 1:
                nodes.add(c)
        if legal_group(g, nodes):
            _not_fused(res, g, sm, str(legal_group(g, nodes)))
            continue
        group = Group(f"g{len(res.groups)}", "attention", nodes, qk, info)
        if ctx.oracle is not None:
            from .ir_build import candidate_ir
            why = ctx.oracle.can_fuse(candidate_ir(g, group, ctx.kernel, ctx.hints), ctx.archs)
            if why:
                lifted = [f"{what}: {format_epi(e)}" for what, e in
                          (("score_mod", mods.score_mod), ("mask", mods.mask)) if e is not None]
                lifted += [f"kv heads: h // {k_group}"] if k_group is not None else []
                res.notes.append(f"attention at {sm}: not fused ({why}); using the unfused plan"
                                 + (f" (lifted {'; '.join(lifted)})" if lifted else ""))
                res.unfused_attention.append((o.span, f"no backend implements it ({why})"))
                continue
        res.groups.append(group)


def attention_lse(g: nx.DiGraph, sm, sp):
    """The `L[b.., i] = logsumexp(j) m[b.., i, j]` that reads exactly the softmax's operand m (the
    scaled, modified, masked scores) at the same points and is stored as it is into an f32 output
    over the attention's [batch.., query]: the attention kernel writes it (AttentionStructure.lse,
    FA4's LSE): (that node, None); (None, None) when no logsumexp reads the operand; (None, the
    reason) when one does but cannot be the attention's: it then reads the scores from memory like
    any other consumer (and the attention does not fuse)."""
    o = op(g, sm)
    ((root, labels),) = operands(g, sm)
    readers = [c for c in _consumers(g, root) if c != sm]
    lses = [c for c in readers if op(g, c).kind == "reduction" and op(g, c).fn == "logsumexp"]
    if not lses:
        return None, None
    if len(readers) != 1:
        return None, "the scores have other readers besides one logsumexp"
    (c,) = lses
    co = op(g, c)
    outs = _consumers(g, c)
    if o.causal is not None:
        # `softmax(j, causal=i) s` masks inside the softmax; `logsumexp(j) s` sums the unmasked scores
        return None, (f"logsumexp({co.reduced[0]}) of the scores of a `causal=` softmax is over the unmasked "
                      "scores, not the attention's log-sum-exp (write the mask with where(.., -inf) and take both "
                      "of it)")
    if co.reduced != (o.fn,) or [l for _, l in operands(g, c)] != [labels]:
        return None, (f"the logsumexp reduces over {', '.join(co.reduced)}, not over the softmax's {o.fn} at the "
                      "same points")
    want = tuple(o.axes[:-1])                # the attention's [batch.., query] (the QK contraction may
    #                                          hold them in Q's storage order)
    if set(co.axes) != set(want) or len(co.axes) != len(want) or len(outs) != 1 or \
            op(g, outs[0]).kind != "output" or op(g, outs[0]).dtype != "f32":
        return None, (f"the log-sum-exp it can write is an f32 output over [{', '.join(want)}] (any order) stored "
                      "as computed (not converted, not used further)")
    return c, None


def _paged_reads(g, k, v, key: str, head: str, batch: tuple[str, ...]):
    """K and V both read through one block table (a paged KV cache, compiler.attention.paged_kv_read):
    {"K": read, "V": read}; None when neither is; the reason (str) when they cannot fuse as one."""
    reads = {role: paged_kv_read(g, u, labels, key, batch) if len(_consumers(g, u)) == 1 else None
             for role, (u, labels) in (("K", k), ("V", v))}
    if reads["K"] is None and reads["V"] is None:
        return None
    if reads["K"] is None or reads["V"] is None:
        return "only one of K and V is read through a block table (a paged KV cache pages both)"
    if reads["K"][1:3] != reads["V"][1:3]:
        return "K and V are read through different block tables or page sizes"
    logical = {*batch, key, head}
    if set(k[1]) != logical or set(v[1]) != logical:
        return (f"a paged K/V read must give every label of [{', '.join((*batch, key, head))}] (got "
                f"K{list(k[1])}, V{list(v[1])})")
    return reads


def _same_axes(labels, want: tuple) -> bool:
    """labels holds the labels of want, in any order, with want's last (the head dim) last."""
    return len(labels) == len(want) and set(labels) == set(want) and tuple(labels)[-1] == want[-1]


def _stored_order(g, pv) -> tuple:
    """The attention's labels in the storage order of its output: the axes of the value an output
    node stores (PV, or the cast after it), named as the PV contraction names them."""
    n = pv
    while len(_consumers(g, n)) == 1 and op(g, _consumers(g, n)[0]).kind == "cast":
        n = _consumers(g, n)[0]
    return tuple(op(g, n).axes)


def _is_subsequence(sub: tuple, seq: tuple) -> bool:
    it = iter(seq)
    return all(x in it for x in sub)


def _is_full(g, n, gi: GemmInfo, gemm_axes: set) -> bool:
    return set(op(g, n).axes) == gemm_axes


def fuse_epilogues(g: nx.DiGraph, res: FusionResult, ctx: FusionContext = FusionContext()) -> None:
    """Grow each GEMM's group over the elementwise ops and row/column reductions that consume it."""
    for c in nx.topological_sort(g):
        if op(g, c).kind != "contraction" or res.group_of(c):
            continue
        gi = gemm_info(g, c)
        if isinstance(gi, str):
            bs = block_scaled_gemm_info(g, c)
            if isinstance(bs, GemmInfo):
                group = _block_scaled_group(g, res, c, bs, ctx)
                if group is not None:
                    _add_epilogue_loads(g, res, group)
                    res.groups.append(Group(f"g{len(res.groups)}", "gemm", group, c, bs))
                continue
            res.notes.append(f"contraction {c}: not a GEMM ({gi}); it runs as a separate generic kernel")
            continue
        ga = gathered_a(g, gi)
        if ga is not None:
            group = _gathered_group(g, res, c, ga, ctx)
            if group is not None:
                _add_epilogue_loads(g, res, group)
                res.groups.append(Group(f"g{len(res.groups)}", "gemm", group, c, ga))
                continue
        group, gi = _dual_or_single(g, res, c, gi, ctx)
        group = _recompute_cheap_values(g, res, group, c)
        group = _keep_a_stored_result(g, res, group, c)
        _add_epilogue_loads(g, res, group)
        group = _split_unbuildable_reductions(g, res, group, c, gi, ctx)
        res.groups.append(Group(f"g{len(res.groups)}", "gemm", group, c, gi))


def _gathered_group(g: nx.DiGraph, res: FusionResult, c, gi: GemmInfo, ctx: FusionContext) -> set | None:
    """The group of a GEMM whose A rows are gathered (canon.gathered_a): the gather joins it (the
    kernel loads A's rows through the index), when a GEMM backend builds that on every arch; else
    None, with a note (the gather then runs as a kernel of its own)."""
    core = {c, gi.gather[0]}
    if res.group_of(gi.gather[0]) or legal_group(g, core):
        return None
    group = _grow_epilogue(g, res, core, c, gi, ctx)
    group = _without_reductions(g, group, c) if any(op(g, n).kind == "reduction" for n in group) else group
    if ctx.oracle is not None:
        from .ir_build import candidate_ir
        scalars = {u for n in group for u in nx.ancestors(g, n) if is_scalar_value(g, u) and res.group_of(u) is None}
        why = ctx.oracle.can_fuse(candidate_ir(g, Group("candidate", "gemm", group | scalars, c, gi), ctx.kernel,
                                               ctx.hints), ctx.archs)
        if why is not None:
            res.notes.append(f"contraction {c}: A's rows gathered through {op(g, gi.gather[1]).name}, which no GEMM "
                             f"backend loads on {', '.join(ctx.archs)} ({why}); the gather runs as a kernel of its own")
            return None
    res.notes.append(f"contraction {c}: A's rows gathered through {op(g, gi.gather[1]).name} inside the GEMM")
    return group


def _block_scaled_group(g: nx.DiGraph, res: FusionResult, c, gi: GemmInfo, ctx: FusionContext) -> set | None:
    """The group of a block-scaled GEMM (block_scaled_gemm_info): the contraction, the product inside
    its sum (the scale gathers and their `k / bk` subscripts included) and its epilogue, when a GEMM
    backend builds it on every arch (asked through the oracle); else None, with a note (the ops then
    run as the kernels they are, each with its reason)."""
    core = {c, *gi.inner}
    for sc in gi.scales:
        core.add(sc.gather)
        core |= {u for u, _ in operands(g, sc.gather)[1:] if op(g, u).kind == "elementwise"}
    if any(res.group_of(n) for n in core) or legal_group(g, core):
        return None
    group = _grow_epilogue(g, res, core, c, gi, ctx)
    group = _without_reductions(g, group, c) if any(op(g, n).kind == "reduction" for n in group) else group
    desc = ", ".join(f"{op(g, sc.source).name}[{sc.operand}: {sc.block_mn}x{sc.block_k}]" for sc in gi.scales)
    if ctx.oracle is not None:
        from .ir_build import candidate_ir
        scalars = {u for n in group for u in nx.ancestors(g, n) if is_scalar_value(g, u) and res.group_of(u) is None}
        why = ctx.oracle.can_fuse(candidate_ir(g, Group("candidate", "gemm", group | scalars, c, gi), ctx.kernel,
                                               ctx.hints), ctx.archs)
        if why is not None:
            res.notes.append(f"contraction {c}: a block-scaled GEMM ({desc}) that no GEMM backend builds on "
                             f"{', '.join(ctx.archs)} ({why}); its ops run as separate kernels")
            return None
    res.notes.append(f"contraction {c}: a block-scaled GEMM, scales {desc} applied inside the sum")
    return group


def _grow_epilogue(g: nx.DiGraph, res: FusionResult, group: set, c, gi: GemmInfo, ctx: FusionContext) -> set:
    """The GEMM group `group` (the contraction c, or c and its dual partner) grown over the ops that
    consume it and can run in its epilogue."""
    axes = set(op(g, c).axes)
    depth: dict = {}                 # ops on the longest path from the accumulator to each epilogue node
    changed = True
    while changed:
        changed = False
        candidates = sorted({s for n in group for s in g.successors(n)} - group, key=_node_order)
        for s in candidates:
            so = op(g, s)
            if so.kind == "output" or res.group_of(s):
                continue
            d = 1 + max((depth.get(u, 0) for u in g.predecessors(s) if u in group), default=0)
            why = _epilogue_reject(g, s, group, gi, axes, ctx) if d <= MAX_EPILOGUE_DEPTH else \
                f"the epilogue is already {MAX_EPILOGUE_DEPTH} ops deep (the rest runs as a kernel of its own)"
            if why:
                note = f"{so.label()} not fused into the GEMM at {c}: {why}"
                if note not in res.notes:
                    res.notes.append(note)
                continue
            trial = group | {s}
            # producers of s from outside must be inputs/params/consts or broadcasts of those
            if legal_group(g, trial):
                res.notes.append(f"{so.label()} not fused into the GEMM at {c}: {legal_group(g, trial)}")
                continue
            # (the scalars it reads join at the end of fusion: see attach_scalars)
            for u, labels in operands(g, s):
                cone = _input_cone(g, res, u, labels, gi, trial, ctx)
                if cone and legal_group(g, trial | cone) is None:
                    trial |= cone       # e.g. `0.5 * R[m, n]` computed in the epilogue, not a kernel
            depth[s] = d
            group = trial
            changed = True
    return _no_condition_leaves(g, group, {c, gi.anchor2} - {None})


def _no_condition_leaves(g: nx.DiGraph, group: set, anchors: set) -> set:
    """The group without the conditions (bool values) that a consumer outside it would read: a
    condition is never stored (it is recomputed by the kernel that uses it), so it stays with its
    consumer; so do the ops that then feed only such conditions."""
    group = set(group)
    changed = True
    while changed:
        changed = False
        for n in sorted(group, key=_node_order):
            if n in anchors:
                continue
            o = op(g, n)
            outside = [s for s in g.successors(n) if s not in group and op(g, s).kind != "output"]
            if o.dtype == "bool" and outside:
                group.discard(n)
                changed = True
    return group


# The most ops on a path through a GEMM epilogue: its expression tree is built, hashed and emitted
# recursively, and no real epilogue comes near (a bias, an activation, a residual, a cast).
MAX_EPILOGUE_DEPTH = 64


def _dual_partner(g: nx.DiGraph, res: FusionResult, c, gi: GemmInfo):
    """(c2, its GemmInfo) for another ungrouped contraction that multiplies the same A operand (node,
    labels, layout) over the same output axes and reduced labels by a B operand of the same dtype,
    layout and shape as c's: the two can share every A tile (a dual GEMM); None if there is none."""
    co, bo = op(g, c), op(g, gi.b)
    for c2 in sorted(g.nodes, key=_node_order):
        o2 = op(g, c2)
        if c2 == c or o2.kind != "contraction" or res.group_of(c2) is not None or o2.axes != co.axes \
                or o2.dtype != co.dtype or o2.reduced != co.reduced:
            continue
        gi2 = gemm_info(g, c2)
        if isinstance(gi2, str) or gi2.a != gi.a or gi2.b == gi.b:
            continue
        if (gi2.m, gi2.n, gi2.k, gi2.batch, gi2.a_layout, gi2.b_layout, gi2.m_fold, gi2.k_fold) != \
                (gi.m, gi.n, gi.k, gi.batch, gi.a_layout, gi.b_layout, gi.m_fold, gi.k_fold):
            continue
        b2 = op(g, gi2.b)
        if (b2.kind, b2.dtype, tuple(b2.shape)) != (bo.kind, bo.dtype, tuple(bo.shape)) or b2.kind != "input":
            continue
        return c2, gi2
    return None


def _dual_or_single(g: nx.DiGraph, res: FusionResult, c, gi: GemmInfo, ctx: FusionContext):
    """The epilogue group of the GEMM at c, and its GemmInfo.  When another contraction shares c's A
    operand and the two results are combined element by element in the epilogue and nowhere else
    (SwiGLU: silu(X Wg^T) * (X Wu^T)), both run as one dual GEMM that reads each A tile once, if a
    GEMM backend builds it on every arch (asked through the oracle); else c's group alone, with a note."""
    partner = _dual_partner(g, res, c, gi)
    if partner is None:
        return _grow_epilogue(g, res, {c}, c, gi, ctx), gi
    c2, gi2 = partner
    dual = replace(gi, anchor2=c2, b2=gi2.b)
    notes = len(res.notes)
    group = _grow_epilogue(g, res, {c, c2}, c, dual, ctx)
    combined = any(n not in (c, c2) and c in nx.ancestors(g, n) and c2 in nx.ancestors(g, n) for n in group)
    why = None
    if not combined:
        why = "their results are not combined in the epilogue"
    elif any(s not in group for s in g.successors(c2)):
        why = f"the result of {c2} is also used outside the epilogue"
    elif ctx.oracle is not None:
        from .ir_build import candidate_ir
        scalars = {u for n in group for u in nx.ancestors(g, n) if is_scalar_value(g, u) and res.group_of(u) is None}
        why = ctx.oracle.can_fuse(candidate_ir(g, Group("candidate", "gemm", group | scalars, c, dual), ctx.kernel, ctx.hints),
                                  ctx.archs)
        why = why and f"no GEMM backend builds the dual GEMM ({why})"
    if why is None:
        res.notes.append(f"contractions {c} and {c2} share their A operand {op(g, gi.a).name or gi.a}: one dual GEMM "
                         "(each A tile is read once, both accumulators feed the epilogue)")
        return group, dual
    del res.notes[notes:]
    if combined:        # (GEMMs that merely share an input, e.g. Q/K/V projections, need no note)
        res.notes.append(f"contractions {c} and {c2} share their A operand {op(g, gi.a).name or gi.a} but stay "
                         f"separate GEMMs: {why}")
    return _grow_epilogue(g, res, {c}, c, gi, ctx), gi


def _epilogue_reject(g, s, group: set, gi: GemmInfo, gemm_axes: set,
                     ctx: FusionContext = FusionContext()) -> str | None:
    so = op(g, s)
    if so.kind == "reduction":
        reductions = ctx.epilogue_reductions()
        if so.fn not in reductions:
            return (f"'{so.fn}' reductions are not fused into epilogues "
                    f"(only {' and '.join(sorted(reductions)) or 'none'})")
        ((src, labels),) = operands(g, s)
        if set(labels) != gemm_axes:
            return "the reduction's operand is not the full GEMM result"
        if is_full_reduction(so, gi):
            return None     # e.g. an FP8 recipe's amax: one value per batch entry, atomics across CTAs
        if len(so.reduced) != 1 or so.reduced[0] not in (gi.m, gi.n) or \
                labels.index(so.reduced[0]) < len(labels) - 2:
            return "an epilogue reduction must reduce over the GEMM's row or column axis"
        if gi.m_fold and so.reduced[0] == gi.m:
            return f"it reduces over '{gi.m}' only, but the GEMM folds [{', '.join(gi.m_labels)}] into M"
        if so.axes != tuple(x for x in (*gi.batch, *gi.m_labels, gi.n) if x != so.reduced[0]):
            return "the reduction's result is not stored in the GEMM result's axis order"
        return None
    if so.kind not in ("elementwise", "broadcast", "cast"):
        return f"{so.kind} ops cannot be fused into an epilogue"
    if so.kind == "broadcast" and is_reduction_store_view(g, s, gi):
        if any(u not in group for u, _ in operands(g, s)):
            return "it broadcasts a full reduction that is not fused"
        return None         # `amax[z] = max(m, n) ..` with z of extent 1: the reduction's store
    why = _store_order_reject(g, s, gi)
    if why:
        return why
    fns = ctx.epilogue_fns()
    if so.kind == "elementwise" and fns is not None and so.fn not in fns:
        return f"'{so.fn}' has no epilogue implementation"
    if set(so.axes) != gemm_axes:
        return f"its iteration space [{', '.join(so.axes)}] differs from the GEMM's"
    for u, labels in operands(g, s):
        if u in group:
            if op(g, u).kind == "reduction":
                return "it consumes an epilogue reduction, which is only complete after the kernel"
            if not same_point(g, u, labels):
                return f"it reads {op(g, u).name or u} at another element (a transposed or permuted read)"
            continue
        uo = op(g, u)
        if is_scalar_expr(g, u):
            continue
        if uo.kind == "broadcast":
            (src, slabels), = operands(g, u)
            why = _vector_reject(g, src, slabels, gi, ctx)
            if why:
                return why
            continue
        if set(labels) == gemm_axes and tuple(labels) == (*gi.batch, *gi.m_labels, gi.n):
            if _storage_layout(g, u) == "col":
                return f"operand {uo.name or u} is column-major; an epilogue reads full tensors row-major"
            continue  # a full tensor (e.g. a residual, or a cast of one) read row-major
        if set(labels) == gemm_axes:
            return f"operand {uo.name or u} is read with its axes in another order than the GEMM result's"
        return f"operand {uo.name or u} is not a row/column vector, scalar or full [m, n] tensor"
    return None


def is_full_reduction(so, gi: GemmInfo) -> bool:
    """A reduction over every non-batch axis of the GEMM result (`max(m, n) abs(y[m, n])`): one
    value per batch entry, combined across the CTAs of the GEMM with atomics."""
    return so.kind == "reduction" and not gi.m_fold and len(so.reduced) == 2 and \
        set(so.reduced) == {gi.m, gi.n} and tuple(so.axes) == tuple(gi.batch)


def is_reduction_store_view(g, s, gi: GemmInfo) -> bool:
    """s broadcasts a full epilogue reduction into an output over the batch axes plus axes of extent
    1 (`out amax : f32[1]`, `amax[z] = max(m, n) ..`): how the spec stores it, not a computation."""
    so = op(g, s)
    if so.kind != "broadcast":
        return False
    (src, labels), = operands(g, s)
    if not is_full_reduction(op(g, src), gi) or tuple(labels) != tuple(gi.batch):
        return False
    extra = [e for a, e in zip(so.axes, so.shape) if a not in labels]
    if any(e != 1 for e in extra) or [a for a in so.axes if a in labels] != list(labels):
        return False
    return bool(list(g.successors(s))) and all(op(g, v).kind == "output" for v in g.successors(s))


def _vector_reject(g, src, labels, gi: GemmInfo, ctx: FusionContext = FusionContext()) -> str | None:
    """Why a broadcast of `src` (read under `labels`) cannot be an epilogue vector load (None if it can):
    an input (or casts of one) indexed by n or m, optionally also by every batch axis of the GEMM."""
    labels = tuple(labels)
    inp = _loaded_input(g, src)
    if inp is None:
        return "it broadcasts a value that is not a row or column vector input (or a cast of one)"
    kind = gi.vector_kind(labels)
    if kind is None:
        if gi.m in labels and gi.m_fold:
            return (f"it broadcasts a vector over '{gi.m}' only, but the GEMM folds "
                    f"[{', '.join(gi.m_labels)}] into its M axis")
        if labels[:-1] and set(labels[:-1]) < set(gi.batch) and labels[-1] in (gi.m, gi.n):
            return (f"it broadcasts a vector over [{', '.join(labels)}]; a per-batch epilogue vector is indexed by "
                    f"every batch axis of the GEMM, [{', '.join(gi.batch)}], then '{gi.m}' or '{gi.n}'")
        return "it broadcasts a value that is not a row or column vector input (or a cast of one)"
    if len(labels) > 1 and op(g, inp).layout != "row":
        return f"the per-batch vector {op(g, inp).name} is column-major; epilogue vectors are read row-major"
    offered = ctx.epilogue_loads()
    if kind not in offered:
        return f"no GEMM backend reads '{kind}' epilogue vectors on {', '.join(ctx.archs)}"
    return None


MAX_CONE = 16


def _recompute_cheap_values(g: nx.DiGraph, res: FusionResult, group: set, anchor) -> set:
    """An epilogue value that only other kernels read (no output, no op of this kernel) is not
    stored when those kernels can compute it more cheaply from values in memory anyway: e.g.
    `f32(H[m, n])` for a norm over the stored f16 output H is read as H (2 bytes) and converted,
    not stored and read back as f32 (4 bytes).  The value leaves the epilogue and later passes
    fuse it into its consumers' kernels."""
    group = set(group)
    while True:
        best = None
        for n in sorted(group - {anchor}, key=_node_order, reverse=True):
            o = op(g, n)
            succ = list(g.successors(n))
            if o.kind not in ("elementwise", "cast") or not succ or \
                    any(s in group or op(g, s).kind == "output" for s in succ):
                continue
            sources = _recompute_sources(g, n, group, anchor)
            if sources is None or not sources:
                continue
            if sum(value_weight(g, u) for u in sources) <= value_weight(g, n):
                best = n
                break
        if best is None:
            return group
        group.discard(best)
        res.notes.append(f"{op(g, best).label()}: not stored by the GEMM at {anchor}; the kernels that read it "
                         "compute it from values already in memory")


def _recompute_sources(g: nx.DiGraph, n, group: set, anchor, depth: int = 6) -> set | None:
    """The values in memory (stored by the group, or outside it) that n is computed from through
    in-group elementwise ops; None if that passes through the contraction or a reduction."""
    out: set = set()
    for u, _ in operands(g, n):
        uo = op(g, u)
        if uo.kind in ("param",) or is_scalar_value(g, u):
            continue
        if u not in group:
            out.add(u)
        elif any(s not in group for s in g.successors(u)):
            out.add(u)          # stored anyway (an output, or read by another kernel)
        elif u != anchor and uo.kind in ("elementwise", "cast", "broadcast") and depth:
            inner = _recompute_sources(g, u, group, anchor, depth - 1)
            if inner is None:
                return None
            out |= inner
        else:
            return None
    return out


def _input_cone(g: nx.DiGraph, res: FusionResult, u, labels, gi: GemmInfo, group: set,
                ctx: FusionContext = FusionContext()) -> set | None:
    """The ops computing an epilogue operand u from inputs alone, when the epilogue can compute them
    itself: elementwise epilogue functions and casts over the GEMM's axes (in its order) reading
    row-major full inputs, scalars, and row/column vectors of inputs.  None if u is not such a value,
    or if another kernel needs part of it too."""
    full = (*gi.batch, *gi.m_labels, gi.n)
    cone: set = set()
    fns = ctx.epilogue_fns()

    def visit(n, read_as) -> bool:
        o = op(g, n)
        if o.kind == "param" or is_scalar_value(g, n):
            return True
        if n in group or n in cone:
            return n in cone
        if res.group_of(n) is not None or len(cone) >= MAX_CONE:
            return False
        if o.kind == "input":
            return tuple(read_as) == full and o.layout == "row"
        if tuple(read_as) != full or o.axes != full:
            return False
        if o.kind == "broadcast":
            (src, sl), = operands(g, n)
            if _vector_reject(g, src, sl, gi, ctx) is not None:
                return False
            chain = [n]
            while op(g, chain[-1]).kind != "input":
                chain.append(operands(g, chain[-1])[0][0])
            cone.update(chain[:-1])
            return True
        if o.kind not in ("elementwise", "cast") or (o.kind == "elementwise" and fns is not None and o.fn not in fns):
            return False
        cone.add(n)
        return all(visit(v, l) for v, l in operands(g, n))

    if op(g, u).kind in ("input", "param") or not visit(u, labels) or not cone:
        return None
    inside = group | cone
    if any(s not in inside for n in cone for s in g.successors(n)):
        return None
    return cone


def _keep_a_stored_result(g: nx.DiGraph, res: FusionResult, group: set, anchor) -> set:
    """An epilogue reduction rides on a GEMM that stores its [m, n] result anyway: when the
    reductions are all that leaves the group, they (and what only they need) run as kernels of their
    own over the stored result instead."""
    reductions = {n for n in group if op(g, n).kind == "reduction"}
    if not reductions:
        return group
    stored = [n for n in group - reductions if any(s not in group for s in g.successors(n))]
    if stored:
        return group
    res.notes.append(f"{op(g, min(reductions, key=_node_order)).label()} not fused into the GEMM at {anchor}: "
                     "the GEMM stores no full result for it to ride on")
    return _without_reductions(g, group, anchor)


def _without_reductions(g: nx.DiGraph, group: set, anchor) -> set:
    """The group less its epilogue reductions and the epilogue ops that only fed them, down to the
    value the reductions read (which the GEMM then stores for the reduction kernels)."""
    reductions = {n for n in group if op(g, n).kind == "reduction"}
    # a full reduction's store view (a broadcast into its output) leaves with it
    reductions |= {s for r in reductions for s in g.successors(r) if s in group}
    keep = group - reductions
    while True:
        dead = {n for n in keep if n != anchor and not any(s in keep for s in g.successors(n))
                and not any(op(g, s).kind == "output" for s in g.successors(n))}
        feeds_reduction = {u for r in reductions for u, _ in operands(g, r)}
        dead -= feeds_reduction
        if not dead:
            break
        keep -= dead
    return keep


def _split_unbuildable_reductions(g: nx.DiGraph, res: FusionResult, group: set, anchor, gi: GemmInfo,
                                  ctx: FusionContext) -> set:
    """Only tensor-core GEMM backends fuse epilogue reductions: when none of them builds this GEMM
    on every arch (so it runs as a loop kernel), its reductions run as kernels of their own over the
    result the GEMM stores."""
    reductions = {n for n in group if op(g, n).kind == "reduction"}
    if not reductions or ctx.oracle is None:
        return group
    from .ir_build import candidate_ir
    scalars = {u for n in group for u in nx.ancestors(g, n) if is_scalar_value(g, u) and res.group_of(u) is None}
    why = ctx.oracle.can_fuse(candidate_ir(g, Group("candidate", "gemm", group | scalars, anchor, gi), ctx.kernel, ctx.hints),
                              ctx.archs)
    if why is None:
        return group
    for r in sorted(reductions, key=_node_order):
        res.notes.append(f"{op(g, r).label()} not fused into the GEMM at {anchor}: no GEMM backend builds it with "
                         f"an epilogue reduction ({why}); it reduces the stored GEMM result in a kernel of its own")
    return _without_reductions(g, group, anchor)


def _store_order_reject(g: nx.DiGraph, s, gi: GemmInfo) -> str | None:
    """An epilogue stores an output as [batch.., M, N] row-major or, transposed, [batch.., N, M]."""
    full = (*gi.batch, *gi.m_labels, gi.n)
    for v in g.successors(s):
        vo = op(g, v)
        if vo.kind != "output":
            continue
        (_, labels), = operands(g, v)
        order = list(labels)
        if vo.layout == "col" and len(order) >= 2:
            order[-2], order[-1] = order[-1], order[-2]
        if tuple(order) == full or (not gi.m_fold and tuple(order) == (*gi.batch, gi.n, gi.m)):
            continue
        return (f"it stores output {vo.name} as [{', '.join(order)}]; a GEMM epilogue stores "
                f"[{', '.join(full)}] or its transpose")
    return None


def _loaded_input(g: nx.DiGraph, n):
    """The input an epilogue load reads when n is that input or a chain of casts of it, else None."""
    o = op(g, n)
    if o.kind == "input":
        return n
    if o.kind == "cast" and is_input_view(g, n):
        (src, _), = operands(g, n)
        return _loaded_input(g, src)
    return None


def _storage_layout(g: nx.DiGraph, n) -> str:
    src = _loaded_input(g, n)
    return op(g, src).layout if src is not None else "row"


def _add_epilogue_loads(g: nx.DiGraph, res: FusionResult, group: set) -> None:
    """Broadcasts of input vectors, and casts of inputs, that feed the epilogue are loads of it:
    they join the group (canonicalisation gave each consumer its own copy)."""
    for n in sorted(group, key=_node_order):
        if op(g, n).kind == "contraction":
            continue        # its operands are the GEMM's A and B, read from memory
        for u in g.predecessors(n):
            if u in group or res.group_of(u) or not is_input_view(g, u):
                continue
            chain = [u]
            while op(g, chain[-1]).kind in ("broadcast", "cast"):
                (src, _), = operands(g, chain[-1])
                if op(g, src).kind == "input":
                    break
                chain.append(src)
            if any(res.group_of(c) or len(list(g.successors(c))) != 1 for c in chain):
                continue
            if legal_group(g, group | set(chain)) is None:
                group |= set(chain)


def _legal_merge(g: nx.DiGraph, a: Group, b: Group, n, order: dict, span_of) -> str | None:
    """legal_group(g, a | b | {n}) for two legal groups and n: legal_addition with the larger as
    the base, in time that grows with the smaller (the same answer: see legal_addition)."""
    base, other = (a, b) if len(a.nodes) >= len(b.nodes) else (b, a)
    (alo, ahi), (blo, bhi) = span_of(a), span_of(b)
    bounds = (min(alo, blo, order[n]), max(ahi, bhi, order[n]))
    return legal_addition(g, base.nodes, other.nodes | {n}, order, bounds)


def _broadcast_gather(g: nx.DiGraph, grp: Group, n) -> bool:
    """A broadcast n of a gather's kernel over fewer axes (RoPE's `cos[s, e / 2]` over b and h): n
    joins it, the gather then being read per element of n's space (loads, not a kernel and an
    intermediate of its own), when n is the group's only reader and the group holds nothing but
    the gather and the index arithmetic of its subscripts."""
    if op(g, n).kind != "broadcast" or not set(op(g, grp.anchor).axes) <= set(op(g, n).axes):
        return False
    kinds = {op(g, x).kind for x in grp.nodes}
    if "gather" not in kinds or not kinds <= {"gather", "elementwise", "cast", "index", "size", "const"}:
        return False
    return all(s in grp.nodes or s == n for x in grp.nodes for s in g.successors(x))


def fuse_elementwise(g: nx.DiGraph, res: FusionResult) -> None:
    """Group remaining elementwise/broadcast/cast nodes that share one iteration space."""
    scalar_memo: dict = {}
    index_memo: dict = {}           # the graph does not change in this pass: answers stay valid
    order = {x: i for i, x in enumerate(nx.topological_sort(g))}
    bounds: dict[int, tuple[int, int]] = {}     # id(group) -> its first and last node in `order`

    def span_of(grp: Group) -> tuple[int, int]:
        if id(grp) not in bounds:
            pos = [order[x] for x in grp.nodes]
            bounds[id(grp)] = (min(pos), max(pos))
        return bounds[id(grp)]
    for n in order:
        o = op(g, n)
        if o.kind not in ("elementwise", "broadcast", "cast") or res.group_of(n):
            continue
        if (is_scalar_value(g, n, scalar_memo) or is_recomputed(g, n, index_memo)) and \
                not any(op(g, s).kind == "output" for s in g.successors(n)):
            continue        # evaluated by the kernel that reads it (attach_scalars)
        if _is_loaded_view(g, n):
            continue        # converted where its consumer loads it (attach_scalars)
        merged = None
        candidates: list[Group] = []
        for u, labels in operands(g, n):
            grp = res.group_of(u)
            if grp is not None and grp.kind == "elementwise" and grp not in candidates and same_point(g, u, labels) \
                    and (set(op(g, grp.anchor).axes) == set(o.axes) or _broadcast_gather(g, grp, n)):
                candidates.append(grp)
        for grp in candidates:
            # n joins its producers' groups; where it reads several (e.g. a chain and a broadcast
            # of an input), they become one kernel when that is legal
            if merged is None:
                lo, hi = span_of(grp)
                if legal_addition(g, grp.nodes, {n}, order, (min(lo, order[n]), max(hi, order[n]))) is None:
                    merged = grp
            elif _legal_merge(g, merged, grp, n, order, span_of) is None:
                merged.nodes |= grp.nodes
                res.groups.remove(grp)
                bounds.pop(id(grp), None)
                bounds.pop(id(merged), None)
                for i, other in enumerate(res.groups):
                    other.id = f"g{i}"      # ids stay unique for groups created later
        if merged is not None:
            lo, hi = span_of(merged)
            merged.nodes.add(n)
            bounds[id(merged)] = (min(lo, order[n]), max(hi, order[n]))
            merged.anchor = n
        else:
            res.groups.append(Group(f"g{len(res.groups)}", "elementwise", {n}, n))


def absorb_elementwise_producers(g: nx.DiGraph, res: FusionResult) -> None:
    """An elementwise kernel whose values only one other elementwise kernel reads, over a subset of
    that kernel's axes, joins it: its values are recomputed per element there instead of going
    through memory (`dloss[m] / lse_r[m]` or a broadcast `label[m]` read by an [m, v] kernel)."""
    changed = True
    while changed:
        changed = False
        for grp in [x for x in res.groups if x.kind == "elementwise"]:
            if any(op(g, s).kind == "output" for n in grp.nodes for s in g.successors(n)):
                continue
            readers = {id(r): r for r in (res.group_of(s) for n in grp.nodes for s in g.successors(n)
                                          if s not in grp.nodes)}
            if len(readers) != 1:
                continue
            (other,) = readers.values()
            if other is None or other.kind != "elementwise" or other is grp:
                continue
            axes = set(op(g, other.anchor).axes)
            if any(not set(op(g, n).axes) <= axes for n in grp.nodes):
                continue
            merged = other.nodes | grp.nodes
            if legal_group(g, merged):
                continue
            other.nodes = merged
            res.groups.remove(grp)
            changed = True
            break


def fuse_reduction_prologues(g: nx.DiGraph, res: FusionResult) -> None:
    """A standalone reduction or softmax absorbs the elementwise kernel that computes its operand
    (e.g. `mean(c) f32(x[n, c])`), recomputing it per element inside its loops, when nothing else
    needs that kernel's values."""
    for grp in [x for x in res.groups if x.kind in ("reduction", "softmax")]:
        (r,) = grp.nodes
        ((u, labels),) = operands(g, r)
        prologue = res.group_of(u)
        if prologue is None or prologue.kind != "elementwise" or not same_point(g, u, labels):
            continue
        if any(s not in prologue.nodes and s != r for n in prologue.nodes for s in g.successors(n)):
            res.notes.append(f"{op(g, r).label()}: its operand's kernel is not fused in: other kernels "
                             "read its values too")
            continue
        if any(set(op(g, n).axes) - set(op(g, u).axes) for n in prologue.nodes):
            continue
        merged = prologue.nodes | {r}
        if legal_group(g, merged):
            continue
        grp.nodes = merged
        res.groups.remove(prologue)


def fuse_softmax_epilogues(g: nx.DiGraph, res: FusionResult) -> None:
    """A standalone softmax absorbs the elementwise kernels that consume its result element by
    element over the same axes (e.g. the cast to a f16 output), so the probabilities are stored once."""
    for grp in [x for x in res.groups if x.kind == "softmax"]:
        sm = next(n for n in grp.nodes if op(g, n).kind == "softmax")
        axes = set(op(g, sm).axes)
        changed = True
        while changed:
            changed = False
            for s in sorted({c for n in grp.nodes for c in g.successors(n)} - grp.nodes, key=_node_order):
                other = res.group_of(s)
                if other is None or other.kind != "elementwise":
                    continue
                if any(set(op(g, n).axes) != axes for n in other.nodes if op(g, n).kind != "const"):
                    continue
                reads = [(u, l) for n in other.nodes for u, l in operands(g, n) if u in grp.nodes]
                if not all(same_point(g, u, l) for u, l in reads):
                    continue
                merged = grp.nodes | other.nodes
                if legal_group(g, merged):
                    continue
                grp.nodes = merged
                res.groups.remove(other)
                changed = True
                break


def fuse(g: nx.DiGraph, ctx: FusionContext | None = None) -> FusionResult:
    """Run every fusion pass; every operator node ends in exactly one group, in topological order."""
    ctx = ctx or FusionContext()
    res = FusionResult([])
    fuse_attention(g, res, ctx)
    fuse_attention_backward(g, res, ctx)
    fuse_epilogues(g, res, ctx)
    from .rowwise import fuse_column_partials, fuse_rowwise
    fuse_rowwise(g, res)                   # row reductions, softmax, norms: one kernel per row chain
    fuse_column_partials(g, res, ctx)      # sums over the rows: partials in the row kernel, one finishing kernel
    fuse_elementwise(g, res)
    for n in nx.topological_sort(g):
        o = op(g, n)
        if o.kind in ("contraction", "reduction", "softmax") and not res.group_of(n):
            res.groups.append(Group(f"g{len(res.groups)}", o.kind, {n}, n))
    fuse_reduction_prologues(g, res)
    fuse_softmax_epilogues(g, res)
    attach_scalars(g, res)
    absorb_elementwise_producers(g, res)
    order = _group_order(g, res.groups)
    for i, grp in enumerate(order):
        grp.id = f"g{i}"
    res.groups = order
    return res


def _is_loaded_view(g: nx.DiGraph, n) -> bool:
    """A cast of an input read by one elementwise op, reduction or softmax: that consumer's kernel
    converts the input as it loads it (a contraction operand needs its own buffer)."""
    if op(g, n).kind != "cast" or not is_input_view(g, n):
        return False
    consumers = list(g.successors(n))
    return len(consumers) == 1 and op(g, consumers[0]).kind in ("elementwise", "broadcast", "cast", "reduction",
                                                                  "softmax")


def attach_scalars(g: nx.DiGraph, res: FusionResult) -> None:
    """Constants, scalar expressions of params and index expressions (`j <= i + (T - S)`) join the
    kernel that reads them (canonicalisation gave each consumer its own copy), so every kernel
    evaluates the scalars and index values it needs; so do casts of inputs, which their consumer's
    kernel applies as it loads the input."""
    for n in reversed(list(nx.topological_sort(g))):
        if res.group_of(n) is not None or not (is_scalar_value(g, n) or _is_loaded_view(g, n)
                                               or is_recomputed(g, n)):
            continue
        for s in sorted(g.successors(n), key=_node_order):
            grp = res.group_of(s)
            if grp is not None:
                grp.nodes.add(n)
                break


def quotient(g: nx.DiGraph, groups: list[Group]) -> nx.DiGraph:
    """The kernel graph: one node per group, an edge where one group reads another's value."""
    where = {n: grp.id for grp in groups for n in grp.nodes}
    q = nx.DiGraph()
    for grp in groups:
        q.add_node(grp.id)
    for u, v in g.edges:
        gu, gv = where.get(u), where.get(v)
        if gu and gv and gu != gv:
            q.add_edge(gu, gv)
    return q


def _group_order(g: nx.DiGraph, groups: list[Group]) -> list[Group]:
    by_id = {grp.id: grp for grp in groups}
    q = quotient(g, groups)
    if not nx.is_directed_acyclic_graph(q):
        from kspec.spec_lang.errors import KspecInternalError
        raise KspecInternalError("fusion produced a cycle between kernels")
    return [by_id[i] for i in nx.lexicographical_topological_sort(q, key=lambda i: min(
        _node_order(n) for n in by_id[i].nodes))]
