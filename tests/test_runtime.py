"""kspec.runtime without a GPU: loading, signatures, argument validation (`Kernel.check`), tensor
kinds, host glue through ctypes, and the "no CUDA device" error.  Tests that build real cubins are
marked `nvcc`."""
from __future__ import annotations

import ctypes
import pydoc
import inspect
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import kspec
from kspec.artifact import (KernelEntry, KspecArtifactError, Manifest, ParamSpec, Plan, SpecRef, TensorSpec,
                            make_binary, write_manifest)
from kspec.runtime import DeviceBuffer, KspecRuntimeError, cuda_available
from kspec.runtime import selftest
from kspec.runtime.tensors import as_view


# ---------------------------------------------------------------------------------- fixtures

class FakeCAI:
    """A device array as far as the CUDA array interface goes; the memory is never touched."""

    def __init__(self, ptr, shape, typestr="<f2", strides=None, readonly=False, stream=None, version=3):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, readonly),
                                         "strides": strides, "version": version, "stream": stream}


def f16(ptr, shape, col=False, typestr="<f2", item=2, **kw):
    strides = None
    if col:
        strides = (item, shape[-2] * item)
    return FakeCAI(ptr, shape, typestr, strides, **kw)


def _fake_module(tmp_path: Path) -> kspec.runtime.Module:
    d = tmp_path / "fake"
    d.mkdir()
    (d / "x.cubin").write_bytes(b"cubin")
    (d / "x.so").write_bytes(b"glue")
    b = {"sm90a": make_binary(d, "x.cubin", "x.so")}
    gemm = KernelEntry(
        "gemm",
        inputs=(TensorSpec("A", "f16", ("M", "K")), TensorSpec("B", "f16", ("K", "N"), "col"),
                TensorSpec("bias", "f16", ("N",))),
        outputs=(TensorSpec("D", "f16", ("M", "N")),),
        params=(ParamSpec("alpha", "f32", 1.0), ParamSpec("beta", "f32", None), ParamSpec("count", "i32", 3)),
        plans=(Plan("gemm_0", "gemm", (("M", "M"), ("N", "N"), ("K", "K"), ("L", 1)), ("A", "B", "bias", "D"),
                    ("alpha", "beta"), {}, {"A": 16, "B": 16, "D": 16}, b),))
    fixed = KernelEntry(
        "fixed", inputs=(TensorSpec("x", "f32", (4, 8)),), outputs=(TensorSpec("y", "f32", (4, 8)),),
        plans=(Plan("fixed_0", "elementwise", (("d0", 4), ("d1", 8)), ("x", "y"), binaries=b),))
    expand = KernelEntry(
        "expand", inputs=(TensorSpec("x", "bf16", ("N",)),), outputs=(TensorSpec("y", "bf16", ("N", "R")),),
        plans=(Plan("expand_0", "elementwise", (("d0", "N"), ("d1", "R")), ("x", "y"), binaries=b),))
    two = KernelEntry(
        "two", inputs=(TensorSpec("x", "f32", ("N",)),),
        outputs=(TensorSpec("y", "f32", ("N",)), TensorSpec("z", "f32", ("N",))),
        plans=(Plan("two_0", "elementwise", (("d0", "N"),), ("x", "y", "z"), binaries=b),))
    write_manifest(d, Manifest(SpecRef("fake.kspec", "0" * 64), ("sm90a",), (gemm, fixed, expand, two)))
    return kspec.load(d)


@pytest.fixture
def mod(tmp_path):
    return _fake_module(tmp_path)


BASE = 0x7F0000000000


def gemm_args(M=64, N=128, K=32):
    A = f16(BASE, (M, K))
    B = f16(BASE + 0x100000, (K, N), col=True)
    bias = f16(BASE + 0x200000, (N,))
    return A, B, bias


def _check_fails(fn, *args, match, **kwargs):
    with pytest.raises(KspecRuntimeError, match=match) as e:
        fn.check(*args, **kwargs)
    return e.value


# ---------------------------------------------------------------------------------- loading

def test_load_and_describe(mod):
    assert mod.archs == ("sm90a",)
    assert mod.kernels == ("gemm", "fixed", "expand", "two")
    assert mod["gemm"] is mod.gemm
    r = repr(mod.gemm)
    assert "A: f16[M, K]" in r and "B: f16[K, N] col" in r and "D: f16[M, N] = None" in r
    assert "alpha: f32 = 1.0" in r and "beta: f32," in r and "-> {D}" in r
    sig = inspect.signature(mod.gemm)
    assert list(sig.parameters) == ["A", "B", "bias", "D", "alpha", "beta", "count", "stream"]
    assert sig.parameters["alpha"].default == 1.0
    assert sig.parameters["beta"].default is inspect.Parameter.empty
    assert sig.parameters["D"].kind is inspect.Parameter.KEYWORD_ONLY
    text = pydoc.render_doc(mod.gemm, renderer=pydoc.plaintext)
    assert "B      f16[K, N] col" in text and "beta   f32  (required)" in text
    assert "Sizes K, M, N are bound" in text
    mtext = pydoc.render_doc(mod, renderer=pydoc.plaintext)
    assert "fixed(x: f32[4, 8]" in mtext and "expand(" in mtext
    assert "gemm(" in repr(mod) and "archs sm90a" in repr(mod)
    assert "gemm" in dir(mod)


def test_unknown_kernel(mod):
    with pytest.raises(AttributeError, match="has no kernel 'nope'.*kernels: gemm, fixed"):
        mod.nope
    with pytest.raises(KeyError):
        mod["nope"]


def test_load_verifies_binaries(tmp_path):
    m = _fake_module(tmp_path)
    (m.path / "x.so").write_bytes(b"tampered")
    with pytest.raises(KspecArtifactError, match="x.so: sha256 mismatch"):
        kspec.load(m.path)


def test_no_cuda_device(mod):
    ok, why = cuda_available()
    if ok:
        pytest.skip("a CUDA device is present")
    assert why
    A, B, bias = gemm_args()
    with pytest.raises(KspecRuntimeError, match="^error: no CUDA device: ") as e:
        mod.gemm(A, B, bias, beta=0.0)
    assert "sm_90a" in e.value.hint
    # the device check comes first, even for arguments that would not validate
    with pytest.raises(KspecRuntimeError, match="no CUDA device"):
        mod.gemm("not a tensor")


# ---------------------------------------------------------------------------------- validation

def test_valid_binding(mod):
    A, B, bias = gemm_args()
    b = mod.gemm.check(A, B, bias, beta=0.25)
    assert b.sizes == {"M": 64, "K": 32, "N": 128}
    assert b.allocate == ("D",)
    assert b.params == {"alpha": 1.0, "beta": 0.25, "count": 3}
    assert b.strides["D"] == (128, 1)
    plan = b.kernel.plans[0]
    assert b.dims(plan) == [64, 128, 32, 1]
    assert b.scalars(plan) == [1.0, 0.25]
    assert b.stream == 0 and b.device is None
    assert b.views["B"].strides == (1, 32)
    # keywords for inputs, a passed output, an explicit stream
    D = f16(BASE + 0x300000, (64, 128))
    b = mod.gemm.check(A=A, B=B, bias=bias, D=D, beta=0, alpha=2, stream=7)
    assert b.allocate == () and b.stream == 7 and b.params["alpha"] == 2.0


def test_dtype(mod):
    A, B, bias = gemm_args()
    B32 = FakeCAI(BASE + 0x100000, (32, 128), "<f4", (4, 128))
    _check_fails(mod.gemm, A, B32, bias, beta=0, match=r"argument 'B': expected f16, got f32$")


def test_rank(mod):
    A, B, bias = gemm_args()
    _check_fails(mod.gemm, A, B, f16(BASE, (1, 128)), beta=0,
                 match=r"argument 'bias': expected rank 1 \(f16\[N\]\), got rank 2 with shape \(1, 128\)")


def test_symbolic_sizes_consistent(mod):
    A, B, _ = gemm_args(K=32)
    _check_fails(mod.gemm, A, B, f16(BASE, (64,)), beta=0,
                 match=r"argument 'bias': dimension 0 \(N\) is 64, but 'B' has N = 128")
    Bk = f16(BASE + 0x100000, (16, 128), col=True)
    _check_fails(mod.gemm, A, Bk, f16(BASE, (128,)), beta=0,
                 match=r"argument 'B': dimension 0 \(K\) is 16, but 'A' has K = 32")
    A2, B2, bias2 = gemm_args()
    _check_fails(mod.gemm, A2, B2, bias2, D=f16(BASE + 0x900000, (64, 64)), beta=0,
                 match=r"argument 'D': dimension 1 \(N\) is 64")


def test_literal_dims(mod):
    x = FakeCAI(BASE, (4, 9), "<f4")
    _check_fails(mod.fixed, x, match=r"argument 'x': dimension 1 must be 8, got 9")
    assert mod.fixed.check(FakeCAI(BASE, (4, 8), "<f4")).allocate == ("y",)


def test_layout_strides(mod):
    A, _, bias = gemm_args()
    B_row = f16(BASE + 0x100000, (32, 128))              # row-major where col is compiled
    e = _check_fails(mod.gemm, A, B_row, bias, beta=0,
                     match=r"argument 'B': expected col layout, i.e. strides \(1, 32\) .* got strides \(128, 1\)")
    assert "transpose" in e.hint
    A_col = f16(BASE, (64, 32), col=True)
    _check_fails(mod.gemm, A_col, gemm_args()[1], bias, beta=0, match="argument 'A': expected row layout")
    # a sliced view (row pitch larger than the extent) is not what the kernel was compiled for
    A_pitched = FakeCAI(BASE, (64, 32), "<f2", (128, 2))
    _check_fails(mod.gemm, A_pitched, gemm_args()[1], bias, beta=0, match=r"strides \(32, 1\)")


def test_unit_dims_take_any_stride(mod):
    A = FakeCAI(BASE, (1, 32), "<f2", (12345 * 2, 2))
    _, B, bias = gemm_args()
    assert mod.gemm.check(A, B, bias, beta=0).sizes["M"] == 1


def test_alignment_pointer(mod):
    _, B, bias = gemm_args()
    A = f16(BASE + 2, (64, 32))
    _check_fails(mod.gemm, A, B, bias, beta=0,
                 match=r"argument 'A': data pointer 0x7f0000000002 is not 16-byte aligned \(plan 'gemm_0'")


def test_alignment_pitch(mod):
    A, B, bias = gemm_args(K=36)          # row pitch 72 bytes
    e = _check_fails(mod.gemm, A, B, bias, beta=0,
                     match=r"argument 'A': stride of dimension 0 \(M\) is 36 elements = 72 bytes, "
                           r"not a multiple of the 16-byte alignment")
    assert e.hint == "make K a multiple of 8"


def test_alignment_of_allocated_output(mod):
    A = f16(BASE, (64, 32))
    B = f16(BASE + 0x100000, (32, 4), col=True)
    bias = f16(BASE + 0x200000, (4,))
    _check_fails(mod.gemm, A, B, bias, beta=0, match=r"output 'D': stride of dimension 0 \(M\) is 4 elements = 8 bytes")


def test_outputs_must_not_overlap(mod):
    A, B, bias = gemm_args()
    D_on_A = f16(BASE + 0x40, (64, 128))
    _check_fails(mod.gemm, A, B, bias, D=D_on_A, beta=0,
                 match="argument 'D': output overlaps input 'A' in memory")
    x = FakeCAI(BASE, (100,), "<f4")
    y = FakeCAI(BASE + 0x1000, (100,), "<f4")
    z = FakeCAI(BASE + 0x1000 + 4 * 99, (100,), "<f4")       # shares y's last element
    _check_fails(mod.two, x, y=y, z=z, match="argument 'z': output overlaps output 'y'")
    z_ok = FakeCAI(BASE + 0x1000 + 4 * 100, (100,), "<f4")
    assert mod.two.check(x, y=y, z=z_ok).allocate == ()
    # inputs may alias each other
    mod.gemm.check(A, B, f16(BASE, (128,)), beta=0)


def test_readonly_output(mod):
    x = FakeCAI(BASE, (4, 8), "<f4")
    y = FakeCAI(BASE + 0x1000, (4, 8), "<f4", readonly=True)
    _check_fails(mod.fixed, x, y=y, match="argument 'y': output is read-only")


def test_params(mod):
    A, B, bias = gemm_args()
    _check_fails(mod.gemm, A, B, bias, match=r"missing parameter 'beta' \(f32, no default\)")
    _check_fails(mod.gemm, A, B, bias, beta="0.5", match=r"parameter 'beta': expected a Python number \(f32\), got str")
    _check_fails(mod.gemm, A, B, bias, beta=True, match="expected a Python number")
    _check_fails(mod.gemm, A, B, bias, beta=0, count=2.5, match=r"parameter 'count': expected an integer \(i32\), got 2.5")
    b = mod.gemm.check(A, B, bias, beta=np.float32(0.5), count=4.0, alpha=None)
    assert b.params == {"alpha": 1.0, "beta": 0.5, "count": 4}


def test_argument_assignment(mod):
    A, B, bias = gemm_args()
    _check_fails(mod.gemm, A, B, match=r"gemm\(\): missing input 'bias' \(f16\[N\]\)")
    _check_fails(mod.gemm, A, B, bias, A, beta=0, match=r"takes 3 positional input\(s\) \(A, B, bias\), got 4")
    _check_fails(mod.gemm, A, B, bias, beta=0, gamma=1, match=r"unexpected argument 'gamma' \(expected one of: A, B, bias, D, alpha")
    _check_fails(mod.gemm, A, B, bias, A=A, beta=0, match="argument 'A' given twice")
    _check_fails(mod.gemm, A, B, None, beta=0, match="argument 'bias': expected a tensor, got None")


def test_unbound_output_size(mod):
    x = FakeCAI(BASE, (16,), "|V2")
    with pytest.raises(KspecRuntimeError, match="bf16/f8 cannot be described"):
        mod.expand.check(x)
    xb = DeviceBuffer(BASE, (16,), "bf16")
    e = _check_fails(mod.expand, xb, match=r"cannot determine size 'R' of output 'y' \(bf16\[N, R\]\)")
    assert e.hint == "pass 'y' explicitly"
    b = mod.expand.check(xb, y=DeviceBuffer(BASE + 0x1000, (16, 3), "bf16"))
    assert b.sizes == {"N": 16, "R": 3}


def test_not_a_tensor(mod):
    _, B, bias = gemm_args()
    _check_fails(mod.gemm, [[1.0]], B, bias, beta=0, match=r"argument 'A': expected a torch CUDA tensor.*got list")
    _check_fails(mod.gemm, np.zeros((64, 32), np.float16), B, bias, beta=0,
                 match=r"argument 'A': ndarray is on the CPU; expected a CUDA tensor")


def test_device_buffer(mod):
    A = DeviceBuffer(BASE, (64, 32), "f16")
    B = DeviceBuffer(BASE + 0x100000, (32, 128), np.float16, strides=(1, 32))
    bias = DeviceBuffer(BASE + 0x200000, [128], "float16", device=0)
    b = mod.gemm.check(A, B, bias, beta=0)
    assert b.device == 0 and b.views["B"].strides == (1, 32)
    assert A.__cuda_array_interface__["strides"] == (64, 2)
    with pytest.raises(KspecRuntimeError, match="unknown dtype"):
        DeviceBuffer(BASE, (4,), "f64")
    with pytest.raises(KspecRuntimeError, match="2 strides for rank 1"):
        DeviceBuffer(BASE, (4,), "f32", strides=(1, 1))


def test_cai_byte_strides_must_divide(mod):
    x = FakeCAI(BASE, (4, 8), "<f4", (33, 4))
    _check_fails(mod.fixed, x, match=r"byte strides \(33, 4\) are not multiples of the 4-byte element size")



# ---- sizes a kernel declares it needs: plans[*].multiples, block-scale quotients, row pitches

def _moe_like(tmp_path: Path):
    """A grouped GEMM over gathered rows whose K role (bound to D) the kernel needs a multiple of 64
    (plans[*].multiples, as the CuTe DSL backend records it), next to a block-scaled GEMM whose
    f8e8m0 scales [M, K / 32] are read in 4-byte rows."""
    d = tmp_path / "moe"
    d.mkdir()
    (d / "x.cubin").write_bytes(b"cubin")
    (d / "x.so").write_bytes(b"glue")
    b = {"sm90a": make_binary(d, "x.cubin", "x.so")}
    moe = KernelEntry(
        "moe",
        inputs=(TensorSpec("X", "bf16", ("N", "D")), TensorSpec("idx", "i32", ("off_rows",), packed="off"),
                TensorSpec("off", "i32", ("E+1",)), TensorSpec("W", "bf16", ("E", "F", "D"))),
        outputs=(TensorSpec("Y", "bf16", ("off_rows", "F"), packed="off"),),
        plans=(Plan("moe_0", "gemm", (("M", "off_rows"), ("N", "F"), ("K", "D"), ("L", "E"), ("R", "N")),
                    ("X", "W", "off", "idx", "Y"), (), {}, {"X": 16, "W": 16, "Y": 16}, b,
                    multiples={"K": 64}),))
    mx = KernelEntry(
        "mx",
        inputs=(TensorSpec("A", "f8e4m3", ("M", "K")), TensorSpec("sa", "f8e8m0", ("M", "K/32"))),
        outputs=(TensorSpec("D", "bf16", ("M", "M")),),
        plans=(Plan("mx_0", "gemm", (("M", "M"), ("N", "M"), ("K", "K"), ("L", 1)), ("A", "sa", "D"), (), {},
                    {"A": 16, "sa": 4, "D": 16}, b),))
    write_manifest(d, Manifest(SpecRef("moe.kspec", "0" * 64), ("sm90a",), (moe, mx)))
    return kspec.load(d)


def test_a_size_the_kernel_needs_a_multiple_of_is_refused_by_name(tmp_path):
    mod = _moe_like(tmp_path)
    assert mod.manifest.kernels[0].plans[0].multiples == {"K": 64}

    def args(D):
        return dict(X=DeviceBuffer(BASE, (10, D), "bf16"), idx=DeviceBuffer(BASE + 0x10000, (12,), "i32"),
                    off=DeviceBuffer(BASE + 0x20000, (3,), "i32"), W=DeviceBuffer(BASE + 0x30000, (2, 128, D), "bf16"))
    mod.moe.check(**args(128))
    e = _check_fails(mod.moe, **args(72), match=r"D = 72 \(from 'X'\) is not a multiple of 64, which plan 'moe_0' "
                                                  r"needs \(its size K")
    assert e.hint == "pad D to a multiple of 64"


def test_call_sizes_completes_and_rounds_a_size_set_as_the_artifact_declares(tmp_path):
    """kspec.selftest.call_sizes: every size symbol of the arguments gets a value (E only in the
    offsets' extent E+1 too), rounded up to the plan's multiples (D: the K role, 64), to whole
    blocks of a `K/32` quotient and to 4-byte rows of the f8e8m0 scales (K: 128); packed row
    counts are left to the offsets; the rest of the set is kept."""
    from kspec.selftest import SIZE_SETS, call_sizes
    mod = _moe_like(tmp_path)
    moe, mx = mod.manifest.kernels
    base = {"M": 200, "N": 144, "K": 80, "F": 136, "T": 7}
    got = call_sizes(moe, base)
    assert got == {**base, "D": 64, "E": 16}                   # D, E: the default 16, D rounded up
    assert call_sizes(moe, {**base, "D": 80, "E": 3}, default=8) == {**base, "D": 128, "E": 3}
    assert "off_rows" not in got
    assert call_sizes(mx, base) == {**base, "K": 128}
    assert call_sizes(mx, {**base, "K": 100}, keep=("K",))["K"] == 100     # a size a user gave: as given
    for s in SIZE_SETS.values():
        sizes = call_sizes(moe, s)
        assert sizes["D"] % 64 == 0 and sizes["E"] == s["E"]
        assert call_sizes(mx, s)["K"] % 128 == 0

# ---- DLPack: real capsules built with ctypes, as a producer would

from kspec.runtime.tensors import _DLManagedTensor, _DLManagedTensorVersioned  # noqa: E402

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeDLPack:
    def __init__(self, ptr, shape, code=2, bits=16, device=(2, 0), strides=None, versioned=False,
                 readonly=False, byte_offset=0):
        self.shape_arr = (ctypes.c_int64 * len(shape))(*shape)
        self.strides_arr = (ctypes.c_int64 * len(shape))(*strides) if strides else None
        self.m = _DLManagedTensorVersioned() if versioned else _DLManagedTensor()
        t = self.m.dl_tensor
        t.data, t.ndim, t.byte_offset = ptr, len(shape), byte_offset
        t.device.device_type, t.device.device_id = device
        t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, 1
        t.shape = self.shape_arr
        t.strides = self.strides_arr
        if versioned:
            self.m.version.major, self.m.version.minor = 1, 0
            self.m.flags = 1 if readonly else 0
        self.versioned = versioned
        self.device = device
        self.calls = []

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, max_version=None):
        self.calls.append((stream, max_version))
        name = b"dltensor_versioned" if (self.versioned and max_version) else b"dltensor"
        return _PyCapsule_New(ctypes.addressof(self.m), name, None)


def test_dlpack_tensors(mod):
    A = FakeDLPack(BASE, (64, 32), byte_offset=0)
    B = FakeDLPack(BASE + 0x100000, (32, 128), strides=(1, 32), versioned=True)
    bias = FakeDLPack(BASE + 0x200000 - 16, (128,), byte_offset=16)
    b = mod.gemm.check(A, B, bias, beta=0, stream=1234)
    assert b.device == 0
    assert b.views["bias"].ptr == BASE + 0x200000
    assert b.views["B"].strides == (1, 32) and b.views["B"].source == "DLPack"
    assert B.calls == [(1234, (1, 0))]            # the launch stream is handed to the producer
    mod.gemm.check(A, B, bias, beta=0)
    assert A.calls[-1][0] == 1                    # NULL stream -> DLPack's "legacy default" (1)


def test_dlpack_dtype_and_device(mod):
    _, B, bias = gemm_args()
    A_bf16 = FakeDLPack(BASE, (64, 32), code=4, bits=16)
    _check_fails(mod.gemm, A_bf16, B, bias, beta=0, match="argument 'A': expected f16, got bf16")
    A_cpu = FakeDLPack(BASE, (64, 32), device=(1, 0))
    _check_fails(mod.gemm, A_cpu, B, bias, beta=0, match="argument 'A': FakeDLPack is on the CPU; expected a CUDA tensor")
    A0 = FakeDLPack(BASE, (64, 32), device=(2, 0))
    B1 = FakeDLPack(BASE + 0x100000, (32, 128), strides=(1, 32), device=(2, 1))
    _check_fails(mod.gemm, A0, B1, bias, beta=0,
                 match="argument 'B': on cuda:1, but 'A' is on cuda:0; all tensors must be on one CUDA device")
    ro = FakeDLPack(BASE + 0x1000, (4, 8), code=2, bits=32, versioned=True, readonly=True)
    _check_fails(mod.fixed, FakeCAI(BASE, (4, 8), "<f4"), y=ro, match="output is read-only")


def test_stream_kinds(mod):
    A, B, bias = gemm_args()

    class TorchLike:
        cuda_stream = 77

    class Proto:
        def __cuda_stream__(self):
            return (0, 88)

    from cuda.bindings import driver as cu
    assert mod.gemm.check(A, B, bias, beta=0, stream=TorchLike()).stream == 77
    assert mod.gemm.check(A, B, bias, beta=0, stream=Proto()).stream == 88
    assert mod.gemm.check(A, B, bias, beta=0, stream=cu.CUstream(99)).stream == 99
    _check_fails(mod.gemm, A, B, bias, beta=0, stream="fast", match="stream: expected a CUDA stream handle, got str")


def test_cai_stream_is_recorded():
    v = as_view(FakeCAI(BASE, (4,), "<f4", stream=5), "argument 'x'", 0)
    assert v.stream == 5 and v.device is None
    assert as_view(FakeCAI(BASE, (4,), "<f4", stream=5, version=2), "x", 0).stream is None


# ---------------------------------------------------------------------------------- host glue

needs_cxx = pytest.mark.skipif(selftest.find_cxx() is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def glue_fixture(tmp_path_factory):
    if selftest.find_cxx() is None:
        pytest.skip("no C++ compiler")
    return kspec.load(selftest.build_fixture(tmp_path_factory.mktemp("glue") / "fixture",
                                             ("sm90a", "sm100a"), fake_cubins=True))


@needs_cxx
def test_fixture_signature(glue_fixture):
    m = glue_fixture
    assert m.kernels == ("scale_add", "two_step") and m.archs == ("sm90a", "sm100a")
    assert "B: f32[M, N] col" in repr(m.scale_add)
    assert "scale: f32," in repr(m.two_step)


@needs_cxx
def test_host_glue_prepare(glue_fixture):
    m = glue_fixture
    A = FakeCAI(BASE, (48, 200), "<f4")
    B = FakeCAI(BASE + 0x100000, (48, 200), "<f4", (4, 48 * 4))
    b = m.scale_add.check(A, B, alpha=0.5)
    assert b.allocate == ("D", "rmax") and b.strides["rmax"] == (1,)
    plan = b.kernel.plans[0]
    glue = m.glue(plan, "sm90a")
    assert glue.workspace_size(b.dims(plan), 0, 132) == 0
    p = glue.prepare(b.dims(plan), [BASE, BASE + 0x100000, 0x1000, 0x2000], b.scalars(plan), 0, 0, 132)
    assert p.grid == (2, 48, 1) and p.block == (128, 1, 1) and p.cluster == (1, 1, 1)
    assert p.smem_bytes == 64 * 1024
    assert p.params_ptr % 128 == 0
    assert p.params_size == 56
    a, bb, d, r, M, N, alpha = struct.unpack("<4Q2qf4x", p.params_bytes())
    assert (a, bb, d, r, M, N, alpha) == (BASE, BASE + 0x100000, 0x1000, 0x2000, 48, 200, 0.5)


@needs_cxx
def test_host_glue_error(glue_fixture):
    plan = glue_fixture.manifest.kernels[0].plans[0]
    glue = glue_fixture.glue(plan, "sm100a")
    with pytest.raises(KspecRuntimeError, match=r"plan 'scale_add_0' \(sm100a\): kspec_prepare failed: "
                                                r"M = 70000 exceeds the grid's y limit"):
        glue.prepare([70000, 8], [0, 0, 0, 0], [1.0], 0, 0, 132)


@needs_cxx
def test_two_plan_binding(glue_fixture):
    k = glue_fixture.two_step
    X = FakeCAI(BASE, (1000,), "<f4")
    _check_fails(k, X, match=r"missing parameter 'scale'")
    b = k.check(X, scale=3.0)
    p0, p1 = b.kernel.plans
    assert b.scalars(p0) == [3.0, 0.0] and b.scalars(p1) == [1.0, 1.0]
    assert b.strides["t"] == (1,)
    glue = glue_fixture.glue(p0, "sm90a")
    assert glue.workspace_size(b.dims(p0), 0, 132) == 256
    with pytest.raises(KspecRuntimeError, match="workspace missing"):
        glue.prepare(b.dims(p0), [BASE, 0x1000], b.scalars(p0), 0, 0, 132)


def test_bad_host_glue(tmp_path):
    from kspec.runtime.glue import HostGlue
    (tmp_path / "x.so").write_bytes(b"not an ELF")
    with pytest.raises(KspecRuntimeError, match=r"x.so: the host glue of plan 'p' \(sm90a\) is not a whole "
                                                r"shared library \(10 bytes, no ELF header\)"):
        HostGlue(tmp_path / "x.so", "plan 'p' (sm90a)")


def test_arch_selection(mod):
    assert mod.arch_for((9, 0), "H100", 0) == "sm90a"
    with pytest.raises(KspecRuntimeError, match=r"compute capability 10.0\) cannot run this artifact: the "
                                                r"artifact has no sm100a binary; it has binaries for sm90a"):
        mod.arch_for((10, 0), "B200", 0)
    with pytest.raises(KspecRuntimeError, match=r"compute capability 8.0\) cannot run.*only for sm90a, sm100a"):
        mod.arch_for((8, 0), "A100", 0)
    with pytest.raises(KspecRuntimeError, match="9.0 and|9.0\\)"):
        mod.arch_for((12, 0), "RTX", 1)


# ---------------------------------------------------------------------------------- real cubins

@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None or selftest.find_cxx() is None, reason="needs nvcc and a C++ compiler")
def test_fixture_with_real_cubins(tmp_path):
    d = selftest.build_fixture(tmp_path / "fixture", ("sm90a", "sm100a"))
    m = kspec.load(d)
    for arch in m.archs:
        for plan in (p for k in m.manifest.kernels for p in k.plans):
            image = m.image(plan, arch)
            assert image[:4] == b"\x7fELF"                 # a cubin is an ELF image
            assert b"kspec_kernel" in image
    # the device check still comes first on this machine
    if not cuda_available()[0]:
        with pytest.raises(KspecRuntimeError, match="no CUDA device"):
            m.two_step(FakeCAI(BASE, (8,), "<f4"), scale=1.0)


# ---------------------------------------------------------------------------------- launch sequence

class RecordingDriver:
    """Stands in for kspec.runtime.driver.Driver: records what a call asks of the GPU."""

    def __init__(self, cc=(9, 0)):
        self.cc = cc
        self.log: list[tuple] = []
        self.next_ptr = 0x7E0000000000

    def require_device(self):
        pass

    def available(self):
        return True, ""

    def facts(self, ordinal):
        return (*self.cc, 132, "Fake H100")

    def primary_context(self, ordinal):
        return ("ctx", ordinal)

    def stream_context(self, stream):
        return None if stream in (0, 1, 2) else ("ctx", 0)

    def context_device(self, ctx):
        return ctx[1]

    def current_device(self):
        return None

    from contextlib import contextmanager

    @contextmanager
    def current(self, ctx):
        self.log.append(("push", ctx))
        yield
        self.log.append(("pop",))

    def pointer_device(self, ptr, what):
        return 0

    def is_capturing(self, stream):
        return False

    def order_after(self, producer, consumer):
        self.log.append(("wait", producer, consumer))

    def alloc_async(self, nbytes, stream, what):
        p = self.next_ptr
        self.next_ptr += (nbytes + 0xFFFF) // 0x10000 * 0x10000
        self.log.append(("alloc", nbytes, stream))
        return p

    def free_async(self, ptr, stream):
        self.log.append(("free", ptr, stream))

    def fill(self, ptr, pattern, width, count, stream, what):
        self.log.append(("fill", ptr, pattern, width, count, stream))

    def copy_to_host(self, ptr, nbytes, stream, what):
        self.log.append(("d2h", ptr, nbytes, stream))      # index tensors read as zeros: in range
        return bytes(nbytes)

    def function(self, ctx, key, image, symbol, what):
        self.log.append(("function", key[1:], symbol, image[:12]))
        return 1

    def param_size(self, func):
        return None

    def param_layout(self, func):
        return None

    def set_dynamic_smem(self, func, nbytes, what):
        self.log.append(("smem", nbytes))

    def launch(self, func, grid, block, cluster, smem, stream, params_ptr, what):
        self.log.append(("launch", what, grid, block, cluster, smem, stream,
                         ctypes.string_at(params_ptr, 56 if "scale_add" in what else 32)))


class MultiParamRecorder:
    """RecordingDriver with multi-parameter (CuTe DSL) launches: records the parameter offsets and
    the parameter bytes up to `tail` bytes past the last parameter's offset."""

    def __init__(self, cc, tail: int = 256):
        self.base = RecordingDriver(cc)
        self.tail = tail

    def __getattr__(self, name):
        return getattr(self.base, name)

    def launch(self, func, grid, block, cluster, smem, stream, params_ptr, what, param_offsets=None):
        self.base.log.append(("launch", what, grid, block, cluster, smem, stream, param_offsets,
                              ctypes.string_at(params_ptr, (param_offsets[-1] + self.tail) if param_offsets else 64)))


@pytest.fixture
def recording(monkeypatch):
    from kspec.runtime import driver
    rec = RecordingDriver()
    monkeypatch.setattr(driver, "_driver", rec)
    return rec


@needs_cxx
def test_launch_sequence(glue_fixture, recording):
    rec = recording
    A = FakeCAI(BASE, (48, 200), "<f4")
    B = FakeCAI(BASE + 0x100000, (48, 200), "<f4", (4, 48 * 4), stream=9)
    out = glue_fixture.scale_add(A, B, alpha=0.5, stream=5)
    D, rmax = out["D"], out["rmax"]
    assert isinstance(D, kspec.runtime.DeviceArray) and D.shape == (48, 200) and D.stream == 5
    kinds = [e[0] for e in rec.log]
    assert kinds[0] == "push" and kinds[-1] == "pop"
    assert ("wait", 9, 5) in rec.log                           # the CAI producer stream is waited on
    assert ("alloc", 48 * 200 * 4, 5) in rec.log and ("alloc", 48 * 4, 5) in rec.log
    fill = next(e for e in rec.log if e[0] == "fill")
    assert fill == ("fill", rmax.ptr, 0xFF800000, 4, 48, 5)   # -inf, before the launch
    assert kinds.index("fill") < kinds.index("launch")
    assert ("smem", 65536) in rec.log
    launch = next(e for e in rec.log if e[0] == "launch")
    assert launch[1:7] == ("plan 'scale_add_0' (sm90a)", (2, 48, 1), (128, 1, 1), (1, 1, 1), 65536, 5)
    a, b, d, r, M, N, alpha = struct.unpack("<4Q2qf4x", launch[7])
    assert (a, b, d, r, M, N, alpha) == (BASE, BASE + 0x100000, D.ptr, rmax.ptr, 48, 200, 0.5)
    assert not [e for e in rec.log if e[0] == "free"]          # outputs live on


@needs_cxx
def test_launch_sequence_two_plans(glue_fixture, recording):
    rec = recording
    X = FakeCAI(BASE, (1000,), "<f4")
    Y = FakeCAI(BASE + 0x10000, (1000,), "<f4")
    out = glue_fixture.two_step(X, Y=Y, scale=3.0)
    assert out["Y"] is Y
    allocs = [e for e in rec.log if e[0] == "alloc"]
    assert allocs == [("alloc", 4096 + 256, 0)]                # intermediate t (rounded) + one workspace
    scratch = next(e for e in rec.log if e[0] == "free")[1]
    launches = [e for e in rec.log if e[0] == "launch"]
    assert [l[1] for l in launches] == ["plan 'two_step_0' (sm90a)", "plan 'two_step_1' (sm90a)"]
    x0, y0, n0, a0, b0 = struct.unpack("<2Qq2f", launches[0][7])
    x1, y1, n1, a1, b1 = struct.unpack("<2Qq2f", launches[1][7])
    assert (x0, y0, n0, a0, b0) == (BASE, scratch, 1000, 3.0, 0.0)     # X -> t
    assert (x1, y1, n1, a1, b1) == (scratch, BASE + 0x10000, 1000, 1.0, 1.0)   # t -> Y
    ws_fills = [e for e in rec.log if e[0] == "fill"]
    assert ws_fills == [("fill", scratch + 4096, 0, 1, 256, 0)] * 2     # workspace zeroed per plan
    kinds = [e[0] for e in rec.log]
    assert kinds.index("free") > max(i for i, k in enumerate(kinds) if k == "launch")


@needs_cxx
def test_launch_wrong_arch(glue_fixture, recording):
    recording.cc = (8, 9)
    with pytest.raises(KspecRuntimeError, match=r"cuda:0 \(Fake H100, compute capability 8.9\) cannot run"):
        glue_fixture.two_step(FakeCAI(BASE, (8,), "<f4"), scale=1.0)
    assert not [e for e in recording.log if e[0] in ("alloc", "launch")]


@needs_cxx
def test_launch_stream_on_other_device(glue_fixture, recording):
    recording.stream_context = lambda s: ("ctx", 1)
    x = DeviceBuffer(BASE, (8,), "f32", device=0)
    with pytest.raises(KspecRuntimeError, match="stream: belongs to cuda:1, but the tensors are on cuda:0"):
        glue_fixture.two_step(x, scale=1.0, stream=1234)
