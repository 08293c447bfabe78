"""Launch ABI on CPU: every launch recorded by the fake driver (kspec.runtime.fakedriver) and checked
against the cubin's own declarations and the tensors passed.

What is checked for each launch: the kernel symbol is an entry point; the parameter blob the glue
built is exactly the size of the cubin's single parameter (EIATTR_KPARAM_INFO); the block fits
__launch_bounds__ (EIATTR_MAX_THREADS / REQNTID); grid limits and grid % cluster; the cluster
against EIATTR_CTA_PER_CLUSTER and the portable limit; static + dynamic shared memory against the
arch's 227 KiB and the opt-in attribute set before the launch; the pointers handed to the glue
are the tensors' in plan order and each appears in the blob or behind a TMA descriptor; every TMA
descriptor obeys cuTensorMapEncodeTiled's documented rules and addresses exactly the bytes of one
tensor (address, element size, extents and byte strides, after merging contiguous axes).

TMA descriptors are recorded through the glue's encoder hook (backends/cutlass/tma_hook.py): the
fake encoder marks each descriptor, so its placement in the parameter blob (64-byte aligned) is
checked too, and only the descriptors the kernel will use are matched against tensors.

Limits (see the fakedriver docstring): nothing runs on a device; driver-side validation is limited
to cuTensorMapEncodeTiled's documented rules and the attributes the cubin declares.

The fixture tests build the plain-CUDA fixture artifact (g++ and a few seconds of nvcc); the
shipped-spec tests compile every spec for sm90a and sm100a (marked nvcc, cached).
"""
from __future__ import annotations

import math
import shutil
import struct
import subprocess

import numpy as np
import pytest
from conftest import SHIPPED, shipped_params

import kspec
from kspec.runtime import driver as rt_driver
from kspec.runtime import selftest as fixture
from kspec.runtime.cubin import parse_cubin, read_cubin
from kspec.runtime.fakedriver import (
    ArgTensor,
    FakeDriver,
    LaunchRecord,
    TensorMapRecord,
    check_call,
    check_launch,
    check_tensor_map,
    fake_call,
    parse_cutlass_tma_report,
)
from kspec.selftest import SIZE_SETS, call_sizes

ARCH_CC = {"sm90a": (9, 0), "sm100a": (10, 0)}

needs_fixture_tools = pytest.mark.skipif(shutil.which("nvcc") is None or fixture.find_cxx() is None,
                                         reason="the fixture artifact needs nvcc and a C++ compiler")


@pytest.fixture(scope="module")
def fixture_art(tmp_path_factory):
    if shutil.which("nvcc") is None or fixture.find_cxx() is None:
        pytest.skip("the fixture artifact needs nvcc and a C++ compiler")
    return fixture.build_fixture(tmp_path_factory.mktemp("abi") / "fixture", ("sm90a", "sm100a"))


def _cuobjdump():
    from kspec.backends.toolchain import find_toolchain
    try:
        tc = find_toolchain()
    except Exception:
        return None
    return tc.cuobjdump


# ------------------------------------------------------------------------------- the cubin reader

@needs_fixture_tools
@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
def test_cubin_reader_matches_cuobjdump(fixture_art, arch):
    cubin = fixture_art / f"scale_add_0.{arch}.cubin"
    info = read_cubin(cubin)
    assert info.sm == {"sm90a": 90, "sm100a": 100}[arch]
    k = info.kernel("kspec_kernel")
    assert k.entry
    # struct Params { 4 pointers; int64 M, N; float alpha; } = 32 + 16 + 4, padded to 8: 56 bytes
    assert [p.size for p in k.params] == [56] and k.params[0].offset == 0
    assert k.max_threads == (128, 1, 1)          # __launch_bounds__(128)
    assert k.reqntid is None and k.cluster_dims is None
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    text = subprocess.run([str(tool), "-elf", str(cubin)], capture_output=True, text=True, check=True).stdout
    section = text.split("\n.nv.info.kspec_kernel\n", 1)[1].split("\n\n\n", 1)[0]
    theirs = [line.split(":", 1)[1].strip() for line in section.splitlines() if line.strip().startswith("Attribute:")]
    ours = k.attribute_names()
    assert len(ours) == len(theirs)
    for mine, cuobj in zip(ours, theirs):
        if not mine.startswith("EIATTR_0x"):      # codes this reader does not name
            assert mine == cuobj
    assert "Size    : 0x38" in section and "EIATTR_MAX_THREADS" in section


def test_cubin_reader_rejects_other_files(tmp_path):
    with pytest.raises(kspec.KspecError, match="not a 64-bit little-endian ELF"):
        parse_cubin(b"not a cubin at all" * 8, "x.cubin")
    elf = bytearray(b"\x7fELF\x02\x01" + bytes(58))
    struct.pack_into("<H", elf, 18, 62)           # EM_X86_64
    with pytest.raises(kspec.KspecError, match="not EM_CUDA"):
        parse_cubin(bytes(elf), "host.so")


# ------------------------------------------------------------------------------- the fake driver

def test_driver_use_swaps_and_restores():
    before = rt_driver.get()
    fake = FakeDriver()
    with fake:
        assert rt_driver.get() is fake
    assert rt_driver.get() is before


@needs_fixture_tools
@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
def test_fixture_launches_match_cubin_and_tensors(fixture_art, arch):
    mod = kspec.load(fixture_art)
    M, N = 200, 136                               # N not a multiple of the 128-thread block
    with FakeDriver(ARCH_CC[arch], sm_count=77) as fake:
        call = fake_call(mod, "scale_add", {"M": M, "N": N}, fake, params={"alpha": 0.25})
        assert check_call(call, arch, mod) == []
        (rec,) = call.launches
        A, B, D, rmax = call.plan_args[0]
        # the parameter blob decoded independently: struct Params {A, B, D, rmax, M, N, alpha}
        pa, pb, pd, pr, m, n, alpha = struct.unpack_from("<4Qqqf", rec.params)
        assert (pa, pb, pd, pr) == (A.ptr, B.ptr, D.ptr, rmax.ptr)
        assert (m, n, alpha) == (M, N, 0.25)
        assert B.strides == (1, M)                # col layout reached the glue as such
        assert rec.grid == (math.ceil(N / 128), M, 1) and rec.block == (128, 1, 1) and rec.cluster == (1, 1, 1)
        assert rec.smem_bytes == 65536 and rec.smem_limit == 65536      # opt-in attribute set first
        assert rec.prepare.sm_count == 77 and rec.prepare.dims == (M, N)
        # rmax is initialised to -inf (f32 bit pattern 0xff800000) before the launch
        assert (rmax.ptr, 0xFF800000, 4, M) in fake.fills
        got = np.frombuffer(fake.download(rmax.ptr, 4 * M), dtype=np.float32)
        assert np.all(np.isneginf(got))

        call2 = fake_call(mod, "two_step", {"N": 1000}, fake, params={"scale": 3.0})
        assert check_call(call2, arch, mod) == []
        (_x, t0), (t1, _y) = call2.plan_args
        assert t0.ptr == t1.ptr and t0.name == t1.name == "t"     # intermediate written, then read
        assert [r.prepare.scalars for r in call2.launches] == [(3.0, 0.0), (1.0, 1.0)]
        assert all(r.prepare.workspace != 0 for r in call2.launches)
        assert call2.launches[0].grid == (math.ceil(1000 / 256), 1, 1)


@needs_fixture_tools
def test_checks_catch_abi_mismatches(fixture_art):
    mod = kspec.load(fixture_art)
    with FakeDriver((9, 0)) as fake:
        call = fake_call(mod, "scale_add", {"M": 64, "N": 256}, fake)
    rec, args = call.launches[0], call.plan_args[0]

    def variant(**changes) -> LaunchRecord:
        fields = dict(rec.__dict__)
        fields.update(changes)
        return LaunchRecord(**fields)

    assert check_launch(rec, "sm90a", args) == []
    assert any("parameter 0 is 56 bytes" in p for p in check_launch(variant(params=rec.params[:48]), "sm90a", args))
    assert any("__launch_bounds__" in p for p in check_launch(variant(block=(256, 1, 1)), "sm90a", args))
    assert any("not a multiple of cluster" in p for p in check_launch(variant(cluster=(3, 1, 1)), "sm90a", args))
    assert any("limit was set" in p for p in check_launch(variant(smem_limit=0), "sm90a", args))
    assert any("exceed sm90a" in p for p in check_launch(variant(smem_bytes=240000, smem_limit=240000), "sm90a", args))
    swapped = [args[1], args[0], *args[2:]]      # A and B handed over in the wrong order
    assert any("the glue got pointers" in p for p in check_launch(rec, "sm90a", swapped))
    assert any("'rmax'" in p and "neither in the parameter blob" in p
               for p in check_launch(variant(params=rec.params[:24] + bytes(32)), "sm90a", args))


# ------------------------------------------------------------------------------- TMA descriptors

CUTLASS_REPORT = """\
TMA Desc Addr:   0x7ffde6f75080
format         1
dim            3
gmem_address   0x55e72cc23d00
globalDim      (72,136,1,1,1)
globalStrides  (2,144,0,0,0)
boxDim         (64,64,1,1,1)
elementStrides (1,1,1,1,1)
interleave     0
swizzle        3
l2Promotion    2
oobFill        0
Error: Failed to initialize the TMA descriptor 999
some other line
"""


def test_parse_cutlass_tma_report():
    (tm,), rest = parse_cutlass_tma_report(CUTLASS_REPORT)
    assert rest == "some other line"
    assert tm.address == 0x55E72CC23D00 and tm.data_type == 1 and tm.element_bytes == 2
    assert tm.dims == (72, 136, 1) and tm.strides == (144, 0) and tm.box == (64, 64, 1) and tm.swizzle == 3
    assert tm.problems() == []
    with pytest.raises(kspec.KspecInternalError, match="unexpected CUTLASS TMA report line"):
        parse_cutlass_tma_report(CUTLASS_REPORT.replace("boxDim ", "bogus  "))


def test_tensor_map_checks_against_tensors():
    # B: f16[K=72, N=136] col (K contiguous), as the GEMM glue describes it: dims (K, N, L=1)
    tm = parse_cutlass_tma_report(CUTLASS_REPORT)[0][0]
    b_col = ArgTensor("B", tm.address, (72, 136), (1, 72), "f16")
    assert check_tensor_map(tm, [b_col]) == []
    # the same bytes read as row-major (the "column-major input uploaded transposed" defect)
    b_row = ArgTensor("B", tm.address, (72, 136), (136, 1), "f16")
    assert any("addresses 'B'" in p for p in check_tensor_map(tm, [b_row]))
    assert any("4-byte elements" in p for p in check_tensor_map(
        TensorMapRecord(**{**tm.__dict__, "data_type": 7}), [b_col]))
    assert any("none of the plan's tensors" in p for p in check_tensor_map(tm, [b_col.__class__(
        "B", tm.address + 256, b_col.shape, b_col.strides, "f16")]))
    bad = TensorMapRecord(**{**tm.__dict__, "strides": (150, 0), "box": (300, 64, 1), "address": tm.address + 8})
    probs = bad.problems()
    assert any("globalStrides[0] = 150" in p for p in probs)
    assert any("boxDim[0] = 300" in p for p in probs)
    assert any("not 16-byte aligned" in p for p in probs)
    # batched tensors: contiguous axes merge, so a (K, M*L) descriptor matches an [L, M, K] tensor
    merged = TensorMapRecord(0, 9, 0x1000, (64, 600), (128,), (64, 128), (1, 1), 0, 3, 2, 0)
    assert check_tensor_map(merged, [ArgTensor("A", 0x1000, (3, 200, 64), (12800, 64, 1), "bf16")]) == []


# ------------------------------------------------------------------------------- shipped specs

@pytest.mark.heavy
@pytest.mark.nvcc
@pytest.mark.parametrize("stem", shipped_params(SHIPPED))
def test_shipped_spec_launch_abi(compiled, stem):
    art = compiled(stem)                        # the archs the spec's `target` line allows
    mod = kspec.load(art)
    for arch in mod.archs:
        with FakeDriver(ARCH_CC[arch], sm_count=132) as fake:
            for base in SIZE_SETS.values():     # tile multiples, ragged, smaller than a tile
                for kname in mod.kernels:
                    # with the sizes the kernel declares it needs (block-scale quotients, multiples)
                    sizes = call_sizes(mod[kname].entry, base)
                    call = fake_call(mod, kname, sizes, fake)
                    problems = check_call(call, arch, mod)
                    # Open on sm100a, to verify on a B200 (as in tests/test_fa4_attention.py): FA4's
                    # kernel asks for 232448 bytes of dynamic shared memory next to a 1024-byte static
                    # section; the fake driver counts both against the 232448-byte limit.
                    problems = [p for p in problems if not (arch == "sm100a" and "static shared memory exceed" in p
                                                            and stem.startswith("attention"))]
                    assert problems == [], f"{stem} {arch} {sizes}:\n" + "\n".join(problems)
                    for plan, rec in zip(mod[kname].entry.plans, call.launches):
                        if plan.kind == "gemm" and "kernel_schedule" in plan.binaries[arch].config:
                            assert len(rec.prepare.tensor_maps) >= 2, f"{plan.id}: no TMA descriptors recorded"


def test_recording_encoder_marks_descriptors_and_rejects_like_the_driver():
    import ctypes

    from kspec.runtime.fakedriver import RecordingEncoder, find_tensor_maps
    enc = RecordingEncoder()
    blob = (ctypes.c_ubyte * 512)()
    base = (ctypes.addressof(blob) + 63) // 64 * 64
    u64 = ctypes.c_uint64 * 3
    u32 = ctypes.c_uint32 * 3

    def encode(at, address, dims, strides, box, dtype=6, swizzle=3):
        return enc.fn(at, dtype, len(dims), address, u64(*dims), u64(*strides), u32(*box), u32(1, 1, 1),
                      0, swizzle, 2, 0)

    # f16 [L=1, M=200, K=72] row-major: dims innermost first (K, M, L), byte strides of M and L
    assert encode(base + 64, 0x10000, (72, 200, 1), (144, 28800), (64, 128, 1)) == 0
    assert encode(base + 192, 0x20000, (136, 72, 1), (144, 19584), (64, 64, 1)) == 0
    assert [r.address for r in enc.records] == [0x10000, 0x20000]
    raw = ctypes.string_at(ctypes.addressof(blob), 512)
    offset = base - ctypes.addressof(blob)
    assert find_tensor_maps(raw) == {0: offset + 64, 1: offset + 192}
    # what cuTensorMapEncodeTiled documents as invalid is refused with CUDA_ERROR_INVALID_VALUE
    assert encode(base + 320, 0x30008, (72, 200, 1), (144, 28800), (64, 128, 1)) == 1       # misaligned address
    assert encode(base + 320, 0x30000, (72, 200, 1), (150, 28800), (64, 128, 1)) == 1       # stride % 16
    assert encode(base + 320, 0x30000, (72, 200, 1), (144, 28800), (128, 128, 1)) == 1      # 256 B > 128 B swizzle
    assert encode(base + 8, 0x30000, (72, 200, 1), (144, 28800), (64, 128, 1)) == 1         # map not 64-aligned
    assert len(enc.records) == 2 and len(enc.rejected) == 4
    assert any("swizzle span" in p for _, why in enc.rejected for p in why)
