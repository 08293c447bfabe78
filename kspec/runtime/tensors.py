"""Tensor arguments: what the runtime accepts and how it reads pointer, shape, strides, dtype and
device from each kind, without touching the GPU.

Accepted, in this order of precedence:
- `DeviceBuffer` (a raw device pointer with explicit shape/dtype) and the runtime's own
  `DeviceArray` outputs;
- torch tensors (read natively; torch is never imported by kspec, only used when the caller has);
- any object with `__dlpack__`/`__dlpack_device__` (the capsule is read with ctypes);
- any object with `__cuda_array_interface__` (v2/v3; its `stream`, when given, is waited on).
Strides are in elements everywhere in the runtime.
"""
from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import dataclass
from typing import Any

from kspec.runtime import dtypes
from kspec.runtime.errors import KspecRuntimeError

ACCEPTED = ("a torch CUDA tensor, an object with __dlpack__ or __cuda_array_interface__, "
            "or kspec.runtime.DeviceBuffer(ptr, shape, dtype)")


@dataclass
class TensorView:
    """What the runtime needs to know about one tensor argument."""
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]          # elements
    dtype: str                        # kspec name, or a descriptive foreign name
    device: int | None                # CUDA ordinal when the source says; else asked of the driver
    source: str
    readonly: bool = False
    stream: int | None = None         # producer stream to order after (CUDA array interface v3)
    keepalive: Any = None             # e.g. a DLPack capsule

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def byte_range(self) -> tuple[int, int] | None:
        """[lo, hi) of the bytes the tensor spans, None when empty."""
        if self.numel == 0:
            return None
        bits = dtypes.bits(self.dtype) if self.dtype in dtypes.DTYPES else 8
        lo = hi = 0
        for n, s in zip(self.shape, self.strides):
            span = s * (n - 1)
            lo, hi = (lo + span, hi) if span < 0 else (lo, hi + span)
        # (sub-byte values: whole bytes, the span rounded outwards)
        return self.ptr + (lo * bits) // 8, self.ptr + ((hi + 1) * bits + 7) // 8


class DeviceBuffer:
    """A raw CUDA device pointer described by hand: `DeviceBuffer(ptr, shape, dtype, strides=None)`.
    `dtype` is a kspec dtype name ("f16", "bf16", ...) or a numpy/torch dtype; `strides` are in
    elements (None = C-contiguous).  kspec does not own or free the memory."""

    def __init__(self, ptr: int, shape, dtype, strides=None, device: int | None = None):
        if isinstance(ptr, bool) or not isinstance(ptr, int):
            try:
                ptr = int(ptr)            # CUdeviceptr and friends
            except (TypeError, ValueError):
                raise KspecRuntimeError(f"DeviceBuffer: ptr must be an integer address, got {type(ptr).__name__}") from None
        self.ptr = ptr
        self.shape = tuple(int(n) for n in shape)
        if any(n < 0 for n in self.shape):
            raise KspecRuntimeError(f"DeviceBuffer: negative extent in shape {self.shape}")
        self.dtype = dtypes.normalize(dtype)
        self.strides = tuple(int(s) for s in strides) if strides is not None else _c_strides(self.shape)
        if len(self.strides) != len(self.shape):
            raise KspecRuntimeError(f"DeviceBuffer: {len(self.strides)} strides for rank {len(self.shape)}")
        self.device = device

    @property
    def __cuda_array_interface__(self) -> dict:
        return _cai(self.ptr, self.shape, self.strides, self.dtype, None)

    def __repr__(self) -> str:
        return f"DeviceBuffer(0x{self.ptr:x}, shape={self.shape}, dtype={self.dtype!r}, strides={self.strides})"


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _cai(ptr, shape, strides, dtype, stream) -> dict:
    d = dtypes.DTYPES[dtype]
    # numpy has no bf16/f8 typestr; consumers that need them should use DLPack or torch
    typestr = d.typestr or f"|V{d.itemsize}"
    return {"version": 3, "shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
            "strides": tuple(s * d.itemsize for s in strides), "descr": [("", typestr)],
            "stream": stream}


def is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, getattr(torch, "Tensor", ()))


def is_tensor_like(obj: Any) -> bool:
    return (isinstance(obj, DeviceBuffer) or hasattr(obj, "_kspec_view") or is_torch_tensor(obj)
            or hasattr(obj, "__dlpack__") or hasattr(obj, "__cuda_array_interface__"))


def as_view(obj: Any, what: str, stream: int) -> TensorView:
    """Describe `obj` (argument `what`, e.g. "argument 'A'").  `stream` is the launch stream, given
    to DLPack producers so they order their pending work before it."""
    v = _as_view(obj, what, stream)
    if v.dtype == "f4e2m1":
        check_packed(v.shape, v.strides, what)
    return v


def check_packed(shape, strides, what: str) -> None:
    """The rule for f4e2m1 (dtypes.span_bytes): values packed two a byte along the one contiguous
    axis, so every other stride (of an axis longer than 1) is even: each row starts on a byte."""
    odd = [(i, s) for i, (n, s) in enumerate(zip(shape, strides)) if n > 1 and s != 1 and s % 2]
    if odd or any(s < 0 for s in strides):
        raise KspecRuntimeError(
            f"{what}: f4e2m1 strides {tuple(strides)} (in values): FP4 values are packed two a byte along the "
            "contiguous axis, so every other stride must be even and non-negative (rows start on a byte)",
            hint="make the contiguous extent even (e.g. K a multiple of 2)")


def _fp4_values(shape, strides):
    """Shape and strides of a torch float4_e2m1fn_x2 tensor (bytes of two values) in values: the
    contiguous axis twice as long, the other strides doubled."""
    unit = next((i for i in range(len(shape) - 1, -1, -1) if strides[i] == 1), None)
    shape = tuple(n * 2 if i == unit else n for i, n in enumerate(shape))
    strides = tuple(s if i == unit else s * 2 for i, s in enumerate(strides))
    return shape, strides


def _as_view(obj: Any, what: str, stream: int) -> TensorView:
    if isinstance(obj, DeviceBuffer):
        return TensorView(obj.ptr, obj.shape, obj.strides, obj.dtype, obj.device, "DeviceBuffer")
    view_fn = getattr(obj, "_kspec_view", None)
    if view_fn is not None:
        return view_fn()
    if is_torch_tensor(obj):
        return _from_torch(obj, what)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(obj, what, stream)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cai(obj, what)
    if hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
        raise KspecRuntimeError(f"{what}: got a host array ({type(obj).__name__}); expected {ACCEPTED}")
    raise KspecRuntimeError(f"{what}: expected {ACCEPTED}, got {type(obj).__name__}")


def _from_torch(t: Any, what: str) -> TensorView:
    if not t.is_cuda:
        raise KspecRuntimeError(f"{what}: torch tensor is on {t.device}; expected a CUDA tensor",
                                hint="move it with .cuda()")
    shape, strides = tuple(int(n) for n in t.shape), tuple(int(s) for s in t.stride())
    dtype = dtypes.from_torch(t.dtype)
    if dtype == "f4e2m1":                  # float4_e2m1fn_x2: bytes of two values
        shape, strides = _fp4_values(shape, strides)
    return TensorView(int(t.data_ptr()), shape, strides, dtype, int(t.device.index or 0), "torch")


def _from_cai(obj: Any, what: str) -> TensorView:
    try:
        cai = obj.__cuda_array_interface__
        ptr, readonly = cai["data"]
        shape = tuple(int(n) for n in cai["shape"])
        typestr = cai["typestr"]
    except Exception as e:  # a malformed interface is the caller's object, not our bug
        raise KspecRuntimeError(f"{what}: unreadable __cuda_array_interface__ ({e!r})") from None
    if cai.get("mask") is not None:
        raise KspecRuntimeError(f"{what}: masked arrays are not supported")
    dtype = dtypes.from_typestr(typestr)
    if dtype.startswith("typestr") and typestr.startswith(("|V", "<V")):
        # bf16/f8 have no numpy typestr; a foreign void type is ambiguous
        dtype = f"untyped {typestr!r} (bf16/f8 cannot be described by __cuda_array_interface__; pass a torch tensor, a DLPack object or a DeviceBuffer)"
    size = dtypes.itemsize(dtype) if dtype in dtypes.DTYPES else _typestr_size(typestr)
    bstrides = cai.get("strides")
    if bstrides is None:
        strides = _c_strides(shape)
    else:
        if any(int(s) % size for s in bstrides):
            raise KspecRuntimeError(f"{what}: byte strides {tuple(bstrides)} are not multiples of the "
                                    f"{size}-byte element size")
        strides = tuple(int(s) // size for s in bstrides)
    stream = cai.get("stream") if int(cai.get("version", 2)) >= 3 else None
    if ptr is None:
        ptr = 0
    return TensorView(int(ptr), shape, strides, dtype, None, "__cuda_array_interface__",
                      readonly=bool(readonly), stream=stream)


def _typestr_size(typestr: str) -> int:
    try:
        return max(int(typestr[2:]), 1)
    except (ValueError, TypeError):
        return 1


# ---- DLPack, read with ctypes (dlpack.h v1.x; versioned capsules are preferred when offered)

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_kDLCUDA, _kDLCUDAManaged = 2, 13
_DLPACK_FLAG_READ_ONLY = 1
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_is_valid.restype = ctypes.c_int
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_pointer.restype = ctypes.c_void_p


def _from_dlpack(obj: Any, what: str, stream: int) -> TensorView:
    try:
        dev_type, dev_id = obj.__dlpack_device__()
    except Exception as e:
        raise KspecRuntimeError(f"{what}: __dlpack_device__ failed ({e!r})") from None
    if int(dev_type) not in (_kDLCUDA, _kDLCUDAManaged):
        where = {1: "the CPU", 3: "pinned host memory"}.get(int(dev_type), f"DLPack device type {int(dev_type)}")
        raise KspecRuntimeError(f"{what}: {type(obj).__name__} is on {where}; expected a CUDA tensor")
    # DLPack stream convention: 1 = legacy default stream, else the stream handle
    s = stream if stream not in (0, None) else 1
    capsule = None
    for kwargs in ({"stream": s, "max_version": (1, 0)}, {"stream": s}, {}):
        try:
            capsule = obj.__dlpack__(**kwargs)
            break
        except TypeError:
            continue
        except Exception as e:
            raise KspecRuntimeError(f"{what}: __dlpack__ failed ({e!r})") from None
    if capsule is None:
        raise KspecRuntimeError(f"{what}: __dlpack__ rejected every calling convention")
    readonly = False
    if _capsule_is_valid(capsule, b"dltensor_versioned"):
        m = _DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, b"dltensor_versioned"))
        if m.version.major != 1:
            raise KspecRuntimeError(f"{what}: DLPack version {m.version.major}.{m.version.minor} is not supported")
        t = m.dl_tensor
        readonly = bool(m.flags & _DLPACK_FLAG_READ_ONLY)
    elif _capsule_is_valid(capsule, b"dltensor"):
        t = _DLManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor")).dl_tensor
    else:
        raise KspecRuntimeError(f"{what}: __dlpack__ returned {type(capsule).__name__}, not an unconsumed DLPack capsule")
    ndim = int(t.ndim)
    shape = tuple(int(t.shape[i]) for i in range(ndim))
    strides = tuple(int(t.strides[i]) for i in range(ndim)) if t.strides else _c_strides(shape)
    dtype = dtypes.from_dlpack(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    if (t.dtype.code, t.dtype.bits, t.dtype.lanes) == dtypes.FP4_X2_DLPACK:     # torch's float4_e2m1fn_x2
        shape, strides = _fp4_values(shape, strides)
    ptr = int(t.data or 0) + int(t.byte_offset)
    # The capsule stays unconsumed: its destructor calls the producer's deleter when we drop it.
    return TensorView(ptr, shape, strides, dtype, int(dev_id), "DLPack", readonly=readonly,
                      keepalive=capsule)
