"""Decoding attention (few query rows against a long KV cache, bound by HBM bandwidth): kspec against
FlashAttention-4 called directly (its own num_splits / pack_gqa heuristic) and the best torch SDPA
backend, in one run (issue 25's numbers).

    python bench/attention_decode.py [--batches 1,8,64] [--kv 4096,32768,131072] [--rows 1]
                                     [--dense-only] [--page 256] [--peak-gbs N] [--reps 30]

Shape: H = 32 query heads, KH = 8 K/V heads (GQA group 4), d = 128, bf16, `--rows` query rows per
sequence (1: one decoding step).  Dense: Q [B, S, H, d], K/V [B, T, KH, d] (FlashAttention's layout,
shared by all three).  FA4 direct gets num_splits=0 (its own split heuristic) on sm_100a and 1 on
sm_90a (FA4 b36 has no split-KV there); the `splits` column is kspec's count for the call (its
split-KV kernel and combine when above 1, sm_100a).  Paged (default; --dense-only skips it): K/V in a pool of pages of `--page` rows, a block table per
sequence, every sequence T keys long.  HBM bytes per call: K and V once (2 * B * T * KH * d * 2) plus
Q and O; the bandwidth column is that over the median time, and the fraction is of the device's peak
(a table of known SKUs, or --peak-gbs).  Ratios are kspec's time over the others' (> 1: kspec
faster).  A case kspec does not build as one fused attention prints the planner's reason instead of
a time.  Without a CUDA device or torch it says so and exits 0.  Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

H, KH, D = 32, 8, 128
PEAK_GBS = {"H200": 4800.0, "H100 NVL": 3900.0, "H100": 3350.0, "H20": 4000.0, "GH200": 4000.0,
            "B200": 8000.0, "B300": 8000.0, "GB200": 8000.0}

DENSE = f"""kernel attention_decode_dense {{
  param scale : f32 = {D ** -0.5!r}
  in  Q : bf16[B, S, H, {D}]
  in  K : bf16[B, T, KH, {D}]
  in  V : bf16[B, T, KH, {D}]
  out O : bf16[B, S, H, {D}]

  s[b, h, i, j] : f32 = scale * sum(e) Q[b, i, h, e] * K[b, j, h / {H // KH}, e]
  p[b, h, i, j] = softmax(j) s[b, h, i, j]
  O[b, i, h, e] = sum(j) p[b, h, i, j] * V[b, j, h / {H // KH}, e]
}}
"""

PAGED = f"""kernel attention_decode_paged {{
  param scale : f32 = {D ** -0.5!r}
  in  Q  : bf16[B, S, H, {D}]
  in  Kc : bf16[NP, P, KH, {D}]
  in  Vc : bf16[NP, P, KH, {D}]
  in  bt : i32[B, MP]
  in  kv_len : i32[B]
  out O  : bf16[B, S, H, {D}]

  s[b, h, i, j] : f32 = scale * sum(e) Q[b, i, h, e] * Kc[bt[b, j / P], j % P, h / {H // KH}, e]
  m[b, h, i, j] = where(j < kv_len[b] and j <= i + (kv_len[b] - S), s[b, h, i, j], -inf)
  p[b, h, i, j] = softmax(j) m[b, h, i, j]
  O[b, i, h, e] = sum(j) p[b, h, i, j] * Vc[bt[b, j / P], j % P, h / {H // KH}, e]
}}
"""


def peak_gbs(name: str, override: float | None) -> float | None:
    """The device's HBM peak in GB/s: --peak-gbs, else the longest SKU name in PEAK_GBS it contains."""
    if override:
        return override
    hits = [k for k in PEAK_GBS if k in name]
    return PEAK_GBS[max(hits, key=len)] if hits else None


def kv_bytes(B: int, S: int, T: int) -> int:
    """HBM bytes one call must move: K and V once, Q read and O written (bf16)."""
    return 2 * B * T * KH * D * 2 + 2 * B * S * H * D * 2


def fused_or_reason(text: str, arch: str) -> str | None:
    """None when kspec plans the spec as one fused attention on arch, else the reason."""
    from kspec.backends.registry import Planner
    from kspec.compiler import plan_kernel
    from kspec.core import KspecError
    from kspec.spec_lang import load_spec
    try:
        sched = plan_kernel(load_spec(text, is_text=True).kernels[0], (arch,), Planner())
    except KspecError as e:
        return str(e).splitlines()[0]
    kinds = [p.kind for p in sched.plans]
    if kinds != ["attention"]:
        notes = [n for n in sched.fusion.notes if "attention" in n]
        return f"{len(kinds)} kernels ({', '.join(kinds)})" + (f": {notes[0]}" if notes else "")
    return None


def fa4_direct_kwargs(arch: str) -> dict:
    """FlashAttention-4 called directly with its own split heuristic (num_splits=0: `_get_fwd_config`
    picks the count, as kspec's split-KV glue does per call) and its own pack-GQA default.  FA4 b36
    has no split-KV forward on sm_90a (it asserts "SplitKV not supported on SM 9.0"), so there it
    gets num_splits=1, its only choice."""
    return {"num_splits": 0 if arch == "sm100a" else 1}


def kspec_splits(mod, kernel: str, arch: str, sizes: dict, sm_count: int) -> int:
    """How many ways kspec's artifact splits the key range of a call at these sizes (1: a
    single-pass kernel): the split kernel's workspace, as the runtime asks for it."""
    from kspec.core import extent_value
    (plan,) = getattr(mod, kernel).entry.plans
    dims = [extent_value(v, sizes) for _r, v in plan.dims]
    variants, ws = mod.launches(plan, arch, dims, 0, sm_count)
    if len(variants) == 1:
        return 1
    roles = dict(zip((r for r, _v in plan.dims), dims))
    rows, dv = roles["B"] * roles["S"] * roles["H"], D
    for ns in range(2, 257):
        if -(-(ns * rows * dv * 4) // 256) * 256 + -(-(ns * rows * 4) // 256) * 256 == ws:
            return ns
    return -1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--kv", default="4096,32768,131072", help="K/V lengths T")
    ap.add_argument("--rows", type=int, default=1, help="query rows per sequence (S)")
    ap.add_argument("--paged", action="store_true", default=True, help="also time a paged KV cache (default)")
    ap.add_argument("--dense-only", dest="paged", action="store_false", help="no paged KV cache")
    ap.add_argument("--page", type=int, default=256, help="rows per page (--paged)")
    ap.add_argument("--peak-gbs", type=float, default=None, help="the device's HBM peak, GB/s")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prebuilt", metavar="DIR", help="load DIR/attention_decode_dense and _paged (bench/prebuild.py) "
                    "instead of compiling")
    args = ap.parse_args(argv)
    from bench import Timer, cuda_torch
    found = cuda_torch("attention_decode")
    if found is None:
        return 0
    torch, arch = found
    import kspec
    name = torch.cuda.get_device_name()
    peak = peak_gbs(name, args.peak_gbs)
    print(f"device {name} ({arch}), HBM peak {peak or '?'} GB/s; H={H} KH={KH} d={D} bf16 S={args.rows}")
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:                       # noqa: BLE001  (report and go on without it)
        print(f"note: FlashAttention-4 not importable here ({type(e).__name__}: {e}); no direct-FA4 column")
        flash_attn_func = None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    timer = Timer(torch, args.reps)
    tmp = Path(tempfile.mkdtemp(prefix="kspec-decode-bench-"))
    kernels, kern_mods = {}, {}
    for layout, text in (("dense", DENSE), *((("paged", PAGED),) if args.paged else ())):
        # a prebuilt artifact was planned where it was built (FlashAttention-4 may be missing here)
        if args.prebuilt:
            mod = kspec.load(Path(args.prebuilt) / f"attention_decode_{layout}")
            kinds = [p.kind for k in mod.manifest.kernels for p in k.plans]
            why = None if kinds == ["attention"] else f"the prebuilt artifact has {len(kinds)} kernels ({', '.join(kinds)})"
        else:
            why = fused_or_reason(text, arch)
        if why:
            print(f"kspec {layout}: not one fused attention ({why}); no kspec column")
            kernels[layout] = None
            continue
        if not args.prebuilt:
            from kspec.compile import compile_spec
            path = tmp / f"{layout}.kspec"
            path.write_text(text)
            mod = kspec.load(compile_spec(path, (arch,), tmp / f"out_{layout}"))
        kernels[layout] = getattr(mod, f"attention_decode_{layout}")
        kern_mods[layout] = mod
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fa_split = fa4_direct_kwargs(arch)
    print(f"{'case':32s} {'kspec':>14s} {'FA4':>14s} {'SDPA best':>22s}  kspec/FA4 kspec/SDPA splits "
          f"(ms, GB/s, % peak; kspec's split count on {sms} SMs; FA4 num_splits={fa_split['num_splits']})")
    S = args.rows
    for layout in kernels:
        for B in (int(x) for x in args.batches.split(",")):
            for T in (int(x) for x in args.kv.split(",")):
                q = torch.randn(B, S, H, D, dtype=torch.bfloat16, device="cuda")
                o = torch.empty_like(q)
                if layout == "dense":
                    k, v = (torch.randn(B, T, KH, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
                    kargs, fa_kw = (q, k, v), {}
                else:
                    pages = -(-T // args.page)
                    k, v = (torch.randn(B * pages, args.page, KH, D, dtype=torch.bfloat16, device="cuda")
                            for _ in range(2))
                    bt = torch.randperm(B * pages, device="cuda", dtype=torch.int32).view(B, pages)
                    kv_len = torch.full((B,), T, dtype=torch.int32, device="cuda")
                    kargs, fa_kw = (q, k, v, bt, kv_len), dict(page_table=bt, seqused_k=kv_len)
                nbytes = kv_bytes(B, S, T)

                def col(ms):
                    if ms is None:
                        return "-"
                    gbs = nbytes / ms / 1e6
                    return f"{ms:.3f} {gbs:6.0f}" + (f" {100 * gbs / peak:3.0f}%" if peak else "")
                kern = kernels[layout]
                t_k = timer(lambda: kern(*kargs, O=o, scale=D ** -0.5)) if kern is not None else None
                t_fa4 = None
                if flash_attn_func is not None:
                    try:
                        t_fa4 = timer(lambda: flash_attn_func(q, k, v, causal=False, **fa_kw, **fa_split))
                    except Exception as e:       # noqa: BLE001
                        print(f"  FA4 {layout} B={B} T={T}: {type(e).__name__}: {e}")
                best = (None, None)
                if layout == "dense":            # SDPA has no paged layout; GQA through enable_gqa
                    qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
                    for bname, be in (("flash", SDPBackend.FLASH_ATTENTION),
                                      ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                                      ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
                        try:
                            with sdpa_kernel(be):
                                t = timer(lambda: torch.nn.functional.scaled_dot_product_attention(
                                    qs, ks, vs, enable_gqa=True))
                        except RuntimeError:
                            continue
                        if best[1] is None or t < best[1]:
                            best = (bname, t)
                r1 = f"{t_fa4 / t_k:9.2f}" if t_k and t_fa4 else "        -"
                r2 = f"{best[1] / t_k:10.2f}" if t_k and best[1] else "         -"
                sdpa = f"{col(best[1])} ({best[0]})" if best[0] else "-"
                ns = "-"
                if kern is not None:
                    sizes = {"B": B, "S": S, "T": T, "H": H, "KH": KH, "NP": k.shape[0], "P": k.shape[1],
                             "MP": k.shape[0] // max(B, 1)}
                    ns = str(kspec_splits(kern_mods[layout], f"attention_decode_{layout}", arch, sizes, sms))
                print(f"{layout + f' B={B} T={T}':32s} {col(t_k):>14s} {col(t_fa4):>14s} {sdpa:>22s}  {r1} {r2} "
                      f"{ns:>6s}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
