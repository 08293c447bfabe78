"""Building many CuTe DSL kernels at once: cache lookups in this process (no DSL import on a warm
build), misses compiled in parallel worker processes (one per kernel x arch: the DSL's target arch is
process-global state), with start/done/heartbeat events for a progress display.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from kspec.backends.desc import GemmDesc

from . import build as cbuild
from .gemm import CuteConfig

HEARTBEAT_SECONDS = 2.0       # first heartbeat of a running build
HEARTBEAT_EVERY = 5.0         # then this often


@dataclass(frozen=True)
class CuteJob:
    label: str                  # "kernel gemm_0 on sm_90a"
    desc: object                # GemmDesc, or attention.AttnDesc / attention_bwd.BwdDesc (kind "cute-fa4", config None)
    arch: str
    config: CuteConfig | None
    kind: str = "cute"


@dataclass(frozen=True)
class CuteEvent:
    """Same fields as backends.build.BuildEvent, so kspec.compile.Progress can show both.
    kind: start | running (heartbeat) | done | cached | failed."""
    kind: str
    label: str
    elapsed: float
    job: CuteJob
    finished: int
    total: int


def _fa4_module(desc):
    """The module that builds a FlashAttention-4 descriptor: attention (forward) or attention_bwd."""
    from . import attention, attention_bwd
    return attention_bwd if isinstance(desc, attention_bwd.BwdDesc) else attention


def _worker(desc, arch: str, root: str, cfg: CuteConfig | None):
    """One build: a GEMM (GemmDesc) or a FlashAttention-4 attention kernel (attention.AttnDesc, or
    the three or five kernels of an attention backward, attention_bwd.BwdDesc)."""
    if isinstance(desc, GemmDesc):
        return cbuild.build(desc, arch, Path(root), cfg)
    return _fa4_module(desc).build(desc, Path(root))


def _lookup(job: "CuteJob", cache_root: Path):
    if isinstance(job.desc, GemmDesc):
        return cbuild.lookup(job.desc, job.arch, cache_root, job.config)
    return _fa4_module(job.desc).lookup(job.desc, cache_root)


def build_many(jobs: Sequence[CuteJob], cache_root: Path, max_parallel: int | None = None,
               progress: Callable[[CuteEvent], None] | None = None) -> list[cbuild.CuteBuild]:
    """Results in job order.  Raises the first failure after the others finished."""
    total = len(jobs)
    results: list[cbuild.CuteBuild | None] = [None] * total
    finished = [0]
    lock = threading.Lock()

    def emit(kind, job, t0):
        if progress is not None:
            with lock:
                if kind in ("done", "cached", "failed"):
                    finished[0] += 1
                progress(CuteEvent(kind, job.label, time.monotonic() - t0, job, finished[0], total))

    misses = []
    for i, j in enumerate(jobs):
        hit = _lookup(j, cache_root)
        if hit is not None:
            results[i] = hit
            emit("cached", j, time.monotonic())
        else:
            misses.append(i)
    if not misses:
        return results  # type: ignore[return-value]

    workers = max(1, min(len(misses), max_parallel or os.cpu_count() or 1))
    starts: dict[int, float] = {}
    errors: list[BaseException] = []
    stop = threading.Event()

    def heartbeat():
        last: dict[int, float] = {}
        while not stop.wait(0.5):
            now = time.monotonic()
            with lock:
                running = [(i, t) for i, t in starts.items() if results[i] is None]
            for i, t in running:
                due = t + HEARTBEAT_SECONDS if i not in last else last[i] + HEARTBEAT_EVERY
                if now >= due:
                    last[i] = now
                    emit("running", jobs[i], t)

    hb = threading.Thread(target=heartbeat, daemon=True)
    hb.start()
    try:
        if workers == 1 and len(misses) == 1:
            i = misses[0]
            starts[i] = time.monotonic()
            emit("start", jobs[i], starts[i])
            try:
                results[i] = _worker(jobs[i].desc, jobs[i].arch, str(cache_root), jobs[i].config)
                emit("done", jobs[i], starts[i])
            except BaseException as e:
                emit("failed", jobs[i], starts[i])
                errors.append(e)
        else:
            ctx = multiprocessing.get_context("spawn")     # the DSL/MLIR state must not be forked
            with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                futs = {}
                for i in misses:
                    starts[i] = time.monotonic()
                    emit("start", jobs[i], starts[i])
                    futs[pool.submit(_worker, jobs[i].desc, jobs[i].arch, str(cache_root), jobs[i].config)] = i
                for f in cf.as_completed(futs):
                    i = futs[f]
                    try:
                        results[i] = f.result()
                        emit("done", jobs[i], starts[i])
                    except BaseException as e:
                        emit("failed", jobs[i], starts[i])
                        errors.append(e)
    finally:
        stop.set()
        hb.join(timeout=1)
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]
