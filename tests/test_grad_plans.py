"""How `kspec grad`'s backward kernels plan (what `kspec graph --strict` says, what `kspec compile`
builds): kernel counts, kinds and backends per arch; GEMMs with the activation's derivative and the
bias's column sum in their epilogues; cross-entropy as one kernel; the cases kspec cannot fuse yet
(attention backward, the norms' dγ/dβ column sums) planned unfused with the reason.  The compile
of the GEMM + gelu backward for both archs with tensor-core SASS is `slow` (CuTe DSL builds)."""
from __future__ import annotations

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


def test_rope_backward_reads_the_inverse_rotation_in_one_elementwise_kernel():
    """RoPE reads Q at `(e + 64) % 128`, a rotation of the head axis: its adjoint reads dY at the
    inverse rotation (here the same, 64 = 128 - 64), so dQ is one elementwise kernel at its ideal
    traffic (read dY, write dQ; cos/sin per position), not a scatter-add summed over e."""
    from kspec.compiler import cost
    prog = load_spec(grad_program(load_spec(SPECS / "rope.kspec"), wrt=["Q"]), is_text=True, file="rope_grad.kspec")
    (sched,) = plan_spec(prog, ARCHS, "rope_bwd", strict=True)
    (p,) = sched.plans
    assert p.kind == "elementwise" and set(p.reads) == {"dY", "cos", "sin"} and p.writes == ("dQ",)
    assert not any(c.fallback for c in p.choices.values())
    sizes = {"B": 8, "S": 4096, "H": 32}
    c = cost(sched, sizes)
    q = 8 * 4096 * 32 * 128
    assert c.fused_bytes == pytest.approx(2 * q * 2 + 2 * 4096 * 128 * 4, rel=1e-3)
    text = grad_program(load_spec(SPECS / "rope.kspec"), wrt=["Q"])
    assert "dY[b, s, h, (e + 64) % 128]" in text and "sum(" not in text.split("kernel rope_bwd")[1]


def test_row_softmax_backward_is_one_row_kernel():
    (p,) = _bwd("row_softmax").plans
    assert p.kind == "rowwise" and {c.backend for c in p.choices.values()} == {"rowwise"}


@pytest.mark.parametrize("stem", ["rmsnorm", "layernorm", "add_rmsnorm"])
def test_norm_backward_is_a_row_kernel_plus_column_sums(stem):
    """dX is one row kernel; dγ/dβ are sums over the rows (columns of [M, N]): the row kernel
    accumulates their column partials and one colsum kernel finishes them (tests/test_column_partials.py)."""
    sched = _bwd(stem)
    rows = [p for p in sched.plans if p.kind == "rowwise"]
    assert len(rows) == 1 and "dx" in rows[0].writes
    cols = [p for p in sched.plans if p.kind == "colsum"]
    assert len(cols) == 1 and len(sched.plans) == 2
    assert sum(o.kind == "reduction" for o in cols[0].ir.ops) == (2 if stem == "layernorm" else 1)
    assert all({c.backend for c in p.choices.values()} == {"rowwise"} for p in sched.plans)
    assert not any(c.fallback for p in sched.plans for c in p.choices.values())


@pytest.mark.parametrize("stem", ["attention_causal", "attention_varlen_padded", "attention_alibi"])
def test_attention_backward_plans_unfused_and_says_why(stem, monkeypatch):
    """S, dP, dQ, dK, dV as tensor-core GEMMs, dO·O as a row kernel, the softmax backward as one
    elementwise kernel; ALiBi's slope gradient, a sum over (b, i, j), is a split reduction.
    (The causal and padded-varlen ones as they plan without FlashAttention-4 installed; with it: one
    attention_bwd plan, tests/test_fa4_attention_bwd.py.)"""
    from kspec.backends.cute import compat
    monkeypatch.setattr(compat, "fa4_available", lambda: "flash-attn-4 is not installed (pip install ...)")
    sched = _bwd(stem, strict=False)
    why = "FlashAttention-4's backward" if stem == "attention_alibi" else "flash-attn-4 is not installed"
    assert any("attention backward" in n and why in n for n in sched.fusion.notes), sched.fusion.notes
    kinds = _summary(sched)
    assert sum(k == "gemm" for k, _, _ in kinds) == 5 and ("rowwise", {"rowwise"}, False) in kinds
    assert [p.writes for p in sched.plans if any(c.fallback for c in p.choices.values())] == []
    with pytest.raises(KspecError, match="attention backward"):
        _bwd(stem)


def test_gqa_backward_sums_query_heads_after_per_head_gemms(monkeypatch):
    """Without FlashAttention-4 (with it: one attention_bwd plan, FA4's GQA backward)."""
    from kspec.backends.cute import compat
    monkeypatch.setattr(compat, "fa4_available", lambda: "flash-attn-4 is not installed (pip install ...)")
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
    from kspec.backends.toolchain import find_toolchain_or_reason
    if find_toolchain_or_reason() is not None:
        pytest.skip(f"no CUDA toolchain: {find_toolchain_or_reason()}")
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
    from kspec.numerics import storage_dtype
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
    sizes = {"M": M, "N": N}
    scratch = {b.name: np.full(tuple(d if isinstance(d, int) else sizes[d] for d in b.shape), np.nan, np.float32)
               for b in kern.lowered.ir.buffers if b.role == "intermediate"}
    got, _ = kern(arrays, outputs=scratch)
    want = kspec.reference(g, f"{stem}_bwd")(**arrays)["dx"]
    np.testing.assert_allclose(got["dx"].astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------- column reductions, on the CPU

_COLUMN_SUMS = """
kernel colsums {
  in dy : bf16[M, N]
  in xh : f32[M, N]
  out dgamma : f32[N]
  out dbeta : f32[N]
  dgamma[n] = sum(m) f32(dy[m, n]) * xh[m, n]
  dbeta[n] = sum(m) f32(dy[m, n])
}
"""


def test_column_reductions_of_the_norm_backward_run_on_the_cpu(tmp_path):
    """dβ = sum(m) dy (a reduction) and dγ = sum(m) dy·x̂ (a dot product over rows) with no row
    kernel to accumulate them (a norm backward's own run there: tests/test_column_partials.py): the
    generic backend's column kernels (32 columns and a share of the rows per CTA, the rows split
    over CTAs whose partials are added atomically into a zeroed output), compiled with g++ against a
    threaded CUDA emulation, equal numpy; they are no fallback, so --strict plans them."""
    import numpy as np

    from generic_emu import emulate
    from kspec.compile import emit_spec
    path = tmp_path / "colsums.kspec"
    path.write_text(_COLUMN_SUMS)
    em = emit_spec(path, ("sm90a",), "colsums", strict=True)
    cols = [eps[0] for eps in em.plans.values()
            if eps[0].lowered.backend == "generic" and eps[0].emitted.init]
    assert len(cols) == 2                                   # dβ's and dγ's column sums
    rng = np.random.default_rng(3)
    M, N = 700, 45                                          # 2 column blocks, the rows split in 3
    for ep in cols:
        arrays, names, grid, block = emulate(ep, {"M": M, "N": N}, rng, tmp_path)
        assert grid == 6 and block == 256
        (out,) = [names[x] for x, _ in ep.emitted.init]
        ins = [arrays[n].astype(np.float64) for n in arrays if n != out]
        want = (ins[0] * ins[1] if len(ins) == 2 else ins[0]).sum(axis=0)
        np.testing.assert_allclose(arrays[out], want, rtol=1e-4, atol=1e-4)


def test_bench_model_part_runs(capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import importlib
    grad_bench = importlib.import_module("grad")
    assert grad_bench.main(["--rows", "512", "--cols", "256"]) == 0
    out = capsys.readouterr().out
    from conftest import FA4_MISSING
    (gqa,) = [x for x in out.splitlines() if x.strip().startswith("attention_gqa ")]
    assert "cross_entropy                  1         0" in out
    # with FlashAttention-4 the GQA backward is one plan (FA4's own five kernels), else unfused
    assert ("(attention backward unfused)" in gqa) == bool(FA4_MISSING), out
    assert FA4_MISSING or gqa.split()[1:3] == ["1", "0"], out


@pytest.mark.parametrize("stem", ["gemm_bias_gelu_residual", "layernorm", "rmsnorm", "add_rmsnorm", "cross_entropy",
                                  "swiglu_mlp", "mlp2", "row_softmax"])
def test_forward_with_saved_values_plans_like_the_spec(stem):
    """NAME_fwd (the forward plus its saved statistics) is as many kernels as the shipped spec: the
    saved row statistics are stored by the kernels that compute them."""
    g = load_spec(grad_program(load_spec(SPECS / f"{stem}.kspec")), is_text=True)
    (fwd,) = plan_spec(g, ARCHS, f"{stem}_fwd", strict=True)
    (orig,) = plan_spec(load_spec(SPECS / f"{stem}.kspec"), ARCHS, strict=True)
    assert [p.kind for p in fwd.plans] == [p.kind for p in orig.plans]
    written = {w for p in fwd.plans for w in p.writes}
    assert {t.name for t in g.kernel(f"{stem}_fwd").outputs} <= written


@pytest.mark.skipif(__import__("conftest").FA4_MISSING is not None, reason="FlashAttention-4 unavailable")
@pytest.mark.parametrize("stem", ["attention_causal", "attention_gqa", "attention_varlen_padded", "attention_alibi"])
def test_attention_forward_saves_its_lse_from_the_fused_kernel(stem):
    g = load_spec(grad_program(load_spec(SPECS / f"{stem}.kspec")), is_text=True)
    (fwd,) = plan_spec(g, ARCHS, f"{stem}_fwd", strict=True)
    (p,) = fwd.plans
    assert p.kind == "attention" and p.ir.attention.lse == "p_lse"


class _AcceptBackward:
    """An oracle wrapping the real planner that implements attention_bwd kernels (records the IR)."""

    def __init__(self):
        from kspec.backends.registry import Planner
        self.inner, self.seen = Planner(), []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def can_fuse(self, ir, archs):
        if ir.kind == "attention_bwd":
            self.seen.append(ir)
            return None
        return self.inner.can_fuse(ir, archs)


def _bwd_graph(stem: str):
    from kspec.compiler import build_graph, canonicalize
    prog = load_spec(grad_program(load_spec(SPECS / f"{stem}.kspec")), is_text=True, file=f"{stem}_grad.kspec")
    (k,) = [k for k in prog.kernels if k.name == f"{stem}_bwd"]
    g = build_graph(k)
    canonicalize(g)
    return g


@pytest.mark.parametrize("stem, causal, d", [("attention_causal", True, 64), ("attention", False, 128),
                                            ("attention_gqa", False, 128), ("attention_varlen_padded", True, 128)])
def test_attention_backward_is_one_attention_bwd_group_where_a_backend_implements_it(stem, causal, d):
    """The whole backward (S, P, dP, D, dS, dQ, dK, dV) is one group of kind attention_bwd when the
    oracle says a backend implements it; its IR names FlashAttention-4's operands.  GQA: K and V read
    at head h / 4, dK and dV the sums over each group's query heads, one group too (the group and
    the K/V head count in the IR).  Padded sequences (`i < Lq[b] and j < Lk[b] and ..`): the used
    lengths in the IR (FlashAttention-4's seqused_q / seqused_k), written to its JSON only when set."""
    from kspec.compiler import FusionContext, format_ir, fuse, ir_from_json, ir_to_json
    g = _bwd_graph(stem)
    oracle = _AcceptBackward()
    res = fuse(g, FusionContext(oracle, ARCHS, f"{stem}_bwd"))
    kinds = [grp.kind for grp in res.groups]
    assert kinds == ["attention_bwd"], kinds
    (ir,) = oracle.seen
    a = ir.attention_bwd
    assert (a.q_buffer, a.k_buffer, a.v_buffer, a.o_buffer, a.do_buffer) == ("Q", "K", "V", "O", "dO")
    assert a.lse_buffer.endswith("lse") and (a.dq_buffer, a.dk_buffer, a.dv_buffer) == ("dQ", "dK", "dV")
    assert a.causal is causal and a.scale == "scale" and a.head_dim == d and a.dtype in ("f16", "bf16")
    assert (a.kv_group, a.kv_head) == ((4, "KH") if stem == "attention_gqa" else (None, None))
    padded = stem == "attention_varlen_padded"
    assert (a.seqused_q, a.seqused_k) == (("Lq", "Lk") if padded else (None, None)) and a.bottom_right == padded
    assert ("seqused_q" in ir_to_json(ir)["attention_bwd"]) == padded
    assert ("used lengths: i < Lq[b], j < Lk[b]" in format_ir(ir)) == padded
    assert {b for _, b, _ in ir.stores} == {"dQ", "dK", "dV"}
    # the IR's JSON (its digest, `kspec lower --json`) and its printout carry the backward's structure
    assert ir_from_json(ir_to_json(ir)) == ir and ir_from_json(ir_to_json(ir)).attention_bwd == a
    assert f"attention backward: Q=Q K=K V=V O=O dO=dO LSE={a.lse_buffer}" in format_ir(ir)
    from kspec.backends.cute import attention_bwd
    assert attention_bwd.covered(ir, "sm90a") is None and attention_bwd.covered(ir, "sm100a") is None


@pytest.mark.parametrize("stem, why", [
    ("attention_alibi", "a gradient of a tensor the score modification reads is not among them")])
def test_attention_backward_unfused_reason_names_what_is_missing(stem, why):
    sched = _bwd(stem, strict=False)
    assert any("attention backward" in n and why in n for n in sched.fusion.notes), sched.fusion.notes
