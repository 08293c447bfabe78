"""A damaged cache entry is never served (issue 27, item 1).

- backends/cache.py on its own: every file of a sealed entry (meta.json included) corrupted,
  truncated, deleted or edited is found; install keeps a whole entry another process wrote first,
  replaces a damaged one, and fails loudly when it cannot write.
- the runtime refuses a truncated host library before dlopen, in a subprocess that must exit
  normally (the old failure was SIGBUS inside ctypes.CDLL).
- the real CLI on the CuTe DSL GEMM cache: the reported repro (meta.json `{` plus a flipped cubin
  byte; a truncated kernel.so) and every file of the entry, each followed by a compile whose
  artifact is byte-identical to the clean build's.
- the one-file memos (emit/, resources/); the nvcc compile cache's own case is in test_build.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kspec.backends import cache as entry
from kspec.core import KspecError

ROOT = Path(__file__).resolve().parents[1]


# ---- backends/cache.py ----

def _sealed(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    (work / "v0").mkdir(parents=True)
    (work / "kernel.cubin").write_bytes(bytes(range(256)) * 4)
    (work / "kernel.so").write_bytes(b"\x7fELF" + b"x" * 500)
    (work / "v0" / "kernel.cubin").write_bytes(b"variant")
    entry.seal(work, {"format": 7, "key": "k", "symbol": "kspec_kernel", "param_offsets": [0, 8]})
    return work


def _damage(p: Path, how: str) -> None:
    if how == "flip":
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 0x01
        p.write_bytes(bytes(b))
    elif how == "truncate":
        p.write_bytes(p.read_bytes()[: max(1, p.stat().st_size // 3)])
    elif how == "delete":
        p.unlink()
    elif how == "empty":
        p.write_bytes(b"")


FILES = ["kernel.cubin", "kernel.so", "v0/kernel.cubin", "meta.json"]


@pytest.mark.parametrize("how", ["flip", "truncate", "delete", "empty"])
@pytest.mark.parametrize("name", FILES)
def test_every_damage_to_every_file_is_found(tmp_path, name, how):
    d = _sealed(tmp_path)
    assert entry.verify(d, 7)[0] is not None
    _damage(d / name, how)
    try:
        meta, why = entry.verify(d, 7)
    except entry.Stale:         # a truncated meta.json that still parses as another format is stale
        assert name == "meta.json"
        return
    assert meta is None and why


def test_an_edited_metadata_field_is_found(tmp_path):
    d = _sealed(tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    meta["param_offsets"] = [0, 16]             # still valid JSON, still the right format
    (d / "meta.json").write_text(json.dumps(meta))
    assert entry.verify(d, 7) == (None, "meta.json does not match its own digest")


def test_a_symlinked_or_extra_named_file_is_refused(tmp_path):
    d = _sealed(tmp_path)
    outside = tmp_path / "outside.cubin"
    shutil.copyfile(d / "kernel.cubin", outside)
    (d / "kernel.cubin").unlink()
    (d / "kernel.cubin").symlink_to(outside)
    assert entry.verify(d, 7) == (None, "kernel.cubin is not a regular file")


def test_read_removes_damage_with_one_warning_and_stale_silently(tmp_path, capsys):
    d = _sealed(tmp_path)
    _damage(d / "kernel.so", "flip")
    assert entry.read(d, 7) is None and not d.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kernel.so does not match its sha256" in err[0] and str(d) in err[0]
    d = _sealed(tmp_path)
    assert entry.read(d, 8) is None and not d.exists()          # another format: stale
    assert capsys.readouterr().err == ""
    assert not list(tmp_path.glob(".discard-*"))


def test_install_keeps_theirs_replaces_damage_and_fails_loudly(tmp_path):
    mine = _sealed(tmp_path)
    dest = tmp_path / "cache" / "ab" / "abcd"
    theirs = tmp_path / "theirs"
    shutil.copytree(mine, theirs)
    assert entry.install(theirs, dest, 7)["key"] == "k" and not theirs.exists()
    # a whole entry is there: ours is not installed, theirs is kept (the caller removes `mine`)
    assert entry.install(mine, dest, 7)["key"] == "k" and mine.exists()
    # a damaged entry in the way is replaced
    _damage(dest / "kernel.cubin", "truncate")
    assert entry.install(mine, dest, 7)["files"]["kernel.cubin"]["bytes"] == 1024 and not mine.exists()
    assert entry.verify(dest, 7)[1] is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_install_into_a_read_only_cache_is_an_error(tmp_path):
    mine = _sealed(tmp_path)
    ro = tmp_path / "ro"
    (ro / "ab").mkdir(parents=True)
    (ro / "ab").chmod(0o555)
    try:
        with pytest.raises(KspecError, match="cannot write the cache entry"):
            entry.install(mine, ro / "ab" / "abcd", 7)
    finally:
        (ro / "ab").chmod(0o755)


def test_install_where_a_file_blocks_the_entry_is_an_error(tmp_path):
    """A swap that fails is an error (the old code swallowed it and served the old files)."""
    mine = _sealed(tmp_path)
    dest = tmp_path / "cache" / "ab" / "abcd"
    dest.parent.mkdir(parents=True)
    dest.parent.chmod(0o755)
    blocker = dest.parent / "abcd"
    blocker.mkdir()
    (blocker / "meta.json").write_text("{")
    (blocker / "lock").mkdir()                  # discard renames it aside: then the install goes on
    meta = entry.install(mine, dest, 7)
    assert meta["key"] == "k"


def test_json_memos_are_verified(tmp_path, capsys):
    p = tmp_path / "emit" / "x.json"
    entry.json_put(p, {"source": "int x;", "include_dirs": ["cutlass:include"]})
    assert entry.json_get(p) == {"source": "int x;", "include_dirs": ["cutlass:include"]}
    text = p.read_text().replace("int x;", "int y;")
    p.write_text(text)
    assert entry.json_get(p) is None and not p.exists()
    assert "does not match its sha256" in capsys.readouterr().err
    p.write_text(json.dumps({"source": "old layout"}))        # an older kspec's memo: stale
    assert entry.json_get(p) is None and capsys.readouterr().err == ""
    assert entry.json_get(p) is None                          # absent


# ---- the runtime's ELF check ----

def test_truncated_host_library_is_refused_before_dlopen(tmp_path):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("needs a C compiler to make a shared library")
    src = tmp_path / "g.c"
    src.write_text("int kspec_workspace_size(void) { return 0; }\n" * 1 + "".join(
        f"int f{k}(int x) {{ return x * {k}; }}\n" for k in range(400)))
    so = tmp_path / "g.so"
    subprocess.run([gcc, "-shared", "-fPIC", "-O0", str(src), "-o", str(so)], check=True)
    bad = tmp_path / "bad.so"
    bad.write_bytes(so.read_bytes()[:2000])
    code = ("import sys\nfrom kspec.runtime.glue import HostGlue\nfrom kspec.runtime.errors import KspecRuntimeError\n"
            "try:\n    HostGlue(sys.argv[1], 'plan p on sm90a')\nexcept KspecRuntimeError as e:\n"
            "    print('REFUSED', e); sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 3, (r.returncode, r.stderr)          # not -7 (SIGBUS)
    assert "REFUSED" in r.stdout and str(bad) in r.stdout and "not a whole shared library" in r.stdout
    from kspec.runtime.elfcheck import elf_problem
    assert elf_problem(so.read_bytes()) is None
    assert elf_problem(so.read_bytes()[:-1]) is not None
    assert elf_problem(b"not an elf") is not None


# ---- the CuTe DSL GEMM cache, through the CLI ----

def _compile(cache: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KSPEC_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "kspec", "compile", str(ROOT / "specs" / "gemm.kspec"),
                           "--arch", "sm90a", "-o", str(out)], capture_output=True, text=True, env=env, cwd=ROOT)


def _tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def clean_gemm(tmp_path_factory):
    from kspec.backends.cute import compat
    why = compat.available()
    if why is not None:
        pytest.skip(f"needs the CuTe DSL: {why}")
    base = tmp_path_factory.mktemp("cute-cache")
    r = _compile(base / "cache", base / "clean")
    assert r.returncode == 0, r.stderr
    return base, _tree(base / "clean")


def _entry_dir(cache: Path) -> Path:
    (d,) = list(cache.glob("cute/*/*"))
    return d


@pytest.mark.cute
@pytest.mark.parametrize("fault", ["repro", "truncated-so", "flip:kernel.ptx", "delete:kernel.so",
                                   "delete:meta.json", "edit:meta.json"])
def test_damaged_cute_entry_is_rebuilt_byte_identical(clean_gemm, tmp_path, fault):
    base, clean = clean_gemm
    cache = tmp_path / "cache"
    shutil.copytree(base / "cache", cache)
    d = _entry_dir(cache)
    if fault == "repro":            # the issue's: `{` into meta.json and one cubin byte flipped
        (d / "meta.json").write_text("{")
        _damage(d / "kernel.cubin", "flip")
    elif fault == "truncated-so":
        (d / "kernel.so").write_bytes((d / "kernel.so").read_bytes()[:2000])
    elif fault == "edit:meta.json":
        meta = json.loads((d / "meta.json").read_text())
        meta["param_offsets"] = [o + 8 for o in meta["param_offsets"]]
        (d / "meta.json").write_text(json.dumps(meta))
    else:
        how, name = fault.split(":")
        _damage(d / name, how)
    for k in range(2):              # compile again, twice: both artifacts are the clean build's
        r = _compile(cache, tmp_path / f"out{k}")
        assert r.returncode == 0, r.stderr
        assert _tree(tmp_path / f"out{k}") == clean
        warnings = [l for l in r.stderr.splitlines() if "is damaged" in l]
        assert len(warnings) == (1 if k == 0 else 0), r.stderr
    assert entry.verify(_entry_dir(cache), json.loads((_entry_dir(cache) / "meta.json").read_text())["format"])[1] is None
    assert not list(cache.glob("cute/*/.discard-*"))


@pytest.mark.cute
def test_damaged_attention_entry_is_rebuilt_byte_identical(tmp_path):
    from kspec.backends.cute import compat
    why = compat.fa4_available()
    if why is not None:
        pytest.skip(f"needs FlashAttention-4: {why}")
    cache = tmp_path / "cache"

    def compile_(out):
        env = {**os.environ, "KSPEC_CACHE_DIR": str(cache)}
        return subprocess.run([sys.executable, "-m", "kspec", "compile", str(ROOT / "specs" / "attention_decode.kspec"),
                               "--arch", "sm90a", "-o", str(out)], capture_output=True, text=True, env=env, cwd=ROOT)
    r = compile_(tmp_path / "clean")
    assert r.returncode == 0, r.stderr
    clean = _tree(tmp_path / "clean")
    (d,) = list(cache.glob("cute-attention/*/*"))
    (cubin,) = sorted(d.glob("v*/kernel.cubin"))[:1]
    _damage(cubin, "flip")
    r = compile_(tmp_path / "again")
    assert r.returncode == 0, r.stderr
    assert sum("is damaged" in l for l in r.stderr.splitlines()) == 1, r.stderr
    assert _tree(tmp_path / "again") == clean


CUTE_FILES = ["entry.py", "exports.map", "glue.c", "kernel.cubin", "kernel.h", "kernel.o", "kernel.ptx", "kernel.so",
              "link.log", "meta.json"]


@pytest.mark.slow
@pytest.mark.cute
@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("name", CUTE_FILES)
def test_every_file_of_a_cute_entry_damaged_every_way(clean_gemm, tmp_path, name, how):
    """The whole matrix for the CuTe DSL GEMM cache (the default tier takes a selection above):
    each file corrupted, truncated or deleted; the next compile rebuilds, byte-identical."""
    base, clean = clean_gemm
    cache = tmp_path / "cache"
    shutil.copytree(base / "cache", cache)
    d = _entry_dir(cache)
    assert sorted(p.name for p in d.iterdir()) == sorted(CUTE_FILES)
    _damage(d / name, how)
    r = _compile(cache, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert _tree(tmp_path / "out") == clean
    assert sum("is damaged" in l for l in r.stderr.splitlines()) == 1, r.stderr


def _compile_attention(cache: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KSPEC_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "kspec", "compile", str(ROOT / "specs" / "attention_decode.kspec"),
                           "--arch", "sm90a", "-o", str(out)], capture_output=True, text=True, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def clean_attention(tmp_path_factory):
    """One cold FlashAttention-4 build (cache and artifact), copied by each damage case."""
    from kspec.backends.cute import compat
    why = compat.fa4_available()
    if why is not None:
        pytest.skip(f"needs FlashAttention-4: {why}")
    base = tmp_path_factory.mktemp("attention-cache")
    r = _compile_attention(base / "cache", base / "clean")
    assert r.returncode == 0, r.stderr
    return base, _tree(base / "clean")


@pytest.mark.slow
@pytest.mark.cute
@pytest.mark.parametrize("name", ["entry.py", "meta.json", "v0/kernel.cubin", "v0/kernel.so"])
@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_every_file_of_an_attention_entry_damaged(clean_attention, tmp_path, name, how):
    base, clean = clean_attention
    cache = tmp_path / "cache"
    shutil.copytree(base / "cache", cache)
    (d,) = list(cache.glob("cute-attention/*/*"))
    _damage(d / name, how)
    r = _compile_attention(cache, tmp_path / "again")
    assert r.returncode == 0, r.stderr
    assert sum("is damaged" in l for l in r.stderr.splitlines()) == 1, r.stderr
    assert _tree(tmp_path / "again") == clean
