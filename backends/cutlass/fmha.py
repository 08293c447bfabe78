"""Fused-attention code generation for the CUTLASS backend.

This module owns the lowering of an `AttentionDesc` to one `.cu` source that follows
backends/ABI.md.  The source instantiates the FMHA kernels CUTLASS ships as examples in the
`nvidia-cutlass` wheel, by including their headers from the wheel (never copies):

- sm90a:  `examples/88_hopper_fmha`  - `cutlass::fmha::kernel::FmhaBuilder<..., KernelTmaWarpSpecializedCooperative>`
  (1 producer + 2 consumer warpgroups, HGMMA, TMA loads/stores, IndividualTileScheduler).
- sm100a: `examples/77_blackwell_fmha` - `Sm100FmhaFwdKernelTmaWarpspecialized` with
  `Sm100FmhaFwdMainloopTmaWarpspecialized` (tcgen05 UTCHMMA, TMEM, 16 warps, IndividualTileScheduler).

Semantics implemented (both archs), for contiguous [B, H, S|T, E] tensors:
    O[b,h,i,:] = sum_j softmax_j(scale * <Q[b,h,i,:], K[b,h,j,:]>) V[b,h,j,:]
- non-causal: all T keys; keys of a partial last K tile are masked (ResidualFusion / ResidualMask),
  so any T works.
- causal: top-left aligned, key j masked when j > i (query i sits at key position i, also when
  S != T; for S > T rows i >= T see all T keys).  On sm90a the example's CausalFusion does not mask
  keys j >= T of a partial K tile, so the generated source adds `KspecCausalResidualFusion`
  (CausalFusion + the j >= T mask); sm100a's `CausalMask<true>` already does both.
- scale must be positive and finite: both kernels take the row max of the *unscaled* scores and
  scale afterwards, which is only the max of the scaled scores when scale > 0.
- sm90a's epilogue always writes the row log-sum-exp; kspec puts that buffer in the ABI workspace
  (B*H*S floats), so the tensor arguments stay (q, k, v, o).  sm100a skips LSE (nullptr).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

from kspec.backends.desc import AttentionDesc, Const, EmittedKernel, Load
from kspec.core import ABI_VERSION, KspecError, KspecInternalError, check_ident

from . import tma_hook
from .host_checks import TMA_CHECK, TMA_HOOK

_ELEMENT_CPP = {"f16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}

# One tile per head dim: exactly the configurations the CUTLASS examples instantiate for the
# forward pass (88_hopper_fmha run_fwd_*: cooperative variants; 77_blackwell_fmha run_fwd_*).
# Other shapes only fail as static_asserts deep in nvcc, so they are not offered.
_TILES: dict[str, dict[int, tuple[int, int, int]]] = {
    "sm90a": {32: (128, 64, 32), 64: (128, 64, 64), 128: (128, 128, 128), 256: (128, 64, 256)},
    "sm100a": {64: (256, 128, 64), 128: (256, 128, 128)},
}

# Compile flags the kernels need beyond the builder's base command line; the examples' CMake
# compiles both with --use_fast_math.  NDEBUG keeps CUTLASS's host-side assert(false) on a failed
# TMA descriptor from aborting the caller's process (kspec_prepare validates inputs first).
_FLAGS = ("-std=c++17", "--expt-relaxed-constexpr", "--use_fast_math", "-DNDEBUG")

DIMS = ("B", "H", "S", "T", "E")
TENSOR_ALIGNMENT_BYTES = 16  # TMA: global addresses and strides are multiples of 16 bytes


class AttentionLoweringError(KspecError):
    """An attention descriptor the fused CUTLASS kernels cannot implement."""


@dataclass(frozen=True)
class CutlassPaths:
    include: str        # cutlass_library/source/include (cute/, cutlass/)
    examples: str       # cutlass_library/source/examples


@lru_cache(maxsize=1)
def cutlass_paths() -> CutlassPaths:
    """Locate the CUTLASS headers inside the installed nvidia-cutlass wheel."""
    try:
        import cutlass_library
    except ImportError as e:  # pragma: no cover - a broken install
        raise KspecError("the nvidia-cutlass package is not installed",
                         hint="pip install 'nvidia-cutlass>=4.2,<4.3'") from e
    root = os.path.join(os.path.dirname(os.path.abspath(cutlass_library.__file__)), "source")
    paths = CutlassPaths(os.path.join(root, "include"), os.path.join(root, "examples"))
    for d in (paths.include, os.path.join(paths.examples, "88_hopper_fmha"),
              os.path.join(paths.examples, "77_blackwell_fmha")):
        if not os.path.isdir(d):
            raise KspecError(f"CUTLASS sources missing from the nvidia-cutlass wheel: {d}")
    return paths


def _example_dir(arch: str) -> str:
    sub = "88_hopper_fmha" if arch == "sm90a" else "77_blackwell_fmha"
    return os.path.join(cutlass_paths().examples, sub)


# ---------------------------------------------------------------------------------------------
# Capability queries
# ---------------------------------------------------------------------------------------------

def attention_support(arch: str, dtype: str, head_dim: int, causal: bool, *,
                      out_dtype: str | None = None, scale: float | None = None) -> str | None:
    """None when the fused kernel implements this attention, else a human reason (used in the
    compiler's fallback warning).  `out_dtype` defaults to `dtype`; `scale` is a folded constant
    scale, if any (a runtime scale is checked at launch)."""
    if arch not in _TILES:
        return f"fused attention is only generated for sm90a and sm100a, not {arch!r}"
    if dtype in ("f8e4m3", "f8e5m2"):
        if arch == "sm90a":
            return ("fp8 fused attention on sm90a needs V stored transposed ([B, H, E, T]); "
                    "kspec passes contiguous [B, H, T, E]")
        return "fp8 fused attention is not generated by kspec yet (only f16 and bf16)"
    if dtype not in _ELEMENT_CPP:
        return f"fused attention supports f16 and bf16 inputs, not {dtype}"
    out = dtype if out_dtype is None else out_dtype
    if out != dtype:
        return f"fused attention writes O in the input dtype ({dtype}), not {out}"
    if head_dim not in _TILES[arch]:
        dims = ", ".join(str(d) for d in sorted(_TILES[arch]))
        return f"the {arch} fused attention kernel supports head dims {dims}, not {head_dim}"
    if scale is not None and not (math.isfinite(scale) and scale > 0.0):
        return f"the fused attention kernels need a positive finite scale, not {scale!r}"
    del causal  # both masks are supported on both archs
    return None


def choose_attention_tile(arch: str, dtype: str, head_dim: int) -> tuple[int, int, int]:
    """The CTA tile (queries x keys x head dim) kspec instantiates for this arch/dtype/head dim."""
    reason = attention_support(arch, dtype, head_dim, causal=False)
    if reason is not None:
        raise AttentionLoweringError(reason)
    return _TILES[arch][head_dim]


# ---------------------------------------------------------------------------------------------
# Emission
# ---------------------------------------------------------------------------------------------

def _check_ident(what: str, name: str) -> None:
    check_ident(name, what)


def _validate(desc: AttentionDesc) -> tuple[int, int, int]:
    _check_ident("kernel name", desc.name)
    ops = {"q": desc.q, "k": desc.k, "v": desc.v, "o": desc.o}
    for role, op in ops.items():
        _check_ident(f"{role} operand name", op.name)
        if op.layout != "row":
            raise AttentionLoweringError(
                f"fused attention needs contiguous [B, H, S|T, E] ('row') tensors; {role} is '{op.layout}'")
    if desc.o.name in (desc.q.name, desc.k.name, desc.v.name):
        raise KspecInternalError("attention output aliases an input")
    if len({desc.q.dtype, desc.k.dtype, desc.v.dtype}) != 1:
        raise AttentionLoweringError(
            f"fused attention needs Q, K, V of one dtype, got {desc.q.dtype}, {desc.k.dtype}, {desc.v.dtype}")
    if isinstance(desc.scale, Load):
        _check_ident("scale parameter name", desc.scale.name)
        if desc.scale.kind != "scalar":
            raise AttentionLoweringError(f"attention scale must be a scalar, got a '{desc.scale.kind}' load")
        const_scale = None
    elif isinstance(desc.scale, Const):
        const_scale = float(desc.scale.value)
    else:
        raise KspecInternalError(f"unknown scale expression {desc.scale!r}")
    reason = attention_support(desc.arch, desc.q.dtype, desc.head_dim, desc.causal,
                               out_dtype=desc.o.dtype, scale=const_scale)
    if reason is not None:
        raise AttentionLoweringError(reason)
    tile = choose_attention_tile(desc.arch, desc.q.dtype, desc.head_dim)
    if desc.tile is not None and tuple(desc.tile) != tile:
        raise AttentionLoweringError(
            f"attention tile {'x'.join(map(str, desc.tile))} is not available on {desc.arch} for head "
            f"dim {desc.head_dim}", hint=f"use tile = {'x'.join(map(str, tile))} or drop the hint")
    return tile


def emit_attention(desc: AttentionDesc) -> EmittedKernel:
    """Generate the `.cu` source (device entry + host glue, see ABI.md) for one attention kernel."""
    tile = _validate(desc)
    runtime_scale = isinstance(desc.scale, Load)
    if runtime_scale:
        scale_expr = "static_cast<float>(scale_d)"
        scale_cfg = f"runtime:{desc.scale.name}"
    else:
        scale_expr = f"static_cast<float>({float(desc.scale.value)!r})"
        scale_cfg = f"const:{float(desc.scale.value)!r}"
    if desc.arch == "sm90a":
        body, variant, mask_impl, lse = _hopper_types(desc, tile), "sm90a_fmha_tma_ws_cooperative", \
            ("KspecCausalResidualFusion" if desc.causal else "ResidualFusion"), "workspace"
    else:
        body, variant, mask_impl, lse = _blackwell_types(desc, tile), "sm100a_fmha_tma_ws", \
            ("CausalMask<true>" if desc.causal else "ResidualMask"), "none"
    source = _SOURCE.format(
        name=desc.name, arch=desc.arch, variant=variant,
        tile="x".join(map(str, tile)),
        mask="causal_top_left (j > i masked)" if desc.causal else "none",
        types=body,
        host=_HOPPER_HOST if desc.arch == "sm90a" else _BLACKWELL_HOST,
        scale_expr=scale_expr,
        needs_scalar="1" if runtime_scale else "0",
        abi=ABI_VERSION,
        tma_prelude=tma_hook.PRELUDE, tma_host=tma_hook.HOST_SOURCE,
        tma_hook=TMA_HOOK,
        tma_check=TMA_CHECK.format(
            ptrs="ptrs", nargs="4",
            fail="if (err != nullptr && err_cap > 0)\n"
                 "        std::snprintf(err, static_cast<size_t>(err_cap), \"%s\", tma_msg);\n      return 1;"),
    )
    paths = cutlass_paths()
    args = (desc.q.name, desc.k.name, desc.v.name, desc.o.name)
    config = (
        ("variant", variant),
        ("tile", "x".join(map(str, tile))),
        ("mask", "causal_top_left" if desc.causal else "none"),
        ("mask_impl", mask_impl),
        ("scheduler", "individual"),
        ("cluster", "1x1x1"),
        ("lse", lse),
        ("scale", scale_cfg),
        ("dtype", desc.q.dtype),
        ("head_dim", str(desc.head_dim)),
    )
    return EmittedKernel(
        name=desc.name, arch=desc.arch, source=source,
        include_dirs=(paths.include, _example_dir(desc.arch)),
        flags=_FLAGS, dims=DIMS, args=args,
        scalars=(desc.scale.name,) if runtime_scale else (),
        init=(),
        alignment=tuple((a, TENSOR_ALIGNMENT_BYTES) for a in dict.fromkeys(args)),
        config=config,
    )


def _hopper_types(desc: AttentionDesc, tile: tuple[int, int, int]) -> str:
    m, n, d = tile
    fusion = "KspecCausalResidualFusion" if desc.causal else "cutlass::fmha::collective::ResidualFusion"
    return _HOPPER_TYPES.format(element=_ELEMENT_CPP[desc.q.dtype], m=m, n=n, d=d, fusion=fusion)


def _blackwell_types(desc: AttentionDesc, tile: tuple[int, int, int]) -> str:
    m, n, d = tile
    mask = "cutlass::fmha::collective::CausalMask<true>" if desc.causal \
        else "cutlass::fmha::collective::ResidualMask"
    return _BLACKWELL_TYPES.format(element=_ELEMENT_CPP[desc.q.dtype],
                                   element_out=_ELEMENT_CPP[desc.o.dtype], m=m, n=n, d=d, mask=mask)


# ---------------------------------------------------------------------------------------------
# C++ templates.  Braces for str.format are doubled.
# ---------------------------------------------------------------------------------------------

_HOPPER_TYPES = r"""
#include "collective/fmha_fusion.hpp"
#include "kernel/fmha_kernel_builder.hpp"

namespace kspec_gen {{
using namespace cute;

using Element = {element};
// Problem (B, H, S, T, E); strides per tensor: (seq, head dim, (batch, head)).
using ProblemShape = cute::tuple<int, int, int, int, int>;
using StrideQ = cute::tuple<int, _1, cute::tuple<int, int>>;
using StrideK = cute::tuple<int, _1, cute::tuple<int, int>>;
using StrideV = cute::tuple<int, _1, cute::tuple<int, int>>;
using StrideO = cute::tuple<int, _1, cute::tuple<int, int>>;
using StrideLSE = cute::tuple<_1, cute::tuple<int, int>>;
using TileShape = Shape<Int<{m}>, Int<{n}>, Int<{d}>>;

// CausalFusion of 88_hopper_fmha masks j > i only; keys of a partial last K tile (j >= T, zero
// filled by TMA) would still count for rows i >= T when S > T.  The trip counts are CausalFusion's;
// the last tile of every trip is a masked one, so this mask reaches the partial tile.
struct KspecCausalResidualFusion : cutlass::fmha::collective::CausalFusion {{
  template<class AccQK, class IndexQK, class ProblemSize>
  CUTLASS_DEVICE void before_softmax(AccQK& acc_qk, IndexQK const& index_qk,
                                     ProblemSize const& problem_size) {{
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc_qk); i++) {{
      auto pos = index_qk(i);
      if (get<0>(pos) < get<1>(pos) || get<1>(pos) >= get<3>(problem_size)) {{
        acc_qk(i) = -INFINITY;
      }}
    }}
  }}
}};

using Kernel = typename cutlass::fmha::kernel::FmhaBuilder<
    Element, float, float, TileShape, StrideQ, StrideK, StrideV,
    {fusion}, cutlass::gemm::KernelTmaWarpSpecializedCooperative>::Kernel;

#if defined(KSPEC_HOST)
constexpr bool kWritesLse = true;   // FmhaFwdEpilogue stores LSE unconditionally
constexpr int kSeqAlignment = 16 / int(sizeof(Element));  // can_implement: S % this == 0
#endif
}}  // namespace kspec_gen
"""

_BLACKWELL_TYPES = r"""
#include "collective/fmha_fusion.hpp"
#include "collective/sm100_fmha_fwd_mainloop_tma_warpspecialized.hpp"
#include "collective/sm100_fmha_fwd_epilogue_tma_warpspecialized.hpp"
#include "kernel/fmha_options.hpp"
#include "kernel/fmha_tile_scheduler.hpp"
#include "kernel/sm100_fmha_fwd_kernel_tma_warpspecialized.hpp"

namespace kspec_gen {{
using namespace cute;

using Element = {element};
using ElementOut = {element_out};
// Problem (S, T, E, ((H_R, H_K), B)) with H_R = 1 (plain multi-head attention, H_K = H).
using ProblemShape = cute::tuple<int, int, int, cute::tuple<cute::tuple<int, int>, int>>;
using StrideQ = cute::tuple<int, _1, cute::tuple<cute::tuple<int, int>, int>>;
using StrideK = cute::tuple<int, _1, cute::tuple<cute::tuple<_0, int>, int>>;
using StrideV = StrideK;
using StrideO = StrideQ;
using StrideLSE = cute::tuple<_1, cute::tuple<cute::tuple<int, int>, int>>;
using TileShape = Shape<Int<{m}>, Int<{n}>, Int<{d}>>;

using Mainloop = cutlass::fmha::collective::Sm100FmhaFwdMainloopTmaWarpspecialized<
    Element, float, float, TileShape, StrideQ, StrideK, StrideV, {mask}>;
using Epilogue = cutlass::fmha::collective::Sm100FmhaFwdEpilogueTmaWarpspecialized<
    ElementOut, float, typename Mainloop::TileShapePV, StrideO, StrideLSE>;
using Kernel = cutlass::fmha::kernel::Sm100FmhaFwdKernelTmaWarpspecialized<
    ProblemShape, Mainloop, Epilogue, cutlass::fmha::kernel::IndividualTileScheduler>;

#if defined(KSPEC_HOST)
constexpr bool kWritesLse = false;  // ptr_LSE = nullptr skips the LSE store
constexpr int kSeqAlignment = 1;
#endif
}}  // namespace kspec_gen
"""

_HOPPER_HOST = r"""
Kernel::Arguments kspec_arguments(KspecProblem const& p, void* const* ptrs, float* lse) {
  using namespace cute;
  StrideQ dQ = make_stride(p.E, _1{}, make_stride(p.H * p.S * p.E, p.S * p.E));
  StrideK dK = make_stride(p.E, _1{}, make_stride(p.H * p.T * p.E, p.T * p.E));
  StrideV dV = dK;
  StrideO dO = dQ;
  StrideLSE dLSE = make_stride(_1{}, make_stride(p.H * p.S, p.S));
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = p.device;
  hw_info.sm_count = p.sm_count;
  return Kernel::Arguments{
      ProblemShape{p.B, p.H, p.S, p.T, p.E},
      {static_cast<Element const*>(ptrs ? ptrs[0] : nullptr), dQ,
       static_cast<Element const*>(ptrs ? ptrs[1] : nullptr), dK,
       static_cast<Element const*>(ptrs ? ptrs[2] : nullptr), dV},
      {static_cast<Element*>(ptrs ? ptrs[3] : nullptr), dO, lse, dLSE},
      hw_info};
}

inline Kernel::Arguments kspec_make_args(KspecProblem const& p, void* const* ptrs, float, void* workspace) {
  return kspec_arguments(p, ptrs, static_cast<float*>(workspace));  // LSE lives at the workspace start
}

// The mainloop derives its softmax scale from 1/sqrt(E); kspec's scale replaces it in Params.
inline void kspec_fix_params(Kernel::Params& params, float scale) {
  params.mainloop.scale_softmax = scale;
  params.mainloop.scale_softmax_log2 = scale * 1.4426950408889634f;  // log2(e)
}
"""

_BLACKWELL_HOST = r"""
Kernel::Arguments kspec_arguments(KspecProblem const& p, void* const* ptrs, float scale) {
  using namespace cute;
  StrideQ dQ = make_stride(p.E, _1{}, make_stride(make_stride(p.S * p.E, p.S * p.E), p.H * p.S * p.E));
  StrideK dK = make_stride(p.E, _1{}, make_stride(make_stride(_0{}, p.T * p.E), p.H * p.T * p.E));
  StrideV dV = dK;
  StrideO dO = dQ;
  StrideLSE dLSE = make_stride(_1{}, make_stride(make_stride(p.S, p.S), p.H * p.S));
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = p.device;
  hw_info.sm_count = p.sm_count;
  typename Mainloop::Arguments mainloop;
  mainloop.load = {static_cast<Element const*>(ptrs ? ptrs[0] : nullptr), dQ,
                   static_cast<Element const*>(ptrs ? ptrs[1] : nullptr), dK,
                   static_cast<Element const*>(ptrs ? ptrs[2] : nullptr), dV};
  mainloop.scale_softmax = scale;  // > 0 checked by the caller (0 would mean 1/sqrt(E))
  typename Epilogue::Arguments epilogue{
      static_cast<ElementOut*>(ptrs ? ptrs[3] : nullptr), dO, nullptr, dLSE};
  return Kernel::Arguments{ProblemShape{p.S, p.T, p.E, make_shape(make_shape(1, p.H), p.B)},
                           mainloop, epilogue, hw_info};
}

inline Kernel::Arguments kspec_make_args(KspecProblem const& p, void* const* ptrs, float scale, void*) {
  return kspec_arguments(p, ptrs, scale);
}

inline void kspec_fix_params(Kernel::Params&, float) {}
"""

_SOURCE = r"""// Generated by kspec (backends/cutlass/fmha.py); do not edit.
// kernel {name}  arch {arch}  variant {variant}  tile {tile}  mask {mask}
// O[b,h,i,:] = sum_j softmax_j(scale * Q[b,h,i,:].K[b,h,j,:]) V[b,h,j,:]; tensors contiguous [B,H,S|T,E].
// ABI: backends/ABI.md.  dims = (B, H, S, T, E); ptrs = (q, k, v, o).
{tma_prelude}#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <exception>
{tma_hook}
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/kernel_hardware_info.h"
#include "cute/tensor.hpp"
{types}
using kspec_gen::Kernel;

#if defined(KSPEC_DEVICE)
extern "C" __global__ void __launch_bounds__(Kernel::MaxThreadsPerBlock, Kernel::MinBlocksPerMultiprocessor)
kspec_kernel(CUTLASS_GRID_CONSTANT typename Kernel::Params const params) {{
  extern __shared__ char smem[];
  Kernel op;
  op(params, smem);
}}
#endif  // KSPEC_DEVICE

#if defined(KSPEC_HOST)
#include <cuda_runtime.h>
{tma_host}
namespace {{
using namespace kspec_gen;

constexpr int kHeadDim = cute::get<2>(TileShape{{}});
constexpr bool kNeedsScalar = {needs_scalar};

struct KspecProblem {{
  int B, H, S, T, E;
  int device, sm_count;
}};

int kspec_fail(char* err, uint64_t err_cap, const char* fmt, long long a = 0, long long b = 0) {{
  if (err != nullptr && err_cap > 0) {{
    std::snprintf(err, static_cast<size_t>(err_cap), fmt, a, b);
  }}
  return 1;
}}

// Checks every size constraint of the kernel; 0 on success.
int kspec_problem(const int64_t* dims, KspecProblem& p, char* err, uint64_t err_cap) {{
  static const char* const names[5] = {{"B", "H", "S", "T", "E"}};
  if (dims == nullptr) return kspec_fail(err, err_cap, "dims is NULL");
  for (int i = 0; i < 5; ++i) {{
    if (dims[i] < 1 || dims[i] > INT32_MAX) {{
      if (err != nullptr && err_cap > 0) {{
        std::snprintf(err, static_cast<size_t>(err_cap), "attention size %s = %lld is out of range [1, 2^31)",
                      names[i], static_cast<long long>(dims[i]));
      }}
      return 1;
    }}
  }}
  const int64_t B = dims[0], H = dims[1], S = dims[2], T = dims[3], E = dims[4];
  if (E != kHeadDim)
    return kspec_fail(err, err_cap, "head dim E = %lld, but this kernel was compiled for E = %lld", E, kHeadDim);
  if (H * S * E > INT32_MAX || H * T * E > INT32_MAX || B * H * S > INT32_MAX)
    return kspec_fail(err, err_cap, "attention too large for 32-bit strides (H*S*E = %lld, H*T*E = %lld)",
                      H * S * E, H * T * E);
  if (B > 65535 || H > 65535)
    return kspec_fail(err, err_cap, "B = %lld and H = %lld must both be <= 65535 (grid limit)", B, H);
  if (S % kSeqAlignment != 0)
    return kspec_fail(err, err_cap, "the sm90a fused attention kernel needs S %% %lld == 0, got S = %lld",
                      kSeqAlignment, S);
  p = KspecProblem{{int(B), int(H), int(S), int(T), int(E), 0, 0}};
  return 0;
}}

uint64_t kspec_lse_bytes(KspecProblem const& p) {{
  if (!kWritesLse) return 0;
  uint64_t bytes = uint64_t(p.B) * uint64_t(p.H) * uint64_t(p.S) * sizeof(float);
  return (bytes + 255) & ~uint64_t(255);
}}
{host}
}}  // namespace

extern "C" __attribute__((visibility("default")))
int kspec_abi_version(void) {{ return {abi}; }}

extern "C" __attribute__((visibility("default")))
int kspec_workspace_size(const int64_t* dims, int32_t device, int32_t sm_count,
                         uint64_t* bytes, char* err, uint64_t err_cap) {{
  try {{
    KspecProblem p;
    if (kspec_problem(dims, p, err, err_cap) != 0) return 1;
    p.device = device;
    p.sm_count = sm_count;  // the same hardware info kspec_prepare will see
    if (bytes == nullptr) return kspec_fail(err, err_cap, "bytes is NULL");
    Kernel::Arguments args = kspec_make_args(p, nullptr, 1.0f, nullptr);
    *bytes = kspec_lse_bytes(p) + uint64_t(Kernel::get_workspace_size(args));
    return 0;
  }} catch (std::exception const&) {{
    return kspec_fail(err, err_cap, "kspec_workspace_size: C++ exception");
  }} catch (...) {{
    return kspec_fail(err, err_cap, "kspec_workspace_size: unknown C++ exception");
  }}
}}

extern "C" __attribute__((visibility("default")))
int kspec_prepare(const int64_t* dims, void* const* ptrs, const double* scalars,
                  void* workspace, int32_t device, int32_t sm_count,
                  void* params, uint64_t params_cap, uint64_t* params_size,
                  uint32_t grid[3], uint32_t block[3], uint32_t cluster[3],
                  uint32_t* smem_bytes, char* err, uint64_t err_cap) {{
  try {{
    KspecProblem p;
    if (kspec_problem(dims, p, err, err_cap) != 0) return 1;
    p.device = device;
    p.sm_count = sm_count;
    if (ptrs == nullptr) return kspec_fail(err, err_cap, "ptrs is NULL");
    static const char* const arg_names[4] = {{"q", "k", "v", "o"}};
    for (int i = 0; i < 4; ++i) {{
      uintptr_t a = reinterpret_cast<uintptr_t>(ptrs[i]);
      if (a == 0 || a % 16 != 0) {{
        if (err != nullptr && err_cap > 0) {{
          std::snprintf(err, static_cast<size_t>(err_cap),
                        "argument #%d (attention tensor %s) must be a non-NULL device pointer aligned to 16 bytes",
                        i, arg_names[i]);
        }}
        return 1;
      }}
    }}
    if (kNeedsScalar && scalars == nullptr) return kspec_fail(err, err_cap, "scalars is NULL");
    const double scale_d = kNeedsScalar ? scalars[0] : 1.0;
    const float scale = {scale_expr};  // runtime scalar or folded constant
    (void)scale_d;
    if (!(std::isfinite(scale) && scale > 0.0f))
      return kspec_fail(err, err_cap, "the fused attention kernel needs a positive finite scale");
    const uint64_t lse_bytes = kspec_lse_bytes(p);
    if (lse_bytes != 0 && (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 256 != 0))
      return kspec_fail(err, err_cap, "workspace of %lld bytes (256-byte aligned) is required", (long long)lse_bytes);
    if (params == nullptr || params_size == nullptr || grid == nullptr || block == nullptr ||
        cluster == nullptr || smem_bytes == nullptr)
      return kspec_fail(err, err_cap, "kspec_prepare: NULL output pointer");
    if (sizeof(Kernel::Params) > params_cap)
      return kspec_fail(err, err_cap, "params buffer too small: need %lld bytes, have %lld",
                        (long long)sizeof(Kernel::Params), (long long)params_cap);

    // CUTLASS encodes TMA descriptors through the driver entry point; without a driver it would
    // leave them garbage, so fail cleanly first.
    if (kspec_tensor_map_encoder() == nullptr) {{
      if (err != nullptr && err_cap > 0) {{
        std::snprintf(err, static_cast<size_t>(err_cap),
                      "CUDA driver entry point cuTensorMapEncodeTiled unavailable; a CUDA driver is required");
      }}
      return 1;
    }}

    char* ws = static_cast<char*>(workspace);
    Kernel::Arguments args = kspec_make_args(p, ptrs, scale, ws);
    if (!Kernel::can_implement(args))
      return kspec_fail(err, err_cap, "CUTLASS FMHA can_implement() rejected B=%lld, H=%lld and these "
                        "sequence lengths", p.B, p.H);
    void* kernel_ws = Kernel::get_workspace_size(args) ? static_cast<void*>(ws + lse_bytes) : nullptr;
    // both FMHA kernels initialise nothing (no stream work); the status still reaches the caller
    const cutlass::Status init = Kernel::initialize_workspace(args, kernel_ws, nullptr);
    if (init != cutlass::Status::kSuccess) {{
      if (err != nullptr && err_cap > 0)
        std::snprintf(err, static_cast<size_t>(err_cap), "CUTLASS FMHA initialize_workspace failed: %s",
                      cutlass::cutlassGetStatusString(init));
      return 1;
    }}
    kspec_tma::reset();
    Kernel::Params kp = Kernel::to_underlying_arguments(args, kernel_ws);
{tma_check}    kspec_fix_params(kp, scale);

    std::memcpy(params, &kp, sizeof(kp));
    *params_size = sizeof(kp);
    dim3 g = Kernel::get_grid_shape(kp);
    dim3 b = Kernel::get_block_shape();
    grid[0] = g.x; grid[1] = g.y; grid[2] = g.z;
    block[0] = b.x; block[1] = b.y; block[2] = b.z;
    cluster[0] = cute::size<0>(typename Kernel::ClusterShape{{}});
    cluster[1] = cute::size<1>(typename Kernel::ClusterShape{{}});
    cluster[2] = cute::size<2>(typename Kernel::ClusterShape{{}});
    *smem_bytes = static_cast<uint32_t>(Kernel::SharedStorageSize);
    return 0;
  }} catch (std::exception const&) {{
    return kspec_fail(err, err_cap, "kspec_prepare: C++ exception");
  }} catch (...) {{
    return kspec_fail(err, err_cap, "kspec_prepare: unknown C++ exception");
  }}
}}
#endif  // KSPEC_HOST
"""
