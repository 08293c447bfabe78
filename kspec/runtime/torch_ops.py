"""Loaded kernels as PyTorch custom operators (`torch.library.custom_op`), so they trace into
`torch.compile` / `torch.export` graphs and can be captured into CUDA graphs.

    op = mod.gemm_bias_relu.as_torch_op()        # registers torch.ops.kspec.gemm_bias_relu_<hash>
    out = op(A, B, bias)                         # {"D": tensor}, like calling the kernel
    D = op.op(A, B, bias, alpha=1.0)             # the raw operator (a tuple when several outputs)

The operator is functional: inputs are read, every output is a new tensor (allocated by torch in
the layout the spec fixes, so `col` outputs come back column-major), params are scalars with the
spec's defaults.  It runs on torch's current CUDA stream.  Its fake ("meta") implementation
computes output shapes, strides and dtypes from the manifest's TensorSpecs and the size symbols
bound by the inputs, without touching a GPU, so compilers trace it on any machine.

The operator's name carries a digest of the kernel's manifest entry and binaries: loading the
same artifact again (or a copy of it) reuses the registered operator; a rebuilt kernel with other
binaries gets a new one.  torch is imported here only; nothing else in the runtime needs it.
No autograd formula is registered: outputs do not require grad.

CUDA graph capture: call the kernel (or the op) once before capturing, so its cubin and host glue
are loaded outside the capture; inside the capture its scratch memory comes from the stream-
ordered pool and its outputs from torch's graph pool.
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from typing import Any

from kspec.artifact import KernelEntry, TensorSpec, manifest_to_json
from kspec.runtime import dtypes
from kspec.runtime.errors import KspecRuntimeError

NAMESPACE = "kspec"


@dataclass
class _Registered:
    op: Any                  # the torch OpOverloadPacket's default overload
    kernel: Any              # the runtime Kernel the CUDA implementation launches (latest load)


class TorchOpRegistry:
    """The process's registered kspec operators, by qualified name (torch's own registry cannot
    unregister, so a name must be registered exactly once)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ops: dict[str, _Registered] = {}

    def get_or_register(self, kernel) -> "TorchOp":
        import torch  # noqa: F401  (the caller asked for a torch op)
        name = op_name(kernel)
        with self._lock:
            reg = self._ops.get(name)
            if reg is None:
                reg = _Registered(None, kernel)
                reg.op = _register(name, kernel.entry, lambda: reg.kernel)
                self._ops[name] = reg
            else:
                reg.kernel = kernel          # same content: launch from the most recent load
        return TorchOp(name, reg.op, kernel.entry)


REGISTRY = TorchOpRegistry()


def op_name(kernel) -> str:
    """`<kernel name>_<12 hex digits>`: the digest covers the kernel's manifest entry (signature,
    plans, binaries' sha256), so identical artifacts share an operator and others never do."""
    mj = manifest_to_json(kernel._module.manifest)
    entry = next(k for k in mj["kernels"] if k["name"] == kernel.entry.name)
    digest = hashlib.sha256(json.dumps([mj["archs"], entry], sort_keys=True).encode()).hexdigest()[:12]
    return f"{kernel.entry.name}_{digest}"


def _scalar_type(dtype: str) -> str:
    return "int" if dtype in ("i8", "i32") else "float"


def schema(entry: KernelEntry) -> str:
    """The operator schema: tensors for the inputs, scalars for the params, a tuple of outputs."""
    args = [f"Tensor {t.name}" for t in entry.inputs]
    if entry.params:
        args.append("*")              # params are keyword-only, like the kernel's own call
    for p in entry.params:
        default = "" if p.default is None else f"={_schema_number(p.default, p.dtype)}"
        args.append(f"{_scalar_type(p.dtype)} {p.name}{default}")
    outs = "Tensor" if len(entry.outputs) == 1 else f"({', '.join('Tensor' for _ in entry.outputs)})"
    return f"({', '.join(args)}) -> {outs}"


def _schema_number(v: float | int, dtype: str) -> str:
    if dtype in ("i8", "i32"):
        return str(int(v))
    f = float(v)
    if f != f or f in (float("inf"), float("-inf")):
        raise KspecRuntimeError(f"parameter default {v!r} cannot be expressed in a torch operator schema")
    return repr(f)


def _unbound_output_symbols(entry: KernelEntry) -> list[str]:
    bound = {e for t in entry.inputs for e in t.shape if isinstance(e, str)}
    return sorted({e for t in entry.outputs for e in t.shape if isinstance(e, str) and e not in bound})


def output_meta(entry: KernelEntry, inputs: dict[str, Any]) -> list[tuple[tuple, str]]:
    """(shape, kspec dtype) of every output from the inputs' shapes (ints or torch SymInts),
    checking ranks, literal extents, dtypes and symbol agreement the way `Kernel.check` does."""
    sizes: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for spec in entry.inputs:
        t = inputs[spec.name]
        shape = tuple(t.shape)
        got = dtypes.from_torch(t.dtype)
        want = dtypes.storage(spec.dtype)
        if got != want:
            raise KspecRuntimeError(f"{entry.name}: argument '{spec.name}': expected {want}, got {got}")
        if len(shape) != len(spec.shape):
            raise KspecRuntimeError(f"{entry.name}: argument '{spec.name}': expected rank {len(spec.shape)} "
                                    f"({spec.describe()}), got shape {tuple(shape)}")
        for axis, (e, n) in enumerate(zip(spec.shape, shape)):
            if isinstance(e, int):
                if n != e:
                    raise KspecRuntimeError(f"{entry.name}: argument '{spec.name}': dimension {axis} must be "
                                            f"{e}, got {n}")
            elif e in sizes:
                if n != sizes[e]:
                    raise KspecRuntimeError(f"{entry.name}: argument '{spec.name}': dimension {axis} ({e}) is "
                                            f"{n}, but '{origin[e]}' has {e} = {sizes[e]}")
            else:
                sizes[e], origin[e] = n, spec.name
    return [(tuple(e if isinstance(e, int) else sizes[e] for e in t.shape), t.dtype) for t in entry.outputs]


def _empty(torch, shape: tuple, spec: TensorSpec, device):
    """An uninitialised tensor with the strides the spec's layout fixes (col: last two axes swapped)."""
    dtype = getattr(torch, dtypes.DTYPES[spec.dtype].torch)
    if spec.layout == "col":
        swapped = (*shape[:-2], shape[-1], shape[-2])
        return torch.empty(swapped, dtype=dtype, device=device).transpose(-1, -2)
    return torch.empty(shape, dtype=dtype, device=device)


def _register(name: str, entry: KernelEntry, current_kernel):
    import torch
    unbound = _unbound_output_symbols(entry)
    if unbound:
        raise KspecRuntimeError(
            f"kernel '{entry.name}' cannot be a functional torch operator: output size(s) "
            f"{', '.join(unbound)} are not bound by any input",
            hint="call the kernel directly and pass those outputs explicitly")
    if not entry.inputs:
        raise KspecRuntimeError(f"kernel '{entry.name}' has no tensor inputs, so a torch operator cannot "
                                f"tell the device to run on")
    in_names = [t.name for t in entry.inputs]
    p_names = [p.name for p in entry.params]

    def split(args, kwargs) -> tuple[dict, dict]:
        return dict(zip(in_names, args)), {n: kwargs[n] for n in p_names if n in kwargs}

    def impl(*args, **kwargs):
        tensors, params = split(args, kwargs)
        for n, t in tensors.items():
            if t.device.type != "cuda":
                raise KspecRuntimeError(f"{entry.name}: argument '{n}': torch tensor is on {t.device}; "
                                        f"expected a CUDA tensor", hint="move it with .cuda()")
        device = tensors[in_names[0]].device
        outs = {t.name: _empty(torch, shape, t, device)
                for t, (shape, _) in zip(entry.outputs, output_meta(entry, tensors))}
        # torch's current stream on the tensors' device (Kernel's default for torch tensors)
        current_kernel()(**tensors, **outs, **params)
        return _result(tuple(outs[t.name] for t in entry.outputs))

    def fake_impl(*args, **kwargs):
        tensors, _ = split(args, kwargs)
        device = tensors[in_names[0]].device
        return _result(tuple(_empty(torch, shape, t, device)
                             for t, (shape, _) in zip(entry.outputs, output_meta(entry, tensors))))

    # registered for the CPU too, only to say clearly that the tensors must be on the GPU
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=(), device_types=("cuda", "cpu"),
                                 schema=schema(entry))
    op.register_fake(fake_impl)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _result(outs: tuple):
    """The schema returns one Tensor for a single output, else a tuple."""
    return outs[0] if len(outs) == 1 else outs


class TorchOp:
    """A kernel as a torch operator.  Calling it takes the kernel's inputs (positional or by name)
    and params (by name) and returns a dict of outputs by name; `.op` is the operator itself
    (`torch.ops.kspec.<name>.default`: inputs positional, params keyword-only, returning the output,
    or a tuple of the outputs in spec order)."""

    def __init__(self, name: str, op, entry: KernelEntry):
        self.name = name
        self.qualified_name = f"{NAMESPACE}::{name}"
        self.op = op
        self.entry = entry

    def __call__(self, *args, **kwargs) -> dict[str, Any]:
        e = self.entry
        in_names = [t.name for t in e.inputs]
        if len(args) > len(in_names):
            raise KspecRuntimeError(f"{e.name}() takes {len(in_names)} positional input(s), got {len(args)}")
        values = dict(zip(in_names, args))
        for k, v in kwargs.items():
            if k in values:
                raise KspecRuntimeError(f"{e.name}(): argument '{k}' given twice")
            if k not in in_names and k not in {p.name for p in e.params}:
                known = ", ".join([*in_names, *(p.name for p in e.params)])
                raise KspecRuntimeError(f"{e.name}(): unexpected argument '{k}' (a torch op takes: {known}; "
                                        f"outputs are always allocated)")
            values[k] = v
        missing = [n for n in in_names if n not in values]
        if missing:
            raise KspecRuntimeError(f"{e.name}(): missing input(s) {', '.join(missing)}")
        call = [values[n] for n in in_names]
        params = {}
        for p in e.params:
            if p.name in values:
                v = values[p.name]
                params[p.name] = int(v) if p.dtype in ("i8", "i32") else float(v)
            elif p.default is None:
                raise KspecRuntimeError(f"{e.name}(): missing parameter '{p.name}' ({p.dtype}, no default)")
        outs = self.op(*call, **params)
        if not isinstance(outs, (tuple, list)):
            outs = (outs,)
        return {t.name: o for t, o in zip(e.outputs, outs)}

    def __repr__(self) -> str:
        return f"<kspec torch op {self.qualified_name}{schema(self.entry)}>"
