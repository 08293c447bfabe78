"""`kspec compile`: spec -> plans -> descriptors -> C++ -> nvcc (cached, parallel) -> artifact.

    compile_spec(path, archs, out_dir)       the whole job; returns the artifact directory
    emit_spec(path, archs)                   everything up to the C++ (no nvcc)
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import kspec
from kspec.backends.desc import ARCHS, EmittedKernel
from kspec.backends.lower import LoweredPlan, attention_veto, cutlass_can_run, lower
from kspec.compiler import KernelSchedule, op, plan_kernel
from kspec.core import KspecInternalError
from kspec.spec_lang import CheckedProgram, KspecError, load_spec


@dataclass(frozen=True)
class EmittedPlan:
    lowered: LoweredPlan
    emitted: EmittedKernel
    backend: str = "cutlass"           # "cutlass" (C++ + nvcc) or "cute" (CuTe DSL)
    cute_config: object = None         # backends.cute.gemm.CuteConfig for cute plans
    fallback: str | None = None        # why the preferred backend could not take this plan

    @property
    def label(self) -> str:
        return f"kernel {self.lowered.plan.id} on {self.lowered.arch.replace('sm', 'sm_')}"


@dataclass
class EmittedSpec:
    program: CheckedProgram
    archs: tuple[str, ...]
    schedules: list[KernelSchedule]
    plans: dict[str, list[EmittedPlan]]      # plan id -> one per arch (in `archs` order)


def _generator_identity() -> str:
    """Hash of the code generators' own source: an emitted kernel is reused only while they are unchanged."""
    import kspec.backends as backends
    h = hashlib.sha256(kspec.__version__.encode())
    root = Path(backends.__file__).parent
    for p in sorted(root.rglob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


_GENERATOR_ID: list[str] = []


def emit_cached(desc, cache_root: Path | None) -> EmittedKernel:
    """emit_backend(desc), memoised on disk: planning through cutlass_cppgen costs seconds per kernel,
    and a warm `kspec compile` should not pay it.  Entries are JSON, written atomically."""
    import json
    import tempfile
    from dataclasses import asdict
    if cache_root is None:
        return emit_backend(desc)
    if not _GENERATOR_ID:
        from kspec.backends.cutlass.compat import cutlass_version
        _GENERATOR_ID.append(_generator_identity() + cutlass_version())
    key = hashlib.sha256((_GENERATOR_ID[0] + repr(desc)).encode()).hexdigest()
    path = cache_root / "emit" / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        fields = {k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
                  for k, v in data.items()}
        return EmittedKernel(**fields)
    except (OSError, ValueError, TypeError):
        pass
    em = emit_backend(desc)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(em), f)
    os.replace(tmp, path)
    return em


def emit_backend(desc) -> EmittedKernel:
    from kspec.backends.desc import AttentionDesc, GemmDesc
    if isinstance(desc, GemmDesc):
        from kspec.backends.cutlass.gemm import emit_gemm
        return emit_gemm(desc)
    if isinstance(desc, AttentionDesc):
        from kspec.backends.cutlass.fmha import emit_attention
        return emit_attention(desc)
    from kspec.backends.generic import emit_generic
    return emit_generic(desc)


BACKENDS = ("auto", "cute", "cutlass")


def _emit_cute(lp: LoweredPlan, backend: str) -> tuple[EmittedKernel | None, object, str | None]:
    """The CuTe DSL backend's emission for a GEMM plan, or (None, None, reason) when it cannot
    take the plan (then the CUTLASS C++ backend does, unless backend == "cute")."""
    from kspec.backends.desc import GemmDesc
    if backend == "cutlass":
        return None, None, None
    if not isinstance(lp.desc, GemmDesc):
        return None, None, None if backend == "auto" else "only GEMM kernels have a CuTe DSL implementation"
    from kspec.backends.cute import gemm as cute_gemm
    why = cute_gemm.can_implement(lp.desc, lp.arch)
    if why is not None:
        return None, None, why
    from kspec.backends.cute import epilogue as cute_epi
    code = cute_epi.generate(lp.desc)
    dims = {role: v for role, v in lp.dims if isinstance(v, int)}
    arch_cfg = getattr(lp.plan, "configs", {}).get(lp.arch)
    if arch_cfg is not None and getattr(arch_cfg, "source", "") == "hint" and lp.desc.tile is not None:
        cfg = cute_gemm.hint_config(lp.desc, lp.arch)          # the spec's schedule: exactly, or not at all
        bad = cute_gemm.valid_config(cfg, lp.arch)
        if bad is not None:
            return None, None, f"the schedule hint is not a CuTe DSL configuration: {bad}"
    else:
        cfg = cute_gemm.default_config(lp.desc, lp.arch, dims)
    tensors = cute_gemm.tensor_abi(lp.desc, code)
    names = cute_gemm.abi_names(lp.desc, code)
    from kspec.core import dtype_bytes
    em = EmittedKernel(
        name=lp.desc.name, arch=lp.arch, source=cute_gemm.entry_source(lp.desc, lp.arch, cfg, code),
        include_dirs=(), flags=(), dims=("M", "N", "K", "L"), args=names,
        scalars=tuple(l.name for l in code.scalars),
        alignment=tuple((names[t.ptr_index], 16 if t.tma else dtype_bytes(t.dtype)) for t in tensors),
        config=tuple(cfg.as_dict().items()))
    return em, cfg, None


def emit_spec(path: str | Path, archs: tuple[str, ...] | None = None, kernel: str | None = None,
              cache_root: Path | None = None, backend: str = "auto") -> EmittedSpec:
    """Plan and emit every kernel of a spec for every arch; all backend errors surface here,
    before nvcc runs.  backend: "auto" (the CuTe DSL where it can implement a GEMM, else CUTLASS
    C++), "cute" (an error where it cannot) or "cutlass"."""
    if backend not in BACKENDS:
        raise KspecError(f"unknown backend '{backend}'", hint="use one of: " + ", ".join(BACKENDS))
    program = load_spec(path)
    archs = tuple(archs or program.targets or ARCHS)
    veto = attention_veto(archs)
    kernels = [program.kernel(kernel)] if kernel else list(program.kernels)
    schedules = [plan_kernel(k, archs, veto) for k in kernels]
    plans: dict[str, list[EmittedPlan]] = {}
    for sched in schedules:
        for p in sched.plans:
            plans[p.id] = []
            lowered, cute = [], []
            for arch in archs:
                try:
                    lp = lower(sched, p, arch, None if backend == "cutlass" else "cute")
                    lowered.append(lp)
                    cute.append(_emit_cute(lp, backend))
                except KspecError as e:
                    raise _located(e, sched, p, arch, program) from None
            whys = [f"{lp.arch}: {why}" for lp, (_, _, why) in zip(lowered, cute) if why]
            all_cute = all(em is not None for em, _, _ in cute)
            if backend == "cute" and not all_cute:
                raise KspecError(f"kernel {sched.kernel.name} (plan {p.id}): the CuTe DSL backend cannot "
                                 f"implement it ({'; '.join(whys)})", op(sched.graph, p.group.anchor).span,
                                 "use --backend auto to fall back to the CUTLASS C++ backend", program.source)
            # A plan has one ABI (manifest args/scalars/dims) across archs.  The CuTe DSL backend
            # uses the CUTLASS C++ backend's argument order, so archs may differ in backend; when
            # the ABIs still differ (a plain CUDA fallback), every arch falls back.
            chosen: list[EmittedPlan] = []
            for lp, (cem, ccfg, why) in zip(lowered, cute):
                if cem is not None:
                    chosen.append(EmittedPlan(lp, cem, "cute", ccfg))
                    continue
                chosen.append(_emit_cpp(sched, p, lp, cache_root, program, why if backend == "auto" else None))
            abis = {(ep.emitted.args, ep.emitted.scalars, ep.emitted.dims) for ep in chosen}
            if len(abis) > 1:
                chosen = [ep if ep.backend != "cute" else
                          _emit_cpp(sched, p, ep.lowered, cache_root, program,
                                    "; ".join(whys) + " (and one ABI is needed on every arch)")
                          for ep in chosen]
            plans[p.id].extend(chosen)
    return EmittedSpec(program, archs, schedules, plans)


def _emit_cpp(sched, p, lp: LoweredPlan, cache_root, program, fallback: str | None) -> EmittedPlan:
    """The CUTLASS C++ (or plain CUDA) emission of a plan on lp.arch."""
    if p.kind == "gemm" and cutlass_can_run(sched, p) is not None and type(lp.desc).__name__ == "GemmDesc":
        lp = lower(sched, p, lp.arch)          # not for CUTLASS C++ either: a plain CUDA kernel
    try:
        em = emit_cached(lp.desc, cache_root)
    except KspecError as e:
        raise _located(e, sched, p, lp.arch, program) from None
    return EmittedPlan(lp, em, fallback=fallback)


def _located(e: KspecError, sched, p, arch, program) -> KspecError:
    if e.span is None and not e.message.startswith("kernel "):
        # a backend message about a descriptor: say which kernel and arch, and where
        return KspecError(f"kernel {sched.kernel.name} (plan {p.id}) on {arch}: {e.message}",
                          op(sched.graph, p.group.anchor).span, e.hint, program.source)
    return e.with_source(program.source)


class Progress:
    """A compact live display of kernel x arch builds (one line per event when not a terminal)."""

    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.t0 = time.monotonic()

    def __call__(self, ev) -> None:
        if not self.enabled:
            return
        total = time.monotonic() - self.t0
        if ev.kind == "start":
            msg = f"[{ev.finished}/{ev.total}] compiling {ev.job.label} ({ev.job.kind})"
        elif ev.kind == "cached":
            msg = f"[{ev.finished}/{ev.total}] cached    {ev.job.label} ({ev.job.kind})"
        elif ev.kind == "running":
            msg = f"[{ev.finished}/{ev.total}] ...       {ev.job.label} ({ev.job.kind}) {ev.elapsed:.0f}s"
        elif ev.kind == "done":
            msg = f"[{ev.finished}/{ev.total}] built     {ev.job.label} ({ev.job.kind}) in {ev.elapsed:.1f}s"
        else:
            msg = f"[{ev.finished}/{ev.total}] FAILED    {ev.job.label} ({ev.job.kind}) after {ev.elapsed:.1f}s"
        print(f"{msg}   [{total:6.1f}s]", file=self.stream, flush=True)


def _jobs(emitted: EmittedSpec):
    from kspec.backends.build import BuildJob
    from kspec.backends.cutlass.compat import cutlass_version
    identity = f"nvidia-cutlass {cutlass_version()}"
    jobs = []
    for plist in emitted.plans.values():
        for ep in plist:
            em = ep.emitted
            if ep.backend != "cutlass":
                continue
            for kind in ("cubin", "host"):
                jobs.append(BuildJob(ep.label, em.source, em.arch, kind, em.include_dirs, em.flags, identity))
    return jobs


def compile_spec(path: str | Path, archs: tuple[str, ...] | None = None, out_dir: str | Path = "build",
                 kernel: str | None = None, jobs: int | None = None, cache=None,
                 progress: Callable | None = None, backend: str = "auto") -> Path:
    """Compile a spec to an artifact directory `out_dir/<spec stem>/`; returns its path.
    backend: see `emit_spec`."""
    from kspec.artifact import (Binary, KernelEntry, Manifest, ParamSpec, SpecRef, TensorSpec, make_binary,
                                write_manifest)
    from kspec.backends.build import CompileCache, build_all
    from kspec.backends.cutlass.compat import cutlass_version
    from kspec.backends.toolchain import find_toolchain

    cache = cache or CompileCache()
    emitted = emit_spec(path, archs, kernel, cache.root, backend)
    build_jobs = _jobs(emitted)
    # nvcc is needed for CUTLASS C++ / plain CUDA jobs; otherwise the toolchain (cuobjdump, for the
    # register and shared-memory counts) is looked up only when those counts are not memoised
    toolchain = _toolchain(required=True) if build_jobs else _LazyToolchain()
    if progress is not None:
        for plist in emitted.plans.values():
            for ep in plist:
                if ep.fallback:
                    print(f"note: {ep.label}: CUTLASS C++ backend (the CuTe DSL backend cannot: {ep.fallback})",
                          file=getattr(progress, "stream", sys.stderr))
    cute_built = _build_cute(emitted, cache.root, jobs, progress)
    results = build_all(build_jobs, toolchain, cache, max_parallel=jobs, progress=progress) if build_jobs else []
    by_job = {(r.job.label, r.job.kind): r for r in results}

    stem = Path(path).stem
    target = Path(out_dir) / stem
    staging = Path(out_dir) / f".{stem}.tmp{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        entries = []
        for sched in emitted.schedules:
            k = sched.kernel
            plans = []
            for p in sched.plans:
                binaries: dict[str, Binary] = {}
                first = emitted.plans[p.id][0]
                for ep in emitted.plans[p.id]:
                    arch = ep.lowered.arch
                    cubin, host = f"{p.id}.{arch}.cubin", f"{p.id}.{arch}.so"
                    if ep.backend == "cute":
                        cb = cute_built[ep.label]
                        shutil.copyfile(cb.cubin, staging / cubin)
                        shutil.copyfile(cb.host, staging / host)
                        regs, smem = _resources(staging / cubin, toolchain, cache.root, cb.symbol)
                        config = dict(cb.config)
                        config["param_offsets"] = ",".join(map(str, cb.param_offsets))
                        binaries[arch] = make_binary(staging, cubin, host, symbol=cb.symbol, config=config,
                                                     registers=regs, smem=smem)
                        if cb.args != ep.emitted.args or cb.scalars != ep.emitted.scalars:
                            raise KspecInternalError(f"plan {p.id}: the CuTe DSL build's ABI differs from its emission")
                    else:
                        shutil.copyfile(by_job[(ep.label, "cubin")].path, staging / cubin)
                        shutil.copyfile(by_job[(ep.label, "host")].path, staging / host)
                        regs, smem = _resources(staging / cubin, toolchain, cache.root)
                        binaries[arch] = make_binary(staging, cubin, host, config=dict(ep.emitted.config),
                                                     registers=regs, smem=smem)
                    if ep.emitted.args != first.emitted.args or ep.emitted.scalars != first.emitted.scalars:
                        raise KspecError(f"internal: plan {p.id} has a different ABI on {arch}")
                plans.append(_plan_entry(p, first, binaries))
            entries.append(KernelEntry(
                name=k.name,
                inputs=tuple(TensorSpec(t.name, t.dtype, t.shape, t.layout) for t in k.inputs),
                outputs=tuple(TensorSpec(t.name, t.dtype, t.shape, t.layout) for t in k.outputs),
                params=tuple(ParamSpec(t.name, t.dtype, t.default) for t in k.params),
                intermediates=tuple(TensorSpec(b.name, b.dtype, b.shape, b.layout) for b in sched.intermediates),
                plans=tuple(plans)))
        spec_text = emitted.program.source.encode()
        manifest = Manifest(spec=SpecRef(Path(path).name, hashlib.sha256(spec_text).hexdigest()),
                            archs=emitted.archs, kernels=tuple(entries),
                            toolchain=_toolchain_versions(emitted, toolchain),
                            kspec_version=kspec.__version__)
        shutil.copyfile(path, staging / Path(path).name)
        write_manifest(staging, manifest)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


class _LazyToolchain:
    """find_toolchain() on first use (None when there is none): a warm CuTe DSL-only compile runs
    no subprocess at all."""

    def __init__(self):
        self._tc: list = []

    def get(self):
        if not self._tc:
            self._tc.append(_toolchain(required=False))
        return self._tc[0]

    @property
    def version(self):
        tc = self.get()
        return tc.version if tc is not None else "none"


def _toolchain(required: bool):
    """The nvcc toolchain; only required when a plan uses the CUTLASS C++ backend (cuobjdump, when
    present, also gives register/shared-memory counts for `kspec inspect`)."""
    from kspec.backends.toolchain import find_toolchain
    try:
        return find_toolchain()
    except KspecError:
        if required:
            raise
        return None


def _toolchain_versions(emitted: EmittedSpec, toolchain) -> dict:
    backends = {ep.backend for plist in emitted.plans.values() for ep in plist}
    out = {}
    if "cutlass" in backends or not backends:
        from kspec.backends.cutlass.compat import cutlass_version
        out["nvcc"] = toolchain.version if toolchain is not None else "none"
        out["cutlass"] = cutlass_version()
    if "cute" in backends:
        from kspec.backends.cute import compat as cute_compat
        out["cutlass-dsl"] = f"{cute_compat.dsl_version()} ({cute_compat.cuda_flavour()})"
    return out


def _build_cute(emitted: EmittedSpec, cache_root: Path, jobs: int | None, progress) -> dict:
    """Build every CuTe DSL plan (cache lookups first, misses in parallel); label -> CuteBuild."""
    items = [ep for plist in emitted.plans.values() for ep in plist if ep.backend == "cute"]
    if not items:
        return {}
    from kspec.backends.cute.parallel import CuteJob, build_many
    cjobs = [CuteJob(ep.label, ep.lowered.desc, ep.lowered.arch, ep.cute_config) for ep in items]
    built = build_many(cjobs, Path(cache_root), max_parallel=jobs, progress=progress)
    return {j.label: b for j, b in zip(cjobs, built)}


def _plan_entry(p, ep: EmittedPlan, binaries):
    from kspec.artifact import Plan
    lp, em = ep.lowered, ep.emitted
    names = lp.names
    dims = dict(lp.dims)
    return Plan(
        id=p.id, kind=p.kind if p.kind in ("gemm", "attention") else "elementwise",
        dims=tuple((role, dims[role]) for role in em.dims),
        args=tuple(names[a] for a in em.args),
        scalars=tuple(lp.scalars[s] for s in em.scalars),
        init={names[n]: v for n, v in em.init},
        alignment={names[n]: a for n, a in em.alignment},
        binaries=binaries)


def _resources(cubin: Path, toolchain, cache_root: Path | None = None,
               symbol: str = "kspec_kernel") -> tuple[int | None, int | None]:
    """Registers and static shared memory of the entry point, when cuobjdump is available
    (remembered per cubin digest under the cache root, so a warm compile runs no cuobjdump)."""
    import json

    from kspec.artifact import sha256_file
    from kspec.backends.inspect import sass_summary
    memo = cache_root / "resources" / f"{sha256_file(cubin)}.json" if cache_root else None
    if memo is not None and memo.is_file():
        try:
            regs, smem = json.loads(memo.read_text())
            return regs, smem
        except (ValueError, TypeError):
            pass
    if isinstance(toolchain, _LazyToolchain):
        toolchain = toolchain.get()
    if toolchain is None or toolchain.cuobjdump is None:
        return None, None
    try:
        k = sass_summary(cubin, toolchain).kernel(symbol)
    except (KspecError, KeyError):
        return None, None
    if memo is not None:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps([k.registers, k.shared_bytes]))
        os.replace(tmp, memo)
    return k.registers, k.shared_bytes


def write_emitted(emitted: EmittedSpec, out_dir: str | Path, stem: str) -> list[Path]:
    """`--emit-only`: write each plan's generated source per arch under out_dir/<stem>/ (`.cu` C++
    for the CUTLASS and generic backends, `.py` for the CuTe DSL backend)."""
    d = Path(out_dir) / stem
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for pid, plist in emitted.plans.items():
        for ep in plist:
            p = d / f"{pid}.{ep.lowered.arch}.{'py' if ep.backend == 'cute' else 'cu'}"
            p.write_text(ep.emitted.source)
            paths.append(p)
    return paths
