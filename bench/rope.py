"""Rotary position embedding (RoPE, bound by HBM bandwidth): kspec's specs/rope.kspec (rotate-half)
against QuACK 0.6.5's `quack.rotary.apply_rotary` and a torch eager implementation, in one run.

    python bench/rope.py [--batches 1,8] [--seqlens 4096,16384] [--heads 32] [--peak-gbs N]
                         [--reps 50] [--prebuilt DIR] [--no-compile] [--interleaved]

Shape: Q [B, S, H, 128] bf16 (head dim contiguous), angles in f32.  kspec's spec takes cos/sin as
[S, 128] (each position's 64 angles over both halves), QuACK as [S, 64]; both are built from the same
angles and the outputs are compared before anything is timed.  `--interleaved` also times GPT-J's
layout (pairs (x[2i], x[2i+1]) rotated by angle i: GPTJ below, cos/sin [S, 64] read at `e / 2`,
compiled here, so it needs nvcc) against QuACK's `interleaved=True`.  HBM bytes per call: Q read and
Y written (2 * B * S * H * 128 * 2) plus kspec's cos/sin tables (2 * S * 128 * 4, or * 64) — the same
count for every column of a row, so the GB/s columns compare like the times; the fraction is of the
device's peak (a table of known SKUs, or --peak-gbs).  Ratios are the others' time over kspec's
(> 1: kspec faster).  Times: CUDA events, an L2 flush before each call, median of --reps.
`--prebuilt DIR` loads bench/prebuild.py's artifact (DIR/rope) instead of compiling.  QuACK
JIT-compiles its kernel with the CuTe DSL on first use (seconds; no QuACK column where it does not
import); `--no-compile` leaves out torch.compile (tens of seconds of compiling).  Without torch or a
CUDA device it prints kspec's plan for the spec (one vectorised kernel per arch, its modelled
traffic) and says there is nothing to measure; it exits 0.  Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_decode import peak_gbs  # noqa: E402  (the SKU table is shared)

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "specs" / "rope.kspec"
D = 128


GPTJ = f"""kernel rope_gptj {{
  in  Q   : bf16[B, S, H, {D}]
  in  cos : f32[S, {D // 2}]
  in  sin : f32[S, {D // 2}]
  out Y   : bf16[B, S, H, {D}]

  Y[b, s, h, e] = f32(Q[b, s, h, e]) * cos[s, e / 2]
                + where(e % 2 == 0, -f32(Q[b, s, h, e + 1]), f32(Q[b, s, h, e - 1])) * sin[s, e / 2]
}}
"""


def rope_bytes(B: int, S: int, H: int, table: int = D) -> int:
    """HBM bytes one call must move: Q read, Y written (bf16), the f32 cos and sin [S, table]."""
    return 2 * B * S * H * D * 2 + 2 * S * table * 4


def plan_summary(archs=("sm90a", "sm100a"), sizes=None) -> list[str]:
    """kspec's plan for specs/rope.kspec, per arch: the kernel count, backend, vector widths of the
    lowered kernel and, at `sizes`, the modelled DRAM bytes against the spec minimum."""
    from kspec.backends.registry import Planner, get
    from kspec.compiler import cost, plan_kernel
    from kspec.spec_lang import load_spec
    sizes = sizes or {"B": 8, "S": 4096, "H": 32}
    sched = plan_kernel(load_spec(SPEC).kernels[0], tuple(archs), Planner())
    lines = [f"kspec plan for {SPEC.name}: {len(sched.plans)} kernel(s)"]
    for p in sched.plans:
        for arch in archs:
            backend = p.choices[arch].backend
            lowered = get(backend).lower(p.ir, arch)
            widths = getattr(lowered.desc, "vec", ())
            lines.append(f"  {p.id} on {arch}: {backend} {p.kind}, "
                         + (f"{' or '.join(map(str, widths))} elements per thread, 128-bit loads and stores"
                            if widths else "one element per thread"))
    c = cost(sched, sizes)
    B, S, H = sizes["B"], sizes["S"], sizes["H"]
    lines.append(f"  modelled DRAM bytes at B={B} S={S} H={H}: {c.fused_bytes / 1e6:.1f} MB, "
                 f"{c.fused_bytes / rope_bytes(B, S, H):.2f}x the spec minimum")
    return lines


def tables(torch, S: int, device="cpu"):
    """Each position's angles s * theta^(-2i/128), i < 64: cos/sin [S, 64] (QuACK's layout) and
    [S, 128] (the spec's: the 64 over both halves), f32."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64, device=device) / D))
    ang = torch.arange(S, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    cos64, sin64 = ang.cos().float(), ang.sin().float()
    return (cos64, sin64), (torch.cat([cos64, cos64], -1).contiguous(), torch.cat([sin64, sin64], -1).contiguous())


def rope_torch(torch, q, cos, sin):
    """Torch eager rotate-half RoPE of q [B, S, H, 128] with cos/sin [S, 128]: f32 math, q's dtype out."""
    x = q.float()
    rot = torch.cat([-x[..., D // 2:], x[..., :D // 2]], dim=-1)
    return (x * cos[:, None, :] + rot * sin[:, None, :]).to(q.dtype)


def rope_torch_interleaved(torch, q, cos, sin):
    """Torch eager interleaved (GPT-J) RoPE of q [B, S, H, 128] with cos/sin [S, 64]: each pair
    (x[2i], x[2i+1]) rotated by angle i; f32 math, q's dtype out."""
    x = q.float().unflatten(-1, (D // 2, 2))
    x0, x1 = x[..., 0], x[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2).to(q.dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--peak-gbs", type=float, default=None, help="the device's HBM peak, GB/s")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--prebuilt", metavar="DIR", help="load the artifact bench/prebuild.py wrote (DIR/rope) "
                    "instead of compiling specs/rope.kspec")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile column")
    ap.add_argument("--interleaved", action="store_true", help="also time GPT-J's interleaved RoPE (GPTJ, compiled "
                    "here: needs nvcc) against QuACK's interleaved=True")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        for line in plan_summary():
            print(line)
        print(f"{'torch is not installed' if torch is None else 'no CUDA device'}: nothing to benchmark")
        return 0
    from bench import Prebuilt, Timer, _compiled, _device_arch, _load
    from kspec import load as kspec_load
    arch = _device_arch(torch)
    if arch is None:
        print(f"device {torch.cuda.get_device_name()} is not an arch kspec compiles for")
        return 0
    name = torch.cuda.get_device_name()
    peak = peak_gbs(name, args.peak_gbs)
    H = args.heads
    print(f"device {name} ({arch}), HBM peak {peak or '?'} GB/s; RoPE, H={H} d={D} bf16, f32 angles")
    try:
        from quack.rotary import apply_rotary
    except Exception as e:                       # noqa: BLE001  (report and go on without it)
        print(f"note: QuACK not importable here ({type(e).__name__}: {e}); no QuACK column")
        apply_rotary = None
    out = Prebuilt(args.prebuilt) if args.prebuilt else Path(tempfile.mkdtemp(prefix="kspec-rope-bench-"))
    kernels = {"rotate-half": _load("rope", arch, out)}
    if args.interleaved:
        from kspec.compile import compile_spec
        tmp = Path(tempfile.mkdtemp(prefix="kspec-rope-bench-"))
        (tmp / "rope_gptj.kspec").write_text(GPTJ)
        kernels["interleaved"] = kspec_load(compile_spec(tmp / "rope_gptj.kspec", (arch,), tmp / "out")).rope_gptj
    timer = Timer(torch, args.reps)
    print(f"{'case':32s} {'kspec':>18s} {'QuACK':>18s} {'torch eager':>18s} {'torch.compile':>18s}"
          "  QuACK/kspec eager/kspec  (ms, GB/s, % peak)")
    for layout, kern in kernels.items():
        interleaved = layout == "interleaved"
        eager = rope_torch_interleaved if interleaved else rope_torch
        for B in (int(x) for x in args.batches.split(",")):
            for S in (int(x) for x in args.seqlens.split(",")):
                q = torch.randn(B, S, H, D, dtype=torch.bfloat16, device="cuda")
                (cos64, sin64), (cos128, sin128) = tables(torch, S, "cuda")
                cos, sin = (cos64, sin64) if interleaved else (cos128, sin128)
                y = torch.empty_like(q)
                nbytes = rope_bytes(B, S, H, cos.shape[1])

                def col(ms):
                    if ms is None:
                        return "-"
                    gbs = nbytes / ms / 1e6
                    return f"{ms:.3f} {gbs:5.0f}" + (f" {100 * gbs / peak:3.0f}%" if peak else "")
                want = eager(torch, q, cos, sin)
                kern(Q=q, cos=cos, sin=sin, Y=y)
                errs = [f"max |kspec - torch| {(y.float() - want.float()).abs().max().item():.3g}"]
                t_k = timer(lambda: kern(Q=q, cos=cos, sin=sin, Y=y))
                t_q = None
                if apply_rotary is not None:
                    try:
                        got = apply_rotary(q, cos64, sin64, interleaved=interleaved)
                        errs.append(f"|QuACK - torch| {(got.float() - want.float()).abs().max().item():.3g}")
                        t_q = timer(lambda: apply_rotary(q, cos64, sin64, interleaved=interleaved))
                    except Exception as e:       # noqa: BLE001
                        print(f"  QuACK {layout} B={B} S={S}: {type(e).__name__}: {e}")
                t_e = timer(lambda: eager(torch, q, cos, sin))
                comp = None if args.no_compile else _compiled(torch, lambda: eager(torch, q, cos, sin))
                t_c = timer(comp) if comp else None
                r_q = f"{t_q / t_k:11.2f}" if t_q else "          -"
                print(f"{f'{layout} B={B} S={S}':32s} {col(t_k):>18s} {col(t_q):>18s} {col(t_e):>18s} "
                      f"{col(t_c):>18s}  {r_q} {t_e / t_k:11.2f}", flush=True)
                print(f"{'':32s} {', '.join(errs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
