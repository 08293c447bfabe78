"""The CUDA driver as the runtime uses it, through cuda-python 13 (`cuda.bindings.driver`).

Nothing here runs at import: cuda.bindings is imported, and libcuda loaded, on the first call
that needs a device, and a machine without either gets `KspecRuntimeError("no CUDA device: ...")`.

`Driver` is the process's explicit cache of driver state: retained primary contexts, device
facts, loaded modules/functions, and the dynamic-shared-memory limit set on each function.

Memory during a call is stream-ordered (`cuMemAllocAsync`/`cuMemFreeAsync` on the launch stream),
so a call never synchronises and can be captured into a CUDA graph (the allocations become graph
memory nodes).  `DeviceArray` is the small output allocator used when torch is not in use.
"""
from __future__ import annotations

import ctypes
import math
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from kspec.runtime import dtypes
from kspec.runtime.errors import KspecRuntimeError
from kspec.runtime.tensors import TensorView, _c_strides, _cai

_SPECIAL_STREAMS = (0, 1, 2)   # NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
_lock = threading.Lock()
_driver: "Driver | None" = None


def get() -> "Driver":
    global _driver
    with _lock:
        if _driver is None:
            _driver = Driver()
        return _driver


@contextmanager
def use(drv) -> Iterator[Any]:
    """Make `get()` return `drv` inside the block and restore the previous driver after.

    The one injection point for a stand-in driver: `kspec.runtime.fakedriver.FakeDriver` records
    every launch on a machine without a GPU (tests, `kspec selftest --fake`)."""
    global _driver
    with _lock:
        previous, _driver = _driver, drv
    try:
        yield drv
    finally:
        with _lock:
            _driver = previous


def _cu():
    from cuda.bindings import driver as cu  # deferred: importing must not need libcuda
    return cu


LAUNCH_CONFIGS = 256        # launch configurations a Driver keeps (Driver.launch_config)


def _make_launch_config(grid, block, cluster, smem: int, stream: int):
    cu = _cu()
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(g) for g in grid)
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(b) for b in block)
    cfg.sharedMemBytes = int(smem)
    cfg.hStream = cu.CUstream(int(stream))
    if math.prod(cluster) > 1:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = (int(c) for c in cluster)
        cfg.attrs = [attr]
        cfg.numAttrs = 1
    else:
        cfg.numAttrs = 0
    return cfg


class Driver:
    def __init__(self):
        self._ready: bool | None = None
        self._why = ""
        self._primary: dict[int, Any] = {}
        self._facts: dict[int, tuple[int, int, int, str]] = {}
        self._functions: dict[tuple, Any] = {}
        self._smem_set: dict[int, int] = {}
        self._param_size: dict[int, int] = {}
        self._param_layout: dict[int, tuple | None] = {}
        self._configs: dict[tuple, Any] = {}

    # ------------------------------------------------------------------ errors and availability
    def call(self, fn_name: str, *args, what: str = "") -> Any:
        cu = _cu()
        res = getattr(cu, fn_name)(*args)
        err = res[0] if isinstance(res, tuple) else res
        if err != cu.CUresult.CUDA_SUCCESS:
            raise KspecRuntimeError(f"{what + ': ' if what else ''}{fn_name} failed: {self.error_text(err)}")
        if not isinstance(res, tuple) or len(res) == 1:
            return None
        return res[1] if len(res) == 2 else res[1:]

    @staticmethod
    def error_text(err) -> str:
        cu = _cu()
        try:
            _, name = cu.cuGetErrorName(err)
            _, text = cu.cuGetErrorString(err)
            return f"{name.decode()} ({text.decode()})"
        except Exception:
            return str(err)

    def available(self) -> tuple[bool, str]:
        """(True, "") when the driver initialises and reports a device; else (False, why)."""
        if self._ready is None:
            self._ready, self._why = self._probe()
        return self._ready, self._why

    @staticmethod
    def _probe() -> tuple[bool, str]:
        try:
            cu = _cu()
        except Exception as e:
            return False, f"cuda-python (cuda.bindings) is not importable ({e})"
        try:
            err = cu.cuInit(0)[0]
        except Exception as e:   # cuda.pathfinder raises when libcuda.so is absent
            return False, f"the NVIDIA driver library (libcuda) could not be loaded ({type(e).__name__}: {e})"
        if err != cu.CUresult.CUDA_SUCCESS:
            return False, f"cuInit failed: {Driver.error_text(err)}"
        err, count = cu.cuDeviceGetCount()
        if err != cu.CUresult.CUDA_SUCCESS:
            return False, f"cuDeviceGetCount failed: {Driver.error_text(err)}"
        if count == 0:
            return False, "the driver reports no CUDA devices"
        return True, ""

    def require_device(self) -> None:
        ok, why = self.available()
        if not ok:
            raise KspecRuntimeError(f"no CUDA device: {why}",
                                    hint="kspec.load() works anywhere, but calling a kernel needs an "
                                         "sm_90a (Hopper) or sm_100a (Blackwell) GPU")

    # ------------------------------------------------------------------ devices and contexts
    def device_count(self) -> int:
        return int(self.call("cuDeviceGetCount"))

    def facts(self, ordinal: int) -> tuple[int, int, int, str]:
        """(cc major, cc minor, multiprocessor count, name) of a device."""
        if ordinal not in self._facts:
            cu = _cu()
            n = self.device_count()
            if not 0 <= ordinal < n:
                raise KspecRuntimeError(f"cuda:{ordinal} does not exist ({n} device(s))")
            dev = self.call("cuDeviceGet", ordinal)
            A = cu.CUdevice_attribute
            major = self.call("cuDeviceGetAttribute", A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
            minor = self.call("cuDeviceGetAttribute", A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
            sms = self.call("cuDeviceGetAttribute", A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
            name = self.call("cuDeviceGetName", 256, dev)
            name = name.split(b"\0", 1)[0].decode(errors="replace") if isinstance(name, bytes) else str(name)
            self._facts[ordinal] = (int(major), int(minor), int(sms), name)
        return self._facts[ordinal]

    def primary_context(self, ordinal: int):
        # retained once per process and never released: the runtime may launch on it at any time
        if ordinal not in self._primary:
            dev = self.call("cuDeviceGet", ordinal)
            self._primary[ordinal] = self.call("cuDevicePrimaryCtxRetain", dev,
                                               what=f"cuda:{ordinal}")
        return self._primary[ordinal]

    def stream_context(self, stream: int):
        """The context a user stream belongs to (None for the special NULL/legacy/per-thread)."""
        if stream in _SPECIAL_STREAMS:
            return None
        cu = _cu()
        return self.call("cuStreamGetCtx", cu.CUstream(stream), what="the stream argument")

    def current_device(self) -> int | None:
        ctx = self.call("cuCtxGetCurrent")
        if ctx is None or int(ctx) == 0:
            return None
        return int(self.call("cuCtxGetDevice"))

    @contextmanager
    def current(self, ctx) -> Iterator[None]:
        """Make `ctx` current for the block and restore the caller's context after."""
        self.call("cuCtxPushCurrent", ctx)
        try:
            yield
        finally:
            self.call("cuCtxPopCurrent")

    def context_device(self, ctx) -> int:
        with self.current(ctx):
            return int(self.call("cuCtxGetDevice"))

    def pointer_device(self, ptr: int, what: str) -> int:
        """Device ordinal of device memory at `ptr` (a context must be current)."""
        cu = _cu()
        P = cu.CUpointer_attribute
        res = cu.cuPointerGetAttribute(P.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, cu.CUdeviceptr(ptr))
        if res[0] != cu.CUresult.CUDA_SUCCESS:
            raise KspecRuntimeError(f"{what}: 0x{ptr:x} is not CUDA memory ({self.error_text(res[0])})")
        mem_type = int(res[1])
        if mem_type == int(cu.CUmemorytype.CU_MEMORYTYPE_HOST):
            raise KspecRuntimeError(f"{what}: 0x{ptr:x} is host memory; expected device memory")
        return int(self.call("cuPointerGetAttribute", P.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                             cu.CUdeviceptr(ptr), what=what))

    # ------------------------------------------------------------------ code
    def function(self, ctx, key: tuple, image: bytes, symbol: str, what: str):
        """`symbol` of cubin `image` in context `ctx`, loaded once per context."""
        k = (int(ctx), *key)
        if k not in self._functions:
            mod = self.call("cuModuleLoadData", image, what=f"loading {what}")
            self._functions[k] = self.call("cuModuleGetFunction", mod, symbol.encode(), what=what)
        return self._functions[k]

    def param_size(self, func) -> int | None:
        """Size of the kernel's single by-value parameter as the cubin declares it."""
        k = int(func)
        if k not in self._param_size:
            cu = _cu()
            res = cu.cuFuncGetParamInfo(func, 0)
            self._param_size[k] = int(res[2]) if res[0] == cu.CUresult.CUDA_SUCCESS else -1
        v = self._param_size[k]
        return None if v < 0 else v

    def param_layout(self, func) -> tuple[tuple[int, int], ...] | None:
        """(offset, size) of every kernel parameter as the cubin declares it, offsets relative to
        the first parameter's; None where the driver cannot say."""
        k = int(func)
        if k not in self._param_layout:
            cu = _cu()
            out = []
            for i in range(4096):
                res = cu.cuFuncGetParamInfo(func, i)
                if res[0] != cu.CUresult.CUDA_SUCCESS:
                    break
                out.append((int(res[1]), int(res[2])))
            self._param_layout[k] = tuple((o - out[0][0], n) for o, n in out) if out else None
        return self._param_layout[k]

    def set_dynamic_smem(self, func, nbytes: int, what: str) -> None:
        k = int(func)
        if self._smem_set.get(k, -1) >= nbytes:
            return
        cu = _cu()
        self.call("cuFuncSetAttribute", func,
                  cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes),
                  what=f"{what}: {nbytes} bytes of dynamic shared memory")
        self._smem_set[k] = nbytes

    def launch(self, func, grid, block, cluster, smem: int, stream: int, params_ptr: int, what: str,
               param_offsets: tuple[int, ...] | None = None) -> None:
        """param_offsets: None for kernels with one by-value Params struct (CUTLASS C++, generic);
        else the byte offset of each kernel parameter inside the blob (CuTe DSL kernels)."""
        cfg = self.launch_config(grid, block, cluster, smem, stream)
        # kernelParams is a void**: one entry per kernel parameter, pointing at its bytes in the blob
        offsets = param_offsets if param_offsets else (0,)
        argv = (ctypes.c_void_p * len(offsets))(*(params_ptr + o for o in offsets))
        self.call("cuLaunchKernelEx", cfg, func, ctypes.addressof(argv), 0, what=f"launching {what}")

    def launch_config(self, grid, block, cluster, smem: int, stream: int):
        """The CUlaunchConfig of a launch, made once per (grid, block, cluster, smem, stream) and
        kept (LAUNCH_CONFIGS of them, oldest dropped first): building one through cuda-python costs
        about 5 us (9 us with a cluster attribute), a lookup 0.1 us.  The driver reads the struct
        during cuLaunchKernelEx and keeps nothing of it, so one object serves every launch."""
        key = (tuple(grid), tuple(block), tuple(cluster), smem, stream)
        cfg = self._configs.get(key)
        if cfg is None:
            if len(self._configs) >= LAUNCH_CONFIGS:
                del self._configs[next(iter(self._configs))]
            cfg = self._configs[key] = _make_launch_config(*key)
        return cfg

    # ------------------------------------------------------------------ memory and streams
    def alloc_async(self, nbytes: int, stream: int, what: str) -> int:
        cu = _cu()
        return int(self.call("cuMemAllocAsync", int(nbytes), cu.CUstream(stream),
                             what=f"allocating {nbytes} bytes for {what}"))

    def free_async(self, ptr: int, stream: int) -> None:
        cu = _cu()
        self.call("cuMemFreeAsync", cu.CUdeviceptr(ptr), cu.CUstream(stream))

    def fill(self, ptr: int, pattern: int, width: int, count: int, stream: int, what: str) -> None:
        """Fill `count` elements of `width` bytes with the bit pattern `pattern`, stream-ordered."""
        cu = _cu()
        fn = {1: "cuMemsetD8Async", 2: "cuMemsetD16Async", 4: "cuMemsetD32Async"}[width]
        self.call(fn, cu.CUdeviceptr(ptr), int(pattern), int(count), cu.CUstream(stream),
                  what=f"initialising {what}")

    def copy_to_host(self, ptr: int, nbytes: int, stream: int, what: str) -> bytes:
        """`nbytes` of device memory at `ptr`, copied after the work queued on `stream` so far and
        waited for (a host synchronisation with that stream)."""
        import numpy as np
        cu = _cu()
        host = np.empty(int(nbytes), dtype=np.uint8)
        self.call("cuMemcpyDtoHAsync", host, cu.CUdeviceptr(ptr), int(nbytes), cu.CUstream(stream),
                  what=f"reading {what}")
        self.call("cuStreamSynchronize", cu.CUstream(stream), what=f"reading {what}")
        return host.tobytes()

    def is_capturing(self, stream: int) -> bool:
        cu = _cu()
        status = self.call("cuStreamIsCapturing", cu.CUstream(stream), what="the stream argument")
        return status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def order_after(self, producer: int, consumer: int) -> None:
        """Make `consumer` wait for the work queued on `producer` so far (no host sync)."""
        cu = _cu()
        ev = self.call("cuEventCreate", int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        try:
            self.call("cuEventRecord", ev, cu.CUstream(producer))
            self.call("cuStreamWaitEvent", cu.CUstream(consumer), ev, 0)
        finally:
            self.call("cuEventDestroy", ev)   # released by the driver once the wait is satisfied


class DeviceArray:
    """A device allocation made by the runtime for an output when torch is not in use.

    Exposes `__cuda_array_interface__` (v3, with the stream it was produced on) and `__dlpack__`-free
    plain attributes: `ptr`, `shape`, `strides` (elements), `dtype` (kspec name), `device`.
    Memory comes from the stream-ordered pool of the launch stream and is returned to it, ordered
    on that stream, when the array is freed or garbage collected; that stream must still exist
    then (or call `free(stream)` with one that does).  `to_numpy()`/`copy_from()` are blocking
    helpers for tests and small scripts."""

    def __init__(self, shape, dtype: str, strides=None, *, device: int = 0, stream: int = 0,
                 _ptr: int | None = None, _ctx=None):
        drv = get()
        drv.require_device()
        self.shape = tuple(int(n) for n in shape)
        self.dtype = dtypes.normalize(dtype)
        self.strides = tuple(strides) if strides is not None else _c_strides(self.shape)
        self.device = device
        self.stream = stream
        self.nbytes = dtypes.span_bytes(self.dtype, self.shape, self.strides)
        self._ctx = _ctx if _ctx is not None else drv.primary_context(device)
        if _ptr is not None:
            self.ptr = _ptr
        else:
            with drv.current(self._ctx):
                self.ptr = drv.alloc_async(max(self.nbytes, 1), stream, f"a {self.dtype}{list(self.shape)} array")
        self._freed = False

    def _kspec_view(self) -> TensorView:
        return TensorView(self.ptr, self.shape, self.strides, self.dtype, self.device, "DeviceArray")

    @property
    def __cuda_array_interface__(self) -> dict:
        return _cai(self.ptr, self.shape, self.strides, self.dtype, self.stream if self.stream else 1)

    def free(self, stream: int | None = None) -> None:
        if self._freed:
            return
        self._freed = True
        drv = get()
        with drv.current(self._ctx):
            drv.free_async(self.ptr, self.stream if stream is None else stream)

    def __del__(self):
        try:
            self.free()
        except Exception:
            pass   # interpreter shutdown or a destroyed context: nothing left to return memory to

    def copy_from(self, array) -> "DeviceArray":
        """Blocking copy of a host numpy array of this shape (or its element count, read in C
        order) and element size, placed at this array's strides (so `col` arrays get column-major
        bytes; see kspec.runtime.transfer)."""
        import numpy as np
        from kspec.runtime.hostimage import device_image
        a = np.asarray(array)
        if a.shape != self.shape and a.size == math.prod(self.shape):
            a = a.reshape(self.shape)
        if a.shape != self.shape or a.dtype.itemsize != dtypes.itemsize(self.dtype):
            raise KspecRuntimeError(f"copy_from: host array {a.dtype}{list(a.shape)} into a "
                                    f"{self.dtype}{list(self.shape)} DeviceArray")
        return self.copy_from_image(device_image(a, self.strides, self.dtype, "copy_from"))

    def copy_from_image(self, image) -> "DeviceArray":
        """Blocking copy of a flat host buffer holding exactly this array's memory span."""
        import numpy as np
        image = np.ascontiguousarray(image)
        if image.nbytes != self.nbytes:
            raise KspecRuntimeError(f"copy_from: a {image.nbytes}-byte host image into a "
                                    f"{self.nbytes}-byte DeviceArray")
        if not image.nbytes:
            return self
        drv = get()
        cu = _cu()
        with drv.current(self._ctx):
            drv.call("cuStreamSynchronize", cu.CUstream(self.stream))
            drv.call("cuMemcpyHtoD", cu.CUdeviceptr(self.ptr), image, image.nbytes)
        return self

    def to_numpy(self):
        """Blocking copy to a host numpy array of the storage in memory order (for col layout,
        the transpose of the last two axes is applied so the result indexes like the tensor)."""
        import numpy as np
        from kspec.runtime.hostimage import host_array
        host = np.empty(self.nbytes, dtype=np.uint8)
        drv = get()
        cu = _cu()
        with drv.current(self._ctx):
            drv.call("cuStreamSynchronize", cu.CUstream(self.stream))
            drv.call("cuMemcpyDtoH", host, cu.CUdeviceptr(self.ptr), self.nbytes)
        return host_array(host, 0, self.shape, self.strides, self.dtype)

    def __repr__(self) -> str:
        return f"DeviceArray({self.dtype}{list(self.shape)}, strides={self.strides}, cuda:{self.device}, 0x{self.ptr:x})"

