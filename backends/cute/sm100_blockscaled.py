"""Block-scaled FP8 GEMMs with f32 scales per K block on sm_100a (DeepSeek-V3's 1x128 / 128x128
recipe; blockscale.py has the sm_90a kernel and the numerics): `sum(k) A[m, k] sa[m, k / 128] B[n, k]
sb[n / 128, k / 128]`.

tcgen05 accumulates in tensor memory, so the scales cannot be applied by the MMA warp: here each
K tile (= one 128-value scale block) is a separate accumulation into one of the two TMEM accumulator
buffers (the MMA warp starts every K tile with ACCUMULATE off and commits it to the accumulator
pipeline), and the four epilogue warps promote it, `acc += tmem * sa[rows, kt] * sb[n block, kt]`, into
an f32 register accumulator (the whole 128 x 128 tile: 128 values per thread), while the MMA warp
fills the other buffer with the next K tile.  After the last K tile the register accumulator goes
through the generated epilogue and the TMA store like Sm100Gemm's.  1-CTA UMMA, clusters 1x1.
kspec's own kernel on Sm100Gemm's building blocks (the row bookkeeping is blockscale.row_plan).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.pipeline import pipeline_init_wait
from cutlass.utils.gemm.sm100 import transform_partitioned_tensor_layout

from . import blockscale as bsc
from . import reduce as red
from .sm100 import Sm100Gemm


class Sm100BlockScaledGemm(Sm100Gemm):
    """mma_tiler_mn: the UMMA tile (128 x 128); scales: (operand, block_mn, order) per scale tensor."""

    def __init__(self, acc_dtype, mma_tiler_mn, epi_fn, input_kinds, num_scalars, stages=None, scales=()):
        super().__init__(acc_dtype, mma_tiler_mn, (1, 1), False, epi_fn, input_kinds, num_scalars, stages)
        self.scales = tuple(scales)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, auxes, inputs, scalars,
                 max_active_clusters: cutlass.Int32, stream, b2s=(), scale_ts=()):
        self._operand_types(a, b, c, inputs)
        self.num_aux = 0
        tiled_mma = self._tiled_mma()
        self._setup()
        tma_a, gA, tma_b, gB, tma_c, gC, sched, grid = self._tma_atoms_1cta(tiled_mma, a, b, c, max_active_clusters)
        self.kernel(tiled_mma, tma_a, gA, tma_b, gB, tma_c, gC, c, inputs, scalars, scale_ts, self.cluster_layout_vmnk,
                    self.a_smem_staged, self.b_smem_staged, self.c_smem_staged, self.epi_tile, sched).launch(
            grid=grid, block=[self.threads_per_cta, 1, 1], cluster=(1, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
               mB: cute.Tensor, tma_c: cute.CopyAtom, mC_tma: cute.Tensor, mC: cute.Tensor, inputs, scalars, scale_ts,
               cluster_layout_vmnk: cute.Layout, a_smem_staged: cute.ComposedLayout,
               b_smem_staged: cute.ComposedLayout, c_smem_staged: cute.ComposedLayout, epi_tile: cute.Tile,
               sched_params: utils.PersistentTileSchedulerParams):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        self._prefetch_descriptors(warp_idx, tma_a, tma_b, tma_c)
        tidx, _, _ = cute.arch.thread_idx()

        smem = utils.SmemAllocator()
        storage = smem.allocate(self._shared_storage())
        ab_pipe, acc_pipe, tmem = self._pipelines(storage, cluster_layout_vmnk)
        ab_producer, ab_consumer = ab_pipe.make_participants()

        sA = smem.allocate_tensor(element_type=self.a_dtype, layout=a_smem_staged.outer, byte_alignment=128,
                                  swizzle=a_smem_staged.inner)
        sB = smem.allocate_tensor(element_type=self.b_dtype, layout=b_smem_staged.outer, byte_alignment=128,
                                  swizzle=b_smem_staged.inner)
        (tile_mn, k_tiles, thr_mma, tCgC, tCcC, tAsA, tAgA, tBsB, tBgB, tCrA, tCrB,
         tCtAcc_fake) = self._views_1cta(tiled_mma, tma_a, mA, tma_b, mB, mC_tma, mC, sA, sB)
        pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)

        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                           cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        work, sched, ab_producer = self._tma_warp_1cta(warp_idx, work, sched, ab_producer, k_tiles, tma_a, tAgA,
                                                       tAsA, tma_b, tBgB, tBsB)

        if warp_idx == self.mma_warp_id:
            # one accumulation per K tile (= scale block), each into the next TMEM accumulator buffer
            tmem.wait_for_alloc()
            tCtAcc_base = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), tCtAcc_fake.layout)
            acc_prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_acc_stage)
            while work.is_valid_tile:
                ab_consumer.reset()
                peek = ab_consumer.try_wait()
                for k in range(k_tiles):
                    acc_pipe.producer_acquire(acc_prod)
                    tCtAcc = tCtAcc_base[None, None, None, acc_prod.index]
                    h = ab_consumer.wait_and_advance(peek)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                    for kb in cutlass.range(cute.size(tCrA, mode=[2]), unroll_full=True):
                        crd = (None, None, kb, h.index)
                        cute.gemm(tiled_mma, tCtAcc, tCrA[crd], tCrB[crd], tCtAcc)
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    h.release()
                    acc_pipe.producer_commit(acc_prod)
                    acc_prod.advance()
                    peek = cutlass.Boolean(1)
                    if h.count + 1 < k_tiles:
                        peek = ab_consumer.try_wait()
                sched.advance_to_next_work()
                work = sched.get_current_work()
            acc_pipe.producer_tail(acc_prod)

        sC, _aux, sIn, _n_full, _full_bytes = self._epilogue_smem(smem, c_smem_staged, inputs)
        if warp_idx < self.mma_warp_id:
            tmem_ptr, tCtAcc_base, acc_cons, c_pipe, epi_bar = self._epilogue_begin(tmem, tCtAcc_fake)
            tCgC_t = transform_partitioned_tensor_layout(tCgC)
            tCcC_t = transform_partitioned_tensor_layout(tCcC)
            copy_t2r, tTR_tAcc_base, tTR_rAcc, tTR_cC_all, copy_r2s, tRS_rC, tRS_sC = self._epilogue_copies(
                tidx, tCtAcc_base, tCgC_t, tCcC_t, sC, epi_tile, False)
            bSG_sC, bSG_gC_all = cpasync.tma_partition(
                tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                cute.group_modes(cute.flat_divide(tCgC_t, epi_tile), 0, 2))
            rIn = [cute.make_rmem_tensor(tTR_rAcc.shape, self.epi_dtype) for _ in self.input_kinds]
            n_v = cute.size(tTR_rAcc)
            M, N, L = mC.shape
            tm, tn = self.mma_tiler[0], self.mma_tiler[1]
            em, en = self.epi_mn
            epi_grid = (tm // em, tn // en)
            n_sub = epi_grid[0] * epi_grid[1]
            # the register accumulator (the whole tile: n_sub sub-tiles of n_v values) and the rows
            # this thread's values lie in (blockscale.row_plan over the TMEM load's partition)
            racc = [cute.make_rmem_tensor(tTR_rAcc.shape, self.acc_dtype) for _ in range(n_sub)]
            cS = cute.flat_divide(transform_partitioned_tensor_layout(
                tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor(tile_mn))), epi_tile)
            plan = bsc.row_plan(lambda t: copy_t2r.get_slice(t).partition_D(cS)[(None, None, None, 0, 0)],
                                red.plan_threads(128), (em, en), epi_grid)
            self.traced.update(bs_plan=plan)                               # for tests
            while work.is_valid_tile:
                tc = work.tile_idx
                sched.advance_to_next_work()
                work = sched.get_current_work()
                bSG_gC = bSG_gC_all[(None, None, None, *tc)]
                bSG_gC = cute.group_modes(bSG_gC, 1, cute.rank(bSG_gC))
                tTR_cC = tTR_cC_all[(None, None, None, None, None, *tc)]
                tTR_cC = cute.group_modes(tTR_cC, 3, cute.rank(tTR_cC))
                m0 = tc[0] * tm
                n0 = tc[1] * tn
                row0, _n, _l = tTR_cC[(None, None, None, 0)][0]
                row0 = row0 - m0
                for s in cutlass.range_constexpr(n_sub):
                    racc[s].fill(0.0)
                for k in range(k_tiles):
                    # this K block's scales (loaded before waiting for its accumulation)
                    rs, sb = bsc.k_block_scales(self.scales, scale_ts, plan, k, m0, n0, row0, M)
                    acc_pipe.consumer_wait(acc_cons)
                    tTR_tAcc = tTR_tAcc_base[(None, None, None, None, None, acc_cons.index)]
                    tTR_tAcc = cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))
                    for s in cutlass.range_constexpr(n_sub):
                        cute.copy(copy_t2r, tTR_tAcc[(None, None, None, s)], tTR_rAcc)
                        for e in cutlass.range_constexpr(n_v):
                            racc[s][e] = racc[s][e] + tTR_rAcc[e] * (rs[plan.slot[s][e]] * sb)
                    cute.arch.fence_view_async_tmem_load()
                    with cute.arch.elect_one():
                        acc_pipe.consumer_release(acc_cons)
                    acc_cons.advance()
                # stage this tile's slices of row/col inputs in shared memory (coalesced)
                if cutlass.const_expr(len(self.input_kinds) > 0):
                    epi_bar.arrive_and_wait()
                    self._stage_vectors(sIn, inputs, tidx, m0, n0, M, N, tc[2])
                    epi_bar.arrive_and_wait()
                prev = sched.num_tiles_executed * n_sub
                for s in cutlass.range_constexpr(n_sub):
                    if cutlass.const_expr(len(self.input_kinds) > 0):
                        tTR_cC_s = tTR_cC[(None, None, None, s)]
                        self._gather_inputs(rIn, sIn, tTR_cC_s, n_v, m0, n0)
                    values = self.epi_fn(copy_r2s.retile(racc[s]).load(),
                                         tuple(copy_r2s.retile(r).load() for r in rIn), scalars)
                    self._store_subtile(values, prev + s, s, copy_r2s, tRS_rC, tRS_sC, epi_bar, warp_idx, tma_c, bSG_sC,
                                        bSG_gC, c_pipe)
            self._epilogue_end(c_pipe, tmem, tmem_ptr)
