"""Tests of the fused-attention lowering (backends/cutlass/fmha.py).

Fast tests check the emitted source and the capability queries; `nvcc` tests compile the
head_dim=128 f16 non-causal kernel for sm90a and sm100a (device cubin + host glue, once per arch)
and inspect SASS and the host library; `gpu` tests launch the kernel on a matching device and
compare against independent numpy attention.
"""
from __future__ import annotations

import ctypes
import math
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from kspec.backends.cutlass.fmha import (AttentionLoweringError, attention_support,
                                         choose_attention_tile, emit_attention)
from kspec.backends.desc import ARCHS, AttentionDesc, Const, Load, Operand
from kspec.core import ABI_VERSION
from kspec.spec_lang.errors import KspecError, KspecInternalError


def make_desc(arch: str = "sm90a", dtype: str = "f16", head_dim: int = 128, causal: bool = False,
              scale=None, name: str = "t0", tile=None, layout: str = "row") -> AttentionDesc:
    if scale is None:
        scale = Load("t5", "scalar", "f32")
    return AttentionDesc(name=name, arch=arch,
                         q=Operand("t1", dtype, layout), k=Operand("t2", dtype),
                         v=Operand("t3", dtype), o=Operand("t4", dtype),
                         head_dim=head_dim, scale=scale, causal=causal, tile=tile)


# ------------------------------------------------------------------------------------------
# emission
# ------------------------------------------------------------------------------------------

def test_hopper_source_instantiates_fmha_builder():
    em = emit_attention(make_desc("sm90a", "f16", 128))
    src = em.source
    assert '#include "kernel/fmha_kernel_builder.hpp"' in src
    assert "cutlass::fmha::kernel::FmhaBuilder<" in src
    assert "cutlass::gemm::KernelTmaWarpSpecializedCooperative" in src
    assert "using Element = cutlass::half_t;" in src
    assert "Shape<Int<128>, Int<128>, Int<128>>" in src
    assert "cutlass::fmha::collective::ResidualFusion, cutlass::gemm" in src
    assert em.include_dirs[1].endswith("88_hopper_fmha")
    assert dict(em.config)["lse"] == "workspace"
    assert dict(em.config)["tile"] == "128x128x128"


def test_blackwell_source_instantiates_sm100_kernel():
    em = emit_attention(make_desc("sm100a", "bf16", 64, causal=True))
    src = em.source
    assert "cutlass::fmha::kernel::Sm100FmhaFwdKernelTmaWarpspecialized<" in src
    assert "cutlass::fmha::collective::Sm100FmhaFwdMainloopTmaWarpspecialized<" in src
    assert "using Element = cutlass::bfloat16_t;" in src
    assert "Shape<Int<256>, Int<128>, Int<64>>" in src
    assert "cutlass::fmha::collective::CausalMask<true>>" in src
    assert em.include_dirs[1].endswith("77_blackwell_fmha")
    assert dict(em.config)["mask"] == "causal_top_left"
    assert dict(em.config)["lse"] == "none"


def test_hopper_causal_uses_residual_aware_fusion_and_bf16():
    src = emit_attention(make_desc("sm90a", "bf16", 64, causal=True)).source
    assert "struct KspecCausalResidualFusion : cutlass::fmha::collective::CausalFusion" in src
    assert "get<1>(pos) >= get<3>(problem_size)" in src
    assert "KspecCausalResidualFusion, cutlass::gemm::KernelTmaWarpSpecializedCooperative" in src
    assert "using Element = cutlass::bfloat16_t;" in src
    assert "Shape<Int<128>, Int<64>, Int<64>>" in src


@pytest.mark.parametrize("arch", ARCHS)
def test_abi_surface(arch):
    em = emit_attention(make_desc(arch))
    src = em.source
    assert em.dims == ("B", "H", "S", "T", "E")
    assert em.args == ("t1", "t2", "t3", "t4")
    assert em.scalars == ("t5",)
    assert em.alignment == (("t1", 16), ("t2", 16), ("t3", 16), ("t4", 16))
    assert em.init == ()
    assert src.count('extern "C" __global__') == 1
    assert ("__launch_bounds__(Kernel::MaxThreadsPerBlock, Kernel::MinBlocksPerMultiprocessor)\n"
            "kspec_kernel(CUTLASS_GRID_CONSTANT typename Kernel::Params const params)") in src
    dev = src.index("#if defined(KSPEC_DEVICE)")
    host = src.index("#if defined(KSPEC_HOST)\n#include <cuda_runtime.h>")
    assert dev < src.index("kspec_kernel(") < host
    assert host < src.index("int kspec_workspace_size(const int64_t* dims, int32_t device, int32_t sm_count,\n"
                            "                         uint64_t* bytes, char* err, uint64_t err_cap)")
    assert host < src.index("int kspec_abi_version(void) { return %d; }" % ABI_VERSION)
    assert host < src.index("int kspec_prepare(const int64_t* dims, void* const* ptrs, const double* scalars,")
    assert "-lcuda" not in " ".join(em.flags)
    assert "--use_fast_math" in em.flags and "-std=c++17" in em.flags


@pytest.mark.parametrize("arch", ARCHS)
def test_includes_resolve_in_the_wheel(arch):
    em = emit_attention(make_desc(arch))
    for inc in re.findall(r'#include "([^"]+)"', em.source):
        assert any(os.path.isfile(os.path.join(d, inc)) for d in em.include_dirs), inc
    # the example headers are used in place, never copied next to the project
    assert all("site-packages" in d or "dist-packages" in d for d in em.include_dirs)


@pytest.mark.parametrize("arch", ARCHS)
def test_emission_is_deterministic(arch):
    a = emit_attention(make_desc(arch, causal=True))
    b = emit_attention(make_desc(arch, causal=True))
    assert a == b


def test_constant_scale_is_folded():
    em = emit_attention(make_desc("sm90a", scale=Const(0.08838834764831845)))
    assert em.scalars == ()
    assert "const float scale = static_cast<float>(0.08838834764831845);" in em.source
    assert "constexpr bool kNeedsScalar = 0;" in em.source
    assert dict(em.config)["scale"] == "const:0.08838834764831845"


def test_runtime_scale_reads_first_scalar():
    em = emit_attention(make_desc("sm100a"))
    assert "constexpr bool kNeedsScalar = 1;" in em.source
    assert "const float scale = static_cast<float>(scale_d);" in em.source
    assert "mainloop.scale_softmax = scale;" in em.source


def test_hopper_overrides_default_softmax_scale():
    src = emit_attention(make_desc("sm90a")).source
    assert "params.mainloop.scale_softmax = scale;" in src
    assert "params.mainloop.scale_softmax_log2 = scale * 1.4426950408889634f;" in src


@pytest.mark.parametrize("bad", ["t0; system(\"x\")", "1abc", "a b", "", "x" * 300])
def test_unsanitized_names_are_rejected(bad):
    # names are mapped before codegen: an unmapped one reaching the generator is a kspec bug
    with pytest.raises(KspecInternalError):
        emit_attention(make_desc(name=bad))
    with pytest.raises(KspecInternalError):
        emit_attention(make_desc(scale=Load(bad, "scalar", "f32")))


def test_emit_rejects_what_the_kernel_cannot_do():
    with pytest.raises(KspecError, match="head dims 64, 128, not 96"):
        emit_attention(make_desc("sm100a", head_dim=96))
    with pytest.raises(KspecError, match="positive finite scale"):
        emit_attention(make_desc(scale=Const(-1.0)))
    with pytest.raises(KspecError, match="contiguous"):
        emit_attention(make_desc(layout="col"))
    with pytest.raises(KspecError, match="tile 128x64x128 is not available"):
        emit_attention(make_desc("sm90a", tile=(128, 64, 128)))
    assert emit_attention(make_desc("sm90a", tile=(128, 128, 128))).source


# ------------------------------------------------------------------------------------------
# capability queries
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head_dim", [80, 96, 512, 16])
def test_unsupported_head_dims_give_a_reason(arch, head_dim):
    reason = attention_support(arch, "f16", head_dim, causal=False)
    assert reason is not None and str(head_dim) in reason and arch in reason


@pytest.mark.parametrize("arch,head_dim", [("sm90a", 64), ("sm90a", 128), ("sm90a", 256), ("sm90a", 32),
                                          ("sm100a", 64), ("sm100a", 128)])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_supported_configurations(arch, head_dim, dtype, causal):
    assert attention_support(arch, dtype, head_dim, causal) is None


def test_other_unsupported_cases():
    assert "256" in attention_support("sm100a", "f16", 256, False)
    assert "transposed" in attention_support("sm90a", "f8e4m3", 128, False)
    assert "fp8" in attention_support("sm100a", "f8e4m3", 128, False)
    assert "f32" in attention_support("sm90a", "f32", 128, False)
    assert "sm80" in attention_support("sm80", "f16", 128, False)
    assert attention_support("sm90a", "f16", 128, False, out_dtype="f32") is not None
    assert attention_support("sm90a", "f16", 128, False, scale=0.0) is not None


def test_choose_tile():
    assert choose_attention_tile("sm90a", "f16", 128) == (128, 128, 128)
    assert choose_attention_tile("sm90a", "bf16", 64) == (128, 64, 64)
    assert choose_attention_tile("sm90a", "f16", 256) == (128, 64, 256)
    assert choose_attention_tile("sm100a", "f16", 128) == (256, 128, 128)
    assert choose_attention_tile("sm100a", "bf16", 64) == (256, 128, 64)
    with pytest.raises(KspecError):
        choose_attention_tile("sm100a", "f16", 96)


# ------------------------------------------------------------------------------------------
# nvcc: compile head_dim=128 f16 non-causal once per arch
# ------------------------------------------------------------------------------------------

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None)
_PIP_CUDA_BIN = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "bin"
NVCC_ARCH = {"sm90a": "sm_90a", "sm100a": "sm_100a"}


def _build(cache, desc: AttentionDesc) -> dict:
    """Device cubin + host glue through the build layer's cache (CI reuses earlier builds)."""
    from conftest import build_emitted
    em = emit_attention(desc)
    cubin, so, secs = build_emitted(em, cache)
    return {"emitted": em, "cubin": cubin, "so": so, "seconds": secs}


@pytest.fixture(scope="module", params=list(ARCHS))
def built(request, kernel_cache):
    if NVCC is None:
        pytest.skip("nvcc not found")
    return _build(kernel_cache, make_desc(request.param, "f16", 128, causal=False))


def _sass(cubin: Path) -> str:
    cuobjdump = _PIP_CUDA_BIN / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("pip nvidia-cuda-cuobjdump not installed")
    env = dict(os.environ, PATH=f"{_PIP_CUDA_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    res = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.mark.nvcc
@pytest.mark.heavy
def test_cubin_has_one_tensor_core_kernel(built):
    sass = _sass(built["cubin"])
    functions = re.findall(r"Function : (\S+)", sass)
    assert functions == ["kspec_kernel"]
    mma = "HGMMA" if built["emitted"].arch == "sm90a" else "UTCHMMA"
    assert mma in sass
    assert "MUFU.EX2" in sass          # the softmax exponentials
    assert "UTMALDG" in sass           # TMA loads of Q/K/V
    print(f"{built['emitted'].arch}: nvcc {built['seconds']:.0f} s (0 = cached)")


@pytest.mark.nvcc
@pytest.mark.heavy
def test_host_library_exports_abi_without_libcuda(built):
    so = str(built["so"])
    syms = subprocess.run(["nm", "-D", "--defined-only", so], capture_output=True, text=True).stdout
    assert re.search(r" T kspec_prepare$", syms, re.M)
    assert re.search(r" T kspec_workspace_size$", syms, re.M)
    assert re.search(r" T kspec_abi_version$", syms, re.M)
    needed = subprocess.run(["readelf", "-d", so], capture_output=True, text=True).stdout
    assert "NEEDED" in needed
    assert "libcuda.so" not in needed and "libcudart.so" not in needed


class _Glue:
    """ctypes view of a host-glue library (signatures from ABI.md)."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.err = ctypes.create_string_buffer(512)

    def workspace(self, dims, sm_count=132):
        b = ctypes.c_uint64(0)
        rc = self.lib.kspec_workspace_size((ctypes.c_int64 * 5)(*dims), 0, sm_count, ctypes.byref(b), self.err, 512)
        return rc, b.value, self.err.value.decode()

    def prepare(self, dims, ptrs, scale, workspace=None, sm_count=132):
        self.params = ctypes.create_string_buffer(8192)
        size = ctypes.c_uint64(0)
        self.grid, self.block, self.cluster = ((ctypes.c_uint32 * 3)() for _ in range(3))
        smem = ctypes.c_uint32(0)
        self.err.value = b""
        rc = self.lib.kspec_prepare(
            (ctypes.c_int64 * 5)(*dims), (ctypes.c_void_p * 4)(*ptrs), (ctypes.c_double * 1)(scale),
            ctypes.c_void_p(workspace), 0, sm_count, self.params, 8192, ctypes.byref(size),
            self.grid, self.block, self.cluster, ctypes.byref(smem), self.err, 512)
        self.size, self.smem = size.value, smem.value
        return rc, self.err.value.decode()


@pytest.mark.nvcc
@pytest.mark.heavy
def test_host_glue_validates_sizes_and_pointers(built):
    arch = built["emitted"].arch
    g = _Glue(built["so"])
    B, H, S, T, E = 2, 3, 136, 200, 128
    rc, ws, _ = g.workspace((B, H, S, T, E))
    assert rc == 0
    # sm90a: the always-written LSE (B*H*S floats, 256-byte rounded) lives in the workspace
    assert ws == (-(-(B * H * S * 4) // 256) * 256 if arch == "sm90a" else 0)
    rc, _, msg = g.workspace((B, H, S, T, 64))
    assert rc != 0 and "compiled for E = 128" in msg
    rc, _, msg = g.workspace((B, H, 0, T, E))
    assert rc != 0 and "S = 0" in msg
    if arch == "sm90a":
        rc, _, msg = g.workspace((B, H, 130, T, E))
        assert rc != 0 and "S % 8 == 0" in msg
    good = [0x100000, 0x200000, 0x300000, 0x400000]
    wsp = 0x800000 if ws else None
    rc, msg = g.prepare((B, H, S, T, E), [0x100008] + good[1:], 0.1, wsp)
    assert rc != 0 and "argument #0 (attention tensor q)" in msg
    rc, msg = g.prepare((B, H, S, T, E), good, -0.5, wsp)
    assert rc != 0 and "positive" in msg
    if arch == "sm90a":
        rc, msg = g.prepare((B, H, S, T, E), good, 0.1, None)
        assert rc != 0 and "workspace" in msg
    rc, msg = g.prepare((B, H, S, T, E), good, 0.1, wsp)
    if rc != 0:   # no CUDA driver on this machine: TMA descriptors cannot be encoded
        assert "driver" in msg
        return
    m = 128 if arch == "sm90a" else 256
    expect_grid = [math.ceil(S / m), B, H] if arch == "sm90a" else [math.ceil(S / m), H, B]
    assert list(g.grid) == expect_grid
    assert list(g.block) == ([384, 1, 1] if arch == "sm90a" else [512, 1, 1])
    assert list(g.cluster) == [1, 1, 1]
    assert 0 < g.size <= 8192 and g.smem > 48 * 1024


# ------------------------------------------------------------------------------------------
# gpu: launch and compare with numpy attention
# ------------------------------------------------------------------------------------------

def _device_arch() -> str | None:
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None
    try:
        if cu.cuInit(0)[0] != cu.CUresult.CUDA_SUCCESS:
            return None
        err, n = cu.cuDeviceGetCount()
        if err != cu.CUresult.CUDA_SUCCESS or n == 0:
            return None
        _, dev = cu.cuDeviceGet(0)
        A = cu.CUdevice_attribute
        _, major = cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        _, minor = cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    except Exception:
        return None
    return {(9, 0): "sm90a", (10, 0): "sm100a"}.get((major, minor), f"sm{major}{minor}")


def reference_attention(q, k, v, scale, causal):
    """Independent numpy attention, f64; causal = top-left: key j masked when j > i."""
    s = np.einsum("bhie,bhje->bhij", q.astype(np.float64), k.astype(np.float64)) * scale
    if causal:
        i = np.arange(q.shape[2])[:, None]
        j = np.arange(k.shape[2])[None, :]
        s = np.where(j > i, -np.inf, s)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bhje->bhie", p, v.astype(np.float64))


def _launch(art: dict, q, k, v, scale) -> np.ndarray:
    from cuda.bindings import driver as cu

    def ok(res):
        err, *rest = res if isinstance(res, tuple) else (res,)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        return rest[0] if len(rest) == 1 else rest

    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))
    sms = ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
    B, H, S, E = q.shape
    T = k.shape[2]
    o = np.zeros_like(q)
    bufs = []
    for a in (q, k, v, o):
        d = ok(cu.cuMemAlloc(a.nbytes))
        ok(cu.cuMemcpyHtoD(d, a.ctypes.data, a.nbytes))
        bufs.append(d)
    g = _Glue(art["so"])
    rc, ws, msg = g.workspace((B, H, S, T, E), sm_count=sms)
    assert rc == 0, msg
    wsp = ok(cu.cuMemAlloc(ws)) if ws else None
    rc, msg = g.prepare((B, H, S, T, E), [int(b) for b in bufs], scale,
                        int(wsp) if wsp is not None else None, sm_count=sms)
    assert rc == 0, msg
    mod = ok(cu.cuModuleLoadData(art["cubin"].read_bytes()))
    fn = ok(cu.cuModuleGetFunction(mod, b"kspec_kernel"))
    ok(cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, g.smem))
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(g.params))
    ok(cu.cuLaunchKernel(fn, *g.grid, *g.block, g.smem, 0, ctypes.addressof(argv), 0))
    ok(cu.cuCtxSynchronize())
    ok(cu.cuMemcpyDtoH(o.ctypes.data, bufs[3], o.nbytes))
    for d in bufs + ([wsp] if wsp is not None else []):
        ok(cu.cuMemFree(d))
    ok(cu.cuModuleUnload(mod))
    return o


def _build_for_device(cache, causal: bool) -> dict:
    """The kernel for the device's arch only: a Hopper machine never builds sm_100a (minutes of
    nvcc for a test that would skip), and the device check comes before any build."""
    arch = _device_arch()
    if arch not in ARCHS:
        pytest.skip(f"needs an sm_90 or sm_100 device (found {arch or 'none'})")
    if NVCC is None:
        pytest.skip("nvcc not found")
    return _build(cache, make_desc(arch, "f16", 128, causal=causal))


@pytest.fixture(scope="module")
def device_built(kernel_cache):
    return _build_for_device(kernel_cache, causal=False)


@pytest.fixture(scope="module")
def causal_built(kernel_cache):
    return _build_for_device(kernel_cache, causal=True)


def test_gpu_fixtures_build_only_the_device_arch(monkeypatch):
    import sys
    me = sys.modules[__name__]
    built_for = []
    monkeypatch.setattr(me, "_build", lambda cache, desc: built_for.append(desc.arch) or {"arch": desc.arch})
    monkeypatch.setattr(me, "NVCC", "/usr/bin/nvcc")
    monkeypatch.setattr(me, "_device_arch", lambda: "sm90a")
    _build_for_device(None, causal=False)
    _build_for_device(None, causal=True)
    assert built_for == ["sm90a", "sm90a"]
    monkeypatch.setattr(me, "_device_arch", lambda: None)
    with pytest.raises(pytest.skip.Exception):
        _build_for_device(None, causal=False)
    assert built_for == ["sm90a", "sm90a"]
    # the GPU tests take the device-arch fixtures, not the per-arch `built` one
    import inspect
    assert "built" not in inspect.signature(test_gpu_non_causal_matches_numpy).parameters
    assert "built" not in inspect.signature(test_gpu_causal_is_top_left).parameters


def _inputs(B, H, S, T, E, seed=0):
    rng = np.random.default_rng(seed)
    mk = lambda n: rng.standard_normal((B, H, n, E)).astype(np.float16)
    return mk(S), mk(T), mk(T)


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.heavy
@pytest.mark.parametrize("S,T", [(136, 200), (256, 256), (64, 384)])
def test_gpu_non_causal_matches_numpy(device_built, S, T):
    q, k, v = _inputs(2, 3, S, T, 128)
    out = _launch(device_built, q, k, v, 0.07)
    ref = reference_attention(q, k, v, 0.07, causal=False)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.heavy
@pytest.mark.parametrize("S,T", [(256, 256), (200, 136), (136, 400)])
def test_gpu_causal_is_top_left(causal_built, S, T):
    q, k, v = _inputs(1, 2, S, T, 128, seed=1)
    out = _launch(causal_built, q, k, v, 0.09)
    ref = reference_attention(q, k, v, 0.09, causal=True)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-2, rtol=2e-2)
