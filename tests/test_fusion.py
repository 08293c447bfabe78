"""Fusion passes: which nodes end up in which kernel group, and the notes saying why something did
not fuse.  Groups are compared as (kind, sorted node labels) so node ids do not matter."""
from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest
from conftest import FA4_MISSING

from kspec.backends.registry import Planner
from kspec.compiler import AttentionInfo, FusionContext, KernelIR, build_graph, canonicalize, fuse, op, plan_kernel, unfused
from kspec.compiler.fusion import is_operator, legal_group
from kspec.core import ARCHS
from kspec.spec_lang import load_spec

SPECS = Path(__file__).resolve().parent.parent / "specs"


def kernel_of(src: str):
    return load_spec(src, is_text=True).kernels[0]


def fused(src: str, oracle=None):
    """Fuse as `kspec graph` does: asking the real backend registry (or the given oracle)."""
    g = build_graph(kernel_of(src))
    canonicalize(g)
    return g, fuse(g, FusionContext(oracle or Planner(), ARCHS, "k"))


class VetoAttention(Planner):
    """An oracle whose backends implement no fused attention (records what fusion asked)."""

    def __init__(self, reason):
        super().__init__()
        self.reason, self.seen = reason, []

    def can_fuse(self, ir, archs):
        self.seen.append(ir)
        return self.reason


def groups(g, res) -> list[tuple[str, list[str]]]:
    return [(grp.kind, sorted(op(g, n).label() for n in grp.nodes if op(g, n).kind != "const"))
            for grp in res.groups]


def check_partition(g, res):
    """Every operator node is in exactly one group, and the groups run in a valid order."""
    seen: dict = {}
    for grp in res.groups:
        for n in grp.nodes:
            assert n not in seen, f"{n} in two groups"
            seen[n] = grp.id
    assert {n for n in g if is_operator(g, n)} == set(seen)
    pos = {grp.id: i for i, grp in enumerate(res.groups)}
    for u, v in g.edges:
        if u in seen and v in seen:
            assert pos[seen[u]] <= pos[seen[v]]


GEMM_HEAD = """kernel c {
  in A : f16[M, K]
  in B : f16[K, N] col
"""


# ---------------------------------------------------------------- GEMM epilogues

def test_epilogue_chain_with_row_and_column_vectors_scales_residual_clamp_cast():
    g, res = fused(GEMM_HEAD + """
  in bn : f16[N]
  in bm : f32[M]
  in sr : f32[M]
  in R  : f16[M, N]
  out D : f16[M, N]
  acc[m, n] : f32 = sum(k) A[m, k] * B[k, n]
  D[m, n] = clamp(sr[m] * (acc[m, n] + bn[n] + bm[m]) + R[m, n], -1.0, 1.0)
}""")
    check_partition(g, res)
    assert groups(g, res) == [("gemm", sorted([
        "contraction sum(k)[m, n] : f32",
        "broadcast broadcast[m, n] : f32", "broadcast broadcast[m, n] : f16", "broadcast broadcast[m, n] : f32",
        "elementwise add[m, n] : f32", "elementwise add[m, n] : f32", "elementwise mul[m, n] : f32",
        "elementwise add[m, n] : f32", "elementwise clamp[m, n] : f32", "cast cast:f16[m, n] : f16 =D"]))]
    assert res.notes == []
    # both clamp bounds were folded into the kernel as constants
    (grp,) = res.groups
    assert sorted(op(g, n).value for n in grp.nodes if op(g, n).kind == "const") == [-1.0, 1.0]


@pytest.mark.parametrize("spec", ["gemm", "gemm_bias_relu", "gemm_bias_gelu_residual", "fp8_gemm_scaled",
                                  "batched_gemm"])
def test_shipped_gemm_specs_are_one_gemm_group(spec):
    g, res = fused((SPECS / f"{spec}.kspec").read_text())
    check_partition(g, res)
    assert [grp.kind for grp in res.groups] == ["gemm"]
    assert {n for n in g if is_operator(g, n)} == res.groups[0].nodes
    assert res.notes == []


def test_aux_store_intermediate_that_is_also_an_output():
    src = GEMM_HEAD + """
  in bn : f16[N]
  out Y : f32[M, N]
  out D : f16[M, N]
  acc[m, n] : f32 = sum(k) A[m, k] * B[k, n]
  Y[m, n] = acc[m, n] + bn[n]
  D[m, n] = relu(Y[m, n])
}"""
    g, res = fused(src)
    assert groups(g, res) == [("gemm", sorted([
        "contraction sum(k)[m, n] : f32", "broadcast broadcast[m, n] : f16", "elementwise add[m, n] : f32 =Y",
        "elementwise relu[m, n] : f32", "cast cast:f16[m, n] : f16 =D"]))]
    sched = plan_kernel(kernel_of(src))
    (plan,) = sched.plans
    assert plan.writes == ("Y", "D") and plan.reads == ("A", "B", "bn")
    assert sched.intermediates == []


def test_epilogue_row_max_is_fused():
    g, res = fused((SPECS / "gemm_rowmax.kspec").read_text())
    assert groups(g, res) == [("gemm", sorted([
        "contraction sum(k)[m, n] : f32", "broadcast broadcast[m, n] : f32", "elementwise add[m, n] : f32 =y",
        "cast cast:f16[m, n] : f16 =D", "reduction max(n)[m] : f32"]))]
    assert res.notes == []


def test_epilogue_column_sum_fused_but_mean_and_min_are_not():
    g, res = fused(GEMM_HEAD + """
  out D : f16[M, N]
  out cs : f32[N]
  out mn : f32[M]
  out me : f32[N]
  acc[m, n] : f32 = sum(k) A[m, k] * B[k, n]
  D[m, n] = acc[m, n]
  cs[n] = sum(m) acc[m, n]
  mn[m] = min(n) acc[m, n]
  me[n] = mean(m) acc[m, n]
}""")
    check_partition(g, res)
    assert groups(g, res) == [
        ("gemm", sorted(["contraction sum(k)[m, n] : f32", "cast cast:f16[m, n] : f16 =D", "reduction sum(m)[n] : f32"])),
        ("rowwise", ["reduction min(n)[m] : f32"]),        # a row reduction: a row kernel
        ("reduction", ["reduction mean(m)[n] : f32"])]
    c = [n for n in g if op(g, n).kind == "contraction"][0]
    assert res.notes == [
        f"reduction min(n)[m] : f32 not fused into the GEMM at {c}: 'min' reductions are not fused into "
        "epilogues (only max and sum)",
        f"reduction mean(m)[n] : f32 not fused into the GEMM at {c}: 'mean' reductions are not fused into "
        "epilogues (only max and sum)"]


def test_reduction_over_the_batch_axis_is_not_fused():
    g, res = fused("""kernel c {
  in A : bf16[L, M, K]
  in B : bf16[L, K, N]
  out D : f32[L, M, N]
  out bs : f32[M, N]
  acc[b, m, n] : f32 = sum(k) A[b, m, k] * B[b, k, n]
  D[b, m, n] = acc[b, m, n]
  bs[m, n] = sum(b) acc[b, m, n]
}""")
    assert groups(g, res) == [("gemm", ["contraction sum(k)[b, m, n] : f32"]),
                              ("reduction", ["reduction sum(b)[m, n] : f32"])]
    assert len(res.notes) == 1
    assert res.notes[0].endswith("an epilogue reduction must reduce over the GEMM's row or column axis")


def test_elementwise_op_over_another_iteration_space_is_not_fused():
    g, res = fused(GEMM_HEAD + """
  in X : f32[M, N, P]
  out D : f32[M, N, P]
  acc[m, n] : f32 = sum(k) A[m, k] * B[k, n]
  D[m, n, p] = acc[m, n] * X[m, n, p]
}""")
    assert groups(g, res) == [("gemm", ["contraction sum(k)[m, n] : f32"]),
                              ("elementwise", ["broadcast broadcast[m, n, p] : f32", "elementwise mul[m, n, p] : f32 =D"])]
    assert len(res.notes) == 1
    assert res.notes[0].endswith("its iteration space [m, n, p] differs from the GEMM's")


def test_consumer_that_also_needs_a_non_fusable_value_of_the_gemm_is_not_fused():
    # D reads acc and t, computed with an integer modulo (no epilogue implementation), so D joining
    # the epilogue would be a cycle
    g, res = fused(GEMM_HEAD + """
  out D : f32[M, N]
  acc[m, n] : f32 = sum(k) A[m, k] * B[k, n]
  t[m, n] = f32(i32(acc[m, n]) % 3)
  D[m, n] = acc[m, n] + t[m, n]
}""")
    check_partition(g, res)
    assert groups(g, res) == [("gemm", ["contraction sum(k)[m, n] : f32"]),
                              ("elementwise", ["cast cast:f32[m, n] : f32 =t", "cast cast:i32[m, n] : i32",
                                               "elementwise add[m, n] : f32 =D", "elementwise mod[m, n] : i32"])]
    c = [n for n in g if op(g, n).kind == "contraction"][0]
    assert f"elementwise mod[m, n] : i32 not fused into the GEMM at {c}: 'mod' has no epilogue implementation" \
        in res.notes
    assert f"elementwise add[m, n] : f32 =D not fused into the GEMM at {c}: fusing would create a cycle between " \
           "kernels" in res.notes


def test_consumer_of_a_non_epilogue_reduction_is_not_fused():
    g, res = fused(GEMM_HEAD + """
  out D : f32[M, N]
  acc[m, n] : f32 = sum(k) A[m, k] * B[k, n]
  r[m] = mean(n) acc[m, n]
  D[m, n] = acc[m, n] - r[m]
}""")
    # the row mean and the subtraction that reads it are one row kernel after the GEMM
    assert [k for k, _ in groups(g, res)] == ["gemm", "rowwise"]
    assert any("it broadcasts a value that is not a row or column vector input" in n for n in res.notes)


def test_batched_epilogue_rejects_a_matrix_broadcast_over_the_batch():
    g, res = fused("""kernel c {
  in A : bf16[L, M, K]
  in B : bf16[L, K, N]
  in R : f32[M, N]
  out D : f32[L, M, N]
  D[b, m, n] = sum(k) A[b, m, k] * B[b, k, n] + R[m, n]
}""")
    assert [k for k, _ in groups(g, res)] == ["gemm", "elementwise"]
    assert any("it broadcasts a value that is not a row or column vector input" in n for n in res.notes)


def test_gemms_sharing_a_bias_each_load_it():
    # CSE merges the two identical bias broadcasts; each GEMM must still get its own (a broadcast
    # is a free view), or the second GEMM would read a materialised [M, N] bias from the first
    src = GEMM_HEAD + """
  in C : f16[K, N] col
  in bias : f16[N]
  out D : f16[M, N]
  out E : f16[M, N]
  D[m, n] = sum(k) A[m, k] * B[k, n] + bias[n]
  E[m, n] = sum(k) A[m, k] * C[k, n] + bias[n]
}"""
    g, res = fused(src)
    check_partition(g, res)
    epi = sorted(["contraction sum(k)[m, n] : f32", "broadcast broadcast[m, n] : f16", "elementwise add[m, n] : f32"])
    assert groups(g, res) == [("gemm", sorted(epi + ["cast cast:f16[m, n] : f16 =D"])),
                              ("gemm", sorted(epi + ["cast cast:f16[m, n] : f16 =E"]))]
    sched = plan_kernel(kernel_of(src))
    assert sched.intermediates == []
    assert [set(p.reads) for p in sched.plans] == [{"A", "B", "bias"}, {"A", "C", "bias"}]


def test_elementwise_only_spec_is_one_elementwise_kernel():
    g, res = fused("""kernel ew {
  param a : f32 = 0.5
  in x : f16[M, N]
  in y : f16[M, N]
  in r : f16[N]
  out z : f16[M, N]
  t[m, n] = silu(x[m, n] * a) + y[m, n]
  z[m, n] = t[m, n] * r[n] - 1.0
}""")
    check_partition(g, res)
    assert [k for k, _ in groups(g, res)] == ["elementwise"]
    assert {n for n in g if is_operator(g, n)} == res.groups[0].nodes


def test_elementwise_groups_split_by_iteration_space():
    # a column sum (not a row kernel: its rows are not contiguous) splits the elementwise chain
    g, res = fused("""kernel ew {
  in x : f32[M, N]
  out s : f32[N]
  out z : f32[M, N]
  t[m, n] = exp(x[m, n])
  s[n] = sum(m) t[m, n]
  z[m, n] = t[m, n] / s[n]
}""")
    check_partition(g, res)
    assert groups(g, res) == [("elementwise", ["elementwise exp[m, n] : f32 =t"]),
                              ("reduction", ["reduction sum(m)[n] : f32"]),
                              ("elementwise", ["broadcast broadcast[m, n] : f32", "elementwise div[m, n] : f32 =z"])]
    # the same over rows is one row kernel
    g, res = fused("""kernel ew {
  in x : f32[M, N]
  out s : f32[M]
  out z : f32[M, N]
  t[m, n] = exp(x[m, n])
  s[m] = sum(n) t[m, n]
  z[m, n] = t[m, n] / s[m]
}""")
    check_partition(g, res)
    assert [k for k, _ in groups(g, res)] == ["rowwise"]


def test_legal_group_detects_paths_leaving_and_reentering():
    g, _ = fused(GEMM_HEAD + """
  out D : f32[M, N]
  acc[m, n] : f32 = sum(k) A[m, k] * B[k, n]
  t[m, n] = log(acc[m, n])
  D[m, n] = acc[m, n] + t[m, n]
}""")
    c = [n for n in g if op(g, n).kind == "contraction"][0]
    lg = [n for n in g if op(g, n).fn == "log"][0]
    add = [n for n in g if op(g, n).fn == "add"][0]
    assert legal_group(g, {c, add}) == "fusing would create a cycle between kernels"
    assert legal_group(g, {c, lg, add}) is None
    assert legal_group(g, {lg, add}) is None


# ---------------------------------------------------------------- attention

ATTN_S_OUT = """kernel attn {
  param scale : f32 = 0.125
  in  Q : f16[B, H, S, 64]
  in  K : f16[B, H, T, 64]
  in  V : f16[B, H, T, 64]
  out O : f16[B, H, S, 64]
  out s : f32[B, H, S, T]
  s[b, h, i, j] = scale * sum(e) Q[b, h, i, e] * K[b, h, j, e]
  p[b, h, i, j] = softmax(j) s[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[b, h, j, e]
}"""

UNFUSED_ATTENTION = [("gemm", sorted(["contraction sum(e)[b, h, i, j] : f32", "elementwise mul[b, h, i, j] : f32 =s"])),
                     ("rowwise", ["softmax(j)[b, h, i, j] : f32"]),
                     ("gemm", sorted(["contraction sum(j)[b, h, i, e] : f32", "cast cast:f16[b, h, i, e] : f16 =O"]))]


@pytest.mark.parametrize("spec, causal, dtype", [("attention", False, "f16"), ("attention_causal", True, "bf16")])
def test_shipped_attention_is_recognised(spec, causal, dtype):
    g, res = fused((SPECS / f"{spec}.kspec").read_text())
    check_partition(g, res)
    assert [grp.kind for grp in res.groups] == ["attention"]
    (grp,) = res.groups
    assert {n for n in g if is_operator(g, n)} == grp.nodes
    info: AttentionInfo = grp.info
    assert grp.anchor == info.qk
    assert (op(g, info.q).name, op(g, info.k).name, op(g, info.v).name) == ("Q", "K", "V")
    assert (info.batch, info.query, info.key, info.head, info.causal) == (("b", "h"), "i", "j", "e", causal)
    assert [op(g, n).fn for n in info.scale] == ["mul"]
    assert op(g, info.softmax).kind == "softmax" and op(g, info.pv).reduced == ("j",)
    assert res.notes == []


def test_score_matrix_that_is_an_output_is_not_attention():
    g, res = fused(ATTN_S_OUT)
    check_partition(g, res)
    assert [k for k, _ in groups(g, res)] == ["gemm", "rowwise", "gemm"]
    assert groups(g, res) == UNFUSED_ATTENTION
    sm = [n for n in g if op(g, n).kind == "softmax"][0]
    assert res.notes[0] == (f"attention at {sm}: not fused: the score matrix (s) is used elsewhere, "
                            "so it must be written to memory")


def test_attention_vetoed_by_the_backend_gives_the_unfused_plan():
    veto = VetoAttention("no FMHA kernel for head dim 128 here")
    g, res = fused((SPECS / "attention.kspec").read_text(), veto)
    # fusion asked about a self-contained candidate kernel IR, not the graph
    assert len(veto.seen) == 1 and isinstance(veto.seen[0], KernelIR) and veto.seen[0].kind == "attention"
    assert veto.seen[0].attention.head_dims == (128, 128, 128)
    check_partition(g, res)
    assert groups(g, res) == UNFUSED_ATTENTION
    sm = [n for n in g if op(g, n).kind == "softmax"][0]
    assert f"attention at {sm}: not fused (no FMHA kernel for head dim 128 here); using the unfused plan" in res.notes
    # an oracle that accepts keeps the fused kernel
    g, res = fused((SPECS / "attention.kspec").read_text(), VetoAttention(None))
    assert [grp.kind for grp in res.groups] == ["attention"]


def test_softmax_not_followed_by_a_contraction_is_not_attention():
    g, res = fused("""kernel sm {
  in  Q : f16[S, 64]
  in  K : f16[T, 64]
  out P : f32[S, T]
  s[i, j] : f32 = sum(e) Q[i, e] * K[j, e]
  P[i, j] = softmax(j) s[i, j]
}""")
    assert [k for k, _ in groups(g, res)] == ["gemm", "rowwise"]
    assert any("not attention (its result is not consumed by one contraction)" in n for n in res.notes)


# ---------------------------------------------------------------- the unfused baseline

def test_unfused_is_one_group_per_op_with_views_and_scalars_riding_along():
    k = load_spec(SPECS / "gemm_bias_gelu_residual.kspec").kernels[0]
    g = build_graph(k)
    canonicalize(g)
    res = unfused(g)
    check_partition(g, res)
    assert groups(g, res) == [
        ("gemm", ["contraction sum(k)[m, n] : f32"]),
        ("elementwise", ["elementwise mul[m, n] : f32"]),
        ("elementwise", ["broadcast broadcast[m, n] : f16", "elementwise add[m, n] : f32"]),
        ("elementwise", ["elementwise gelu[m, n] : f32 =h"]),
        ("elementwise", ["elementwise add[m, n] : f32"]),
        ("elementwise", ["cast cast:f16[m, n] : f16 =D"])]
    k = load_spec(SPECS / "fp8_gemm_scaled.kspec").kernels[0]
    g = build_graph(k)
    canonicalize(g)
    res = unfused(g)
    # scale_a * scale_b is a scalar expression evaluated inside the kernel that uses it
    assert groups(g, res) == [("gemm", ["contraction sum(k)[m, n] : f32"]),
                              ("elementwise", ["elementwise mul : f32", "elementwise mul[m, n] : f32"]),
                              ("elementwise", ["cast cast:bf16[m, n] : bf16 =D"])]


@pytest.mark.parametrize("spec", sorted(p.stem for p in SPECS.glob("*.kspec")))
def test_fused_and_unfused_partition_every_shipped_spec(spec):
    k = load_spec(SPECS / f"{spec}.kspec").kernels[0]
    g = build_graph(k)
    canonicalize(g)
    check_partition(g, fuse(g))
    check_partition(g, unfused(g))
    assert nx.is_directed_acyclic_graph(g)


def test_column_major_residual_is_not_fused():
    g, res = fused(GEMM_HEAD + """
  in R : f16[M, N] col
  out D : f16[M, N]
  D[m, n] = sum(k) A[m, k] * B[k, n] + R[m, n]
}""")
    check_partition(g, res)
    assert [k for k, _ in groups(g, res)] == ["gemm", "elementwise"]
    assert any(n.endswith("operand R is column-major; an epilogue reads full tensors row-major") for n in res.notes)


def test_transposed_residual_read_is_not_fused():
    g, res = fused(GEMM_HEAD + """
  in R : f16[N, M]
  out D : f16[M, N]
  D[m, n] = sum(k) A[m, k] * B[k, n] + R[n, m]
}""")
    assert [k for k, _ in groups(g, res)] == ["gemm", "elementwise"]
    assert any("operand R is read with its axes in another order than the GEMM result" in n for n in res.notes)


def test_batched_epilogue_takes_row_vectors_but_not_per_batch_vectors():
    head = """kernel c {
  in A : bf16[L, M, K]
  in B : bf16[L, K, N]
  in bias : f32[N]
  in s : f32[L]
  out D : f32[L, M, N]
"""
    g, res = fused(head + "  D[b, m, n] = sum(k) A[b, m, k] * B[b, k, n] + bias[n]\n}")
    assert [k for k, _ in groups(g, res)] == ["gemm"] and res.notes == []
    g, res = fused(head + "  D[b, m, n] = s[b] * sum(k) A[b, m, k] * B[b, k, n]\n}")
    assert [k for k, _ in groups(g, res)] == ["gemm", "elementwise"]
    assert any("it broadcasts a value that is not a row or column vector input" in n for n in res.notes)


BATCHED_BIAS = """kernel bgemm_bias {
  in  A    : f16[L, M, K]
  in  B    : f16[L, K, N]
  in  bias : f16[L, N]
  in  cs   : f32[L, M]
  out D    : f16[L, M, N]
  D[l, m, n] = relu(cs[l, m] * sum(k) A[l, m, k] * B[l, k, n] + bias[l, n])
}"""

KEY_PADDING = """kernel scores_masked {
  in  Q    : f16[B, S, E]
  in  K    : f16[B, T, E]
  in  mask : f32[B, T]
  out P    : f16[B, S, T]
  P[b, i, j] = 0.125 * sum(e) Q[b, i, e] * K[b, j, e] + mask[b, j]
}"""


def test_per_batch_bias_and_column_scale_are_epilogue_vectors():
    """bias[l, n] (a bias per batch entry) and cs[l, m] load one vector per batch entry in the
    GEMM's epilogue (was: a second kernel with an f32 [L, M, N] round trip)."""
    from kspec.compiler.kir import format_epi
    sched = plan_of(BATCHED_BIAS)
    (p,) = sched.plans
    assert p.kind == "gemm" and sched.fusion.notes == []
    (d,) = p.ir.epilogue.stores
    assert format_epi(d.value) == "cast:f16(relu(add(mul(cs[l, m], acc), bias[l, n])))"
    kinds = {ld.name: ld.kind for ld in epi_loads_of(p.ir)}
    assert kinds == {"bias": "row_batched", "cs": "col_batched"}
    for (_, arch), lp in lower_all(sched).items():
        assert lp.desc.batched and lp.backend == "cutlass"


def epi_loads_of(ir):
    from kspec.compiler.kir import epi_loads
    return [ld for st in ir.epilogue.stores for ld in epi_loads(st.value)]


def test_key_padding_mask_on_batched_scores_is_one_gemm():
    sched = plan_kernel(kernel_of(KEY_PADDING), ARCHS, Planner())
    (p,) = sched.plans
    assert p.kind == "gemm" and [(ld.name, ld.kind) for ld in epi_loads_of(p.ir)] == [("mask", "row_batched")]
    assert {c.backend for c in p.choices.values()} == {"cute"}


def test_per_batch_vector_over_some_batch_axes_or_column_major_is_not_fused():
    # scores batched over [b, h]; the mask varies with b only: not one vector per batch entry
    g, res = fused("""kernel c {
  in  Q    : f16[B, H, S, E]
  in  K    : f16[B, H, T, E]
  in  mask : f32[B, T]
  out P    : f32[B, H, S, T]
  P[b, h, i, j] = sum(e) Q[b, h, i, e] * K[b, h, j, e] + mask[b, j]
}""")
    assert [k for k, _ in groups(g, res)] == ["gemm", "elementwise"]
    assert any("a per-batch epilogue vector is indexed by every batch axis of the GEMM, [b, h]" in n
               for n in res.notes), res.notes
    g, res = fused(BATCHED_BIAS.replace("bias : f16[L, N]", "bias : f16[L, N] col"))
    assert [k for k, _ in groups(g, res)] == ["gemm", "elementwise"]
    assert any("the per-batch vector bias is column-major" in n for n in res.notes), res.notes


class NoBatchedVectors(Planner):
    """An oracle whose GEMM backends read no per-batch epilogue vectors."""

    def epilogue_loads(self, archs):
        return super().epilogue_loads(archs) - {"row_batched", "col_batched"}


def test_per_batch_vector_not_offered_by_any_backend_stays_out_of_the_epilogue():
    g, res = fused(KEY_PADDING, NoBatchedVectors())
    assert [k for k, _ in groups(g, res)] == ["gemm", "elementwise"]
    assert any("no GEMM backend reads 'row_batched' epilogue vectors" in n for n in res.notes), res.notes


def test_per_batch_vectors_fused_match_the_unfused_reference():
    import numpy as np
    from kspec.backends.reference import reference
    rng = np.random.default_rng(3)
    L, M, N, K = 3, 5, 7, 4
    args = dict(A=rng.standard_normal((L, M, K)).astype(np.float16), B=rng.standard_normal((L, K, N)).astype(np.float16),
                bias=rng.standard_normal((L, N)).astype(np.float16), cs=rng.standard_normal((L, M)).astype(np.float32))
    out = reference(BATCHED_BIAS)(**args)["D"]
    assert out.tobytes() == reference(BATCHED_BIAS, fused=False)(**args)["D"].tobytes()
    f = {k: v.astype(np.float64) for k, v in args.items()}
    want = np.maximum(f["cs"][:, :, None] * np.einsum("lmk,lkn->lmn", f["A"], f["B"]) + f["bias"][:, None, :], 0)
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-3, atol=2e-3)


F32_ROWMAX = """kernel f32_rowmax {
  in  A    : f32[M, K]
  in  B    : f32[K, N]
  in  bias : f32[N]
  out D    : f32[M, N]
  out rmax : f32[M]
  y[m, n] = sum(k) A[m, k] * B[k, n] + bias[n]
  D[m, n] = y[m, n]
  rmax[m] = max(n) y[m, n]
}"""


def test_epilogue_reduction_of_a_loop_kernel_gemm_is_split_into_a_reduction_kernel():
    """f32 x f32 has no tensor-core backend: the GEMM runs as a loop kernel, which fuses no
    reductions, so the row max reduces the stored result in a row kernel (was: a located error
    'no backend can build kernel ...')."""
    sched = plan_kernel(kernel_of(F32_ROWMAX), ARCHS, Planner())
    check_partition(sched.graph, sched.fusion)
    assert [p.kind for p in sched.plans] == ["gemm", "rowwise"]
    gemm_plan, row = sched.plans
    assert gemm_plan.ir.epilogue.reductions == () and all(c.backend == "generic" for c in gemm_plan.choices.values())
    assert tuple(row.reads) == ("D",) and tuple(row.writes) == ("rmax",)
    assert {c.backend for c in row.choices.values()} == {"rowwise"}
    assert any(n.startswith("reduction max(n)[m] : f32 not fused into the GEMM") and
               "no GEMM backend builds it with an epilogue reduction (sm90a: cute: operand dtype f32" in n
               for n in sched.fusion.notes), sched.fusion.notes


def test_split_reduction_matches_float64_numpy_and_the_unfused_reference():
    import numpy as np
    from kspec.backends.reference import reference
    rng = np.random.default_rng(5)
    A, B, bias = rng.standard_normal((6, 5)), rng.standard_normal((5, 9)), rng.standard_normal(9)
    args = dict(A=A.astype(np.float32), B=B.astype(np.float32), bias=bias.astype(np.float32))
    out = reference(F32_ROWMAX)(**args)
    unfused = reference(F32_ROWMAX, fused=False)(**args)
    assert all(out[k].tobytes() == unfused[k].tobytes() for k in ("D", "rmax"))
    f = {k: v.astype(np.float64) for k, v in args.items()}
    want = f["A"] @ f["B"] + f["bias"]
    np.testing.assert_allclose(out["D"], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["rmax"], want.max(axis=1), rtol=1e-5, atol=1e-5)


class NoEpilogueReductionBackend(Planner):
    """An oracle under which no backend builds a GEMM with epilogue reductions."""

    def can_fuse(self, ir, archs):
        if ir.kind == "gemm" and ir.epilogue.reductions:
            return "no epilogue reductions here"
        return super().can_fuse(ir, archs)


def test_epilogue_reduction_no_backend_fuses_is_split_for_every_shipped_form():
    g, res = fused((SPECS / "gemm_rowmax.kspec").read_text(), NoEpilogueReductionBackend())
    check_partition(g, res)
    assert [k for k, _ in groups(g, res)] == ["gemm", "rowwise"]
    assert any("(no epilogue reductions here); it reduces the stored GEMM result" in n for n in res.notes)
    g, res = fused((SPECS / "gemm_rowmax.kspec").read_text())
    assert [k for k, _ in groups(g, res)] == ["gemm"]


def test_statements_with_other_index_names_still_fuse_into_the_epilogue():
    # each statement names its indices freely; values read under new names are unified with the
    # names of the statement that defined them, so the chain is one epilogue
    g, res = fused("""kernel u {
      in A : f16[M, K]
      in B : f16[K, N]
      in c : f16[M]
      out D : f16[M, N]
      acc[m, n] : f32 = sum(k) A[m, k] * B[k, n]
      t[i, j] = relu(acc[i, j]) * c[i]
      D[x, y] = t[x, y] + 1.0
    }""")
    assert [grp.kind for grp in res.groups] == ["gemm"]
    assert res.groups[0].info.m == "m" and res.groups[0].info.n == "n"


def test_label_unification_never_merges_distinct_indices():
    # t is read transposed: i -> n, j -> m would be needed, and the left side uses m already
    g, res = fused("""kernel v {
      in A : f16[M, K]
      in B : f16[K, M]
      out D : f16[M, M]
      acc[m, n] : f32 = sum(k) A[m, k] * B[k, n]
      D[m, n] = acc[n, m] + acc[m, n]
    }""")
    (grp,) = [grp for grp in res.groups if grp.kind == "gemm"]
    add = [n for n in g.nodes if op(g, n).fn == "add"]
    assert len(add) == 1 and add[0] not in grp.nodes     # the transposed read is not an epilogue operand


def test_reduction_absorbs_the_elementwise_kernel_computing_its_operand():
    g, res = fused("""kernel r {
      in X : bf16[N, C]
      out m : f32[N]
      m[n] = mean(c) f32(X[n, c]) * 2.0
    }""")
    assert [(grp.kind, sorted(op(g, x).kind for x in grp.nodes if op(g, x).kind != "const")) for grp in res.groups] \
        == [("rowwise", ["cast", "elementwise", "reduction"])]


def test_reduction_prologue_needed_elsewhere_is_not_absorbed():
    # (a column sum: a row sum is one row kernel that also stores Y)
    g, res = fused("""kernel r {
      in X : f32[N, C]
      out Y : f32[N, C]
      out m : f32[C]
      Y[n, c] = exp(X[n, c])
      m[c] = sum(n) Y[n, c]
    }""")
    assert sorted(grp.kind for grp in res.groups) == ["elementwise", "reduction"]
    assert any("other kernels read its values too" in note for note in res.notes)


def test_softmax_absorbs_its_scaling_and_the_cast_of_its_store():
    g, res = fused("""kernel s {
      in X : f32[N, C]
      out P : f16[N, C]
      P[n, c] = softmax(c) (X[n, c] * 0.5)
    }""")
    (grp,) = res.groups
    assert grp.kind == "rowwise"
    assert sorted(op(g, x).kind for x in grp.nodes if op(g, x).kind != "const") == ["cast", "elementwise", "softmax"]


# ---------------------------------------------------------------- specs users write (issue 12)

def plan_of(src: str):
    """Planned as `kspec compile --backend cutlass` plans (these tests read the CUTLASS descriptors):
    the backend registry answers what fuses and who builds it."""
    return plan_kernel(kernel_of(src), ("sm90a", "sm100a"), Planner("cutlass"))


def lower_all(sched):
    from kspec.backends import registry
    return {(p.id, arch): registry.get(p.choices[arch].backend).lower(p.ir, arch)
            for p in sched.plans for arch in ("sm90a", "sm100a")}


MLP2 = (SPECS / "mlp2.kspec").read_text()


def test_two_layer_mlp_with_a_literal_scale_plans_two_gemms():
    # was: KspecInternalError "fusion produced a cycle between kernels" (the 0.5 landed in both groups)
    sched = plan_of(MLP2)
    g = sched.graph
    check_partition(g, sched.fusion)
    assert [p.kind for p in sched.plans] == ["gemm", "gemm"]
    first, second = sched.plans
    assert {op(g, n).kind for n in first.group.nodes} == {"contraction", "const", "elementwise", "cast"}
    assert [op(g, n).value for n in first.group.nodes if op(g, n).kind == "const"] == [0.5]
    assert [b.name for b in sched.intermediates] == [second.reads[0]] and sched.intermediates[0].dtype == "f16"
    lowered = lower_all(sched)
    assert all(type(lp.desc).__name__ == "GemmDesc" for lp in lowered.values())


def test_a_literal_shared_by_two_kernels_is_one_copy_per_kernel():
    sched = plan_of("""kernel two {
  in X : f16[M, K]
  in W : f16[N, K]
  in R : f16[M, N]
  out Y : f16[M, N]
  out Z : f16[M, N]
  Y[m, n] = 0.5 * sum(k) X[m, k] * W[n, k]
  Z[m, n] = 0.5 * R[m, n] + 0.5 * Y[m, n]
}""")
    g = sched.graph
    check_partition(g, sched.fusion)
    for n in g:
        if op(g, n).kind == "const":
            assert g.out_degree(n) == 1
    # 0.5 * R is computed by the epilogue from R, not by a kernel of its own (item 3)
    assert [p.kind for p in sched.plans] == ["gemm"] and not sched.intermediates
    (lp, _) = lower_all(sched).values()
    assert lp.desc.output.name != lp.desc.aux_stores[0].name
    assert sorted(lp.names[st.name] for st in (lp.desc.output, *lp.desc.aux_stores)) == ["Y", "Z"]


def test_attention_with_a_key_padding_mask_and_literal_scale_plans_with_a_note():
    sched = plan_of("""kernel attn_mask {
  in  Q : f16[B, H, S, 64]
  in  K : f16[B, H, T, 64]
  in  V : f16[B, H, T, 64]
  in  mask : f32[B, T]
  out O : f16[B, H, S, 64]
  s[b, h, i, j] : f32 = 0.125 * sum(e) Q[b, h, i, e] * K[b, h, j, e] + mask[b, j]
  p[b, h, i, j] = softmax(j) s[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[b, h, j, e]
}""")
    check_partition(sched.graph, sched.fusion)
    if sched.plans[0].kind == "attention":
        # FlashAttention-4 (the CuTe DSL backend, where installed) runs the lifted score_mod
        (p,) = sched.plans
        assert p.ir.attention.score_mod is not None and p.ir.attention.aux == ("mask",)
        assert {c.backend for c in p.choices.values()} == {"cute"}
        return
    # else the masked softmax is one row kernel (backends/rowwise) between the two GEMMs
    assert [p.kind for p in sched.plans] == ["gemm", "rowwise", "gemm"]
    # the key padding bias lifts into a score_mod, which the CUTLASS FMHA templates do not implement
    assert any("attention at" in n and "not fused" in n and "implement no score modification" in n
               for n in sched.fusion.notes)
    lower_all(sched)


def test_a_scalar_inside_the_sum_is_still_a_contraction():
    src = """kernel attn {
  param scale : f32 = 0.125
  in  Q : f16[B, H, S, 64]
  in  K : f16[B, H, T, 64]
  in  V : f16[B, H, T, 64]
  out O : f16[B, H, S, 64]
  s[b, h, i, j] : f32 = sum(e) Q[b, h, i, e] * K[b, h, j, e] * scale
  p[b, h, i, j] = softmax(j) s[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[b, h, j, e]
}"""
    g, res = fused(src)
    assert [grp.kind for grp in res.groups] == ["attention"]
    info = res.groups[0].info
    assert [op(g, n).fn for n in info.scale] == ["mul"]
    assert not [n for n in g if op(g, n).kind == "reduction"]
    # scalar factors on either side, and a division, in a GEMM
    g, res = fused(GEMM_HEAD + """
      param a : f32 = 2.0
      out D : f16[M, N]
      D[m, n] = sum(k) a * A[m, k] * B[k, n] / 4.0
    }""")
    # (`/ 4.0` is the exact factor `0.25 *`: canonicalisation writes it as a multiplication)
    assert groups(g, res) == [("gemm", sorted(["contraction sum(k)[m, n] : f32", "elementwise mul[m, n] : f32",
                                               "elementwise mul[m, n] : f32", "cast cast:f16[m, n] : f16 =D"]))]


def test_a_vector_factor_inside_the_sum_becomes_a_scaled_epilogue():
    g, res = fused(GEMM_HEAD + """
      in s : f32[M]
      out D : f32[M, N]
      D[m, n] = sum(k) A[m, k] * s[m] * B[k, n]
    }""")
    assert [grp.kind for grp in res.groups] == ["gemm"]
    assert "broadcast broadcast[m, n] : f32" in groups(g, res)[0][1]


def test_three_factors_over_the_reduced_index_contract_a_product():
    g, _ = fused(GEMM_HEAD + """
      in w : f16[K]
      out D : f32[M, N]
      D[m, n] = sum(k) A[m, k] * w[k] * B[k, n]
    }""")
    (c,) = [n for n in g if op(g, n).kind == "contraction"]
    assert sorted(op(g, u).kind for u in g.predecessors(c)) == ["elementwise", "input"]


def test_fp8_gemm_with_a_cast_bias_is_one_kernel():
    sched = plan_of((SPECS / "fp8_gemm_cast_bias.kspec").read_text())
    assert [p.kind for p in sched.plans] == ["gemm"] and not sched.intermediates
    from kspec.backends.desc import Load, Op

    def cast_loads(e) -> list:
        if not isinstance(e, Op):
            return []
        here = [e.args[0]] if e.fn == "cast:f32" and isinstance(e.args[0], Load) else []
        return here + [ld for a in e.args for ld in cast_loads(a)]

    for lp in lower_all(sched).values():
        assert [(ld.kind, ld.dtype) for ld in cast_loads(lp.desc.output.value)] == [("row", "bf16")]


def test_cast_bias_shared_by_two_gemms_is_loaded_by_each():
    sched = plan_of("""kernel two {
  in X : f16[M, K]
  in W1 : f16[N, K]
  in W2 : f16[N, K]
  in bias : f16[N]
  out Y : f32[M, N]
  out Z : f32[M, N]
  Y[m, n] = sum(k) X[m, k] * W1[n, k] + f32(bias[n])
  Z[m, n] = sum(k) X[m, k] * W2[n, k] + f32(bias[n])
}""")
    assert [p.kind for p in sched.plans] == ["gemm", "gemm"] and not sched.intermediates
    lower_all(sched)


def test_explicit_f32_cast_in_a_norm_is_not_materialised():
    sched = plan_of("""kernel rmsnorm {
  param eps : f32 = 1e-6
  in  X : f16[M, C]
  in  w : f16[C]
  out Y : f16[M, C]
  xf[m, c] : f32 = f32(X[m, c])
  ss[m] = mean(c) xf[m, c] * xf[m, c]
  Y[m, c] = xf[m, c] * rsqrt(ss[m] + eps) * f32(w[c])
}""")
    check_partition(sched.graph, sched.fusion)
    assert not [b for b in sched.intermediates if len(b.shape) == 2], sched.intermediates
    assert "X" in sched.plans[0].reads and "X" in sched.plans[-1].reads
    lower_all(sched)


def test_declared_f16_probabilities_are_still_attention():
    src = (SPECS / "attention.kspec").read_text().replace("p[b, h, i, j] = softmax", "p[b, h, i, j] : f16 = softmax")
    g, res = fused(src)
    assert [grp.kind for grp in res.groups] == ["attention"]
    info = res.groups[0].info
    assert [op(g, n).dtype for n in info.p_cast] == ["f16"]
    sched = plan_of(src)
    assert [p.kind for p in sched.plans] == ["attention"]
    lower_all(sched)
    # rounding P to fp8 is not what the fused kernel does: vetoed with the reason
    sched = plan_of(src.replace("p[b, h, i, j] : f16", "p[b, h, i, j] : f8e4m3"))
    assert "attention" not in [p.kind for p in sched.plans]
    assert any("probabilities are rounded to f8e4m3" in n for n in sched.fusion.notes)


def test_multi_query_attention_is_recognised_and_the_veto_says_why():
    src = """kernel mqa {
  param scale : f32 = 0.125
  in  Q : f16[B, H, S, 64]
  in  K : f16[B, T, 64]
  in  V : f16[B, T, 64]
  out O : f16[B, H, S, 64]
  s[b, h, i, j] : f32 = scale * sum(e) Q[b, h, i, e] * K[b, j, e]
  p[b, h, i, j] = softmax(j) s[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[b, j, e]
}"""
    _, res = fused(src, VetoAttention(None))        # recognised as attention (the backends decide)
    assert [grp.kind for grp in res.groups] == ["attention"]
    assert res.groups[0].info.kv_batch == ("b",)
    # without --sizes naming H (FlashAttention-4 compiles the group, H here, into the kernel: the CuTe
    # backend fuses it when they do, tests/test_attention_groups.py) and CUTLASS's reason: unfused
    # (where FA4 is not installed, the CuTe backend's reason is that)
    sched = plan_of(src)
    cute_why = ("the GQA group (query heads per K/V head) is known only per call" if FA4_MISSING is None
                else FA4_MISSING)
    assert any("cutlass: K and V are shared across [h] (multi-query attention)" in n and f"cute: {cute_why}" in n
               for n in sched.fusion.notes), sched.fusion.notes
    # the unfused plan's QK^T folds the head axis into M: one GEMM per batch, not a loop kernel
    qk = sched.plans[0]
    assert qk.kind == "gemm" and (qk.info.batch, qk.info.m_fold, qk.info.m) == (("b",), ("h",), "i")
    lowered = lower_all(sched)
    assert dict(lowered[(qk.id, "sm90a")].dims)["M"] == ("H", "S")


LINEAR = (SPECS / "linear_shared_weight.kspec").read_text()


def test_shared_weight_linear_folds_batch_and_sequence_into_m():
    sched = plan_of(LINEAR)
    (p,) = sched.plans
    assert p.kind == "gemm"
    gi = p.info
    assert (gi.m_fold, gi.m, gi.n, gi.k, gi.batch, gi.a_layout, gi.b_layout) == (("b",), "s", "n", "k", (), "row", "col")
    for lp in lower_all(sched).values():
        assert dict(lp.dims) == {"M": ("B", "S"), "N": "N", "K": "K", "L": 1}
        assert lp.desc.batched is False and lp.desc.a.layout == "row"


def test_shared_weight_linear_with_a_shared_batch_axis():
    _, res = fused("""kernel lin {
  in X : f16[G, B, S, K]
  in W : f16[G, N, K]
  out Y : f16[G, B, S, N]
  Y[g, b, s, n] = sum(k) X[g, b, s, k] * W[g, n, k]
}""")
    (grp,) = res.groups
    assert grp.kind == "gemm" and (grp.info.batch, grp.info.m_fold, grp.info.m) == (("g",), ("b",), "s")


@pytest.mark.parametrize("body, why", [
    ("Y[b, s, n] = sum(k) X[b, s, k] * W[n, k] + c[s]", "broadcasts a vector over 's' only"),
    ("Y[s, b, n] = sum(k) X[b, s, k] * W[n, k]", None),
])
def test_shared_weight_linear_limits(body, why):
    out_shape = "[B, S, N]" if body.startswith("Y[b") else "[S, B, N]"
    g, res = fused(f"""kernel lin {{
  in X : f16[B, S, K]
  in W : f16[N, K]
  in c : f32[S]
  out Y : f32{out_shape}
  {body}
}}""")
    check_partition(g, res)
    if why:
        assert res.groups[0].kind == "gemm"
        assert any(why in n for n in res.notes)
    else:
        # the result's axis order is not [(b, s), n]: not a folded GEMM
        assert any("not a GEMM" in n for n in res.notes)


SWIGLU = (SPECS / "swiglu_mlp.kspec").read_text()
SWIGLU_SIZES = {"M": 4096, "K": 4096, "F": 11008, "N": 4096}


class NoDualGemm(Planner):
    """An oracle whose GEMM backends build no dual GEMMs (records the candidates fusion asked about)."""

    def __init__(self):
        super().__init__()
        self.asked = []

    def can_fuse(self, ir, archs):
        if ir.kind == "gemm" and ir.gemm.dual:
            self.asked.append(ir)
            return "no dual GEMM kernel here"
        return super().can_fuse(ir, archs)


def test_swiglu_gate_and_up_projections_are_one_dual_gemm():
    """h = silu(X Wg^T) * (X Wu^T): one kernel reads each X tile once for both products (two
    accumulators, Accum(0) and Accum(1)), then Y = h Wd^T: two GEMMs, no f32 [M, F] round trip."""
    from kspec.compiler import cost
    from kspec.compiler.kir import format_epi
    sched = plan_kernel(kernel_of(SWIGLU), ARCHS, Planner())
    g = sched.graph
    check_partition(g, sched.fusion)
    assert [p.kind for p in sched.plans] == ["gemm", "gemm"]
    dual, down = sched.plans
    s = dual.ir.gemm
    assert s.dual and (s.a_buffer, {s.b_buffer, s.b2_buffer}) == ("X", {"Wg", "Wu"})
    assert down.ir.gemm.a_buffer.startswith("h") and not down.ir.gemm.dual
    (h,) = dual.ir.epilogue.stores
    gate_acc = "acc" if s.b_buffer == "Wg" else "acc1"
    up_acc = "acc1" if gate_acc == "acc" else "acc"
    assert format_epi(h.value) == f"cast:f16(mul(silu({gate_acc}), {up_acc}))"
    assert [b.dtype for b in sched.intermediates] == ["f16"]
    assert all(c.backend == "cute" for p in sched.plans for c in p.choices.values())
    assert any("one dual GEMM" in n for n in sched.fusion.notes)
    # DRAM bytes at LLaMA-7B sizes: 912 MB as three GEMMs, 518 MB with the dual GEMM
    three = plan_kernel(kernel_of(SWIGLU), ARCHS, NoDualGemm())
    fused_bytes, three_bytes = cost(sched, SWIGLU_SIZES).fused_bytes, cost(three, SWIGLU_SIZES).fused_bytes
    assert fused_bytes < 0.6 * three_bytes
    X, W, H, Y = 4096 * 4096 * 2, 11008 * 4096 * 2, 4096 * 11008 * 2, 4096 * 4096 * 2
    assert fused_bytes == (X + 2 * W + H) + (H + 4096 * 11008 * 2 + Y)


def test_swiglu_without_a_dual_gemm_backend_plans_three_gemms_with_a_note():
    oracle = NoDualGemm()
    sched = plan_kernel(kernel_of(SWIGLU), ARCHS, oracle)
    g = sched.graph
    assert [p.kind for p in sched.plans] == ["gemm", "gemm", "gemm"]
    assert len(oracle.asked) == 1 and oracle.asked[0].gemm.dual
    gate = sched.plans[1]
    assert sorted(op(g, n).fn for n in gate.group.nodes if op(g, n).kind == "elementwise") == ["mul", "silu"]
    assert [b.dtype for b in sched.intermediates] == ["f32", "f16"]
    assert any("share their A operand X but stay separate GEMMs: no GEMM backend builds the dual GEMM "
               "(no dual GEMM kernel here)" in n for n in sched.fusion.notes), sched.fusion.notes
    lower_all(sched)


def test_a_backend_pin_binds_what_fusion_asks():
    """`backend = cutlass` in a schedule block pins the kernel to CUTLASS C++, which builds no dual
    GEMM: fusion asks the pinned backend, so the plan stays three GEMMs (with the reason in a note)
    instead of fusing a kernel the pin then refuses."""
    spec = SWIGLU + "\nschedule swiglu_mlp { backend = cutlass }\n"
    sched = plan_kernel(kernel_of(spec), ARCHS, Planner())
    assert [p.kind for p in sched.plans] == ["gemm", "gemm", "gemm"]
    assert all(c.backend == "cutlass" for p in sched.plans for c in p.choices.values())
    assert any("stay separate GEMMs" in n and "cutlass" in n for n in sched.fusion.notes), sched.fusion.notes


def test_cutlass_declines_the_dual_gemm_by_capability():
    from kspec.backends import registry
    sched = plan_kernel(kernel_of(SWIGLU), ARCHS, Planner())
    why = registry.get("cutlass").can_implement(sched.plans[0].ir, "sm90a")
    assert "dual GEMMs" in why


@pytest.mark.parametrize("body,dual", [
    # two products of X merely read side by side (Q/K/V-style projections): separate GEMMs, no note
    ("  out G : f16[M, F]\n  out U : f16[M, F]\n  G[m, f] = sum(k) X[m, k] * Wg[f, k]\n"
     "  U[m, f] = sum(k) X[m, k] * Wu[f, k]\n}", False),
    # the up projection is also an output: its value leaves the epilogue
    ("  out U : f32[M, F]\n  out H : f16[M, F]\n  U[m, f] = sum(k) X[m, k] * Wu[f, k]\n"
     "  H[m, f] = silu(sum(k) X[m, k] * Wg[f, k]) * U[m, f]\n}", False),
    # combined with a bias and a gelu: still one dual GEMM
    ("  in  bu : f32[F]\n  out H : f16[M, F]\n"
     "  H[m, f] = gelu(sum(k) X[m, k] * Wg[f, k]) * (sum(k) X[m, k] * Wu[f, k] + bu[f])\n}", True),
])
def test_dual_gemm_recognition_limits(body, dual):
    head = "kernel d {\n  in X : f16[M, K]\n  in Wg : f16[F, K]\n  in Wu : f16[F, K]\n"
    sched = plan_kernel(kernel_of(head + body), ARCHS, Planner())
    check_partition(sched.graph, sched.fusion)
    assert [p.ir.gemm.dual for p in sched.plans if p.kind == "gemm"] == ([True] if dual else [False, False])
    if not dual:
        assert not any("one dual GEMM" in n for n in sched.fusion.notes)


def test_dual_gemm_fused_reference_matches_float64_numpy():
    import numpy as np
    from kspec.backends.reference import reference
    rng = np.random.default_rng(11)
    M, K, F, N = 6, 16, 10, 8
    args = {k: (rng.standard_normal(s) / 2).astype(np.float16)
            for k, s in (("X", (M, K)), ("Wg", (F, K)), ("Wu", (F, K)), ("Wd", (N, F)))}
    out = reference(SWIGLU)(**args)["Y"]
    assert out.tobytes() == reference(SWIGLU, fused=False)(**args)["Y"].tobytes()
    f = {k: v.astype(np.float64) for k, v in args.items()}
    gate, up = f["X"] @ f["Wg"].T, f["X"] @ f["Wu"].T
    h = (gate / (1 + np.exp(-gate)) * up).astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(out.astype(np.float64), h @ f["Wd"].T, rtol=5e-3, atol=5e-3)


def test_attention_output_projection_folds_heads_into_k():
    sched = plan_of("""kernel oproj {
  in  O  : f16[B, S, H, 128]
  in  Wo : f16[N, H, 128]
  in  R  : f16[B, S, N]
  out Y  : f16[B, S, N]
  Y[b, s, n] = sum(h, e) O[b, s, h, e] * Wo[n, h, e] + R[b, s, n]
}""")
    (p,) = sched.plans
    assert p.kind == "gemm" and (p.info.m_labels, p.info.k_labels) == (("b", "s"), ("h", "e"))
    for lp in lower_all(sched).values():
        assert dict(lp.dims) == {"M": ("B", "S"), "N": "N", "K": ("H", 128), "L": 1}


def test_norm_after_a_gemm_reads_the_stored_f16_result_not_an_f32_copy():
    sched = plan_of("""kernel gemm_residual_rmsnorm {
  param eps : f32 = 1e-6
  in  X : f16[M, K]
  in  W : f16[N, K]
  in  R : f16[M, N]
  in  g : f16[N]
  out H : f16[M, N]
  out Y : f16[M, N]
  H[m, n] = sum(k) X[m, k] * W[n, k] + f32(R[m, n])
  ss[m] = mean(n) f32(H[m, n]) * f32(H[m, n])
  Y[m, n] = f32(H[m, n]) * rsqrt(ss[m] + eps) * f32(g[n])
}""")
    check_partition(sched.graph, sched.fusion)
    assert sched.plans[0].kind == "gemm" and sched.plans[0].writes == ("H",)
    assert not [b for b in sched.intermediates if len(b.shape) == 2], [b.describe() for b in sched.intermediates]
    assert [p.kind for p in sched.plans] == ["gemm", "rowwise"]      # the RMSNorm is one row kernel
    from kspec.compiler import cost
    c = cost(sched, {"M": 4096, "N": 4096, "K": 4096})
    # X, W, R, H (write), then H once more (the row kernel) and Y: 6 f16 [4096, 4096] tensors, plus vectors
    assert c.fused_bytes == pytest.approx(6 * 2 * 4096 * 4096, rel=1e-3)
    lower_all(sched)


def test_layer_norm_recomputes_its_centred_value_instead_of_storing_it():
    sched = plan_of("""kernel layernorm {
  param eps : f32 = 1e-5
  in  X : f16[M, C]
  in  gamma : f16[C]
  in  beta : f16[C]
  out Y : f16[M, C]
  mu[m] = mean(c) f32(X[m, c])
  d[m, c] : f32 = f32(X[m, c]) - mu[m]
  var[m] = mean(c) d[m, c] * d[m, c]
  Y[m, c] = d[m, c] * rsqrt(var[m] + eps) * f32(gamma[c]) + f32(beta[c])
}""")
    check_partition(sched.graph, sched.fusion)
    # d (f32) is never stored: the whole norm is one row kernel that reads X once
    assert not [b for b in sched.intermediates if len(b.shape) == 2], [b.describe() for b in sched.intermediates]
    assert [p.kind for p in sched.plans] == ["rowwise"]
    assert sum("X" in p.reads for p in sched.plans) == 1
    lower_all(sched)


def test_an_output_stored_with_batch_axes_inside_is_not_an_epilogue_store():
    sched = plan_of("""kernel t {
  in K : f16[B, H, T, 64]
  in O : f16[B, H, S, 64]
  out t0 : f16[T, S, B, H]
  t0[t, s, b, h] = sum(e) K[b, h, t, e] * O[b, h, s, e]
}""")
    assert [p.kind for p in sched.plans] == ["gemm", "elementwise"]
    assert any("stores output t0 as [t, s, b, h]" in n for n in sched.fusion.notes)
    lower_all(sched)


def test_folded_m_is_not_taken_for_a_small_literal_m():
    sched = plan_of("""kernel decode {
  in X : f16[B, 1, K]
  in W : f16[N, K]
  out Y : f16[B, 1, N]
  Y[b, s, n] = sum(k) X[b, s, k] * W[n, k]
}""")
    (p,) = sched.plans
    assert p.info.m_labels == ("b", "s")
    tiles = {a: dict(ch.config)["tile"] for a, ch in p.choices.items()}
    assert tiles["sm90a"].startswith("128x") and tiles["sm100a"].startswith("256x")
