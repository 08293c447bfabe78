"""`kspec build --ray` on a local Ray cluster (2 CPUs, loopback only, no dashboard): the same
library as a local build, byte-identical artifacts, and a worker killed mid-compile.  Skipped
when Ray (the optional extra `kspec[ray]`) is not installed."""
from __future__ import annotations

import faulthandler
import os
import sys

import pytest

from library_fixtures import assert_cache_consistent, compiles, make_fake_nvcc, reset_ctl, tree, write_library

ray = pytest.importorskip("ray", reason='Ray is an optional extra: pip install "kspec[ray]"')

from kspec.backends.build import CompileCache  # noqa: E402
from kspec.library import build_library, load_library  # noqa: E402

TIME_LIMIT_S = 600      # the whole module; a hung cluster dumps the stacks and ends the run


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("raycluster")
    nvcc, ctl = make_fake_nvcc(root)
    # Ray workers inherit the environment of the cluster when it starts
    saved = {k: os.environ.get(k) for k in ("KSPEC_NVCC", "KSPEC_FAKE_NVCC_CTL")}
    os.environ["KSPEC_NVCC"] = str(nvcc)
    os.environ["KSPEC_FAKE_NVCC_CTL"] = str(ctl)
    faulthandler.dump_traceback_later(TIME_LIMIT_S, exit=True, file=sys.stderr)
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        yield ctl
    finally:
        ray.shutdown()
        faulthandler.cancel_dump_traceback_later()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def ctl(cluster):
    reset_ctl(cluster)
    yield cluster
    reset_ctl(cluster)


def test_ray_cluster_binds_loopback_only(cluster):
    nodes = ray.nodes()
    assert nodes and all(n["NodeManagerAddress"] == "127.0.0.1" for n in nodes)
    assert ray.cluster_resources()["CPU"] == 2


def test_ray_build_of_several_specs_for_both_archs_matches_a_local_build(tmp_path, ctl):
    lib = load_library(write_library(tmp_path), out=str(tmp_path / "ray-out"))
    s = build_library(lib, executor="ray", cache_root=str(tmp_path / "ray-cache"))
    assert s.ok and s.executor == "ray" and s.workers == 2
    assert len(compiles(ctl)) == 12 and len(set(compiles(ctl))) == 12
    assert {r.task.arch for r in s.results} == {"sm90a", "sm100a"}
    assert len({r.host for r in s.results}) >= 2, "tasks should spread over both workers"
    assert "on ray (2 workers)" in s.table()

    local = load_library(write_library(tmp_path), out=str(tmp_path / "local-out"))
    build_library(local, jobs=2, cache_root=str(tmp_path / "local-cache"))
    assert tree(tmp_path / "ray-out") == tree(tmp_path / "local-out")

    # a re-run against the shared cache compiles nothing
    s2 = build_library(lib, executor="ray", cache_root=str(tmp_path / "ray-cache"))
    assert sum(r.built for r in s2.results) == 0 and len(compiles(ctl)) == 24


def test_ray_worker_killed_mid_compile_is_retried_and_the_cache_stays_consistent(tmp_path, ctl):
    lib = load_library(write_library(tmp_path, buckets=False), out=str(tmp_path / "out"))
    (ctl / "kill").write_text("")
    s = build_library(lib, executor="ray", cache_root=str(tmp_path / "cache"))
    assert (ctl / "killed").is_dir(), "the stand-in nvcc should have killed a Ray worker"
    assert s.ok
    reset_ctl(ctl)
    assert_cache_consistent(CompileCache(tmp_path / "cache"), count=12)
    # identical to a build where nothing went wrong
    clean = load_library(write_library(tmp_path, buckets=False), out=str(tmp_path / "clean"))
    build_library(clean, jobs=2, cache_root=str(tmp_path / "clean-cache"))
    assert tree(tmp_path / "out") == tree(tmp_path / "clean")


def test_ray_tune_ranks_on_cpu_workers_and_writes_one_database(tmp_path, ctl):
    """With no GPU in the cluster, tuning tasks rank by the cost model on CPU workers; their
    winners land in one database file (merged under its lock)."""
    from library_fixtures import SPEC_AXPY, SPEC_ROWSUM

    from kspec.raybuild import tune_ray
    from kspec.tune import MODEL_DRIVER, TuningDB
    for name, text in (("axpy.kspec", SPEC_AXPY), ("rowsum.kspec", SPEC_ROWSUM)):
        (tmp_path / name).write_text(text)
    db = tmp_path / "tune.json"
    jobs = [(str(tmp_path / n), ("sm90a", "sm100a"), [{"N": 4096, "M": 8}], str(db), str(tmp_path / "cache"), None)
            for n in ("axpy.kspec", "rowsum.kspec")]
    results = tune_ray(jobs)
    assert [len(r) for r in results] == [4, 2]
    entries = TuningDB(db).entries()
    assert len(entries) == 6 and {e.driver for e in entries} == {MODEL_DRIVER}
    assert {e.kernel.split(":")[0] for e in entries} == {"axpy.kspec", "rowsum.kspec"}
