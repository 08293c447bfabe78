"""The row kernel's CUDA text: the prelude (the `Params` struct), the device helpers and entry
point around a generated body, and the host glue that picks the launch (vector path, cluster size,
threads per row, rows per CTA, shared memory); `emit_rowwise` joins them into an `EmittedKernel`."""
from __future__ import annotations

from kspec.backends.desc import EmittedKernel
from kspec.backends.generic import GLUE_ABI, GLUE_PREPARE_OPEN
from kspec.core import ABI_VERSION, check_ident

from .desc import COLSUM_TX, COLSUM_TY, MAX_CLUSTER, SMEM_BUDGET, V, RowwiseDesc

_PRELUDE = r"""#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#define KSPEC_V %(vec)d

struct Params {
  void* ptr[%(nptr)d];
  long long dim[%(ndim)d];
  double scalar[%(nscalar)d];
  long long rows;     // product of the outer extents
  long long n;        // row length
  long long upr;      // vector steps (or elements) per CTA of a cluster
  long long cap;      // cached elements per row per CTA
  int vec;            // 1: 8-element steps with 128-bit accesses (+ scalar tail)
  int cs;             // CTAs per row (cluster size)
  int cache;          // 1: inputs read in several passes are kept in shared memory
  int pad_;
};
"""

_DEVICE = r"""
#if defined(KSPEC_DEVICE)
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
#define KSPEC_SHARED(type, name, dims) __shared__ type name dims
#define KSPEC_SHARED_DYNAMIC(name) extern __shared__ __align__(16) unsigned char name[]
#define KSPEC_ENTRY extern "C" __global__ void __launch_bounds__(1024)
#endif
// KSPEC_EMULATE: the tests run this kernel on the CPU (tests/rowwise_emu.h supplies the CUDA names)
#if defined(KSPEC_DEVICE) || defined(KSPEC_EMULATE)
template <int N> struct kspec_w { static constexpr int value = N; };
__device__ __forceinline__ long long kspec_minll(long long a, long long b) { return a < b ? a : b; }
// an integer-valued node (a size read as a value, an integer cast) rounded and saturated like the
// generic kernels do; the row kernel carries it as a float
__device__ __forceinline__ long long kspec_sat(long long v, long long lo, long long hi) { return v < lo ? lo : v > hi ? hi : v; }
__device__ __forceinline__ long long kspec_sat(float v, long long lo, long long hi) {
  return kspec_sat((long long)rintf(fminf(fmaxf(v, (float)lo), (float)hi)), lo, hi);
}
__device__ __forceinline__ float kspec_f(float x) { return x; }
__device__ __forceinline__ float kspec_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float kspec_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float kspec_f(__nv_fp8_e4m3 x) { return (float)x; }
__device__ __forceinline__ float kspec_f(__nv_fp8_e5m2 x) { return (float)x; }
template <typename T> __device__ __forceinline__ T kspec_to(float x);
template <> __device__ __forceinline__ float kspec_to<float>(float x) { return x; }
template <> __device__ __forceinline__ __half kspec_to<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 kspec_to<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __nv_fp8_e4m3 kspec_to<__nv_fp8_e4m3>(float x) { return __nv_fp8_e4m3(x); }
template <> __device__ __forceinline__ __nv_fp8_e5m2 kspec_to<__nv_fp8_e5m2>(float x) { return __nv_fp8_e5m2(x); }

// W consecutive elements: 128-bit (or 64-bit) accesses when W elements fill them, else one by one.
template <int W, typename T>
__device__ __forceinline__ void kspec_ld_global(const T* __restrict__ src, T (&dst)[W]) {
  if constexpr ((W * sizeof(T)) %% 16 == 0) {
    #pragma unroll
    for (int i = 0; i < (int)(W * sizeof(T) / 16); ++i)
      reinterpret_cast<uint4*>(dst)[i] = __ldg(reinterpret_cast<const uint4*>(src) + i);
  } else if constexpr (W * sizeof(T) == 8) {
    reinterpret_cast<uint2*>(dst)[0] = __ldg(reinterpret_cast<const uint2*>(src));
  } else {
    #pragma unroll
    for (int i = 0; i < W; ++i) dst[i] = src[i];
  }
}
template <int W, typename T>
__device__ __forceinline__ void kspec_ld_shared(const T* src, T (&dst)[W]) {
  if constexpr ((W * sizeof(T)) %% 16 == 0) {
    #pragma unroll
    for (int i = 0; i < (int)(W * sizeof(T) / 16); ++i)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(__builtin_assume_aligned(src, 16))[i];
  } else if constexpr (W * sizeof(T) == 8) {
    reinterpret_cast<uint2*>(dst)[0] = reinterpret_cast<const uint2*>(__builtin_assume_aligned(src, 8))[0];
  } else {
    #pragma unroll
    for (int i = 0; i < W; ++i) dst[i] = src[i];
  }
}
template <int W, typename T>
__device__ __forceinline__ void kspec_st(T* dst, const T (&src)[W]) {
  if constexpr ((W * sizeof(T)) %% 16 == 0) {
    #pragma unroll
    for (int i = 0; i < (int)(W * sizeof(T) / 16); ++i)
      reinterpret_cast<uint4*>(__builtin_assume_aligned(dst, 16))[i] = reinterpret_cast<const uint4*>(src)[i];
  } else if constexpr (W * sizeof(T) == 8) {
    reinterpret_cast<uint2*>(__builtin_assume_aligned(dst, 8))[0] = reinterpret_cast<const uint2*>(src)[0];
  } else {
    #pragma unroll
    for (int i = 0; i < W; ++i) dst[i] = src[i];
  }
}

KSPEC_ENTRY kspec_kernel(const Params p) {
  KSPEC_SHARED_DYNAMIC(kspec_smem);
  KSPEC_SHARED(float, kspec_red, [32][%(slots)d]);
  KSPEC_SHARED(float, kspec_part, [%(npart)d][%(slots)d]);
  (void)kspec_red; (void)kspec_part;
%(body)s
}
#endif  // KSPEC_DEVICE || KSPEC_EMULATE
"""

_HOST = r"""
#if defined(KSPEC_HOST)
""" + GLUE_ABI + r"""
static const int kspec_vec_checks[][3] = {%(vec_checks)s};   // arg, itemsize, number of stride dims
static const int kspec_vec_strides[] = {%(vec_strides)s};

""" + GLUE_PREPARE_OPEN + r"""  long long rows = 1;
  for (int i = 0; i < %(n_outer)d; ++i) rows *= dims[i];
  const long long n = dims[%(n_outer)d];
  // the vector path: every row-indexed pointer 16-byte aligned, every row stride a multiple of 16 bytes
  int vec = 1;
  int off = 0;
  for (int c = 0; c < (int)(sizeof(kspec_vec_checks) / sizeof(kspec_vec_checks[0])); ++c) {
    const int a = kspec_vec_checks[c][0], item = kspec_vec_checks[c][1], ns = kspec_vec_checks[c][2];
    if (a < 0) continue;
    if (((uintptr_t)ptrs[a]) %% 16 != 0) vec = 0;
    for (int s = 0; s < ns; ++s)
      if ((dims[kspec_vec_strides[off + s]] * item) %% 16 != 0) vec = 0;
    off += ns;
  }
  if (n < KSPEC_V) vec = 0;
  const long long step = vec ? KSPEC_V : 1;
  const long long nunits = n / step;
  const long long cache_bytes = %(cache_bytes)d;      // shared-memory bytes per cached element
#ifndef KSPEC_SMEM_BUDGET
#define KSPEC_SMEM_BUDGET %(budget)d
#endif
  const long long budget = KSPEC_SMEM_BUDGET;
  int cs = 1;
  long long upr = nunits;
  auto cap_of = [&](long long u) { return ((u * step + step) + 15) / 16 * 16; };
  while (cache_bytes > 0 && cs < %(max_cluster)d && cap_of(upr) * cache_bytes > budget) {
    cs *= 2;
    upr = (nunits + cs - 1) / cs;
  }
  int cache = cache_bytes > 0 && cap_of(upr) * cache_bytes <= budget;
  if (!cache) { cs = 1; upr = nunits; }
  long long tx = 32;
  while (tx < 1024 && tx * 4 < upr) tx *= 2;
  long long ty = 1;
  if (cs == 1) {
    while (tx * ty < 128 && (!cache || 2 * ty * cap_of(upr) * cache_bytes <= budget)) ty *= 2;
  }
  p.rows = rows; p.n = n; p.upr = upr; p.cap = cache ? cap_of(upr) : 0;
  p.vec = vec; p.cs = cs; p.cache = cache;
  if (params_cap < sizeof(Params)) { std::snprintf(err, err_cap, "parameter buffer too small"); return 1; }
  std::memcpy(params, &p, sizeof(Params));
  *params_size = sizeof(Params);
%(blocks)s
  if (blocks > 2147483647LL) { std::snprintf(err, err_cap, "too many rows for one launch"); return 1; }
  grid[0] = (uint32_t)blocks; grid[1] = 1; grid[2] = 1;
  block[0] = (uint32_t)tx; block[1] = (uint32_t)ty; block[2] = 1;
  cluster[0] = (uint32_t)cs; cluster[1] = 1; cluster[2] = 1;
  *smem_bytes = (uint32_t)(cache ? ty * p.cap * cache_bytes : 0);
  return 0;
}
#endif  // KSPEC_HOST
"""


# Column partials: the kernel grid-strides over the rows with one thread row per row slot, at most
# P slots (the partials buffer's rows), fewer when fewer CTAs are resident at once (a second wave
# would do all of its rows after the first: twice the time).  Residency is estimated from the SM
# count, the threads per CTA (1024 per SM: __launch_bounds__(1024) lets a thread take 64 of the 64K
# registers) and the shared memory per CTA (227 KiB per SM on sm_90 and sm_100).
_SLOT_BLOCKS = r"""  long long slots = %(slots)d;
  if (slots %% ty) { std::snprintf(err, err_cap, "row slots not a multiple of the rows per CTA"); return 1; }
  if (sm_count > 0) {
    const long long cta_smem = (cache ? ty * cap_of(upr) * cache_bytes : 0) + 2048;
    long long per_sm = 1024 / (tx * ty);
    if (per_sm > 32) per_sm = 32;
    if ((227LL << 10) / cta_smem < per_sm) per_sm = (227LL << 10) / cta_smem;
    if (per_sm < 1) per_sm = 1;
    const long long resident = (long long)sm_count * per_sm / cs * ty;     // thread rows at once
    if (resident < slots) slots = resident / ty * ty > 0 ? resident / ty * ty : ty;
  }
  const long long blocks = slots / ty * cs;   // the row slots: the kernel grid-strides over the rows"""


def emit_rowwise(desc: RowwiseDesc) -> EmittedKernel:
    for name in (desc.name, *desc.args, *desc.scalars, *desc.dims):
        check_ident(name, "generated row kernel")
    checks, strides = [], []
    for arg, item, sds in desc.vec_checks:
        checks.append(f"{{{arg}, {item}, {len(sds)}}}")
        strides.extend(sds)
    sizes = {"nptr": max(1, len(desc.args)), "ndim": max(1, len(desc.dims)), "nscalar": max(1, len(desc.scalars)),
             "nptr_real": len(desc.args), "ndim_real": len(desc.dims), "nscalar_real": len(desc.scalars),
             "vec": V, "body": desc.body, "slots": max(1, desc.n_slots), "npart": max(1, desc.n_passes),
             "n_outer": desc.n_outer, "vec_checks": ", ".join(checks) or "{-1, 0, 0}",
             "vec_strides": ", ".join(map(str, strides)) or "-1", "cache_bytes": desc.cache_bytes,
             "budget": SMEM_BUDGET, "max_cluster": MAX_CLUSTER, "abi": ABI_VERSION,
             "colsum_tx": COLSUM_TX, "colsum_ty": COLSUM_TY, "npart_sums": max(1, desc.n_slots)}
    if desc.slots:
        sizes["blocks"] = _SLOT_BLOCKS % {"slots": desc.slots}
    else:
        sizes["blocks"] = "  const long long blocks = (rows + ty - 1) / ty * cs;"
    host = (_HOST_COLSUM if desc.kind == "colsum" else _HOST) % sizes
    source = (f"// Generated by kspec: row kernel '{desc.name}' for {desc.arch}. Do not edit.\n"
              + _PRELUDE % sizes + _DEVICE % sizes + host)
    return EmittedKernel(name=desc.name, arch=desc.arch, source=source, include_dirs=(),
                         flags=("-std=c++17", "-O3"), dims=desc.dims, args=desc.args, scalars=desc.scalars,
                         alignment=tuple(zip(desc.args, desc.arg_bytes or (1,) * len(desc.args))),
                         config=_config(desc))


def _config(desc: RowwiseDesc) -> tuple[tuple[str, str], ...]:
    if desc.kind == "colsum":
        return (("kind", "colsum"), ("partial rows", str(desc.slots)), ("block", f"{COLSUM_TX}x{COLSUM_TY}"))
    out = (("kind", "rowwise"), ("passes", str(desc.n_passes)), ("vector", f"{V} elements"),
           ("cluster", f"up to {MAX_CLUSTER} CTAs per row"))
    return out + ((("column partials", f"up to {desc.slots} row slots"),) if desc.slots else ())


# The finishing kernel of column partials (colsum.py): 32 columns per CTA, its TY thread rows split
# the partial rows and fold through shared memory in a fixed order.
_HOST_COLSUM = r"""
#if defined(KSPEC_HOST)
""" + GLUE_ABI + GLUE_PREPARE_OPEN + r"""  const long long n = dims[0];
  p.rows = n; p.n = n; p.upr = 0; p.cap = 0; p.vec = 0; p.cs = 1; p.cache = 0;
  if (params_cap < sizeof(Params)) { std::snprintf(err, err_cap, "parameter buffer too small"); return 1; }
  std::memcpy(params, &p, sizeof(Params));
  *params_size = sizeof(Params);
  const long long blocks = (n + %(colsum_tx)d - 1) / %(colsum_tx)d;
  if (blocks > 2147483647LL) { std::snprintf(err, err_cap, "too many columns for one launch"); return 1; }
  grid[0] = (uint32_t)(blocks > 0 ? blocks : 1); grid[1] = 1; grid[2] = 1;
  block[0] = %(colsum_tx)d; block[1] = %(colsum_ty)d; block[2] = 1;
  cluster[0] = 1; cluster[1] = 1; cluster[2] = 1;
  *smem_bytes = (uint32_t)(%(colsum_ty)d * %(colsum_tx)d * %(npart_sums)d * sizeof(float));
  return 0;
}
#endif  // KSPEC_HOST
"""
