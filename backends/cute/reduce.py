"""Epilogue row and column reductions (sum, max of an epilogue value along N or M, written beside D)
for the CuTe DSL GEMM kernels (sm90.py, sm100.py).

A reduction along N (`axis == "n"`) gives one value per row m, along M one per column n; a batched
GEMM writes one vector per batch (the output is (M, L) or (N, L), contiguous).  The generated
epilogue function returns the value to reduce after D and the auxiliary outputs; each kernel then
combines it in three steps per epilogue sub-tile and one per output tile:

1. registers: the values one thread holds for the same row (column) are combined;
2. warp shuffles: a butterfly over the lane bits whose lanes always hold the same rows (columns);
3. shared memory: one lane per such lane group combines its partial into an f32 vector spanning
   the tile's rows (columns) with a shared-memory atomic;
4. once per tile the vector is combined into the global output with one atomic per row (column):
   RED.ADD.F32 for sums, and for maxima the integer-ordering trick (signed max for non-negative,
   unsigned min for negative floats) that CUTLASS's atomic maximum also uses.  The runtime fills
   the outputs with the identity (0 or -inf, the manifest's `init`) before the launch.

Which values share a row and which lanes hold the same rows follows from the kernels' register
layouts; `make_plan` derives it at trace time from the coordinates a thread's partition of an
identity tensor holds (static for a static thread index) and checks the assumptions it relies on.
Values outside the problem (partial tiles) are replaced by the identity before they are combined.
Imported by the kernel modules only (it imports the DSL).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import cutlass
import cutlass.cute as cute

from kspec.core import KspecInternalError

from .epilogue import REDUCTION_OPS as OPS

AXES = ("m", "n", "mn")
IDENTITY = {"sum": 0.0, "max": -math.inf}
WARP = 32


@dataclass(frozen=True)
class ReducePlan:
    """How one kernel reduces one epilogue value.  key: the coordinate that indexes the result
    (0 = m for a reduction along n, 1 = n for one along m); groups: value indices of one thread
    that share that coordinate; lane_bits: butterfly shuffle offsets (lanes l and l ^ bit always
    hold the same coordinates); rep_mask: lanes with `(lane & rep_mask) == 0` write the shared vector."""
    op: str
    key: int
    groups: tuple[tuple[int, ...], ...]
    lane_bits: tuple[int, ...]
    full: bool = False          # along m and n: the row vector is combined into one value per tile

    @property
    def rep_mask(self) -> int:
        return sum(self.lane_bits)

    @property
    def is_max(self) -> bool:
        return self.op == "max"


def make_plan(op: str, axis: str, coords: dict[int, Sequence[tuple[int, ...]]]) -> ReducePlan:
    """coords: thread index -> the (m, n, ...) coordinate of each of its values, for every thread of
    at least one whole warp (more warps make the checks stronger).  Raises KspecInternalError when
    the layout does not have the structure the kernel's code relies on."""
    if op not in OPS or axis not in AXES:
        raise KspecInternalError(f"epilogue reduction {op} along {axis}")
    key = 1 if axis == "m" else 0       # a full reduction ("mn") first reduces each row, as "n" does
    threads = sorted(coords)
    t0 = threads[0]
    nv = len(coords[t0])

    def keys(t):
        return [c[key] for c in coords[t]]

    def grouping(t):
        k = keys(t)
        seen: dict[int, list[int]] = {}
        for v, x in enumerate(k):
            seen.setdefault(x, []).append(v)
        return tuple(tuple(g) for g in seen.values())

    groups = grouping(t0)
    for t in threads:
        if len(coords[t]) != nv or grouping(t) != groups:
            raise KspecInternalError(f"epilogue reduction: thread {t} groups its values differently from "
                                     f"thread {t0} (the register layout is not uniform across threads)")
    bits = []
    for b in (1, 2, 4, 8, 16):
        pairs = [(t, t ^ b) for t in threads if (t ^ b) in coords and t // WARP == (t ^ b) // WARP]
        if pairs and all(keys(t) == keys(u) for t, u in pairs):
            bits.append(b)
    # every lane of a checked warp must be present for the lane-bit test to mean anything
    for w in {t // WARP for t in threads}:
        if any(w * WARP + l not in coords for l in range(WARP)):
            raise KspecInternalError(f"epilogue reduction: coordinates of warp {w} are incomplete")
    return ReducePlan(op, key, groups, tuple(bits), axis == "mn")


def static_coords(partition: Callable[[int], object], threads: Sequence[int]) -> dict[int, list[tuple[int, ...]]]:
    """Trace time: the coordinates each listed thread's partition of an identity tensor holds
    (`partition(t)` must give a coordinate tensor whose entries are Python ints for a static t)."""
    out = {}
    for t in threads:
        c = partition(t)
        vals = []
        for v in range(cute.size(c)):
            x = c[v]
            if not all(isinstance(i, int) for i in x):
                raise KspecInternalError("epilogue reduction: a thread's coordinates are not static")
            vals.append(tuple(x))
        out[t] = vals
    return out


def plan_threads(num_threads: int) -> list[int]:
    """The threads whose coordinates `make_plan` checks: the first and the last warp."""
    last = (num_threads // WARP - 1) * WARP
    return sorted(set(range(WARP)) | set(range(last, last + WARP)))


def simulate(plan: ReducePlan, values, coords, shape, base=(0, 0)):
    """numpy model of steps 1-3 for one sub-tile (tests): values[t][v] and coords[t][v] for the
    threads given (whole warps); `shape` is the problem's (M, N) seen from the sub-tile origin
    `base`.  Returns the tile vector the kernel would hold in shared memory (identity elsewhere)."""
    import numpy as np
    ident = IDENTITY[plan.op]
    comb = np.maximum if plan.is_max else np.add
    out = np.full(shape[plan.key], ident, np.float32)
    threads = sorted(values)
    part = {}
    for t in threads:
        part[t] = [np.float32(ident)] * len(plan.groups)
        for g, grp in enumerate(plan.groups):
            acc = np.float32(ident)
            for v in grp:
                m, n = coords[t][v][0] + base[0], coords[t][v][1] + base[1]
                x = values[t][v] if (m < shape[0] and n < shape[1]) else ident
                acc = comb(acc, np.float32(x))
            part[t][g] = acc
    for b in plan.lane_bits:                      # butterfly: every lane gets its partner's partial
        part = {t: [comb(part[t][g], part[t ^ b][g]) for g in range(len(plan.groups))] for t in threads}
    for t in threads:
        if (t % WARP) & plan.rep_mask:
            continue
        for g, grp in enumerate(plan.groups):
            i = coords[t][grp[0]][plan.key] + base[plan.key]
            if i < shape[plan.key]:
                out[i] = comb(out[i], part[t][g])
    return out


# ---------------------------------------------------------------------------------------------
# device code (inlined where the kernels call it)
# ---------------------------------------------------------------------------------------------

def _combine(a, b, is_max):
    return cutlass.max(a, b) if is_max else a + b


def _atomic(ptr, x, is_max):
    # Maxima: integer atomics on the float's bits (native ATOMS.MAX.S32 / ATOMS.MIN in shared memory,
    # REDG.E.MAX.S32 / REDG.E.MIN in global).  Sums: `atomic_add` on f32 is the LLVM `atomicrmw fadd`
    # the PTX `atom.add.f32` comes from.  In global memory it is one REDG.E.ADD.F32; in shared memory
    # sm_90a and sm_100a have no f32 add instruction, so ptxas emits a load + FADD + ATOMS.CAST.SPIN
    # loop for it, exactly as for CUDA C's atomicAdd(float*) or an inline `red.shared.add.f32` on
    # __shared__ data (checked with nvcc 13 + cuobjdump on both archs; integer shared atomics are
    # native ATOMS.ADD).  No DSL op lowers to anything better; contention stays low because only one
    # lane per lane group (after the shuffles) adds per row or column.  tests/test_cute_backend.py
    # asserts this SASS.
    if is_max:
        cute.arch.atomic_fmax(ptr, x)
    else:
        cute.arch.atomic_add(ptr, x)


@cute.jit
def reduce_subtile(vals, crd, off_m, off_n, M, N, base, s_red, plan: cutlass.Constexpr):
    """Steps 1-3: vals[v] (registers, f32) at coordinates crd[v] + (off_m, off_n) into
    s_red[index - base]."""
    ident = cutlass.Float32(IDENTITY[plan.op])
    lane = cute.arch.lane_idx()
    for g in cutlass.range_constexpr(len(plan.groups)):
        grp = plan.groups[g]
        part = ident
        for i in cutlass.range_constexpr(len(grp)):
            c = crd[grp[i]]
            inside = ((c[0] + off_m) < M) & ((c[1] + off_n) < N)
            part = _combine(part, cutlass.Float32(cutlass.select_(inside, vals[grp[i]], ident)), plan.is_max)
        for b in cutlass.range_constexpr(len(plan.lane_bits)):
            part = _combine(part, cute.arch.shuffle_sync_bfly(part, offset=plan.lane_bits[b]), plan.is_max)
        if (lane & plan.rep_mask) == 0:
            c0 = crd[grp[0]]
            idx = c0[plan.key] + (off_m if plan.key == 0 else off_n) - base
            _atomic(s_red.iterator + idx, part, plan.is_max)


@cute.jit
def flush(s_red, length: cutlass.Constexpr, tid, num_threads: cutlass.Constexpr, base, extent, out, batch,
          plan: cutlass.Constexpr):
    """Step 4: s_red[i] -> out[base + i, batch] (atomics; entries beyond `extent` and entries that
    still hold the identity are skipped), leaving s_red filled with the identity.  A full reduction
    (plan.full) combines the tile's row vector into out[batch]: each thread its entries, then a
    butterfly over the warp, then one atomic per warp."""
    ident = cutlass.Float32(IDENTITY[plan.op])
    if cutlass.const_expr(plan.full):
        part = ident
        for i in range(tid, length, num_threads):
            part = _combine(part, s_red[i], plan.is_max)      # rows past M hold the identity
            s_red[i] = ident
        for b in cutlass.range_constexpr(5):
            part = _combine(part, cute.arch.shuffle_sync_bfly(part, offset=1 << b), plan.is_max)
        if cute.arch.lane_idx() == 0:
            if part != ident:
                _atomic(out.iterator + cute.crd2idx(batch, out.layout), part, plan.is_max)
    else:
        for i in range(tid, length, num_threads):
            x = s_red[i]
            s_red[i] = ident
            if base + i < extent:
                if x != ident:
                    _atomic(out.iterator + cute.crd2idx((base + i, batch), out.layout), x, plan.is_max)


@cute.jit
def fill(s_red, length: cutlass.Constexpr, tid, num_threads: cutlass.Constexpr, plan: cutlass.Constexpr):
    for i in range(tid, length, num_threads):
        s_red[i] = cutlass.Float32(IDENTITY[plan.op])
