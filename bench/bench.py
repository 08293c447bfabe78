"""kspec benchmark: shipped specs at realistic sizes against torch baselines, measured in one run.

    python bench/bench.py [--quick] [--only gemm,attention] [--reps 50]

For every case it prints kspec's time and TFLOP/s (or GB/s) and ratios against, in the same run:
torch.matmul (cuBLAS), the torch eager sequence of unfused ops, torch.compile of that sequence
(when it works here), and for attention torch's scaled_dot_product_attention on the flash backend.
Timing: warm-up, CUDA events around each call, an L2 flush (a 256 MiB write) before each call,
median of --reps calls; the GPU spins ~2 ms before each timed call so the events bracket GPU time
only, not the host's launch (bench/launch_overhead.py reports that host cost separately).  Without a CUDA device (or without torch) it says so and exits 0.
This is not a test: nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"


def cuda_torch(who: str):
    """(torch, kspec arch of the current device), or None after saying why there is nothing to
    benchmark here (no torch, no CUDA device, a device kspec does not compile for)."""
    try:
        import torch
    except ImportError:
        print(f"{who}: torch is not installed: nothing to benchmark")
        return None
    if not torch.cuda.is_available():
        print(f"{who}: no CUDA device: nothing to benchmark")
        return None
    arch = _device_arch(torch)
    if arch is None:
        print(f"{who}: device {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}) "
              "is neither sm_90 nor sm_100, the archs kspec compiles for: nothing to benchmark")
        return None
    return torch, arch


def _device_arch(torch) -> str | None:
    major, minor = torch.cuda.get_device_capability()
    from kspec.core import arch_of_cc
    return arch_of_cc(major * 10 + minor)


class Timer:
    def __init__(self, torch, reps: int):
        self.torch = torch
        self.reps = reps
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    # A device-side head start before each timed call: the GPU spins while the host enqueues the
    # start event, the call and the end event, so the interval is the call's GPU time, not the host
    # time of launching it (kspec's Python launch path cost ~250 us per call on the H200 on
    # 2026-12-04, more than many kernels run; bench/launch_overhead.py measures that host cost).
    HEAD_START_CYCLES = 4_000_000        # ~2 ms at H200/B200 clocks

    def __call__(self, fn) -> float:
        """Median milliseconds of fn()'s GPU time over reps calls, each after an L2 flush."""
        torch = self.torch
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        sleep = getattr(torch.cuda, "_sleep", None)
        for _ in range(self.reps):
            self.flush.zero_()
            if sleep is not None:
                sleep(self.HEAD_START_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def _compiled(torch, fn):
    try:
        c = torch.compile(fn)
        c()
        return c
    except Exception as e:  # noqa: BLE001 - torch.compile is optional here
        print(f"    (torch.compile unavailable: {type(e).__name__}: {str(e)[:80]})")
        return None


class Prebuilt:
    """Artifacts built elsewhere (bench/prebuild.py): loaded, never compiled."""

    def __init__(self, path):
        self.path = Path(path)


def _load(stem: str, arch: str, out):
    import kspec
    if isinstance(out, Prebuilt):
        return getattr(kspec.load(out.path / stem), stem)
    from kspec.compile import Progress, compile_spec
    art = compile_spec(SPECS / f"{stem}.kspec", (arch,), out, progress=Progress())
    return getattr(kspec.load(art), stem)


def _report(name: str, flops: float, bytes_: float, ms: dict[str, float | None]) -> None:
    k = ms["kspec"]
    line = f"  {name:<44} kspec {k:8.3f} ms  {flops / k / 1e9:7.1f} TFLOP/s  {bytes_ / k / 1e6:7.1f} GB/s"
    print(line)
    for base, t in ms.items():
        if base != "kspec" and t is not None:
            print(f"    vs {base:<24} {t:8.3f} ms   kspec speed-up x{t / k:5.2f}")


def bench_gemm(torch, timer, arch, out, quick):
    sizes = [4096] if quick else [4096, 8192]
    f = _load("gemm", arch, out)
    for n in sizes:
        a = torch.randn(n, n, device="cuda", dtype=torch.float16)
        b = torch.randn(n, n, device="cuda", dtype=torch.float16).t()      # col-major B[K, N]
        d = torch.empty(n, n, device="cuda", dtype=torch.float16)
        ms = {"kspec": timer(lambda: f(A=a, B=b, D=d)), "torch.matmul": timer(lambda: torch.matmul(a, b, out=d))}
        _report(f"gemm f16 {n}^3", 2 * n ** 3, 3 * n * n * 2, ms)


def bench_epilogue(torch, timer, arch, out, quick):
    import torch.nn.functional as F
    f = _load("gemm_bias_gelu_residual", arch, out)
    n = 4096 if quick else 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16).t()
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    r = torch.randn(n, n, device="cuda", dtype=torch.float16)
    d = torch.empty(n, n, device="cuda", dtype=torch.float16)

    def eager():
        acc = torch.matmul(a, b).float()
        return (F.gelu(1.0 * acc + bias.float()) + r.float()).half()
    ms = {"kspec": timer(lambda: f(A=a, B=b, bias=bias, R=r, D=d)),
          "torch.matmul alone": timer(lambda: torch.matmul(a, b)),
          "torch eager (unfused)": timer(eager)}
    c = _compiled(torch, eager)
    ms["torch.compile"] = timer(c) if c else None
    _report(f"gemm+bias+gelu+residual f16 {n}^3", 2 * n ** 3, 4 * n * n * 2, ms)


def bench_batched(torch, timer, arch, out, quick):
    f = _load("batched_gemm", arch, out)
    L, n = (8, 2048) if quick else (16, 4096)
    a = torch.randn(L, n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(L, n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(L, n, n, device="cuda", dtype=torch.bfloat16)
    ms = {"kspec": timer(lambda: f(A=a, B=b, C=c)), "torch.bmm": timer(lambda: torch.bmm(a, b, out=c))}
    _report(f"batched gemm bf16 {L}x{n}^3", 2 * L * n ** 3, 3 * L * n * n * 2, ms)


def bench_fp8(torch, timer, arch, out, quick):
    if not hasattr(torch, "float8_e4m3fn"):
        print("  fp8: this torch has no float8_e4m3fn; skipped")
        return
    f = _load("fp8_gemm_scaled", arch, out)
    n = 4096 if quick else 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    d = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    one = torch.ones((), device="cuda")
    ms = {"kspec": timer(lambda: f(A=a, B=b, D=d, scale_a=1.0, scale_b=1.0))}
    try:
        ms["torch._scaled_mm"] = timer(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    except Exception as e:  # noqa: BLE001
        print(f"    (torch._scaled_mm unavailable: {str(e)[:80]})")
    _report(f"fp8 e4m3 gemm {n}^3", 2 * n ** 3, n * n * 4, ms)


def bench_attention(torch, timer, arch, out, quick):
    import torch.nn.functional as F
    f = _load("attention", arch, out)
    B, H, S, E = (4, 16, 2048, 128) if quick else (4, 16, 8192, 128)
    q, k, v = (torch.randn(B, H, S, E, device="cuda", dtype=torch.float16) for _ in range(3))
    o = torch.empty_like(q)
    scale = E ** -0.5
    ms = {"kspec": timer(lambda: f(Q=q, K=k, V=v, O=o, scale=scale))}
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms["sdpa (flash)"] = timer(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale))
    except Exception as e:  # noqa: BLE001
        print(f"    (sdpa flash backend unavailable: {str(e)[:80]})")

    def eager():
        s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
        return torch.matmul(torch.softmax(s, -1).half(), v)
    if S <= 4096:
        ms["torch eager (unfused)"] = timer(eager)
    _report(f"attention f16 B{B} H{H} S{S} E{E}", 4 * B * H * S * S * E, 4 * B * H * S * E * 2, ms)


# (M, N, K) of Llama-3-70B's and DeepSeek-V3's projections at a 4096-token batch (issue 24's sweep)
QUANT_SHAPES = [(4096, 8192, 8192), (4096, 28672, 8192), (4096, 8192, 28672),       # Llama-70B qkv-ish, up, down
                (4096, 7168, 2048), (4096, 24576, 1536), (4096, 7168, 18432)]       # DeepSeek-V3 o, q_b, down
QUICK_SHAPES = QUANT_SHAPES[:1] + QUANT_SHAPES[3:4]


def bench_fp8_amax(torch, timer, arch, out, quick):
    """fp8_gemm_amax (one kernel: GEMM, scales, bf16 D and the amax of the scaled result) against
    torch._scaled_mm followed by torch.amax (two kernels), as an FP8 training step needs both."""
    if not hasattr(torch, "float8_e4m3fn"):
        print("  fp8: this torch has no float8_e4m3fn; skipped")
        return
    f = _load("fp8_gemm_amax", arch, out)
    for m, n, k in QUICK_SHAPES if quick else QUANT_SHAPES:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        amax = torch.empty(1, device="cuda", dtype=torch.float32)
        one = torch.ones((), device="cuda")
        ms = {"kspec": timer(lambda: f(A=a, B=b, D=d, amax=amax, scale_a=1.0, scale_b=1.0))}
        try:
            def torch_pair():
                y = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                return torch.amax(y.abs())
            ms["_scaled_mm + amax"] = timer(torch_pair)
            ms["_scaled_mm alone"] = timer(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                                                    out_dtype=torch.bfloat16))
        except Exception as e:  # noqa: BLE001
            print(f"    (torch._scaled_mm unavailable: {str(e)[:80]})")
        _report(f"fp8 gemm + amax {m}x{n}x{k}", 2 * m * n * k, m * k + n * k + 2 * m * n, ms)


def bench_fp8_blockwise(torch, timer, arch, out, quick):
    """fp8_gemm_blockwise (DeepSeek-V3: 1x128 activation and 128x128 weight scales) against
    torch._scaled_mm with the same block scales where this torch supports them, else against the
    bf16 GEMM of the dequantised operands."""
    f = _load("fp8_gemm_blockwise", arch, out)
    for m, n, k in QUICK_SHAPES if quick else QUANT_SHAPES:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        sa = torch.rand(m, k // 128, device="cuda") + 0.5
        sb = torch.rand(n // 128, k // 128, device="cuda") + 0.5
        d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ms = {"kspec": timer(lambda: f(A=a, B=b, sa=sa, sb=sb, D=d))}
        try:     # torch's blockwise scaled_mm takes A's scales M-major and B's [K/128, N/128]
            sa_t = sa.t().contiguous().t()
            ms["_scaled_mm (blockwise)"] = timer(lambda: torch._scaled_mm(a, b.t(), scale_a=sa_t, scale_b=sb.t(),
                                                                          out_dtype=torch.bfloat16))
        except Exception as e:  # noqa: BLE001
            print(f"    (blockwise torch._scaled_mm unavailable: {str(e)[:80]})")
            ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
            ms["bf16 matmul (dequantised)"] = timer(lambda: torch.matmul(ab, bb.t()))
        _report(f"fp8 blockwise {m}x{n}x{k}", 2 * m * n * k, m * k + n * k + 2 * m * n, ms)


def bench_int8_dequant(torch, timer, arch, out, quick):
    """gemm_int8_dequant (SmoothQuant W8A8, one kernel) against torch._int_mm then the scaling."""
    f = _load("gemm_int8_dequant", arch, out)
    for m, n, k in QUICK_SHAPES if quick else QUANT_SHAPES:
        a = torch.randint(-127, 128, (m, k), device="cuda", dtype=torch.int8)
        b = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
        sa, sb = torch.rand(m, device="cuda"), torch.rand(n, device="cuda")
        d = torch.empty(m, n, device="cuda", dtype=torch.float16)
        ms = {"kspec": timer(lambda: f(A=a, B=b, sa=sa, sb=sb, D=d))}
        try:
            ms["_int_mm + scale (eager)"] = timer(
                lambda: (torch._int_mm(a, b.t()).float() * sa[:, None] * sb[None, :]).half())
        except Exception as e:  # noqa: BLE001
            print(f"    (torch._int_mm unavailable: {str(e)[:80]})")
        _report(f"int8 dequant {m}x{n}x{k}", 2 * m * n * k, m * k + n * k + 2 * m * n, ms)


def bench_moe(torch, timer, arch, out, quick):
    """moe_grouped_gemm (one persistent kernel over every expert, bias + SiLU + routing weight fused)
    against a loop of per-expert torch GEMMs with the same epilogue, and torch's grouped matmul
    (torch._grouped_mm) where this torch has it.  Mixtral-like (8 experts, d=4096, f=14336) and
    DeepSeek-V3-like (256 experts, d=7168, f=2048) routings of T tokens x top-k."""
    import torch.nn.functional as F
    f = _load("moe_grouped_gemm", arch, out)
    cases = [(8, 4096, 14336, 4096 * 2)] if quick else [(8, 4096, 14336, 4096 * 2), (256, 7168, 2048, 4096 * 8)]
    for E, D, Fd, rows in cases:
        g = torch.Generator(device="cuda").manual_seed(0)
        counts = torch.multinomial(torch.ones(E, device="cuda"), rows, replacement=True, generator=g).bincount(
            minlength=E)
        off = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
        off[1:] = counts.cumsum(0)
        x = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, Fd, D, device="cuda", dtype=torch.bfloat16) * D ** -0.5
        bias = torch.randn(E, Fd, device="cuda", dtype=torch.bfloat16)
        rw = torch.rand(rows, device="cuda")
        y = torch.empty(rows, Fd, device="cuda", dtype=torch.bfloat16)
        bounds = off.tolist()

        def loop():
            for e in range(E):
                a, b = bounds[e], bounds[e + 1]
                if b > a:
                    h = torch.matmul(x[a:b], w[e].t()).float() + bias[e].float()
                    y[a:b] = (rw[a:b, None] * F.silu(h)).to(torch.bfloat16)
        ms = {"kspec": timer(lambda: f(X=x, off=off, W=w, bias=bias, rw=rw, Y=y)), "per-expert loop": timer(loop)}
        if hasattr(torch, "_grouped_mm"):
            try:
                offs = off[1:].contiguous()
                ms["torch._grouped_mm (GEMM only)"] = timer(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
            except Exception as e:  # noqa: BLE001
                print(f"    (torch._grouped_mm unavailable: {str(e)[:80]})")
        _report(f"moe grouped E{E} D{D} F{Fd} rows{rows}", 2 * rows * D * Fd, 2 * (rows * (D + Fd) + E * Fd * D), ms)


CASES = {"gemm": bench_gemm, "epilogue": bench_epilogue, "batched": bench_batched, "fp8": bench_fp8,
         "attention": bench_attention, "fp8_amax": bench_fp8_amax, "fp8_blockwise": bench_fp8_blockwise,
         "int8_dequant": bench_int8_dequant, "moe": bench_moe}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    ap.add_argument("--only", help="comma-separated cases: " + ", ".join(CASES))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("-o", "--output", default=str(ROOT / "build" / "bench"), help="artifact directory")
    ap.add_argument("--prebuilt", metavar="DIR", help="load artifacts prebuilt by bench/prebuild.py instead of compiling")
    args = ap.parse_args(argv)
    found = cuda_torch("bench")
    if found is None:
        return 0
    torch, arch = found
    print(f"bench on {torch.cuda.get_device_name()} ({arch}), torch {torch.__version__}, reps {args.reps}")
    timer = Timer(torch, args.reps)
    chosen = args.only.split(",") if args.only else list(CASES)
    for name in chosen:
        if name not in CASES:
            print(f"unknown case {name}; cases: {', '.join(CASES)}")
            return 1
        print(f"{name}:")
        try:
            out = Prebuilt(args.prebuilt) if args.prebuilt else Path(args.output)
            CASES[name](torch, timer, arch, out, args.quick)
        except Exception as e:  # noqa: BLE001 - report and go on with the other cases
            print(f"  {name} failed: {type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
