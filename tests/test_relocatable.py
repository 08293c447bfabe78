"""Artifacts and caches carry no machine paths (issue 13, item 3): the compile cache keys nvcc by
major.minor, the emit memo stores include dirs relative to the CUTLASS tree, and an artifact built
here loads from a copy after the original is gone."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kspec.backends import cache as cache_entry
from kspec.backends.build import CompileCache, BuildJob, toolchain_release
from kspec.backends.desc import EmittedKernel
from kspec.backends.toolchain import Toolchain


def _tc(version: str) -> Toolchain:
    return Toolchain(nvcc=Path(f"/opt/cuda-{version}/bin/nvcc"), version=version,
                     cuda_home=Path(f"/opt/cuda-{version}"), bin_dir=Path(f"/opt/cuda-{version}/bin"))


def test_cache_key_uses_nvcc_major_minor(tmp_path):
    cache = CompileCache(tmp_path / "cache")
    job = BuildJob("k", "int x;", "sm90a", "cubin", include_dirs=("/site-a/include",),
                   include_identity="nvidia-cutlass 4.2.0.0")
    a = cache.key(job, _tc("13.0.88"))
    assert cache.key(job, _tc("13.0.48")) == a            # another patch release, another install path
    assert cache.key(job, _tc("13.1.80")) != a
    assert toolchain_release("13.0.88") == "13.0" and toolchain_release("12.8") == "12.8"


def test_cache_key_without_identity_keys_header_contents_not_paths(tmp_path):
    cache = CompileCache(tmp_path / "cache")
    for site in ("a", "b"):
        inc = tmp_path / site / "include"
        inc.mkdir(parents=True)
        (inc / "h.h").write_text("#define X 1\n")
        os.utime(inc / "h.h", ns=(10**18, 10**18))
    keys = {cache.key(BuildJob("k", "s", "sm90a", include_dirs=(str(tmp_path / s / "include"),)), _tc("13.0.88"))
            for s in ("a", "b")}
    assert len(keys) == 1
    (tmp_path / "b" / "include" / "h.h").write_text("#define X 22\n")
    assert cache.key(BuildJob("k", "s", "sm90a", include_dirs=(str(tmp_path / "b" / "include"),)),
                     _tc("13.0.88")) not in keys


def _fake_emitted(include_dirs) -> EmittedKernel:
    return EmittedKernel(name="k", arch="sm90a", source="// src\n", include_dirs=tuple(include_dirs),
                         flags=("-O3",), dims=("M",), args=("a",))


class _FakeBackend:
    """A stand-in backend whose code generator returns `make()`'s kernel and counts its calls."""
    name = "fake"

    def __init__(self, make):
        self.make, self.calls = make, []

    def identity(self) -> str:
        return "fake 1"

    def emit(self, lowered):
        self.calls.append(lowered.desc)
        return self.make()


class _Lowered:
    backend = "fake"

    def __init__(self, desc):
        self.desc = desc


@pytest.fixture
def memo(tmp_path, monkeypatch):
    """emit_cached with a stand-in code generator whose include dirs are the real CUTLASS ones."""
    pytest.importorskip("cutlass_library")
    import kspec.compile as kc
    from kspec.backends.cutlass import compat
    fake = _FakeBackend(lambda: _fake_emitted(compat.cutlass_include_dirs()))
    monkeypatch.setattr(kc.registry, "get", lambda name: fake)
    return kc, compat, fake


def test_emit_memo_stores_no_machine_paths(tmp_path, memo, monkeypatch):
    kc, compat, fake = memo
    calls = fake.calls
    root = tmp_path / "cache"
    first = kc.emit_cached(_Lowered(("desc", 1)), root)
    (entry,) = (root / "emit").glob("*.json")
    text = entry.read_text()
    assert compat.cutlass_source_dir() not in text and "site-packages" not in text
    assert cache_entry.json_get(entry)["include_dirs"] == ["cutlass:include", "cutlass:tools/util/include"]
    again = kc.emit_cached(_Lowered(("desc", 1)), root)
    assert len(calls) == 1 and again == first                 # a memo hit, resolved to this machine's tree

    # the same cache read where CUTLASS lives elsewhere: the dirs follow the tree, not the old path
    moved = tmp_path / "moved-cutlass"
    for d in ("include", "tools/util/include"):
        (moved / d).mkdir(parents=True)
    monkeypatch.setattr(compat, "cutlass_source_dir", lambda: str(moved))
    relocated = kc.emit_cached(_Lowered(("desc", 1)), root)
    assert len(calls) == 1
    assert relocated.include_dirs == (str(moved / "include"), str(moved / "tools" / "util" / "include"))


def test_emit_memo_of_the_old_format_is_a_miss(tmp_path, memo):
    kc, compat, fake = memo
    calls = fake.calls
    root = tmp_path / "cache"
    kc.emit_cached(_Lowered(("desc", 2)), root)
    (entry,) = (root / "emit").glob("*.json")
    data = cache_entry.json_get(entry)
    data["include_dirs"] = ["/some/other/machine/cutlass/include"]       # what the memo used to hold
    cache_entry.json_put(entry, data)                                    # sealed as a memo is today
    em = kc.emit_cached(_Lowered(("desc", 2)), root)
    assert len(calls) == 2 and em.include_dirs == compat.cutlass_include_dirs()


def test_include_dirs_outside_cutlass_are_not_memoised(tmp_path, memo, monkeypatch):
    kc, compat, fake = memo
    calls = fake.calls
    fake.make = lambda: _fake_emitted((str(tmp_path),))
    root = tmp_path / "cache"
    assert kc.emit_cached(_Lowered(("desc", 3)), root).include_dirs == (str(tmp_path),)
    assert not list((root / "emit").glob("*.json")) if (root / "emit").exists() else True


AXPY = """kernel axpy {
  param alpha : f32 = 2.0
  in  X : f32[N]
  in  Y : f32[N]
  out Z : f32[N]
  Z[n] = alpha * X[n] + Y[n]
}
"""


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("KSPEC_NVCC"), reason="needs nvcc")
def test_artifact_built_here_loads_from_a_copy(tmp_path):
    import kspec
    from kspec.compile import compile_spec
    from kspec.runtime.glue import HostGlue
    spec = tmp_path / "src" / "axpy.kspec"
    spec.parent.mkdir()
    spec.write_text(AXPY)
    cache = CompileCache(tmp_path / "cache")
    built = compile_spec(spec, ("sm90a",), tmp_path / "build", cache=cache)
    # nothing of this machine's layout in the manifest or the binaries
    for f in built.iterdir():
        data = f.read_bytes()
        for path in (str(tmp_path), str(Path.home()), shutil.which("nvcc") or "/nonexistent-nvcc"):
            assert path.encode() not in data, (f.name, path)
    # copy the folder elsewhere, delete the original and the cache, load the copy
    moved = tmp_path / "elsewhere" / "axpy"
    shutil.copytree(built, moved)
    shutil.rmtree(tmp_path / "build")
    shutil.rmtree(tmp_path / "cache")
    mod = kspec.load(moved)
    assert mod.kernels == ("axpy",) and mod.path == moved
    plan = mod.manifest.kernels[0].plans[0]
    glue = mod.glue(plan, "sm90a")
    assert isinstance(glue, HostGlue) and glue.path.parent == moved
    assert glue.workspace_size([1000], 0, 132) == 0
    p = glue.prepare([1000], [0x1000, 0x2000, 0x3000], [2.0], 0, 0, 132)
    assert p.grid[0] >= 1 and p.params_size > 0
    assert mod.image(plan, "sm90a")[:4] == b"\x7fELF"
