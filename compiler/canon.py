"""Canonicalisation passes over the dataflow graph: copy elimination, constant folding, common
subexpression merging, dead-node removal, per-consumer copies of values that are cheaper to
recompute than to share (broadcasts, casts of inputs, widening casts, scalars, elementwise values
narrower at their sources), and GEMM recognition (operand layouts absorb transposes; free axes of A
fold into M and several innermost reduced axes into K)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import networkx as nx

from kspec.core import DTYPE_TABLE, INT_DTYPES, dtype_bytes

from .graph import GENERATED_KINDS, OpNode, op, operands, uses


def value_bytes(dtype: str) -> int:
    """Bytes per element of a value of `dtype` (a condition, "bool", as one byte; f4e2m1 as one,
    for ordering values by width: memory sizes are `tensor_bytes`)."""
    return 1 if dtype == "bool" else dtype_bytes(dtype)


def tensor_bytes(dtype: str, numel: int) -> int:
    """Bytes of memory `numel` values of `dtype` occupy: a 4-bit f4e2m1 packs two a byte (the
    runtime's rule, kspec.runtime.dtypes.span_bytes), a condition takes a byte."""
    return numel if dtype == "bool" else DTYPE_TABLE[dtype].storage_bytes(numel)


def _rewire(g: nx.DiGraph, old, new, relabel=None) -> None:
    """Point every consumer of `old` at `new`; relabel(labels) maps the labels consumers used for
    old's axes to the labels they must use for new's axes."""
    for v in list(g.successors(old)):
        for pos, labels in uses(g, old, v):
            new_labels = relabel(labels) if relabel else labels
            if g.has_edge(new, v):
                g.edges[new, v]["uses"] += ((pos, new_labels),)
            else:
                g.add_edge(new, v, uses=((pos, new_labels),))
        g.remove_edge(old, v)


def remove_copies(g: nx.DiGraph) -> int:
    """Drop `copy` nodes (a statement that only renames a value); consumers read the source."""
    count = 0
    for n in list(nx.topological_sort(g)):
        o = op(g, n)
        if o.kind != "elementwise" or o.fn != "copy":
            continue
        (src, read_labels), = operands(g, n)
        feeds_output = any(op(g, v).kind == "output" for v in g.successors(n))
        if feeds_output and (op(g, src).kind in ("input", "param", "const") or read_labels != o.axes):
            # an output stores its producer's value in the producer's axis order: a copy of an
            # input, or a transposing copy, is the kernel that writes that output
            continue
        pos_in_copy = {a: i for i, a in enumerate(o.axes)}

        def relabel(labels, read_labels=read_labels, pos_in_copy=pos_in_copy):
            return tuple(labels[pos_in_copy[r]] for r in read_labels)
        _rewire(g, n, src, relabel)
        src_op = op(g, src)
        if o.name and src_op.name is None and src_op.kind not in ("input", "param", "const"):
            g.nodes[src]["op"] = replace(src_op, name=o.name)
        g.remove_node(n)
        count += 1
    return count


_FOLD = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b if b != 0 else math.copysign(math.inf, a) if a else math.nan,
    "neg": lambda a: -a, "maximum": max, "minimum": min, "abs": abs,
    "floordiv": lambda a, b: a // b if b != 0 else None, "mod": lambda a, b: a % b if b != 0 else None,
    "exp": math.exp, "tanh": math.tanh, "sqrt": math.sqrt, "log": math.log,
}


def fold_constants(g: nx.DiGraph) -> int:
    """Evaluate elementwise nodes whose operands are all constants."""
    count = 0
    for n in list(nx.topological_sort(g)):
        o = op(g, n)
        if o.kind != "elementwise" or o.fn not in _FOLD or o.axes:
            continue
        ins = operands(g, n)
        if not ins or not all(op(g, u).kind == "const" for u, _ in ins):
            continue
        try:
            value = _FOLD[o.fn](*[op(g, u).value for u, _ in ins])
        except (OverflowError, ValueError):
            continue
        if value is None:
            continue        # an integer division by zero: the reference reports it at run time
        for u, _ in ins:
            if g.has_edge(u, n):
                g.remove_edge(u, n)
        g.nodes[n]["op"] = OpNode("const", o.dtype, (), (), value=value, span=o.span)
        count += 1
    remove_dead(g)
    return count


def _key(g: nx.DiGraph, n):
    o = op(g, n)
    ins = tuple(sorted((pos, u, labels) for u in g.predecessors(n) for pos, labels in uses(g, u, n)))
    return (replace(o, name=None, span=None), ins)


def merge_common_subexpressions(g: nx.DiGraph) -> int:
    """Merge nodes computing the same op on the same operands (constants included)."""
    seen: dict = {}
    count = 0
    for n in list(nx.topological_sort(g)):
        o = op(g, n)
        if o.kind in ("input", "param", "output"):
            continue
        k = _key(g, n)
        if k in seen:
            keep = seen[k]
            _rewire(g, n, keep)
            if o.name and op(g, keep).name is None:
                g.nodes[keep]["op"] = replace(op(g, keep), name=o.name)
            g.remove_node(n)
            count += 1
        else:
            seen[k] = n
    return count


def _exact_widening(src: str, dst: str) -> bool:
    """Every value of dtype `src` is a value of `dst`, and a product of two of them is exact in a f32
    (or i32 -> int64) sum: float -> wider float (not tf32, which rounds), int -> wider int."""
    from kspec.core import DTYPE_TABLE
    a, b = DTYPE_TABLE.get(src), DTYPE_TABLE.get(dst)
    if a is None or b is None or a.kind != b.kind or b.bits <= a.bits or dst == "tf32" or src == "tf32":
        return False
    return a.storage == src or a.kind == "float"


def absorb_operand_casts(g: nx.DiGraph) -> int:
    """`sum(k) f32(A[m, k]) * f32(B[n, k])` is the contraction of A and B themselves: a conversion of a
    contraction operand that widens exactly (f8/f16/bf16 -> f32, i8 -> i32) changes no product and
    no sum, so the contraction reads the narrow operand (a GEMM on its tensor cores, not on f32
    copies).  The cast stays for any other reader."""
    count = 0
    for c in list(g.nodes):
        if op(g, c).kind != "contraction":
            continue
        for x in list(g.predecessors(c)):
            xo = op(g, x)
            if xo.kind != "cast":
                continue
            (src, read_labels), = operands(g, x)
            if not _exact_widening(op(g, src).dtype, xo.dtype):
                continue
            pos_in_x = {a: i for i, a in enumerate(xo.axes)}
            moved = tuple((pos, tuple(labels[pos_in_x[r]] for r in read_labels)) for pos, labels in uses(g, x, c))
            if g.has_edge(src, c):
                g.edges[src, c]["uses"] += moved
            else:
                g.add_edge(src, c, uses=moved)
            g.remove_edge(x, c)
            count += 1
    if count:
        remove_dead(g)
    return count


def remove_dead(g: nx.DiGraph) -> int:
    """Remove nodes that no output depends on (inputs and params are kept: they are the signature)."""
    live: set = set()
    for n in g.nodes:
        if op(g, n).kind == "output":
            live.add(n)
            live |= nx.ancestors(g, n)
    dead = [n for n in g.nodes if n not in live and op(g, n).kind not in ("input", "param")]
    g.remove_nodes_from(dead)
    return len(dead)


@dataclass(frozen=True)
class GemmInfo:
    """A contraction recognised as (batched) GEMM: D[batch.., m, n] = sum_k A[.., m, k] B[.., k, n].
    `m_fold` lists A's free labels outside m that B lacks (e.g. the batch and sequence axes of a
    shared-weight linear layer X[b, s, k] W[n, k]): they fold into M, outermost first, so the GEMM
    is D[(m_fold.., m), n] with one M extent."""
    a: str                       # producer node of the A operand
    b: str
    m: str                       # labels
    n: str
    k: str
    batch: tuple[str, ...]
    a_layout: str                # "row": k contiguous in A; "col": m contiguous
    b_layout: str                # "row": n contiguous in B; "col": k contiguous
    m_fold: tuple[str, ...] = ()
    k_fold: tuple[str, ...] = ()     # reduced labels folded into K before k (e.g. heads and head dim)
    anchor2: str | None = None       # a dual GEMM (set by fusion): the second contraction of A ...
    b2: str | None = None            # ... with this second B operand (same dtype, layout and shape)
    scales: tuple = ()               # a block-scaled GEMM: ScaleInfo per factor read at K blocks
    inner: tuple = ()                # ... and the nodes forming the product inside the sum
    gather: tuple = ()               # A's rows gathered (set by fusion): (gather node, index input node)

    @property
    def m_labels(self) -> tuple[str, ...]:
        """Every label folded into M, outermost first (m last)."""
        return (*self.m_fold, self.m)

    @property
    def k_labels(self) -> tuple[str, ...]:
        """Every reduced label, outermost first (k last): K is their product."""
        return (*self.k_fold, self.k)

    def vector_kind(self, labels) -> str | None:
        """The epilogue load kind (compiler.kir.LOAD_KINDS) of a vector read under `labels` and
        broadcast over the GEMM result: 'row' [n], 'col' [m], 'row_batched' [batch.., n],
        'col_batched' [batch.., m] (every batch axis, in order); None for anything else, and for
        vectors along m when M folds several axes."""
        labels = tuple(labels)
        along = labels[-1:] if labels[:-1] in ((), self.batch) else ()
        if along not in ((self.n,), (self.m,)) or (along == (self.m,) and self.m_fold):
            return None
        kind = "row" if along == (self.n,) else "col"
        return kind + "_batched" if len(labels) > 1 else kind


def _storage_order(g: nx.DiGraph, node, labels: tuple[str, ...]) -> tuple[str, ...]:
    """The labels of a value's axes from outermost to innermost in memory."""
    o = op(g, node)
    order = list(labels)
    if o.kind == "input" and o.layout == "col":
        order[-2], order[-1] = order[-1], order[-2]
    return tuple(order)


def gemm_info(g: nx.DiGraph, n) -> GemmInfo | str:
    """Recognise a contraction node as a GEMM; return the reason when it is not one."""
    o = op(g, n)
    if o.kind != "contraction":
        return "not a contraction"
    if len(o.axes) < 2:
        return "its result has fewer than two axes"
    if len(o.reduced) != 1:
        folded = _folded_gemm(g, n)
        return folded if folded is not None else \
            f"it reduces over {len(o.reduced)} indices that are not the innermost axes of both operands in one order"
    (ua, la), (ub, lb) = operands(g, n)
    k = o.reduced[0]
    m, nn = o.axes[-2], o.axes[-1]
    batch = o.axes[:-2]
    if m in lb and m not in la:
        (ua, la), (ub, lb) = (ub, lb), (ua, la)
    if set(la) != set(batch) | {m, k} or set(lb) != set(batch) | {k, nn}:
        folded = _folded_gemm(g, n)
        return folded if folded is not None else "its operands are not [batch.., m, k] and [batch.., k, n]"
    sa, sb = _storage_order(g, ua, la), _storage_order(g, ub, lb)
    if sa[:len(batch)] != batch or sb[:len(batch)] != batch:
        return "batch axes are not the outermost axes of every operand in the same order"
    a_layout = "row" if sa[-1] == k else "col"
    b_layout = "row" if sb[-1] == nn else "col"
    return GemmInfo(ua, ub, m, nn, k, tuple(batch), a_layout, b_layout)


@dataclass(frozen=True)
class ScaleInfo:
    """A block-scale factor inside a GEMM's sum: the gather node reading the scale tensor `source`
    at [mn / block_mn, k / block_k] (order "mk") or [k / block_k, mn / block_mn] ("km")."""
    gather: object
    source: object
    operand: str                 # "a" (indexed by m) | "b" (by n)
    block_k: int
    block_mn: int
    order: str


def gathered_a(g: nx.DiGraph, gi: GemmInfo) -> GemmInfo | None:
    """`sum(d) X[idx[e, t], d] * W[e, f, d]`: A's rows are rows of an input X selected by an integer
    input idx over the GEMM's batch and m axes (MoE tokens gathered by routing index).  The GemmInfo
    with A = X itself and `gather` = (the gather node, idx), or None when A is not such a gather."""
    o = op(g, gi.a)
    if o.kind != "gather" or len(o.subscripts) != 2 or o.subscripts[0] != "@1" or o.subscripts[1] != gi.k:
        return None
    (x, _), (ix, ilabels) = operands(g, gi.a)
    if op(g, x).kind != "input" or op(g, x).layout != "row" or op(g, ix).kind != "input" or \
            op(g, ix).dtype not in INT_DTYPES or tuple(ilabels) != (*gi.batch, gi.m) or gi.m_fold or gi.k_fold:
        return None
    if len(list(g.successors(gi.a))) != 1:
        return None
    return replace(gi, a=x, a_layout="row", gather=(gi.a, ix))


def block_scaled_gemm_info(g: nx.DiGraph, c) -> GemmInfo | str:
    """`sum(k) A[m, k] * sa[m, k / 128] * B[n, k] * sb[n / 128, k / 128]`: a contraction whose product
    is two GEMM operands times factors read at blocks of k (block scales, each indexed by m or n, whole
    or in blocks, and by k / bk with one bk for all): a block-scaled GEMM whose block sizes come from
    the subscripts.  The reason when it is not one."""
    o = op(g, c)
    if o.kind != "contraction" or len(o.axes) != 2 or len(o.reduced) != 1:
        return "not a contraction of two free axes over one reduced axis"
    m, nn = o.axes
    k = o.reduced[0]
    inner: list = []
    leaves: list = []
    for u, labels in operands(g, c):
        if not _product_leaves(g, u, tuple(labels), inner, leaves):
            return "its product goes through values used elsewhere"
    operands_, scales = [], []
    for leaf, labels in leaves:
        lo = op(g, leaf)
        if lo.kind == "gather":
            sc = _block_scale(g, leaf, labels, m, nn, k)
            if isinstance(sc, str):
                return sc
            scales.append(sc)
        elif lo.kind == "input" or (lo.kind == "cast" and is_input_view(g, leaf) and
                                    _exact_widening(op(g, operands(g, leaf)[0][0]).dtype, lo.dtype)):
            operands_.append((leaf, labels))
        else:
            return f"a factor of its product is a {lo.kind} value"
    if not scales:
        return "no factor is read at blocks of k"
    if len(operands_) != 2:
        return "its product does not have exactly two full operands"
    (ua, la), (ub, lb) = operands_
    if set(la) == {nn, k} and set(lb) == {m, k}:
        (ua, la), (ub, lb) = (ub, lb), (ua, la)
    if set(la) != {m, k} or set(lb) != {nn, k}:
        return "its operands are not [m, k] and [k, n]"
    if len({sc.block_k for sc in scales}) != 1:
        return "its block scales use different blocks of k"
    for x in (ua, ub):                   # a cast of an input: the GEMM reads the input itself
        while op(g, x).kind == "cast":
            x = operands(g, x)[0][0]
    sa, sb = _storage_order(g, ua, la), _storage_order(g, ub, lb)
    for x in (ua, ub):
        if op(g, x).kind == "cast":
            inner.append(x)
    return GemmInfo(ua, ub, m, nn, k, (), "row" if sa[-1] == k else "col", "row" if sb[-1] == nn else "col",
                    scales=tuple(scales), inner=tuple(dict.fromkeys(inner)))


def block_scale_nodes(g: nx.DiGraph, gi: GemmInfo) -> set:
    """The nodes of a block-scaled GEMM's group that form the product inside its sum (the mul and
    broadcast nodes, the scale gathers and their `k / bk` subscripts): the MMA and the per-block
    scaling compute them, not the epilogue.  Empty for any other GEMM."""
    out = set(gi.inner)
    for sc in gi.scales:
        out.add(sc.gather)
        stack = [u for u, _ in operands(g, sc.gather)[1:]]
        while stack:
            u = stack.pop()
            if op(g, u).kind in ("elementwise", "index", "const") and u not in out:
                out.add(u)
                stack.extend(x for x, _ in operands(g, u))
    return out


def _product_leaves(g: nx.DiGraph, n, labels: tuple, inner: list, out: list) -> bool:
    """Flatten the product feeding a contraction through `mul` and broadcast nodes used only there:
    `out` gets (leaf, the contraction's labels for its axes), `inner` the nodes passed through."""
    o = op(g, n)
    if (o.kind == "elementwise" and o.fn == "mul") or o.kind == "broadcast":
        if len(list(g.successors(n))) != 1 or o.kind == "broadcast" and not operands(g, n):
            return False
        inner.append(n)
        amap = dict(zip(o.axes, labels))
        return all(_product_leaves(g, u, tuple(amap.get(x, x) for x in ul), inner, out) for u, ul in operands(g, n))
    if not o.axes:
        return False                     # a scalar factor is moved out of sums by the checker
    out.append((n, labels))
    return True


def _block_scale(g: nx.DiGraph, n, labels: tuple, m: str, nn: str, k: str) -> ScaleInfo | str:
    """The block-scale factor a gather node is, or why it is not one."""
    o = op(g, n)
    args = operands(g, n)
    src = args[0][0]
    if op(g, src).kind != "input" or len(o.subscripts) != 2:
        return "a factor of its product is a gather that is not a block scale [mn, k / bk] of an input"
    amap = dict(zip(o.axes, labels))
    subs = []
    for sub in o.subscripts:
        if sub.startswith("@"):
            blk = _index_block(g, args[int(sub[1:])][0], args[int(sub[1:])][1], amap)
            if blk is None:
                return "a block-scale subscript is not `index / literal`"
            subs.append(blk)
        elif sub.startswith("#"):
            return "a block scale read at a literal position"
        else:
            subs.append((amap.get(sub, sub), 1))
    labels_of = [x[0] for x in subs]
    if k not in labels_of:
        return "a gathered factor is not indexed by k / block"
    i_k = labels_of.index(k)
    other = subs[1 - i_k]
    if subs[i_k][1] < 2 or other[0] not in (m, nn):
        return "a block scale must be indexed by k / block and by m or n"
    return ScaleInfo(n, src, "a" if other[0] == m else "b", subs[i_k][1], other[1], "mk" if i_k == 1 else "km")


def _index_block(g: nx.DiGraph, n, labels: tuple, amap: dict):
    """(label, c) when node n, read under `labels` by a gather whose labels map to the contraction's
    by amap, is `index / c` (c a literal >= 1), else None."""
    o = op(g, n)
    if o.kind != "elementwise" or o.fn != "floordiv":
        return None
    (x, lx), (y, _) = operands(g, n)
    if op(g, x).kind != "index" or op(g, y).kind != "const" or not isinstance(op(g, y).value, int) or \
            op(g, y).value < 1:
        return None
    fmap = dict(zip(o.axes, labels))              # floordiv's labels -> the gather's
    (lab,) = lx
    return amap.get(fmap.get(lab, lab), fmap.get(lab, lab)), int(op(g, y).value)


def _folded_gemm(g: nx.DiGraph, n) -> GemmInfo | None:
    """A contraction that is a GEMM once several axes fold into one:
    - A's free axes that B lacks fold into M when they sit, in the same order, right before m in A
      (row-major) and in the result, after any batch axes both operands share (a shared-weight linear
      layer, Y[b, s, n] = sum(k) X[b, s, k] W[n, k]);
    - several reduced axes fold into K when they are the innermost axes of A (row-major) and the
      innermost (or, row-major B, those right before n) of B, in the same order (an attention output
      projection, sum(h, e) O[b, s, h, e] Wo[n, h, e])."""
    o = op(g, n)
    red = set(o.reduced)
    nn = o.axes[-1]
    (ua, la), (ub, lb) = operands(g, n)
    if nn in la:
        (ua, la), (ub, lb) = (ub, lb), (ua, la)
    if nn in la or nn not in lb or not red <= set(la) or not red <= set(lb):
        return None
    batch = tuple(x for x in o.axes if x in la and x in lb)
    ms = tuple(x for x in o.axes if x in la and x not in lb)
    if not ms or set(lb) != set(batch) | red | {nn} or set(la) != set(batch) | set(ms) | red:
        return None
    if o.axes != (*batch, *ms, nn):
        return None
    sa, sb = _storage_order(g, ua, la), _storage_order(g, ub, lb)
    ks = sa[len(sa) - len(red):]
    if sa != (*batch, *ms, *ks):
        return None
    if sb == (*batch, *ks, nn):
        b_layout = "row"
    elif sb == (*batch, nn, *ks):
        b_layout = "col"
    else:
        return None
    return GemmInfo(ua, ub, ms[-1], nn, ks[-1], batch, "row", b_layout, m_fold=ms[:-1], k_fold=ks[:-1])


def _next_id(g: nx.DiGraph) -> int:
    return max((int(str(n)[1:]) for n in g.nodes if str(n)[1:].isdigit()), default=-1) + 1


# The predicates below follow a value back through its operands.  They walk iteratively (a chain
# of 10,000 statements is 10,000 nodes deep) and give up, answering False, after this many nodes:
# index and scalar expressions are a handful of ops; a deeper value is treated as a computed one.
WALK_LIMIT = 256


def _walk_all(g: nx.DiGraph, n, judge, memo: dict | None = None) -> bool:
    """True when judge(x) holds for n and every node reached from n backwards through the nodes
    judge answers "more" for: judge returns True (this node is fine, stop), False (fails), or None
    (fine if all its operands are).  memo: answers of earlier calls on the same, unchanged graph."""
    if memo is not None and n in memo:
        return memo[n]
    stack, seen, ok = [n], {n}, True
    while stack:
        x = stack.pop()
        verdict = judge(x)
        if verdict is True:
            continue
        if verdict is None and memo is not None and x in memo:
            verdict = memo[x] or False
            if verdict:
                continue
        if verdict is False or len(seen) > WALK_LIMIT:
            ok = False
            break
        for u in g.predecessors(x):
            if u not in seen:
                seen.add(u)
                stack.append(u)
    if memo is not None:
        memo[n] = ok
    return ok


def is_input_view(g: nx.DiGraph, n) -> bool:
    """n is a broadcast, or a cast of an input (or of another such view): a value any kernel can
    compute from an input while loading it, so it is never worth a kernel or a buffer of its own."""
    for _ in range(WALK_LIMIT):
        o = op(g, n)
        if o.kind == "broadcast":
            return True
        if o.kind != "cast":
            return False
        (n, _), = operands(g, n)
        if op(g, n).kind == "input":
            return True
    return False


def is_scalar_value(g: nx.DiGraph, n, memo: dict | None = None) -> bool:
    """n is a constant or an op without axes computed only from params and constants: every kernel
    that needs it evaluates it itself."""
    def judge(x):
        o = op(g, x)
        if o.kind in ("const", "size") or (x != n and o.kind == "param"):
            return True
        return None if o.kind in ("elementwise", "cast") and not o.axes else False
    return _walk_all(g, n, judge, memo)


def is_index_expr(g: nx.DiGraph, n, memo: dict | None = None) -> bool:
    """n is computed from index values, sizes, params and constants alone (`j <= i + (T - S)`,
    `h / G`, `f32(j - i)`)."""
    def judge(x):
        o = op(g, x)
        if o.kind in GENERATED_KINDS or (x != n and o.kind == "param"):
            return True
        return None if o.kind in ("elementwise", "cast", "broadcast") and o.fn != "copy" else False
    return _walk_all(g, n, judge, memo)


def is_recomputed(g: nx.DiGraph, n, memo: dict | None = None) -> bool:
    """Index arithmetic and conditions (`j < Lk[b]`: dtype "bool") are computed by every kernel that
    reads them, from whatever they read: no condition ever goes through memory, and no index value
    ties two kernels together."""
    o = op(g, n)
    return is_index_expr(g, n, memo) or (o.dtype == "bool" and o.kind in ("elementwise", "broadcast"))


def _split_per_consumer(g: nx.DiGraph, pick, budget: int | None = None) -> int:
    """Give every consumer of a node `pick` selects its own copy of it (output consumers stay with
    the original, named node).  Nodes are visited consumers-first, so a chain of picked nodes is
    copied whole.  At most `budget` copies are made (None: no limit)."""
    count = 0
    ids = _next_id(g)
    for n in reversed(list(nx.topological_sort(g))):
        o = op(g, n)
        consumers = sorted(g.successors(n), key=lambda v: (op(g, v).kind != "output", str(v)))
        if len(consumers) < 2 or not pick(g, n):
            continue
        if budget is not None and count + len(consumers) - 1 > budget:
            continue
        ins = [(u, g.edges[u, n]["uses"]) for u in g.predecessors(n)]
        for v in consumers[1:]:
            new = f"n{ids}"
            ids += 1
            g.add_node(new, op=replace(o, name=None))
            for u, u_uses in ins:
                g.add_edge(u, new, uses=u_uses)
            g.add_edge(new, v, uses=g.edges[n, v]["uses"])
            g.remove_edge(n, v)
            count += 1
    return count


def is_widening_cast(g: nx.DiGraph, n) -> bool:
    """n converts a value to a wider dtype (f16 -> f32): reading the narrow value and converting it
    where it is needed never costs more memory traffic than storing the wide one."""
    o = op(g, n)
    if o.kind != "cast":
        return False
    (src, _), = operands(g, n)
    return value_bytes(op(g, src).dtype) < value_bytes(o.dtype)


def value_weight(g: nx.DiGraph, n) -> int:
    """Bytes of a value per element, weighted by rank (a full tensor outweighs any vector)."""
    o = op(g, n)
    return value_bytes(o.dtype) * (1 << (2 * len(o.axes)))


def is_cheap_to_recompute(g: nx.DiGraph, n, depth: int = 4) -> bool:
    """n is an elementwise value (e.g. `f32(X[m, c]) - mean[m]` in a layer norm) computed through
    elementwise ops from values that are narrower in memory than n itself: each kernel that needs it
    recomputes it from those rather than reading it back (f32) from a buffer."""
    o = op(g, n)
    if o.kind not in ("elementwise", "cast") or not o.axes or o.fn == "copy":
        return False
    leaves: set = set()

    def walk(x, d) -> bool:
        xo = op(g, x)
        if xo.kind in ("param", *GENERATED_KINDS):
            return True
        if x != n and (xo.kind not in ("elementwise", "cast", "broadcast") or d == 0):
            leaves.add(x)
            return True
        return all(walk(u, d - 1) for u in g.predecessors(x))
    walk(n, depth)
    return bool(leaves) and sum(value_weight(g, x) for x in leaves) < value_weight(g, n)


def split_shared_broadcasts(g: nx.DiGraph) -> int:
    """Give every consumer of a broadcast, of a cast of an input, of a widening cast, or of a value
    cheaper to recompute than to read back, its own copy.  Such a view is free to recompute where it
    is loaded; shared (e.g. after CSE) it would tie its consumers into one kernel or force the
    expanded or converted tensor through memory (an f32 copy of an f16 input, a [M, N] bias)."""
    views = _split_per_consumer(g, lambda g, n: is_input_view(g, n) or is_widening_cast(g, n))
    remat = _split_per_consumer(g, lambda g, n: is_cheap_to_recompute(g, n) or is_input_view(g, n) or
                                is_widening_cast(g, n), budget=max(32, g.number_of_nodes()))
    return views + remat


def split_shared_scalars(g: nx.DiGraph) -> int:
    """Give every consumer of a constant, a scalar expression of params and sizes, or an index
    expression its own copy, so each kernel evaluates the scalars (and index values) it reads and none of them
    ties two kernels together."""
    return _split_per_consumer(g, lambda g, n: (is_scalar_value(g, n) or is_recomputed(g, n)) and
                               not any(op(g, v).kind == "output" for v in g.successors(n)))


# ---------------------------------------------------------------------------------------------
# one form per spelling: what attention recognition (compiler/attention.py) sees does not depend
# on how the user wrote an equivalent expression
# ---------------------------------------------------------------------------------------------

_COMMUTATIVE = ("add", "mul", "maximum", "minimum")
_FLIP = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}


def _is_neg_inf_const(g: nx.DiGraph, n) -> bool:
    o = op(g, n)
    return o.kind == "const" and o.value == -math.inf


def _set_args(g: nx.DiGraph, n, args: list) -> None:
    """Replace n's operands by args [(node, labels)] in position order."""
    for u in list(g.predecessors(n)):
        g.remove_edge(u, n)
    for pos, (u, labels) in enumerate(args):
        if g.has_edge(u, n):
            g.edges[u, n]["uses"] += ((pos, tuple(labels)),)
        else:
            g.add_edge(u, n, uses=((pos, tuple(labels)),))


def order_commutative_operands(g: nx.DiGraph) -> int:
    """A commutative binary op reads its literal constant operand first:
    `s * 0.125` is `0.125 * s`, the form the softmax-scale recognition reads."""
    count = 0
    for n in list(g.nodes):
        o = op(g, n)
        ins = operands(g, n)
        if o.kind == "elementwise" and o.fn == "div" and len(ins) == 2 and o.dtype not in INT_DTYPES:
            d = ins[1][0]
            do = op(g, d)
            if do.kind == "const" and not do.axes and isinstance(do.value, float) and do.value and \
                    math.isfinite(do.value) and math.frexp(do.value)[0] in (0.5, -0.5):
                # x / 2^k is exactly 2^-k * x: the scale `/ sqrt(64.0)` is the factor `0.125 *`
                r = f"n{_next_id(g)}"
                g.add_node(r, op=replace(do, value=1.0 / do.value))
                _set_args(g, n, [(r, ()), ins[0]])
                g.nodes[n]["op"] = o = replace(o, fn="mul")
                count += 1
                continue
        if o.kind != "elementwise" or o.fn not in _COMMUTATIVE or o.dtype in INT_DTYPES:
            continue        # index arithmetic keeps its spelling (`b + 1` is what varlen offsets match)
        if len(ins) != 2:
            continue
        (a, al), (b, bl) = ins
        scalar = lambda u: op(g, u).kind == "const" and not op(g, u).axes     # a literal: no ABI argument moves
        if scalar(b) and not scalar(a):
            _set_args(g, n, [(b, bl), (a, al)])
            count += 1
    return count


def _single_use(g: nx.DiGraph, n) -> bool:
    return g.out_degree(n) == 1 and len(uses(g, n, next(iter(g.successors(n))))) == 1 and \
        op(g, n).name is None


def _negate(g: nx.DiGraph, c, labels):
    """(node, labels) computing `not c`: an integer comparison flips, `not` drops, and/or follow
    De Morgan (in place when c has no other reader); otherwise a `not` node.  Float comparisons
    never flip (`not (x > y)` is not `x <= y` for a NaN)."""
    o = op(g, c)
    if o.kind == "broadcast" and o.dtype == "bool" and _single_use(g, c):
        (u, ul), = operands(g, c)
        _set_args(g, c, [_negate(g, u, ul)])
        return c, labels
    if o.kind == "elementwise" and _single_use(g, c):
        ins = operands(g, c)
        if o.fn == "not":
            u, ul = ins[0]
            return u, tuple(dict(zip(o.axes, labels)).get(x, x) for x in ul)
        if o.fn in _FLIP and all(op(g, u).dtype in INT_DTYPES for u, _ in ins):
            g.nodes[c]["op"] = replace(o, fn=_FLIP[o.fn])
            return c, labels
        if o.fn in ("and", "or"):
            _set_args(g, c, [_negate(g, u, ul) for u, ul in ins])
            g.nodes[c]["op"] = replace(op(g, c), fn="or" if o.fn == "and" else "and")
            return c, labels
    m = f"n{_next_id(g)}"
    g.add_node(m, op=OpNode("elementwise", "bool", tuple(o.axes), tuple(o.shape), fn="not", span=o.span))
    g.add_edge(c, m, uses=((0, tuple(o.axes)),))
    return m, labels


def normalise_masks(g: nx.DiGraph) -> int:
    """Masks in one form: `where(c, -inf, x)` is `where(not c, x, -inf)` with the negation pushed
    down to the comparisons (a window written with `or` and its branches swapped becomes the
    conjunction of its bounds), and a mask commutes past an additive term:
    `where(c, x, -inf) + y` is `where(c, x + y, -inf)` (the mask then reaches the softmax, where
    FlashAttention-4's causal mask or window skips the masked blocks).  -inf + y is -inf for any y
    but +inf: a +inf addend already makes the softmax row NaN in either form."""
    count = 0
    changed = True
    while changed:
        changed = False
        for n in list(nx.topological_sort(g)):
            o = op(g, n)
            if o.kind != "elementwise":
                continue
            ins = operands(g, n)
            if o.fn == "where" and len(ins) == 3 and _is_neg_inf_const(g, ins[1][0]) and \
                    not _is_neg_inf_const(g, ins[2][0]):
                c, cl = ins[0]
                _set_args(g, n, [_negate(g, c, cl), ins[2], ins[1]])
                count += 1
                changed = True
            elif o.fn in ("add", "sub") and len(ins) == 2:
                for k in ((0, 1) if o.fn == "add" else (0,)):
                    w, wl = ins[k]
                    wo = op(g, w)
                    if wo.kind != "elementwise" or wo.fn != "where" or not _single_use(g, w) or \
                            len(set(wl)) != len(wl) or set(wl) != set(o.axes) or len(wo.axes) != len(wl):
                        continue
                    (c, cl), (x, xl), (ninf, nl) = operands(g, w)
                    if not _is_neg_inf_const(g, ninf) or _is_neg_inf_const(g, x):
                        continue
                    to_n = dict(zip(wo.axes, wl))          # w's labels -> n's
                    cl, xl = tuple(to_n[a] for a in cl), tuple(to_n[a] for a in xl)
                    y = ins[1 - k]
                    # n becomes the where (it keeps n's name and readers); w becomes x +/- y
                    _set_args(g, w, [(x, xl), y] if k == 0 else [y, (x, xl)])
                    g.nodes[w]["op"] = replace(o, fn=o.fn, name=None)
                    _set_args(g, n, [(c, cl), (w, tuple(o.axes)), (ninf, nl)])
                    g.nodes[n]["op"] = replace(o, fn="where")
                    count += 1
                    changed = True
                    break
            if changed:
                break
    return count


def recognise_softmax(g: nx.DiGraph) -> int:
    """A hand-written softmax is a softmax: `x = exp(y - max(j) y); p = x / sum(j) x` (every value
    over the same axes, read in their own order, the intermediates read by nothing else) becomes
    `p = softmax(j) y`, so attention recognition sees it."""
    def only(n, reader) -> bool:
        return set(g.successors(n)) == {reader} and op(g, n).kind != "output"

    def ident(n, labels) -> bool:
        return tuple(labels) == tuple(op(g, n).axes)

    def reduced_over(b, fn, axes):
        """b broadcasts a reduction `fn` over one label of `axes` to axes: (reduction, its operand, label)."""
        bo = op(g, b)
        if bo.kind != "broadcast" or tuple(bo.axes) != axes:
            return None
        (r, rl), = operands(g, b)
        ro = op(g, r)
        if ro.kind != "reduction" or ro.fn != fn or len(ro.reduced) != 1 or not ident(r, rl):
            return None
        j = ro.reduced[0]
        (u, ul), = operands(g, r)
        if tuple(a for a in axes if a != j) != tuple(ro.axes) or j not in axes or tuple(ul) != axes:
            return None
        return r, u, j

    count = 0
    for n in list(nx.topological_sort(g)):
        o = op(g, n)
        if o.kind != "elementwise" or o.fn != "div" or not o.axes or o.dtype in INT_DTYPES:
            continue
        A = tuple(o.axes)
        (x, xl), (bz, bzl) = operands(g, n)
        xo = op(g, x)
        if not (ident(x, xl) and ident(bz, bzl) and xo.kind == "elementwise" and xo.fn == "exp" and
                tuple(xo.axes) == A):
            continue
        z = reduced_over(bz, "sum", A)
        if z is None or z[1] != x or not only(bz, n) or not only(z[0], bz) or set(g.successors(x)) != {n, z[0]}:
            continue
        (d, dl), = operands(g, x)
        do = op(g, d)
        if not (ident(d, dl) and do.kind == "elementwise" and do.fn == "sub" and tuple(do.axes) == A and only(d, x)):
            continue
        (y, yl), (bm, bml) = operands(g, d)
        m = reduced_over(bm, "max", A)
        if m is None or m[1] != y or m[2] != z[2] or not ident(y, yl) or not ident(bm, bml) or \
                not only(bm, d) or not only(m[0], bm) or op(g, y).dtype != o.dtype:
            continue
        _set_args(g, n, [(y, A)])
        g.nodes[n]["op"] = OpNode("softmax", o.dtype, A, tuple(o.shape), fn=z[2], name=o.name, span=o.span)
        count += 1
    if count:
        remove_dead(g)
    return count


def squeeze_unit_reads(g: nx.DiGraph) -> int:
    """An input whose every read is a plain view that drops axes of extent 1 read at 0
    (`K : [B, 1, T, d]` read as `K[b, 0, j, e]`) is that view: the input node takes the shape without
    those axes (OpNode.squeezed records them; the bytes are the same) and its readers read it
    directly, so `K[b, 0, j, e]` is `K[b, j, e]` (multi-query attention) to everything after."""
    count = 0
    for x in [n for n in g.nodes if op(g, n).kind == "input"]:
        xo = op(g, x)
        if xo.packed is not None or xo.squeezed or not g.out_degree(x):
            continue
        drop: set | None = None
        for n in g.successors(x):
            o = op(g, n)
            if o.kind != "gather" or len(list(g.predecessors(n))) != 1 or \
                    [pos for pos, _l in uses(g, x, n)] != [0] or len(o.subscripts) != len(xo.shape):
                drop = None
                break
            zeros = {k for k, sub in enumerate(o.subscripts) if sub == "#0"}
            kept = tuple(sub for k, sub in enumerate(o.subscripts) if k not in zeros)
            if not zeros or (drop is not None and zeros != drop) or kept != tuple(o.axes) or \
                    any(xo.shape[k] != 1 for k in zeros):
                drop = None
                break
            drop = zeros
        if not drop:
            continue
        if xo.layout == "col" and (len(xo.shape) - 1 in drop or len(xo.shape) - 2 in drop):
            continue                # a col matrix keeps its last two axes (its layout names them)
        keep = [k for k in range(len(xo.shape)) if k not in drop]
        g.nodes[x]["op"] = replace(xo, axes=tuple(f"d{k}" for k in range(len(keep))),   # graph.py's input axes
                                   shape=tuple(xo.shape[k] for k in keep),
                                   squeezed=tuple(sorted(drop)))
        for n in list(g.successors(x)):
            _rewire(g, n, x)
            g.remove_node(n)
        count += 1
    return count


def canonicalize(g: nx.DiGraph) -> dict[str, int]:
    """Run every canonicalisation pass; returns how much each one changed."""
    stats = {"copies": remove_copies(g), "squeezed": squeeze_unit_reads(g), "folded": fold_constants(g),
             "merged": merge_common_subexpressions(g), "dead": remove_dead(g)}
    stats["operand_casts"] = absorb_operand_casts(g)
    stats["softmax"] = recognise_softmax(g)
    stats["commuted"] = order_commutative_operands(g)
    stats["masks"] = normalise_masks(g)
    if stats["masks"] or stats["commuted"]:
        stats["merged"] += merge_common_subexpressions(g)
        stats["dead"] += remove_dead(g)
    stats["broadcasts_split"] = split_shared_broadcasts(g)
    stats["scalars_split"] = split_shared_scalars(g)
    return stats
