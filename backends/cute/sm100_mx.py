"""Block-scaled GEMMs on sm_100a with tcgen05's block-scaled MMA: `sum(k) A[m, k] sa[m, k / V]
B[n, k] sb[n, k / V]`, the scales stored as written, row-major [M, K / V] and [N, K / V].  The kinds
(gemm.MX_KINDS, one table): MXFP8 (fp8 data, E8M0 scales, V = 32; `kind::mxf8f6f4`), MXFP4 (FP4 E2M1
data two values a byte, E8M0 scales, V = 32) and NVFP4 (FP4 data, E4M3 scales, V = 16; both FP4
kinds `kind::mxf4nvf4`).  The operand dtypes choose the MMA kind and K: a K tile is four MMA
instructions, 128 bytes of an operand row (128 fp8 values, 256 FP4 values).

The tensor cores read the scales from tensor memory in their own blocked layout (the
BlockScaledBasicChunk of `cutlass.utils.blockscaled_layout`: 128 rows x 4 scale columns = 512 bytes
per chunk, the chunks of a K tile one after another).  A row-major scale row holds a K tile's
scales (4 for MXFP8, 8 for MXFP4, 16 for NVFP4) in consecutive bytes, and the blocked layout keeps
each group of 4 together, so four extra warps (6..9) copy each row's groups of 4 bytes by cp.async
straight into the stage's blocked shared-memory tile (no reformatting pass over memory, no TMA: a
4-byte group is below TMA's 16-byte minimum) and arrive on the stage's full barrier beside the TMA
loads of A and B.  The MMA warp copies the stage's scales to tensor memory (tcgen05.cp,
`Cp4x32x128bOp`) and issues the block-scaled MMAs; the epilogue is Sm100Gemm's (row/column vectors,
scalars: NVFP4's global scale is `alpha * sum(k) ...`).  1-CTA UMMA 128 x 128, clusters 1x1, K a
multiple of the K tile (gemm.size_multiples; the host glue checks it).  kspec's own kernel on the DSL
wheel's block-scaled building blocks (the CUTLASS DSL examples' dense_blockscaled_gemm_persistent
shows their use, for the same kinds, with TMA-loaded, pre-blocked scales).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.pipeline import pipeline_init_wait
from cutlass.utils.gemm.sm100 import transform_partitioned_tensor_layout

from kspec.core import KspecInternalError

from .sm100 import Sm100Gemm

SF_WARPS = (6, 7, 8, 9)
SF_GROUP = 4                  # scales per cp.async: the 4 scale columns of a BlockScaledBasicChunk


def blocked_offsets(rows: int, k_tile: int, sf_vec: int) -> list[list[int]]:
    """Byte offset, in one stage's blocked scale tile, of each row's groups of 4 scales of a K tile
    (trace time: the BlockScaledBasicChunk tiled over (rows, k_tile), (2, 1) order as
    make_smem_layout_sfa does); checks that each group's 4 scales are consecutive bytes and that
    the rows cover the tile."""
    layout = cute.tile_to_shape(blockscaled_utils.BlockScaledBasicChunk(sf_vec).layout, (rows, k_tile), (2, 1))
    per = k_tile // sf_vec
    offs = []
    seen = set()
    for m in range(rows):
        row = [cute.crd2idx((m, j * sf_vec), layout) for j in range(per)]
        if any(not isinstance(x, int) for x in row):
            raise KspecInternalError("MX scales: the blocked layout is not static")
        groups = [row[g:g + SF_GROUP] for g in range(0, per, SF_GROUP)]
        if any(grp != list(range(grp[0], grp[0] + SF_GROUP)) for grp in groups):
            raise KspecInternalError("MX scales: a row's groups of 4 scales are not consecutive in the blocked layout")
        seen.update(row)
        offs.append([grp[0] for grp in groups])
    if seen != set(range(rows * per)):
        raise KspecInternalError("MX scales: the rows do not cover the blocked scale tile")
    return offs


def group_offset(rows: int, r: int, g: int) -> int:
    """Where _copy_row puts group g of row r's scales (the BlockScaledBasicChunk: 32-row sub-blocks
    of 16 bytes, 4 of them side by side; the K tile's chunks of rows x 4 bytes one after another)."""
    return g * rows * SF_GROUP + (r % 32) * 16 + (r // 32) * SF_GROUP


class Sm100MxGemm(Sm100Gemm):
    """mma_tiler_mn: (128, 128); A and B fp8 or FP4 (K-major), one scale (f8e8m0 or f8e4m3) per
    sf_vec values of K (gemm.MX_KINDS)."""

    def __init__(self, acc_dtype, mma_tiler_mn, epi_fn, input_kinds, num_scalars, stages=None, sf_vec=32):
        super().__init__(acc_dtype, mma_tiler_mn, (1, 1), False, epi_fn, input_kinds, num_scalars, stages)
        self.threads_per_cta = 32 * 10
        self.sf_vec = sf_vec

    def _tiled_mma(self):
        return sm100_utils.make_blockscaled_trivial_tiled_mma(
            self.a_dtype, self.b_dtype, self.a_major, self.b_major, self.sf_dtype, self.sf_vec, tcgen05.CtaGroup.ONE,
            self.mma_tiler[:2])

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, auxes, inputs, scalars,
                 max_active_clusters: cutlass.Int32, stream, b2s=(), scale_ts=()):
        self._operand_types(a, b, c, inputs)
        self.sf_dtype = scale_ts[0].element_type
        self.num_aux = 0
        tiled_mma = self._tiled_mma()
        self._setup()
        # the stages also hold each K tile's blocked scales (tm x per and tn x per bytes): fewer of them
        tm, tn, tk = self.mma_tiler
        sf_bytes = (tm + tn) * tk // self.sf_vec
        a1 = cute.size_in_bytes(self.a_dtype, cute.slice_(self.a_smem_staged, (None, None, None, 0)))
        b1 = cute.size_in_bytes(self.b_dtype, cute.slice_(self.b_smem_staged, (None, None, None, 0)))
        self.num_ab_stage = max(2, self.num_ab_stage * (a1 + b1) // (a1 + b1 + sf_bytes) - 1)
        self.a_smem_staged = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.a_dtype, self.num_ab_stage)
        self.b_smem_staged = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.b_dtype, self.num_ab_stage)
        self.sfa_smem_staged = blockscaled_utils.make_smem_layout_sfa(tiled_mma, self.mma_tiler, self.sf_vec,
                                                                      self.num_ab_stage)
        self.sfb_smem_staged = blockscaled_utils.make_smem_layout_sfb(tiled_mma, self.mma_tiler, self.sf_vec,
                                                                      self.num_ab_stage)
        self.sf_stage_bytes = (tm * tk // self.sf_vec, tn * tk // self.sf_vec)
        self._check_blocked(tm, tn, tk)
        # TMEM: the double-buffered accumulator, then A's and B's scale columns
        self.num_acc_cols = tn * self.num_acc_stage
        self.num_sfa_cols = (tm // 32) * 4
        self.num_sfb_cols = (tn // 32) * 4
        self.num_tmem_cols = 512
        tma_a, gA, tma_b, gB, tma_c, gC, sched, grid = self._tma_atoms_1cta(tiled_mma, a, b, c, max_active_clusters)
        self.kernel(tiled_mma, tma_a, gA, tma_b, gB, tma_c, gC, c, inputs, scalars, scale_ts[0], scale_ts[1],
                    self.cluster_layout_vmnk, self.a_smem_staged, self.b_smem_staged, self.sfa_smem_staged,
                    self.sfb_smem_staged, self.c_smem_staged, self.epi_tile, sched).launch(
            grid=grid, block=[self.threads_per_cta, 1, 1], cluster=(1, 1, 1), stream=stream)

    def _check_blocked(self, tm, tn, tk):
        """Trace time: the blocked scale tiles are the 128 x 4 chunks _copy_row writes into, whole
        groups of 4 scales a row per K tile."""
        if (tk // self.sf_vec) % SF_GROUP:
            raise KspecInternalError(f"MX scales: {tk // self.sf_vec} scales a row per K tile, not whole groups "
                                     f"of {SF_GROUP}")
        for rows, staged, stage_bytes in ((tm, self.sfa_smem_staged, self.sf_stage_bytes[0]),
                                          (tn, self.sfb_smem_staged, self.sf_stage_bytes[1])):
            offs = blocked_offsets(rows, tk, self.sf_vec)
            want = [[group_offset(rows, r, g) for g in range(len(offs[0]))] for r in range(rows)]
            if offs != want or cute.cosize(staged) != stage_bytes * self.num_ab_stage:
                raise KspecInternalError("MX scales: the blocked shared-memory tile is not the 128 x 4 chunks "
                                         "this kernel's scale loads assume")

    @cute.jit
    def _load_scales(self, mSFA: cute.Tensor, mSFB: cute.Tensor, sSFA_base, sSFB_base, ab_pipe, sched_params,
                     k_tiles, tidx):
        """Warps 6..9: per tile and K tile, wait for the stage, copy each row's scales of A's and
        B's tile rows, 4 bytes at a time by cp.async, into the stage's blocked tile, arrive on its
        full barrier."""
        tm, tn, tk = self.mma_tiler
        nthr = 32 * len(SF_WARPS)
        t = tidx - 32 * SF_WARPS[0]
        groups = tk // self.sf_vec // SF_GROUP          # groups of 4 scales of a row in one K tile
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), self.sf_dtype, num_bits_per_copy=8 * SF_GROUP)
        M = mSFA.shape[0]
        N = mSFB.shape[0]
        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_ab_stage)
        while work.is_valid_tile:
            tc = work.tile_idx
            for k in range(k_tiles):
                ab_pipe.sync_object_empty.wait(state.index, state.phase)
                for j in cutlass.range_constexpr(tm // nthr):
                    r = t + j * nthr
                    ktile = cute.local_tile(mSFA[cutlass.min(tc[0] * tm + r, M - 1), None],
                                            (groups * SF_GROUP,), (k,))
                    for g in cutlass.range_constexpr(groups):
                        src = cute.local_tile(ktile, (SF_GROUP,), (g,))
                        self._copy_row(atom, src, sSFA_base, state.index * self.sf_stage_bytes[0], tm, r, g)
                for j in cutlass.range_constexpr(tn // nthr):
                    r = t + j * nthr
                    ktile = cute.local_tile(mSFB[cutlass.min(tc[1] * tn + r, N - 1), None],
                                            (groups * SF_GROUP,), (k,))
                    for g in cutlass.range_constexpr(groups):
                        src = cute.local_tile(ktile, (SF_GROUP,), (g,))
                        self._copy_row(atom, src, sSFB_base, state.index * self.sf_stage_bytes[1], tn, r, g)
                cute.arch.cp_async_mbarrier_arrive_noinc(ab_pipe.producer_get_barrier(state))
                state.advance()
            sched.advance_to_next_work()
            work = sched.get_current_work()

    @cute.jit
    def _copy_row(self, atom, src, base, stage_off, rows: cutlass.Constexpr, r, g: cutlass.Constexpr):
        """cp.async of group g of row r's scales to its place in the stage's blocked tile, byte
        g * rows * 4 + (r % 32) * 16 + (r // 32) * 4 (group_offset: the BlockScaledBasicChunk;
        __call__ checks this against the layout the MMA's shared-memory descriptors use)."""
        off = g * rows * SF_GROUP + (r % 32) * 16 + (r // 32) * SF_GROUP
        # (4-byte aligned by construction: the stage and group offsets are multiples of 4)
        dst = cute.make_tensor((base + stage_off + off).align(4), cute.make_layout(SF_GROUP))
        cute.copy(atom, src, dst)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
               mB: cute.Tensor, tma_c: cute.CopyAtom, mC_tma: cute.Tensor, mC: cute.Tensor, inputs, scalars,
               mSFA: cute.Tensor, mSFB: cute.Tensor, cluster_layout_vmnk: cute.Layout,
               a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout, sfa_smem_staged: cute.Layout,
               sfb_smem_staged: cute.Layout, c_smem_staged: cute.ComposedLayout, epi_tile: cute.Tile,
               sched_params: utils.PersistentTileSchedulerParams):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        self._prefetch_descriptors(warp_idx, tma_a, tma_b, tma_c)
        tidx, _, _ = cute.arch.thread_idx()

        smem = utils.SmemAllocator()
        storage = smem.allocate(self._shared_storage(
            sSFA=cute.struct.Align[cute.struct.MemRange[self.sf_dtype, cute.cosize(sfa_smem_staged)], 128],
            sSFB=cute.struct.Align[cute.struct.MemRange[self.sf_dtype, cute.cosize(sfb_smem_staged)], 128]))
        # the full barrier: A and B by TMA (1 arrival with their bytes), the scales by cp.async (one
        # arrival per scale thread)
        ab_pipe, acc_pipe, tmem = self._pipelines(storage, cluster_layout_vmnk, ab_producers=1 + 32 * len(SF_WARPS))
        ab_producer, ab_consumer = ab_pipe.make_participants()

        sA = smem.allocate_tensor(element_type=self.a_dtype, layout=a_smem_staged.outer, byte_alignment=128,
                                  swizzle=a_smem_staged.inner)
        sB = smem.allocate_tensor(element_type=self.b_dtype, layout=b_smem_staged.outer, byte_alignment=128,
                                  swizzle=b_smem_staged.inner)
        sSFA = storage.sSFA.get_tensor(sfa_smem_staged)
        sSFB = storage.sSFB.get_tensor(sfb_smem_staged)
        (tile_mn, k_tiles, thr_mma, tCgC, tCcC, tAsA, tAgA, tBsB, tBgB, tCrA, tCrB,
         tCtAcc_fake) = self._views_1cta(tiled_mma, tma_a, mA, tma_b, mB, mC_tma, mC, sA, sB)
        pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)

        if warp_idx >= SF_WARPS[0]:
            self._load_scales(mSFA, mSFB, storage.sSFA.data_ptr(), storage.sSFB.data_ptr(), ab_pipe, sched_params,
                              k_tiles, tidx)

        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                           cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        work, sched, ab_producer = self._tma_warp_1cta(warp_idx, work, sched, ab_producer, k_tiles, tma_a, tAgA,
                                                       tAsA, tma_b, tBgB, tBsB)

        if warp_idx == self.mma_warp_id:
            tmem.wait_for_alloc()
            acc_tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc_base = cute.make_tensor(acc_tmem_ptr, tCtAcc_fake.layout)
            # the scales' tensor-memory columns follow the accumulator's
            tCtSFA = cute.make_tensor(
                cute.recast_ptr(acc_tmem_ptr + self.num_acc_cols, dtype=self.sf_dtype),
                blockscaled_utils.make_tmem_layout_sfa(tiled_mma, self.mma_tiler, self.sf_vec,
                                                       cute.slice_(sfa_smem_staged, (None, None, None, 0))))
            tCtSFB = cute.make_tensor(
                cute.recast_ptr(acc_tmem_ptr + self.num_acc_cols + self.num_sfa_cols, dtype=self.sf_dtype),
                blockscaled_utils.make_tmem_layout_sfb(tiled_mma, self.mma_tiler, self.sf_vec,
                                                       cute.slice_(sfb_smem_staged, (None, None, None, 0))))
            s2t_a, sSFA_s2t, tSFA_s2t = self._s2t(sSFA, tCtSFA)
            s2t_b, sSFB_s2t, tSFB_s2t = self._s2t(sSFB, tCtSFB)
            acc_prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_acc_stage)
            while work.is_valid_tile:
                tCtAcc = tCtAcc_base[None, None, None, acc_prod.index]
                ab_consumer.reset()
                peek = ab_consumer.try_wait()
                acc_pipe.producer_acquire(acc_prod)
                for k in range(k_tiles):
                    h = ab_consumer.wait_and_advance(peek)
                    cute.copy(s2t_a, sSFA_s2t[(None, None, None, None, h.index)], tSFA_s2t)
                    cute.copy(s2t_b, sSFB_s2t[(None, None, None, None, h.index)], tSFB_s2t)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, k != 0)
                    crd = (None, None, None, h.index)
                    cute.gemm(tiled_mma, tCtAcc, [tCrA[crd], tCtSFA], [tCrB[crd], tCtSFB], tCtAcc)
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
            while work.is_valid_tile:
                tc = work.tile_idx
                sched.advance_to_next_work()
                work = sched.get_current_work()
                bSG_gC = bSG_gC_all[(None, None, None, *tc)]
                bSG_gC = cute.group_modes(bSG_gC, 1, cute.rank(bSG_gC))
                tTR_cC = tTR_cC_all[(None, None, None, None, None, *tc)]
                tTR_cC = cute.group_modes(tTR_cC, 3, cute.rank(tTR_cC))
                tTR_tAcc = tTR_tAcc_base[(None, None, None, None, None, acc_cons.index)]
                acc_pipe.consumer_wait(acc_cons)
                tTR_tAcc = cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))
                n_sub = cute.size(tTR_tAcc.shape, mode=[3])
                prev = sched.num_tiles_executed * n_sub
                m0 = tc[0] * self.mma_tiler[0]
                n0 = tc[1] * self.mma_tiler[1]
                if cutlass.const_expr(len(self.input_kinds) > 0):
                    self._stage_vectors(sIn, inputs, tidx, m0, n0, M, N, tc[2])
                    epi_bar.arrive_and_wait()
                for s in cutlass.range_constexpr(n_sub):
                    cute.copy(copy_t2r, tTR_tAcc[(None, None, None, s)], tTR_rAcc)
                    if cutlass.const_expr(len(self.input_kinds) > 0):
                        tTR_cC_s = tTR_cC[(None, None, None, s)]
                        self._gather_inputs(rIn, sIn, tTR_cC_s, n_v, m0, n0)
                    values = self.epi_fn(copy_r2s.retile(tTR_rAcc).load(),
                                         tuple(copy_r2s.retile(r).load() for r in rIn), scalars)
                    self._store_subtile(values, prev + s, s, copy_r2s, tRS_rC, tRS_sC, epi_bar, warp_idx, tma_c, bSG_sC,
                                        bSG_gC, c_pipe)
                epi_bar.arrive_and_wait()
                with cute.arch.elect_one():
                    acc_pipe.consumer_release(acc_cons)
                acc_cons.advance()
            self._epilogue_end(c_pipe, tmem, tmem_ptr)

    def _s2t(self, sSF: cute.Tensor, tSF: cute.Tensor):
        """The shared -> tensor memory copy of a scale tile (tcgen05.cp 4x32x128b): the copy, the
        staged shared-memory source (as descriptors) and the tensor-memory destination."""
        sSF_c = cute.filter_zeros(sSF)
        tSF_c = cute.filter_zeros(tSF)
        s2t = tcgen05.make_s2t_copy(cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), self.sf_dtype),
                                    tSF_c)
        thr = s2t.get_slice(0)
        return s2t, tcgen05.get_s2t_smem_desc_tensor(s2t, thr.partition_S(sSF_c)), thr.partition_D(tSF_c)
