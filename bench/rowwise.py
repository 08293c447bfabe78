"""Row kernels (norms, softmax, cross-entropy): modelled traffic on any machine, measured bandwidth on a GPU.

    python bench/rowwise.py                  # CPU: kernel count and modelled DRAM bytes, before/after
    python bench/rowwise.py --gpu [--reps 50] [--rows 16384 --cols 8192]

The model part plans each shipped row spec twice, without and with the row-wise fusion rule, and
prints the kernel count and the cost model's DRAM bytes against the ideal (each input read once,
each output written once).  The GPU part compiles each spec for the device, times it (CUDA events,
an L2 flush before each call, median of --reps), and prints its bandwidth (ideal bytes / time)
against a device-to-device copy of the same number of bytes, torch eager and torch.compile.
Without torch or a CUDA device the GPU part says so and exits 0.  Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
ROW_SPECS = ("layernorm", "rmsnorm", "add_rmsnorm", "row_softmax", "cross_entropy")


def _ideal(kernel, sizes) -> int:
    from kspec.compiler.canon import tensor_bytes
    total = 0
    for t in (*kernel.inputs, *kernel.outputs):
        n = 1
        for d in t.shape:
            n *= d if isinstance(d, int) else sizes[d]
        total += tensor_bytes(t.dtype, n)
    return total


def _without_row_rule(kernel):
    """The plan kspec made before the row rule: the rule is switched off for this one call (a
    gather still gets its elementwise kernel, as the rule's fallback gives it)."""
    import kspec.compiler.rowwise as rw
    from kspec.compiler import plan_kernel
    original = rw.fuse_rowwise

    def gathers_only(g, res):
        import networkx as nx
        from kspec.compiler.fusion import Group
        from kspec.compiler.graph import op
        for n in nx.topological_sort(g):
            if op(g, n).kind == "gather" and res.group_of(n) is None:
                res.groups.append(Group(f"g{len(res.groups)}", "elementwise", {n}, n))
    rw.fuse_rowwise = gathers_only
    try:
        return plan_kernel(kernel)
    finally:
        rw.fuse_rowwise = original


def model(rows: int, cols: int) -> None:
    from kspec.compiler import cost, plan_kernel
    from kspec.spec_lang import load_spec
    sizes = {"M": rows, "N": cols, "V": cols}
    print(f"modelled DRAM traffic at M={rows}, N=V={cols} (bf16):")
    print(f"  {'spec':<14} {'ops':>4} {'before':>22} {'now':>22} {'ideal':>10}")
    for stem in ROW_SPECS:
        k = load_spec(SPECS / f"{stem}.kspec").kernels[0]
        before, now = _without_row_rule(k), plan_kernel(k)
        cb, cn = cost(before, sizes), cost(now, sizes)
        ideal = _ideal(k, sizes)
        print(f"  {stem:<14} {cn.unfused_kernels:>4} {len(before.plans):>3} kernels {cb.fused_bytes / 1e9:7.3f} GB "
              f"{len(now.plans):>3} kernels {cn.fused_bytes / 1e9:7.3f} GB {ideal / 1e9:7.3f} GB"
              f"   ({cb.fused_bytes / ideal:.1f}x -> {cn.fused_bytes / ideal:.1f}x ideal)")


def gpu(rows: int, cols: int, reps: int, out: Path) -> int:
    sys.path.insert(0, str(ROOT / "bench"))
    from bench import Timer, _compiled, cuda_torch
    found = cuda_torch("rowwise")
    if found is None:
        return 0
    torch, arch = found

    import kspec
    from kspec.compile import Progress, compile_spec
    timer = Timer(torch, reps)
    F = torch.nn.functional
    M, N = rows, cols
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, res = torch.randn(M, N, **bf), torch.randn(M, N, **bf)
    w, b = torch.randn(N, **bf), torch.randn(N, **bf)
    label = torch.randint(0, N, (M,), device="cuda", dtype=torch.int32)
    y, h = torch.empty_like(x), torch.empty_like(x)
    loss = torch.empty(M, device="cuda", dtype=torch.float32)
    cases = {
        "layernorm": (dict(x=x, gamma=w, beta=b, y=y), lambda: F.layer_norm(x, (N,), w, b, 1e-5), 2 * M * N * 2),
        "rmsnorm": (dict(x=x, w=w, y=y), lambda: _rms(torch, x, w), 2 * M * N * 2),
        "add_rmsnorm": (dict(x=x, res=res, w=w, h=h, y=y), lambda: _add_rms(torch, x, res, w), 4 * M * N * 2),
        "row_softmax": (dict(x=x, y=y), lambda: torch.softmax(x, -1), 2 * M * N * 2),
        "cross_entropy": (dict(logits=x, label=label, loss=loss),
                          lambda: F.cross_entropy(x.float(), label.long(), reduction="none"), M * N * 2),
    }
    print(f"row kernels on {torch.cuda.get_device_name()} ({arch}), {M} x {N} bf16, reps {reps}")
    for stem, (args, eager, nbytes) in cases.items():
        # the kernel alone: the pre-launch index check (a D2H copy + a stream sync) is timed apart
        fn = getattr(kspec.load(compile_spec(SPECS / f"{stem}.kspec", (arch,), out, progress=Progress(enabled=False)),
                                check_indices=False), stem)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t_copy = timer(lambda: dst.copy_(src))          # reads and writes nbytes in all
        t = timer(lambda: fn(**args))
        t_eager = timer(eager)
        c = _compiled(torch, eager)
        t_comp = timer(c) if c else None
        print(f"  {stem:<14} kspec {t:7.3f} ms {nbytes / t / 1e6:7.1f} GB/s = {t_copy / t:5.1%} of copy "
              f"({nbytes / t_copy / 1e6:.0f} GB/s); x{t_eager / t:4.2f} vs eager"
              + (f", x{t_comp / t:4.2f} vs torch.compile" if t_comp else ""))
        if fn.entry.index_ranges:
            fn.check_indices = True
            t_checked = timer(lambda: fn(**args))
            fn.check_indices = False
            print(f"  {'':<14} with the index check before each launch: {t_checked:7.3f} ms")
    return 0


def _rms(torch, x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).bfloat16()


def _add_rms(torch, x, res, w):
    hh = x + res
    hf = hh.float()
    return hh, (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).bfloat16()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--gpu", action="store_true", help="also measure on the CUDA device")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("-o", "--output", default=str(ROOT / "build" / "bench"), help="artifact directory")
    args = ap.parse_args(argv)
    model(args.rows, args.cols)
    return gpu(args.rows, args.cols, args.reps, Path(args.output)) if args.gpu else 0


if __name__ == "__main__":
    sys.exit(main())
