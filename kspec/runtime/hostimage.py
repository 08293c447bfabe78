"""Host-side images of device memory: the numpy dtype of a kspec dtype's storage, and the flat
buffer an upload copies for given element strides (pure numpy; used by the driver's DeviceArray
and by kspec.runtime.transfer)."""
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
    if name == "f4e2m1":
        # two values a byte in device memory: no numpy dtype holds that layout
        raise KspecRuntimeError("host arrays of f4e2m1 (two values a byte on the device) are not supported by the "
                                "runtime's transfers", hint="pass device tensors (torch float4_e2m1fn_x2)")
    if name in ("bf16", "f8e4m3", "f8e5m2", "f8e8m0"):
        try:
            import ml_dtypes
        except ImportError:
            raise KspecRuntimeError(f"host arrays of {name} need the ml_dtypes package",
                                    hint="pip install ml_dtypes") from None
        return np.dtype({"bf16": ml_dtypes.bfloat16, "f8e4m3": ml_dtypes.float8_e4m3fn,
                         "f8e5m2": ml_dtypes.float8_e5m2, "f8e8m0": ml_dtypes.float8_e8m0fnu}[name])
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
    image = np.zeros(span_elements(a.shape, strides), dtype=a.dtype)
    if a.size:
        view = np.lib.stride_tricks.as_strided(image, a.shape, tuple(s * a.dtype.itemsize for s in strides))
        view[...] = a
    return image
