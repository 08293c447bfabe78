"""Attention score modifications: what lies between the QK contraction and the softmax, lifted out
of the graph as small expressions per score element (the score_mod / mask_mod model of
FlexAttention and FlashAttention-4), and grouped-query K/V reads (`K[b, h / G, j, e]`).

`score_path` finds the QK contraction behind a softmax and splits the scale off; `lift_mods` turns
the rest into `kir` expressions over `Score()`, `Index(label)`, `Size(symbol)`, scalar `Load`s,
`Const`s and `AuxLoad`s of extra tensors, and splits a top-level `where(cond, x, -inf)` off as the
mask; `kv_group_read` recognises a K or V operand read at head `h / G`.  Fusion uses these to decide
whether an attention fuses (with the reason when it does not); ir_build uses them to fill
`AttentionStructure`.  One implementation serves both, so what fusion accepts is what the IR holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import networkx as nx

from kspec.core import INT_DTYPES

from .graph import op, operands
from .kir import AuxLoad, Const, EpiExpr, Index, Load, Op, Score, Size, epi_nodes


class NotLiftable(Exception):
    """Why the ops between QK^T and the softmax cannot run inside one attention kernel."""


def _scaled_value(g: nx.DiGraph, n):
    """If n multiplies a tensor by a scalar param/const (or divides it by one), that tensor's node."""
    o = op(g, n)
    if o.kind != "elementwise" or o.fn not in ("mul", "div"):
        return None
    ins = operands(g, n)
    scalars = [u for u, _ in ins if op(g, u).kind in ("param", "const")]
    tensors = [u for u, _ in ins if op(g, u).kind not in ("param", "const")]
    if len(ins) != 2 or len(scalars) != 1 or len(tensors) != 1:
        return None
    if o.fn == "div" and ins[0][0] != tensors[0]:
        return None
    return tensors[0]


def attention_scale(g, scale_nodes) -> str | float | None:
    """The softmax scale as a param name or a folded constant; None if it is not a single factor."""
    consts = 1.0
    param = None
    for n in scale_nodes:
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
    return param if param is not None else float(consts)


@dataclass(frozen=True)
class ScorePath:
    qk: object                 # the QK^T contraction
    scale: tuple               # scalar multiplications/divisions right after it (the softmax scale)
    score: object              # the node whose value is Score(): the last scale node, or qk
    path: frozenset            # the nodes computing the softmax operand from the score (the mods)


def score_path(g: nx.DiGraph, sm) -> ScorePath | str:
    """The contraction a softmax's operand is computed from through elementwise ops, and the scale
    right after it; the reason as a str when there is not exactly one such contraction."""
    ((prev, _),) = operands(g, sm)
    return score_path_of(g, prev)


def score_path_of(g: nx.DiGraph, prev) -> ScorePath | str:
    """score_path of the value `prev` (a softmax's operand, or an attention backward's recomputed one)."""
    cone: set = set()
    contractions: set = set()
    stack = [prev]
    while stack:
        n = stack.pop()
        if n in cone or n in contractions:
            continue
        kind = op(g, n).kind
        if kind == "contraction":
            contractions.add(n)
        elif kind in ("elementwise", "cast", "broadcast"):
            cone.add(n)
            stack.extend(g.predecessors(n))
        # anything else (inputs, gathers, reductions, ...) is a leaf here: lifting judges it
    if len(contractions) != 1:
        return (f"its operand combines values of {len(contractions)} contractions" if contractions else
                "its operand is not computed from a contraction through elementwise ops")
    (qk,) = contractions
    scale: list = []
    x = qk
    while True:
        # the longest run of scalar factors right after QK^T that is still one param or constant
        nxt = list(g.successors(x))
        if len(nxt) != 1 or nxt[0] not in cone or _scaled_value(g, nxt[0]) != x or \
                attention_scale(g, [*scale, nxt[0]]) is None:
            break
        scale.append(nxt[0])
        x = nxt[0]
    return ScorePath(qk, tuple(scale), x, frozenset(cone - set(scale)))


@dataclass(frozen=True)
class LiftedMods:
    score_mod: EpiExpr | None
    mask: EpiExpr | None
    aux: tuple                   # input nodes read by AuxLoad (buffers the mods read)
    nodes: frozenset             # graph nodes the mods compute (they join the attention kernel)


def lift_mods(g: nx.DiGraph, sm, sp: ScorePath, labels: tuple[str, ...],
              name_of: Callable[[object], str] = lambda n: str(n), readers: frozenset = frozenset()) -> LiftedMods:
    """The ops between the score and the softmax as expressions per score element.  labels: the
    attention's labels (batch.., query, key), which the score node's axes must be.  name_of maps an
    input/param node to its buffer name; readers: nodes of the kernel besides the softmax that may
    read the softmax's operand (its log-sum-exp).  Raises NotLiftable with the reason."""
    ((root, root_labels),) = operands(g, sm)
    if not sp.path:
        return LiftedMods(None, None, (), frozenset())
    expr, aux, nodes = _lift(g, root, {a: a for a in root_labels}, sp.score, labels, name_of)
    # a mod's value may be read only by other mods (or the softmax): it never leaves the kernel
    for n in sorted(nodes, key=str):
        if any(s not in nodes and s != sm and s not in readers for s in g.successors(n)):
            raise NotLiftable(f"{op(g, n).label()} (between QK^T and the softmax) is also used outside "
                              "the attention, so it must be written to memory")
    mask, score_mod = _split_mask(expr)
    if isinstance(score_mod, Score):
        score_mod = None
    if mask is not None and any(isinstance(x, Score) for x in epi_nodes(mask)):
        mask, score_mod = None, expr          # a score-dependent mask stays a score modification
    return LiftedMods(score_mod, mask, tuple(aux), frozenset(nodes))


def output_scale(g: nx.DiGraph, pv, batch: tuple[str, ...], name_of: Callable[[object], str] = lambda n: str(n)):
    """`O = d[b, h / G] * sum(j) p V`: the attention's output multiplied by a value of its batch labels
    only (FlashAttention-4's v_descale of FP8 attention): (the multiply, its scale as an expression
    over Index(batch labels) and AuxLoads, the inputs it reads, the nodes computing it), or None."""
    cs = list(g.successors(pv))
    if len(cs) != 1:
        return None
    m = cs[0]
    mo = op(g, m)
    if mo.kind != "elementwise" or mo.fn != "mul" or len(operands(g, m)) != 2:
        return None
    (x, xl), (y, yl) = operands(g, m)
    other, ol = (y, yl) if x == pv else (x, xl)
    if other == pv or tuple(mo.axes) != tuple(op(g, pv).axes):
        return None
    to_attn = dict(zip(op(g, other).axes, ol))          # other's axes -> the attention's labels
    extra: set = set()
    root = other
    if op(g, other).kind == "broadcast":
        (root, ul), = operands(g, other)
        to_attn = {a: to_attn[l] for a, l in zip(op(g, root).axes, ul) if l in to_attn}
        extra = {other}
    if not set(to_attn.values()) <= set(batch) or len(to_attn) != len(op(g, root).axes) or \
            op(g, root).dtype in INT_DTYPES:
        return None
    try:
        expr, aux, nodes = _lift(g, root, to_attn, None, tuple(batch), name_of)
    except NotLiftable:
        return None
    if isinstance(expr, Const) or not aux:
        return None                   # a constant factor is the caller's to fold; not a per-head scale
    nodes = set(nodes) | extra
    if any(s not in nodes and s != m for n in nodes for s in g.successors(n)):
        return None
    return m, expr, tuple(aux), frozenset(nodes)


def _lift(g: nx.DiGraph, root, to_attn: dict, score, labels: tuple[str, ...],
          name_of: Callable[[object], str], leaves: dict | None = None) -> tuple[EpiExpr, list, set]:
    """The value of `root` (its axes named by the attention's labels through `to_attn`) as an
    expression per element: (expression, inputs read as AuxLoad, graph nodes computed).  `score` is
    the node whose value is Score(); `leaves` maps other nodes to the expressions they stand for
    (read at the attention's own labels)."""
    sp = ScorePath(None, (), score, frozenset())
    nodes: set = set()
    aux: list = []
    memo: dict = {}

    def label(m: dict, x: str) -> Index:
        if x not in m:
            raise NotLiftable(f"a value reads index '{x}', which is not an index of the scores")
        return Index(m[x])

    def lift(n, m: dict) -> EpiExpr:
        key = (n, tuple(sorted(m.items())))
        if key in memo:
            return memo[key]
        o = op(g, n)
        if leaves and n in leaves:
            if any(m.get(a) != a for a in o.axes) or set(o.axes) != set(labels):
                raise NotLiftable(f"{o.label()} is read with its indices permuted")
            e: EpiExpr = leaves[n]
        elif n == sp.score:
            if any(m.get(a) != a for a in o.axes) or set(o.axes) != set(labels):
                raise NotLiftable("the score is read with its indices permuted")
            e = Score()
        elif o.kind == "param":
            e = Load(name_of(n), "scalar", o.dtype)
        elif o.kind == "const":
            # integer constants stay ints (index arithmetic such as `i - 128`)
            e = Const(int(o.value) if o.dtype in INT_DTYPES else float(o.value))
        elif o.kind == "size":
            nodes.add(n)
            e = Size(o.fn)
        elif o.kind == "index":
            nodes.add(n)
            e = label(m, o.fn)
        elif o.kind == "input":
            if n not in aux:
                aux.append(n)
            e = AuxLoad(name_of(n), tuple(label(m, a) for a in o.axes), o.dtype)
        elif o.kind == "gather":
            nodes.add(n)
            ins = operands(g, n)
            src, _ = ins[0]
            if op(g, src).kind != "input":
                raise NotLiftable(f"{o.label()} gathers from a computed value, not a kernel input")
            if src not in aux:
                aux.append(src)
            subs: list[EpiExpr] = []
            for x in o.subscripts:
                if x.startswith("#"):
                    subs.append(Const(int(x[1:])))
                elif x.startswith("@"):
                    u, ul = ins[int(x[1:])]
                    subs.append(lift(u, _through(g, u, ul, m)))
                else:
                    subs.append(label(m, x))
            e = AuxLoad(name_of(src), tuple(subs), op(g, src).dtype)
        elif o.kind in ("elementwise", "cast", "broadcast"):
            nodes.add(n)
            args = tuple(lift(u, _through(g, u, ul, m)) for u, ul in operands(g, n))
            if o.kind == "broadcast":
                e = args[0]
            elif o.kind == "cast":
                e = Op(f"cast:{o.dtype}", args)
            else:
                e = Op(o.fn, args)
        else:
            raise NotLiftable(f"{o.label()} cannot be computed per score element inside the attention kernel")
        memo[key] = e
        return e

    expr = lift(root, dict(to_attn))
    return expr, aux, nodes


def _through(g: nx.DiGraph, u, read_labels, m: dict) -> dict:
    """The label map for operand u: u's axis -> the attention label its reader's label maps to."""
    return {a: m[l] for a, l in zip(op(g, u).axes, read_labels) if l in m}


def is_top_left_causal(mask: EpiExpr | None, query: str, key: str) -> bool:
    """mask is exactly `key <= query` (what `softmax(j, causal=i)` means when S and T agree)."""
    return mask == Op("le", (Index(key), Index(query))) or mask == Op("ge", (Index(query), Index(key)))


def _is_neg_inf(e: EpiExpr) -> bool:
    if isinstance(e, Const):
        return e.value == -math.inf
    return isinstance(e, Op) and e.fn == "neg" and isinstance(e.args[0], Const) and e.args[0].value == math.inf


def _split_mask(e: EpiExpr) -> tuple[EpiExpr | None, EpiExpr]:
    """`where(c, x, -inf)` -> (c, x); nested ones are and-ed; `where(c, -inf, x)` masks `not c`."""
    mask: EpiExpr | None = None
    while isinstance(e, Op) and e.fn == "where":
        c, a, b = e.args
        if _is_neg_inf(b) and not _is_neg_inf(a):
            keep, e = c, a
        elif _is_neg_inf(a) and not _is_neg_inf(b):
            keep, e = Op("not", (c,)), b
        else:
            break
        mask = keep if mask is None else Op("and", (mask, keep))
    return mask, e


def kv_group_read(g: nx.DiGraph, n, head_label: str):
    """If n reads a kernel input at head index `h / G` (`K[b, h / G, j, e]`): (the input node, G as a
    param name, an int or a size symbol, the K/V head count (extent of that input axis), the nodes
    computing the read).  None when n is not such a read."""
    o = op(g, n)
    if o.kind != "gather":
        return None
    ins = operands(g, n)
    src, _ = ins[0]
    if op(g, src).kind != "input":
        return None
    computed = [(axis, x) for axis, x in enumerate(o.subscripts) if x not in o.axes]
    if len(computed) != 1 or not computed[0][1].startswith("@"):
        return None
    axis, x = computed[0]
    found = group_of(g, *ins[int(x[1:])], {a: a for a in o.axes}, head_label)
    if found is None:
        return None
    group, nodes = found
    return src, group, op(g, src).shape[axis], {n} | nodes


def group_of(g: nx.DiGraph, u, ul, to_attn: dict, head_label: str):
    """u (read under ul, whose labels to_attn maps to the attention's) computes `h / G` with h the
    attention's head label: (G as a param name, an int, a size symbol or the quotient "H/KH" of two
    size symbols, the nodes computing it)."""
    uo = op(g, u)
    if uo.kind != "elementwise" or uo.fn != "floordiv":
        return None
    mine = {a: to_attn.get(l) for a, l in zip(uo.axes, ul)}
    (num, nl), (den, _) = operands(g, u)
    no, do = op(g, num), op(g, den)
    if no.kind != "index" or len(nl) != 1 or mine.get(nl[0]) != head_label:
        return None
    if do.kind == "param":
        return do.name, {u, num}
    if do.kind == "const" and do.dtype in INT_DTYPES:
        return int(do.value), {u, num, den}
    if do.kind == "size":
        return do.fn, {u, num, den}
    if do.kind == "elementwise" and do.fn == "floordiv" and not do.axes:
        # `h / (H / KH)`: the group as the quotient of two size symbols, "H/KH" (known per call)
        (a, _), (b, _) = operands(g, den)
        if op(g, a).kind == "size" and op(g, b).kind == "size":
            return f"{op(g, a).fn}/{op(g, b).fn}", {u, num, den, a, b}
    return None


def paged_kv_read(g: nx.DiGraph, n, read_labels: tuple[str, ...], key: str, batch: tuple[str, ...]):
    """If n (read under `read_labels` by the attention) reads a kernel input through a block table (a
    paged KV cache, `Kc[bt[b.., j / P], j % P, h, e]`: the page pool's axis 0 selects the page,
    axis 1 the row in it, P the extent of axis 1, j the attention's key label): (the pool input
    node, the block-table input node, P as an int or a size symbol, the nodes computing the read,
    the GQA group and the pool's K/V head count when the head is read at `h / G`, else None, None).
    None when n is not such a read."""
    o = op(g, n)
    if o.kind != "gather" or len(o.subscripts) < 3 or len(read_labels) != len(o.axes):
        return None
    ins = operands(g, n)
    src, _ = ins[0]
    so = op(g, src)
    computed = [k for k, x in enumerate(o.subscripts[2:], 2) if x.startswith(("@", "#"))]
    if so.kind != "input" or not all(x.startswith("@") for x in o.subscripts[:2]) or len(computed) > 1:
        return None
    to_attn = dict(zip(o.axes, read_labels))          # n's labels -> the attention's
    (pg, pl), (off, ol) = ins[int(o.subscripts[0][1:])], ins[int(o.subscripts[1][1:])]
    nodes = {n}
    group = heads = None
    if computed:
        # GQA through the pool's head axis: `Kc[bt[b, j / P], j % P, h / G, e]`
        x = o.subscripts[computed[0]]
        if not x.startswith("@") or not batch:
            return None
        found = group_of(g, *ins[int(x[1:])], to_attn, batch[-1])
        if found is None:
            return None
        group, gnodes = found
        heads = so.shape[computed[0]]
        nodes |= gnodes

    def key_by(u, labels, outer: dict, fn):
        """u (read under `labels`, whose labels `outer` maps to the attention's) computes `key fn P`
        with P the pool's page extent: P, or None."""
        uo = op(g, u)
        if uo.kind != "elementwise" or uo.fn != fn or len(uo.axes) != 1:
            return None
        mine = {a: outer.get(l) for a, l in zip(uo.axes, labels)}
        (num, nl), (den, _) = operands(g, u)
        no, do = op(g, num), op(g, den)
        if no.kind != "index" or len(nl) != 1 or mine.get(nl[0]) != key:
            return None
        page = do.fn if do.kind == "size" else int(do.value) if do.kind == "const" and do.dtype in INT_DTYPES \
            else None
        if page is None or page != so.shape[1]:
            return None
        nodes.update((u, num, den))
        return page

    go = op(g, pg)
    if go.kind != "gather" or len(go.subscripts) != 2 or go.subscripts[1] != "@1":
        return None
    bt, _ = operands(g, pg)[0]
    if op(g, bt).kind != "input" or op(g, bt).dtype not in INT_DTYPES:
        return None
    pg_to_attn = {a: to_attn.get(l) for a, l in zip(go.axes, pl)}
    if pg_to_attn.get(go.subscripts[0]) not in batch:
        return None
    page = key_by(*operands(g, pg)[1], pg_to_attn, "floordiv")
    if page is None or key_by(off, ol, to_attn, "mod") != page:
        return None
    nodes.add(pg)
    return src, bt, page, nodes, group, heads
