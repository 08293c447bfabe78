"""Fused attention in the CuTe DSL backend: FlashAttention-4's forward kernel classes
(`FlashAttentionForwardSm90`, `FlashAttentionForwardSm100`, pip flash-attn-4, BSD-3) compiled ahead of
time through kspec's own export path, with no TVM-FFI and no NVIDIA runtime library in the artifact.

    lower(ir, arch) -> AttnDesc          what the kernel is (no DSL import)
    entry_source(desc) -> str            the traced module: generated mods + a @cute.jit entry
    build(desc, cache_root) -> AttnBuild every size variant of the kernel on desc.arch (cached)

**How a kernel is built.**  FA4 chooses its kernel configuration (tile, q_stage, pack-GQA, 2-CTA,
persistent scheduler, S ping-pong, ...) in `flash_attn.cute.interface._flash_attn_fwd` from the
shapes, the arch and the SM count.  kspec runs that function (no device) over a sweep of query lengths
x batch-heads products per SKU (sweep_points: meta-tensor probes of FA4's compile key, then torch
FakeTensors once per key), with `cute.compile` intercepted: each distinct kernel object FA4 constructs
is one *variant*.  kspec then traces its own `kspec_entry` (entry_source), which calls
the FA4 kernel object with plain `make_fake_tensor` arguments, compiles it with `cute.compile` WITHOUT
`--enable-tvm-ffi`, exports it with `export_to_c` and links it with kspec's capture shim and host
glue (build.capture_glue) into a `.so` that needs libc only; the runtime launches the cubin itself.

**Variants.**  Each variant records the sizes it serves (its `select` boxes over the ABI's dims S,
B and H) and the SKU SM counts it was built for (FA4 bakes the count into its persistent launcher's
grid; a kernel whose trace never asks it is compiled once for every SKU); the runtime picks the SKU
(kspec.runtime.module.sku_for), then the variant whose box holds the call's sizes.  Every variant
computes the same function for every shape (the heuristics choose speed, not semantics).

**Layouts.**  kspec's tensors are row-major [B, H, S, D]; FA4 takes (b, s, h, d) with any strides, so
Q/K/V/O are passed as strided views and nothing is copied.  LSE is [B, H, S] f32, FA4's layout.

**Masks and score modifications**: backends/cute/attnmods.py.  **Split-KV decoding** (sm100a: a
split kernel and FA4's combine beside the size variants): splitkv.py.  **FP8** (e4m3 with descales,
sm100a): fp8.py.  **GQA groups known only per call** (`h / G` with a param or size symbol, MQA over
a symbolic H): built once per group `kspec compile --sizes` names (groups_named, for_groups), each
variant's boxes holding G = H / HK.  **Heads as two axes** (`Q[b, g, r, i, e]`, `K[b, g, j, e]`):
fold_heads.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from kspec.backends.desc import Const, Load
from kspec.core import KspecError, KspecInternalError, dtype_bytes, packed_rows_symbol

from .. import cache as cache_entry
from . import attnmods, compat

BUILD_FORMAT = 2
DTYPES = ("f16", "bf16", "f8e4m3")     # f8e4m3: sm100a only (fp8.py)
ROLES = ("B", "H", "S", "T", "HK")          # ABI dims, in order; then G (a literal group) and extra symbols


def head_dims_reason(arch: str, d: int, dv: int) -> str | None:
    """FA4 b36's head-dim rule (interface._validate_head_dims; tests/test_fa4_attention.py checks this
    copy against it): sm90a 8..256, sm100a 8..128 or (192, 128) or (256, 256); multiples of 8."""
    if d % 8 or dv % 8:
        return f"head dims ({d}, {dv}) must be multiples of 8 (16-byte rows)"
    if arch == "sm90a":
        ok = 8 <= d <= 256 and 8 <= dv <= 256
        allowed = "8..256"
    else:
        ok = (8 <= d <= 128 and 8 <= dv <= 128) or (d, dv) in ((192, 128), (256, 256))
        allowed = "8..128, (192, 128) or (256, 256)"
    return None if ok else f"FlashAttention-4 on {arch} supports QK/V head dims {allowed}, not ({d}, {dv})"


@dataclass(frozen=True)
class AuxArg:
    name: str                          # C identifier
    dtype: str
    shape: tuple[str, ...]             # C expressions (dims roles or int literals)


@dataclass(frozen=True)
class AttnDesc:
    name: str
    arch: str
    dtype: str
    head_dim: int
    head_dim_v: int
    q: str
    k: str
    v: str
    o: str
    lse: str | None
    aux: tuple[AuxArg, ...]
    group: int                         # query heads per K/V head (FA4 compiles it in)
    kv_shared: bool                    # MQA written with K/V lacking the head axis
    scale: Load | Const
    mods: attnmods.Mods
    mod_scalars: tuple[tuple[str, str], ...]     # aux_scalars: ("scalar", ABI scalar) | ("dim", role)
    dims: tuple[str, ...]              # ABI dims roles
    scalars: tuple[str, ...]           # ABI scalars (C identifiers)
    sm_count: int                      # the SKU the launcher is built for
    page_table: str | None = None      # paged KV: FA4's page_table (i32 [B, MP]); K/V are pools [NP, P, HK, d]
    page_size: str | None = None       # its rows per page: a dims role ("P") or an int literal
    seqused_k: str | None = None       # FA4's seqused_k (i32 [B]): keys in use per sequence
    cu_seqlens_q: str | None = None    # FA4's cu_seqlens_q (i32 [B + 1]): Q and O packed, [rows S, H, d]
    cu_seqlens_k: str | None = None    # FA4's cu_seqlens_k (i32 [B + 1]): K and V packed, [rows T, HK, d]
    # storage order of Q, K, V, O as ABI roles (B, S/T, H/HK, D = the head dim), outermost first; a
    # packed buffer's rows are the role S (T); () entries: the canonical [B, H, S, D]
    layouts: tuple[tuple[str, ...], ...] = ()
    sm_counts: tuple[int, ...] = ()    # every SKU (SM count) to build for, sm_count first; () = sm_count only
    split: bool = False                # the split-KV build (splitkv.py): O and LSE partials in the workspace
    # group 0: the GQA group is a size symbol or param (per call): built once per group in `groups`
    # (named by `kspec compile --sizes`), each variant's boxes holding G = H / HK to that value
    groups: tuple[int, ...] = ()
    group_param: str | None = None     # the i32 param the spec divides the head by (checked against G)
    descales: tuple[str | None, ...] = ()   # FP8: the q, k, v descale inputs (f32 [B, KH]; fp8.py), () none
    self_attention: bool = False       # the key extent is the query extent (T = S): never decode-shaped
    splits: int = 0                    # split-KV count fixed by a tuning winner (0: splitkv.num_splits' heuristic)

    @property
    def args(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v, self.o, *((self.lse,) if self.lse else ()), *(a.name for a in self.aux),
                *((self.page_table,) if self.page_table else ()), *((self.seqused_k,) if self.seqused_k else ()),
                *(n for n in (self.cu_seqlens_q, self.cu_seqlens_k) if n), *(n for n in self.descales if n))

    def alignment(self) -> tuple[tuple[str, int], ...]:
        out = [(n, 16) for n in (self.q, self.k, self.v, self.o)]
        if self.lse:
            out.append((self.lse, 4))
        out += [(a.name, dtype_bytes(a.dtype)) for a in self.aux]
        out += [(n, 4) for n in (self.page_table, self.seqused_k, self.cu_seqlens_q, self.cu_seqlens_k) if n]
        out += [(n, 4) for n in self.descales if n]
        return tuple(out)


# ---------------------------------------------------------------------------------------------
# IR -> descriptor
# ---------------------------------------------------------------------------------------------

def fold_heads(ir, a):
    """Heads written as two axes, `Q[b, g, r, i, e]` against `K[b, g, j, e]` (K/V head g, r the query
    heads sharing it), as the one head axis FA4 takes: Q [B, KH, R, S, d] stored in that order is Q
    [B, KH * R, S, d] with head h = g * R + r, and K is read at h / R, so the attention is GQA with
    group R over KH K/V heads.  None when `a` is not such an attention (or one kspec folds: Q, K, V, O
    in their canonical order, not paged or packed, mods that read no head index)."""
    import dataclasses

    from kspec.compiler.kir import AuxLoad, Index
    if a is None or len(a.batch) != 3 or a.kv_shared != (a.batch[2],) or a.kv_group is not None or a.orders \
            or a.page_table is not None or a.kv_len is not None:
        return None
    q = ir.buffer(a.q_buffer)
    if q.packed is not None or len(q.shape) != 5:
        return None
    for e in (a.mask, a.score_mod):
        for x in (_nodes(e) if e is not None else ()):
            if isinstance(x, AuxLoad) or (isinstance(x, Index) and x.label in a.batch):
                return None
    b, kh, r = q.shape[:3]
    h = kh * r if isinstance(kh, int) and isinstance(r, int) else (kh, r)
    dims = tuple((k, h if k == "H" else b if k == "B" else v) for k, v in a.dims)
    return dataclasses.replace(a, batch=a.batch[:2], kv_shared=(), kv_group=r, kv_head=kh, dims=dims)


def unsupported(ir, arch: str) -> str | None:
    """Why FA4 (through this backend) cannot build this attention kernel IR (None when it can)."""
    a = ir.attention
    if a is None:
        return "not an attention kernel"
    a = fold_heads(ir, a) or a
    if len(set(a.dtypes)) != 1 or a.dtypes[0] not in DTYPES:
        return (f"FlashAttention-4 takes f16 or bf16 (or, on sm100a, f8e4m3) Q, K and V of one dtype, not "
                f"{', '.join(a.dtypes)}")
    from . import fp8
    why = fp8.unsupported(ir, a, arch)
    if why:
        return why
    if a.dtypes[0] == fp8.FP8:
        a = fp8.descales(ir, a)[1]            # the descale factors are FA4's, not a score_mod
    if len(a.out_buffers) != 1:
        return "fused attention stores exactly one output O"
    out = ir.buffer(a.out_buffers[0])
    if out.dtype != a.dtypes[0] and a.dtypes[0] != fp8.FP8:
        return f"FlashAttention-4 writes O in the input dtype ({a.dtypes[0]}), not {out.dtype}"
    d, _dk, dv = a.head_dims
    if not (isinstance(d, int) and isinstance(dv, int) and a.head_dims[1] == d):
        return "the head dims of Q, K and V must be integer literals (Q's and K's equal)"
    why = head_dims_reason(arch, d, dv)
    if why:
        return why
    if not 1 <= len(a.batch) <= 2:
        return f"{len(a.batch)} batch axes (FlashAttention-4 takes [batch, heads])"
    if a.scale is None:
        return "the score scale must be one param or constant factor"
    if not a.inputs_row_major:
        return "Q, K and V must be row-major kernel inputs"
    for dt in a.p_dtypes:
        if dt not in (a.dtypes[0], "f32"):
            return f"the probabilities are rounded to {dt}; FlashAttention-4 multiplies them with V in {a.dtypes[0]}"
    if a.kv_shared and (len(a.batch) == 1 or a.kv_shared != (a.batch[-1],)):
        return "K and V may be shared across the heads only (multi-query attention), not across the batch"
    if _group(a) is None and not _per_call_group(ir, a):
        return ("the GQA group (query heads per K/V head) must be an integer literal, a size symbol or an i32 "
                "param dividing the head index: FlashAttention-4 compiles it into the kernel")
    for e in (a.score_mod, a.mask):
        why = e is not None and attnmods.unsupported(e)
        if why:
            return why
    for name in a.aux:
        if ir.buffer(name).dtype not in ("f32", "f16", "bf16", "i32", "i8"):
            return f"aux tensor {name} of dtype {ir.buffer(name).dtype}"
    if a.lse is not None and ir.buffer(a.lse).dtype != "f32":
        return "the log-sum-exp output must be f32"
    return _paged_unsupported(ir, a) or _varlen_unsupported(ir, a)


# Size names no spec can use (not identifiers): the per-sequence key count (FA4's seqlen_k when
# seqused_k is given), and the per-sequence lengths of packed (varlen) batches, cu[b + 1] - cu[b]
# (FA4's seqlen_q / seqlen_k when cu_seqlens_q / cu_seqlens_k are given).
SEQUSED = "<seqused_k>"
SEQLEN_Q, SEQLEN_K = "<seqlen_q>", "<seqlen_k>"


def _packing(ir, a) -> tuple[str | None, str | None]:
    """The offsets packing the queries (Q, O) and the keys (K, V): FA4's cu_seqlens_q / cu_seqlens_k."""
    q = ir.buffer(a.q_buffer).packed
    k = ir.buffer(a.k_buffer).packed if a.page_table is None else None
    return q, k


def _paged_unsupported(ir, a) -> str | None:
    """Why FA4 cannot take this attention's per-sequence key counts or paged KV cache."""
    if a.kv_len is not None:
        if ir.buffer(a.kv_len).dtype != "i32":
            return f"FlashAttention-4 takes per-sequence key counts (seqused_k) as i32, not {ir.buffer(a.kv_len).dtype}"
        if len(a.batch) != 2:
            return "per-sequence key counts need [batch, heads] attention"
        w = attnmods.analyse(*_fa4_view(ir, a, dict(a.dims)["S"])).window
        if w is not None and any(v == "T" for form in (w.left, w.right) if form for v, _c in form):
            return ("a sliding window that is not aligned to each sequence's own key count (FlashAttention-4 "
                    "aligns its window to seqused_k)")
    if a.page_table is None:
        return None
    if ir.buffer(a.page_table).dtype != "i32":
        return f"FlashAttention-4 takes an i32 page table, not {ir.buffer(a.page_table).dtype}"
    if a.kv_shared or len(a.batch) != 2:
        return ("a paged K/V pool must be [pages, page size, K/V heads, head dim], its heads read at the query "
                "head (or at h / G, a literal GQA group)")
    for name in (a.k_buffer, a.v_buffer):
        if len(ir.buffer(name).shape) != 4:
            return f"the page pool {name} must be [pages, page size, heads, head dim]"
    d, _dk, dv = a.head_dims
    if d % 16 or dv % 16:
        # FA4 b36 loads a page that is not exactly one key tile with cp.async (paged_kv_non_tma),
        # which asserts "Paged KV does not support irregular head dim"
        return (f"FlashAttention-4 reads pages that are not exactly one key tile with cp.async, which needs "
                f"head dims that are multiples of 16, not ({d}, {dv})")
    return None


def _varlen_unsupported(ir, a) -> str | None:
    """Why FA4 cannot take this attention's packed (cu_seqlens) batches."""
    cu_q, cu_k = _packing(ir, a)
    if cu_q is None and cu_k is None:
        return None
    out = ir.buffer(a.out_buffers[0])
    if len(a.batch) != 2:
        return "packed sequences need [batch, heads] attention"
    if out.packed != cu_q or (a.page_table is None and ir.buffer(a.v_buffer).packed != cu_k):
        return "Q and O, and K and V, must be packed by the same offsets"
    for cu in (cu_q, cu_k):
        if cu is not None and ir.buffer(cu).dtype != "i32":
            return f"FlashAttention-4 takes cumulative sequence offsets as i32, not {ir.buffer(cu).dtype}"
    if a.lse is not None and cu_q is not None and ir.buffer(a.lse).packed != cu_q:
        return f"the log-sum-exp over packed queries must be packed by {cu_q} too ([B, S, H] packed({cu_q}))"
    if a.kv_len is not None or a.page_table is not None:
        return "packed sequences together with per-sequence key counts or a paged KV cache"
    orders = _orders(a)
    for name, order, seq in zip((a.q_buffer, a.k_buffer, a.v_buffer, a.out_buffers[0]), orders,
                                (a.query, a.key, a.key, a.query)):
        if ir.buffer(name).packed is not None and tuple(order[:2]) != (a.batch[0], seq):
            return f"the packed {name} must be stored [batch, sequence, ...]"
    if a.lse is not None and cu_q is not None and tuple(orders[4][:2]) != (a.batch[0], a.query):
        return f"the packed log-sum-exp {a.lse} must be stored [batch, sequence, heads]"
    # Generated mods see per-sequence positions: FA4 hands score_mod/mask_mod each sequence's own
    # q_idx/kv_idx (tile coordinates of the sequence) and seqlen_info with its own lengths (4.0.0b36
    # softmax.apply_score_mod_inner, mask.py, and the per-sequence fastdiv recompute in
    # flash_fwd_sm90/sm100), which is what i, j, S and T mean over packed sequences.  A tensor the
    # mods read at query/key positions would be a dense [.., S, T] array whose extents are not each
    # sequence's: refused.
    from kspec.compiler.kir import AuxLoad, Index
    view, _roles = _fa4_view(ir, a, dict(a.dims)["S"])
    for e in (view.mask, view.score_mod):
        for x in (_nodes(e) if e is not None else ()):
            if isinstance(x, AuxLoad) and any(isinstance(y, Index) and y.label in (a.query, a.key)
                                              for sub in x.index for y in _nodes(sub)):
                return (f"over packed sequences the mods may read tensors by batch and head, not by query/key "
                        f"position ({x.buffer} is read at a position)")
    return None


def _fa4_view(ir, a, s_role):
    """(a as FlashAttention-4 sees its sizes, roles for attnmods.analyse): each sequence's key count
    `kv_len[b]` (seqused_k) and the lengths of packed sequences `cu[b + 1] - cu[b]` (cu_seqlens)
    read as FA4's seqlen_k / seqlen_q, and the conjunct `j < seqlen_k` dropped: FA4 never visits a
    key past it."""
    import dataclasses

    from kspec.compiler.kir import AuxLoad, Const, Index, Op, Size
    cu_q, cu_k = _packing(ir, a)
    t_name = SEQUSED if a.kv_len is not None else SEQLEN_K if cu_k is not None else None
    roles = {"S": SEQLEN_Q if cu_q is not None else s_role, "T": t_name or dict(a.dims)["T"]}
    if t_name is None and cu_q is None:
        return a, roles
    b = Index(a.batch[0])

    def load(e, buffer, index) -> bool:
        return isinstance(e, AuxLoad) and e.buffer == buffer and e.index == index

    def length(e) -> str | None:
        """SEQLEN_Q / SEQLEN_K if e is `cu[b + 1] - cu[b]` of a packing."""
        if isinstance(e, Op) and e.fn == "sub":
            for cu, name in ((cu_q, SEQLEN_Q), (cu_k, SEQLEN_K)):
                if cu is not None and load(e.args[0], cu, (Op("add", (b, Const(1))),)) and load(e.args[1], cu, (b,)):
                    return name
        return None

    def sub(e):
        if a.kv_len is not None and load(e, a.kv_len, (b,)):
            return Size(SEQUSED)
        if length(e) is not None:
            return Size(length(e))
        if isinstance(e, AuxLoad):
            return dataclasses.replace(e, index=tuple(sub(x) for x in e.index))
        if isinstance(e, Op):
            return Op(e.fn, tuple(sub(x) for x in e.args))
        return e

    def keep(e) -> bool:
        return t_name is None or not (isinstance(e, Op) and (
            (e.fn == "lt" and e.args == (Index(a.key), Size(t_name))) or
            (e.fn == "gt" and e.args == (Size(t_name), Index(a.key)))))

    def conj(e):
        if isinstance(e, Op) and e.fn == "and":
            kept = [x for x in (conj(y) for y in e.args) if x is not None]
            return None if not kept else kept[0] if len(kept) == 1 else Op("and", tuple(kept))
        return e if keep(e) else None

    mask = conj(sub(a.mask)) if a.mask is not None else None
    score_mod = sub(a.score_mod) if a.score_mod is not None else None
    used = {x.buffer for e in (mask, score_mod) if e is not None for x in _nodes(e) if isinstance(x, AuxLoad)}
    return dataclasses.replace(a, mask=mask, score_mod=score_mod,
                               aux=tuple(x for x in a.aux if x in used)), roles


def _orders(a) -> tuple[tuple[str, ...], ...]:
    """Q, K, V, O's storage orders in the attention's labels (kir.AttentionStructure.orders)."""
    if a.orders:
        return a.orders
    kv = tuple(x for x in a.batch if x not in a.kv_shared)
    return ((*a.batch, a.query, a.head), (*kv, a.key, a.head), (*kv, a.key, a.head), (*a.batch, a.query, a.head))


def _layouts(a, cu_q, cu_k) -> tuple[tuple[str, ...], ...]:
    """_orders as ABI roles (AttnDesc.layouts); () when every buffer is in the canonical order."""
    if not a.orders and cu_q is None and cu_k is None:
        return ()
    out = []
    for k, order in enumerate(_orders(a)):
        kv = k in (1, 2)
        role = {a.query: "S", a.key: "T", a.head: "D", a.batch[-1]: "HK" if kv else "H"}
        if len(a.batch) > 1:
            role[a.batch[0]] = "B"
        roles = [role[x] for x in order]
        if (cu_k if kv else cu_q) is not None:
            roles = roles[1:]            # [B, S, ..] packed: one row axis S (T)
        out.append(tuple(roles))
    return tuple(out)


def _nodes(e):
    from kspec.compiler.kir import epi_nodes
    return epi_nodes(e)


def _per_call_group(ir, a) -> bool:
    """The group is known only at call time but FA4 can be built per value: a size symbol or an i32
    param `G` in `h / G` with a K/V head axis, or MQA over a head count that is a size symbol."""
    if getattr(a, "kv_shared", ()):
        return isinstance(dict(a.dims).get("H"), str)
    g = a.kv_group
    if not isinstance(g, str) or a.kv_head is None:
        return False
    names = {b.name: b for b in ir.buffers}
    return g not in names or (names[g].role == "param" and names[g].dtype == "i32")


def groups_named(ir, sizes: dict[str, int]) -> tuple[int, ...]:
    """The per-call GQA group an attention gets at these sizes (`kspec compile --sizes`): G itself, or
    H / KH (MQA: H); () when the sizes do not fix it."""
    return groups_of(fold_heads(ir, ir.attention) or ir.attention, sizes)


def groups_of(a, sizes: dict[str, int]) -> tuple[int, ...]:
    """groups_named of an attention's (or attention backward's: no MQA) structure `a`."""
    h = dict(a.dims).get("H")
    hv = h if isinstance(h, int) else sizes.get(h) if isinstance(h, str) else None
    if getattr(a, "kv_shared", ()):
        return (hv,) if hv else ()
    if isinstance(a.kv_group, str) and a.kv_group in sizes:
        return (sizes[a.kv_group],)
    if isinstance(a.kv_group, str) and "/" in a.kv_group:          # "H/KH": the quotient of two sizes
        num, den = a.kv_group.split("/")
        if sizes.get(num) and sizes.get(den) and sizes[num] % sizes[den] == 0:
            return (sizes[num] // sizes[den],)
    kh = a.kv_head if isinstance(a.kv_head, int) else sizes.get(a.kv_head)
    if hv and kh and hv % kh == 0:
        return (hv // kh,)
    return ()


def _group(a) -> int | None:
    if a.kv_shared:
        h = dict(a.dims).get("H")
        return h if isinstance(h, int) else None
    if a.kv_group is None:
        return 1
    return a.kv_group if isinstance(a.kv_group, int) else None


def lower(ir, arch: str, sm_count: int | None = None):
    """The kernel IR as an AttnDesc plus the ABI facts (names, dims, scalars) for a LoweredPlan."""
    from kspec.backends.names import Names
    why = unsupported(ir, arch)
    if why:
        raise KspecInternalError(f"attention lowering called for an unsupported kernel {ir.id}: {why}")
    a = fold_heads(ir, ir.attention) or ir.attention
    from . import fp8
    descales = None
    if a.dtypes[0] == fp8.FP8:
        descales, a = fp8.descales(ir, a)    # FA4's DescaleTensors, out of the score_mod and o_scale
    names = Names()
    dims_map = dict(a.dims)
    roles: dict[str, object] = {"B": dims_map.get("B", 1),
                                "H": dims_map["H"], "S": dims_map["S"], "T": dims_map["T"]}
    group = _group(a)
    if a.kv_shared:
        roles["HK"] = 1
    elif a.kv_head is not None:
        roles["HK"] = a.kv_head
    else:
        roles["HK"] = roles["H"]
    dim_roles = list(ROLES)
    group_param = None
    if a.kv_group is not None and not a.kv_shared:
        if isinstance(a.kv_group, str) and any(b.name == a.kv_group and b.role == "param" for b in ir.buffers):
            group_param = a.kv_group          # a param: checked against the kernel's group at launch
        elif isinstance(a.kv_group, str) and "/" in a.kv_group:
            pass                              # `h / (H / KH)`: the glue's H == G * HK check says it all
        else:
            roles["G"] = a.kv_group
            dim_roles.append("G")
    if group is None:
        group = 0                             # per call: built for each group `kspec compile --sizes` names
    paged: dict[str, object] = {}
    if a.page_table is not None:
        pool, table = ir.buffer(a.k_buffer).shape, ir.buffer(a.page_table).shape
        for r, v in (("NP", pool[0]), ("P", a.page_size), ("MP", table[1])):
            if isinstance(v, int):
                paged[r] = str(v)
            else:
                roles[r] = v
                dim_roles.append(r)
                paged[r] = r
    cu_q, cu_k = _packing(ir, a)
    if cu_q is not None:                 # packed: FA4's S and T are the row counts of the packed arrays
        roles["S"] = packed_rows_symbol(cu_q)
    if cu_k is not None:
        roles["T"] = packed_rows_symbol(cu_k)
    sym_role = {v: r for r, v in roles.items() if isinstance(v, str)}

    def role_of(ext) -> str:
        if isinstance(ext, int):
            return str(ext)
        if ext not in sym_role:
            r = f"X{len([x for x in dim_roles if x.startswith('X')])}"
            roles[r] = ext
            sym_role[ext] = r
            dim_roles.append(r)
        return sym_role[ext]

    view, mod_roles = _fa4_view(ir, a, roles["S"])
    scalars: dict[str, object] = {}
    if group_param is not None:
        scalars[names(group_param)] = group_param
    aux = tuple(AuxArg(names(n), ir.buffer(n).dtype, tuple(role_of(e) for e in ir.buffer(n).shape)) for n in view.aux)
    if isinstance(a.scale, str):
        scale: Load | Const = Load(names(a.scale), "scalar", "f32")
        scalars[scale.name] = a.scale
    else:
        scale = Const(float(a.scale))
    mods = attnmods.analyse(view, mod_roles)
    for p in attnmods.window_params(mods.window):        # window bounds read integer params at launch
        scalars[names(p)] = p
    mods = replace(mods, window=attnmods.rename_window_params(mods.window, names))
    mod_scalars = []
    for kind, ref in mods.scalars:
        if kind == "param":
            c = names(ref)
            scalars[c] = ref
            mod_scalars.append(("scalar", c))
        else:
            mod_scalars.append(("dim", role_of(ref)))
    o = ir.buffer(a.out_buffers[0])
    # LSE (a.lse: the spec's `L[b.., i] = logsumexp(j) m[b.., i, j]` of the softmax's operand m, see
    # compiler/fusion.py attention_lse) is FA4 4.0.0b36's mLSE, checked against its source: f32
    # [B, H, S]; the natural log (Softmax.finalize in softmax.py on sm90, the correction epilogue in
    # flash_fwd_sm100.py: (row_max * scale_log2 + log2(row_sum)) * ln 2, less the sm100 max_offset it
    # added); over the scores after softmax_scale and the score_mod (utils.compute_softmax_scale_log2
    # scales before a score_mod, then works in base 2 with scale_log2 = log2 e), masked keys and keys
    # past seqused_k excluded; -inf for a row with no unmasked key (row_sum 0, and rows of tiles with
    # no key block: softmax.reset() on sm90, the -inf default of the sm100 stats).  That is kspec's
    # `logsumexp` on every point.  (Two differences need no handling here: FA4 computes exp2/log2
    # with fast-math approximations, within the tolerance kspec allows fused kernels, and a row whose
    # sum is NaN gets -inf where kspec says NaN, only for NaN scores, whose O is NaN either way.
    # kspec passes no learnable sink, which FA4 would fold into LSE.)
    desc = AttnDesc(name=f"k_{ir.id.rsplit('_', 1)[-1]}", arch=arch, dtype=a.dtypes[0], head_dim=a.head_dims[0],
                    head_dim_v=a.head_dims[2], q=names(a.q_buffer), k=names(a.k_buffer), v=names(a.v_buffer),
                    o=names(o.name), lse=names(a.lse) if a.lse else None, aux=aux, group=group,
                    kv_shared=bool(a.kv_shared), scale=scale, mods=mods, mod_scalars=tuple(mod_scalars),
                    dims=tuple(dim_roles), scalars=tuple(scalars),
                    sm_count=int(sm_count or compat.OFFLINE_SM_COUNT[arch]),
                    page_table=names(a.page_table) if a.page_table else None,
                    page_size=paged.get("P"), seqused_k=names(a.kv_len) if a.kv_len else None,
                    cu_seqlens_q=names(cu_q) if cu_q else None, cu_seqlens_k=names(cu_k) if cu_k else None,
                    layouts=_layouts(a, cu_q, cu_k), group_param=names(group_param) if group_param else None,
                    descales=tuple(names(n) if n else None for n in (descales.q, descales.k, descales.v))
                    if descales is not None else (), self_attention=roles["T"] == roles["S"])
    dims = tuple((r, roles[r]) for r in dim_roles)
    return desc, names.back(), dims, scalars


def skus(desc: AttnDesc) -> tuple[int, ...]:
    """The SM counts (GPU SKUs) desc is built for, its primary one (sm_count) first."""
    return desc.sm_counts or (desc.sm_count,)


def for_skus(desc: AttnDesc, sm_counts) -> AttnDesc:
    """desc built for these SM counts (`kspec compile --sm-count`), the first its primary one."""
    counts = tuple(dict.fromkeys(int(n) for n in sm_counts))
    if not counts or min(counts) < 1:
        raise KspecInternalError(f"bad SM counts {sm_counts!r}")
    return replace(desc, sm_count=counts[0], sm_counts=counts if len(counts) > 1 else ())


def config_items(desc: AttnDesc) -> tuple[tuple[str, str], ...]:
    m = desc.mods
    mask = ("causal (bottom-right)" if m.causal else "window" if m.window else "mask_mod" if m.mask_mod else "none")
    return (("kernel", f"FlashAttention-4 {compat.FA4_VERSION} " + ("FlashAttentionForwardSm90" if desc.arch == "sm90a"
                                               else "FlashAttentionForwardSm100")),
            ("head_dims", f"{desc.head_dim},{desc.head_dim_v}"), ("gqa_group", _group_item(desc)),
            ("mask", mask), ("score_mod", "generated" if m.score_mod else "none"),
            ("lse", "yes" if desc.lse else "no"), ("sm_count", ",".join(map(str, skus(desc)))),
            ("split_kv", _split_item(desc)),
            *((("fp8", "e4m3, descale " + ("/".join(r for r, n in zip("qkv", desc.descales) if n) or "none")),)
              if desc.dtype == "f8e4m3" else ()),
            *((("paged_kv", f"page_size={desc.page_size}"),) if desc.page_table else ()),
            *((("seqused_k", "yes"),) if desc.seqused_k else ()),
            *((("varlen", ", ".join(n for n, c in (("cu_seqlens_q", desc.cu_seqlens_q),
                                                   ("cu_seqlens_k", desc.cu_seqlens_k)) if c)),)
              if desc.cu_seqlens_q or desc.cu_seqlens_k else ()),
            *((("layout", " ".join("".join(r[0] if r != "HK" else "H" for r in lay) for lay in desc.layouts)),)
              if desc.layouts else ()),
            ("source", "FlashAttention-4 heuristics"))


def _group_item(desc: AttnDesc) -> str:
    if desc.group:
        return str(desc.group)
    if desc.groups:
        return "per call, built for " + " and ".join(map(str, desc.groups))
    return "per call (name the groups to build: kspec compile --sizes)"


def for_groups(desc: AttnDesc, groups) -> AttnDesc:
    """desc of a per-call GQA group, built for these groups (`kspec compile --sizes`)."""
    gs = tuple(sorted({int(g) for g in groups}))
    if desc.group or not gs or min(gs) < 1:
        raise KspecInternalError(f"bad GQA groups {groups!r} for {desc.name}")
    return replace(desc, groups=gs)


def _split_item(desc: AttnDesc) -> str:
    """The config's split_kv item: the split count rule of the split-KV variant, or why there is none."""
    from . import splitkv
    why = splitkv.split_unsupported(desc)
    if why:
        return "none (" + why.split(" (")[0].split(":")[0] + ")"
    return f"{desc.splits} (tuned)" if desc.splits else "auto (FlashAttention-4 heuristic, per call)"


# ---------------------------------------------------------------------------------------------
# generated entry module
# ---------------------------------------------------------------------------------------------

def _layout(desc: AttnDesc, k: int) -> tuple[str, ...]:
    """Buffer k (Q, K, V, O)'s storage order as roles, outermost first (AttnDesc.layouts)."""
    if desc.layouts:
        return desc.layouts[k]
    if k in (1, 2):
        return ("B", "T", "D") if desc.kv_shared else ("B", "HK", "T", "D")
    return ("B", "H", "S", "D")


def _modes(desc: AttnDesc, k: int, head: int) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """FA4's (b, s, h) modes of buffer k (or (rows, h) when packed): their extents (roles) and their
    strides (products of storage extents), from its storage order; the head dim is innermost."""
    order = _layout(desc, k)
    if order[-1] != "D":
        raise KspecInternalError(f"attention {desc.name}: the head dim of buffer {k} is not innermost ({order})")
    seq, heads = ("T", "HK") if k in (1, 2) else ("S", "H")
    packed = desc.cu_seqlens_k if k in (1, 2) else desc.cu_seqlens_q
    modes = (seq, heads) if packed else ("B", seq, heads)
    extent = {r: r for r in order}
    extent["D"] = str(head)

    def stride(r: str) -> tuple[str, ...]:
        # an axis the buffer lacks (MQA's K/V heads, a missing batch) has extent 1: any stride does
        at = order.index(r) if r in order else 0
        return tuple(extent[x] for x in order[at + 1:])
    return modes, tuple(stride(r) for r in modes)


def _lse_modes(desc: AttnDesc) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """FA4's LSE modes, (b, h, s) or (h, rows) when the queries are packed, with their strides from
    the LSE's storage order.  The canonical [B, H, S] gives strides for all but the last mode (which
    is contiguous, a static 1); any other order gives every mode's stride."""
    order = desc.layouts[4] if len(desc.layouts) > 4 else ("B", "H", "S")
    modes = ("H", "S") if desc.cu_seqlens_q else ("B", "H", "S")
    if order == modes:
        return modes, tuple(tuple(order[k + 1:]) for k in range(len(order) - 1))
    # a mode the LSE lacks (no batch axis) has extent 1: the outermost axis's stride does
    return modes, tuple(tuple(order[(order.index(r) if r in order else 0) + 1:]) or ("1",) for r in modes)


def _tensors(desc: AttnDesc):
    """(name in the entry, ptr index, dtype, shape roles, stride factors, static last stride, align)."""
    d, dv = desc.head_dim, desc.head_dim_v
    if desc.page_table:     # page pools [NP, P, HK, d], FA4's own layout
        P = desc.page_size
        k = ("mK", 1, desc.dtype, ("NP", P, "HK"), ((P, "HK", str(d)), ("HK", str(d)), (str(d),)))
        v = ("mV", 2, desc.dtype, ("NP", P, "HK"), ((P, "HK", str(dv)), ("HK", str(dv)), (str(dv),)))
    else:
        k = ("mK", 1, desc.dtype, *_modes(desc, 1, d))
        v = ("mV", 2, desc.dtype, *_modes(desc, 2, dv))
    if desc.split:
        # FA4's split-KV outputs, in the workspace (splitkv.py): O partials (NS, B, S, H, dv) and LSE
        # partials (NS, B, H, S), f32, contiguous; the spec's O (and LSE) are the combine's
        o = ("mO", 3, "f32", ("NS", "B", "S", "H"), (("B", "S", "H", str(dv)), ("S", "H", str(dv)), ("H", str(dv)),
                                                      (str(dv),)))
    else:
        o = ("mO", 3, desc.dtype, *_modes(desc, 3, dv))
    out = [("mQ", 0, desc.dtype, *_modes(desc, 0, d)), k, v, o]
    i = 4
    if desc.split:
        out.append(("mLSE", i if desc.lse else -1, "f32", ("NS", "B", "H", "S"), (("B", "H", "S"), ("H", "S"), ("S",))))
        i += 1 if desc.lse else 0
    elif desc.lse:
        out.append(("mLSE", i, "f32", *_lse_modes(desc)))
        i += 1
    for k, a in enumerate(desc.aux):
        strides = tuple(tuple(a.shape[j + 1:]) for j in range(len(a.shape) - 1))
        out.append((f"mA{k}", i, a.dtype, a.shape, strides))
        i += 1
    if desc.page_table:
        out.append(("mPT", i, "i32", ("B", "MP"), (("MP",),)))
        i += 1
    if desc.seqused_k:
        out.append(("mSK", i, "i32", ("B",), ()))
        i += 1
    for name, cu in (("mCQ", desc.cu_seqlens_q), ("mCK", desc.cu_seqlens_k)):
        if cu:
            out.append((name, i, "i32", ("(B + 1)",), ()))
            i += 1
    for name, d in zip(("mQD", "mKD", "mVD"), desc.descales):
        if d:
            out.append((name, i, "f32", ("B", "HK"), (("HK",),)))     # FP8 descales [B, KH], contiguous
            i += 1
    return out


def _values(desc: AttnDesc) -> list[tuple[str, str]]:
    """The entry's non-tensor parameters: (name, DSL type)."""
    out = [("softmax_scale", "Float32")]
    w = desc.mods.window
    if w is not None and w.left is not None:
        out.append(("window_left", "Int32"))
    if w is not None and w.right is not None:
        out.append(("window_right", "Int32"))
    for k, (kind, _ref) in enumerate(desc.mod_scalars):
        out.append((f"c{k}", "Float32" if kind == "scalar" else "Int32"))
    return out


def entry_source(desc: AttnDesc) -> str:
    tensors = _tensors(desc)
    params = [f"{n}: cute.Tensor" for n, *_ in tensors] + [f"{n}: cutlass.{t}" for n, t in _values(desc)]
    names = {n for n, *_ in tensors}
    kw = []
    w = desc.mods.window
    if w is not None and w.left is not None:
        kw.append("window_size_left=window_left")
    if w is not None and w.right is not None:
        kw.append("window_size_right=window_right")
    aux_t = "[" + ", ".join(f"mA{k}" for k in range(len(desc.aux))) + "]" if desc.aux else "None"
    aux_s = "(" + "".join(f"c{k}, " for k in range(len(desc.mod_scalars))) + ")" if desc.mod_scalars else "None"
    if desc.cu_seqlens_q:
        kw.append("mCuSeqlensQ=mCQ")
    if desc.cu_seqlens_k:
        kw.append("mCuSeqlensK=mCK")
    if desc.seqused_k:
        kw.append("mSeqUsedK=mSK")
    if desc.page_table:
        kw.append("mPageTable=mPT")
    if desc.descales:
        kw.append("descale_tensors=DescaleTensors(" + ", ".join(
            f"{r}_descale={n if d else 'None'}" for r, n, d in zip("qkv", ("mQD", "mKD", "mVD"), desc.descales)) + ")")
    kw.append(f"aux_data=AuxData({aux_t}, {aux_s})")
    call = (f"    FA(mQ, mK, mV, mO, {'mLSE' if 'mLSE' in names else 'None'}, softmax_scale, "
            + ", ".join(kw) + ", stream=stream)")
    lines = [
        f'"""Generated by kspec (CuTe DSL backend, FlashAttention-4 {compat.FA4_VERSION}): attention kernel '
        f'{desc.name} for {desc.arch}."""',
        "import cuda.bindings.driver as cuda",
        "import cutlass",
        "import cutlass.cute as cute",
        "from flash_attn.cute.utils import AuxData",
        *(["from flash_attn.cute.flash_fwd_sm100 import DescaleTensors"] if desc.descales else []),
        "",
        "from kspec.backends.cute import dslops as F",
        "",
        "FA = None   # the FlashAttention-4 kernel object of the variant being built (set by kspec)",
        "",
    ]
    if desc.mods.score_mod:
        lines += [desc.mods.score_mod]
    if desc.mods.mask_mod:
        lines += [desc.mods.mask_mod]
    lines += [
        "",
        "@cute.jit",
        f"def kspec_entry({', '.join(params + ['stream: cuda.CUstream'])}):",
        call,
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# variants: FA4's own choice, over a sweep of query lengths and batch x heads, per SKU
# ---------------------------------------------------------------------------------------------
#
# What FA4 b36's forward choice (_flash_attn_fwd with kspec's arguments: num_splits=1, no varlen Q,
# no block sparsity, no MLA) reads from the sizes, beyond the spec's own constants (dtype, head dims,
# GQA group, mask, mods, LSE, paging):
#   - S (max_seqlen_q) through S * group: q_stage, 2-CTA (more than one M block), the persistent
#     scheduler (one M block), pack-GQA for head dim 256;
#   - B * H and B * HK (HK = H / group), against the SM count: for head dims (256, 256) on sm100a,
#     pack-GQA (2*B*H <= SMs) and single-M-block 2-CTA (2*B*HK or 2*B*H <= SMs);
#   - the SM count itself (FLASH_ATTENTION_NUM_SMS), and the persistent launcher bakes it in.
# T only enters through num_splits and S ping-pong with num_splits > 1, which kspec never asks for.
# So the sweep is S x (B * HK) per SKU; a variant's select boxes are over S, B and H (B * H = group *
# B * HK: every threshold on B * HK is one on B * H).

def sweep_lengths(group: int) -> list[int]:
    """Query lengths at which FA4's choice may change (its thresholds are multiples of 64 rows of
    packed queries, S * group), plus powers of two."""
    pts = {1}
    for m in range(64, 2049, 64):
        for g in {1, group}:
            pts.update((m // g, m // g + 1))
    pts.update(2 ** k for k in range(21))
    return sorted(p for p in pts if p >= 1)


def sweep_batch_heads(group: int, sm_count: int) -> list[int]:
    """Values of B * HK (sequences x K/V heads) at which FA4's choice may change: its thresholds
    compare 2 * B * H or 2 * B * HK (H = group * HK) with the SM count; plus powers of two."""
    pts = {1}
    for c in (1, 2, 4):
        for m in {sm_count // c, sm_count // c // group}:
            pts.update((m, m + 1))
    pts.update(2 ** k for k in range(17))
    return sorted(p for p in pts if p >= 1)


def sweep_points(desc: AttnDesc) -> list[tuple[int, int, int]]:
    """The (S, B, HK) sizes at which FA4 is asked for its kernel: every swept query length with every
    swept B * HK.  FA4's choice reads B and HK only through their product, so it is realized as K/V
    heads of one sequence: FA4 gives packed (varlen) batches of more than 256 sequences a host-built
    batch lookup (BIN_BATCH_SEARCH_THRESH) that kspec's kernels do without.  MQA has one K/V head:
    there the product is B, kept to 256 sequences when packed."""
    xs = sweep_batch_heads(desc.group, desc.sm_count)
    if not desc.kv_shared:
        return [(s, 1, x) for s in sweep_lengths(desc.group) for x in xs]
    return [(s, x, 1) for s in sweep_lengths(desc.group) for x in xs if x <= 256 or not desc.cu_seqlens_q]


class _Captured(Exception):
    pass


class _Probed(Exception):
    pass


class _KeyLog(dict):
    """FA4's compile cache during the sweep: remembers the compile key last looked up, and when
    probing stops FA4 right there (_Probed)."""
    last = None
    probe = False

    def __contains__(self, key) -> bool:
        self.last = key
        if self.probe:
            raise _Probed()
        return dict.__contains__(self, key)


@contextlib.contextmanager
def _sweep_mode(interface, keys: _KeyLog, fake: bool):
    """How one FA4 call of the sweep runs: `fake`, on torch FakeTensors of device "cuda" (what FA4
    needs to build a kernel object); else a probe of its compile key on meta tensors ("cuda" factory
    calls made on "meta", FA4 told it runs fake), a hundred times cheaper."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode
    if fake:
        # FA4 reads data_ptr() of its arguments (a FakeTensor's is null); torch then prints a C++
        # deprecation warning from every worker process.  The pointer is not used, so no warning is set.
        import torch
        warn = torch._C._set_warn_deprecated_on_mutable_data_ptr
        torch._C._set_warn_deprecated_on_mutable_data_ptr = lambda t: None
        try:
            with FakeTensorMode():
                yield
        finally:
            torch._C._set_warn_deprecated_on_mutable_data_ptr = warn
        return

    class Meta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if str(kwargs.get("device")) == "cuda":
                kwargs["device"] = "meta"
            return func(*args, **kwargs)
    real, validate = interface.is_fake_mode, interface._validate_tensor
    interface.is_fake_mode, keys.probe = (lambda: True), True
    # (FA4 checks an FP8 descale tensor's device even when it runs fake; on meta it is not "cuda")
    interface._validate_tensor = lambda t, name, *args, **kwargs: None
    try:
        with Meta():
            yield
    finally:
        interface.is_fake_mode, keys.probe, interface._validate_tensor = real, False, validate


def _signature(obj) -> str:
    """A stable description of one FA4 constructor call."""
    def norm(v):
        if callable(v) and not isinstance(v, type):
            return f"<fn {getattr(v, '__cute_hash__', getattr(v, '__qualname__', '?'))}>"
        return repr(v)
    args, kwargs = obj
    return repr(([norm(a) for a in args], sorted((k, norm(v)) for k, v in kwargs.items())))


def choose_variants(desc: AttnDesc, mod, points=None, num_splits: int = 1,
                    seqlen_k: int | None = None) -> list[tuple[str, object, list[tuple[int, int, int]]]]:
    """[(signature, FA4 kernel object, (S, B, HK) sizes it serves)] in order of first use, from FA4's
    heuristics on the SKU desc.sm_count, at `points` (default: sweep_points); `mod` is the imported
    entry module (its generated mods).  num_splits, seqlen_k: FA4's split count and the key count
    asked for (default: no split, as many keys as queries)."""
    import torch

    import cutlass.cute as cute
    interface = compat.fa4_interface()
    cls_name = "FlashAttentionForwardSm90" if desc.arch == "sm90a" else "FlashAttentionForwardSm100"
    original_cls = getattr(interface, cls_name)
    calls: list = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return original_cls(*args, **kwargs)

    def stop(fa, *args, **kwargs):
        raise _Captured(fa)

    tdt = {"f16": torch.float16, "bf16": torch.bfloat16, "f8e4m3": torch.float8_e4m3fn}[desc.dtype]
    w = desc.mods.window
    points = sweep_points(desc) if points is None else list(points)
    key_of: list = []                   # per point, FA4's compile key
    first: dict = {}                    # compile key -> the first point with it
    built: dict = {}                    # compile key -> (signature, FA4 kernel object)

    def calls_to_make():
        """Every point probed for its compile key, then one FakeTensor call per distinct key."""
        for pt in points:
            yield pt, False
        for pt in first.values():
            yield pt, True
    real_compile = cute.compile
    cache = interface._flash_attn_fwd.compile_cache
    with compat.fa4_target(desc.arch, desc.sm_count) as cc:
        setattr(interface, cls_name, record)
        cute.compile = stop
        keys = interface._flash_attn_fwd.compile_cache = _KeyLog()
        try:
            for (s, batch, hk), fake in calls_to_make():
                h = hk * desc.group if not desc.kv_shared else desc.group
                hk = 1 if desc.kv_shared else hk
                calls.clear()
                fa = None
                with _sweep_mode(interface, keys, fake):
                    # packed: s query rows in all (and as many key rows), split into `batch` sequences
                    q_rows = (s,) if desc.cu_seqlens_q else (batch, s)
                    q = torch.empty(*q_rows, h, desc.head_dim, dtype=tdt, device="cuda")
                    n_keys = max(seqlen_k or s, 1)
                    kv_rows = (batch, n_keys)
                    paged = {}
                    if desc.page_table:
                        # a page size that is a size symbol may be anything at run time: FA4's
                        # cp.async page loads (any page size), which a non-tile page size selects
                        page = int(desc.page_size) if desc.page_size.isdigit() else 16
                        pages = -(-n_keys // page)
                        kv_rows = (batch * pages, page)
                        paged["page_table"] = torch.empty(batch, pages, dtype=torch.int32, device="cuda")
                    if desc.seqused_k:
                        paged["seqused_k"] = torch.empty(batch, dtype=torch.int32, device="cuda")
                    if desc.cu_seqlens_q:
                        paged["cu_seqlens_q"] = torch.empty(batch + 1, dtype=torch.int32, device="cuda")
                    if desc.cu_seqlens_k:
                        kv_rows = (n_keys,)
                        paged["cu_seqlens_k"] = torch.empty(batch + 1, dtype=torch.int32, device="cuda")
                    k = torch.empty(*kv_rows, hk, desc.head_dim, dtype=tdt, device="cuda")
                    v = torch.empty(*kv_rows, hk, desc.head_dim_v, dtype=tdt, device="cuda")
                    aux = [torch.empty(*(2 for _ in a.shape), dtype=torch.float32, device="cuda") for a in desc.aux]
                    for r, dn in zip("qkv", desc.descales):
                        if dn:
                            paged[f"{r}_descale"] = torch.empty(batch, hk, dtype=torch.float32, device="cuda")
                    try:
                        interface._flash_attn_fwd(
                            q, k, v, causal=desc.mods.causal,
                            window_size_left=None if w is None or w.left is None else 64,
                            window_size_right=None if w is None or w.right is None else 0,
                            score_mod=getattr(mod, "kspec_score_mod", None),
                            mask_mod=getattr(mod, "kspec_mask_mod", None),
                            aux_tensors=aux or None, return_lse=bool(desc.lse), _arch=cc,
                            num_splits=num_splits, **paged)
                    except _Captured as e:
                        fa = e.args[0]
                    except _Probed:
                        pass
                if not fake:
                    key_of.append(keys.last)
                    first.setdefault(keys.last, (s, batch, hk))
                elif fa is not None and len(calls) == 1 and first.get(keys.last) == (s, batch, hk):
                    built[keys.last] = (_signature(calls[0]), fa)
                else:
                    raise KspecInternalError(f"FlashAttention-4 built {len(calls)} kernel objects for S={s}, "
                                             f"B={batch}, HK={hk} (or not the kernel its compile key promised)")
        finally:
            setattr(interface, cls_name, original_cls)
            cute.compile = real_compile
            interface._flash_attn_fwd.compile_cache = cache
    found: dict[str, tuple[object, list[tuple[int, int, int]]]] = {}
    for pt, key in zip(points, key_of):
        sig, fa = built[key]
        found.setdefault(sig, (fa, []))[1].append(pt)
    return [(sig, fa, pts) for sig, (fa, pts) in found.items()]


def boxes(points_by_variant: list[list[tuple[int, int]]]) -> list[list[dict]]:
    """Per variant, the boxes of ABI sizes it serves, from the (S, P) sweep points FA4 served with it
    (P = B * H; together the points form a grid): each point covers the sizes up to the next point's,
    the first from 0 and the last unbounded, so the boxes partition every size.  A box is {"S": [lo,
    hi]} (hi None = unbounded), plus "B" and "H" ranges where the choice depends on B * H
    (product_boxes); a variant's boxes merge its neighbouring cells."""
    owner: dict[tuple[int, int], int] = {}
    for k, pts in enumerate(points_by_variant):
        for pt in pts:
            if owner.setdefault((int(pt[0]), int(pt[1])), k) != k:
                raise KspecInternalError(f"two variants for the sizes S, B*H = {tuple(pt)}")
    ss, ps = sorted({s for s, _ in owner}), sorted({p for _, p in owner})
    if len(owner) != len(ss) * len(ps):
        raise KspecInternalError(f"the sweep is not a grid: {len(owner)} points for {len(ss)} x {len(ps)}")

    def cells(values):
        return [(0 if n == 0 else v, values[n + 1] - 1 if n + 1 < len(values) else None)
                for n, v in enumerate(values)]
    rows: list[tuple[list, list]] = []            # ([S lo, S hi], [(variant, P lo, P hi)])
    for s, (slo, shi) in zip(ss, cells(ss)):
        pattern: list[tuple[int, int, int | None]] = []
        for p, (plo, phi) in zip(ps, cells(ps)):
            k = owner[(s, p)]
            if pattern and pattern[-1][0] == k:
                pattern[-1] = (k, pattern[-1][1], phi)
            else:
                pattern.append((k, plo, phi))
        if rows and rows[-1][1] == pattern:
            rows[-1][0][1] = shi
        else:
            rows.append(([slo, shi], pattern))
    out: list[list[dict]] = [[] for _ in points_by_variant]
    for (slo, shi), pattern in rows:
        for k, plo, phi in pattern:
            if plo == 0 and phi is None:
                out[k].append({"S": [slo, shi]})
            else:
                out[k] += [{"S": [slo, shi], **box} for box in product_boxes(plo, phi)]
    return out


def product_boxes(lo: int, hi: int | None) -> list[dict]:
    """Boxes {"B": [b0, b1], "H": [h0, h1]} (None = unbounded) holding exactly the sizes B, H >= 0
    with lo <= B * H <= hi (hi None: no upper bound): O(sqrt(hi)) boxes, one per run of B over which
    the H range stays the same."""
    out = []
    if lo <= 0:
        out += [{"B": [0, 0], "H": [0, None]}, {"B": [1, None], "H": [0, 0]}]
    lo = max(lo, 1)
    b = 1
    while hi is None or b <= hi:
        h0 = -(-lo // b)                              # ceil(lo / b)
        h1 = None if hi is None else hi // b
        ends = [] if h0 == 1 else [(lo - 1) // (h0 - 1)]  # the last B with the same ceil(lo / B)
        if h1 is not None:
            ends.append(hi // h1)                     # the last B with the same hi // B
        b1 = min(ends) if ends else None
        if h1 is None or h0 <= h1:
            out.append({"B": [b, b1], "H": [h0, h1]})
        if b1 is None:
            break
        b = b1 + 1
    return out


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    cubin: str
    host: str
    symbol: str
    param_offsets: tuple[int, ...]
    select: tuple[dict, ...]
    config: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class AttnBuild:
    """Like build.CuteBuild (cubin/host/symbol/param_offsets/config/args/scalars of the first
    variant, which kspec.compile copies) plus every variant."""
    key: str
    dir: str
    variants: tuple[Variant, ...]
    args: tuple[str, ...]
    scalars: tuple[str, ...]
    seconds: float = 0.0
    cached: bool = False
    config: tuple[tuple[str, str], ...] = field(default=())

    @property
    def cubin(self) -> str:
        return self.variants[0].cubin

    @property
    def host(self) -> str:
        return self.variants[0].host

    @property
    def symbol(self) -> str:
        return self.variants[0].symbol

    @property
    def param_offsets(self) -> tuple[int, ...]:
        return self.variants[0].param_offsets


def build_key(desc: AttnDesc) -> str:
    from .build import _source_identity
    material = {"desc": repr(desc), "src": entry_source(desc), "fa4": compat.FA4_VERSION,
                "quack": compat.QUACK_VERSION, "dsl": compat.dsl_version(), "flavour": compat.cuda_flavour(),
                "backend": _source_identity(), "format": BUILD_FORMAT}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _fake_args(desc: AttnDesc):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from .dslops import dsl_type
    syms = {r: cute.sym_int32() for r in ("B", "S", "H", "T", "HK")}
    out = []
    for name, _i, dt, shape, strides in _tensors(desc):
        el = dtype_bytes(dt)
        div = max(16 // el, 1) if name in ("mQ", "mK", "mV", "mO") else 1
        shp = []
        for r in shape:
            if r not in syms:
                syms[r] = int(r) if r.isdigit() else cute.sym_int32()
            shp.append(syms[r])
        if name in ("mQ", "mK", "mV", "mO"):
            shp.append(desc.head_dim_v if name in ("mV", "mO") else desc.head_dim)
        # every mode's stride given (an LSE not stored [B, H, S]): all dynamic; else the last is 1
        stride = tuple(cute.sym_int64(divisibility=div) for _ in strides) + (() if len(strides) == len(shp)
                                                                             else (1,))
        out.append(make_fake_tensor(dsl_type(dt), tuple(shp), stride=stride,
                                    assumed_align=16 if div > 1 else el))
    for _n, t in _values(desc):
        out.append(getattr(cutlass, t)(0))
    return out


def _glue(desc: AttnDesc, ciface: str, entry: str, offs, sizes) -> str:
    from . import splitkv
    from .build import GlueTensor, capture_glue
    tensors = []
    data = {"mO": "ks_o_partial", "mLSE": "ks_lse_partial"} if desc.split else {}
    for name, i, _dt, shape, strides in _tensors(desc):
        tensors.append(GlueTensor(name, i, tuple(shape), tuple(tuple(s) for s in strides), data.get(name)))
    checks = _checks(desc)
    if desc.split:
        checks += splitkv.prepare_lines(desc.head_dim_v)
    values = []
    if isinstance(desc.scale, Load):
        values.append(f"    float softmax_scale = (float)scalars[{desc.scalars.index(desc.scale.name)}];")
    else:
        values.append(f"    float softmax_scale = (float){float(desc.scale.value)!r};")

    def linear(form) -> str:
        def var(v: str) -> str:
            if v.startswith(attnmods.PARAM):
                return f"(int64_t)scalars[{desc.scalars.index(v[len(attnmods.PARAM):])}]"
            return v
        terms = [f"({c}LL)" if v == "1" else f"({c}LL) * {var(v)}" for v, c in form]
        return " + ".join(terms) or "0"
    w = desc.mods.window
    if w is not None and w.left is not None:
        values.append(f"    int32_t window_left = (int32_t)({linear(w.left)});")
    if w is not None and w.right is not None:
        values.append(f"    int32_t window_right = (int32_t)({linear(w.right)});")
    for k, (kind, ref) in enumerate(desc.mod_scalars):
        if kind == "scalar":
            values.append(f"    float c{k} = (float)scalars[{desc.scalars.index(ref)}];")
        else:
            values.append(f"    int32_t c{k} = (int32_t)({ref});")
    args = [f"&{n}" for n, _t in _values(desc)]
    split = {}
    if desc.split:
        split = {"workspace": splitkv.workspace_lines(desc.dims, desc.head_dim_v),
                 "helpers": splitkv.chooser_c(desc.head_dim_v, desc.group > 1, desc.splits)}
    return capture_glue(tensors, checks, values, args, ciface, entry, offs, sizes, compat.SMEM_OPTIN[desc.arch],
                        what="FlashAttention-4", **split)


def _checks(desc: AttnDesc) -> list[str]:
    """C lines of kspec_prepare validating the ABI dims (KS_FAIL; KS_EMPTY for nothing to launch)."""
    checks = [f"    const int64_t {r} = dims[{k}];" for k, r in enumerate(desc.dims)]
    checks += [f"    (void){r};" for r in desc.dims]
    checks += [
        "    if (B < 0 || H < 0 || S < 0 || T < 0 || HK < 1)",
        "        KS_FAIL(\"bad attention sizes (B=%lld H=%lld S=%lld T=%lld, K/V heads %lld)\", (long long)B, "
        "(long long)H, (long long)S, (long long)T, (long long)HK);",
        "    if (B > INT32_MAX || H > INT32_MAX || S > INT32_MAX || T > INT32_MAX)",
        "        KS_FAIL(\"attention sizes must fit in 32 bits\");",
        f"    if (H != HK * {desc.group})",
        (f"        KS_FAIL(\"%lld query heads with %lld K/V heads: this kernel needs exactly {desc.group} query heads "
         f"per K/V head (H = {desc.group} x K/V heads)\", (long long)H, (long long)HK);" if desc.group > 1 else
         "        KS_FAIL(\"%lld query heads with %lld K/V heads: they must be equal\", (long long)H, (long long)HK);"),
        "    if (T == 0 && B != 0 && H != 0 && S != 0)",
        "        KS_FAIL(\"T = 0: attention over no keys (FlashAttention-4 needs at least one key; the output would be 0)\");",
    ]
    checks += group_checks(desc)
    checks += ["    if (B == 0 || H == 0 || S == 0) KS_EMPTY();"]
    return checks


def group_checks(desc) -> list[str]:
    """C lines of kspec_prepare refusing a call whose per-call GQA group, the dim G or the i32 param
    desc.group_param, is not the one desc (an AttnDesc or attention_bwd.BwdDesc) was built for."""
    checks = []
    if "G" in desc.dims:
        checks += [f"    if (G != {desc.group}) KS_FAIL(\"GQA group %lld, but the kernel was built for {desc.group}\", "
                   "(long long)G);"]
    if desc.group_param:
        k = desc.scalars.index(desc.group_param)
        checks += [f"    if ((int64_t)scalars[{k}] != {desc.group}) KS_FAIL(\"GQA group param = %lld, but the kernel "
                   f"was built for {desc.group} query heads per K/V head (H = %lld, K/V heads %lld)\", "
                   f"(long long)scalars[{k}], (long long)H, (long long)HK);"]
    return checks


def _compile_variant(work: Path, desc: AttnDesc, mod, fa) -> dict:
    from .build import GlueTensor, check_header, compile_export, link_host
    mod.FA = fa
    ptxas = getattr(fa, "ptxas_options", "")
    try:
        with _sm_count_reads() as reads:
            entry, offs, sizes, _ptx, seconds = compile_export(
                work, mod.kspec_entry, _fake_args(desc), desc.arch, f"FlashAttention-4 kernel {desc.name}",
                f" --ptxas-options '{ptxas}'" if ptxas else "")
    finally:
        mod.FA = None
    tensors = [GlueTensor(n, i, tuple(shape), tuple(strides)) for n, i, _d, shape, strides in _tensors(desc)]
    cparams = [f"{'float' if t == 'Float32' else 'int32_t'} {n}" for n, t in _values(desc)]
    ciface = check_header((work / "kernel.h").read_text(), tensors, cparams, trailing=[])
    (work / "glue.c").write_text(_glue(desc, ciface, entry, offs, sizes))
    link_host(work / "kernel.o", work / "glue.c", work / "kernel.so", work / "link.log")
    (work / "kernel.o").unlink(missing_ok=True)
    return {"symbol": entry, "param_offsets": list(offs), "compile_seconds": seconds,
            "sm_independent": not reads}


@contextlib.contextmanager
def _sm_count_reads():
    """The SM-count queries made while tracing: FA4's persistent schedulers ask cutlass.utils.HardwareInfo
    (kspec's offline stand-in inside compat.fa4_target) and bake the answer into the host launcher as
    the persistent grid.  A kernel traced without asking builds to the same binary for every SKU.
    FA4's and QuACK's lru_caches of the answer are cleared first, so every query is seen."""
    import sys

    import cutlass.utils
    hw = cutlass.utils.HardwareInfo
    if not issubclass(hw, compat._OfflineHardwareInfo):
        raise KspecInternalError("SM-count queries counted outside compat.fa4_target")
    for name in ("flash_attn.cute.cute_dsl_utils", "quack.cute_dsl_utils"):
        for fn in ("get_max_active_clusters", "get_device_multiprocessor_count"):
            getattr(getattr(sys.modules.get(name), fn, None), "cache_clear", lambda: None)()
    reads: list[str] = []
    methods = ("get_device_multiprocessor_count", "get_max_active_clusters")
    saved = {m: hw.__dict__.get(m) for m in methods}

    def counted(m, f):
        def ask(self, *args, **kwargs):
            reads.append(m)
            return f(self, *args, **kwargs)
        return ask
    for m in methods:
        setattr(hw, m, counted(m, getattr(hw, m)))
    try:
        yield reads
    finally:
        for m, f in saved.items():
            if f is None:
                delattr(hw, m)
            else:
                setattr(hw, m, f)


def _import_entry(path: Path):
    """The generated module, imported under a name unique to its build directory (the DSL reads
    the source of jit functions through their module, so it stays in sys.modules)."""
    import importlib.util
    import sys
    name = "kspec_fa4_entry_" + re.sub(r"\W", "_", path.parent.name)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _read(d: Path, fmt: int = BUILD_FORMAT) -> dict | None:
    """A whole cache entry's metadata (of every variant: attention_bwd.py's three or five kernels too), or
    None (missing; damaged or stale: removed, rebuilt)."""
    meta = cache_entry.read(d, fmt)
    if meta is None:
        return None
    files = set(meta["files"])
    variants = meta.get("variants")
    if not isinstance(variants, list) or not variants or any(
            not {f"{v['dir']}/kernel.cubin", f"{v['dir']}/kernel.so"} <= files for v in variants):
        cache_entry.warn_damaged(d, "a variant lacks kernel.cubin or kernel.so")
        cache_entry.discard(d)
        return None
    return meta


def _result(desc, parts: list[tuple[str, Path, dict]], seconds: float, cached: bool, config=None) -> AttnBuild:
    """One AttnBuild from the per-SKU builds `parts` [(key, dir, meta)]: every SKU's variants, those
    with the same binary and boxes on several SKUs merged into one (config sm_count "132,114").
    desc: an AttnDesc, or another descriptor with args and scalars (attention_bwd.BwdDesc) and its
    `config` items."""
    merged: dict[tuple, dict] = {}
    for _key, d, meta in parts:
        for v in meta["variants"]:
            same = (v["sha256"]["kernel.cubin"], v["sha256"]["kernel.so"], json.dumps(v["select"]))
            cfg = dict(v["config"])
            if same in merged:
                m = merged[same]["config"]
                m["sm_count"] = f"{m['sm_count']},{cfg['sm_count']}"
            else:
                merged[same] = {"d": d, "v": v, "config": cfg}
    variants = tuple(Variant(cubin=str(e["d"] / e["v"]["dir"] / "kernel.cubin"),
                             host=str(e["d"] / e["v"]["dir"] / "kernel.so"), symbol=e["v"]["symbol"],
                             param_offsets=tuple(e["v"]["param_offsets"]), select=tuple(e["v"]["select"]),
                             config=tuple((k, str(x)) for k, x in e["config"].items()))
                     for e in merged.values())
    key, d, _meta = parts[0]
    return AttnBuild(key=key if len(parts) == 1 else hashlib.sha256(" ".join(k for k, _d, _m in parts).encode())
                     .hexdigest(), dir=str(d), variants=variants, args=desc.args, scalars=desc.scalars,
                     seconds=seconds, cached=cached, config=config_items(desc) if config is None else config)


def _sku_descs(desc: AttnDesc) -> list[AttnDesc]:
    """desc once per SKU it is built for (each cached on its own)."""
    return [replace(desc, sm_count=n, sm_counts=()) for n in skus(desc)]


def _dir(root: Path, desc: AttnDesc, lengths) -> tuple[str, Path]:
    key = build_key(desc) + ("" if lengths is None else "-" + "-".join(map(str, lengths)))
    return key, root / "cute-attention" / key[:2] / key


def _per_group(desc: AttnDesc, what: str = "attention kernel") -> list[AttnDesc]:
    """desc once per GQA group it is built for (a per-call group: each `groups` value)."""
    if desc.group:
        return [desc]
    if not desc.groups:
        raise KspecError(f"{what} {desc.name} on {desc.arch}: its GQA group (query heads per K/V head) "
                         "is known only at call time, and FlashAttention-4 compiles it into the kernel",
                         hint="name the groups to build with `kspec compile --sizes`: the group symbol itself "
                              "(G=4), or the query and K/V head counts (H=32,KH=8)")
    return [replace(desc, group=g, groups=()) for g in desc.groups]


def _grouped(desc: AttnDesc, builds: list[AttnBuild], config=None) -> AttnBuild:
    """One AttnBuild from the per-group builds of a per-call group: every variant's boxes also hold
    G (= H / HK at call time) to its group, so the runtime picks the group's kernels.  desc: an
    AttnDesc, or another descriptor with group, groups and its `config` items (attention_bwd.BwdDesc)."""
    if desc.group:
        return builds[0]
    variants = []
    for g, b in zip(desc.groups, builds):
        for v in b.variants:
            variants.append(replace(v, select=tuple({**box, "G": [g, g]} for box in v.select),
                                    config=tuple((k, str(g) if k == "gqa_group" else x) for k, x in v.config)
                                    + (() if any(k == "gqa_group" for k, _x in v.config) else (("gqa_group", str(g)),))))
    key = hashlib.sha256(" ".join(b.key for b in builds).encode()).hexdigest()
    return replace(builds[0], key=key, variants=tuple(variants), seconds=sum(b.seconds for b in builds),
                   cached=all(b.cached for b in builds), config=config_items(desc) if config is None else config)


def lookup(desc: AttnDesc, cache_root: Path | None) -> AttnBuild | None:
    """The cached build, or None; never imports the DSL or FA4."""
    if not desc.group:
        builds = [lookup(one, cache_root) for one in _per_group(desc)]
        return None if any(b is None for b in builds) else _grouped(desc, builds)
    if cache_root is None:
        return None
    parts = []
    for one in _sku_descs(desc):
        key, d = _dir(Path(cache_root), one, None)
        meta = _read(d)
        if meta is None:
            return None
        parts.append((key, d, meta))
    return _result(desc, parts, 0.0, True)


def build(desc: AttnDesc, cache_root: Path | None, lengths: list[int] | None = None) -> AttnBuild:
    """Every FA4 variant of `desc` on every SKU it is built for (each SKU cached by content).
    lengths: build only the variants serving these query lengths (tests; the artifact's boxes then
    cover only those)."""
    why = compat.fa4_available()
    if why:
        raise KspecError(f"attention kernel {desc.name} on {desc.arch}: {why}")
    if not desc.group:
        return _grouped(desc, [build(one, cache_root, lengths) for one in _per_group(desc)])
    root = Path(cache_root if cache_root is not None else tempfile.mkdtemp(prefix="kspec-attn-"))
    t0 = time.monotonic()
    parts, cached = [], True
    for one in _sku_descs(desc):
        key, d = _dir(root, one, lengths)
        meta = _read(d)
        if meta is None:
            cached = False
            meta = _build_sku(one, key, d, lengths, parts)
        parts.append((key, d, meta))
    return _result(desc, parts, time.monotonic() - t0, cached)


def _build_sku(desc: AttnDesc, key: str, d: Path, lengths, done: list[tuple[str, Path, dict]]) -> dict:
    """Build the variants FA4 chooses on the SKU desc.sm_count into `d`; its meta.json.  A kernel
    that another SKU's build in `done` compiled without asking the SM count (_sm_count_reads) is
    copied from there, not compiled again."""
    from .build import _sha
    reuse = {}                          # FA4 signature -> (variant dir, its meta) of SM-independent kernels
    for _key, dd, meta in done:
        for v in meta["variants"]:
            if v.get("sm_independent"):
                reuse[dict(v["config"])["fa4_signature"]] = (dd / v["dir"], v)
    root = d.parent.parent
    cache_entry.reclaim_once(root)
    with cache_entry.workdir(root, f".{key[:12]}.") as work:
        (work / "entry.py").write_text(entry_source(desc))
        with compat.fa4_target(desc.arch, desc.sm_count):
            mod = _import_entry(work / "entry.py")
        found = choose_variants(desc, mod)
        if lengths is not None:
            rows = {s for _sig, _fa, pts in found for s, _b, _hk in pts if s in lengths}
            rows = rows or {min(s for _sig, _fa, pts in found for s, _b, _hk in pts)}
            found = [(sig, fa, [pt for pt in pts if pt[0] in rows]) for sig, fa, pts in found]
            found = [f for f in found if f[2]]
        heads = 1 if desc.kv_shared else desc.group       # query heads per K/V head in the sweep
        sel = boxes([[(s, b * hk * heads) for s, b, hk in pts] for _sig, _fa, pts in found])
        variants = []
        with compat.fa4_target(desc.arch, desc.sm_count):
            for k, ((sig, fa, _pts), box) in enumerate(zip(found, sel)):
                vd = work / f"v{k}"
                vd.mkdir()
                sig_hash = hashlib.sha256(sig.encode()).hexdigest()[:16]
                if sig_hash in reuse:
                    src, prev = reuse[sig_hash]
                    for f in ("kernel.cubin", "kernel.so"):
                        shutil.copyfile(src / f, vd / f)
                    info = {"symbol": prev["symbol"], "param_offsets": prev["param_offsets"], "compile_seconds": 0.0,
                            "sm_independent": True}
                else:
                    info = _compile_variant(vd, desc, mod, fa)
                cfg = [["variant", f"{k}"], ["fa4_class", type(fa).__name__],
                       ["tile", f"{getattr(fa, 'm_block_size', getattr(fa, 'tile_m', '?'))}x"
                                f"{getattr(fa, 'n_block_size', getattr(fa, 'tile_n', '?'))}"],
                       ["q_stage", str(getattr(fa, "q_stage", 1))],
                       ["2cta", str(bool(getattr(fa, "use_2cta_instrs", False))).lower()],
                       ["pack_gqa", str(bool(getattr(fa, "pack_gqa", False))).lower()],
                       *([["kv_loads", "tma" if getattr(fa, "use_tma_KV", True) else "cp.async"]]
                         if desc.page_table else []),
                       ["sm_count", str(desc.sm_count)],
                       ["fa4_signature", sig_hash]]
                variants.append({"dir": f"v{k}", **info, "select": box, "config": cfg,
                                 "sha256": {f: _sha(vd / f) for f in ("kernel.cubin", "kernel.so")}})
        from . import splitkv
        if splitkv.split_unsupported(desc) is None:
            with compat.fa4_target(desc.arch, desc.sm_count):
                variants += _build_split(desc, work, len(variants), reuse)
        meta = {"format": BUILD_FORMAT, "key": key, "arch": desc.arch, "sm_count": desc.sm_count,
                "variants": variants}
        shutil.rmtree(work / "__pycache__", ignore_errors=True)
        cache_entry.seal(work, meta)
        return cache_entry.install(work, d, BUILD_FORMAT)


# Split-KV probe: the kernel FA4 builds for long decoding (one sequence, S = 1, 128k keys, 16 splits)
SPLIT_PROBE = {"S": 1, "B": 1, "T": 131072, "num_splits": 16}


def _build_split(desc: AttnDesc, work: Path, first: int, reuse: dict) -> list[dict]:
    """The split-KV variant of desc (FA4's forward with is_split_kv, writing f32 O and LSE partials
    into the workspace) and the combine kernel merging them (splitkv.py): two variant records, the
    split one selected by the runtime when its glue asks for a workspace, the combine one never by
    size (select []).  Runs inside _build_sku (under compat.fa4_target)."""
    from . import splitkv
    from .build import _sha
    sdesc = replace(desc, split=True)
    (work / "split").mkdir()
    (work / "split" / "entry.py").write_text(entry_source(sdesc))
    mod = _import_entry(work / "split" / "entry.py")
    hk = 1 if desc.kv_shared else 8
    p = SPLIT_PROBE
    ((sig, fa, _pts),) = choose_variants(sdesc, mod, points=[(p["S"], p["B"], hk)], num_splits=p["num_splits"],
                                         seqlen_k=p["T"])
    if not getattr(fa, "is_split_kv", False):
        raise KspecInternalError(f"FlashAttention-4 built no split-KV kernel for {desc.name} on {desc.arch}")
    out = []
    sig_hash = hashlib.sha256(("split " + sig).encode()).hexdigest()[:16]
    vd = work / f"v{first}"
    vd.mkdir()
    if sig_hash in reuse:
        src, prev = reuse[sig_hash]
        for f in ("kernel.cubin", "kernel.so"):
            shutil.copyfile(src / f, vd / f)
        info = {"symbol": prev["symbol"], "param_offsets": prev["param_offsets"], "compile_seconds": 0.0,
                "sm_independent": True}
    else:
        info = _compile_variant(vd, sdesc, mod, fa)
    cfg = [["variant", f"{first}"], ["role", "split"], ["fa4_class", type(fa).__name__],
           ["tile", f"{fa.m_block_size}x{fa.n_block_size}"], ["q_stage", str(fa.q_stage)],
           ["pack_gqa", str(bool(fa.pack_gqa)).lower()],
           ["s_ping_pong", str(bool(getattr(fa, "use_s_ping_pong", False))).lower()],
           *([["kv_loads", "tma" if getattr(fa, "use_tma_KV", True) else "cp.async"]] if desc.page_table else []),
           ["num_splits", str(desc.splits) if desc.splits else "auto"],
           ["sm_count", str(desc.sm_count)], ["fa4_signature", sig_hash]]
    out.append({"dir": f"v{first}", **info, "select": [{"S": [1, None]}], "config": cfg,
                "sha256": {f: _sha(vd / f) for f in ("kernel.cubin", "kernel.so")}})
    tile_m, k_block = splitkv.combine_params(desc.head_dim_v)
    c_hash = hashlib.sha256(("combine " + splitkv.combine_source(desc) + repr((tile_m, k_block, splitkv.LOG_MAX_SPLITS,
                             desc.dims, desc.layouts, desc.lse, desc.splits))).encode()).hexdigest()[:16]
    cd = work / f"v{first + 1}"
    cd.mkdir()
    if c_hash in reuse:
        src, prev = reuse[c_hash]
        for f in ("kernel.cubin", "kernel.so"):
            shutil.copyfile(src / f, cd / f)
        cinfo = {"symbol": prev["symbol"], "param_offsets": prev["param_offsets"], "compile_seconds": 0.0,
                 "sm_independent": True}
    else:
        lse_modes, lse_factors = _lse_modes(desc)
        lse_strides = {r: (tuple(lse_factors[k]) if k < len(lse_factors) else ()) for k, r in enumerate(lse_modes)}
        checks = _checks(desc) + splitkv.prepare_lines(desc.head_dim_v)
        cinfo = splitkv.build_combine(cd, desc, _modes(desc, 3, desc.head_dim_v), lse_strides, checks,
                                      compat.SMEM_OPTIN[desc.arch],
                                      helpers=splitkv.chooser_c(desc.head_dim_v, desc.group > 1, desc.splits))
    ccfg = [["variant", f"{first + 1}"], ["role", "combine"], ["kernel", "FlashAttentionForwardCombine"],
            ["tile", f"{tile_m}x{k_block}"], ["max_splits", str(1 << splitkv.LOG_MAX_SPLITS)],
            ["sm_count", str(desc.sm_count)], ["fa4_signature", c_hash]]
    out.append({"dir": f"v{first + 1}", **cinfo, "select": [], "config": ccfg,
                "sha256": {f: _sha(cd / f) for f in ("kernel.cubin", "kernel.so")}})
    shutil.rmtree(work / "split", ignore_errors=True)
    return out
