"""GPU tests that need no compiler: the artifacts prebuilt by bench/prebuild.py (bench/prebuilt/, or
$KSPEC_PREBUILT) on the present device.  Run by bench/gpu_check.sh; skipped without a device or
without prebuilt artifacts.

- The real driver's view of every cubin matches what the fake driver's cubin reader assumes
  (parameter size from cuFuncGetParamInfo, max threads per block, static shared memory), so the
  CPU launch-ABI tests check against the same facts the driver enforces.
- Every kernel matches the numpy reference at every size set and placement of `kspec selftest`.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PREBUILT = Path(os.environ.get("KSPEC_PREBUILT", ROOT / "bench" / "prebuilt"))
ARTIFACTS = sorted(p.parent for p in PREBUILT.glob("*/manifest.json"))

pytestmark = pytest.mark.gpu


def _device_arch() -> str:
    from kspec.runtime import cuda_available
    ok, why = cuda_available()
    if not ok:
        pytest.skip(f"no CUDA device: {why}")
    from kspec.core import arch_of_cc
    from kspec.runtime import driver
    major, minor, _, name = driver.get().facts(0)
    arch = arch_of_cc(major * 10 + minor)
    if arch is None:
        pytest.skip(f"{name} is compute capability {major}.{minor}; kspec targets sm_90a and sm_100a")
    return arch


def _artifacts():
    if not ARTIFACTS:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no prebuilt artifacts in {PREBUILT} "
                                                                 "(python bench/prebuild.py)"))]
    return [pytest.param(a, id=a.name) for a in ARTIFACTS]


@pytest.mark.parametrize("art", _artifacts())
def test_driver_agrees_with_cubin_reader(art):
    arch = _device_arch()
    from cuda.bindings import driver as cu

    import kspec
    from kspec.runtime import driver
    from kspec.runtime.cubin import read_cubin
    mod = kspec.load(art)
    if arch not in mod.archs:
        pytest.skip(f"{art.name} has no {arch} binaries")
    drv = driver.get()
    ctx = drv.primary_context(0)
    A = cu.CUfunction_attribute
    with drv.current(ctx):
        for k in mod.manifest.kernels:
            for plan in k.plans:
                b = plan.binaries[arch]
                info = read_cubin(art / b.cubin).kernel(b.symbol)
                func = drv.function(ctx, ("abi-test", art.name, plan.id, arch), mod.image(plan, arch), b.symbol,
                                    plan.id)
                assert drv.param_size(func) == info.params[0].size
                max_threads = drv.call("cuFuncGetAttribute", A.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, func)
                if info.max_threads is not None:
                    assert max_threads <= info.max_threads[0] * info.max_threads[1] * info.max_threads[2]
                static = drv.call("cuFuncGetAttribute", A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func)
                assert static <= info.static_smem_bytes


@pytest.mark.parametrize("art", _artifacts())
def test_prebuilt_matches_reference(art):
    _device_arch()
    from kspec.selftest import run
    out = io.StringIO()
    rc = run([str(art)], bench=False, out=out)
    assert rc == 0, out.getvalue()
