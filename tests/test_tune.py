"""Autotuning on a CPU machine: candidates, the configuration cost model, the tuning database, and
the tuned configuration reaching the backend's descriptor (`kspec tune`, `kspec compile`)."""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import pytest

from library_fixtures import SPEC_AXPY

from kspec.backends import registry
from kspec.compile import plan_spec
from kspec.core import KspecError
from kspec.spec_lang import load_spec
from kspec.tune import (MODEL_DRIVER, DEVICE_MODELS, TuneEntry, TuningDB, bucket_key, estimate_seconds, rank,
                        tune_spec)

ROOT = Path(__file__).resolve().parents[1]
GEMM = ROOT / "specs" / "gemm.kspec"


@pytest.fixture(scope="module")
def gemm_ir():
    (sched,) = plan_spec(load_spec(GEMM), ("sm90a", "sm100a"))
    (plan,) = sched.plans
    return plan.ir


def _tile(cfg):
    return dict(cfg)["tile"], dict(cfg)["cluster"]


def test_cutlass_offers_distinct_candidates_default_first(gemm_ir):
    b = registry.get("cutlass")
    for arch in ("sm90a", "sm100a"):
        cands = b.candidates(gemm_ir, arch)
        assert cands[0] == b.default_config(gemm_ir, arch)
        assert len(cands) >= 5
        assert len({_tile(c) for c in cands}) == len(cands)


def test_cost_model_follows_the_problem_shape(gemm_ir):
    b = registry.get("cutlass")
    # decode-like: M = 64 rows; a 128-row tile wastes half its MMA work
    small = rank(gemm_ir, "sm90a", b, {"M": 64, "N": 4096, "K": 4096})
    assert _tile(small[0].config)[0].startswith("64x")
    # a big square GEMM: the largest tiles (least L2 traffic per FLOP) win on both archs
    big90 = rank(gemm_ir, "sm90a", b, {"M": 8192, "N": 8192, "K": 8192})
    assert _tile(big90[0].config)[0] in ("128x256x64", "256x128x64")
    big100 = rank(gemm_ir, "sm100a", b, {"M": 8192, "N": 8192, "K": 8192})
    assert _tile(big100[0].config) == ("256x256x64", "2x1x1")
    # sorted, and a larger problem never gets faster
    for r in (small, big90, big100):
        assert [x.seconds for x in r] == sorted(x.seconds for x in r)
    cfg = big90[0].config
    assert estimate_seconds(gemm_ir, "sm90a", cfg, {"M": 8192, "N": 8192, "K": 16384}) > big90[0].seconds


def test_cost_model_wave_quantization_matches_a_hand_count(gemm_ir):
    """M=N=K=8192 on sm90a with 128x256 tiles on 2x1 clusters: 64 x 32 = 2048 CTAs over 132 SMs
    (66 cluster pairs) = 16 waves, each a 128x256x8192 MMA per SM: compute-bound."""
    dm = DEVICE_MODELS["sm90a"]
    cfg = (("tile", "128x256x64"), ("cluster", "2x1x1"))
    got = estimate_seconds(gemm_ir, "sm90a", cfg, {"M": 8192, "N": 8192, "K": 8192})
    waves = math.ceil(2048 / 132)
    compute = waves * 2.0 * 128 * 256 * 8192 / (dm.tensor_flops[2] / dm.sms)
    assert waves == 16
    assert got == pytest.approx(3e-6 + waves * 0.4e-6 + compute, rel=1e-9)


def test_non_gemm_kernels_have_one_candidate_and_a_bandwidth_estimate(tmp_path):
    spec = tmp_path / "axpy.kspec"
    spec.write_text(SPEC_AXPY)
    sched = plan_spec(load_spec(spec), ("sm90a",), kernel="axpy")[0]
    (plan,) = sched.plans
    b = registry.get(plan.choices["sm90a"].backend)
    (only,) = rank(plan.ir, "sm90a", b, {"N": 1 << 24})
    # two f32 inputs and one f32 output of 2^24 elements over 3.35 TB/s
    assert only.seconds == pytest.approx(3e-6 + 3 * 4 * (1 << 24) / 3.35e12, rel=1e-9)


def test_bucket_keys_are_canonical():
    assert bucket_key(None) == "*" and bucket_key({}) == "*"
    assert bucket_key({"N": 4096, "M": 64}) == "M=64,N=4096"
    with pytest.raises(KspecError):
        bucket_key({"M": 0})


def _entry(ir="a" * 64, arch="sm90a", bucket="*", toolchain="nvidia-cutlass 4.2; nvcc 13.0", driver=MODEL_DRIVER,
           tile="128x128x64"):
    return TuneEntry(ir, arch, bucket, "cutlass", toolchain, driver, (("tile", tile), ("cluster", "2x1x1")), 1e-5)


def test_database_prefers_a_measurement_and_ignores_stale_toolchains(tmp_path):
    db = TuningDB(tmp_path / "tune.json")
    db.put([_entry(tile="64x128x64"), _entry(driver="cuda 12080", tile="128x256x64")])
    tc = "nvidia-cutlass 4.2; nvcc 13.0"
    assert dict(db.lookup("a" * 64, "sm90a", "*", "cutlass", tc).config)["tile"] == "64x128x64"
    assert dict(db.lookup("a" * 64, "sm90a", "*", "cutlass", tc, "cuda 12080").config)["tile"] == "128x256x64"
    # another driver: the measurement does not apply, the model ranking does
    assert dict(db.lookup("a" * 64, "sm90a", "*", "cutlass", tc, "cuda 13000").config)["tile"] == "64x128x64"
    assert db.lookup("a" * 64, "sm90a", "*", "cutlass", "nvidia-cutlass 4.2; nvcc 12.8") is None
    assert db.lookup("a" * 64, "sm100a", "*", "cutlass", tc) is None
    # a plain, sorted JSON file that a person can read and commit
    data = json.loads((tmp_path / "tune.json").read_text())
    assert data["format"] == 1 and [e["driver"] for e in data["entries"]] == ["cuda 12080", "model"]
    db.put([_entry(tile="256x128x64")])           # replaces, does not duplicate
    assert len(db.entries()) == 2


def test_damaged_database_is_a_located_user_error(tmp_path):
    p = tmp_path / "tune.json"
    p.write_text("{not json")
    with pytest.raises(KspecError) as e:
        TuningDB(p).entries()
    assert "tune.json is not a kspec tuning database" in e.value.message


def _put_many(path: str, who: int) -> None:
    TuningDB(path).put([_entry(ir=f"{who:02d}{i:062d}") for i in range(15)])


def test_concurrent_writers_merge(tmp_path):
    path = str(tmp_path / "tune.json")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_put_many, args=(path, w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(TuningDB(path).entries()) == 45


def test_tuned_configuration_reaches_the_cutlass_descriptor(tmp_path, gemm_ir, monkeypatch):
    """tune_spec ranks and writes the winners; emit_spec applies them (emission stubbed: no cppgen)."""
    import kspec.compile as kc
    seen = []

    def fake_emit(lowered, cache_root, memo_only=False):
        seen.append(lowered)
        return None
    monkeypatch.setattr(kc, "emit_cached", fake_emit)
    db = TuningDB(tmp_path / "tune.json")
    sizes = {"M": 64, "N": 4096, "K": 4096}
    res = tune_spec(GEMM, ("sm90a", "sm100a"), [sizes], db, measure_gpu=False, verify=False, backend="cutlass")
    assert [(r.arch, r.bucket) for r in res] == [("sm90a", "K=4096,M=64,N=4096"), ("sm100a", "K=4096,M=64,N=4096")]
    assert {e.ir for e in db.entries()} == {gemm_ir.digest()}
    kc.emit_spec(GEMM, ("sm90a", "sm100a"), backend="cutlass", tuned=db.chooser(sizes))
    assert [lp.desc.tile[:2] for lp in seen] == [(64, 128), (64, 128)]
    # another bucket has no entry: the heuristic default
    seen.clear()
    kc.emit_spec(GEMM, ("sm90a",), backend="cutlass", tuned=db.chooser({"M": 4096}))
    assert seen[0].desc.tile == (128, 128, 64)


def test_tune_cli_writes_the_database(tmp_path):
    spec = tmp_path / "axpy.kspec"
    spec.write_text(SPEC_AXPY)
    db = tmp_path / "tune.json"
    r = subprocess.run([sys.executable, "-m", "kspec", "tune", str(spec), "--arch", "sm90a,sm100a", "--sizes", "N=4096,M=8",
                        "--tuning-db", str(db), "--format", "json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [(o["plan"], o["arch"], o["bucket"]) for o in out] == [
        ("axpy_0", "sm90a", "M=8,N=4096"), ("axpy_0", "sm100a", "M=8,N=4096"),
        ("act_0", "sm90a", "M=8,N=4096"), ("act_0", "sm100a", "M=8,N=4096")]
    entries = TuningDB(db).entries()
    assert len(entries) == 4 and all(e.driver == MODEL_DRIVER and e.backend == "generic" for e in entries)
    r = subprocess.run([sys.executable, "-m", "kspec", "tune", str(spec), "--tuning-db", str(tmp_path / "x.json"),
                        "--measure"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--measure needs a CUDA device" in r.stderr


@pytest.mark.nvcc
def test_candidates_are_in_cutlass_configuration_list(gemm_ir):
    """Every extra tile/cluster pair is one of CUTLASS's generator configurations (cutlass_cppgen;
    ~10-40 s per arch, no nvcc, marked with the slow tests)."""
    from kspec.backends.cutlass import compat, gemm
    b = registry.get("cutlass")
    for arch, cc in (("sm90a", 90), ("sm100a", 100)):
        desc = b.lower(gemm_ir, arch).desc
        with compat.offline(cc) as cg:
            valid = {(c.tile, c.cluster) for c in gemm._configs(gemm._make_plan(cg, desc, cc), desc, cc)}
        for cfg in b.candidates(gemm_ir, arch)[1:]:
            tile, cluster = (tuple(int(x) for x in v.split("x")) for v in _tile(cfg))
            assert (tile, cluster) in valid, (arch, tile, cluster)


def test_tune_cli_takes_a_library_manifest(tmp_path):
    from library_fixtures import write_library
    m = write_library(tmp_path)
    db = tmp_path / "tune.json"
    r = subprocess.run([sys.executable, "-m", "kspec", "tune", str(m), "--tuning-db", str(db)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # axpy.kspec: 2 kernels x 2 archs x 2 buckets; rowsum.kspec: 1 kernel x 2 archs, no bucket
    assert "wrote 10 winners" in r.stdout
    assert sorted({e.bucket for e in TuningDB(db).entries()}) == ["*", "M=4096,N=65536", "M=8,N=256"]
