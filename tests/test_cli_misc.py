"""CLI paths not covered elsewhere: run without a GPU, cache info/clear, inspect errors."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import SPECS

from kspec.runtime import cuda_available


def kspec(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kspec", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


@pytest.mark.skipif(cuda_available()[0], reason="a CUDA device is present")
def test_run_without_a_gpu_says_so_and_points_at_reference():
    r = kspec("run", SPECS / "gemm.kspec", "--random-inputs", "M=64,N=64,K=64")
    assert r.returncode == 1
    assert "no CUDA device" in r.stderr and "--reference" in r.stderr
    assert "Traceback" not in r.stderr


def test_cache_info_and_clear(tmp_path):
    env = {"KSPEC_CACHE_DIR": str(tmp_path / "cache")}
    (tmp_path / "cache" / "ab" / ("ab" + "0" * 62)).mkdir(parents=True)
    r = kspec("cache", "info", env=env)
    assert r.returncode == 0 and f"root: {tmp_path / 'cache'}" in r.stdout
    r = kspec("cache", "clear", env=env)
    assert r.returncode == 0 and "cleared" in r.stdout
    r = kspec("cache", "info", env=env)
    assert "entries: 0" in r.stdout
    assert all(f"  {kind}: 0 (0.0 MiB)" in r.stdout for kind in ("nvcc", "cute", "attention")), r.stdout


def test_inspect_of_a_missing_artifact_is_a_clear_error(tmp_path):
    r = kspec("inspect", tmp_path / "nothing")
    assert r.returncode == 1 and "error" in r.stderr and "Traceback" not in r.stderr


def test_compile_with_an_unknown_arch():
    r = kspec("compile", SPECS / "gemm.kspec", "--arch", "sm80")
    assert r.returncode == 1 and "unknown arch 'sm80'" in r.stderr


def test_graph_and_compile_accept_sm_underscore_spelling(tmp_path):
    r = kspec("compile", SPECS / "gemm.kspec", "--arch", "sm_90a", "--emit-only", "-o", tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "gemm" / "gemm_0.sm90a.py").exists()
