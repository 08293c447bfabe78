"""Host cost of one kspec call (the Python launch path: argument checks, host glue, cuLaunchKernelEx)
against torch's for the same work, on problems too small for the GPU time to matter; with --profile,
where kspec's host time goes (cProfile, top functions by own time).

    python bench/launch_overhead.py [--prebuilt DIR] [--calls 300] [--profile]

Per case, three numbers: kspec's host microseconds per call (wall clock over --calls back-to-back
calls, the stream drained once at the end), the same with the index checks on (the default, for the
kernels that have index tensors), and torch's host microseconds per call for an equivalent op.  When
the host cost exceeds the kernel's GPU time, a benchmark that times each call with CUDA events
measures the host, not the kernel.  Needs torch and a CUDA device (else it says so and exits 0).
Nothing here asserts a speed.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prebuilt", default=str(ROOT / "bench" / "prebuilt"))
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", action="store_true", help="also profile kspec's host path (cProfile)")
    args = ap.parse_args(argv)
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
