"""Helpers for the library-build tests: small plain-CUDA specs, and a stand-in nvcc whose output is
a deterministic function of its input (so builds are fast and comparable) and whose behaviour a
test steers through files in a control folder (Ray workers inherit the environment once, when the
cluster starts, so files rather than variables carry per-test switches):

    CTL/count      one line appended per compile (the source's sha256 and the output kind)
    CTL/sleep      seconds to sleep inside each compile
    CTL/fail       when present, a compile whose command line contains its text fails
    CTL/kill       when present, the first compile that manages to create CTL/killed kills its
                   parent process (the pool or Ray worker) with SIGKILL, half-way through
"""
from __future__ import annotations

import sys
from pathlib import Path

FAKE_NVCC = r'''#!{python}
import hashlib, os, signal, sys, time
from pathlib import Path
args = sys.argv[1:]
if args[:1] == ["--version"]:
    print("nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88")
    sys.exit(0)
ctl = Path(os.environ["KSPEC_FAKE_NVCC_CTL"])
out = args[args.index("-o") + 1]
src = Path(args[-1]).read_bytes()
kind = "cubin" if "-cubin" in args else "host"
if (ctl / "kill").exists():
    try:
        os.mkdir(ctl / "killed")
    except FileExistsError:
        pass
    else:
        Path(out).write_bytes(b"half a binary")
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(30)
        sys.exit(1)
fail = ctl / "fail"
if fail.exists() and fail.read_text() in " ".join(args):
    print(args[-1] + "(1): error: stand-in failure", file=sys.stderr)
    sys.exit(1)
sleep = ctl / "sleep"
if sleep.exists():
    time.sleep(float(sleep.read_text() or 0))
digest = hashlib.sha256(src + kind.encode() + " ".join(a for a in args if a.startswith("-arch") or "code=" in a).encode()).hexdigest()
with open(ctl / "count", "a") as f:
    f.write(hashlib.sha256(src).hexdigest()[:12] + " " + kind + "\n")
Path(out).write_bytes(("fake " + kind + " " + digest + "\n").encode() * 8)
'''

SPEC_AXPY = """
kernel axpy {
  in  X : f32[N]
  in  Y : f32[N]
  param alpha : f32 = 2.0
  out Z : f32[N]
  Z[i] = alpha * X[i] + Y[i]
}
kernel act {
  in  X : f16[M, N]
  out Y : f16[M, N]
  Y[m, n] = relu(X[m, n]) * X[m, n]
}
"""

SPEC_ROWSUM = """
kernel rowsum {
  in  X : f32[M, N]
  out S : f32[M]
  S[m] = sum(n) X[m, n]
}
"""


def make_fake_nvcc(root: Path) -> tuple[Path, Path]:
    """(the nvcc script, its control folder) under root."""
    bin_dir = root / "fakecuda" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(FAKE_NVCC.replace("{python}", sys.executable))
    nvcc.chmod(0o755)
    ctl = root / "ctl"
    ctl.mkdir(exist_ok=True)
    return nvcc, ctl


def reset_ctl(ctl: Path) -> None:
    for name in ("count", "sleep", "kill", "fail"):
        (ctl / name).unlink(missing_ok=True)
    if (ctl / "killed").exists():
        (ctl / "killed").rmdir()


def compiles(ctl: Path) -> list[str]:
    p = ctl / "count"
    return p.read_text().splitlines() if p.exists() else []


def write_library(root: Path, buckets: bool = True) -> Path:
    """Two specs (three kernels) for both archs; axpy.kspec in two size buckets."""
    specs = root / "specs"
    specs.mkdir(parents=True, exist_ok=True)
    (specs / "axpy.kspec").write_text(SPEC_AXPY)
    (specs / "rowsum.kspec").write_text(SPEC_ROWSUM)
    text = ('[library]\nout = "lib"\narchs = ["sm90a", "sm100a"]\n\n'
            + ('[buckets]\nsmall = { N = 256, M = 8 }\nlarge = { N = 65536, M = 4096 }\n\n' if buckets else "")
            + '[[specs]]\npath = "specs/axpy.kspec"\n'
            + ('buckets = ["small", "large"]\n' if buckets else "")
            + '\n[[specs]]\npath = "specs/rowsum.kspec"\n' + ('buckets = []\n' if buckets else ""))
    m = root / "library.toml"
    m.write_text(text)
    return m


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_cache_consistent(cache, count: int | None = None) -> None:
    """Every entry verifies (sha256 of its binary); no half-written entry is visible."""
    import hashlib
    import json
    entries = list(cache._entry_dirs())
    assert entries and (count is None or len(entries) == count)
    for d in entries:
        meta = json.loads((d / "meta.json").read_text())
        binary = d / ("kernel.cubin" if meta["kind"] == "cubin" else "kernel.so")
        assert hashlib.sha256(binary.read_bytes()).hexdigest() == meta["files"][binary.name]["sha256"]
        assert b"half a binary" not in binary.read_bytes()
