"""Backward kernels derived by `kspec grad`: their plans and modelled traffic on any machine, their
bandwidth on a GPU.

    python bench/grad.py                     # CPU: per pattern, the backward's kernels and DRAM bytes
    python bench/grad.py --gpu [--reps 50] [--rows 16384 --cols 8192]

The model part derives the backward of each pattern's shipped spec, plans it, and prints the kernel
count, the loop-kernel fallbacks, and the cost model's DRAM bytes against the spec minimum (each
input read once, each output written once).  The GPU part compiles the row patterns' backward
(LayerNorm, RMSNorm, cross-entropy) for the device and times it (CUDA events, an L2 flush before
each call, median of --reps) against a device-to-device copy of the spec-minimum bytes and torch
autograd's backward of the same forward; and the causal attention's backward (B=4, H=16, S=2048,
d=64, bf16), in TFLOP/s against torch's SDPA backward (its flash kernel) and, where
flash_attn.cute is importable, FlashAttention-4's own backward.  Without torch or a CUDA device the
GPU part says so and exits 0.  Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
PATTERNS = ("gemm_bias_gelu_residual", "mlp2", "swiglu_mlp", "layernorm", "rmsnorm", "cross_entropy",
            "attention_causal", "attention_gqa")
GPU_PATTERNS = ("layernorm", "rmsnorm", "cross_entropy", "attention_causal")     # timed on a GPU (`gpu`)
ATTN = {"B": 4, "H": 16, "S": 2048, "D": 64}     # the attention backward's problem on a GPU


def _sizes(rows: int, cols: int) -> dict:
    return {"M": rows, "N": cols, "K": cols, "F": 2 * cols, "V": 4 * cols, "B": 4, "H": 32, "KH": 8, "S": 4096,
            "T": 4096}


def model(rows: int, cols: int) -> None:
    from kspec.compile import plan_spec
    from kspec.compiler import cost
    from kspec.spec_lang import load_spec
    from kspec.spec_lang.grad import grad_program
    sizes = _sizes(rows, cols)
    print(f"backward plans, modelled at M={rows}, N=K={cols}, F={2 * cols}, V={4 * cols}; attention B=4 H=32 S=4096:")
    print(f"  {'pattern':<24} {'kernels':>7} {'fallbacks':>9} {'DRAM':>10} {'spec min':>10} {'x min':>6}")
    for stem in PATTERNS:
        prog = load_spec(grad_program(load_spec(SPECS / f"{stem}.kspec")), is_text=True)
        (sched,) = plan_spec(prog, ("sm90a", "sm100a"), f"{stem}_bwd")
        c = cost(sched, sizes)
        falls = sum(any(ch.fallback for ch in p.choices.values()) for p in sched.plans)
        unfused = " (attention backward unfused)" if sched.fusion.unfused_attention else ""
        print(f"  {stem:<24} {len(sched.plans):>7} {falls:>9} {c.fused_bytes / 1e9:8.3f} GB "
              f"{c.minimum_bytes / 1e9:8.3f} GB {c.fused_bytes / max(c.minimum_bytes, 1):6.2f}{unfused}")


def gpu(rows: int, cols: int, reps: int, out: Path, prebuilt: Path | None = None) -> int:
    try:
        import torch
    except ImportError:
        print("bench: torch is not installed; nothing measured.")
        return 0
    if not torch.cuda.is_available():
        print("bench: no CUDA device; nothing measured.")
        return 0
    sys.path.insert(0, str(ROOT / "bench"))
    from bench import Timer, _device_arch

    import kspec
    from kspec.compile import Progress, compile_spec
    from kspec.spec_lang import load_spec
    from kspec.spec_lang.grad import grad_program
    arch = _device_arch(torch)
    if arch is None:
        print("bench: the device is neither sm_90 nor sm_100; nothing measured.")
        return 0
    timer = Timer(torch, reps)
    F = torch.nn.functional
    M, N = rows, cols
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, dy = torch.randn(M, N, **bf), torch.randn(M, N, **bf)
    w, b = torch.randn(N, **bf), torch.randn(N, **bf)
    label = torch.randint(0, N, (M,), device="cuda", dtype=torch.int32)
    dloss = torch.randn(M, device="cuda", dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    print(f"backward kernels on {torch.cuda.get_device_name()} ({arch}), {M} x {N} bf16, reps {reps}")
    forwards = {
        "layernorm": (dict(x=x, gamma=w, beta=b), lambda a: F.layer_norm(a["x"], (N,), a["gamma"], a["beta"], 1e-5),
                      "y", dy),
        "rmsnorm": (dict(x=x, w=w), lambda a: (a["x"].float() * torch.rsqrt(a["x"].float().pow(2).mean(-1, True)
                                                                               + 1e-6) * a["w"].float()).bfloat16(),
                    "y", dy),
        "cross_entropy": (dict(logits=x, label=label),
                          lambda a: F.cross_entropy(a["logits"].float(), a["label"].long(), reduction="none"),
                          "loss", dloss),
    }
    B, H, S, D = ATTN["B"], ATTN["H"], ATTN["S"], ATTN["D"]
    q, k, v, do = (torch.randn(B, H, S, D, **bf) for _ in range(4))
    forwards["attention_causal"] = (
        dict(Q=q, K=k, V=v), lambda a: F.scaled_dot_product_attention(a["Q"], a["K"], a["V"], is_causal=True,
                                                                      scale=0.125), "O", do)
    assert tuple(forwards) == GPU_PATTERNS
    for stem, (ins, torch_fwd, out_name, grad_out) in forwards.items():
        if prebuilt is not None:        # bench/prebuild.py built `{stem}_grad` on a CPU machine
            art = prebuilt / f"{stem}_grad"
            spec = art / kspec.load(art).manifest.spec.file
        else:
            spec = out / f"{stem}_grad.kspec"
            spec.write_text(grad_program(load_spec(SPECS / f"{stem}.kspec")))
            art = compile_spec(spec, (arch,), out, progress=Progress(enabled=False))
        mod = kspec.load(art, check_indices=False)
        fwd, bwd = getattr(mod, f"{stem}_fwd"), getattr(mod, f"{stem}_bwd")
        saved = fwd(**ins)
        args = {**ins, **saved, f"d{out_name}": grad_out}
        t = timer(lambda: bwd(**args))
        got = bwd(**args)
        if stem.startswith("attention"):
            _attention_line(torch, timer, stem, t, ins, torch_fwd, grad_out)
            continue
        # the bytes it must move: the inputs some planned kernel reads, once, and the gradients, once
        from kspec.compile import plan_spec
        (sched,) = plan_spec(load_spec(spec), (arch,), f"{stem}_bwd")
        read = {r for p in sched.plans for r in p.reads}
        nbytes = sum(v.numel() * v.element_size() for k, v in args.items() if k in read) \
            + sum(v.numel() * v.element_size() for v in got.values())
        src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t_copy = timer(lambda: dst.copy_(src))
        leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in ins.items()}
        y = torch_fwd(leaves)
        floats = [v for v in leaves.values() if v.requires_grad]
        t_torch = timer(lambda: torch.autograd.grad(y, floats, grad_out, retain_graph=True))
        print(f"  {stem:<14} kspec backward {t:7.3f} ms, {nbytes / t / 1e6:7.1f} GB/s = {t_copy / t:5.1%} of copy; "
              f"x{t_torch / t:4.2f} vs torch autograd's backward")
    return 0


def _attention_line(torch, timer, stem, t, ins, torch_fwd, grad_out) -> None:
    """The attention backward's TFLOP/s (2.5x the causal forward's 2*B*H*S*S*D, as FlashAttention
    counts it) against torch's SDPA backward and, where importable, FlashAttention-4's."""
    B, H, S, D = ATTN["B"], ATTN["H"], ATTN["S"], ATTN["D"]
    flops = 2.5 * 2 * B * H * S * S * D          # causal: half of 4*B*H*S*S*D, times 2.5 for the backward
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in ins.items()}
    y = torch_fwd(leaves)
    t_sdpa = timer(lambda: torch.autograd.grad(y, list(leaves.values()), grad_out, retain_graph=True))
    line = (f"  {stem:<14} kspec backward {t:7.3f} ms, {flops / t / 1e9:6.1f} TFLOP/s; "
            f"x{t_sdpa / t:4.2f} vs torch SDPA's backward ({flops / t_sdpa / 1e9:.1f} TFLOP/s)")
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:                       # not installed (the GPU machines here have no network)
        print(line + f"; FlashAttention-4 not importable ({type(e).__name__})")
        return
    qkv = [x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in ins.values()]   # [B, S, H, D]
    o = flash_attn_func(*qkv, softmax_scale=0.125, causal=True)
    o = o[0] if isinstance(o, tuple) else o
    g = grad_out.transpose(1, 2).contiguous()
    t_fa4 = timer(lambda: torch.autograd.grad(o, qkv, g, retain_graph=True))
    print(line + f"; x{t_fa4 / t:4.2f} vs FlashAttention-4's backward ({flops / t_fa4 / 1e9:.1f} TFLOP/s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--gpu", action="store_true", help="also measure on the CUDA device")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("-o", "--output", default=str(ROOT / "build" / "bench_grad"), help="artifact directory")
    ap.add_argument("--prebuilt", metavar="DIR", help="load the backwards bench/prebuild.py built (DIR/<pattern>_grad) "
                    "instead of compiling")
    args = ap.parse_args(argv)
    model(args.rows, args.cols)
    return gpu(args.rows, args.cols, args.reps, Path(args.output),
               Path(args.prebuilt) if args.prebuilt else None) if args.gpu else 0


if __name__ == "__main__":
    sys.exit(main())
