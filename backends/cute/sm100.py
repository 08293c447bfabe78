"""kspec's Blackwell (sm_100a) GEMM kernel on the CuTe DSL: tcgen05 UMMA with the accumulator in
tensor memory, TMA loads (multicast across the cluster, 2-CTA UMMA when the MMA tile is 256 rows),
a static persistent tile scheduler, warp specialization (one TMA warp, one MMA warp, four epilogue
warps, double-buffered accumulators in TMEM) and a fused epilogue: TMEM -> registers -> the
generated math -> shared memory -> TMA store (D and auxiliary outputs); epilogue inputs staged in
shared memory (row/column vectors per MMA tile, residual sub-tiles by double-buffered TMA loads);
row/column reductions of epilogue values combined per tile and written with atomics (reduce.py).

Built only from the DSL wheel's building blocks (`cutlass.utils.sm100`, `cutlass.utils.gemm.sm100`
partition helpers, pipelines, TMEM allocator).  Same tensor and epilogue conventions as `sm90.py`.
Sm100Gemm's methods are also the building blocks the other sm_100a GEMM kernels (sm100_blockscaled,
sm100_mx, sm100_grouped) share: the shared-memory struct, pipelines and TMEM allocator, a 1-CTA
kernel's TMA atoms, tile views and TMA warp, and the epilogue warps' setup, input staging and
sub-tile stores.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from kspec.backends.cute.epilogue import COL_KINDS, ROW_KINDS
from cutlass.utils.gemm.sm100 import (epilogue_smem_copy_and_partition, epilogue_tmem_copy_and_partition,
                                      transform_partitioned_tensor_layout)

from kspec.core import KspecInternalError

from . import reduce as red
from . import sync


class Sm100Gemm:
    """mma_tiler_mn: the UMMA tile (M 64/128, or 128/256 with `use_2cta`); cluster_mn: cluster
    shape (M must be even with 2-CTA UMMA)."""

    def __init__(self, acc_dtype, mma_tiler_mn, cluster_mn, use_2cta, epi_fn, input_kinds, num_scalars,
                 stages=None, reductions=(), dual=False, epi_dtype=None):
        self.acc_dtype = acc_dtype
        # the epilogue's arithmetic type: the accumulator's, or f32 for a float epilogue on an i32
        # accumulator (the generated function converts the accumulator; inputs are staged as f32)
        self.epi_dtype = acc_dtype if epi_dtype is None else epi_dtype
        self.mma_tiler = (*mma_tiler_mn, 1)
        self.cluster_shape_mn = tuple(cluster_mn)
        self.use_2cta_instrs = use_2cta
        self.cta_group = tcgen05.CtaGroup.TWO if use_2cta else tcgen05.CtaGroup.ONE
        self.epi_fn = epi_fn
        self.input_kinds = tuple(input_kinds)
        self.num_scalars = num_scalars
        self.stages_override = stages
        self.reductions = tuple(reductions)          # (op, axis) per reduced value (reduce.py)
        self.traced = {}                             # trace-time facts (tests)
        # a dual GEMM: a second B operand sharing the A tiles, and a second TMEM accumulator per
        # stage (stage s of the second at buffer s + num_acc_stage)
        self.dual = dual
        self.epilogue_warp_id = (0, 1, 2, 3)
        self.mma_warp_id = 4
        self.tma_warp_id = 5
        self.threads_per_cta = 32 * 6
        self.epilog_sync_bar_id = 1
        self.tmem_alloc_sync_bar_id = 2
        self.arch = "sm_100"

    def _vector_coord(self, j, i, batch):
        """The coordinate of element i of epilogue vector input j in the tile's batch entry: vectors
        shared by the batch are (N,)/(M,), per-batch vectors (N, L)/(M, L)."""
        return (i, batch) if self.input_kinds[j].endswith("_batched") else i

    def _in_layout(self):
        """Shared-memory layout of one full-input sub-tile: (EPI_M, EPI_N), n contiguous."""
        em, en = self.epi_mn
        return cute.make_layout((em, en), stride=(en, 1))

    def _tiled_mma(self):
        # separate A and B dtypes: tcgen05 kind::f8f6f4 multiplies e4m3 x e5m2 directly
        return sm100_utils.make_trivial_tiled_mma(self.a_dtype, self.b_dtype, self.a_major, self.b_major,
                                                  self.acc_dtype, self.cta_group, self.mma_tiler[:2])

    def _setup(self):
        tiled_mma = self._tiled_mma()
        k_inst = cute.size(tiled_mma.shape_mnk, mode=[2])
        self.mma_tiler = (self.mma_tiler[0], self.mma_tiler[1], k_inst * 4)
        v = cute.size(tiled_mma.thr_id.shape)
        self.cta_tile_shape_mnk = (self.mma_tiler[0] // v, self.mma_tiler[1], self.mma_tiler[2])
        self.cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((*self.cluster_shape_mn, 1)),
                                                     (tiled_mma.thr_id.shape,))
        self.num_mcast_a = cute.size(self.cluster_layout_vmnk.shape[2])
        self.num_mcast_b = cute.size(self.cluster_layout_vmnk.shape[1])
        self.epi_tile = sm100_utils.compute_epilogue_tile_shape(self.cta_tile_shape_mnk, self.use_2cta_instrs,
                                                                self.c_layout, self.c_dtype)
        self.epi_mn = (int(cute.size(self.epi_tile[0])), int(cute.size(self.epi_tile[1])))
        if utils.get_smem_capacity_in_bytes() != sync.SMEM_CAPACITY:
            raise KspecInternalError(f"the DSL's sm_100 shared memory is {utils.get_smem_capacity_in_bytes()} B, "
                                     f"kspec plans with {sync.SMEM_CAPACITY} B")
        self.num_acc_stage = sync.ACC_STAGES
        self.num_c_stage = sync.EPI_STORE_STAGES["sm100a"]
        # the shared-memory split and the A/B stage count: the planner computes the same (sync.py);
        # the DSL's own sizes of the epilogue tile and of one stage must agree with it
        self.smem_budget = sb = sync.smem_budget(
            "sm100a", self.mma_tiler[:2], use_2cta=self.use_2cta_instrs, a_bits=self.a_dtype.width,
            b_bits=self.b_dtype.width, d_bits=self.c_dtype.width, d_m_major=self.c_layout.is_m_major_c(),
            dual=self.dual, num_aux=self.num_aux,
            inputs=tuple(("row" if k in ROW_KINDS else "col" if k in COL_KINDS else "full", w)
                         for k, w in zip(self.input_kinds, self.input_widths)),
            reductions=tuple("n" if axis == "mn" else axis for _op, axis in self.reductions),
            override=self.stages_override)
        a1 = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.a_dtype, 1)
        b1 = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.b_dtype, 1)
        c1 = sm100_utils.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile, 1)
        dsl = (self.epi_mn, cute.size_in_bytes(self.a_dtype, a1), cute.size_in_bytes(self.b_dtype, b1),
               cute.size_in_bytes(self.c_dtype, c1), self.mma_tiler[2])
        mine = (sb.epi_tile, sb.a_tile_bytes, sb.b_tile_bytes, sb.epi_tile[0] * sb.epi_tile[1] * self.c_dtype.width // 8,
                sync.k_tile(self.a_dtype.width))
        if tuple(dsl) != mine:
            raise KspecInternalError(f"sm_100a shared-memory plan: the DSL's (epilogue tile, A, B, D stage bytes, "
                                     f"tile K) {dsl} != sync.smem_budget's {mine}")
        why = sb.problem()
        if why:
            raise KspecInternalError(f"sm_100a GEMM tile {self.mma_tiler[0]}x{self.mma_tiler[1]}: {why} "
                                     "(the planner refuses this configuration)")
        stages = sb.stages
        self.num_ab_stage = stages
        self.a_smem_staged = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.a_dtype, stages)
        self.b_smem_staged = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.b_dtype, stages)
        self.c_smem_staged = sm100_utils.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile,
                                                              self.num_c_stage)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        self.num_tmem_cols = utils.get_num_tmem_alloc_cols(
            tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage * (1 + int(self.dual)))),
            arch=self.arch)

    def _shared_storage(self, **extra):
        """The kernel's shared-memory struct: the A/B and accumulator rings' full and empty barriers,
        the TMEM allocator's, then `extra` (name: type) fields."""
        fields = {"ab_bars": cute.struct.MemRange[cutlass.Int64, self.num_ab_stage * 2],
                  "acc_bars": cute.struct.MemRange[cutlass.Int64, self.num_acc_stage * 2],
                  "tmem_dealloc_mbar": cutlass.Int64,
                  "tmem_holding_buf": cutlass.Int32, **extra}
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def _pipelines(self, storage, cluster_layout_vmnk, ab_producers=1, ab_consumers=1, acc_consumers=4,
                   two_cta=False):
        """The A/B ring (TMA -> MMA warp; `ab_producers` arrivals fill a stage: the TMA load's, and
        one per cp.async thread of a kernel with extra load warps), the accumulator ring (MMA warp
        -> epilogue warps) and the TMEM allocator, on `storage`'s barriers; then the cluster's
        barrier-init arrive (the kernel waits with pipeline_init_wait)."""
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_bars.data_ptr(), num_stages=self.num_ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, ab_producers),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, ab_consumers),
            tx_count=self.num_tma_load_bytes, cta_layout_vmnk=cluster_layout_vmnk, defer_sync=True)
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_bars.data_ptr(), num_stages=self.num_acc_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, acc_consumers),
            cta_layout_vmnk=cluster_layout_vmnk, defer_sync=True)
        tmem = utils.TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=self.tmem_alloc_sync_bar_id, num_threads=32 * 5),
            allocator_warp_id=self.epilogue_warp_id[0], is_two_cta=two_cta,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr)
        pipeline_init_arrive(cluster_shape_mn=cluster_layout_vmnk, is_relaxed=True)
        return ab_pipe, acc_pipe, tmem

    def _epilogue_begin(self, tmem, tCtAcc_fake):
        """The epilogue warps' start: allocate the tensor memory, the accumulator ring's consumer
        state, the TMA store ring of the staging buffers and the epilogue warps' named barrier.
        Returns (tmem_ptr, tCtAcc_base, acc_cons, c_pipe, epi_bar)."""
        tmem.allocate(self.num_tmem_cols)
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
        tCtAcc_base = cute.make_tensor(tmem_ptr, tCtAcc_fake.layout)
        acc_cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_acc_stage)
        c_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.num_c_stage, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128))
        epi_bar = pipeline.NamedBarrier(barrier_id=self.epilog_sync_bar_id, num_threads=128)
        return tmem_ptr, tCtAcc_base, acc_cons, c_pipe, epi_bar

    def _epilogue_copies(self, tidx, tCtAcc_base, tCgC_t, tCcC_t, sC, epi_tile, use_2cta):
        """The epilogue's copies: TMEM -> registers (its partition of the accumulator, of the
        coordinates `tCcC_t` and the register fragment), registers -> the shared staging buffers.
        Returns (copy_t2r, tTR_tAcc_base, tTR_rAcc, tTR_cC_all, copy_r2s, tRS_rC, tRS_sC)."""
        tCtAcc_t = transform_partitioned_tensor_layout(tCtAcc_base)
        copy_t2r, tTR_tAcc_base, tTR_rAcc = epilogue_tmem_copy_and_partition(
            self, tidx, tCtAcc_t, tCgC_t, epi_tile, use_2cta)
        tTR_cC_all = copy_t2r.get_slice(tidx).partition_D(cute.flat_divide(tCcC_t, epi_tile))
        tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, self.c_dtype)
        copy_r2s, tRS_rC, tRS_sC = epilogue_smem_copy_and_partition(self, copy_t2r, tTR_rC, tidx, sC)
        return copy_t2r, tTR_tAcc_base, tTR_rAcc, tTR_cC_all, copy_r2s, tRS_rC, tRS_sC

    def _epilogue_end(self, c_pipe, tmem, tmem_ptr):
        """The epilogue warps' end: wait for the last TMA stores, free the tensor memory."""
        c_pipe.producer_tail()
        tmem.relinquish_alloc_permit()
        tmem.free(tmem_ptr)

    def _epilogue_smem(self, smem, c_smem_staged, inputs):
        """The epilogue's shared memory: the staging buffers of D and of each auxiliary output, and
        each input's: an MMA tile's slice of a row vector (along N: ROW_KINDS) or of any other
        vector (along M), a full input's double-buffered sub-tiles.  Returns (sC, sAux, sIn, number
        of full inputs, bytes of one sub-tile of all full inputs)."""
        sC = smem.allocate_tensor(element_type=self.c_dtype, layout=c_smem_staged.outer, byte_alignment=128,
                                  swizzle=c_smem_staged.inner)
        sAux = [smem.allocate_tensor(element_type=self.c_dtype, layout=c_smem_staged.outer, byte_alignment=128,
                                     swizzle=c_smem_staged.inner) for _ in range(self.num_aux)]
        sIn = []
        n_full = 0
        full_bytes = 0
        em, en = self.epi_mn
        for j, kind in enumerate(self.input_kinds):
            if kind in ROW_KINDS:
                sIn.append(smem.allocate_tensor(self.epi_dtype, cute.make_layout((self.mma_tiler[1],)), 128))
            elif kind != "full":
                sIn.append(smem.allocate_tensor(self.epi_dtype, cute.make_layout((self.mma_tiler[0],)), 128))
            else:
                sIn.append(smem.allocate_tensor(inputs[j].element_type,
                                                cute.make_layout((em, en, sync.RESIDUAL_STAGES), stride=(en, 1, em * en)), 128))
                n_full += 1
                full_bytes += em * en * inputs[j].element_type.width // 8
        return sC, sAux, sIn, n_full, full_bytes

    def _gather_inputs(self, rIn, sIn, tTR_cC_s, n_v, m0, n0, full_at=None):
        """Trace-time loops: each of this thread's n_v values of a sub-tile (coordinates tTR_cC_s)
        takes its epilogue inputs from shared memory into rIn: row vectors at n - n0, other vectors
        at m - m0 (the tile's origin), full inputs from the sub-tile buffer `full_at` = (sub-tile
        origin m, origin n, buffer)."""
        for e in range(n_v):
            m, n, _l = tTR_cC_s[e]
            for j in range(len(self.input_kinds)):
                kind = self.input_kinds[j]
                if kind in ROW_KINDS:
                    rIn[j][e] = sIn[j][n - n0]
                elif kind != "full":
                    rIn[j][e] = sIn[j][m - m0]
                else:
                    sm0, sn0, buf = full_at
                    rIn[j][e] = sIn[j][m - sm0, n - sn0, buf].to(self.epi_dtype)

    @cute.jit
    def _stage_vectors(self, sIn, inputs, tidx, m0, n0, M, N, batch):
        """Stage an MMA tile's slices of the row/column vector inputs in shared memory (coalesced:
        the 128 epilogue threads stride over the tile's columns/rows; reads clamped to the last
        row/column).  The caller syncs the epilogue warps before the values are read."""
        for j in cutlass.range_constexpr(len(self.input_kinds)):
            if cutlass.const_expr(self.input_kinds[j] in ROW_KINDS):
                for i in range(tidx, self.mma_tiler[1], 128):
                    sIn[j][i] = inputs[j][self._vector_coord(j, cutlass.min(n0 + i, N - 1), batch)].to(
                        self.epi_dtype)
            elif cutlass.const_expr(self.input_kinds[j] in COL_KINDS):
                for i in range(tidx, self.mma_tiler[0], 128):
                    sIn[j][i] = inputs[j][self._vector_coord(j, cutlass.min(m0 + i, M - 1), batch)].to(
                        self.epi_dtype)

    @cute.jit
    def _store_subtile(self, values, count, s: cutlass.Constexpr, copy_r2s, tRS_rC, tRS_sC, epi_bar, warp_idx,
                       tma_c, bSG_sC, bSG_gC, c_pipe, tRS_sAux=(), aux_atoms=(), aux_dst=()):
        """Store sub-tile s of a tile: the epilogue's values (D, then the auxiliary outputs) to the
        staging buffer of the `count`-th sub-tile of the store ring, then one elected warp's TMA
        stores of it (the epilogue warps sync before and after)."""
        tRS_rC.store(values[0].to(self.c_dtype))
        buf = sync.ring_index(count, self.num_c_stage)
        cute.copy(copy_r2s, tRS_rC, tRS_sC[(None, None, None, buf)])
        for x in cutlass.range_constexpr(self.num_aux):
            tRS_rC.store(values[1 + x].to(self.c_dtype))
            cute.copy(copy_r2s, tRS_rC, tRS_sAux[x][(None, None, None, buf)])
        cute.arch.fence_proxy("async.shared", space="cta")
        epi_bar.arrive_and_wait()
        if warp_idx == self.epilogue_warp_id[0]:
            cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, s)])
            for x in cutlass.range_constexpr(self.num_aux):
                cute.copy(aux_atoms[x], aux_dst[x][0][(None, buf)], aux_dst[x][1][(None, s)])
            c_pipe.producer_commit()
            c_pipe.producer_acquire()
        epi_bar.arrive_and_wait()

    def _tiles(self, mA, mB, mC_tma, mC):
        """The MMA tiles of A, B and D (D's TMA coordinates and its coordinates), and the K tiles.
        Returns (gA, gB, tile_mn, gC, cC, k_tiles)."""
        gA = cute.local_tile(mA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        tile_mn = cute.slice_(self.mma_tiler, (None, None, 0))
        gC = cute.local_tile(mC_tma, tile_mn, (None, None, None))
        cC = cute.local_tile(cute.make_identity_tensor(mC.shape), tile_mn, (None, None, None))
        k_tiles = cute.size(gA, mode=[3])
        return gA, gB, tile_mn, gC, cC, k_tiles

    @cute.jit
    def _prefetch_descriptors(self, warp_idx, tma_a, tma_b, tma_c):
        """The TMA warp prefetches the TMA descriptors (tma_a None: A is not loaded by TMA)."""
        if warp_idx == self.tma_warp_id:
            if cutlass.const_expr(tma_a is not None):
                cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_c)

    def _views_1cta(self, tiled_mma, tma_a, mA, tma_b, mB, mC_tma, mC, sA, sB):
        """A 1-CTA, cluster 1x1 kernel's tiles and partitions: the TMA partitions of A and B (per
        tile and K tile), the MMA fragments of their stages, the partitions of D and of its
        coordinates, and the accumulator layout (all its TMEM stages).  Returns (tile_mn, k_tiles,
        thr_mma, tCgC, tCcC, tAsA, tAgA, tBsB, tBgB, tCrA, tCrB, tCtAcc_fake)."""
        gA, gB, tile_mn, gC, cC, k_tiles = self._tiles(mA, mB, mC_tma, mC)
        thr_mma = tiled_mma.get_slice(0)
        tCgC = thr_mma.partition_C(gC)
        tCcC = thr_mma.partition_C(cC)
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 3),
                                           cute.group_modes(thr_mma.partition_A(gA), 0, 3))
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 3),
                                           cute.group_modes(thr_mma.partition_B(gB), 0, 3))
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))
        return tile_mn, k_tiles, thr_mma, tCgC, tCcC, tAsA, tAgA, tBsB, tBgB, tCrA, tCrB, tCtAcc_fake

    @cute.jit
    def _tma_warp_1cta(self, warp_idx, work, sched, ab_producer, k_tiles, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB):
        """The TMA warp of a 1-CTA, cluster 1x1 kernel: per tile and K tile, A's and B's tiles into
        the next stage of the A/B ring.  Returns the work tile, the scheduler and the ring's producer
        as the loop leaves them (the kernel goes on with these, as with a loop of its own)."""
        if warp_idx == self.tma_warp_id:
            while work.is_valid_tile:
                tc = work.tile_idx
                tAgA_t = tAgA[None, tc[0], None, tc[2]]
                tBgB_t = tBgB[None, tc[1], None, tc[2]]
                ab_producer.reset()
                peek = ab_producer.try_acquire()
                for k in cutlass.range(0, k_tiles, 1, unroll=1):
                    h = ab_producer.acquire_and_advance(peek)
                    cute.copy(tma_a, tAgA_t[None, h.count], tAsA[None, h.index], tma_bar_ptr=h.barrier)
                    cute.copy(tma_b, tBgB_t[None, h.count], tBsB[None, h.index], tma_bar_ptr=h.barrier)
                    peek = cutlass.Boolean(1)
                    if h.count + 1 < k_tiles:
                        peek = ab_producer.try_acquire()
                sched.advance_to_next_work()
                work = sched.get_current_work()
            ab_producer.tail()
        return work, sched, ab_producer

    def _operand_types(self, a, b, c, inputs):
        """Trace time: the operands' and D's element types and layouts, the epilogue inputs' widths."""
        self.a_dtype = a.element_type
        self.b_dtype = b.element_type
        self.c_dtype = c.element_type
        self.a_major = utils.LayoutEnum.from_tensor(a).mma_major_mode()
        self.b_major = utils.LayoutEnum.from_tensor(b).mma_major_mode()
        self.c_layout = utils.LayoutEnum.from_tensor(c)
        self.input_widths = tuple(t.element_type.width for t in inputs)

    def _tma_atoms_1cta(self, tiled_mma, a, b, c, max_active_clusters):
        """Trace time, a 1-CTA cluster-1x1 kernel: the TMA atoms (and coordinate tensors) of A's and
        B's stages and of D's staging buffer, the bytes one stage's loads bring, and the persistent
        scheduler's parameters and grid.  Returns (tma_a, gA, tma_b, gB, tma_c, gC, sched, grid)."""
        a_smem = cute.slice_(self.a_smem_staged, (None, None, None, 0))
        b_smem = cute.slice_(self.b_smem_staged, (None, None, None, 0))
        tma_a, gA = cute.nvgpu.make_tiled_tma_atom_A(
            sm100_utils.cluster_shape_to_tma_atom_A((1, 1), tiled_mma.thr_id), a, a_smem, self.mma_tiler, tiled_mma,
            self.cluster_layout_vmnk.shape)
        tma_b, gB = cute.nvgpu.make_tiled_tma_atom_B(
            sm100_utils.cluster_shape_to_tma_atom_B((1, 1), tiled_mma.thr_id), b, b_smem, self.mma_tiler, tiled_mma,
            self.cluster_layout_vmnk.shape)
        self.num_tma_load_bytes = cute.size_in_bytes(self.a_dtype, a_smem) + cute.size_in_bytes(self.b_dtype, b_smem)
        tma_c, gC = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), c,
                                                cute.select(self.c_smem_staged, mode=[0, 1]), self.epi_tile)
        ntiles = cute.zipped_divide(c, tiler=cute.slice_(self.cta_tile_shape_mnk, (None, None, 0)))[
            0, (None, None, None)].shape
        sched = utils.PersistentTileSchedulerParams(ntiles, (1, 1, 1))
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, max_active_clusters)
        return tma_a, gA, tma_b, gB, tma_c, gC, sched, grid

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, auxes, inputs, scalars,
                 max_active_clusters: cutlass.Int32, stream, b2s=()):
        self._operand_types(a, b, c, inputs)
        # `auxes`: the auxiliary outputs, then the reduction outputs
        self.num_aux = len(auxes) - len(self.reductions)
        reds = tuple(auxes[self.num_aux:])
        auxes = tuple(auxes[:self.num_aux])
        tiled_mma = self._tiled_mma()
        self._setup()
        # full-tensor epilogue inputs (residuals) are loaded per epilogue sub-tile by TMA
        full_atoms, full_tmas = [], []
        for j, kind in enumerate(self.input_kinds):
            if cutlass.const_expr(kind == "full"):
                atom, t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), inputs[j],
                                                      self._in_layout(), self.epi_tile)
                full_atoms.append(atom)
                full_tmas.append(t)
        v = cute.size(tiled_mma.thr_id.shape)
        tf32 = cutlass.TFloat32 if a.element_type is cutlass.Float32 else None
        a_smem = cute.slice_(self.a_smem_staged, (None, None, None, 0))
        b_smem = cute.slice_(self.b_smem_staged, (None, None, None, 0))
        tma_a, gA = cute.nvgpu.make_tiled_tma_atom_A(
            sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_shape_mn, tiled_mma.thr_id), a, a_smem,
            self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape, internal_type=tf32)
        tma_b, gB = cute.nvgpu.make_tiled_tma_atom_B(
            sm100_utils.cluster_shape_to_tma_atom_B(self.cluster_shape_mn, tiled_mma.thr_id), b, b_smem,
            self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape, internal_type=tf32)
        # a dual GEMM's second B operand: the same tiles, loaded beside B into its own stage ring
        b2_loads = [cute.nvgpu.make_tiled_tma_atom_B(
            sm100_utils.cluster_shape_to_tma_atom_B(self.cluster_shape_mn, tiled_mma.thr_id), x, b_smem,
            self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape, internal_type=tf32) for x in b2s]
        self.num_tma_load_bytes = (cute.size_in_bytes(self.a_dtype, a_smem)
                                   + cute.size_in_bytes(self.b_dtype, b_smem) * (1 + len(b2s))) * v
        sb = self.smem_budget
        sync.check_count("sm_100a A/B ring, full barrier transaction bytes", self.num_tma_load_bytes,
                         sync.ab_stage_tx_bytes(sb.a_tile_bytes, sb.b_tile_bytes, 1 + len(b2s), self.use_2cta_instrs),
                         f"(A {sb.a_tile_bytes} B + {1 + len(b2s)} x B {sb.b_tile_bytes} B) x {v} CTA(s) per MMA")
        aux_atoms, aux_tmas = [], []
        for x in auxes:
            atom, t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), x,
                                                  cute.select(self.c_smem_staged, mode=[0, 1]), self.epi_tile)
            aux_atoms.append(atom)
            aux_tmas.append(t)
        tma_c, gC = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), c,
                                                cute.select(self.c_smem_staged, mode=[0, 1]), self.epi_tile)
        ntiles = cute.zipped_divide(c, tiler=cute.slice_(self.cta_tile_shape_mnk, (None, None, 0)))[
            0, (None, None, None)].shape
        sched = utils.PersistentTileSchedulerParams(ntiles, (*self.cluster_shape_mn, 1))
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, max_active_clusters)
        self.kernel(tiled_mma, tma_a, gA, tma_b, gB, tma_c, gC, c, tuple(aux_atoms), tuple(aux_tmas), reds, inputs,
                    tuple(full_atoms), tuple(full_tmas),
                    scalars, tuple(x[0] for x in b2_loads), tuple(x[1] for x in b2_loads), self.cluster_layout_vmnk,
                    self.a_smem_staged, self.b_smem_staged, self.c_smem_staged, self.epi_tile, sched).launch(
            grid=grid, block=[self.threads_per_cta, 1, 1], cluster=(*self.cluster_shape_mn, 1), stream=stream)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
               mB: cute.Tensor, tma_c: cute.CopyAtom, mC_tma: cute.Tensor, mC: cute.Tensor, aux_atoms, aux_tmas,
               reds, inputs, full_atoms,
               full_tmas, scalars, b2_atoms, b2_tmas,
               cluster_layout_vmnk: cute.Layout, a_smem_staged: cute.ComposedLayout,
               b_smem_staged: cute.ComposedLayout, c_smem_staged: cute.ComposedLayout, epi_tile: cute.Tile,
               sched_params: utils.PersistentTileSchedulerParams):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        self._prefetch_descriptors(warp_idx, tma_a, tma_b, tma_c)
        use_2cta = cute.size(tiled_mma.thr_id.shape) == 2
        v = cute.size(tiled_mma.thr_id.shape)
        bidx, _, _ = cute.arch.block_idx()
        mma_v = bidx % v
        is_leader = mma_v == 0
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        crd_vmnk = cluster_layout_vmnk.get_flat_coord(cta_rank)
        tidx, _, _ = cute.arch.thread_idx()

        # arrive counts, checked against the ones derived from the warp roles and the cluster routing
        shape = sync.cluster_vmn(self.cluster_shape_mn, self.use_2cta_instrs)
        cl = f"cluster {self.cluster_shape_mn[0]}x{self.cluster_shape_mn[1]}{' 2-CTA' if self.use_2cta_instrs else ''}"
        ab_empty = sync.check_count(
            "sm_100a A/B ring, empty barrier arrive count",
            sync.sm100_ab_empty_arrivals(self.cluster_shape_mn, self.use_2cta_instrs),
            sync.routed_arrivals(shape, sync.sm100_ab_empty_routes(shape), warps=1),
            f"one tcgen05.commit from each MMA leader whose multicast reaches the barrier's CTA ({cl})")
        acc_empty = sync.check_count(
            "sm_100a accumulator ring, empty barrier arrive count", sync.sm100_acc_empty_arrivals(self.use_2cta_instrs),
            sync.routed_arrivals(shape, sync.to_pair_leader_routes(shape), warps=len(self.epilogue_warp_id)),
            f"{len(self.epilogue_warp_id)} epilogue warps x 1 elected lane x the CTAs of the MMA releasing in its leader ({cl})")
        sync.check_count("sm_100a A/B ring, full barrier arrive count", sync.AB_FULL_ARRIVALS,
                         sync.routed_arrivals(shape, sync.local_routes(shape, leaders_only=True), warps=1),
                         "1 elected lane of the MMA leader's TMA warp")
        sync.check_count("sm_100a accumulator ring, full barrier arrive count", sync.ACC_FULL_ARRIVALS,
                         sync.routed_arrivals(shape, sync.acc_full_routes(shape), warps=1),
                         "1 tcgen05.commit of the MMA leader, to each CTA of the MMA")

        smem = utils.SmemAllocator()
        storage = smem.allocate(self._shared_storage())
        ab_pipe, acc_pipe, tmem = self._pipelines(storage, cluster_layout_vmnk, ab_consumers=ab_empty,
                                                  acc_consumers=acc_empty, two_cta=use_2cta)
        ab_producer, ab_consumer = ab_pipe.make_participants()

        sA = smem.allocate_tensor(element_type=self.a_dtype, layout=a_smem_staged.outer, byte_alignment=128,
                                  swizzle=a_smem_staged.inner)
        sB = smem.allocate_tensor(element_type=self.b_dtype, layout=b_smem_staged.outer, byte_alignment=128,
                                  swizzle=b_smem_staged.inner)
        sB2 = [smem.allocate_tensor(element_type=self.b_dtype, layout=b_smem_staged.outer, byte_alignment=128,
                                    swizzle=b_smem_staged.inner) for _ in b2_atoms]
        a_mask = None
        b_mask = None
        if cutlass.const_expr(self.num_mcast_a > 1 or self.num_mcast_b > 1 or self.use_2cta_instrs):
            a_mask = cpasync.create_tma_multicast_mask(cluster_layout_vmnk, crd_vmnk, mcast_mode=2)
            b_mask = cpasync.create_tma_multicast_mask(cluster_layout_vmnk, crd_vmnk, mcast_mode=1)
        gA, gB, tile_mn, gC, cC, k_tiles = self._tiles(mA, mB, mC_tma, mC)
        thr_mma = tiled_mma.get_slice(mma_v)
        tCgA = thr_mma.partition_A(gA)
        tCgB = thr_mma.partition_B(gB)
        tCgC = thr_mma.partition_C(gC)
        tCcC = thr_mma.partition_C(cC)
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, crd_vmnk[2], cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, 0, None, 0)).shape),
            cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3))
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, crd_vmnk[1], cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, None, 0, 0)).shape),
            cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3))
        b2_part = [cpasync.tma_partition(
            b2_atoms[x], crd_vmnk[1], cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, None, 0, 0)).shape),
            cute.group_modes(sB2[x], 0, 3),
            cute.group_modes(thr_mma.partition_B(cute.local_tile(
                b2_tmas[x], cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))), 0, 3))
            for x in range(len(b2_atoms))]
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        tCrB2 = [tiled_mma.make_fragment_B(x) for x in sB2]
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage * (1 + len(b2_atoms))))
        pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)

        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                           cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        if warp_idx == self.tma_warp_id:
            while work.is_valid_tile:
                tc = work.tile_idx
                mt = (tc[0] // v, tc[1], tc[2])
                tAgA_t = tAgA[None, mt[0], None, mt[2]]
                tBgB_t = tBgB[None, mt[1], None, mt[2]]
                ab_producer.reset()
                peek = ab_producer.try_acquire()
                for k in cutlass.range(0, k_tiles, 1, unroll=1):
                    h = ab_producer.acquire_and_advance(peek)
                    cute.copy(tma_a, tAgA_t[None, h.count], tAsA[None, h.index], tma_bar_ptr=h.barrier,
                              mcast_mask=a_mask)
                    cute.copy(tma_b, tBgB_t[None, h.count], tBsB[None, h.index], tma_bar_ptr=h.barrier,
                              mcast_mask=b_mask)
                    for x in cutlass.range_constexpr(len(b2_atoms)):
                        cute.copy(b2_atoms[x], b2_part[x][1][None, mt[1], None, mt[2]][None, h.count],
                                  b2_part[x][0][None, h.index], tma_bar_ptr=h.barrier, mcast_mask=b_mask)
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
                tCtAcc = tCtAcc_base[None, None, None, acc_prod.index]
                tCtAcc2 = [tCtAcc_base[None, None, None, acc_prod.index + self.num_acc_stage] for _ in b2_atoms]
                ab_consumer.reset()
                peek = cutlass.Boolean(1)
                if is_leader:
                    peek = ab_consumer.try_wait()
                    acc_pipe.producer_acquire(acc_prod)
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for k in range(k_tiles):
                    if is_leader:
                        h = ab_consumer.wait_and_advance(peek)
                        for kb in cutlass.range(cute.size(tCrA, mode=[2]), unroll_full=True):
                            crd = (None, None, kb, h.index)
                            cute.gemm(tiled_mma, tCtAcc, tCrA[crd], tCrB[crd], tCtAcc)
                            for x in cutlass.range_constexpr(len(b2_atoms)):
                                cute.gemm(tiled_mma, tCtAcc2[x], tCrA[crd], tCrB2[x][crd], tCtAcc2[x])
                            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                        h.release()
                        peek = cutlass.Boolean(1)
                        if h.count + 1 < k_tiles:
                            peek = ab_consumer.try_wait()
                if is_leader:
                    acc_pipe.producer_commit(acc_prod)
                acc_prod.advance()
                sched.advance_to_next_work()
                work = sched.get_current_work()
            acc_pipe.producer_tail(acc_prod)

        # the staging buffers of D and the auxiliary outputs, the epilogue inputs' shared memory (and
        # below, the barrier of the full inputs' TMA loads)
        sC, sAux, sIn, n_full, full_bytes = self._epilogue_smem(smem, c_smem_staged, inputs)
        em, en = self.epi_mn
        # reductions: one f32 per MMA-tile row (column), combined into global memory once per tile
        sRed = [smem.allocate_tensor(cutlass.Float32, cute.make_layout((self.mma_tiler[0 if axis != "m" else 1],)), 128)
                for _op, axis in self.reductions]
        in_bar = smem.allocate_array(cutlass.Int64, sync.RESIDUAL_STAGES)
        if warp_idx < self.mma_warp_id:
            if cutlass.const_expr(n_full > 0):
                if tidx == 0:
                    cute.arch.mbarrier_init(in_bar, sync.RESIDUAL_ARRIVALS)
                    cute.arch.mbarrier_init(in_bar + 1, sync.RESIDUAL_ARRIVALS)
                cute.arch.mbarrier_init_fence()
            tmem_ptr, tCtAcc_base, acc_cons, c_pipe, epi_bar = self._epilogue_begin(tmem, tCtAcc_fake)
            # partitions (the same for every tile)
            tCgC_t = transform_partitioned_tensor_layout(tCgC)
            tCcC_t = transform_partitioned_tensor_layout(tCcC)
            copy_t2r, tTR_tAcc_base, tTR_rAcc, tTR_cC_all, copy_r2s, tRS_rC, tRS_sC = self._epilogue_copies(
                tidx, tCtAcc_base, tCgC_t, tCcC_t, sC, epi_tile, self.use_2cta_instrs)
            tRS_sAux = [copy_r2s.get_slice(tidx).partition_D(x) for x in sAux]
            aux_all = []
            for x in cutlass.range_constexpr(self.num_aux):
                tCgX_t = transform_partitioned_tensor_layout(
                    thr_mma.partition_C(cute.local_tile(aux_tmas[x], tile_mn, (None, None, None))))
                aux_all.append(cpasync.tma_partition(
                    aux_atoms[x], 0, cute.make_layout(1), cute.group_modes(sAux[x], 0, 2),
                    cute.group_modes(cute.flat_divide(tCgX_t, epi_tile), 0, 2)))
            bSG_sC, bSG_gC_all = cpasync.tma_partition(
                tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                cute.group_modes(cute.flat_divide(tCgC_t, epi_tile), 0, 2))
            rIn = [cute.make_rmem_tensor(tTR_rAcc.shape, self.epi_dtype) for _ in self.input_kinds]
            tTR_rAcc2 = [cute.make_rmem_tensor(tTR_rAcc.shape, self.acc_dtype) for _ in b2_atoms]
            # the sub-tile boxes of the output, as coordinates, and the matching TMA sources of full inputs
            cEpi_all = cute.flat_divide(tCcC_t, epi_tile)
            full_src = []
            k = 0
            for j in cutlass.range_constexpr(len(self.input_kinds)):
                if cutlass.const_expr(self.input_kinds[j] == "full"):
                    gR = cute.local_tile(full_tmas[k], tile_mn, (None, None, None))
                    tCgR_t = transform_partitioned_tensor_layout(thr_mma.partition_C(gR))
                    full_src.append(cpasync.tma_partition(
                        full_atoms[k], 0, cute.make_layout(1), cute.group_modes(sIn[j], 0, 2),
                        cute.group_modes(cute.flat_divide(tCgR_t, epi_tile), 0, 2)))
                    k += 1
            n_v = cute.size(tTR_rAcc)
            M, N, L = mC.shape
            plans = []
            if cutlass.const_expr(len(self.reductions) > 0):
                # the static coordinates of each thread's values in one sub-tile (the same partition
                # of an identity tensor over one MMA tile, as the first CTA of an MMA pair: the peer's
                # coordinates differ by a constant)
                cS = cute.flat_divide(transform_partitioned_tensor_layout(
                    tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor(tile_mn))), epi_tile)
                coords = red.static_coords(
                    lambda t: copy_t2r.get_slice(t).partition_D(cS)[(None, None, None, 0, 0)], red.plan_threads(128))
                plans = [red.make_plan(op, axis, coords) for op, axis in self.reductions]
                self.traced.update(red_plans=plans, red_coords=coords)      # for tests
                rRed = cute.make_rmem_tensor(tTR_rAcc.shape, self.epi_dtype)
                for r in cutlass.range_constexpr(len(self.reductions)):
                    red.fill(sRed[r], cute.size(sRed[r]), tidx, 128, plans[r])
                epi_bar.arrive_and_wait()
            while work.is_valid_tile:
                tc = work.tile_idx
                mt = (tc[0] // v, tc[1], tc[2])
                # tiles this CTA finished before this one: read BEFORE advancing (the scheduler
                # counts the current tile inside advance_to_next_work; issue 22 item 1)
                tiles_done = sched.num_tiles_executed
                sched.advance_to_next_work()
                work = sched.get_current_work()
                bSG_gC = bSG_gC_all[(None, None, None, *mt)]
                tTR_cC = tTR_cC_all[(None, None, None, None, None, *mt)]
                tTR_tAcc = tTR_tAcc_base[(None, None, None, None, None, acc_cons.index)]
                acc_pipe.consumer_wait(acc_cons)
                tTR_tAcc = cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))
                tTR_tAcc2 = [tTR_tAcc_base[(None, None, None, None, None, acc_cons.index + self.num_acc_stage)]
                             for _ in b2_atoms]
                tTR_tAcc2 = [cute.group_modes(x, 3, cute.rank(x)) for x in tTR_tAcc2]
                tTR_cC = cute.group_modes(tTR_cC, 3, cute.rank(tTR_cC))
                bSG_gC = cute.group_modes(bSG_gC, 1, cute.rank(bSG_gC))
                aux_dst = []
                for x in cutlass.range_constexpr(self.num_aux):
                    g_aux = aux_all[x][1][(None, None, None, *mt)]
                    aux_dst.append((aux_all[x][0], cute.group_modes(g_aux, 1, cute.rank(g_aux))))
                n_sub = cute.size(tTR_tAcc.shape, mode=[3])
                prev = sync.residual_start(tiles_done, n_sub)
                cEpi = cute.group_modes(cEpi_all[(None, None, None, None, *mt)], 2, 4)
                bIn = []
                for f in cutlass.range_constexpr(n_full):
                    g_tile = full_src[f][1][(None, None, None, *mt)]
                    bIn.append((full_src[f][0], cute.group_modes(g_tile, 1, cute.rank(g_tile))))
                # stage this MMA tile's slices of row/col inputs in shared memory (coalesced)
                m0 = mt[0] * self.mma_tiler[0]
                n0 = mt[1] * self.mma_tiler[1]
                if cutlass.const_expr(n_full < len(self.input_kinds)):
                    self._stage_vectors(sIn, inputs, tidx, m0, n0, M, N, mt[2])
                    epi_bar.arrive_and_wait()
                # full inputs: sub-tile g (counted over the CTA's whole run) lives in buffer g % 2 and
                # completes phase (g // 2) % 2 of barrier g % 2; sub-tile g + 1 is loaded during g
                if cutlass.const_expr(n_full > 0):
                    if warp_idx == self.epilogue_warp_id[0]:
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(in_bar + sync.ring_index(prev, sync.RESIDUAL_STAGES), full_bytes)
                        for f in cutlass.range_constexpr(n_full):
                            cute.copy(full_atoms[f], bIn[f][1][(None, 0)], bIn[f][0][(None, sync.ring_index(prev, sync.RESIDUAL_STAGES))],
                                      tma_bar_ptr=in_bar + sync.ring_index(prev, sync.RESIDUAL_STAGES))
                for s in cutlass.range_constexpr(n_sub):        # unrolled: each sub-tile's TMEM load overlaps the previous store
                    g = prev + s
                    if cutlass.const_expr(n_full > 0):
                        if warp_idx == self.epilogue_warp_id[0]:
                            if s + 1 < n_sub:
                                with cute.arch.elect_one():
                                    cute.arch.mbarrier_arrive_and_expect_tx(in_bar + sync.ring_index(g + 1, sync.RESIDUAL_STAGES), full_bytes)
                                for f in cutlass.range_constexpr(n_full):
                                    cute.copy(full_atoms[f], bIn[f][1][(None, s + 1)], bIn[f][0][(None, sync.ring_index(g + 1, sync.RESIDUAL_STAGES))],
                                              tma_bar_ptr=in_bar + sync.ring_index(g + 1, sync.RESIDUAL_STAGES))
                    cute.copy(copy_t2r, tTR_tAcc[(None, None, None, s)], tTR_rAcc)
                    for x in cutlass.range_constexpr(len(b2_atoms)):
                        cute.copy(copy_t2r, tTR_tAcc2[x][(None, None, None, s)], tTR_rAcc2[x])
                    if cutlass.const_expr(len(self.input_kinds) > 0):
                        tTR_cC_s = tTR_cC[(None, None, None, s)]
                        sm0, sn0, _ = cEpi[(0, 0, s)]             # the sub-tile's origin
                        if cutlass.const_expr(n_full > 0):
                            cute.arch.mbarrier_wait(in_bar + sync.ring_index(g, sync.RESIDUAL_STAGES), sync.ring_phase(g, sync.RESIDUAL_STAGES))
                        self._gather_inputs(rIn, sIn, tTR_cC_s, n_v, m0, n0,
                                            (sm0, sn0, sync.ring_index(g, sync.RESIDUAL_STAGES)))
                    values = self.epi_fn(copy_r2s.retile(tTR_rAcc).load(),
                                         tuple(copy_r2s.retile(r).load() for r in rIn), scalars,
                                         *(copy_r2s.retile(r).load() for r in tTR_rAcc2))
                    for r in cutlass.range_constexpr(len(self.reductions)):
                        copy_r2s.retile(rRed).store(values[1 + self.num_aux + r])
                        red.reduce_subtile(rRed, tTR_cC[(None, None, None, s)], 0, 0, M, N,
                                           m0 if self.reductions[r][1] != "m" else n0, sRed[r], plans[r])
                    self._store_subtile(values, prev + s, s, copy_r2s, tRS_rC, tRS_sC, epi_bar, warp_idx, tma_c,
                                        bSG_sC, bSG_gC, c_pipe, tRS_sAux, aux_atoms, aux_dst)
                epi_bar.arrive_and_wait()
                with cute.arch.elect_one():
                    acc_pipe.consumer_release(acc_cons)
                acc_cons.advance()
                if cutlass.const_expr(len(self.reductions) > 0):
                    # the accumulator is released first: the MMA warp need not wait for the flush
                    for r in cutlass.range_constexpr(len(self.reductions)):
                        along_n = self.reductions[r][1] != "m"
                        red.flush(sRed[r], cute.size(sRed[r]), tidx, 128, m0 if along_n else n0,
                                  M if along_n else N, reds[r], mt[2], plans[r])
                    epi_bar.arrive_and_wait()
            self._epilogue_end(c_pipe, tmem, tmem_ptr)
