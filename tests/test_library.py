"""`kspec build`: manifests, the local process pool, incremental re-runs, concurrent builds, killed
workers and corrupt cache entries.  nvcc is a stand-in (tests/library_fixtures.py) whose outputs
are deterministic, so these tests take seconds and compare whole artifact trees; the planning,
emission, cache and artifact assembly are the real ones."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from library_fixtures import assert_cache_consistent, compiles, make_fake_nvcc, reset_ctl, tree, write_library

from kspec.core import KspecError
from kspec.library import build_library, load_library, plan_tasks

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    nvcc, ctl = make_fake_nvcc(tmp_path)
    monkeypatch.setenv("KSPEC_NVCC", str(nvcc))
    monkeypatch.setenv("KSPEC_FAKE_NVCC_CTL", str(ctl))
    monkeypatch.setenv("KSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KSPEC_TUNING_DB", raising=False)
    return ctl


# ---- manifests ---------------------------------------------------------------------------------

def test_manifest_lists_specs_buckets_and_archs(tmp_path):
    m = write_library(tmp_path)
    lib = load_library(m)
    assert [Path(s.path).name for s in lib.specs] == ["axpy.kspec", "rowsum.kspec"]
    axpy, rowsum = lib.specs
    assert axpy.archs == ("sm90a", "sm100a")
    assert [(b.name, b.as_dict) for b in axpy.buckets] == [("small", {"M": 8, "N": 256}),
                                                           ("large", {"M": 4096, "N": 65536})]
    assert rowsum.buckets == ()
    assert Path(lib.out) == tmp_path / "lib"
    # without a tuning database the buckets of a kernel share one task: 3 kernels x 2 archs
    tasks = plan_tasks(lib, str(tmp_path / "cache"))
    assert sorted((t.kernel, t.arch, t.bucket) for t in tasks) == sorted(
        (k, a, "") for k in ("axpy", "act", "rowsum") for a in ("sm90a", "sm100a"))
    # with one, every bucket of axpy.kspec is its own task
    tasks = plan_tasks(lib, str(tmp_path / "cache"), tuning_db=str(tmp_path / "db.json"))
    assert len(tasks) == 2 * 2 * 2 + 2


def test_manifest_globs_json_and_directories(tmp_path):
    write_library(tmp_path)
    (tmp_path / "lib.json").write_text(json.dumps({"library": {"archs": "sm_90a"},
                                                   "specs": [{"path": "specs/*.kspec"}]}))
    lib = load_library(tmp_path / "lib.json")
    assert [Path(s.path).stem for s in lib.specs] == ["axpy", "rowsum"]
    assert all(s.archs == ("sm90a",) for s in lib.specs)
    d = load_library(tmp_path / "specs", out=str(tmp_path / "o"))
    assert [Path(s.path).stem for s in d.specs] == ["axpy", "rowsum"] and d.specs[0].archs is None


@pytest.mark.parametrize("text, words", [
    ('[library]\nouts = "x"\n[[specs]]\npath = "specs/axpy.kspec"\n', ["[library]", "unknown key(s) outs"]),
    ('[[specs]]\npath = "specs/axpy.kspec"\nbuckets = ["tiny"]\n', ["[[specs]] #1", "unknown bucket(s) tiny"]),
    ('[[specs]]\npath = "specs/nope*.kspec"\n', ["[[specs]] #1", "matches no file"]),
    ('[[specs]]\npath = "specs/axpy.kspec"\narchs = ["sm80"]\n', ["archs", "unknown arch 'sm80'"]),
    ('[buckets]\nsmall = { M = -1 }\n[[specs]]\npath = "specs/axpy.kspec"\n', ["[buckets] small", "positive"]),
    ('[library]\narchs = ["sm90a"]\n', ["no [[specs]] entries"]),
    ('[[specs]]\npath = "specs/axpy.kspec"\n[[specs]]\npath = "specs/*.kspec"\n', ["listed twice"]),
    ('[[specs]\npath = 1\n', ["not valid TOML"]),
])
def test_manifest_mistakes_name_the_file_and_key(tmp_path, text, words):
    write_library(tmp_path)
    m = tmp_path / "bad.toml"
    m.write_text(text)
    with pytest.raises(KspecError) as e:
        load_library(m)
    msg = e.value.render()
    assert "bad.toml" in msg
    for w in words:
        assert w in msg


# ---- building ----------------------------------------------------------------------------------

def test_pool_build_writes_artifacts_then_reruns_from_the_cache(tmp_path, fake):
    lib = load_library(write_library(tmp_path))
    events = []
    s = build_library(lib, jobs=2, report=lambda ev, t, r: events.append((ev, t.label)))
    assert s.ok and s.executor == "local" and s.workers == 2
    # 3 kernels x 2 archs x (cubin + host glue), each compiled exactly once
    assert len(compiles(fake)) == 12 and len(set(compiles(fake))) == 12
    assert sum(r.built for r in s.results) == 12
    assert sorted(e for e, _ in events) == ["done"] * 6 + ["start"] * 6
    out = Path(lib.out)
    for bucket in ("small", "large"):
        man = json.loads((out / bucket / "axpy" / "manifest.json").read_text())
        assert [k["name"] for k in man["kernels"]] == ["axpy", "act"]
        assert man["archs"] == ["sm90a", "sm100a"]
    index = json.loads((out / "library.json").read_text())
    assert [(a["spec"], a["bucket"], a["path"]) for a in index["artifacts"]] == [
        ("axpy.kspec", "small", "small/axpy"), ("axpy.kspec", "large", "large/axpy"), ("rowsum.kspec", None, "rowsum")]
    assert index["artifacts"][0]["size_key"] == "M=8,N=256"
    table = s.table()
    assert "rowsum.kspec:rowsum" in table and "12 binaries built" in table
    first = tree(out)

    # incremental: nothing is compiled again, and the artifacts are byte-identical
    s2 = build_library(lib, jobs=2)
    assert len(compiles(fake)) == 12
    assert all(r.status == "cached" for r in s2.results) and "0 binaries built, 12 cached" in s2.table()
    assert s2.workers == 0 and "6 tasks all found in the cache" in s2.table()      # no worker started
    assert tree(out) == first


def test_serial_and_pool_builds_are_identical(tmp_path, fake):
    lib = load_library(write_library(tmp_path))
    build_library(lib, executor="serial")
    serial = tree(Path(lib.out))
    (tmp_path / "cache").rename(tmp_path / "cache-serial")
    build_library(lib, jobs=2)
    assert tree(Path(lib.out)) == serial


def test_corrupt_cache_entry_is_detected_and_rebuilt(tmp_path, fake):
    lib = load_library(write_library(tmp_path, buckets=False))
    build_library(lib, jobs=2)
    good = tree(Path(lib.out))
    metas = sorted((tmp_path / "cache").glob("??/*/meta.json"))
    assert len(metas) == 12
    victim = next(m for m in metas if json.loads(m.read_text())["kind"] == "cubin")
    (victim.parent / "kernel.cubin").write_bytes(b"bit rot")
    s = build_library(lib, jobs=2)
    assert sum(r.corrupt for r in s.results) == 1 and sum(r.built for r in s.results) == 1
    assert [r.status for r in s.results].count("rebuilt") == 1
    assert "1 corrupt cache entries rebuilt" in s.table()
    assert len(compiles(fake)) == 13
    assert tree(Path(lib.out)) == good


def test_worker_killed_mid_compile_is_retried_and_the_cache_stays_consistent(tmp_path, fake):
    from kspec.backends.build import CompileCache
    lib = load_library(write_library(tmp_path, buckets=False))
    (fake / "kill").write_text("")
    s = build_library(lib, jobs=2)
    assert (fake / "killed").is_dir(), "the stand-in nvcc should have killed a worker"
    assert s.ok
    assert max(r.attempts for r in s.results) >= 2
    reset_ctl(fake)
    assert_cache_consistent(CompileCache(tmp_path / "cache"))
    killed = tree(Path(lib.out))
    # the same library built with no fault is identical
    (tmp_path / "cache").rename(tmp_path / "cache-killed")
    build_library(lib, jobs=2)
    assert tree(Path(lib.out)) == killed



def test_two_concurrent_builds_of_the_same_library(tmp_path, fake):
    m = write_library(tmp_path, buckets=False)
    (fake / "sleep").write_text("0.3")
    env = dict(os.environ)
    procs = [subprocess.Popen([sys.executable, "-m", "kspec", "build", str(m), "-o", str(tmp_path / f"out{i}"),
                               "-j", "2", "-q"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    # each binary compiled once across both builds (the per-key lock), both artifact trees equal
    assert len(compiles(fake)) == 12 and len(set(compiles(fake))) == 12
    assert tree(tmp_path / "out0") == tree(tmp_path / "out1")
    for o in outs:
        assert "6 tasks" in o and "wrote 2 artifacts" in o


def test_spec_errors_stop_the_build_before_any_compile(tmp_path, fake):
    m = write_library(tmp_path, buckets=False)
    (tmp_path / "specs" / "rowsum.kspec").write_text("kernel rowsum {\n  in X : f32[M, N]\n  out S : f32[M]\n"
                                                     "  S[m] = sum(n) Y[m, n]\n}\n")
    r = subprocess.run([sys.executable, "-m", "kspec", "build", str(m), "-q"], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 1, r.stderr
    assert "rowsum.kspec:4:" in r.stderr and "Y" in r.stderr
    assert compiles(fake) == []


def test_build_cli_reports_failed_tasks_with_the_summary(tmp_path, fake):
    m = write_library(tmp_path, buckets=False)
    (fake / "fail").write_text("code=sm_100a")          # every sm_100a host-glue build fails
    r = subprocess.run([sys.executable, "-m", "kspec", "build", str(m), "-j", "2", "-q"], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 1, r.stderr
    assert "3 of 6 build tasks failed" in r.stderr and "on sm_100a" in r.stderr and "stand-in failure" in r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith(("axpy.kspec", "rowsum.kspec"))]
    assert len(rows) == 6 and [(" sm100a " in line) for line in rows if " FAILED " in line] == [True] * 3
    assert "3 FAILED" in r.stdout
    assert not (tmp_path / "lib" / "axpy").exists() and not (tmp_path / "lib" / "rowsum").exists()


@pytest.mark.slow
def test_tuned_library_builds_a_configuration_per_bucket(tmp_path, fake):
    """tune = true: the build ranks each bucket (cost model), and each bucket's artifact carries its
    winner (sm90a GEMM: a 64-row tile for M = 64, a 128x256 tile for M = 8192).  Real emission
    through cutlass_cppgen (~10-30 s), stand-in nvcc."""
    import shutil
    shutil.copy(ROOT / "specs" / "gemm.kspec", tmp_path / "gemm.kspec")
    (tmp_path / "lib.toml").write_text(
        '[library]\nout = "lib"\narchs = ["sm90a"]\ntuning_db = "tuning.json"\ntune = true\n\n'
        '[buckets]\ndecode = { M = 64, N = 4096, K = 4096 }\nprefill = { M = 8192, N = 8192, K = 8192 }\n\n'
        '[[specs]]\npath = "gemm.kspec"\n')
    lib = load_library(tmp_path / "lib.toml")
    s = build_library(lib, jobs=2)
    assert s.ok and len(s.results) == 2
    tiles = {}
    for bucket in ("decode", "prefill"):
        man = json.loads((tmp_path / "lib" / bucket / "gemm" / "manifest.json").read_text())
        tiles[bucket] = man["kernels"][0]["plans"][0]["binaries"]["sm90a"]["config"]["tile"]
    # (the CuTe DSL backend's tiles are MxN; the CUTLASS backend's MxNxK)
    assert tiles["decode"].startswith("64x") and tiles["prefill"] in ("128x256", "256x128", "128x256x64", "256x128x64")
    from kspec.tune import TuningDB
    assert {e.bucket for e in TuningDB(tmp_path / "tuning.json").entries()} == {"K=4096,M=64,N=4096",
                                                                               "K=8192,M=8192,N=8192"}
    # tuned and built: a re-run finds everything in the cache and starts no worker
    again = build_library(lib, jobs=2)
    assert again.workers == 0 and all(r.status == "cached" for r in again.results)
    # `kspec compile` applies the same database for a bucket
    r = subprocess.run([sys.executable, "-m", "kspec", "compile", str(tmp_path / "gemm.kspec"), "--arch", "sm90a",
                        "--emit-only", "--print", "--tuning-db", str(tmp_path / "tuning.json"),
                        "--sizes", "M=64,N=4096,K=4096"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    t = tiles["decode"]            # a CUTLASS source names it in a comment, a CuTe DSL one as a tuple
    assert "tile=" + t in r.stdout or "(" + t.replace("x", ", ") + ")" in r.stdout


@pytest.mark.nvcc
def test_library_build_with_real_nvcc(tmp_path, monkeypatch):
    """The plain-CUDA library through the real nvcc (about 5-10 s per binary), loaded back."""
    monkeypatch.setenv("KSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KSPEC_NVCC", raising=False)
    m = write_library(tmp_path, buckets=False)
    m.write_text(m.read_text().replace('archs = ["sm90a", "sm100a"]', 'archs = ["sm90a"]'))
    s = build_library(load_library(m), jobs=2)
    assert s.ok and sum(r.built for r in s.results) == 6
    import kspec
    mod = kspec.load(tmp_path / "lib" / "axpy")
    assert hasattr(mod, "axpy") and hasattr(mod, "act")


def test_progress_lines_and_rich_bar(tmp_path):
    import io

    from kspec.library import BuildTask, ProgressReporter, TaskResult
    t = BuildTask(str(tmp_path / "a.kspec"), "k", "sm90a", "decode", (("M", 64),), str(tmp_path))
    plain = io.StringIO()
    r = ProgressReporter(2, stream=plain)
    r("start", t, None)
    r("done", t, TaskResult(t, True, built=2, seconds=1.25))
    r("retry", t, None)
    r("done", t, TaskResult(t, False, error="error: x"))
    lines = [line.split("   [")[0] for line in plain.getvalue().splitlines()]
    assert lines == ["[0/2] queued    a.kspec:k sm90a [decode]",
                     "[1/2] built     a.kspec:k sm90a [decode] in 1.2s (2 built, 0 cached)",
                     "[1/2] RETRY     a.kspec:k sm90a [decode] (its worker died)",
                     "[2/2] FAILED    a.kspec:k sm90a [decode]"]
    pytest.importorskip("rich", reason="rich draws the bar on a terminal when it is installed")

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    term = Terminal()
    r = ProgressReporter(1, stream=term)
    r("done", t, TaskResult(t, True, cached=2))
    r.close()
    import re
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", term.getvalue())
    assert "cached    a.kspec:k sm90a [decode]" in text and "1/1" in text


def test_build_dir_takes_arch_like_compile(tmp_path, fake):
    """`kspec build DIR --arch sm90a`: every spec of the directory for that arch only (stand-in nvcc)."""
    write_library(tmp_path, buckets=False)
    r = subprocess.run([sys.executable, "-m", "kspec", "build", str(tmp_path / "specs"), "-o", str(tmp_path / "o"),
                        "--arch", "sm_90a", "-q"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "3 tasks" in r.stdout and "wrote 2 artifacts" in r.stdout
    for stem in ("axpy", "rowsum"):
        assert json.loads((tmp_path / "o" / stem / "manifest.json").read_text())["archs"] == ["sm90a"]
    r = subprocess.run([sys.executable, "-m", "kspec", "build", str(tmp_path / "specs"), "--arch", "sm80"],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 1 and "sm80" in r.stderr
