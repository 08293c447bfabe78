"""Split-KV decoding for FlashAttention-4 attention kernels (backends/cute/attention.py): the key
range of each (sequence, K/V head, query tile) is cut into `num_splits` parts computed by separate
CTAs, each writing an f32 partial output and its log-sum-exp into the call's workspace; FA4's
combine kernel (flash_fwd_combine.FlashAttentionForwardCombine) then merges them into O (and the
spec's LSE).  Decoding (a few query rows per K/V head against long caches) otherwise launches one
CTA per (sequence, K/V head): B = 1 with 8 K/V heads occupies 8 of an H200's 132 SMs.

    split_unsupported(desc) -> reason | None    why a kernel gets no split variant
    num_splits(...) -> int                      the chooser (FlashAttention-4's own heuristic)
    chooser_c(dv, pack_gqa, override) -> str    the same function in C, in both kernels' host glue
    partial_bytes(...) / workspace_lines(...)   the partial buffers: [NS, B, S, H, dv] f32 O, then
                                                [NS, B, H, S] f32 LSE, 256-byte aligned
    combine_source / build_combine              the combine kernel through kspec's export path

**The chooser** is FA4 4.0.0b36's (`interface._get_fwd_config` with num_splits < 1, then
`num_splits_heuristic`), evaluated per call with the device's own SM count: with R = S * G query
rows per K/V head when queries are packed (pack-GQA) and S otherwise, the number of query tiles is
`B * HK * (1 if packed else G) * ceil(R / (q_stage * 128))`, the key blocks `ceil(T / 128)`; no split
when there are at most 4 key blocks, else `min(SMs // tiles, 128, key blocks)` (at least 1).  A
tuning-database winner with a `num_splits` item (`kspec tune`, applied by `kspec compile
--tuning-db`) fixes the count instead, clamped to [1, min(128, key blocks)].  The glue of both
kernels evaluates the same C function, so the split kernel and the combine agree on the count and on
the workspace; the runtime takes the split variant exactly when its glue asks for a workspace (a
count above 1), and the size-bucketed single-pass variants otherwise.

**Not split** (the single-pass variants serve every call): self-attention (the key extent is the
query extent, so no call is decode-shaped), sm90a (FA4 b36 has no split-KV forward
on Hopper: `_flash_attn_fwd` asserts "SplitKV not supported on SM 9.0" and FlashAttentionForwardSm90
takes no is_split_kv), packed queries (FA4 splits those with a scheduler-metadata kernel of its
own), sliding windows (FA4's count reads the window sizes, which are launch-time values here),
head dims that differ (FA4 retiles them) or a V head dim of 192 or more (FA4: "SplitKV is not
supported for hdim_v >= 192 except 256"; kspec stays within the 128-wide epilogue).
"""
from __future__ import annotations

from pathlib import Path

from kspec.core import KspecInternalError

MAX_SPLITS = 128            # FA4's max_splits in num_splits_heuristic
LOG_MAX_SPLITS = 7          # the combine kernel is built for up to 2^7 = 128 splits
TILE_M = TILE_N = 128       # FA4's sm100 forward tile (q rows x keys)
ALIGN = 256                 # workspace sub-buffer alignment
SM90_REASON = ("FlashAttention-4 4.0.0b36 has no split-KV forward on sm90a (its interface asserts "
               "\"SplitKV not supported on SM 9.0\"; FlashAttentionForwardSm90 takes no is_split_kv)")


def split_unsupported(desc) -> str | None:
    """Why desc gets no split-KV variant (None: it gets one, with the combine kernel)."""
    if desc.arch == "sm90a":
        return SM90_REASON
    if desc.self_attention:
        return "self-attention (the keys are the queries, T = S): no call is decode-shaped"
    if desc.dtype == "f8e4m3":
        return "FP8 attention: kspec builds FlashAttention-4's FP8 forward unsplit"
    if desc.cu_seqlens_q:
        return "packed (varlen) queries: FlashAttention-4 splits those with a scheduler-metadata kernel of its own"
    if desc.mods.window is not None:
        return "a sliding window: FlashAttention-4's split count reads the window sizes, launch-time values here"
    if desc.head_dim != desc.head_dim_v:
        return f"head dims ({desc.head_dim}, {desc.head_dim_v}) differ: FlashAttention-4 retiles those for split-KV"
    if desc.head_dim_v >= 192:
        return f"V head dim {desc.head_dim_v}: kspec's split-KV epilogue is the 128-wide one (FA4: below 192)"
    return None


def num_splits(B: int, H: int, S: int, T: int, HK: int, sm_count: int, *, head_dim_v: int = 128,
               pack_gqa: bool | None = None, override: int = 0) -> int:
    """How many parts the key range of a call is split into (1: no split); see the module doc.
    pack_gqa: whether the kernel packs the G = H / HK query heads of a K/V head into its tile rows
    (FA4's default: G > 1).  The same function as chooser_c's C."""
    HK = max(HK, 1)
    group = max(H // HK, 1)
    pack = group > 1 if pack_gqa is None else (pack_gqa and group > 1)
    blocks_n = -(-max(T, 0) // TILE_N)
    if override > 0:
        return max(1, min(override, MAX_SPLITS, blocks_n))
    rows = S * (group if pack else 1)
    q_stage = heuristic_q_stage(S, group, pack, head_dim_v)
    tiles = B * HK * (1 if pack else group) * -(-rows // (q_stage * TILE_M))
    if blocks_n <= 4 or tiles == 0:
        return 1
    return max(1, min(sm_count // tiles, MAX_SPLITS, blocks_n))


def heuristic_q_stage(S: int, group: int, pack_gqa: bool, head_dim_v: int) -> int:
    """FA4's sm100 q_stage for a call (interface._get_fwd_config): 2 when the packed query rows
    exceed one tile (and dv != 256)."""
    return 2 if S * (group if pack_gqa else 1) > TILE_M and head_dim_v != 256 else 1


def partial_bytes(NS: int, B: int, H: int, S: int, dv: int) -> tuple[int, int, int]:
    """(bytes of the O partials, offset of the LSE partials, total workspace bytes)."""
    o = NS * B * S * H * dv * 4
    off = -(-o // ALIGN) * ALIGN
    return o, off, off + -(-(NS * B * H * S * 4) // ALIGN) * ALIGN


def chooser_c(dv: int, pack_gqa: bool, override: int) -> str:
    """num_splits as a C function of the ABI dims and the device's SM count: FA4's q_stage rule per
    call (what FA4 itself would count), the pack-GQA and group of the built kernel."""
    return "\n".join([
        "static int64_t ks_num_splits(int64_t B, int64_t H, int64_t S, int64_t T, int64_t HK, int32_t sm_count) {",
        "    if (HK < 1) HK = 1;",
        "    int64_t group = H / HK; if (group < 1) group = 1;",
        "    int64_t blocks_n = (T + %d - 1) / %d;" % (TILE_N, TILE_N),
        *([f"    int64_t ns = {override};",
           f"    if (ns > {MAX_SPLITS}) ns = {MAX_SPLITS};",
           "    if (ns > blocks_n) ns = blocks_n;",
           "    return ns < 1 ? 1 : ns;"] if override > 0 else [
            f"    int pack = {1 if pack_gqa else 0} && group > 1;",
            "    int64_t rows = S * (pack ? group : 1);",
            f"    int64_t q_stage = rows > {TILE_M}{' && 0' if dv == 256 else ''} ? 2 : 1;",
            f"    int64_t tiles = B * HK * (pack ? 1 : group) * ((rows + q_stage * {TILE_M} - 1) / (q_stage * {TILE_M}));",
            "    if (blocks_n <= 4 || tiles == 0) return 1;",
            "    int64_t ns = (int64_t)sm_count / tiles;",
            f"    if (ns > {MAX_SPLITS}) ns = {MAX_SPLITS};",
            "    if (ns > blocks_n) ns = blocks_n;",
            "    return ns < 1 ? 1 : ns;"]),
        "}",
    ])


def workspace_lines(dims: tuple[str, ...], dv: int) -> list[str]:
    """The body of kspec_workspace_size for a split kernel or its combine: the partial buffers for
    the chosen count, 0 when the call does not split (the runtime then takes another variant)."""
    decl = [f"    const int64_t {r} = dims[{k}]; (void){r};" for k, r in enumerate(dims)]
    return decl + [
        "    (void)device; (void)err; (void)err_cap;",
        "    *bytes = 0;",
        "    if (B <= 0 || H <= 0 || S <= 0 || T <= 0 || HK < 1) return 0;",
        "    int64_t NS = ks_num_splits(B, H, S, T, HK, sm_count);",
        "    if (NS <= 1) return 0;",
        f"    uint64_t o = (uint64_t)NS * B * S * H * {dv} * 4;",
        f"    uint64_t off = (o + {ALIGN - 1}) / {ALIGN} * {ALIGN};",
        f"    *bytes = off + ((uint64_t)NS * B * H * S * 4 + {ALIGN - 1}) / {ALIGN} * {ALIGN};",
        "    return 0;",
    ]


def prepare_lines(dv: int) -> list[str]:
    """Lines of kspec_prepare (after the size checks) fixing NS and the partial buffers' addresses."""
    return [
        "    const int64_t NS = ks_num_splits(B, H, S, T, HK, sm_count);",
        "    if (NS <= 1) KS_FAIL(\"split-KV kernel called for a call that does not split (B=%lld H=%lld S=%lld "
        "T=%lld)\", (long long)B, (long long)H, (long long)S, (long long)T);",
        "    if (workspace == NULL) KS_FAIL(\"split-KV kernel called without its workspace\");",
        f"    const uint64_t ks_lse_off = ((uint64_t)NS * B * S * H * {dv} * 4 + {ALIGN - 1}) / {ALIGN} * {ALIGN};",
        "    void *ks_o_partial = workspace;",
        "    void *ks_lse_partial = (void *)((char *)workspace + ks_lse_off);",
    ]


# ---------------------------------------------------------------------------------------------
# the combine kernel (FA4's FlashAttentionForwardCombine, exported by kspec)
# ---------------------------------------------------------------------------------------------

def combine_params(dv: int) -> tuple[int, int]:
    """(tile_m, k_block_size) as FA4's _flash_attn_fwd_combine picks them for head dim dv."""
    k_block = 64 if dv <= 64 else 128
    return (8 if k_block % 128 == 0 else 16 if k_block % 64 == 0 else 32), k_block


def combine_source(desc) -> str:
    params = ["mOP: cute.Tensor", "mLSEP: cute.Tensor", "mO: cute.Tensor"]
    if desc.lse:
        params.append("mLSE: cute.Tensor")
    return "\n".join([
        f'"""Generated by kspec (CuTe DSL backend): FlashAttention-4 split-KV combine for {desc.name} on {desc.arch}."""',
        "import cuda.bindings.driver as cuda",
        "import cutlass",
        "import cutlass.cute as cute",
        "",
        "FA = None   # the FlashAttentionForwardCombine object (set by kspec)",
        "",
        "",
        "@cute.jit",
        f"def kspec_entry({', '.join(params + ['stream: cuda.CUstream'])}):",
        f"    FA(mOP, mLSEP, mO, {'mLSE' if desc.lse else 'None'}, None, None, None, None, None, stream=stream)",
        "",
    ])


def combine_tensors(desc, o_modes, lse_strides) -> list[tuple]:
    """(name, dtype, shape (roles or int literals, innermost last), per-mode stride factors (() = a
    static unit stride), data C expression) of the combine's tensors.  o_modes: FA4's view of kspec's
    O, its (b, s, h) roles and stride factors (attention._modes); lse_strides: the LSE's stride
    factors by role B, H, S."""
    dv = str(desc.head_dim_v)
    out = [("mOP", "f32", ("NS", "B", "S", "H", dv), (("B", "S", "H", dv), ("S", "H", dv), ("H", dv), (dv,), ()),
            "ks_o_partial"),
           # the LSE partials [NS, B, H, S] seen as (NS, B, S, H), as FA4 passes them
           ("mLSEP", "f32", ("NS", "B", "S", "H"), (("B", "H", "S"), ("H", "S"), (), ("S",)), "ks_lse_partial"),
           ("mO", desc.dtype, (*o_modes[0], dv), (*o_modes[1], ()), "ptrs[3]")]
    if desc.lse:
        out.append(("mLSE", "f32", ("B", "S", "H"), tuple(lse_strides[r] for r in ("B", "S", "H")), "ptrs[4]"))
    return out


def fake_args(tensors) -> list:
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from kspec.core import dtype_bytes

    from .dslops import dsl_type
    syms: dict[str, object] = {}
    out = []
    for name, dt, shape, strides, _data in tensors:
        el = dtype_bytes(dt)
        vec = name in ("mOP", "mO")          # 16-byte rows: FA4's assumed alignment of O and its partials
        shp = []
        for r in shape:
            if r not in syms:
                syms[r] = int(r) if r.isdigit() else cute.sym_int32()
            shp.append(syms[r])
        stride = tuple(1 if not f else cute.sym_int64(divisibility=max(16 // el, 1) if vec else 1) for f in strides)
        out.append(make_fake_tensor(dsl_type(dt), tuple(shp), stride=stride, assumed_align=16 if vec else el))
    return out


def glue_tensors(tensors) -> list:
    from .build import GlueTensor
    return [GlueTensor(name, k, tuple(r for r in shape if not r.isdigit()), tuple(f for f in strides if f), data)
            for k, (name, _dt, shape, strides, data) in enumerate(tensors)]


def build_combine(work: Path, desc, o_modes, lse_strides, checks: list[str], smem_optin: int,
                  helpers: str = "") -> dict:
    """Compile, export and link the combine kernel of desc into `work` (kernel.cubin, kernel.so):
    the build record (symbol, param_offsets, compile_seconds).  Runs under compat.fa4_target."""
    import importlib.util
    import shutil
    import sys

    import cutlass
    from flash_attn.cute.flash_fwd_combine import FlashAttentionForwardCombine

    from .build import capture_glue, check_header, compile_export, link_host
    from .dslops import dsl_type
    dv = desc.head_dim_v
    tile_m, k_block = combine_params(dv)
    # num_head only sizes FA4's varlen scheduler (packed queries, which kspec does not split): unused
    fa = FlashAttentionForwardCombine(dtype=dsl_type(desc.dtype), dtype_partial=cutlass.Float32, head_dim=dv,
                                      num_head=1, tile_m=tile_m, k_block_size=k_block,
                                      log_max_splits=LOG_MAX_SPLITS)
    if not fa.can_implement(dsl_type(desc.dtype), cutlass.Float32, dv, tile_m, k_block, LOG_MAX_SPLITS, 256):
        raise KspecInternalError(f"FlashAttention-4's combine kernel cannot be built for head dim {dv}")
    (work / "combine.py").write_text(combine_source(desc))
    name = "kspec_fa4_combine_" + "".join(c if c.isalnum() else "_" for c in work.parent.name + work.name)
    spec = importlib.util.spec_from_file_location(name, work / "combine.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    tensors = combine_tensors(desc, o_modes, lse_strides)
    mod.FA = fa
    try:
        entry, offs, sizes, _ptx, seconds = compile_export(work, mod.kspec_entry, fake_args(tensors), desc.arch,
                                                           f"FlashAttention-4's combine kernel for {desc.name}")
    finally:
        mod.FA = None
    gts = glue_tensors(tensors)
    ciface = check_header((work / "kernel.h").read_text(), gts, [], trailing=[])
    glue = capture_glue(gts, checks, [], [], ciface, entry, offs, sizes, smem_optin,
                        what="FlashAttention-4 combine", workspace=workspace_lines(desc.dims, dv), helpers=helpers)
    (work / "glue.c").write_text(glue)
    link_host(work / "kernel.o", work / "glue.c", work / "kernel.so", work / "link.log")
    (work / "kernel.o").unlink(missing_ok=True)
    for junk in ("combine.py", "__pycache__"):
        p = work / junk
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return {"symbol": entry, "param_offsets": list(offs), "compile_seconds": seconds, "sm_independent": True}
