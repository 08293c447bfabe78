"""Host-glue statuses reach the caller (issue 13, items 2 and 4): the GEMM glue checks the TMA
driver entry point, can_implement, initialize_workspace and every descriptor encode; errors name
the kernel, the argument and the cause; the workspace is sized with the launch device's SM count;
the runtime refuses glue of another ABI and keys loaded functions by cubin content."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kspec
from kspec.artifact import KernelEntry, Manifest, Plan, SpecRef, TensorSpec, make_binary, write_manifest
from kspec.core import ABI_VERSION, abi_header
from kspec.runtime import DeviceBuffer, KspecRuntimeError
from kspec.runtime.glue import HostGlue
from kspec.runtime.selftest import find_cxx

needs_cxx = pytest.mark.skipif(find_cxx() is None, reason="no C++ compiler")


# ---------------------------------------------------------------------------------- emitted GEMM glue

@pytest.fixture(scope="module")
def gemm_source():
    pytest.importorskip("cutlass_library")
    sys.path.insert(0, str(Path(__file__).parent))
    from test_cutlass_gemm import relu_bias
    from kspec.backends.cutlass.gemm import emit_gemm
    return emit_gemm(relu_bias("sm90a"))


def _host_part(src: str) -> str:
    return src[src.rindex("#if defined(KSPEC_HOST)\n\n"):]


def test_gemm_glue_checks_every_status(gemm_source):
    src = gemm_source.source
    host = _host_part(src)
    # the TMA hook replaces CUTLASS's driver wrapper after it is defined and before any TMA header
    hook = src.index("#define CUTLASS_CUDA_DRIVER_WRAPPER_CALL(func) kspec_tma::encode_##func")
    assert src.index('#include "cutlass/cuda_host_adapter.hpp"') < hook < src.index('#include "cute/tensor.hpp"')
    assert "cutlass::call_cuTensorMapEncodeTiled(map, type, rank, address, rest...)" in src
    # kspec_prepare: alignment, sizes and can_implement (user mistakes first), then the driver entry
    # point, initialize_workspace and the encode record
    order = [host.index(s) for s in (
        'extern "C" int kspec_abi_version(void) { return %d; }' % ABI_VERSION,
        "a % kArgAlignment[i] != 0",
        "if (!Kernel::can_implement(args))",
        "if (kspec_tensor_map_encoder() == nullptr)",
        "Kernel::initialize_workspace(args, nullptr, nullptr, nullptr)",
        "kspec_tma::reset();",
        "Params p = Kernel::to_underlying_arguments(args, workspace);",
        "if (tma.failures != 0)",
        "std::memcpy(params, &p, sizeof(Params));")]
    assert order == sorted(order)
    assert "constexpr unsigned kArgAlignment[4] = {16, 16, 16, 16};" in host
    assert "catch (std::exception const& e)" in host
    # errors name arguments by ABI position, which the runtime turns into names
    assert "argument #%d: its TMA descriptor failed to encode" in host
    # the workspace is sized with the device's SM count, not a placeholder
    start = host.index('extern "C" int kspec_workspace_size(')
    ws = host[start:host.index("namespace {", start)]
    assert "kspec_make_arguments(dims, null_ptrs, zero_scalars, device, sm_count, &args" in ws
    assert "0, 1, &args" not in ws
    # and the prototypes are the ABI's
    for proto in re.findall(r"int kspec_\w+\([^)]*\)", abi_header()):
        name = proto.split("(")[0].split()[-1]
        assert name in host


@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
def test_fmha_glue_checks_initialize_and_every_encode(arch):
    pytest.importorskip("cutlass_library")
    from kspec.backends.cutlass.fmha import emit_attention
    sys.path.insert(0, str(Path(__file__).parent))
    from test_cutlass_fmha import make_desc
    src = emit_attention(make_desc(arch)).source
    hook = src.index("#define CUTLASS_CUDA_DRIVER_WRAPPER_CALL(func) kspec_tma::encode_##func")
    assert hook < src.index('#include "cutlass/cutlass.h"')
    host = src[src.index("int kspec_prepare("):]
    order = [host.index(s) for s in (
        "if (kspec_tensor_map_encoder() == nullptr)",
        "if (!Kernel::can_implement(args))",
        "Kernel::initialize_workspace(args, kernel_ws, nullptr)",
        "kspec_tma::reset();",
        "Kernel::to_underlying_arguments(args, kernel_ws)",
        "if (tma.failures != 0)",
        "std::memcpy(params, &kp, sizeof(kp));")]
    assert order == sorted(order)
    assert "argument #%d: its TMA descriptor failed to encode" in host


def test_abi_doc_names_what_the_runtime_calls():
    doc = (Path(__file__).resolve().parents[1] / "backends" / "ABI.md").read_text()
    assert "cuLibraryLoadData" not in doc and "cuModuleLoadData" in doc
    assert "int kspec_workspace_size(const int64_t* dims, int32_t device, int32_t sm_count," in doc
    assert "kspec_abi_version" in doc
    driver = (Path(__file__).resolve().parents[1] / "kspec" / "runtime" / "driver.py").read_text()
    assert '"cuModuleLoadData"' in driver and "cuLibraryLoadData" not in driver


# ---------------------------------------------------------------------------------- runtime side

GLUE = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>
%(version)s
extern "C" int kspec_workspace_size(const int64_t* dims, int32_t device, int32_t sm_count,
                                    uint64_t* bytes, char* err, uint64_t err_cap) {
  (void)dims; (void)device; (void)err; (void)err_cap;
  *bytes = 100 * (uint64_t)sm_count;      /* per-SM state, like a persistent scheduler */
  return 0;
}
extern "C" int kspec_prepare(const int64_t* dims, void* const* ptrs, const double* scalars,
                             void* workspace, int32_t device, int32_t sm_count,
                             void* params, uint64_t params_cap, uint64_t* params_size,
                             uint32_t grid[3], uint32_t block[3], uint32_t cluster[3],
                             uint32_t* smem_bytes, char* err, uint64_t err_cap) {
  (void)scalars; (void)device;
  if (((uintptr_t)ptrs[1]) %% 4096 != 0) {
    snprintf(err, err_cap, "argument #1: its TMA descriptor failed to encode (cuTensorMapEncodeTiled returned CUresult 1)");
    return 7;
  }
  uint64_t p[3] = {(uint64_t)ptrs[0], (uint64_t)workspace, (uint64_t)sm_count};
  memcpy(params, p, sizeof p); *params_size = sizeof p;
  grid[0] = (uint32_t)dims[0]; grid[1] = grid[2] = 1; block[0] = 32; block[1] = block[2] = 1;
  cluster[0] = cluster[1] = cluster[2] = 1; *smem_bytes = 0;
  return 0;
}
"""


def _glue(tmp_path: Path, name: str, version: str | None = f"{ABI_VERSION}") -> Path:
    src = tmp_path / f"{name}.cc"
    ver = "" if version is None else f'extern "C" int kspec_abi_version(void) {{ return {version}; }}'
    src.write_text(GLUE % {"version": ver})
    so = tmp_path / f"{name}.so"
    subprocess.run([find_cxx(), "-x", "c++", "-O1", "-fPIC", "-shared", "-o", str(so), str(src)], check=True)
    return so


def _artifact(tmp_path: Path, cubin: bytes = b"cubin one") -> Path:
    d = tmp_path / "art"
    d.mkdir(parents=True)
    shutil.copyfile(_glue(tmp_path, "g"), d / "g.so")
    (d / "g.cubin").write_bytes(cubin)
    b = {"sm90a": make_binary(d, "g.cubin", "g.so")}
    k = KernelEntry("copy", inputs=(TensorSpec("src", "f32", ("N",)),), outputs=(TensorSpec("dst", "f32", ("N",)),),
                    plans=(Plan("copy_0", "elementwise", (("d0", "N"),), ("src", "dst"), binaries=b),))
    write_manifest(d, Manifest(SpecRef("c.kspec", "0" * 64), ("sm90a",), (k,)))
    return d


@needs_cxx
def test_glue_of_another_abi_is_refused(tmp_path):
    with pytest.raises(KspecRuntimeError, match=r"built for an older kspec \(no kspec_abi_version\); this "
                                                r"runtime speaks ABI version %d" % ABI_VERSION):
        HostGlue(_glue(tmp_path, "old", None), "plan 'p' (sm90a)")
    with pytest.raises(KspecRuntimeError, match="built for ABI version 2"):
        HostGlue(_glue(tmp_path, "v2", "2"), "plan 'p' (sm90a)")


@needs_cxx
def test_glue_errors_name_kernel_argument_and_cause(tmp_path):
    mod = kspec.load(_artifact(tmp_path))
    plan = mod.manifest.kernels[0].plans[0]
    glue = mod.glue(plan, "sm90a")
    with pytest.raises(KspecRuntimeError) as e:
        glue.prepare([8], [0x10000, 0x20010], [], 0, 0, 132)
    assert str(e.value).endswith(
        "kernel 'copy', plan 'copy_0' (sm90a): kspec_prepare failed: argument 'dst': its TMA descriptor "
        "failed to encode (cuTensorMapEncodeTiled returned CUresult 1)")
    assert glue.name_arguments("argument #7 is odd") == "argument #7 is odd"     # out of range: kept


class _Driver:
    """A stand-in driver that records allocations and loaded functions (no GPU)."""

    def __init__(self, sms: int):
        self.sms, self.log, self.loaded = sms, [], {}
        from contextlib import contextmanager

        @contextmanager
        def current(ctx):
            yield
        self.current = current

    def require_device(self): pass
    def facts(self, ordinal): return (9, 0, self.sms, "Fake H100")
    def primary_context(self, ordinal): return ("ctx", ordinal)
    def stream_context(self, stream): return None
    def context_device(self, ctx): return 0
    def current_device(self): return None
    def pointer_device(self, ptr, what): return 0
    def is_capturing(self, stream): return False
    def order_after(self, a, b): pass
    def free_async(self, ptr, stream): pass
    def fill(self, *a): self.log.append(("fill", *a[:5]))
    def param_size(self, func): return None
    def param_layout(self, func): return None
    def set_dynamic_smem(self, func, n, what): pass

    def alloc_async(self, nbytes, stream, what):
        self.log.append(("alloc", nbytes))
        return 0x7E0000000000

    def function(self, ctx, key, image, symbol, what):
        # the real Driver caches by (context, *key): a reused key means a reused function
        k = (ctx, *key)
        if k not in self.loaded:
            self.loaded[k] = (len(self.loaded) + 1, image)
        return self.loaded[k][0]

    def launch(self, func, grid, block, cluster, smem, stream, params_ptr, what):
        import ctypes
        self.log.append(("launch", func, ctypes.string_at(params_ptr, 24)))


@needs_cxx
def test_workspace_is_sized_for_the_launch_device(tmp_path, monkeypatch):
    import struct
    from kspec.runtime import driver
    for sms in (132, 148):
        fake = _Driver(sms)
        monkeypatch.setattr(driver, "_driver", fake)
        mod = kspec.load(_artifact(tmp_path / str(sms)))    # a fresh .so: a loaded one is never rewritten
        x = DeviceBuffer(0x10000, (64,), "f32")
        y = DeviceBuffer(0x20000, (64,), "f32")
        mod.copy(x, dst=y)
        assert ("alloc", 100 * sms) in fake.log                   # sized with the device's SM count
        launch = next(e for e in fake.log if e[0] == "launch")
        _, ws, sm_count = struct.unpack("<3Q", launch[2])
        assert sm_count == sms and ws == 0x7E0000000000


@needs_cxx
def test_function_cache_is_keyed_by_cubin_content(tmp_path, monkeypatch):
    from kspec.runtime import driver
    fake = _Driver(132)
    monkeypatch.setattr(driver, "_driver", fake)
    x = DeviceBuffer(0x10000, (64,), "f32")
    y = DeviceBuffer(0x20000, (64,), "f32")
    funcs = []
    for i, cubin in enumerate((b"cubin one", b"cubin two", b"cubin one")):
        mod = kspec.load(_artifact(tmp_path / str(i), cubin))
        mod.copy(x, dst=y)
        funcs.append(next(e for e in reversed(fake.log) if e[0] == "launch")[1])
        del mod                                  # ids of collected modules are reused by new ones
    # a different cubin never gets an earlier module's function; the same cubin shares it
    assert funcs[0] != funcs[1] and funcs[2] == funcs[0]
    assert {img for _, img in fake.loaded.values()} == {b"cubin one", b"cubin two"}


# ---------------------------------------------------------------------------------- one real nvcc build

@pytest.mark.nvcc
@pytest.mark.heavy
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_compiled_gemm_glue_reports_causes(gemm_source, kernel_cache):
    from kspec.backends.build import BuildJob, build_all
    from kspec.backends.cutlass.compat import cutlass_version
    from kspec.backends.toolchain import find_toolchain
    em = gemm_source
    (host,) = build_all([BuildJob("gemm glue", em.source, em.arch, "host", em.include_dirs, em.flags,
                                  f"nvidia-cutlass {cutlass_version()}")], find_toolchain(), kernel_cache)
    glue = HostGlue(host.path, "kernel 'k0', plan 'k0_0' (sm90a)", ("A", "B", "bias", "D"))
    dims = [256, 384, 192, 1]
    assert glue.workspace_size(dims, 0, 132) >= 0
    with pytest.raises(KspecRuntimeError, match="sm_count must be positive"):
        glue.workspace_size(dims, 0, 0)
    with pytest.raises(KspecRuntimeError, match=r"kernel 'k0', plan 'k0_0' \(sm90a\): kspec_prepare failed: "
                                                r"argument 'B' must be a non-NULL device pointer aligned to 16 bytes"):
        glue.prepare(dims, [0x100000, 0x200008, 0x300000, 0x400000], [], 0, 0, 132)
    with pytest.raises(KspecRuntimeError, match="GEMM sizes M, N, K, L must be positive"):
        glue.prepare([0, 384, 192, 1], [0x100000, 0x200000, 0x300000, 0x400000], [], 0, 0, 132)
    from kspec.runtime import cuda_available
    good = [0x100000, 0x200000, 0x300000, 0x400000]
    if not cuda_available()[0]:
        # no driver here: the entry point check fails cleanly instead of launching unset descriptors
        with pytest.raises(KspecRuntimeError, match="cuTensorMapEncodeTiled is unavailable"):
            glue.prepare(dims, good, [], 0, 0, 132)

    # every encode goes through the recorded path: an encoder that refuses B's descriptor (as the
    # driver does for a bad address or stride) is an error naming B, never a launchable blob
    import ctypes
    from kspec.runtime.fakedriver import RecordingEncoder

    class RefusesB(RecordingEncoder):
        def _encode(self, tmap, data_type, rank, address, *rest):
            if address == good[1]:
                return 1                                        # CUDA_ERROR_INVALID_VALUE
            return super()._encode(tmap, data_type, rank, address, *rest)

    hook = glue._lib.kspec_set_tensor_map_encoder
    hook.argtypes, hook.restype = [ctypes.c_void_p], ctypes.c_int
    for encoder, refused in ((RecordingEncoder(), False), (RefusesB(), True)):
        hook(ctypes.cast(encoder.fn, ctypes.c_void_p))
        try:
            if refused:
                with pytest.raises(KspecRuntimeError, match=r"kernel 'k0', plan 'k0_0' \(sm90a\): kspec_prepare "
                                                            r"failed: argument 'B': its TMA descriptor failed to "
                                                            r"encode \(cuTensorMapEncodeTiled returned CUresult 1; "
                                                            r"1 of \d+ descriptors failed\)"):
                    glue.prepare(dims, good, [], 0, 0, 132)
            else:
                p = glue.prepare(dims, good, [], 0, 0, 132)
                assert p.params_size > 0 and p.grid[0] >= 1
                assert {r.address for r in encoder.records} >= {good[0], good[1]}
        finally:
            hook(None)
