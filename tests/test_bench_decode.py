"""bench/attention_decode.py on a machine without a GPU (or without torch): --help works, a run says
there is nothing to benchmark, and why, and exits 0, and its pieces (the specs it builds, the bytes it
counts, the peak it divides by) are right without a device."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "attention_decode.py"


def _module():
    spec = importlib.util.spec_from_file_location("attention_decode", BENCH)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_help_and_a_gpu_less_run():
    r = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--paged" in r.stdout and "--peak-gbs" in r.stdout
    try:
        import torch
    except ImportError:
        torch = None                               # the bench says so: nothing to benchmark either
    if torch is not None and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run the benchmark itself")
    r = subprocess.run([sys.executable, str(BENCH), "--paged"], capture_output=True, text=True, timeout=120)
    why = "torch is not installed" if torch is None else "no CUDA device"
    assert r.returncode == 0 and f"{why}: nothing to benchmark" in r.stdout, r.stdout + r.stderr


def test_bytes_and_peak():
    m = _module()
    # B=1, S=1, T=4096: K and V are 2 * 4096 * 8 * 128 bf16 values, Q and O 2 * 32 * 128
    assert m.kv_bytes(1, 1, 4096) == 2 * 4096 * 8 * 128 * 2 + 2 * 32 * 128 * 2
    assert m.peak_gbs("NVIDIA H200", None) == 4800.0
    assert m.peak_gbs("NVIDIA H100 NVL", None) == 3900.0       # the longest matching name wins
    assert m.peak_gbs("NVIDIA H100 80GB HBM3", None) == 3350.0
    assert m.peak_gbs("some GPU", None) is None and m.peak_gbs("some GPU", 1000.0) == 1000.0


def test_the_decode_specs_are_one_gqa_attention_and_a_refusal_gives_the_reason():
    m = _module()
    from kspec.backends import registry
    from kspec.compiler import plan_kernel
    from kspec.spec_lang import load_spec
    for text in (m.DENSE, m.PAGED):
        sched = plan_kernel(load_spec(text, is_text=True).kernels[0], ("sm90a",))
        (p,) = sched.plans
        assert p.kind == "attention" and p.ir.attention.kv_group == 4
        if registry.get("cute").can_implement(p.ir, "sm90a") is None:
            assert m.fused_or_reason(text, "sm90a") is None
    # K and V grouped differently: not one kernel, and the reason is what the bench prints
    why = m.fused_or_reason(m.DENSE.replace("V[b, j, h / 4, e]", "V[b, j, h / 2, e]"), "sm90a")
    assert why and ("different head groupings" in why or "no backend can build" in why), why


def test_fa4_direct_uses_its_own_split_heuristic_where_it_has_one():
    m = _module()
    assert m.fa4_direct_kwargs("sm100a") == {"num_splits": 0}        # FA4's _get_fwd_config picks the count
    assert m.fa4_direct_kwargs("sm90a") == {"num_splits": 1}         # FA4 b36: "SplitKV not supported on SM 9.0"


def test_the_split_column_reads_the_workspace_the_runtime_asks_for():
    from types import SimpleNamespace

    from kspec.backends.cute import splitkv
    m = _module()
    plan = SimpleNamespace(dims=(("B", "B"), ("H", "H"), ("S", "S"), ("T", ("MP", "P")), ("HK", "KH")))
    sizes = {"B": 1, "H": 32, "S": 1, "MP": 512, "P": 256, "KH": 8}

    class Mod:
        attention_decode_paged = SimpleNamespace(entry=SimpleNamespace(plans=(plan,)))

        def launches(self, p, arch, dims, device, sms):
            ns = splitkv.num_splits(*dims, sms)
            return ([3, 4], splitkv.partial_bytes(ns, 1, 32, 1, 128)[2]) if ns > 1 else ([0], 0)
    assert m.kspec_splits(Mod(), "attention_decode_paged", "sm100a", sizes, 132) == 16
    assert m.kspec_splits(Mod(), "attention_decode_paged", "sm100a", {**sizes, "MP": 2}, 132) == 1
