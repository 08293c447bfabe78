"""Plain CUDA row kernels for "rowwise" plans (compiler/rowwise.py): norms, softmax, logsumexp and
cross-entropy, residual-add + RMSNorm, any chain of row reductions and elementwise maps.

Written for kspec (no upstream kernel fits this plain-CUDA route); the source follows backends/ABI.md
exactly like generic.py: a `Params` struct by value, `kspec_kernel`, and host glue `kspec_prepare`.

The kernel
- One CTA per row (`blockDim.x` = TX threads, a power of two from 32 to 1024), several rows per CTA
  (`blockDim.y` = TY) for short rows, and for long rows a thread-block cluster of CS CTAs
  (2 to 8) per row, each holding a slice of it.
- A row is processed in passes: every reduction whose operand needs only values known so far is
  accumulated in one pass; the next pass can use their results.  A softmax is a max pass, a
  sum-of-exponentials pass and its values.  The last pass stores the element outputs; row outputs
  (`loss[m]`, `mu[m]`) are stored by one thread per row.
- Inputs read in more than one pass are cached on chip: the first pass loads them from global
  memory (128-bit loads) and keeps the raw values in shared memory, later passes read shared memory.
  Each input is read from DRAM once; intermediates never leave the chip (they are recomputed from
  the cached inputs in f32 registers, rounded per node to their dtype as the reference does).
- Vector path: 8 elements per thread step with 128-bit loads and stores, chosen at run time by the
  host glue when every row-indexed pointer is 16-byte aligned and every row stride is a multiple of
  16 bytes; the row's tail (length mod 8) is handled element by element.  Otherwise the kernel runs
  element by element (any row length, any alignment, any row stride).
- Reductions accumulate in f32: warp butterfly shuffles (`__shfl_xor_sync`), then a shared-memory
  fold across the row's warps, then (clusters) a fold across the cluster's CTAs through distributed
  shared memory (`cluster.map_shared_rank`).  Every fold runs in a fixed order, so all threads of a
  row see bit-identical results.
- Long rows: the host glue picks the smallest cluster (1, 2, 4, 8) whose per-CTA slice of the
  cached inputs fits SMEM_BUDGET bytes of shared memory.  Rows too long even for 8 CTAs run
  uncached: each pass re-reads its inputs from global memory (served by L2 where they fit).
- Gathers (`logits[m, label[m]]`) read one element per row; an index outside its dimension gives
  NaN (the reference raises an error instead).

Row strides are launch sizes (`s<k>` dims), so a kernel takes rows at any stride; the runtime passes
the strides of the dense layout its manifest records.

Modules: desc.py (`RowwiseDesc` and the shared constants), gen.py (the generator: IR -> kernel body),
colsum.py (the kernel finishing column partials), source.py (the CUDA text and host glue), backend.py
(`RowwiseBackend`).
"""
from __future__ import annotations

from .backend import RowwiseBackend
from .colsum import lower_colsum
from .desc import MAX_CLUSTER, SMEM_BUDGET, V, RowwiseDesc
from .gen import lower_rowwise
from .source import emit_rowwise

__all__ = ["MAX_CLUSTER", "SMEM_BUDGET", "V", "RowwiseBackend", "RowwiseDesc", "emit_rowwise", "lower_colsum",
           "lower_rowwise"]
