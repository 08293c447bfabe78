"""Every workaround kspec needs to compile CuTe DSL kernels on a machine without a GPU, in one place.

The CuTe DSL (pip `nvidia-cutlass-dsl`) assumes a device in a few spots.  kspec compiles ahead of
time for an explicit arch, so:

- **target arch**: `cute.compile(..., options="--gpu-arch sm_90a")` picks the device code, but the
  DSL also latches a "runtime arch" (env `CUTE_DSL_ARCH`, else the detected GPU, else sm_100a).
  `export_to_c` only works when that runtime arch can run the target, so both are set per compile
  (`target_arch`).
- **SM count**: the persistent tile scheduler needs the number of clusters that fit on the device.
  kspec passes it as a runtime `Int32` argument (the host glue computes it from the SM count the
  runtime reports), so nothing device-specific is baked into a binary.  `OFFLINE_SM_COUNT` is only
  the value used when the DSL itself asks during tracing.
- **stream**: `export_to_c` needs the stream parameter annotated `cuda.CUstream`; `fake_stream()`
  gives the placeholder `cute.compile` traces with.
- **dump directory**: the DSL writes PTX/cubin only into an existing `--dump-dir`.
- **FlashAttention-4** (attention.py): `import quack` needs triton only for one subclass, stubbed
  while it is imported (`_preload_quack_autotuner`); FA4 reads its arch and SM count from
  `FLASH_ATTENTION_ARCH` / `FLASH_ATTENTION_NUM_SMS` and its persistent schedulers ask
  `cutlass.utils.HardwareInfo` while tracing, answered from the SKU kspec builds for (`fa4_target`,
  which also clears FA4's lru_cache of it).  FA4 turns 2-CTA forward kernels off only when
  `torch.version.cuda` starts with "12"; with a CPU torch it is None, which matches kspec's cu13 DSL.

Nothing here imports the DSL at module import time: `import kspec.backends.cute` stays cheap and
works where the DSL is not installed (`available()` says why not).
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from pathlib import Path
from typing import Iterator

from kspec.core import KspecInternalError

# Versions this backend is written and tested against (pyproject pins the same).  kspec depends on
# `nvidia-cutlass-dsl-libs-cu13` (which brings -libs-base and -libs-core, the Python package and its
# .pth) and not on the `nvidia-cutlass-dsl` meta package, whose default also installs the cu12
# libraries: with both present the DSL picks a flavour by the driver it finds, so a GPU-less build
# box and a GPU box could disagree.  cu13 matches the nvcc 13 toolchain kspec uses.
DSL_VERSION = "4.8.1"
DSL_ARCH = {"sm90a": "sm_90a", "sm100a": "sm_100a"}
# Used only if the DSL queries the device while tracing; kernels take the real count at run time.
OFFLINE_SM_COUNT = {"sm90a": 132, "sm100a": 148}
# Opt-in shared memory per block (bytes): a property of the arch (H100/H200 and B200 alike), which the
# DSL's launcher asks the device for; the capture shim answers with this value.
SMEM_OPTIN = {"sm90a": 232448, "sm100a": 232448}

_LOCK = threading.RLock()


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None when the pinned CuTe DSL is installed, else why not (for `can_implement`).  Checks the
    installed distribution only: importing the DSL costs a second, and a warm build needs none."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        v = version("nvidia-cutlass-dsl-libs-base")
    except PackageNotFoundError:
        return f"the CuTe DSL is not installed (pip install nvidia-cutlass-dsl-libs-cu13=={DSL_VERSION})"
    if v != DSL_VERSION:
        return f"CuTe DSL {v} is installed; kspec's CuTe DSL backend needs {DSL_VERSION}"
    if cuda_flavour() == "unknown":
        return "no CuTe DSL library flavour (nvidia-cutlass-dsl-libs-cu13) is installed"
    return None


def dsl_version() -> str:
    return DSL_VERSION


def cuda_flavour() -> str:
    """The CUDA flavour of the DSL's libraries (kspec installs exactly one: cu13)."""
    from importlib.metadata import PackageNotFoundError, version
    for fl in ("cu13", "cu12"):
        try:
            version(f"nvidia-cutlass-dsl-libs-{fl}")
            return fl
        except PackageNotFoundError:
            continue
    return "unknown"


def dsl_arch(arch: str) -> str:
    try:
        return DSL_ARCH[arch]
    except KeyError:
        raise KspecInternalError(f"CuTe DSL backend asked for unknown arch {arch!r}") from None


@contextlib.contextmanager
def target_arch(arch: str) -> Iterator[str]:
    """Trace and export for `arch` with no device present.  Serialised: the runtime arch is
    process-global DSL state.  Yields the DSL's arch string ("sm_90a")."""
    sm = dsl_arch(arch)
    with _LOCK:
        old_env = os.environ.get("CUTE_DSL_ARCH")
        os.environ["CUTE_DSL_ARCH"] = sm
        from cutlass.cutlass_dsl import CuTeDSL
        envar = CuTeDSL._get_dsl().envar
        old = envar.arch
        envar.arch = sm
        try:
            yield sm
        finally:
            envar.arch = old
            if old_env is None:
                os.environ.pop("CUTE_DSL_ARCH", None)
            else:
                os.environ["CUTE_DSL_ARCH"] = old_env


def compile_options(arch: str, dump_dir: Path) -> str:
    dump_dir.mkdir(parents=True, exist_ok=True)      # the DSL silently dumps nothing otherwise
    return f"--gpu-arch {dsl_arch(arch)} --keep-cubin --keep-ptx --dump-dir {dump_dir}"


def fake_stream():
    from cutlass.cute.runtime import make_fake_stream
    return make_fake_stream()


def stream_annotation():
    """The annotation `export_to_c` requires on a kernel's stream parameter."""
    import cuda.bindings.driver as cuda
    return cuda.CUstream


# ---------------------------------------------------------------------------------------------
# FlashAttention-4 (pip flash-attn-4) and QuACK (pip quack-kernels), which it imports
# ---------------------------------------------------------------------------------------------
# Exact pins: FA4's kernel classes and its `_flash_attn_fwd` heuristics are internal surfaces that
# change between betas (see backends/cute/attention.py).  pyproject's `attention` extra pins the same.
FA4_VERSION = "4.0.0b36"
QUACK_VERSION = "0.6.5"
# what FA4 and QuACK import besides torch (pyproject's `attention` extra installs them), and how to
# get the whole set from a checkout
ATTENTION_IMPORTS = ("apache-tvm-ffi", "torch-c-dlpack-ext", "einops")
ATTENTION_INSTALL = 'pip install -e ".[attention]" in a kspec checkout'

_FA4_CC = {"sm90a": 90, "sm100a": 100}


@functools.lru_cache(maxsize=1)
def fa4_available() -> str | None:
    """None when the pinned FlashAttention-4 and QuACK (and torch, which both import) are installed,
    else why not.  Reads distribution metadata only."""
    from importlib.metadata import PackageNotFoundError, version
    for dist, want in (("flash-attn-4", FA4_VERSION), ("quack-kernels", QUACK_VERSION)):
        try:
            v = version(dist)
        except PackageNotFoundError:
            return f"{dist} is not installed ({ATTENTION_INSTALL})"
        if v != want:
            return f"{dist} {v} is installed; kspec's FlashAttention-4 path needs {want} ({ATTENTION_INSTALL})"
    for dist in ATTENTION_IMPORTS:
        try:
            version(dist)
        except PackageNotFoundError:
            return f"{dist} is not installed (FlashAttention-4 imports it; {ATTENTION_INSTALL})"
    try:
        version("torch")
    except PackageNotFoundError:
        return "torch is not installed (FlashAttention-4 imports it; a CPU wheel is enough to build)"
    return available()


def _preload_quack_autotuner() -> None:
    """`import quack` (which FA4 imports) does `import triton` in quack/autotuner.py only to subclass
    triton.runtime.cache.FileCacheManager; nothing kspec compiles uses triton.  Without triton
    installed, a four-module stub is visible in sys.modules *only* while quack.autotuner is imported:
    torch's own `has_triton_package()` probes (run first, by importing torch._dynamo and
    torch._inductor.utils) keep seeing no triton."""
    import sys
    import types
    if "quack.autotuner" in sys.modules:
        return
    try:
        import triton  # noqa: F401  (a real triton: nothing to do)
        return
    except ImportError:
        pass
    import torch._dynamo  # noqa: F401
    import torch._inductor.utils  # noqa: F401
    t, rt = types.ModuleType("triton"), types.ModuleType("triton.runtime")
    cache, testing = types.ModuleType("triton.runtime.cache"), types.ModuleType("triton.testing")

    class FileCacheManager:
        def __init__(self, key, *args, **kwargs):
            self.key = key

    def do_bench(*args, **kwargs):
        raise KspecInternalError("triton stub: benchmarking needs a GPU and the real triton")

    cache.FileCacheManager, rt.cache, t.runtime, testing.do_bench, t.testing = FileCacheManager, cache, rt, do_bench, testing
    names = {"triton": t, "triton.runtime": rt, "triton.runtime.cache": cache, "triton.testing": testing}
    sys.modules.update(names)
    try:
        import quack.autotuner  # noqa: F401  (binds the stub as its module-global `triton`)
    finally:
        for n in names:
            sys.modules.pop(n, None)


def fa4_interface():
    """flash_attn.cute.interface, imported the way kspec needs it (no triton, no GPU)."""
    with _LOCK:
        _preload_quack_autotuner()
        from flash_attn.cute import interface
        return interface


class _OfflineHardwareInfo:
    """cutlass.utils.HardwareInfo without a driver: the SM count of the SKU kspec builds for."""
    sm_count = 0

    def __init__(self, device_id: int = 0):
        self.device_id = device_id

    def get_device_multiprocessor_count(self) -> int:
        return self.sm_count

    def get_max_active_clusters(self, cluster_size: int = 1) -> int:
        return max(self.sm_count // max(int(cluster_size), 1), 1)

    def get_l2_cache_size_in_bytes(self) -> int:
        return 50 * 1024 * 1024


@contextlib.contextmanager
def fa4_target(arch: str, sm_count: int) -> Iterator[int]:
    """Trace FA4 for `arch` on a SKU with `sm_count` SMs, with no device: the DSL's target arch
    (target_arch), FA4's arch and SM-count overrides (FLASH_ATTENTION_ARCH, FLASH_ATTENTION_NUM_SMS),
    and cutlass.utils.HardwareInfo answered from `sm_count` (FA4's persistent schedulers ask it while
    tracing and bake the answer into the host launcher; FA4's own lru_cache of it is cleared, so one
    process can build for several SKUs).  Yields FA4's integer arch (90, 100)."""
    import sys
    interface = fa4_interface()
    with target_arch(arch):
        import cutlass.utils
        import cutlass.utils.hardware_info as hw
        from flash_attn.cute import cute_dsl_utils
        original = hw.HardwareInfo
        hwinfo = type("KspecHardwareInfo", (_OfflineHardwareInfo,), {"sm_count": int(sm_count)})
        patched = [(m, "HardwareInfo") for m in (cutlass.utils, hw, *[
            mod for name, mod in list(sys.modules.items())
            if name.startswith(("flash_attn.", "quack.")) and getattr(mod, "HardwareInfo", None) is original])]
        env = {"FLASH_ATTENTION_ARCH": dsl_arch(arch), "FLASH_ATTENTION_NUM_SMS": str(int(sm_count))}
        old_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        for m, a in patched:
            setattr(m, a, hwinfo)
        cute_dsl_utils.get_max_active_clusters.cache_clear()
        interface._get_device_arch.cache_clear()
        try:
            yield _FA4_CC[arch]
        finally:
            for m, a in patched:
                setattr(m, a, original)
            cute_dsl_utils.get_max_active_clusters.cache_clear()
            interface._get_device_arch.cache_clear()
            for k, v in old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
