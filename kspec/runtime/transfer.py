"""Host <-> device copies in a tensor's layout: the one place that knows how a host numpy array
becomes device memory of a spec's `row` or `col` layout, used by `kspec run`, the GPU tests and
users alike.

    d = kspec.runtime.to_device(B, "col")           # B: a host (K, N) array -> column-major device copy
    d = kspec.runtime.to_device(B, spec)            # spec: an artifact TensorSpec (its layout and dtype)
    args = mod.gemm.to_device(A, B, bias)           # every named tensor in its spec's layout and dtype
    host = kspec.runtime.from_device(out["D"])      # back to a numpy array indexed like the tensor

A host array is indexed logically (`B[k, n]`), whatever its own numpy strides; the device copy
holds the same values at the strides the layout fixes (`kspec.artifact.layout_strides`), so a
`col` tensor's device bytes are column-major.  `host_image` computes those bytes on the host: it
is what an upload copies, and needs no GPU.
"""
from __future__ import annotations

import math
from typing import Any

from kspec.artifact import LAYOUTS, TensorSpec, layout_strides
from kspec.runtime import dtypes
from kspec.runtime.errors import KspecRuntimeError


def numpy_dtype(name: str):
    """The numpy dtype holding a kspec dtype's storage (bf16 and fp8 need ml_dtypes, imported only
    here and only for them)."""
    import numpy as np
    name = dtypes.storage(name)
    if name in ("bf16", "f8e4m3", "f8e5m2"):
        try:
            import ml_dtypes
        except ImportError:
            raise KspecRuntimeError(f"host arrays of {name} need the ml_dtypes package",
                                    hint="pip install ml_dtypes") from None
        return np.dtype({"bf16": ml_dtypes.bfloat16, "f8e4m3": ml_dtypes.float8_e4m3fn,
                         "f8e5m2": ml_dtypes.float8_e5m2}[name])
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


def _layout_and_dtype(spec_or_layout: Any, dtype: Any) -> tuple[str, str | None, str]:
    if isinstance(spec_or_layout, TensorSpec):
        want = dtypes.storage(spec_or_layout.dtype) if dtype is None else dtypes.normalize(dtype)
        return spec_or_layout.layout, want, f"'{spec_or_layout.name}'"
    if spec_or_layout not in LAYOUTS:
        raise KspecRuntimeError(f"to_device: layout must be one of {', '.join(LAYOUTS)} or a TensorSpec, "
                                f"got {spec_or_layout!r}")
    return spec_or_layout, (None if dtype is None else dtypes.normalize(dtype)), "array"


def staged(array: Any, spec_or_layout: Any = "row", dtype: Any = None):
    """(host image, shape, element strides, kspec dtype) of an upload, computed on the host.
    `array` is converted to the target dtype's storage with numpy's astype when it differs."""
    import numpy as np
    layout, want, what = _layout_and_dtype(spec_or_layout, dtype)
    a = np.asarray(array)
    if layout == "col" and a.ndim < 2:
        raise KspecRuntimeError(f"{what}: layout 'col' needs rank >= 2, got shape {a.shape}")
    if want is None:
        want = dtypes.normalize(a.dtype)
    np_dtype = numpy_dtype(want)
    if a.dtype != np_dtype:
        a = a.astype(np_dtype)
    strides = layout_strides(tuple(a.shape), layout)
    return host_image(a, strides, what), tuple(int(n) for n in a.shape), strides, dtypes.storage(want)


def to_device(array: Any, spec_or_layout: Any = "row", *, dtype: Any = None, device: int = 0,
              stream: int = 0):
    """A new `DeviceArray` holding `array` in a layout ("row", "col" or a TensorSpec's).  Blocking
    copy; for tests and scripts (pass torch/cupy tensors to kernels directly in real code)."""
    from kspec.runtime.driver import DeviceArray
    image, shape, strides, name = staged(array, spec_or_layout, dtype)
    return DeviceArray(shape, name, strides, device=device, stream=stream).copy_from_image(image)


def from_device(x: Any):
    """A host numpy array of a kernel output or input (`DeviceArray` or torch tensor), indexed
    like the tensor whatever its layout.  Blocking."""
    if hasattr(x, "to_numpy"):
        return x.to_numpy()
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        name = dtypes.from_torch(t.dtype)
        if name in ("bf16", "f8e4m3", "f8e5m2"):   # numpy has no such dtypes: reinterpret the bits
            bits = t.contiguous().view(torch.int16 if name == "bf16" else torch.int8).numpy()
            return bits.view(numpy_dtype(name))
        return t.numpy()
    raise KspecRuntimeError(f"from_device: expected a DeviceArray or a torch tensor, got {type(x).__name__}")
