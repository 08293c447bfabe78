"""The `kspec selftest` cases of issue 22 (bench/risks/): each settles on a GPU a risk no CPU test
can; here they are rehearsed on the fake driver."""
from __future__ import annotations

import io
import json

import pytest
from conftest import ROOT, test_cache_root
from test_cute_backend import needs_dsl


RISK_SPECS = ("risk_residual_64x128", "risk_big_epilogue", "risk_tf32_cute", "risk_mixed_fp8_cute")


@pytest.fixture(scope="module")
def risk_arts(tmp_path_factory):
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    out = tmp_path_factory.mktemp("risks")
    cache = CompileCache(test_cache_root())
    return [compile_spec(ROOT / "bench" / "risks" / f"{s}.kspec", ("sm90a", "sm100a"), out, cache=cache)
            for s in RISK_SPECS]


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
def test_issue_22_risk_cases_are_wired(risk_arts, arch, tmp_path):
    """Issue 22 item 9: the selftest cases that settle each risk on a GPU (bench/risks/, prebuilt by
    bench/prebuild.py for bench/gpu_check.sh), rehearsed on the fake driver: every artifact builds
    with the CuTe DSL backend at the configuration the risk names, its launches check out, its
    results say which risk they settle, and K = 0 is refused before any launch."""
    from kspec.selftest import RISK_ARCHS, RISKS, run
    for art in risk_arts:
        m = json.loads((art / "manifest.json").read_text())
        b = m["kernels"][0]["plans"][0]["binaries"][arch]
        assert b["config"]["backend"] == "cute", (art.name, b["config"])
    cfg = {a.name: json.loads((a / "manifest.json").read_text())["kernels"][0]["plans"][0]["binaries"]["sm100a"]["config"]
           for a in risk_arts}
    assert cfg["risk_residual_64x128"]["tile"] == "64x128" and cfg["risk_big_epilogue"]["tile"] == "128x256"
    out = io.StringIO()
    rc = run([str(a) for a in risk_arts], fake=arch, bench=False, json_path=str(tmp_path / "r.json"), out=out)
    text = out.getvalue()
    assert rc == 0, text
    res = json.loads((tmp_path / "r.json").read_text())
    for art in risk_arts:
        if arch in RISK_ARCHS.get(art.name, (arch,)):
            assert f"{art.name} ({arch}):  [settles: {RISKS[art.name]}]" in text
        else:   # an sm_100a risk is not settled by an sm_90a run (the H200 run of 2026-12-04 said "yes")
            assert f"{art.name} ({arch}):  [settles nothing on {arch}: its risk is on " in text, text
            assert not any(c["risk"] for c in json.loads((tmp_path / "r.json").read_text())["checks"]
                           if c["artifact"] == art.name and c["variant"] != "K=0")
        empty = [c for c in res["checks"] if c["artifact"] == art.name and c["variant"] == "K=0"]
        assert len(empty) == 1 and empty[0]["ok"] and "K = 0" in empty[0]["detail"], empty
    assert all(c["ok"] for c in res["checks"])


@needs_dsl
@pytest.mark.cute
def test_gpu_check_summary_names_the_risk_each_artifact_settles(risk_arts, tmp_path):
    """bench/gpu_check.sh's summary says, per artifact, which risk its results settle; a rehearsal
    on the fake driver says it checked the launches only."""
    import os
    import shutil
    import subprocess
    import sys
    prebuilt = tmp_path / "prebuilt"
    for art in risk_arts[:2]:
        shutil.copytree(art, prebuilt / art.name)
    summary = tmp_path / "summary.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")}
    env.update(PYTHON=sys.executable, KSPEC_PREBUILT=str(prebuilt), KSPEC_GPU_CHECK_FAKE="sm100a")
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(summary)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    text = summary.read_text()
    assert r.returncode == 0, r.stdout + r.stderr + text
    assert ("settles: sm_100a residual ring parity at a 64x128 tile (2 epilogue sub-tiles; issue 22 item 1): "
            "rehearsed (launch ABI only)") in text, text
    assert "PASS risk_big_epilogue" in text and "result: PASS" in text


@pytest.mark.cute
def test_the_fa4_shared_memory_question_is_open_not_failed_in_a_rehearsal(compiled, tmp_path):
    """FA4's sm_100a kernels ask for 232,448 B of dynamic shared memory beside a 1,024 B static
    section, over the per-block limit as the fake driver counts it: a rehearsal reports the
    question as open (only a GPU answers it), not as a failure and not as a pass."""
    from conftest import FA4_MISSING
    if FA4_MISSING:
        pytest.skip(f"FlashAttention-4 unavailable: {FA4_MISSING}")
    from kspec.selftest import FA4_SMEM_RISK, run
    art = compiled("attention", ("sm100a",))
    out = io.StringIO()
    rc = run([str(art)], fake="sm100a", bench=False, json_path=str(tmp_path / "r.json"), out=out)
    text = out.getvalue()
    res = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and f"[settles: {FA4_SMEM_RISK}]" in text, text
    opened = [c for c in res["checks"] if c["open"]]
    assert opened and all("static shared memory exceed" in c["detail"] and c["risk"] == FA4_SMEM_RISK for c in opened)
    assert "open: only a GPU answers them" in text
    assert [c for c in res["checks"] if c["variant"] == "T=0"], "attention over T = 0 keys is refused by name"


@needs_dsl
@pytest.mark.cute
def test_selftest_checks_the_quantized_and_grouped_gemms(compiled, tmp_path):
    """The block-scaled and MoE artifacts go through every selftest check on the fake driver: the
    reduction-over-nothing check sets the reduced size (K, D) to 0, never a derived extent (`K/128`
    block-scale counts, `E+1` offsets, packed row counts) nor a packed output's sequence count E
    (E = 0 empties the output, which is a legal call), and the inputs satisfy the spec's own
    divisibility (K a multiple of 128 for 128-wide blocks)."""
    from kspec.selftest import run
    arts = [compiled(stem, ("sm90a",)) for stem in ("fp8_gemm_blockwise", "moe_grouped_gemm", "moe_gather_gemm")]
    out = io.StringIO()
    rc = run([str(a) for a in arts], fake="sm90a", bench=False, json_path=str(tmp_path / "r.json"), out=out)
    text = out.getvalue()
    assert rc == 0, text
    variants = {}
    for c in json.loads((tmp_path / "r.json").read_text())["checks"]:
        variants.setdefault(c["artifact"], set()).add(c["variant"])
    assert "K=0" in variants["fp8_gemm_blockwise"] and not any("/" in v for v in variants["fp8_gemm_blockwise"])
    for moe in ("moe_grouped_gemm", "moe_gather_gemm"):
        assert "D=0" in variants[moe] and "E=0" not in variants[moe], variants[moe]
        assert not any("+" in v or "rows" in v for v in variants[moe]), variants[moe]


def test_random_inputs_are_folded_into_the_recorded_index_ranges():
    """A key-length tensor the spec only compares against (a paged cache's kv_len) has no bound in
    the spec; the selftest folds its random values into the range the runtime checks, leaving
    valid values and an allowed sentinel alone."""
    from types import SimpleNamespace

    import numpy as np

    from kspec.core import IndexRange
    from kspec.selftest import within_index_ranges
    entry = SimpleNamespace(
        inputs=[SimpleNamespace(name="bt", shape=("B", "MP")), SimpleNamespace(name="kv_len", shape=("B",)),
                SimpleNamespace(name="label", shape=("B",))],
        index_ranges=[IndexRange("kv_len", "bt", 1, ("MP", "P"), inclusive=True),
                      IndexRange("label", "bt", 1, "MP", ignore=-100)])
    host = {"bt": np.zeros((3, 4), np.int32), "kv_len": np.array([-4, 70, 64], np.int32),
            "label": np.array([-100, 9, 2], np.int32)}
    # P is no input's extent: the bound falls back on the shapes the entry names, so give it through MP*P
    entry.inputs.append(SimpleNamespace(name="pages", shape=("P",)))
    host["pages"] = np.zeros(16, np.int32)
    got = within_index_ranges(entry, host)
    assert got["kv_len"].tolist() == [4, 70 % 65, 64]          # [0, MP*P] = [0, 64]
    assert got["label"].tolist() == [-100, 9 % 4, 2]           # the sentinel stays
