"""How much `import kspec` and `kspec --version` cost on top of a bare interpreter, measured in one
run (median of N fresh processes each).  Target (kernel-IR seam issue): within 0.3 s of
`python -c pass`.

    python bench/import_time.py [--runs 10]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def median_seconds(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, cwd=ROOT)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    py = sys.executable
    cases = [("python -c pass", [py, "-c", "pass"]),
             ("import kspec", [py, "-c", "import kspec"]),
             ("import kspec.runtime", [py, "-c", "import kspec.runtime"]),
             ("kspec --version", [py, "-m", "kspec", "--version"])]
    base = None
    print(f"{'command':<24} {'median s':>9} {'over bare':>10} {'ratio':>7}")
    for name, argv in cases:
        t = median_seconds(argv, args.runs)
        base = t if base is None else base
        print(f"{name:<24} {t:>9.3f} {t - base:>+10.3f} {t / base:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
