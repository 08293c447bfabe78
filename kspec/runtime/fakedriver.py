"""A stand-in for the CUDA driver that records every launch, so the launch ABI can be checked on a
machine without a GPU (tests/test_launch_abi.py, `kspec selftest --fake`).

`FakeDriver` replaces `kspec.runtime.driver.get()`'s object (through `driver.use`, entered by
`with FakeDriver(...) as fake:`).  It serves everything `kspec.runtime.module` asks of the driver:
device facts of a chosen compute capability, contexts, streams, and memory, where a "device
pointer" is the address of host memory the fake owns (so fills, copies and the runtime's own
`DeviceArray` outputs are real bytes).  `launch` runs nothing: it records a `LaunchRecord` with the
cubin image, the kernel symbol, the parameter blob, grid, block, cluster, dynamic shared memory and
the dynamic-shared-memory limit set on the function.  While active it also wraps
`HostGlue.prepare`, recording what the runtime handed the host glue (sizes, pointers, scalars,
workspace, sm count) and the TMA descriptors the glue asked for.

TMA descriptors.  The CUTLASS host glue links the static CUDA runtime, which reaches
`cuTensorMapEncodeTiled` through `cudaGetDriverEntryPointByVersion` (local to the glue, so not
interposable), and static cudart initialises through the driver's private `cuGetExportTable`: a
fake `libcuda.so.1` cannot serve that path honestly (tried: cudart asks for `cuGetExportTable`
and gives up).  So the glue routes the encode through an injectable encoder
(backends/cutlass/tma_hook.py, exported as `kspec_set_tensor_map_encoder`).  While a prepare runs,
the fake installs `RecordingEncoder`, which records every call, refuses what the driver documents
as invalid, and writes a marker (magic, record index, address) into the 128-byte descriptor, so
`check_launch` can find each descriptor inside the parameter blob (offset, 64-byte alignment) and
check the ones the kernel will use against the tensors passed.  Glue built without the hook
still gets its descriptors recorded on a machine without a driver: CUTLASS
(cute/atom/copy_traits_sm90_tma.hpp) reports every argument of the encode it could not do on
stderr, which the fake captures (file descriptor 2) and parses (`parse_cutlass_tma_report`); their
placement in the blob is then unknown.

Limits: nothing runs on a device (numbers are `kspec selftest`'s job on a GPU, or an `on_launch`
emulator's in tests); driver-side validation is limited to cuTensorMapEncodeTiled's documented
argument rules and the cubin's declared attributes; descriptors a backend encodes on the device
or through another entry point are not seen.
"""
from __future__ import annotations

import ctypes
import math
import os
import struct
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

from kspec.core import STEP_ROLES, KspecInternalError, attention_bwd_layout, extent_value
from kspec.runtime import dtypes
from kspec.runtime.errors import KspecRuntimeError

# ------------------------------------------------------------------------------------------------
# TMA descriptors, as CUTLASS reports them when the driver cannot encode them
# ------------------------------------------------------------------------------------------------

# CUtensorMapDataType -> bytes per element
TENSOR_MAP_ELEMENT_BYTES = {0: 1, 1: 2, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 4, 11: 4, 12: 4}


@dataclass(frozen=True)
class TensorMapRecord:
    """The arguments of one cuTensorMapEncodeTiled call (dims innermost first)."""
    index: int
    data_type: int
    address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]          # bytes, of dims[1:]
    box: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int

    @property
    def element_bytes(self) -> int:
        return TENSOR_MAP_ELEMENT_BYTES.get(self.data_type, 0)

    def describe(self) -> str:
        return (f"TMA descriptor #{self.index} @0x{self.address:x} type {self.data_type} dims {list(self.dims)} "
                f"strides {list(self.strides)} box {list(self.box)} swizzle {self.swizzle}")

    def problems(self) -> list[str]:
        """What cuTensorMapEncodeTiled's documented requirements reject in these arguments."""
        out = []
        es = self.element_bytes
        align = 32 if self.interleave == 2 else 16
        rank = len(self.dims)
        if es == 0:
            out.append(f"unsupported data type {self.data_type}")
        if not 1 <= rank <= 5 or (self.interleave and rank < 3):
            out.append(f"rank {rank} out of range")
        if self.address == 0 or self.address % align:
            out.append(f"globalAddress 0x{self.address:x} is not {align}-byte aligned")
        for i, d in enumerate(self.dims):
            if not 0 < d <= 1 << 32:
                out.append(f"globalDim[{i}] = {d} out of range")
        for i, s in enumerate(self.strides):
            if s % align or s >= 1 << 40:
                out.append(f"globalStrides[{i}] = {s} is not a multiple of {align} below 2^40")
        for i, b in enumerate(self.box):
            if not 0 < b <= 256:
                out.append(f"boxDim[{i}] = {b} out of 1..256")
        for i, e in enumerate(self.element_strides):
            if not 0 < e <= 8:
                out.append(f"elementStrides[{i}] = {e} out of 1..8")
        if es and self.box and self.interleave == 0:
            inner = self.box[0] * es
            if inner % 16:
                out.append(f"boxDim[0] * element size = {inner} bytes, not a multiple of 16")
            if 1 <= self.swizzle <= 3 and inner > 16 << self.swizzle:
                out.append(f"boxDim[0] * element size = {inner} bytes exceeds the {16 << self.swizzle}-byte swizzle span")
        return out


_TMA_FIELDS = ("TMA Desc Addr:", "format", "dim", "gmem_address", "globalDim", "globalStrides", "boxDim",
               "elementStrides", "interleave", "swizzle", "l2Promotion", "oobFill")


def parse_cutlass_tma_report(text: str, start_index: int = 0) -> tuple[list[TensorMapRecord], str]:
    """(records, the rest of the text) from CUTLASS's report of a failed cuTensorMapEncodeTiled
    (cute/atom/copy_traits_sm90_tma.hpp prints every argument to std::cerr).  Tuples print as
    `(a,b,c,...)` with 5 entries; globalStrides includes the implicit element stride first."""
    records: list[TensorMapRecord] = []
    rest: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("TMA Desc Addr:"):
            rest.append(lines[i])
            i += 1
            continue
        block = lines[i:i + len(_TMA_FIELDS)]
        i += len(_TMA_FIELDS)
        if i < len(lines) and lines[i].startswith("Error: Failed to initialize the TMA descriptor"):
            i += 1
        values = {}
        for key, line in zip(_TMA_FIELDS, block):
            if not line.startswith(key):
                raise KspecInternalError(f"unexpected CUTLASS TMA report line {line!r} (expected {key})")
            values[key] = line[len(key):].strip()

        def tup(v: str) -> tuple[int, ...]:
            return tuple(int(x) for x in v.strip("()").split(",") if x.strip())

        try:
            rank = int(values["dim"])
            tup(values["globalDim"]), int(values["format"]), int(values["gmem_address"], 16)
        except ValueError as e:
            raise KspecInternalError(f"unreadable CUTLASS TMA report {block!r}: {e}") from None
        strides = tup(values["globalStrides"])
        records.append(TensorMapRecord(
            index=start_index + len(records), data_type=int(values["format"]),
            address=int(values["gmem_address"], 16) if values["gmem_address"] not in ("0", "(nil)") else 0,
            dims=tup(values["globalDim"])[:rank], strides=strides[1:rank], box=tup(values["boxDim"])[:rank],
            element_strides=tup(values["elementStrides"])[:rank], interleave=int(values["interleave"]),
            swizzle=int(values["swizzle"]), l2_promotion=int(values["l2Promotion"]),
            oob_fill=int(values["oobFill"])))
    return records, "\n".join(rest)


TENSOR_MAP_MAGIC = int.from_bytes(b"KSPEC_TM", "little")   # first 8 bytes of every descriptor the fake encodes

_u64p = ctypes.POINTER(ctypes.c_uint64)
_u32p = ctypes.POINTER(ctypes.c_uint32)
_ENCODE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p,
                              _u64p, _u64p, _u32p, _u32p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
                              ctypes.c_uint32)


class RecordingEncoder:
    """A `cuTensorMapEncodeTiled` for the host glue's `kspec_set_tensor_map_encoder` hook
    (backends/cutlass/tma_hook.py): it records the arguments, rejects what the driver documents as
    invalid (CUDA_ERROR_INVALID_VALUE), and writes a findable marker into the 128-byte descriptor:
    magic, record index, global address."""

    def __init__(self):
        self.records: list[TensorMapRecord] = []
        self.rejected: list[tuple[TensorMapRecord, list[str]]] = []
        self.fn = _ENCODE_FN(self._encode)

    def _encode(self, tmap, data_type, rank, address, dims, strides, box, estr, interleave, swizzle, l2, oob):
        try:
            n = int(rank)
            if not 1 <= n <= 5:
                return 1
            rec = TensorMapRecord(len(self.records), int(data_type), int(address or 0),
                                  tuple(int(dims[i]) for i in range(n)), tuple(int(strides[i]) for i in range(n - 1)),
                                  tuple(int(box[i]) for i in range(n)),
                                  tuple(int(estr[i]) for i in range(n)) if estr else (1,) * n,
                                  int(interleave), int(swizzle), int(l2), int(oob))
            problems = rec.problems()
            if tmap is None or tmap % 64:
                problems.append("tensorMap is not 64-byte aligned")
            if problems:
                self.rejected.append((rec, problems))
                return 1                              # CUDA_ERROR_INVALID_VALUE
            self.records.append(rec)
            marker = struct.pack("<QQQ", TENSOR_MAP_MAGIC, rec.index, rec.address)
            ctypes.memmove(tmap, marker + bytes(128 - len(marker)), 128)
            return 0
        except Exception:                             # never unwind through C frames
            return 999

    def reset(self) -> None:
        self.records.clear()
        self.rejected.clear()


def find_tensor_maps(blob: bytes) -> dict[int, int]:
    """{record index: offset} of the fake encoder's descriptors inside a parameter blob."""
    out = {}
    magic = struct.pack("<Q", TENSOR_MAP_MAGIC)
    at = blob.find(magic)
    while at >= 0:
        if at + 16 <= len(blob):
            out[struct.unpack_from("<Q", blob, at + 8)[0]] = at
        at = blob.find(magic, at + 1)
    return out


class _CaptureStderr:
    """Redirect file descriptor 2 (where the host glue's C++ writes) into a temporary file."""

    def __enter__(self) -> _CaptureStderr:
        import tempfile
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        self.text = ""
        return self

    def __exit__(self, *exc) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self.text = self._file.read().decode("utf-8", "replace")
        self._file.close()


# ------------------------------------------------------------------------------------------------
# the fake driver
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrepareRecord:
    """What the runtime passed to `kspec_prepare`, and the TMA descriptors encoded during the call."""
    glue: str
    dims: tuple[int, ...]
    ptrs: tuple[int, ...]
    scalars: tuple[float, ...]
    workspace: int
    device: int
    sm_count: int
    params_size: int
    tensor_maps: tuple[TensorMapRecord, ...] = ()
    rejected: tuple[tuple[TensorMapRecord, tuple[str, ...]], ...] = ()   # encodes the driver would refuse


@dataclass
class LaunchRecord:
    what: str
    symbol: str
    image: bytes = field(repr=False)
    params: bytes = field(repr=False)
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    cluster: tuple[int, int, int]
    smem_bytes: int
    smem_limit: int                   # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES set on the function
    stream: int
    prepare: PrepareRecord | None = None
    param_offsets: tuple[int, ...] | None = None     # multi-parameter kernels (CuTe DSL): offset of each


@dataclass
class _Allocation:
    buffer: ctypes.Array
    ptr: int
    nbytes: int
    what: str


_UNREAD = object()


class _FakeFunction:
    _next = 1

    def __init__(self, image: bytes, symbol: str):
        self.image, self.symbol = image, symbol
        self.params = _UNREAD                   # FakeDriver._params_of
        self.handle = _FakeFunction._next
        _FakeFunction._next += 1

    def __int__(self) -> int:
        return self.handle


_ALIGN = 256


class FakeDriver:
    """The driver interface `kspec.runtime.module` uses, recording instead of launching.

    cc: the compute capability it reports (9, 0) -> sm90a, (10, 0) -> sm100a.  Device pointers are
    host addresses of memory the fake owns; `alloc`, `upload` and `download` give tests and the
    selftest synchronous access to it."""

    def __init__(self, cc: tuple[int, int] = (9, 0), sm_count: int = 132, name: str = "kspec fake device",
                 param_sizes: bool = True, on_launch=None):
        self.cc, self.sm_count, self.name = cc, sm_count, name
        self.stderr: list[str] = []           # host-glue output other than TMA reports
        self.encoder = RecordingEncoder()
        self.rejected_tensor_maps: list[tuple[TensorMapRecord, list[str]]] = []
        self.launches: list[LaunchRecord] = []
        self.fills: list[tuple[int, int, int, int]] = []
        self.fills_at: list[int] = []          # per fill: how many launches were recorded before it
        self.reads: list[tuple[int, int, int]] = []   # device-to-host copies: (ptr, bytes, stream)
        self.memory: dict[int, _Allocation] = {}
        self._smem: dict[int, int] = {}
        self._functions: dict[tuple, _FakeFunction] = {}
        # prepared launches by parameter-blob address (the runtime prepares every plan of a call, then
        # launches them in turn)
        self._pending: dict[int, PrepareRecord] = {}
        self._stack: ExitStack | None = None
        self._param_sizes = param_sizes
        self.on_launch = on_launch             # optional emulator: on_launch(record) may write outputs

    # ---------------------------------------------------------------- activation
    def __enter__(self) -> FakeDriver:
        from kspec.runtime import driver as _driver
        from kspec.runtime.glue import HostGlue
        stack = ExitStack()
        stack.enter_context(_driver.use(self))
        original = HostGlue.prepare
        fake = self

        def prepare(glue, dims, ptrs, scalars, workspace, device, sm_count):
            hook = getattr(glue._lib, "kspec_set_tensor_map_encoder", None) if hasattr(glue, "_lib") else None
            fake.encoder.reset()
            if hook is not None:
                hook.argtypes, hook.restype = [ctypes.c_void_p], ctypes.c_int
                hook(ctypes.cast(fake.encoder.fn, ctypes.c_void_p))
            try:
                with _CaptureStderr() as cap:
                    out = original(glue, dims, ptrs, scalars, workspace, device, sm_count)
            finally:
                if hook is not None:
                    hook(None)
            rejected = tuple((r, tuple(why)) for r, why in fake.encoder.rejected)
            fake.rejected_tensor_maps += list(rejected)
            # glue without the hook: CUTLASS reports the arguments of an encode it could not do
            # (with the hook, only of encodes the fake rejected, which `rejected` already holds)
            reported, rest = parse_cutlass_tma_report(cap.text, len(fake.encoder.records))
            maps = list(fake.encoder.records) + (reported if hook is None else [])
            if rest.strip():
                fake.stderr.append(rest)
                sys.stderr.write(rest + "\n")
            fake._pending[int(out.params_ptr)] = PrepareRecord(str(glue.path.name), tuple(int(d) for d in dims),
                                          tuple(int(p) for p in ptrs), tuple(float(s) for s in scalars),
                                          int(workspace or 0), int(device), int(sm_count),
                                          int(out.params_size), tuple(maps), rejected)
            return out

        HostGlue.prepare = prepare
        stack.callback(setattr, HostGlue, "prepare", original)
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    # ---------------------------------------------------------------- availability, devices, contexts
    def available(self) -> tuple[bool, str]:
        return True, ""

    def require_device(self) -> None:
        pass

    def device_count(self) -> int:
        return 1

    def facts(self, ordinal: int) -> tuple[int, int, int, str]:
        if ordinal != 0:
            raise KspecRuntimeError(f"cuda:{ordinal} does not exist (1 device(s))")
        return self.cc[0], self.cc[1], self.sm_count, self.name

    def primary_context(self, ordinal: int) -> int:
        return 0x1000 + ordinal

    def stream_context(self, stream: int):
        return None

    def current_device(self) -> int | None:
        return None

    def current(self, ctx):
        from contextlib import nullcontext
        return nullcontext()

    def context_device(self, ctx) -> int:
        return 0

    def pointer_device(self, ptr: int, what: str) -> int:
        if self._owner(ptr) is None:
            raise KspecRuntimeError(f"{what}: 0x{ptr:x} is not memory of the fake device")
        return 0

    def is_capturing(self, stream: int) -> bool:
        return False

    def order_after(self, producer: int, consumer: int) -> None:
        pass

    # ---------------------------------------------------------------- code and launches
    def function(self, ctx, key: tuple, image: bytes, symbol: str, what: str):
        k = (int(ctx), *key)
        if k not in self._functions:
            self._functions[k] = _FakeFunction(bytes(image), symbol)
        return self._functions[k]

    @staticmethod
    def _params_of(func):
        """The parameters the cubin declares for the function's kernel, read once per function
        (like the real driver, which caches cuFuncGetParamInfo per CUfunction)."""
        if func.params is _UNREAD:
            from kspec.runtime.cubin import parse_cubin
            info = parse_cubin(func.image, func.symbol).kernels.get(func.symbol)
            func.params = tuple(info.params) if info is not None and info.params else None
        return func.params

    def param_size(self, func) -> int | None:
        """The size the cubin declares for parameter 0 (what cuFuncGetParamInfo reports)."""
        if not self._param_sizes:
            return None
        params = self._params_of(func)
        return params[0].size if params else None

    def param_layout(self, func) -> tuple[tuple[int, int], ...] | None:
        """(offset, size) of each parameter the cubin declares (EIATTR_KPARAM_INFO), offsets relative
        to the first's (what cuFuncGetParamInfo reports, rebased)."""
        if not self._param_sizes:
            return None
        params = self._params_of(func)
        if not params:
            return None
        return tuple((p.offset - params[0].offset, p.size) for p in params)

    def set_dynamic_smem(self, func, nbytes: int, what: str) -> None:
        self._smem[int(func)] = max(self._smem.get(int(func), 0), int(nbytes))

    def launch(self, func, grid, block, cluster, smem: int, stream: int, params_ptr: int, what: str,
               param_offsets: tuple[int, ...] | None = None) -> None:
        pending = self._pending.pop(int(params_ptr), None)
        # the blob's size is what the glue reported to the runtime (the launch gets only a pointer)
        blob = ctypes.string_at(params_ptr, pending.params_size) if pending is not None else b""
        self.launches.append(LaunchRecord(what, func.symbol, func.image, blob, tuple(int(g) for g in grid),
                                          tuple(int(b) for b in block), tuple(int(c) for c in cluster),
                                          int(smem), self._smem.get(int(func), 0), int(stream), pending,
                                          tuple(param_offsets) if param_offsets else None))
        if self.on_launch is not None:
            self.on_launch(self.launches[-1])

    # ---------------------------------------------------------------- memory
    def alloc(self, nbytes: int, what: str = "a buffer") -> int:
        n = max(int(nbytes), 1)
        buf = (ctypes.c_ubyte * (n + _ALIGN))()
        base = ctypes.addressof(buf)
        ptr = (base + _ALIGN - 1) // _ALIGN * _ALIGN
        self.memory[ptr] = _Allocation(buf, ptr, n, what)
        return ptr

    def alloc_async(self, nbytes: int, stream: int, what: str) -> int:
        return self.alloc(nbytes, what)

    def free_async(self, ptr: int, stream: int) -> None:
        if int(ptr) not in self.memory:
            raise KspecRuntimeError(f"free of 0x{int(ptr):x}, which the fake device did not allocate")
        # kept alive (not released) so records can still be read after the call returns

    def _owner(self, ptr: int) -> _Allocation | None:
        for a in self.memory.values():
            if a.ptr <= ptr < a.ptr + a.nbytes or ptr == a.ptr:
                return a
        return None

    def _check_range(self, ptr: int, nbytes: int, what: str) -> None:
        a = self._owner(ptr)
        if a is None or ptr + nbytes > a.ptr + a.nbytes:
            raise KspecRuntimeError(f"{what}: [0x{ptr:x}, +{nbytes}) is outside memory of the fake device")

    def fill(self, ptr: int, pattern: int, width: int, count: int, stream: int, what: str) -> None:
        self._check_range(int(ptr), width * count, what)
        self.fills.append((int(ptr), int(pattern), int(width), int(count)))
        self.fills_at.append(len(self.launches))
        ctypes.memmove(int(ptr), int(pattern).to_bytes(width, "little") * int(count), width * int(count))

    def upload(self, ptr: int, data: bytes) -> None:
        self._check_range(int(ptr), len(data), "upload")
        ctypes.memmove(int(ptr), data, len(data))

    def download(self, ptr: int, nbytes: int) -> bytes:
        self._check_range(int(ptr), nbytes, "download")
        return ctypes.string_at(int(ptr), nbytes)

    def copy_to_host(self, ptr: int, nbytes: int, stream: int, what: str) -> bytes:
        self.reads.append((int(ptr), int(nbytes), int(stream)))
        self._check_range(int(ptr), int(nbytes), f"reading {what}")
        return ctypes.string_at(int(ptr), int(nbytes))

    def call(self, fn_name: str, *args, what: str = "") -> Any:
        """The few raw driver calls `DeviceArray` and `kspec selftest` make."""
        if fn_name in ("cuStreamSynchronize", "cuCtxSynchronize"):
            return None
        if fn_name == "cuMemAlloc":
            return self.alloc(int(args[0]), "cuMemAlloc")
        if fn_name == "cuMemFree":
            if int(args[0]) not in self.memory:
                raise KspecRuntimeError(f"cuMemFree of 0x{int(args[0]):x}, which the fake device did not allocate")
            return None
        if fn_name == "cuMemcpyHtoD":
            dst, src, n = args
            import numpy as np
            self.upload(int(dst), np.ascontiguousarray(src).tobytes()[:int(n)])
            return None
        if fn_name == "cuMemcpyDtoH":
            dst, src, n = args
            import numpy as np
            view = np.ascontiguousarray(dst).view(np.uint8).reshape(-1)
            view[:int(n)] = np.frombuffer(self.download(int(src), int(n)), dtype=np.uint8)
            return None
        raise KspecInternalError(f"the fake driver does not implement {fn_name}")


# ------------------------------------------------------------------------------------------------
# checking recorded launches
# ------------------------------------------------------------------------------------------------

# Hopper and Blackwell: 227 KiB of shared memory per block with the opt-in attribute, 48 KiB without.
MAX_SMEM_PER_BLOCK = {"sm90a": 232448, "sm100a": 232448}
DEFAULT_SMEM_LIMIT = 48 * 1024
PORTABLE_CLUSTER = 8


@dataclass(frozen=True)
class ArgTensor:
    """One tensor argument of a plan as the runtime bound it: pointer, extents, element strides."""
    name: str
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        return dtypes.itemsize(self.dtype)


def _coalesce(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """(extent, byte stride) pairs with extent-1 axes dropped and axes that are contiguous with
    each other merged, innermost first: two layouts address the same bytes in the same order iff
    these lists are equal."""
    items = sorted(((e, s) for e, s in pairs if e > 1), key=lambda p: p[1])
    out: list[tuple[int, int]] = []
    for e, s in items:
        if out and out[-1][1] * out[-1][0] == s:
            out[-1] = (out[-1][0] * e, out[-1][1])
        else:
            out.append((e, s))
    return out


def check_tensor_map(tm: TensorMapRecord, args: Sequence[ArgTensor]) -> list[str]:
    """A descriptor must satisfy the driver's rules and describe exactly one of the plan's tensors."""
    problems = [f"{tm.describe()}: {p}" for p in tm.problems()]
    match = [a for a in args if a.ptr == tm.address]
    if not match:
        names = ", ".join(f"{a.name}@0x{a.ptr:x}" for a in args)
        return problems + [f"{tm.describe()}: its address is none of the plan's tensors ({names})"]
    a = match[0]
    if tm.element_bytes and tm.element_bytes != a.itemsize:
        problems.append(f"{tm.describe()}: {tm.element_bytes}-byte elements, but '{a.name}' is {a.dtype} "
                        f"({a.itemsize} bytes)")
    es = tm.element_bytes or a.itemsize
    desc_pairs = [(tm.dims[0], es)] + list(zip(tm.dims[1:], tm.strides))
    want_pairs = [(n, s * a.itemsize) for n, s in zip(a.shape, a.strides)]
    desc = sorted((e, s) for e, s in desc_pairs if e > 1)
    want = sorted((e, s) for e, s in want_pairs if e > 1)
    if desc != want and len(desc) != len(want):
        # a descriptor may fold axes that are contiguous with each other (e.g. batch and rows);
        # only then compare the merged layouts (merging equal-rank layouts would hide a transpose)
        desc, want = _coalesce(desc_pairs), _coalesce(want_pairs)
    if desc != want:
        problems.append(f"{tm.describe()}: addresses '{a.name}' as (extent, byte stride) {desc}, but the tensor "
                        f"passed is shape {a.shape} strides {a.strides} (elements) = {want}")
    return problems


def check_launch(rec: LaunchRecord, arch: str, args: Sequence[ArgTensor], *,
                 require_tma: Sequence[str] = ()) -> list[str]:
    """Everything a launch record can be checked against without a GPU: the cubin's declared
    parameter layout, thread and cluster limits; grid limits; shared memory; the pointers handed
    to the glue and found in the parameter blob; the TMA descriptors against the tensors."""
    from kspec.runtime.cubin import parse_cubin
    what = rec.what
    out: list[str] = []
    info = parse_cubin(rec.image, what).kernels.get(rec.symbol)
    if info is None:
        return [f"{what}: the cubin has no kernel '{rec.symbol}'"]
    if not info.entry:
        out.append(f"{what}: '{rec.symbol}' is not an entry point (__global__) in the cubin")
    # parameters: one by-value Params struct, or (CuTe DSL kernels) one pointer per parameter into
    # the blob, at the offsets the manifest records, which must be the cubin's own
    if rec.param_offsets is not None:
        # (compared relative to the first parameter: the DSL's cubins place the parameter area at a
        # non-zero base, 48 bytes into the bank, which does not change the layout the launch builds)
        declared = tuple(p.offset - info.params[0].offset for p in info.params) if info.params else ()
        if rec.param_offsets != declared:
            out.append(f"{what}: launched with parameter offsets {rec.param_offsets}, the cubin declares "
                       f"{declared} (EIATTR_KPARAM_INFO)")
        elif info.params and declared[-1] + info.params[-1].size > len(rec.params):
            out.append(f"{what}: the glue built a {len(rec.params)}-byte parameter blob, the cubin's parameters "
                       f"end at byte {declared[-1] + info.params[-1].size}")
    elif len(info.params) != 1:
        out.append(f"{what}: the kernel takes {len(info.params)} parameters; the ABI passes exactly one")
    elif info.params[0].size != len(rec.params):
        out.append(f"{what}: the glue built a {len(rec.params)}-byte parameter blob, the cubin's parameter 0 "
                   f"is {info.params[0].size} bytes (EIATTR_KPARAM_INFO)")
    if rec.prepare is not None and rec.prepare.params_size != len(rec.params):
        out.append(f"{what}: launched {len(rec.params)} bytes but kspec_prepare reported {rec.prepare.params_size}")
    # block
    threads = math.prod(rec.block)
    if min(rec.block) < 1 or threads > 1024:
        out.append(f"{what}: block {rec.block} is not a valid CUDA block ({threads} threads)")
    if info.max_threads is not None and threads > math.prod(info.max_threads):
        out.append(f"{what}: block {rec.block} has {threads} threads, more than the kernel's "
                   f"__launch_bounds__ {math.prod(info.max_threads)} (EIATTR_MAX_THREADS)")
    if info.reqntid is not None and tuple(rec.block) != info.reqntid:
        out.append(f"{what}: block {rec.block} differs from the kernel's required {info.reqntid} (EIATTR_REQNTID)")
    # grid and cluster
    if min(rec.grid) < 1 or rec.grid[0] >= 1 << 31 or rec.grid[1] > 65535 or rec.grid[2] > 65535:
        out.append(f"{what}: grid {rec.grid} is out of CUDA's limits")
    if min(rec.cluster) < 1:
        out.append(f"{what}: cluster {rec.cluster} has a zero dimension")
    else:
        for g, c, axis in zip(rec.grid, rec.cluster, "xyz"):
            if g % c:
                out.append(f"{what}: grid.{axis} = {g} is not a multiple of cluster.{axis} = {c}")
        if math.prod(rec.cluster) > PORTABLE_CLUSTER:
            out.append(f"{what}: cluster {rec.cluster} exceeds the portable cluster size {PORTABLE_CLUSTER}")
    if info.cluster_dims is not None and tuple(rec.cluster) != info.cluster_dims:
        out.append(f"{what}: launched with cluster {rec.cluster}, the kernel declares {info.cluster_dims} "
                   "(EIATTR_CTA_PER_CLUSTER)")
    if info.max_cluster_rank and math.prod(rec.cluster) > info.max_cluster_rank:
        out.append(f"{what}: cluster {rec.cluster} exceeds the kernel's maximum rank {info.max_cluster_rank}")
    # shared memory
    cap = MAX_SMEM_PER_BLOCK.get(arch)
    total = rec.smem_bytes + info.static_smem_bytes
    if cap is not None and total > cap:
        out.append(f"{what}: {rec.smem_bytes} bytes dynamic + {info.static_smem_bytes} static shared memory "
                   f"exceed {arch}'s {cap} bytes per block")
    if rec.smem_bytes > DEFAULT_SMEM_LIMIT and rec.smem_limit < rec.smem_bytes:
        out.append(f"{what}: launched with {rec.smem_bytes} bytes of dynamic shared memory but the function's "
                   f"limit was set to {rec.smem_limit} (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)")
    # pointers
    maps = rec.prepare.tensor_maps if rec.prepare is not None else ()
    # (a split-KV launch's glue gets the plan's pointers but uses partial buffers in the workspace
    # for some: its args name those "<...>", and the blob checks below cover them)
    if rec.prepare is not None and not any(a.name.startswith("<") for a in args) and \
            tuple(rec.prepare.ptrs) != tuple(a.ptr for a in args):
        out.append(f"{what}: the glue got pointers {[hex(p) for p in rec.prepare.ptrs]}, expected "
                   f"{[f'{a.name}=0x{a.ptr:x}' for a in args]}")
    # Descriptors the fake encoder wrote are findable in the blob: check those the kernel will
    # use (CUTLASS also encodes descriptors it then discards).  Without markers (descriptors
    # recorded from CUTLASS's report), every recorded one is checked.
    placed = find_tensor_maps(rec.params)
    used = [tm for tm in maps if tm.index in placed] if placed else list(maps)
    mapped = {tm.address for tm in used}
    words = {int.from_bytes(rec.params[i:i + 8], "little") for i in range(0, len(rec.params) - 7, 8)}
    for a in args:
        # a ragged TMA view (QuACK's create_ragged_tensor_for_tma with ptr_shift, which FlashAttention-4
        # uses for varlen O, and for dK, dV of its sm_90a backward over used key counts) starts
        # RAGGED_ROWS rows of its sequence mode before the data: the packed rows, or a dense tensor's
        # sequence axis (one of its modes)
        shifted = {a.ptr - RAGGED_ROWS * st * dtypes.itemsize(a.dtype) for st in a.strides}
        if a.ptr not in words and a.ptr not in mapped and not shifted & (words | mapped):
            out.append(f"{what}: the pointer of '{a.name}' (0x{a.ptr:x}) is neither in the parameter blob nor "
                       "behind a TMA descriptor")
    for index, offset in placed.items():
        if offset % 64:
            out.append(f"{what}: TMA descriptor #{index} sits at byte {offset} of the parameter blob, not 64-byte aligned")
        if index >= len(maps):
            out.append(f"{what}: the parameter blob holds TMA descriptor #{index}, which was not encoded in this call")
    for tm in used:
        out += check_tensor_map(tm, args)
    for tm, why in (rec.prepare.rejected if rec.prepare is not None else ()):
        out.append(f"{what}: cuTensorMapEncodeTiled would fail for {tm.describe()}: {'; '.join(why)}")
    for name in require_tma:
        a = next((x for x in args if x.name == name), None)
        if a is not None and a.ptr not in mapped:
            out.append(f"{what}: '{name}' has no TMA descriptor")
    return out


# ------------------------------------------------------------------------------------------------
# running an artifact's kernels against the fake
# ------------------------------------------------------------------------------------------------

@dataclass
class FakeCall:
    """One kernel call made against the fake driver and the launches it recorded."""
    kernel: str
    sizes: dict[str, int]
    binding: Any
    launches: list[LaunchRecord]
    plan_args: list[list[ArgTensor]]            # per launch, the plan's tensors in ABI order
    plan_ids: list[str]


# quack.copy_utils.BIG_INT (quack-kernels 0.6.5): the row shift of a ragged TMA tensor
RAGGED_ROWS = 2 ** 30


def _check_sizes_named(k, sizes: dict[str, int]) -> None:
    """Every size symbol of kernel entry k's arguments has a value in `sizes` (packed row counts
    aside: _packed_offsets derives them), the B of an offsets extent `B+1` and the K of a
    block-scale extent `K/32` included."""
    from kspec.core import packed_rows_symbol, split_offset_dim, split_quotient_dim
    rows = {packed_rows_symbol(t.packed) for t in (*k.inputs, *k.outputs) if t.packed}
    missing = set()
    for t in (*k.inputs, *k.outputs):
        for e in t.shape:
            if isinstance(e, str) and e not in sizes:
                sym = (split_offset_dim(e) or split_quotient_dim(e) or (e,))[0]
                if sym not in sizes and sym not in rows:
                    missing.add(sym)
    if missing:
        raise KspecInternalError(f"{k.name}: the sizes give no {', '.join(sorted(missing))} "
                                 "(kspec.selftest.call_sizes completes a size set for a kernel)")


def _packed_offsets(k, sizes: dict[str, int]) -> dict[str, Any]:
    """Valid offsets for every packed (varlen) batch of kernel entry k: B sequences of 100 + 17 b rows
    each, unless `sizes` gives the row count (split evenly then); sizes gets the row counts."""
    import numpy as np
    out = {}
    for t in (*k.inputs, *k.outputs):
        if t.packed and t.packed not in out:
            rows_sym = t.shape[0]
            n = extent_value(k.tensor(t.packed).shape[0], sizes) - 1         # [B+1] offsets: B sequences
            if rows_sym in sizes:
                lengths = [sizes[rows_sym] // n + (b < sizes[rows_sym] % n) for b in range(n)]
            else:
                lengths = [100 + 17 * b for b in range(n)]
            out[t.packed] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            sizes[rows_sym] = int(out[t.packed][-1])
    return out


def fake_call(mod, kernel: str, sizes: dict[str, int], fake: FakeDriver, *, pass_outputs: bool = False,
              fill: int | None = None, params: dict[str, float] | None = None) -> FakeCall:
    """Call `mod.<kernel>` on fake device memory: inputs (and, with pass_outputs, outputs) are
    allocated in their declared layouts at `sizes`; launches are recorded by `fake` (which must be
    active).  `fill`, when given, is the byte every input is filled with.  Params without a default
    and not in `params` get 1.5."""
    from kspec.artifact import layout_strides
    from kspec.runtime.tensors import DeviceBuffer
    k = mod[kernel].entry
    args: dict[str, Any] = {}
    sizes = dict(sizes)
    _check_sizes_named(k, sizes)
    offsets = _packed_offsets(k, sizes)
    for t in (*k.inputs, *(k.outputs if pass_outputs else ())):
        shape = tuple(extent_value(e, sizes) for e in t.shape)
        strides = layout_strides(shape, t.layout)
        nbytes = dtypes.span_bytes(t.dtype, shape, strides)
        ptr = fake.alloc(nbytes, f"'{t.name}'")
        if fill is not None and nbytes:
            fake.upload(ptr, bytes([fill]) * nbytes)
        if t.name in offsets:
            fake.upload(ptr, offsets[t.name].tobytes())
        args[t.name] = DeviceBuffer(ptr, shape, dtypes.storage(t.dtype), strides=strides)
    for p in k.params:
        if params and p.name in params:
            args[p.name] = params[p.name]
        elif p.default is None:
            args[p.name] = 1.5
    binding = mod[kernel].check(**args)
    first = len(fake.launches)
    result = mod[kernel](**args)
    return record_call(mod, kernel, sizes, binding, fake.launches[first:], result, args, fake)


def record_call(mod, kernel: str, sizes: dict, binding, launches, result, args, fake) -> FakeCall:
    """The FakeCall of one call of `mod.<kernel>` that recorded `launches` on `fake` (binding: the
    kernel's check of the call's `args`; result: what it returned): per launch, its plan and the
    tensors it reads and writes in ABI order (a split-KV pair's or an attention backward's steps with
    their workspace buffers).  Used by fake_call and `kspec selftest --fake`."""
    k = mod[kernel].entry
    by_id = {p.id: p for p in k.plans}
    ids = [_launch_plan(rec.what) for rec in launches]
    # one launch per plan, a split-KV pair (split kernel, then combine) for an attention plan, or
    # an attention backward's steps
    if [i for n, i in enumerate(ids) if n == 0 or ids[n - 1] != i] != [p.id for p in k.plans]:
        raise KspecInternalError(f"{kernel}: {len(k.plans)} plans but launches {ids} recorded")
    plan_args = []
    for pid, rec in zip(ids, launches):
        plan = by_id[pid]
        tensors = []
        for name, ptr in zip(plan.args, rec.prepare.ptrs if rec.prepare else ()):
            spec = k.tensor(name)
            shape = binding.extents(spec)
            if name in binding.views:
                strides = binding.views[name].strides
            elif name in result and hasattr(result[name], "strides"):
                strides = tuple(result[name].strides)
            else:
                strides = binding.strides[name]
            tensors.append(ArgTensor(name, int(ptr), tuple(shape), tuple(strides), spec.dtype))
        role = _launch_role(plan, rec.what)
        if role in ("split", "combine"):
            tensors = _split_kv_args(role, tensors, fake, rec, binding, k, plan)
        elif role is not None:
            tensors = attention_bwd_args(role, tensors, rec, binding, plan)
        plan_args.append(tensors)
    # allocated outputs: the pointers the glue got must be the ones returned to the caller
    for name, out in result.items():
        if name not in args:
            ptr = getattr(out, "ptr", None)
            used = {a.ptr for tl in plan_args for a in tl if a.name == name}
            if ptr is not None and used and used != {ptr}:
                raise KspecInternalError(f"{kernel}: output '{name}' returned at 0x{ptr:x} but written at {used}")
    return FakeCall(kernel, dict(sizes), binding, launches, plan_args, ids)


def _launch_plan(what: str) -> str:
    """The plan id in a launch's description ("plan '<id>' (<arch>[, variant <n>])")."""
    import re
    m = re.search(r"plan '([^']*)'", what)
    if m is None:
        raise KspecInternalError(f"a launch described as {what!r} names no plan")
    return m.group(1)


def _launch_variant(plan, what: str):
    """The artifact.Variant a launch ran, or None."""
    import re
    m = re.search(r"\((sm\w+), variant (\d+)\)", what)
    if m is None or m.group(1) not in plan.binaries:
        return None
    variants = plan.binaries[m.group(1)].variants
    return variants[int(m.group(2))] if int(m.group(2)) < len(variants) else None


def _launch_role(plan, what: str) -> str | None:
    """"split" or "combine" when the launch is one of a split-KV pair, a step of an attention
    backward (kspec.core.STEP_ROLES) when it is one of those (the variant's config role)."""
    v = _launch_variant(plan, what)
    role = v.config.get("role") if v is not None else None
    return role if role in ("split", "combine", *STEP_ROLES) else None


def attention_bwd_args(role: str, tensors: list[ArgTensor], rec: LaunchRecord, binding, plan) -> list[ArgTensor]:
    """What a launch of FlashAttention-4's attention backward reads and writes, in its kernel's order
    (backends/cute/attention_bwd.py tensors): the plan's tensors (Q, K, V, O, dO, LSE, dQ, dK, dV, the
    offsets of packed sequences, the used lengths of padded ones, then the aux tensors a score
    modification reads, the main kernel's) and the workspace's dq_accum [B, H, S_r * E_r], dpsum and lse_log2 [B, H, S_r], and with GQA dk_accum
    and dv_accum [B, HK, T_r * E_r] in place of dK and dV (f32, 256-byte aligned, the rounding from
    the variant's config; kspec.core.attention_bwd_layout)."""
    cfg = _launch_variant(plan, rec.what).config
    roles = dict(zip((r for r, _v in plan.dims), binding.dims(plan)))
    ws = rec.prepare.workspace if rec.prepare is not None else 0
    if not ws:
        raise KspecInternalError(f"{rec.what}: an attention backward launch without a workspace")
    packed = cfg.get("packed", "none").split(",")
    lay = attention_bwd_layout(cfg, roles)

    def buf(name):
        off, shape = lay[name]
        strides = tuple(math.prod(shape[a + 1:]) for a in range(len(shape)))
        return ArgTensor(f"<{name}>", ws + off, shape, strides, "f32")
    acc, dpsum, lse2 = buf("dq_accum"), buf("dpsum"), buf("lse_log2")
    q, k, v, o, do, lse, dq, dk, dv, *rest = tensors
    used = cfg.get("seqused", "none").split(",")
    cq = rest[:1] if "q" in packed else []
    ck = rest[len(cq):len(cq) + 1] if "k" in packed else []
    rest = rest[len(cq) + len(ck):]
    sq = rest[:1] if "q" in used else []                    # the used lengths of padded sequences
    sk = rest[len(sq):len(sq) + 1] if "k" in used else []
    aux = rest[len(sq) + len(sk):]                          # a score modification's tensors, last
    dk_acc, dv_acc = (buf("dk_accum"), buf("dv_accum")) if "dk_accum" in lay else (dk, dv)
    return {"bwd_preprocess": [o, do, dpsum, lse, lse2, acc, *cq, *sq],
            "bwd_main": [q, k, v, do, lse2, dpsum, acc, dk_acc, dv_acc, *cq, *ck, *sq, *sk, *aux],
            "bwd_postprocess": [acc, dq, *cq, *sq], "bwd_postprocess_dk": [dk_acc, dk], "bwd_postprocess_dv": [dv_acc, dv]}[role]


@dataclass(frozen=True)
class SplitWorkspace:
    """The split-KV partial buffers a pair of launches shares (backends/cute/splitkv.py): NS splits,
    O partials [NS, B, S, H, dv] f32 at the workspace, LSE partials [NS, B, H, S] f32 after them."""
    num_splits: int
    o_partial: ArgTensor
    lse_partial: ArgTensor
    nbytes: int


def split_workspace(fake: "FakeDriver", rec: LaunchRecord, B: int, H: int, S: int, dv: int) -> SplitWorkspace:
    """The partial buffers of a split-KV launch, from its workspace's size and the call's sizes: the
    split count is the one whose buffers (each 256-byte aligned) fill the workspace."""
    ws = rec.prepare.workspace if rec.prepare is not None else 0
    owner = fake._owner(ws) if ws else None
    if owner is None:
        raise KspecInternalError(f"{rec.what}: a split-KV launch without a workspace")
    nbytes = owner.ptr + owner.nbytes - ws
    rows = B * S * H
    for ns in range(2, 257):
        o = -(-(ns * rows * dv * 4) // 256) * 256
        if o + -(-(ns * rows * 4) // 256) * 256 == nbytes:
            return SplitWorkspace(
                ns, ArgTensor("<O partials>", ws, (ns, B, S, H, dv), (rows * dv, S * H * dv, H * dv, dv, 1), "f32"),
                ArgTensor("<LSE partials>", ws + o, (ns, B, H, S), (rows, H * S, S, 1), "f32"), nbytes)
    raise KspecInternalError(f"{rec.what}: a {nbytes}-byte workspace is no split-KV partial layout "
                             f"(B={B}, H={H}, S={S}, dv={dv})")


def _split_kv_args(role: str, tensors: list[ArgTensor], fake, rec: LaunchRecord, binding, k, plan) -> list[ArgTensor]:
    """What a launch of a split-KV pair reads and writes: the split kernel Q, K, V (and the plan's
    other inputs) with the partials in place of O and the LSE; the combine the partials, O and LSE."""
    roles = dict(zip((r for r, _v in plan.dims), binding.dims(plan)))
    ws = split_workspace(fake, rec, roles["B"], roles["H"], roles["S"], tensors[3].shape[-1])
    if role == "split":
        return [*tensors[:3], ws.o_partial, ws.lse_partial,
                *(t for t in tensors[4:] if k.tensor(t.name) is not None and
                  t.name not in {x.name for x in k.outputs})]
    return [ws.o_partial, ws.lse_partial, *(t for t in tensors[3:] if t.name in {x.name for x in k.outputs})]


def check_call(call: FakeCall, arch: str, mod) -> list[str]:
    """`check_launch` for every launch of a call; GEMM plans on TMA backends must feed both operands
    through TMA descriptors."""
    out = []
    k = mod[call.kernel].entry
    by_id = {p.id: p for p in k.plans}
    for pid, rec, args in zip(call.plan_ids, call.launches, call.plan_args):
        plan = by_id[pid]
        config = plan.binaries[arch].config if arch in plan.binaries else {}
        # CUTLASS GEMMs on sm90a/sm100a load both operands with TMA
        need = tuple(plan.args[:2]) if plan.kind == "gemm" and "kernel_schedule" in config else ()
        out += check_launch(rec, arch, args, require_tma=need)
    return out


def to_json(call: FakeCall) -> dict:
    """A JSON-ready summary of a fake call (for logs and `kspec selftest --fake`)."""
    return {"kernel": call.kernel, "sizes": call.sizes,
            "launches": [{"plan": pid, "what": r.what, "grid": r.grid, "block": r.block, "cluster": r.cluster,
                          "smem_bytes": r.smem_bytes, "params_bytes": len(r.params),
                          "tensor_maps_in_params": sorted(find_tensor_maps(r.params)),
                          "tensor_maps": [asdict(t) for t in (r.prepare.tensor_maps if r.prepare else ())]}
                         for pid, r in zip(call.plan_ids, call.launches)]}
