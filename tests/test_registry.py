"""The backend registry and the truthful tools: which backend builds each kernel on each arch, why
a preferred one declined, fallbacks shown by `kspec graph`/`lower`/`compile` and refused by
--strict, backend pins from the command line and from a spec's schedule block."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FA4_MISSING, needs_fa4

from kspec.backends import registry
from kspec.backends.api import Backend
from kspec.backends.registry import Planner
from kspec.cli import main
from kspec.compiler import plan_kernel
from kspec.core import ARCHS, KspecError
from kspec.spec_lang import load_spec

SPECS = Path(__file__).resolve().parent.parent / "specs"

F32_GEMM = """kernel qgemm {
  in  A : f32[M, K]
  in  B : f32[K, N] col
  out C : f32[M, N]
  C[m, n] = sum(k) A[m, k] * B[k, n]
}
"""
GEMV = """kernel gemv {
  in  A : f16[M, K]
  in  x : f16[K]
  out y : f32[M]
  y[m] = sum(k) A[m, k] * x[k]
}
"""
ELEMENTWISE = """kernel ew {
  in  X : f16[M, N]
  out Y : f16[M, N]
  Y[m, n] = relu(X[m, n]) * 2.0
}
"""
HEAD96 = """kernel att96 {
  param scale : f32 = 0.1
  in  Q : f16[B, H, S, 96]
  in  K : f16[B, H, T, 96]
  in  V : f16[B, H, T, 96]
  out O : f16[B, H, S, 96]
  s[b, h, i, j] = scale * sum(e) Q[b, h, i, e] * K[b, h, j, e]
  p[b, h, i, j] = softmax(j) s[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[b, h, j, e]
}
"""


def plans(src: str, **kw):
    k = load_spec(src, is_text=True).kernels[0]
    return plan_kernel(k, ARCHS, Planner(**kw)).plans


def write(tmp_path, name, src) -> str:
    p = tmp_path / f"{name}.kspec"
    p.write_text(src)
    return str(p)


def run_cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_every_registered_backend_follows_the_protocol():
    assert registry.PREFERENCE[-1] == "generic"          # the loop-kernel backend is the last resort
    for b in registry.backends():
        assert isinstance(b, Backend), b
        assert set(b.capabilities.archs) <= set(ARCHS) and b.capabilities.describe()
    with pytest.raises(KspecError, match="unknown backend 'nope'"):
        registry.get("nope")


def test_fusion_asks_the_registry_for_epilogue_ops():
    from kspec.backends.cutlass.backend import CutlassBackend
    planner = Planner()
    assert planner.epilogue_fns(ARCHS) >= CutlassBackend.capabilities.epilogue_fns
    assert "mod" not in planner.epilogue_fns(ARCHS) and "floordiv" not in planner.epilogue_fns(ARCHS)


def test_compiler_holds_no_backend_tables():
    """The compiler asks backends; it names no arch, backend or CUTLASS rule of its own."""
    root = Path(__file__).resolve().parent.parent / "compiler"
    for p in root.glob("*.py"):
        text = p.read_text()
        for word in ("sm90a", "sm100a", "cutlass", "EPILOGUE_FNS", "attention_veto"):
            assert word not in text.lower() if word.islower() else word not in text, (p.name, word)


def test_front_end_holds_no_backend_limits():
    """spec_lang checks a schedule setting's form; which tiles, clusters and stage counts exist is
    each backend's to say (their setting_problem).  No tile/cluster/stage limit, no backend name
    beyond the example in the `backend = NAME` message, and no arch beyond the grammar's own."""
    root = Path(__file__).resolve().parent.parent / "spec_lang"
    for p in root.glob("*.py"):
        text = p.read_text()
        for word in ("_setting_problem", "powers of two", "CTAs", "M tile", "N tile", "K tile", "K cluster",
                     "between 1 and 16", "multiple of 8", "64, 128 or 256", "cute", "fmha", "cta"):
            assert word.lower() not in text.lower().replace("like `backend = cutlass`", ""), (p.name, word)
        assert "cutlass" not in text.lower().replace("like `backend = cutlass`", ""), p.name


GEMM_SPEC = (SPECS / "gemm.kspec").read_text()


def _schedule_line(setting: str) -> tuple[str, int, int]:
    src = GEMM_SPEC.rstrip("\n") + f"\nschedule gemm {{ {setting} }}\n"
    return src, src.count("\n"), len("schedule gemm { ") + 1


@pytest.mark.parametrize("setting, cute, cutlass", [
    ("tile = 100x128x64", "tile 100x128 (M 64 or 128; N 64, 128, 192 or 256)", "tile M must be 64, 128 or 256"),
    ("tile = 128x12x64", "tile 128x12 (M 64 or 128; N 64, 128, 192 or 256)",
     "tile N must be a multiple of 8 from 8 to 256"),
    ("tile = 128x128x48", "tile K is 64 for f16 operands", "tile K must be 16, 32, 64, 128 or 256"),
    ("cluster = 3x1x1", "cluster 3x1 (powers of two, at most 8 CTAs: kspec launches portable cluster sizes only)",
     "cluster sizes must be powers of two"),
    ("cluster = 2x1x2", "the K cluster size must be 1", "the K cluster size must be 1"),
    ("cluster = 8x4x1", "cluster 8x4 (powers of two, at most 8 CTAs: kspec launches portable cluster sizes only)",
     "a cluster holds at most 8 CTAs (kspec launches portable cluster sizes only)"),
    ("stages = 1", "stages must be at least 2", "stages must be at least 2"),
])
def test_schedule_settings_no_backend_honours(tmp_path, capsys, setting, cute, cutlass):
    """The user mistakes the front end used to catch with CUTLASS's numbers are found by the
    backends when the kernel is planned: located at the setting, each backend's rule in the hint,
    and never dropped for a loop-kernel fallback."""
    src, line, col = _schedule_line(setting)
    f = write(tmp_path, "gemm", src)
    rc, _, err = run_cli(capsys, "graph", f, "--arch", "sm90a")
    assert rc == 1, err
    assert f"gemm.kspec:{line}:{col}: error: kernel gemm: no backend builds kernel gemm_0 (gemm) on sm90a " \
           f"with `{setting}`" in err, err
    lines = err.splitlines()
    caret = lines[[i for i, l in enumerate(lines) if "error:" in l][0] + 2]
    assert caret == " " * (4 + col - 1) + "^" * len(setting)
    assert f"hint: cute: {cute}" in err and f"; cutlass: {cutlass}" in err and "drop it" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("cluster", ["4x4x1", "16x1x1", "2x8x1"])
def test_non_portable_clusters_refused_on_sm100a(tmp_path, capsys, cluster):
    """Issue 22 item 4: sm_100a hardware runs 9-16 CTA clusters only when a launch sets
    CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, which kspec never does; both GEMM backends
    refuse them when the kernel is planned (they used to accept up to 16, and the launch failed)."""
    setting = f"cluster = {cluster}"
    src, line, col = _schedule_line(setting)
    f = write(tmp_path, "gemm", src)
    rc, _, err = run_cli(capsys, "graph", f, "--arch", "sm100a")
    assert rc == 1, err
    assert f"gemm.kspec:{line}:{col}: error: kernel gemm: no backend builds kernel gemm_0 (gemm) on sm100a " \
           f"with `{setting}`" in err, err
    cm, cn = cluster.split("x")[:2]
    assert f"cute: cluster {cm}x{cn} (powers of two, at most 8 CTAs" in err
    assert "cutlass: a cluster holds at most 8 CTAs" in err
    # 8 CTAs is still taken on sm_100a
    (p,) = plans(_schedule_line("cluster = 4x2x1")[0])
    assert dict(p.choices["sm100a"].config)["cluster"] == "4x2"


def test_schedule_settings_each_backend_judges_its_own(tmp_path, capsys):
    """A setting one backend takes and another does not picks the one that takes it; a pin to the
    other is a located error naming it; a stage count the CuTe DSL takes is not refused up front."""
    src, line, col = _schedule_line("tile = 128x128x32")          # CUTLASS: yes; CuTe DSL: K is 64 for f16
    (p,) = plans(src)
    for arch in ARCHS:
        ch = p.choices[arch]
        assert ch.backend == "cutlass" and dict(ch.config)["tile"] == "128x128x32" and dict(ch.config)["source"] == "hint"
        assert ch.rejected == (("cute", "tile 128x128x32: tile K is 64 for f16 operands (128 bytes per stage)"),)
    f = write(tmp_path, "gemm", src.replace("{ tile", "{ backend = cute  tile"))
    rc, _, err = run_cli(capsys, "lower", f)
    assert rc == 1 and f"gemm.kspec:{line}:{col + len('backend = cute  ')}: error: kernel gemm: backend cute cannot " \
        "build kernel gemm_0 (gemm) on sm90a with `tile = 128x128x32`" in err, err
    assert "hint: cute: tile K is 64 for f16 operands" in err
    src, _, _ = _schedule_line("stages = 17")                      # was refused by the front end (1..16)
    (p,) = plans(src)
    assert {(c.backend, dict(c.config)["stages"]) for c in p.choices.values()} == {("cute", "17")}
    # a cluster-only hint takes the heuristic's tile, and is what tuning gets (no other candidates)
    (p,) = plans(_schedule_line("cluster = 2x1x1")[0])
    assert {(c.backend, dict(c.config)["cluster"]) for c in p.choices.values()} == {("cute", "2x1")}
    assert all(len(registry.get("cute").candidates(p.ir, a)) == 1 for a in ARCHS)
    # an arch's own schedule overrides the generic one setting by setting, and is reported where written
    src = _schedule_line("tile = 128x128x64")[0] + "schedule gemm for sm100a { stages = 1 }\n"
    f = write(tmp_path, "gemm2", src)
    rc, _, err = run_cli(capsys, "graph", f)
    assert rc == 1 and f"gemm2.kspec:{src.count(chr(10))}:28: error: kernel gemm: no backend builds kernel gemm_0 " \
        "(gemm) on sm100a with `stages = 1`" in err, err


@pytest.mark.parametrize("src, kind, reason", [
    (F32_GEMM, "gemm", "cutlass: operands f32 x f32: CUTLASS tensor cores multiply f32 data as tf32"),
    (GEMV, "contraction", "no other backend implements contraction kernels"),
])
def test_slow_paths_are_reported_as_fallbacks(src, kind, reason):
    (p,) = plans(src)
    for arch in ARCHS:
        ch = p.choices[arch]
        assert (ch.backend, ch.kind) == ("generic", kind) and "loop" in ch.fallback, ch
        assert reason in ch.fallback


# head dim 512: neither FlashAttention-4 (sm90a: 8..256) nor the CUTLASS FMHA templates take it
HEAD512 = HEAD96.replace("96", "512").replace("att512", "att96")


@needs_fa4
def test_head_dim_96_is_one_fused_kernel_where_flashattention4_is_installed():
    (p,) = plans(HEAD96)
    assert p.kind == "attention" and p.choices["sm90a"].backend == "cute" and p.choices["sm90a"].fallback is None


def test_unsupported_attention_head_dim_is_visible_and_strict_refuses_it(tmp_path, capsys):
    ps = plans(HEAD512)
    assert [(p.kind, p.choices["sm90a"].backend) for p in ps][1:] == [("rowwise", "rowwise"), ("gemm", "generic")]
    assert ps[0].choices["sm90a"].backend in ("cute", "cutlass")
    assert ps[1].choices["sm90a"].fallback is None                        # the softmax is a row kernel
    assert "operands f32 x f16" in ps[2].choices["sm90a"].fallback        # P (f32) x V (f16)
    f = write(tmp_path, "att96", HEAD512)
    rc, out, err = run_cli(capsys, "graph", f, "--arch", "sm90a")
    assert rc == 0
    assert "attention at" in out and "head dims 32, 64, 128, 256, not 512" in out
    assert "FALLBACK att96_2 on sm90a: a naive loop GEMM" in out
    rc, out, err = run_cli(capsys, "graph", f, "--arch", "sm90a", "--strict")
    assert rc == 1 and "att96.kspec:" in err
    # the unfused attention is refused first, with the backends' reasons
    assert "this attention is not fused into one kernel" in err and "not 512" in err
    assert "--strict forbids unfused attention" in err


def test_strict_compile_fails_before_any_toolchain_runs(tmp_path, capsys):
    f = write(tmp_path, "qgemm", F32_GEMM)
    rc, _, err = run_cli(capsys, "compile", f, "--strict", "-o", tmp_path / "out")
    assert rc == 1 and "kernel qgemm_0 (gemm) on sm90a would run as a naive loop GEMM" in err
    assert "operands f32 x f32" in err
    assert not (tmp_path / "out").exists()


def test_pinned_backend_from_the_command_line(tmp_path, capsys):
    gemm = SPECS / "gemm.kspec"
    rc, out, _ = run_cli(capsys, "lower", gemm, "--backend", "generic")
    assert rc == 0 and "sm90a: generic gemm (block=256)  FALLBACK: a naive loop GEMM" in out
    rc, out, _ = run_cli(capsys, "lower", gemm, "--backend", "cutlass")
    assert rc == 0 and "sm90a: cutlass gemm (tile=128x128x64" in out
    # --backend puts a backend first: kernels it does not build are chosen as usual
    f = write(tmp_path, "ew", ELEMENTWISE)
    rc, out, _ = run_cli(capsys, "lower", f, "--backend", "cutlass")
    assert rc == 0 and "sm90a: generic elementwise" in out
    q = write(tmp_path, "qgemm", F32_GEMM)
    rc, out, _ = run_cli(capsys, "lower", q, "--backend", "cutlass")
    assert rc == 0 and "sm90a: generic gemm (block=256)  FALLBACK" in out and "cutlass: operands f32 x f32" in out
    rc, _, err = run_cli(capsys, "graph", gemm, "--backend", "nope")
    assert rc == 1 and "unknown backend 'nope'" in err and "backends: cute, cutlass, rowwise, generic" in err


def test_pinned_backend_from_a_schedule_block(tmp_path, capsys):
    src = (SPECS / "gemm.kspec").read_text() + "\nschedule gemm for sm100a { backend = generic }\n"
    (p,) = plans(src)
    assert p.choices["sm100a"].backend == "generic" and p.choices["sm90a"].backend != "generic"
    # a spec pin is binding: a pinned backend that cannot build the kernel is an error naming both
    q = write(tmp_path, "qgemm", F32_GEMM + "schedule qgemm { backend = cutlass }\n")
    rc, _, err = run_cli(capsys, "lower", q)
    assert rc == 1 and "backend cutlass cannot build kernel qgemm_0 (gemm) on sm90a: operands f32 x f32" in err
    bad = (SPECS / "gemm.kspec").read_text() + "\nschedule gemm { backend = tensorrt }\n"
    f = write(tmp_path, "bad", bad)
    rc, _, err = run_cli(capsys, "graph", f)
    assert rc == 1 and "kernel gemm: unknown backend 'tensorrt'" in err and "bad.kspec:" in err


def test_kspec_lower_prints_ir_backend_and_cost(capsys):
    rc, out, err = run_cli(capsys, "lower", SPECS / "gemm_rowmax.kspec", "--sizes", "M=4096,N=4096,K=4096")
    assert rc == 0, err
    assert "kernel gemm_rowmax_0 : gemm   (spec kernel gemm_rowmax)" in out
    assert "rowmax : f32 = max over n of add(acc, bias[n])" in out
    assert "sm100a: cute gemm (tile=128x128 cluster=1x1 2cta=false stages=auto source=heuristic)" in out
    assert "cost at M=4096, N=4096, K=4096:" in out
    rc, out, _ = run_cli(capsys, "lower", SPECS / "attention.kspec", "--format", "json")
    (doc,) = json.loads(out)
    # FlashAttention-4 through the CuTe DSL backend where it is installed, else the CUTLASS FMHA templates
    want = "cute" if FA4_MISSING is None else "cutlass"
    assert doc["ir"]["kind"] == "attention" and doc["backends"]["sm90a"]["backend"] == want


def test_compile_manifest_records_backend_and_kind(tmp_path, capsys):
    """Checked through --emit-only (no toolchain): what graph prints is what compile emits."""
    f = write(tmp_path, "qgemm", F32_GEMM)
    rc, out, err = run_cli(capsys, "compile", f, "--emit-only", "-o", tmp_path / "src")
    assert rc == 0, err
    src = (tmp_path / "src" / "qgemm" / "qgemm_0.sm90a.cu").read_text()
    assert "plain CUDA kernel" in src


def test_internal_errors_exit_2_with_a_report_hint(monkeypatch, capsys, tmp_path):
    from kspec.core import KspecInternalError

    def boom(*a, **k):
        raise KspecInternalError("the planner lost a node")

    monkeypatch.setattr("kspec.compile.plan_spec", boom)
    rc, _, err = run_cli(capsys, "graph", SPECS / "gemm.kspec")
    assert rc == 2 and "kspec: internal error: the planner lost a node" in err
    assert "please report it" in err and "--debug" in err and "Traceback" not in err
    rc, _, err = run_cli(capsys, "graph", SPECS / "gemm.kspec", "--debug")
    assert rc == 2 and "Traceback" in err


PACKED_ELEMENTWISE = """kernel pk {
  in  cu : i32[B + 1]
  in  X : f16[B, S, 64] packed(cu)
  out Y : f16[B, S, 64] packed(cu)
  Y[b, s, e] = relu(X[b, s, e])
}
"""


def test_no_backend_is_a_typed_error_with_each_backends_reason(tmp_path):
    """'no backend can build' is told apart by type (bench/prebuild.py skips such specs), and the
    error carries the kernel, the arch and every backend's reason."""
    from kspec.core import NoBackendError
    with pytest.raises(NoBackendError) as ei:
        plans(PACKED_ELEMENTWISE)
    e = ei.value
    assert isinstance(e, KspecError) and (e.kernel, e.kind, e.arch) == ("pk_0", "elementwise", "sm90a")
    assert [b for b, _ in e.reasons] == ["generic"] and "packed(cu)" in e.reasons[0][1]
    assert e.message.startswith("no backend can build kernel pk_0 (elementwise) on sm90a: generic: X is packed")
    assert e.span is not None and (e.span.line, e.span.col) == (5, 16)
    # bench/prebuild.py lists such a spec as skipped: it catches the type, not a message prefix
    text = (Path(__file__).resolve().parent.parent / "bench" / "prebuild.py").read_text()
    assert "except NoBackendError" in text and "no backend can build" not in text


def test_the_ir_carries_the_hints_fusion_saw():
    """Schedule hints are computed once per kernel: the candidates fusion asks the registry about
    and the scheduled kernel IR carry the same object (here a `backend = cutlass` pin, which binds
    fusion as well as the choice)."""
    seen = []

    class Spy(Planner):
        def can_fuse(self, ir, archs):
            seen.append(ir.hints)
            return super().can_fuse(ir, archs)

    src = (SPECS / "gemm_rowmax.kspec").read_text() + "\nschedule gemm_rowmax { backend = cutlass }\n"
    k = load_spec(src, is_text=True).kernels[0]
    sched = plan_kernel(k, ARCHS, Spy())
    (p,) = sched.plans
    assert seen and all(h is p.ir.hints for h in seen)
    assert [(a, h.backend) for a, h in p.ir.hints] == [(a, "cutlass") for a in ARCHS]
    assert {c.backend for c in p.choices.values()} == {"cutlass"}


def test_attention_schedule_settings_go_to_the_backend_that_takes_them(tmp_path, capsys):
    """FlashAttention-4 chooses its own tiles: a tile setting is built by the CUTLASS FMHA kernel
    that has that tile, and a tile neither has is an error at the setting naming both rules."""
    base = (SPECS / "attention.kspec").read_text()
    (p,) = plans(base + "schedule attention for sm90a { tile = 128x128x128 }\n")
    ch = p.choices["sm90a"]
    assert p.kind == "attention" and ch.backend == "cutlass" and dict(ch.config)["tile"] == "128x128x128"
    if FA4_MISSING is None:
        assert ch.rejected[0][0] == "cute" and "FlashAttention-4 chooses its own tiles" in ch.rejected[0][1]
    f = write(tmp_path, "att", base + "schedule attention for sm90a { tile = 128x64x128 }\n")
    rc, _, err = run_cli(capsys, "graph", f, "--arch", "sm90a")
    line = (base + "schedule").count("\n") + 1
    # not given up for an unfused plan with loop GEMMs: the setting was written for the attention
    assert rc == 1 and f"att.kspec:{line}:32: error: kernel attention: no backend builds the fused attention " \
        "kernel on sm90a with `tile = 128x64x128`" in err, err
    assert "cutlass: the FMHA kernel for head dim 128 on sm90a has tile 128x128x128 only" in err
    if FA4_MISSING is None:
        assert "cute: FlashAttention-4 chooses its own tiles and pipeline; it takes no tile setting" in err


MIXED_FP8 = """kernel mixed {
  in  A : f8e4m3[M, K]
  in  B : f8e5m2[K, N] col
  in  s : f32[N]
  out D : bf16[M, N]
  D[m, n] = (sum(k) A[m, k] * B[k, n]) * s[n]
}
"""


@pytest.mark.skipif(registry.get("cute").available() is not None, reason="the CuTe DSL is not installed")
def test_paths_nothing_validates_are_opt_in(tmp_path, capsys):
    """Issue 22: tf32 WGMMA on sm90a and mixed fp8 kinds on tcgen05 (sm100a) have never run on a GPU:
    the CuTe DSL backend builds them only when asked (`backend = cute` in the schedule, or
    --backend cute); otherwise CUTLASS C++ builds them, and `kspec graph` says why not the CuTe
    DSL backend.  The validated arch keeps the CuTe DSL backend."""
    tf32 = SPECS / "gemm_tf32.kspec"
    (p,) = plans(tf32.read_text())
    assert (p.choices["sm90a"].backend, p.choices["sm100a"].backend) == ("cutlass", "cute")
    assert p.choices["sm90a"].opt_in and p.choices["sm90a"].opt_in[0][0] == "cute"
    (p,) = plans(MIXED_FP8)
    assert (p.choices["sm90a"].backend, p.choices["sm100a"].backend) == ("cute", "cutlass")
    rc, out, _ = run_cli(capsys, "graph", write(tmp_path, "mixed", MIXED_FP8))
    assert rc == 0 and "sm100a: cutlass gemm" in out
    assert ("(not cute: f8e4m3 x f8e5m2 on tcgen05 (kind::f8f6f4 with mixed kinds, documented as unsupported by "
            "NVIDIA's CuTe DSL example) is not yet validated on any GPU; built only when asked: `backend = cute` "
            "in the spec's schedule for sm100a, or --backend cute)") in out
    rc, out, _ = run_cli(capsys, "graph", write(tmp_path, "mixed", MIXED_FP8), "--format", "json")
    doc = json.loads(out)
    assert doc["plans"][0]["backends"]["sm100a"]["opt_in"][0][0] == "cute"
    assert doc["plans"][0]["backends"]["sm90a"]["opt_in"] == []
    # asked for: by the schedule (that arch) or by the command line (every kernel it can build)
    (p,) = plans(MIXED_FP8 + "schedule mixed for sm100a { backend = cute }\n")
    assert p.choices["sm100a"].backend == "cute" and not p.choices["sm100a"].opt_in
    (p,) = plans(tf32.read_text(), pinned="cute")
    assert p.choices["sm90a"].backend == "cute"
    rc, out, _ = run_cli(capsys, "graph", tf32, "--backend", "cute")
    assert rc == 0 and "sm90a: cute gemm" in out and "not cute" not in out
