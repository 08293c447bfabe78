"""Compile-time benchmark: `kspec compile` as a whole process, cold (empty cache) and warm, per backend.

    python bench/compile_time.py [SPEC] [--archs sm90a,sm100a] [--backends cute,cutlass] [--warm-runs 3]

For each backend it runs, in one session, a cold compile with a fresh empty cache directory and then
warm compiles of the unchanged spec against that cache, each as a separate `python -m kspec compile`
process.  It reports wall seconds, CPU seconds (user + system of the process and its children: the
parallel CuTe DSL workers and nvcc) and the peak resident memory of the largest process, and the
ratio of each backend's cold wall time to the first backend's, and the load average before and
after.  No GPU is needed.  This is not a test: nothing here asserts a speed (the machine may be
shared; CPU time is the steadier number).

Bytecode: an installed kspec has its modules compiled to .pyc, so the bench compiles kspec's sources
first (`compileall`) and runs the compiles with bytecode caching on, even where the environment sets
PYTHONDONTWRITEBYTECODE (which otherwise makes every process recompile ~0.3 s of kspec source);
`--no-bytecode` measures without.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(spec: Path, archs: str, backend: str, cache: Path, out: Path, bytecode: bool = True) -> dict:
    """One `kspec compile` process; wall/CPU/peak RSS measured with wait4 on that process."""
    env = {**os.environ, "KSPEC_CACHE_DIR": str(cache)}
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    cmd = [sys.executable, "-m", "kspec", "compile", str(spec), "--arch", archs, "-o", str(out), "-q",
           "--backend", backend]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    out_text = proc.stdout.read().decode()
    err = proc.stderr.read().decode()
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}):\n{err[-3000:]}")
    # ru covers the process and (for children it waited for) their CPU time; ru_maxrss is the
    # largest resident set among them, in KiB on Linux
    return {"wall_s": round(wall, 2), "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
            "peak_rss_mib": round(ru.ru_maxrss / 1024, 1), "stdout": out_text.strip().splitlines()[-1:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default=str(ROOT / "specs" / "gemm_bias_gelu_residual.kspec"))
    ap.add_argument("--archs", default="sm90a,sm100a")
    ap.add_argument("--backends", default="cute,cutlass")
    ap.add_argument("--warm-runs", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--no-bytecode", action="store_true", help="do not precompile kspec's modules")
    args = ap.parse_args(argv)
    spec = Path(args.spec)
    results: dict[str, dict] = {}
    bytecode = not args.no_bytecode
    if bytecode:
        import compileall
        for d in ("kspec", "spec_lang", "compiler", "backends"):
            compileall.compile_dir(str(ROOT / d), quiet=1)
    load0 = os.getloadavg()
    print(f"load average before: {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f} on {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory(prefix="kspec-bench-") as tmp:
        for backend in args.backends.split(","):
            cache = Path(tmp) / f"cache-{backend}"
            out = Path(tmp) / f"out-{backend}"
            cold = run_once(spec, args.archs, backend, cache, out, bytecode)
            warm = [run_once(spec, args.archs, backend, cache, out, bytecode) for _ in range(args.warm_runs)]
            results[backend] = {"cold": cold, "warm": warm}
            best = min(warm, key=lambda r: r["wall_s"]) if warm else None
            print(f"{backend:8s} cold: {cold['wall_s']:7.2f} s wall {cold['cpu_s']:7.2f} s CPU "
                  f"peak RSS {cold['peak_rss_mib']:7.1f} MiB", flush=True)
            if best:
                print(f"{backend:8s} warm: {best['wall_s']:7.2f} s wall {best['cpu_s']:7.2f} s CPU "
                      f"peak RSS {best['peak_rss_mib']:7.1f} MiB (best of {len(warm)})", flush=True)
    names = list(results)
    if len(names) > 1:
        base = results[names[0]]["cold"]
        for n in names[1:]:
            other = results[n]["cold"]
            print(f"cold {n}/{names[0]}: wall x{other['wall_s'] / base['wall_s']:.1f}, "
                  f"CPU x{other['cpu_s'] / max(base['cpu_s'], 1e-9):.1f}")
    load = os.getloadavg()
    print(f"load average during the run: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps({"spec": spec.name, "archs": args.archs, "results": results,
                                               "loadavg_before": load0, "loadavg": load, "cpus": os.cpu_count(),
                                               "bytecode": bytecode}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
