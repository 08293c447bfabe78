"""Compiling generated CUDA sources with nvcc: a content-addressed compile cache and a parallel
build driver.

A `BuildJob` is one nvcc invocation (one source, one arch, one kind of output: a device `cubin`
or the host-glue `.so`, see ABI.md).  `CompileCache` stores each result under the sha256 of
everything that determines the binary, so an unchanged kernel is never compiled twice;
`build_all` compiles the missing ones in parallel, bounded by cores and memory.

Cache layout (root = `$KSPEC_CACHE_DIR`, default `~/.cache/kspec`):
    <root>/<key[:2]>/<key>/kernel.cubin|kernel.so   the binary
                           kernel.cu                the source it was built from
                           build.log                nvcc's command and output (warnings)
                           meta.json                size + sha256 of every file, label, arch, seconds, toolchain
                                                    (sealed and verified by backends/cache.py)
    <root>/logs/            logs of failed builds (named in the error message)
    <root>/locks/, tmp/     per-key lock files; entries being written (renamed into place; the
                            leftovers of a killed build are reclaimed, backends/cache.py)

An unwritable root falls back to a temporary cache for the run, with a warning (`cache.usable_root`).
"""
from __future__ import annotations

import concurrent.futures as cf
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Literal, Sequence

from kspec.core import ARCH_TABLE, KspecError

from . import cache as cache_entry
from .toolchain import Toolchain

# Bump when the key material or the entry layout changes: old entries are then simply never hit.
CACHE_FORMAT = 2
# Peak resident memory of one nvcc compiling a CUTLASS 3.x kernel (measured 2-4 GB).
NVCC_BYTES = int(3.5 * 2**30)

_NVCC_ARCH = {a.name: a.nvcc for a in ARCH_TABLE.values()}
_KIND_FLAGS = {
    "cubin": ("-DKSPEC_DEVICE", "-cubin"),
    # -Xlinker -x: no local symbols in the .so.  nvcc compiles the host side from a temporary
    # `tmpxft_<pid>_..cudafe1.cpp`, whose name would otherwise land in the symbol table and make
    # every rebuild differ; without it the host library is byte-identical across rebuilds.
    "host": ("-DKSPEC_HOST", "-Xcompiler", "-fPIC", "-shared", "-Xlinker", "-x"),
}
_OUTPUT_NAME = {"cubin": "kernel.cubin", "host": "kernel.so"}
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")
# a CuTe DSL entry's folder: its key, and for attention the sizes it was built for (`KEY-4096`)
_KEYED_RE = re.compile(r"^[0-9a-f]{64}(-[0-9-]+)?$")
# the kinds of cache entry and the folder under the root that holds each (nvcc's at the root itself;
# the CuTe DSL backends' own: backends/cute/build.py, backends/cute/attention.py, attention_bwd.py)
ENTRY_KINDS = {"nvcc": "", "cute": "cute", "attention": "cute-attention", "attention_bwd": "cute-attention-bwd"}


class BackendBuildError(KspecError):
    """nvcc rejected generated code.  The message names the kernel and arch and the saved log;
    `log_path` is that file, `failures` every failed (job, log) of the build."""

    def __init__(self, message: str, hint: str | None = None, log_path: Path | None = None,
                 failures: Sequence[tuple["BuildJob", Path]] = ()):
        super().__init__(message, hint=hint)
        self.log_path = log_path
        self.failures = list(failures)


@dataclass(frozen=True)
class BuildJob:
    """One nvcc run.  label is for messages ("kernel gemm_bias_relu on sm_100a").
    include_identity stands for the *contents* of include_dirs in the cache key (e.g.
    "nvidia-cutlass 4.2.0.0"); when empty, the include paths themselves are keyed."""
    label: str
    source: str
    arch: Literal["sm90a", "sm100a"]
    kind: Literal["cubin", "host"] = "cubin"
    include_dirs: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    include_identity: str = ""

    def __post_init__(self) -> None:
        if self.arch not in _NVCC_ARCH:
            raise KspecError(f"unknown arch '{self.arch}' for {self.label}",
                             hint="use one of: " + ", ".join(_NVCC_ARCH))
        if self.kind not in _KIND_FLAGS:
            raise ValueError(f"BuildJob kind must be 'cubin' or 'host', not {self.kind!r}")
        # Lists are accepted for convenience; tuples keep the job hashable.
        object.__setattr__(self, "include_dirs", tuple(str(d) for d in self.include_dirs))
        object.__setattr__(self, "flags", tuple(self.flags))

    @property
    def output_name(self) -> str:
        return _OUTPUT_NAME[self.kind]

    def nvcc_command(self, nvcc: os.PathLike | str, src: str, out: str,
                     link_flags: Sequence[str] = ()) -> list[str]:
        """The nvcc command line; link_flags (host kind only) locate the toolkit's libraries and
        are not part of the cache key (they depend on where the toolkit is, not on the binary)."""
        extra = list(link_flags) if self.kind == "host" else []
        sm = _NVCC_ARCH[self.arch]
        # host glue needs no PTX: `-arch=sm_90a` would also run a compute_90a pass (~30% of the
        # host build); -gencode asks for the one SASS target only
        arch = [f"-arch={sm}"] if self.kind == "cubin" else ["-gencode", f"arch=compute_{sm[3:]},code={sm}"]
        return [str(nvcc), *_KIND_FLAGS[self.kind], *arch,
                *(f"-I{d}" for d in self.include_dirs), *self.flags, *extra, "-o", out, src]


@dataclass(frozen=True)
class BuildResult:
    """A built (or found) binary.  seconds: wall time spent on it by this call;
    compile_seconds: what nvcc took when the entry was built."""
    job: BuildJob
    path: Path
    cached: bool
    seconds: float
    log: Path
    key: str
    compile_seconds: float = 0.0


@dataclass(frozen=True)
class BuildEvent:
    """Progress of `build_all`.  kind: "start" (nvcc started), "done" (built), "cached"
    (found in the cache), "failed".  elapsed: seconds since this job started."""
    kind: Literal["start", "done", "cached", "failed"]
    label: str
    elapsed: float
    job: BuildJob
    finished: int      # jobs finished so far (after this event)
    total: int


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0     # compiled
    corrupt: int = 0    # entries that failed verification and were rebuilt


class _Cancelled(Exception):
    pass


class _NvccRunner:
    """Runs nvcc processes and can terminate all of them (Ctrl-C during a build)."""

    def __init__(self) -> None:
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self.cancelled = threading.Event()

    def run(self, cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> int:
        with open(log, "ab") as out:
            with self._lock:
                if self.cancelled.is_set():
                    raise _Cancelled()
                # Own session: cancel_all can stop nvcc with its cicc/ptxas children.
                proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
                self._procs.add(proc)
            try:
                rc = proc.wait()
            finally:
                with self._lock:
                    self._procs.discard(proc)
        if self.cancelled.is_set():
            raise _Cancelled()
        return rc

    def cancel_all(self) -> None:
        self.cancelled.set()
        with self._lock:
            for p in self._procs:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass


class CompileCache:
    """Content-addressed store of compiled binaries (see the module docstring for the layout).
    Safe to share between threads and between processes."""

    def __init__(self, root: os.PathLike | str | None = None, *, writable: bool = True):
        """writable: the cache will be written (a build): an unwritable root then falls back to a
        temporary cache for the run, with a warning.  `kspec cache info|clear` pass False."""
        if root is None:
            root = os.environ.get("KSPEC_CACHE_DIR") or "~/.cache/kspec"
        self.root = Path(root).expanduser()
        if writable:
            self.root = cache_entry.usable_root(self.root)
        self.stats = CacheStats()
        self._stats_lock = threading.Lock()

    # ---- keys and entries ----

    def key(self, job: BuildJob, toolchain: Toolchain) -> str:
        """sha256 over everything that determines the binary (not the label)."""
        material = {
            "format": CACHE_FORMAT,
            "source": job.source,
            "arch": job.arch,
            "kind": job.kind,
            "flags": list(job.flags),
            # what the headers are, never where this machine keeps them
            "includes": job.include_identity or tree_identity(*job.include_dirs),
            # major.minor: a patch release of the same toolkit shares the cache across machines
            "nvcc": toolchain_release(toolchain.version),
        }
        if job.kind == "host":
            # the kind's own flags change the binary too (only the host's were ever changed: the
            # cubins' keys, and their entries, stay as they were)
            material["kind_flags"] = list(_KIND_FLAGS["host"])
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()

    def entry_dir(self, key: str) -> Path:
        return self.root / key[:2] / key

    def lookup(self, job: BuildJob, toolchain: Toolchain) -> BuildResult | None:
        """The verified cached result for `job`, or None.  A corrupt entry is removed (and
        counted in stats.corrupt) so the next build replaces it."""
        t0 = time.monotonic()
        key = self.key(job, toolchain)
        meta = self._verified_meta(key, job)
        if meta is None:
            return None
        d = self.entry_dir(key)
        return BuildResult(job, d / job.output_name, True, time.monotonic() - t0, d / "build.log", key,
                           float(meta.get("seconds", 0.0)))

    def _verified_meta(self, key: str, job: BuildJob) -> dict | None:
        """The entry's metadata if every file of it is whole (backends/cache.py); a damaged entry
        is removed with a warning (and counted in stats.corrupt), a stale one silently."""
        d = self.entry_dir(key)
        if not d.exists():
            return None
        damaged = []
        meta = cache_entry.read(d, CACHE_FORMAT, on_damage=lambda dd, why: (damaged.append(why),
                                                                        cache_entry.warn_damaged(dd, why)))
        if meta is not None and (meta.get("key") != key or job.output_name not in meta["files"]):
            cache_entry.warn_damaged(d, "it holds another build")
            cache_entry.discard(d)
            damaged.append("key")
            meta = None
        if damaged:
            with self._stats_lock:
                self.stats.corrupt += 1
        return meta

    def _tmp_root(self) -> Path:
        p = self.root / "tmp"
        p.mkdir(parents=True, exist_ok=True)
        return p

    @contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        """An exclusive per-key lock across processes, so one compiles and the others wait
        and then reuse its entry instead of compiling the same kernel again."""
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{key}.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # ---- building ----

    def build(self, job: BuildJob, toolchain: Toolchain, *, _runner: _NvccRunner | None = None,
              _on_start: Callable[[], None] | None = None) -> BuildResult:
        """The cached binary for `job`, compiling it first if needed.
        Raises BackendBuildError (with a saved log) when nvcc fails."""
        t0 = time.monotonic()
        hit = self.lookup(job, toolchain)
        if hit is None:
            key = self.key(job, toolchain)
            with self._locked(key):
                hit = self.lookup(job, toolchain)      # another process may have built it meanwhile
                if hit is None:
                    if _on_start:
                        _on_start()
                    result = self._compile(job, toolchain, key, _runner or _NvccRunner(), t0)
                    with self._stats_lock:
                        self.stats.misses += 1
                    return result
        with self._stats_lock:
            self.stats.hits += 1
        return BuildResult(job, hit.path, True, time.monotonic() - t0, hit.log, hit.key, hit.compile_seconds)

    def reclaim(self) -> None:
        """Remove what killed builds left under this root (once per process; backends/cache.py)."""
        cache_entry.reclaim_once(self.root, "tmp", "emit", "resources", "cute", "cute-attention")

    def _compile(self, job: BuildJob, tc: Toolchain, key: str, runner: _NvccRunner, t0: float) -> BuildResult:
        self.reclaim()
        with cache_entry.workdir(self._tmp_root(), f"{key[:16]}-") as tmp:
            src, log = tmp / "kernel.cu", tmp / "build.log"
            src.write_text(job.source)
            cmd = job.nvcc_command(tc.nvcc, src.name, job.output_name, tc.host_link_flags())
            log.write_text(f"# {job.label}\n# nvcc {tc.version} ({tc.nvcc})\n$ {shlex.join(cmd)}\n")
            started = time.monotonic()
            rc = runner.run(cmd, tc.env(), tmp, log)
            seconds = time.monotonic() - started
            out = tmp / job.output_name
            if rc != 0 or not out.is_file():
                raise self._failure(job, key, rc, log, src)
            meta = {"format": CACHE_FORMAT, "key": key, "label": job.label, "arch": job.arch,
                    "kind": job.kind, "seconds": round(seconds, 3),
                    "toolchain": tc.describe(), "flags": list(job.flags),
                    "include_identity": job.include_identity, "created": time.time()}
            cache_entry.seal(tmp, meta)
            dest = self._install(tmp, key, job)
        return BuildResult(job, dest / job.output_name, False, time.monotonic() - t0, dest / "build.log",
                           key, seconds)

    def _install(self, tmp: Path, key: str, job: BuildJob) -> Path:
        """Rename the sealed build into place (a whole entry another process installed first is
        kept); a rename that fails is an error (backends/cache.py)."""
        dest = self.entry_dir(key)
        cache_entry.install(tmp, dest, CACHE_FORMAT)
        return dest

    def _failure(self, job: BuildJob, key: str, rc: int, log: Path, src: Path) -> BackendBuildError:
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", job.label).strip("_")[:80] or "build"
        saved = logs / f"{stem}-{key[:12]}.log"
        text = log.read_text(errors="replace")
        saved.write_text(text + f"\n# nvcc exit status {rc}\n")
        shutil.copyfile(src, saved.with_suffix(".cu"))
        first = _first_error(text)
        hint = ("this is a bug in kspec's code generation (the generated C++ did not compile); "
                "please report it with the log and source")
        if first:
            hint = f"first error: {first}\n        {hint}"
        return BackendBuildError(f"backend failed for {job.label} (nvcc exit {rc}); full log: {saved}",
                                 hint=hint, log_path=saved, failures=[(job, saved)])

    # ---- maintenance ----

    def _entry_dirs(self, kind: str = "nvcc") -> Iterator[Path]:
        """The entry folders of one kind (ENTRY_KINDS): `<root>[/<folder>]/<key[:2]>/<key>[-suffix]`."""
        base = self.root / ENTRY_KINDS[kind]
        if not base.is_dir():
            return
        name = _KEY_RE if kind == "nvcc" else _KEYED_RE
        for top in base.iterdir():
            if top.is_dir() and re.fullmatch(r"[0-9a-f]{2}", top.name):
                for d in top.iterdir():
                    if d.is_dir() and name.match(d.name) and d.name.startswith(top.name):
                        yield d

    def info(self) -> dict:
        """{"root", "entries", "bytes", "failed_logs", "by_kind"} of what is on disk now: entries and
        bytes over every kind of entry (nvcc builds, CuTe DSL GEMMs, FlashAttention-4 attention),
        by_kind {kind: (entries, bytes)}."""
        by_kind = {}
        for kind in ENTRY_KINDS:
            n = size = 0
            for d in self._entry_dirs(kind):
                n += 1
                size += sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            by_kind[kind] = (n, size)
        logs = self.root / "logs"
        n_logs = sum(1 for f in logs.glob("*.log")) if logs.is_dir() else 0
        return {"root": str(self.root), "entries": sum(n for n, _ in by_kind.values()),
                "bytes": sum(b for _, b in by_kind.values()), "failed_logs": n_logs, "by_kind": by_kind}

    def clear(self) -> int:
        """Remove every entry (nvcc, CuTe DSL, attention and its backward), failed-build log, lock and temp dir;
        returns the entries removed (every kind).  Only kspec's own folders are touched, whatever else lives
        under the root (a tuning database stays).  What cannot be removed is a KspecError naming it."""
        n = 0
        for d in list(self._entry_dirs()):
            cache_entry.discard(d, "the cache entry",
                                hint="check the permissions of the cache directory (KSPEC_CACHE_DIR)")
            n += 1
        n += sum(1 for kind in ENTRY_KINDS if kind != "nvcc" for _ in self._entry_dirs(kind))
        failed: list[tuple[str, str]] = []

        def onexc(_fn, path, e):
            if isinstance(e, tuple):                       # (onerror's exc_info before Python 3.12)
                e = e[1]
            if not isinstance(e, FileNotFoundError):       # (removed meanwhile by another process)
                failed.append((path, getattr(e, "strerror", None) or str(e)))
        how = {"onexc": onexc} if sys.version_info >= (3, 12) else {"onerror": onexc}
        if self.root.is_dir():
            for top in self.root.iterdir():
                # emit/ and resources/ hold kspec.compile's memoised generated sources and cubin facts
                if top.is_dir() and (top.name in ("logs", "locks", "tmp", "emit", "resources",
                                                  *(f for f in ENTRY_KINDS.values() if f))
                                     or re.fullmatch(r"[0-9a-f]{2}", top.name)):
                    shutil.rmtree(top, **how)
        if failed:
            path, why = failed[0]
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            raise KspecError(f"cannot clear the cache {self.root}: {path}: {why}{more}",
                             hint="check the permissions of the cache directory (KSPEC_CACHE_DIR)")
        return n


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if line.startswith(("#", "$")):
            continue
        if re.search(r"\berror\b", line, re.I):
            return line.strip()[:300]
    return ""


def default_parallelism() -> int:
    """nvcc processes to run at once: `$KSPEC_JOBS` if set, else the usable cores bounded by
    available memory at ~3.5 GB per CUTLASS nvcc (so a big build does not swap or get OOM-killed)."""
    env = os.environ.get("KSPEC_JOBS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    avail = _mem_available()
    by_mem = cores if avail is None else int(avail // NVCC_BYTES)
    return max(1, min(cores, by_mem))


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def build_all(jobs: Sequence[BuildJob], toolchain: Toolchain, cache: CompileCache | None = None,
              max_parallel: int | None = None,
              progress: Callable[[BuildEvent], None] | None = None) -> list[BuildResult]:
    """Build every job (in parallel, cached) and return results in the order of `jobs`.

    progress, if given, is called with a BuildEvent for every start/done/cached/failed; calls
    are serialized, so it need not be thread-safe.  If nvcc fails, jobs not yet started are
    cancelled, those running finish (their results are cached for the next try), and a
    BackendBuildError for the first failure is raised.  On Ctrl-C running nvcc processes are
    terminated.
    """
    cache = cache or CompileCache()
    for arch in sorted({j.arch for j in jobs}):
        toolchain.check_arch(arch)
    keys = [cache.key(j, toolchain) for j in jobs]
    unique: dict[str, BuildJob] = {}
    for k, j in zip(keys, jobs):
        unique.setdefault(k, j)

    done_by_key: dict[str, BuildResult] = {}
    lock = threading.Lock()
    finished = [0]

    def emit(kind: str, job: BuildJob, t0: float) -> None:
        if progress is None:
            return
        with lock:
            if kind in ("done", "cached", "failed"):
                finished[0] += 1
            progress(BuildEvent(kind, job.label, time.monotonic() - t0, job, finished[0], len(unique)))

    todo: dict[str, BuildJob] = {}
    for k, j in unique.items():
        t0 = time.monotonic()
        hit = cache.lookup(j, toolchain)
        if hit is not None:
            with cache._stats_lock:
                cache.stats.hits += 1
            done_by_key[k] = hit
            emit("cached", j, t0)
        else:
            todo[k] = j

    runner = _NvccRunner()

    def work(job: BuildJob) -> BuildResult:
        t0 = time.monotonic()
        try:
            r = cache.build(job, toolchain, _runner=runner, _on_start=lambda: emit("start", job, t0))
        except BackendBuildError:
            emit("failed", job, t0)
            raise
        emit("cached" if r.cached else "done", job, t0)
        return r

    failures: list[BackendBuildError] = []
    if todo:
        workers = max(1, min(max_parallel or default_parallelism(), len(todo)))
        pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kspec-nvcc")
        futures = {pool.submit(work, j): k for k, j in todo.items()}
        try:
            for fut in cf.as_completed(futures):
                try:
                    done_by_key[futures[fut]] = fut.result()
                except cf.CancelledError:
                    continue
                except BackendBuildError as e:
                    failures.append(e)
                    for f in futures:       # queued jobs are dropped; running ones finish
                        f.cancel()
                except _Cancelled:
                    continue
        except BaseException:
            runner.cancel_all()
            for f in futures:
                f.cancel()
            raise
        finally:
            pool.shutdown(wait=True)

    if failures:
        first = failures[0]
        all_failed = [jf for e in failures for jf in e.failures]
        message = first.message
        if len(all_failed) > 1:
            message += f" (and {len(all_failed) - 1} more failed: " + \
                       ", ".join(j.label for j, _ in all_failed[1:]) + ")"
        raise BackendBuildError(message, hint=first.hint, log_path=first.log_path, failures=all_failed)
    return [done_by_key[k] for k in keys]


def toolchain_release(version: str) -> str:
    """The major.minor release of an nvcc version ("13.0.88" -> "13.0"), as the cache keys it."""
    return ".".join(version.split(".")[:2])


def tree_identity(*dirs: os.PathLike | str) -> str:
    """A cheap identity of the files under `dirs` (relative path, size, mtime), for
    BuildJob.include_identity when no package version pins the headers."""
    h = hashlib.sha256()
    for d in dirs:
        base = Path(d)
        h.update(b"\0dir\n")          # the number and order of dirs count, not where they are
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            for name in sorted(filenames):
                p = Path(dirpath) / name
                try:
                    st = p.stat()
                except OSError:
                    continue
                h.update(f"{p.relative_to(base)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def nvcc_jobs(emitted, label: str, identity: str) -> list[BuildJob]:
    """The two nvcc runs of an emitted kernel (device cubin, host glue; see ABI.md)."""
    return [BuildJob(label, emitted.source, emitted.arch, kind, emitted.include_dirs, emitted.flags, identity)
            for kind in ("cubin", "host")]


class NvccBuilt:
    """What every backend whose kernels nvcc builds shares (CUTLASS, row, generic): usable when a
    toolchain is found, and two build jobs per emitted kernel (device cubin, host glue)."""

    def available(self) -> str | None:
        from .toolchain import find_toolchain_or_reason
        return find_toolchain_or_reason()

    def build_jobs(self, emitted, label: str) -> list[BuildJob]:
        return nvcc_jobs(emitted, label, self.identity())

