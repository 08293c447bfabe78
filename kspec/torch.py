"""Differentiable kspec kernels for PyTorch: a `kspec grad` pair (NAME_fwd, NAME_bwd) as one
autograd-aware callable, built from two `torch.library` custom operators with a registered
autograd formula, so `loss.backward()`, `torch.autograd.gradcheck` and `torch.compile` see it.

    rms = kspec.torch.trainable("specs/rmsnorm.kspec")              # derives the pair (kspec grad)
    rms = kspec.torch.trainable("rmsnorm_grad.kspec", "rmsnorm", artifact="out/rmsnorm_grad")
    y = rms(x, w, eps=1e-6)["y"]                                    # differentiable in x and w

The callable returns NAME_fwd's outputs by name: the forward's own and the statistics it saves for
the backward (a norm's mean, a softmax's log-sum-exp), which carry no gradient.  Its backward
calls NAME_bwd with the forward's inputs and outputs and d<OUT> per output (zeros for an output
whose gradient is not needed), and returns d<IN> for each input NAME_bwd differentiates (None for
integer inputs and the others).  Params are keyword arguments with the spec's defaults.

Where it runs: CUDA tensors launch the compiled kernels of `artifact` (a `kspec compile` output
directory of the pair, loaded with kspec.load); CPU tensors run the numpy reference, in the spec's
dtypes, so training steps and gradcheck run on a machine without a GPU.  The operators are
registered once per process and content (their names carry a digest of the pair's spec text).

This module imports torch, the spec language and the reference backend; the runtime (kspec.runtime)
stays free of all three.
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import numpy as np

from kspec.core import INT_DTYPES, KspecError

NAMESPACE = "kspec"
_LOCK = threading.Lock()
_REGISTERED: dict[str, "Trainable"] = {}


def trainable(spec, kernel: str | None = None, *, artifact=None, wrt: list[str] | None = None) -> "Trainable":
    """A differentiable callable for `kernel` of `spec`: a path, spec text or CheckedProgram that
    either holds KERNEL_fwd and KERNEL_bwd (what `kspec grad` writes) or the forward itself (the pair
    is derived here, with `wrt`).  `artifact`: the compiled pair (a directory or a loaded module),
    used for CUDA tensors."""
    from kspec.spec_lang import CheckedProgram, load_spec
    from kspec.spec_lang.grad import grad_program
    if isinstance(spec, CheckedProgram):
        program = spec
    elif isinstance(spec, Path) or (isinstance(spec, str) and "{" not in spec):
        program = load_spec(spec)
    else:
        program = load_spec(spec, is_text=True)
    names = [k.name for k in program.kernels]
    if kernel is None:
        pairs = [n[:-4] for n in names if n.endswith("_fwd") and n[:-4] + "_bwd" in names]
        plain = [n for n in names if not (n.endswith("_fwd") or n.endswith("_bwd"))]
        if len(pairs) == 1 and not plain:
            kernel = pairs[0]
        elif len(plain) == 1 and not pairs:
            kernel = plain[0]
        else:
            raise KspecError(f"{program.file} holds kernels {', '.join(names)}; name the one to train with kernel=")
    if f"{kernel}_fwd" not in names or f"{kernel}_bwd" not in names:
        program = load_spec(grad_program(program, kernel, wrt), is_text=True, file=f"<kspec grad {kernel}>")
    elif wrt is not None:
        raise KspecError(f"{program.file} already holds {kernel}_fwd and {kernel}_bwd: wrt= applies when the pair "
                         "is derived (`kspec grad --wrt`)")
    module = artifact
    if artifact is not None and isinstance(artifact, (str, Path)):
        import kspec
        module = kspec.load(artifact)
    from kspec.spec_lang.printer import print_program
    from kspec.spec_lang.parser import parse
    text = print_program(parse(program.source, program.file)) if program.source else repr(program)
    key = hashlib.sha256(f"{kernel}\n{text}".encode()).hexdigest()[:12]
    with _LOCK:
        t = _REGISTERED.get(key)
        if t is None:
            t = Trainable(program, kernel, key)
            _REGISTERED[key] = t
        if module is not None:
            t.module = module
    return t


class Trainable:
    """KERNEL_fwd and KERNEL_bwd of a checked program as a differentiable torch callable."""

    def __init__(self, program, kernel: str, digest: str):
        import torch
        from kspec.backends.reference import ReferenceKernel
        self.name = kernel
        self.fwd = program.kernel(f"{kernel}_fwd")
        self.bwd = program.kernel(f"{kernel}_bwd")
        self.ref_fwd, self.ref_bwd = ReferenceKernel(self.fwd), ReferenceKernel(self.bwd)
        self.module = None
        self.inputs = [t.name for t in self.fwd.inputs]
        self.params = list(self.fwd.params)
        self.outputs = [t.name for t in self.fwd.outputs]
        bwd_in = {t.name for t in self.bwd.inputs}
        # outputs whose gradient the backward takes (d<OUT>), inputs whose gradient it gives (d<IN>)
        self.grad_of_output = {o: "d" + o for o in self.outputs if "d" + o in bwd_in}
        bwd_out = {t.name for t in self.bwd.outputs}
        self.grad_of_input = {i: "d" + i for i in self.inputs if "d" + i in bwd_out}
        self.fwd_op = self._register(f"{kernel}_fwd_{digest}", self.fwd, self.ref_fwd, "fwd")
        self.bwd_op = self._register(f"{kernel}_bwd_{digest}", self.bwd, self.ref_bwd, "bwd")
        torch.library.register_autograd(f"{NAMESPACE}::{kernel}_fwd_{digest}", self._backward,
                                        setup_context=self._setup_context)

    def __repr__(self) -> str:
        return (f"<kspec trainable {self.name}({', '.join(self.inputs)}) -> ({', '.join(self.outputs)}); "
                f"gradients: {', '.join(self.grad_of_input.values()) or 'none'}>")

    # ---- calling ----
    def __call__(self, *args, **kwargs) -> dict[str, Any]:
        if len(args) > len(self.inputs):
            raise KspecError(f"{self.name}() takes {len(self.inputs)} inputs ({', '.join(self.inputs)}), "
                             f"got {len(args)}")
        values = dict(zip(self.inputs, args))
        for k, v in kwargs.items():
            if k in values:
                raise KspecError(f"{self.name}(): argument '{k}' given twice")
            if k not in self.inputs and k not in {p.name for p in self.params}:
                raise KspecError(f"{self.name}(): unexpected argument '{k}'",
                                 hint=f"inputs: {', '.join(self.inputs)}; params: "
                                 f"{', '.join(p.name for p in self.params) or 'none'}")
            values[k] = v
        missing = [n for n in self.inputs if n not in values]
        if missing:
            raise KspecError(f"{self.name}(): missing input(s) {', '.join(missing)}")
        params = self._params(values)
        outs = self.fwd_op(*(values[n] for n in self.inputs), **params)
        if not isinstance(outs, (tuple, list)):
            outs = (outs,)
        return dict(zip(self.outputs, outs))

    def _params(self, values) -> dict:
        out = {}
        for p in self.params:
            v = values.get(p.name, p.default)
            if v is None:
                raise KspecError(f"{self.name}(): missing parameter '{p.name}' ({p.dtype}, no default)")
            out[p.name] = int(v) if p.dtype in INT_DTYPES else float(v)
        return out

    # ---- the operators ----
    def _register(self, name: str, kernel, ref, which: str):
        import torch
        in_names = [t.name for t in kernel.inputs]
        outs = kernel.outputs
        args = [f"Tensor {n}" for n in in_names]
        if kernel.params:
            args.append("*")
            args += [f"{'int' if p.dtype in INT_DTYPES else 'float'} {p.name}" for p in kernel.params]
        ret = "Tensor" if len(outs) == 1 else f"({', '.join('Tensor' for _ in outs)})"
        schema = f"({', '.join(args)}) -> {ret}"

        def impl(*tensors, **params):
            if tensors[0].device.type == "cuda":
                return self._launch(kernel, tensors, params)
            got = ref(**{n: _to_numpy(t) for n, t in zip(in_names, tensors)}, **params)
            res = tuple(_from_numpy(torch, got[t.name], t.dtype) for t in outs)
            return res[0] if len(res) == 1 else res

        def fake(*tensors, **params):
            sizes = _sizes(kernel, in_names, tensors)
            res = tuple(tensors[0].new_empty(tuple(d if isinstance(d, int) else sizes[d] for d in t.shape),
                                             dtype=_torch_dtype(torch, t.dtype)) for t in outs)
            return res[0] if len(res) == 1 else res

        op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=(), device_types=("cpu", "cuda"),
                                     schema=schema)
        op.register_fake(fake)
        return getattr(getattr(torch.ops, NAMESPACE), name).default

    def _launch(self, kernel, tensors, params):
        if self.module is None:
            raise KspecError(f"{self.name}: CUDA tensors need the compiled pair",
                             hint="kspec compile the grad spec and pass artifact=DIR to kspec.torch.trainable")
        k = getattr(self.module, kernel.name)
        got = k(**dict(zip([t.name for t in kernel.inputs], tensors)), **params)
        res = tuple(got[t.name] for t in kernel.outputs)
        return res[0] if len(res) == 1 else res

    # ---- autograd ----
    def _setup_context(self, ctx, inputs, output, keyword_only_inputs=None):
        outs = output if isinstance(output, (tuple, list)) else (output,)
        ctx.save_for_backward(*inputs, *outs)
        ctx.kspec_params = dict(keyword_only_inputs or {})
        ctx.mark_non_differentiable(*(o for n, o in zip(self.outputs, outs) if n not in self.grad_of_output))

    def _backward(self, ctx, *grads):
        import torch
        saved = ctx.saved_tensors
        ins, outs = saved[:len(self.inputs)], saved[len(self.inputs):]
        values = dict(zip(self.inputs, ins)) | dict(zip(self.outputs, outs))
        for name, g, o in zip(self.outputs, grads, outs):
            if name in self.grad_of_output:
                values[self.grad_of_output[name]] = torch.zeros_like(o) if g is None else \
                    g.to(o.dtype).contiguous()
        bwd_in = [t.name for t in self.bwd.inputs]
        res = self.bwd_op(*(values[n] for n in bwd_in), **ctx.kspec_params)
        if not isinstance(res, (tuple, list)):
            res = (res,)
        got = dict(zip([t.name for t in self.bwd.outputs], res))
        return tuple(got.get(self.grad_of_input[n]) if n in self.grad_of_input else None for n in self.inputs)


def _sizes(kernel, names, tensors) -> dict:
    sizes: dict = {}
    for n, t in zip(names, tensors):
        for d, e in zip(kernel.tensor(n).shape, t.shape):
            if isinstance(d, str):
                sizes.setdefault(d, e)
    return sizes


def _torch_dtype(torch, dtype: str):
    from kspec.runtime.dtypes import DTYPES
    return getattr(torch, DTYPES[dtype].torch)


def _to_numpy(t) -> np.ndarray:
    """A CPU tensor as numpy (16-bit floats through f32; the reference rounds to the spec's dtype)."""
    import torch
    t = t.detach().cpu()
    if t.is_floating_point() and t.dtype != torch.float64:
        t = t.float()
    return t.numpy()


def _from_numpy(torch, a, dtype: str):
    a = np.asarray(a)
    if a.dtype.kind == "f" or a.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return torch.from_numpy(np.ascontiguousarray(a.astype(np.float32))).to(_torch_dtype(torch, dtype))
    return torch.from_numpy(np.ascontiguousarray(a)).to(_torch_dtype(torch, dtype))
