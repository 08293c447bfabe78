"""Kernel IR: the contract between planning and backends.

One `KernelIR` per planned kernel: a frozen, self-contained value that holds no reference into the
compiler's networkx graph.  It has
- the buffers the kernel touches (name, role, dtype, symbolic shape, layout, alignment);
- its ops, a closed SSA sub-graph in topological order: values that come from outside the kernel
  are `input`/`param` ops naming the buffer they load; every other op is computed inside;
- which values leave the kernel, and into which buffers (`stores`);
- a structured view where one applies: `GemmStructure` (a contraction recognised as a GEMM, with
  its epilogue as a small expression DAG, `Epilogue`) or `AttentionStructure`;
- the user's per-arch schedule hints.

`verify(ir)` checks its invariants, `format_ir(ir)` prints it, `ir_to_json`/`ir_from_json`
round-trip it, and `ir.graph()` gives a fresh networkx view for backends that walk ops.
Every backend consumes only this IR.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Literal, Protocol, Union

from kspec.core import DTYPES, INT_DTYPES, KspecInternalError, Span, format_extent

Extent = Union[str, int]                 # a size symbol or an int literal
BatchExtent = Union[Extent, tuple]        # a flattened batch: the product of several extents

KINDS = ("gemm", "attention", "attention_bwd", "rowwise", "elementwise", "reduction", "softmax", "contraction",
         "colsum")
OP_KINDS = ("input", "param", "const", "index", "size", "contraction", "elementwise", "broadcast", "reduction",
            "softmax", "cast", "gather", "partial")
# "index": the integer value of its one axis label (fn = the label); "size": the runtime value of a
# size symbol (fn = the symbol).  Conditions (comparisons, and/or/not) have dtype "bool", a value
# that only lives inside a kernel (no buffer holds one).
BOOL = "bool"
ROLES = ("input", "output", "param", "intermediate")


# ---- epilogue expressions (evaluated per output element (m, n), in f32 unless cast) ----------

@dataclass(frozen=True)
class Accum:
    """The GEMM accumulator value at (m, n); index 1: the second accumulator of a dual GEMM
    (A times the second B operand)."""
    index: int = 0


@dataclass(frozen=True)
class Load:
    """An epilogue input, by buffer name.  kind: 'row' = vector indexed by n (broadcast over m, e.g.
    a bias[N]), 'col' = vector indexed by m, 'row_batched' / 'col_batched' = one such vector per
    batch entry of a batched GEMM (a row-major [L, N] / [L, M] buffer over every batch axis, e.g. a
    per-batch bias[l, n] or key-padding mask[b, j]), 'full' = an MxN tensor (e.g. a residual),
    'scalar' = a runtime scalar parameter (passed by value)."""
    name: str
    kind: Literal["row", "col", "row_batched", "col_batched", "full", "scalar"]
    dtype: str


LOAD_KINDS = ("row", "col", "row_batched", "col_batched", "full", "scalar")
VECTOR_AXIS = {"row": "n", "col": "m", "row_batched": "n", "col_batched": "m"}   # the axis a vector runs along


@dataclass(frozen=True)
class Const:
    value: float                  # an int in integer (index) arithmetic: `j % 2`, `i - 128`


@dataclass(frozen=True)
class Op:
    """fn: one of add, sub, mul, div, neg, maximum, minimum, relu, gelu (erf), gelu_tanh, silu,
    sigmoid, tanh, exp, log, sqrt, rsqrt, abs, clamp (args: x, lo, hi), cast:<dtype> (one arg).
    In attention mods also: floordiv, mod (integer), lt, le, gt, ge, eq, ne (-> bool), and, or,
    not (bool), where (args: cond, a, b)."""
    fn: str
    args: tuple["EpiExpr", ...]


# ---- attention mods: expressions per score element (b.., h, i, j) -------------------------------
# The score_mod / mask_mod model of FlexAttention and FlashAttention-4: the score modification and
# the mask between QK^T and the softmax, lifted out as small expressions over the logical indices,
# the score, runtime scalars (`Load(kind="scalar")`) and elements of extra tensors (`AuxLoad`).

@dataclass(frozen=True)
class Score:
    """The attention score at (b.., h, i, j), already multiplied by the scale (f32)."""


@dataclass(frozen=True)
class ScoreGrad:
    """In an attention backward's score_mod_grad: the gradient of the loss with respect to the
    modified score at (b.., h, i, j), P * (dP - D) (f32; FlashAttention-4's score_mod_bwd `grad`)."""


@dataclass(frozen=True)
class Index:
    """The integer value of one of the attention's labels (a batch label, the query or the key)."""
    label: str


@dataclass(frozen=True)
class Size:
    """The runtime value of a size symbol (an extent such as S or T), an integer."""
    name: str


@dataclass(frozen=True)
class AuxLoad:
    """One element of an extra tensor: `buffer[index...]`, each subscript an integer expression."""
    buffer: str
    index: tuple["EpiExpr", ...]
    dtype: str


EpiExpr = Union[Accum, Load, Const, Op, Score, ScoreGrad, Index, Size, AuxLoad]
ModExpr = EpiExpr


@dataclass(frozen=True)
class Store:
    """An MxN value written by the epilogue into a buffer: the main output D, or an auxiliary
    store of an intermediate value that the spec also returns."""
    name: str
    value: EpiExpr
    dtype: str
    layout: Literal["row", "col"] = "row"


@dataclass(frozen=True)
class ReductionStore:
    """A reduction of an epilogue value along one axis: axis 'n' gives a vector over m (row
    reduction, e.g. a row max), axis 'm' a vector over n; 'mn' reduces over both, one value per
    batch entry (an FP8 recipe's amax), stored into a buffer of the batch axes and axes of extent 1."""
    name: str
    op: Literal["max", "sum"]
    axis: Literal["m", "n", "mn"]
    value: EpiExpr
    dtype: str


@dataclass(frozen=True)
class Epilogue:
    stores: tuple[Store, ...]                 # the main output D is the last
    reductions: tuple[ReductionStore, ...] = ()

    @property
    def output(self) -> Store:
        return self.stores[-1]


def _children(e: EpiExpr) -> tuple:
    if isinstance(e, Op):
        return e.args
    if isinstance(e, AuxLoad):
        return e.index
    return ()


def epi_nodes(e: EpiExpr):
    """Every node of an expression, root first."""
    yield e
    for a in _children(e):
        yield from epi_nodes(a)


def epi_fns(e: EpiExpr) -> set[str]:
    """Every Op fn an expression uses."""
    return {x.fn for x in epi_nodes(e) if isinstance(x, Op)}


def epi_loads(e: EpiExpr) -> list[Load]:
    return [x for x in epi_nodes(e) if isinstance(x, Load)]


def format_epi(e: EpiExpr) -> str:
    if isinstance(e, Accum):
        return "acc" if e.index == 0 else f"acc{e.index}"
    if isinstance(e, Load):
        if e.kind in ("scalar", "full"):
            return e.name
        return f"{e.name}[{'l, ' if e.kind.endswith('_batched') else ''}{VECTOR_AXIS[e.kind]}]"
    if isinstance(e, Const):
        return repr(e.value)
    if isinstance(e, Score):
        return "score"
    if isinstance(e, ScoreGrad):
        return "dscore"
    if isinstance(e, Index):
        return f"idx({e.label})"
    if isinstance(e, Size):
        return f"size({e.name})"
    if isinstance(e, AuxLoad):
        return f"{e.buffer}[{', '.join(format_epi(a) for a in e.index)}]"
    return f"{e.fn}({', '.join(format_epi(a) for a in e.args)})"


def key_length_bound(mask: EpiExpr | None, key: str, batch: tuple[str, ...]) -> str | None:
    """The buffer X when the mask has a top-level conjunct `key < X[b]` (b the first batch label):
    per-sequence key counts, as FA4's seqused_k.  None otherwise."""
    stack = [mask] if mask is not None else []
    while stack:
        e = stack.pop()
        if isinstance(e, Op) and e.fn == "and":
            stack.extend(e.args)
            continue
        if isinstance(e, Op) and e.fn in ("lt", "gt"):
            j, x = e.args if e.fn == "lt" else e.args[::-1]
            if j == Index(key) and isinstance(x, AuxLoad) and batch and x.index == (Index(batch[0]),):
                return x.buffer
    return None


# ---- the IR ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IRBuffer:
    name: str                      # the spec's tensor/param name, or a generated intermediate name
    role: str                      # input | output | param | intermediate
    dtype: str
    shape: tuple[Extent, ...]
    layout: str = "row"
    align: int = 16                # bytes the data pointer (and row pitches) are assumed aligned to
    # varlen: the shape is logical [B, S, ...]; in memory sequence b is rows packed[b] ..
    # packed[b + 1] - 1 of a [rows, ...] array (`packed` names the offsets buffer, i32 [B + 1])
    packed: str | None = None

    def describe(self) -> str:
        if self.role == "param":
            return f"param {self.name} : {self.dtype}"
        shape = f"[{', '.join(map(str, self.shape))}]"
        pk = f" packed({self.packed})" if self.packed else ""
        return f"{self.role} {self.name} : {self.dtype}{shape} {self.layout}{pk} align {self.align}"


@dataclass(frozen=True)
class IROp:
    id: str
    kind: str                      # see OP_KINDS
    dtype: str
    axes: tuple[str, ...]          # index labels of the value, in storage order
    shape: tuple[Extent, ...]
    args: tuple[tuple[str, tuple[str, ...]], ...] = ()   # (op id, labels this op reads its axes under)
    fn: str = ""
    name: str | None = None        # the spec name the value carries, if any
    reduced: tuple[str, ...] = ()
    reduced_shape: tuple[Extent, ...] = ()
    value: float | int | None = None
    causal: str | None = None
    layout: str = "row"
    buffer: str | None = None      # input/param ops: the buffer loaded
    # gather: per axis of the source (operand 0), what selects the element: an axis label of this op,
    # "#<int>" a literal, or "@<pos>" the integer value of operand <pos> (source axes read as "~<axis>")
    subscripts: tuple[str, ...] = ()
    span: Span | None = field(default=None, compare=False, repr=False)

    def label(self) -> str:
        ax = f"[{', '.join(self.axes)}]" if self.axes else ""
        if self.kind in ("input", "param"):
            return f"load {self.buffer}{ax} : {self.dtype}" + (" col" if self.layout == "col" else "")
        if self.kind == "const":
            return f"const {self.value}"
        if self.kind in ("index", "size"):
            return f"{self.kind} {self.fn}{ax} : {self.dtype}"
        if self.kind in ("contraction", "reduction", "partial"):
            return f"{self.kind} {self.fn}({', '.join(self.reduced)}){ax} : {self.dtype}"
        if self.kind == "softmax":
            c = f", causal={self.causal}" if self.causal else ""
            return f"softmax({self.fn}{c}){ax} : {self.dtype}"
        return f"{self.kind} {self.fn}{ax} : {self.dtype}"


@dataclass(frozen=True)
class GemmStructure:
    """D[batch.., m, n] = epilogue(sum_k A[batch.., m, k] * B[batch.., k, n])."""
    anchor: str                    # the contraction op
    a: str                         # op ids of the operands (input ops)
    b: str
    a_buffer: str
    b_buffer: str
    a_dtype: str
    b_dtype: str
    acc_dtype: str
    a_layout: str                  # "row": k contiguous in A; "col": m contiguous
    b_layout: str                  # "row": n contiguous in B; "col": k contiguous
    m: str                         # labels
    n: str
    k: str
    batch: tuple[str, ...]
    dims: tuple[tuple[str, BatchExtent], ...]     # ("M", ..), ("N", ..), ("K", ..), ("L", ..)
    m_fold: tuple[str, ...] = ()                  # A's free labels folded into M before m (shared weight)
    k_fold: tuple[str, ...] = ()                  # reduced labels folded into K before k
    # a dual GEMM (e.g. SwiGLU's gate and up projections): a second contraction of the same A with
    # a second B operand (same dtype, layout and extents), accumulated beside the first (Accum(1))
    anchor2: str | None = None
    b2: str | None = None
    b2_buffer: str | None = None
    # a block-scaled GEMM: factors read at K blocks inside the sum (`sa[m, k / 128]`, `sb[n / 128,
    # k / 128]`), D = epilogue(sum_k A[m, k] sa[m, k / bk] B[k, n] sb[.., k / bk]); each entry
    # (buffer, operand "a"|"b", dtype, block_k, block_mn, order), order "mk": the scale tensor is
    # [mn blocks, k blocks], "km": [k blocks, mn blocks]; block_mn 1 = one scale per row (column)
    scales: tuple[tuple[str, str, str, int, int, str], ...] = ()
    # A's rows gathered: GEMM row r (of the packed rows) is row a_rows[r] of a_buffer (an integer
    # buffer packed like the output; MoE tokens read through their routing index)
    a_rows: str | None = None

    @property
    def dual(self) -> bool:
        return self.b2 is not None

    @property
    def block_scales(self) -> tuple["BlockScale", ...]:
        return tuple(BlockScale(*x) for x in self.scales)


@dataclass(frozen=True)
class BlockScale:
    """One block-scale factor of a GEMM (GemmStructure.scales): `buffer[mn / block_mn, k / block_k]`
    ("mk") or `buffer[k / block_k, mn / block_mn]` ("km") multiplies A (operand "a", mn = m) or B
    ("b", mn = n) inside the sum."""
    buffer: str
    operand: str
    dtype: str
    block_k: int
    block_mn: int
    order: str = "mk"

    def describe(self) -> str:
        mn = "m" if self.operand == "a" else "n"
        mn = mn if self.block_mn == 1 else f"{mn} / {self.block_mn}"
        idx = (mn, f"k / {self.block_k}") if self.order == "mk" else (f"k / {self.block_k}", mn)
        return f"{self.buffer}[{', '.join(idx)}] : {self.dtype}"


@dataclass(frozen=True)
class AttentionStructure:
    """O[b, h, i, e] = sum_j softmax_j(scale * sum_e Q[b,h,i,e] K[b,h,j,e]) V[b,h,j,e]."""
    qk: str
    softmax: str
    pv: str
    q: str
    k: str
    v: str
    q_buffer: str
    k_buffer: str
    v_buffer: str
    dtypes: tuple[str, str, str]
    batch: tuple[str, ...]
    query: str
    key: str
    head: str
    causal: bool
    scale: str | float | None      # a param name, a folded constant, or None (not one factor)
    head_dims: tuple[Extent | None, Extent | None, Extent | None]   # of Q, K, V
    dims: tuple[tuple[str, Extent], ...]          # ("B", ..), ("H", ..), ("S", ..), ("T", ..), ("E", ..)
    inputs_row_major: bool
    out_buffers: tuple[str, ...]
    kv_shared: tuple[str, ...] = ()                # batch axes of Q that K and V lack (MQA)
    p_dtypes: tuple[str, ...] = ()                 # dtypes the probabilities are rounded to before PV
    # The lifted score modification and mask (FlexAttention / FA4 score_mod and mask_mod), applied
    # in this order after the scale: s' = score_mod(score, idx..); keep (b.., i, j) iff mask(..).
    # A masked score is -inf; a row with every score masked has output 0 (and log-sum-exp -inf).
    # Types: Index, Size and integer Consts are integers, arithmetic on them is integer (floordiv,
    # mod floor-rounded), comparisons give booleans, an explicit cast:f32 converts; AuxLoad values
    # take part in f32 arithmetic.  `causal` (top-left, key <= query) applies together with `mask`.
    score_mod: EpiExpr | None = None               # None: the scaled score as it is
    mask: EpiExpr | None = None                    # a boolean expression; None: nothing masked
    aux: tuple[str, ...] = ()                      # buffers the mods read (AuxLoad), all in ir.buffers
    # GQA: K/V are read at head index h // kv_group: an int, a size symbol, the name of an i32
    # param (`K[b, h / G, j, e]`) or "H/KH", the quotient of two size symbols (`K[b, h / (H / KH), ..]`);
    # kv_head is the K/V head count
    kv_group: Extent | None = None
    kv_head: Extent | None = None                  # GQA: the K/V head count (extent of that axis)
    lse: str | None = None                         # buffer receiving the log-sum-exp [batch.., i], f32
    # Paged KV cache: K and V are page pools [pages, page_size, heads.., E] read through a block
    # table [batch[0], pages per sequence] (an integer buffer): key j of sequence b is row
    # j % page_size of page page_table[b, j // page_size].  The key extent is pages * page_size.
    page_table: str | None = None
    page_size: Extent | None = None
    # Per-sequence key counts (FA4's seqused_k): an integer buffer [batch[0]]; keys j >= kv_len[b]
    # are masked.  The mask says so too (it holds the conjunct `j < kv_len[b]`), so a backend that
    # ignores this field still computes the same function; one that knows it may skip those keys.
    kv_len: str | None = None
    # Storage order of Q, K, V and O: each buffer's axes named by the attention's labels (K/V's head
    # axis by the query head label, read at h // kv_group under GQA); () means the canonical
    # [batch.., seq, head].  FlashAttention's own layout [b, s, h, e] is ((b, i, h, e), (b, j, h, e), ..).
    # A packed buffer (IRBuffer.packed) stores its first two axes (batch, seq) as one row axis.  With
    # an `lse` output, a fifth entry is its [batch.., query] order.
    orders: tuple[tuple[str, ...], ...] = ()
    # An output scale: O = o_scale(b..) * sum_j p V, an expression over the batch labels (Index) and
    # loads of aux buffers (FlashAttention-4's v_descale of FP8 attention, `v_descale[b, h / G] * ..`)
    o_scale: EpiExpr | None = None

    @property
    def head_dim(self) -> Extent | None:
        return self.head_dims[0] if len(set(self.head_dims)) == 1 else None


@dataclass(frozen=True)
class AttentionBwdStructure:
    """The backward of a plain, causal or score-modified attention (what `kspec grad` derives;
    FlashAttention-4's backward): P = exp(mod(scale * Q K^T) (causally masked) - LSE), dV = P^T dO,
    dP = dO V^T, D = rowsum(dO * O), dS = scale * mod'(scale * Q K^T) * P * (dP - D) (masked),
    dQ = dS K, dK = dS^T Q (mod the identity without a score_mod).  Tensors are [b, h, seq, head]
    in any order with the head dim innermost (`layouts`), or packed (varlen: the buffers' `packed`
    offsets, [b, seq, h, head]); LSE is f32 [b, h, i] (packed: [b, i, h]).  GQA: K and V (and dK,
    dV) have kv_head heads, read at head h // kv_group; dK and dV sum each group's query heads'
    parts."""
    q_buffer: str
    k_buffer: str
    v_buffer: str
    o_buffer: str
    do_buffer: str
    lse_buffer: str
    dq_buffer: str
    dk_buffer: str
    dv_buffer: str
    dtype: str                                     # of Q, K, V, O, dO (f16 | bf16)
    out_dtypes: tuple[str, str, str]               # of dQ, dK, dV
    batch: tuple[str, ...]
    query: str
    key: str
    head: str
    causal: bool
    scale: str | None                              # a param name, or None (scale 1)
    head_dim: Extent | None
    dims: tuple[tuple[str, Extent], ...]           # ("B", ..), ("H", ..), ("S", ..), ("T", ..), ("E", ..)
    bottom_right: bool = False                     # causal as key <= query + (T - S) (FlashAttention-4's)
    # storage order of Q, K, V, O, dO, LSE, dQ, dK, dV as roles B, H, S (T for K, V, dK, dV), E,
    # outermost first; () when every tensor is canonical ([B, H, seq, E], LSE [B, H, S])
    layouts: tuple[tuple[str, ...], ...] = ()
    # GQA: the group (an int, a size symbol or the name of an i32 param, as AttentionStructure's
    # kv_group) and the K/V head count; None, None without GQA
    kv_group: Extent | None = None
    kv_head: Extent | None = None
    # A score modification (AttentionStructure.score_mod: the softmax reads score_mod(scaled score))
    # and its derivative (compiler/attention_grad.py): dS = scale * score_mod_grad, an expression over
    # ScoreGrad (P * (dP - D)), Score and the mod's own leaves; FlashAttention-4's score_mod and
    # score_mod_bwd.  aux: the buffers they read (AuxLoad), inputs of the kernel that get no gradient.
    score_mod: EpiExpr | None = None
    score_mod_grad: EpiExpr | None = None
    aux: tuple[str, ...] = ()
    # padded sequences: the i32 [B] buffers of the used query and key counts the mask bounds by
    # (`i < Lq[b]`, `j < Lk[b]`; FlashAttention-4's seqused_q / seqused_k), None where it does not
    seqused_q: str | None = None
    seqused_k: str | None = None


# AttentionBwdStructure's fields written to its JSON only when set (other backwards keep their digests)
_BWD_OPTIONAL = ("kv_group", "kv_head", "bottom_right", "layouts", "score_mod", "score_mod_grad", "aux", "seqused_q",
                 "seqused_k")


@dataclass(frozen=True)
class RowStructure:
    """A row-wise kernel: one row per combination of the `outer` labels, reduced along `axis`.  A
    column-partials finishing kernel ("colsum"): one row per column (`outer` the row kernel's row
    axis), reduced along the slot axis of the partials it sums."""
    outer: tuple[str, ...]
    axis: str
    extents: tuple[tuple[str, Extent], ...]       # label -> extent (symbol or literal)

    def extent(self, label: str) -> Extent:
        return dict(self.extents)[label]


@dataclass(frozen=True)
class ArchHint:
    tile: tuple[int, int, int] | None = None
    cluster: tuple[int, int, int] | None = None
    stages: int | None = None
    backend: str | None = None
    # where each setting is written (a backend that cannot honour one is reported there); not part
    # of the IR's identity, like every span
    spans: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)

    def setting(self, key: str) -> str:
        """The setting as written: `tile 128x128x64`, `stages 4`."""
        v = getattr(self, key)
        return f"{key} {'x'.join(map(str, v)) if isinstance(v, tuple) else v}"

    def span_of(self, key: str) -> Span | None:
        return dict(self.spans).get(key)


@dataclass(frozen=True)
class KernelIR:
    id: str                                        # unique within a spec: "<kernel>_<i>"
    kind: str                                      # see KINDS
    spec_kernel: str
    buffers: tuple[IRBuffer, ...]
    ops: tuple[IROp, ...]
    stores: tuple[tuple[str, str, tuple[str, ...]], ...]   # (op id, buffer, labels of the buffer's axes)
    gemm: GemmStructure | None = None
    epilogue: Epilogue | None = None
    attention: AttentionStructure | None = None
    hints: tuple[tuple[str, ArchHint], ...] = ()   # arch -> the spec's schedule hint
    row: RowStructure | None = None
    anchor: str | None = None                      # the op the kernel is organised around
    span: Span | None = field(default=None, compare=False, repr=False)
    attention_bwd: AttentionBwdStructure | None = None

    # -- lookups ---------------------------------------------------------------------------------
    def op(self, op_id: str) -> IROp:
        for o in self.ops:
            if o.id == op_id:
                return o
        raise KeyError(op_id)

    def buffer(self, name: str) -> IRBuffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    def hint(self, arch: str) -> ArchHint:
        return dict(self.hints).get(arch, ArchHint())

    @property
    def internal(self) -> tuple[IROp, ...]:
        """The ops computed inside the kernel (not loads of outside values)."""
        return tuple(o for o in self.ops if o.kind not in ("input", "param"))

    def stores_of(self, op_id: str) -> list[str]:
        return [b for n, b, _ in self.stores if n == op_id]

    def store_labels(self, op_id: str, buffer: str) -> tuple[str, ...]:
        """The labels under which `buffer`'s axes (in declared order) hold op `op_id`'s value."""
        for n, b, labels in self.stores:
            if n == op_id and b == buffer:
                return labels
        raise KeyError((op_id, buffer))

    def reads(self) -> list[str]:
        out: list[str] = []
        for o in self.ops:
            if o.kind in ("input", "param") and o.buffer not in out:
                out.append(o.buffer)  # type: ignore[arg-type]
        return out

    def writes(self) -> list[str]:
        out: list[str] = []
        for _, b, _ in self.stores:
            if b not in out:
                out.append(b)
        return out

    def digest(self) -> str:
        """A content hash (spans excluded): what a backend's cache keys on."""
        return hashlib.sha256(json.dumps(ir_to_json(self, spans=False), sort_keys=True).encode()).hexdigest()

    def graph(self):
        """A fresh networkx view of the ops (the compiler's graph conventions: node attribute "op"
        with the op's fields, edge attribute "uses" = ((position, labels), ...))."""
        import networkx as nx
        g = nx.DiGraph(kernel=self.id)
        for o in self.ops:
            g.add_node(o.id, op=o)
            for pos, (u, labels) in enumerate(o.args):
                if g.has_edge(u, o.id):
                    g.edges[u, o.id]["uses"] += ((pos, tuple(labels)),)
                else:
                    g.add_edge(u, o.id, uses=((pos, tuple(labels)),))
        return g


@dataclass(frozen=True)
class BackendChoice:
    """Which backend builds a kernel on one arch, as the registry decided while scheduling."""
    backend: str
    kind: str                                      # the kernel kind it builds
    fallback: str | None                           # why this is a slow loop-kernel fallback, if it is
    config: tuple[tuple[str, str], ...] = ()       # the backend's configuration (tile, cluster, ...)
    rejected: tuple[tuple[str, str], ...] = ()     # (backend, reason) of preferred backends that declined
    opt_in: tuple[tuple[str, str], ...] = ()       # of those, the ones that build it only when asked

    def describe(self) -> str:
        cfg = " ".join(f"{k}={v}" for k, v in self.config)
        out = f"{self.backend} {self.kind}" + (f" ({cfg})" if cfg else "")
        return out + (f"  FALLBACK: {self.fallback}" if self.fallback else "")


class Oracle(Protocol):
    """What fusion and scheduling ask about backends (implemented by backends.registry.Planner);
    the compiler holds no backend tables of its own."""

    def epilogue_fns(self, archs: tuple[str, ...]) -> frozenset[str] | None: ...

    def epilogue_reductions(self, archs: tuple[str, ...]) -> frozenset[str]: ...

    def epilogue_loads(self, archs: tuple[str, ...]) -> frozenset[str]: ...

    def can_fuse(self, ir: "KernelIR", archs: tuple[str, ...]) -> str | None: ...

    def choose(self, ir: "KernelIR", arch: str) -> BackendChoice: ...


# ---- verifier ------------------------------------------------------------------------------------

def verify(ir: KernelIR) -> KernelIR:
    """Check the IR's invariants; raise KspecInternalError naming the first violation."""
    def bad(msg: str):
        raise KspecInternalError(f"kernel IR {ir.id}: {msg}")

    if ir.kind not in KINDS:
        bad(f"unknown kind {ir.kind!r}")
    names = [b.name for b in ir.buffers]
    if len(set(names)) != len(names):
        bad("duplicate buffer names")
    bufs = {b.name: b for b in ir.buffers}
    for b in ir.buffers:
        if b.role not in ROLES or b.dtype not in DTYPES or b.layout not in ("row", "col"):
            bad(f"buffer {b.name}: bad role/dtype/layout")
        if b.role == "param" and b.shape:
            bad(f"param {b.name} has a shape")
        if b.layout == "col" and len(b.shape) < 2:
            bad(f"buffer {b.name}: col layout needs rank >= 2")
        if b.packed is not None:
            cu = next((x for x in ir.buffers if x.name == b.packed), None)
            if b.role not in ("input", "output") or len(b.shape) < 2 or \
                    (cu is not None and (cu.dtype not in INT_DTYPES or len(cu.shape) != 1)):
                bad(f"packed buffer {b.name}: an input or output [batch, seq, ..] packed by an integer vector")
    seen: dict[str, IROp] = {}
    for o in ir.ops:
        if o.id in seen:
            bad(f"op {o.id} defined twice")
        if o.kind not in OP_KINDS:
            bad(f"op {o.id}: unknown kind {o.kind!r}")
        if o.dtype not in DTYPES and o.dtype != BOOL:
            bad(f"op {o.id}: unknown dtype {o.dtype!r}")
        if len(o.axes) != len(o.shape) or len(set(o.axes)) != len(o.axes):
            bad(f"op {o.id}: axes {o.axes} do not match shape {o.shape}")
        if o.kind in ("input", "param"):
            if o.args or o.buffer not in bufs:
                bad(f"op {o.id}: a load must name a buffer of the kernel and take no operands")
            b = bufs[o.buffer]  # type: ignore[index]
            if b.dtype != o.dtype or len(b.shape) != len(o.axes):
                bad(f"op {o.id}: does not match buffer {b.name}")
        elif o.kind == "const":
            if o.args or o.value is None:
                bad(f"const {o.id} must have a value and no operands")
        elif o.kind in ("index", "size"):
            if o.args or not o.fn or (o.kind == "index") != (o.axes == (o.fn,)):
                bad(f"{o.kind} {o.id} must name its label/symbol (an index op has that one axis) and take "
                    "no operands")
        elif not o.args:
            bad(f"op {o.id} ({o.kind}) has no operands")
        scope = set(o.axes) | set(o.reduced)
        if o.kind == "softmax":
            scope |= {o.fn}
        for u, labels in o.args:
            if u not in seen:
                bad(f"op {o.id} reads {u} before it is defined")
            if len(labels) != len(seen[u].axes):
                bad(f"op {o.id} reads {u} with {len(labels)} labels for {len(seen[u].axes)} axes")
            placeholders = o.kind == "gather" and u == o.args[0][0]
            if o.kind != "broadcast" and not placeholders and not set(labels) <= scope:
                bad(f"op {o.id} reads {u} under labels {labels} outside its iteration space")
        if o.kind in ("contraction", "reduction", "partial") and len(o.reduced) != len(o.reduced_shape):
            bad(f"op {o.id}: reduced labels and extents differ in length")
        seen[o.id] = o
    if not ir.stores:
        bad("no value leaves the kernel")
    for n, b, labels in ir.stores:
        if n not in seen or seen[n].kind in ("input", "param"):
            bad(f"store of {n}, which the kernel does not compute")
        if b not in bufs or bufs[b].role not in ("output", "intermediate"):
            bad(f"store into {b}, which is not an output or intermediate buffer")
        if len(labels) != len(bufs[b].shape) or set(labels) != set(seen[n].axes):
            bad(f"store of {n} into {b} under labels {labels} does not cover its axes {seen[n].axes}")
    if (ir.kind == "gemm") != (ir.gemm is not None) or (ir.kind == "attention") != (ir.attention is not None):
        bad("the structure does not match the kind")
    if ir.gemm is not None:
        s = ir.gemm
        if seen.get(s.anchor) is None or seen[s.anchor].kind != "contraction":
            bad("the GEMM anchor is not a contraction")
        for x, buf in ((s.a, s.a_buffer), (s.b, s.b_buffer), *(((s.b2, s.b2_buffer),) if s.dual else ())):
            if x not in seen or seen[x].buffer != buf:
                bad(f"GEMM operand {x} is not a load of {buf}")
        if s.dual:
            second = seen.get(s.anchor2)
            if second is None or second.kind != "contraction" or second.axes != seen[s.anchor].axes or \
                    {u for u, _ in second.args} != {s.a, s.b2}:
                bad("the dual GEMM's second anchor is not a contraction of A and B2 over the same axes")
            if (seen[s.b2].dtype, seen[s.b2].shape) != (seen[s.b].dtype, seen[s.b].shape):
                bad("the dual GEMM's B operands differ in dtype or shape")
        if ir.epilogue is None or not ir.epilogue.stores:
            bad("a GEMM needs an epilogue with at least the output store")
        for st in (*ir.epilogue.stores, *ir.epilogue.reductions):
            if st.name not in bufs:
                bad(f"epilogue store into unknown buffer {st.name}")
            if any(isinstance(x, Accum) and x.index not in ((0, 1) if s.dual else (0,)) for x in epi_nodes(st.value)):
                bad(f"epilogue of {st.name} reads an accumulator the GEMM does not have")
            for ld in epi_loads(st.value):
                if ld.name not in bufs:
                    bad(f"epilogue load of unknown buffer {ld.name}")
                if ld.kind not in LOAD_KINDS:
                    bad(f"epilogue load of {ld.name}: unknown kind {ld.kind!r}")
                if ld.kind.endswith("_batched"):
                    b = bufs[ld.name]
                    if not s.batch or len(b.shape) != len(s.batch) + 1 or b.layout != "row":
                        bad(f"epilogue load of {ld.name}: a per-batch vector needs a batched GEMM and a row-major "
                            f"buffer over its {len(s.batch)} batch axes and one more")
    if ir.attention is not None:
        a = ir.attention
        for x in (a.qk, a.softmax, a.pv, a.q, a.k, a.v):
            if x not in seen:
                bad(f"attention refers to unknown op {x}")
        labels = set(a.batch) | {a.query, a.key}
        for x in (epi_nodes(a.o_scale) if a.o_scale is not None else ()):
            if isinstance(x, (Score, Accum)) or (isinstance(x, Index) and x.label not in a.batch):
                bad(f"attention o_scale: {format_epi(x)} is not a value of the batch labels {list(a.batch)}")
        for what, e in (("score_mod", a.score_mod), ("mask", a.mask), ("o_scale", a.o_scale)):
            _verify_mods(f"attention {what}", e, labels, a.aux, bufs, bad)
            for x in (epi_nodes(e) if e is not None else ()):
                if isinstance(x, Score) and what == "mask":
                    bad("attention mask reads the score (a score-dependent mask is a score_mod)")
                if isinstance(x, ScoreGrad):
                    bad(f"attention {what} reads a score's gradient (an attention backward's score_mod_grad does)")
        if a.lse is not None and (a.lse not in bufs or bufs[a.lse].role not in ("output", "intermediate")):
            bad(f"attention lse buffer {a.lse} is not an output")
        if a.orders:
            want = [(*a.batch, a.query, a.head), (*(x for x in a.orders[1] if x not in (a.key, a.head)), a.key, a.head)]
            want += [want[1], want[0]]
            if len(a.orders) != 4 + (a.lse is not None) or any(len(o) != len(w) or set(o) != set(w) or o[-1] != a.head
                                                                for o, w in zip(a.orders, want)):
                bad(f"attention storage orders {a.orders} are not [batch.., seq, head] permutations, head last")
            if a.lse is not None and (len(a.orders[4]) != len(a.batch) + 1 or set(a.orders[4]) != {*a.batch, a.query}):
                bad(f"attention storage order of the log-sum-exp {a.orders[4]} is not a [batch.., query] permutation")
            for name, o in zip((a.q_buffer, a.k_buffer, a.v_buffer), a.orders):
                if name in bufs and a.page_table is None and len(bufs[name].shape) != len(o):
                    bad(f"attention storage order of {name} has {len(o)} axes, the buffer {len(bufs[name].shape)}")
        if (a.page_table is None) != (a.page_size is None):
            bad("a paged KV cache needs both the page table and the page size")
        if a.page_table is not None:
            pt = bufs.get(a.page_table)
            if pt is None or pt.role != "input" or pt.dtype not in INT_DTYPES or len(pt.shape) != 2 or not a.batch:
                bad(f"page table {a.page_table} is not an integer input [batch, pages]")
            for name in (a.k_buffer, a.v_buffer):
                if len(bufs[name].shape) < 3 or bufs[name].shape[1] != a.page_size:
                    bad(f"paged {name} is not a page pool [pages, {a.page_size}, ..]")
        if a.kv_len is not None:
            kl = bufs.get(a.kv_len)
            if kl is None or kl.dtype not in INT_DTYPES or len(kl.shape) != 1 or not a.batch:
                bad(f"key lengths {a.kv_len} are not an integer vector over the batch")
            if key_length_bound(a.mask, a.key, a.batch) != a.kv_len:
                bad(f"the mask does not bound the keys by {a.kv_len}[{a.batch[0]}]")
    if ir.attention_bwd is not None:
        _verify_attention_bwd_mods(ir.attention_bwd, bufs, bad)
        for name in (ir.attention_bwd.seqused_q, ir.attention_bwd.seqused_k):
            if name is not None and (name not in bufs or bufs[name].dtype != "i32" or len(bufs[name].shape) != 1):
                bad(f"used lengths {name} are not an i32 vector over the batch")
    if (ir.kind in ("rowwise", "colsum")) != (ir.row is not None):
        bad("the row structure does not match the kind")
    if ir.anchor is not None and ir.anchor not in seen:
        bad(f"anchor {ir.anchor} is not an op")
    return ir


def _verify_attention_bwd_mods(a: AttentionBwdStructure, bufs: dict, bad) -> None:
    """An attention backward's score modification: both expressions or neither; ScoreGrad only in the
    gradient; indices of the attention, loads of declared scalars and aux buffers."""
    if (a.score_mod is None) != (a.score_mod_grad is None):
        bad("attention backward: a score_mod without its gradient (or the other way round)")
    labels = {*a.batch, a.query, a.key}
    _verify_mods("attention backward score_mod_grad", a.score_mod_grad, labels, a.aux, bufs, bad)
    _verify_mods("attention backward score_mod", a.score_mod, labels, a.aux, bufs, bad)
    if a.score_mod is not None and any(isinstance(x, ScoreGrad) for x in epi_nodes(a.score_mod)):
        bad("attention backward score_mod reads the score's gradient")


def _verify_mods(what: str, e: EpiExpr | None, labels: set, aux: tuple, bufs: dict, bad) -> None:
    """What every attention mod expression must be: a value per score element over the attention's
    labels, its loads declared scalars and aux buffers (read with all their subscripts)."""
    for x in (epi_nodes(e) if e is not None else ()):
        if isinstance(x, Accum) or (isinstance(x, Load) and x.kind != "scalar"):
            bad(f"{what}: {format_epi(x)} has no meaning per score element")
        if isinstance(x, Index) and x.label not in labels:
            bad(f"{what}: index {x.label} is not one of {sorted(labels)}")
        if isinstance(x, AuxLoad) and (x.buffer not in aux or x.buffer not in bufs
                                       or len(x.index) != len(bufs[x.buffer].shape)):
            bad(f"{what}: {format_epi(x)} is not a load of a declared aux buffer")
        if isinstance(x, Load) and x.name not in bufs:
            bad(f"{what}: unknown scalar {x.name}")


# ---- printing ------------------------------------------------------------------------------------

def format_ir(ir: KernelIR) -> str:
    lines = [f"kernel {ir.id} : {ir.kind}   (spec kernel {ir.spec_kernel})", "  buffers:"]
    lines += [f"    {b.describe()}" for b in ir.buffers]
    lines.append("  ops:")
    for o in ir.ops:
        args = ", ".join(f"{u}[{', '.join(l)}]" if l else u for u, l in o.args)
        lines.append(f"    {o.id:>5} = {o.label()}" + (f"  <- {args}" if args else ""))
    lines.append("  stores: " + ", ".join(f"{n} -> {b}[{', '.join(l)}]" for n, b, l in ir.stores))
    if ir.gemm is not None:
        s = ir.gemm
        batch = f"[{', '.join(s.batch)}] " if s.batch else ""
        dims = ", ".join(f"{r}={format_extent(v)}" for r, v in s.dims)
        m = f"({', '.join((*s.m_fold, s.m))})" if s.m_fold else s.m
        k = f"({', '.join((*s.k_fold, s.k))})" if s.k_fold else s.k
        b2 = f" and acc1 = {s.a_buffer} x {s.b2_buffer}" if s.dual else ""
        lines.append(f"  gemm: {batch}{s.a_buffer} ({s.a_dtype}, {s.a_layout}) x {s.b_buffer} ({s.b_dtype}, "
                     f"{s.b_layout}) -> acc {s.acc_dtype}{b2}; m={m} n={s.n} k={k}; {dims}")
        for sc in s.block_scales:
            lines.append(f"  block scale of {sc.operand.upper()}: {sc.describe()} (block {sc.block_k} along k)")
        if s.a_rows is not None:
            lines.append(f"  A rows gathered: row r of the GEMM is row {s.a_rows}[r] of {s.a_buffer}")
    if ir.epilogue is not None:
        lines.append("  epilogue:")
        for st in ir.epilogue.stores:
            lines.append(f"    {st.name} : {st.dtype} ({st.layout}) = {format_epi(st.value)}")
        for r in ir.epilogue.reductions:
            lines.append(f"    {r.name} : {r.dtype} = {r.op} over {r.axis} of {format_epi(r.value)}")
    if ir.attention is not None:
        a = ir.attention
        dims = ", ".join(f"{r}={format_extent(v)}" for r, v in a.dims)
        lines.append(f"  attention: Q={a.q_buffer} K={a.k_buffer} V={a.v_buffer} ({'/'.join(a.dtypes)}), "
                     f"softmax over {a.key}{', causal' if a.causal else ''}, scale={a.scale}; {dims}")
        if a.kv_group is not None:
            lines.append(f"    kv heads: h // {a.kv_group} of {a.kv_head}")
        if a.score_mod is not None:
            lines.append(f"    score_mod: {format_epi(a.score_mod)}")
        if a.mask is not None:
            lines.append(f"    mask: {format_epi(a.mask)}")
        if a.o_scale is not None:
            lines.append(f"    O scaled by: {format_epi(a.o_scale)}")
        if a.lse is not None:
            lines.append(f"    lse -> {a.lse}")
        if a.page_table is not None:
            lines.append(f"    paged kv: {a.key} -> page {a.page_table}[{a.batch[0]}, {a.key} // {a.page_size}], "
                         f"row {a.key} % {a.page_size}")
        if a.kv_len is not None:
            lines.append(f"    keys used: {a.key} < {a.kv_len}[{a.batch[0]}]")
        if a.orders:
            lines.append("    storage: " + ", ".join(f"{n}[{', '.join(o)}]" for n, o in
                                                   zip((a.q_buffer, a.k_buffer, a.v_buffer, a.out_buffers[0],
                                                        a.lse), a.orders)))
    if ir.attention_bwd is not None:
        a = ir.attention_bwd
        lines.append(f"  attention backward: Q={a.q_buffer} K={a.k_buffer} V={a.v_buffer} O={a.o_buffer} "
                     f"dO={a.do_buffer} LSE={a.lse_buffer} ({a.dtype}) -> dQ={a.dq_buffer} dK={a.dk_buffer} "
                     f"dV={a.dv_buffer} ({'/'.join(a.out_dtypes)}); "
                     f"{('causal (bottom-right), ' if a.bottom_right else 'causal, ') if a.causal else ''}scale "
                     f"{a.scale or 1}; " + ", ".join(f"{k}={format_extent(v)}" for k, v in a.dims)
                     + (f"; kv heads: {a.head} // {a.kv_group} of {format_extent(a.kv_head)}"
                        if a.kv_group is not None else ""))
        if a.seqused_q or a.seqused_k:
            lines.append("    used lengths: " + ", ".join(f"{x} < {n}[{a.batch[0]}]" for x, n in
                                                        ((a.query, a.seqused_q), (a.key, a.seqused_k)) if n))
        if a.score_mod is not None:
            lines.append(f"    score_mod: {format_epi(a.score_mod)}; its gradient: {format_epi(a.score_mod_grad)}"
                         + (f"; aux {', '.join(a.aux)}" if a.aux else ""))
    if ir.row is not None:
        r = ir.row
        lines.append(f"  rows: one per [{', '.join(r.outer)}], reduced along {r.axis}; "
                     + ", ".join(f"{k}={v}" for k, v in r.extents))
    for arch, h in ir.hints:
        parts = [f"{f.name}={getattr(h, f.name)}" for f in fields(h) if f.compare and getattr(h, f.name) is not None]
        if parts:
            lines.append(f"  hint {arch}: {' '.join(parts)}")
    return "\n".join(lines)


# ---- JSON round trip -----------------------------------------------------------------------------

def _epi_to_json(e: EpiExpr):
    if isinstance(e, Op):
        return {"Op": [e.fn, [_epi_to_json(a) for a in e.args]]}
    if isinstance(e, Accum):
        return {"Accum": [e.index] if e.index else []}
    if isinstance(e, Score):
        return {"Score": []}
    if isinstance(e, ScoreGrad):
        return {"ScoreGrad": []}
    if isinstance(e, Index):
        return {"Index": [e.label]}
    if isinstance(e, Size):
        return {"Size": [e.name]}
    if isinstance(e, AuxLoad):
        return {"AuxLoad": [e.buffer, [_epi_to_json(a) for a in e.index], e.dtype]}
    if isinstance(e, Const):
        v = e.value
        return {"Const": [v if math.isfinite(v) else {"float": repr(v)}]}
    return {"Load": [e.name, e.kind, e.dtype]}


def _epi_from_json(d) -> EpiExpr:
    (tag, v), = d.items()
    if tag == "Op":
        return Op(v[0], tuple(_epi_from_json(a) for a in v[1]))
    if tag == "Accum":
        return Accum(*v)
    if tag == "Score":
        return Score()
    if tag == "ScoreGrad":
        return ScoreGrad()
    if tag == "Index":
        return Index(v[0])
    if tag == "Size":
        return Size(v[0])
    if tag == "AuxLoad":
        return AuxLoad(v[0], tuple(_epi_from_json(a) for a in v[1]), v[2])
    if tag == "Const":      # integer constants (index arithmetic) stay ints
        return Const(float(v[0]["float"]) if isinstance(v[0], dict) else v[0] if isinstance(v[0], int)
                     else float(v[0]))
    return Load(*v)


def _tup(x):
    """JSON lists back to the tuples the dataclasses hold (recursively)."""
    if isinstance(x, list):
        return tuple(_tup(i) for i in x)
    return x


def ir_to_json(ir: KernelIR, spans: bool = True) -> dict:
    def plain(dc) -> dict:
        return {f.name: getattr(dc, f.name) for f in fields(dc) if f.compare}      # spans: below, or not at all

    def span(s):
        return None if (s is None or not spans) else [s.file, s.line, s.col, s.end_line, s.end_col]

    def value(v):
        return {"float": repr(v)} if isinstance(v, float) and not math.isfinite(v) else v

    ops = []
    for o in ir.ops:
        d = plain(o)
        d["value"] = value(o.value)
        d["span"] = span(o.span)
        ops.append(d)
    doc = {"id": ir.id, "kind": ir.kind, "spec_kernel": ir.spec_kernel,
           "buffers": [plain(b) for b in ir.buffers], "ops": ops, "stores": [[n, b, list(l)] for n, b, l in ir.stores],
           "gemm": _gemm_to_json(ir.gemm, plain) if ir.gemm else None,
           "attention": _attention_to_json(ir.attention, plain, value) if ir.attention else None,
           "epilogue": None, "hints": [[a, plain(h)] for a, h in ir.hints],
           "row": plain(ir.row) if ir.row else None, "anchor": ir.anchor, "span": span(ir.span)}
    if ir.attention_bwd is not None:     # (only when present: other kernels keep the digests they had)
        doc["attention_bwd"] = _attention_bwd_to_json(ir.attention_bwd, plain)
    if ir.epilogue is not None:
        doc["epilogue"] = {
            "stores": [{"name": s.name, "value": _epi_to_json(s.value), "dtype": s.dtype, "layout": s.layout}
                       for s in ir.epilogue.stores],
            "reductions": [{"name": r.name, "op": r.op, "axis": r.axis, "value": _epi_to_json(r.value),
                            "dtype": r.dtype} for r in ir.epilogue.reductions]}
    return json.loads(json.dumps(doc))


def _gemm_to_json(s: GemmStructure, plain) -> dict:
    """A GEMM's fields; a dual GEMM's fields only when it is one, so a plain GEMM's digest (the key
    of its builds and tuning results) is what it was before dual GEMMs existed."""
    d = plain(s)
    if not s.dual:
        for k in ("anchor2", "b2", "b2_buffer"):
            del d[k]
    if not s.scales:
        del d["scales"]
    if s.a_rows is None:
        del d["a_rows"]
    return d


def _attention_to_json(a: AttentionStructure, plain, value) -> dict:
    """The fields; `orders` only when not canonical, so the digest of an attention in the canonical
    layout is what it was before storage orders existed."""
    d = {**plain(a), "scale": value(a.scale)}
    if not a.orders:
        del d["orders"]
    if a.o_scale is None:
        del d["o_scale"]              # (so attentions without one keep the digests they had)
    for k in ("score_mod", "mask", "o_scale"):
        if k in d:
            d[k] = _epi_to_json(getattr(a, k)) if getattr(a, k) is not None else None
    return d


def _attention_bwd_to_json(a: AttentionBwdStructure, plain) -> dict:
    """The fields; those of _BWD_OPTIONAL (GQA's, the bottom-right mask's, the layouts', the score
    modification's) only when set: a plain or causal backward keeps the digest it had."""
    d = {k: v for k, v in plain(a).items() if v not in (None, False, (), []) or k not in _BWD_OPTIONAL}
    for k in ("score_mod", "score_mod_grad"):
        if k in d:
            d[k] = _epi_to_json(getattr(a, k))
    return d


def _attention_bwd_from_json(d: dict) -> AttentionBwdStructure:
    mods = {k: (_epi_from_json(d[k]) if d.get(k) is not None else None) for k in ("score_mod", "score_mod_grad")}
    return AttentionBwdStructure(**{k: _tup(v) for k, v in d.items() if k not in mods}, **mods)


def ir_from_json(d: dict) -> KernelIR:
    def span(s):
        return Span(*s) if s else None

    def num(v):
        return float(v["float"]) if isinstance(v, dict) else v

    def make(cls, obj: dict):
        return cls(**{k: _tup(v) for k, v in obj.items()})

    ops = tuple(IROp(**{**{k: _tup(v) for k, v in o.items() if k != "span"}, "value": num(o["value"]),
                        "span": span(o.get("span"))}) for o in d["ops"])
    epi = None
    if d.get("epilogue"):
        e = d["epilogue"]
        epi = Epilogue(tuple(Store(s["name"], _epi_from_json(s["value"]), s["dtype"], s["layout"]) for s in e["stores"]),
                       tuple(ReductionStore(r["name"], r["op"], r["axis"], _epi_from_json(r["value"]), r["dtype"])
                             for r in e["reductions"]))
    att = None
    if d.get("attention"):
        a = d["attention"]
        mods = {k: (_epi_from_json(a[k]) if a.get(k) is not None else None) for k in ("score_mod", "mask", "o_scale")}
        att = make(AttentionStructure, {**a, "scale": num(a["scale"]), "score_mod": None, "mask": None, "o_scale": None})
        att = replace(att, **mods)
    return KernelIR(
        id=d["id"], kind=d["kind"], spec_kernel=d["spec_kernel"],
        buffers=tuple(make(IRBuffer, b) for b in d["buffers"]), ops=ops,
        stores=tuple((n, b, tuple(l)) for n, b, l in d["stores"]),
        gemm=make(GemmStructure, d["gemm"]) if d.get("gemm") else None, epilogue=epi, attention=att,
        hints=tuple((a, make(ArchHint, h)) for a, h in d["hints"]),
        row=make(RowStructure, d["row"]) if d.get("row") else None, anchor=d.get("anchor"), span=span(d.get("span")),
        attention_bwd=_attention_bwd_from_json(d["attention_bwd"]) if d.get("attention_bwd") else None)
