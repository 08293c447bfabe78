"""`kspec graph` (text, dot, json, svg) and `kspec run --reference`, through `kspec.cli.main` and once
through the installed entry point."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import shipped_params

from kspec.cli import main, random_inputs
from kspec.spec_lang import load_spec

SPECS = Path(__file__).resolve().parent.parent / "specs"
GBGR = str(SPECS / "gemm_bias_gelu_residual.kspec")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------- kspec graph

def test_graph_text_shows_one_fused_kernel_and_bytes_saved(capsys):
    rc, out, err = run_cli(capsys, "graph", GBGR, "--sizes", "M=4096,N=4096,K=4096")
    assert rc == 0, err
    assert "graph of kernel gemm_bias_gelu_residual:" in out
    assert "kernel gemm_bias_gelu_residual: 1 fused kernel\n" in out
    assert "[gemm_bias_gelu_residual_0] gemm: reads A, B, alpha, bias, R -> writes D" in out
    assert "GEMM A=A (row), B=B (col), m=m n=n k=k" in out
    assert "elementwise gelu[m, n] : f32 =h" in out
    # the CuTe DSL backend builds it; the spec's sm90a schedule hint is taken as given
    assert "sm90a: cute gemm (tile=128x128 cluster=2x1 2cta=false stages=auto source=hint)" in out
    assert "sm100a: cute gemm (tile=128x128 cluster=1x1 2cta=false stages=auto source=heuristic)" in out
    assert "FALLBACK" not in out
    assert "cost model at M=4096, N=4096, K=4096:" in out
    ratio = (8 * 4096 + 2) / (48 * 4096 + 2)
    saved = (48 - 8) * 4096 * 4096 / 1e6       # bytes, in MB (the bias terms cancel)
    m = re.search(r"fused/unfused DRAM bytes: ([0-9.]+)  \(([0-9.]+) MB saved\)", out)
    assert m, out
    assert float(m.group(1)) == round(ratio, 3)
    assert float(m.group(2)) == pytest.approx(saved, abs=0.01)
    assert "unfused (one kernel per op)  6" in out


def test_graph_unfused_flag(capsys):
    rc, out, _ = run_cli(capsys, "graph", GBGR, "--unfused")
    assert rc == 0
    assert "kernel gemm_bias_gelu_residual: 6 fused kernels" in out
    assert "global intermediates:" in out
    assert "fused/unfused DRAM bytes: 1.000  (0 B saved)" in out


def test_graph_attention_text(capsys):
    rc, out, err = run_cli(capsys, "graph", SPECS / "attention_causal.kspec", "--arch", "sm90a")
    assert rc == 0, err
    # the backend's veto callback decides; either way the plan is printed, with the reason if vetoed
    if "[attention_causal_0] attention:" in out:
        assert "kernel attention_causal: 1 fused kernel\n" in out
        assert "fused attention: Q=Q, K=K, V=V, softmax over j, causal; the [b, h, i, j] scores stay on chip" in out
    else:
        assert "kernel attention_causal: 3 fused kernels\n" in out
        assert re.search(r"attention at n\d+: not fused \(sm90a: .+\); using the unfused plan", out)


def test_graph_dot(capsys, tmp_path):
    rc, out, _ = run_cli(capsys, "graph", GBGR, "--format", "dot")
    assert rc == 0
    assert out.startswith('digraph "gemm_bias_gelu_residual" {') and out.rstrip().endswith("}")
    assert out.count('subgraph "cluster_') == 1
    assert 'label="gemm_bias_gelu_residual_0 (gemm)\\nsm90a: cute, sm100a: cute"; style=rounded; color=blue;' in out
    assert re.search(r'n\d+ -> n\d+ \[label="m,k"\];', out)
    if shutil.which("dot"):
        r = subprocess.run(["dot", "-Tplain"], input=out.encode(), capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
    path = tmp_path / "g.dot"
    rc, out, _ = run_cli(capsys, "graph", GBGR, "--format", "dot", "-o", path)
    assert rc == 0 and out == f"wrote {path}\n"
    assert path.read_text().startswith("digraph")


def test_graph_dot_has_one_cluster_per_kernel(capsys):
    rc, out, _ = run_cli(capsys, "graph", GBGR, "--format", "dot", "--unfused")
    assert rc == 0
    assert out.count('subgraph "cluster_') == 6


def test_graph_json(capsys):
    rc, out, _ = run_cli(capsys, "graph", GBGR, "--format", "json", "--sizes", "M=4096,N=4096,K=4096")
    assert rc == 0
    doc = json.loads(out)
    assert doc["kernel"] == "gemm_bias_gelu_residual"
    kinds = sorted(n["kind"] for n in doc["nodes"])
    assert kinds == sorted(["param", "input", "input", "input", "input", "contraction", "elementwise", "broadcast",
                            "elementwise", "elementwise", "elementwise", "cast", "output"])
    ids = {n["id"] for n in doc["nodes"]}
    assert all(e["from"] in ids and e["to"] in ids for e in doc["edges"])
    (plan,) = doc["plans"]
    assert plan["kind"] == "gemm" and plan["writes"] == ["D"]
    assert set(plan["nodes"]) == {n["id"] for n in doc["nodes"] if n["kind"] not in ("param", "input", "output")}
    assert plan["backends"]["sm90a"] == {"backend": "cute", "kind": "gemm", "fallback": None, "rejected": [], "opt_in": [],
                                         "config": {"tile": "128x128", "cluster": "2x1", "2cta": "false",
                                                    "stages": "auto", "source": "hint"}}
    c = doc["cost"]
    assert c["fused_bytes"] == 8 * 4096 * 4096 + 2 * 4096
    assert c["unfused_bytes"] == 48 * 4096 * 4096 + 2 * 4096
    assert c["unfused_kernels"] == 6


def test_graph_json_for_a_spec_with_two_kernels(capsys, tmp_path):
    spec = tmp_path / "two.kspec"
    spec.write_text("kernel a { in x : f32[N]\n out y : f32[N]\n y[i] = x[i] * 2.0 }\n"
                    "kernel b { in x : f32[N]\n out y : f32[N]\n y[i] = x[i] + 1.0 }\n")
    rc, out, _ = run_cli(capsys, "graph", spec, "--format", "json")
    assert rc == 0
    docs = json.loads(out)
    assert [d["kernel"] for d in docs] == ["a", "b"]


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_graph_svg(capsys, tmp_path):
    path = tmp_path / "g.svg"
    rc, out, err = run_cli(capsys, "graph", GBGR, "--format", "svg", "-o", path)
    assert rc == 0, err
    assert out == f"wrote {path}\n"
    data = path.read_text()
    assert "<svg" in data and "cluster_gemm_bias_gelu_residual_0" in data


def test_graph_svg_without_graphviz(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))           # no `dot` on PATH
    path = tmp_path / "g.svg"
    rc, out, err = run_cli(capsys, "graph", GBGR, "--format", "svg", "-o", path)
    assert rc == 1
    assert "error: drawing SVG needs Graphviz's `dot` program, which is not installed" in err
    assert "hint: install Graphviz" in err
    assert not path.exists() and "Traceback" not in err


def test_graph_svg_needs_an_output_path(capsys):
    rc, _, err = run_cli(capsys, "graph", GBGR, "--format", "svg")
    assert rc == 1 and "--format svg needs -o PATH" in err


def test_graph_errors(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "graph", GBGR, "--sizes", "M=x")
    assert rc == 1 and "size M='x' is not an integer" in err
    rc, _, err = run_cli(capsys, "graph", GBGR, "--arch", "sm80")
    assert rc == 1 and "unknown arch 'sm80'" in err
    rc, _, err = run_cli(capsys, "graph", GBGR, "--kernel", "gemm_bias_gelu")
    assert rc == 1 and "no kernel named 'gemm_bias_gelu'" in err
    bad = tmp_path / "bad.kspec"
    bad.write_text("kernel k { in A : f16[M, K]\n out D : f16[M, N]\n D[m, n] = A[m, k] }\n")
    rc, _, err = run_cli(capsys, "graph", bad)
    assert rc == 1 and "index 'k' is not bound on the left side and is not reduced" in err


@pytest.mark.parametrize("spec", shipped_params(sorted(p.name for p in SPECS.glob("*.kspec"))))
def test_graph_every_shipped_spec(capsys, spec):
    rc, out, err = run_cli(capsys, "graph", SPECS / spec, "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["plans"] and doc["cost"]["fused_bytes"] <= doc["cost"]["unfused_bytes"]


# ---------------------------------------------------------------- kspec run --reference

def test_run_reference_prints_checksums(capsys):
    rc, out, err = run_cli(capsys, "run", "--reference", "--random-inputs", "M=256,N=512,K=128",
                           SPECS / "gemm.kspec")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "kernel gemm (reference, seed 0):"
    m = re.fullmatch(r"  D: float16\[256, 512\]  sum=(\S+)  abs-sum=(\S+)  max=(\S+)  min=(\S+)", lines[1])
    assert m, out
    # the same inputs, multiplied independently
    k = load_spec(SPECS / "gemm.kspec").kernels[0]
    ins = random_inputs(k, {"M": 256, "N": 512, "K": 128}, 0)
    assert ins["A"].shape == (256, 128) and ins["B"].shape == (128, 512)
    d = (ins["A"].astype(np.float64) @ ins["B"].astype(np.float64)).astype(np.float16).astype(np.float64)
    assert float(m.group(2)) == pytest.approx(np.abs(d).sum(), rel=1e-3)
    assert float(m.group(3)) == pytest.approx(d.max(), rel=2e-3)
    assert float(m.group(4)) == pytest.approx(d.min(), rel=2e-3)


def test_run_reference_every_output_and_seed(capsys):
    rc, out, _ = run_cli(capsys, "run", "--reference", "--random-inputs", "M=32,N=16,K=8", "--seed", "3",
                         SPECS / "gemm_rowmax.kspec")
    assert rc == 0
    assert "kernel gemm_rowmax (reference, seed 3):" in out
    assert "  D: float16[32, 16]  sum=" in out and "  rowmax: float32[32]  sum=" in out


@pytest.mark.parametrize("sizes, message", [
    ("M=abc", "error: size M='abc' is not an integer"),
    ("M", "error: bad size 'M'"),
    ("M=0", "error: size M=0 is out of range"),
    ("Q=3", "error: kernel gemm has no size symbol Q"),
])
def test_run_reference_bad_sizes(capsys, sizes, message):
    rc, out, err = run_cli(capsys, "run", "--reference", "--random-inputs", sizes, SPECS / "gemm.kspec")
    assert rc == 1
    assert message in err and "Traceback" not in err


def test_installed_entry_point():
    exe = shutil.which("kspec")
    cmd = [exe] if exe else [sys.executable, "-m", "kspec"]
    r = subprocess.run(cmd + ["run", "--reference", "--random-inputs", "M=64,N=64,K=64", str(SPECS / "gemm.kspec")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "D: float16[64, 64]" in r.stdout
    env = dict(os.environ, PATH="/nonexistent")
    r = subprocess.run([sys.executable, "-m", "kspec", "run", "--reference", "--random-inputs", "M=-1",
                        str(SPECS / "gemm.kspec")], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and "out of range" in r.stderr


def test_graph_shows_the_swiglu_dual_gemm_and_the_dram_bytes_it_saves(capsys):
    rc, out, err = run_cli(capsys, "graph", SPECS / "swiglu_mlp.kspec", "--sizes", "M=4096,K=4096,F=11008,N=4096")
    assert rc == 0, err
    assert "kernel swiglu_mlp: 2 fused kernels\n" in out
    assert "[swiglu_mlp_0] gemm: reads X, Wg, Wu -> writes h" in out
    assert "(a dual GEMM: one A tile feeds two accumulators)" in out
    assert re.search(r"fused total\s+2\s+1\.11 TFLOP\s+518\.00 MB", out), out


def test_graph_splits_the_reduction_of_a_loop_kernel_gemm_with_a_note(capsys, tmp_path):
    spec = tmp_path / "f32_rowmax.kspec"
    spec.write_text("""kernel f32_rowmax {
  in  A    : f32[M, K]
  in  B    : f32[K, N]
  out D    : f32[M, N]
  out rmax : f32[M]
  D[m, n] = sum(k) A[m, k] * B[k, n]
  rmax[m] = max(n) D[m, n]
}
""")
    rc, out, err = run_cli(capsys, "graph", spec)
    assert rc == 0, err                       # was: exit 1, "no backend can build kernel f32_rowmax_0"
    assert "kernel f32_rowmax: 2 fused kernels" in out and "[f32_rowmax_1] rowwise: reads D -> writes rmax" in out
    assert "it reduces the stored GEMM result in a kernel of its own" in out
