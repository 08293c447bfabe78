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

from typing import Any

from kspec.artifact import LAYOUTS, TensorSpec, layout_strides
from kspec.runtime import dtypes
from kspec.runtime.errors import KspecRuntimeError
from kspec.runtime.hostimage import (device_image, host_array, host_image, numpy_dtype, span_elements,  # noqa: F401
                                      unpack_fp4)


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
    return device_image(a, strides, want, what), tuple(int(n) for n in a.shape), strides, dtypes.storage(want)


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
        if name == "f4e2m1":                                 # float4_e2m1fn_x2: two values a byte
            raw = t.contiguous().view(torch.uint8).numpy()
            return unpack_fp4(raw).reshape(raw.shape[:-1] + (2 * raw.shape[-1],) if raw.ndim else (2,))
        if name in ("bf16", "f8e4m3", "f8e5m2", "f8e8m0"):   # numpy has no such dtypes: reinterpret the bits
            bits = t.contiguous().view(torch.int16 if name == "bf16" else torch.int8).numpy()
            return bits.view(numpy_dtype(name))
        return t.numpy()
    raise KspecRuntimeError(f"from_device: expected a DeviceArray or a torch tensor, got {type(x).__name__}")


def read_view(view, stream: int = 0, what: str = "a tensor"):
    """A host numpy copy of a tensor argument (`kspec.runtime.tensors.TensorView`), indexed like
    the tensor: one device-to-host copy of the bytes it spans, ordered after the work queued on
    `stream` and waited for.  Through the runtime's driver object (the fake driver on a CPU)."""
    import numpy as np
    from kspec.runtime import driver as _driver
    span = view.byte_range()
    if span is None:
        return np.empty(view.shape, dtype=numpy_dtype(view.dtype))
    lo, hi = span
    raw = _driver.get().copy_to_host(lo, hi - lo, stream, what)
    return host_array(raw, view.ptr - lo, view.shape, view.strides, view.dtype)


def from_numpy(array, dtype: str | None = None, *, layout: str = "row", device: int = 0):
    """A new DeviceArray holding a copy of a host numpy array in `layout` ("row" or "col"; see
    `to_device`, which also takes a TensorSpec).  Blocking; for tests and scripts."""
    return to_device(array, layout, dtype=dtype, device=device)
