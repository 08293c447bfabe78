"""kspec.runtime on a real device: the plain-CUDA fixture artifact (kspec.runtime.selftest) run
for real: outputs allocated vs passed, a non-default stream, multi-plan kernels through
intermediates, `init` fills, and CUDA graph capture.  Skipped with a reason without a device."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

import kspec
from kspec.runtime import DeviceArray, DeviceBuffer, KspecRuntimeError, cuda_available, from_numpy, selftest

_ok, _why = cuda_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.nvcc,
    pytest.mark.skipif(not _ok, reason=f"no CUDA device: {_why}"),
    pytest.mark.skipif(shutil.which("nvcc") is None or selftest.find_cxx() is None,
                       reason="the fixture needs nvcc and a C++ compiler"),
]


def _call(fn, *args):
    res = fn(*args)
    err = res[0]
    from cuda.bindings import driver as cu
    assert err == cu.CUresult.CUDA_SUCCESS, f"{fn.__name__}: {err}"
    return res[1] if len(res) == 2 else res[1:]


@pytest.fixture(scope="module")
def arch():
    from kspec.runtime import driver
    major, minor, _, name = driver.get().facts(0)
    a = {(9, 0): "sm90a", (10, 0): "sm100a"}.get((major, minor))
    if a is None:
        pytest.skip(f"cuda:0 ({name}) is compute capability {major}.{minor}; kspec targets 9.0 and 10.0")
    return a


@pytest.fixture(scope="module")
def mod(tmp_path_factory, arch):
    return kspec.load(selftest.build_fixture(tmp_path_factory.mktemp("gpu") / "fixture", (arch,)))


@pytest.fixture(scope="module")
def ctx():
    from kspec.runtime import driver
    c = driver.get().primary_context(0)
    from cuda.bindings import driver as cu
    _call(cu.cuCtxSetCurrent, c)      # the tests' own driver calls (streams, graphs) need a context
    return c


@pytest.fixture
def stream(ctx):
    from cuda.bindings import driver as cu
    s = _call(cu.cuStreamCreate, int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    yield s
    _call(cu.cuStreamSynchronize, s)
    _call(cu.cuStreamDestroy, s)


def _inputs(M=48, N=200, seed=0, negative=False):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((M, N), dtype=np.float32)
    B = rng.standard_normal((M, N), dtype=np.float32)
    if negative:              # every row max is negative: a zero-filled rmax would be wrong
        A, B = -np.abs(A) - 1.0, -np.abs(B)
    dA = from_numpy(A)
    dBt = from_numpy(np.ascontiguousarray(B.T))           # col layout: B^T stored row-major
    bB = DeviceBuffer(dBt.ptr, (M, N), "f32", strides=(1, M))
    return A, B, dA, dBt, bB


def _sync(s=None):
    from cuda.bindings import driver as cu
    _call(cu.cuStreamSynchronize, s if s is not None else cu.CUstream(0))


def test_outputs_allocated(mod, ctx):
    A, B, dA, _keep, bB = _inputs(negative=True)
    out = mod.scale_add(dA, bB, alpha=0.5)
    assert set(out) == {"D", "rmax"}
    assert isinstance(out["D"], DeviceArray) and out["D"].shape == (48, 200)
    ref = 0.5 * A + B
    np.testing.assert_allclose(out["D"].to_numpy(), ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["rmax"].to_numpy(), ref.max(axis=1), rtol=1e-6, atol=1e-6)


def test_outputs_passed(mod, ctx):
    A, B, dA, _keep, bB = _inputs(seed=1)
    D = DeviceArray((48, 200), "f32")
    rmax = from_numpy(np.full(48, 1e30, np.float32))       # init must overwrite this with -inf
    out = mod.scale_add(dA, bB, D=D, rmax=rmax)             # alpha defaults to 2.0
    assert out["D"] is D and out["rmax"] is rmax
    ref = 2.0 * A + B
    np.testing.assert_allclose(D.to_numpy(), ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rmax.to_numpy(), ref.max(axis=1), rtol=1e-6, atol=1e-6)


def test_multi_plan(mod, ctx):
    X = np.random.default_rng(2).standard_normal(1000, dtype=np.float32)
    out = mod.two_step(from_numpy(X), scale=3.0, shift=-2.0)
    np.testing.assert_allclose(out["Y"].to_numpy(), 3.0 * X - 2.0, rtol=1e-6, atol=1e-6)


def test_non_default_stream(mod, ctx, stream):
    from cuda.bindings import driver as cu
    A, B, dA, _keep, bB = _inputs(seed=3)
    _sync()                                          # inputs were copied on the NULL stream
    D = DeviceArray((48, 200), "f32", stream=int(stream))
    rmax = DeviceArray((48,), "f32", stream=int(stream))
    mod.scale_add(dA, bB, D=D, rmax=rmax, alpha=1.5, stream=stream)       # a CUstream
    dX = from_numpy(A.ravel())          # kept alive: freed on the NULL stream, used on `stream`
    out = mod.two_step(dX, scale=2.0, stream=int(stream))   # an int handle
    assert out["Y"].stream == int(stream)
    _call(cu.cuStreamSynchronize, stream)
    ref = 1.5 * A + B
    np.testing.assert_allclose(D.to_numpy(), ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["Y"].to_numpy(), 2.0 * A.ravel() + 1.0, rtol=1e-6, atol=1e-6)


def test_graph_capture(mod, ctx, stream):
    from cuda.bindings import driver as cu
    A, B, dA, dBt, bB = _inputs(seed=4)
    X = np.random.default_rng(5).standard_normal(1000, dtype=np.float32)
    dX = from_numpy(X)
    D = DeviceArray((48, 200), "f32", stream=int(stream))
    rmax = DeviceArray((48,), "f32", stream=int(stream))
    Y = DeviceArray((1000,), "f32", stream=int(stream))
    _sync()
    mod.scale_add(dA, bB, D=D, rmax=rmax, stream=stream)          # warm-up: loads cubin and glue
    mod.two_step(dX, Y=Y, scale=1.0, stream=stream)
    _call(cu.cuStreamSynchronize, stream)

    _call(cu.cuStreamBeginCapture, stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    try:
        mod.scale_add(dA, bB, D=D, rmax=rmax, alpha=-1.0, stream=stream)
        mod.two_step(dX, Y=Y, scale=4.0, shift=0.5, stream=stream)   # intermediate: graph alloc/free nodes
    finally:
        graph = _call(cu.cuStreamEndCapture, stream)
    exe = _call(cu.cuGraphInstantiate, graph, 0)
    try:
        # nothing ran during capture: the outputs still hold the warm-up results
        np.testing.assert_allclose(Y.to_numpy(), X + 1.0, rtol=1e-6, atol=1e-6)
        _call(cu.cuGraphLaunch, exe, stream)
        _call(cu.cuStreamSynchronize, stream)
        np.testing.assert_allclose(D.to_numpy(), -A + B, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(rmax.to_numpy(), (-A + B).max(axis=1), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(Y.to_numpy(), 4.0 * X + 0.5, rtol=1e-6, atol=1e-6)
        # a replay reads the inputs' current contents
        X2 = X * 10
        dX.copy_from(X2)
        _call(cu.cuGraphLaunch, exe, stream)
        _call(cu.cuStreamSynchronize, stream)
        np.testing.assert_allclose(Y.to_numpy(), 4.0 * X2 + 0.5, rtol=1e-5, atol=1e-5)
    finally:
        _call(cu.cuGraphExecDestroy, exe)
        _call(cu.cuGraphDestroy, graph)


def test_device_checks(mod, ctx):
    _, _, dA, _keep, bB = _inputs()
    import ctypes
    host = (ctypes.c_float * (48 * 200))()
    bad = DeviceBuffer(ctypes.addressof(host), (48, 200), "f32")
    with pytest.raises(KspecRuntimeError, match="argument 'A': 0x[0-9a-f]+ is not CUDA memory|is host memory"):
        mod.scale_add(bad, bB)


def test_torch_interop(mod, ctx):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    A = torch.randn(48, 200, device="cuda")
    B = torch.randn(200, 48, device="cuda").t()              # col layout view
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = mod.scale_add(A, B, alpha=0.25)                 # torch's current stream is used
    assert isinstance(out["D"], torch.Tensor)
    s.synchronize()
    ref = 0.25 * A + B
    torch.testing.assert_close(out["D"], ref)
    torch.testing.assert_close(out["rmax"], ref.max(dim=1).values)
