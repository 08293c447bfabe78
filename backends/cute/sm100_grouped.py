"""kspec's grouped (MoE) GEMM for sm_100a on the CuTe DSL: sm90_grouped.py's scheme on Sm100Gemm's
pipeline (one TMA warp, one tcgen05 MMA warp with the accumulator double-buffered in tensor memory,
four epilogue warps).  Rows of A and D packed by group (`packed(off)`), B one [N, K] matrix per group;
row slots map to (group, m-tile) by a scan of the offsets (sm90_grouped.locate); A is
loaded by TMA from the group's first row, D stored through the ragged TMA view (sm90_grouped.py) that
clips each group's last tile; 1-CTA UMMA, clusters 1x1; epilogue vectors per group ("row_batched")
and per packed row ("col_packed").
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.pipeline import pipeline_init_wait
from cutlass.utils.gemm.sm100 import transform_partitioned_tensor_layout

from .sm90_grouped import group_rows, locate, ragged_rows
from .sm100 import Sm100Gemm


class Sm100GroupedGemm(Sm100Gemm):
    """mma_tiler_mn: the UMMA tile (M 64 or 128); input_kinds: "row", "row_batched", "col_packed"."""

    def __init__(self, acc_dtype, mma_tiler_mn, epi_fn, input_kinds, num_scalars, stages=None, gather=False):
        super().__init__(acc_dtype, mma_tiler_mn, (1, 1), False, epi_fn, input_kinds, num_scalars, stages)
        self.epi_dtype = acc_dtype
        # gathered A rows: four more warps (6..9) read them by 16-byte cp.async (as sm90_grouped.py)
        self.gather = gather
        self.gather_warps = (6, 7, 8, 9)
        if gather:
            self.threads_per_cta = 32 * 10

    def _locate(self, offsets: cute.Tensor, slot, num_groups):
        return locate(offsets, slot, num_groups, self.mma_tiler[0])

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, offsets: cute.Tensor, inputs, scalars,
                 max_active_clusters: cutlass.Int32, stream, rows=None):
        self._operand_types(a, b, c, inputs)
        self.num_aux = 0
        tiled_mma = self._tiled_mma()
        self._setup()
        a_smem = cute.slice_(self.a_smem_staged, (None, None, None, 0))
        b_smem = cute.slice_(self.b_smem_staged, (None, None, None, 0))
        if cutlass.const_expr(self.gather):
            tma_a, gA = None, a                  # rows gathered by cp.async from A itself
        else:
            tma_a, gA = cute.nvgpu.make_tiled_tma_atom_A(
                sm100_utils.cluster_shape_to_tma_atom_A((1, 1), tiled_mma.thr_id), a, a_smem, self.mma_tiler,
                tiled_mma, self.cluster_layout_vmnk.shape)
        tma_b, gB = cute.nvgpu.make_tiled_tma_atom_B(
            sm100_utils.cluster_shape_to_tma_atom_B((1, 1), tiled_mma.thr_id), b, b_smem, self.mma_tiler, tiled_mma,
            self.cluster_layout_vmnk.shape)
        self.num_tma_load_bytes = cute.size_in_bytes(self.b_dtype, b_smem) + (
            0 if cutlass.const_expr(self.gather) else cute.size_in_bytes(self.a_dtype, a_smem))
        tma_c, gC = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), ragged_rows(c),
                                                cute.select(self.c_smem_staged, mode=[0, 1]), self.epi_tile)
        rows_n, n = c.shape
        num_groups = b.shape[2]
        tm, tn = self.mma_tiler[0], self.mma_tiler[1]
        ntiles = ((rows_n + tm - 1) // tm + num_groups, (n + tn - 1) // tn, 1)
        sched = utils.PersistentTileSchedulerParams(ntiles, (1, 1, 1))
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, max_active_clusters)
        self.kernel(tiled_mma, tma_a, gA, tma_b, gB, tma_c, gC, offsets, inputs, scalars, self.cluster_layout_vmnk,
                    self.a_smem_staged, self.b_smem_staged, self.c_smem_staged, self.epi_tile, sched, rows_n, n,
                    rows).launch(
            grid=grid, block=[self.threads_per_cta, 1, 1], cluster=(1, 1, 1), stream=stream)

    @cute.jit
    def _gather_a(self, mA: cute.Tensor, a_rows: cute.Tensor, sA: cute.Tensor, ab_pipe, offsets, sched_params,
                  num_groups, k_tiles, tidx):
        """Warps 6..9: per tile and K tile, wait for the stage to be empty, copy this thread's 16-byte
        chunks of the tile's A rows (row r read at A[a_rows[off[group] + m0 + r]]) by cp.async into
        the UMMA's smem layout, and arrive on the stage's full barrier when they land."""
        tm, tk = self.mma_tiler[0], self.mma_tiler[2]
        nthr = 32 * len(self.gather_warps)
        gtid = tidx - 32 * self.gather_warps[0]
        epc = 128 // self.a_dtype.width
        cpr = tk // epc
        per_thread = tm * cpr // nthr
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), self.a_dtype, num_bits_per_copy=128)
        # the UMMA A stage layout is ((rows, inst_k), 1, k blocks, stage): element (r, k) of a K tile
        # is sA[((r, k % inst_k), 0, k // inst_k, stage)]
        kblocks = cute.size(sA, mode=[2])
        inst_k = tk // kblocks
        self.traced.update(gather_sA_shape=str(sA.shape))                  # for tests
        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_ab_stage)
        while work.is_valid_tile:
            tc = work.tile_idx
            grp, mt = self._locate(offsets, tc[0], num_groups)
            if grp >= 0:
                row0 = offsets[grp] + mt * tm
                limit = offsets[grp + 1] - row0
                src_rows = cute.make_rmem_tensor(per_thread, cutlass.Int32)
                for j in cutlass.range_constexpr(per_thread):
                    r = (gtid + j * nthr) // cpr
                    src_rows[j] = 0
                    if r < limit:
                        src_rows[j] = a_rows[row0 + r]
                for k in range(k_tiles):
                    ab_pipe.sync_object_empty.wait(state.index, state.phase)
                    for j in cutlass.range_constexpr(per_thread):
                        c = gtid + j * nthr
                        r = c // cpr
                        src = cute.local_tile(mA[src_rows[j], None], (epc,), (k * cpr + c % cpr,))
                        k0 = (c % cpr) * epc
                        dst = cute.local_tile(sA[((r, None), 0, k0 // inst_k, state.index)], (epc,),
                                              ((k0 % inst_k) // epc,))
                        cute.copy(atom, src, dst)
                    cute.arch.cp_async_mbarrier_arrive_noinc(ab_pipe.producer_get_barrier(state))
                    state.advance()
            sched.advance_to_next_work()
            work = sched.get_current_work()

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a, mA: cute.Tensor, tma_b: cute.CopyAtom,
               mB: cute.Tensor, tma_c: cute.CopyAtom, mC_tma: cute.Tensor, offsets: cute.Tensor, inputs, scalars,
               cluster_layout_vmnk: cute.Layout, a_smem_staged: cute.ComposedLayout,
               b_smem_staged: cute.ComposedLayout, c_smem_staged: cute.ComposedLayout, epi_tile: cute.Tile,
               sched_params: utils.PersistentTileSchedulerParams, rows: cutlass.Int32, n_cols: cutlass.Int32,
               a_rows):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        self._prefetch_descriptors(warp_idx, None if cutlass.const_expr(self.gather) else tma_a, tma_b, tma_c)
        tidx, _, _ = cute.arch.thread_idx()

        smem = utils.SmemAllocator()
        storage = smem.allocate(self._shared_storage())
        # a gathered A: the full barrier also counts one cp.async arrival per gather thread
        ab_pipe, acc_pipe, tmem = self._pipelines(
            storage, cluster_layout_vmnk,
            ab_producers=1 + (32 * len(self.gather_warps) if cutlass.const_expr(self.gather) else 0))
        ab_producer, ab_consumer = ab_pipe.make_participants()

        sA = smem.allocate_tensor(element_type=self.a_dtype, layout=a_smem_staged.outer, byte_alignment=128,
                                  swizzle=a_smem_staged.inner)
        sB = smem.allocate_tensor(element_type=self.b_dtype, layout=b_smem_staged.outer, byte_alignment=128,
                                  swizzle=b_smem_staged.inner)
        tile_mn = cute.slice_(self.mma_tiler, (None, None, 0))
        gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        thr_mma = tiled_mma.get_slice(0)
        tCgB = thr_mma.partition_B(gB)
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 3),
                                           cute.group_modes(tCgB, 0, 3))
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))
        k_tiles = (mA.shape[1] + self.mma_tiler[2] - 1) // self.mma_tiler[2]
        num_groups = mB.shape[2]
        pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)

        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                           cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        if cutlass.const_expr(self.gather):
            if warp_idx >= self.gather_warps[0]:
                self._gather_a(mA, a_rows, sA, ab_pipe, offsets, sched_params, num_groups, k_tiles, tidx)
        if warp_idx == self.tma_warp_id:
            while work.is_valid_tile:
                tc = work.tile_idx
                grp, mt = self._locate(offsets, tc[0], num_groups)
                if grp >= 0:
                    tAsA = tAgA = None
                    if cutlass.const_expr(not self.gather):
                        gA = cute.local_tile(cute.domain_offset((offsets[grp], None), mA),
                                             cute.slice_(self.mma_tiler, (None, 0, None)), (mt, None))
                        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 3),
                                                           cute.group_modes(thr_mma.partition_A(gA), 0, 3))
                    tBgB_t = tBgB[None, tc[1], None, grp]
                    ab_producer.reset()
                    peek = ab_producer.try_acquire()
                    for k in cutlass.range(0, k_tiles, 1, unroll=1):
                        h = ab_producer.acquire_and_advance(peek)
                        if cutlass.const_expr(not self.gather):
                            cute.copy(tma_a, tAgA[None, h.count], tAsA[None, h.index], tma_bar_ptr=h.barrier)
                        cute.copy(tma_b, tBgB_t[None, h.count], tBsB[None, h.index], tma_bar_ptr=h.barrier)
                        peek = cutlass.Boolean(1)
                        if h.count + 1 < k_tiles:
                            peek = ab_producer.try_acquire()
                sched.advance_to_next_work()
                work = sched.get_current_work()
            ab_producer.tail()

        if warp_idx == self.mma_warp_id:
            tmem.wait_for_alloc()
            tCtAcc_base = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), tCtAcc_fake.layout)
            acc_prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_acc_stage)
            while work.is_valid_tile:
                tc = work.tile_idx
                grp, _mt = self._locate(offsets, tc[0], num_groups)
                if grp >= 0:
                    tCtAcc = tCtAcc_base[None, None, None, acc_prod.index]
                    ab_consumer.reset()
                    peek = ab_consumer.try_wait()
                    acc_pipe.producer_acquire(acc_prod)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                    for k in range(k_tiles):
                        h = ab_consumer.wait_and_advance(peek)
                        for kb in cutlass.range(cute.size(tCrA, mode=[2]), unroll_full=True):
                            crd = (None, None, kb, h.index)
                            cute.gemm(tiled_mma, tCtAcc, tCrA[crd], tCrB[crd], tCtAcc)
                            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                        h.release()
                        peek = cutlass.Boolean(1)
                        if h.count + 1 < k_tiles:
                            peek = ab_consumer.try_wait()
                    acc_pipe.producer_commit(acc_prod)
                    acc_prod.advance()
                sched.advance_to_next_work()
                work = sched.get_current_work()
            acc_pipe.producer_tail(acc_prod)

        sC, _aux, sIn, _n_full, _full_bytes = self._epilogue_smem(smem, c_smem_staged, inputs)
        if warp_idx < self.mma_warp_id:
            tmem_ptr, tCtAcc_base, acc_cons, c_pipe, epi_bar = self._epilogue_begin(tmem, tCtAcc_fake)
            # the partitions of one tile (coordinates local to the tile; the same for every tile)
            cT = thr_mma.partition_C(cute.local_tile(cute.make_identity_tensor((*tile_mn, 1)), tile_mn,
                                                     (None, None, None)))
            tCcT_t = transform_partitioned_tensor_layout(cT)
            copy_t2r, tTR_tAcc_base, tTR_rAcc, tTR_cT, copy_r2s, tRS_rC, tRS_sC = self._epilogue_copies(
                tidx, tCtAcc_base, tCcT_t, tCcT_t, sC, epi_tile, False)
            tTR_cT = tTR_cT[(None, None, None, None, None, 0, 0, 0)]
            tTR_cT = cute.group_modes(tTR_cT, 3, cute.rank(tTR_cT))
            rIn = [cute.make_rmem_tensor(tTR_rAcc.shape, self.epi_dtype) for _ in self.input_kinds]
            n_v = cute.size(tTR_rAcc)
            stored = cutlass.Int32(0)            # sub-tiles stored so far: the staging buffer ring's position
            while work.is_valid_tile:
                tc = work.tile_idx
                grp, mt = self._locate(offsets, tc[0], num_groups)
                sched.advance_to_next_work()
                work = sched.get_current_work()
                if grp >= 0:
                    row0 = offsets[grp]
                    length = offsets[grp + 1] - row0
                    # this tile of the group's D rows, through the ragged view (rows past the group clip)
                    gC = cute.local_tile(group_rows(mC_tma, row0, length), tile_mn, (mt, tc[1]))
                    tCgC_t = transform_partitioned_tensor_layout(thr_mma.partition_C(gC))
                    bSG_sC, bSG_gC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                                                           cute.group_modes(cute.flat_divide(tCgC_t, epi_tile), 0, 2))
                    bSG_gC = cute.group_modes(bSG_gC, 1, cute.rank(bSG_gC))
                    tTR_tAcc = tTR_tAcc_base[(None, None, None, None, None, acc_cons.index)]
                    acc_pipe.consumer_wait(acc_cons)
                    tTR_tAcc = cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))
                    n_sub = cute.size(tTR_tAcc.shape, mode=[3])
                    m0 = mt * self.mma_tiler[0]
                    n0 = tc[1] * self.mma_tiler[1]
                    if cutlass.const_expr(len(self.input_kinds) > 0):
                        for j in cutlass.range_constexpr(len(self.input_kinds)):
                            if cutlass.const_expr(self.input_kinds[j] == "col_packed"):
                                for i in range(tidx, self.mma_tiler[0], 128):
                                    sIn[j][i] = inputs[j][row0 + cutlass.min(m0 + i, length - 1)].to(self.epi_dtype)
                            else:
                                for i in range(tidx, self.mma_tiler[1], 128):
                                    sIn[j][i] = inputs[j][self._vector_coord(j, cutlass.min(n0 + i, n_cols - 1),
                                                                             grp)].to(self.epi_dtype)
                        epi_bar.arrive_and_wait()
                    for s in cutlass.range_constexpr(n_sub):
                        cute.copy(copy_t2r, tTR_tAcc[(None, None, None, s)], tTR_rAcc)
                        if cutlass.const_expr(len(self.input_kinds) > 0):
                            tTR_c_s = tTR_cT[(None, None, None, s)]
                            for e in cutlass.range_constexpr(n_v):
                                lm, ln, _l = tTR_c_s[e]
                                for j in cutlass.range_constexpr(len(self.input_kinds)):
                                    if cutlass.const_expr(self.input_kinds[j] == "col_packed"):
                                        rIn[j][e] = sIn[j][lm]
                                    else:
                                        rIn[j][e] = sIn[j][ln]
                        values = self.epi_fn(copy_r2s.retile(tTR_rAcc).load(),
                                             tuple(copy_r2s.retile(r).load() for r in rIn), scalars)
                        self._store_subtile(values, stored + s, s, copy_r2s, tRS_rC, tRS_sC, epi_bar, warp_idx, tma_c, bSG_sC,
                                            bSG_gC, c_pipe)
                    epi_bar.arrive_and_wait()
                    with cute.arch.elect_one():
                        acc_pipe.consumer_release(acc_cons)
                    acc_cons.advance()
                    stored = stored + n_sub
            self._epilogue_end(c_pipe, tmem, tmem_ptr)
