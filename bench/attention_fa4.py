"""Fused attention forward: kspec's FlashAttention-4 kernels against the best torch SDPA backend and
FlashAttention-4 called directly, in one run (issue 16's numbers).

    python bench/attention_fa4.py [--seqlens 4096,8192,16384] [--dtypes f16,bf16] [--causal] [--varlen] [--reps 30]

Per case: batch x heads chosen to keep ~32k query rows (B*S = 32768, H = 16), d = 128.  kspec compiles
the spec for the device's arch (specs/attention.kspec, or its bf16/causal twin written to a temp dir)
and launches through `kspec.load`; torch SDPA is timed with each backend it offers (flash,
efficient, cuDNN) and the fastest is the baseline; FA4 is `flash_attn.cute.flash_attn_func` when
importable.  TFLOP/s counts 4*B*H*S*T*d (halved for causal).  Without a CUDA device or torch it says
so and exits 0.  Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import Prebuilt, Timer, _load, cuda_torch  # noqa: E402


def _spec(dtype: str, causal: bool, d: int, tmp: Path) -> Path:
    mask = ", causal=i" if causal else ""
    text = f"""kernel attention {{
  param scale : f32 = {1.0 / d ** 0.5!r}
  in  Q : {dtype}[B, H, S, {d}]
  in  K : {dtype}[B, H, S, {d}]
  in  V : {dtype}[B, H, S, {d}]
  out O : {dtype}[B, H, S, {d}]

  s[b, h, i, j] : f32 = scale * sum(e) Q[b, h, i, e] * K[b, h, j, e]
  p[b, h, i, j] = softmax(j{mask}) s[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[b, h, j, e]
}}
"""
    p = tmp / f"attention_{dtype}_{'causal' if causal else 'full'}.kspec"
    p.write_text(text)
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="4096,8192,16384")
    ap.add_argument("--dtypes", default="f16,bf16")
    ap.add_argument("--causal", action="store_true", help="also time causal attention")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prebuilt", metavar="DIR", help="load artifacts prebuilt by bench/prebuild.py (a GPU machine "
                    "without the CuTe DSL): only specs/attention.kspec (f16, d=128) and attention_varlen are there")
    ap.add_argument("--varlen", action="store_true",
                    help="also time specs/attention_varlen.kspec (packed, causal, bf16) against FA4's varlen call")
    args = ap.parse_args(argv)
    found = cuda_torch("attention_fa4")
    if found is None:
        return 0
    torch, arch = found
    import kspec
    from kspec.compile import compile_spec
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:                       # noqa: BLE001  (report and go on without it)
        print(f"note: FlashAttention-4 not importable here ({type(e).__name__}: {e}); no direct-FA4 column")
        flash_attn_func = None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    timer = Timer(torch, args.reps)
    d, H = 128, 16
    tmp = Path(tempfile.mkdtemp(prefix="kspec-attn-bench-"))
    print(f"{'case':34s} {'kspec':>9s} {'SDPA best':>16s} {'FA4':>9s}   kspec/SDPA  kspec/FA4   (TFLOP/s)")
    for dtype in args.dtypes.split(","):
        tdt = torch.float16 if dtype == "f16" else torch.bfloat16
        for causal in ([False, True] if args.causal else [False]):
            if args.prebuilt:
                if (dtype, causal) != ("f16", False):
                    print(f"{dtype}{' causal' if causal else ''}: not prebuilt (only specs/attention.kspec, f16)")
                    continue
                kern = _load("attention", arch, Prebuilt(args.prebuilt))
            else:
                kern = kspec.load(compile_spec(_spec(dtype, causal, d, tmp), (arch,), tmp / "out")).attention
            for S in (int(s) for s in args.seqlens.split(",")):
                B = max(32768 // S, 1)
                q, k, v = (torch.randn(B, H, S, d, dtype=tdt, device="cuda") for _ in range(3))
                o = torch.empty_like(q)
                flops = 4 * B * H * S * S * d * (0.5 if causal else 1.0)
                tf = lambda ms: flops / ms / 1e9                      # noqa: E731
                t_k = timer(lambda: kern(q, k, v, O=o, scale=d ** -0.5))
                best = (None, float("inf"))
                for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                                 ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel(be):
                            t = timer(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
                    except RuntimeError:
                        continue
                    if t < best[1]:
                        best = (name, t)
                t_fa4 = None
                if flash_attn_func is not None:
                    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                    t_fa4 = timer(lambda: flash_attn_func(qt, kt, vt, causal=causal))
                case = f"{dtype} d={d} B={B} H={H} S={S}{' causal' if causal else ''}"
                sdpa = f"{tf(best[1]):7.1f} ({best[0]})" if best[0] else "      -"
                fa4 = f"{tf(t_fa4):9.1f}" if t_fa4 else "        -"
                r1 = f"{best[1] / t_k:10.2f}" if best[0] else "         -"
                r2 = f"{t_fa4 / t_k:10.2f}" if t_fa4 else "         -"
                print(f"{case:34s} {tf(t_k):9.1f} {sdpa:>16s} {fa4}   {r1}  {r2}", flush=True)
    if args.varlen:
        _varlen(torch, timer, arch, Prebuilt(args.prebuilt) if args.prebuilt else tmp / "out", args.seqlens)
    return 0


def _varlen(torch, timer, arch: str, out, seqlens: str) -> None:
    """Packed causal batches of ragged lengths (about 32k rows in all) against FA4's own varlen call
    (`flash_attn_varlen_func` with the host max_seqlen hint, as callers pass it; kspec's kernel has
    none, so FA4 bounds its grid by the total rows). No SDPA column: SDPA has no packed layout."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:                            # noqa: BLE001
        flash_attn_varlen_func = None
    kern = _load("attention_varlen", arch, out)
    kern.check_indices = False                   # the kernel alone (the offsets check syncs)
    H, d = 16, 128
    for longest in (int(s) for s in seqlens.split(",")):
        lengths = [max(longest * (k % 4 + 1) // 4, 1) for k in range(max(32768 // longest, 1) * 2)]
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
        rows = int(cu[-1])
        q, k, v = (torch.randn(rows, H, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        o = torch.empty_like(q)
        flops = sum(4 * H * n * n * d * 0.5 for n in lengths)
        tf = lambda ms: flops / ms / 1e9          # noqa: E731
        t_k = timer(lambda: kern(cu, cu, q, k, v, O=o, scale=d ** -0.5))
        t_fa4 = None
        if flash_attn_varlen_func is not None:
            t_fa4 = timer(lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                         max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
                                                         causal=True))
        case = f"bf16 varlen d={d} {len(lengths)} seqs <= {longest} causal"
        fa4 = f"{tf(t_fa4):9.1f}" if t_fa4 else "        -"
        r2 = f"{t_fa4 / t_k:10.2f}" if t_fa4 else "         -"
        print(f"{case:34s} {tf(t_k):9.1f} {'-':>16s} {fa4}   {'-':>10s}  {r2}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
