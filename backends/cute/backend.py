"""The CuTe DSL backend behind the backend protocol (backends/api.py): kspec's own persistent GEMM
kernels for sm_90a (WGMMA, TMA, warp-specialised) and sm_100a (tcgen05/UMMA, TMEM, 2-CTA), written on
the pinned nvidia-cutlass-dsl wheel's building blocks, with the epilogue generated from the kernel
IR's expression DAG.  Builds in seconds without nvcc (the DSL compiles and exports ahead of time);
the host `.so` is linked by kspec against its own capture shim (csrc/), so an artifact contains no
NVIDIA runtime library.  Preferred over the CUTLASS C++ backend wherever it can implement a GEMM."""
from __future__ import annotations

from dataclasses import dataclass

from kspec.backends.api import Capabilities, LoweredPlan, SettingProblem
from kspec.backends.desc import EmittedKernel, GemmDesc
from kspec.compiler.kir import KernelIR
from kspec.core import ARCHS, KspecError, dtype_bytes

from . import epilogue as cute_epi
from . import gemm as cute_gemm


@dataclass(frozen=True)
class CuteDesc:
    """A GEMM descriptor plus the CuTe DSL configuration chosen for it."""
    gemm: GemmDesc
    config: cute_gemm.CuteConfig


class CuteBackend:
    name = "cute"
    capabilities = Capabilities(
        archs=ARCHS, kinds=("gemm", "attention", "attention_bwd"), packed=True,
        attention=(("sm90a", "FlashAttention-4: f16/bf16, head dims 8..256; causal (either alignment), sliding "
                    "window, score_mod/mask_mod, GQA/MQA, LSE, paged KV, packed (cu_seqlens) batches"),
                   ("sm100a", "FlashAttention-4: f16/bf16, head dims 8..128, (192,128), (256,256); causal, "
                    "sliding window, score_mod/mask_mod, GQA/MQA, LSE, paged KV, packed (cu_seqlens) batches")),
        gemm_operands=(("f16", "f16"), ("bf16", "bf16"), ("f8e4m3", "f8e4m3"), ("f8e5m2", "f8e5m2"),
                       ("f8e4m3", "f8e5m2"), ("f8e5m2", "f8e4m3"), ("i8", "i8"), ("tf32", "tf32")),
        epilogue_fns=frozenset(cute_epi.UNARY + cute_epi.BINARY + cute_epi.TERNARY),
        epilogue_reductions=frozenset(cute_epi.REDUCTION_OPS),
        epilogue_loads=frozenset(("row", "col", "row_batched", "col_batched", "full", "scalar")))

    def available(self) -> str | None:
        from . import compat
        return compat.available()

    def identity(self) -> str:
        from . import compat
        return f"nvidia-cutlass-dsl {compat.dsl_version()} ({compat.cuda_flavour()})"

    # ---- capability ------------------------------------------------------------------------
    def _gemm_desc(self, ir: KernelIR, arch: str) -> LoweredPlan:
        from kspec.backends.cutlass.backend import lower_gemm_desc
        return lower_gemm_desc(ir, arch, self.name)

    def can_implement(self, ir: KernelIR, arch: str) -> str | None:
        if ir.kind == "attention":
            from . import attention, compat
            # what FlashAttention-4 cannot do first: installing it would not help there
            return attention.unsupported(ir, arch) or compat.fa4_available()
        if ir.kind == "attention_bwd":
            from . import attention_bwd
            return attention_bwd.unsupported(ir, arch)
        if ir.kind != "gemm":
            return f"the CuTe DSL backend implements GEMMs and attention (forward and backward), not {ir.kind} kernels"
        packed = [b for b in ir.buffers if b.packed]
        if packed:
            why = cute_gemm.grouped_problem(ir, arch)
            if why:
                return why
        desc = self._gemm_desc(ir, arch).desc
        return cute_gemm.can_implement(desc, arch)

    def is_fallback(self, ir: KernelIR) -> str | None:
        return None

    def needs_opt_in(self, ir: KernelIR, arch: str) -> str | None:
        """tf32 on sm90a and mixed fp8 kinds on sm100a: built here only when asked (gemm.unvalidated)."""
        if ir.kind != "gemm":
            return None
        return cute_gemm.unvalidated(self._gemm_desc(ir, arch).desc, arch)

    def setting_problem(self, ir: KernelIR, arch: str) -> SettingProblem | None:
        """GEMMs: the spec's tile/cluster/stages must be a configuration the kernels take (K is
        the kernel's own, 128 bytes of operand per stage).  FlashAttention-4 chooses its tiles
        per problem size and takes none of these settings."""
        h = ir.hint(arch)
        if ir.kind in ("attention", "attention_bwd"):
            for key in ("tile", "cluster", "stages"):
                if getattr(h, key) is not None:
                    return SettingProblem(key, f"FlashAttention-4 chooses its own tiles and pipeline; it takes no "
                                               f"{key} setting")
            return None
        if not self._hinted(ir, arch):
            return None
        desc = self._gemm_desc(ir, arch).desc
        k = cute_gemm.k_tile(desc.a.dtype)
        if h.tile is not None and h.tile[2] != k:
            return SettingProblem("tile", f"tile K is {k} for {desc.a.dtype} operands (128 bytes per stage)")
        if h.cluster is not None and h.cluster[2] != 1:
            return SettingProblem("cluster", "the K cluster size must be 1")
        return cute_gemm.config_problem(self._config(desc, ir, arch), arch, desc=desc)

    @staticmethod
    def _hinted(ir: KernelIR, arch: str) -> bool:
        h = ir.hint(arch)
        return bool(h.tile or h.cluster or h.stages)

    def _config(self, desc: GemmDesc, ir: KernelIR, arch: str) -> cute_gemm.CuteConfig:
        dims = {role: v for role, v in ir.gemm.dims if isinstance(v, int)}
        if self._hinted(ir, arch):
            return cute_gemm.hint_config(desc, arch, dims)    # the spec's schedule: exactly
        return cute_gemm.default_config(desc, arch, dims)

    def default_config(self, ir: KernelIR, arch: str) -> tuple[tuple[str, str], ...]:
        if ir.kind == "attention_bwd":
            from . import attention_bwd
            return attention_bwd.config_items(attention_bwd.lower(ir, arch)[0])
        if ir.kind == "attention":
            from . import attention
            return attention.config_items(attention.lower(ir, arch)[0])
        desc = self._gemm_desc(ir, arch).desc
        cfg = self._config(desc, ir, arch)
        items = tuple((k, v) for k, v in cfg.as_dict().items() if k != "backend")
        return items + (("source", "hint" if self._hinted(ir, arch) else "heuristic"),)

    def candidates(self, ir: KernelIR, arch: str) -> list[tuple[tuple[str, str], ...]]:
        if ir.kind in ("attention", "attention_bwd") or self._hinted(ir, arch):
            # FA4's heuristics choose per size bucket; a spec's schedule setting is used exactly
            return [self.default_config(ir, arch)]
        desc = self._gemm_desc(ir, arch).desc
        return [tuple(c.as_dict().items()) for c in cute_gemm.candidates(desc, arch)]

    def size_problem(self, ir: KernelIR, arch: str, sizes: dict[str, int]) -> str | None:
        """Why this kernel cannot be built for these `--sizes` (None: it can): a FlashAttention-4
        attention (or attention backward) whose GQA group is known only per call needs the sizes to
        name it (FA4 compiles the group in), so without them it is planned unfused, as `kspec compile`
        would build it."""
        if ir.kind not in ("attention", "attention_bwd"):
            return None
        from . import attention
        if ir.kind == "attention_bwd":
            a = ir.attention_bwd
            known = not isinstance(a.kv_group, str) or attention.groups_of(a, sizes)
        else:
            a = attention.fold_heads(ir, ir.attention) or ir.attention
            known = attention._group(a) is not None or attention.groups_named(ir, sizes)
        if known:
            return None
        name = ("the head count " + dict(a.dims).get("H", "H") if getattr(a, "kv_shared", ()) else
                "H and KH" if isinstance(a.kv_group, str) and "/" in a.kv_group else
                f"{a.kv_group} (or the query and K/V head counts)")
        return (f"the GQA group (query heads per K/V head) is known only per call and FlashAttention-4 compiles it "
                f"into the kernel: name {name} with --sizes to build it")

    def call_notes(self, ir: KernelIR, arch: str, sizes: dict[str, int], config=None) -> list[str]:
        """What a call at these sizes launches, where the artifact decides per call (`kspec graph
        --sizes`): for a FlashAttention-4 attention, whether it splits the key range and how many ways
        on each SKU built for (backends/cute/splitkv.py)."""
        if ir.kind != "attention":
            return []
        from kspec.core import extent_value

        from . import attention, splitkv
        text = ",".join(f"{k}={v}" for k, v in sorted(sizes.items()))
        try:
            lp = self.lower(ir, arch, (*(config or self.default_config(ir, arch)), ("sizes", text)))
        except KspecError as e:
            return [f"{e.message} ({e.hint})" if e.hint else e.message]
        desc = lp.desc
        if desc.groups:
            out = [f"GQA group {', '.join(map(str, desc.groups))} at these sizes: `kspec compile --sizes {text}` "
                   "builds its kernels"]
            desc = attention.replace(desc, group=desc.groups[0], groups=())
        else:
            out = []
        why = splitkv.split_unsupported(desc)
        if why:
            return [*out, f"split-KV: none on {arch} ({why})"]
        roles = dict(lp.dims)
        try:
            v = {r: extent_value(roles[r], sizes) for r in ("B", "H", "S", "T", "HK")}
        except KeyError as e:
            return [f"split-KV: give {e.args[0]} in --sizes to see the split count"]
        at = ", ".join(f"{r}={v[r]}" for r in ("B", "H", "S", "T", "HK"))
        counts = []
        for sms in attention.skus(desc):
            ns = splitkv.num_splits(v["B"], v["H"], v["S"], v["T"], v["HK"], sms, head_dim_v=desc.head_dim_v,
                                    pack_gqa=desc.group > 1, override=desc.splits)
            what = f"{ns} splits (the split-KV kernel, then the combine)" if ns > 1 else \
                "no split (a single-pass kernel)"
            counts.append(f"{what} on {sms} SMs")
        return [*out, f"split-KV at {at}: " + "; ".join(counts)]

    # ---- lowering, emission, build ---------------------------------------------------------------
    def lower(self, ir: KernelIR, arch: str, config=None) -> LoweredPlan:
        """config: one of `candidates(ir, arch)` (a tuning winner); default: the heuristic's."""
        if ir.kind == "attention_bwd":
            from . import attention, attention_bwd
            desc, names, dims, scalars = attention_bwd.lower(ir, arch)
            sizes = dict(config or ()).get("sizes")            # `kspec compile --sizes`: a per-call group's value
            if not desc.group and sizes:
                from kspec.core import parse_sizes
                groups = attention.groups_of(ir.attention_bwd, parse_sizes(sizes))
                if groups:
                    desc = attention.for_groups(desc, groups)
            return LoweredPlan(ir, arch, self.name, desc, names, dims, scalars, attention_bwd.config_items(desc))
        if ir.kind == "attention":
            from . import attention
            desc, names, dims, scalars = attention.lower(ir, arch)
            skus = dict(config or ()).get("sm_count")      # `kspec compile --sm-count`: the SKUs to build for
            if skus:
                desc = attention.for_skus(desc, skus.split(","))
            splits = dict(config or ()).get("num_splits", "")  # a tuning winner fixing the split-KV count
            if splits.isdigit() and int(splits) > 0:
                from dataclasses import replace
                desc = replace(desc, splits=int(splits))
            sizes = dict(config or ()).get("sizes")            # `kspec compile --sizes`: a per-call group's value
            if not desc.group and sizes:
                from kspec.core import parse_sizes
                groups = attention.groups_named(ir, parse_sizes(sizes))
                if groups:
                    desc = attention.for_groups(desc, groups)
            if not desc.group and not desc.groups:
                a = attention.fold_heads(ir, ir.attention) or ir.attention
                quotient = isinstance(a.kv_group, str) and "/" in a.kv_group
                what, eg = (("the head count H", "H=32") if a.kv_shared else
                            ("the head counts " + " and ".join(a.kv_group.split("/")),
                             ",".join(f"{x}={v}" for x, v in zip(a.kv_group.split("/"), (32, 8)))) if quotient else
                            (f"{a.kv_group}, or H and {a.kv_head}", f"{a.kv_group}=4 or H=32,{a.kv_head}=8"))
                raise KspecError(f"attention kernel {ir.id} on {arch}: its GQA group (query heads per K/V head) is "
                                 f"known only at call time, and FlashAttention-4 compiles it into the kernel",
                                 ir.span, f"name the group to build with `kspec compile --sizes` ({what}: e.g. "
                                 f"{eg}); one artifact per group, or one `kspec build` bucket each")
            return LoweredPlan(ir, arch, self.name, desc, names, dims, scalars, attention.config_items(desc))
        lp = self._gemm_desc(ir, arch)
        cfg = self._config(lp.desc, ir, arch) if config is None else _from_items(config)
        return LoweredPlan(ir, arch, self.name, CuteDesc(lp.desc, cfg), lp.names, lp.dims, lp.scalars,
                           tuple(cfg.as_dict().items()))

    def emit(self, lowered: LoweredPlan) -> EmittedKernel:
        if not isinstance(lowered.desc, CuteDesc):
            from . import attention, attention_bwd
            d = lowered.desc
            m = attention_bwd if isinstance(d, attention_bwd.BwdDesc) else attention
            return EmittedKernel(name=d.name, arch=lowered.arch, source=m.entry_source(d), include_dirs=(),
                                 flags=(), dims=d.dims, args=d.args, scalars=d.scalars, alignment=d.alignment(),
                                 init=d.init() if m is attention_bwd else (), config=m.config_items(d))
        desc, cfg = lowered.desc.gemm, lowered.desc.config
        code = cute_epi.generate(desc)
        tensors = cute_gemm.tensor_abi(desc, code)
        names = cute_gemm.abi_names(desc, code)
        return EmittedKernel(
            name=desc.name, arch=lowered.arch, source=cute_gemm.entry_source(desc, lowered.arch, cfg, code),
            include_dirs=(), flags=(), dims=("M", "N", "K", "L", *(("R",) if desc.a_rows else ())), args=names,
            scalars=tuple(l.name for l in code.scalars), init=desc.reduction_init(),
            alignment=tuple((names[t.ptr_index], t.alignment) for t in tensors),
            config=tuple(cfg.as_dict().items()), multiples=cute_gemm.size_multiples(desc))

    def build_jobs(self, emitted, label: str) -> list:
        return []            # no nvcc: see build_binaries

    def build_binaries(self, items, cache_root, jobs=None, progress=None) -> dict:
        """Build (cache lookups first, misses in parallel processes) every (label, LoweredPlan) of
        this backend; label -> backends.cute.build.CuteBuild (cubin, host .so, symbol, offsets) or
        attention.AttnBuild (every size variant of a FlashAttention-4 kernel; the three or five kernels of its
        attention backward)."""
        from pathlib import Path

        from .parallel import CuteJob, build_many
        # GEMMs and FlashAttention-4 attention kernels alike, in parallel worker processes
        cjobs = [CuteJob(label, lp.desc.gemm, lp.arch, lp.desc.config) if isinstance(lp.desc, CuteDesc)
                 else CuteJob(label, lp.desc, lp.arch, None, kind="cute-fa4") for label, lp in items]
        if not cjobs:
            return {}
        built = build_many(cjobs, Path(cache_root), max_parallel=jobs, progress=progress)
        return {j.label: b for j, b in zip(cjobs, built)}


def _from_items(items) -> cute_gemm.CuteConfig:
    """A CuteConfig from its printable items (CuteConfig.as_dict)."""
    d = dict(items)
    tile = tuple(int(x) for x in d["tile"].split("x"))
    cluster = tuple(int(x) for x in d["cluster"].split("x"))
    stages = None if d.get("stages", "auto") == "auto" else int(d["stages"])
    return cute_gemm.CuteConfig(tile, cluster, d.get("2cta") == "true", stages)

