"""The README tutorial's printed output (tests/test_readme_blocks.py runs every block as written)."""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np

from conftest import ROOT

import kspec

README = (ROOT / "README.md").read_text()


def _tutorial_spec() -> str:
    block = re.search(r"```\n(# mlp_tail\.kspec\n.*?)```", README, re.S)
    assert block, "the tutorial spec is missing from the README"
    return block.group(1)


def test_tutorial_spec_checks_and_the_error_example_is_exact(tmp_path):
    spec = tmp_path / "mlp_tail.kspec"
    spec.write_text(_tutorial_spec())
    r = subprocess.run([sys.executable, "-m", "kspec", "check", "mlp_tail.kspec"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() in README
    bad = tmp_path / "bad" / "mlp_tail.kspec"
    bad.parent.mkdir()
    bad.write_text(_tutorial_spec().replace("sum(k) A[m, k]", "A[m, k]"))
    r = subprocess.run([sys.executable, "-m", "kspec", "check", "mlp_tail.kspec"], cwd=bad.parent,
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.splitlines()[0] in README


def test_tutorial_graph_ratio_and_reference_api(tmp_path):
    spec = tmp_path / "mlp_tail.kspec"
    spec.write_text(_tutorial_spec())
    r = subprocess.run([sys.executable, "-m", "kspec", "graph", str(spec), "--sizes", "M=4096,N=4096,K=4096"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "fused/unfused DRAM bytes: 0.167" in r.stdout and "0.167" in README
    f = kspec.reference(str(spec))
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((32, 16)), rng.standard_normal((16, 8))
    bias, res = rng.standard_normal(8), rng.standard_normal((32, 8))
    out = f(A=a, B=b, bias=bias, R=res, alpha=0.5)
    assert set(out) == {"D"} and out["D"].dtype == np.float16 and out["D"].shape == (32, 8)


def test_tutorial_compile_emit_only(tmp_path):
    spec = tmp_path / "mlp_tail.kspec"
    spec.write_text(_tutorial_spec())
    r = subprocess.run([sys.executable, "-m", "kspec", "compile", str(spec), "--emit-only", "-o", str(tmp_path / "src")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "src" / "mlp_tail").iterdir()) == [
        "mlp_tail_0.sm100a.py", "mlp_tail_0.sm90a.py"]   # CuTe DSL modules (the default GEMM backend)


def test_training_section_runs_as_written(tmp_path):
    """The Training section: `kspec grad` of the tutorial spec, then its Python block as written
    (CPU torch: the pair runs through the numpy reference) leaves gradients on A, B and bias."""
    import pytest
    pytest.importorskip("torch", reason="the training block needs torch (CPU is enough)")
    (tmp_path / "mlp_tail.kspec").write_text(_tutorial_spec())
    section = README[README.index("## Training: `kspec grad`"):README.index("## Shipped specs")]
    cmds = re.findall(r"```bash\n(.*?)```", section, re.S)[0]
    grad_cmd = cmds.splitlines()[0].split("#")[0].split()
    assert grad_cmd[:2] == ["kspec", "grad"]
    r = subprocess.run([sys.executable, "-m", "kspec", *grad_cmd[1:]], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    check = "\nassert A.grad.shape == (64, 32) and B.grad is not None and bias.grad.abs().sum() > 0\n"
    r = subprocess.run([sys.executable, "-c", block + check], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "mlp_tail_grad.kspec").read_text()
    for line in re.findall(r"```\n(  acc\[m, n\].*?)```", section, re.S)[0].splitlines():
        assert line.split("...")[0] in text, line
