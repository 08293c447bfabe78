"""Prebuild every shipped spec for sm90a and sm100a on a CPU machine, for bench/gpu_check.sh.

Also the specs of bench/risks/ (`risk_*`): each settles on a GPU one risk no CPU test can (issue 22;
`kspec selftest` prints which, kspec.selftest.RISKS).

    python bench/prebuild.py [-o bench/prebuilt] [--arch sm90a,sm100a] [-j JOBS] [--wheels]

Writes one artifact folder per spec into OUT (default bench/prebuilt/, ignored by git), plus
OUT/SIZES.txt with the folder sizes; fails if the whole folder exceeds 60 MiB.  Needs nvcc and
nvidia-cutlass (compiles are cached in $KSPEC_CACHE_DIR, so a rebuild after a small change is quick).

With --wheels it also downloads, into .whl/ (ignored), the pure-Python wheels the GPU machine may
lack for `kspec selftest` (lark; networkx, ml_dtypes and pytest are looked up by the script there
and installed from .whl/ only when missing): `pip download --only-binary=:all:` for CPython 3.12
manylinux x86-64, the GPU machine's Python.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 60 << 20
WHEELS = ("lark", "networkx", "ml_dtypes", "pytest", "iniconfig", "pluggy", "packaging")


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def bench_specs() -> dict[str, str]:
    """Spec texts that bench/attention_decode.py and bench/grad.py compile for themselves, by the
    artifact name their `--prebuilt DIR` loads; and the plain attention's backward (head dim 128),
    whose sm_90a main kernel is FA4_SMEM_RISK's case, for gpu_check.sh's selftest to settle; the
    GQA attention's (FA4's five-kernel GQA backward, its dK/dV accumulators zeroed by the runtime);
    and the score-modified backwards FA4 builds with generated score_mod/score_mod_bwd (soft-capping
    at head dim 128, ALiBi with --wrt Q,K,V): values only a GPU run checks, against the reference.
    Of those four only the backward kernel is built (SELFTEST_ONLY; no bench script loads them, and
    their forwards are FA4 kernels selftest checks elsewhere), which keeps both archs in 60 MiB."""
    sys.path.insert(0, str(ROOT / "bench"))
    import attention_decode
    import grad
    from kspec.spec_lang import load_spec
    from kspec.spec_lang.grad import grad_program
    out = {"attention_decode_dense": attention_decode.DENSE, "attention_decode_paged": attention_decode.PAGED}
    for stem in (*grad.GPU_PATTERNS, "attention", "attention_gqa"):
        out[f"{stem}_grad"] = grad_program(load_spec(ROOT / "specs" / f"{stem}.kspec"))
    softcap = (ROOT / "specs" / "attention_softcap.kspec").read_text()
    softcap = softcap.replace("256", "128").replace("0.0625", "0.08838834764831845")
    out["attention_softcap128_grad"] = grad_program(load_spec(softcap, is_text=True))
    out["attention_alibi_grad"] = grad_program(load_spec(ROOT / "specs" / "attention_alibi.kspec"), wrt=["Q", "K", "V"])
    return out


# artifacts only `kspec selftest` reads: name -> the one kernel built (the derived backward)
SELFTEST_ONLY = {"attention_grad": "attention_bwd", "attention_gqa_grad": "attention_gqa_bwd",
                 "attention_softcap128_grad": "attention_softcap_bwd", "attention_alibi_grad": "attention_alibi_bwd"}


def download_wheels(dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
           "--platform", "manylinux2014_x86_64", "-d", str(dest), *WHEELS]
    return subprocess.run(cmd).returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default=str(ROOT / "bench" / "prebuilt"))
    ap.add_argument("--arch", default="sm90a,sm100a")
    ap.add_argument("-j", "--jobs", type=int, default=None)
    ap.add_argument("--only", help="comma-separated spec stems (default: every spec in specs/)")
    ap.add_argument("--wheels", action="store_true", help="also download the wheels gpu_check.sh may need into .whl/")
    args = ap.parse_args(argv)
    from kspec.compile import compile_spec
    from kspec.core import NoBackendError, normalize_arch
    from kspec.spec_lang import load_spec
    archs = tuple(normalize_arch(a) for a in args.arch.split(","))
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    sources = {p.stem: p for d in (ROOT / "specs", ROOT / "bench" / "risks") for p in sorted(d.glob("*.kspec"))}
    # the specs some bench scripts write themselves (decode attention, derived backwards): written
    # to a temporary folder under the names those scripts load with --prebuilt
    tmp = Path(tempfile.mkdtemp(prefix="kspec-prebuild-"))
    for stem, text in bench_specs().items():
        (tmp / f"{stem}.kspec").write_text(text)
        sources[stem] = tmp / f"{stem}.kspec"
    stems = args.only.split(",") if args.only else list(sources)
    lines = []
    for stem in stems:
        t0 = time.time()
        try:
            # a spec's `target` line limits its archs (mxfp8_gemm: sm100a only)
            targets = load_spec(sources[stem]).targets
            spec_archs = tuple(a for a in archs if not targets or a in targets)
            if not spec_archs:
                lines.append(f"{stem:<28} skipped: targets {', '.join(targets)} only")
                print(lines[-1], flush=True)
                continue
            art = compile_spec(sources[stem], spec_archs, out, jobs=args.jobs, kernel=SELFTEST_ONLY.get(stem))
        except NoBackendError as e:
            # a shipped spec no backend builds yet (language + reference only): said, not hidden
            lines.append(f"{stem:<28} skipped: {e.message}")
            print(lines[-1], flush=True)
            continue
        size = folder_bytes(art)
        lines.append(f"{stem:<28} {size / 2**20:7.2f} MiB  ({time.time() - t0:.0f} s)")
        print(lines[-1], flush=True)
    total = folder_bytes(out)
    lines.append(f"{'total':<28} {total / 2**20:7.2f} MiB  (archs {', '.join(archs)})")
    (out / "SIZES.txt").write_text("\n".join(lines) + "\n")
    print(lines[-1])
    rc = 0
    if total > LIMIT:
        print(f"prebuild: {out} is {total / 2**20:.1f} MiB, over the {LIMIT >> 20} MiB the GPU machine accepts")
        rc = 1
    if args.wheels:
        rc = download_wheels(ROOT / ".whl") or rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
