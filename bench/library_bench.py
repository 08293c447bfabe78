"""Library-build benchmark: the same library built serially, on the local process pool and on Ray
(a local 2-CPU cluster), as wall times and ratios; then a paper estimate for a 1,000-kernel library.

    python bench/library_bench.py [--nvcc stand-in[:SECONDS] | --nvcc real] [--modes serial,local,ray]
                                  [--jobs 2] [--warm-emit] [--specs specs/*.kspec]

The library is every shipped spec for sm90a and sm100a.  Each mode starts from an empty compile
cache (so it plans, emits and compiles everything).  Planning and emission are always the real
ones; nvcc is either the real compiler (`--nvcc real`: 1-4 minutes per CUTLASS binary on a small
machine) or a stand-in that sleeps SECONDS per binary (default 3) and writes a deterministic
output, which measures what the build driver adds around the compiler.  --warm-emit seeds every
mode's cache with the generated sources (the emit memo), leaving only the compile phase.

The estimate uses the nvcc seconds recorded in the user's compile cache (meta.json of every entry
built so far, split into CUTLASS and plain-CUDA kernels) and the pool's measured efficiency.
This is a measurement script, not a test: nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

STAND_IN = r'''#!{python}
import hashlib, os, sys, time
from pathlib import Path
args = sys.argv[1:]
if args[:1] == ["--version"]:
    print("Cuda compilation tools, release 13.0, V13.0.88")
    sys.exit(0)
time.sleep(float(os.environ.get("KSPEC_BENCH_NVCC_SECONDS", "3")))
src = Path(args[-1]).read_bytes()
Path(args[args.index("-o") + 1]).write_bytes(hashlib.sha256(src + " ".join(args[:-3]).encode()).digest() * 64)
'''


def recorded_nvcc_seconds(root: Path) -> dict[str, list[float]]:
    """nvcc seconds per binary (cubin + host glue of one kernel summed) from a compile cache."""
    per: dict[tuple[str, str], float] = {}
    kind: dict[tuple[str, str], str] = {}
    for m in root.glob("??/*/meta.json"):
        try:
            d = json.loads(m.read_text())
        except (OSError, ValueError):
            continue
        key = (d.get("label", ""), d.get("arch", ""))
        per[key] = per.get(key, 0.0) + float(d.get("seconds", 0.0))
        kind[key] = "cutlass" if str(d.get("include_identity", "")).startswith("nvidia-cutlass") else "generic"
    out: dict[str, list[float]] = {"cutlass": [], "generic": []}
    for k, s in per.items():
        out[kind[k]].append(s)
    return out


def write_manifest(d: Path, specs: list[str]) -> Path:
    lines = ['[library]\nout = "lib"\narchs = ["sm90a", "sm100a"]\n']
    for s in specs:
        lines.append(f'[[specs]]\npath = "{Path(s).resolve()}"\n')
    m = d / "library.toml"
    m.write_text("\n".join(lines))
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvcc", default="stand-in:3")
    ap.add_argument("--modes", default="serial,local,ray")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--warm-emit", action="store_true")
    ap.add_argument("--specs", default=str(ROOT / "specs" / "*.kspec"))
    ap.add_argument("--user-cache", default=os.environ.get("KSPEC_CACHE_DIR") or "~/.cache/kspec",
                    help="compile cache whose recorded nvcc times feed the estimate")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kspec-libbench-"))
    if args.nvcc.startswith("stand-in"):
        seconds = args.nvcc.partition(":")[2] or "3"
        nvcc = work / "bin" / "nvcc"
        nvcc.parent.mkdir(parents=True)
        nvcc.write_text(STAND_IN.replace("{python}", sys.executable))
        nvcc.chmod(0o755)
        os.environ["KSPEC_NVCC"] = str(nvcc)
        os.environ["KSPEC_BENCH_NVCC_SECONDS"] = seconds
        what = f"stand-in nvcc sleeping {seconds}s per binary"
    else:
        what = "real nvcc"
    from kspec.library import build_library, load_library
    specs = sorted(glob.glob(args.specs))
    manifest = write_manifest(work, specs)
    emit_seed = None
    if args.warm_emit:
        from kspec.compile import emit_spec
        emit_seed = work / "seed"
        t0 = time.monotonic()
        for s in specs:
            emit_spec(s, ("sm90a", "sm100a"), cache_root=emit_seed)
        print(f"seeded the emit memo in {time.monotonic() - t0:.1f}s")

    times: dict[str, float] = {}
    summaries = {}
    for mode in args.modes.split(","):
        cache = work / f"cache-{mode}"
        if emit_seed is not None:
            shutil.copytree(emit_seed / "emit", cache / "emit")
        lib = load_library(manifest, out=str(work / f"out-{mode}"))
        t0 = time.monotonic()
        s = build_library(lib, executor=mode, jobs=1 if mode == "serial" else args.jobs, cache_root=str(cache))
        times[mode] = time.monotonic() - t0
        summaries[mode] = s
        if mode == "ray":
            import ray
            ray.shutdown()
        print(f"{mode:>6}: {times[mode]:7.1f}s  ({len(s.results)} tasks, {sum(r.built for r in s.results)} binaries, "
              f"{s.workers} workers)", flush=True)
    same = len({json.dumps(_tree_digest(work / f"out-{m}")) for m in times}) == 1
    print(f"\nlibrary: {len(specs)} specs x 2 archs; {what}; machine: {os.cpu_count()} CPUs")
    base = times.get("serial")
    for m, t in times.items():
        print(f"  {m:>6}  {t:7.1f}s" + (f"   speed-up vs serial {base / t:4.2f}x" if base else ""))
    print(f"  artifacts identical across modes: {same}")

    rec = recorded_nvcc_seconds(Path(args.user_cache).expanduser())
    cut = rec["cutlass"]
    if cut:
        mean = statistics.mean(cut)
        med = statistics.median(cut)
        print(f"\nrecorded nvcc time per CUTLASS kernel (cubin + host glue, {len(cut)} kernels in "
              f"{args.user_cache}): mean {mean:.0f}s, median {med:.0f}s")
        eff = (base / times["local"]) / args.jobs if base and "local" in times else 0.9
        for cpus in (64,):
            wall = 1000 * mean / (cpus * min(1.0, eff))
            print(f"1,000 CUTLASS kernels on {cpus} CPUs at the measured pool efficiency {eff:.2f}: "
                  f"~{wall / 60:.0f} min (serial: ~{1000 * mean / 3600:.1f} h); "
                  f"memory: {cpus} nvcc x 3.5 GB = {cpus * 3.5:.0f} GB")
    if rec["generic"]:
        print(f"recorded nvcc time per plain-CUDA kernel: mean {statistics.mean(rec['generic']):.1f}s "
              f"({len(rec['generic'])} kernels)")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _tree_digest(root: Path) -> dict[str, str]:
    import hashlib
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


if __name__ == "__main__":
    sys.exit(main())
