"""How `kspec grad`'s backward kernels plan (what `kspec graph --strict` says, what `kspec compile`
builds): kernel counts, kinds and backends per arch; GEMMs with the activation's derivative and the
bias's column sum in their epilogues; cross-entropy as one kernel; the cases kspec cannot fuse yet
(attention backward, the norms' dγ/dβ column sums) planned unfused with the reason.  The compile
of the GEMM + gelu backward for both archs with tensor-core SASS is `slow` (CuTe DSL builds)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kspec.compile import plan_spec
from kspec.core import KspecError
from kspec.spec_lang import load_spec
from kspec.spec_lang.grad import grad_program

SPECS = Path(__file__).resolve().parent.parent / "specs"
ROOT = SPECS.parent
ARCHS = ("sm90a", "sm100a")


def _bwd(stem: str, strict: bool = True):
    prog = load_spec(grad_program(load_spec(SPECS / f"{stem}.kspec")), is_text=True, file=f"{stem}_grad.kspec")
    (sched,) = plan_spec(prog, ARCHS, f"{stem}_bwd", strict=strict)
    return sched


def _summary(sched):
    """[(kind, {backend per arch}, fallback?)] per planned kernel."""
    return [(p.kind, {c.backend for c in p.choices.values()}, any(c.fallback for c in p.choices.values()))
            for p in sched.plans]


def test_gemm_bias_gelu_backward_fuses_the_derivative_and_the_bias_sum():
    sched = _bwd("gemm_bias_gelu_residual")
    kinds = _summary(sched)
    assert [k for k, _, _ in kinds] == ["gemm", "gemm", "gemm", "elementwise", "elementwise"]
    assert all(b == {"cute"} for k, b, _ in kinds if k == "gemm") and not any(f for *_, f in kinds)
    recompute = sched.plans[0].ir
    fns = {o.fn for o in recompute.ops if o.kind == "elementwise"}
    assert {"gelu", "where", "eq", "exp"} <= fns                     # gelu' in the recompute GEMM's epilogue
    assert [(r.op, r.axis) for r in recompute.epilogue.reductions] == [("sum", "m")]   # dbias: a column sum
    assert set(sched.plans[1].reads) >= {"B"} and set(sched.plans[2].reads) >= {"A"}


@pytest.mark.parametrize("stem, gemms", [("mlp2", 5), ("swiglu_mlp", 7), ("gemm_bias_relu", 3),
                                         ("gemm", 2), ("batched_gemm", 2)])
def test_gemm_backwards_are_tensor_core_gemms(stem, gemms):
    kinds = _summary(_bwd(stem))
    assert sum(k == "gemm" for k, _, _ in kinds) == gemms
    assert all(b == {"cute"} for k, b, _ in kinds if k == "gemm")
    assert not any(f for *_, f in kinds)


def test_swiglu_backward_mirrors_the_dual_gemm():
    sched = _bwd("swiglu_mlp")
    duals = [p for p in sched.plans if p.kind == "gemm" and p.ir.gemm.b2 is not None]
    assert len(duals) == 1                       # the forward's dual GEMM, recomputed with silu' in its epilogue
    assert {o.fn for o in duals[0].ir.ops if o.kind == "elementwise"} >= {"sigmoid", "mul"}


def test_cross_entropy_backward_is_one_kernel_at_the_spec_minimum():
    from kspec.compiler import cost
    sched = _bwd("cross_entropy")
    (p,) = sched.plans
    assert p.kind == "elementwise" and set(p.reads) == {"logits", "mx", "label", "dloss", "lse_r"}
    c = cost(sched, {"M": 4096, "V": 32000})
    assert c.fused_bytes == pytest.approx(c.minimum_bytes, rel=1e-3)


def test_row_softmax_backward_is_one_row_kernel():
    (p,) = _bwd("row_softmax").plans
    assert p.kind == "rowwise" and {c.backend for c in p.choices.values()} == {"rowwise"}


@pytest.mark.parametrize("stem", ["rmsnorm", "layernorm", "add_rmsnorm"])
def test_norm_backward_is_a_row_kernel_plus_column_sums(stem):
    """dX is one row kernel; dγ/dβ are sums over the rows (columns of [M, N]), which no backend
    builds yet except as loop kernels: planned, marked FALLBACK, refused by --strict."""
    sched = _bwd(stem, strict=False)
    rows = [p for p in sched.plans if p.kind == "rowwise"]
    assert len(rows) == 1 and "dx" in rows[0].writes
    loops = [p for p in sched.plans if any(c.fallback for c in p.choices.values())]
    assert loops and all(p.kind in ("reduction", "contraction") for p in loops)
    with pytest.raises(KspecError, match="would run as a"):
        _bwd(stem)


@pytest.mark.parametrize("stem", ["attention_causal", "attention_varlen_padded", "attention_alibi"])
def test_attention_backward_plans_unfused_and_says_why(stem):
    """S, dP, dQ, dK, dV as tensor-core GEMMs, dO·O as a row kernel, the softmax backward as one
    elementwise kernel; ALiBi's slope gradient is a sum over (b, i, j), a loop reduction for now."""
    sched = _bwd(stem, strict=False)
    assert any("attention backward" in n and "FlashAttention-4's backward" in n for n in sched.fusion.notes)
    kinds = _summary(sched)
    assert sum(k == "gemm" for k, _, _ in kinds) == 5 and ("rowwise", {"rowwise"}, False) in kinds
    assert [p.writes for p in sched.plans if any(c.fallback for c in p.choices.values())] == \
        ([("dslope",)] if stem == "attention_alibi" else [])
    with pytest.raises(KspecError, match="attention backward"):
        _bwd(stem)


def test_gqa_backward_sums_query_heads_after_per_head_gemms():
    sched = _bwd("attention_gqa", strict=False)
    gemm_writes = [w for p in sched.plans if p.kind == "gemm" for w in p.writes]
    assert any(w.startswith("dK_part") for w in gemm_writes) and any(w.startswith("dV_part") for w in gemm_writes)


def test_emitted_recompute_gemm_selects_in_its_epilogue(tmp_path):
    """--emit-only of the GEMM + gelu backward: the recompute GEMM's CuTe DSL epilogue calls F.where
    and F.eq (gelu' at 0), for both archs, without building anything."""
    spec = tmp_path / "g.kspec"
    spec.write_text(grad_program(load_spec(SPECS / "gemm_bias_gelu_residual.kspec")))
    r = subprocess.run([sys.executable, "-m", "kspec", "compile", str(spec), "--kernel", "gemm_bias_gelu_residual_bwd",
                        "--strict", "--emit-only", "-o", str(tmp_path / "src")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for arch in ARCHS:
        src = (tmp_path / "src" / "g" / f"gemm_bias_gelu_residual_bwd_0.{arch}.py").read_text()
        assert "F.where(" in src and "F.eq(" in src and "F.gelu(" in src


@pytest.mark.slow
def test_gemm_backward_compiles_with_tensor_cores(tmp_path):
    if shutil.which("cuobjdump") is None:
        pytest.skip("cuobjdump is needed to read the SASS")
    spec = tmp_path / "g.kspec"
    spec.write_text(grad_program(load_spec(SPECS / "gemm_bias_gelu_residual.kspec")))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "kspec", "compile", str(spec), "--kernel", "gemm_bias_gelu_residual_bwd",
                        "--strict", "--arch", "sm90a,sm100a", "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "kspec", "inspect", str(out / "g")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("tensor core: HGMMA") == 3 and r.stdout.count("tensor core: UTCHMMA") == 3


@pytest.mark.slow
@pytest.mark.parametrize("stem", ["rmsnorm", "layernorm"])
def test_norm_backward_row_kernel_runs_on_the_cpu_emulator(stem):
    """The generated dX row kernel (CUDA text, compiled with g++ against tests/rowwise_emu.h) gives
    the reference's dX: mean's 1/N is the row length read as a launch size."""
    import numpy as np

    import kspec
    from kspec.backends.reference.numerics import storage_dtype
    from kspec.spec_lang import parse, print_program
    from rowwise_harness import EmuKernel, available
    if available():
        pytest.skip(f"cannot emulate row kernels here: {available()}")
    text = grad_program(load_spec(SPECS / f"{stem}.kspec"))
    prog = parse(text)
    bwd_only = print_program(type(prog)(tuple(k for k in prog.kernels if k.name.endswith("_bwd"))))
    kern = EmuKernel(bwd_only, is_text=True, plan=0)
    rng = np.random.default_rng(0)
    M, N = 5, 40
    g = load_spec(text, is_text=True)
    fwd_k = g.kernel(f"{stem}_fwd")
    xs = {t.name: rng.standard_normal(tuple(M if d == "M" else N for d in t.shape)).astype(storage_dtype(t.dtype))
          for t in fwd_k.inputs}
    fwd = kspec.reference(g, f"{stem}_fwd")(**xs)
    arrays = {**xs, **fwd, "dy": rng.standard_normal((M, N)).astype(storage_dtype("bf16"))}
    scratch = {n: np.full((M, N), np.nan, np.float32) for n in kern.lowered.names.values() if n.startswith("tmp_")}
    got, _ = kern(arrays, outputs=scratch)
    want = kspec.reference(g, f"{stem}_bwd")(**arrays)["dx"]
    np.testing.assert_allclose(got["dx"].astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2)
