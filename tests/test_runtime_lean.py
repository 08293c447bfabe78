"""The lean runtime: loading an artifact, checking a call's arguments, staging host arrays and
calling the host glue import only kspec.core, numpy and cuda-python -- never the compiler, the
spec language, a backend, lark, networkx, ml_dtypes or CUTLASS -- and work from a plain source
checkout (`PYTHONPATH=<repo>`) on an interpreter that has nothing else installed."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kspec.runtime import selftest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_TOP = ("lark", "networkx", "ml_dtypes", "cutlass", "cutlass_cppgen", "cutlass_library", "torch")
FORBIDDEN_KSPEC = ("kspec.compiler", "kspec.spec_lang", "kspec.backends", "kspec.compile", "kspec.cli")

# Runs in a fresh interpreter: load, check, stage, size and prepare through the glue, and (without
# a GPU) make the call reach the "no CUDA device" error; then report what got imported.
SCRIPT = r"""
import json, sys
import kspec.runtime
from kspec.runtime import KspecRuntimeError, cuda_available
from kspec.runtime.transfer import staged
import numpy as np

mod = kspec.runtime.load(sys.argv[1])

class CAI:
    def __init__(self, ptr, shape, strides=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "data": (ptr, False),
                                         "strides": strides, "version": 3}

A = CAI(0x7f0000000000, (48, 200))
B = CAI(0x7f0000100000, (48, 200), (4, 48 * 4))
b = mod.scale_add.check(A, B, alpha=0.5)
assert b.sizes == {"M": 48, "N": 200}, b.sizes
plan = b.kernel.plans[0]
glue = mod.glue(plan, "sm90a")
assert glue.workspace_size(b.dims(plan), 0, 132) == 0
p = glue.prepare(b.dims(plan), [0x7f0000000000, 0x7f0000100000, 0x1000, 0x2000], b.scalars(plan), 0, 0, 132)
assert p.grid == (2, 48, 1), p.grid
image, shape, strides, dtype = staged(np.arange(6, dtype=np.float32).reshape(2, 3), b.kernel.inputs[1])
assert strides == (1, 2) and image.tolist() == [0, 3, 1, 4, 2, 5]
if not cuda_available()[0]:
    try:
        mod.two_step(CAI(0x7f0000000000, (8,)), scale=1.0)
        raise SystemExit("expected no CUDA device")
    except KspecRuntimeError as e:
        assert "no CUDA device" in str(e), e
print(json.dumps(sorted(sys.modules)))
"""


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    if selftest.find_cxx() is None:
        pytest.skip("no C++ compiler to build the fixture's host glue")
    return selftest.build_fixture(tmp_path_factory.mktemp("lean") / "fixture", ("sm90a",), fake_cubins=True)


def _forbidden(modules: list[str]) -> list[str]:
    return [m for m in modules
            if m.split(".")[0] in FORBIDDEN_TOP or any(m == f or m.startswith(f + ".") for f in FORBIDDEN_KSPEC)]


def test_runtime_imports_nothing_of_the_compiler(artifact):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(artifact)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    modules = json.loads(r.stdout.strip().splitlines()[-1])
    assert "kspec.runtime.module" in modules and "kspec.artifact" in modules
    assert _forbidden(modules) == []


def test_source_checkout_with_only_numpy_and_cuda_python(artifact, tmp_path):
    """A machine with Python, numpy and cuda-python only: `python -S` (no site-packages) with a
    path of the source checkout plus a folder holding just numpy and cuda-python."""
    site = tmp_path / "site"
    site.mkdir()
    for pkg in ("numpy", "cuda"):
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            pytest.skip(f"{pkg} is not installed")
        src = Path(list(spec.submodule_search_locations)[0])
        (site / pkg).symlink_to(src, target_is_directory=True)
        for extra in src.parent.glob(f"{pkg}.libs"):           # numpy's bundled shared libraries
            (site / extra.name).symlink_to(extra, target_is_directory=True)
        for dist in src.parent.glob(f"{pkg.replace('-', '_')}*.dist-info"):
            (site / dist.name).symlink_to(dist, target_is_directory=True)
    for dist in Path(importlib.util.find_spec("cuda").submodule_search_locations[0]).parent.glob("cuda_*.dist-info"):
        if not (site / dist.name).exists():
            (site / dist.name).symlink_to(dist, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site)])
    # the interpreter really has nothing else: the compiler's dependencies are not importable
    probe = subprocess.run([sys.executable, "-S", "-c",
                            "import importlib.util as u, json; print(json.dumps([m for m in "
                            "('lark', 'networkx', 'ml_dtypes', 'cutlass', 'cutlass_library', 'torch', 'numpy', "
                            "'cuda.bindings') if u.find_spec(m.split('.')[0]) is not None]))"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout) == ["numpy", "cuda.bindings"]
    r = subprocess.run([sys.executable, "-S", "-c", SCRIPT, str(artifact)], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    modules = json.loads(r.stdout.strip().splitlines()[-1])
    assert _forbidden(modules) == []
    # and it ran the checkout's code, not an installed kspec
    loc = subprocess.run([sys.executable, "-S", "-c", "import kspec.runtime as r; print(r.__file__)"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert loc.stdout.strip() == str(ROOT / "kspec" / "runtime" / "__init__.py")
