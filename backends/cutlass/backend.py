"""The CUTLASS C++ backend behind the backend protocol (backends/api.py).

Implements GEMM kernel IRs (tensor-core operands, EVT epilogues) through `cutlass_cppgen`
(gemm.py, evt.py) and fused attention through the FMHA example kernels (fmha.py); nvcc builds
both.  Owns its tile/cluster heuristic and its capability record.
"""
from __future__ import annotations

from kspec.backends.api import MAX_CLUSTER_CTAS, Capabilities, LoweredPlan, SettingProblem
from kspec.backends.build import NvccBuilt
from kspec.backends.desc import AttentionDesc, GemmDesc, Operand
from kspec.backends.names import Names
from kspec.compiler.kir import Const, KernelIR, Load, epi_fns, epi_loads
from kspec.core import ARCHS, FP8_DTYPES, KspecError, dtype_bytes

from . import evt
from .fmha import _TILES as _FMHA_TILES
from .fmha import attention_support
from .gemm import OPERAND_DTYPES

_FP8 = FP8_DTYPES
GEMM_OPERANDS = tuple((a, a) for a in OPERAND_DTYPES if a not in _FP8) + \
    tuple((a, b) for a in _FP8 for b in _FP8)
EPILOGUE_FNS = frozenset(evt.SUPPORTED_OPS) - {"cast:<dtype>"}
EPILOGUE_REDUCTIONS = frozenset(("max", "sum"))


def _heuristic(ir: KernelIR, arch: str) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Tile heuristic by arch and operand width (used when the spec gives no schedule hint):
      sm90a  16-bit: 128x128x64 on a 2x1x1 cluster (TMA multicast of B across the pair)
             8-bit:  128x128x128;  tf32: 128x128x32;  M literal <= 64: tile M 64
      sm100a 16-bit: 256x128x64 on a 2x1x1 cluster (2-SM tcgen05 MMA); 8-bit 256x128x128; tf32 256x128x32
             M literal <= 128: tile M 128 on one SM (cluster 1x1x1)
    The backend validates every choice against CUTLASS's configuration list for that arch and dtype."""
    s = ir.gemm
    k_tile = {1: 128, 2: 64, 4: 32}[dtype_bytes(s.a_dtype)]
    m_extent = dict(s.dims)["M"]
    small = isinstance(m_extent, int) and not s.m_fold      # a folded M is a product: never small
    if arch == "sm90a":
        return (64 if small and m_extent <= 64 else 128, 128, k_tile), (2, 1, 1)
    if small and m_extent <= 128:
        return (128, 128, k_tile), (1, 1, 1)
    return (256, 128, k_tile), (2, 1, 1)


# Extra GEMM tile/cluster pairs worth tuning over for 16-bit operands, each checked against
# CUTLASS's own configuration list for f16 row x col operands (`gemm._configs`): on sm90a the CTA
# tile, on sm100a the MMA tile (M 256 = a 2-SM MMA on a cluster with an even M extent).
_TUNING_TILES: dict[str, tuple[tuple[tuple[int, int, int], tuple[int, int, int]], ...]] = {
    "sm90a": (((128, 128, 64), (1, 2, 1)), ((128, 256, 64), (2, 1, 1)), ((64, 128, 64), (2, 1, 1)),
              ((256, 128, 64), (1, 2, 1)), ((128, 64, 64), (1, 2, 1)), ((64, 256, 64), (2, 1, 1))),
    "sm100a": (((256, 256, 64), (2, 1, 1)), ((128, 128, 64), (1, 1, 1)), ((128, 256, 64), (1, 1, 1)),
               ((256, 128, 64), (4, 1, 1)), ((128, 128, 64), (2, 1, 1)), ((64, 128, 64), (1, 1, 1))),
}


def _gemm_setting_problem(h) -> SettingProblem | None:
    """CUTLASS 3.x GEMM tile/cluster/stage shapes (sm90a CTA tile, sm100a MMA tile) as its generator
    lists them for tensor-core kernels; kspec emits the stage count only from 2 on (gemm._check_desc)."""
    if h.tile is not None:
        m, n, k = h.tile
        if m not in (64, 128, 256):
            return SettingProblem("tile", "tile M must be 64, 128 or 256")
        if n % 8 or not 8 <= n <= 256:
            return SettingProblem("tile", "tile N must be a multiple of 8 from 8 to 256")
        if k not in (16, 32, 64, 128, 256):
            return SettingProblem("tile", "tile K must be 16, 32, 64, 128 or 256")
    if h.cluster is not None:
        cm, cn, ck = h.cluster
        if any(c & (c - 1) for c in h.cluster):
            return SettingProblem("cluster", "cluster sizes must be powers of two")
        if ck != 1:
            return SettingProblem("cluster", "the K cluster size must be 1")
        if cm * cn > MAX_CLUSTER_CTAS:
            return SettingProblem("cluster", f"a cluster holds at most {MAX_CLUSTER_CTAS} CTAs "
                                             "(kspec launches portable cluster sizes only)")
    if h.stages is not None and h.stages < 2:
        return SettingProblem("stages", "stages must be at least 2 (the shared-memory budget sets the most)")
    return None


def _shape(t) -> str:
    return "x".join(map(str, t))


class CutlassBackend(NvccBuilt):
    name = "cutlass"
    capabilities = Capabilities(
        archs=ARCHS, kinds=("gemm", "attention"), gemm_operands=GEMM_OPERANDS,
        epilogue_fns=EPILOGUE_FNS, epilogue_reductions=EPILOGUE_REDUCTIONS,
        epilogue_loads=frozenset(("row", "col", "row_batched", "col_batched", "full", "scalar")),
        attention=tuple((a, "f16/bf16, head dims " + ",".join(map(str, sorted(t))) + "; causal top-left or none")
                        for a, t in _FMHA_TILES.items()))

    def available(self) -> str | None:
        try:
            from .compat import cutlass_version
            cutlass_version()
        except Exception as e:  # noqa: BLE001 - reported as a reason, not raised
            return f"nvidia-cutlass is not usable: {e}"
        return super().available()

    def identity(self) -> str:
        from .compat import cutlass_version
        return f"nvidia-cutlass {cutlass_version()}"

    # ---- capability ------------------------------------------------------------------------
    def can_implement(self, ir: KernelIR, arch: str) -> str | None:
        if arch not in self.capabilities.archs:
            return f"the CUTLASS backend does not target {arch}"
        if ir.kind == "gemm":
            return self._gemm_reason(ir, arch)
        if ir.kind == "attention":
            return self._attention_reason(ir, arch)
        return f"the CUTLASS backend implements GEMMs and fused attention, not {ir.kind} kernels"

    def is_fallback(self, ir: KernelIR) -> str | None:
        return None

    def setting_problem(self, ir: KernelIR, arch: str) -> SettingProblem | None:
        """The spec's tile/cluster/stages against what CUTLASS instantiates: for attention the one
        FMHA tile per head dim; for GEMMs the shapes CUTLASS's generator lists (a screen: the exact
        list, which depends on dtypes, layouts and the epilogue, is checked at emit, where a miss is
        reported at the setting too, with the nearest valid choices)."""
        h = ir.hint(arch)
        if ir.kind == "attention":
            from .fmha import choose_attention_tile
            a = ir.attention
            tile = choose_attention_tile(arch, a.dtypes[0], a.head_dim)
            if h.tile is not None and tuple(h.tile) != tile:
                return SettingProblem("tile", f"the FMHA kernel for head dim {a.head_dim} on {arch} has tile "
                                              f"{_shape(tile)} only")
            for key in ("cluster", "stages"):
                if getattr(h, key) is not None:
                    return SettingProblem(key, f"the FMHA kernels take no {key} setting (tile {_shape(tile)} only)")
            return None
        return _gemm_setting_problem(h)

    def _gemm_reason(self, ir: KernelIR, arch: str) -> str | None:
        s = ir.gemm
        a, b = s.a_dtype, s.b_dtype
        if s.dual:
            return "dual GEMMs (two B operands sharing the A tiles) are not implemented by the CUTLASS backend"
        if s.scales:
            return "block-scaled GEMMs (scales read at blocks of K inside the sum) are not implemented by the CUTLASS backend"
        if s.a_rows is not None:
            return "GEMMs whose A rows are gathered through an index are not implemented by the CUTLASS backend"
        if (a, b) not in GEMM_OPERANDS:
            if a == "f32" or b == "f32":
                return f"operands {a} x {b}: CUTLASS tensor cores multiply f32 data as tf32 (declare it tf32)"
            return (f"operands {a} x {b}: CUTLASS GEMMs take "
                    + ", ".join(sorted({x for p in GEMM_OPERANDS for x in p})) + " (the two fp8 kinds may mix)")
        if arch == "sm90a" and a in _FP8 and (s.a_layout, s.b_layout) != ("row", "col"):
            return "fp8 GEMMs on sm90a need A row-major and B column-major (K contiguous in both)"
        for st in (*ir.epilogue.stores, *ir.epilogue.reductions):
            bad = {f for f in epi_fns(st.value) if not f.startswith("cast:")} - EPILOGUE_FNS
            if bad:
                return f"epilogue op {', '.join(sorted(bad))} has no CUTLASS EVT equivalent"
            for ld in epi_loads(st.value):
                if ld.kind != "scalar" and ld.dtype not in evt._LOAD_DTYPES:
                    return f"epilogue input {ld.name} is {ld.dtype}; EVT loads take {', '.join(evt._LOAD_DTYPES)}"
                if ld.kind == "full" and ir.buffer(ld.name).layout == "col":
                    return f"epilogue input {ld.name} is column-major; EVT reads full tensors row-major"
        for st in ir.epilogue.stores:
            if st.dtype not in evt._STORE_DTYPES:
                return f"output {st.name} is {st.dtype}; EVT stores {', '.join(evt._STORE_DTYPES)}"
        for r in ir.epilogue.reductions:
            if r.op not in EPILOGUE_REDUCTIONS:
                return f"epilogue reduction {r.op} has no EVT equivalent (max, sum)"
            if r.axis not in ("m", "n"):
                return f"epilogue reduction '{r.name}' over both m and n: the EVT reduces rows or columns only"
        return None

    def _attention_reason(self, ir: KernelIR, arch: str) -> str | None:
        a = ir.attention
        if len(set(a.dtypes)) != 1:
            return f"Q, K and V have different dtypes ({', '.join(sorted(set(a.dtypes)))})"
        head = a.head_dim
        if not isinstance(head, int):
            return "the head dimension must be the same integer literal in Q, K and V"
        if len(a.batch) > 2:
            return "more than two batch axes"
        if a.scale is None:
            return "the score scale must be one param or constant factor"
        if a.score_mod is not None or a.mask is not None or a.kv_group is not None or a.lse is not None or \
                a.o_scale is not None:
            return ("the CUTLASS FMHA templates implement no score modification, mask (other than top-left "
                    "causal), grouped K/V heads, log-sum-exp output or output scale")
        if a.page_table is not None or a.kv_len is not None:
            return "the CUTLASS FMHA templates read dense K/V (no paged KV cache, no per-sequence key counts)"
        if a.kv_shared:
            return (f"K and V are shared across [{', '.join(a.kv_shared)}] (multi-query attention); the fused "
                    "kernel reads K and V with every batch axis of Q")
        for dt in a.p_dtypes:
            if dt not in (a.dtypes[0], "f32"):
                return (f"the probabilities are rounded to {dt}; the fused kernel multiplies them with V "
                        f"in {a.dtypes[0]}")
        if not a.inputs_row_major:
            return "Q, K and V must be row-major kernel inputs"
        if a.orders:
            return ("the CUTLASS FMHA templates read Q, K, V and O as [batch.., heads, seq, head dim], not "
                    + ", ".join(f"[{', '.join(o)}]" for o in a.orders))
        if len(a.out_buffers) != 1:
            return "fused attention stores exactly one output O"
        out = ir.buffer(a.out_buffers[0]).dtype
        scale = a.scale if isinstance(a.scale, float) else None
        return attention_support(arch, a.dtypes[0], head, a.causal, out_dtype=out, scale=scale)

    # ---- configuration -------------------------------------------------------------------------
    def default_config(self, ir: KernelIR, arch: str) -> tuple[tuple[str, str], ...]:
        if ir.kind == "attention":
            from .fmha import choose_attention_tile
            a = ir.attention
            return (("tile", _shape(choose_attention_tile(arch, a.dtypes[0], a.head_dim))), ("source", "fixed"))
        tile, cluster = _heuristic(ir, arch)
        h = ir.hint(arch)
        if h.tile or h.cluster or h.stages:
            out = (("tile", _shape(h.tile or tile)), ("cluster", _shape(h.cluster or cluster)))
            return out + ((("stages", str(h.stages)),) if h.stages else ()) + (("source", "hint"),)
        return (("tile", _shape(tile)), ("cluster", _shape(cluster)), ("source", "heuristic"))

    def candidates(self, ir: KernelIR, arch: str) -> list[tuple[tuple[str, str], ...]]:
        """The default first, then (for 16-bit GEMMs without a schedule hint) the tile/cluster pairs
        of _TUNING_TILES; a configuration whose fused epilogue does not fit is rejected at emit."""
        default = self.default_config(ir, arch)
        if ir.kind != "gemm" or dict(default).get("source") == "hint" or dtype_bytes(ir.gemm.a_dtype) != 2:
            return [default]
        out = [default]
        for tile, cluster in _TUNING_TILES[arch]:
            cfg = (("tile", _shape(tile)), ("cluster", _shape(cluster)), ("source", "candidate"))
            if all(dict(c)["tile"] != cfg[0][1] or dict(c)["cluster"] != cfg[1][1] for c in out):
                out.append(cfg)
        return out

    # ---- lowering ------------------------------------------------------------------------------
    def lower(self, ir: KernelIR, arch: str, config: tuple[tuple[str, str], ...] | None = None) -> LoweredPlan:
        """config: one of `candidates(ir, arch)` (e.g. a tuning-database winner) instead of the default."""
        if ir.kind == "gemm":
            return self._lower_gemm(ir, arch, config)
        return self._lower_attention(ir, arch)

    def _lower_gemm(self, ir: KernelIR, arch: str, config=None) -> LoweredPlan:
        cfg = dict(config or self.default_config(ir, arch))
        if not isinstance(cfg.get("tile"), str) or not isinstance(cfg.get("cluster"), str):
            raise KspecError(f"kernel {ir.id} on {arch}: configuration {cfg} has no valid tile and cluster",
                             ir.span, "a tuning database entry may be damaged; re-run `kspec tune`")
        try:
            return lower_gemm_desc(ir, arch, self.name, cfg)
        except ValueError:
            raise KspecError(f"kernel {ir.id} on {arch}: configuration {cfg} has no valid tile and cluster",
                             ir.span, "a tuning database entry may be damaged; re-run `kspec tune`") from None

    def _lower_attention(self, ir: KernelIR, arch: str) -> LoweredPlan:
        a = ir.attention
        names = Names()
        ops = {r: Operand(names(buf), dt) for r, buf, dt in
               (("q", a.q_buffer, a.dtypes[0]), ("k", a.k_buffer, a.dtypes[1]), ("v", a.v_buffer, a.dtypes[2]))}
        o_buf = ir.buffer(a.out_buffers[0])
        o = Operand(names(o_buf.name), o_buf.dtype)
        scalars: dict[str, object] = {}
        if isinstance(a.scale, str):
            c = names(a.scale)
            scalars[c] = a.scale
            scale_e: Load | Const = Load(c, "scalar", "f32")
        else:
            scale_e = Const(float(a.scale))
        desc = AttentionDesc(name=f"k_{ir.id.rsplit('_', 1)[-1]}", arch=arch, q=ops["q"], k=ops["k"], v=ops["v"],
                             o=o, head_dim=a.head_dim, scale=scale_e, causal=a.causal, tile=ir.hint(arch).tile)
        return LoweredPlan(ir, arch, self.name, desc, names.back(), a.dims, scalars)

    def emit(self, lowered: LoweredPlan):
        if isinstance(lowered.desc, GemmDesc):
            from .gemm import emit_gemm
            return emit_gemm(lowered.desc)
        from .fmha import emit_attention
        return emit_attention(lowered.desc)


def _packing(ir: KernelIR) -> str | None:
    """The offsets a grouped GEMM's rows are packed by: A's, or the gathering index's."""
    s = ir.gemm
    return ir.buffer(s.a_rows if s.a_rows is not None else s.a_buffer).packed


def lower_gemm_desc(ir: KernelIR, arch: str, backend: str, cfg: dict | None = None) -> LoweredPlan:
    """A GEMM kernel IR as a `GemmDesc` with C identifiers (shared by the CUTLASS and CuTe DSL
    backends, which use one argument order).  cfg: the CUTLASS configuration to record in it
    (None: the spec's hint, if any)."""
    from kspec.compiler.kir import Op, ReductionStore, Store
    s = ir.gemm
    names = Names()
    scalars: dict[str, object] = {}
    a = Operand(names(s.a_buffer), s.a_dtype, s.a_layout)
    b = Operand(names(s.b_buffer), s.b_dtype, s.b_layout)
    b2 = Operand(names(s.b2_buffer), s.b_dtype, s.b_layout) if s.dual else None

    def rename(e):
        if isinstance(e, Load):
            c = names(e.name)
            if e.kind == "scalar":
                scalars[c] = e.name
            return Load(c, e.kind, e.dtype)
        if isinstance(e, Op):
            return Op(e.fn, tuple(rename(x) for x in e.args))
        return e

    stores = [Store(names(st.name), rename(st.value), st.dtype, st.layout) for st in ir.epilogue.stores]
    reds = [ReductionStore(names(r.name), r.op, r.axis, rename(r.value), r.dtype) for r in ir.epilogue.reductions]
    hint = ir.hint(arch)
    if cfg is None:
        tile, cluster, hinted = hint.tile, hint.cluster, True
    else:
        tile = tuple(int(x) for x in cfg["tile"].split("x"))
        cluster = tuple(int(x) for x in cfg["cluster"].split("x"))
        hinted = cfg.get("source") == "hint"
    from dataclasses import replace
    scales = tuple(replace(sc, buffer=names(sc.buffer)) for sc in s.block_scales)
    desc = GemmDesc(name=f"k_{ir.id.rsplit('_', 1)[-1]}", arch=arch, a=a, b=b, acc_dtype=s.acc_dtype,
                    output=stores[-1], aux_stores=tuple(stores[:-1]), reductions=tuple(reds),
                    batched=bool(s.batch), tile=tile, cluster=cluster, stages=hint.stages if hinted else None, b2=b2,
                    scales=scales, grouped=names(_packing(ir)) if _packing(ir) else None,
                    a_rows=names(s.a_rows) if s.a_rows is not None else None)
    return LoweredPlan(ir, arch, backend, desc, names.back(), s.dims, scalars)

