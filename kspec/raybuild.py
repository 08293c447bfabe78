"""`kspec build --ray [ADDRESS]` and `kspec tune --ray`: the library build's tasks on a Ray cluster.

Compile tasks (`kspec.library.run_task`) run on CPU workers (one CPU each); tuning measurements
ask for one GPU each.  Every worker must mount the compile cache at the same path (a shared file
system): the cache's per-key locks, temp-dir-then-rename installs and sha256 verification make
concurrent workers, and workers killed mid-compile, safe.  Ray re-runs a task whose worker died
(`max_retries`); a re-run finds the binaries its first attempt finished in the cache.  The driver
assembles the artifacts from the cache exactly as a local build does, so the results are identical.

With no ADDRESS a local cluster is started bound to 127.0.0.1 with no dashboard; ADDRESS is what
`ray.init(address=...)` takes ("auto", "ray://head:10001", "10.0.0.5:6379").
Ray is optional: `pip install "kspec[ray]"`.
"""
from __future__ import annotations

import os
from typing import Sequence

from kspec.core import KspecError, KspecInternalError



def _ray():
    try:
        import ray
    except ImportError:
        raise KspecError("--ray needs the Ray package", hint='pip install "kspec[ray]"') from None
    return ray


def ensure_ray(address: str | None = None, num_cpus: int | None = None):
    """Connect to `address`, or start a local cluster on loopback; reuses an initialised Ray."""
    ray = _ray()
    if ray.is_initialized():
        return ray
    try:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False,
                     _node_ip_address="127.0.0.1", log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - connection problems are the user's environment
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        raise KspecError(f"cannot start or reach {where}: {type(e).__name__}: {e}",
                         hint="check `ray status`, or build without --ray") from None
    return ray


def run_ray(tasks: Sequence, run_task, task_result, address: str | None = None, report=None,
            retries: int = 2, num_cpus: int | None = None) -> tuple[list, int]:
    """Run every task as a Ray task (1 CPU each); returns (results in task order, cluster CPUs).
    run_task / task_result: kspec.library's (passed in: the library calls this module, not the
    other way round)."""
    from kspec.backends.build import NVCC_BYTES
    ray = ensure_ray(address, num_cpus)
    res = ray.cluster_resources()
    workers = int(res.get("CPU", 1))
    # memory-aware placement: each task reserves one nvcc's peak memory, capped at the cluster's
    # memory per CPU so that a small cluster can still place every task
    memory = int(min(NVCC_BYTES, res.get("memory", 0) / max(1.0, res.get("CPU", 1.0))))
    opts = {"memory": memory} if memory > 0 else {}
    remote = ray.remote(num_cpus=1, max_retries=retries, retry_exceptions=False, **opts)(run_task)
    refs = {}
    for i, t in enumerate(tasks):
        if report:
            report("start", t, None)
        refs[remote.remote(t)] = i
    results: dict = {}
    waiting = list(refs)
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=1)
        for ref in ready:
            i = refs[ref]
            try:
                r = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                # an exception inside run_task that is not a KspecError: a bug in kspec
                raise KspecInternalError(f"building {tasks[i].label} failed on a Ray worker: {e}") from None
            except ray.exceptions.RayError as e:
                # the worker or its node died more often than max_retries allows
                r = task_result(tasks[i], False, error=f"error: Ray could not run {tasks[i].label} "
                               f"({type(e).__name__}, after {retries} retries): {str(e).splitlines()[0]}",
                               attempts=retries + 1)
            results[i] = r
            if report:
                report("done", tasks[i], r)
    return [results[i] for i in range(len(tasks))], workers


def _tune_one(path: str, archs, buckets, db_path: str | None, cache_root: str, backend):
    from pathlib import Path

    from kspec.tune import TuningDB, tune_spec
    return tune_spec(path, archs, buckets, TuningDB(db_path) if db_path else None,
                     cache_root=Path(cache_root), backend=backend)


def tune_ray(jobs: list[tuple], address: str | None = None) -> list:
    """Run `kspec.tune.tune_spec(path, archs, buckets, db, ...)` for each job on Ray: on GPU workers
    (one GPU each) when the cluster has GPUs, where candidates are measured; else on CPU workers,
    which rank by the cost model.  jobs: (path, archs, buckets, db_path, cache_root, backend)."""
    ray = ensure_ray(address)
    gpus = ray.cluster_resources().get("GPU", 0)
    remote = ray.remote(num_cpus=1, num_gpus=1 if gpus else 0, max_retries=1)(_tune_one)
    refs = [remote.remote(*j) for j in jobs]
    out = []
    for j, ref in zip(jobs, refs):
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, KspecError):
                raise cause from None
            raise KspecInternalError(f"tuning {j[0]} failed on a Ray worker: {e}") from None
    return out
