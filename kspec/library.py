"""`kspec build`: compile a library of kernels (specs x archs x size buckets) in parallel.

A library manifest (TOML, or JSON with the same structure) lists what to build:

    [library]
    out = "out/lib"                   # relative to the manifest (default: out)
    archs = ["sm90a", "sm100a"]       # default for every spec (else the spec's target, else all)
    tuning_db = "kspec-tuning.json"   # optional: winners per kernel, arch and bucket (kspec tune)
    tune = true                       # rank missing tuning entries with the cost model first

    [buckets]                         # optional named size buckets
    decode = { M = 64 }
    prefill = { M = 8192 }

    [[specs]]
    path = "specs/*.kspec"            # a file or a glob, relative to the manifest
    archs = ["sm90a"]                 # optional overrides: archs, buckets (names), backend, strict
    buckets = ["decode", "prefill"]

`kspec build DIR` builds every `*.kspec` in DIR for the specs' archs, without buckets.

The work is split into tasks of one spec kernel on one arch in one bucket (`BuildTask`); each
task plans, emits and compiles its kernels into the content-addressed compile cache (so a re-run
is all cache hits, and concurrent builds, or workers killed mid-compile, never corrupt it).
Tasks run on a local process pool (`run_local`) or on Ray (`kspec.raybuild`).  The driver then
assembles each spec's artifact from the cache (`OUT/<stem>/`, or `OUT/<bucket>/<stem>/` per
bucket) and writes `OUT/library.json`, an index of the artifacts.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import glob
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from kspec.core import DEFAULT_OUT_DIR, KspecError, KspecInternalError, normalize_arch

INDEX_FORMAT = 1


# ---------------------------------------------------------------------------------------------
# The manifest
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Bucket:
    name: str
    sizes: tuple[tuple[str, int], ...]

    @property
    def as_dict(self) -> dict[str, int]:
        return dict(self.sizes)


@dataclass(frozen=True)
class SpecEntry:
    path: str                                  # absolute path of the .kspec file
    archs: tuple[str, ...] | None              # None: the spec's target, else every arch
    buckets: tuple[Bucket, ...] = ()
    backend: str | None = None
    strict: bool = False


@dataclass(frozen=True)
class Library:
    source: str                                # the manifest file or directory
    out: str
    specs: tuple[SpecEntry, ...]
    tuning_db: str | None = None
    tune: bool = False


_LIBRARY_KEYS = {"out", "archs", "tuning_db", "tune", "backend", "strict", "name"}
_SPEC_KEYS = {"path", "archs", "buckets", "backend", "strict"}


def _fail(where: str, message: str, hint: str | None = None) -> KspecError:
    return KspecError(f"{where}: {message}", hint=hint)


def _archs(value, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [x for x in value.split(",") if x.strip()]
    if not isinstance(value, list) or not value or not all(isinstance(x, str) for x in value):
        raise _fail(where, f"archs must be a list of arch names, got {value!r}")
    try:
        return tuple(dict.fromkeys(normalize_arch(x) for x in value))
    except KspecError as e:
        raise _fail(where, e.message, e.hint) from None


def load_library(path: str | os.PathLike, out: str | None = None) -> Library:
    """Read a library manifest (TOML/JSON) or a directory of specs; errors name the file and key."""
    p = Path(path)
    if p.is_dir():
        specs = sorted(p.glob("*.kspec"))
        if not specs:
            raise KspecError(f"{p}: no .kspec files in this directory")
        return Library(str(p), str(Path(out) if out else Path(DEFAULT_OUT_DIR)),
                       tuple(SpecEntry(str(s.resolve()), None) for s in specs))
    try:
        text = p.read_text()
    except OSError as e:
        raise KspecError(f"cannot read the library manifest {p}: {e.strerror or e}") from None
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise KspecError(f"{p}: not valid JSON: {e}") from None
    else:
        try:
            import tomllib
        except ModuleNotFoundError:          # Python 3.10
            import tomli as tomllib          # type: ignore[no-redef]
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise KspecError(f"{p}: not valid TOML: {e}") from None
    if not isinstance(data, dict):
        raise KspecError(f"{p}: a library manifest is a table with [library], [buckets] and [[specs]]")
    unknown = set(data) - {"library", "buckets", "specs"}
    if unknown:
        raise _fail(str(p), f"unknown section(s) {', '.join(sorted(unknown))}",
                    "sections: [library], [buckets], [[specs]]")
    base = p.parent
    lib = data.get("library", {})
    if not isinstance(lib, dict):
        raise _fail(f"{p} [library]", "must be a table")
    bad = set(lib) - _LIBRARY_KEYS
    if bad:
        raise _fail(f"{p} [library]", f"unknown key(s) {', '.join(sorted(bad))}",
                    f"keys: {', '.join(sorted(_LIBRARY_KEYS))}")
    lib_archs = _archs(lib["archs"], f"{p} [library] archs") if "archs" in lib else None

    buckets: dict[str, Bucket] = {}
    raw_buckets = data.get("buckets", {})
    if not isinstance(raw_buckets, dict):
        raise _fail(f"{p} [buckets]", "must be a table of name = { SYMBOL = size, ... }")
    from kspec.core import is_ident
    for name, sizes in raw_buckets.items():
        where = f"{p} [buckets] {name}"
        if not is_ident(name):
            raise _fail(where, "a bucket name must be an identifier (letters, digits, _)")
        if not isinstance(sizes, dict) or not sizes:
            raise _fail(where, "must be a table of symbol sizes, e.g. { M = 64 }")
        for sym, v in sizes.items():
            if not is_ident(sym) or not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise _fail(where, f"{sym} = {v!r}: sizes are positive integers of spec symbols")
        buckets[name] = Bucket(name, tuple(sorted(sizes.items())))

    raw_specs = data.get("specs", [])
    if not isinstance(raw_specs, list) or not raw_specs:
        raise _fail(str(p), "no [[specs]] entries", 'add [[specs]] with path = "some.kspec"')
    specs: list[SpecEntry] = []
    seen: set[str] = set()
    for i, s in enumerate(raw_specs):
        where = f"{p} [[specs]] #{i + 1}"
        if not isinstance(s, dict) or "path" not in s or not isinstance(s["path"], str):
            raise _fail(where, 'needs path = "FILE.kspec" (or a glob)')
        bad = set(s) - _SPEC_KEYS
        if bad:
            raise _fail(where, f"unknown key(s) {', '.join(sorted(bad))}", f"keys: {', '.join(sorted(_SPEC_KEYS))}")
        pattern = str(base / s["path"])
        files = sorted(glob.glob(pattern)) if any(c in s["path"] for c in "*?[") else [pattern]
        if not files:
            raise _fail(where, f"path {s['path']!r} matches no file")
        archs = _archs(s["archs"], f"{where} archs") if "archs" in s else lib_archs
        names = s.get("buckets", list(buckets))
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise _fail(where, f"buckets must be a list of bucket names, got {names!r}")
        missing = [n for n in names if n not in buckets]
        if missing:
            raise _fail(where, f"unknown bucket(s) {', '.join(missing)}",
                        f"buckets: {', '.join(buckets) or 'none are defined under [buckets]'}")
        backend = s.get("backend", lib.get("backend"))
        strict = bool(s.get("strict", lib.get("strict", False)))
        for f in files:
            fp = Path(f)
            if not fp.is_file():
                raise _fail(where, f"{s['path']!r}: no such spec file ({fp})")
            key = str(fp.resolve())
            if key in seen:
                raise _fail(where, f"{fp.name} is listed twice", "list each spec once; give it several buckets")
            seen.add(key)
            specs.append(SpecEntry(key, archs, tuple(buckets[n] for n in names), backend, strict))
    stems = [Path(s.path).stem for s in specs]
    dup = sorted({x for x in stems if stems.count(x) > 1})
    if dup:
        raise _fail(str(p), f"two specs named {dup[0]}.kspec would write the same artifact folder")
    out_dir = Path(out) if out else base / str(lib.get("out", DEFAULT_OUT_DIR))
    db = lib.get("tuning_db")
    return Library(str(p), str(out_dir), tuple(specs), str(base / db) if db else None, bool(lib.get("tune", False)))


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BuildTask:
    """One spec kernel on one arch in one size bucket; runs anywhere the cache root is mounted."""
    spec: str
    kernel: str
    arch: str
    bucket: str                                # "" when the spec has no buckets
    sizes: tuple[tuple[str, int], ...]
    cache_root: str
    backend: str | None = None
    strict: bool = False
    tuning_db: str | None = None
    tune: bool = False                         # rank this kernel's candidates first when the db has no winner

    @property
    def label(self) -> str:
        b = f" [{self.bucket}]" if self.bucket else ""
        return f"{Path(self.spec).name}:{self.kernel} {self.arch}{b}"


@dataclass(frozen=True)
class TaskResult:
    task: BuildTask
    ok: bool
    built: int = 0                  # nvcc runs this task made
    cached: int = 0                 # binaries found in the cache
    corrupt: int = 0                # cache entries that failed verification and were rebuilt
    seconds: float = 0.0            # wall time of the task
    compile_seconds: float = 0.0    # nvcc time of the binaries built by this task
    configs: tuple[str, ...] = ()   # per plan: "plan: backend tile=... cluster=..."
    error: str = ""
    host: str = ""
    attempts: int = 1

    @property
    def status(self) -> str:
        if not self.ok:
            return "FAILED"
        if self.corrupt:
            return "rebuilt"
        return "cached" if self.built == 0 else "built"


class _ToolchainMemo:
    """find_toolchain() once per worker process and environment (it runs nvcc --version; a pool
    worker runs many tasks)."""

    def __init__(self):
        self._found: dict[tuple, object] = {}

    def get(self, find):
        key = tuple(os.environ.get(v, "") for v in ("KSPEC_NVCC", "CUDA_HOME", "CUDA_PATH", "PATH"))
        if key not in self._found:
            self._found[key] = find()
        return self._found[key]


_TOOLCHAINS = _ToolchainMemo()


def run_task(task: BuildTask) -> TaskResult:
    """Plan, emit and compile one task's kernels into the shared cache.  A user-facing error
    (KspecError) is returned in the result; anything else is an internal fault and is raised."""
    import socket

    from kspec.backends.build import CompileCache, build_all
    from kspec.backends.toolchain import find_toolchain
    from kspec.compile import _jobs, emit_spec
    from kspec.tune import TuningDB, describe
    t0 = time.monotonic()
    host = f"{socket.gethostname()}:{os.getpid()}"
    cache = CompileCache(task.cache_root)
    try:
        if task.tune and task.tuning_db:
            from kspec.tune import tune_spec
            tune_spec(task.spec, (task.arch,), [dict(task.sizes)] if task.sizes else None, TuningDB(task.tuning_db),
                      cache_root=cache.root, measure_gpu=False, backend=task.backend, kernel=task.kernel,
                      only_missing=True)
        tuned = TuningDB(task.tuning_db).chooser(dict(task.sizes)) if task.tuning_db else None
        emitted = emit_spec(task.spec, (task.arch,), task.kernel, cache.root, task.backend, task.strict, tuned,
                            sizes=dict(task.sizes) if task.sizes else None)
        results = build_all(_jobs(emitted), _TOOLCHAINS.get(find_toolchain), cache, max_parallel=1)
    except KspecError as e:
        return TaskResult(task, False, seconds=time.monotonic() - t0, error=e.render(), host=host)
    configs = tuple(f"{pid}: {ep.lowered.backend} {describe(ep.emitted.config) if ep.emitted.config else ''}".rstrip()
                    for pid, plist in emitted.plans.items() for ep in plist)
    built = [r for r in results if not r.cached]
    return TaskResult(task, True, built=len(built), cached=len(results) - len(built), corrupt=cache.stats.corrupt,
                      seconds=time.monotonic() - t0, compile_seconds=sum(r.compile_seconds for r in built),
                      configs=configs, host=host)


def probe_task(task: BuildTask, programs: dict | None = None) -> tuple[TaskResult | None, int]:
    """(the task's result when everything it would build is already in the cache (generated
    sources in the emit memo, binaries verified), else None; corrupt cache entries it found and
    discarded).  Runs in the driver so that an incremental build starts no worker at all; it never
    emits or compiles."""
    from kspec.backends import registry
    from kspec.backends.build import CompileCache
    from kspec.backends.toolchain import find_toolchain
    from kspec.compile import emit_cached, plan_spec
    from kspec.spec_lang import load_spec
    from kspec.tune import TuningDB, describe
    t0 = time.monotonic()
    cache = CompileCache(task.cache_root)
    programs = {} if programs is None else programs
    try:
        if task.spec not in programs:
            programs[task.spec] = load_spec(task.spec)
        scheds = plan_spec(programs[task.spec], (task.arch,), task.kernel, task.backend, task.strict,
                           sizes=dict(task.sizes) if task.sizes else None)
        tuned = TuningDB(task.tuning_db).chooser(dict(task.sizes)) if task.tuning_db else None
        toolchain = _TOOLCHAINS.get(find_toolchain)
        n, configs = 0, []
        for sched in scheds:
            for p in sched.plans:
                choice = p.choices[task.arch]
                b = registry.get(choice.backend)
                config = tuned(p.ir, task.arch, choice.backend) if tuned else None
                if config is None and task.tune and len(b.candidates(p.ir, task.arch)) > 1:
                    return None, cache.stats.corrupt          # not tuned yet: the task tunes first
                from kspec.compile import with_sizes    # (a per-call GQA group: the bucket names it)
                config = with_sizes(b, p.ir, task.arch, config, dict(task.sizes) if task.sizes else None)
                lp = b.lower(p.ir, task.arch, config) if config else b.lower(p.ir, task.arch)
                em = emit_cached(lp, cache.root, memo_only=True)
                if em is None:
                    return None, cache.stats.corrupt
                for job in b.build_jobs(em, f"kernel {p.ir.id} on {task.arch}"):
                    if cache.lookup(job, toolchain) is None:
                        return None, cache.stats.corrupt
                    n += 1
                configs.append(f"{p.id}: {choice.backend} {describe(em.config) if em.config else ''}".rstrip())
    except KspecError:
        return None, cache.stats.corrupt       # the task reports it
    return TaskResult(task, True, cached=n, seconds=time.monotonic() - t0, configs=tuple(configs), host="driver"), 0


def plan_tasks(library: Library, cache_root: str, tuning_db: str | None = None) -> list[BuildTask]:
    """One task per spec kernel, arch and bucket.  Without a tuning database every bucket builds
    the same binaries, so the buckets of a kernel and arch share one task."""
    from kspec.core import ARCHS
    from kspec.spec_lang import load_spec
    tasks = []
    db = tuning_db or library.tuning_db
    for s in library.specs:
        program = load_spec(s.path)
        archs = s.archs or tuple(program.targets or ARCHS)
        for k in program.kernels:
            for arch in archs:
                for b in (s.buckets if db else ()) or (None,):
                    tasks.append(BuildTask(s.path, k.name, arch, b.name if b else "", b.sizes if b else (),
                                           cache_root, s.backend, s.strict, db, library.tune and bool(db)))
    return tasks


# ---------------------------------------------------------------------------------------------
# Running tasks: local process pool
# ---------------------------------------------------------------------------------------------

Reporter = Callable[[str, BuildTask, "TaskResult | None"], None]   # (event, task, result)


def default_jobs() -> int:
    from kspec.backends.build import default_parallelism
    return default_parallelism()


def run_serial(tasks: Sequence[BuildTask], report: Reporter | None = None) -> list[TaskResult]:
    out = []
    for t in tasks:
        if report:
            report("start", t, None)
        r = run_task(t)
        if report:
            report("done", t, r)
        out.append(r)
    return out


def run_local(tasks: Sequence[BuildTask], jobs: int | None = None, report: Reporter | None = None,
              retries: int = 2) -> list[TaskResult]:
    """Run tasks on a pool of `jobs` worker processes (default: cores bounded by memory).  A task
    whose worker dies (killed, out of memory) is retried on a fresh pool up to `retries` times."""
    jobs = max(1, min(jobs or default_jobs(), len(tasks) or 1))
    if jobs == 1:
        return run_serial(tasks, report)
    results: dict[int, TaskResult] = {}
    attempts = {i: 0 for i in range(len(tasks))}
    pending = list(range(len(tasks)))
    ctx = multiprocessing.get_context("spawn")       # no fork of a threaded parent
    while pending:
        broken: list[int] = []
        with cf.ProcessPoolExecutor(max_workers=min(jobs, len(pending)), mp_context=ctx) as pool:
            futures = {}
            for i in pending:
                attempts[i] += 1
                if report:
                    report("start", tasks[i], None)
                futures[pool.submit(run_task, tasks[i])] = i
            for fut in cf.as_completed(futures):
                i = futures[fut]
                try:
                    r = fut.result()
                except BrokenProcessPool:
                    broken.append(i)
                    continue
                except Exception as e:  # noqa: BLE001 - a bug inside a worker
                    raise KspecInternalError(f"building {tasks[i].label} failed inside a worker: "
                                             f"{type(e).__name__}: {e}") from e
                r = _with_attempts(r, attempts[i])
                results[i] = r
                if report:
                    report("done", tasks[i], r)
        pending = []
        for i in broken:
            if attempts[i] > retries:
                r = TaskResult(tasks[i], False, error=f"error: the worker building {tasks[i].label} died "
                               f"{attempts[i]} times (killed or out of memory)", attempts=attempts[i])
                results[i] = r
                if report:
                    report("done", tasks[i], r)
            else:
                if report:
                    report("retry", tasks[i], None)
                pending.append(i)
    return [results[i] for i in range(len(tasks))]


def _with_attempts(r: TaskResult, n: int) -> TaskResult:
    from dataclasses import replace
    return replace(r, attempts=n) if n != r.attempts else r


# ---------------------------------------------------------------------------------------------
# Progress and summary
# ---------------------------------------------------------------------------------------------

class ProgressReporter:
    """Per-task progress: a rich progress bar on a terminal when `rich` is installed, else one line
    per event.  Thread-safe (Ray's driver loop and the pool both call it from one thread anyway)."""

    def __init__(self, total: int, stream=None, enabled: bool = True):
        self.total, self.done, self.stream, self.enabled = total, 0, stream or sys.stderr, enabled
        self.t0 = time.monotonic()
        self._rich = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
                # markup off: "[bucket]" in a label is text, not a rich style tag
                self._rich = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), transient=False, console=Console(file=self.stream))
                self._bar = self._rich.add_task("building", total=total)
                self._rich.start()
            except ImportError:
                self._rich = None

    def __call__(self, event: str, task: BuildTask, result: TaskResult | None) -> None:
        if not self.enabled:
            return
        if event == "done":
            self.done += 1
        elapsed = time.monotonic() - self.t0
        if event == "start":
            line = f"[{self.done}/{self.total}] queued    {task.label}"
        elif event == "retry":
            line = f"[{self.done}/{self.total}] RETRY     {task.label} (its worker died)"
        elif result is not None and result.ok:
            line = (f"[{self.done}/{self.total}] {result.status:<9} {task.label} in {result.seconds:.1f}s "
                    f"({result.built} built, {result.cached} cached)")
        else:
            line = f"[{self.done}/{self.total}] FAILED    {task.label}"
        if self._rich is not None:
            if event != "start":
                self._rich.console.print(line, markup=False, highlight=False)
            self._rich.update(self._bar, completed=self.done, description=task.label)
        else:
            print(f"{line}   [{elapsed:6.1f}s]", file=self.stream, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()


@dataclass
class BuildSummary:
    results: list[TaskResult]
    artifacts: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    executor: str = "local"
    workers: int = 1

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def table(self) -> str:
        rows = [("kernel", "arch", "bucket", "status", "nvcc", "cached", "compile s", "wall s", "configuration")]
        for r in self.results:
            t = r.task
            cfg = "; ".join(c.split(": ", 1)[1] for c in r.configs) if r.configs else (r.error.splitlines() or [""])[0][:60]
            rows.append((f"{Path(t.spec).name}:{t.kernel}", t.arch, t.bucket or "-", r.status + ("" if r.attempts == 1 else f" (x{r.attempts})"),
                         str(r.built), str(r.cached), f"{r.compile_seconds:.1f}", f"{r.seconds:.1f}", cfg))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        lines = []
        for n, row in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
            if n == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 13)
        built = sum(r.built for r in self.results)
        cached = sum(r.cached for r in self.results)
        corrupt = sum(r.corrupt for r in self.results)
        failed = sum(not r.ok for r in self.results)
        cpu = sum(r.compile_seconds for r in self.results)
        lines.append("")
        probed = sum(r.host == "driver" for r in self.results)
        where = f"on {self.executor} ({self.workers} workers)" if self.workers else "all found in the cache"
        lines.append(f"{len(self.results)} tasks {where}: {built} binaries built, "
                     f"{cached} cached" + (f", {corrupt} corrupt cache entries rebuilt" if corrupt else "")
                     + (f", {failed} FAILED" if failed else "")
                     + f"; nvcc {cpu:.1f}s; wall {self.seconds:.1f}s; {len(self.artifacts)} artifacts"
                     + (f" ({probed} tasks complete in the cache before any worker started)" if probed and self.workers else ""))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The build
# ---------------------------------------------------------------------------------------------

def build_library(library: Library, *, jobs: int | None = None, executor: str = "local",
                  ray_address: str | None = None, cache_root: str | None = None, tuning_db: str | None = None,
                  report: Reporter | None = None, retries: int = 2) -> BuildSummary:
    """Build every task of `library` (executor "serial", "local" or "ray"), then assemble the
    artifacts from the cache and write OUT/library.json.  Raises KspecError naming every failed
    task when any failed (artifacts of the specs that built are still written)."""
    from kspec.backends.build import CompileCache
    from kspec.compile import prepare_output
    t0 = time.monotonic()
    prepare_output(library.out, create=False)      # a bad output directory is found before any build
    cache = CompileCache(cache_root)
    root = str(cache.root.resolve())
    db = tuning_db or library.tuning_db
    tasks = plan_tasks(library, root, db)
    # incremental: tasks whose sources and binaries are all cached finish here, with no worker
    done: dict[int, TaskResult] = {}
    programs: dict = {}
    corrupt: dict[int, int] = {}
    for i, t in enumerate(tasks):
        r, corrupt[i] = probe_task(t, programs)
        if r is not None:
            done[i] = r
            if report:
                report("done", t, r)
    todo = [t for i, t in enumerate(tasks) if i not in done]
    workers = 0
    if not todo:
        results = []
    elif executor == "serial":
        results, workers = run_serial(todo, report), 1
    elif executor == "local":
        workers = max(1, min(jobs or default_jobs(), len(todo)))
        results = run_local(todo, workers, report, retries)
    elif executor == "ray":
        from kspec.raybuild import run_ray
        results, workers = run_ray(todo, run_task, TaskResult, ray_address, report, retries, jobs)
    else:
        raise KspecInternalError(f"unknown executor {executor!r}")
    from dataclasses import replace
    it = iter(results)
    results = [done[i] if i in done else next(it) for i in range(len(tasks))]
    # entries the probe found corrupt (and removed) were rebuilt by their task
    results = [replace(r, corrupt=r.corrupt + corrupt[i]) if corrupt[i] else r for i, r in enumerate(results)]
    summary = BuildSummary(results, executor=executor, workers=workers)
    failed_specs = {r.task.spec for r in results if not r.ok}
    summary.artifacts = assemble(library, root, db, skip=failed_specs)
    summary.seconds = time.monotonic() - t0
    if failed_specs:
        msgs = [f"{r.task.label}:\n{r.error}" for r in results if not r.ok]
        raise LibraryBuildError(f"{len(msgs)} of {len(results)} build tasks failed", summary,
                                hint="\n".join(msgs[:5]) + (f"\n... and {len(msgs) - 5} more" if len(msgs) > 5 else ""))
    return summary


class LibraryBuildError(KspecError):
    def __init__(self, message: str, summary: BuildSummary, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.summary = summary


def artifact_dir(library: Library, spec: SpecEntry, bucket: Bucket | None) -> Path:
    out = Path(library.out)
    return (out / bucket.name if bucket else out) / Path(spec.path).stem


def assemble(library: Library, cache_root: str, tuning_db: str | None, skip=frozenset()) -> list[dict]:
    """Write each spec's artifacts from the (now warm) cache and the index OUT/library.json."""
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    from kspec.tune import TuningDB, bucket_key
    from kspec.backends.toolchain import find_toolchain
    cache = CompileCache(cache_root)
    toolchain = _TOOLCHAINS.get(find_toolchain)
    index = []
    for s in library.specs:
        if s.path in skip:
            continue
        for b in (s.buckets or (None,)):
            tuned = TuningDB(tuning_db).chooser(b.as_dict if b else None) if tuning_db else None
            target = artifact_dir(library, s, b)
            art = compile_spec(s.path, s.archs, target.parent, jobs=1, cache=cache, backend=s.backend,
                               strict=s.strict, tuned=tuned, toolchain=toolchain, sizes=b.as_dict if b else None)
            manifest = json.loads((art / "manifest.json").read_text())
            index.append({"spec": Path(s.path).name, "bucket": b.name if b else None,
                          "sizes": dict(b.sizes) if b else {}, "size_key": bucket_key(b.as_dict if b else None),
                          "archs": manifest.get("archs"), "path": os.path.relpath(art, library.out)})
    out = Path(library.out)
    tmp = out / f".library.json.tmp{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": INDEX_FORMAT, "artifacts": index}, indent=1) + "\n")
        os.replace(tmp, out / "library.json")
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise KspecError(f"cannot write {out / 'library.json'}: {e.strerror or e}",
                         hint="check the output directory: its permissions and free space") from None
    return index
