"""A tiny real artifact built from plain CUDA kernels that follow backends/ABI.md, for the
runtime's tests and for a device smoke test: `python -m kspec.runtime.selftest` (needs nvcc, a
C++ compiler and an sm_90a/sm_100a GPU; exits 0 when every check passes).

Kernels of the fixture artifact:
- `scale_add(A: f32[M, N], B: f32[M, N] col, *, D=None, rmax=None, alpha: f32 = 2.0)`:
  D = alpha * A + B and rmax[m] = max_n D[m, n] (an atomic max, so `rmax` has init neg_inf);
  asks for 64 KiB of dynamic shared memory to exercise the opt-in attribute.
- `two_step(X: f32[N], *, Y=None, scale: f32 (required), shift: f32 = 1.0)`: two plans through
  an intermediate t = scale * X + 0.0, then Y = 1.0 * t + shift (constant scalars in the manifest).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kspec.artifact import (KernelEntry, Manifest, ParamSpec, Plan, SpecRef, TensorSpec, make_binary,
                            write_manifest)

SCALE_ADD_SRC = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>
struct Params { const float* A; const float* B; float* D; float* rmax; int64_t M, N; float alpha; };
#ifdef KSPEC_DEVICE
__device__ void atomic_max_f32(float* addr, float v) {
  // ordered-int trick: non-negative floats order as ints, negative ones reversed as unsigned
  if (v >= 0.f) atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
  else atomicMin(reinterpret_cast<unsigned*>(addr), __float_as_uint(v));
}
extern "C" __global__ void __launch_bounds__(128) kspec_kernel(const Params p) {
  extern __shared__ float smem[];
  int64_t m = blockIdx.y;
  int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  smem[threadIdx.x] = 0.f;   // touch the dynamic smem the launch provides
  if (m < p.M && n < p.N) {
    float v = p.alpha * p.A[m * p.N + n] + p.B[n * p.M + m] + smem[threadIdx.x];
    p.D[m * p.N + n] = v;
    atomic_max_f32(&p.rmax[m], v);
  }
}
#endif
#ifdef KSPEC_HOST
extern "C" int kspec_abi_version(void) { return 3; }
extern "C" int kspec_workspace_size(const int64_t* dims, int32_t device, int32_t sm_count,
                                    uint64_t* bytes, char* err, uint64_t err_cap) {
  (void)dims; (void)device; (void)sm_count; (void)err; (void)err_cap; *bytes = 0; return 0;
}
extern "C" int kspec_prepare(const int64_t* dims, void* const* ptrs, const double* scalars,
                             void* workspace, int32_t device, int32_t sm_count,
                             void* params, uint64_t params_cap, uint64_t* params_size,
                             uint32_t grid[3], uint32_t block[3], uint32_t cluster[3],
                             uint32_t* smem_bytes, char* err, uint64_t err_cap) {
  (void)workspace; (void)device; (void)sm_count;
  if (params_cap < sizeof(Params)) { snprintf(err, err_cap, "params buffer too small"); return 1; }
  if (dims[0] > 65535) { snprintf(err, err_cap, "M = %lld exceeds the grid's y limit 65535", (long long)dims[0]); return 2; }
  Params p = {(const float*)ptrs[0], (const float*)ptrs[1], (float*)ptrs[2], (float*)ptrs[3],
              dims[0], dims[1], (float)scalars[0]};
  memcpy(params, &p, sizeof p);
  *params_size = sizeof p;
  grid[0] = (uint32_t)((dims[1] + 127) / 128); grid[1] = (uint32_t)dims[0]; grid[2] = 1;
  block[0] = 128; block[1] = 1; block[2] = 1;
  cluster[0] = cluster[1] = cluster[2] = 1;
  *smem_bytes = 64 * 1024;
  return 0;
}
#endif
"""

AFFINE_SRC = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>
struct Params { const float* x; float* y; int64_t n; float a, b; };
#ifdef KSPEC_DEVICE
extern "C" __global__ void kspec_kernel(const Params p) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < p.n) p.y[i] = p.a * p.x[i] + p.b;
}
#endif
#ifdef KSPEC_HOST
extern "C" int kspec_abi_version(void) { return 3; }
extern "C" int kspec_workspace_size(const int64_t* dims, int32_t device, int32_t sm_count,
                                    uint64_t* bytes, char* err, uint64_t err_cap) {
  (void)dims; (void)device; (void)sm_count; (void)err; (void)err_cap;
  *bytes = 256; return 0;   // unused; exercises the workspace path
}
extern "C" int kspec_prepare(const int64_t* dims, void* const* ptrs, const double* scalars,
                             void* workspace, int32_t device, int32_t sm_count,
                             void* params, uint64_t params_cap, uint64_t* params_size,
                             uint32_t grid[3], uint32_t block[3], uint32_t cluster[3],
                             uint32_t* smem_bytes, char* err, uint64_t err_cap) {
  (void)device; (void)sm_count;
  if (params_cap < sizeof(Params)) { snprintf(err, err_cap, "params buffer too small"); return 1; }
  if (workspace == NULL) { snprintf(err, err_cap, "workspace missing"); return 3; }
  Params p = {(const float*)ptrs[0], (float*)ptrs[1], dims[0], (float)scalars[0], (float)scalars[1]};
  memcpy(params, &p, sizeof p);
  *params_size = sizeof p;
  grid[0] = (uint32_t)((dims[0] + 255) / 256); grid[1] = 1; grid[2] = 1;
  block[0] = 256; block[1] = 1; block[2] = 1;
  cluster[0] = cluster[1] = cluster[2] = 1;
  *smem_bytes = 0;
  return 0;
}
#endif
"""

SOURCES = {"scale_add_0": SCALE_ADD_SRC, "affine": AFFINE_SRC}

# The semantics of the fixture's kernels as a spec, so `kspec selftest` can compare them with the reference.
FIXTURE_SPEC = """# plain-CUDA runtime fixture (kspec.runtime.selftest)
kernel scale_add {
  in  A : f32[M, N]
  in  B : f32[M, N] col
  param alpha : f32 = 2.0
  out D : f32[M, N]
  out rmax : f32[M]

  D[m, n] = alpha * A[m, n] + B[m, n]
  rmax[m] = max(n) D[m, n]
}

kernel two_step {
  in  X : f32[N]
  param scale : f32
  param shift : f32 = 1.0
  out Y : f32[N]

  t[n] = scale * X[n]
  Y[n] = t[n] + shift
}
"""


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")


def find_cxx() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build_fixture(out: str | os.PathLike, archs: tuple[str, ...] = ("sm90a",), *, nvcc: str = "nvcc",
                  fake_cubins: bool = False) -> Path:
    """Write the fixture artifact into `out` and return it.  Host glue is built with the C++
    compiler (the sources need no CUDA headers under KSPEC_HOST); cubins with nvcc, or, with
    `fake_cubins`, placeholder bytes (for tests that never launch)."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    cxx = find_cxx()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    bins: dict[str, dict[str, object]] = {name: {} for name in SOURCES}
    for name, src in SOURCES.items():
        cu = d / f"{name}.cu"
        cu.write_text(src)
        host0 = d / f"{name}.{archs[0]}.so"
        _run([cxx, "-x", "c++", "-DKSPEC_HOST", "-O2", "-fPIC", "-shared", "-o", str(host0), str(cu)])
        for arch in archs:
            host = d / f"{name}.{arch}.so"
            if host != host0:
                shutil.copyfile(host0, host)
            cubin = d / f"{name}.{arch}.cubin"
            if fake_cubins:
                cubin.write_bytes(b"not a cubin: " + name.encode())
            else:
                _run([nvcc, "-cubin", f"-arch=sm_{arch[2:]}", "-DKSPEC_DEVICE", "-O3", "-o", str(cubin), str(cu)])
            bins[name][arch] = make_binary(d, cubin.name, host.name, config={"kind": "plain-cuda"})
    f32 = "f32"
    scale_add = KernelEntry(
        name="scale_add",
        inputs=(TensorSpec("A", f32, ("M", "N")), TensorSpec("B", f32, ("M", "N"), "col")),
        outputs=(TensorSpec("D", f32, ("M", "N")), TensorSpec("rmax", f32, ("M",))),
        params=(ParamSpec("alpha", f32, 2.0),),
        plans=(Plan("scale_add_0", "elementwise", (("M", "M"), ("N", "N")), ("A", "B", "D", "rmax"),
                    ("alpha",), {"rmax": "neg_inf"}, {"A": 16, "B": 16, "D": 16},
                    dict(bins["scale_add_0"])),))
    two_step = KernelEntry(
        name="two_step",
        inputs=(TensorSpec("X", f32, ("N",)),),
        outputs=(TensorSpec("Y", f32, ("N",)),),
        params=(ParamSpec("scale", f32, None), ParamSpec("shift", f32, 1.0)),
        intermediates=(TensorSpec("t", f32, ("N",)),),
        plans=(Plan("two_step_0", "elementwise", (("d0", "N"),), ("X", "t"), ("scale", 0.0), {}, {},
                    dict(bins["affine"])),
               Plan("two_step_1", "elementwise", (("d0", "N"),), ("t", "Y"), (1.0, "shift"), {}, {},
                    dict(bins["affine"]))))
    spec = d / "fixture.kspec"
    spec.write_text(FIXTURE_SPEC)
    from kspec.artifact import sha256_file
    manifest = Manifest(spec=SpecRef("fixture.kspec", sha256_file(spec)), archs=tuple(archs),
                        kernels=(scale_add, two_step), toolchain={"nvcc": "fixture"})
    write_manifest(d, manifest)
    return d


def _device_arch() -> str | None:
    from kspec.runtime import driver
    drv = driver.get()
    ok, why = drv.available()
    if not ok:
        print(f"selftest: skipped: {why}")
        return None
    major, minor, _, name = drv.facts(0)
    arch = {(9, 0): "sm90a", (10, 0): "sm100a"}.get((major, minor))
    print(f"selftest: cuda:0 = {name}, compute capability {major}.{minor} -> {arch}")
    return arch


def main() -> int:
    import numpy as np
    import kspec
    from kspec.runtime import from_numpy
    arch = _device_arch()
    if arch is None:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        art = build_fixture(Path(tmp) / "fixture", (arch,))
        mod = kspec.load(art)
        rng = np.random.default_rng(0)
        M, N = 48, 200
        A = rng.standard_normal((M, N), dtype=np.float32)
        B = rng.standard_normal((M, N), dtype=np.float32)
        dA = from_numpy(A)
        dB = from_numpy(np.ascontiguousarray(B.T))       # col layout = B^T row-major
        from kspec.runtime import DeviceBuffer
        bB = DeviceBuffer(dB.ptr, (M, N), "f32", strides=(1, M))
        out = mod.scale_add(dA, bB, alpha=0.5)
        D, rmax = out["D"].to_numpy(), out["rmax"].to_numpy()
        ref = 0.5 * A + B
        ok = np.allclose(D, ref, atol=1e-5) and np.allclose(rmax, ref.max(axis=1), atol=1e-5)
        print(f"selftest: scale_add {'ok' if ok else 'MISMATCH'}")
        X = rng.standard_normal(1000, dtype=np.float32)
        y = mod.two_step(from_numpy(X), scale=3.0)["Y"].to_numpy()
        ok2 = np.allclose(y, 3.0 * X + 1.0, atol=1e-5)
        print(f"selftest: two_step {'ok' if ok2 else 'MISMATCH'}")
        return 0 if ok and ok2 else 1


if __name__ == "__main__":
    sys.exit(main())
