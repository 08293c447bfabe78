"""bench/gpu_check.sh on a machine without a GPU: it must finish, say so, write the summary file
and exit 3 (the documented no-GPU status).  On a GPU machine this test is skipped: run the script."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_without_gpu_writes_summary(tmp_path):
    from kspec.runtime import cuda_available
    if cuda_available()[0]:
        pytest.skip("this machine has a GPU: run bench/gpu_check.sh itself")
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    summary = tmp_path / "out" / "summary.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")}
    env["PYTHON"] = sys.executable
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(summary)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    text = summary.read_text()
    assert "device: none" in text and "result: NO GPU - nothing was run" in text
    assert "total time:" in text


def test_gpu_check_rehearsal_with_fake_driver(tmp_path):
    """KSPEC_GPU_CHECK_FAKE runs the whole script on CPU: selftest --fake over the prebuilt folder,
    and the summary lists each spec with its checks."""
    from kspec.runtime import selftest as fixture
    if shutil.which("bash") is None or shutil.which("nvcc") is None or fixture.find_cxx() is None:
        pytest.skip("needs bash, nvcc and a C++ compiler for the fixture artifact")
    prebuilt = tmp_path / "prebuilt"
    fixture.build_fixture(prebuilt / "fixture", ("sm90a", "sm100a"))
    summary = tmp_path / "summary.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")}
    env.update(PYTHON=sys.executable, KSPEC_PREBUILT=str(prebuilt), KSPEC_GPU_CHECK_FAKE="sm100a")
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(summary)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    text = summary.read_text()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rehearsal: fake driver for sm100a" in text
    assert "PASS fixture" in text and "12 passed, 0 failed" in text
    assert "step selftest: rc=0" in text and "result: PASS" in text
