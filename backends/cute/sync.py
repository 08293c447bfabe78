"""kspec's own GPU synchronisation arithmetic for the CuTe DSL GEMM kernels, as pure functions.

The kernels (`sm90.py`, `sm100.py`) are built from the DSL wheel's pipelines, which are validated
upstream; what kspec adds around them is arithmetic: which ring slot and mbarrier phase a counter
maps to, how many A/B stages fit beside the epilogue's shared memory, how many arrivals each
barrier waits for, how many bytes a stage's TMA loads bring, which CTAs of a cluster a multicast
reaches.  All of it lives here so that

- the kernels call it while they are traced (plain ints, or DSL integers: the ring functions use
  only `//` and `%`), and check what they pass to the DSL's pipeline constructors against it
  (`check_count`: a mismatch fails the compile with the arithmetic spelled out);
- the planner (`gemm.py`) computes the stage count a configuration would get from the same
  function the kernel uses, and never plans one below `MIN_AB_STAGES`;
- `tests/test_sync_protocols.py` simulates every barrier the kernels create with these functions,
  without a GPU.

Standard library and kspec.core only: importable without the DSL.
"""
from __future__ import annotations

from dataclasses import dataclass

from kspec.core import KspecInternalError

# ------------------------------------------------------------------------------------------ constants
# Opt-in shared memory per CTA on both archs (the DSL's SMEM_CAPACITY_MAP for sm_90 / sm_100).
SMEM_CAPACITY = 232448
# What each kernel keeps back from the A/B ring's budget for barriers, alignment padding and the
# shared-storage struct (sm_90a: an extra 1 KiB for its 1024-byte aligned buffers).
SMEM_RESERVED = {"sm90a": 2048, "sm100a": 1024}
# The A/B ring needs two stages: on sm_90a a stage is released only after the next stage's WGMMA
# is issued (one batch in flight), so one stage deadlocks; zero cannot hold a tile at all.
MIN_AB_STAGES = 2
RESIDUAL_STAGES = 2                          # residual ("full") epilogue inputs: double-buffered
EPI_STORE_STAGES = {"sm90a": 4, "sm100a": 2}  # D / aux staging buffers drained by TMA stores
ACC_STAGES = 2                               # sm_100a: double-buffered accumulators in TMEM
WARP = 32
SM100_EPI_WARPS = 4                          # sm_100a: warps 0-3 run the epilogue
SM90_WARPGROUP_WARPS = 4


# ------------------------------------------------------------------------------------------ rings
def ring_index(count, stages):
    """The slot of the `count`-th use of a ring of `stages` buffers (count from 0 over a CTA's run)."""
    return count % stages


def ring_phase(count, stages):
    """The mbarrier phase parity the `count`-th use of a ring waits on: barrier `ring_index` has
    completed `count // stages` phases before this use's phase."""
    return (count // stages) % 2


def pipeline_state(count, stages, producer=False):
    """(index, phase) of the DSL's PipelineState after `count` advances: consumers start at phase
    0, producers at phase 1 (their first wait on an empty buffer passes at once)."""
    return ring_index(count, stages), ring_phase(count, stages) ^ (1 if producer else 0)


def residual_start(tiles_done, n_sub):
    """The residual ring's counter at a tile's first epilogue sub-tile: `tiles_done` is how many
    tiles this CTA finished before this one (the scheduler's count read BEFORE it advances past
    this tile), each of `n_sub` sub-tiles."""
    return tiles_done * n_sub


# ------------------------------------------------------------------------------------------ clusters
def mma_width(use_2cta: bool) -> int:
    """CTAs per MMA: 2 with sm_100a's 2-CTA UMMA, else 1."""
    return 2 if use_2cta else 1


def cluster_vmn(cluster_mn, use_2cta=False) -> tuple[int, int, int]:
    """The cluster as (V, M, N): V CTAs per MMA (the pair of a 2-CTA UMMA), M MMA rows, N columns."""
    v = mma_width(use_2cta)
    cm, cn = cluster_mn
    if cm % v:
        raise KspecInternalError(f"cluster {cm}x{cn} with 2-CTA MMA: M must be even")
    return v, cm // v, cn


def cta_rank(coord, shape_vmn) -> int:
    """A CTA's rank in its cluster from its (v, m, n) coordinate (the DSL's column-major layout)."""
    v, m, n = coord
    V, M, _ = shape_vmn
    return v + V * (m + M * n)


def cta_coords(shape_vmn):
    V, M, N = shape_vmn
    return [(v, m, n) for n in range(N) for m in range(M) for v in range(V)]


def mcast_mask(shape_vmn, coord, mode) -> int:
    """The multicast mask (bit per CTA rank) of a TMA load issued by CTA `coord`: mode "a" reaches
    every CTA of its MMA row (same v and m: A tiles are shared along N), mode "b" every CTA of its
    MMA column (same v and n: B tiles are shared along M).  A single-CTA cluster has mask 1."""
    v, m, n = coord
    V, M, N = shape_vmn
    if mode == "a":
        return sum(1 << cta_rank((v, m, j), shape_vmn) for j in range(N))
    if mode == "b":
        return sum(1 << cta_rank((v, i, n), shape_vmn) for i in range(M))
    raise KspecInternalError(f"multicast mode {mode!r}")


def umma_commit_mask(shape_vmn, coord) -> int:
    """sm_100a: the CTAs an MMA leader's `tcgen05.commit` releases an A/B stage in: every CTA that
    received part of the stage (its row and column multicasts, for itself and its 2-CTA peer)."""
    v, m, n = coord
    mask = mcast_mask(shape_vmn, coord, "a") | mcast_mask(shape_vmn, coord, "b")
    if shape_vmn[0] == 2:
        peer = (v ^ 1, m, n)
        mask |= mcast_mask(shape_vmn, peer, "a") | mcast_mask(shape_vmn, peer, "b")
    return mask


def mask_ranks(mask: int) -> list[int]:
    return [r for r in range(mask.bit_length()) if mask >> r & 1]


def pair_leader(rank: int, use_2cta: bool) -> int:
    """The CTA whose barriers a 2-CTA UMMA pair shares (even rank), else the CTA itself."""
    return rank // 2 * 2 if use_2cta else rank


# ------------------------------------------------------------------------------------------ arrive counts
def sm90_ab_empty_arrivals(cluster_mn, mma_warpgroups: int) -> int:
    """sm_90a A/B ring, empty barrier: every consumer warp of every CTA that shares a multicast
    with this one (its cluster row and column, itself once) arrives once per stage."""
    cm, cn = cluster_mn
    return (cm + cn - 1) * mma_warpgroups * SM90_WARPGROUP_WARPS


def sm100_ab_empty_arrivals(cluster_mn, use_2cta: bool) -> int:
    """sm_100a A/B ring, empty barrier: one `tcgen05.commit` arrival from each MMA leader whose
    multicast reaches this CTA (leaders in its MMA row and column, its own pair's once)."""
    _, M, N = cluster_vmn(cluster_mn, use_2cta)
    return M + N - 1


def sm100_acc_empty_arrivals(use_2cta: bool) -> int:
    """sm_100a accumulator ring, empty barrier (in the pair leader): one elected thread per
    epilogue warp of each CTA of the MMA."""
    return SM100_EPI_WARPS * mma_width(use_2cta)


AB_FULL_ARRIVALS = 1        # the producer's arrive.expect_tx (the pair leader's, with 2-CTA UMMA)
ACC_FULL_ARRIVALS = 1       # the MMA leader's tcgen05.commit
RESIDUAL_ARRIVALS = 1       # the elected epilogue thread's arrive.expect_tx


def ab_stage_tx_bytes(a_tile_bytes: int, b_tile_bytes: int, num_b: int, use_2cta: bool = False) -> int:
    """Bytes one A/B stage's TMA loads complete on the (pair leader's) full barrier: each CTA's A
    and B tiles (num_b B operands: 2 in a dual GEMM), over the CTAs of the MMA."""
    return (a_tile_bytes + b_tile_bytes * num_b) * mma_width(use_2cta)


def check_count(what: str, given: int, expected: int, arithmetic: str) -> int:
    """Trace-time check of a count the kernel passes to a DSL pipeline constructor (an arrive count,
    a transaction byte count) against the one derived from kernel facts (`routed_arrivals`, the
    shared-memory budget); a mismatch fails the compile with the arithmetic spelled out."""
    given, expected = int(given), int(expected)
    if given != expected:
        raise KspecInternalError(f"{what}: the kernel passes {given}, but {arithmetic} = {expected}")
    return given


# ------------------------------------------------------------------------------------------ tiles and stages
def k_tile(a_bits: int) -> int:
    """The K extent of a stage: 128 bytes of each operand row (four MMA instructions' K)."""
    return 1024 // a_bits


def sm90_cooperative(tile_mn, dual: bool) -> bool:
    """sm_90a: two consumer warpgroups share an M=128 tile when N is wide, and in a dual GEMM."""
    return tile_mn[0] > 64 and (tile_mn[1] > 128 or dual)


def sm90_epi_tile(tile_mn, dual: bool, d_bits: int) -> tuple[int, int]:
    tm, tn = tile_mn
    if sm90_cooperative(tile_mn, dual):
        return min(128, tm), min(32, tn)
    return min(64, tm), min(64 if d_bits == 8 else 32, tn)


def sm100_epi_tile(cta_tile_mn, use_2cta: bool, d_bits: int, d_m_major: bool) -> tuple[int, int]:
    """The epilogue sub-tile of an sm_100a CTA tile with no source tensor C (as the DSL's
    `compute_epilogue_tile_size`): 4 warps over TMEM's 128 lanes, about 4096 elements."""
    cm, cn = cta_tile_mn
    warp_m, warp_n = (2, 2) if (cm == 64 and use_2cta) else (4, 1)
    tile_m = min(cm, 32 * warp_m)
    n_perf = (8192 if d_bits == 4 else 4096) // tile_m
    while cn % n_perf:
        n_perf //= 2
    n_min_d = 8 * warp_n if d_m_major else (128 * warp_n if d_bits == 6 else 128 // d_bits * warp_n)
    tile_n = min(cn, max(n_perf, 8 * warp_n, n_min_d))
    if cn % tile_n:
        tile_n = cn
    return tile_m, tile_n


def sub_tiles(tile_mn, epi_tile) -> int:
    """Epilogue sub-tiles per (CTA) tile."""
    return (tile_mn[0] // epi_tile[0]) * (tile_mn[1] // epi_tile[1])


@dataclass(frozen=True)
class SmemBudget:
    """How one CTA's shared memory is split, and the A/B stage count that leaves."""
    arch: str
    ab_stage_bytes: int        # one A/B stage (A, B and a dual GEMM's second B)
    epi_bytes: int             # D and aux staging buffers (all store stages)
    in_bytes: int              # epilogue inputs and reduction rows staged in shared memory
    fit: int                   # stages that fit
    override: int | None       # a stage cap from the schedule
    epi_tile: tuple[int, int]
    a_tile_bytes: int
    b_tile_bytes: int

    @property
    def stages(self) -> int:
        return self.fit if self.override is None else min(self.fit, self.override)

    def problem(self) -> str | None:
        """Why the kernel cannot run with this split (None when it can)."""
        if self.stages >= MIN_AB_STAGES:
            return None
        free = SMEM_CAPACITY - SMEM_RESERVED[self.arch] - self.epi_bytes - self.in_bytes
        return (f"only {max(self.stages, 0)} A/B pipeline stage(s) of {self.ab_stage_bytes:,} B fit beside "
                f"the epilogue's {self.epi_bytes + self.in_bytes:,} B of shared memory ({max(free, 0):,} B left "
                f"of {SMEM_CAPACITY - SMEM_RESERVED[self.arch]:,} B); the kernel needs at least {MIN_AB_STAGES}")


def smem_budget(arch: str, tile_mn, *, use_2cta: bool = False, a_bits: int, b_bits: int, d_bits: int,
                d_m_major: bool = False, dual: bool = False, num_aux: int = 0, inputs=(), reductions=(),
                override: int | None = None) -> SmemBudget:
    """The shared-memory split of a kernel configuration.  tile_mn: the CTA tile on sm_90a, the
    MMA tile on sm_100a (two CTAs' M with 2-CTA UMMA); inputs: (class, bits) per epilogue input,
    class "row" / "col" (a vector staged as f32 per tile) or "full" (double-buffered sub-tiles);
    reductions: the axis ("m" / "n") of each epilogue reduction (one f32 per tile row/column)."""
    tm, tn = tile_mn
    tk = k_tile(a_bits)
    num_b = 2 if dual else 1
    if arch == "sm90a":
        epi = sm90_epi_tile(tile_mn, dual, d_bits)
        a_tile = tm * tk * a_bits // 8
        b_tile = tn * tk * b_bits // 8
        vec_m, vec_n = tm, tn
    elif arch == "sm100a":
        v = mma_width(use_2cta)
        epi = sm100_epi_tile((tm // v, tn), use_2cta, d_bits, d_m_major)
        a_tile = tm // v * tk * a_bits // 8
        b_tile = tn // v * tk * b_bits // 8
        vec_m, vec_n = tm, tn                  # vectors are staged over the whole MMA tile
    else:
        raise KspecInternalError(f"no CuTe DSL GEMM kernel for {arch}")
    ab = a_tile + b_tile * num_b
    epi_bytes = epi[0] * epi[1] * d_bits // 8 * EPI_STORE_STAGES[arch] * (1 + num_aux)
    in_bytes = 0
    for cls, bits in inputs:
        if cls == "row":
            in_bytes += vec_n * 4 + 128
        elif cls == "col":
            in_bytes += vec_m * 4 + 128
        elif cls == "full":
            in_bytes += RESIDUAL_STAGES * epi[0] * epi[1] * bits // 8 + 128
        else:
            raise KspecInternalError(f"epilogue input class {cls!r}")
    for axis in reductions:
        in_bytes += (vec_m if axis == "n" else vec_n) * 4 + 128
    fit = (SMEM_CAPACITY - SMEM_RESERVED[arch] - epi_bytes - in_bytes) // ab
    return SmemBudget(arch, ab, epi_bytes, in_bytes, fit, override, epi, a_tile, b_tile)


# ------------------------------------------------------------------------------------------ derived counts
def routed_arrivals(shape_vmn, routes, *, warps: int, per_warp: bool = True) -> int:
    """The arrive count one barrier must be initialised with, derived from kernel facts by
    enumeration: `warps` signalling warps in each CTA (one elected lane each when `per_warp`, else
    all 32 threads), each CTA's signal landing on the barriers of the CTA ranks `routes(coord)`
    returns.  Every CTA's copy of the barrier must receive the same count (else the kernel's one
    init count is wrong for some CTA): raises KspecInternalError when they differ; CTAs no signal
    reaches are left out (their copy of the barrier is unused)."""
    per = warps * (1 if per_warp else WARP)
    got: dict[int, int] = {}
    for coord in cta_coords(shape_vmn):
        for r in routes(coord):
            got[r] = got.get(r, 0) + per
    counts = set(got.values())
    if len(counts) != 1:
        raise KspecInternalError(f"barrier arrivals differ between the CTAs of a {shape_vmn} cluster: {got}")
    return counts.pop()


def sm90_ab_empty_routes(shape_vmn):
    """sm_90a: a consumer warp releases a stage in every CTA it shares a multicast with (one lane
    per destination CTA, the DSL's PipelineTmaAsync signalling)."""
    return lambda coord: mask_ranks(mcast_mask(shape_vmn, coord, "a") | mcast_mask(shape_vmn, coord, "b"))


def sm100_ab_empty_routes(shape_vmn):
    """sm_100a: only an MMA leader (v = 0) commits, to every CTA that received part of the stage."""
    return lambda coord: mask_ranks(umma_commit_mask(shape_vmn, coord)) if coord[0] == 0 else []


def to_pair_leader_routes(shape_vmn):
    """A signal every CTA sends to its MMA pair leader's barrier (sm_100a accumulator release)."""
    return lambda coord: [pair_leader(cta_rank(coord, shape_vmn), shape_vmn[0] == 2)]


def local_routes(shape_vmn, leaders_only: bool = False):
    """A signal that stays in its own CTA (leaders_only: only MMA leaders send it)."""
    return lambda coord: [] if leaders_only and coord[0] else [cta_rank(coord, shape_vmn)]


def acc_full_routes(shape_vmn):
    """sm_100a accumulator full barrier: the MMA leader's commit signals every CTA of its MMA (the
    DSL's TMEM sync mask), whose epilogue warps read their half of the accumulator."""
    return lambda coord: [cta_rank((v, coord[1], coord[2]), shape_vmn) for v in range(shape_vmn[0])] if coord[0] == 0 else []
