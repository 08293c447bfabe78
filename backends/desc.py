"""Kernel descriptors: the backend-neutral contract between the compiler's plans and a code generator.

A backend's `lower(ir, arch)` turns a kernel IR (compiler/kir.py) into one of the descriptors
below, and its code generator emits C++ from the descriptor alone.  Every name in a
descriptor is already a sanitized C identifier (`t0`, `t1`, ...): user text never reaches C++.

Conventions
- dtypes are kspec dtype names: "f16", "bf16", "f32", "tf32", "f8e4m3", "f8e5m2", "i8", "i32".
- GEMM computes D[m, n] = epilogue(accum[m, n]) with accum[m, n] = sum_k A[m, k] * B[k, n]
  (batched: a leading batch index L on A, B, D and every full-size epilogue tensor).
- Layout "row" means the last index is contiguous (A: K-contiguous, B: N-contiguous);
  "col" means the first index of the 2-D matrix is contiguous (A: M-contiguous, B: K-contiguous).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from kspec.core import ARCH_TABLE, ARCHS  # noqa: F401

Arch = Literal["sm90a", "sm100a"]
ARCH_CC = {a.name: a.cc for a in ARCH_TABLE.values()}


@dataclass(frozen=True)
class Operand:
    name: str            # sanitized identifier of the argument
    dtype: str
    layout: Literal["row", "col"] = "row"


# The epilogue expression DAG belongs to the kernel IR; descriptors reuse it with C identifiers as names.
from kspec.compiler.kir import Accum, BlockScale, Const, EpiExpr, Load, Op, ReductionStore, Store  # noqa: E402,F401


@dataclass(frozen=True)
class GemmDesc:
    name: str                      # sanitized kernel id, unique within an artifact
    arch: str                      # "sm90a" | "sm100a"
    a: Operand
    b: Operand
    acc_dtype: str                 # "f32" (or "i32" for i8)
    output: Store                  # the D tensor
    aux_stores: tuple[Store, ...] = ()
    reductions: tuple[ReductionStore, ...] = ()
    batched: bool = False
    # scalars applied to the accumulator before the epilogue (fp8 per-tensor scales), names of
    # 'scalar' Loads; the epilogue expression already contains them, this is informational.
    tile: tuple[int, int, int] | None = None       # CTA tile M x N x K; None = backend default
    cluster: tuple[int, int, int] | None = None
    stages: int | None = None
    # a dual GEMM: a second B operand (same dtype, layout and extents as b) whose product with A is
    # the epilogue's Accum(1) (SwiGLU's up projection beside the gate projection)
    b2: Operand | None = None
    # a block-scaled GEMM (compiler.kir.BlockScale, with C identifiers as buffer names): factors
    # read at blocks of K inside the sum
    scales: tuple = ()
    # a grouped GEMM: A's and D's rows packed by group (`packed(off)`), B one matrix per group; the
    # offsets tensor's C name (i32 [L + 1]); its per-row epilogue vectors are packed the same way
    grouped: str | None = None
    # a grouped GEMM whose A rows are gathered: the index tensor's C name (i32 [M], packed by the
    # offsets): GEMM row r is row a_rows[r] of A ([R, K], R its own row count)
    a_rows: str | None = None

    def reduction_init(self) -> tuple[tuple[str, str], ...]:
        """What the loader fills each epilogue reduction output with before the launch (the
        identity of its atomic combination): EmittedKernel.init."""
        return tuple((r.name, "neg_inf" if r.op == "max" else "zero") for r in self.reductions)


@dataclass(frozen=True)
class AttentionDesc:
    """O[b, h, i, e] = sum_j softmax_j(scale * sum_e Q[b,h,i,e] K[b,h,j,e]) V[b,h,j,e]
    (optionally causal: key j masked out when j > i).  Tensors are contiguous [B, H, S|T, E]."""
    name: str
    arch: str
    q: Operand
    k: Operand
    v: Operand
    o: Operand
    head_dim: int
    scale: Load | Const            # runtime scalar param or folded constant
    causal: bool = False
    tile: tuple[int, int, int] | None = None


KernelDesc = Union[GemmDesc, AttentionDesc]


@dataclass(frozen=True)
class EmittedKernel:
    """What a code generator returns for one descriptor: one `.cu` source (compiled twice, see
    backends/ABI.md: `-DKSPEC_DEVICE -cubin` and `-DKSPEC_HOST -shared`) plus the launch facts the
    manifest records.

    dims:    size roles in ABI order: GEMM ("M", "N", "K", "L") with L = 1 when not batched;
             attention ("B", "H", "S", "T", "E"); elementwise: the output extents in order
             ("d0", "d1", ...).
    args:    tensor argument names (descriptor names) in ABI pointer order.
    scalars: scalar parameter names in ABI order.
    init:    outputs the loader must fill before launch (atomic reductions): name -> "zero" | "neg_inf".
    alignment: required byte alignment per tensor argument.
    multiples: size roles (of dims) whose value must be a multiple of a number: the kernel has no
             tail handling there (e.g. the CuTe DSL GEMM whose A rows are gathered reads whole
             128-byte K tiles).  The manifest records them (plans[*].multiples) and the runtime
             refuses other sizes before any launch.
    config:  the tile/cluster/stages/schedule actually chosen, for the manifest and `kspec inspect`.
    """
    name: str
    arch: str
    source: str
    include_dirs: tuple[str, ...]
    flags: tuple[str, ...]
    dims: tuple[str, ...]
    args: tuple[str, ...]
    scalars: tuple[str, ...] = ()
    init: tuple[tuple[str, str], ...] = ()
    alignment: tuple[tuple[str, int], ...] = ()
    config: tuple[tuple[str, str], ...] = ()
    multiples: tuple[tuple[str, int], ...] = ()
