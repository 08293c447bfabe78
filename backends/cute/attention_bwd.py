"""The attention backward in the CuTe DSL backend: this module owns it.  The backward of a plain,
causal, packed or padded varlen, GQA or score-modified attention (compiler.kir.AttentionBwdStructure,
what `kspec grad` derives) is built as FlashAttention-4 4.0.0b36's own backward: three kernels (GQA:
five), run in order by one kspec call, sharing a per-call workspace, exactly as
`flash_attn.cute.interface._flash_attn_bwd` drives them:

    1. FlashAttentionBackwardPreprocess   D = rowsum(dO * O) (`dpsum`), LSE * log2(e) (`lse_log2`),
                                          the f32 dQ accumulator (`dq_accum`) zeroed
    2. FlashAttentionBackwardSm90 / Sm100 dK and dV, and dQ accumulated in f32 into dq_accum (GQA:
                                          dK and dV accumulated in f32 into dk_accum and dv_accum
                                          over each K/V head's G query heads)
    3. FlashAttentionBackwardPostprocess  dq_accum * softmax_scale converted to dQ
    4. FlashAttentionBackwardPostprocess  GQA: dk_accum * softmax_scale converted to dK
    5. FlashAttentionBackwardPostprocess  GQA: dv_accum converted to dV

    covered(ir, arch) / unsupported(...)  which backwards FA4 takes (and why not)
    lower(ir, arch) -> BwdDesc            what the kernel is (no DSL import)
    entry_source(desc) -> str             the traced module: one @cute.jit entry per kernel
    build(desc, cache_root) / lookup(...) the kernels on desc.arch (cached; an attention.AttnBuild whose
                                          variants have the roles desc.steps, never chosen by size)

**FA4's choices, not copies of them.**  kspec runs `_flash_attn_bwd` itself (torch FakeTensors, no
device, under compat.fa4_target) with `cute.compile` intercepted (capture): the kernel objects it
constructs are the ones kspec compiles, through its own entry (kspec's strided views of
[B, H, S, E] tensors, no TVM-FFI; build.compile_export), so the tiles, stages, swaps, 2-CTA and
accumulator orders are FA4's for the arch, head dim, mask and GQA group.  The workspace layout is
read from the tensors FA4 allocates in that same call: dq_accum f32 [B, H, S_r * E_r], dpsum and
lse_log2 f32 [B, H, S_r], with S_r the query length rounded up to FA4's tile_m and E_r the head dim
rounded up as FA4 rounds it; with GQA then dk_accum and dv_accum f32 [B, HK, T_r * E_r], T_r the key
length rounded up to the main kernel's tile_n, to an even number of tiles for a 2-CTA cluster; each
256-byte aligned, in that order (kspec.core.attention_bwd_workspace; the C in every kernel's glue;
the rounding in every variant's config, ws_*).  The choice does not depend on the sizes (FA4's
compile key varies with them only for TVM-FFI stride specialisations kspec does not use); capture
checks this at three sizes, one of them an odd number of key tiles.

**GQA** (K and V read at head `h / G`; compiler.fusion.match_attention_backward matches dK and dV
stored as `sum(h) where(h / G == kh, part, 0)` over the per-query-head parts): FA4 is run with K and V
of HK = H / G heads, which makes it construct the main kernel with qhead_per_kvhead = G and the dK
and dV postprocesses; the ABI's dims hold HK, and the glue refuses H != G * HK.  A group known only
per call (G an i32 param or a size symbol, or `h / (H / KH)`) is built, as the forward's is
(attention.py), for the group `kspec compile --sizes` names: each group's five kernels in a select
box G = that group (the runtime's step_variants picks the call's), a param G or a dim G checked
against it by the glue; without the sizes it plans unfused, saying so.

**Masks and layouts.**  Causal is FA4's own mask, aligned bottom-right: the spec's `j <= i + (T - S)`
for any lengths, or `j <= i` when the query and key lengths are one (checked at launch).  Q, K, V,
O, dO, dQ, dK, dV may be stored in any order of [b, h, seq, head] with the head dim innermost
(kspec passes strided views: BwdDesc.layout / _view; GQA: [b, h, seq, head] only).  **Packed
(varlen) sequences**: Q, O, dO, dQ and the LSE packed by one offsets tensor, K, V, dK, dV by one (or
dense): FA4's cu_seqlens_q / cu_seqlens_k, its [rows, H, E] layout, the packed LSE [rows, H] passed
as FA4's [H, rows] view, S and T the row counts; the workspace is then FA4's varlen one ([H, n],
n = rows + B tiles rounded up to a tile: FA4 pads each sequence to whole tiles).  Batches of more
than 256 sequences run without FA4's host-built batch lookup (as the forward does).  **Padded
sequences** (dense tensors, sequence b using its first Lq[b] query and Lk[b] key slots: the mask's
`i < Lq[b]` and `j < Lk[b]`, Lq and Lk i32 [B] inputs, either alone, with or without the
bottom-right causal `j <= i + (Lk[b] - Lq[b])` over those lengths): FA4's seqused_q / seqused_k,
the ABI's args after any offsets (and before any aux tensors), passed to the preprocess, the main
kernel and the dQ postprocess in FA4's own slots; the workspace is the dense one.  FA4 writes no
dQ row past Lq[b] and no dK / dV row past Lk[b] (its postprocess converts only the used rows of
dq_accum, which its preprocess zeroes whole), where the spec's gradient is 0: the plan's init
(BwdDesc.init, EmittedKernel.init) has the runtime zero dQ, dK and dV before the preprocess.

**Score modifications** (soft-capping, ALiBi, a bias: AttentionBwdStructure.score_mod, matched with
its derivative score_mod_grad by compiler/attention_grad.py) are FA4's score_mod and score_mod_bwd,
generated by attnmods.analyse_bwd into the entry module (as the forward's mods) and handed to
`_flash_attn_bwd` in capture, so the main kernel FA4 constructs applies them; the tensors they read
are the ABI's last args (after dV and any offsets; the main kernel's aux_tensors, mA<k>) and the
params and sizes they read its aux_scalars (c<k>, after softmax_scale), exactly as the forward
passes them.  FA4 computes no gradient for those tensors: a backward that also wants one (ALiBi's
dslope) is refused by the matching (`kspec grad --wrt Q,K,V` leaves it out).

**The runtime** (kspec.runtime.module.Module.launches) launches a binary whose variants carry the
roles of one of kspec.core.STEP_SEQUENCES as one call: the plan's init fills (padded sequences:
dQ, dK, dV) once, then the kernels in order, one workspace of the size the first one's glue asks,
not cleared (the preprocess zeroes dq_accum; FA4 allocates it and the row buffers uninitialised
too), but for what kspec.core.STEP_ZEROED names: GQA's dk_accum and dv_accum, zeroed (one memset)
right before the main kernel, as FA4 allocates them with torch.zeros.

**Not covered** (planned unfused, with the reason `kspec graph` prints): masks other than these,
among them a top-left causal `j <= i` over query and key lengths that may differ (or over used
lengths); head dims other than 64 and 128 (soft-capping at 256, as shipped, too); dtypes other than
f16/bf16; a score modification the matching does not recognise as the derivative of the recomputed
mod (or whose gradient is also wanted for a tensor it reads), or reading sizes or aux tensors with
extents other than the attention's B, H, S, T; combinations not built yet: used lengths with packed
sequences, GQA or a score modification, a score modification over packed sequences or with GQA, GQA
over packed sequences or tensors in another order than [b, h, seq, head]; a GQA group FA4 cannot
compile in (not a literal, a size symbol or an i32 param; a literal group of 1, H != G x KH at
literal head counts), a per-call group --sizes does not name, K and V in different groupings, and
MQA (K/V without a head axis).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kspec.backends.desc import Const, Load
from kspec.core import (ARCHS, ATTENTION_BWD_GQA_STEPS, ATTENTION_BWD_STEPS, KspecError, KspecInternalError,
                        attention_bwd_workspace, packed_rows_symbol)

HEAD_DIMS = (64, 128)
DTYPES = ("f16", "bf16")
AUX_DTYPES = ("f32", "f16", "bf16", "i32", "i8")   # tensors a score modification may read (as the forward's)
ROLES = ("B", "H", "S", "T")                       # ABI dims, in order (GQA: then HK, the K/V heads)
KV_TENSORS = (1, 2, 7, 8)                          # K, V, dK, dV of (Q, K, V, O, dO, LSE, dQ, dK, dV): over T
STEPS = ATTENTION_BWD_STEPS                        # the variants' roles, in launch order (GQA: GQA_STEPS)
GQA_STEPS = ATTENTION_BWD_GQA_STEPS
ALIGN = 256                                        # workspace sub-buffer alignment (attention_bwd_workspace's)
BUILD_FORMAT = 1
# (B, S, H) at which FA4's choice is captured (GQA: H K/V heads, G times as many query heads); S = 300
# is an odd number of key tiles of 128 and 64 (a 2-CTA backward rounds its dK/dV accumulators to even)
CAPTURE_POINTS = ((2, 512, 4), (1, 200, 2), (1, 300, 2))


def covered(ir, arch: str) -> str | None:
    """Why FlashAttention-4's backward as kspec would drive it cannot compute this backward (None: it
    can): the arch, the dtypes (f16/bf16 in and out), the head dim (64, 128), a causal mask over
    lengths that may differ, the [b, h, seq, head] layout, packing, the GQA group (_gqa_unsupported)
    and a score modification's functions, aux tensors and sizes (_mods_unsupported).  What the
    matching refuses never gets here."""
    a = ir.attention_bwd
    if a is None:
        return "not an attention backward kspec recognises"
    if arch not in ARCHS:
        return f"FlashAttention-4's backward is built for {', '.join(ARCHS)}, not {arch}"
    if a.dtype not in DTYPES:
        return f"FlashAttention-4's backward takes f16/bf16 Q, K, V, O, dO (got {a.dtype})"
    if a.head_dim not in HEAD_DIMS:
        return f"head dim {a.head_dim}: kspec drives FlashAttention-4's backward at head dims 64 and 128 only"
    if tuple(a.out_dtypes) != (a.dtype,) * 3:
        return f"dQ, dK and dV must be stored as {a.dtype} (got {', '.join(a.out_dtypes)})"
    dims = dict(a.dims)
    cu_q, cu_k = _packing(ir, a)
    if a.causal and not a.bottom_right and (dims["S"] != dims["T"] or cu_q or cu_k):
        return ("a causal backward with query and key lengths that may differ (FlashAttention-4 aligns its causal "
                "mask bottom-right, the spec's `j <= i` top-left; write `j <= i + (T - S)`)")
    if len(a.batch) != 2:
        return "FlashAttention-4's backward takes [b, h, seq, head] tensors (one batch and one head axis)"
    for names, cu in (((a.q_buffer, a.o_buffer, a.do_buffer, a.lse_buffer, a.dq_buffer), cu_q),
                      ((a.k_buffer, a.v_buffer, a.dk_buffer, a.dv_buffer), cu_k)):
        if any(ir.buffer(n).packed != cu for n in names):
            return (f"{', '.join(names)} must be packed alike (all by {cu})" if cu else
                    f"{', '.join(names)} must all be dense or all packed by the same offsets")
        if cu is not None and ir.buffer(cu).dtype != "i32":
            return f"FlashAttention-4 takes cumulative sequence offsets as i32, not {ir.buffer(cu).dtype}"
    for name in (a.seqused_q, a.seqused_k):
        if name is not None and tuple(ir.buffer(name).shape) != (dims["B"],):
            return f"FlashAttention-4 takes the used lengths {name} as i32 [B], one per sequence"
    if a.kv_group is not None and (cu_q or cu_k or a.layouts or a.score_mod is not None):
        return ("GQA over packed sequences, tensors in another order than [b, h, seq, head], or with a score "
                "modification (not built yet)")
    return _gqa_unsupported(ir, a) or _mods_unsupported(ir, a)


def _packing(ir, a) -> tuple[str | None, str | None]:
    """The offsets packing the queries (Q, O, dO, LSE, dQ) and the keys (K, V, dK, dV), or None."""
    return ir.buffer(a.q_buffer).packed, ir.buffer(a.k_buffer).packed


def _mods_unsupported(ir, a) -> str | None:
    """Why FA4's backward cannot take this backward's score modification as generated score_mod and
    score_mod_bwd functions (None: it can, or there is none)."""
    from kspec.compiler.kir import Size, epi_nodes

    from . import attnmods
    if a.score_mod is None:
        return None
    for e in (a.score_mod, a.score_mod_grad):
        why = attnmods.unsupported(e)
        if why:
            return why
        sizes = {x.name for x in epi_nodes(e) if isinstance(x, Size)}
        dims = {v for _r, v in a.dims if isinstance(v, str)}
        if sizes - dims:
            return f"the score modification reads the size {sorted(sizes - dims)[0]}, not one of the attention's"
    for name in a.aux:
        b = ir.buffer(name)
        if b.dtype not in AUX_DTYPES:
            return f"aux tensor {name} of dtype {b.dtype}"
        if b.packed is not None or b.layout != "row" or any(not isinstance(x, int) and _role(a, x) is None
                                                             for x in b.shape):
            return (f"aux tensor {name} must be row-major with extents that are literals or the attention's own "
                    "B, H, S, T")
    return None


def _role(a, extent) -> str | None:
    """The ABI dim role (B, H, S, T) whose extent `extent` is, or None."""
    return next((r for r in ROLES if dict(a.dims)[r] == extent), None)


def _gqa_unsupported(ir, a) -> str | None:
    """Why FA4's GQA backward as kspec drives it cannot take this group (None: it can, or no GQA)."""
    from . import attention
    g = a.kv_group
    if g is None:
        return None
    if isinstance(g, str):
        return None if attention._per_call_group(ir, a) else (
            f"the GQA group {g} must be an integer literal, a size symbol or an i32 param dividing the head index "
            "(FlashAttention-4 compiles it into the kernel)")
    if g < 2:
        return f"GQA group {g}: K/V read at head h / {g} (FlashAttention-4's GQA backward takes a group of 2 or more)"
    h, hk = dict(a.dims)["H"], a.kv_head
    if isinstance(h, int) and isinstance(hk, int) and h != g * hk:
        return (f"H = {h} query heads over KH = {hk} K/V heads at h / {g}: FlashAttention-4's GQA backward needs "
                f"H = {g} x KH (every K/V head shared by exactly {g} query heads)")
    return None


def unsupported(ir, arch: str) -> str | None:
    """The backend's answer for an attention_bwd kernel: what FlashAttention-4 cannot do first (installing
    it would not help there), then whether it is installed."""
    from . import compat
    return covered(ir, arch) or compat.fa4_available()


# ---------------------------------------------------------------------------------------------
# IR -> descriptor
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BwdDesc:
    name: str
    arch: str
    dtype: str
    head_dim: int
    causal: bool
    q: str                     # C names of the ABI's tensors, in ABI order (args)
    k: str
    v: str
    o: str
    do: str
    lse: str
    dq: str
    dk: str
    dv: str
    scale: Load | Const
    dims: tuple[str, ...]
    scalars: tuple[str, ...]
    sm_count: int
    group: int = 1             # GQA: query heads per K/V head (dims then hold HK); 0: known per call ..
    groups: tuple[int, ...] = ()         # .. built for these (`kspec compile --sizes`)
    group_param: str | None = None       # the i32 param the spec divides the head by (checked against it)
    bottom_right: bool = False           # the causal mask aligned bottom-right (FA4's own alignment)
    layouts: tuple[tuple[str, ...], ...] = ()     # storage orders (AttentionBwdStructure.layouts)
    cu_q: str | None = None              # FA4's cu_seqlens_q / cu_seqlens_k (i32 [B + 1]): packed rows
    cu_k: str | None = None
    seqused_q: str | None = None         # FA4's seqused_q / seqused_k (i32 [B]): the used query / key counts
    seqused_k: str | None = None         # of padded sequences (dQ, dK, dV zeroed before the call: init)
    # a score modification: FA4's score_mod and score_mod_bwd (attnmods.analyse_bwd), the aux tensors
    # they read (attention.AuxArg, after dV in the ABI) and their aux_scalars (("scalar", ABI scalar)
    # | ("dim", role))
    mods: object = None
    aux: tuple = ()
    mod_scalars: tuple[tuple[str, str], ...] = ()

    @property
    def gqa(self) -> bool:
        return self.group != 1

    @property
    def steps(self) -> tuple[str, ...]:
        """The kernels' roles in launch order: three, five with GQA (its dK, dV postprocesses)."""
        return GQA_STEPS if self.gqa else STEPS

    @property
    def args(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v, self.o, self.do, self.lse, self.dq, self.dk, self.dv,
                *(n for n in (self.cu_q, self.cu_k, self.seqused_q, self.seqused_k) if n), *(x.name for x in self.aux))

    def alignment(self) -> tuple[tuple[str, int], ...]:
        from kspec.core import dtype_bytes
        aux = {x.name: dtype_bytes(x.dtype) for x in self.aux}
        small = (self.lse, self.cu_q, self.cu_k, self.seqused_q, self.seqused_k)
        return tuple((n, aux[n] if n in aux else 4 if n in small else 16) for n in self.args)

    def init(self) -> tuple[tuple[str, str], ...]:
        """The outputs the runtime zeroes before the call (EmittedKernel.init): with used lengths dQ, dK
        and dV, whose rows past them FA4 never writes (the spec's gradient is 0 there)."""
        return tuple((n, "zero") for n in (self.dq, self.dk, self.dv)) if self.seqused_q or self.seqused_k else ()

    @property
    def seqused(self) -> str:
        """Which used lengths FA4 is given: "q,k", "q", "k" or "none" (every variant's config)."""
        return ",".join(x for x, n in (("q", self.seqused_q), ("k", self.seqused_k)) if n) or "none"

    @property
    def packed(self) -> str:
        """Which side is packed (cu_seqlens): "q,k", "q", "k" or "none" (every variant's config, read
        by kspec.core.attention_bwd_layout and the fake driver)."""
        return ",".join(x for x, n in (("q", self.cu_q), ("k", self.cu_k)) if n) or "none"

    def layout(self, k: int) -> tuple[str, ...]:
        """Tensor k's (Q, K, V, O, dO, LSE, dQ, dK, dV) storage order as roles, outermost first; a
        packed one without B (its sequence role is then the packed row count); GQA's K, V, dK, dV
        with HK heads."""
        kv = k in KV_TENSORS
        seq = "T" if kv else "S"
        order = self.layouts[k] if self.layouts else (("B", "H", "S") if k == 5 else ("B", "H", seq, "E"))
        if kv and self.gqa:
            order = tuple("HK" if r == "H" else r for r in order)
        return tuple(r for r in order if r != "B") if (self.cu_k if kv else self.cu_q) else order


def lower(ir, arch: str, sm_count: int | None = None):
    """The kernel IR as a BwdDesc plus the ABI facts (names, dims, scalars) for a LoweredPlan."""
    from kspec.backends.names import Names

    from . import compat
    why = covered(ir, arch)
    if why:
        raise KspecInternalError(f"attention backward lowering called for an unsupported kernel {ir.id}: {why}")
    a = ir.attention_bwd
    names = Names()
    ext = dict(a.dims)
    roles, group_param = ROLES, None
    if a.kv_group is not None:
        ext["HK"], roles = a.kv_head, (*ROLES, "HK")
    if isinstance(a.kv_group, str):
        # known per call: a param (checked against the kernel's group at launch), a size symbol (a dim,
        # checked too), or "H/KH" (the glue's H == G * HK check says it all)
        if any(b.name == a.kv_group and b.role == "param" for b in ir.buffers):
            group_param = a.kv_group
        elif "/" not in a.kv_group:
            ext["G"], roles = a.kv_group, (*roles, "G")
    scalars: dict[str, object] = {}
    if a.scale is not None:
        scale: Load | Const = Load(names(a.scale), "scalar", "f32")
    else:
        scale = Const(1.0)
    bufs = [names(b) for b in (a.q_buffer, a.k_buffer, a.v_buffer, a.o_buffer, a.do_buffer, a.lse_buffer,
                               a.dq_buffer, a.dk_buffer, a.dv_buffer)]
    if isinstance(scale, Load):
        scalars[scale.name] = a.scale
    if group_param is not None:
        scalars[names(group_param)] = group_param
    mods = _lower_mods(ir, a, names, scalars)
    cu_q, cu_k = _packing(ir, a)
    if cu_q is not None:                 # packed: FA4's S and T are the row counts of the packed arrays
        ext["S"] = packed_rows_symbol(cu_q)
    if cu_k is not None:
        ext["T"] = packed_rows_symbol(cu_k)
    desc = BwdDesc(f"k_{ir.id.rsplit('_', 1)[-1]}", arch, a.dtype, int(a.head_dim), bool(a.causal), *bufs,
                   scale=scale, dims=roles, scalars=tuple(scalars),
                   sm_count=int(sm_count or compat.OFFLINE_SM_COUNT[arch]),
                   group=a.kv_group if isinstance(a.kv_group, int) else 0 if a.kv_group else 1,
                   group_param=names(group_param) if group_param else None, bottom_right=bool(a.bottom_right),
                   layouts=tuple(a.layouts), cu_q=names(cu_q) if cu_q else None,
                   cu_k=names(cu_k) if cu_k else None, seqused_q=names(a.seqused_q) if a.seqused_q else None,
                   seqused_k=names(a.seqused_k) if a.seqused_k else None, **mods)
    return desc, names.back(), tuple((r, ext[r]) for r in roles), scalars


def _lower_mods(ir, a, names, scalars: dict) -> dict:
    """BwdDesc's mods, aux and mod_scalars for a backward with a score modification ({} without);
    the params the mods read join `scalars` (C name -> param)."""
    from . import attnmods
    from .attention import AuxArg
    if a.score_mod is None:
        return {}
    ext = dict(a.dims)
    mods = attnmods.analyse_bwd(a, {"S": ext["S"], "T": ext["T"]})
    aux = tuple(AuxArg(names(n), ir.buffer(n).dtype, tuple(str(x) if isinstance(x, int) else _role(a, x)
                                                            for x in ir.buffer(n).shape)) for n in mods.aux)
    mod_scalars = []
    for kind, ref in mods.scalars:
        if kind == "param":
            scalars[names(ref)] = ref
            mod_scalars.append(("scalar", names(ref)))
        else:
            mod_scalars.append(("dim", _role(a, ref)))
    return {"mods": mods, "aux": aux, "mod_scalars": tuple(mod_scalars)}


def fa4_classes(desc: BwdDesc) -> list[str]:
    """The FA4 class of each of desc's kernels, in launch order (desc.steps)."""
    main = "FlashAttentionBackwardSm90" if desc.arch == "sm90a" else "FlashAttentionBackwardSm100"
    return ["FlashAttentionBackwardPreprocess", main] + ["FlashAttentionBackwardPostprocess"] * (len(desc.steps) - 2)


def config_items(desc: BwdDesc, kernels: str | None = None) -> tuple[tuple[str, str], ...]:
    from . import compat
    from .attention import _group_item
    pre, main, post, *_ = fa4_classes(desc)
    gqa = desc.gqa
    names = f"{pre}, {main}, {post}" + (f" (dQ), {post} (dK), {post} (dV)" if gqa else "")
    ws = "dq_accum f32, dpsum f32, lse_log2 f32" + (", dk_accum f32, dv_accum f32 (per call; dk_accum and dv_accum "
                                                   "zeroed before the main kernel)" if gqa else " (per call)")
    return (("kernel", f"FlashAttention-4 {compat.FA4_VERSION} backward: " + (kernels or names)),
            ("head_dim", str(desc.head_dim)),
            ("mask", ("causal (bottom-right)" if desc.bottom_right else "causal") if desc.causal else "none"),
            *((("gqa_group", _group_item(desc)),) if gqa else ()),
            *((("varlen", ", ".join(n for n, c in (("cu_seqlens_q", desc.cu_q), ("cu_seqlens_k", desc.cu_k)) if c)),)
              if desc.cu_q or desc.cu_k else ()),
            *((("seqused", ", ".join(n for n, c in (("seqused_q", desc.seqused_q), ("seqused_k", desc.seqused_k))
                                     if c) + " (dQ, dK, dV zeroed before the call)"),)
              if desc.seqused != "none" else ()),
            *((("score_mod", "generated, with its generated derivative (score_mod_bwd)"),) if desc.mods else ()),
            ("workspace", ws),
            ("source", "FlashAttention-4 heuristics"))


# ---------------------------------------------------------------------------------------------
# the kernels' tensors and entry
# ---------------------------------------------------------------------------------------------

def _view(desc: BwdDesc, k: int) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """FA4's view of tensor k (Q, K, V, O, dO, dQ, dK, dV: (b, seq, heads), or (rows, heads) when
    packed, then the static head dim; the LSE: (b, h, S), or (h, rows) when packed): the modes'
    extents (roles) and strides (products of the storage extents after each), from its storage
    order.  A mode whose stride is a static 1 (the head dim; the canonical LSE's S) gets none."""
    order = desc.layout(k)
    kv = k in KV_TENSORS
    seq, heads = ("T", "HK" if desc.gqa else "H") if kv else ("S", "H")
    packed = desc.cu_k if kv else desc.cu_q
    if k == 5:
        modes = ("H", "S") if packed else ("B", "H", "S")
    else:
        modes = (seq, heads) if packed else ("B", seq, heads)
    extent = {r: (str(desc.head_dim) if r == "E" else r) for r in order}

    def stride(r: str) -> tuple[str, ...]:
        return tuple(extent[x] for x in order[order.index(r) + 1:]) or ("1",)
    if k == 5 and order == modes:
        return modes, tuple(stride(r) for r in modes[:-1])
    return modes, tuple(stride(r) for r in modes)


def tensors(desc: BwdDesc, step: str) -> list[tuple]:
    """(entry name, dtype, dynamic shape (C expressions), stride factors, data C expression) of one
    kernel's tensors, in the entry's order.  FA4's Q/K/V/O/dO/dQ/dK/dV views end with the static head
    dim (_view); the workspace buffers are row-major [B, H, n] ([H, n] for packed queries), the
    offsets of packed sequences [B + 1], the used lengths of padded ones [B].  GQA: K, V, dK, dV and
    the dK/dV accumulators have HK heads; the main kernel writes the accumulators."""
    idx = {n: f"ptrs[{i}]" for i, n in enumerate(("q", "k", "v", "o", "do", "lse", "dq", "dk", "dv"))}
    for n, c in (("cu_q", desc.cu_q), ("cu_k", desc.cu_k), ("sq", desc.seqused_q), ("sk", desc.seqused_k)):
        if c:
            idx[n] = f"ptrs[{len(idx)}]"
    dt = desc.dtype
    kv = "HK" if desc.gqa else "H"
    k_of = {"q": 0, "k": 1, "v": 2, "o": 3, "do": 4, "lse": 5, "dq": 6, "dk": 7, "dv": 8}

    def seq(name, which):
        return (name, dt, *_view(desc, k_of[which]), idx[which])

    def rows(n, heads="H"):
        return ((heads, n), ((n,),)) if desc.cu_q else (("B", heads, n), ((heads, n), (n,)))
    lse = ("mLSE", "f32", *_view(desc, 5), idx["lse"])
    dpsum = ("mdPsum", "f32", *rows("ks_sr"), "ks_dpsum")
    lse2 = ("mLSElog2", "f32", *rows("ks_sr"), "ks_lse_log2")
    acc = ("mdQaccum", "f32", *rows("ks_qd"), "ks_dq_accum")
    dk, dv = seq("mdK", "dk"), seq("mdV", "dv")
    dk_acc = ("mdKaccum", "f32", *rows("ks_kd", kv), "ks_dk_accum")
    dv_acc = ("mdVaccum", "f32", *rows("ks_kd", kv), "ks_dv_accum")
    cq = [("mCQ", "i32", ("(B + 1)",), (), idx["cu_q"])] if desc.cu_q else []
    ck = [("mCK", "i32", ("(B + 1)",), (), idx["cu_k"])] if desc.cu_k else []
    sq = [("mSQ", "i32", ("B",), (), idx["sq"])] if desc.seqused_q else []
    sk = [("mSK", "i32", ("B",), (), idx["sk"])] if desc.seqused_k else []
    aux = [(f"mA{k}", x.dtype, tuple(x.shape), tuple(tuple(x.shape[j + 1:]) for j in range(len(x.shape) - 1)),
            f"ptrs[{len(idx) + k}]") for k, x in enumerate(desc.aux)]
    out = {"bwd_preprocess": [seq("mO", "o"), seq("mdO", "do"), dpsum, lse, lse2, acc, *cq, *sq],
           "bwd_main": [seq("mQ", "q"), seq("mK", "k"), seq("mV", "v"), seq("mdO", "do"), lse2,
                        dpsum, acc, *((dk_acc, dv_acc) if desc.gqa else (dk, dv)), *cq, *ck, *sq, *sk, *aux],
           "bwd_postprocess": [acc, seq("mdQ", "dq"), *cq, *sq],
           "bwd_postprocess_dk": [dk_acc, dk], "bwd_postprocess_dv": [dv_acc, dv]}
    if step not in desc.steps:
        raise KspecInternalError(f"no attention backward step {step!r}")
    return out[step]


# each kernel's non-tensor arguments (dV's postprocess scales by 1, a constant in the entry)
_VALUES = {"bwd_preprocess": (), "bwd_main": ("softmax_scale",), "bwd_postprocess": ("softmax_scale",),
           "bwd_postprocess_dk": ("softmax_scale",), "bwd_postprocess_dv": ()}
# the entry's names of the FA4 kernel objects kspec sets, per step
_OBJECTS = {"bwd_preprocess": "PRE", "bwd_main": "MAIN", "bwd_postprocess": "POST", "bwd_postprocess_dk": "POST_DK",
            "bwd_postprocess_dv": "POST_DV"}


def _values(desc: BwdDesc, step: str) -> list[tuple[str, str]]:
    """A kernel's non-tensor parameters: (name, DSL type); the main kernel's mod scalars c<k> last."""
    out = [(v, "Float32") for v in _VALUES[step]]
    if step == "bwd_main":
        out += [(f"c{k}", "Float32" if kind == "scalar" else "Int32") for k, (kind, _r) in enumerate(desc.mod_scalars)]
    return out


def entry_source(desc: BwdDesc) -> str:
    """The traced module: kspec_<step> for each of desc.steps, calling the FA4 object kspec set in PRE,
    MAIN, POST (GQA: and POST_DK, POST_DV) with FA4's own argument order (the optional ones None, as
    _flash_attn_bwd passes them for a non-deterministic backward; cu_seqlens_q / cu_seqlens_k for
    packed sequences, seqused_q / seqused_k for padded ones)."""
    def params(step):
        return ", ".join([f"{t[0]}: cute.Tensor" for t in tensors(desc, step)] +
                         [f"{v}: cutlass.{t}" for v, t in _values(desc, step)] + ["stream: cuda.CUstream"])
    aux_t = "[" + ", ".join(f"mA{k}" for k in range(len(desc.aux))) + "]" if desc.aux else "None"
    aux_s = "(" + "".join(f"c{k}, " for k in range(len(desc.mod_scalars))) + ")" if desc.mod_scalars else "None"
    mods = [desc.mods.score_mod, desc.mods.score_mod_bwd] if desc.mods else []
    cq, ck = ("mCQ" if desc.cu_q else "None"), ("mCK" if desc.cu_k else "None")
    sq, sk = ("mSQ" if desc.seqused_q else "None"), ("mSK" if desc.seqused_k else "None")
    # MAIN's tensors up to dV (or the dK/dV accumulators); the offsets, used lengths and aux tensors
    # after them in the entry go to FA4's own slots below
    main = [t[0] for t in tensors(desc, "bwd_main")][:9]
    posts = []
    for step, scale in (("bwd_postprocess_dk", "softmax_scale"), ("bwd_postprocess_dv", "cutlass.Float32(1.0)")):
        if step in desc.steps:
            acc, out = (t[0] for t in tensors(desc, step))
            posts += ["", "", "@cute.jit", f"def kspec_{step}({params(step)}):",
                      f"    {_OBJECTS[step]}({acc}, {out}, {scale}, None, None, None, None, stream=stream)"]
    return "\n".join([
        f'"""Generated by kspec (CuTe DSL backend, FlashAttention-4): attention backward {desc.name} for '
        f'{desc.arch}."""',
        "import cuda.bindings.driver as cuda",
        "import cutlass",
        "import cutlass.cute as cute",
        "from flash_attn.cute.utils import AuxData",
        *(["", "from kspec.backends.cute import dslops as F"] if mods else []),
        "",
        f"{' = '.join(_OBJECTS[st] for st in desc.steps)} = None   # FA4's kernel objects (set by kspec)",
        "",
        *mods,
        "",
        "@cute.jit",
        f"def kspec_bwd_preprocess({params('bwd_preprocess')}):",
        "    # (O, dO, dpsum, LSE, lse_log2, dq_accum, cu_seqlens_q, seqused_q, dLSE, row_max, scale_p,",
        "    #  softmax_scale (read with scale_p only), cu_total_m_blocks, o_lo)",
        f"    PRE(mO, mdO, mdPsum, mLSE, mLSElog2, mdQaccum, {cq}, {sq}, None, None, None, cutlass.Float32(1.0),",
        "        None, None, stream=stream)",
        "",
        "",
        "@cute.jit",
        f"def kspec_bwd_main({params('bwd_main')}):",
        "    # (.., softmax_scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, window_size_left / right,",
        "    #  dQ / dK / dV semaphores, aux, block sparsity, cu_total_m_blocks_k)",
        f"    MAIN({', '.join(main)}, softmax_scale, {cq}, {ck}, {sq}, {sk},",
        f"         None, None, None, None, None, AuxData({aux_t}, {aux_s}), None, None, stream=stream)",
        "",
        "",
        "@cute.jit",
        f"def kspec_bwd_postprocess({params('bwd_postprocess')}):",
        "    # (dq_accum, dQ, scale, cu_seqlens_q, seqused_q, sink tensors, cu_total_m_blocks)",
        f"    POST(mdQaccum, mdQ, softmax_scale, {cq}, {sq}, None, None, stream=stream)",
        *posts,
        "",
    ])


def _fake_args(desc: BwdDesc, step: str) -> list:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from kspec.core import dtype_bytes

    from .dslops import dsl_type
    syms: dict[str, object] = {}
    out = []
    for name, dt, shape, strides, _data in tensors(desc, step):
        el = dtype_bytes(dt)
        div = 16 // el                      # FA4's assumed 16-byte alignment of every tensor but the LSE
        aux = name.startswith("mA")         # a score modification's tensor: element-aligned, no head dim
        if name in ("mLSE", "mCQ", "mCK", "mSQ", "mSK") or aux:
            div = 1
        shp = [int(r) if r.isdigit() else syms.setdefault(r, cute.sym_int32()) for r in shape]
        if dt in ("f16", "bf16") and not aux:
            shp.append(desc.head_dim)
        if len(strides) == len(shp):       # every mode strided (a packed LSE [h, rows] of [rows, h])
            stride = tuple(cute.sym_int64(divisibility=1) for _ in strides)
        else:
            stride = tuple(cute.sym_int64(divisibility=div) for _ in strides) + (1,)
        out.append(make_fake_tensor(dsl_type(dt), tuple(shp), stride=stride, assumed_align=div * el))
    return out + [getattr(cutlass, t)(1.0 if t == "Float32" else 1) for _v, t in _values(desc, step)]


# ---------------------------------------------------------------------------------------------
# the workspace and the host glue
# ---------------------------------------------------------------------------------------------

def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def workspace_bytes(B: int, H: int, S: int, tile_m: int, head_dim_rounded: int, *kv: int, packed: bool = False) -> int:
    """The workspace of one call (kspec.core.attention_bwd_workspace: what the glue's C computes; kv:
    GQA's HK, T, kv_tile, kv_pair; packed: packed queries, S their row count)."""
    return attention_bwd_workspace(B, H, S, tile_m, head_dim_rounded, *kv, packed=packed)["total"][0]


def _layout_c(desc: BwdDesc, cap: Captured) -> list[str]:
    """C lines computing the sub-buffer sizes of the workspace (kspec.core.attention_bwd_workspace) from
    B, H, S (GQA: and HK, T); S the packed row count when the queries are packed (FA4 pads each
    sequence: S + B tiles, rounded up to a tile, rows per head)."""
    tile_m, dr = cap.tile_m, cap.head_dim_rounded
    n = "(uint64_t)H" if desc.cu_q else "(uint64_t)B * H"
    out = [
        (f"    const int64_t ks_sr = (S + (B + 1) * {tile_m} - 1) / {tile_m} * {tile_m};" if desc.cu_q else
         f"    const int64_t ks_sr = (S + {tile_m} - 1) / {tile_m} * {tile_m};"),
        f"    const int64_t ks_qd = ks_sr * {dr};",
        f"    const uint64_t ks_off1 = ({n} * ks_qd * 4 + {ALIGN - 1}) / {ALIGN} * {ALIGN};",
        f"    const uint64_t ks_rows = ({n} * ks_sr * 4 + {ALIGN - 1}) / {ALIGN} * {ALIGN};",
    ]
    if desc.gqa:
        n, pair = cap.kv_tile, cap.kv_pair
        out += [
            f"    const int64_t ks_kr = ((T + {n} - 1) / {n} + {pair - 1}) / {pair} * {pair} * {n};",
            f"    const int64_t ks_kd = ks_kr * {dr};",
            "    const uint64_t ks_off3 = ks_off1 + 2 * ks_rows;",
            f"    const uint64_t ks_kv = ((uint64_t)B * HK * ks_kd * 4 + {ALIGN - 1}) / {ALIGN} * {ALIGN};",
        ]
    return out


def _decl(desc: BwdDesc) -> list[str]:
    return [f"    const int64_t {r} = dims[{k}]; (void){r};" for k, r in enumerate(desc.dims)]


def _sizes(desc: BwdDesc, sep: str) -> str:
    return sep.join(f"{r} {{op}} 0" for r in desc.dims)


def workspace_lines(desc: BwdDesc, cap: Captured) -> list[str]:
    """The body of kspec_workspace_size (the same in every kernel's glue)."""
    return _decl(desc) + [
        "    (void)device; (void)sm_count; (void)err; (void)err_cap;",
        "    *bytes = 0;",
        f"    if ({_sizes(desc, ' || ').format(op='<=')}) return 0;",
        *_layout_c(desc, cap),
        "    *bytes = " + ("ks_off3 + 2 * ks_kv;" if desc.gqa else "ks_off1 + 2 * ks_rows;"),
        "    return 0;",
    ]


def checks(desc: BwdDesc, cap: Captured) -> list[str]:
    """C lines of kspec_prepare: the sizes validated, the workspace's sub-buffers placed.  S and T are
    the packed row counts when the queries / keys are packed (the runtime checks the offsets)."""
    from . import attention
    names = " ".join(f"{r}=%lld" for r in desc.dims)
    values = ", ".join(f"(long long){r}" for r in desc.dims)
    out = _decl(desc) + [
        f"    if ({_sizes(desc, ' || ').format(op='<')})",
        f"        KS_FAIL(\"bad attention sizes ({names})\", {values});",
        "    if (" + " || ".join(f"{r} > INT32_MAX" for r in desc.dims) + ")",
        "        KS_FAIL(\"attention sizes must fit in 32 bits\");",
        "    if (B == 0 || H == 0) KS_EMPTY();",
    ]
    if desc.gqa:
        g = desc.group
        out += [f"    if (H != HK * {g})",
                f"        KS_FAIL(\"%lld query heads with %lld K/V heads: this kernel needs exactly {g} query heads per "
                f"K/V head (H = {g} x K/V heads)\", (long long)H, (long long)HK);"]
    out += attention.group_checks(desc)
    out += [
        "    if (S == 0 || T == 0)",
        "        KS_FAIL(\"S = %lld queries, T = %lld keys: FlashAttention-4's backward needs at least one of each\", "
        "(long long)S, (long long)T);",
    ]
    if desc.causal and not desc.bottom_right:
        out += ["    if (S != T) KS_FAIL(\"causal attention backward with S = %lld queries and T = %lld keys: they must "
                "be equal\", (long long)S, (long long)T);"]
    out += [
        *_layout_c(desc, cap),
        "    if (ks_qd > INT32_MAX) KS_FAIL(\"S = %lld queries: the dQ accumulator rows exceed 32-bit extents\", "
        "(long long)S);",
    ]
    if desc.gqa:
        out += ["    if (ks_kd > INT32_MAX) KS_FAIL(\"T = %lld keys: the dK/dV accumulator rows exceed 32-bit extents\", "
                "(long long)T);"]
    out += [
        "    if (workspace == NULL) KS_FAIL(\"FlashAttention-4's backward called without its workspace\");",
        "    void *ks_dq_accum = workspace;",
        "    void *ks_dpsum = (void *)((char *)workspace + ks_off1);",
        "    void *ks_lse_log2 = (void *)((char *)workspace + ks_off1 + ks_rows);",
    ]
    if desc.gqa:
        out += ["    void *ks_dk_accum = (void *)((char *)workspace + ks_off3);",
                "    void *ks_dv_accum = (void *)((char *)workspace + ks_off3 + ks_kv);"]
    return out


def _glue_tensors(desc: BwdDesc, step: str) -> list:
    from .build import GlueTensor
    return [GlueTensor(name, -1, tuple(shape), tuple(f for f in strides if f), data)
            for name, _dt, shape, strides, data in tensors(desc, step)]


def _glue(desc: BwdDesc, step: str, ciface: str, entry: str, offs, sizes, cap: Captured) -> str:
    from . import compat
    from .build import capture_glue
    values, args = [], []
    if _VALUES[step]:
        if isinstance(desc.scale, Load):
            values.append(f"    float softmax_scale = (float)scalars[{desc.scalars.index(desc.scale.name)}];")
        else:
            values.append(f"    float softmax_scale = (float){float(desc.scale.value)!r};")
        args.append("&softmax_scale")
    if step == "bwd_main":
        for k, (kind, ref) in enumerate(desc.mod_scalars):
            values.append(f"    float c{k} = (float)scalars[{desc.scalars.index(ref)}];" if kind == "scalar" else
                          f"    int32_t c{k} = (int32_t)({ref});")
            args.append(f"&c{k}")
    return capture_glue(_glue_tensors(desc, step), checks(desc, cap), values, args, ciface, entry, offs,
                        sizes, compat.SMEM_OPTIN[desc.arch], what=f"FlashAttention-4 backward ({step})",
                        workspace=workspace_lines(desc, cap))


# ---------------------------------------------------------------------------------------------
# FA4's choice
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Captured:
    objects: tuple                  # the kernel objects, one per step (desc.steps)
    signature: str
    tile_m: int                     # the workspace's row rounding
    head_dim_rounded: int
    kv_tile: int = 0                # GQA: the dK/dV accumulators' key rounding (FA4's tile_n) ..
    kv_pair: int = 1                # .. to an even number of tiles where 2 (a 2-CTA cluster's)

    def config(self) -> list[list[str]]:
        """The workspace rounding as every variant's config records it (kspec.core.attention_bwd_layout)."""
        return [["ws_tile_m", str(self.tile_m)], ["ws_head_dim", str(self.head_dim_rounded)],
                *([["ws_kv_tile", str(self.kv_tile)], ["ws_kv_pair", str(self.kv_pair)]] if self.kv_tile else [])]


class _Uncached(dict):
    """A compile cache that never hits: FA4 constructs every kernel of a call, even two alike (GQA's
    dK and dV postprocesses at equal head dims)."""

    def __contains__(self, key) -> bool:
        return False


def _describe(obj) -> str:
    return type(obj).__name__ + repr(sorted((k, repr(v)) for k, v in vars(obj).items()
                                            if v is None or isinstance(v, (bool, int, float, str, tuple))))


def capture(desc: BwdDesc, mod=None) -> Captured:
    """FA4's backward kernel objects for desc (three; GQA: five), from `_flash_attn_bwd` run on torch
    FakeTensors with `cute.compile` recorded (nothing is compiled or launched there); FA4's compile
    caches are swapped for ones that never hit meanwhile, so every kernel is constructed.  GQA: K and
    V of H / G heads.  Runs under compat.fa4_target.  mod: the imported entry module, whose generated
    kspec_score_mod / kspec_score_mod_bwd FA4 is given (with aux tensors standing for desc.aux) when
    desc has a score modification."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import cutlass.cute as cute

    from . import compat
    interface = compat.fa4_interface()
    fns = (interface._bwd_preprocess, interface._flash_attn_bwd, interface._bwd_postprocess_convert)
    tdt = {"f16": torch.float16, "bf16": torch.bfloat16}[desc.dtype]
    seen, calls, kv_seen = [], [], []

    def record(*args, **kwargs):
        calls.append(args)
        return lambda *x, **y: None
    for B, S, H in CAPTURE_POINTS:
        calls.clear()
        real, caches = cute.compile, [f.compile_cache for f in fns]
        warn = torch._C._set_warn_deprecated_on_mutable_data_ptr     # FA4 reads data_ptr() (unused)
        cute.compile = record
        torch._C._set_warn_deprecated_on_mutable_data_ptr = lambda t: None
        for f in fns:
            f.compile_cache = _Uncached()
        HK, H = H, H * desc.group
        try:
            with FakeTensorMode():
                # packed: S rows in all, B sequences (FA4's varlen layout [rows, H, E], LSE [H, rows])
                q = torch.empty(*((S,) if desc.cu_q else (B, S)), H, desc.head_dim, dtype=tdt, device="cuda")
                kv = torch.empty(*((S,) if desc.cu_k else (B, S)), HK, desc.head_dim, dtype=tdt, device="cuda")
                lse = torch.empty(H, S, dtype=torch.float32, device="cuda") if desc.cu_q else \
                    torch.empty(B, H, S, dtype=torch.float32, device="cuda")
                cu = {f"cu_seqlens_{x}": torch.empty(B + 1, dtype=torch.int32, device="cuda")
                      for x, c in (("q", desc.cu_q), ("k", desc.cu_k)) if c}
                lens = {f"max_seqlen_{x}": S for x, c in (("q", desc.cu_q), ("k", desc.cu_k)) if c}
                used = {f"seqused_{x}": torch.empty(B, dtype=torch.int32, device="cuda")
                        for x, c in (("q", desc.seqused_q), ("k", desc.seqused_k)) if c}
                interface._flash_attn_bwd(q, kv, kv, q, q, lse, softmax_scale=0.125, causal=desc.causal, **cu,
                                          **lens, **used, **_mod_kwargs(desc, mod))
        finally:
            cute.compile = real
            torch._C._set_warn_deprecated_on_mutable_data_ptr = warn
            for f, c in zip(fns, caches):
                f.compile_cache = c
        names, want = [type(a[0]).__name__ for a in calls], fa4_classes(desc)
        if names != want:
            raise KspecInternalError(f"FlashAttention-4's backward built {names} for {desc.name} on {desc.arch}, "
                                     f"kspec expects {want}")
        objects = tuple(a[0] for a in calls)
        pre, main, post = objects[:3]
        # the workspace as FA4 allocated it: lse_log2 [B, H, S_r], dq_accum [B, H, S_r * E_r] ([H, ..]
        # with packed queries, S_r then the padded row count)
        lse2, acc = calls[1][5], calls[1][7]
        sr, qd = int(lse2.shape[-1]), int(acc.shape[-1])
        tile_m = int(pre.tile_m)
        want = (S + (B + 1) * tile_m - 1) // tile_m * tile_m if desc.cu_q else _up(S, tile_m)
        if sr != want or qd % sr or main.tile_m != tile_m or post.tile_m != tile_m:
            raise KspecInternalError(f"FlashAttention-4's backward workspace for S={S} is not rounded to its tile "
                                     f"({sr} rows, tile_m {tile_m})")
        cap = Captured(objects, " ".join(_describe(o) for o in objects), tile_m, qd // sr)
        seen.append(cap)
        # GQA: the dK/dV accumulators as FA4 allocated them, (B, HK, T) with T = S
        kv_seen.append((calls[1][8:10], B, HK, S) if desc.gqa else None)
    if len({c.signature for c in seen}) != 1 or len({c.head_dim_rounded for c in seen}) != 1:
        raise KspecInternalError(f"FlashAttention-4's backward for {desc.name} on {desc.arch} depends on the sizes; "
                                 "kspec builds one")
    return seen[0] if desc.group == 1 else _kv_rounding(desc, seen[0], kv_seen)


def _mod_kwargs(desc: BwdDesc, mod) -> dict:
    """`_flash_attn_bwd`'s score_mod, score_mod_bwd and aux_tensors for desc (FakeTensors of the aux
    tensors' rank, as the forward's capture passes them: FA4 keys its kernels by their dtype and
    static strides, none of which kspec's entry uses)."""
    import torch
    if desc.mods is None:
        return {}
    if mod is None:
        raise KspecInternalError(f"attention backward {desc.name}: its score modification needs the entry module")
    aux = [torch.empty(*(2 for _ in x.shape), dtype=torch.float32, device="cuda") for x in desc.aux]
    return {"score_mod": mod.kspec_score_mod, "score_mod_bwd": mod.kspec_score_mod_bwd, "aux_tensors": aux or None}


def _kv_rounding(desc: BwdDesc, cap: Captured, seen) -> Captured:
    """cap with the rounding of GQA's dK/dV accumulators as FA4 allocated them at the capture points
    `seen` ((dk_accum, dv_accum), B, HK, T): [B, HK, T_r * E_r], T_r a whole number of the main
    kernel's tile_n, one tile more where a 2-CTA cluster needs an even count; checked at every point
    against kspec.core.attention_bwd_workspace."""
    n = int(cap.objects[1].tile_n)
    odd = [int(accs[0].shape[2]) // cap.head_dim_rounded - _up(T, n) for accs, _B, _HK, T in seen if _up(T, n) // n % 2]
    cap = dataclasses.replace(cap, kv_tile=n, kv_pair=2 if any(odd) else 1)
    for accs, B, HK, T in seen:
        want = attention_bwd_workspace(B, HK * desc.group, T, cap.tile_m, cap.head_dim_rounded, HK, T, n, cap.kv_pair)
        shapes = [tuple(int(x) for x in t.shape) for t in accs]
        if not odd or shapes != [want["dk_accum"][1], want["dv_accum"][1]] or \
                any(int(p.tile_m) != n for p in cap.objects[3:]):
            raise KspecInternalError(f"FlashAttention-4's GQA backward accumulates dK and dV in {shapes} for B={B}, "
                                     f"HK={HK}, T={T}; kspec expects {[want['dk_accum'][1], want['dv_accum'][1]]} "
                                     f"(tile_n {n}, postprocess tiles {[p.tile_m for p in cap.objects[3:]]})")
    return cap


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------

def build_key(desc: BwdDesc) -> str:
    from . import compat
    from .build import _source_identity
    material = {"desc": repr(desc), "src": entry_source(desc), "fa4": compat.FA4_VERSION,
                "quack": compat.QUACK_VERSION, "dsl": compat.dsl_version(), "flavour": compat.cuda_flavour(),
                "backend": _source_identity(), "format": BUILD_FORMAT}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _dir(root: Path, desc: BwdDesc) -> tuple[str, Path]:
    key = build_key(desc)
    return key, root / "cute-attention-bwd" / key[:2] / key


_WHAT = "attention backward kernel"


def _grouped(desc: BwdDesc, builds):
    """One AttnBuild of a per-call GQA group's per-group builds (attention._grouped): each group's
    kernels in a box G = that group, so the runtime launches the call's group's sequence."""
    from . import attention
    one_box = [dataclasses.replace(b, variants=tuple(dataclasses.replace(v, select=({},)) for v in b.variants))
               for b in builds]
    return attention._grouped(desc, one_box, config_items(desc))


def lookup(desc: BwdDesc, cache_root: Path | None):
    """The cached build (an attention.AttnBuild), or None; never imports the DSL or FA4."""
    from . import attention
    if not desc.group:
        builds = [lookup(one, cache_root) for one in attention._per_group(desc, _WHAT)]
        return None if any(b is None for b in builds) else _grouped(desc, builds)
    if cache_root is None:
        return None
    key, d = _dir(Path(cache_root), desc)
    meta = attention._read(d, BUILD_FORMAT)
    return None if meta is None else attention._result(desc, [(key, d, meta)], 0.0, True, config_items(desc))


def build(desc: BwdDesc, cache_root: Path | None):
    """The kernels of desc on desc.arch (cached by content): an attention.AttnBuild whose variants
    are desc.steps in order."""
    from . import attention, compat
    why = compat.fa4_available()
    if why:
        raise KspecError(f"attention backward kernel {desc.name} on {desc.arch}: {why}")
    if not desc.group:
        return _grouped(desc, [build(one, cache_root) for one in attention._per_group(desc, _WHAT)])
    root = Path(cache_root if cache_root is not None else tempfile.mkdtemp(prefix="kspec-attn-bwd-"))
    t0 = time.monotonic()
    key, d = _dir(root, desc)
    meta = attention._read(d, BUILD_FORMAT)
    cached = meta is not None
    if meta is None:
        meta = _build(desc, key, d)
    return attention._result(desc, [(key, d, meta)], time.monotonic() - t0, cached, config_items(desc))


def _build(desc: BwdDesc, key: str, d: Path) -> dict:
    from .. import cache as cache_entry
    from . import attention, compat
    from .build import _sha, check_header, compile_export, link_host
    root = d.parent.parent
    cache_entry.reclaim_once(root)
    with cache_entry.workdir(root, f".{key[:12]}.") as work:
        (work / "entry.py").write_text(entry_source(desc))
        variants = []
        with compat.fa4_target(desc.arch, desc.sm_count):
            mod = attention._import_entry(work / "entry.py")
            cap = capture(desc, mod)
            for step, fa in zip(desc.steps, cap.objects):
                setattr(mod, _OBJECTS[step], fa)
            try:
                for k, (step, fa) in enumerate(zip(desc.steps, cap.objects)):
                    vd = work / f"v{k}"
                    vd.mkdir()
                    ptxas = getattr(fa, "ptxas_options", "")
                    with attention._sm_count_reads() as reads:
                        entry, offs, sizes, _ptx, seconds = compile_export(
                            vd, getattr(mod, f"kspec_{step}"), _fake_args(desc, step), desc.arch,
                            f"FlashAttention-4 attention backward {desc.name} ({step})",
                            f" --ptxas-options '{ptxas}'" if ptxas else "")
                    if reads:
                        # FA4's backward schedulers are not persistent: nothing SKU-specific is baked in
                        raise KspecInternalError(f"FlashAttention-4's backward ({step}) asked the SM count while "
                                                 "tracing; kspec builds it once for every SKU")
                    gts = _glue_tensors(desc, step)
                    ciface = check_header((vd / "kernel.h").read_text(), gts,
                                          [f"{'float' if t == 'Float32' else 'int32_t'} {v}"
                                           for v, t in _values(desc, step)], trailing=[])
                    (vd / "glue.c").write_text(_glue(desc, step, ciface, entry, offs, sizes, cap))
                    link_host(vd / "kernel.o", vd / "glue.c", vd / "kernel.so", vd / "link.log")
                    (vd / "kernel.o").unlink(missing_ok=True)
                    cfg = [["variant", str(k)], ["role", step], ["fa4_class", type(fa).__name__],
                           ["tile", f"{fa.tile_m}x{getattr(fa, 'tile_n', getattr(fa, 'tile_hdim', getattr(fa, 'head_dim_padded', '?')))}"],
                           *cap.config(),
                           ["packed", desc.packed],
                           ["seqused", desc.seqused],
                           *([["2cta", str(bool(fa.use_2cta_instrs)).lower()]]
                             if hasattr(fa, "use_2cta_instrs") else []),
                           ["fa4_signature", hashlib.sha256(cap.signature.encode()).hexdigest()[:16]]]
                    variants.append({"dir": f"v{k}", "symbol": entry, "param_offsets": list(offs),
                                     "compile_seconds": seconds, "sm_independent": True, "select": [],
                                     "config": cfg, "sha256": {f: _sha(vd / f) for f in ("kernel.cubin",
                                                                                         "kernel.so")}})
            finally:
                for step in desc.steps:
                    setattr(mod, _OBJECTS[step], None)
        meta = {"format": BUILD_FORMAT, "key": key, "arch": desc.arch, "variants": variants}
        shutil.rmtree(work / "__pycache__", ignore_errors=True)
        cache_entry.seal(work, meta)
        return cache_entry.install(work, d, BUILD_FORMAT)
