// A CPU emulation of the CUDA features a generated row kernel (backends/rowwise.py) uses, so the
// tests can run the generated kernel text itself on a machine without a GPU.
//
// Compiled with g++ together with the generated source (-DKSPEC_HOST -DKSPEC_EMULATE), it exports
// kspec_emu_run(): kspec_prepare() chooses the launch exactly as on a GPU, then every CTA of one
// cluster runs at once, one std::thread per CUDA thread.  __syncthreads is a barrier of the CTA,
// __shfl_xor_sync a barrier-separated exchange among the 32 threads of a warp, cluster.sync a
// barrier of the cluster, and map_shared_rank maps an address into another CTA's shared memory.
// Shared memory (static and dynamic) lives in a per-CTA arena.  "Device pointers" are host memory.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#include <vector_types.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#ifndef __device__
#define __device__
#endif
#ifndef __forceinline__
#define __forceinline__ inline
#endif
#define KSPEC_ENTRY static void
#define KSPEC_SHARED(type, name, dims) \
  type (&name) dims = *reinterpret_cast<type (*) dims>(kspec_emu::alloc_static(sizeof(type dims)))
#define KSPEC_SHARED_DYNAMIC(name) unsigned char* name = kspec_emu::tls.cta->dynamic.data()

struct kspec_dim3 { unsigned x = 0, y = 0, z = 0; };

namespace kspec_emu {
struct Cluster;
struct Cta {
  std::vector<unsigned char> arena = std::vector<unsigned char>(1 << 16);
  std::vector<unsigned char> dynamic;
  std::unique_ptr<std::barrier<>> bar;
  std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
  std::vector<float> warp_slot;          // 32 floats per warp
  Cluster* cluster = nullptr;
  unsigned rank = 0;
};
struct Cluster {
  std::vector<Cta*> ctas;
  std::unique_ptr<std::barrier<>> bar;
};
struct Thread {
  kspec_dim3 tid, bid, bdim, gdim;
  Cta* cta = nullptr;
  size_t bump = 0;
  int warp = 0, lane = 0;
};
inline thread_local Thread tls;

inline void* alloc_static(size_t bytes) {
  size_t off = tls.bump;
  tls.bump += (bytes + 15) / 16 * 16;
  return tls.cta->arena.data() + off;
}
}  // namespace kspec_emu

#define threadIdx (kspec_emu::tls.tid)
#define blockIdx (kspec_emu::tls.bid)
#define blockDim (kspec_emu::tls.bdim)
#define gridDim (kspec_emu::tls.gdim)

inline void __syncthreads() { kspec_emu::tls.cta->bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
  auto& t = kspec_emu::tls;
  float* slot = &t.cta->warp_slot[t.warp * 32];
  slot[t.lane] = v;
  t.cta->warp_bar[t.warp]->arrive_and_wait();
  float r = slot[t.lane ^ off];
  t.cta->warp_bar[t.warp]->arrive_and_wait();
  return r;
}
template <typename T> inline T __ldg(const T* p) { return *p; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

namespace cg {
struct cluster_group {
  void sync() const { kspec_emu::tls.cta->cluster->bar->arrive_and_wait(); }
  unsigned block_rank() const { return kspec_emu::tls.cta->rank; }
  template <typename T> T* map_shared_rank(T* addr, int rank) const {
    auto* own = kspec_emu::tls.cta;
    auto* other = own->cluster->ctas[rank];
    auto off = reinterpret_cast<unsigned char*>(addr) - own->arena.data();
    return reinterpret_cast<T*>(other->arena.data() + off);
  }
};
inline cluster_group this_cluster() { return {}; }
}  // namespace cg
