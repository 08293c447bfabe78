"""kspec dtypes as the runtime sees them: storage size and their names in torch, DLPack and the
CUDA array interface, and the bit patterns `init` fills use."""
from __future__ import annotations

from dataclasses import dataclass

from kspec.core import DTYPE_TABLE, KspecInternalError
from kspec.runtime.errors import KspecRuntimeError


@dataclass(frozen=True)
class DType:
    name: str                     # kspec name
    itemsize: int
    typestr: str | None           # __cuda_array_interface__ typestr; None where numpy has none
    dlpack: tuple[int, int]       # (DLDataTypeCode, bits)
    torch: str                    # attribute of the torch module
    neg_inf: int                  # bit pattern of -inf (or the most negative finite value)


# tf32 is an f32 tensor in memory that the kernel reads with tf32 precision.  Sizes come from the
# one dtype table (kspec.core); this adds only what the runtime's interop needs.
DTYPES: dict[str, DType] = {d.name: d for d in (
    DType(name, DTYPE_TABLE[name].itemsize, typestr, dlpack, torch_name, neg_inf)
    for name, typestr, dlpack, torch_name, neg_inf in (
        ("f16", "<f2", (2, 16), "float16", 0xFC00),
        ("bf16", None, (4, 16), "bfloat16", 0xFF80),
        ("f32", "<f4", (2, 32), "float32", 0xFF800000),
        ("tf32", "<f4", (2, 32), "float32", 0xFF800000),
        ("f8e4m3", None, (10, 8), "float8_e4m3fn", 0xFE),    # e4m3fn has no inf: -448
        ("f8e5m2", None, (12, 8), "float8_e5m2", 0xFC),
        ("i8", "|i1", (0, 8), "int8", 0x80),
        ("i32", "<i4", (0, 32), "int32", 0x80000000),
        # DLPack 1.1 codes kDLFloat4_e2m1fn = 17 (torch float4_e2m1fn_x2 holds two a byte) and
        # kDLFloat8_e8m0fnu = 14; neither has -inf (e2m1: -6; e8m0 has no sign: 2^-127)
        ("f4e2m1", None, (17, 4), "float4_e2m1fn_x2", 0xF),
        ("f8e8m0", None, (14, 8), "float8_e8m0fnu", 0x00),
    ))}
if tuple(DTYPES) != tuple(DTYPE_TABLE):
    raise KspecInternalError("kspec.runtime.dtypes does not cover kspec.core.DTYPE_TABLE")

# What an argument's memory can be, whatever the spec calls it (tf32 tensors are f32 storage).
STORAGE = {d.name: d.storage for d in DTYPE_TABLE.values() if d.storage != d.name}

_FROM_TYPESTR = {"<f2": "f16", "<f4": "f32", "|i1": "i8", "<i1": "i8", "<i4": "i32",
                 "|u1": "u8", "<f8": "f64", "<i8": "i64", "<i2": "i16"}
_FROM_DLPACK = {(2, 16): "f16", (4, 16): "bf16", (2, 32): "f32", (10, 8): "f8e4m3", (12, 8): "f8e5m2",
                (14, 8): "f8e8m0", (17, 4): "f4e2m1",
                (0, 8): "i8", (0, 32): "i32", (2, 64): "f64", (0, 64): "i64", (1, 8): "u8",
                (0, 16): "i16", (6, 8): "bool"}
_FROM_TORCH = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "f8e4m3",
               "float8_e5m2": "f8e5m2", "int8": "i8", "int32": "i32", "float64": "f64",
               "float8_e8m0fnu": "f8e8m0", "float4_e2m1fn_x2": "f4e2m1",
               "int64": "i64", "uint8": "u8", "int16": "i16", "bool": "bool"}
# ml_dtypes/numpy names accepted by DeviceBuffer besides kspec names
_ALIASES = {"float16": "f16", "half": "f16", "bfloat16": "bf16", "float32": "f32", "float": "f32",
            "float8_e4m3fn": "f8e4m3", "float8_e5m2": "f8e5m2", "int8": "i8", "int32": "i32",
            "float8_e8m0fnu": "f8e8m0", "float4_e2m1fn": "f4e2m1"}


def storage(name: str) -> str:
    return STORAGE.get(name, name)


def itemsize(name: str) -> int:
    return DTYPES[name].itemsize


def from_typestr(typestr: str) -> str:
    """kspec name of a CUDA-array-interface typestr (or a descriptive foreign name)."""
    return _FROM_TYPESTR.get(typestr, f"typestr {typestr!r}")


def bits(name: str) -> int:
    """Storage bits of one value (4 for f4e2m1)."""
    return DTYPE_TABLE[name].bits


def span_bytes(name: str, shape, strides) -> int:
    """Bytes of memory a view of these extents and (non-negative) strides covers.  The one rule for
    a sub-byte dtype (f4e2m1): shapes and strides count values, packed two a byte along the
    contiguous axis, every other stride even (each row starts on a byte; tensors.check_packed), so
    the span is its values' bits rounded up to whole bytes."""
    shape, strides = tuple(shape), tuple(strides)
    if any(int(n) == 0 for n in shape):
        return 0
    values = sum((int(n) - 1) * int(s) for n, s in zip(shape, strides)) + 1
    return DTYPE_TABLE[name].storage_bytes(values) if name in DTYPE_TABLE else values * itemsize(name)


# torch's float4_e2m1fn_x2 (and its DLPack export: code 17, 4 bits x 2 lanes) counts bytes of two
# values; kspec's f4e2m1 views count values (DLPack's own packed f4e2m1: 4 bits x 1 lane)
FP4_X2_DLPACK = (17, 4, 2)


def from_dlpack(code: int, bits: int, lanes: int) -> str:
    if (code, bits, lanes) == FP4_X2_DLPACK:
        return "f4e2m1"
    if lanes != 1:
        return f"vector dtype (code {code}, {bits} bits x {lanes})"
    return _FROM_DLPACK.get((code, bits), f"DLPack dtype (code {code}, {bits} bits)")


def from_torch(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return _FROM_TORCH.get(name, name)


def normalize(dtype) -> str:
    """A dtype given by the user (kspec name, numpy/ml_dtypes dtype or its name, torch dtype)."""
    if isinstance(dtype, str):
        if dtype in DTYPES:
            return dtype
        if dtype in _ALIASES:
            return _ALIASES[dtype]
    else:
        name = str(dtype).removeprefix("torch.")
        if name in _ALIASES:
            return _ALIASES[name]
        for attr in ("name", "__name__"):       # numpy dtypes, numpy/ml_dtypes scalar types
            nm = getattr(dtype, attr, None)
            if isinstance(nm, str) and nm in _ALIASES:
                return _ALIASES[nm]
    raise KspecRuntimeError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
