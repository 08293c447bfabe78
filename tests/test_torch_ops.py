"""Loaded kernels as PyTorch custom ops: schema, the fake implementation (shapes, strides, dtypes
from the manifest), tracing with torch.compile(fullgraph=True) and torch.export on the CPU, and
(on a GPU) the real launch, torch.compile and CUDA graph capture."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")

import kspec  # noqa: E402
from kspec.artifact import (KernelEntry, Manifest, ParamSpec, Plan, SpecRef, TensorSpec, make_binary,  # noqa: E402
                            write_manifest)
from kspec.runtime import KspecRuntimeError  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402


def _artifact(d: Path, cubin: bytes = b"cubin") -> Path:
    d.mkdir(parents=True)
    (d / "x.cubin").write_bytes(cubin)
    (d / "x.so").write_bytes(b"glue")
    b = {"sm90a": make_binary(d, "x.cubin", "x.so")}
    gemm = KernelEntry(
        "gemm",
        inputs=(TensorSpec("A", "f16", ("L", "M", "K")), TensorSpec("B", "f16", ("L", "K", "N"), "col"),
                TensorSpec("bias", "f16", ("N",))),
        outputs=(TensorSpec("D", "bf16", ("L", "M", "N")), TensorSpec("Dt", "f32", ("L", "M", "N"), "col"),
                 TensorSpec("rmax", "f32", ("L", "M"))),
        params=(ParamSpec("alpha", "f32", 1.0), ParamSpec("beta", "f32", None), ParamSpec("count", "i32", 3)),
        plans=(Plan("gemm_0", "gemm", (("M", "M"), ("N", "N"), ("K", "K"), ("L", "L")),
                    ("A", "B", "bias", "D", "Dt", "rmax"), ("alpha", "beta"), binaries=b),))
    one = KernelEntry("one", inputs=(TensorSpec("x", "f32", ("N", 8)),), outputs=(TensorSpec("y", "i32", (8, "N")),),
                      plans=(Plan("one_0", "elementwise", (("d0", "N"),), ("x", "y"), binaries=b),))
    expand = KernelEntry("expand", inputs=(TensorSpec("x", "f32", ("N",)),),
                         outputs=(TensorSpec("y", "f32", ("N", "R")),),
                         plans=(Plan("expand_0", "elementwise", (("d0", "N"), ("d1", "R")), ("x", "y"), binaries=b),))
    write_manifest(d, Manifest(SpecRef("t.kspec", "0" * 64), ("sm90a",), (gemm, one, expand)))
    return d


@pytest.fixture(scope="module")
def mod(tmp_path_factory):
    return kspec.load(_artifact(tmp_path_factory.mktemp("torchops") / "art"))


def _gemm_inputs(L=2, M=64, N=48, K=32, make=torch.empty):
    A = make(L, M, K, dtype=torch.float16)
    B = make(L, N, K, dtype=torch.float16).transpose(-1, -2)      # col: K is contiguous
    bias = make(N, dtype=torch.float16)
    return A, B, bias


def test_schema_and_name(mod):
    op = mod.gemm.as_torch_op()
    assert op.qualified_name.startswith("kspec::gemm_") and len(op.name) == len("gemm_") + 12
    assert str(op.op._schema).endswith("(Tensor A, Tensor B, Tensor bias, *, float alpha=1., float beta, "
                                       "int count=3) -> (Tensor, Tensor, Tensor)")
    assert "-> Tensor" in repr(mod.one.as_torch_op())


def test_fake_outputs_follow_the_manifest(mod):
    op = mod.gemm.as_torch_op()
    with FakeTensorMode():
        out = op(*_gemm_inputs(), beta=0.5)
    assert list(out) == ["D", "Dt", "rmax"]
    D, Dt, rmax = out["D"], out["Dt"], out["rmax"]
    assert (tuple(D.shape), D.dtype, D.stride()) == ((2, 64, 48), torch.bfloat16, (64 * 48, 48, 1))
    # col output: the last two axes swapped in memory, batch outermost
    assert (tuple(Dt.shape), Dt.dtype, Dt.stride()) == ((2, 64, 48), torch.float32, (64 * 48, 1, 64))
    assert (tuple(rmax.shape), rmax.dtype, rmax.stride()) == ((2, 64), torch.float32, (64, 1))
    with FakeTensorMode():
        y = mod.one.as_torch_op()(torch.empty(5, 8))["y"]
    assert tuple(y.shape) == (8, 5) and y.dtype == torch.int32


def test_fake_checks_arguments(mod):
    op = mod.gemm.as_torch_op()
    with FakeTensorMode():
        A, B, bias = _gemm_inputs()
        with pytest.raises(KspecRuntimeError, match="argument 'A': expected f16, got f32"):
            op(A.float(), B, bias, beta=1.0)
        with pytest.raises(KspecRuntimeError, match=r"argument 'bias': dimension 0 \(N\) is 47, but 'B' has N = 48"):
            op(A, B, bias[:47], beta=1.0)
        with pytest.raises(KspecRuntimeError, match="expected rank 3"):
            op(A[0], B, bias, beta=1.0)
        with pytest.raises(KspecRuntimeError, match="missing parameter 'beta'"):
            op(A, B, bias)
        with pytest.raises(KspecRuntimeError, match="unexpected argument 'D'"):
            op(A, B, bias, beta=1.0, D=A)
        with pytest.raises(KspecRuntimeError, match=r"dimension 1 must be 8, got 7"):
            mod.one.as_torch_op()(torch.empty(5, 7))


def test_real_call_with_cpu_tensors_says_so(mod):
    with pytest.raises(KspecRuntimeError, match=r"one: argument 'x': torch tensor is on cpu; expected a CUDA tensor"):
        mod.one.as_torch_op()(torch.zeros(5, 8))


def test_unbound_output_sizes_cannot_be_functional(mod):
    with pytest.raises(KspecRuntimeError, match="output size.*R are not bound by any input"):
        mod.expand.as_torch_op()


def test_registered_once_per_content(tmp_path, mod):
    first = mod.gemm.as_torch_op()
    copy = tmp_path / "copy"
    shutil.copytree(mod.path, copy)
    again = kspec.load(copy).gemm.as_torch_op()                # same content elsewhere: same op
    assert again.qualified_name == first.qualified_name and again.op is first.op
    other = kspec.load(_artifact(tmp_path / "rebuilt", cubin=b"other cubin")).gemm.as_torch_op()
    assert other.qualified_name != first.qualified_name


def test_torch_compile_fullgraph_traces_through_the_fake(mod):
    op = mod.gemm.as_torch_op()
    graphs = []

    class Traced(Exception):
        pass

    def backend(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            raise Traced()                                    # no launch on this machine
        return run

    def f(A, B, bias):
        out = op(A, B, bias, beta=2.0)
        return out["D"].float() + out["Dt"], out["rmax"].sum()

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    with pytest.raises(Traced):
        compiled(*_gemm_inputs(make=torch.zeros))
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "kspec" in str(n.target)]
    assert len(calls) == 1 and str(calls[0].target).startswith(f"kspec.{op.name}")
    assert calls[0].kwargs == {"beta": 2.0}


def test_torch_export_records_output_meta(mod):
    op = mod.gemm.as_torch_op()

    class M(torch.nn.Module):
        def forward(self, A, B, bias):
            return op(A, B, bias, alpha=0.5, beta=1.0)["Dt"]

    A = torch.zeros(2, 64, 32, dtype=torch.float16)
    B = torch.zeros(2, 48, 32, dtype=torch.float16).transpose(-1, -2)
    bias = torch.zeros(48, dtype=torch.float16)
    ep = torch.export.export(M(), (A, B, bias))
    (node,) = [n for n in ep.graph.nodes if n.op == "call_function" and "kspec" in str(n.target)]
    vals = node.meta["val"]
    assert [tuple(v.shape) for v in vals] == [(2, 64, 48), (2, 64, 48), (2, 64)]
    assert vals[1].stride() == (64 * 48, 1, 64) and vals[0].dtype == torch.bfloat16


def test_as_torch_op_without_torch(mod, monkeypatch):
    import builtins
    real = builtins.__import__

    def no_torch(name, *a, **k):
        if name == "torch":
            raise ImportError("no torch")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(KspecRuntimeError, match=r"as_torch_op\(\) needs PyTorch"):
        mod.one.as_torch_op()


# ---------------------------------------------------------------------------------- on a GPU

def _gpu_fixture(tmp_path):
    from kspec.runtime import cuda_available, selftest
    ok, why = cuda_available()
    if not ok or not torch.cuda.is_available():
        pytest.skip(f"no CUDA device for torch: {why or 'torch.cuda.is_available() is False'}")
    if shutil.which("nvcc") is None or selftest.find_cxx() is None:
        pytest.skip("needs nvcc and a C++ compiler")
    major, minor = torch.cuda.get_device_capability()
    arch = {(9, 0): "sm90a", (10, 0): "sm100a"}.get((major, minor))
    if arch is None:
        pytest.skip(f"device is sm_{major}{minor}")
    return kspec.load(selftest.build_fixture(tmp_path / "fixture", (arch,)))


@pytest.mark.gpu
@pytest.mark.nvcc
def test_gpu_op_eager_compiled_and_graph_captured(tmp_path):
    m = _gpu_fixture(tmp_path)
    op = m.scale_add.as_torch_op()
    g = torch.Generator().manual_seed(0)
    A64 = torch.randn(48, 200, generator=g, dtype=torch.float64)
    B64 = torch.randn(48, 200, generator=g, dtype=torch.float64)
    A = A64.float().cuda()
    B = B64.float().t().contiguous().t().cuda()               # col layout
    ref = 0.5 * A64.numpy() + B64.numpy()

    out = op(A, B, alpha=0.5)
    np.testing.assert_allclose(out["D"].cpu().double().numpy(), ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["rmax"].cpu().double().numpy(), ref.max(axis=1), rtol=1e-6, atol=1e-6)

    compiled = torch.compile(lambda a, b: op(a, b, alpha=0.5)["D"] * 2.0, fullgraph=True, backend="eager")
    np.testing.assert_allclose(compiled(A, B).cpu().double().numpy(), 2.0 * ref, rtol=1e-6, atol=1e-6)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(A, B, alpha=0.5)                                   # warm-up: cubin and glue loaded
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(A, B, alpha=0.5)
    A.copy_((2.0 * A64).float().cuda())
    graph.replay()
    torch.cuda.synchronize()
    ref2 = 0.5 * (2.0 * A64.numpy()) + B64.numpy()
    np.testing.assert_allclose(captured["D"].cpu().double().numpy(), ref2, rtol=1e-6, atol=1e-6)
