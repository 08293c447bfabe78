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
