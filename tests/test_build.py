"""Compile cache and parallel build driver.

The cache and driver logic is tested fast with a stand-in nvcc (a shell script that writes its
arguments and source to the output); the `nvcc`-marked tests repeat the essentials with the real
nvcc on tiny plain-CUDA sources (about a second each)."""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import subprocess
import time
import types
from pathlib import Path

import pytest

from kspec.backends import build
from kspec.backends.build import (BackendBuildError, BuildJob, CompileCache, build_all,
                                  default_parallelism, tree_identity)
from kspec.backends.toolchain import Toolchain, find_toolchain
from kspec.spec_lang.errors import KspecError

FAKE_NVCC = r"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0; fi
out=""; prev=""; src=""
for a in "$@"; do
  if [ "$prev" = "-o" ]; then out="$a"; fi
  prev="$a"; src="$a"
done
if grep -q FAIL "$src"; then
  echo "$src(3): error: identifier \"FAIL\" is undefined" >&2
  echo "1 error detected in the compilation of \"$src\"." >&2
  exit 1
fi
echo "warning: fake nvcc"
if [ -n "$FAKE_NVCC_COUNT" ]; then echo x >> "$FAKE_NVCC_COUNT"; fi
sleep "${FAKE_NVCC_SLEEP:-0}"
{ echo "$@"; cat "$src"; } > "$out"
"""


@pytest.fixture
def fake_tc(tmp_path):
    bin_dir = tmp_path / "fakecuda" / "bin"
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    return Toolchain(nvcc=nvcc, version="13.0.88", cuda_home=bin_dir.parent, bin_dir=bin_dir)


@pytest.fixture
def cache(tmp_path):
    return CompileCache(tmp_path / "cache")


@pytest.fixture
def count_file(tmp_path, monkeypatch):
    """Counts fake nvcc runs (across threads and processes)."""
    f = tmp_path / "nvcc-runs"
    monkeypatch.setenv("FAKE_NVCC_COUNT", str(f))
    return lambda: len(f.read_text().splitlines()) if f.exists() else 0


def job(src="int x;", arch="sm90a", kind="cubin", flags=(), label=None, **kw) -> BuildJob:
    return BuildJob(label or f"kernel k on {arch}", src, arch, kind, flags=flags, **kw)


# ---- keys (no compiler involved) ----

def test_key_covers_everything_that_changes_the_binary(fake_tc, cache):
    base = cache.key(job(), fake_tc)
    assert cache.key(job(label="another label"), fake_tc) == base
    variants = [job(src="int y;"), job(arch="sm100a"), job(kind="host"), job(flags=("-O3",)),
                job(include_dirs=("/inc",)), job(include_dirs=("/inc",), include_identity="cutlass 4.2.0")]
    keys = {cache.key(v, fake_tc) for v in variants}
    assert base not in keys and len(keys) == len(variants)
    newer = Toolchain(nvcc=fake_tc.nvcc, version="13.1.0", cuda_home=fake_tc.cuda_home, bin_dir=fake_tc.bin_dir)
    assert cache.key(job(), newer) != base
    # the include identity stands for the contents: the path is then not keyed
    a = job(include_dirs=("/site-a/include",), include_identity="cutlass 4.2.0")
    b = job(include_dirs=("/site-b/include",), include_identity="cutlass 4.2.0")
    assert cache.key(a, fake_tc) == cache.key(b, fake_tc)


def test_job_validation_and_nvcc_command(fake_tc):
    with pytest.raises(KspecError, match="unknown arch 'sm80'"):
        job(arch="sm80")
    with pytest.raises(ValueError):
        job(kind="ptx")
    j = BuildJob("k", "src", "sm100a", "host", include_dirs=["/a"], flags=["-std=c++17"])
    assert j.include_dirs == ("/a",) and j.flags == ("-std=c++17",)
    assert j.nvcc_command("nvcc", "kernel.cu", "kernel.so") == [
        "nvcc", "-DKSPEC_HOST", "-Xcompiler", "-fPIC", "-shared", "-Xlinker", "-x", "-gencode",
        "arch=compute_100a,code=sm_100a", "-I/a", "-std=c++17", "-o", "kernel.so", "kernel.cu"]
    assert job().nvcc_command("nvcc", "k.cu", "k.cubin")[:4] == ["nvcc", "-DKSPEC_DEVICE", "-cubin", "-arch=sm_90a"]


def test_default_parallelism_bounded_by_memory(monkeypatch):
    monkeypatch.delenv("KSPEC_JOBS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(build, "_mem_available", lambda: 8 * 2**30)
    assert default_parallelism() == 2          # 8 GiB / 3.5 GiB
    monkeypatch.setattr(build, "_mem_available", lambda: 1 * 2**30)
    assert default_parallelism() == 1
    monkeypatch.setattr(build, "_mem_available", lambda: 256 * 2**30)
    assert default_parallelism() == 16
    monkeypatch.setenv("KSPEC_JOBS", "3")
    assert default_parallelism() == 3


def test_tree_identity_changes_with_contents(tmp_path):
    (tmp_path / "a.h").write_text("x")
    first = tree_identity(tmp_path)
    assert tree_identity(tmp_path) == first
    (tmp_path / "a.h").write_text("xy")
    assert tree_identity(tmp_path) != first


# ---- cache behaviour with the stand-in nvcc ----

def test_miss_then_hit_without_running_nvcc(fake_tc, cache, count_file):
    r1 = cache.build(job(), fake_tc)
    assert not r1.cached and r1.path.is_file() and count_file() == 1
    assert r1.path == cache.entry_dir(r1.key) / "kernel.cubin"
    meta = json.loads((r1.path.parent / "meta.json").read_text())
    assert meta["files"]["kernel.cubin"]["sha256"] == hashlib.sha256(r1.path.read_bytes()).hexdigest()
    assert set(meta["files"]) == {"kernel.cubin", "kernel.cu", "build.log"}
    assert meta["label"] == "kernel k on sm90a" and meta["arch"] == "sm90a"
    assert meta["toolchain"]["nvcc_version"] == "13.0.88"
    assert "warning: fake nvcc" in r1.log.read_text()
    assert (r1.path.parent / "kernel.cu").read_text() == "int x;"
    r2 = cache.build(job(label="same kernel, new label"), fake_tc)
    assert r2.cached and r2.path == r1.path and count_file() == 1
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)
    # a fresh cache object on the same root (a new process) hits too
    assert CompileCache(cache.root).lookup(job(), fake_tc) is not None


def test_host_kind_builds_a_shared_object(fake_tc, cache):
    r = cache.build(job(kind="host"), fake_tc)
    assert r.path.name == "kernel.so"
    assert "-DKSPEC_HOST -Xcompiler -fPIC -shared -Xlinker -x -gencode arch=compute_90a,code=sm_90a" in r.path.read_text()


@pytest.mark.parametrize("change", ["source", "arch", "flags", "kind"])
def test_change_misses(fake_tc, cache, count_file, change):
    cache.build(job(), fake_tc)
    changed = {"source": job(src="int y;"), "arch": job(arch="sm100a"), "flags": job(flags=("-O3",)),
               "kind": job(kind="host")}[change]
    r = cache.build(changed, fake_tc)
    assert not r.cached and count_file() == 2 and cache.info()["entries"] == 2


@pytest.mark.parametrize("name", ["kernel.cubin", "kernel.cu", "build.log", "meta.json"])
@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_damage_to_any_file_of_an_entry_is_rebuilt_with_one_warning(fake_tc, cache, count_file, name, how, capsys):
    r1 = cache.build(job(), fake_tc)
    good = r1.path.read_bytes()
    p = r1.path.parent / name
    if how == "delete":
        p.unlink()
    else:
        b = bytearray(p.read_bytes())
        if how == "flip":
            b[len(b) // 2] ^= 1
        else:
            del b[len(b) // 2:]
        p.write_bytes(bytes(b))
    capsys.readouterr()
    r2 = cache.build(job(), fake_tc)
    assert not r2.cached and r2.path.read_bytes() == good and cache.stats.corrupt == 1 and count_file() == 2
    assert capsys.readouterr().err.count("is damaged") == 1
    assert cache.build(job(), fake_tc).cached and count_file() == 2


def test_corrupt_entry_is_rebuilt_and_counted(fake_tc, cache, count_file):
    r1 = cache.build(job(), fake_tc)
    data = bytearray(r1.path.read_bytes())
    data[0] ^= 0xFF
    r1.path.write_bytes(bytes(data))
    r2 = cache.build(job(), fake_tc)
    assert not r2.cached and count_file() == 2 and cache.stats.corrupt == 1
    assert r2.path.read_bytes()[0] == bytes(data)[0] ^ 0xFF        # original content again
    # broken metadata counts as corrupt too
    (r2.path.parent / "meta.json").write_text("{not json")
    assert cache.lookup(job(), fake_tc) is None and cache.stats.corrupt == 2
    assert cache.info()["entries"] == 0


def test_failure_raises_with_saved_log(fake_tc, cache):
    bad = job(src="FAIL;", label="kernel broken on sm100a", arch="sm100a")
    with pytest.raises(BackendBuildError) as ei:
        cache.build(bad, fake_tc)
    e = ei.value
    assert e.message.startswith("backend failed for kernel broken on sm100a")
    assert e.log_path is not None and e.log_path.is_file() and str(e.log_path) in e.message
    assert e.log_path.parent == cache.root / "logs"
    log = e.log_path.read_text()
    assert 'identifier "FAIL" is undefined' in log and "nvcc exit status 1" in log
    assert "-arch=sm_100a" in log                                    # the command is recorded
    assert e.log_path.with_suffix(".cu").read_text() == "FAIL;"
    assert 'identifier "FAIL" is undefined' in e.hint and "FAIL;" not in e.message
    assert cache.info()["entries"] == 0 and list((cache.root / "tmp").iterdir()) == []
    assert cache.info()["failed_logs"] == 1


def test_info_and_clear(fake_tc, cache, tmp_path):
    assert cache.info() == {"root": str(cache.root), "entries": 0, "bytes": 0, "failed_logs": 0,
                            "by_kind": {"nvcc": (0, 0), "cute": (0, 0), "attention": (0, 0), "attention_bwd": (0, 0)}}
    r1 = cache.build(job(), fake_tc)
    cache.build(job(arch="sm100a"), fake_tc)
    info = cache.info()
    assert info["entries"] == 2 and info["bytes"] > 2 * r1.path.stat().st_size
    # CuTe DSL GEMM and FlashAttention-4 entries (their folders as backends/cute writes them) count too
    key = "ab" * 32
    (cache.root / "cute" / "ab" / key).mkdir(parents=True)
    (cache.root / "cute" / "ab" / key / "kernel.cubin").write_bytes(b"x" * 100)
    (cache.root / "cute-attention" / "ab" / f"{key}-4096" / "sm100").mkdir(parents=True)
    (cache.root / "cute-attention" / "ab" / f"{key}-4096" / "sm100" / "kernel.cubin").write_bytes(b"y" * 30)
    (cache.root / "cute-attention-bwd" / "ab" / key / "v1").mkdir(parents=True)
    (cache.root / "cute-attention-bwd" / "ab" / key / "v1" / "kernel.cubin").write_bytes(b"z" * 7)
    (cache.root / "cute" / "ab" / "not-a-key").mkdir()
    info = cache.info()
    assert info["by_kind"]["cute"] == (1, 100) and info["by_kind"]["attention"] == (1, 30)
    assert info["by_kind"]["attention_bwd"] == (1, 7)
    assert info["entries"] == 5 and info["bytes"] == info["by_kind"]["nvcc"][1] + 137
    (cache.root / "unrelated.txt").write_text("keep me")
    assert cache.clear() == 5
    assert not (cache.root / "cute").exists() and not (cache.root / "cute-attention").exists()
    assert not (cache.root / "cute-attention-bwd").exists()
    assert cache.info()["entries"] == 0 and (cache.root / "unrelated.txt").exists()
    assert not (cache.root / "locks").exists()


def test_cache_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KSPEC_CACHE_DIR", str(tmp_path / "c"))
    assert CompileCache().root == tmp_path / "c"
    monkeypatch.delenv("KSPEC_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert CompileCache().root == tmp_path / ".cache" / "kspec"


def _build_in_child(root: str, tc: Toolchain, j: BuildJob, q) -> None:
    try:
        r = CompileCache(root).build(j, tc)
        q.put((str(r.path), r.cached, hashlib.sha256(r.path.read_bytes()).hexdigest()))
    except BaseException as e:          # report instead of hanging the parent
        q.put(("error", repr(e), ""))


def _two_processes(root: Path, tc: Toolchain, j: BuildJob) -> list[tuple]:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(root), tc, j, q)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return results


def test_two_processes_same_job_one_compile(fake_tc, cache, count_file, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "0.5")     # both are surely in flight together
    results = _two_processes(cache.root, fake_tc, job())
    assert all(r[0] != "error" for r in results), results
    assert results[0][0] == results[1][0] and results[0][2] == results[1][2]
    assert sorted(r[1] for r in results) == [False, True]     # one compiled, one reused it
    assert count_file() == 1 and cache.info()["entries"] == 1


def test_loser_of_an_install_race_reuses_the_winner(fake_tc, cache, count_file, monkeypatch):
    """Without the lock (e.g. another kspec version), the second rename finds the entry."""
    r1 = cache.build(job(), fake_tc)
    monkeypatch.setattr(CompileCache, "lookup", lambda self, j, tc: None)   # pretend we missed
    r2 = cache.build(job(), fake_tc)
    assert r2.path == r1.path and count_file() == 2 and cache.info()["entries"] == 1
    assert list((cache.root / "tmp").iterdir()) == []


# ---- build_all ----

def test_build_all_parallel_order_dedupe_and_progress(fake_tc, cache, count_file, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "0.3")
    jobs = [job(src=f"int v{i};", label=f"kernel k{i} on sm90a") for i in range(4)]
    jobs.append(job(src="int v0;", label="duplicate of k0"))
    events = []
    t0 = time.monotonic()
    results = build_all(jobs, fake_tc, cache, max_parallel=4, progress=events.append)
    wall = time.monotonic() - t0
    assert [r.job.label for r in results][:4] == [j.label for j in jobs[:4]]
    assert results[4].path == results[0].path and count_file() == 4
    assert wall < 4 * 0.3 + 0.6, f"not parallel: {wall:.2f}s"
    kinds = sorted(e.kind for e in events)
    assert kinds == ["done"] * 4 + ["start"] * 4
    assert events[-1].finished == events[-1].total == 4
    assert all(e.elapsed >= 0.25 for e in events if e.kind == "done")

    events.clear()
    again = build_all(jobs, fake_tc, cache, progress=events.append)
    assert all(r.cached for r in again) and count_file() == 4
    assert [e.kind for e in events] == ["cached"] * 4


def test_build_all_failure_lets_running_jobs_finish(fake_tc, cache, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "0.5")
    jobs = [job(src="FAIL;", label="kernel bad on sm90a"), job(src="int ok;", label="kernel ok on sm90a")]
    with pytest.raises(BackendBuildError) as ei:
        build_all(jobs, fake_tc, cache, max_parallel=2)
    assert "kernel bad on sm90a" in ei.value.message and ei.value.log_path.is_file()
    assert cache.info()["entries"] == 1                 # the good one finished and is cached
    assert cache.lookup(jobs[1], fake_tc) is not None


def test_build_all_two_failures_are_both_reported(fake_tc, cache):
    jobs = [job(src="FAIL; 1", label="kernel a on sm90a"), job(src="FAIL; 2", label="kernel b on sm90a")]
    with pytest.raises(BackendBuildError) as ei:
        build_all(jobs, fake_tc, cache, max_parallel=2)
    assert len(ei.value.failures) == 2 and "1 more failed" in ei.value.message
    assert all(p.is_file() for _, p in ei.value.failures)


def test_build_all_checks_toolchain_arch_support(fake_tc, cache):
    old = Toolchain(nvcc=fake_tc.nvcc, version="12.4.0", cuda_home=fake_tc.cuda_home, bin_dir=fake_tc.bin_dir)
    with pytest.raises(KspecError, match="cannot build for sm100a"):
        build_all([job(arch="sm100a")], old, cache)


# ---- the real nvcc ----

def _real_toolchain() -> Toolchain:
    try:
        return find_toolchain()
    except KspecError as e:
        pytest.skip(f"no nvcc: {e.message}")


TINY_KERNEL = r"""
struct Params { float* x; int n; };
#ifdef KSPEC_DEVICE
extern "C" __global__ void kspec_kernel(Params p) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < p.n) p.x[i] = __expf(p.x[i]) * SCALE;
}
#endif
#ifdef KSPEC_HOST
extern "C" int kspec_workspace_size(const long long*, unsigned long long* bytes, char*, unsigned long long) {
  *bytes = 0; return 0;
}
#endif
"""


def tiny(arch="sm90a", kind="cubin", scale="2.0f", src=TINY_KERNEL) -> BuildJob:
    return BuildJob(f"kernel tiny on {arch}", src, arch, kind, flags=(f"-DSCALE={scale}",))


@pytest.fixture
def real_nvcc_runs(monkeypatch):
    """Counts compiling nvcc processes (not `nvcc --version` probes of toolchain discovery)."""
    calls = []
    real_popen = subprocess.Popen

    def counting(cmd, *a, **kw):
        if "-o" in cmd:
            calls.append(cmd)
        return real_popen(cmd, *a, **kw)
    monkeypatch.setattr(build.subprocess, "Popen", counting)
    return calls


@pytest.mark.nvcc
def test_real_cubin_and_host_build_then_hit(cache, real_nvcc_runs):
    tc = _real_toolchain()
    results = build_all([tiny(), tiny(kind="host")], tc, cache, max_parallel=1)
    cubin, so = results
    assert not cubin.cached and cubin.path.read_bytes()[:4] == b"\x7fELF"
    assert so.path.suffix == ".so" and so.path.read_bytes()[:4] == b"\x7fELF"
    import ctypes
    lib = ctypes.CDLL(str(so.path))                 # loads without libcuda
    assert hasattr(lib, "kspec_workspace_size")
    assert len(real_nvcc_runs) == 2 and cubin.compile_seconds > 0
    again = build_all([tiny(), tiny(kind="host")], tc, cache)
    assert all(r.cached for r in again) and len(real_nvcc_runs) == 2
    changed = cache.build(tiny(scale="3.0f"), tc)
    assert not changed.cached and len(real_nvcc_runs) == 3


@pytest.mark.nvcc
def test_real_corrupt_cubin_rebuilt(cache, real_nvcc_runs):
    tc = _real_toolchain()
    r1 = cache.build(tiny(), tc)
    good = r1.path.read_bytes()
    r1.path.write_bytes(good[:100] + bytes(b ^ 0x5A for b in good[100:200]) + good[200:])
    r2 = cache.build(tiny(), tc)
    assert not r2.cached and cache.stats.corrupt == 1 and len(real_nvcc_runs) == 2
    assert hashlib.sha256(r2.path.read_bytes()).hexdigest() == hashlib.sha256(good).hexdigest()


@pytest.mark.nvcc
def test_real_two_processes_compile_same_job(cache):
    tc = _real_toolchain()
    results = _two_processes(cache.root, tc, tiny(arch="sm100a"))
    assert all(r[0] != "error" for r in results), results
    assert results[0][0] == results[1][0] and results[0][2] == results[1][2]
    assert sorted(r[1] for r in results) == [False, True]
    assert cache.info()["entries"] == 1


@pytest.mark.nvcc
def test_real_nvcc_error_is_a_backend_build_error(cache):
    tc = _real_toolchain()
    bad = BuildJob("kernel broken on sm100a", TINY_KERNEL.replace("p.n)", "p.n_missing)"), "sm100a",
                   flags=("-DSCALE=1.0f",))
    with pytest.raises(BackendBuildError) as ei:
        cache.build(bad, tc)
    e = ei.value
    assert e.message.startswith("backend failed for kernel broken on sm100a (nvcc exit")
    log = e.log_path.read_text()
    assert "n_missing" in log and "error" in log
    assert "n_missing" in e.hint                           # first error line, not the whole dump
    assert len(str(e)) < 1000


def test_interrupt_stops_running_nvcc_and_leaves_no_entries(fake_tc, cache, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "20")
    started = []

    def progress(e):
        if e.kind == "start":
            started.append(e.label)
            if len(started) == 2:            # both nvcc runs are (about to be) in flight
                raise KeyboardInterrupt
    jobs = [job(src=f"int v{i};", label=f"kernel k{i} on sm90a") for i in range(3)]
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        build_all(jobs, fake_tc, cache, max_parallel=2, progress=progress)
    assert time.monotonic() - t0 < 10
    assert cache.info()["entries"] == 0 and list((cache.root / "tmp").iterdir()) == []


def test_one_compile_counts_its_dsl_and_nvcc_builds_in_one_sequence():
    """`kspec compile` of a spec with CuTe DSL and nvcc kernels prints one [i/n] count over both."""
    import io

    from kspec.backends.build import BuildEvent
    from kspec.backends.cute.parallel import CuteEvent
    from kspec.compile import Progress, _OneCounter
    out = io.StringIO()
    c = _OneCounter(Progress(out), later=2)
    dsl = types.SimpleNamespace(label="kernel gemm_0 on sm_90a", kind="cute")
    c.first(CuteEvent("start", dsl.label, 0.0, dsl, 0, 1))
    c.first(CuteEvent("done", dsl.label, 1.0, dsl, 1, 1))
    job = BuildJob("rms", "x", "sm90a", "cubin", (), (), "t")
    c.then(BuildEvent("done", "rms", 1.0, job, 1, 2))
    c.then(BuildEvent("cached", "rms", 0.0, job, 2, 2))
    assert [line.split("]")[0] + "]" for line in out.getvalue().splitlines()] == ["[0/3]", "[1/3]", "[2/3]", "[3/3]"]
