"""Driving the CUTLASS Python interface (`cutlass_cppgen`, pip `nvidia-cutlass` 4.2) offline.

This module is the only place that knows which `cutlass_cppgen` internals misbehave on a machine
without a GPU, without libcuda, and with cuda-python 13 (no `cuda.__version__`, `cuda.cuda`,
`cuda.cudart`).  Everything else in kspec enters `offline(cc)` and then uses the interface's planning
objects (`op.Gemm`, tile descriptions) and EVT frontend/IR/emitters as if a device of that compute
capability were present.

Workarounds, each scoped to the `offline()` block and undone on exit:
- `device_cc()` is called by `op.Gemm`, `epilogue.trace`, `backend.operation` and
  `backend.compiler`: inside the block those module globals return the *target* cc.
- `get_option_registry()` would build `OptionRegistry(device_cc())` for all eight generator ccs
  (~15 s); the block installs a registry holding only the target cc's GEMM options (built once per
  process and kept in an explicit cache object).
- The nvcc-version cache (`cutlass_cppgen._nvcc_version`, `_NVCC_VERSION`) decides which kernels the
  generator lists; the block sets it from the local nvcc (or a pinned default) instead of letting the
  interface run `nvcc --version` via a global side effect.
- `cutlass_library/__init__.py` skips `import cutlass_library.generator` whenever '-m' is anywhere in
  sys.argv (meant for `python -m cutlass_library.generator`, but also true under `pytest -m nvcc`
  or any tool with a -m flag); `offline()` imports the submodule explicitly, as the package would.
- Importing `cutlass_cppgen` creates `compiled_cache.db` (sqlite) in the current directory; kspec
  does the first import from a private temporary directory so the user's tree is not littered.
- `device_id()` / `initialize_cuda_context()` / `check_cuda_versions()` would import `cuda.cuda` and
  query a device; inside the block they raise `KspecInternalError`, so any stray device query is a
  loud bug instead of a crash deep in cuda-python.
Nothing in site-packages is modified.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from kspec.core import ARCH_TABLE, KspecError, KspecInternalError

# The nvidia-cutlass releases whose internals this module was written and tested against.
TESTED_CUTLASS = ((4, 2),)
SUPPORTED_CC = (90, 100)
# Used when no nvcc is on PATH (emit-only use): the toolkit kspec's CUDA 13 toolchain ships.
DEFAULT_NVCC_VERSION = "13.0"
# Kernels of sm_100a need CUDA >= 12.8; sm_90a WGMMA kernels need >= 12.0.
_MIN_NVCC = {a.cc: a.min_nvcc for a in ARCH_TABLE.values()}


class CutlassCompatError(KspecError):
    """The installed CUTLASS Python interface cannot be driven the way kspec needs."""


# --------------------------------------------------------------------------------------------
# versions and paths
# --------------------------------------------------------------------------------------------

def _parse_version(text: str) -> tuple[int, ...]:
    parts = re.findall(r"\d+", text)
    return tuple(int(p) for p in parts)


def cutlass_version() -> str:
    """The installed nvidia-cutlass distribution version, e.g. '4.2.0.0'."""
    try:
        return importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError as e:
        raise CutlassCompatError(
            "the CUTLASS Python interface (pip package nvidia-cutlass) is not installed",
            hint='pip install "nvidia-cutlass>=4.2,<4.3"') from e


def check_cutlass_version(version: str | None = None) -> str:
    """Raise `CutlassCompatError` unless `version` (default: the installed one) is a tested release."""
    version = cutlass_version() if version is None else version
    major_minor = _parse_version(version)[:2]
    if major_minor not in TESTED_CUTLASS:
        tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_CUTLASS)
        raise CutlassCompatError(
            f"nvidia-cutlass {version} is not a version kspec was tested with (tested: {tested}); "
            "kspec drives internals of its Python interface that change between releases",
            hint='pip install "nvidia-cutlass>=4.2,<4.3"')
    return version


def _cutlass_library() -> Any:
    check_cutlass_version()
    return importlib.import_module("cutlass_library")


def cutlass_source_dir() -> str:
    """The CUTLASS source tree shipped inside the wheel (`cutlass_library/source`)."""
    lib = _cutlass_library()
    path = getattr(lib, "source_path", None) or os.path.join(os.path.dirname(lib.__file__), "source")
    return os.path.abspath(path)


def cutlass_include_dirs() -> tuple[str, ...]:
    """Include directories for CUTLASS/CuTe headers: `include` and `tools/util/include` of the wheel."""
    root = cutlass_source_dir()
    dirs = (os.path.join(root, "include"), os.path.join(root, "tools", "util", "include"))
    for d in dirs:
        if not os.path.isdir(d):
            raise CutlassCompatError(f"CUTLASS headers not found at {d}",
                                     hint="reinstall nvidia-cutlass; its wheel ships the headers")
    return dirs


@functools.lru_cache(maxsize=None)
def _detect_nvcc_version(nvcc: str | None) -> str | None:
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def nvcc_version() -> str:
    """Version 'major.minor' of the nvcc on PATH, or DEFAULT_NVCC_VERSION when there is none."""
    return _detect_nvcc_version(shutil.which("nvcc")) or DEFAULT_NVCC_VERSION


def check_cc(cc: int, toolkit: str) -> None:
    if cc not in SUPPORTED_CC:
        raise KspecError(f"compute capability {cc} is not supported by kspec's CUTLASS backend "
                         f"(supported: {', '.join(map(str, SUPPORTED_CC))})")
    if _parse_version(toolkit)[:2] < _MIN_NVCC[cc]:
        need = ".".join(map(str, _MIN_NVCC[cc]))
        raise KspecError(f"CUDA toolkit {toolkit} is too old for sm_{cc}a kernels (need >= {need})")


# --------------------------------------------------------------------------------------------
# the scoped shim
# --------------------------------------------------------------------------------------------

@dataclass
class _Patch:
    """One attribute replaced inside `offline()`: where, what, and the value to restore."""
    module: Any
    name: str
    value: Any
    saved: Any = None
    existed: bool = False

    def apply(self) -> None:
        self.existed = hasattr(self.module, self.name)
        self.saved = getattr(self.module, self.name, None)
        setattr(self.module, self.name, self.value)

    def restore(self) -> None:
        if self.existed:
            setattr(self.module, self.name, self.saved)
        else:
            delattr(self.module, self.name)


# Modules that call `device_cc()` through a module global (grep of cutlass_cppgen 4.2).
_DEVICE_CC_CALLERS = (
    "cutlass_cppgen.op.op",
    "cutlass_cppgen.epilogue.epilogue",
    "cutlass_cppgen.backend.operation",
    "cutlass_cppgen.backend.compiler",
)


def _no_device(what: str) -> Callable[..., Any]:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise KspecInternalError(
            f"cutlass_cppgen tried to {what} while kspec drives it offline; this is a kspec bug")
    return refuse


@dataclass
class _RegistryCache:
    """GEMM option registries per target cc, built once per process (the generator is slow:
    ~3 s for sm90, ~14 s for sm100)."""
    registries: dict[tuple[int, str], Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, cc: int, toolkit: str) -> Any:
        key = (cc, toolkit)
        with self.lock:
            if key not in self.registries:
                self.registries[key] = _build_registry(cc)
            return self.registries[key]


_REGISTRY_CACHE = _RegistryCache()
# Patching module globals is process-wide; one offline block at a time (re-entrant per thread).
_OFFLINE_LOCK = threading.RLock()


def _build_registry(cc: int) -> Any:
    """A `library_defaults.OptionRegistry` holding the GEMM options of `cc` only.  Must run inside
    `offline()` (the generator reads the nvcc-version cache)."""
    import cutlass_library
    from cutlass_cppgen.library_defaults import ArchOptions, OptionRegistry

    class SingleArchOptionRegistry(OptionRegistry):
        # OptionRegistry.__init__ would run the generator for every cc 50..100 and for conv too.
        def __init__(self, target_cc: int):  # noqa: D401 - same contract as the base class
            gemm_kinds = [cutlass_library.GemmKind.Universal, cutlass_library.GemmKind.Universal3x]
            self.registry = {target_cc: {cutlass_library.OperationKind.Gemm: ArchOptions(
                target_cc, target_cc, cutlass_library.OperationKind.Gemm, gemm_kinds)}}

        def options_for_cc(self, cc_: int, op_kind=cutlass_library.OperationKind.Gemm):
            options = self.registry.get(cc_, {}).get(op_kind)
            if options is None:
                raise KspecInternalError(f"no CUTLASS options registered for cc {cc_} ({op_kind})")
            return options

    return SingleArchOptionRegistry(cc)


@contextlib.contextmanager
def offline(cc: int, toolkit: str | None = None) -> Iterator[Any]:
    """Use `cutlass_cppgen` for target compute capability `cc` (90 or 100) with no device.

    Yields the `cutlass_cppgen` module.  On exit every replaced attribute is restored, so a user
    process that also uses the interface with a real GPU is left as it was."""
    check_cutlass_version()
    toolkit = toolkit or nvcc_version()
    check_cc(cc, toolkit)
    with _OFFLINE_LOCK:
        cutlass_cppgen = _import_cutlass_cppgen()
        generator = importlib.import_module("cutlass_library.generator")
        lib = importlib.import_module("cutlass_library")
        if getattr(lib, "generator", None) is not generator:
            lib.generator = generator     # the binding `import cutlass_library.generator` makes
        patches = [
            _Patch(cutlass_cppgen, "_nvcc_version", toolkit),
            _Patch(cutlass_cppgen, "_NVCC_VERSION", toolkit),
            _Patch(cutlass_cppgen, "device_id", _no_device("query the CUDA device id")),
            _Patch(cutlass_cppgen, "initialize_cuda_context", _no_device("initialize a CUDA context")),
            _Patch(cutlass_cppgen, "check_cuda_versions", _no_device("read cuda-python's version")),
            _Patch(cutlass_cppgen, "device_cc", _target_cc(cc)),
        ]
        for name in _DEVICE_CC_CALLERS:
            patches.append(_Patch(importlib.import_module(name), "device_cc", _target_cc(cc)))
        applied: list[_Patch] = []
        try:
            for p in patches:
                p.apply()
                applied.append(p)
            registry = _REGISTRY_CACHE.get(cc, toolkit)
            p = _Patch(cutlass_cppgen, "_option_registry", registry)
            p.apply()
            applied.append(p)
            yield cutlass_cppgen
        finally:
            for p in reversed(applied):
                p.restore()


def _import_cutlass_cppgen() -> Any:
    """Import the interface; a first import runs from a private temp dir because
    `cutlass_cppgen.backend.compiler` opens `./compiled_cache.db` at import time."""
    if "cutlass_cppgen" in sys.modules:
        return sys.modules["cutlass_cppgen"]
    cwd = os.getcwd()
    scratch = tempfile.mkdtemp(prefix="kspec-cutlass-cppgen-")
    try:
        os.chdir(scratch)
        return importlib.import_module("cutlass_cppgen")
    finally:
        os.chdir(cwd)


def _target_cc(cc: int) -> Callable[..., int]:
    def device_cc(device: int = -1) -> int:
        return cc
    return device_cc


# --------------------------------------------------------------------------------------------
# small typed views of the interface, so callers do not spell cutlass_library enums themselves
# --------------------------------------------------------------------------------------------

# kspec dtype -> cutlass_library.DataType member name ("tf32" operands are stored as f32; CUTLASS
# registers its tf32 tensor-core kernels under f32 operands).
_DTYPE_NAMES = {"f16": "f16", "bf16": "bf16", "f32": "f32", "tf32": "f32",
                "f8e4m3": "e4m3", "f8e5m2": "e5m2", "i8": "s8", "i32": "s32"}


def library_dtype(dtype: str) -> Any:
    """The `cutlass_library.DataType` for a kspec dtype name."""
    lib = _cutlass_library()
    try:
        return getattr(lib.DataType, _DTYPE_NAMES[dtype])
    except KeyError as e:
        raise KspecError(f"dtype '{dtype}' has no CUTLASS equivalent") from e


def library_layout(layout: str) -> Any:
    lib = _cutlass_library()
    if layout == "row":
        return lib.LayoutType.RowMajor
    if layout == "col":
        return lib.LayoutType.ColumnMajor
    raise KspecError(f"layout '{layout}' is not 'row' or 'col'")
