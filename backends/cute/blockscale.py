"""Block-scaled FP8 GEMMs on sm_90a (DeepSeek-V3's recipe, as DeepGEMM runs it): the scales are f32
factors read at blocks of K inside the sum, `sum(k) A[m, k] sa[m, k / 128] B[n, k] sb[n / 128, k / 128]`.

The kernel's K tile is the scale block (128 fp8 values): each K tile's WGMMAs accumulate into a
temporary register accumulator, which is then added to the real one multiplied by the tile's scales
(`acc += tmp * sa[m, kt] * sb[n-block, kt]`, once per K block and element: "promotion").  A's scale
is per row (block 1) or per 128 rows, B's per 128 columns or coarser (one value per CTA tile and K
block).  The scale tensors are read from global memory (they are small and stay in L2), one load per
distinct row a thread holds, issued before the wait for the tile's WGMMAs so they overlap them.

Which rows a thread's accumulator values hold comes from the epilogue's register-to-shared copy
partition (the same view the epilogue uses): `row_plan` derives the distinct rows at trace time from
static thread indices and checks that every thread's rows are its first row plus the same offsets.
kspec's own code, on the DSL's building blocks (sm90.py's kernel with this mainloop variant).
Imported by the kernel modules only (it imports the DSL); `k_block_scales` is the scale loads both
archs' kernels issue per K block.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from kspec.core import KspecInternalError


@dataclass(frozen=True)
class RowPlan:
    """deltas: the distinct row offsets (from a thread's first row) its accumulator values hold,
    over every epilogue sub-tile; slot[(e, v)]: which delta value v of sub-tile e has."""
    deltas: tuple[int, ...]
    slot: tuple[tuple[int, ...], ...]


def row_plan(partition, threads, epi_tile, epi_grid) -> RowPlan:
    """partition(t): the register-to-shared copy's partition of an identity sub-tile for a static
    thread t (its coordinates are Python ints); epi_grid: sub-tiles along (M, N), row-major."""
    rows = {}
    for t in threads:
        c = partition(t)
        vals = []
        for v in range(len(c) if isinstance(c, (list, tuple)) else cute.size(c)):
            x = c[v]
            if not isinstance(x[0], int):
                raise KspecInternalError("block scales: a thread's accumulator rows are not static")
            vals.append(x[0])
        rows[t] = vals
    t0 = threads[0]
    base = [r - rows[t0][0] for r in rows[t0]]
    for t in threads:
        if [r - rows[t][0] for r in rows[t]] != base:
            raise KspecInternalError(f"block scales: thread {t} holds other row offsets than thread {t0}")
    n_epi = epi_grid[0] * epi_grid[1]
    deltas = sorted({(e // epi_grid[1]) * epi_tile[0] + d for e in range(n_epi) for d in base})
    slot = tuple(tuple(deltas.index((e // epi_grid[1]) * epi_tile[0] + d) for d in base) for e in range(n_epi))
    return RowPlan(tuple(deltas), slot)


def k_block_scales(scales, scale_ts, plan: RowPlan, k, m0, n0, row0, M):
    """K block k's scales of a tile at (m0, n0) (trace-time loops): the product of the B scales of
    the tile's column block (one f32, `sb`) and, per row delta of `plan`, the product of the A scales
    of that row (`rs`, a register vector; rows past M clamp to the last).  scales: (operand,
    block_mn, order) per scale tensor, order "mk" for [blocks, K blocks] or else [K blocks, blocks]."""
    sb = cutlass.Float32(1.0)
    rs = cute.make_rmem_tensor(len(plan.deltas), cutlass.Float32)
    for i in range(len(plan.deltas)):
        rs[i] = cutlass.Float32(1.0)
    for j in range(len(scales)):
        operand, block_mn, order = scales[j]
        if operand == "b":
            blk = n0 // block_mn
            sb = sb * scale_ts[j][(blk, k) if order == "mk" else (k, blk)].to(cutlass.Float32)
        else:
            for i in range(len(plan.deltas)):
                blk = cutlass.min(m0 + row0 + plan.deltas[i], M - 1) // block_mn
                rs[i] = rs[i] * scale_ts[j][(blk, k) if order == "mk" else (k, blk)].to(cutlass.Float32)
    return rs, sb
