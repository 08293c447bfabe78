"""The per-signature cache of `Kernel.check` and `Module._launch` (kspec.runtime.module._SignatureCache):
a repeat call skips the checks its signature (each argument's dtype, shape, strides, device,
read-only flag; which arguments were passed) already passed, and nothing else.  Once the cache is
warm, a call that differs in any of those, or in a pointer (alignment, outputs overlapping
arguments), a param, the stream, the device or the device's arch, is still checked and refused with
the same message as on a cold cache, before any launch."""
from __future__ import annotations

import pytest

from kspec.runtime import DeviceBuffer, KspecRuntimeError
from kspec.runtime.module import _SIGNATURE_CACHE_SIZE
from test_runtime import BASE, FakeCAI, _fake_module, f16, gemm_args, glue_fixture, needs_cxx, recording  # noqa: F401


def _refusal(fn, *args, **kwargs) -> str:
    with pytest.raises(KspecRuntimeError) as e:
        fn.check(*args, **kwargs)
    return str(e.value)


def _warm_and_cold(tmp_path, kernel: str, good: tuple, bad: tuple) -> tuple[str, str]:
    """The refusal of call `bad` (args, kwargs) on a kernel that just accepted `good`, and on a
    freshly loaded one."""
    warm = _fake_module(tmp_path / "warm")[kernel]
    warm.check(*good[0], **good[1])
    assert len(warm._calls) == 1
    cold = _fake_module(tmp_path / "cold")[kernel]
    return _refusal(warm, *bad[0], **bad[1]), _refusal(cold, *bad[0], **bad[1])


@pytest.fixture
def dirs(tmp_path):
    (tmp_path / "warm").mkdir()
    (tmp_path / "cold").mkdir()
    return tmp_path


def test_repeat_call_hits_and_binds_the_same(dirs):
    k = _fake_module(dirs / "warm").gemm
    A, B, bias = gemm_args()
    first = k.check(A, B, bias, beta=0)
    again = k.check(f16(BASE + 0x400000, (64, 32)), B, bias, beta=0.5)      # same signature, other pointer
    assert len(k._calls) == 1 and again.fixed is first.fixed
    assert again.sizes == first.sizes == {"M": 64, "N": 128, "K": 32}
    assert again.allocate == ("D",) and again.strides == first.strides
    assert again.views["A"].ptr == BASE + 0x400000 and again.params["beta"] == 0.5
    # a caller's change to a Binding does not reach the cache
    again.sizes["M"] = 1
    again.strides["D"] = (1, 1)
    assert k.check(A, B, bias, beta=0).sizes["M"] == 64
    assert k.check(A, B, bias, beta=0).strides["D"] == (128, 1)


@pytest.mark.parametrize("case", ["shape", "rank", "dtype", "layout", "pitch", "pointer", "overlap",
                                  "overlap_output", "readonly", "device", "param", "unbound"])
def test_warm_cache_refuses_what_a_cold_one_does(dirs, case):
    A, B, bias = gemm_args()
    good = ((A, B, bias), {"beta": 0})
    bad = {
        "shape": ((A, f16(BASE + 0x100000, (48, 128), col=True), bias), {"beta": 0}),   # K = 48 vs 32
        "rank": ((f16(BASE, (64, 32, 1)), B, bias), {"beta": 0}),
        "dtype": ((FakeCAI(BASE, (64, 32), "<f4"), B, bias), {"beta": 0}),
        "layout": ((A, f16(BASE + 0x100000, (32, 128)), bias), {"beta": 0}),           # B row-major
        "pitch": ((FakeCAI(BASE, (64, 32), "<f2", (72, 2)), B, bias), {"beta": 0}),     # 72-byte rows
        "pointer": ((f16(BASE + 2, (64, 32)), B, bias), {"beta": 0}),
        "overlap": ((A, B, bias), {"beta": 0, "D": f16(BASE + 0x40, (64, 128))}),
        "readonly": ((A, B, bias), {"beta": 0, "D": f16(BASE + 0x300000, (64, 128), readonly=True)}),
        "device": ((DeviceBuffer(BASE, (64, 32), "f16", device=0), B,
                    DeviceBuffer(BASE + 0x200000, (128,), "f16", device=1)), {"beta": 0}),
        "param": ((A, B, bias), {"beta": "0"}),
        "unbound": ((A, B, bias), {}),                                                     # beta missing
    }
    if case == "overlap_output":
        # warm on the passed-output signature at a good address, then alias an input at the same signature
        good = ((A, B, bias), {"beta": 0, "D": f16(BASE + 0x300000, (64, 128))})
        bad_call = ((A, B, bias), {"beta": 0, "D": f16(BASE + 0x100000, (64, 128))})
    elif case in ("overlap", "readonly"):
        good = ((A, B, bias), {"beta": 0, "D": f16(BASE + 0x300000, (64, 128))})
        bad_call = bad[case]
    elif case == "device":
        good = ((DeviceBuffer(BASE, (64, 32), "f16", device=0), B,
                 DeviceBuffer(BASE + 0x200000, (128,), "f16", device=0)), {"beta": 0})
        bad_call = bad[case]
    else:
        bad_call = bad[case]
    warm, cold = _warm_and_cold(dirs, "gemm", good, bad_call)
    assert warm == cold
    if case == "pointer":
        assert "data pointer 0x7f0000000002 is not 16-byte aligned (plan 'gemm_0'" in warm
    if case == "overlap_output":
        assert "argument 'D': output overlaps input 'B' in memory" in warm


def test_outputs_overlapping_each_other_after_a_hit(dirs):
    k = _fake_module(dirs / "warm").two
    x = FakeCAI(BASE, (100,), "<f4")
    k.check(x, y=FakeCAI(BASE + 0x1000, (100,), "<f4"), z=FakeCAI(BASE + 0x2000, (100,), "<f4"))
    with pytest.raises(KspecRuntimeError, match="argument 'z': output overlaps output 'y'"):
        k.check(x, y=FakeCAI(BASE + 0x1000, (100,), "<f4"), z=FakeCAI(BASE + 0x1000 + 4 * 99, (100,), "<f4"))
    assert len(k._calls) == 1


def test_refused_signatures_are_not_remembered(dirs):
    k = _fake_module(dirs / "warm").gemm
    A, B, bias = gemm_args()
    for _ in range(2):
        with pytest.raises(KspecRuntimeError, match="not 16-byte aligned"):
            k.check(f16(BASE + 2, (64, 32)), B, bias, beta=0)
    assert len(k._calls) == 0
    k.check(A, B, bias, beta=0)
    assert len(k._calls) == 1


def test_cache_size_is_capped(dirs):
    k = _fake_module(dirs / "warm").gemm
    _, B, bias = gemm_args()
    for m in range(1, _SIGNATURE_CACHE_SIZE + 20):
        k.check(f16(BASE, (m, 32)), B, bias, beta=0)
    assert len(k._calls) == _SIGNATURE_CACHE_SIZE
    assert k.check(f16(BASE, (3, 32)), B, bias, beta=0).sizes["M"] == 3      # evicted, checked again


# ---------------------------------------------------------------------------------- launches

def _launches(rec):
    return [e for e in rec.log if e[0] == "launch"]


@needs_cxx
def test_launch_follows_a_changed_call(glue_fixture, recording):
    rec = recording
    k = glue_fixture.scale_add
    A = FakeCAI(BASE, (48, 200), "<f4")
    B = FakeCAI(BASE + 0x100000, (48, 200), "<f4", (4, 48 * 4))
    k(A, B, alpha=0.5, stream=5)
    k(A, B, alpha=0.5, stream=5)
    first, second = _launches(rec)
    assert first[1:7] == second[1:7] == ("plan 'scale_add_0' (sm90a)", (2, 48, 1), (128, 1, 1), (1, 1, 1), 65536, 5)
    # another shape: new grid and sizes in the blob; another stream: launched there; another alpha
    A2 = FakeCAI(BASE, (96, 200), "<f4")
    B2 = FakeCAI(BASE + 0x100000, (96, 200), "<f4", (4, 96 * 4))
    rec.log.clear()
    out = k(A2, B2, alpha=2.0, stream=7)
    (launch,) = _launches(rec)
    assert launch[2] == (2, 96, 1) and launch[6] == 7 and out["D"].shape == (96, 200)
    import struct
    a, b, d, r, M, N, alpha = struct.unpack("<4Q2qf4x", launch[7])
    assert (M, N, alpha, d) == (96, 200, 2.0, out["D"].ptr)
    # the device's arch changes (another driver): refused, nothing launched
    rec.log.clear()
    rec.cc = (8, 9)
    with pytest.raises(KspecRuntimeError, match=r"compute capability 8.9\) cannot run"):
        k(A, B, alpha=0.5, stream=5)
    assert not _launches(rec) and not [e for e in rec.log if e[0] == "alloc"]
    # sm100a: the other binary's launch, from the same signature
    rec.cc = (10, 0)
    k(A, B, alpha=0.5, stream=5)
    assert _launches(rec)[-1][1] == "plan 'scale_add_0' (sm100a)"


@needs_cxx
def test_launch_rechecks_pointers_and_devices(glue_fixture, recording):
    rec = recording
    k = glue_fixture.scale_add
    A = FakeCAI(BASE, (48, 200), "<f4")
    B = FakeCAI(BASE + 0x100000, (48, 200), "<f4", (4, 48 * 4))
    k(A, B, alpha=0.5)
    rec.log.clear()
    # a pointer on another device, same signature
    rec.pointer_device = lambda ptr, what: 1 if ptr == BASE + 0x100000 else 0
    with pytest.raises(KspecRuntimeError, match=r"argument 'B': on cuda:1, but the call runs on cuda:0"):
        k(A, B, alpha=0.5)
    del rec.pointer_device
    # a misaligned pointer, same signature
    if any(plan.alignment for plan in k.entry.plans):
        name, align = next(iter(k.entry.plans[0].alignment.items()))
        with pytest.raises(KspecRuntimeError, match="is not .*-byte aligned"):
            k(FakeCAI(BASE + 4, (48, 200), "<f4"), B, alpha=0.5)
    # a stream of another device
    rec.stream_context = lambda s: ("ctx", 1)
    with pytest.raises(KspecRuntimeError, match="stream: belongs to cuda:1"):
        k(DeviceBuffer(BASE, (48, 200), "f32", device=0), DeviceBuffer(BASE + 0x100000, (48, 200), "f32",
                                                                    strides=(1, 48), device=0), alpha=0.5, stream=99)
    assert not _launches(rec)


def test_the_real_driver_builds_each_launch_configuration_once(monkeypatch):
    """Driver.launch (the cuda-python path, exercised here with cuLaunchKernelEx recorded instead of
    called) passes one CUlaunchConfig per (grid, block, cluster, smem, stream), built once: its
    fields are the launch's, a cluster launch carries the cluster attribute, and the kernel
    parameter array points into the blob at the given offsets."""
    import ctypes

    cu = pytest.importorskip("cuda.bindings.driver")
    from kspec.runtime import driver as drvmod
    drv = drvmod.Driver()
    seen = []

    def call(fn, *args, what=""):
        assert fn == "cuLaunchKernelEx" and what == "launching k"
        cfg, func, argv_addr, extra = args
        n = 3
        argv = (ctypes.c_void_p * n).from_address(argv_addr)
        seen.append((cfg, func, [argv[i] for i in range(n)]))
    monkeypatch.setattr(drv, "call", call)
    drv.launch("f", (132, 1, 1), (384, 1, 1), (1, 1, 1), 200704, 7, 0x1000, "k", param_offsets=(0, 8, 24))
    drv.launch("f", (132, 1, 1), (384, 1, 1), (1, 1, 1), 200704, 7, 0x2000, "k", param_offsets=(0, 8, 24))
    drv.launch("f", (66, 2, 1), (128, 1, 1), (2, 1, 1), 1024, 7, 0x3000, "k", param_offsets=(0, 8, 24))
    (c1, _, a1), (c2, _, a2), (c3, _, a3) = seen
    assert c1 is c2 and c3 is not c1                     # built once per configuration
    assert a1 == [0x1000, 0x1008, 0x1018] and a2 == [0x2000, 0x2008, 0x2018] and a3[0] == 0x3000
    assert (c1.gridDimX, c1.gridDimY, c1.blockDimX, c1.sharedMemBytes, c1.numAttrs) == (132, 1, 384, 200704, 0)
    assert int(c1.hStream) == 7
    assert (c3.gridDimX, c3.gridDimY, c3.blockDimX, c3.numAttrs) == (66, 2, 128, 1)
    attr = c3.attrs[0]
    assert attr.id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert (attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z) == (2, 1, 1)
    # bounded: the oldest configuration is dropped first
    monkeypatch.setattr(drvmod, "LAUNCH_CONFIGS", 2)
    drv.launch("f", (1, 1, 1), (32, 1, 1), (1, 1, 1), 0, 0, 0x4000, "k", param_offsets=(0, 8, 24))
    assert len(drv._configs) == 2 and ((132, 1, 1), (384, 1, 1), (1, 1, 1), 200704, 7) not in drv._configs
