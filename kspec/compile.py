"""`kspec compile`: spec -> plans (kernel IR + backend per arch) -> backend lowering -> source ->
toolchain (cached, parallel) -> artifact.

    compile_spec(path, archs, out_dir)       the whole job; returns the artifact directory
    emit_spec(path, archs)                   everything up to the generated source (no toolchain)
    prepare_output(out_dir)                  the output directory, checked writable before any build

An artifact is staged in a locked work directory beside it (`.<stem>.<random>.kspec-work`, see
backends/cache.py) and renamed into place whole; a killed compile's staging is reclaimed by the
next compile into the same directory.  A problem writing it (a read-only directory, a path that
is a file, a full disk) is a KspecError naming the path: exit 1, not an internal error.
"""
from __future__ import annotations

import dataclasses

import hashlib
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import kspec
from kspec.backends import cache as cache_entry
from kspec.backends import registry
from kspec.backends.api import LoweredPlan, SettingError
from kspec.backends.desc import EmittedKernel
from kspec.compiler import KernelSchedule, plan_kernel
from kspec.compiler.indices import guarded_sentinels, index_ranges, merge_index_ranges, with_sentinels
from kspec.core import ARCHS, DEFAULT_OUT_DIR, KspecInternalError, file_stem, packed_rows_symbol
from kspec.spec_lang import CheckedProgram, KspecError, load_spec

if TYPE_CHECKING:
    from kspec.artifact import TensorSpec


@dataclass(frozen=True)
class EmittedPlan:
    lowered: LoweredPlan
    emitted: EmittedKernel

    @property
    def backend(self) -> str:
        return self.lowered.backend

    @property
    def label(self) -> str:
        return f"kernel {self.lowered.ir.id} on {self.lowered.arch.replace('sm', 'sm_')}"


@dataclass
class EmittedSpec:
    program: CheckedProgram
    archs: tuple[str, ...]
    schedules: list[KernelSchedule]
    plans: dict[str, list[EmittedPlan]]      # plan id -> one per arch (in `archs` order)


def _generator_identity(backend) -> str:
    """Hash of a backend's own source (its module or folder, plus the shared backend modules) and
    its identity: an emitted kernel is reused only while they are unchanged."""
    import kspec.backends as backends
    h = hashlib.sha256(kspec.__version__.encode() + backend.identity().encode())
    root = Path(backends.__file__).parent
    mod = Path(sys.modules[type(backend).__module__].__file__)
    own = mod.parent if mod.parent != root else mod
    files = sorted(root.glob("*.py")) + (sorted(own.rglob("*.py")) if own.is_dir() else [own])
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


_GENERATOR_ID: dict[str, str] = {}


def emit_cached(lowered: LoweredPlan, cache_root: Path | None, memo_only: bool = False) -> EmittedKernel | None:
    """backend.emit(lowered), memoised on disk: planning through cutlass_cppgen costs seconds per
    kernel, and a warm `kspec compile` should not pay it.  Entries are JSON, written atomically.
    memo_only: return None instead of emitting when the memo has no entry."""
    from dataclasses import asdict
    backend = registry.get(lowered.backend)
    if cache_root is None:
        return backend.emit(lowered)
    if backend.name not in _GENERATOR_ID:
        _GENERATOR_ID[backend.name] = _generator_identity(backend)
    key = hashlib.sha256((_GENERATOR_ID[backend.name] + repr(lowered.desc)).encode()).hexdigest()
    path = cache_root / "emit" / f"{key}.json"
    data = cache_entry.json_get(path)
    if data is not None:
        try:
            data["include_dirs"] = _resolve_include_dirs(data["include_dirs"])
            fields = {k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
                      for k, v in data.items()}
            return EmittedKernel(**fields)
        except (ValueError, TypeError, KeyError):
            pass        # written by another kspec version: replaced below
    if memo_only:
        return None
    em = backend.emit(lowered)
    data = asdict(em)
    portable = _portable_include_dirs(em.include_dirs)
    if portable is None:
        return em       # an include dir outside the CUTLASS tree: not memoised (no machine paths on disk)
    data["include_dirs"] = portable
    cache_entry.json_put(path, data)
    return em


# The emit memo outlives the machine paths of the code generator's inputs (a moved venv, a cache
# copied to another machine): include dirs are stored relative to the CUTLASS source tree and
# resolved against this machine's tree when read.
_CUTLASS_PREFIX = "cutlass:"


def _portable_include_dirs(dirs) -> list[str] | None:
    if not dirs:
        return []
    from kspec.backends.cutlass.compat import cutlass_source_dir
    root = os.path.realpath(cutlass_source_dir())
    out = []
    for d in dirs:
        rel = os.path.relpath(os.path.realpath(d), root)
        if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
            return None
        out.append(_CUTLASS_PREFIX + rel.replace(os.sep, "/"))
    return out


def _resolve_include_dirs(stored) -> list[str]:
    """Absolute include dirs on this machine; ValueError (a memo miss) for anything else."""
    if not isinstance(stored, list) or not all(isinstance(d, str) and d.startswith(_CUTLASS_PREFIX)
                                               for d in stored):
        raise ValueError("include dirs of an older memo format")
    if not stored:
        return []
    from kspec.backends.cutlass.compat import cutlass_source_dir
    root = cutlass_source_dir()
    out = [os.path.join(root, *d[len(_CUTLASS_PREFIX):].split("/")) for d in stored]
    if not all(os.path.isdir(d) for d in out):
        raise ValueError("CUTLASS tree without the memoised include dirs")
    return out


def plan_spec(program: CheckedProgram, archs: tuple[str, ...], kernel: str | None = None,
              backend: str | None = None, strict: bool = False, fuse_ops: bool = True,
              sizes: dict[str, int] | None = None) -> list[KernelSchedule]:
    """Plan every kernel of a checked spec, choosing a backend per kernel and arch through the
    registry (what `kspec graph`, `kspec lower` and `kspec compile` all use).  sizes: the `--sizes`
    bucket, which a kernel may need (a GQA group known only per call)."""
    planner = registry.Planner(backend, strict, sizes)
    kernels = [program.kernel(kernel)] if kernel else list(program.kernels)
    try:
        return [plan_kernel(k, archs, planner, fuse_ops=fuse_ops) for k in kernels]
    except KspecError as e:
        raise e.with_source(program.source)


# (kernel IR, arch, backend name) -> a configuration from the backend's candidates, or None for
# its default (kspec.tune.TuningDB.chooser looks winners up in a tuning database)
ConfigChooser = Callable[..., "tuple[tuple[str, str], ...] | None"]


def with_sm_counts(b, ir, arch: str, config, sm_counts: dict[str, tuple[int, ...]] | None):
    """config with its "sm_count" item set to the SM counts (GPU SKUs) asked for `arch`, for a backend
    whose configuration of this kernel records one (its binaries depend on the SKU: FlashAttention-4
    bakes the SM count into its launcher and its kernel choice); other kernels read the SM count at
    launch, so the option leaves them as they are."""
    if not sm_counts or arch not in sm_counts:
        return config
    base = config or b.default_config(ir, arch)
    if "sm_count" not in dict(base):
        return config
    return tuple((k, ",".join(map(str, sm_counts[arch])) if k == "sm_count" else v) for k, v in base)


def with_sizes(b, ir, arch: str, config, sizes: dict[str, int] | None):
    """config with a "sizes" item (the `--sizes` text) for a kernel whose build depends on a size it
    cannot know from the spec: a FlashAttention-4 attention whose GQA group is known only per call
    (its config's gqa_group says "per call"), built for the group those sizes name."""
    if not sizes:
        return config
    base = config or b.default_config(ir, arch)
    if not dict(base).get("gqa_group", "").startswith("per call"):
        return config
    return (*base, ("sizes", ",".join(f"{k}={v}" for k, v in sorted(sizes.items()))))


def emit_spec(path: str | Path, archs: tuple[str, ...] | None = None, kernel: str | None = None,
              cache_root: Path | None = None, backend: str | None = None, strict: bool = False,
              tuned: ConfigChooser | None = None, sm_counts: dict[str, tuple[int, ...]] | None = None,
              sizes: dict[str, int] | None = None) -> EmittedSpec:
    """Plan and emit every kernel of a spec for every arch; all backend errors surface here,
    before any toolchain runs.  tuned: picks each kernel's configuration (default: the backend's);
    sm_counts: arch -> the SM counts of the GPU SKUs to build SKU-specific kernels for (with_sm_counts;
    default: one per arch, backends.cute.compat.OFFLINE_SM_COUNT); sizes: the `--sizes` bucket, which
    also names the group of a GQA attention whose group is known only per call (with_sizes)."""
    program = load_spec(path)
    archs = tuple(archs or program.targets or ARCHS)
    schedules = plan_spec(program, archs, kernel, backend, strict, sizes=sizes)
    plans: dict[str, list[EmittedPlan]] = {}
    for sched in schedules:
        for p in sched.plans:
            plans[p.id] = []
            for arch in archs:
                choice = p.choices[arch]
                try:
                    config = tuned(p.ir, arch, choice.backend) if tuned else None
                    b = registry.get(choice.backend)
                    config = with_sm_counts(b, p.ir, arch, config, sm_counts)
                    config = with_sizes(b, p.ir, arch, config, sizes)
                    lp = b.lower(p.ir, arch, config) if config else b.lower(p.ir, arch)
                    em = emit_cached(lp, cache_root)
                except KspecError as e:
                    raise _located(e, sched, p, arch, program) from None
                plans[p.id].append(EmittedPlan(lp, em))
            _one_abi(plans[p.id], sched, p, cache_root, program, sm_counts, sizes)
    return EmittedSpec(program, archs, schedules, plans)


def _one_abi(eps: list[EmittedPlan], sched, p, cache_root, program, sm_counts=None, sizes=None) -> None:
    """A plan has one ABI (manifest args, scalars, dims) on every arch.  The CuTe DSL and CUTLASS
    backends share an argument order, so archs may differ in backend; where the ABIs still differ,
    the archs whose backend does not match the first arch's are rebuilt by that backend."""
    if any(ep.emitted is None for ep in eps):
        return                      # emission stubbed out (tests): nothing to compare
    abis = {(ep.emitted.args, ep.emitted.scalars, ep.emitted.dims) for ep in eps}
    if len(abis) <= 1:
        return
    first = registry.get(eps[0].backend)
    for i, ep in enumerate(eps[1:], 1):
        if (ep.emitted.args, ep.emitted.scalars, ep.emitted.dims) == (eps[0].emitted.args, eps[0].emitted.scalars,
                                                                      eps[0].emitted.dims):
            continue
        why = first.can_implement(p.ir, ep.lowered.arch)
        if why is not None:
            raise KspecInternalError(f"plan {p.id}: backends {eps[0].backend} and {ep.backend} give different "
                                     f"ABIs and {first.name} cannot build {ep.lowered.arch}: {why}")
        try:
            config = with_sizes(first, p.ir, ep.lowered.arch, with_sm_counts(first, p.ir, ep.lowered.arch, None,
                                                                             sm_counts), sizes)
            lp = first.lower(p.ir, ep.lowered.arch, config) if config else first.lower(p.ir, ep.lowered.arch)
            eps[i] = EmittedPlan(lp, emit_cached(lp, cache_root))
        except KspecError as e:
            raise _located(e, sched, p, ep.lowered.arch, program) from None
        p.choices[ep.lowered.arch] = p.choices[eps[0].lowered.arch].__class__(
            first.name, p.ir.kind, None, first.default_config(p.ir, ep.lowered.arch),
            ((ep.backend, "one ABI is needed on every arch"),))


def _located(e: KspecError, sched, p, arch, program) -> KspecError:
    if isinstance(e, SettingError) and (span := p.ir.hint(arch).span_of(e.setting)) is not None:
        # a schedule setting the backend found wrong only at emit: reported where it is written
        return KspecError(f"kernel {sched.kernel.name} (plan {p.id}) on {arch}: {e.message}", span, e.hint,
                          program.source)
    if e.span is None and not e.message.startswith("kernel "):
        # a backend message about a descriptor: say which kernel and arch, and where
        return KspecError(f"kernel {sched.kernel.name} (plan {p.id}) on {arch}: {e.message}",
                          p.ir.span, e.hint, program.source)
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


class _OneCounter:
    """One `[i/n]` count over a compile's two build phases: the backends that build their own binaries
    (the CuTe DSL; `first`) and then the nvcc jobs (`then`, `later` of them, known up front)."""

    def __init__(self, progress: Callable, later: int):
        self.progress, self.later, self.before = progress, later, 0

    def first(self, ev) -> None:
        self.before = max(self.before, ev.total)
        self.progress(dataclasses.replace(ev, total=ev.total + self.later))

    def then(self, ev) -> None:
        self.progress(dataclasses.replace(ev, finished=ev.finished + self.before, total=ev.total + self.before))


def _jobs(emitted: EmittedSpec):
    jobs = []
    for plist in emitted.plans.values():
        for ep in plist:
            jobs += registry.get(ep.lowered.backend).build_jobs(ep.emitted, ep.label)
    return jobs


def compile_spec(path: str | Path, archs: tuple[str, ...] | None = None, out_dir: str | Path = DEFAULT_OUT_DIR,
                 kernel: str | None = None, jobs: int | None = None, cache=None,
                 progress: Callable | None = None, backend: str | None = None, strict: bool = False,
                 emitted: EmittedSpec | None = None, tuned: ConfigChooser | None = None,
                 toolchain=None, sm_counts: dict[str, tuple[int, ...]] | None = None,
                 sizes: dict[str, int] | None = None) -> Path:
    """Compile a spec to an artifact directory `out_dir/<spec stem>/`; returns its path.
    `emitted`: the spec already planned and emitted (by `emit_spec` with the same arguments);
    `tuned`, `sm_counts`, `sizes`: see emit_spec."""
    from kspec.backends.build import CompileCache, build_all

    cache = cache or CompileCache()
    prepare_output(out_dir, create=False)
    emitted = emitted or emit_spec(path, archs, kernel, cache.root, backend, strict, tuned, sm_counts, sizes)
    out = prepare_output(out_dir)
    cache.reclaim()
    build_jobs = _jobs(emitted)
    # nvcc is needed for CUTLASS C++ / plain CUDA jobs; otherwise the toolchain (cuobjdump, for the
    # register and shared-memory counts) is looked up only when those counts are not memoised
    if toolchain is None:
        toolchain = _toolchain(required=True) if build_jobs else _LazyToolchain()
    counted = _OneCounter(progress, len(build_jobs)) if progress is not None else None
    built = _build_binaries(emitted, cache.root, jobs, counted and counted.first)
    results = build_all(build_jobs, toolchain, cache, max_parallel=jobs,
                        progress=counted and counted.then) if build_jobs else []
    by_job = {(r.job.label, r.job.kind): r for r in results}

    stem = Path(path).stem
    target = out / stem
    cache_entry.reclaim_dir(out, work_only=True)
    try:
        with cache_entry.workdir(out, f".{stem[:64]}.") as staging:
            _write_artifact(path, staging, target, emitted, built, by_job, toolchain, cache, build_jobs)
    except OSError as e:
        raise _write_error(e, target) from None
    return target


def _write_error(e: OSError, target: Path) -> KspecError:
    where = f"{e.filename}: " if e.filename and str(e.filename) != str(target) else ""
    return KspecError(f"cannot write the artifact {target}: {where}{e.strerror or e}",
                      hint="check the output directory (-o): its permissions and free space")


def prepare_output(out_dir: str | Path, create: bool = True) -> Path:
    """`out_dir`, checked to take new files: a KspecError naming the path and the problem
    otherwise (a file, /dev/null, a read-only or special directory).  create=False checks without
    creating anything (the nearest existing folder must take a new one): for before a spec is
    planned, since a refused spec writes nothing."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        kind = "a file" if out.is_file() else "not a directory"
        raise KspecError(f"the output directory {out} is {kind}", hint="give -o a directory (it is created if needed)")
    base = out
    for up in (out, *out.parents):
        if up.exists():
            if not up.is_dir():
                raise KspecError(f"cannot create the output directory {out}: {up} is a file",
                                 hint="give -o a directory (it is created if needed)")
            base = up
            break
    try:
        if create:
            out.mkdir(parents=True, exist_ok=True)
            base = out
        probe = base / f".probe-{os.getpid()}-{time.monotonic_ns()}{cache_entry.NEW_SUFFIX}"
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as e:
        why = e.strerror or str(e)
        if isinstance(e, FileNotFoundError) and base.is_dir():
            why = f"it does not take new files ({why})"          # /proc/self and the like
        where = out if base == out else f"{out} ({base})"
        raise KspecError(f"cannot write to the output directory {where}: {why}",
                         hint="give -o a writable directory") from None
    return out


def _write_artifact(path, staging: Path, target: Path, emitted: EmittedSpec, built, by_job, toolchain, cache,
                    build_jobs) -> None:
    """Fill `staging` with the artifact and rename it to `target` (an older one is replaced)."""
    from kspec.artifact import (Binary, KernelEntry, Manifest, ParamSpec, SpecRef, TensorSpec, make_binary,
                                write_manifest)
    entries = []
    for sched in emitted.schedules:
        k = sched.kernel
        plans = []
        for p in sched.plans:
            binaries: dict[str, Binary] = {}
            first = emitted.plans[p.id][0]
            for ep in emitted.plans[p.id]:
                arch = ep.lowered.arch
                cubin, host = f"{file_stem(p.id)}.{arch}.cubin", f"{file_stem(p.id)}.{arch}.so"
                prebuilt = built.get(ep.label)
                if prebuilt is not None and getattr(prebuilt, "variants", None):
                    binaries[arch] = _variant_binary(staging, p, arch, prebuilt, ep, toolchain, cache.root)
                elif prebuilt is not None:          # a backend that builds its own binaries (CuTe DSL)
                    shutil.copyfile(prebuilt.cubin, staging / cubin)
                    shutil.copyfile(prebuilt.host, staging / host)
                    regs, smem = _resources(staging / cubin, toolchain, cache.root, prebuilt.symbol)
                    config = dict(prebuilt.config)
                    config["param_offsets"] = ",".join(map(str, prebuilt.param_offsets))
                    binaries[arch] = make_binary(staging, cubin, host, symbol=prebuilt.symbol, config=config,
                                                 registers=regs, smem=smem, backend=ep.lowered.backend,
                                                 kind=p.choices[arch].kind)
                    if prebuilt.args != ep.emitted.args or prebuilt.scalars != ep.emitted.scalars:
                        raise KspecInternalError(f"plan {p.id}: the {ep.lowered.backend} build's ABI differs "
                                                 "from its emission")
                else:
                    shutil.copyfile(by_job[(ep.label, "cubin")].path, staging / cubin)
                    shutil.copyfile(by_job[(ep.label, "host")].path, staging / host)
                    regs, smem = _resources(staging / cubin, toolchain, cache.root)
                    binaries[arch] = make_binary(staging, cubin, host, config=dict(ep.emitted.config),
                                                 registers=regs, smem=smem, backend=ep.lowered.backend,
                                                 kind=p.choices[arch].kind)
                if ep.emitted.args != first.emitted.args or ep.emitted.scalars != first.emitted.scalars:
                    raise KspecInternalError(f"plan {p.id} has a different ABI on {arch}")
            plans.append(_plan_entry(p, first, binaries, _squeezed(sched), emitted.plans[p.id]))
        entries.append(KernelEntry(
            name=k.name,
            inputs=tuple(_tensor_spec(t) for t in k.inputs),
            outputs=tuple(_tensor_spec(t) for t in k.outputs),
            params=tuple(ParamSpec(t.name, t.dtype, t.default) for t in k.params),
            intermediates=tuple(TensorSpec(b.name, b.dtype, b.shape, b.layout) for b in sched.intermediates),
            plans=tuple(plans),
            index_ranges=with_sentinels(merge_index_ranges(r for p in sched.plans for r in index_ranges(p.ir)),
                                        guarded_sentinels(sched.graph))))
    spec_text = emitted.program.source.encode()
    manifest = Manifest(spec=SpecRef(Path(path).name, hashlib.sha256(spec_text).hexdigest()),
                        archs=emitted.archs, kernels=tuple(entries),
                        toolchain=_toolchain_versions(emitted, toolchain if build_jobs else None),
                        kspec_version=kspec.__version__)
    shutil.copyfile(path, staging / Path(path).name)
    write_manifest(staging, manifest)
    old = None
    if target.is_dir() and not target.is_symlink():
        # aside first (a name reclaim_dir removes if this process dies), then replaced
        old = target.with_name(f".{target.name[:64]}.old-{os.getpid()}-{time.monotonic_ns()}{cache_entry.WORK_SUFFIX}")
        os.rename(target, old)
    elif target.exists() or target.is_symlink():
        raise KspecError(f"cannot write the artifact {target}: a file of that name is in the way",
                         hint="remove it, or give -o another directory")
    os.replace(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _tensor_spec(t) -> TensorSpec:
    """A spec tensor as the manifest records it: a packed one by its storage shape [cu_rows, ...]."""
    from kspec.artifact import TensorSpec
    if t.packed:
        return TensorSpec(t.name, t.dtype, (packed_rows_symbol(t.packed), *t.shape[2:]), t.layout, t.packed)
    return TensorSpec(t.name, t.dtype, t.shape, t.layout)


def _variant_binary(staging: Path, p, arch: str, built, ep, toolchain, cache_root):
    """A Binary with size-bucketed variants (FlashAttention-4 kernels: artifact.Variant), the first
    variant's files as the binary's own; variants with the same files (one kernel serving other
    sizes on another SKU) share them; the binary's config keeps the build's own sm_count (every SKU)."""
    from kspec.artifact import Variant, make_binary, sha256_file
    variants = []
    files: dict[tuple[str, str], tuple[str, str]] = {}
    for k, v in enumerate(built.variants):
        same = (sha256_file(Path(v.cubin)), sha256_file(Path(v.host)))
        if same not in files:
            files[same] = f"{file_stem(p.id)}.{arch}.v{k}.cubin", f"{file_stem(p.id)}.{arch}.v{k}.so"
            shutil.copyfile(v.cubin, staging / files[same][0])
            shutil.copyfile(v.host, staging / files[same][1])
        cubin, host = files[same]
        config = {**dict(v.config), "param_offsets": ",".join(map(str, v.param_offsets))}
        select = tuple({r: (lo, hi) for r, (lo, hi) in box.items()} for box in v.select)
        variants.append(Variant(cubin, host, {"cubin": sha256_file(staging / cubin), "host": sha256_file(staging / host)},
                                v.symbol, config, select))
    first = variants[0]
    regs, smem = _resources(staging / first.cubin, toolchain, cache_root, first.symbol)
    if built.args != ep.emitted.args or built.scalars != ep.emitted.scalars:
        raise KspecInternalError(f"plan {p.id}: the {ep.lowered.backend} build's ABI differs from its emission")
    b = make_binary(staging, first.cubin, first.host, symbol=first.symbol, config={**first.config, **dict(built.config)},
                    registers=regs, smem=smem, backend=ep.lowered.backend, kind=p.choices[arch].kind)
    from dataclasses import replace
    return replace(b, variants=tuple(variants))


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
    """The manifest's toolchain record: each backend used, and nvcc when one built with it."""
    used = sorted({ep.backend for plist in emitted.plans.values() for ep in plist})
    out = {f"backend:{n}": registry.get(n).identity() for n in used}
    if toolchain is not None:
        out["nvcc"] = toolchain.version
    return out


def _build_binaries(emitted: EmittedSpec, cache_root: Path, jobs: int | None, progress) -> dict:
    """Binaries of the backends that build their own (no nvcc jobs; the CuTe DSL): label -> build."""
    out: dict = {}
    by_backend: dict[str, list] = {}
    for plist in emitted.plans.values():
        for ep in plist:
            by_backend.setdefault(ep.backend, []).append((ep.label, ep.lowered))
    for name, items in by_backend.items():
        b = registry.get(name)
        if hasattr(b, "build_binaries"):
            out.update(b.build_binaries(items, cache_root, jobs, progress))
    return out


def _squeezed(sched) -> dict[str, tuple[int, ...]]:
    """Inputs the kernels read without some extent-1 axes (canon.squeeze_unit_reads): name -> those
    axes of the spec's tensor."""
    from kspec.compiler import op
    g = sched.graph
    return {op(g, n).name: op(g, n).squeezed for n in g.nodes if op(g, n).kind == "input" and op(g, n).squeezed}


def _spec_axis(squeezed: tuple[int, ...], axis: int) -> int:
    """The spec tensor's axis that axis `axis` of its squeezed view is."""
    kept = [k for k in range(axis + len(squeezed) + 1) if k not in squeezed]
    return kept[axis]


def _plan_entry(p, ep: EmittedPlan, binaries, squeezed: dict | None = None, every: list | None = None):
    """The manifest's plan from its first arch's emission `ep`; `every`: the emissions of every arch,
    whose size multiples all hold (the least common multiple per role)."""
    from kspec.artifact import Plan
    lp, em = ep.lowered, ep.emitted
    names = lp.names
    dims = dict(lp.dims)
    squeezed = squeezed or {}
    multiples: dict[str, int] = {}
    for e in every or [ep]:
        for role, m in (e.emitted.multiples if e.emitted is not None else ()):
            multiples[role] = math.lcm(multiples.get(role, 1), m)
    return Plan(
        id=p.id, kind=p.kind if p.kind in ("gemm", "attention") else "elementwise",
        dims=tuple((role, dims[role]) for role in em.dims),
        args=tuple(names[a] for a in em.args),
        scalars=tuple(lp.scalars[s] for s in em.scalars),
        init={names[n]: v for n, v in em.init},
        alignment={names[n]: a for n, a in em.alignment},
        binaries=binaries,
        strides={role: (names[a], _spec_axis(squeezed.get(names[a], ()), axis))
                 for role, a, axis in getattr(lp.desc, "strides", ())},
        multiples=multiples)


def _resources(cubin: Path, toolchain, cache_root: Path | None = None,
               symbol: str = "kspec_kernel") -> tuple[int | None, int | None]:
    """Registers and static shared memory of the entry point: read from the cubin's own ELF
    attributes (EIATTR_REGCOUNT, .nv.shared.<name>) in well under a millisecond; cuobjdump (about a
    second per cubin, remembered per cubin digest under the cache root) only when the cubin does not
    declare them."""
    from kspec.runtime.cubin import read_cubin
    try:
        info = read_cubin(cubin).kernels.get(symbol)
    except KspecError:              # not a cubin this parser reads: cuobjdump's view below
        info = None
    if info is not None and info.registers is not None:
        return info.registers, info.static_smem_bytes
    from kspec.artifact import sha256_file
    from kspec.backends.inspect import sass_summary
    memo = cache_root / "resources" / f"{sha256_file(cubin)}.json" if cache_root else None
    if memo is not None:
        try:
            regs, smem = cache_entry.json_get(memo)
            return regs, smem
        except (ValueError, TypeError):
            pass        # no memo (None does not unpack) or another version's
    if isinstance(toolchain, _LazyToolchain):
        toolchain = toolchain.get()
    if toolchain is None or toolchain.cuobjdump is None:
        return None, None
    try:
        k = sass_summary(cubin, toolchain).kernel(symbol)
    except (KspecError, KeyError):
        return None, None
    if memo is not None:
        cache_entry.json_put(memo, [k.registers, k.shared_bytes])
    return k.registers, k.shared_bytes


def write_emitted(emitted: EmittedSpec, out_dir: str | Path, stem: str) -> list[Path]:
    """`--emit-only`: write each plan's generated source per arch under out_dir/<stem>/ (`.cu` C++
    for the CUTLASS and generic backends, `.py` for the CuTe DSL backend)."""
    d = prepare_output(Path(out_dir) / stem)
    paths = []
    try:
        for pid, plist in emitted.plans.items():
            for ep in plist:
                p = d / f"{file_stem(pid)}.{ep.lowered.arch}.{'py' if ep.backend == 'cute' else 'cu'}"
                p.write_text(ep.emitted.source)
                paths.append(p)
    except OSError as e:
        raise KspecError(f"cannot write {e.filename or d}: {e.strerror or e}",
                         hint="check the output directory (-o): its permissions and free space") from None
    return paths
