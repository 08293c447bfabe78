"""Plain CUDA C++ for plans that are not GEMMs or fused attention: elementwise chains, reductions,
softmax, and contractions CUTLASS cannot take (several reduced indices, mixed or f32 operands).

One thread per output element (per row for softmax); every node's value is rounded to its dtype,
exactly as the numpy reference does, so these kernels match the reference to function accuracy.
A pure elementwise kernel (gathers and index arithmetic included) also has a vector path: VEC
consecutive elements along the innermost axis per thread, indices decoded once per thread, and the
tensors read or written contiguously along that axis moved as 128-bit loads and stores; the host
glue takes it when the innermost extent is a multiple of VEC and those pointers are 16-byte aligned,
else the one-element-per-thread path runs.  Literal extents are constants in the device code.
The source follows backends/ABI.md: a `Params` struct by value, `kspec_kernel`, and host glue.
Spec names never appear: buffers are `t0`, `t1`, ... and values `v0`, `v1`, ...

This module plans a kernel's code (`lower_generic`) and is the backend; gen.py holds the per-element
generator, vector.py the vector path, column.py column reductions (no fallback: 32 columns and a
share of the rows per CTA), split.py split reductions (no fallback: one output and a share of its
contiguous reduced elements per CTA), source.py the CUDA text and host glue.
"""
from __future__ import annotations

import networkx as nx

from kspec.backends.api import Capabilities, LoweredPlan
from kspec.backends.build import NvccBuilt
from kspec.backends.desc import EmittedKernel
from kspec.backends.generic.column import column_reduction, lower_column
from kspec.backends.generic.gen import (_CTYPE, _FN, BLOCK, VECTOR_MAX_OPS, GenericDesc, KspecLoweringError, _element,
                                        _Gen, _index_decode, _reduce_into, _round, _softmax_body, _stores)
from kspec.backends.generic.source import GLUE_ABI, GLUE_PREPARE_OPEN, emit_generic
from kspec.backends.generic.split import lower_split, split_reduction
from kspec.backends.generic.vector import _vector_path
from kspec.backends.names import number_placeholders
from kspec.compiler.graph import op
from kspec.compiler.kir import KINDS, KernelIR
from kspec.core import ARCHS, KspecError, dtype_bytes

# the names the row kernels (backends/rowwise) share
__all__ = ["BLOCK", "GLUE_ABI", "GLUE_PREPARE_OPEN", "GenericBackend", "GenericDesc", "KspecLoweringError",
           "emit_generic", "lower_generic", "_CTYPE", "_FN", "_round"]


def lower_generic(ir: KernelIR, arch: str) -> LoweredPlan:
    try:
        return _lower_generic(ir, arch)
    except RecursionError:
        # values feeding a loop are inlined into one C expression: a chain of thousands of ops is
        # more than the generator (or nvcc) takes
        raise KspecLoweringError(f"plan {ir.id}: the CUDA backend cannot inline an expression this deep (split the chain "
                                 "with a stored intermediate)", ir.span) from None


def _lower_generic(ir: KernelIR, arch: str) -> LoweredPlan:
    for b in ir.buffers:
        if b.dtype not in _CTYPE:
            # FP4 data (two values a byte) and E8M0 scales: block-scaled GEMMs on tensor cores only
            raise KspecLoweringError(f"plan {ir.id}: {b.name} is {b.dtype}, which the plain CUDA kernels do not "
                                     "read or write (block-scaled formats: tensor-core GEMMs only)", ir.span)
    for o in ir.ops:
        if o.dtype not in _CTYPE and o.dtype != "bool":
            raise KspecLoweringError(f"plan {ir.id}: a {o.dtype} value, which the plain CUDA kernels do not "
                                     "compute with", ir.span)
    gen = _Gen(ir, arch)
    g = gen.g
    plan_id = ir.id
    nodes = [o.id for o in ir.internal if o.kind != "const"]
    leaving = [n for n in nodes if ir.stores_of(n)]
    softmaxes = [n for n in nodes if op(g, n).kind == "softmax"]
    root = softmaxes[0] if softmaxes else (leaving[-1] if leaving else nodes[-1])
    ro = op(g, root)
    space = ro.axes if ro.kind != "softmax" else tuple(a for a in ro.axes if a != ro.fn)
    # the iteration space; a contraction/reduction/softmax adds its loop axes after it
    for label, ext in zip(ro.axes, ro.shape):
        gen.dim(label, ext)
    body: list[str] = []
    threads = " * ".join(f"p.dim[{gen.dim_of[l][1:]}]" for l in space) or "1LL"
    body.append("long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;")
    body.append("if (tid >= p.count) return;")
    body += _index_decode(gen, space, "tid")
    kinds = {op(g, n).kind for n in nodes}
    loop_nodes = [n for n in nodes if op(g, n).kind in ("softmax", "reduction")]
    after = [n for n in nodes if loop_nodes and n in nx.descendants(g, loop_nodes[0])]
    if loop_nodes and (len(loop_nodes) > 1 or (op(g, loop_nodes[0]).kind == "reduction" and after)):
        raise KspecLoweringError(f"plan {plan_id}: the CUDA backend runs one reduction or softmax per kernel, "
                                 "and a reduction as the kernel's only result", op(g, loop_nodes[0]).span)
    # elementwise nodes feeding a reduction/softmax are recomputed inside its loops
    gen.inline = set(nodes) - set(loop_nodes) - set(after) if loop_nodes else set()
    column = column_reduction(ir)
    if column is not None:
        return lower_column(gen, column, space, plan_id)
    split = split_reduction(ir)
    if split is not None:
        return lower_split(gen, split, space, plan_id)
    vector, vbody = None, []
    if loop_nodes and op(g, loop_nodes[0]).kind == "softmax":
        root = loop_nodes[0]
        ro = op(g, root)
        _softmax_body(gen, root, body, after, [n for n in leaving if n == root or n in after])
    elif loop_nodes:
        body.extend(_reduce_into(gen, root, "v0"))
        _stores(gen, root, "v0", body)
    else:
        body += _element(gen, nodes, leaving, space, kinds)
        if space and "contraction" not in kinds and len(nodes) <= VECTOR_MAX_OPS:
            vector = _vector_path(gen, nodes, leaving, space, kinds)
            if vector is not None:
                vbody = vector[0]
                body = [f"if (p.vec == {w}) {{ if (p.idx32) kspec_vector<{w}, unsigned int>(p); "
                        f"else kspec_vector<{w}, long long>(p); return; }}" for w in vector[1].widths] + body
    names = gen.names
    split = "\n//--vector--\n"
    text, args, scalars = number_placeholders("\n".join("    " + line for line in body) + split
                                              + "\n".join("  " + line for line in vbody), names, gen.scalars)
    text, vtext = text.split(split)
    back = names.back()
    vec, vec_dim, vec_args = (), "", ()
    if vector is not None:
        vec, vec_dim, vec_args = vector[1].widths, vector[1].d, tuple(a for a in args if a in vector[1].ptrs)
    desc = GenericDesc(name=f"k_{plan_id.rsplit('_', 1)[-1]}", arch=arch, body=text, args=args, scalars=scalars,
                       dims=tuple(d for d, _ in gen.dim_values), threads=threads,
                       arg_bytes=tuple(dtype_bytes(ir.buffer(back[a]).dtype) for a in args),
                       vec=vec, vec_dim=vec_dim, vec_args=vec_args, vec_body=vtext)
    return LoweredPlan(ir, arch, "generic", desc, names.back(), tuple(gen.dim_values), dict(gen.scalars))


class GenericBackend(NvccBuilt):
    """Plain CUDA loop kernels for every kernel IR: the backend of last resort.  Elementwise kernels
    are what it is for; any other kind it runs is reported as a fallback (and refused by --strict)."""
    name = "generic"
    capabilities = Capabilities(archs=ARCHS, kinds=("elementwise",),
                                fallback_kinds=tuple(k for k in KINDS if k != "elementwise"))

    def identity(self) -> str:
        return "kspec-generic 2"

    def can_implement(self, ir: KernelIR, arch: str) -> str | None:
        if arch not in ARCHS:
            return f"the generic backend does not target {arch}"
        if ir.kind == "attention":
            return "fused attention has no loop-kernel form (the unfused plan is used instead)"
        if ir.kind == "colsum" or any(o.kind == "partial" for o in ir.ops):
            return "column partials (a row kernel's sums over its rows) are built by the row-kernel backend only"
        if ir.kind == "gemm" and ir.gemm.a_rows is not None:
            return "a GEMM with gathered A rows has no loop-kernel form (the gather runs as a kernel of its own instead)"
        if ir.kind == "gemm" and ir.gemm.scales:
            return "a block-scaled GEMM has no loop-kernel form (its unfused ops run as separate kernels instead)"
        if ir.kind == "gemm" and ir.epilogue.reductions:
            return (f"it cannot fuse the epilogue reduction into {ir.epilogue.reductions[0].name} (use operand "
                    "dtypes a tensor-core backend takes, or reduce a stored result in a statement of its own)")
        loops = [o for o in ir.internal if o.kind in ("softmax", "reduction")]
        if len(loops) > 1:
            return "it runs one reduction or softmax per kernel"
        # what its code generator cannot express is refused here, when the kernel is planned, so
        # `kspec graph` never plans a kernel that `kspec compile` then rejects (generation is cheap)
        try:
            self._remember(ir, arch, lower_generic(ir, arch))
        except KspecLoweringError as e:
            return e.message.split(": ", 1)[1] if e.message.startswith(f"plan {ir.id}: ") else e.message
        return None

    def _remember(self, ir: KernelIR, arch: str, lowered: LoweredPlan) -> None:
        """The vector widths of a kernel just lowered, for default_config (which the registry asks
        right after can_implement: the kernel is not generated twice)."""
        memo = self.__dict__.setdefault("_widths", {})
        if len(memo) > 256:
            memo.clear()
        memo[(id(ir), arch)] = (ir, lowered.desc.vec)

    def setting_problem(self, ir: KernelIR, arch: str) -> None:
        return None          # loop kernels take no tile, cluster or stage settings: they ignore them

    def is_fallback(self, ir: KernelIR) -> str | None:
        if ir.kind == "elementwise" or (ir.kind in ("reduction", "contraction")
                                        and (column_reduction(ir) is not None or split_reduction(ir) is not None)):
            return None
        return {"gemm": "a naive loop GEMM (one thread per output element, no tensor cores)",
                "contraction": "a naive loop contraction (one thread per output element)",
                "reduction": "a loop reduction (one thread per output element)",
                "softmax": "a loop softmax (one thread per row, three passes over memory)"}.get(
                    ir.kind, f"a loop {ir.kind} kernel")

    def default_config(self, ir: KernelIR, arch: str) -> tuple[tuple[str, str], ...]:
        """The block size, and for an elementwise kernel with a vector path its widths (`vec`: what
        `kspec graph` prints is what the kernel does; the host glue picks one at launch)."""
        if ir.kind != "elementwise":
            return (("block", str(BLOCK)),)
        hit = self.__dict__.get("_widths", {}).get((id(ir), arch))
        if hit is None or hit[0] is not ir:
            try:
                self._remember(ir, arch, lower_generic(ir, arch))
            except KspecLoweringError:
                return (("block", str(BLOCK)),)
            hit = self._widths[(id(ir), arch)]
        vec = hit[1]
        return (("block", str(BLOCK)),) + ((("vec", ",".join(map(str, vec))),) if vec else ())

    def candidates(self, ir: KernelIR, arch: str) -> list[tuple[tuple[str, str], ...]]:
        return [self.default_config(ir, arch)]

    def lower(self, ir: KernelIR, arch: str, config: tuple[tuple[str, str], ...] | None = None) -> LoweredPlan:
        # one configuration (the block size is fixed); a tuned config can only be the default
        if config is not None and dict(config).get("block", str(BLOCK)) != str(BLOCK):
            raise KspecError(f"kernel {ir.id} on {arch}: the generic backend has no configuration {dict(config)}",
                             ir.span, "a tuning database entry may be stale; re-run `kspec tune`")
        return lower_generic(ir, arch)

    def emit(self, lowered: LoweredPlan) -> EmittedKernel:
        return emit_generic(lowered.desc)
