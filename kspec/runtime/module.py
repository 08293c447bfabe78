"""`kspec.load(path) -> Module`: one Python callable per spec kernel of a compiled artifact.

Calling a kernel, `mod.gemm(A, B, bias, D=None, alpha=1.0, stream=None) -> dict[str, tensor]`:
1. the driver must initialise and report a device, else `KspecRuntimeError("no CUDA device: ...")`;
2. `Kernel.check(...)` validates every argument without touching the GPU (also callable on its
   own, e.g. to test argument handling on a machine without a GPU) and returns a `Binding`;
   what a call's signature fixes (`_signature_key`: each argument's dtype, shape, strides, device)
   is checked once and remembered per kernel (`_SignatureCache`, with how it launches per arch,
   device and SM count); a repeat call re-checks only its pointers, params, stream and devices;
3. the binary for the device's compute capability is chosen (9.0 -> sm90a, 10.0 -> sm100a);
4. the index tensors (integer inputs used as subscripts, `KernelEntry.index_ranges`) are read and
   range-checked unless `check_indices` is off or the stream is capturing (kspec.runtime.indexcheck);
5. the cubin is loaded once per context, missing outputs are allocated, and the plans are launched
   in order on the caller's stream.

Host numpy arrays: `mod.gemm.to_device(A=a, B=b)` uploads each in its spec's layout (see
kspec.runtime.transfer).  PyTorch: `mod.gemm.as_torch_op()` (see kspec.runtime.torch_ops).

Inputs are positional or keyword; outputs and params are keywords.  The result is a dict of
every output by name (passed ones are returned as given, allocated ones as torch tensors when
torch is already imported by the caller, else `DeviceArray`s).

Stream: `stream=` (an int handle, a `CUstream`, a torch/cupy stream or any `__cuda_stream__`
object); else torch's current stream when an argument is a torch tensor; else the NULL stream.
Nothing synchronises.  Workspace and intermediates are taken from the stream-ordered pool
(`cuMemAllocAsync`) and returned right after the last plan is queued (`cuMemFreeAsync`), so a
call is capture-safe: under CUDA graph capture they become graph allocation/free nodes.  Call a
kernel once before capturing so its cubin and host glue are loaded outside the capture, and pass
outputs explicitly when capturing (an output allocated during capture is graph memory).
"""
from __future__ import annotations

import hashlib
import inspect
import keyword
import math
import numbers
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kspec.artifact import KernelEntry, Manifest, Plan, TensorSpec, layout_strides, read_manifest
from kspec.core import (ARCH_TABLE, STEP_ROLES, STEP_SEQUENCES, STEP_ZEROED, arch_of_cc, attention_bwd_layout, extent_value,
                        split_offset_dim, split_quotient_dim)
from kspec.runtime import driver as _driver
from kspec.runtime import dtypes
from kspec.runtime.emptycheck import check_no_empty_reduction
from kspec.runtime.errors import KspecRuntimeError
from kspec.runtime.glue import HostGlue, Prepared
from kspec.runtime.indexcheck import check_before_launch
from kspec.runtime.tensors import TensorView, as_view, is_torch_tensor

_SCRATCH_ALIGN = 256
_PAIR_ROLES = ("split", "combine")     # variants launched together (split-KV), never chosen by size
# variants launched in order as one call, sharing one workspace, never chosen by size: the kernels of
# FlashAttention-4's attention backward (backends/cute/attention_bwd.py), three, or five with GQA
# (kspec.core.STEP_SEQUENCES)
_STEP_ROLES = STEP_ROLES


def load(path: str | Path, verify: bool = True, check_indices: bool = True) -> "Module":
    """Load a compiled artifact directory (or its manifest.json).  Works without a GPU.
    check_indices: read the index tensors (integer inputs used as subscripts) before each launch and
    raise for a value out of range (one small device-to-host copy and a stream sync per call; see
    kspec.runtime.indexcheck).  Each kernel's `check_indices` attribute can change it later."""
    p = Path(path)
    manifest = read_manifest(p, verify=verify)
    root = p if p.is_dir() else p.parent
    # a class per artifact so that help(mod) lists its kernels
    doc = "\n\n".join(describe_kernel(k, tuple(manifest.archs)) for k in manifest.kernels)
    cls = type("Module", (Module,), {"__doc__": f"kspec artifact {root}\n\n{doc}", "__module__": "kspec.runtime"})
    return cls(root, manifest, check_indices)


def _stream_handle(stream: Any) -> int:
    if isinstance(stream, bool):
        raise KspecRuntimeError("stream: expected a CUDA stream, got a bool")
    if isinstance(stream, int):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        v = proto() if callable(proto) else proto
        return int(v[1])
    for attr in ("cuda_stream", "ptr", "handle"):     # torch, cupy, cuda.core
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    try:
        return int(stream)                           # cuda.bindings CUstream
    except (TypeError, ValueError):
        raise KspecRuntimeError(f"stream: expected a CUDA stream handle, got {type(stream).__name__}") from None


@dataclass
class Binding:
    """A validated call: what every argument is and every size symbol's value."""
    kernel: KernelEntry
    views: dict[str, TensorView]                 # passed inputs and outputs
    passed: dict[str, Any]                       # the caller's objects, by name
    allocate: tuple[str, ...]                    # outputs the runtime allocates
    sizes: dict[str, int]
    params: dict[str, float | int]
    stream: int
    device: int | None
    uses_torch: bool
    strides: dict[str, tuple[int, ...]] = field(default_factory=dict)   # of allocated tensors
    # what the call's signature fixes (Kernel.check's cache), None for a Binding built by hand
    fixed: "_Fixed | None" = field(default=None, repr=False, compare=False)

    def extents(self, spec: TensorSpec) -> tuple[int, ...]:
        return tuple(extent_value(e, self.sizes) for e in spec.shape)

    def dims(self, plan: Plan) -> list[int]:
        def value(v):
            if isinstance(v, tuple):
                return math.prod(value(x) for x in v)
            return v if isinstance(v, int) else self.sizes[v]

        def stride(name: str, axis: int) -> int:    # a stride the kernel takes as a size
            return (self.views[name].strides if name in self.views else self.strides[name])[axis]
        return [stride(*plan.strides[r]) if r in plan.strides else value(v) for r, v in plan.dims]

    def scalars(self, plan: Plan) -> list[float]:
        return [float(self.params[s]) if isinstance(s, str) else float(s) for s in plan.scalars]


class Kernel:
    """One spec kernel of a loaded artifact; call it like a function (see the module docstring)."""

    def __init__(self, module: "Module", entry: KernelEntry, check_indices: bool = True):
        self._module = module
        self.entry = entry
        self.name = entry.name
        # read and range-check the index tensors before each launch (kspec.runtime.indexcheck)
        self.check_indices = check_indices
        self._calls = _SignatureCache()
        self._input_names = tuple(_names(entry.inputs))
        self._output_names = frozenset(_names(entry.outputs))
        self._pspecs = {p.name: p for p in entry.params}
        self.__doc__ = describe_kernel(entry, module.archs)
        sig = _signature(entry)
        if sig is not None:
            self.__signature__ = sig

    def __repr__(self) -> str:
        return f"<kspec kernel {_call_line(self.entry)}>"

    # ------------------------------------------------------------------ validation (no GPU)
    def check(self, *args, stream: Any = None, **kwargs) -> Binding:
        """Validate a call's arguments against the compiled signature, without a GPU."""
        k = self.entry
        objs, params = self._assign(args, kwargs)
        uses_torch = any(is_torch_tensor(o) for o in objs.values())
        views: dict[str, TensorView] = {}
        # DLPack producers need the stream; torch's current stream needs a device: read torch
        # tensors first (no stream needed), then resolve the stream, then everything else.
        for name, obj in objs.items():
            if is_torch_tensor(obj):
                views[name] = as_view(obj, f"argument '{name}'", 0)
        handle = self._resolve_stream(stream, views, uses_torch)
        for name, obj in objs.items():
            if name not in views:
                views[name] = as_view(obj, f"argument '{name}'", handle)
        key = _signature_key(views)
        fixed = self._calls.get(key)
        if fixed is None:
            b = self._check_all(views, objs, params, handle, uses_torch)
            self._calls.put(key, b.fixed)
            return b
        # a signature validated before: only what depends on the pointers is left to check
        fixed.check_pointers(k, views)
        return Binding(k, views, objs, fixed.allocate, dict(fixed.sizes), params, handle, fixed.device,
                       uses_torch, dict(fixed.strides), fixed)

    def _check_all(self, views: dict[str, TensorView], objs: dict[str, Any], params: dict[str, float | int],
                   handle: int, uses_torch: bool) -> Binding:
        """Every check of a call, for a signature not seen before; the Binding carries what the
        signature fixes (`_Fixed`) for the next call with the same one."""
        k = self.entry
        specs = {t.name: t for t in (*k.inputs, *k.outputs)}
        sizes: dict[str, int] = {}
        origin: dict[str, str] = {}
        for name, view in views.items():
            self._check_tensor(specs[name], view, sizes, origin, is_output=name not in _names(k.inputs),
                               pitched=_pitched(k, name))
        self._check_quotients(specs, views, sizes, origin)
        device = self._check_devices(views)
        allocate = tuple(t.name for t in k.outputs if t.name not in views)
        for t in (*(specs[n] for n in allocate), *k.intermediates):
            for e in t.shape:
                if isinstance(e, str) and e not in sizes:
                    what = "output" if t.name in specs else "intermediate"
                    raise KspecRuntimeError(
                        f"cannot determine size '{e}' of {what} '{t.name}' ({t.describe()}) from the "
                        f"arguments", hint=f"pass '{t.name}' explicitly" if t.name in specs else None)
        for plan in k.plans:
            for role, v in plan.dims:
                for sym in (v if isinstance(v, tuple) else (v,)):
                    if isinstance(sym, str) and sym not in sizes:
                        raise KspecRuntimeError(f"cannot determine size '{sym}' (plan '{plan.id}', role {role})")
        b = Binding(k, views, objs, allocate, sizes, params, handle, device, uses_torch)
        for t in (*(specs[n] for n in allocate), *k.intermediates):
            b.strides[t.name] = layout_strides(b.extents(t), t.layout)
        self._check_multiples(b, origin)
        check_no_empty_reduction(k.name, ((t.name, t.shape, tuple(views[t.name].shape)) for t in k.inputs),
                                 ((t.name, t.shape, b.extents(t)) for t in k.outputs))
        self._check_alignment(b)
        self._check_overlap(b)
        b.fixed = _Fixed.of(b)
        return b

    def _assign(self, args: tuple, kwargs: dict) -> tuple[dict[str, Any], dict[str, float | int]]:
        k = self.entry
        inputs = self._input_names
        outputs = self._output_names
        pspecs = self._pspecs
        if len(args) > len(inputs):
            raise KspecRuntimeError(
                f"{k.name}() takes {len(inputs)} positional input(s) ({', '.join(inputs)}), got {len(args)}",
                hint="pass outputs and params by keyword")
        objs: dict[str, Any] = dict(zip(inputs, args))
        raw_params: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in objs:
                raise KspecRuntimeError(f"{k.name}(): argument '{key}' given twice")
            if key in inputs or key in outputs:
                if value is not None or key in inputs:
                    objs[key] = value
            elif key in pspecs:
                raw_params[key] = value
            else:
                known = ", ".join([*inputs, *outputs, *pspecs, "stream"])
                raise KspecRuntimeError(f"{k.name}(): unexpected argument '{key}' (expected one of: {known})")
        for name in inputs:
            if name not in objs:
                spec = next(t for t in k.inputs if t.name == name)
                raise KspecRuntimeError(f"{k.name}(): missing input '{name}' ({spec.describe()})")
            if objs[name] is None:
                raise KspecRuntimeError(f"argument '{name}': expected a tensor, got None")
        params: dict[str, float | int] = {}
        for name, p in pspecs.items():
            v = raw_params.get(name)
            if v is None:
                if p.default is None:
                    raise KspecRuntimeError(f"{k.name}(): missing parameter '{name}' ({p.dtype}, no default)")
                v = p.default
            params[name] = _check_scalar(name, p.dtype, v)
        return objs, params

    def _resolve_stream(self, stream: Any, torch_views: dict[str, TensorView], uses_torch: bool) -> int:
        if stream is not None:
            return _stream_handle(stream)
        if uses_torch and torch_views:
            torch = sys.modules["torch"]
            dev = next(iter(torch_views.values())).device or 0
            return int(torch.cuda.current_stream(dev).cuda_stream)
        return 0

    @staticmethod
    def _check_quotients(specs: dict, views: dict, sizes: dict[str, int], origin: dict[str, str]) -> None:
        """Every `K/32` dimension of an argument: K is a multiple of 32 and the extent is K / 32
        (block scales cover whole blocks; nothing launches otherwise)."""
        for name, v in views.items():
            for axis, (e, n) in enumerate(zip(specs[name].shape, v.shape)):
                quo = split_quotient_dim(e)
                if quo is None:
                    continue
                sym, q = quo
                if sym not in sizes:
                    raise KspecRuntimeError(f"argument '{name}': dimension {axis} ({e}) needs {sym}, which no "
                                            "other argument gives")
                if sizes[sym] % q:
                    raise KspecRuntimeError(
                        f"argument '{name}': dimension {axis} ({e}): {sym} = {sizes[sym]} (from '{origin[sym]}') "
                        f"is not a multiple of {q}", hint=f"block scales cover whole blocks of {q}: pad {sym}")
                if n != sizes[sym] // q:
                    raise KspecRuntimeError(f"argument '{name}': dimension {axis} ({e}) must be {sizes[sym] // q} "
                                            f"({sym} = {sizes[sym]} from '{origin[sym]}'), got {n}")

    @staticmethod
    def _check_multiples(b: Binding, origin: dict[str, str]) -> None:
        """Every size role a plan needs to be a multiple of a number (plans[*].multiples: the kernel has
        no tail handling along it) is one, before anything launches."""
        for plan in b.kernel.plans:
            if not plan.multiples:
                continue
            values = dict(zip((r for r, _ in plan.dims), b.dims(plan)))
            for role, m in plan.multiples.items():
                if values[role] % m == 0:
                    continue
                ext = dict(plan.dims)[role]
                name = ext if isinstance(ext, str) else role
                src = f" (from '{origin[ext]}')" if isinstance(ext, str) and ext in origin else ""
                raise KspecRuntimeError(
                    f"{name} = {values[role]}{src} is not a multiple of {m}, which plan '{plan.id}' needs "
                    f"(its size {role}: the kernel has no tail handling there)", hint=f"pad {name} to a multiple of {m}")

    @staticmethod
    def _check_tensor(spec: TensorSpec, v: TensorView, sizes: dict[str, int], origin: dict[str, str],
                      is_output: bool, pitched: bool = False) -> None:
        what = f"argument '{spec.name}'"
        want = dtypes.storage(spec.dtype)
        if v.dtype != want:
            shown = spec.dtype if want == spec.dtype else f"{want} (storage of {spec.dtype})"
            raise KspecRuntimeError(f"{what}: expected {shown}, got {v.dtype}")
        if len(v.shape) != len(spec.shape):
            raise KspecRuntimeError(f"{what}: expected rank {len(spec.shape)} ({spec.describe()}), got "
                                    f"rank {len(v.shape)} with shape {tuple(v.shape)}")
        for axis, (e, n) in enumerate(zip(spec.shape, v.shape)):
            if isinstance(e, int):
                if n != e:
                    raise KspecRuntimeError(f"{what}: dimension {axis} must be {e}, got {n} "
                                            f"(shape {tuple(v.shape)}, expected {spec.describe()})")
            elif split_quotient_dim(e) is not None:
                # `K/32` (one block scale per 32 values): checked against K once every tensor is bound
                sizes.setdefault(e, n)
                origin.setdefault(e, spec.name)
                if sizes[e] != n:
                    raise KspecRuntimeError(f"{what}: dimension {axis} ({e}) is {n}, but '{origin[e]}' has {e} = "
                                            f"{sizes[e]}")
            elif split_offset_dim(e) is not None:
                # `B+1`: the B + 1 offsets of B packed sequences bind B
                sym, k = split_offset_dim(e)
                if n < k:
                    raise KspecRuntimeError(f"{what}: dimension {axis} ({e}) must be at least {k}, got {n}")
                if sym in sizes and sizes[sym] != n - k:
                    raise KspecRuntimeError(f"{what}: dimension {axis} ({e}) is {n}, so {sym} = {n - k}, but "
                                            f"'{origin[sym]}' has {sym} = {sizes[sym]}")
                sizes[sym], origin[sym] = n - k, spec.name
            elif e in sizes:
                if sizes[e] != n:
                    raise KspecRuntimeError(f"{what}: dimension {axis} ({e}) is {n}, but '{origin[e]}' "
                                            f"has {e} = {sizes[e]}")
            else:
                sizes[e], origin[e] = n, spec.name
        if v.numel:
            want_strides = layout_strides(tuple(v.shape), spec.layout)
            for axis, n in enumerate(v.shape):
                if pitched and axis < len(v.shape) - 1 and n > 1:
                    # rows at any pitch; an output's rows must not overlap one another
                    if v.strides[axis] < (want_strides[axis] if is_output else 0):
                        raise KspecRuntimeError(
                            f"{what}: stride {v.strides[axis]} of dimension {axis} is "
                            f"{'smaller than a dense row' if is_output else 'negative'} (strides "
                            f"{tuple(v.strides)}, shape {tuple(v.shape)})",
                            hint="pass rows that do not overlap" if is_output else None)
                    continue
                if n > 1 and v.strides[axis] != want_strides[axis]:
                    raise KspecRuntimeError(
                        f"{what}: expected {spec.layout} layout, i.e. strides {want_strides} (elements) for "
                        f"shape {tuple(v.shape)}, got strides {tuple(v.strides)}",
                        hint=_layout_hint(spec))
        if is_output and v.readonly:
            raise KspecRuntimeError(f"{what}: output is read-only")

    @staticmethod
    def _check_devices(views: dict[str, TensorView]) -> int | None:
        first: tuple[str, int] | None = None
        for name, v in views.items():
            if v.device is None:
                continue
            if first is None:
                first = (name, v.device)
            elif v.device != first[1]:
                raise KspecRuntimeError(f"argument '{name}': on cuda:{v.device}, but '{first[0]}' is on "
                                        f"cuda:{first[1]}; all tensors must be on one CUDA device")
        return first[1] if first else None

    @staticmethod
    def _check_alignment(b: Binding) -> None:
        k = b.kernel
        for plan in k.plans:
            for name, align in plan.alignment.items():
                spec = k.tensor(name)
                bits = dtypes.bits(spec.dtype)          # (strides in values: 4 bits each for f4e2m1)
                view = b.views.get(name)
                if view is not None:
                    what, shape, strides = f"argument '{name}'", view.shape, view.strides
                    if view.ptr % align:
                        raise _misaligned(name, view.ptr, align, plan.id)
                else:
                    role = "output" if name in _names(k.outputs) else "intermediate"
                    what, shape, strides = f"{role} '{name}'", b.extents(spec), b.strides[name]
                for axis, (n, s) in enumerate(zip(shape, strides)):
                    if n > 1 and s != 1 and (s * bits) % (align * 8):
                        sym = spec.shape[axis]
                        inner = [spec.shape[i] for i, st in enumerate(strides) if st == 1 and shape[i] > 1]
                        hint = (f"make {inner[0]} a multiple of {max(align * 8 // bits, 1)}" if inner and
                                isinstance(inner[0], str) else None)
                        raise KspecRuntimeError(
                            f"{what}: stride of dimension {axis} ({sym}) is {s} elements = {s * bits / 8:g} bytes, "
                            f"not a multiple of the {align}-byte alignment plan '{plan.id}' requires",
                            hint=hint)

    @staticmethod
    def _check_overlap(b: Binding) -> None:
        outs = [n for n in _names(b.kernel.outputs) if n in b.views]
        if outs:
            _check_overlap_ranges(b.kernel, outs, {n: v.byte_range() for n, v in b.views.items()})

    # ------------------------------------------------------------------ host arrays
    def to_device(self, *args, device: int = 0, stream: int = 0, **kwargs) -> dict[str, Any]:
        """Upload host numpy arrays for this kernel's tensors (inputs positional or by name,
        outputs by name), each as a `DeviceArray` in its spec's layout and storage dtype (values
        converted with numpy's astype when the dtype differs).  Returns them by name, ready to
        pass as keywords: `k(**k.to_device(A, B))`.  Blocking; for tests and scripts."""
        from kspec.runtime.transfer import to_device
        k = self.entry
        inputs = _names(k.inputs)
        if len(args) > len(inputs):
            raise KspecRuntimeError(f"{k.name}.to_device() takes {len(inputs)} positional input(s) "
                                    f"({', '.join(inputs)}), got {len(args)}")
        host = dict(zip(inputs, args))
        specs = {t.name: t for t in (*k.inputs, *k.outputs)}
        for name, a in kwargs.items():
            if name not in specs:
                raise KspecRuntimeError(f"{k.name}.to_device(): '{name}' is not an input or output "
                                        f"(expected one of: {', '.join(specs)})")
            if name in host:
                raise KspecRuntimeError(f"{k.name}.to_device(): argument '{name}' given twice")
            host[name] = a
        return {name: to_device(a, specs[name], device=device, stream=stream) for name, a in host.items()}

    # ------------------------------------------------------------------ torch
    def as_torch_op(self):
        """This kernel as a PyTorch custom operator (see kspec.runtime.torch_ops): traceable by
        torch.compile/torch.export through its fake implementation, capturable in CUDA graphs,
        launched on torch's current stream.  Needs torch; registered once per kernel content."""
        try:
            import torch  # noqa: F401
        except ImportError:
            raise KspecRuntimeError(f"{self.name}.as_torch_op() needs PyTorch", hint="pip install torch") from None
        from kspec.runtime.torch_ops import REGISTRY
        return REGISTRY.get_or_register(self)

    # ------------------------------------------------------------------ launch (GPU)
    def __call__(self, *args, stream: Any = None, **kwargs) -> dict[str, Any]:
        drv = _driver.get()
        drv.require_device()
        b = self.check(*args, stream=stream, **kwargs)
        return self._module._launch(drv, b, check_indices=self.check_indices)


class Module:
    """A loaded artifact: `.kernels` (names), `.archs`, and one `Kernel` attribute per spec kernel
    (also reachable as `module["name"]`)."""

    def __init__(self, root: Path, manifest: Manifest, check_indices: bool = True):
        self.path = Path(root)
        self.manifest = manifest
        self.archs: tuple[str, ...] = tuple(manifest.archs)
        self.kernels: tuple[str, ...] = tuple(k.name for k in manifest.kernels)
        # a class per kernel so that help(mod.name) shows that kernel's signature and arguments
        self._kernels = {k.name: type(k.name, (Kernel,), {"__doc__": describe_kernel(k, self.archs),
                                                          "__module__": "kspec.runtime"})(self, k, check_indices)
                         for k in manifest.kernels}
        self._glue: dict[tuple[str, str], HostGlue] = {}
        self._images: dict[tuple[str, str], bytes] = {}
        self._digests: dict[tuple[str, str], str] = {}
        self._archs: dict[tuple[int, int], str] = {}
        self._offsets: dict[tuple[str, str, int], tuple[int, ...] | None] = {}
        self._layouts: dict[tuple, tuple[int, ...]] = {}

    def __getattr__(self, name: str) -> Kernel:
        kernels = self.__dict__.get("_kernels", {})
        if name in kernels:
            return kernels[name]
        raise AttributeError(f"artifact {self.__dict__.get('path')} has no kernel '{name}' "
                             f"(kernels: {', '.join(kernels) or 'none'})")

    def __getitem__(self, name: str) -> Kernel:
        try:
            return self._kernels[name]
        except KeyError:
            raise KeyError(f"no kernel '{name}' (kernels: {', '.join(self._kernels)})") from None

    def __dir__(self):
        return [*super().__dir__(), *self._kernels]

    def __repr__(self) -> str:
        lines = [f"<kspec module {self.path} ({self.manifest.spec.file}; archs {', '.join(self.archs)})"]
        lines += ["  " + _call_line(k) for k in self.manifest.kernels]
        return "\n".join(lines) + ">"

    # ------------------------------------------------------------------ binaries
    def binary(self, plan: Plan, arch: str, variant: int = -1):
        """The plan's binary on `arch`, or its variant number `variant` (artifact.Variant)."""
        b = plan.binaries[arch]
        return b if variant < 0 else b.variants[variant]

    def variant(self, plan: Plan, arch: str, dims: list[int], sm_count: int | None = None) -> int:
        """The variant of a size-bucketed binary that serves these dims (-1: the binary has none): among
        the variants built for the SKU `sku_for` picks for the device's SM count, the one whose select
        box holds the dims (a variant recording no SM count serves every SKU)."""
        b = plan.binaries[arch]
        if not b.variants:
            return -1
        values = _select_values(plan, dims)
        sku = sku_for(b, sm_count)
        for i, v in enumerate(b.variants):
            if v.config.get("role") in _PAIR_ROLES + _STEP_ROLES:
                continue                  # split-KV kernels and steps: taken by launches, not by size
            if v.holds(values) and (sku is None or not variant_skus(v) or sku in variant_skus(v)):
                return i
        _missing_group(plan, arch, b, values)
        sizes = ", ".join(f"{r}={v}" for r, v in values.items() if r in dict(plan.dims))
        on = "" if sku is None else f" built for {sku} SMs"
        raise KspecRuntimeError(f"plan '{plan.id}' ({arch}): no kernel variant{on} in the artifact serves {sizes}",
                                hint="recompile the artifact without restricting its size buckets")

    def split_variants(self, plan: Plan, arch: str, sm_count: int | None = None,
                       dims: list[int] | None = None) -> tuple[int, int] | None:
        """(split kernel, combine kernel) variant numbers of a split-KV binary on the SKU `sku_for` picks
        (FlashAttention-4 decoding, backends/cute/splitkv.py), or None when the binary has none.  The
        split one runs when its glue asks for a workspace for the call (its split count is above 1)."""
        b = plan.binaries[arch]
        sku = sku_for(b, sm_count)
        values = _select_values(plan, dims) if dims is not None else None

        def find(role):
            # (a per-call GQA group: the pair built for the call's group, G in its boxes)
            return next((i for i, v in enumerate(b.variants) if v.config.get("role") == role and
                         (values is None or all(_box_group_ok(box, values) for box in v.select[:1])) and
                         (sku is None or not variant_skus(v) or sku in variant_skus(v))), None)
        split, combine = find("split"), find("combine")
        if split is None:
            return None
        if combine is None:
            raise KspecRuntimeError(f"plan '{plan.id}' ({arch}): the artifact has a split-KV kernel but no combine "
                                    "kernel for it", hint="rebuild the artifact with `kspec compile`")
        return split, combine

    def step_variants(self, plan: Plan, arch: str, dims: list[int] | None = None) -> list[int] | None:
        """The variant numbers of a binary made of several kernels launched in order as one call (an
        attention backward: FlashAttention-4's preprocess, main and postprocess kernels; GQA: and the
        dK, dV postprocesses), in the order of its sequence in kspec.core.STEP_SEQUENCES, or None.
        A binary built for several GQA groups (a per-call group) holds one sequence per group, each in
        its box G: dims picks the call's."""
        b = plan.binaries[arch]
        steps = [(i, v) for i, v in enumerate(b.variants) if v.config.get("role") in _STEP_ROLES]
        if not steps:
            return None
        if dims is not None and any("G" in box for _i, v in steps for box in v.select):
            values = _select_values(plan, dims)
            steps = [(i, v) for i, v in steps if all(_box_group_ok(box, values) for box in v.select)]
            if not steps:
                _missing_group(plan, arch, b, values)
        at = {v.config.get("role"): i for i, v in steps}
        seq = next((seq for seq in STEP_SEQUENCES if set(seq) == set(at)), None)
        if seq is None or len(at) != len(steps) or not all(v.config.get("role") in _STEP_ROLES for v in b.variants):
            raise KspecRuntimeError(f"plan '{plan.id}' ({arch}): the artifact has the kernels "
                                    f"{sorted(at)}, not a sequence of "
                                    f"{' or '.join(', '.join(seq) for seq in STEP_SEQUENCES)}",
                                    hint="rebuild the artifact with `kspec compile`")
        return [at[r] for r in seq]

    def _step_zeroing(self, plan: Plan, arch: str, dims: list[int], steps: list[int]) -> dict[int, tuple[int, int]]:
        """variant -> (byte offset in the workspace, bytes) to zero before that step of a sequence runs:
        the workspace buffers kspec.core.STEP_ZEROED names for its role (GQA's dK/dV accumulators before
        the attention backward's main kernel), where the binary's layout has them."""
        out = {}
        for v in (v for v in steps if v >= 0):
            cfg = plan.binaries[arch].variants[v].config
            names = STEP_ZEROED.get(cfg.get("role"), ())
            lay = attention_bwd_layout(cfg, dict(zip((r for r, _x in plan.dims), dims))) if names else {}
            spans = [(lay[n][0], lay[n][0] + 4 * math.prod(lay[n][1])) for n in names if n in lay]
            if spans:
                out[v] = (min(a for a, _b in spans), max(b for _a, b in spans) - min(a for a, _b in spans))
        return out

    def launches(self, plan: Plan, arch: str, dims: list[int], device: int, sm_count: int | None
                 ) -> tuple[list[int], int]:
        """The variants launched for one plan (in order) and the workspace bytes they share: the steps of
        a sequence (step_variants) with the workspace every one's glue asks for; the split-KV kernel and
        its combine when the split kernel's glue asks for a workspace at these sizes; else the single
        variant `variant` picks (its own workspace)."""
        steps = self.step_variants(plan, arch, dims)
        if steps is not None:
            sizes = [self.glue(plan, arch, v).workspace_size(dims, device, sm_count or 0) for v in steps]
            if len(set(sizes)) != 1:
                raise KspecRuntimeError(f"plan '{plan.id}' ({arch}): its kernels size their shared workspace "
                                        f"differently ({sizes} bytes); the artifact is inconsistent",
                                        hint="rebuild the artifact with `kspec compile`")
            return steps, sizes[0]
        pair = self.split_variants(plan, arch, sm_count, dims)
        if pair is not None:
            ws = self.glue(plan, arch, pair[0]).workspace_size(dims, device, sm_count or 0)
            if ws > 0:
                other = self.glue(plan, arch, pair[1]).workspace_size(dims, device, sm_count or 0)
                if other != ws:
                    raise KspecRuntimeError(f"plan '{plan.id}' ({arch}): the split-KV kernel and its combine size "
                                            f"the workspace differently ({ws} and {other} bytes); the artifact is "
                                            "inconsistent", hint="rebuild the artifact with `kspec compile`")
                return list(pair), ws
        v = self.variant(plan, arch, dims, sm_count)
        return [v], self.glue(plan, arch, v).workspace_size(dims, device, sm_count or 0)

    def glue(self, plan: Plan, arch: str, variant: int = -1) -> HostGlue:
        key = (plan.id, arch, variant)
        if key not in self._glue:
            self._glue[key] = HostGlue(self.path / self.binary(plan, arch, variant).host,
                                       f"kernel '{self._kernel_of(plan)}', plan '{plan.id}' ({arch})", plan.args)
        return self._glue[key]

    def _param_offsets(self, plan: Plan, arch: str, variant: int, binary, what: str) -> tuple[int, ...] | None:
        key = (plan.id, arch, variant)
        if key not in self._offsets:
            self._offsets[key] = _param_offsets(binary, what)
        return self._offsets[key]

    def _layout_offsets(self, layout: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
        """The offsets of a parameter layout the driver reports, remembered per layout."""
        offs = self._layouts.get(layout)
        if offs is None:
            if len(self._layouts) >= 64:
                self._layouts.clear()
            offs = self._layouts[layout] = tuple(o for o, _ in layout)
        return offs

    def _kernel_of(self, plan: Plan) -> str:
        return next((k.name for k in self.manifest.kernels if plan in k.plans), "?")

    def image(self, plan: Plan, arch: str, variant: int = -1) -> bytes:
        key = (plan.id, arch, variant)
        if key not in self._images:
            self._images[key] = (self.path / self.binary(plan, arch, variant).cubin).read_bytes()
        return self._images[key]

    def image_digest(self, plan: Plan, arch: str, variant: int = -1) -> str:
        """sha256 of the cubin as loaded (what the driver's function cache is keyed by)."""
        key = (plan.id, arch, variant)
        if key not in self._digests:
            self._digests[key] = hashlib.sha256(self.image(plan, arch, variant)).hexdigest()
        return self._digests[key]

    def arch_for(self, cc: tuple[int, int], name: str, ordinal: int) -> str:
        arch = arch_of_cc(cc[0] * 10 + cc[1])
        if arch is None or arch not in self.archs:
            have = ", ".join(f"{a} (compute capability {ARCH_TABLE[a].cc // 10}.{ARCH_TABLE[a].cc % 10})" for a in self.archs)
            why = (f"the artifact has no {arch} binary" if arch else
                   f"kspec compiles only for {', '.join(ARCH_TABLE)}")
            raise KspecRuntimeError(
                f"cuda:{ordinal} ({name}, compute capability {cc[0]}.{cc[1]}) cannot run this artifact: "
                f"{why}; it has binaries for {have}",
                hint=f"recompile with `kspec compile --arch {arch}`" if arch else None)
        return arch

    # ------------------------------------------------------------------ one call
    def _launch(self, drv, b: Binding, check_indices: bool = True) -> dict[str, Any]:
        k = b.kernel
        stream = b.stream
        device, ctx = self._place(drv, b)
        major, minor, sms, dev_name = drv.facts(device)
        arch = self._arch(major, minor, dev_name, device)
        with drv.current(ctx):
            for name, v in b.views.items():
                if v.device is None:
                    on = drv.pointer_device(v.ptr, f"argument '{name}'")
                    if on != device:
                        raise KspecRuntimeError(f"argument '{name}': on cuda:{on}, but the call runs on "
                                                f"cuda:{device}; all tensors must be on one CUDA device")
            capturing = drv.is_capturing(stream)
            if not capturing:
                for v in b.views.values():
                    if v.stream is not None and _same_stream(v.stream, stream) is False:
                        drv.order_after(int(v.stream), stream)
                if check_indices and k.index_ranges:
                    check_before_launch(k.name, k.index_ranges, b.views, b.sizes, stream)
            lp = self._launch_plan(b, arch, device, sms)
            results, ptrs = self._outputs(drv, b, device, ctx, lp)
            if lp.empty:
                # every output is empty: nothing to compute, so nothing is launched, whatever the backend
                # (a glue need not take zero sizes: CUTLASS's refuse them; emptycheck.py)
                return results
            total, ws_offset = lp.total, lp.ws_offset
            scratch = drv.alloc_async(total, stream, f"{k.name} scratch") if total else 0
            try:
                for name, off in lp.offsets.items():
                    ptrs[name] = scratch + off
                # every plan's launch is prepared (and judged) before the first one is queued: a call
                # that one of them cannot run launches nothing
                prepared = []
                for i, (plan, dims, (vs, ws)) in enumerate(zip(k.plans, lp.dims, lp.chosen)):
                    scalars = b.scalars(plan)
                    args = [ptrs[a] for a in plan.args]
                    for v in vs:
                        glue = self.glue(plan, arch, v)
                        pr = glue.prepare(dims, args, scalars, scratch + ws_offset if ws else 0, device, sms)
                        shape = (i, v, pr.grid, pr.block, pr.cluster)
                        if shape not in lp.shapes_ok:
                            _check_launch_shape(pr, plan, arch, dims)
                            lp.shapes_ok.add(shape)
                        # a plan's initial fills (plan.init) once, before its first kernel (of a sequence too:
                        # an attention backward's outputs zeroed before its preprocess, not between steps)
                        prepared.append((plan, glue, ws, v, pr, len(vs) > 1, lp.fills[i] if v == vs[0] else [],
                                         lp.zeroes[i].get(v)))
                for plan, glue, ws, v, pr, pair, fills, zero in prepared:
                    # a split-KV pair's workspace holds partials the split kernel writes in full and the
                    # combine reads, an attention backward's the buffers its preprocess writes (and the
                    # dQ accumulator it zeroes): not cleared (FA4 allocates them uninitialised too), but
                    # for the ranges a step expects zeroed (GQA's dK/dV accumulators: `zero`)
                    self._run_plan(drv, b, plan, arch, glue, ctx, ptrs, scratch + ws_offset if ws else 0,
                                   0 if pair else ws, device, sms, v, pr, fills, zero)
            finally:
                if scratch:
                    drv.free_async(scratch, stream)
        return results

    def _arch(self, major: int, minor: int, dev_name: str, device: int) -> str:
        """`arch_for`, remembered per compute capability (a refusal is not remembered)."""
        arch = self._archs.get((major, minor))
        if arch is None:
            arch = self._archs[(major, minor)] = self.arch_for((major, minor), dev_name, device)
        return arch

    def _launch_plan(self, b: Binding, arch: str, device: int, sms: int) -> "_LaunchPlan":
        """How this call launches: from the cache of its signature (`b.fixed`) when it launched
        on this (arch, device, SM count) before, else worked out (and remembered there)."""
        key = (arch, device, sms)
        fixed = b.fixed
        lp = fixed.launch.get(key) if fixed is not None else None
        if lp is not None:
            return lp
        k = b.kernel
        dims = [b.dims(p) for p in k.plans]
        empty = all(math.prod(b.extents(t)) == 0 for t in k.outputs)      # then nothing launches
        chosen = [] if empty else [self.launches(p, arch, d, device, sms) for p, d in zip(k.plans, dims)]
        zeroes = [self._step_zeroing(p, arch, d, vs) for p, d, (vs, _ws) in zip(k.plans, dims, chosen)]
        # one scratch block: every intermediate, then one workspace reused by the plans in turn
        offsets, total = {}, 0
        for t in k.intermediates:
            offsets[t.name] = total
            total += _round_up(_nbytes(b.extents(t), b.strides[t.name], t.dtype), _SCRATCH_ALIGN)
        ws_offset = total
        total += max((ws for _vs, ws in chosen), default=0)
        outputs = [(t.name, b.extents(t), b.strides[t.name], t.dtype) for t in k.outputs if t.name not in b.passed]
        fills = [_plan_fills(b, plan) for plan in k.plans]
        lp = _LaunchPlan(dims, chosen, offsets, ws_offset, total, outputs, fills, zeroes, empty)
        if fixed is not None:
            if len(fixed.launch) >= 8:
                fixed.launch.clear()
            fixed.launch[key] = lp
        return lp

    def _place(self, drv, b: Binding):
        """The device and context of the call: the tensors' device, the stream's context when it
        is a user stream (its device must match), else the primary context."""
        sctx = drv.stream_context(b.stream)
        sdev = drv.context_device(sctx) if sctx is not None else None
        device = b.device
        if device is None:
            device = sdev if sdev is not None else drv.current_device()
        if device is None:
            device = 0
        if sdev is not None and sdev != device:
            raise KspecRuntimeError(f"stream: belongs to cuda:{sdev}, but the tensors are on cuda:{device}")
        return device, (sctx if sctx is not None else drv.primary_context(device))

    def _outputs(self, drv, b: Binding, device: int, ctx, lp: "_LaunchPlan"
                 ) -> tuple[dict[str, Any], dict[str, int]]:
        ptrs = {n: v.ptr for n, v in b.views.items()}
        results: dict[str, Any] = {n: b.passed[n] for n in _names(b.kernel.outputs) if n in b.passed}
        if not lp.outputs:
            return results, ptrs
        torch = _torch_with_cuda()
        if torch is not None:
            on = f"cuda:{device}"
            other_stream = int(torch.cuda.current_stream(device).cuda_stream) != b.stream
        for name, shape, strides, dtype in lp.outputs:
            if torch is not None:
                out = torch.empty_strided(shape, strides, dtype=getattr(torch, dtypes.DTYPES[dtype].torch), device=on)
                if other_stream:
                    # the caching allocator must not hand the block out again before our stream is done
                    out.record_stream(torch.cuda.ExternalStream(b.stream, device=on))
                ptrs[name] = int(out.data_ptr())
            else:
                out = _driver.DeviceArray(shape, dtype, strides, device=device, stream=b.stream, _ctx=ctx)
                ptrs[name] = out.ptr
            results[name] = out
        return {t.name: results[t.name] for t in b.kernel.outputs}, ptrs

    def _run_plan(self, drv, b: Binding, plan: Plan, arch: str, glue: HostGlue, ctx, ptrs: dict[str, int],
                  workspace: int, ws_bytes: int, device: int, sms: int, variant: int = -1,
                  prepared: "Prepared | None" = None, fills=None, zero: tuple[int, int] | None = None) -> None:
        """Launch one prepared plan.  fills: the plan's initial fills as `_LaunchPlan` holds them
        ((tensor, pattern, width, count)); None to work them out here.  zero: (offset, bytes) of the
        workspace to zero first (a step of a sequence, `_step_zeroing`)."""
        what = f"plan '{plan.id}' ({arch})"
        if fills is None:
            fills = _plan_fills(b, plan)
        for name, pattern, width, count in fills:
            drv.fill(ptrs[name], pattern, width, count, b.stream, f"'{name}' of {what}")
        if ws_bytes:
            # the ABI's prepare has no stream to clear a workspace on; semaphores expect zeros
            drv.fill(workspace, 0, 1, ws_bytes, b.stream, f"the workspace of {what}")
        if zero is not None:
            drv.fill(workspace + zero[0], 0, 4, zero[1] // 4, b.stream, f"the accumulators in the workspace of {what}")
        if prepared is None:
            prepared = glue.prepare(b.dims(plan), [ptrs[a] for a in plan.args], b.scalars(plan),
                                    workspace, device, sms)
        if 0 in prepared.grid:
            return                                   # empty problem: nothing to launch
        binary = self.binary(plan, arch, variant)
        if variant >= 0:
            what = f"plan '{plan.id}' ({arch}, variant {variant})"
        # keyed by the cubin's content, not id(self): ids are reused once a module is collected,
        # and a new module at an old id must not get the old module's function
        func = drv.function(ctx, (self.image_digest(plan, arch, variant), plan.id, arch),
                            self.image(plan, arch, variant), binary.symbol, what)
        offsets = self._param_offsets(plan, arch, variant, binary, what)
        if offsets is not None:
            # a kernel of several parameters (CuTe DSL): the manifest's offsets must be the cubin's
            # own, and the glue's blob must hold every parameter
            layout = drv.param_layout(func)
            if layout is not None and self._layout_offsets(layout) != offsets:
                raise KspecRuntimeError(f"{what}: the manifest places the kernel's parameters at byte offsets "
                                        f"{list(offsets)[:8]} but the kernel declares {[o for o, _ in layout][:8]}; "
                                        "the artifact is inconsistent", hint="rebuild the artifact with `kspec compile`")
            if layout and layout[-1][0] + layout[-1][1] > prepared.params_size:
                raise KspecRuntimeError(f"{what}: the host glue built a {prepared.params_size}-byte parameter "
                                        f"block but the kernel's parameters take {layout[-1][0] + layout[-1][1]} "
                                        "bytes; the artifact is inconsistent", hint="rebuild the artifact with `kspec compile`")
        want = drv.param_size(func) if offsets is None else None
        if want is not None and want != prepared.params_size:
            raise KspecRuntimeError(f"{what}: the host glue built a {prepared.params_size}-byte parameter "
                                    f"block but the kernel takes {want} bytes; the artifact is inconsistent",
                                    hint="rebuild the artifact with `kspec compile`")
        if prepared.smem_bytes:
            drv.set_dynamic_smem(func, prepared.smem_bytes, what)
        extra = {} if offsets is None else {"param_offsets": offsets}
        drv.launch(func, prepared.grid, prepared.block, prepared.cluster, prepared.smem_bytes, b.stream,
                   prepared.params_ptr, what, **extra)


# ---------------------------------------------------------------------------------- helpers

# ---- the per-signature cache of Kernel.check and Module._launch

_SIGNATURE_CACHE_SIZE = 64      # signatures remembered per kernel (oldest first out)


def _signature_key(views: dict[str, TensorView]) -> tuple:
    """What every check of `Kernel.check` depends on besides the pointer values: per argument (in
    the order bound), its name (which inputs and outputs were passed: the allocated outputs and
    which tensor is checked against which spec), storage dtype, shape and strides (the size
    symbols, layout and pitch checks, the alignment of strides, the empty-reduction check, every
    plan's dims), device (the one-device check) and read-only flag (outputs must be writable).
    Params are not part of it: they are checked on every call and only feed the glue's scalars."""
    return tuple((name, v.dtype, v.shape, v.strides, v.device, v.readonly) for name, v in views.items())


class _SignatureCache:
    """Kernel.check's cache: `_signature_key` -> `_Fixed`, at most _SIGNATURE_CACHE_SIZE entries.
    Only signatures that passed every check are stored, so a hit means the call differs from a
    valid one in its pointers (and params, stream, objects) only; what depends on those is
    checked again on every call (`_Fixed.check_pointers`, Module._launch)."""

    def __init__(self, size: int = _SIGNATURE_CACHE_SIZE):
        self.size = size
        self._entries: dict[tuple, _Fixed] = {}

    def get(self, key: tuple) -> "_Fixed | None":
        return self._entries.get(key)

    def put(self, key: tuple, fixed: "_Fixed") -> None:
        entries = self._entries
        while len(entries) >= self.size:
            entries.pop(next(iter(entries)), None)
        entries[key] = fixed

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


@dataclass
class _Fixed:
    """What one validated call signature fixes (see `_signature_key`): the size symbols' values, the
    outputs to allocate and the strides of allocated tensors, the device; the checks left for each
    call because they read the pointers: each argument's alignment (`pointer_checks`, in the order
    `_check_alignment` makes them) and the overlap of passed outputs with the other arguments
    (`spans`: each argument's byte range relative to its pointer); and, per (arch, device, SM
    count), how the call launches (`launch`, filled by Module._launch)."""
    sizes: dict[str, int]
    allocate: tuple[str, ...]
    strides: dict[str, tuple[int, ...]]
    device: int | None
    pointer_checks: tuple[tuple[str, int, str], ...]      # (argument, alignment, plan id)
    outputs_passed: tuple[str, ...]
    spans: dict[str, tuple[int, int] | None]              # for the overlap check, when an output is passed
    launch: dict[tuple, "_LaunchPlan"] = field(default_factory=dict)

    @staticmethod
    def of(b: Binding) -> "_Fixed":
        k = b.kernel
        checks = tuple((name, align, plan.id) for plan in k.plans for name, align in plan.alignment.items()
                       if name in b.views)
        outs = tuple(n for n in _names(k.outputs) if n in b.views)
        spans = {}
        if outs:
            for n, v in b.views.items():
                r = v.byte_range()
                spans[n] = None if r is None else (r[0] - v.ptr, r[1] - v.ptr)
        return _Fixed(dict(b.sizes), b.allocate, dict(b.strides), b.device, checks, outs, spans)

    def check_pointers(self, k: KernelEntry, views: dict[str, TensorView]) -> None:
        """The checks of a call with this signature that depend on the pointer values."""
        for name, align, plan_id in self.pointer_checks:
            ptr = views[name].ptr
            if ptr % align:
                raise _misaligned(name, ptr, align, plan_id)
        if self.outputs_passed:
            ranges = {}
            for n, span in self.spans.items():
                ptr = views[n].ptr
                ranges[n] = None if span is None else (ptr + span[0], ptr + span[1])
            _check_overlap_ranges(k, self.outputs_passed, ranges)


def _plan_fills(b: Binding, plan: Plan) -> list[tuple[str, int, int, int]]:
    """The initial fills a plan asks for (`plan.init`: zeros, or -inf for max reductions) at this
    call's extents: (tensor, pattern, element width, element count); empty tensors need none."""
    k = b.kernel
    fills = []
    for name, how in plan.init.items():
        spec = k.tensor(name)
        d = dtypes.DTYPES[spec.dtype]
        count = _nbytes(b.extents(spec), _strides_of(b, name), spec.dtype) // d.itemsize
        if count:
            fills.append((name, 0 if how == "zero" else d.neg_inf, d.itemsize, count))
    return fills


@dataclass
class _LaunchPlan:
    """How a call of one signature launches on one (arch, device, SM count): every plan's dims,
    variants and workspace bytes (`Module.launches`; the glue's workspace size is a function of
    dims, device and SM count), the scratch block's layout, the outputs to allocate and the
    initial fills, whether every output is empty; `shapes_ok` remembers launch geometries `_check_launch_shape` accepted."""
    dims: list[list[int]]
    chosen: list[tuple[list[int], int]]
    offsets: dict[str, int]                  # intermediates in the scratch block
    ws_offset: int
    total: int
    outputs: list[tuple[str, tuple[int, ...], tuple[int, ...], str]]      # name, shape, strides, dtype
    fills: list[list[tuple[str, int, int, int]]]     # per plan: (tensor, pattern, width, count)
    zeroes: list[dict[int, tuple[int, int]]]   # per plan: variant -> (workspace offset, bytes) zeroed before it
    empty: bool = False                      # every output is empty: the call launches nothing
    shapes_ok: set = field(default_factory=set)


def _misaligned(name: str, ptr: int, align: int, plan_id: str) -> KspecRuntimeError:
    return KspecRuntimeError(
        f"argument '{name}': data pointer 0x{ptr:x} is not {align}-byte aligned "
        f"(plan '{plan_id}' requires it)", hint="pass a tensor that starts at an aligned address (not an offset view)")


def _check_overlap_ranges(k: KernelEntry, outs, ranges: dict[str, tuple[int, int] | None]) -> None:
    """Passed outputs `outs` must not overlap one another or any input ([lo, hi) byte ranges)."""
    for i, o in enumerate(outs):
        ro = ranges[o]
        if ro is None:
            continue
        others = [n for n in outs[:i]] + [n for n in _names(k.inputs)]
        for other in others:
            r = ranges[other]
            if r is not None and ro[0] < r[1] and r[0] < ro[1]:
                kind = "output" if other in outs else "input"
                raise KspecRuntimeError(f"argument '{o}': output overlaps {kind} '{other}' in memory; "
                                        f"outputs must not alias other arguments")


def _select_values(plan: Plan, dims: list[int]) -> dict[str, int]:
    """The values a variant's select boxes are over: the plan's dims by role, and for attention the
    GQA group G = H / HK (query heads per K/V head), which FlashAttention-4 compiles in."""
    values = {role: v for (role, _), v in zip(plan.dims, dims)}
    if "H" in values and "HK" in values and values["HK"] > 0 and "G" not in values:
        values["G"] = values["H"] // values["HK"] if values["H"] % values["HK"] == 0 else -1
    return values


def _box_group_ok(box: dict, values: dict[str, int]) -> bool:
    if "G" not in box:
        return True
    lo, hi = box["G"]
    return lo <= values.get("G", -1) and (hi is None or values.get("G", -1) <= hi)


def _missing_group(plan: Plan, arch: str, binary, values: dict[str, int]) -> None:
    """Raise the named error for a call whose GQA group has no kernel in the artifact (the group is
    compiled into FlashAttention-4's kernels; an artifact holds the groups it was built for)."""
    built = sorted({box["G"][0] for v in binary.variants for box in v.select if "G" in box})
    if not built or values.get("G") in built:
        return
    h, hk, g = values.get("H"), values.get("HK"), values.get("G")
    call = f"{h} query heads on {hk} K/V heads" + (f" (group {g})" if g is not None and g > 0 else
                                                 " (not a whole group per K/V head)")
    hint = (f"rebuild the artifact for that group: `kspec compile --sizes H={h},KH={hk}` (or the group symbol, "
            f"G={g})" if g is not None and g > 0 else "H must be a multiple of the K/V head count")
    raise KspecRuntimeError(f"plan '{plan.id}' ({arch}): the artifact holds FlashAttention-4 kernels for the GQA "
                            f"group{'s' if len(built) > 1 else ''} {', '.join(map(str, built))} (query heads per K/V "
                            f"head), and this call has {call}", hint=hint)


def variant_skus(v) -> tuple[int, ...]:
    """The SM counts (GPU SKUs) a variant was built for: its config "sm_count" ("132,114"); () if none."""
    return tuple(int(n) for n in v.config.get("sm_count", "").split(",") if n.strip().isdigit())


def sku_for(binary, sm_count: int | None) -> int | None:
    """Which of the SKUs a size-bucketed binary was built for (`kspec compile --sm-count`) serves a
    device with `sm_count` SMs: that count when it was built, else the largest built below it (its
    persistent grid then fills at most the device, leaving SMs idle rather than queueing a second
    wave), else the smallest built; with no device count, the first built.  Every SKU's kernels
    compute the same function: the choice is speed only.  None: its variants record no SM count."""
    built = tuple(dict.fromkeys(n for v in binary.variants for n in variant_skus(v)))
    if not built:
        return None
    if sm_count is None:
        return built[0]
    if sm_count in built:
        return sm_count
    below = [n for n in built if n < sm_count]
    return max(below) if below else min(built)


# CUDA's launch limits (every arch kspec targets): grid x < 2^31, y and z <= 65,535; a block has
# at most 1,024 threads, x and y <= 1,024, z <= 64; a portable cluster at most 8 CTAs (16 opted in).
GRID_MAX = (2**31 - 1, 65535, 65535)
BLOCK_MAX = (1024, 1024, 64)
BLOCK_THREADS_MAX = 1024
CLUSTER_MAX = 8          # portable cluster sizes: no launch sets NON_PORTABLE_CLUSTER_SIZE_ALLOWED


def _check_launch_shape(pr, plan: Plan, arch: str, dims: list[int]) -> None:
    """A launch the host glue prepared lies within CUDA's limits, or the call is refused by name."""
    grid, block, cluster = tuple(pr.grid), tuple(pr.block), tuple(pr.cluster)
    if 0 in grid:
        return                                   # an empty problem: nothing is launched
    sizes = ", ".join(f"{r}={v}" for (r, _), v in zip(plan.dims, dims))
    what = f"plan '{plan.id}' ({arch})"
    if any(g > m or g < 0 for g, m in zip(grid, GRID_MAX)):
        axis = next(i for i, (g, m) in enumerate(zip(grid, GRID_MAX)) if g > m or g < 0)
        raise KspecRuntimeError(
            f"{what}: this call needs a launch grid of {grid}, beyond CUDA's limit of {GRID_MAX[axis]:,} blocks "
            f"along {'xyz'[axis]} (sizes {sizes})",
            hint="split the call into several smaller ones (e.g. fewer batches or heads per call)")
    if any(t < 1 or t > m for t, m in zip(block, BLOCK_MAX)) or math.prod(block) > BLOCK_THREADS_MAX:
        raise KspecRuntimeError(f"{what}: the host glue prepared a block of {block} threads, beyond CUDA's limits; "
                                "the artifact is inconsistent", hint="rebuild the artifact with `kspec compile`")
    if any(c < 1 for c in cluster) or math.prod(cluster) > CLUSTER_MAX or \
            any(g % c for g, c in zip(grid, cluster)):
        raise KspecRuntimeError(f"{what}: the host glue prepared a cluster of {cluster} for a grid of {grid}, which "
                                "CUDA cannot launch; the artifact is inconsistent",
                                hint="rebuild the artifact with `kspec compile`")


def _param_offsets(binary, what: str) -> tuple[int, ...] | None:
    """Per-parameter offsets of a multi-parameter kernel (CuTe DSL: Binary.config["param_offsets"]),
    None for a kernel taking one Params struct."""
    raw = binary.config.get("param_offsets")
    if not raw:
        return None
    try:
        offs = tuple(int(x) for x in raw.split(","))
    except ValueError:
        raise KspecRuntimeError(f"{what}: malformed param_offsets {raw[:60]!r} in the manifest",
                                hint="rebuild the artifact with `kspec compile`") from None
    if any(o < 0 for o in offs) or list(offs) != sorted(offs):
        raise KspecRuntimeError(f"{what}: malformed param_offsets in the manifest",
                                hint="rebuild the artifact with `kspec compile`")
    return offs


_torch_cuda = False     # torch.cuda.is_available() once seen True: it stays so for the process


def _torch_with_cuda():
    """torch, when the caller has imported it and it has CUDA (outputs are then torch tensors)."""
    global _torch_cuda
    torch = sys.modules.get("torch")
    if torch is None or getattr(torch, "cuda", None) is None:
        return None
    if not _torch_cuda:
        if not torch.cuda.is_available():
            return None
        _torch_cuda = True
    return torch


def _names(specs) -> list[str]:
    return [t.name for t in specs]


def _pitched(k: KernelEntry, name: str) -> bool:
    """Whether every plan taking tensor `name` takes the strides of all its axes but the last as
    sizes (row kernels), so the tensor may come with rows at any pitch."""
    spec = k.tensor(name)
    if spec.layout != "row" or len(spec.shape) < 2:
        return False
    users = [p for p in k.plans if name in p.args]
    want = set(range(len(spec.shape) - 1))
    return bool(users) and all({a for t, a in p.strides.values() if t == name} >= want for p in users)


def _strides_of(b: Binding, name: str) -> tuple[int, ...]:
    return b.views[name].strides if name in b.views else b.strides[name]


def _nbytes(shape, strides, dtype: str) -> int:
    return dtypes.span_bytes(dtype, shape, strides)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _same_stream(a: int, b: int) -> bool:
    norm = lambda s: 1 if s in (0, 1) else s     # NULL and CU_STREAM_LEGACY are the same stream
    return norm(int(a)) == norm(int(b))


def _check_scalar(name: str, dtype: str, v: Any) -> float | int:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise KspecRuntimeError(f"parameter '{name}': expected a Python number ({dtype}), got {type(v).__name__}")
    if dtype in ("i8", "i32"):
        if not float(v).is_integer():
            raise KspecRuntimeError(f"parameter '{name}': expected an integer ({dtype}), got {v!r}")
        return int(v)
    return float(v)


def _layout_hint(spec: TensorSpec) -> str:
    if spec.layout == "col":
        return f"pass '{spec.name}' column-major, e.g. x.transpose(-1, -2).contiguous().transpose(-1, -2) in torch"
    return f"pass a contiguous tensor, e.g. {spec.name}.contiguous() in torch"


def _call_line(k: KernelEntry) -> str:
    parts = [f"{t.name}: {t.describe()}" for t in k.inputs]
    parts += [f"{t.name}: {t.describe()} = None" for t in k.outputs]
    parts += [f"{p.name}: {p.dtype}" + ("" if p.default is None else f" = {p.default!r}") for p in k.params]
    outs = ", ".join(t.name for t in k.outputs)
    return f"{k.name}({', '.join(parts)}, stream=None) -> {{{outs}}}"


def describe_kernel(k: KernelEntry, archs: tuple[str, ...]) -> str:
    """The text `help()` and the docs show for a kernel."""
    width = max([len(t.name) for t in (*k.inputs, *k.outputs)] + [len(p.name) for p in k.params] + [1])
    lines = [_call_line(k), ""]
    lines.append("Inputs:")
    lines += [f"  {t.name:<{width}}  {t.describe()}" for t in k.inputs]
    lines.append("Outputs (allocated when not passed; all returned in a dict by name):")
    lines += [f"  {t.name:<{width}}  {t.describe()}" for t in k.outputs]
    if k.params:
        lines.append("Params:")
        lines += [f"  {p.name:<{width}}  {p.dtype}" + ("  (required)" if p.default is None else f" = {p.default!r}")
                  for p in k.params]
    symbols = sorted({e for t in (*k.inputs, *k.outputs) for e in t.shape if isinstance(e, str)})
    if symbols:
        lines.append(f"Sizes {', '.join(symbols)} are bound from the arguments' shapes.")
    lines.append("Layouts: row = C-contiguous; col = last two axes swapped (column-major matrices).")
    if k.index_ranges:
        lines.append("Index tensors, checked before each launch unless check_indices is off: "
                     + "; ".join(r.describe() for r in k.index_ranges) + ".")
    lines.append(f"Plans: {', '.join(f'{p.id} ({p.kind})' for p in k.plans)}; archs: {', '.join(archs)}.")
    lines.append("stream: int handle, CUstream, torch/cupy stream; default: torch's current stream "
                 "for torch tensors, else the NULL stream.")
    return "\n".join(lines)


def _signature(k: KernelEntry) -> inspect.Signature | None:
    names = [*_names(k.inputs), *_names(k.outputs), *(p.name for p in k.params)]
    if any(keyword.iskeyword(n) or not n.isidentifier() for n in names):
        return None
    P = inspect.Parameter
    params = [P(t.name, P.POSITIONAL_OR_KEYWORD, annotation=t.describe()) for t in k.inputs]
    params += [P(t.name, P.KEYWORD_ONLY, default=None, annotation=t.describe()) for t in k.outputs]
    params += [P(p.name, P.KEYWORD_ONLY, default=P.empty if p.default is None else p.default, annotation=p.dtype)
               for p in k.params]
    params.append(P("stream", P.KEYWORD_ONLY, default=None))
    return inspect.Signature(params, return_annotation="dict[str, tensor]")
