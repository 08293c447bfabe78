"""The CUDA source of a plain-CUDA kernel (backends/generic) and its host glue, following
backends/ABI.md: a `Params` struct by value, `kspec_kernel`, `kspec_prepare` (which picks the vector
path's width at launch).  GLUE_ABI and GLUE_PREPARE_OPEN are shared with the row kernels."""
from __future__ import annotations

from kspec.backends.desc import EmittedKernel
from kspec.backends.generic.gen import BLOCK, GenericDesc
from kspec.core import ABI_VERSION, check_ident

_PRELUDE = r"""#include <cstdint>
#include <cstdio>
#include <cstring>
#include <climits>
#include <cmath>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

struct Params {
  void* ptr[%(nptr)d];
  long long dim[%(ndim)d];
  double scalar[%(nscalar)d];
  long long count;   // elements of the iteration space
  int vec;           // elements per thread of the vector path (%(vec)s), 0: one element per thread
  int idx32;         // 1: count fits 32 bits, indices are decoded in 32-bit arithmetic
};
"""

_DEVICE = r"""
#if defined(KSPEC_DEVICE)
__device__ __forceinline__ float kspec_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float kspec_min(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ long long kspec_max(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ long long kspec_min(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ float kspec_abs(float a) { return fabsf(a); }
__device__ __forceinline__ long long kspec_abs(long long a) { return a < 0 ? -a : a; }
__device__ __forceinline__ float kspec_div(float a, float b) { return a / b; }
__device__ __forceinline__ long long kspec_div(long long a, long long b) { return b == 0 ? 0 : a / b; }
__device__ __forceinline__ long long kspec_floordiv(long long a, long long b) {
  if (b == 0) return 0;
  long long q = a / b;
  return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ long long kspec_mod(long long a, long long b) { return a - b * kspec_floordiv(a, b); }
__device__ __forceinline__ long long kspec_sat(long long v, long long lo, long long hi) { return v < lo ? lo : v > hi ? hi : v; }
__device__ __forceinline__ long long kspec_sat(float v, long long lo, long long hi) {
  return kspec_sat((long long)rintf(fminf(fmaxf(v, (float)lo), (float)hi)), lo, hi);
}
#ifndef KSPEC_ASSUME
#if defined(__CUDA_ARCH__)
#define KSPEC_ASSUME(c) __builtin_assume(c)
#else
#define KSPEC_ASSUME(c) ((void)0)
#endif
#endif
// the vector path's 128-bit moves between a 16-byte aligned array and 16-byte aligned memory
template <typename T, int N> __device__ __forceinline__ void kspec_ld128(T (&dst)[N], const T* src) {
  static_assert(sizeof(dst) %% 16 == 0, "whole 16-byte words");
  KSPEC_ASSUME(((uintptr_t)src & 15) == 0);
#pragma unroll
  for (int k = 0; k < (int)(sizeof(dst) / 16); ++k)
    reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(src)[k];
}
// one 16-byte word (a gather's window)
template <typename T> __device__ __forceinline__ void kspec_ldw(T* dst, const T* src) {
  KSPEC_ASSUME(((uintptr_t)src & 15) == 0);
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
// floor division and, for a window gather reading element floor((a j + c) / d) for j < n in words
// of w elements, the elements j that lie in word k (compile-time constants once unrolled)
__host__ __device__ constexpr int kspec_fdiv(int a, int b) { return a / b - ((a %% b != 0) && ((a < 0) != (b < 0))); }
__host__ __device__ constexpr unsigned int kspec_word_mask(int n, int a, int c, int d, int w, int k) {
  unsigned int m = 0;
  for (int j = 0; j < n; ++j) if (kspec_fdiv(kspec_fdiv(a * j + c, d), w) == k) m |= 1u << j;
  return m;
}
template <typename T, int N> __device__ __forceinline__ void kspec_st128(T* dst, const T (&src)[N]) {
  static_assert(sizeof(src) %% 16 == 0, "whole 16-byte words");
  KSPEC_ASSUME(((uintptr_t)dst & 15) == 0);
#pragma unroll
  for (int k = 0; k < (int)(sizeof(src) / 16); ++k) {
    const uint4 w = reinterpret_cast<const uint4*>(src)[k];
#if defined(__CUDA_ARCH__)
    // spelt out: nvcc 13 splits a plain uint4 store of a local array into 32-bit stores on sm_90a
    asm volatile("st.global.v4.b32 [%%0], {%%1, %%2, %%3, %%4};"
                 :: "l"(__cvta_generic_to_global(reinterpret_cast<uint4*>(dst) + k)),
                 "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w) : "memory");
#else
    reinterpret_cast<uint4*>(dst)[k] = w;
#endif
  }
}

%(vector)s
extern "C" __global__ void __launch_bounds__(%(block)d) kspec_kernel(const Params p) {
%(body)s
}
#endif  // KSPEC_DEVICE
"""

# The host glue every plain-CUDA generator shares (backends/ABI.md; `%`-templates over the generator's
# sizes: abi, nptr_real, ndim_real, nscalar_real): the ABI version, an empty workspace, and the
# opening of kspec_prepare that fills a `Params` of pointers, dims and scalars.
GLUE_ABI = r"""extern "C" int kspec_abi_version(void) { return %(abi)d; }

extern "C" int kspec_workspace_size(const int64_t* dims, int32_t device, int32_t sm_count,
                                    uint64_t* bytes, char* err, uint64_t err_cap) {
  (void)dims; (void)device; (void)sm_count; (void)err; (void)err_cap;
  *bytes = 0;
  return 0;
}
"""

GLUE_PREPARE_OPEN = r"""extern "C" int kspec_prepare(const int64_t* dims, void* const* ptrs, const double* scalars,
                             void* workspace, int32_t device, int32_t sm_count,
                             void* params, uint64_t params_cap, uint64_t* params_size,
                             uint32_t grid[3], uint32_t block[3], uint32_t cluster[3],
                             uint32_t* smem_bytes, char* err, uint64_t err_cap) {
  (void)workspace; (void)device; (void)sm_count;
  Params p;
  std::memset(&p, 0, sizeof(p));
  for (int i = 0; i < %(nptr_real)d; ++i) {
    if (ptrs[i] == nullptr) { std::snprintf(err, err_cap, "tensor argument %%d is a null pointer", i); return 1; }
    p.ptr[i] = ptrs[i];
  }
  for (int i = 0; i < %(ndim_real)d; ++i) {
    if (dims[i] < 0) { std::snprintf(err, err_cap, "size %%d is negative", i); return 1; }
    p.dim[i] = dims[i];
  }
  for (int i = 0; i < %(nscalar_real)d; ++i) p.scalar[i] = scalars[i];
"""


_HOST = r"""
#if defined(KSPEC_HOST)
""" + GLUE_ABI + r"""
""" + GLUE_PREPARE_OPEN + r"""  if (params_cap < sizeof(Params)) { std::snprintf(err, err_cap, "parameter buffer too small"); return 1; }
  p.count = %(threads)s;
  p.idx32 = p.count <= 4294967295LL ? 1 : 0;
  // the widest vector path (%(vec)s elements per thread) the innermost extent is a multiple of, where
  // every pointer it moves 16 bytes at a time is 16-byte aligned; otherwise one element per thread
  p.vec = 0;
%(vec_pick)s  std::memcpy(params, &p, sizeof(Params));
  *params_size = sizeof(Params);
  long long threads = p.vec ? p.count / p.vec : p.count;
  long long blocks = (threads + %(block)d - 1) / %(block)d;
  if (blocks > 2147483647LL) { std::snprintf(err, err_cap, "problem too large for one launch"); return 1; }
  grid[0] = (uint32_t)(blocks > 0 ? blocks : 0); grid[1] = 1; grid[2] = 1;
  block[0] = %(block)d; block[1] = 1; block[2] = 1;
  cluster[0] = 1; cluster[1] = 1; cluster[2] = 1;
  *smem_bytes = 0;
  return 0;
}
#endif  // KSPEC_HOST
"""


def _vector_pick(desc: GenericDesc) -> str:
    """The host's choice of the vector width (C statements over the filled `p`)."""
    if not desc.vec:
        return ""
    aligned = " && ".join(f"((uintptr_t)p.ptr[{desc.args.index(a)}] & 15) == 0" for a in desc.vec_args) or "true"
    out = f"  if ({aligned}) {{\n"
    for k, w in enumerate(desc.vec):
        out += f"    {'if' if k == 0 else 'else if'} (p.dim[{desc.vec_dim[1:]}] % {w} == 0) p.vec = {w};\n"
    return out + "  }\n"


_VECTOR = r"""
// the vector path: VEC consecutive elements along the innermost axis per thread, 128-bit moves;
// index variables of type I (unsigned int where the element count fits 32 bits)
template <int VEC, typename I> __device__ __forceinline__ void kspec_vector(const Params& p) {
%s
}
"""


def emit_generic(desc: GenericDesc) -> EmittedKernel:
    for name in (desc.name, *desc.args, *desc.scalars, *desc.dims):
        check_ident(name, "generated kernel")
    sizes = {"nptr": max(1, len(desc.args)), "ndim": max(1, len(desc.dims)), "nscalar": max(1, len(desc.scalars)),
             "nptr_real": len(desc.args), "ndim_real": len(desc.dims), "nscalar_real": len(desc.scalars),
             "block": BLOCK, "body": desc.body, "threads": desc.threads, "abi": ABI_VERSION,
             "vec": " or ".join(map(str, desc.vec)) or "none", "vec_pick": _vector_pick(desc),
             "vector": _VECTOR % desc.vec_body if desc.vec else ""}
    source = (f"// Generated by kspec: plain CUDA kernel '{desc.name}' for {desc.arch}. Do not edit.\n"
              + _PRELUDE % sizes + _DEVICE % sizes + _HOST % sizes)
    return EmittedKernel(name=desc.name, arch=desc.arch, source=source, include_dirs=(),
                         flags=("-std=c++17", "-O3"), dims=desc.dims, args=desc.args, scalars=desc.scalars,
                         alignment=tuple(zip(desc.args, desc.arg_bytes or (1,) * len(desc.args))),
                         init=desc.init,
                         config=(("kind", "generic"), ("block", str(BLOCK)),
                                 ("vec", ",".join(map(str, desc.vec)) or "-")))
