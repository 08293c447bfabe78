"""The host-glue shared library of one plan and arch (backends/ABI.md), called through ctypes.

The glue needs neither a GPU nor libcuda to be loaded or to size and fill a parameter blob for a
plain kernel, so this part of a launch can be exercised on any machine."""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from kspec.core import ABI_VERSION
from kspec.runtime.elfcheck import check_shared_object
from kspec.runtime.errors import KspecRuntimeError

# Hopper/Blackwell accept up to 32764 bytes of kernel parameters.
PARAMS_CAP = 32768
_PARAMS_ALIGN = 128           # CUTLASS Params hold alignas(64) TMA descriptors
_ERR_CAP = 2048

_u32x3 = ctypes.c_uint32 * 3


@dataclass
class Prepared:
    """A parameter blob and launch geometry from `kspec_prepare`.  `buffer` owns the memory at
    `params_ptr`; keep this object alive until the launch call has returned (the driver copies the
    parameters at launch)."""
    buffer: ctypes.Array
    params_ptr: int
    params_size: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    cluster: tuple[int, int, int]
    smem_bytes: int

    def params_bytes(self) -> bytes:
        return ctypes.string_at(self.params_ptr, self.params_size)


class HostGlue:
    """One dlopen'ed glue library.  RTLD_LOCAL: every plan's library exports the same names."""

    def __init__(self, path: str | Path, what: str, arg_names: Sequence[str] = ()):
        self.path = Path(path)
        self.what = what
        self.arg_names = tuple(arg_names)       # plan args in ABI pointer order, for messages
        check_shared_object(self.path, f"host glue of {what}")     # a damaged file would fault, not raise
        try:
            self._lib = ctypes.CDLL(str(self.path), mode=ctypes.RTLD_LOCAL)
        except OSError as e:
            raise KspecRuntimeError(f"{self.path}: cannot load host glue of {what}: {e}") from None
        try:
            ws = self._lib.kspec_workspace_size
            prep = self._lib.kspec_prepare
        except AttributeError as e:
            raise KspecRuntimeError(f"{self.path}: host glue of {what} does not export "
                                    f"kspec_workspace_size/kspec_prepare ({e})") from None
        # a glue built for another ABI takes other arguments: calling it would corrupt memory
        try:
            version_fn = self._lib.kspec_abi_version
        except AttributeError:
            version = None
        else:
            version_fn.argtypes, version_fn.restype = [], ctypes.c_int
            version = int(version_fn())
        if version != ABI_VERSION:
            built = "an older kspec (no kspec_abi_version)" if version is None else f"ABI version {version}"
            raise KspecRuntimeError(f"{self.path}: host glue of {what} was built for {built}; this "
                                    f"runtime speaks ABI version {ABI_VERSION}",
                                    hint="rebuild the artifact with `kspec compile`")
        i64p = ctypes.POINTER(ctypes.c_int64)
        u32p = ctypes.POINTER(ctypes.c_uint32)
        u64p = ctypes.POINTER(ctypes.c_uint64)
        ws.argtypes = [i64p, ctypes.c_int32, ctypes.c_int32, u64p, ctypes.c_char_p, ctypes.c_uint64]
        ws.restype = ctypes.c_int
        prep.argtypes = [i64p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_double),
                         ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p,
                         ctypes.c_uint64, u64p, u32p, u32p, u32p, u32p, ctypes.c_char_p, ctypes.c_uint64]
        prep.restype = ctypes.c_int
        self._ws, self._prep = ws, prep

    def _fail(self, fn: str, rc: int, err: ctypes.Array) -> KspecRuntimeError:
        msg = err.value.decode("utf-8", "replace").strip() or f"returned {rc}"
        return KspecRuntimeError(f"{self.what}: {fn} failed: {self.name_arguments(msg)}")

    def name_arguments(self, msg: str) -> str:
        """The glue knows arguments by ABI position ("argument #1"); name them for the user."""
        def name(m: re.Match) -> str:
            i = int(m.group(1))
            return f"argument '{self.arg_names[i]}'" if i < len(self.arg_names) else m.group(0)
        return re.sub(r"argument #(\d+)", name, msg)

    def workspace_size(self, dims: Sequence[int], device: int, sm_count: int) -> int:
        """Device workspace bytes for these sizes on `device` with `sm_count` multiprocessors
        (persistent schedulers size per-SM state by it, so it must be the launch device's)."""
        d = (ctypes.c_int64 * max(len(dims), 1))(*dims)
        out = ctypes.c_uint64(0)
        err = ctypes.create_string_buffer(_ERR_CAP)
        rc = self._ws(d, device, sm_count, ctypes.byref(out), err, _ERR_CAP)
        if rc != 0:
            raise self._fail("kspec_workspace_size", rc, err)
        return int(out.value)

    def prepare(self, dims: Sequence[int], ptrs: Sequence[int], scalars: Sequence[float],
                workspace: int, device: int, sm_count: int) -> Prepared:
        d = (ctypes.c_int64 * max(len(dims), 1))(*dims)
        p = (ctypes.c_void_p * max(len(ptrs), 1))(*ptrs)
        s = (ctypes.c_double * max(len(scalars), 1))(*scalars)
        buf = (ctypes.c_ubyte * (PARAMS_CAP + _PARAMS_ALIGN))()
        base = ctypes.addressof(buf)
        aligned = (base + _PARAMS_ALIGN - 1) // _PARAMS_ALIGN * _PARAMS_ALIGN
        size = ctypes.c_uint64(0)
        grid, block, cluster = _u32x3(), _u32x3(), _u32x3(1, 1, 1)
        smem = ctypes.c_uint32(0)
        err = ctypes.create_string_buffer(_ERR_CAP)
        rc = self._prep(d, p, s, ctypes.c_void_p(workspace or None), device, sm_count,
                        ctypes.c_void_p(aligned), PARAMS_CAP, ctypes.byref(size), grid, block, cluster,
                        ctypes.byref(smem), err, _ERR_CAP)
        if rc != 0:
            raise self._fail("kspec_prepare", rc, err)
        if size.value > PARAMS_CAP:
            raise KspecRuntimeError(f"{self.what}: kspec_prepare reports {size.value} bytes of "
                                    f"parameters, more than the {PARAMS_CAP}-byte buffer")
        return Prepared(buf, aligned, int(size.value), tuple(grid), tuple(block),
                        tuple(max(int(c), 1) for c in cluster), int(smem.value))
