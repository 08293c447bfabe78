"""Host-side images of device memory: the numpy dtype of a kspec dtype's storage, the flat buffer
an upload copies for given element strides, and the way back from device bytes to a host array
(pure numpy; used by the driver's DeviceArray, kspec.runtime.transfer and kspec selftest).

FP4 (f4e2m1): a host array holds one value a byte (ml_dtypes.float4_e2m1fn, the 4-bit code in the
low nibble); device memory packs two a byte along the contiguous axis, value 2i in the low nibble
of byte i (kspec.runtime.dtypes.span_bytes).  `device_image` packs and `host_array` unpacks, so
strides stay in values on both sides."""
from __future__ import annotations

import math
from typing import Any

from kspec.runtime import dtypes
from kspec.runtime.errors import KspecRuntimeError


def numpy_dtype(name: str):
    """The numpy dtype holding a kspec dtype's storage (bf16 and fp8 need ml_dtypes, imported only
    here and only for them)."""
    import numpy as np
    name = dtypes.storage(name)
    if name in ("bf16", "f8e4m3", "f8e5m2", "f8e8m0", "f4e2m1"):
        try:
            import ml_dtypes
        except ImportError:
            raise KspecRuntimeError(f"host arrays of {name} need the ml_dtypes package",
                                    hint="pip install ml_dtypes") from None
        return np.dtype({"bf16": ml_dtypes.bfloat16, "f8e4m3": ml_dtypes.float8_e4m3fn,
                         "f8e5m2": ml_dtypes.float8_e5m2, "f8e8m0": ml_dtypes.float8_e8m0fnu,
                         "f4e2m1": ml_dtypes.float4_e2m1fn}[name])   # FP4: a value a byte on the host
    return np.dtype({"f16": np.float16, "f32": np.float32, "i8": np.int8, "i32": np.int32}[name])


def span_elements(shape, strides) -> int:
    """Elements of memory a dense tensor of these extents and (non-negative) strides covers."""
    if math.prod(shape) == 0:
        return 0
    return sum((int(n) - 1) * int(s) for n, s in zip(shape, strides)) + 1


def host_image(array: Any, strides, what: str = "array"):
    """The flat host buffer an upload copies: `array`'s values placed at element `strides` (so
    `as_strided(image, array.shape, strides * itemsize)` reads back `array`)."""
    import numpy as np
    a = np.asarray(array)
    strides = tuple(int(s) for s in strides)
    if len(strides) != a.ndim or any(s < 0 for s in strides):
        raise KspecRuntimeError(f"{what}: strides {strides} do not fit an array of shape {a.shape}")
    # placed as unsigned integers of the same width: numpy's as_strided cannot rebuild some ml_dtypes
    # arrays from their array interface (float8_e5m2's typestr '<f1' is "not understood")
    bits = _as_uint(a)
    image = np.zeros(span_elements(a.shape, strides), dtype=bits.dtype)
    if a.size:
        view = np.lib.stride_tricks.as_strided(image, a.shape, tuple(s * a.dtype.itemsize for s in strides))
        view[...] = bits
    return image.view(a.dtype)


def _as_uint(a):
    """`a` viewed as unsigned integers of its element width (no copy)."""
    import numpy as np
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def pack_fp4(a):
    """E2M1 values (ml_dtypes float4_e2m1fn, a byte each, the code in the low 4 bits) packed two a
    byte along the last axis, whose length must be even: value 2i in the low nibble of byte i."""
    import numpy as np
    codes = np.ascontiguousarray(a).view(np.uint8) & 0xF
    if codes.shape[-1] % 2:
        raise KspecRuntimeError(f"f4e2m1 rows of {codes.shape[-1]} values do not fill whole bytes",
                                hint="FP4 values are packed two a byte: make the contiguous extent even")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _flat_bytes(raw):
    """`raw` (bytes, or a numpy array of them) as a flat uint8 array, without a copy."""
    import numpy as np
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return np.frombuffer(raw, dtype=np.uint8)
    return np.ascontiguousarray(raw).view(np.uint8).ravel()


def unpack_fp4(raw):
    """The inverse of pack_fp4 on a flat byte buffer: 2 * len(raw) float4_e2m1fn values."""
    import numpy as np
    b = _flat_bytes(raw)
    codes = np.empty(2 * b.size, dtype=np.uint8)
    codes[0::2], codes[1::2] = b & 0xF, b >> 4
    return codes.view(numpy_dtype("f4e2m1"))


def device_image(array: Any, strides, name: str, what: str = "array"):
    """The bytes an upload of `array` (already of `name`'s host dtype) copies to a view at value
    `strides`: `host_image`, packed two values a byte for f4e2m1 (strides must then follow the
    packing rule: kspec.runtime.tensors.check_packed)."""
    image = host_image(array, strides, what)
    if dtypes.storage(name) != "f4e2m1":
        return image
    import numpy as np
    from kspec.runtime.tensors import check_packed
    check_packed(np.shape(array), strides, what)
    if image.size % 2:                       # the last byte's high nibble lies past the view
        image = np.concatenate([image, np.zeros(1, image.dtype)])
    return pack_fp4(image)


def host_array(raw, first: int, shape, strides, name: str):
    """A host array indexed like a device view, from `raw`, the bytes copied from device memory
    beginning at or before the view; `first` is the view's start within them, in bytes."""
    import numpy as np
    np_dtype = numpy_dtype(name)
    if dtypes.storage(name) == "f4e2m1":
        flat, first = unpack_fp4(raw), 2 * first      # one value a byte: offsets in values
    else:
        flat, first = _flat_bytes(raw).view(np_dtype), first // np_dtype.itemsize
    item = np_dtype.itemsize
    bits = _as_uint(flat[first:])                      # (as host_image: strided views of unsigned ints)
    return np.lib.stride_tricks.as_strided(bits, tuple(shape), tuple(s * item for s in strides)).copy().view(np_dtype)
