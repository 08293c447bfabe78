"""kspec's Hopper (sm_90a) GEMM kernel on the CuTe DSL: TMA loads into a multi-stage shared-memory
ring, WGMMA on one or two consumer warpgroups, one producer warp (warp specialization), a static
persistent tile scheduler, and a fused epilogue that writes D through shared memory and a TMA store.

Built only from the DSL wheel's building blocks (pipelines, tile scheduler, MMA/copy atoms,
`cutlass.utils.hopper_helpers`).  The epilogue math is a generated function (`epilogue.py`):
`epi(acc, inputs, scalars) -> value` on register vectors (TensorSSA) in f32/i32.

Tensors (all rank 3, runtime extents and strides): A (M, K, L), B (N, K, L), D (M, N, L);
epilogue inputs: kind "row" (N,), "col" (M,), "row_batched" (N, L), "col_batched" (M, L), "full" (M, N, L);
outputs after D: the auxiliary outputs (like D), then the reduction outputs ((M, L) or (N, L), see reduce.py).
The grouped kernel (sm90_grouped.py) shares Sm90Gemm's shared-memory struct, the consumer warpgroups'
start, epilogue copies, barrier, store ring and sub-tile stores (its methods).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
import cutlass._mlir.dialects.cute_nvgpu as _cute_nvgpu_ir
from cutlass.cute.atom import make_atom
from cutlass.cute.core import _pack_shape
from cutlass.cute.nvgpu.warpgroup import OperandSource
from cutlass.cute.nvgpu.warpgroup.mma import MmaF16BF16Trait, MmaOp
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from kspec.backends.cute.epilogue import COL_KINDS, ROW_KINDS
from kspec.core import KspecInternalError

from . import blockscale as bsc
from . import reduce as red
from . import sync


def _cooperative_budget(budget, tile_mn, d_bits: int):
    """The shared-memory split with the cooperative (two-warpgroup) epilogue sub-tile, for a tile the
    planner's rule keeps on one warpgroup but block scales split (blockscale.py)."""
    import dataclasses
    tm, tn = tile_mn
    epi = (min(128, tm), min(32, tn))
    epi_bytes = budget.epi_bytes // (budget.epi_tile[0] * budget.epi_tile[1]) * epi[0] * epi[1]
    fit = (sync.SMEM_CAPACITY - sync.SMEM_RESERVED["sm90a"] - epi_bytes - budget.in_bytes) // budget.ab_stage_bytes
    return dataclasses.replace(budget, epi_tile=epi, epi_bytes=epi_bytes, fit=fit)


class _Tf32WgmmaOp(MmaOp):
    """WGMMA with tf32 operands (`wgmma.mma_async...f32.tf32.tf32`, K = 8 per instruction), which the
    DSL wheel's warpgroup module does not wrap (it has f16/bf16, fp8 and int8 ops).  PTX allows
    tf32 operands only K-major (no transpose for 32-bit types), both from shared memory here."""

    descriptive_name = "warpgroup TF32 MMA Operation (kspec)"

    def __init__(self, shape_mn, a_major_mode, b_major_mode):
        super().__init__(cutlass.TFloat32, cutlass.TFloat32, cutlass.Float32, (*shape_mn, 8),
                         OperandSource.SMEM, a_major_mode, b_major_mode)
        K = cute.nvgpu.OperandMajorMode.K
        if a_major_mode != K or b_major_mode != K:
            raise KspecInternalError("tf32 WGMMA needs K-major A and B (gemm.can_implement checks this)")

    def _make_trait(self, *, loc=None, ip=None, **kwargs):
        ty = _cute_nvgpu_ir.MmaAtomSM90Type.get(
            _pack_shape(self.shape_mnk, loc=loc, ip=ip).type.attribute, self.a_major_mode._to_ir(),
            self.b_major_mode._to_ir(), self.a_dtype.mlir_type, self.b_dtype.mlir_type, self.acc_dtype.mlir_type,
            self.a_src._to_ir())
        return MmaF16BF16Trait(make_atom(ty, [cutlass.Boolean(False).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip))


class Sm90Gemm:
    """One configuration of the kernel.  tile_mn: CTA tile (M in 64/128, N in 64..256);
    cluster_mn: cluster shape (TMA multicast of A along N, of B along M)."""

    def __init__(self, acc_dtype, tile_mn, cluster_mn, epi_fn, input_kinds, num_scalars, stages=None,
                 reductions=(), dual=False, epi_dtype=None, scales=()):
        self.acc_dtype = acc_dtype
        # the epilogue's arithmetic type: the accumulator's, or f32 for a float epilogue on an i32
        # accumulator (the generated function converts the accumulator; inputs are staged as f32)
        self.epi_dtype = acc_dtype if epi_dtype is None else epi_dtype
        self.tile_shape_mnk = (tile_mn[0], tile_mn[1], 1)
        self.cluster_shape_mn = tuple(cluster_mn)
        self.epi_fn = epi_fn
        self.input_kinds = tuple(input_kinds)
        self.num_scalars = num_scalars
        self.stages_override = stages
        self.reductions = tuple(reductions)          # (op, axis) per reduced value (reduce.py)
        self.traced = {}                             # trace-time facts (tests)
        # a dual GEMM (a second B operand sharing the A tiles, a second register accumulator)
        self.dual = dual
        # two consumer warpgroups share an M=128 tile when N is wide ("cooperative"), and in a dual
        # GEMM (each holds half of both accumulators)
        # block scales (blockscale.py): (operand, block_mn, order) per scale tensor; the promotion
        # keeps a second register accumulator, so 128-row tiles are split over two warpgroups
        self.scales = tuple(scales)
        coop = sync.sm90_cooperative(tile_mn, dual) or (bool(self.scales) and tile_mn[0] > 64)
        self.atom_layout_mnk = (2, 1, 1) if coop else (1, 1, 1)
        self.num_mma_warp_groups = math.prod(self.atom_layout_mnk)
        self.threads_per_wg = 128
        self.threads_per_cta = (1 + self.num_mma_warp_groups) * self.threads_per_wg
        self.num_mma_threads = self.num_mma_warp_groups * self.threads_per_wg
        self.load_warp_id = 0
        self.epi_store_warp_id = 4
        self.load_regs = 40
        self.mma_regs = 232
        self.buffer_align_bytes = 1024

    def _vector_coord(self, j, i, batch):
        """The coordinate of element i of epilogue vector input j in the tile's batch entry: vectors
        shared by the batch are (N,)/(M,), per-batch vectors (N, L)/(M, L)."""
        return (i, batch) if self.input_kinds[j].endswith("_batched") else i

    # ------------------------------------------------------------------ host-side planning
    def _setup(self):
        if self.a_dtype is cutlass.TFloat32:
            self.tiled_mma = cute.make_tiled_mma(cute.make_mma_atom(_Tf32WgmmaOp(
                (64, self.tile_shape_mnk[1]), self.a_layout.sm90_mma_major_mode(),
                self.b_layout.sm90_mma_major_mode())), self.atom_layout_mnk)
        else:
            self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.a_dtype, self.b_dtype, self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
                self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.tile_shape_mnk[1]))
        k_inst = cute.size(self.tiled_mma.shape_mnk, mode=[2])
        self.tile_shape_mnk = (self.tile_shape_mnk[0], self.tile_shape_mnk[1], k_inst * 4)
        self.cta_layout_mnk = cute.make_layout((*self.cluster_shape_mn, 1))
        self.num_mcast_a = self.cluster_shape_mn[1]
        self.num_mcast_b = self.cluster_shape_mn[0]
        tm, tn, tk = self.tile_shape_mnk
        # the shared-memory split and the A/B stage count: the planner computes the same (sync.py)
        self.smem_budget = sync.smem_budget(
            "sm90a", (tm, tn), a_bits=self.a_dtype.width, b_bits=self.b_dtype.width, d_bits=self.d_dtype.width,
            dual=self.dual, num_aux=self.num_aux,
            inputs=tuple(("row" if k in ROW_KINDS else "col" if k in COL_KINDS else "full", w)
                         for k, w in zip(self.input_kinds, self.input_widths)),
            reductions=tuple("n" if axis == "mn" else axis for _op, axis in self.reductions),
            override=self.stages_override)
        if tk != sync.k_tile(self.a_dtype.width):
            raise KspecInternalError(f"sm_90a tile K {tk} != sync.k_tile {sync.k_tile(self.a_dtype.width)}")
        if self.atom_layout_mnk == (2, 1, 1) and not sync.sm90_cooperative((tm, tn), self.dual):
            # block scales split a 128-row tile over two warpgroups: the cooperative epilogue sub-tile
            self.smem_budget = _cooperative_budget(self.smem_budget, (tm, tn), self.d_dtype.width)
        self.epi_tile = self.smem_budget.epi_tile
        self.epi_stage = sync.EPI_STORE_STAGES["sm90a"]
        why = self.smem_budget.problem()
        if why:
            raise KspecInternalError(f"sm_90a GEMM tile {tm}x{tn}: {why} (the planner refuses this configuration)")
        self.ab_stage = self.smem_budget.stages
        a_major_k = self.a_layout.sm90_mma_major_mode() == cute.nvgpu.warpgroup.OperandMajorMode.K
        b_major_k = self.b_layout.sm90_mma_major_mode() == cute.nvgpu.warpgroup.OperandMajorMode.K
        a_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(self.a_layout, self.a_dtype, tk if a_major_k else tm), self.a_dtype)
        self.a_smem_staged = cute.tile_to_shape(a_atom, (tm, tk, self.ab_stage),
                                                order=(0, 1, 2) if a_major_k else (1, 0, 2))
        b_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(self.b_layout, self.b_dtype, tk if b_major_k else tn), self.b_dtype)
        self.b_smem_staged = cute.tile_to_shape(b_atom, (tn, tk, self.ab_stage),
                                                order=(0, 1, 2) if b_major_k else (1, 0, 2))
        d_major = self.epi_tile[1] if self.d_layout.is_n_major_c() else self.epi_tile[0]
        d_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(self.d_layout, self.d_dtype, d_major), self.d_dtype)
        self.d_smem_staged = cute.tile_to_shape(d_atom, (*self.epi_tile, self.epi_stage),
                                                order=(1, 0, 2) if self.d_layout.is_m_major_c() else (0, 1, 2))

    def _tma_load(self, tensor, smem_staged, tile, mcast):
        op = (cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp() if mcast == 1
              else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp())
        # f32 data multiplied at tf32 precision: shared memory holds it as tf32 (the same bits)
        internal = cutlass.TFloat32 if self.a_dtype is cutlass.TFloat32 else None
        return cute.nvgpu.cpasync.make_tiled_tma_atom(op, tensor, cute.slice_(smem_staged, (None, None, 0)), tile,
                                                      num_multicast=mcast, internal_type=internal)

    def _shared_storage(self):
        """The kernel's shared-memory struct: the A/B ring's full and empty barriers, the A and B
        stages, D's staging buffers."""
        fields = {"bars": cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2],
                  "sA": cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_staged)],
                                          self.buffer_align_bytes],
                  "sB": cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_staged)],
                                          self.buffer_align_bytes],
                  "sD": cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(self.d_smem_staged)],
                                          self.buffer_align_bytes]}
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def _consumer_begin(self, sched_params, tCrA):
        """The consumer warpgroups' start: raise their register budget, their tile scheduler and
        first work tile, the A/B ring's read and release states, the MMA K blocks of a stage.
        Returns (sched, work, read, release, k_blocks)."""
        cute.arch.setmaxregister_increase(self.mma_regs)
        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        k_blocks = cute.size(tCrA, mode=[2])
        return sched, work, read, release, k_blocks

    def _epilogue_copies(self, tiled_mma, epi_tidx, sD, acc):
        """The consumer warpgroups' epilogue copy, registers -> shared memory (stmatrix), with this
        thread's partition of the staging buffers and of the accumulator, and the register
        fragments of one sub-tile (accumulator type and D's).  Returns (copy_r2s, thr_r2s, tRS_sD,
        tRS_rAcc, rD_shape, tRS_rD, tRS_rOut)."""
        atom_r2s = sm90_utils.sm90_get_smem_store_op(self.d_layout, elem_ty_d=self.d_dtype,
                                                     elem_ty_acc=self.acc_dtype)
        atom_d = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.d_layout.is_m_major_c(), 4),
                                     self.d_dtype)
        copy_r2s = cute.make_tiled_copy_S(atom_r2s, cute.make_tiled_copy_C_atom(atom_d, tiled_mma))
        thr_r2s = copy_r2s.get_slice(epi_tidx)
        tRS_sD = thr_r2s.partition_D(sD)
        tRS_rAcc = copy_r2s.retile(acc)
        rD_shape = cute.shape(thr_r2s.partition_S(sD))[:3]
        tRS_rD = cute.make_rmem_tensor(rD_shape, self.acc_dtype)
        tRS_rOut = cute.make_rmem_tensor(rD_shape, self.d_dtype)
        return copy_r2s, thr_r2s, tRS_sD, tRS_rAcc, rD_shape, tRS_rD, tRS_rOut

    def _epilogue_sync(self):
        """The consumer warpgroups' named barrier and the TMA store ring of D's staging buffers."""
        epi_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads))
        return epi_bar, store_pipe

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, d: cute.Tensor, auxes, inputs, scalars,
                 max_active_clusters: cutlass.Int32, stream, b2s=(), scale_ts=()):
        # kspec's tf32 operands are f32 in memory, multiplied as tf32
        self.a_dtype = cutlass.TFloat32 if a.element_type is cutlass.Float32 else a.element_type
        self.b_dtype = cutlass.TFloat32 if b.element_type is cutlass.Float32 else b.element_type
        self.d_dtype = d.element_type
        self.a_layout = utils.LayoutEnum.from_tensor(a)
        self.b_layout = utils.LayoutEnum.from_tensor(b)
        self.d_layout = utils.LayoutEnum.from_tensor(d)
        self.input_widths = tuple(t.element_type.width for t in inputs)
        # `auxes`: the auxiliary outputs, then the reduction outputs
        self.num_aux = len(auxes) - len(self.reductions)
        reds = tuple(auxes[self.num_aux:])
        auxes = tuple(auxes[:self.num_aux])
        self._setup()
        tm, tn, tk = self.tile_shape_mnk
        # full-tensor epilogue inputs (residuals) are loaded per epilogue sub-tile by TMA
        in_layout = cute.make_layout(self.epi_tile, stride=(self.epi_tile[1], 1))
        full_atoms, full_tmas = [], []
        for j, kind in enumerate(self.input_kinds):
            if cutlass.const_expr(kind == "full"):
                atom, t = cute.nvgpu.cpasync.make_tiled_tma_atom(
                    cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), inputs[j], in_layout, self.epi_tile)
                full_atoms.append(atom)
                full_tmas.append(t)
        tma_a, gA = self._tma_load(a, self.a_smem_staged, (tm, tk), self.cluster_shape_mn[1])
        tma_b, gB = self._tma_load(b, self.b_smem_staged, (tn, tk), self.cluster_shape_mn[0])
        # a dual GEMM's second B operand: the same tiles, loaded beside B into its own stage ring
        b2_loads = [self._tma_load(x, self.b_smem_staged, (tn, tk), self.cluster_shape_mn[0]) for x in b2s]
        tma_d, gD = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), d, cute.slice_(self.d_smem_staged, (None, None, 0)),
            self.epi_tile)
        aux_atoms, aux_tmas = [], []
        for x in auxes:
            atom, t = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), x, cute.slice_(self.d_smem_staged, (None, None, 0)),
                self.epi_tile)
            aux_atoms.append(atom)
            aux_tmas.append(t)
        ntiles = cute.zipped_divide(d, tiler=(tm, tn))[0, (None, None, None)].shape
        sched = utils.PersistentTileSchedulerParams(ntiles, (*self.cluster_shape_mn, 1))
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, max_active_clusters)

        self.shared_storage = self._shared_storage()
        self.kernel(tma_a, gA, tma_b, gB, tma_d, gD, d, tuple(aux_atoms), tuple(aux_tmas), reds, inputs,
                    tuple(full_atoms), tuple(full_tmas), scalars, tuple(x[0] for x in b2_loads),
                    tuple(x[1] for x in b2_loads),
                    self.tiled_mma, self.cta_layout_mnk,
                    self.a_smem_staged, self.b_smem_staged, self.d_smem_staged, sched, scale_ts).launch(
            grid=grid, block=[self.threads_per_cta, 1, 1], cluster=(*self.cluster_shape_mn, 1),
            min_blocks_per_mp=1, stream=stream)

    @cute.jit
    def _store_subtile(self, values, count, ec, copy_r2s, tRS_rOut, tRS_sD, epi_bar, warp_idx, tma_d, bSG_sD,
                       bSG_gD, store_pipe, tRS_sAux=(), aux_atoms=(), aux_dst=()):
        """Store sub-tile ec of a tile: the epilogue's values (D, then the auxiliary outputs) to the
        staging buffer of the `count`-th sub-tile of the store ring, then the store warp's TMA stores
        of it (the consumer warpgroups sync before and after)."""
        tRS_rOut.store(values[0].to(self.d_dtype))
        buf = sync.ring_index(count, self.epi_stage)
        cute.copy(copy_r2s, tRS_rOut, tRS_sD[None, None, None, buf])
        for x in cutlass.range_constexpr(self.num_aux):
            tRS_rOut.store(values[1 + x].to(self.d_dtype))
            cute.copy(copy_r2s, tRS_rOut, tRS_sAux[x][None, None, None, buf])
        cute.arch.fence_proxy("async.shared", space="cta")
        epi_bar.arrive_and_wait()
        if warp_idx == self.epi_store_warp_id:
            cute.copy(tma_d, bSG_sD[None, buf], bSG_gD[None, ec])
            for x in cutlass.range_constexpr(self.num_aux):
                cute.copy(aux_atoms[x], aux_dst[x][0][None, buf], aux_dst[x][1][None, ec])
            store_pipe.producer_commit()
            store_pipe.producer_acquire()
        epi_bar.arrive_and_wait()

    @cute.jit
    def _block_scaled_mainloop(self, tiled_mma, acc, tmp, tRS_rAcc, tRS_rTmp, tCrA, tCrB, ab_pipe, read, k_tiles,
                               k_blocks: cutlass.Constexpr, scale_ts, plan: cutlass.Constexpr, tc, row0, M):
        """One output tile's mainloop with block scales (blockscale.py): per K tile (= scale block),
        tmp = A_kt B_kt on the tensor cores, then acc += tmp * sa[rows, kt] * sb[n block, kt]."""
        tm, tn, _ = self.tile_shape_mnk
        m0 = tc[0] * tm
        n0 = tc[1] * tn
        n_v = cute.size(tRS_rTmp) // len(plan.slot)
        for k in range(k_tiles):
            ab_pipe.consumer_wait(read)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(k_blocks):
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, kb > 0)
                crd = (None, None, kb, read.index)
                cute.gemm(tiled_mma, tmp, tCrA[crd], tCrB[crd], tmp)
            cute.nvgpu.warpgroup.commit_group()
            # the scales of this K block, loaded while the WGMMAs run
            rs, sb = bsc.k_block_scales(self.scales, scale_ts, plan, k, m0, n0, row0, M)
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipe.consumer_release(read)
            read.advance()
            for e in cutlass.range_constexpr(len(plan.slot)):
                for v in cutlass.range_constexpr(n_v):
                    x = e * n_v + v
                    tRS_rAcc[x] = tRS_rAcc[x] + tRS_rTmp[x] * (rs[plan.slot[e][v]] * sb)
        return read

    # ------------------------------------------------------------------ device code
    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_d: cute.CopyAtom, mD_tma: cute.Tensor, mD: cute.Tensor, aux_atoms, aux_tmas, reds, inputs,
               full_atoms, full_tmas, scalars, b2_atoms, b2_tmas,
               tiled_mma: cute.TiledMma, cta_layout_mnk: cute.Layout, a_smem_staged: cute.ComposedLayout,
               b_smem_staged: cute.ComposedLayout, d_smem_staged: cute.ComposedLayout,
               sched_params: utils.PersistentTileSchedulerParams, scale_ts):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_d)
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        a_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1)
        b_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
        a_mask = a_mask if self.num_mcast_a > 1 else 0
        b_mask = b_mask if self.num_mcast_b > 1 else 0
        tx_bytes = (cute.size_in_bytes(self.a_dtype, cute.slice_(a_smem_staged, (None, None, 0)))
                    + cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem_staged, (None, None, 0)))
                    * (1 + len(b2_atoms)))
        sb = self.smem_budget
        sync.check_count("sm_90a A/B ring, full barrier transaction bytes", tx_bytes,
                         sync.ab_stage_tx_bytes(sb.a_tile_bytes, sb.b_tile_bytes, 1 + len(b2_atoms)),
                         f"A {sb.a_tile_bytes} B + {1 + len(b2_atoms)} x B {sb.b_tile_bytes} B")

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tm, tn, _ = self.tile_shape_mnk
        # shared-memory staging of the epilogue inputs and the barrier of their TMA loads
        sIn = []
        n_full = 0
        full_bytes = 0
        for j, kind in enumerate(self.input_kinds):
            if cutlass.const_expr(kind in ROW_KINDS):
                sIn.append(smem.allocate_tensor(self.epi_dtype, cute.make_layout((tn,)), 128))
            elif cutlass.const_expr(kind in COL_KINDS):
                sIn.append(smem.allocate_tensor(self.epi_dtype, cute.make_layout((tm,)), 128))
            else:
                # two sub-tile buffers: the next sub-tile's TMA load overlaps this one's math
                sIn.append(smem.allocate_tensor(inputs[j].element_type, cute.make_layout(
                    (*self.epi_tile, sync.RESIDUAL_STAGES), stride=(self.epi_tile[1], 1, self.epi_tile[0] * self.epi_tile[1])), 128))
                n_full += 1
                full_bytes += self.epi_tile[0] * self.epi_tile[1] * inputs[j].element_type.width // 8
        # reductions: one f32 per tile row (column), combined into global memory once per tile
        sRed = [smem.allocate_tensor(cutlass.Float32, cute.make_layout((tm if axis != "m" else tn,)), 128)
                for _op, axis in self.reductions]
        in_bar = smem.allocate_array(cutlass.Int64, sync.RESIDUAL_STAGES)
        if cutlass.const_expr(n_full > 0):
            if tidx == 0:
                cute.arch.mbarrier_init(in_bar, sync.RESIDUAL_ARRIVALS)
                cute.arch.mbarrier_init(in_bar + 1, sync.RESIDUAL_ARRIVALS)
            cute.arch.mbarrier_init_fence()
        # arrive counts, checked against the ones derived from the warp roles and the cluster routing
        consumers = sync.sm90_ab_empty_arrivals(self.cluster_shape_mn, self.num_mma_warp_groups)
        shape = (1, *self.cluster_shape_mn)
        consumer_warps = (self.threads_per_cta - self.threads_per_wg) // 32      # every MMA warp releases
        sync.check_count("sm_90a A/B ring, empty barrier arrive count", consumers,
                         sync.routed_arrivals(shape, sync.sm90_ab_empty_routes(shape), warps=consumer_warps),
                         f"{consumer_warps} consumer warps x one lane per CTA sharing a multicast row or column "
                         f"with the barrier's CTA (cluster {self.cluster_shape_mn[0]}x{self.cluster_shape_mn[1]})")
        sync.check_count("sm_90a A/B ring, full barrier arrive count", sync.AB_FULL_ARRIVALS,
                         sync.routed_arrivals(shape, sync.local_routes(shape), warps=1),
                         "1 elected lane of the TMA producer warp, in its own CTA")
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(), num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
            tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)), defer_sync=True)
        pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sD = storage.sD.get_tensor(d_smem_staged.outer, swizzle=d_smem_staged.inner)
        sAux = [smem.allocate_tensor(self.d_dtype, d_smem_staged.outer, self.buffer_align_bytes,
                                     d_smem_staged.inner) for _ in range(self.num_aux)]
        sB2 = [smem.allocate_tensor(self.b_dtype, b_smem_staged.outer, self.buffer_align_bytes,
                                    b_smem_staged.inner) for _ in b2_atoms]
        tile_mn = cute.slice_(self.tile_shape_mnk, (None, None, 0))
        gA = cute.local_tile(mA, cute.slice_(self.tile_shape_mnk, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.tile_shape_mnk, (0, None, None)), (None, None, None))
        gD = cute.local_tile(mD_tma, tile_mn, (None, None, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, cluster_coord[1], cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape),
            cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, cluster_coord[0], cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape),
            cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        b2_part = [cute.nvgpu.cpasync.tma_partition(
            b2_atoms[x], cluster_coord[0], cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape),
            cute.group_modes(sB2[x], 0, 2),
            cute.group_modes(cute.local_tile(b2_tmas[x], cute.slice_(self.tile_shape_mnk, (0, None, None)),
                                             (None, None, None)), 0, 2)) for x in range(len(b2_atoms))]

        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        thr_mma = tiled_mma.get_slice(
            cute.make_layout(self.num_mma_warp_groups, stride=self.threads_per_wg)(wg_idx - 1))
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gD).shape[:3], self.acc_dtype)
        tCrB2 = [tiled_mma.make_fragment_B(thr_mma.partition_B(x)) for x in sB2]
        acc2 = [cute.make_rmem_tensor(thr_mma.partition_C(gD).shape[:3], self.acc_dtype) for _ in sB2]
        k_tiles = cute.size(gA, mode=[3])
        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)
        if warp_idx == self.load_warp_id:
            # producer: TMA loads of A and B tiles into the stage ring
            sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                               cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
            while work.is_valid_tile:
                tc = work.tile_idx
                tAgA_t = tAgA[None, tc[0], None, tc[2]]
                tBgB_t = tBgB[None, tc[1], None, tc[2]]
                prod.reset_count()
                for _k in range(k_tiles):
                    ab_pipe.producer_acquire(prod)
                    bar = ab_pipe.producer_get_barrier(prod)
                    cute.copy(tma_a, tAgA_t[None, prod.count], tAsA[None, prod.index], tma_bar_ptr=bar,
                              mcast_mask=a_mask)
                    cute.copy(tma_b, tBgB_t[None, prod.count], tBsB[None, prod.index], tma_bar_ptr=bar,
                              mcast_mask=b_mask)
                    for x in cutlass.range_constexpr(len(b2_atoms)):
                        cute.copy(b2_atoms[x], b2_part[x][1][None, tc[1], None, tc[2]][None, prod.count],
                                  b2_part[x][0][None, prod.index], tma_bar_ptr=bar, mcast_mask=b_mask)
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
            tRS_sAux = [thr_r2s.partition_D(x) for x in sAux]
            tRS_rAcc2 = [copy_r2s.retile(x) for x in acc2]
            tRS_rD2 = [cute.make_rmem_tensor(rD_shape, self.acc_dtype) for _ in acc2]
            rIn = [cute.make_rmem_tensor(rD_shape, self.epi_dtype) for _ in self.input_kinds]
            tRS_cL = thr_r2s.partition_S(cute.make_identity_tensor(self.epi_tile))   # sub-tile-local (m, n)
            n_v = cute.size(tRS_rD)
            epi_bar, store_pipe = self._epilogue_sync()
            M, N, L = mD.shape
            tmp = tRS_rTmp = bs_plan = bs_row0 = None
            if cutlass.const_expr(len(self.scales) > 0):
                # block scales: the K tile's product goes into tmp, then acc += tmp * scales
                tmp = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
                tRS_rTmp = copy_r2s.retile(tmp)
                ident = cute.make_identity_tensor(self.epi_tile)
                bs_plan = bsc.row_plan(lambda t: copy_r2s.get_slice(t).partition_S(ident),
                                       red.plan_threads(self.num_mma_threads), self.epi_tile,
                                       (self.tile_shape_mnk[0] // self.epi_tile[0],
                                        self.tile_shape_mnk[1] // self.epi_tile[1]))
                self.traced.update(bs_plan=bs_plan)                       # for tests
                bs_row0 = tRS_cL[0][0]
            plans = []
            if cutlass.const_expr(len(self.reductions) > 0):
                coords = red.static_coords(lambda t: copy_r2s.get_slice(t).partition_S(
                    cute.make_identity_tensor(self.epi_tile)), red.plan_threads(self.num_mma_threads))
                plans = [red.make_plan(op, axis, coords) for op, axis in self.reductions]
                self.traced.update(red_plans=plans, red_coords=coords)      # for tests
                rRed = cute.make_rmem_tensor(rD_shape, self.epi_dtype)
                for r in cutlass.range_constexpr(len(self.reductions)):
                    red.fill(sRed[r], cute.size(sRed[r]), epi_tidx, self.num_mma_threads, plans[r])
                epi_bar.arrive_and_wait()
            while work.is_valid_tile:
                tc = work.tile_idx
                read.reset_count()
                release.reset_count()
                acc.fill(0)
                for x in cutlass.range_constexpr(len(acc2)):
                    acc2[x].fill(0)
                if cutlass.const_expr(len(self.scales) > 0):
                    # (the pipeline state comes back: a loop in a called function rebinds its own name)
                    read = self._block_scaled_mainloop(tiled_mma, acc, tmp, tRS_rAcc, tRS_rTmp, tCrA, tCrB, ab_pipe,
                                                       read, k_tiles, k_blocks, scale_ts, bs_plan, tc, bs_row0, M)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.fence()
                # keep one WGMMA batch in flight: release a stage only after the next one issued
                for k in range(0 if cutlass.const_expr(len(self.scales) > 0) else k_tiles):
                    ab_pipe.consumer_wait(read)
                    for kb in cutlass.range_constexpr(k_blocks):
                        crd = (None, None, kb, read.index)
                        cute.gemm(tiled_mma, acc, tCrA[crd], tCrB[crd], acc)
                        for x in cutlass.range_constexpr(len(acc2)):
                            cute.gemm(tiled_mma, acc2[x], tCrA[crd], tCrB2[x][crd], acc2[x])
                    cute.nvgpu.warpgroup.commit_group()
                    read.advance()
                    if k > 0:
                        cute.nvgpu.warpgroup.wait_group(1)
                        ab_pipe.consumer_release(release)
                        release.advance()
                cute.nvgpu.warpgroup.wait_group(0)
                if k_tiles > 0 and cutlass.const_expr(len(self.scales) == 0):
                    ab_pipe.consumer_release(release)
                    release.advance()

                # epilogue: per sub-tile, registers -> math -> smem -> TMA store
                gD_epi = cute.zipped_divide(gD[None, None, *tc], self.epi_tile)
                bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
                    tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_epi)
                n_epi = cute.size(gD_epi, mode=[1])
                epi_shape = gD_epi.shape[1]
                epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
                prev = sync.residual_start(sched.num_tiles_executed, n_epi)   # before the scheduler advances
                aux_dst = []
                for x in cutlass.range_constexpr(self.num_aux):
                    aux_dst.append(cute.nvgpu.cpasync.tma_partition(
                        aux_atoms[x], 0, cute.make_layout(1), cute.group_modes(sAux[x], 0, 2),
                        cute.zipped_divide(cute.local_tile(aux_tmas[x], tile_mn, (None, None, None))[None, None, *tc],
                                           self.epi_tile)))
                # stage this tile's slices of row/col inputs in shared memory (coalesced, once per tile)
                m0 = tc[0] * tm
                n0 = tc[1] * tn
                if cutlass.const_expr(n_full < len(self.input_kinds)):
                    for j in cutlass.range_constexpr(len(self.input_kinds)):
                        if cutlass.const_expr(self.input_kinds[j] in ROW_KINDS):
                            for i in range(epi_tidx, tn, self.num_mma_threads):
                                sIn[j][i] = inputs[j][self._vector_coord(j, cutlass.min(n0 + i, N - 1), tc[2])].to(
                                    self.epi_dtype)
                        elif cutlass.const_expr(self.input_kinds[j] in COL_KINDS):
                            for i in range(epi_tidx, tm, self.num_mma_threads):
                                sIn[j][i] = inputs[j][self._vector_coord(j, cutlass.min(m0 + i, M - 1), tc[2])].to(
                                    self.epi_dtype)
                    epi_bar.arrive_and_wait()
                full_src = []
                k = 0
                for j in cutlass.range_constexpr(len(self.input_kinds)):
                    if cutlass.const_expr(self.input_kinds[j] == "full"):
                        gR = cute.local_tile(full_tmas[k], tile_mn, (None, None, None))
                        full_src.append(cute.nvgpu.cpasync.tma_partition(
                            full_atoms[k], 0, cute.make_layout(1), cute.group_modes(sIn[j], 0, 2),
                            cute.zipped_divide(gR[None, None, *tc], self.epi_tile)))
                        k += 1
                # full inputs: sub-tile g (counted over the CTA's whole run) lives in buffer g % 2 and
                # completes phase (g // 2) % 2 of barrier g % 2; sub-tile g + 1 is loaded during g
                if cutlass.const_expr(n_full > 0):
                    if warp_idx == self.epi_store_warp_id:
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(in_bar + sync.ring_index(prev, sync.RESIDUAL_STAGES), full_bytes)
                        for f in cutlass.range_constexpr(n_full):
                            cute.copy(full_atoms[f], full_src[f][1][None, epi_layout.get_hier_coord(0)],
                                      full_src[f][0][None, sync.ring_index(prev, sync.RESIDUAL_STAGES)], tma_bar_ptr=in_bar + sync.ring_index(prev, sync.RESIDUAL_STAGES))
                for e in cutlass.range_constexpr(n_epi):
                    ec = epi_layout.get_hier_coord(e)
                    g = prev + e
                    if cutlass.const_expr(n_full > 0):
                        if cutlass.const_expr(e + 1 < n_epi):
                            if warp_idx == self.epi_store_warp_id:
                                with cute.arch.elect_one():
                                    cute.arch.mbarrier_arrive_and_expect_tx(in_bar + sync.ring_index(g + 1, sync.RESIDUAL_STAGES), full_bytes)
                                for f in cutlass.range_constexpr(n_full):
                                    cute.copy(full_atoms[f], full_src[f][1][None, epi_layout.get_hier_coord(e + 1)],
                                              full_src[f][0][None, sync.ring_index(g + 1, sync.RESIDUAL_STAGES)], tma_bar_ptr=in_bar + sync.ring_index(g + 1, sync.RESIDUAL_STAGES))
                        cute.arch.mbarrier_wait(in_bar + sync.ring_index(g, sync.RESIDUAL_STAGES), sync.ring_phase(g, sync.RESIDUAL_STAGES))
                    for v in cutlass.range_constexpr(n_v):
                        tRS_rD[v] = tRS_rAcc[e * n_v + v]
                        for x in cutlass.range_constexpr(len(acc2)):
                            tRS_rD2[x][v] = tRS_rAcc2[x][e * n_v + v]
                        if cutlass.const_expr(len(self.input_kinds) > 0):
                            lm, ln = tRS_cL[v]
                            for j in cutlass.range_constexpr(len(self.input_kinds)):
                                kind = self.input_kinds[j]
                                if cutlass.const_expr(kind in ROW_KINDS):
                                    rIn[j][v] = sIn[j][ec[1] * self.epi_tile[1] + ln]
                                elif cutlass.const_expr(kind in COL_KINDS):
                                    rIn[j][v] = sIn[j][ec[0] * self.epi_tile[0] + lm]
                                else:
                                    rIn[j][v] = sIn[j][lm, ln, sync.ring_index(g, sync.RESIDUAL_STAGES)].to(
                                        self.epi_dtype)
                    values = self.epi_fn(tRS_rD.load(), tuple(r.load() for r in rIn), scalars,
                                         *(r.load() for r in tRS_rD2))
                    for r in cutlass.range_constexpr(len(self.reductions)):
                        rRed.store(values[1 + self.num_aux + r])
                        red.reduce_subtile(rRed, tRS_cL, m0 + ec[0] * self.epi_tile[0], n0 + ec[1] * self.epi_tile[1],
                                           M, N, m0 if self.reductions[r][1] != "m" else n0, sRed[r], plans[r])
                    self._store_subtile(values, prev + e, ec, copy_r2s, tRS_rOut, tRS_sD, epi_bar, warp_idx, tma_d,
                                        bSG_sD, bSG_gD, store_pipe, tRS_sAux, aux_atoms, aux_dst)
                if cutlass.const_expr(len(self.reductions) > 0):
                    # every sub-tile's shared-memory atomics are done (the barrier above)
                    for r in cutlass.range_constexpr(len(self.reductions)):
                        along_n = self.reductions[r][1] != "m"
                        red.flush(sRed[r], cute.size(sRed[r]), epi_tidx, self.num_mma_threads,
                                  m0 if along_n else n0, M if along_n else N, reds[r], tc[2], plans[r])
                    epi_bar.arrive_and_wait()
                sched.advance_to_next_work()
                work = sched.get_current_work()
            store_pipe.producer_tail()
