"""CUTLASS 3.x GEMM code generation for sm90a (WGMMA) and sm100a (tcgen05): `emit_gemm`.

Owns: checking a `GemmDesc` against what CUTLASS offers on the target arch (dtypes, layouts, the
tile/cluster/stage configurations of CUTLASS's own generator, before any nvcc runs), choosing a
default configuration, and writing the one `.cu` source that backends/ABI.md describes: the kernel
type (CollectiveBuilder mainloop + EVT epilogue), the `kspec_kernel` entry point under
`KSPEC_DEVICE`, and the host glue (`kspec_workspace_size`, `kspec_prepare`) under `KSPEC_HOST`.

The epilogue is translated by `evt.py`; everything that touches cutlass_cppgen's quirks runs inside
`compat.offline(cc)`.  Output is deterministic: the same descriptor gives byte-identical source.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kspec.backends.api import SettingError
from kspec.backends.desc import ARCH_CC, EmittedKernel, GemmDesc
from kspec.core import ABI_VERSION, DTYPE_TABLE, KspecError

from . import compat, evt, tma_hook
from .host_checks import TMA_CHECK
from .host_checks import TMA_HOOK as _TMA_HOOK

OPERAND_DTYPES = ("f16", "bf16", "tf32", "f8e4m3", "f8e5m2")
_FP8 = ("f8e4m3", "f8e5m2")
_BITS = {name: d.bits for name, d in DTYPE_TABLE.items()}
TMA_ALIGNMENT_BYTES = 16

# -DNDEBUG stays: device asserts cost registers, and a host assert would abort the caller's process.
# The host glue checks every status itself (can_implement, initialize_workspace, the driver entry
# point and each TMA descriptor encode; see _TMA_HOOK) and returns it as an error.
BASE_FLAGS = ("-std=c++17", "--expt-relaxed-constexpr", "-O3", "-DNDEBUG",
              "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1", "-DCUTLASS_DEBUG_TRACE_LEVEL=0")


@dataclass(frozen=True)
class GemmConfig:
    """One kernel configuration from CUTLASS's generator list.  `tile` is the tile handed to the
    CollectiveBuilder: the CTA tile on sm90a; the MMA tile on sm100a (two CTAs for 2-SM kernels)."""
    tile: tuple[int, int, int]
    cluster: tuple[int, int, int]
    kernel_schedule: str          # cutlass_library.KernelScheduleType member name
    epilogue_schedule: str        # cutlass_library.EpilogueScheduleType member name
    td: Any = field(default=None, compare=False, hash=False, repr=False)

    @property
    def is_2sm(self) -> bool:
        return "2Sm" in self.kernel_schedule

    def describe(self) -> str:
        t, c = self.tile, self.cluster
        return f"tile={t[0]}x{t[1]}x{t[2]} cluster={c[0]}x{c[1]}x{c[2]} ({self.kernel_schedule})"


# ---------------------------------------------------------------------------------------------
# validation and planning
# ---------------------------------------------------------------------------------------------

def _check_desc(desc: GemmDesc) -> int:
    if desc.arch not in ARCH_CC:
        raise KspecError(f"GEMM '{desc.name}': arch '{desc.arch}' is not supported by the CUTLASS "
                         f"backend (supported: {', '.join(ARCH_CC)})")
    evt.check_ident(desc.name, "kernel")
    evt.check_ident(desc.a.name, "operand")
    evt.check_ident(desc.b.name, "operand")
    for op, role in ((desc.a, "A"), (desc.b, "B")):
        if op.dtype == "f32":
            raise KspecError(f"GEMM '{desc.name}': operand {role} is f32; tensor cores on {desc.arch} "
                             "multiply f32 data as tf32", hint="declare the operands tf32 (f32 storage)")
        if op.dtype not in OPERAND_DTYPES:
            raise KspecError(f"GEMM '{desc.name}': operand {role} dtype {op.dtype} is not supported on "
                             f"{desc.arch} by the CUTLASS backend (supported: {', '.join(OPERAND_DTYPES)})")
        if op.layout not in ("row", "col"):
            raise KspecError(f"GEMM '{desc.name}': operand {role} has unknown layout '{op.layout}'")
    a, b = desc.a.dtype, desc.b.dtype
    if a != b and not (a in _FP8 and b in _FP8):
        raise KspecError(f"GEMM '{desc.name}': mixed operand dtypes {a} x {b} are not supported "
                         f"on {desc.arch} (only the two fp8 kinds may be mixed)")
    if desc.acc_dtype != "f32":
        raise KspecError(f"GEMM '{desc.name}': accumulator dtype {desc.acc_dtype} is not supported "
                         f"on {desc.arch} for {a} operands (use f32)")
    for what, v in (("tile", desc.tile), ("cluster", desc.cluster)):
        if v is not None and (len(v) != 3 or any((not isinstance(x, int)) or x <= 0 for x in v)):
            raise KspecError(f"GEMM '{desc.name}': {what} must be three positive integers, got {v}")
    if desc.stages is not None and (not isinstance(desc.stages, int) or desc.stages < 2):
        raise KspecError(f"GEMM '{desc.name}': stages must be an integer >= 2, got {desc.stages}")
    return ARCH_CC[desc.arch]


def _alignment_elems(dtype: str) -> int:
    return TMA_ALIGNMENT_BYTES * 8 // _BITS[dtype]


def _layout_name(layout: Any) -> str:
    return "row" if layout.name == "RowMajor" else "col"


def _make_plan(cutlass_cppgen: Any, desc: GemmDesc, cc: int) -> Any:
    import cutlass_library as lib
    ea, eb = compat.library_dtype(desc.a.dtype), compat.library_dtype(desc.b.dtype)
    acc = compat.library_dtype(desc.acc_dtype)
    la, lb = compat.library_layout(desc.a.layout), compat.library_layout(desc.b.layout)
    options = cutlass_cppgen.get_option_registry().options_for_cc(cc)
    tensorop = options.operations_by_opclass.get(lib.OpcodeClass.TensorOp, {})
    if ((ea, eb, acc), (la, lb)) not in tensorop:
        # Checked here because op.Gemm would silently fall back to SIMT kernels.
        layouts = sorted(f"A {_layout_name(k[1][0])} / B {_layout_name(k[1][1])}"
                         for k in tensorop if k[0] == (ea, eb, acc))
        have = f"supported layouts: {', '.join(layouts)}" if layouts else "no layout is supported"
        raise KspecError(f"GEMM '{desc.name}': CUTLASS has no {desc.a.dtype} x {desc.b.dtype} -> "
                         f"{desc.acc_dtype} tensor-core kernel on {desc.arch} with A {desc.a.layout} / "
                         f"B {desc.b.layout} ({have})",
                         hint="store the operand transposed (change its layout) in the spec")
    plan = cutlass_cppgen.op.Gemm(
        element_A=ea, element_B=eb, element_C=lib.DataType.void,
        element_D=compat.library_dtype(desc.output.dtype), layout_A=la, layout_B=lb,
        layout_C=compat.library_layout(desc.output.layout), element_accumulator=acc,
        cc=cc, kernel_cc=cc)
    if plan.op_class != lib.OpcodeClass.TensorOp:
        raise KspecError(f"GEMM '{desc.name}': no tensor-core kernel for these dtypes on {desc.arch}")
    return plan


def _configs(plan: Any, desc: GemmDesc, cc: int) -> list[GemmConfig]:
    """The generator's configurations for this dtype/layout combination whose epilogue fits in
    shared memory, restricted to what kspec emits: explicit warp-specialized schedules, static
    clusters, the default persistent tile scheduler, 16-byte aligned A/B."""
    from cutlass_cppgen.utils.datatypes import td_from_profiler_op
    import cutlass_library as lib
    align_a, align_b = _alignment_elems(desc.a.dtype), _alignment_elems(desc.b.dtype)
    seen: dict[GemmConfig, GemmConfig] = {}
    for op in plan.possible_operations.all_operations:
        if op.A.alignment != align_a or op.B.alignment != align_b:
            continue
        td = td_from_profiler_op(op)
        ks, es = td.kernel_schedule, td.epilogue_schedule
        if ks is None or ks == lib.KernelScheduleType.ScheduleAuto:
            continue
        if td.tile_scheduler not in (None, lib.TileSchedulerType.Default):
            continue
        if td.cluster_shape[0] <= 0 or td.cluster_shape[1] <= 0:
            continue          # dynamic cluster shapes need a runtime fallback cluster
        if cc == 100:
            # The generator leaves some 2-SM epilogues on Auto; the EVT descriptor needs the real one.
            want = lib.EpilogueScheduleType.TmaWarpSpecialized2Sm if "2Sm" in ks.name \
                else lib.EpilogueScheduleType.TmaWarpSpecialized1Sm
            if es in (None, lib.EpilogueScheduleType.ScheduleAuto):
                es = want
            if es != want:
                continue
            td.epilogue_schedule = es
        elif es not in (lib.EpilogueScheduleType.TmaWarpSpecialized,
                        lib.EpilogueScheduleType.TmaWarpSpecializedCooperative):
            continue
        tile = tuple(int(x) for x in td.blackwell_threadblock_shape)
        cfg = GemmConfig(tile=tile, cluster=tuple(int(x) for x in td.cluster_shape),  # type: ignore[arg-type]
                         kernel_schedule=ks.name, epilogue_schedule=es.name, td=td)
        seen.setdefault(cfg, cfg)
    return sorted(seen.values(), key=lambda c: (c.tile, c.cluster, c.kernel_schedule, c.epilogue_schedule))


def _preference(cfg: GemmConfig, cc: int, kbytes_tile: int) -> tuple:
    """Rank configurations for the default choice: shapes CUTLASS's own examples use first."""
    m, n, k = cfg.tile
    k_rank = abs(k - kbytes_tile)
    if cc == 90:
        tiles = [(128, 256), (128, 128), (256, 128), (64, 128)]
        clusters = [(2, 1, 1), (1, 2, 1), (1, 1, 1)]
        scheds = ["TmaWarpSpecializedCooperative", "TmaWarpSpecializedPingpong", "TmaWarpSpecialized"]
    else:
        tiles = [(256, 128), (256, 256), (128, 256), (128, 128)]
        clusters = [(2, 1, 1), (1, 1, 1), (2, 2, 1), (4, 1, 1)]
        scheds = ["TmaWarpSpecialized2SmSm100", "TmaWarpSpecialized1SmSm100"]
    def rank(lst: list, v: Any) -> int:
        return lst.index(v) if v in lst else len(lst)
    fast_accum = "FP8FastAccum" in cfg.kernel_schedule   # keep full-precision fp8 accumulation
    return (k_rank, rank(tiles, (m, n)), rank(clusters, cfg.cluster), fast_accum,
            rank(scheds, cfg.kernel_schedule), cfg.tile, cfg.cluster, cfg.kernel_schedule)


def _nearest(configs: list[GemmConfig], tile: tuple | None, cluster: tuple | None, limit: int = 6) -> str:
    def dist(c: GemmConfig) -> tuple:
        d = 0.0
        if tile is not None:
            d += sum(abs(math.log2(a / b)) for a, b in zip(c.tile, tile))
        if cluster is not None:
            d += sum(abs(math.log2(a / b)) for a, b in zip(c.cluster, cluster))
        return (d, c.tile, c.cluster)
    pairs: dict[tuple, GemmConfig] = {}
    for c in sorted(configs, key=dist):
        pairs.setdefault((c.tile, c.cluster), c)
    shown = list(pairs)[:limit]
    return "; ".join(f"tile={t[0]}x{t[1]}x{t[2]} cluster={c[0]}x{c[1]}x{c[2]}" for t, c in shown)


def choose_config(configs: list[GemmConfig], desc: GemmDesc, cc: int) -> GemmConfig:
    """Validate desc.tile/cluster against the list, or choose a default from it."""
    if not configs:
        raise KspecError(f"GEMM '{desc.name}': CUTLASS lists no usable kernel configuration on "
                         f"{desc.arch} for these dtypes/layouts and this epilogue")
    match = [c for c in configs
             if (desc.tile is None or c.tile == tuple(desc.tile))
             and (desc.cluster is None or c.cluster == tuple(desc.cluster))]
    if not match:
        asked = []
        if desc.tile is not None:
            asked.append("tile=" + "x".join(map(str, desc.tile)))
        if desc.cluster is not None:
            asked.append("cluster=" + "x".join(map(str, desc.cluster)))
        what = "MMA tile" if cc == 100 else "CTA tile"
        tile_listed = desc.tile is not None and any(c.tile == tuple(desc.tile) for c in configs)
        raise SettingError(
            "tile" if desc.tile is not None and not tile_listed else "cluster",
            f"GEMM '{desc.name}': {' '.join(asked)} is not a CUTLASS configuration on {desc.arch} "
            f"for {desc.a.dtype} x {desc.b.dtype} ({what} M x N x K)",
            hint=f"nearest valid CUTLASS choices: {_nearest(configs, desc.tile, desc.cluster)}")
    kbytes_tile = 128 * 8 // _BITS[desc.a.dtype]     # a 128-byte K slice per stage
    return min(match, key=lambda c: _preference(c, cc, kbytes_tile))


def _check_stages(desc: GemmDesc, cfg: GemmConfig, plan: Any, cc: int) -> None:
    if desc.stages is None:
        return
    from cutlass_cppgen.utils.check import calculate_smem_usage_per_stage
    from cutlass_library import OperationKind, SharedMemPerCC
    per_stage = calculate_smem_usage_per_stage(cfg.td, OperationKind.Gemm)
    epi = plan.epilogue_functor.get_smem_size(cfg.td)
    capacity = SharedMemPerCC[cc] << 10
    most = (capacity - epi) // per_stage
    if desc.stages > most:
        raise SettingError("stages", f"GEMM '{desc.name}': {desc.stages} stages of {cfg.describe()} need "
                           f"{desc.stages * per_stage + epi} bytes of shared memory; {desc.arch} has "
                           f"{capacity}", hint=f"valid CUTLASS stage counts for this tile: 2..{most}")


# ---------------------------------------------------------------------------------------------
# emission
# ---------------------------------------------------------------------------------------------

_INCLUDES = (
    "cutlass/cutlass.h",
    "cutlass/numeric_types.h",
    "cutlass/kernel_hardware_info.hpp",
    "cute/tensor.hpp",
    "cute/atom/mma_atom.hpp",
    "cutlass/epilogue/thread/activation.h",
    "cutlass/gemm/collective/collective_builder.hpp",
    "cutlass/epilogue/collective/collective_builder.hpp",
    "cutlass/gemm/kernel/gemm_universal.hpp",
    "cutlass/gemm/kernel/tile_scheduler.hpp",
    "cutlass/util/packed_stride.hpp",
)


def _epilogue_descriptor(cc: int, cfg: GemmConfig, epi: evt.EvtEpilogue, elem_d: str) -> str:
    import cutlass_library as lib
    es = lib.EpilogueScheduleTag[getattr(lib.EpilogueScheduleType, cfg.epilogue_schedule)]
    m, n, k = cfg.tile
    if cc == 90:
        # The interface's own sm90 emitter passes the cluster-wide tile here; the EVT nodes need the
        # CTA tile that the CollectiveBuilder below receives.
        return (f"using EpilogueDescriptor = cutlass::epilogue::collective::detail::EpilogueDescriptor<\n"
                f"  cute::Shape<cute::_{m}, cute::_{n}, cute::_{k}>, "
                f"cutlass::epilogue::collective::EpilogueTileAuto,\n"
                f"  void, {elem_d}, {es}>;\n")
    sd = evt.stride_d_type(epi)
    return (f"using EpilogueDescriptor = cutlass::epilogue::collective::detail::Sm100EpilogueDescriptor<\n"
            f"  cutlass::arch::OpClassTensorOp, cute::Shape<cute::_{m}, cute::_{n}, cute::_{k}>,\n"
            f"  cutlass::epilogue::collective::EpilogueTileAuto, float, void, {elem_d},\n"
            f"  {es}, {sd}, {sd}, false /* IsPerColScaleSupported */, false /* IsBlockScaleSupported */>;\n")


def _kernel_types(desc: GemmDesc, cc: int, cfg: GemmConfig, epi: evt.EvtEpilogue) -> str:
    import cutlass_library as lib
    elem = lambda d: evt.element_tag(compat.library_dtype(d))  # noqa: E731
    lay = lambda l: "cutlass::layout::RowMajor" if l == "row" else "cutlass::layout::ColumnMajor"  # noqa: E731
    elem_d = elem(desc.output.dtype)
    callbacks_decl, callbacks = evt.emit_callbacks(epi, cc)
    ks = lib.KernelScheduleTag[getattr(lib.KernelScheduleType, cfg.kernel_schedule)]
    es = lib.EpilogueScheduleTag[getattr(lib.EpilogueScheduleType, cfg.epilogue_schedule)]
    m, n, k = cfg.tile
    cm, cn, ck = cfg.cluster
    tile = f"cute::Shape<cute::_{m}, cute::_{n}, cute::_{k}>"
    cluster = f"cute::Shape<cute::_{cm}, cute::_{cn}, cute::_{ck}>"
    align_d = _alignment_elems(desc.output.dtype)
    if desc.stages is None:
        stages = ("cutlass::gemm::collective::StageCountAutoCarveout<"
                  "static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>")
    else:
        stages = f"cutlass::gemm::collective::StageCount<{desc.stages}>"
    arch = f"cutlass::arch::Sm{cc}"
    body = _epilogue_descriptor(cc, cfg, epi, elem_d)
    body += callbacks_decl.strip("\n") + "\n"
    body += f"""
using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    {arch}, cutlass::arch::OpClassTensorOp,
    {tile}, {cluster},
    cutlass::epilogue::collective::EpilogueTileAuto,
    float, float,
    ElementC, StrideC, {align_d},
    ElementD, StrideD, {align_d},
    {es},
    {callbacks}
  >::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    {arch}, cutlass::arch::OpClassTensorOp,
    {elem(desc.a.dtype)}, {lay(desc.a.layout)}, {_alignment_elems(desc.a.dtype)},
    {elem(desc.b.dtype)}, {lay(desc.b.layout)}, {_alignment_elems(desc.b.dtype)},
    float,
    {tile}, {cluster},
    {stages},
    {ks}
  >::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
    cute::Shape<int, int, int, int>,
    CollectiveMainloop,
    CollectiveEpilogue,
    void  // default persistent tile scheduler
>;
"""
    return body


def _host_glue(desc: GemmDesc, epi: evt.EvtEpilogue, cfg: GemmConfig,
               names: evt.ArgNames) -> str:
    elem = lambda d: evt.element_tag(compat.library_dtype(d))  # noqa: E731
    thread_args = evt.arguments_initializer(epi, names)
    stride_d = evt.stride_d_value(epi)
    ia, ib = names.ptr_index[desc.a.name], names.ptr_index[desc.b.name]
    i_d = names.ptr_index[desc.output.name]
    mode = "kBatched" if desc.batched else "kGemm"
    batch_check = "" if desc.batched else (
        '  if (L != 1) { kspec_set_err(err, err_cap, "this kernel is not batched: L must be 1"); '
        "return 2; }\n")
    cm, cn, ck = cfg.cluster
    order = sorted(names.ptr_index, key=names.ptr_index.get)
    align = [a for _, a in _arg_alignment(desc, order)]
    tma_check = TMA_CHECK.format(ptrs="ptrs", nargs="kNumArgs",
                                 fail="kspec_set_err(err, err_cap, tma_msg);\n      return 7;")
    has_reductions = "true" if desc.reductions else "false"
    return f"""
namespace {{

using Arguments = typename Kernel::Arguments;
using Params = typename Kernel::Params;

void kspec_set_err(char* err, uint64_t err_cap, const char* msg) {{
  if (err != nullptr && err_cap > 0) {{
    std::snprintf(err, static_cast<size_t>(err_cap), "%s", msg);
  }}
}}

// Arguments with contiguous strides per the manifest layouts (batched: batch stride = matrix size).
int kspec_make_arguments(const int64_t* dims, void* const* ptrs, const double* scalars,
                         int32_t device, int32_t sm_count, Arguments* out,
                         char* err, uint64_t err_cap) {{
  const int64_t M = dims[0], N = dims[1], K = dims[2], L = dims[3];
  if (M <= 0 || N <= 0 || K <= 0 || L <= 0) {{
    kspec_set_err(err, err_cap, "GEMM sizes M, N, K, L must be positive");
    return 1;
  }}
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX || L > INT32_MAX) {{
    kspec_set_err(err, err_cap, "GEMM sizes must fit in 32 bits");
    return 1;
  }}
{batch_check}  const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K), l = static_cast<int>(L);
  auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{{}}, cute::make_shape(m, k, l));
  auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{{}}, cute::make_shape(n, k, l));
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device;
  hw_info.sm_count = sm_count;
  (void)scalars;
  *out = Arguments{{
    cutlass::gemm::GemmUniversalMode::{mode},
    {{m, n, k, l}},
    {{static_cast<{elem(desc.a.dtype)} const*>(ptrs[{ia}]), stride_a,
     static_cast<{elem(desc.b.dtype)} const*>(ptrs[{ib}]), stride_b}},
    {{{thread_args},
     nullptr, {stride_d},
     static_cast<{elem(desc.output.dtype)}*>(ptrs[{i_d}]), {stride_d}}},
    hw_info
  }};
  return 0;
}}

}}  // namespace

extern "C" int kspec_abi_version(void) {{ return {ABI_VERSION}; }}

extern "C" int kspec_workspace_size(const int64_t* dims, int32_t device, int32_t sm_count,
                                    uint64_t* bytes, char* err, uint64_t err_cap) {{
  try {{
    if (sm_count <= 0) {{
      kspec_set_err(err, err_cap, "sm_count must be positive (the launch device's multiprocessor count)");
      return 1;
    }}
    void* null_ptrs[{max(1, len(names.ptr_index))}] = {{}};
    double zero_scalars[{max(1, len(names.scalar_index))}] = {{}};
    Arguments args;
    int rc = kspec_make_arguments(dims, null_ptrs, zero_scalars, device, sm_count, &args, err, err_cap);
    if (rc != 0) return rc;
    // sized with the device's SM count: the persistent tile scheduler keeps per-SM state
    *bytes = static_cast<uint64_t>(Kernel::get_workspace_size(args));
    return 0;
  }} catch (std::exception const& e) {{
    kspec_set_err(err, err_cap, e.what());
    return 9;
  }} catch (...) {{
    kspec_set_err(err, err_cap, "kspec_workspace_size: unknown C++ exception");
    return 9;
  }}
}}

namespace {{

// Byte alignment each tensor argument needs (the manifest's alignment), in ABI order.
constexpr unsigned kArgAlignment[{max(1, len(align))}] = {{{", ".join(str(a) for a in align) or "1"}}};
constexpr int kNumArgs = {len(align)};

int kspec_prepare_checked(const int64_t* dims, void* const* ptrs, const double* scalars,
                          void* workspace, int32_t device, int32_t sm_count,
                          void* params, uint64_t params_cap, uint64_t* params_size,
                          uint32_t grid[3], uint32_t block[3], uint32_t cluster[3],
                          uint32_t* smem_bytes, char* err, uint64_t err_cap) {{
  char msg[512];
  if (sm_count <= 0) {{
    kspec_set_err(err, err_cap, "sm_count must be positive (the launch device's multiprocessor count)");
    return 1;
  }}
  for (int i = 0; i < kNumArgs; ++i) {{
    uintptr_t a = reinterpret_cast<uintptr_t>(ptrs[i]);
    if (a == 0 || a % kArgAlignment[i] != 0) {{
      std::snprintf(msg, sizeof(msg), "argument #%d must be a non-NULL device pointer aligned to %u bytes, got %p",
                    i, kArgAlignment[i], ptrs[i]);
      kspec_set_err(err, err_cap, msg);
      return 1;
    }}
  }}
  Arguments args;
  int rc = kspec_make_arguments(dims, ptrs, scalars, device, sm_count, &args, err, err_cap);
  if (rc != 0) return rc;
  if (!Kernel::can_implement(args)) {{
    std::snprintf(msg, sizeof(msg),
                  "CUTLASS can_implement rejected M=%lld N=%lld K=%lld L=%lld (leading dimensions must "
                  "be multiples of {TMA_ALIGNMENT_BYTES} bytes)",
                  (long long)dims[0], (long long)dims[1], (long long)dims[2], (long long)dims[3]);
    kspec_set_err(err, err_cap, msg);
    return 3;
  }}
  // TMA descriptors are encoded through the driver's cuTensorMapEncodeTiled, reached at run time
  // (the glue never links libcuda): without it CUTLASS would leave the descriptors unset.
  // The encoder is an installed one (kspec_set_tensor_map_encoder, tma_hook.py) or the driver's,
  // found through cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", ...).
  if (kspec_tensor_map_encoder() == nullptr) {{
    std::snprintf(msg, sizeof(msg), "the CUDA driver entry point cuTensorMapEncodeTiled is unavailable "
                  "(cudaGetDriverEntryPointByVersion failed: %s); a CUDA 12+ driver is required "
                  "to encode TMA descriptors", cudaGetErrorString(cudaGetLastError()));
    kspec_set_err(err, err_cap, msg);
    return 5;
  }}
  const size_t ws_bytes = Kernel::get_workspace_size(args);
  if (ws_bytes != 0 && workspace == nullptr) {{
    std::snprintf(msg, sizeof(msg), "a workspace of %llu bytes is required", (unsigned long long)ws_bytes);
    kspec_set_err(err, err_cap, msg);
    return 1;
  }}
  if (ws_bytes == 0 && !{has_reductions}) {{
    // Nothing to initialise, so no stream work: the status check is all that runs.  (A non-empty
    // workspace is zero-filled by the loader on the launch stream instead, so that a call stays
    // on the caller's stream and capturable; the ABI's prepare has no stream.  Epilogue reductions
    // would fill their outputs on the default stream here: the loader does that on the launch stream
    // from the manifest's `init`, so it is skipped.)
    cutlass::Status st = Kernel::initialize_workspace(args, nullptr, nullptr, nullptr);
    if (st != cutlass::Status::kSuccess) {{
      std::snprintf(msg, sizeof(msg), "CUTLASS initialize_workspace failed: %s", cutlass::cutlassGetStatusString(st));
      kspec_set_err(err, err_cap, msg);
      return 6;
    }}
  }}
  if (params_cap < sizeof(Params)) {{
    kspec_set_err(err, err_cap, "parameter buffer too small for Kernel::Params");
    return 4;
  }}
  kspec_tma::reset();
  Params p = Kernel::to_underlying_arguments(args, workspace);
{tma_check}  std::memcpy(params, &p, sizeof(Params));
  *params_size = static_cast<uint64_t>(sizeof(Params));
  dim3 g = Kernel::get_grid_shape(p);
  dim3 b = Kernel::get_block_shape();
  grid[0] = g.x; grid[1] = g.y; grid[2] = g.z;
  block[0] = b.x; block[1] = b.y; block[2] = b.z;
  cluster[0] = {cm}; cluster[1] = {cn}; cluster[2] = {ck};
  *smem_bytes = static_cast<uint32_t>(Kernel::SharedStorageSize);
  return 0;
}}

}}  // namespace

extern "C" int kspec_prepare(const int64_t* dims, void* const* ptrs, const double* scalars,
                             void* workspace, int32_t device, int32_t sm_count,
                             void* params, uint64_t params_cap, uint64_t* params_size,
                             uint32_t grid[3], uint32_t block[3], uint32_t cluster[3],
                             uint32_t* smem_bytes, char* err, uint64_t err_cap) {{
  try {{
    return kspec_prepare_checked(dims, ptrs, scalars, workspace, device, sm_count, params, params_cap,
                                 params_size, grid, block, cluster, smem_bytes, err, err_cap);
  }} catch (std::exception const& e) {{
    kspec_set_err(err, err_cap, e.what());
    return 9;
  }} catch (...) {{
    kspec_set_err(err, err_cap, "kspec_prepare: unknown C++ exception");
    return 9;
  }}
}}
"""




_DEVICE_ENTRY = """
extern "C" __global__ void __launch_bounds__(Kernel::MaxThreadsPerBlock, Kernel::MinBlocksPerMultiprocessor)
kspec_kernel(CUTLASS_GRID_CONSTANT typename Kernel::Params const params) {
  extern __shared__ char smem[];
  Kernel op;
  op(params, smem);
}
"""


def _arg_alignment(desc: GemmDesc, args) -> tuple[tuple[str, int], ...]:
    """Byte alignment per tensor argument: TMA operands 16, atomic reduction targets 4."""
    red_names = {r.name for r in desc.reductions}
    return tuple((n, 4 if n in red_names else TMA_ALIGNMENT_BYTES) for n in args)


def _abi_order(desc: GemmDesc, epi: evt.EvtEpilogue) -> tuple[tuple[str, ...], tuple[str, ...]]:
    args = [desc.a.name, desc.b.name] + [ld.name for ld in epi.tensor_loads] + [desc.output.name] + \
        [s.name for s in desc.aux_stores] + [r.name for r in desc.reductions]
    if len(set(args)) != len(args):
        raise KspecError(f"GEMM '{desc.name}': a tensor appears twice among its arguments: {args}")
    scalars = tuple(ld.name for ld in epi.scalar_loads)
    if set(scalars) & set(args):
        raise KspecError(f"GEMM '{desc.name}': a name is both a tensor and a scalar argument")
    return tuple(args), scalars


def emit_gemm(desc: GemmDesc) -> EmittedKernel:
    """Emit the `.cu` source and launch facts for one GEMM descriptor (no nvcc is run)."""
    cc = _check_desc(desc)
    with compat.offline(cc) as cutlass_cppgen:
        epi = evt.trace_epilogue(desc, cc)
        plan = _make_plan(cutlass_cppgen, desc, cc)
        try:
            plan.epilogue_visitor = epi.frontend
        except RuntimeError as e:    # "The epilogue consumes too much shared memory"
            raise KspecError(f"GEMM '{desc.name}': the fused epilogue does not fit in shared memory "
                             f"on {desc.arch}: {e}") from e
        cfg = choose_config(_configs(plan, desc, cc), desc, cc)
        _check_stages(desc, cfg, plan, cc)
        args, scalars = _abi_order(desc, epi)
        names = evt.ArgNames(ptr_index={n: i for i, n in enumerate(args)},
                             scalar_index={n: i for i, n in enumerate(scalars)})
        types = _kernel_types(desc, cc, cfg, epi)
        host = _host_glue(desc, epi, cfg, names)

    includes = "".join(f'#include "{h}"\n' for h in _INCLUDES)
    source = (
        f"// Generated by kspec: GEMM kernel '{desc.name}' for {desc.arch}. Do not edit.\n"
        f"// {cfg.describe()} stages={desc.stages or 'auto'}\n"
        f"{tma_hook.PRELUDE}"
        "#include <cstdint>\n#include <cstdio>\n#include <cstring>\n#include <climits>\n"
        f"{_TMA_HOOK}{includes}\n"
        "namespace kspec_gemm {\nusing namespace cute;\n\n"
        f"{types}"
        "}  // namespace kspec_gemm\n\n"
        "using Kernel = kspec_gemm::GemmKernel;\n"
        "\n#if defined(KSPEC_DEVICE)\n"
        f"{_DEVICE_ENTRY}"
        "#endif  // KSPEC_DEVICE\n"
        "\n#if defined(KSPEC_HOST)\n"
        f"{tma_hook.HOST_SOURCE}"
        f"{tma_hook.DRIVER_TRAMPOLINES if desc.reductions else ''}"
        f"{host}"
        "#endif  // KSPEC_HOST\n")

    init = desc.reduction_init()
    alignment = _arg_alignment(desc, args)
    mma = ("2sm" if cfg.is_2sm else "1sm") if cc == 100 else "wgmma"
    config = (
        ("tile", "x".join(map(str, cfg.tile))),
        ("cluster", "x".join(map(str, cfg.cluster))),
        ("stages", str(desc.stages) if desc.stages is not None else "auto"),
        ("kernel_schedule", cfg.kernel_schedule),
        ("epilogue_schedule", cfg.epilogue_schedule),
        ("tile_scheduler", "persistent"),
        ("mma", mma),
        ("cutlass", compat.cutlass_version()),
    )
    return EmittedKernel(
        name=desc.name, arch=desc.arch, source=source,
        include_dirs=compat.cutlass_include_dirs(), flags=BASE_FLAGS,
        dims=("M", "N", "K", "L"), args=args, scalars=scalars, init=init,
        alignment=alignment, config=config)
