"""GEMM descriptors -> CuTe DSL kernels: capability checks, configurations, and the generated entry module.

    can_implement(desc, arch) -> None | reason
    candidates(desc, arch)    -> every configuration this backend would accept (autotuning list)
    default_config(desc, arch, dims=None) -> the heuristic's choice
    entry_source(desc, arch, config) -> the Python module `build.py` traces with `cute.compile`
    tensor_abi(desc)          -> how each tensor argument is described to the DSL and filled by the glue

Conventions (backends/desc.py): A is [M, K] ("row" = K contiguous), B is [K, N] ("row" = N
contiguous), D is [M, N]; batched adds a leading L.  The DSL kernels see A as (M, K, L), B as
(N, K, L), D and full epilogue inputs as (M, N, L): every extent and non-unit stride is a runtime
value, so one binary serves every problem size.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from kspec.backends.api import MAX_CLUSTER_CTAS, SettingProblem
from kspec.backends.desc import GemmDesc
from kspec.compiler.kir import VECTOR_AXIS, Load, epi_nodes
from kspec.core import DTYPE_TABLE, FP8_DTYPES, dtype_bytes

from . import epilogue, sync

ARCHS = ("sm90a", "sm100a")
TMA_ALIGN_BYTES = 16
_FLOAT16 = ("f16", "bf16")
_D_DTYPES = ("f16", "bf16", "f32", "i32")


@dataclass(frozen=True)
class CuteConfig:
    """tile: (M, N) CTA tile on sm90a, UMMA tile on sm100a (two CTAs' worth with use_2cta);
    cluster: (M, N) CTAs per cluster; stages: cap on the A/B shared-memory ring (None = as many as fit)."""
    tile: tuple[int, int]
    cluster: tuple[int, int] = (1, 1)
    use_2cta: bool = False
    stages: int | None = None

    def describe(self) -> str:
        s = f"tile={self.tile[0]}x{self.tile[1]} cluster={self.cluster[0]}x{self.cluster[1]}"
        if self.use_2cta:
            s += " 2cta"
        if self.stages:
            s += f" stages<={self.stages}"
        return s

    def as_dict(self) -> dict[str, str]:
        return {"backend": "cute", "tile": f"{self.tile[0]}x{self.tile[1]}",
                "cluster": f"{self.cluster[0]}x{self.cluster[1]}", "2cta": str(self.use_2cta).lower(),
                "stages": str(self.stages or "auto")}


def can_implement(desc: GemmDesc, arch: str) -> str | None:
    """None when this backend can build `desc` for `arch`, else the reason (for fallback reports)."""
    from . import compat
    if arch not in ARCHS:
        return f"arch {arch} is not supported by the CuTe DSL backend (supported: {', '.join(ARCHS)})"
    why = compat.available()
    if why:
        return why
    a, b = desc.a.dtype, desc.b.dtype
    if desc.b2 is not None and (desc.b2.dtype, desc.b2.layout) != (b, desc.b.layout):
        return f"dual GEMM B operands of different dtypes or layouts ({b} {desc.b.layout}, {desc.b2.dtype} {desc.b2.layout})"
    if a in _FLOAT16 or a == "tf32":
        if a != b:
            return f"mixed operand dtypes {a} x {b}"
    elif a in FP8_DTYPES:
        if b not in FP8_DTYPES:
            return f"mixed operand dtypes {a} x {b}"
    elif a == "i8":
        if b != "i8":
            return f"mixed operand dtypes {a} x {b}"
    elif a in FP4_DTYPES or b in FP4_DTYPES:
        if mx_kind(desc) is None:
            return (f"{a} x {b} operands: FP4 data is read by the block-scaled MMA only (MXFP4: f8e8m0 scales "
                    "per 32 values of K; NVFP4: f8e4m3 scales per 16), per row of A and column of B")
    else:
        return f"operand dtype {a} is not supported by the CuTe DSL backend"
    if (a == "i8") != (desc.acc_dtype == "i32"):
        return f"accumulator {desc.acc_dtype} with {a} operands"
    if arch == "sm90a":
        if (a in FP8_DTYPES or a in ("i8", "tf32")) and (desc.a.layout != "row" or desc.b.layout != "col"):
            # PTX wgmma transposes (MN-major operands) only 16-bit types
            return (f"{a} WGMMA on sm90a needs K-major operands (A row-major, B column-major); "
                    f"got A {desc.a.layout} / B {desc.b.layout}")
    if desc.scales:
        why = _block_scale_problem(desc, arch)
        if why:
            return why
    if desc.grouped and (desc.a.dtype not in _FLOAT16 + FP8_DTYPES or desc.acc_dtype != "f32"):
        return f"the grouped GEMM takes f16, bf16 or fp8 operands (got {desc.a.dtype})"
    if desc.output.dtype not in _D_DTYPES:
        return f"output dtype {desc.output.dtype} is not supported by the CuTe DSL backend"
    if desc.output.dtype == "i32" and desc.acc_dtype != "i32":
        return f"output dtype {desc.output.dtype} with accumulator {desc.acc_dtype}"
    for e in (x for st in (desc.output, *desc.aux_stores, *desc.reductions) for x in epilogue._walk(st.value)):
        if isinstance(e, epilogue.Load) and e.kind != "scalar" and e.dtype not in ("f16", "bf16", "f32", "i32", "i8"):
            return f"epilogue input dtype {e.dtype}"
    why = epilogue.unsupported(desc)
    if why:
        return why
    if not candidates(desc, arch):
        # every tile leaves fewer than two A/B stages beside this epilogue's shared memory
        small = CuteConfig((64, 64))
        return f"no CuTe DSL tile fits: at {small.describe()}, {smem_budget(desc, arch, small).problem()}"
    return None


def unvalidated(desc: GemmDesc, arch: str) -> str | None:
    """Why a GEMM this backend can build is one nothing has validated on a GPU (None: it is not);
    the planner then builds it here only when asked (registry.opt_in_reason)."""
    a, b = desc.a.dtype, desc.b.dtype
    if arch == "sm90a" and a == "tf32":
        return ("tf32 WGMMA on sm90a is kspec's own MMA atom (f32 data truncated to tf32, not rounded), "
                "not yet validated on any GPU")
    if arch == "sm100a" and a in FP8_DTYPES and b in FP8_DTYPES and a != b:
        return (f"{a} x {b} on tcgen05 (kind::f8f6f4 with mixed kinds, documented as unsupported by NVIDIA's "
                "CuTe DSL example) is not yet validated on any GPU")
    return None


GROUPED_TILE = (128, 128)


def grouped_problem(ir, arch: str) -> str | None:
    """None when a GEMM IR with packed buffers is a grouped GEMM the sm90a grouped kernel builds
    (sm90_grouped.py): A and D packed by one offsets tensor over the GEMM's one batch axis (the
    group), B dense per group, epilogue vectors per group or per packed row (same offsets)."""
    s = ir.gemm
    a, b = ir.buffer(s.a_buffer), ir.buffer(s.b_buffer)
    off = a.packed if s.a_rows is None else ir.buffer(s.a_rows).packed
    if off is None or (s.a_rows is not None and a.packed):
        p = next(x for x in ir.buffers if x.packed)
        return (f"{p.name} is packed({p.packed}); a grouped GEMM packs its A operand (the tokens), or the index "
                "its rows are gathered by, by group")
    if len(s.batch) != 1 or s.m_fold or s.k_fold or b.packed or s.dual or s.scales:
        return f"a grouped GEMM packs A ({s.a_buffer}) by one group axis and reads B per group, dense"
    if (s.a_layout, s.b_layout) != ("row", "col"):
        return f"the grouped GEMM reads K-major A and B (A row-major, B [group, n, k]); got {s.a_layout}/{s.b_layout}"
    stores = ir.epilogue.stores
    if len(stores) != 1 or ir.epilogue.reductions or ir.buffer(stores[0].name).packed != off or \
            stores[0].layout != "row":
        return f"the grouped GEMM stores one row-major output packed({off}), with no reductions"
    for ld in (x for x in epi_nodes(stores[0].value) if isinstance(x, Load)):
        buf = ir.buffer(ld.name)
        if ld.kind == "col_batched" and buf.packed == off:
            continue
        if ld.kind in ("row", "row_batched", "scalar") and buf.packed is None:
            continue
        return (f"epilogue input {ld.name} ({ld.kind}{', packed' if buf.packed else ''}): the grouped GEMM reads "
                f"vectors over n (per group or shared), per-row vectors packed({off}) and scalars")
    return None


# Block-scaled FP8 (blockscale.py): the K tile is the scale block; one CTA tile has one B scale.
BLOCK_SCALED_TILE = (128, 128)


@dataclass(frozen=True)
class MxKind:
    """One block-scaled format tcgen05's block-scaled MMA reads (sm100_mx.py): operand dtypes, the
    scale dtype and how many values along K one scale covers (its `sf_vec`)."""
    name: str
    operands: tuple[str, ...]
    scale: str
    sf_vec: int

    def k_multiple(self) -> int:
        """What K must be a multiple of: the kernel's K tile (128 bytes of an operand row; no K tail)."""
        return k_tile(self.operands[0])


FP4_DTYPES = ("f4e2m1",)
# The block-scaled kinds the sm100a kernel builds, one table (the MMA kind follows from the
# operands: kind::mxf8f6f4 for fp8, kind::mxf4nvf4 for FP4): MXFP8 and MXFP4 (OCP MX, E8M0 scales per
# 32) and NVFP4 (E4M3 scales per 16; its global scale is the epilogue's `alpha *`).
MX_KINDS = (MxKind("MXFP8", FP8_DTYPES, "f8e8m0", 32),
            MxKind("MXFP4", FP4_DTYPES, "f8e8m0", 32),
            MxKind("NVFP4", FP4_DTYPES, "f8e4m3", 16))


def _mx_scales(desc: GemmDesc) -> tuple[str, int] | None:
    """(scale dtype, sf_vec) when desc has one scale per row of A and one per column of B, both of
    one dtype and block along K, row-major [rows, K / block]; None otherwise."""
    if len(desc.scales) != 2 or {sc.operand for sc in desc.scales} != {"a", "b"}:
        return None
    keys = {(sc.dtype, sc.block_k, sc.block_mn, sc.order) for sc in desc.scales}
    if len(keys) != 1:
        return None
    (dtype, block_k, block_mn, order), = keys
    if block_mn != 1 or order != "mk" or not any((k.scale, k.sf_vec) == (dtype, block_k) for k in MX_KINDS):
        return None
    return dtype, block_k


def mx_kind(desc: GemmDesc) -> MxKind | None:
    """The MX_KINDS entry desc is (scales and operands), or None."""
    sc = _mx_scales(desc)
    if sc is None:
        return None
    for k in MX_KINDS:
        if (k.scale, k.sf_vec) == sc and desc.a.dtype in k.operands and desc.b.dtype in k.operands:
            return k
    return None


def is_mx(desc: GemmDesc) -> bool:
    """Block scales per row of A and column of B at one of MX_KINDS' (scale dtype, block): tcgen05's
    block-scaled MMA on sm100a (sm100_mx.py), whatever the operands (mx_kind says if they fit)."""
    return _mx_scales(desc) is not None


def _block_scale_problem(desc: GemmDesc, arch: str) -> str | None:
    if is_mx(desc):
        sc = _mx_scales(desc)
        if arch != "sm100a":
            return (f"block-scaled GEMMs with {sc[0]} scales per {sc[1]} values use tcgen05's block-scaled MMA: "
                    "sm100a only")
        kind = mx_kind(desc)
        if kind is None:
            fits = [f"{k.name} ({'/'.join(k.operands)} data)" for k in MX_KINDS if (k.scale, k.sf_vec) == sc]
            return (f"operands {desc.a.dtype} x {desc.b.dtype} with {sc[0]} scales per {sc[1]}: the sm100a "
                    f"block-scaled kernel takes {' or '.join(fits)}")
        if (desc.a.layout, desc.b.layout) != ("row", "col") or desc.batched or desc.b2 is not None:
            return f"the {kind.name} kernel reads K-major A and B, not batched"
        if desc.acc_dtype != "f32":
            return f"the {kind.name} kernel accumulates in f32 (got {desc.acc_dtype})"
        return None
    a = desc.a.dtype
    if a not in FP8_DTYPES or desc.b.dtype not in FP8_DTYPES or desc.acc_dtype != "f32":
        return f"block-scaled GEMMs take fp8 operands (got {a} x {desc.b.dtype})"
    if desc.b2 is not None or desc.batched:
        return "block-scaled dual or batched GEMMs are not implemented"
    if len({sc.operand for sc in desc.scales}) != len(desc.scales):
        return "more than one block scale of one operand"
    for sc in desc.scales:
        if sc.dtype != "f32":
            return f"block scale {sc.buffer} is {sc.dtype}; the sm90a block-scaled GEMM reads f32 scales"
        if sc.block_k != k_tile(a):
            return f"blocks of {sc.block_k} along K (the sm90a kernel's K tile, and so its scale block, is {k_tile(a)})"
        if sc.operand == "a" and sc.block_mn not in (1, 128):
            return f"A's scales cover {sc.block_mn} rows (1 or 128)"
        if sc.operand == "b" and sc.block_mn % BLOCK_SCALED_TILE[1]:
            return (f"B's scales cover {sc.block_mn} columns: one scale per CTA tile needs a multiple of "
                    f"{BLOCK_SCALED_TILE[1]}")
    return None


def candidates(desc: GemmDesc, arch: str) -> list[CuteConfig]:
    """The configurations worth trying for autotuning (all compile; which is fastest needs a GPU)."""
    if desc.grouped:
        return [c for c in (CuteConfig((64, 128)), CuteConfig((128, 128)), CuteConfig((128, 256)))
                if valid_config(c, arch, desc=desc) is None]
    if desc.scales:            # (the sm100a block-scaled kernel runs 1x1 clusters)
        cls = ((1, 1),) if arch == "sm100a" else ((1, 1), (2, 1), (1, 2))
        return [c for c in (CuteConfig(BLOCK_SCALED_TILE, cl) for cl in cls) if valid_config(c, arch, desc=desc) is None]
    return [c for c in _candidates(arch) if valid_config(c, arch, desc=desc) is None]


def _bits(dtype: str) -> int:
    return DTYPE_TABLE[dtype].bits


@functools.lru_cache(maxsize=512)
def _input_classes(desc: GemmDesc) -> tuple[tuple[str, int], ...]:
    """(class, bits) of each tensor input of the generated epilogue, in the kernel's order."""
    code = epilogue.generate(desc)
    return tuple(("row" if ld.kind in epilogue.ROW_KINDS else "col" if ld.kind in epilogue.COL_KINDS else "full",
                  _bits(ld.dtype)) for ld in code.inputs)


def smem_budget(desc: GemmDesc, arch: str, cfg: CuteConfig) -> "sync.SmemBudget":
    """The shared-memory split (and A/B stage count) the kernel would get for `desc` with `cfg`:
    the same function the kernels' `_setup` calls (sync.smem_budget), from the descriptor."""
    inputs = _input_classes(desc)
    return sync.smem_budget(arch, cfg.tile, use_2cta=cfg.use_2cta, a_bits=_bits(desc.a.dtype),
                            b_bits=_bits(desc.b.dtype), d_bits=_bits(desc.output.dtype),
                            d_m_major=desc.output.layout == "col", dual=desc.b2 is not None,
                            num_aux=len(desc.aux_stores), inputs=inputs,
                            reductions=tuple("n" if r.axis == "mn" else r.axis for r in desc.reductions),
                            override=cfg.stages)


def _candidates(arch: str) -> list[CuteConfig]:
    out: list[CuteConfig] = []
    if arch == "sm90a":
        for tm in (64, 128):
            for tn in (64, 128, 256):
                if tm == 64 and tn == 256:
                    continue
                for cl in ((1, 1), (2, 1), (1, 2)):
                    out.append(CuteConfig((tm, tn), cl))
    else:
        for tm in (64, 128):
            for tn in (64, 128, 256):
                for cl in ((1, 1), (2, 1)):
                    out.append(CuteConfig((tm, tn), cl))
        for tn in (128, 256):
            for cl in ((2, 1), (4, 1)):
                out.append(CuteConfig((256, tn), cl, use_2cta=True))
    return out


# A dual GEMM keeps two accumulators: on sm90a both in registers (at most 128 per thread for the
# pair), on sm100a both double-buffered in tensor memory (2 stages x 2 x N columns <= 512): N <= 128.
DUAL_MAX_TILE_N = 128


def valid_config(cfg: CuteConfig, arch: str, dual: bool = False, desc: GemmDesc | None = None) -> str | None:
    """None when the kernels accept `cfg` on `arch` (for a dual GEMM: `dual`), else why not.
    With `desc`, also that the A/B ring keeps sync.MIN_AB_STAGES stages beside its epilogue."""
    p = config_problem(cfg, arch, dual, desc)
    return p.reason if p else None


def config_problem(cfg: CuteConfig, arch: str, dual: bool = False, desc: GemmDesc | None = None) -> SettingProblem | None:
    """valid_config, saying which schedule setting (tile, cluster, stages) is the one at fault."""
    if desc is not None:
        dual = desc.b2 is not None
    p = _shape_problem(cfg, arch, dual)
    if p is None and desc is not None:
        why = smem_budget(desc, arch, cfg).problem()
        if why:
            return SettingProblem("tile", f"tile {cfg.tile[0]}x{cfg.tile[1]}: {why}")
    return p


def _shape_problem(cfg: CuteConfig, arch: str, dual: bool) -> SettingProblem | None:
    (tm, tn), (cm, cn) = cfg.tile, cfg.cluster
    if dual and tn > DUAL_MAX_TILE_N:
        return SettingProblem("tile", f"tile N {tn} (a dual GEMM's two accumulators need tile N <= {DUAL_MAX_TILE_N})")
    pow2 = lambda x: x > 0 and x & (x - 1) == 0          # noqa: E731
    if not (pow2(cm) and pow2(cn)) or cm * cn > MAX_CLUSTER_CTAS:
        return SettingProblem("cluster", f"cluster {cm}x{cn} (powers of two, at most {MAX_CLUSTER_CTAS} CTAs: "
                                         "kspec launches portable cluster sizes only)")
    if cfg.stages is not None and cfg.stages < 2:
        return SettingProblem("stages", "stages must be at least 2")
    if arch == "sm90a":
        if cfg.use_2cta:
            return SettingProblem("tile", "2-CTA MMA is a sm100a feature")
        if tm not in (64, 128) or tn not in (64, 128, 192, 256):
            return SettingProblem("tile", f"tile {tm}x{tn} (M 64 or 128; N 64, 128, 192 or 256)")
        return None
    if cfg.use_2cta:
        if tm != 256 or cm % 2:
            # (128-row 2-CTA tiles, 64-row CTAs, are left out: their epilogue's strided N sub-tile
            # has never been checked against its shared-memory buffer)
            return SettingProblem("cluster" if tm == 256 else "tile",
                                  f"2-CTA tile {tm}x{tn} with cluster {cm}x{cn} (M 256, even cluster M)")
    elif tm not in (64, 128):
        return SettingProblem("tile", f"tile {tm}x{tn} (M 64 or 128, or 256 with 2-CTA MMA)")
    if tn % 32 or not 32 <= tn <= 256:
        return SettingProblem("tile", f"tile N {tn} (a multiple of 32 up to 256)")
    return None


def k_tile(dtype: str) -> int:
    """The K extent of every CTA tile: four MMA instructions' K, 128 bytes of each operand row
    (256 values of a 4-bit dtype)."""
    return sync.k_tile(_bits(dtype))


def hint_config(desc: GemmDesc, arch: str, dims: dict[str, int] | None = None) -> CuteConfig:
    """The configuration a schedule hint (desc.tile/cluster/stages) asks for (K is the kernel's own);
    what the hint leaves out (a hint of only a cluster or a stage count) is the heuristic's."""
    if desc.tile is None:
        base = default_config(desc, arch, dims)
        cl = (desc.cluster[0], desc.cluster[1]) if desc.cluster else base.cluster
        return CuteConfig(base.tile, cl, base.use_2cta, desc.stages)
    tm, tn = desc.tile[0], desc.tile[1]
    cl = (desc.cluster[0], desc.cluster[1]) if desc.cluster else (1, 1)
    two = arch == "sm100a" and tm == 256
    return CuteConfig((tm, tn), cl, two, desc.stages)


def default_config(desc: GemmDesc, arch: str, dims: dict[str, int] | None = None) -> CuteConfig:
    """Heuristic: the planner's tile hint where the kernels accept it, else big tiles (and 2-CTA UMMA
    on sm100a) for big problems, 128x128 otherwise, 64-row tiles for skinny M."""
    dims = dims or {}
    m, n = dims.get("M"), dims.get("N")
    dual = desc.b2 is not None
    if desc.scales:
        return CuteConfig(BLOCK_SCALED_TILE)
    if desc.grouped:
        return CuteConfig(GROUPED_TILE)
    if desc.tile is not None:
        cfg = hint_config(desc, arch)
        if valid_config(cfg, arch, desc=desc) is None:
            return cfg
    cfg = _heuristic(desc, arch, m, n, dual)
    if valid_config(cfg, arch, desc=desc) is None:
        return cfg
    # the epilogue's shared memory leaves too few A/B stages at the heuristic's tile: the largest
    # candidate that keeps them (can_implement has declined a GEMM no tile fits)
    fits = candidates(desc, arch)
    return max(fits, key=lambda c: (c.tile[0] * c.tile[1], -c.cluster[0] * c.cluster[1])) if fits else cfg


def _heuristic(desc: GemmDesc, arch: str, m, n, dual: bool) -> CuteConfig:
    small_m = isinstance(m, int) and m <= 64
    big = isinstance(m, int) and isinstance(n, int) and m >= 4096 and n >= 4096
    if dual:
        if small_m:
            return CuteConfig((64, 128))
        if arch == "sm90a":
            return CuteConfig((128, 128), (2, 1)) if big else CuteConfig((128, 128))
        return CuteConfig((256, 128), (2, 1), True) if big else CuteConfig((128, 128))
    if arch == "sm90a":
        if small_m:
            return CuteConfig((64, 128))
        return CuteConfig((128, 256), (2, 1)) if big else CuteConfig((128, 128))
    if small_m:
        return CuteConfig((64, 128))
    return CuteConfig((256, 256), (2, 1), True) if big else CuteConfig((128, 128))


# ---------------------------------------------------------------------------------------------
# tensor ABI
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorABI:
    """One tensor argument as the DSL sees it.  shape entries are dim roles ("M", "N", "K", "L");
    stride entries are 1 (static unit stride) or a tuple of dim roles whose product is the stride.
    `tma`: the kernel reads/writes it with TMA (16-byte aligned base and strides required).
    `ptr_index`: its position in the ABI's pointer list (`abi_names`), which differs from the
    kernel's parameter order (the ABI is the CUTLASS C++ backend's: A, B, epilogue inputs, D)."""
    name: str
    dtype: str
    shape: tuple[str, ...]
    stride: tuple[object, ...]
    tma: bool
    ptr_index: int = 0
    align: int = 0                 # bytes the base must be aligned to besides TMA's 16 (0: the element)

    @property
    def alignment(self) -> int:
        return 16 if self.tma else max(self.align, dtype_bytes(self.dtype))

    @property
    def dynamic_shapes(self) -> tuple[str, ...]:
        return self.shape

    @property
    def dynamic_strides(self) -> tuple[tuple[str, ...], ...]:
        return tuple(s for s in self.stride if s != 1)

    def leading(self) -> str:
        """The extent of the contiguous mode (its byte size must be 16-byte aligned for TMA)."""
        return self.shape[self.stride.index(1)]


# A gathered A's rows are read in whole 128-byte K tiles by cp.async (no K-tail predication)
GATHER_K_BYTES = 128


def size_multiples(desc: GemmDesc) -> tuple[tuple[str, int], ...]:
    """The size roles whose value the kernel needs to be a multiple of a number
    (EmittedKernel.multiples; the host glue refuses other values too): K of a GEMM whose A rows
    are gathered."""
    kind = mx_kind(desc)
    if kind is not None:
        # the block-scaled kernel has no K tail: whole K tiles (128 for fp8, 256 for FP4 data), so
        # whole scale blocks and whole bytes of packed FP4 rows too
        return (("K", kind.k_multiple()),)
    return (("K", GATHER_K_BYTES // dtype_bytes(desc.a.dtype)),) if desc.a_rows else ()


def _grouped_abi(desc: GemmDesc, code: "epilogue.EpilogueCode") -> list[TensorABI]:
    """A (M = all rows, K), B (N, K, L), the offsets (L + 1), the epilogue vectors, D (M, N): the
    order of abi_names."""
    # (A: TMA rows; gathered A: R rows read by 16-byte cp.async, the same alignment rule)
    out = [TensorABI("a", desc.a.dtype, ("R" if desc.a_rows else "M", "K"), (("K",), 1), True, 0),
           TensorABI("b", desc.b.dtype, ("N", "K", "L"), (("K",), 1, ("K", "N")), True, 1),
           TensorABI("off", "i32", ("(L + 1)",), (1,), False, 2)]
    nb = 3
    if desc.a_rows:
        out.append(TensorABI("rows", "i32", ("M",), (1,), False, 3))
        nb = 4
    for j, ld in enumerate(code.inputs):
        if ld.kind == "col_batched":          # per packed row
            out.append(TensorABI(f"i{j}", ld.dtype, ("M",), (1,), False, nb + j))
        elif ld.kind == "row_batched":
            out.append(TensorABI(f"i{j}", ld.dtype, ("N", "L"), (1, ("N",)), False, nb + j))
        else:
            out.append(TensorABI(f"i{j}", ld.dtype, ("N",), (1,), False, nb + j))
    out.append(TensorABI("d", desc.output.dtype, ("M", "N"), (("N",), 1), True, nb + len(code.inputs)))
    return out


def tensor_abi(desc: GemmDesc, code: "epilogue.EpilogueCode") -> list[TensorABI]:
    if desc.grouped:
        return _grouped_abi(desc, code)
    a_row = desc.a.layout == "row"
    b_row = desc.b.layout == "row"
    d_row = desc.output.layout == "row"
    n_in = len(code.inputs)
    # pointers before the epilogue inputs: A, B (, B2), the block scales
    nb = (2 if desc.b2 is None else 3) + len(desc.scales)
    mx = is_mx(desc)
    d_stride = (("N",), 1, ("M", "N")) if d_row else (1, ("M",), ("M", "N"))
    b_stride = (1, ("N",), ("K", "N")) if b_row else (("K",), 1, ("K", "N"))
    out = [
        TensorABI("a", desc.a.dtype, ("M", "K", "L"), (("K",), 1, ("M", "K")) if a_row else (1, ("M",), ("M", "K")),
                  True, 0),
        TensorABI("b", desc.b.dtype, ("N", "K", "L"), b_stride, True, 1),
        TensorABI("d", desc.output.dtype, ("M", "N", "L"), (("N",), 1, ("M", "N")) if d_row else (1, ("M",), ("M", "N")),
                  True, nb + n_in),
    ]
    if desc.b2 is not None:
        out.insert(2, TensorABI("b2", desc.b2.dtype, ("N", "K", "L"), b_stride, True, 2))
    for j, sc in enumerate(desc.scales):
        # [mn blocks, k blocks] ("mk") or [k blocks, mn blocks], row-major, read element by element
        mn = ("M" if sc.operand == "a" else "N") if sc.block_mn == 1 else \
            f"({'M' if sc.operand == 'a' else 'N'} / {sc.block_mn})"
        kb = f"(K / {sc.block_k})"
        shape = (mn, kb) if sc.order == "mk" else (kb, mn)
        # (MX scales: each row's scales of a K tile by 4-byte cp.asyncs)
        out.append(TensorABI(f"q{j}", sc.dtype, shape, ((shape[1],), 1), False, 2 + (desc.b2 is not None) + j,
                             4 if mx else 0))
    for j, ld in enumerate(code.inputs):
        if ld.kind in ("row", "col"):
            out.append(TensorABI(f"i{j}", ld.dtype, (VECTOR_AXIS[ld.kind].upper(),), (1,), False, nb + j))
        elif ld.kind in ("row_batched", "col_batched"):
            # one vector per batch entry, row-major [L, N] / [L, M]: seen as (N, L) / (M, L)
            dim = VECTOR_AXIS[ld.kind].upper()
            out.append(TensorABI(f"i{j}", ld.dtype, (dim, "L"), (1, (dim,)), False, nb + j))
        else:
            # full inputs are read by TMA, a sub-tile at a time
            out.append(TensorABI(f"i{j}", ld.dtype, ("M", "N", "L"), (("N",), 1, ("M", "N")), True, nb + j))
    for k, st in enumerate(desc.aux_stores):
        out.append(TensorABI(f"x{k}", st.dtype, ("M", "N", "L"), d_stride, True, nb + 1 + n_in + k))
    # reduction outputs: one contiguous vector per batch, (M, L) for a reduction along n, (N, L) along
    # m; a full reduction (along m and n) one value per batch entry, (L,)
    for k, r in enumerate(desc.reductions):
        pos = nb + 1 + n_in + len(desc.aux_stores) + k
        if r.axis == "mn":
            out.append(TensorABI(f"r{k}", r.dtype, ("L",), (1,), False, pos))
            continue
        ext = "M" if r.axis == "n" else "N"
        out.append(TensorABI(f"r{k}", r.dtype, (ext, "L"), (1, (ext,)), False, pos))
    return out


def abi_names(desc: GemmDesc, code: "epilogue.EpilogueCode") -> tuple[str, ...]:
    """Descriptor names of the tensor arguments in ABI order: A, B, the epilogue's tensor inputs in
    first-use order, D, the auxiliary outputs, the reduction outputs -- the same order as the
    CUTLASS C++ backend, so one plan may use either backend per arch under one manifest signature."""
    b2 = (desc.b2.name,) if desc.b2 is not None else ()
    if desc.grouped:
        rows = (desc.a_rows,) if desc.a_rows else ()
        return (desc.a.name, desc.b.name, desc.grouped, *rows, *(l.name for l in code.inputs), desc.output.name)
    return (desc.a.name, desc.b.name, *b2, *(sc.buffer for sc in desc.scales), *(l.name for l in code.inputs),
            desc.output.name,
            *(st.name for st in desc.aux_stores), *(r.name for r in desc.reductions))


# ---------------------------------------------------------------------------------------------
# the generated entry module
# ---------------------------------------------------------------------------------------------

def entry_source(desc: GemmDesc, arch: str, cfg: CuteConfig, code: "epilogue.EpilogueCode") -> str:
    """A self-contained Python module: the epilogue, the kernel object, and `kspec_entry`, the
    `@cute.jit` function that `cute.compile` traces and `export_to_c` exports."""
    from .dslops import _DSL_TYPES
    acc = _DSL_TYPES[desc.acc_dtype]
    kinds = repr(code.input_kinds)
    ns = len(code.scalars)
    dual = ", dual=True" if desc.b2 is not None else ""
    if epilogue.compute_dtype(desc) != desc.acc_dtype:     # a float epilogue on an i32 accumulator
        dual += f", epi_dtype=cutlass.{_DSL_TYPES[epilogue.compute_dtype(desc)]}"
    if desc.scales:
        dual += f", scales={tuple((sc.operand, sc.block_mn, sc.order) for sc in desc.scales)!r}"
    reds = repr(code.reductions)
    if desc.grouped:
        # per-row vectors of a grouped GEMM are packed by its offsets ("col_packed")
        gkinds = tuple("col_packed" if k == "col_batched" else k for k in code.input_kinds)
        cls = "Sm90GroupedGemm" if arch == "sm90a" else "Sm100GroupedGemm"
        gather = ", gather=True" if desc.a_rows else ""
        ctor = f"{cls}(cutlass.{acc}, {cfg.tile!r}, kspec_epilogue, {gkinds!r}, {ns}, {cfg.stages!r}{gather})"
        imp = f"from kspec.backends.cute.{'sm90' if arch == 'sm90a' else 'sm100'}_grouped import {cls}"
    elif desc.scales and arch == "sm100a" and is_mx(desc):
        ctor = (f"Sm100MxGemm(cutlass.{acc}, {cfg.tile!r}, kspec_epilogue, {kinds}, {ns}, {cfg.stages!r}, "
                f"sf_vec={mx_kind(desc).sf_vec})")
        imp = "from kspec.backends.cute.sm100_mx import Sm100MxGemm"
    elif desc.scales and arch == "sm100a":
        scales = tuple((sc.operand, sc.block_mn, sc.order) for sc in desc.scales)
        ctor = (f"Sm100BlockScaledGemm(cutlass.{acc}, {cfg.tile!r}, kspec_epilogue, {kinds}, {ns}, {cfg.stages!r}, "
                f"{scales!r})")
        imp = "from kspec.backends.cute.sm100_blockscaled import Sm100BlockScaledGemm"
    elif arch == "sm90a":
        ctor = (f"Sm90Gemm(cutlass.{acc}, {cfg.tile!r}, {cfg.cluster!r}, kspec_epilogue, {kinds}, {ns}, "
                f"{cfg.stages!r}, {reds}{dual})")
        imp = "from kspec.backends.cute.sm90 import Sm90Gemm"
    else:
        ctor = (f"Sm100Gemm(cutlass.{acc}, {cfg.tile!r}, {cfg.cluster!r}, {cfg.use_2cta!r}, kspec_epilogue, "
                f"{kinds}, {ns}, {cfg.stages!r}, {reds}{dual})")
        imp = "from kspec.backends.cute.sm100 import Sm100Gemm"
    tensors = [f"{t.name}: cute.Tensor" for t in tensor_abi(desc, code)]
    scalars = [f"s{k}: cutlass.Float32" for k in range(ns)]
    params = ", ".join(tensors + scalars + ["max_clusters: cutlass.Int32", "stream: cuda.CUstream"])
    ins = "".join(f"i{j}, " for j in range(len(code.inputs)))
    auxes = "".join(f"x{k}, " for k in range(len(desc.aux_stores)))
    auxes += "".join(f"r{k}, " for k in range(len(desc.reductions)))       # reduction outputs follow
    scs = "".join(f"s{k}, " for k in range(ns))
    b2 = "b2, " if desc.b2 is not None else ""
    qs = "".join(f"q{j}, " for j in range(len(desc.scales)))
    rows = ", rows" if desc.a_rows else ""
    call = (f"    GEMM(a, b, d, off, ({ins}), ({scs}), max_clusters, stream{rows})\n" if desc.grouped else
            f"    GEMM(a, b, d, ({auxes}), ({ins}), ({scs}), max_clusters, stream, ({b2})"
            f"{', (' + qs + ')' if qs else ''})\n")
    return (f'"""Generated by kspec (CuTe DSL backend) for GEMM {desc.name} on {arch}; do not edit."""\n'
            "import cuda.bindings.driver as cuda\n"
            "import cutlass\n"
            "import cutlass.cute as cute\n\n"
            "from kspec.backends.cute import dslops as F\n"
            f"{imp}\n\n\n"
            f"{code.source}\n\n"
            f"GEMM = {ctor}\n\n\n"
            "@cute.jit\n"
            f"def kspec_entry({params}):\n"
            f"{call}")
