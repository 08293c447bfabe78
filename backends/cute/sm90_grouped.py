"""kspec's grouped (MoE) GEMM for sm_90a on the CuTe DSL: the rows of A and D are packed by group,
`packed(off)` (group l is rows off[l] .. off[l + 1] - 1 of a [rows, K] / [rows, N] array), and B holds
one [N, K] matrix per group (an expert's weights, `W[e, f, d]`).  One persistent kernel covers every
group: Sm90Gemm's warp-specialised TMA + WGMMA pipeline and generated epilogue, with

- a tile space of (ceil(rows / tm) + L) row slots x ceil(N / tn) column tiles: slot s is m-tile i of
  group l when the groups before l have s - i m-tiles in all (`locate`, a scan of the offsets each
  warp does per tile); slots past the last m-tile are skipped by every warp alike, so the pipelines
  stay in step;
- A loaded by TMA from the packed array at row off[l] + i * tm (a coordinate offset, as QuACK's and
  FlashAttention-4's variable-length kernels do; rows past the group read the next group's rows or
  TMA's zero fill, and only feed accumulator rows that are never stored);
- D stored by TMA through a *ragged* view (the technique of QuACK's `create_ragged_tensor_for_tma`
  with `ptr_shift`, after Triton's ragged TMA): a descriptor with a row extent of 2^30, an extra mode
  of the row stride, and its base 2^30 rows before the data, offset per group so that the group's
  last row is the descriptor's last row: rows past the group are clipped by the TMA unit itself;
- epilogue vectors per group (`bias[e, f]`: kind "row_batched", (N, L)) and per packed row (a routing
  weight `rw[e, t]` packed by the same offsets: kind "col_packed", (rows,)), staged per tile as in
  Sm90Gemm.

Clusters are 1x1 (a multicast partner could be in another group).  The offsets are checked by the
runtime before the launch (monotonic, first 0, last = rows).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from .sm90 import Sm90Gemm

RAGGED_ROWS = 2 ** 30            # the ragged view's row extent (kspec.runtime.fakedriver.RAGGED_ROWS)
RAGGED_EXTRA = 2 ** 31 - 1       # the extent of its extra mode
GROUPED_KINDS = ("row", "row_batched", "col_packed")


def ragged_rows(t: cute.Tensor) -> cute.Tensor:
    """(rows, N) -> (2^30, N, 2^31 - 1) with strides (s, 1, s), based 2^30 rows before t's data."""
    s = t.stride[0]
    base = cute.domain_offset((-RAGGED_ROWS, None), t).iterator
    return cute.make_tensor(base, cute.make_layout((RAGGED_ROWS, t.shape[1], RAGGED_EXTRA), stride=(s, t.stride[1], s)))


def group_rows(t_tma: cute.Tensor, offset, length) -> cute.Tensor:
    """The ragged view (of ragged_rows, as a TMA coordinate tensor) seen from group row 0: its extra
    mode at offset + length, its rows from 2^30 - length, so row `length` is out of bounds."""
    return cute.domain_offset((RAGGED_ROWS - length, None), t_tma[None, None, offset + length])


@cute.jit
def locate(offsets: cute.Tensor, slot, num_groups, tm: cutlass.Constexpr):
    """(group, m-tile in the group) of row slot `slot` with m-tiles of tm rows; group -1 past the
    last m-tile (the grouped kernels of both archs map their row slots by this scan)."""
    grp = cutlass.Int32(-1)
    mt = cutlass.Int32(0)
    before = cutlass.Int32(0)
    for e in range(num_groups):
        tiles = (offsets[e + 1] - offsets[e] + tm - 1) // tm
        if (slot >= before) & (slot < before + tiles):
            grp = e
            mt = slot - before
        before = before + tiles
    return grp, mt


class Sm90GroupedGemm(Sm90Gemm):
    """tile_mn: CTA tile; input_kinds: GROUPED_KINDS or "scalar"-free vector kinds of the epilogue."""

    def __init__(self, acc_dtype, tile_mn, epi_fn, input_kinds, num_scalars, stages=None, gather=False):
        super().__init__(acc_dtype, tile_mn, (1, 1), epi_fn, input_kinds, num_scalars, stages)
        # gathered A rows (row r of the GEMM is row rows[r] of A): all four warps of the producer
        # warpgroup load A by 16-byte cp.async (TMA cannot gather rows on sm_90a), warp 0 also B by TMA
        self.gather = gather
        if gather:
            self.load_regs = 56
            self.mma_regs = 224

    def _locate(self, offsets: cute.Tensor, slot, num_groups):
        return locate(offsets, slot, num_groups, self.tile_shape_mnk[0])

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, d: cute.Tensor, offsets: cute.Tensor, inputs, scalars,
                 max_active_clusters: cutlass.Int32, stream, rows=None):
        self.a_dtype = a.element_type
        self.b_dtype = b.element_type
        self.d_dtype = d.element_type
        self.a_layout = utils.LayoutEnum.from_tensor(a)
        self.b_layout = utils.LayoutEnum.from_tensor(b)
        self.d_layout = utils.LayoutEnum.from_tensor(d)
        self.input_widths = tuple(t.element_type.width for t in inputs)
        self.num_aux = 0
        self._setup()
        tm, tn, tk = self.tile_shape_mnk
        if cutlass.const_expr(self.gather):
            tma_a, gA = None, a                  # rows gathered by cp.async from A itself
        else:
            tma_a, gA = self._tma_load(a, self.a_smem_staged, (tm, tk), 1)
        tma_b, gB = self._tma_load(b, self.b_smem_staged, (tn, tk), 1)
        tma_d, gD = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), ragged_rows(d),
            cute.slice_(self.d_smem_staged, (None, None, 0)), self.epi_tile)
        rows_n, n = d.shape
        num_groups = b.shape[2]
        ntiles = ((rows_n + tm - 1) // tm + num_groups, (n + tn - 1) // tn, 1)
        sched = utils.PersistentTileSchedulerParams(ntiles, (1, 1, 1))
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, max_active_clusters)

        self.shared_storage = self._shared_storage()
        self.kernel(tma_a, gA, tma_b, gB, tma_d, gD, offsets, inputs, scalars, self.tiled_mma,
                    self.a_smem_staged, self.b_smem_staged, self.d_smem_staged, sched, rows_n, n, rows).launch(
            grid=grid, block=[self.threads_per_cta, 1, 1], cluster=(1, 1, 1), min_blocks_per_mp=1, stream=stream)

    @cute.jit
    def _gather_producer(self, mA: cute.Tensor, a_rows: cute.Tensor, sA: cute.Tensor, tma_b, tBsB, tBgB, ab_pipe,
                         offsets, sched_params, num_groups, k_tiles, tidx, warp_idx):
        """The producer warpgroup of a gathered A: per tile, per K tile, warp 0 waits for the stage and
        loads B by TMA (arming the barrier with B's bytes), the other warps wait for the stage too,
        then every thread copies its 16-byte chunks of the tile's A rows, each row read at
        A[a_rows[off[group] + m], k], by cp.async, and arrives on the stage's barrier when they land
        (cp.async.mbarrier.arrive.noinc: the barrier counts 1 + 128 arrivals)."""
        tm, tn, tk = self.tile_shape_mnk
        epc = 128 // self.a_dtype.width                    # elements per 16-byte chunk
        cpr = tk // epc                                    # chunks per row of a K tile
        per_thread = tm * cpr // self.threads_per_wg
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), self.a_dtype, num_bits_per_copy=128)
        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        while work.is_valid_tile:
            tc = work.tile_idx
            grp, mt = self._locate(offsets, tc[0], num_groups)
            if grp >= 0:
                row0 = offsets[grp] + mt * tm
                limit = offsets[grp + 1] - row0               # rows of this tile inside the group
                tBgB_t = tBgB[None, tc[1], None, grp]
                # the A row each of this thread's chunks reads (rows past the group read row 0 of A:
                # their accumulator rows are never stored)
                src_rows = cute.make_rmem_tensor(per_thread, cutlass.Int32)
                for j in cutlass.range_constexpr(per_thread):
                    r = (tidx + j * self.threads_per_wg) // cpr
                    src_rows[j] = 0
                    if r < limit:
                        src_rows[j] = a_rows[row0 + r]
                prod.reset_count()
                for k in range(k_tiles):
                    if warp_idx == self.load_warp_id:
                        ab_pipe.producer_acquire(prod)
                        cute.copy(tma_b, tBgB_t[None, prod.count], tBsB[None, prod.index],
                                  tma_bar_ptr=ab_pipe.producer_get_barrier(prod))
                    else:
                        ab_pipe.sync_object_empty.wait(prod.index, prod.phase)
                    sA_s = sA[None, None, prod.index]
                    for j in cutlass.range_constexpr(per_thread):
                        c = tidx + j * self.threads_per_wg
                        r = c // cpr
                        col = (c % cpr) * epc
                        src = cute.local_tile(mA[src_rows[j], None], (epc,), (k * cpr + c % cpr,))
                        dst = cute.local_tile(sA_s[r, None], (epc,), (c % cpr,))
                        cute.copy(atom, src, dst)
                        del col
                    cute.arch.cp_async_mbarrier_arrive_noinc(ab_pipe.producer_get_barrier(prod))
                    prod.advance()
            sched.advance_to_next_work()
            work = sched.get_current_work()
        if warp_idx == self.load_warp_id:
            ab_pipe.producer_tail(prod)

    # ------------------------------------------------------------------ device code
    @cute.kernel
    def kernel(self, tma_a, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_d: cute.CopyAtom, mD_tma: cute.Tensor, offsets: cute.Tensor, inputs, scalars,
               tiled_mma: cute.TiledMma, a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
               d_smem_staged: cute.ComposedLayout, sched_params: utils.PersistentTileSchedulerParams,
               rows: cutlass.Int32, n_cols: cutlass.Int32, a_rows):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            if cutlass.const_expr(not self.gather):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_d)
        b_bytes = cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem_staged, (None, None, 0)))
        # a gathered A arrives by cp.async: one mbarrier arrival per producer thread, no bytes to expect
        tx_bytes = b_bytes if cutlass.const_expr(self.gather) else (
            b_bytes + cute.size_in_bytes(self.a_dtype, cute.slice_(a_smem_staged, (None, None, 0))))
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tm, tn, tk = self.tile_shape_mnk
        sIn = []
        for j, kind in enumerate(self.input_kinds):
            sIn.append(smem.allocate_tensor(self.epi_dtype, cute.make_layout((tn if "row" in kind else tm,)), 128))
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(), num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 1 + (self.threads_per_wg if cutlass.const_expr(self.gather) else 0)),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_warp_groups * 4),
            tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sD = storage.sD.get_tensor(d_smem_staged.outer, swizzle=d_smem_staged.inner)
        gB = cute.local_tile(mB, cute.slice_(self.tile_shape_mnk, (0, None, None)), (None, None, None))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
                                                      cute.group_modes(gB, 0, 2))
        num_groups = mB.shape[2]

        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        thr_mma = tiled_mma.get_slice(
            cute.make_layout(self.num_mma_warp_groups, stride=self.threads_per_wg)(wg_idx - 1))
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(cute.make_identity_tensor((tm, tn))).shape, self.acc_dtype)
        k_tiles = (mA.shape[1] + tk - 1) // tk
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)
        if cutlass.const_expr(self.gather):
            if wg_idx == 0:
                self._gather_producer(mA, a_rows, sA, tma_b, tBsB, tBgB, ab_pipe, offsets, sched_params, num_groups,
                                      k_tiles, tidx, warp_idx)
        elif warp_idx == self.load_warp_id:
            # producer: TMA loads of the A rows of the tile's group and of the group's B tiles
            sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                               cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
            while work.is_valid_tile:
                tc = work.tile_idx
                grp, mt = self._locate(offsets, tc[0], num_groups)
                if grp >= 0:
                    mA_g = cute.domain_offset((offsets[grp], None), mA)
                    gA = cute.local_tile(mA_g, (tm, tk), (mt, None))
                    tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                                                  cute.group_modes(sA, 0, 2),
                                                                  cute.group_modes(gA, 0, 2))
                    tBgB_t = tBgB[None, tc[1], None, grp]
                    prod.reset_count()
                    for _k in range(k_tiles):
                        ab_pipe.producer_acquire(prod)
                        bar = ab_pipe.producer_get_barrier(prod)
                        cute.copy(tma_a, tAgA[None, prod.count], tAsA[None, prod.index], tma_bar_ptr=bar)
                        cute.copy(tma_b, tBgB_t[None, prod.count], tBsB[None, prod.index], tma_bar_ptr=bar)
                        ab_pipe.producer_commit(prod)
                        prod.advance()
                sched.advance_to_next_work()
                work = sched.get_current_work()
            ab_pipe.producer_tail(prod)

        if wg_idx > 0:
            sched, work, read, release, k_blocks = self._consumer_begin(sched_params, tCrA)
            epi_tidx = tidx - self.threads_per_wg
            copy_r2s, thr_r2s, tRS_sD, tRS_rAcc, rD_shape, tRS_rD, tRS_rOut = self._epilogue_copies(
                tiled_mma, epi_tidx, sD, acc)
            rIn = [cute.make_rmem_tensor(rD_shape, self.epi_dtype) for _ in self.input_kinds]
            tRS_cL = thr_r2s.partition_S(cute.make_identity_tensor(self.epi_tile))
            n_v = cute.size(tRS_rD)
            epi_bar, store_pipe = self._epilogue_sync()
            epi_grid = (tm // self.epi_tile[0], tn // self.epi_tile[1])
            n_epi = epi_grid[0] * epi_grid[1]
            stored = cutlass.Int32(0)            # sub-tiles stored so far: the staging buffer ring's position
            while work.is_valid_tile:
                tc = work.tile_idx
                grp, mt = self._locate(offsets, tc[0], num_groups)
                if grp >= 0:
                    row0 = offsets[grp]
                    length = offsets[grp + 1] - row0
                    read.reset_count()
                    release.reset_count()
                    acc.fill(0)
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    cute.nvgpu.warpgroup.fence()
                    for k in range(k_tiles):
                        ab_pipe.consumer_wait(read)
                        for kb in cutlass.range_constexpr(k_blocks):
                            crd = (None, None, kb, read.index)
                            cute.gemm(tiled_mma, acc, tCrA[crd], tCrB[crd], acc)
                        cute.nvgpu.warpgroup.commit_group()
                        read.advance()
                        if k > 0:
                            cute.nvgpu.warpgroup.wait_group(1)
                            ab_pipe.consumer_release(release)
                            release.advance()
                    cute.nvgpu.warpgroup.wait_group(0)
                    if k_tiles > 0:
                        ab_pipe.consumer_release(release)
                        release.advance()

                    # epilogue: D rows of this group only (the ragged view clips the rest)
                    gD = cute.local_tile(group_rows(mD_tma, row0, length), (tm, tn), (mt, tc[1]))
                    bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
                        tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2),
                        cute.zipped_divide(gD, self.epi_tile))
                    m0 = mt * tm
                    n0 = tc[1] * tn
                    if cutlass.const_expr(len(self.input_kinds) > 0):
                        for j in cutlass.range_constexpr(len(self.input_kinds)):
                            if cutlass.const_expr(self.input_kinds[j] == "col_packed"):
                                for i in range(epi_tidx, tm, self.num_mma_threads):
                                    sIn[j][i] = inputs[j][row0 + cutlass.min(m0 + i, length - 1)].to(self.epi_dtype)
                            else:
                                for i in range(epi_tidx, tn, self.num_mma_threads):
                                    sIn[j][i] = inputs[j][self._vector_coord(j, cutlass.min(n0 + i, n_cols - 1),
                                                                             grp)].to(self.epi_dtype)
                        epi_bar.arrive_and_wait()
                    for e in cutlass.range_constexpr(n_epi):
                        ec = (e // epi_grid[1], e % epi_grid[1])
                        for v in cutlass.range_constexpr(n_v):
                            tRS_rD[v] = tRS_rAcc[e * n_v + v]
                            if cutlass.const_expr(len(self.input_kinds) > 0):
                                lm, ln = tRS_cL[v]
                                for j in cutlass.range_constexpr(len(self.input_kinds)):
                                    if cutlass.const_expr(self.input_kinds[j] == "col_packed"):
                                        rIn[j][v] = sIn[j][ec[0] * self.epi_tile[0] + lm]
                                    else:
                                        rIn[j][v] = sIn[j][ec[1] * self.epi_tile[1] + ln]
                        values = self.epi_fn(tRS_rD.load(), tuple(r.load() for r in rIn), scalars)
                        self._store_subtile(values, stored + e, ec, copy_r2s, tRS_rOut, tRS_sD, epi_bar, warp_idx,
                                            tma_d, bSG_sD, bSG_gD, store_pipe)
                    stored = stored + n_epi
                sched.advance_to_next_work()
                work = sched.get_current_work()
            store_pipe.producer_tail()
