"""A threaded CPU emulation of the generic backend's one-dimensional-grid kernels (column and split
reductions): the emitted CUDA source compiled with g++ against a few definitions (__syncthreads as
a std::barrier, atomicAdd as a plain add, since CTAs run one after another and one thread per
output adds), run through its own host glue (kspec_prepare) on numpy arrays.  Used by
tests/test_grad_plans.py, test_fusion_fuzz.py, test_generic_split.py and test_logsumexp.py."""
from __future__ import annotations

import ctypes
import math
import shutil
import subprocess

import numpy as np
import pytest

_COL_EMU = r"""
#include <barrier>
#include <thread>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(n)
#define __shared__ static
struct kspec_u3 { unsigned x, y, z; };
static thread_local kspec_u3 blockIdx, threadIdx, blockDim, gridDim;
static std::barrier<>* kspec_bar;
inline void __syncthreads() { kspec_bar->arrive_and_wait(); }
// CTAs run one after another (so a function-level static is one CTA's shared memory) and only one
// thread per column adds: a plain add is the atomic here
inline float atomicAdd(float* a, float v) { float old = *a; *a = old + v; return old; }
#define KSPEC_DEVICE
#define KSPEC_HOST
"""

_COL_RUN = r"""
extern "C" int kspec_emu_run(const int64_t* dims, void* const* ptrs, const double* scalars, int64_t* launch,
                             char* err, uint64_t cap) {
  alignas(16) unsigned char blob[sizeof(Params)];
  uint64_t size = 0;
  uint32_t grid[3], block[3], cluster[3], smem = 0;
  int rc = kspec_prepare(dims, ptrs, scalars, nullptr, 0, 132, blob, sizeof blob, &size, grid, block, cluster,
                         &smem, err, cap);
  if (rc) return rc;
  Params p;
  std::memcpy(&p, blob, sizeof p);
  launch[0] = grid[0]; launch[1] = block[0];
  for (unsigned b = 0; b < grid[0]; ++b) {
    std::barrier<> bar(block[0]);
    kspec_bar = &bar;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < block[0]; ++t)
      ts.emplace_back([&, b, t] {
        blockIdx = {b, 0, 0}; threadIdx = {t, 0, 0}; blockDim = {block[0], 1, 1}; gridDim = {grid[0], 1, 1};
        kspec_kernel(p);
      });
    for (auto& th : ts) th.join();
  }
  return 0;
}
"""


def emulate(ep, sizes: dict, rng, workdir, scalars=(0.0,), given: dict | None = None):
    """Run emitted plan `ep` (an emit_spec plan) on random inputs at `sizes` (`given`: arrays by
    buffer name to use instead); the buffers it zeroes before launch (EmittedKernel.init) start at 0.
    Returns (arrays by buffer name, names (kernel argument -> buffer), grid size, block size); skips
    without g++ or CUDA headers."""
    from rowwise_harness import cuda_include

    from kspec.numerics import storage_dtype
    if shutil.which("g++") is None or cuda_include() is None:
        pytest.skip("no g++ or CUDA headers")
    names, ir = ep.lowered.names, ep.lowered.ir
    stem = ir.id
    cpp, so = workdir / f"{stem}.cpp", workdir / f"{stem}.so"
    cpp.write_text(_COL_EMU + ep.emitted.source + _COL_RUN)
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", f"-I{cuda_include()}", str(cpp),
                    "-o", str(so)], check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(so))
    zeroed = {names[x] for x, _ in ep.emitted.init}
    arrays = {}
    for a in ep.lowered.desc.args:
        b = ir.buffer(names[a])
        shape = tuple(d if isinstance(d, int) else sizes[d] for d in b.shape)
        if given and names[a] in given:
            arrays[names[a]] = given[names[a]]
            continue
        arrays[names[a]] = np.zeros(shape, np.float32) if names[a] in zeroed else \
            rng.standard_normal(shape).astype(storage_dtype(b.dtype))
    dims = [math.prod(v if isinstance(v, int) else sizes[v] for v in (d if isinstance(d, tuple) else (d,)))
            for _, d in ep.lowered.dims]
    ptrs = [arrays[names[a]].ctypes.data for a in ep.lowered.desc.args]
    launch = (ctypes.c_int64 * 2)()
    err = ctypes.create_string_buffer(256)
    sc = (ctypes.c_double * max(len(scalars), 1))(*scalars)
    rc = lib.kspec_emu_run((ctypes.c_int64 * len(dims))(*dims), (ctypes.c_void_p * len(ptrs))(*ptrs), sc,
                           launch, err, ctypes.c_uint64(256))
    assert rc == 0, err.value
    return arrays, names, launch[0], launch[1]
