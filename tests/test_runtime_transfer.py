"""Host -> device uploads in a spec's layout (issue 13, item 1), checked on the CPU: a stand-in
driver records the bytes each upload copies, and the test reads them back at the layout's strides
with independent numpy."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import kspec
from kspec.artifact import KernelEntry, Manifest, Plan, SpecRef, TensorSpec, make_binary, write_manifest
from kspec.runtime import KspecRuntimeError, from_device, from_numpy, to_device
from kspec.runtime.transfer import host_image, staged


class CopyRecorder:
    """The part of kspec.runtime.driver.Driver that DeviceArray uses, keeping every upload."""

    def __init__(self):
        self.memory: dict[int, bytes] = {}
        self.next_ptr = 0x7E0000000000

    def require_device(self):
        pass

    def available(self):
        return True, ""

    def primary_context(self, ordinal):
        return ("ctx", ordinal)

    @contextmanager
    def current(self, ctx):
        yield

    def alloc_async(self, nbytes, stream, what):
        p = self.next_ptr
        self.next_ptr += (nbytes + 0xFFFF) // 0x10000 * 0x10000
        return p

    def free_async(self, ptr, stream):
        pass

    def call(self, fn, *args, what=""):
        if fn == "cuMemcpyHtoD":
            dst, src, n = args
            self.memory[int(dst)] = np.ascontiguousarray(src).tobytes()[:n]
        elif fn == "cuMemcpyDtoH":
            dst, src, n = args
            dst.view(np.uint8)[:n] = np.frombuffer(self.memory[int(src)][:n], np.uint8)
        return None


@pytest.fixture
def recorder(monkeypatch):
    pytest.importorskip("cuda.bindings.driver")     # CUdeviceptr/CUstream wrap the handles
    from kspec.runtime import driver
    rec = CopyRecorder()
    monkeypatch.setattr(driver, "_driver", rec)
    return rec


def _device_values(rec, d, np_dtype):
    """Read a DeviceArray's recorded bytes back at its strides, independently of kspec."""
    raw = np.frombuffer(rec.memory[d.ptr], dtype=np_dtype)
    item = np.dtype(np_dtype).itemsize
    return np.lib.stride_tricks.as_strided(raw, d.shape, tuple(s * item for s in d.strides))


def test_col_upload_is_column_major(recorder):
    B = np.arange(12, dtype=np.float32).reshape(3, 4)          # logical B[k, n]
    d = to_device(B, "col")
    assert d.shape == (3, 4) and d.strides == (1, 3)
    # column-major bytes: column 0 first (0, 4, 8), then column 1 ...
    assert recorder.memory[d.ptr] == np.asfortranarray(B).tobytes(order="A")
    assert np.frombuffer(recorder.memory[d.ptr], np.float32).tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
    np.testing.assert_array_equal(_device_values(recorder, d, np.float32), B)
    np.testing.assert_array_equal(d.to_numpy(), B)             # the read path undoes the layout
    np.testing.assert_array_equal(from_device(d), B)


def test_row_upload_and_batched_col(recorder):
    x = np.arange(24, dtype=np.float16).reshape(2, 3, 4)
    r = from_numpy(x)
    assert r.strides == (12, 4, 1) and recorder.memory[r.ptr] == x.tobytes()
    c = from_numpy(x, layout="col")                            # batch outermost, each matrix column-major
    assert c.strides == (12, 1, 3)
    assert recorder.memory[c.ptr] == np.ascontiguousarray(np.swapaxes(x, -1, -2)).tobytes()
    np.testing.assert_array_equal(c.to_numpy(), x)


def test_host_array_strides_do_not_matter(recorder):
    B = np.arange(12, dtype=np.float32).reshape(4, 3).T        # a Fortran-ordered (3, 4) view
    d = to_device(B, "col")
    assert recorder.memory[d.ptr] == np.ascontiguousarray(B.T).tobytes()
    d = to_device(B, "row")
    assert recorder.memory[d.ptr] == np.ascontiguousarray(B).tobytes()


def _module(tmp_path: Path):
    d = tmp_path / "art"
    d.mkdir()
    (d / "x.cubin").write_bytes(b"cubin")
    (d / "x.so").write_bytes(b"glue")
    b = {"sm90a": make_binary(d, "x.cubin", "x.so")}
    k = KernelEntry("gemm", inputs=(TensorSpec("A", "f16", ("M", "K")), TensorSpec("B", "f16", ("K", "N"), "col")),
                    outputs=(TensorSpec("D", "f32", ("M", "N")),),
                    plans=(Plan("gemm_0", "gemm", (("M", "M"), ("N", "N"), ("K", "K")), ("A", "B", "D"),
                                binaries=b),))
    write_manifest(d, Manifest(SpecRef("g.kspec", "0" * 64), ("sm90a",), (k,)))
    return kspec.load(d)


def test_kernel_to_device_uses_each_spec(recorder, tmp_path):
    mod = _module(tmp_path)
    A = np.random.default_rng(0).standard_normal((5, 3))       # float64: converted to the spec's f16
    B = np.random.default_rng(1).standard_normal((3, 7)).astype(np.float32)
    args = mod.gemm.to_device(A, B=B)
    assert set(args) == {"A", "B"}
    assert args["A"].dtype == "f16" and args["A"].strides == (3, 1)
    assert args["B"].dtype == "f16" and args["B"].strides == (1, 3)
    np.testing.assert_array_equal(_device_values(recorder, args["B"], np.float16), B.astype(np.float16))
    assert recorder.memory[args["B"].ptr] == np.ascontiguousarray(B.astype(np.float16).T).tobytes()
    # what the kernel's argument check sees: strides that match each layout
    b = mod.gemm.check(**args)
    assert b.sizes == {"M": 5, "K": 3, "N": 7}
    # the old way (a row-major upload of every input) is what the check rejects for a col input
    with pytest.raises(KspecRuntimeError, match="expected col layout"):
        mod.gemm.check(args["A"], from_numpy(B.astype(np.float16)))
    out = mod.gemm.to_device(D=np.zeros((5, 7)))
    assert out["D"].dtype == "f32" and out["D"].strides == (7, 1)
    with pytest.raises(KspecRuntimeError, match="'X' is not an input or output"):
        mod.gemm.to_device(X=A)
    with pytest.raises(KspecRuntimeError, match="given twice"):
        mod.gemm.to_device(A, A=A)


def test_staging_without_a_device():
    image, shape, strides, dtype = staged(np.arange(6, dtype=np.int32).reshape(2, 3), "col")
    assert (shape, strides, dtype) == ((2, 3), (1, 2), "i32")
    assert image.tolist() == [0, 3, 1, 4, 2, 5]
    spec = TensorSpec("W", "bf16", ("K", "N"), "col")
    image, shape, strides, dtype = staged(np.ones((2, 2), np.float32), spec)
    assert dtype == "bf16" and image.dtype.itemsize == 2 and strides == (1, 2)
    assert host_image(np.zeros((0, 4), np.float32), (1, 0)).size == 0
    with pytest.raises(KspecRuntimeError, match="layout 'col' needs rank >= 2"):
        staged(np.ones(3, np.float32), "col")
    with pytest.raises(KspecRuntimeError, match="layout must be one of row, col"):
        staged(np.ones(3, np.float32), "diag")


def test_gpu_spec_tests_upload_in_layout():
    # the GPU spec tests go through the layout-aware upload, not a row-major from_numpy of everything
    text = (Path(__file__).resolve().parent / "test_gpu_specs.py").read_text()
    assert ".to_device(" in text and "from_numpy(" not in text


def test_kspec_run_uploads_col_inputs_column_major(recorder, tmp_path, monkeypatch, capsys):
    """`kspec run ARTIFACT` end to end on the CPU: uploads go through the recording driver, and a
    stand-in kernel computes from the device bytes read at the strides its layout contract fixes
    (as the GEMM does); a row-major upload of the col input B is what used to go wrong."""
    import argparse
    import shutil as sh

    from kspec.artifact import layout_strides
    from kspec.runtime import DeviceArray, module
    from kspec.run import run_on_gpu
    from kspec.runtime.transfer import numpy_dtype

    root = Path(__file__).resolve().parents[1]
    d = tmp_path / "gemm_bias_relu"
    d.mkdir()
    sh.copyfile(root / "specs" / "gemm_bias_relu.kspec", d / "gemm_bias_relu.kspec")
    (d / "x.cubin").write_bytes(b"cubin")
    (d / "x.so").write_bytes(b"glue")
    b = {"sm90a": make_binary(d, "x.cubin", "x.so")}
    k = KernelEntry("gemm_bias_relu",
                    inputs=(TensorSpec("A", "f16", ("M", "K")), TensorSpec("B", "f16", ("K", "N"), "col"),
                            TensorSpec("bias", "f16", ("N",))),
                    outputs=(TensorSpec("D", "f16", ("M", "N")),),
                    plans=(Plan("p0", "gemm", (("M", "M"), ("N", "N"), ("K", "K"), ("L", 1)), ("A", "B", "bias", "D"),
                                binaries=b),))
    write_manifest(d, Manifest(SpecRef("gemm_bias_relu.kspec", "0" * 64), ("sm90a",), (k,)))

    def device_kernel(self, *args, stream=None, **kwargs):
        bnd = self.check(*args, stream=stream, **kwargs)         # strides must match each layout
        host = {}
        for spec in self.entry.inputs:
            v = bnd.views[spec.name]
            raw = np.frombuffer(recorder.memory[v.ptr], dtype=numpy_dtype(spec.dtype))
            item = raw.dtype.itemsize
            host[spec.name] = np.lib.stride_tricks.as_strided(raw, v.shape, tuple(s * item for s in v.strides))
        acc = host["A"].astype(np.float64) @ host["B"].astype(np.float64) + host["bias"].astype(np.float64)
        D = np.maximum(acc, 0).astype(np.float16)
        out = DeviceArray(D.shape, "f16", layout_strides(D.shape, "row")).copy_from(D)
        return {"D": out}

    monkeypatch.setattr(module.Kernel, "__call__", device_kernel)
    recorder.available = lambda: (True, "")
    args = argparse.Namespace(file=str(d), kernel=None, seed=3, arch=None, output=None)
    assert run_on_gpu(args, {"M": 24, "N": 40, "K": 16}) == 0
    out = capsys.readouterr().out
    assert "kernel gemm_bias_relu:" in out and "D: max relative error" in out and " ok" in out
