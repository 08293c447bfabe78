"""Faults from outside kspec (issue 27, items 5 and 6): the file system refuses, a compile is killed.

- environment errors are exit 1 naming the path and the problem, never an internal error: `-o`
  given /dev/null, a file, a path under a file, /proc/self or a read-only directory; `graph -o`
  that cannot be written; `kspec cache clear` on a read-only cache.  An unwritable cache directory
  falls back to a temporary one with one warning, and the artifact is the same.  (Read-only
  directories for real: a read-only bind mount in a private mount namespace, `unshare -rm`, since
  the tests run as root, for whom permission bits do not stop a write.)
- `kill -9` of a compile at 20 random points: the next compile is byte-identical to a clean build
  and no temporary directory is left (backends/cache.py's work dirs are flock-held by their builder
  and reclaimed once it is dead).
- cache entries follow the umask (a team can share a cache), and the nvcc host library is
  byte-identical across rebuilds.

Elsewhere: damage to each file of each cache kind's entry in test_cache_faults.py (CuTe DSL GEMM,
attention, memos) and test_build.py (nvcc); manifest tampering in test_manifest_tamper.py; the
runtime's bad-input table in test_bad_calls.py; the fuzzer in test_plan_fuzz.py (slow).
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from library_fixtures import SPEC_AXPY, make_fake_nvcc, reset_ctl, tree
from test_build import fake_tc  # noqa: F401  (the build tests' stand-in toolchain)

from kspec.backends import cache as entry

ROOT = Path(__file__).resolve().parents[1]
GEMM = ROOT / "specs" / "gemm.kspec"


@pytest.fixture
def fake(tmp_path):
    """(env for a CLI run with the stand-in nvcc, the spec, the control folder)."""
    nvcc, ctl = make_fake_nvcc(tmp_path)
    spec = tmp_path / "axpy.kspec"
    spec.write_text(SPEC_AXPY)
    env = {**os.environ, "KSPEC_NVCC": str(nvcc), "KSPEC_FAKE_NVCC_CTL": str(ctl),
           "KSPEC_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("KSPEC_TUNING_DB", None)
    return env, spec, ctl


def kspec(*args, env=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kspec", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120, **kw)


def leftovers(*dirs: Path) -> list[str]:
    """Temporary things under dirs: work dirs, discards, memo temporary files."""
    out = []
    for d in dirs:
        for p in d.rglob("*"):
            n = p.name
            if n.endswith((entry.WORK_SUFFIX, entry.NEW_SUFFIX)) or n.startswith(entry.DISCARD_PREFIX) or \
                    (n.startswith(".") and n.endswith(".tmp")) or ".tmp" in n and p.is_dir():
                out.append(str(p.relative_to(d)))
    return sorted(out)


# ---------------------------------------------------------------------------------------------
# environment errors: exit 1, the path named, nothing written
# ---------------------------------------------------------------------------------------------

def _main(args, capsys) -> tuple[int, str]:
    from kspec.cli import main
    rc = main([str(a) for a in args])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("where", ["dev-null", "file", "under-file", "proc-self"])
def test_bad_output_paths_are_exit_1_before_anything_is_built(tmp_path, capsys, where, monkeypatch):
    monkeypatch.setenv("KSPEC_CACHE_DIR", str(tmp_path / "cache"))
    a_file = tmp_path / "a_file"
    a_file.write_text("mine\n")
    out, named, problem = {
        "dev-null": ("/dev/null", "/dev/null", "is not a directory"),
        "file": (a_file, a_file, "is a file"),
        "under-file": (a_file / "sub", a_file, "is a file"),
        "proc-self": ("/proc/self", "/proc/self", "does not take new files"),
    }[where]
    for args in (["compile", GEMM, "--arch", "sm90a", "-o", out],
                 ["compile", GEMM, "--arch", "sm90a", "--emit-only", "-o", out]):
        rc, err = _main(args, capsys)
        assert rc == 1, err
        assert str(named) in err and problem in err and "internal error" not in err, err
    assert a_file.read_text() == "mine\n"
    assert not (tmp_path / "cache").exists()          # refused before planning wrote any memo
    rc, err = _main(["graph", GEMM, "-o", a_file / "g.txt"], capsys)
    assert rc == 1 and f"cannot write {a_file / 'g.txt'}: Not a directory" in err, err


def test_a_library_build_into_a_file_is_exit_1_before_any_task(tmp_path, fake, capsys, monkeypatch):
    from library_fixtures import write_library
    env, _, ctl = fake
    for k in ("KSPEC_NVCC", "KSPEC_FAKE_NVCC_CTL", "KSPEC_CACHE_DIR"):
        monkeypatch.setenv(k, env[k])
    manifest = write_library(tmp_path / "lib", buckets=False)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    rc, err = _main(["build", manifest, "-o", a_file / "lib", "-q"], capsys)
    assert rc == 1 and f"cannot create the output directory {a_file / 'lib'}: {a_file} is a file" in err, err
    assert not (ctl / "count").exists()               # no task ran


def test_an_unwritable_cache_falls_back_to_a_temporary_one(tmp_path, fake, capsys):
    """A cache directory under a file (root cannot make it writable either); the read-only
    directory itself is in test_read_only_directories."""
    env, spec, _ = fake
    clean = kspec("compile", spec, "--arch", "sm90a", "-o", tmp_path / "clean", "-q", env=env)
    assert clean.returncode == 0, clean.stderr
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    r = kspec("compile", spec, "--arch", "sm90a", "-o", tmp_path / "out", "-q",
              env={**env, "KSPEC_CACHE_DIR": str(blocker / "cache")})
    assert r.returncode == 0, r.stderr
    (warning,) = [l for l in r.stderr.splitlines() if "warning" in l]
    assert f"the cache directory {blocker / 'cache'} cannot be written ({blocker} is a file, not a directory)" \
        in warning
    assert "using a temporary cache for this run" in warning
    assert tree(tmp_path / "out") == tree(tmp_path / "clean")
    tmp_cache = Path(warning.split("(")[2].split(",")[0])
    assert not tmp_cache.exists()                     # removed at exit


def test_environment_oserrors_are_exit_1_internal_bugs_stay_2(capsys, monkeypatch):
    """The CLI's last line: an OSError only the environment causes (EROFS, ENOSPC, EACCES...) is
    exit 1 naming the path; any other exception is still an internal error."""
    import errno

    from kspec import cli
    for exc, rc in ((OSError(errno.ENOSPC, "No space left on device", "/x/y.cubin"), 1),
                    (PermissionError(errno.EACCES, "Permission denied", "/x"), 1),
                    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/x"), 2),
                    (KeyError("k"), 2)):
        def boom(args, exc=exc):
            raise exc
        monkeypatch.setattr(cli, "cmd_check", boom)
        got, err = _main(["check", "x.kspec"], capsys)
        assert got == rc, err
        if rc == 1:
            assert err.startswith(f"error: {exc.filename}: {exc.strerror}"), err
        else:
            assert "internal error" in err


def test_an_unwritable_tuning_database_is_exit_1(tmp_path):
    from test_tune import _entry

    from kspec.core import KspecError
    from kspec.tune import TuningDB
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    with pytest.raises(KspecError, match=f"cannot write the tuning database {blocker}/tune.json: {blocker} is a file"):
        TuningDB(blocker / "tune.json").put([_entry()])


def _unshare_ok() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    r = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"unshare -rm refused: {r.stderr.strip()}"


@pytest.mark.skipif(_unshare_ok() is not None, reason=f"needs a private mount namespace: {_unshare_ok()}")
def test_read_only_directories(tmp_path, fake):
    """Real read-only directories (bind mounts remounted read-only, in a private namespace): an
    output directory, an empty cache (falls back, same artifact), a cache to clear."""
    env, spec, _ = fake
    clean = kspec("compile", spec, "--arch", "sm90a", "-o", tmp_path / "clean", "-q", env=env)
    assert clean.returncode == 0, clean.stderr
    ro_out, ro_cache, full = tmp_path / "ro_out", tmp_path / "ro_cache", tmp_path / "cache"
    ro_out.mkdir()
    ro_cache.mkdir()
    ok = tmp_path / "ok"
    py = sys.executable
    script = f"""
set -u
for d in {ro_out} {ro_cache} {full}; do mount --bind $d $d && mount -o remount,ro,bind $d || exit 97; done
touch {ro_out}/x 2>/dev/null && exit 98
cd {ROOT}
run() {{ "$@" 2>&1; echo "== rc $?"; }}
run {py} -m kspec compile {spec} --arch sm90a -o {ro_out} -q
run {py} -m kspec compile {spec} --arch sm90a -o {ro_out}/sub --emit-only
run {py} -m kspec graph {spec} -o {ro_out}/g.txt
KSPEC_CACHE_DIR={ro_cache} run {py} -m kspec compile {spec} --arch sm90a -o {ok} -q
KSPEC_CACHE_DIR={full} run {py} -m kspec cache clear
"""
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    runs = [chunk.strip() for chunk in r.stdout.split("== rc ")]
    outs = [runs[0]] + [c.split("\n", 1)[1] if "\n" in c else "" for c in runs[1:-1]]
    rcs = [int(c.split("\n", 1)[0]) for c in runs[1:]]
    assert rcs == [1, 1, 1, 0, 1], r.stdout
    assert f"cannot write to the output directory {ro_out}: Read-only file system" in outs[0]
    assert f"cannot write to the output directory {ro_out}/sub" in outs[1]
    assert f"cannot write {ro_out}/g.txt: Read-only file system" in outs[2]
    assert f"the cache directory {ro_cache} cannot be written (Read-only file system)" in outs[3]
    assert f"cannot remove the cache entry {full}/" in outs[4] and "Read-only file system" in outs[4]
    assert not any("internal error" in o for o in outs), r.stdout
    assert tree(ok / "axpy") == tree(tmp_path / "clean" / "axpy")
    assert list(ro_out.iterdir()) == [] and list(ro_cache.iterdir()) == []
    assert len(list(full.glob("??/*"))) == 4          # clear could not remove anything: all there


# ---------------------------------------------------------------------------------------------
# kill -9
# ---------------------------------------------------------------------------------------------

def _kill_points(env, spec, ctl, tmp_path, points: int, seed: int, check_every: int, settle: float) -> None:
    clean_dir = tmp_path / "clean"
    t = time.monotonic()
    r = kspec("compile", spec, "--arch", "sm90a,sm100a", "-o", clean_dir, "-q",
              env={**env, "KSPEC_CACHE_DIR": str(tmp_path / "clean-cache")})
    cold = time.monotonic() - t
    assert r.returncode == 0, r.stderr
    clean = tree(clean_dir / spec.stem)
    cache, out = Path(env["KSPEC_CACHE_DIR"]), tmp_path / "out"
    rng = random.Random(seed)
    killed = 0
    for i in range(points):
        if rng.random() < 0.5 and cache.exists():
            shutil.rmtree(cache)                       # a cold build: kills land in nvcc and installs
        p = subprocess.Popen([sys.executable, "-m", "kspec", "compile", str(spec), "--arch", "sm90a,sm100a",
                              "-o", str(out), "-q"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.05, 0.85) * cold)
        p.send_signal(signal.SIGKILL)                 # the compile only: its nvcc, if any, is orphaned
        killed += p.wait() == -signal.SIGKILL
        if (i + 1) % check_every == 0:
            r = kspec("compile", spec, "--arch", "sm90a,sm100a", "-o", out, "-q", env=env)
            assert r.returncode == 0, r.stderr
            assert tree(out / spec.stem) == clean, f"after kill {i}"
    assert killed >= points // 2, f"only {killed} of {points} compiles were still running when killed"
    time.sleep(settle)              # the killed compiles' orphaned nvcc processes finish writing
    r = kspec("compile", spec, "--arch", "sm90a,sm100a", "-o", out, "-q", env=env)
    assert r.returncode == 0, r.stderr
    assert tree(out / spec.stem) == clean
    # a kill in the microseconds between a name's mkdir and its rename (backends/cache.py NEW_SUFFIX)
    # leaves an unlocked `.kspec-new`, which reclaim_dir keeps until it is UNLOCKED_S old (a live
    # builder holds that name only as long): aged past that, it is reclaimed like every other leftover
    old = time.time() - entry.UNLOCKED_S - 60
    for rel in leftovers(cache):
        if rel.endswith(entry.NEW_SUFFIX):
            os.utime(cache / rel, (old, old))
            entry.reclaim_dir((cache / rel).parent)
    assert leftovers(cache) == [] and sorted(p.name for p in out.iterdir()) == [spec.stem]


def test_kill_9_at_20_points(tmp_path, fake):
    """With the stand-in nvcc (20 ms per compile), both archs: 4 nvcc builds, 2 emit memos, the
    artifact; kills land in any of them (a compile takes about a second here)."""
    env, spec, ctl = fake
    reset_ctl(ctl)
    (ctl / "sleep").write_text("0.02")
    _kill_points(env, spec, ctl, tmp_path, points=20, seed=27, check_every=10, settle=0.5)


@pytest.mark.slow
@pytest.mark.cute
@pytest.mark.nvcc
def test_kill_9_real_builds(tmp_path):
    """The same with the real toolchains: a CuTe DSL GEMM and nvcc row kernels in one spec (8 points:
    each one is a cold compile of both; the 20 points above use a stand-in compiler)."""
    from kspec.backends.cute import compat
    from kspec.backends.toolchain import find_toolchain_or_reason
    why = compat.available() or find_toolchain_or_reason()
    if why:
        pytest.skip(why)
    spec = tmp_path / "mixed.kspec"
    spec.write_text(GEMM.read_text() + (ROOT / "specs" / "rmsnorm.kspec").read_text())
    env = {**os.environ, "KSPEC_CACHE_DIR": str(tmp_path / "cache")}
    _kill_points(env, spec, None, tmp_path, points=8, seed=28, check_every=1, settle=10)


# ---------------------------------------------------------------------------------------------
# reclaiming leftovers (backends/cache.py)
# ---------------------------------------------------------------------------------------------

def _old(p: Path) -> Path:
    t = time.time() - 3600
    os.utime(p, (t, t))
    return p


def test_reclaim_takes_dead_builders_leftovers_only(tmp_path):
    root = tmp_path / "cache"
    (root / "ab").mkdir(parents=True)
    dead, fd = entry._mkdir_private_name(root, "dead-")
    os.close(fd)                                                       # its builder died
    young = root / f"young-1234{entry.NEW_SUFFIX}"                    # a builder before its lock
    young.mkdir()
    stale = root / f"stale-1234{entry.NEW_SUFFIX}"                    # ... killed there a day ago
    stale.mkdir()
    t = time.time() - entry.UNLOCKED_S - 60
    os.utime(stale, (t, t))
    (root / "ab" / f"{entry.DISCARD_PREFIX}abcd-1234").mkdir()
    memo = root / ".x.json.123.abcd.tmp"                             # json_put's, its writer gone
    memo.write_text("{")
    keep = [root / "ab" / ("a" * 64), root / "notes.tmp", root / "tuning.json"]
    keep[0].mkdir()
    for k in keep[1:]:
        k.write_text("x")
        _old(k)
    with entry.workdir(root, "live-") as live:
        _old(live)
        assert entry.reclaim_dir(root) == 4
        assert live.is_dir() and young.is_dir() and not dead.exists() and not memo.exists() and not stale.exists()
        assert not list((root / "ab").glob(".discard-*")) and all(k.exists() for k in keep)
    assert not live.exists()                          # its block removed it
    # an output directory: only work dirs, never the user's own files
    out = tmp_path / "out"
    out.mkdir()
    user = [out / ".notes.tmp", out / f"{entry.DISCARD_PREFIX}mine"]
    user[0].write_text("x")
    _old(user[0])
    user[1].mkdir()
    staging, fd = entry._mkdir_private_name(out, ".gemm.")
    os.close(fd)
    assert entry.reclaim_dir(out, work_only=True) == 1 and not staging.exists() and all(u.exists() for u in user)


def test_a_live_builder_in_another_process_keeps_its_dir(tmp_path):
    root = tmp_path / "cache"
    code = ("import sys, time\nfrom pathlib import Path\nfrom kspec.backends import cache\n"
            "with cache.workdir(Path(sys.argv[1]), 'other-') as w:\n"
            "    print(w, flush=True)\n    time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        work = Path(p.stdout.readline().strip())
        _old(work)
        before = os.fstat(0)
        assert entry.reclaim_dir(root) == 0 and work.is_dir()
        assert os.fstat(0) == before        # a lock held elsewhere (False) is no fd to close: not stdin
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert work.is_dir()                          # kill -9: nothing ran to delete it
        assert entry.reclaim_dir(root) == 1 and not work.exists()
    finally:
        p.kill()
        p.wait()


# ---------------------------------------------------------------------------------------------
# modes, reproducible host libraries
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_cache_entries_follow_the_umask(tmp_path, umask, fake_tc):  # noqa: F811 (the fixture)
    """Entries were 0700 (mkdtemp): a cache shared by a team could not be read."""
    from kspec.backends.build import BuildJob, CompileCache
    old = os.umask(umask)
    try:
        r = CompileCache(tmp_path / "cache").build(BuildJob("k", "int x;", "sm90a"), fake_tc)
    finally:
        os.umask(old)
    assert stat.S_IMODE(r.path.parent.stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE(r.path.stat().st_mode) == 0o666 & ~umask


@pytest.mark.nvcc
def test_host_libraries_are_byte_identical_across_rebuilds(tmp_path):
    """nvcc compiles host code from a `tmpxft_<pid>_...cudafe1.cpp` whose name reached the .so's
    symbol table: two cold builds differed by a few bytes.  Linked with -Xlinker -x they do not."""
    from kspec.backends.build import CompileCache
    from kspec.backends.toolchain import find_toolchain_or_reason
    from kspec.compile import compile_spec
    why = find_toolchain_or_reason()
    if why:
        pytest.skip(why)
    trees = []
    for k in range(2):
        art = compile_spec(ROOT / "specs" / "rmsnorm.kspec", ("sm90a",), tmp_path / f"out{k}",
                           cache=CompileCache(tmp_path / f"cache{k}"))
        trees.append(tree(art))
        (so,) = [n for n in trees[-1] if n.endswith(".so")]
        assert b"tmpxft_" not in trees[-1][so]
    assert trees[0] == trees[1]
