"""Every shipped spec on a real GPU against the numpy reference (skipped without a device).

Kernels are compiled for the device's arch only, through the shared compile cache."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import CUTE_ONLY, SHIPPED, SPECS, shipped_params

from kspec.cli import random_inputs
from kspec.run import TOLERANCE, relative_error
from kspec.spec_lang import load_spec

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]


def _device_arch() -> str | None:
    from kspec.runtime import cuda_available
    ok, why = cuda_available()
    if not ok:
        pytest.skip(f"no CUDA device: {why}")
    from cuda.bindings import driver as cu
    _, dev = cu.cuDeviceGet(0)
    _, major = cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    _, minor = cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    arch = {(9, 0): "sm90a", (10, 0): "sm100a"}.get((major, minor))
    if arch is None:
        pytest.skip(f"device is sm_{major}{minor}; kspec targets sm_90a and sm_100a")
    return arch


SIZES = {"M": 256, "N": 384, "K": 192, "L": 3, "B": 2, "H": 3, "S": 256, "T": 384, "V": 1000}
ODD = {"M": 200, "N": 136, "K": 72, "L": 2, "B": 1, "H": 2, "S": 136, "T": 200, "V": 4097}


def _run(compiled, stem, sizes, pass_outputs=False, seed=0, backend="auto"):
    import kspec
    from kspec.backends.reference import reference
    from kspec.artifact import layout_strides
    from kspec.runtime import DeviceArray, from_device
    arch = _device_arch()
    prog = load_spec(SPECS / f"{stem}.kspec")
    if prog.targets and arch not in prog.targets:
        pytest.skip(f"{stem} targets {', '.join(prog.targets)} only")
    mod = kspec.load(compiled(stem, (arch,), backend))
    k = prog.kernels[0]
    host = random_inputs(k, sizes, seed)
    want = reference(prog)(**host)
    kernel = getattr(mod, stem)
    args = kernel.to_device(**host)            # each input in its spec's layout (col inputs column-major)
    if pass_outputs:
        for t in k.outputs:
            shape = want[t.name].shape
            args[t.name] = DeviceArray(shape, t.dtype, layout_strides(shape, t.layout or "row"))
    got = kernel(**args)
    for t in k.outputs:
        if pass_outputs:
            assert got[t.name] is args[t.name]
        err = relative_error(from_device(got[t.name]), want[t.name])
        assert err <= TOLERANCE[t.dtype], f"{stem}.{t.name}: relative error {err:.3g}"


@pytest.mark.parametrize("stem", shipped_params(SHIPPED))
def test_shipped_spec_matches_reference(compiled, stem):
    _run(compiled, stem, SIZES)          # the default: CuTe DSL GEMMs where it can implement them


@pytest.mark.parametrize("stem", [s for s in SHIPPED if "gemm" in s and s not in CUTE_ONLY])
def test_shipped_gemm_spec_matches_reference_with_cutlass_cpp(compiled, stem):
    _run(compiled, stem, SIZES, backend="cutlass")


@pytest.mark.parametrize("stem", ["gemm_bias_gelu_residual", "gemm_rowmax", "attention", "attention_causal",
                                  "attention_lse", "layernorm", "rmsnorm", "add_rmsnorm", "row_softmax", "cross_entropy"])
def test_odd_sizes(compiled, stem):
    _run(compiled, stem, ODD, seed=1)


@pytest.mark.parametrize("stem", ["gemm_bias_relu", "attention"])
def test_outputs_passed_in(compiled, stem):
    _run(compiled, stem, SIZES, pass_outputs=True, seed=2)
