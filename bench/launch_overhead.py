"""Host cost of one kspec call (the Python launch path: argument checks, host glue, cuLaunchKernelEx)
against torch's for the same work, on problems too small for the GPU time to matter; with --profile,
where kspec's host time goes (cProfile, top functions by own time).

    python bench/launch_overhead.py [--prebuilt DIR] [--calls 300] [--profile]
    python bench/launch_overhead.py --fake [--prebuilt DIR] [--calls 2000] [--profile]

Per case, three numbers: kspec's host microseconds per call (wall clock over --calls back-to-back
calls, the stream drained once at the end), the same with the index checks on (the default, for the
kernels that have index tensors), and torch's host microseconds per call for an equivalent op.  When
the host cost exceeds the kernel's GPU time, a benchmark that times each call with CUDA events
measures the host, not the kernel.  Needs torch and a CUDA device (else it says so and exits 0).
Nothing here asserts a speed.

--fake: the same three kernels on any machine (no GPU, no torch): kspec's Python path with
DeviceBuffer arguments, outputs allocated by the runtime.  Per case: microseconds per call under
the recording FakeDriver the tests use (its recording, stderr capture and TMA-descriptor checks
included), under a lean stand-in driver (`LeanDriver`: no recording; the host glue still runs and
encodes its descriptors through a do-nothing encoder), so about kspec's own cost plus the glue's,
and Python function calls per call (cProfile, lean driver).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import cuda_torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def per_call_us(torch, fn, calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def cases(torch, prebuilt: Path):
    """(name, artifact stem, kspec arguments, torch equivalent) at small sizes."""
    import kspec
    f16, bf16 = dict(device="cuda", dtype=torch.float16), dict(device="cuda", dtype=torch.bfloat16)
    a, b = torch.randn(256, 256, **f16), torch.randn(256, 256, **f16)
    yield "gemm 256^3 f16", kspec.load(prebuilt / "gemm").gemm, dict(A=a, B=b.T), lambda: a @ b.T
    x, w = torch.randn(256, 1024, **bf16), torch.randn(1024, **bf16)
    mod = kspec.load(prebuilt / "rmsnorm")
    kname = mod.kernels[0]
    names = [t.name for t in mod[kname].entry.inputs]
    yield ("rmsnorm 256x1024 bf16", mod[kname], dict(zip(names, (x, w))),
           lambda: torch.nn.functional.rms_norm(x, (1024,), w))
    q = torch.randn(1, 4, 128, 128, **f16)
    yield ("attention 1x4x128x128 f16", kspec.load(prebuilt / "attention").attention, dict(Q=q, K=q, V=q),
           lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))


# ---------------------------------------------------------------------------- --fake

def fake_cases(prebuilt: Path):
    """(name, artifact, sizes) as in `cases`, for DeviceBuffer arguments."""
    yield "gemm 256^3 f16", prebuilt / "gemm", dict(M=256, N=256, K=256)
    yield "rmsnorm 256x1024 bf16", prebuilt / "rmsnorm", dict(M=256, N=1024)
    yield "attention 1x4x128x128 f16", prebuilt / "attention", dict(B=1, H=4, S=128, T=128)


def lean_driver():
    """A FakeDriver that records nothing: memory comes from one arena (bump-allocated, never
    reused while the run lasts), launches and fills are dropped, and HostGlue.prepare is not
    wrapped; each glue that builds TMA descriptors gets a do-nothing encoder once (`hook`)."""
    import ctypes

    from kspec.runtime.fakedriver import _ENCODE_FN, FakeDriver

    class LeanDriver(FakeDriver):
        ARENA = 256 << 20

        def __init__(self):
            super().__init__()
            self._arena = (ctypes.c_ubyte * (self.ARENA + 256))()
            self._base = (ctypes.addressof(self._arena) + 255) // 256 * 256
            self._next = 0
            self._encode = _ENCODE_FN(lambda *a: 0)
            self._hooked = set()
            self._sizes, self._layouts = {}, {}

        def hook(self, glue) -> None:
            if id(glue) not in self._hooked:
                fn = getattr(glue._lib, "kspec_set_tensor_map_encoder", None)
                if fn is not None:
                    fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_int
                    fn(ctypes.cast(self._encode, ctypes.c_void_p))
                self._hooked.add(id(glue))

        def alloc(self, nbytes, what="a buffer"):
            n = (max(int(nbytes), 1) + 255) // 256 * 256
            if self._next + n > self.ARENA:
                self._next = 0                  # wrap: nothing reads the memory of earlier calls
            ptr = self._base + self._next
            self._next += n
            return ptr

        def free_async(self, ptr, stream):
            pass

        def pointer_device(self, ptr, what):
            return 0

        def param_size(self, func):             # once per function, like the real driver
            if func not in self._sizes:
                self._sizes[func] = super().param_size(func)
            return self._sizes[func]

        def param_layout(self, func):
            if func not in self._layouts:
                self._layouts[func] = super().param_layout(func)
            return self._layouts[func]

        def fill(self, ptr, pattern, width, count, stream, what):
            pass

        def launch(self, func, grid, block, cluster, smem, stream, params_ptr, what, param_offsets=None):
            pass

    return LeanDriver()


def fake_main(args) -> int:
    import cProfile
    import pstats
    import time

    import kspec
    from kspec.artifact import layout_strides
    from kspec.core import extent_value
    from kspec.runtime import driver as _driver
    from kspec.runtime import dtypes
    from kspec.runtime.fakedriver import FakeDriver
    from kspec.runtime.tensors import DeviceBuffer

    def arguments(drv, k, sizes):
        out = {}
        for t in k.inputs:
            shape = tuple(extent_value(e, sizes) for e in t.shape)
            strides = layout_strides(shape, t.layout)
            nbytes = (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * dtypes.itemsize(t.dtype)
            out[t.name] = DeviceBuffer(drv.alloc(nbytes), shape, dtypes.storage(t.dtype), strides=strides)
        return out

    def per_call(fn, kw, calls, drv):
        for _ in range(10):
            fn(**kw)
        t0 = time.perf_counter()
        for i in range(calls):
            fn(**kw)
            if len(getattr(drv, "launches", ())) > 256:     # the recording driver keeps every launch
                drv.launches.clear()
                drv.memory = {p: a for p, a in drv.memory.items() if p in keep}
        return (time.perf_counter() - t0) / calls * 1e6

    print(f"host cost per call on the fake driver (no GPU), {args.calls} calls each (kspec from "
          f"{Path(kspec.__file__).parent})")
    print(f"  {'case':<28} {'recording us':>12} {'lean us':>8} {'py calls/call':>14}")
    profiled = None
    for name, art, sizes in fake_cases(Path(args.prebuilt)):
        try:
            mod = kspec.load(art)
            fn = mod[mod.kernels[0]]
            fn.check_indices = False
            with FakeDriver() as rec:
                kw = arguments(rec, fn.entry, sizes)
                keep = set(rec.memory)
                recording = per_call(fn, kw, args.calls, rec)
            lean = lean_driver()
            with _driver.use(lean):
                kw = arguments(lean, fn.entry, sizes)
                for plan in fn.entry.plans:
                    for arch in plan.binaries:
                        lean.hook(mod.glue(plan, arch))
                bare = per_call(fn, kw, args.calls, lean)
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(300):
                    fn(**kw)
                prof.disable()
            calls = pstats.Stats(prof).total_calls / 300
            print(f"  {name:<28} {recording:12.1f} {bare:8.1f} {calls:14.0f}", flush=True)
            profiled = profiled or prof
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"  {name:<28} failed: {type(e).__name__}: {str(e)[:160]}")
    if args.profile and profiled:
        print("where one call's host time goes (first case, lean driver, 300 calls; own time):")
        pstats.Stats(profiled, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prebuilt", default=str(ROOT / "bench" / "prebuilt"))
    ap.add_argument("--calls", type=int, default=None, help="calls per case (default 300; 2000 with --fake)")
    ap.add_argument("--profile", action="store_true", help="also profile kspec's host path (cProfile)")
    ap.add_argument("--fake", action="store_true", help="no GPU: kspec's host path on the fake driver")
    args = ap.parse_args(argv)
    if args.calls is None:
        args.calls = 2000 if args.fake else 300
    if args.fake:
        return fake_main(args)
    found = cuda_torch("launch_overhead")
    if found is None:
        return 0
    torch, arch = found
    print(f"host cost per call on {torch.cuda.get_device_name()} ({arch}), {args.calls} calls each")
    print(f"  {'case':<28} {'kspec us':>9} {'+index checks':>14} {'torch us':>9} {'kspec/torch':>11}")
    profiled = None
    for name, fn, kw, ref in cases(torch, Path(args.prebuilt)):
        try:
            fn.check_indices = False
            bare = per_call_us(torch, lambda: fn(**kw), args.calls)
            fn.check_indices = True
            checked = per_call_us(torch, lambda: fn(**kw), args.calls) if fn.entry.index_ranges else bare
            t = per_call_us(torch, ref, args.calls)
            print(f"  {name:<28} {bare:9.1f} {checked:14.1f} {t:9.1f} {bare / t:11.1f}", flush=True)
            profiled = profiled or (fn, kw)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"  {name:<28} failed: {type(e).__name__}: {str(e)[:160]}")
    if args.profile and profiled:
        import cProfile
        import pstats
        fn, kw = profiled
        fn.check_indices = False
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn(**kw)
        torch.cuda.synchronize()
        prof.disable()
        print(f"where one call's host time goes ({fn.entry.name}, {args.calls} calls; own time):")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
