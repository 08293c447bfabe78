"""Scheduling (plan order, reads/writes, intermediates, liveness, slot reuse, tile configs) and the
cost model (FLOPs and DRAM bytes, fused against one kernel per op), checked against sizes worked
out by hand."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from kspec.core import extent_value
from conftest import shipped_params

from kspec.backends.registry import Planner
from kspec.compiler import cost, op, plan_kernel
from kspec.spec_lang import load_spec

SPECS = Path(__file__).resolve().parent.parent / "specs"


def kernel_of(src: str):
    return load_spec(src, is_text=True).kernels[0]


def shipped(name: str):
    return load_spec(SPECS / f"{name}.kspec").kernels[0]


def planned(kernel, archs=("sm90a", "sm100a"), oracle=None):
    """Planned as `kspec graph` plans: the real backend registry chooses a backend per arch."""
    return plan_kernel(kernel, archs, oracle or Planner())


def planned_cutlass(kernel, archs=("sm90a", "sm100a")):
    """Planned with the CUTLASS C++ backend preferred (`--backend cutlass`): its tile heuristic."""
    return plan_kernel(kernel, archs, Planner("cutlass"))


def cfg(plan, arch) -> dict:
    return dict(plan.choices[arch].config)


class NoFusedAttention(Planner):
    def can_fuse(self, ir, archs):
        return "vetoed" if ir.kind == "attention" else super().can_fuse(ir, archs)


def assert_dependency_order(sched):
    """Every buffer a plan reads is an input/param or was written by an earlier plan."""
    written: set = set()
    for p in sched.plans:
        for b in p.reads:
            kind = sched.buffers[b].kind
            assert kind in ("input", "param") or b in written, (p.id, b)
        written |= set(p.writes)
    assert {t.name for t in sched.kernel.outputs} <= written


@pytest.mark.parametrize("spec", sorted(p.stem for p in SPECS.glob("*.kspec")))
@pytest.mark.parametrize("fuse_ops", [True, False])
def test_plans_run_in_dependency_order(spec, fuse_ops):
    sched = plan_kernel(shipped(spec), fuse_ops=fuse_ops)
    assert_dependency_order(sched)
    assert [p.id for p in sched.plans] == [f"{spec}_{i}" for i in range(len(sched.plans))]


def test_fused_gemm_reads_and_writes():
    sched = plan_kernel(shipped("gemm_bias_gelu_residual"))
    (p,) = sched.plans
    assert (p.kind, set(p.reads), p.writes) == ("gemm", {"A", "B", "alpha", "bias", "R"}, ("D",))
    assert sched.intermediates == [] and sched.liveness == {} and sched.reuse == {}
    assert {b.name: b.kind for b in sched.buffers.values()} == {
        "alpha": "param", "A": "input", "B": "input", "bias": "input", "R": "input", "D": "output"}
    assert sched.buffers["B"].layout == "col" and sched.buffers["D"].shape == ("M", "N")


def test_vetoed_attention_plans_intermediates_and_liveness():
    sched = planned(shipped("attention"), oracle=NoFusedAttention())
    g = sched.graph
    assert [p.kind for p in sched.plans] == ["gemm", "rowwise", "gemm"]
    (s_buf,) = sched.plans[0].writes
    (p_buf,) = sched.plans[1].writes
    assert op(g, sched.buffers[s_buf].node).name == "s" and op(g, sched.buffers[p_buf].node).name == "p"
    assert set(sched.plans[0].reads) == {"Q", "K", "scale"}
    assert sched.plans[1].reads == (s_buf,)
    assert set(sched.plans[2].reads) == {p_buf, "V"} and sched.plans[2].writes == ("O",)
    assert {b.name: (b.dtype, b.shape) for b in sched.intermediates} == {
        s_buf: ("f32", ("B", "H", "S", "T")), p_buf: ("f32", ("B", "H", "S", "T"))}
    assert sched.liveness == {s_buf: (0, 1), p_buf: (1, 2)}
    # p is written while s is still being read: no reuse
    assert sched.reuse == {s_buf: s_buf, p_buf: p_buf}


# column softmaxes (over m, not contiguous): each is a kernel of its own; the row max is a row kernel
CHAIN = """kernel chain {
  in  x : f32[M, N]
  out y : f32[M, N]
  out r : f32[M]
  a[m, n] = softmax(m) x[m, n]
  b[m, n] = softmax(m) a[m, n]
  c[m, n] = softmax(m) b[m, n]
  r[m] = max(n) b[m, n]
  y[m, n] = softmax(m) c[m, n]
}"""


def test_intermediates_with_disjoint_lifetimes_share_a_slot():
    sched = plan_kernel(kernel_of(CHAIN))
    g = sched.graph
    assert [p.kind for p in sched.plans] == ["softmax", "softmax", "softmax", "rowwise", "softmax"]
    assert_dependency_order(sched)
    by_name = {op(g, b.node).name: b.name for b in sched.intermediates}
    assert set(by_name) == {"a", "b", "c"}
    a, b, c = by_name["a"], by_name["b"], by_name["c"]
    assert sched.liveness == {a: (0, 1), b: (1, 3), c: (2, 4)}
    # a dies at plan 1; c is first written at plan 2 with the same dtype and shape
    assert sched.reuse == {a: a, b: b, c: a}


def test_slots_are_not_shared_across_shapes_or_dtypes():
    sched = plan_kernel(kernel_of("""kernel chain {
  in  x : f32[M, N]
  out y : f32[M]
  a[m, n] = softmax(m) x[m, n]
  s[m] = sum(n) a[m, n]
  t[m] = f16(s[m])
  u[m, n] = softmax(m) x[m, n] * t[m]
  y[m] = max(n) u[m, n]
}"""))
    g = sched.graph
    by_name = {op(g, b.node).name: b for b in sched.intermediates}
    for b in by_name.values():
        assert sched.reuse[b.name] == b.name or \
            (sched.buffers[sched.reuse[b.name]].dtype, sched.buffers[sched.reuse[b.name]].shape) == (b.dtype, b.shape)
    # u reuses a's slot (same dtype and shape, a dead by then); nothing else is shared
    assert sched.reuse[by_name["u"].name] == by_name["a"].name
    assert sum(1 for b in sched.intermediates if sched.reuse[b.name] != b.name) == 1


# ---------------------------------------------------------------- tile configs

def test_schedule_hint_for_one_arch_wins_over_the_heuristic():
    sched = planned_cutlass(shipped("gemm_bias_gelu_residual"))
    (p,) = sched.plans
    h90, h100 = cfg(p, "sm90a"), cfg(p, "sm100a")
    assert h90 == {"tile": "128x128x64", "cluster": "2x1x1", "source": "hint"}
    assert h100["source"] == "heuristic" and h100["tile"].endswith("x64")
    assert {a: (ch.backend, ch.kind, ch.fallback) for a, ch in p.choices.items()} == {
        "sm90a": ("cutlass", "gemm", None), "sm100a": ("cutlass", "gemm", None)}


def test_generic_and_per_arch_hints_combine_field_by_field():
    src = """kernel g {
  in A : f16[M, K]
  in B : f16[K, N] col
  out D : f16[M, N]
  D[m, n] = sum(k) A[m, k] * B[k, n]
}
schedule g { tile = 64x64x32  stages = 3 }
schedule g for sm100a { tile = 256x128x64  cluster = 4x1x1 }"""
    (p,) = planned_cutlass(kernel_of(src)).plans
    c90, c100 = cfg(p, "sm90a"), cfg(p, "sm100a")
    assert (c90["tile"], c90["stages"], c90["source"]) == ("64x64x32", "3", "hint")
    assert c90["cluster"] == cfg(planned_cutlass(kernel_of(src.split("schedule")[0])).plans[0], "sm90a")["cluster"]
    assert c100 == {"tile": "256x128x64", "cluster": "4x1x1", "stages": "3", "source": "hint"}
    assert p.choices["sm100a"].describe() == "cutlass gemm (tile=256x128x64 cluster=4x1x1 stages=3 source=hint)"


def test_only_requested_archs_are_configured_and_non_gemm_plans_have_no_tile():
    sched = planned(kernel_of(CHAIN), archs=("sm100a",))
    for p in sched.plans:
        assert list(p.choices) == ["sm100a"]
        assert p.choices["sm100a"].backend in ("generic", "rowwise") and "tile" not in cfg(p, "sm100a")


@pytest.mark.parametrize("dtype, k_tile", [("f16", 64), ("bf16", 64), ("f8e4m3", 128), ("tf32", 32)])
def test_heuristic_k_tile_follows_operand_width(dtype, k_tile):
    src = f"""kernel g {{
  in A : {dtype}[M, K]
  in B : {dtype}[K, N] col
  out D : f32[M, N]
  D[m, n] = sum(k) A[m, k] * B[k, n]
}}"""
    (p,) = planned_cutlass(kernel_of(src)).plans
    for arch in ("sm90a", "sm100a"):
        assert cfg(p, arch)["source"] == "heuristic" and cfg(p, arch)["tile"].split("x")[2] == str(k_tile)


def test_heuristic_small_literal_m():
    (p,) = planned_cutlass(kernel_of("""kernel g {
  in A : f16[64, K]
  in B : f16[K, N] col
  out D : f16[64, N]
  D[m, n] = sum(k) A[m, k] * B[k, n]
}""")).plans
    assert cfg(p, "sm90a")["tile"].startswith("64x")
    assert cfg(p, "sm100a")["tile"].startswith("128x") and cfg(p, "sm100a")["cluster"] == "1x1x1"


# ---------------------------------------------------------------- cost model

def test_gemm_bias_gelu_residual_cost_at_4096():
    M = N = K = 4096
    c = cost(plan_kernel(shipped("gemm_bias_gelu_residual")), {"M": M, "N": N, "K": K})
    f16, f32 = 2, 4
    # fused: read A, B, bias, R once, write D once (alpha travels in the launch parameters)
    fused = f16 * (M * K + K * N + N + M * N) + f16 * M * N
    # unfused, one kernel per op:
    unfused = (f16 * (M * K + K * N) + f32 * M * N        # acc = A @ B
               + f32 * M * N + f32 * M * N                # alpha * acc
               + f32 * M * N + f16 * N + f32 * M * N      # + bias[n] (the broadcast is a view)
               + f32 * M * N + f32 * M * N                # gelu
               + f32 * M * N + f16 * M * N + f32 * M * N  # + R
               + f32 * M * N + f16 * M * N)               # cast to f16 into D
    assert [(p.kind, p.bytes) for p in c.plans] == [("gemm", fused)]
    assert (c.fused_bytes, c.unfused_bytes, c.unfused_kernels) == (fused, unfused, 6)
    assert c.bytes_ratio == fused / unfused
    assert c.bytes_ratio == pytest.approx((8 * 4096 + 2) / (48 * 4096 + 2), rel=1e-12)
    assert c.bytes_ratio < 0.17
    flops = 2 * M * N * K + 4 * M * N                     # mul, add, gelu, add
    assert c.fused_flops == c.unfused_flops == flops
    assert c.sizes == {"M": M, "N": N, "K": K}


@pytest.mark.parametrize("spec, dt, e", [("attention", 2, 128), ("attention_causal", 2, 64)])
def test_fused_attention_bytes_never_include_the_score_matrix(spec, dt, e):
    B, H, S, T = 2, 16, 4096, 4096
    sizes = {"B": B, "H": H, "S": S, "T": T}
    c = cost(plan_kernel(shipped(spec)), sizes)
    T_ = T if spec == "attention" else S
    qkvo = dt * B * H * (S * e + 2 * T_ * e + S * e)
    assert [(p.kind, p.bytes) for p in c.plans] == [("attention", qkvo)]
    scores = B * H * S * T_ * 4
    assert c.fused_bytes < scores
    # unfused: QK^T writes S, scale reads/writes it, softmax reads/writes it, PV reads it
    assert c.unfused_bytes >= qkvo + 6 * scores
    assert c.fused_flops == 2 * B * H * S * T_ * e * 2 + B * H * S * T_ + 5 * B * H * S * T_


BLOCK_SCALED = ("fp8_gemm_blockwise", "mxfp8_gemm", "nvfp4_gemm")      # scales inside the sum: [M, K, N] products unfused


@pytest.mark.parametrize("spec", sorted(p.stem for p in SPECS.glob("*.kspec")))
def test_unfused_schedule_costs_the_unfused_baseline(spec):
    sizes = {"M": 512, "N": 256, "K": 128, "B": 2, "H": 4, "S": 128, "T": 256, "L": 3}
    k = shipped(spec)
    base = cost(plan_kernel(k), sizes)
    flat = cost(plan_kernel(k, fuse_ops=False), sizes)
    assert flat.ideal_bytes == base.unfused_bytes      # (the baseline reads each operand once)
    assert len(flat.plans) == base.unfused_kernels
    if spec in BLOCK_SCALED:
        # the unfused product A*sa*B*sb is [M, K, N] elementwise work; the block-scaled GEMM's MMA is not
        assert base.fused_flops < flat.fused_flops
    else:
        assert flat.fused_flops == base.fused_flops
    # a scalar expression (fp8's scale_a * scale_b) is one FLOP inside a kernel, not a kernel of its own
    g = plan_kernel(k).graph
    scalar_ops = sum(1 for n in g if op(g, n).kind == "elementwise" and not op(g, n).axes)
    if spec in BLOCK_SCALED:
        assert base.unfused_flops == flat.fused_flops - scalar_ops
    else:
        assert base.unfused_flops == base.fused_flops - scalar_ops
    assert base.fused_bytes <= base.unfused_bytes


def test_cost_uses_literal_bindings_and_default_sizes():
    k = kernel_of("""kernel g {
  in A : f16[M, 64]
  in B : f16[K, N] col
  out D : f16[M, N]
  D[m, n] = sum(k) A[m, k] * B[k, n]
}""")
    c = cost(plan_kernel(k), {"M": 8, "K": 999})
    assert c.sizes == {"M": 8, "K": 64, "N": 1024}      # K is bound to 64 by unification
    assert c.fused_bytes == 2 * (8 * 64 + 64 * 1024 + 8 * 1024)


# ---------------------------------------------------------------- modelled against ideal bytes

REALISTIC = {"M": 4096, "N": 4096, "K": 4096, "F": 4096, "B": 4, "H": 16, "S": 4096, "T": 4096, "L": 8, "V": 32000,
             "NP": 1024, "P": 16, "MP": 256,      # a paged KV cache: 4 sequences of 4096 keys in 16-row pages
             "KH": 4,                            # GQA: 16 query heads over 4 K/V heads
             "E": 8, "D": 4096, "off_rows": 16384}   # MoE: 8 experts, 16384 routed token rows


def _stored_bytes(dtype: str, n: int) -> int:
    """Device bytes of n values: FP4 two a byte, the rest their element size."""
    return n // 2 if dtype == "f4e2m1" else n * {"f16": 2, "bf16": 2, "f32": 4, "tf32": 4, "i32": 4}.get(dtype, 1)


def test_fp4_tensors_cost_half_a_byte_a_value():
    """NVFP4's A and B are FP4, two values a byte in memory: the minimum and the GEMM's modelled
    traffic count M*K/2 bytes for A, not M*K."""
    sched = planned(shipped("nvfp4_gemm"), ("sm100a",))
    sizes = {"M": 4096, "N": 2048, "K": 8192}
    c = cost(sched, sizes)
    M, N, K = sizes["M"], sizes["N"], sizes["K"]
    want = M * K // 2 + N * K // 2 + (M + N) * (K // 16) + M * N * 2      # A, B, E4M3 scales, bf16 D
    assert c.minimum_bytes == want
    assert c.fused_bytes == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("spec", shipped_params(sorted(p.stem for p in SPECS.glob("*.kspec"))))
def test_shipped_gemm_and_attention_specs_are_within_1_1_of_ideal(spec):
    targets = load_spec(SPECS / f"{spec}.kspec").targets        # a `target` line: its archs only
    sched = planned(shipped(spec), targets or ("sm90a", "sm100a"))   # the backends kspec compile would use
    c = cost(sched, REALISTIC)
    assert all(p.tiled for p in c.plans)
    assert c.fused_bytes <= 1.1 * c.ideal_bytes
    for p in c.plans:
        assert p.bytes <= 1.1 * p.ideal_bytes
    # the spec minimum: each input read once, each output written once
    assert c.minimum_bytes == sum(
        _stored_bytes(b.dtype, math.prod(extent_value(d, REALISTIC) for d in b.shape))
        for b in sched.buffers.values() if b.kind in ("input", "output"))
    single = {"mlp2": 1.5, "swiglu_mlp": 1.4}      # their f16 [M, F] intermediate h (written, read back)
    assert c.fused_bytes == pytest.approx(single.get(spec, 1.0) * c.minimum_bytes, rel=1e-3)


def test_loop_softmax_rereads_its_row_three_times():
    # over the outer axis: not contiguous, so not a row kernel but the generic loop softmax
    k = kernel_of("""kernel sm {
  in  X : f16[M, N]
  out Y : f16[M, N]
  Y[m, n] = softmax(m) f32(X[m, n])
}""")
    sched = plan_kernel(k)
    (p,) = cost(sched, {"M": 8192, "N": 8192}).plans
    x = 2 * 8192 * 8192
    assert (p.tiled, p.ideal_bytes, p.bytes_read, p.bytes_written) == (False, 2 * x, 3 * x, x)
    assert p.ratio == 2.0
    # a small buffer stays in L2: read from DRAM once
    (p,) = cost(sched, {"M": 64, "N": 64}).plans
    assert p.bytes == p.ideal_bytes


def test_loop_gemm_rereads_its_operands_per_output():
    k = kernel_of("""kernel g {
  in A : f32[M, K]
  in B : f32[K, N]
  in bias : f32[N]
  out D : f32[M, N]
  D[m, n] = sum(k) A[m, k] * B[k, n] + bias[n]
}""")
    sched = planned(k)
    M = N = K = 4096
    a = b = d = 4 * 4096 * 4096
    (p,) = cost(sched, {"M": M, "N": N, "K": K}).plans
    assert not p.tiled        # f32 operands: the plain CUDA loop kernel (a fallback chosen by the registry)
    assert p.bytes_read == a * N + b * M + 4 * N          # the bias fits in L2
    assert p.ideal_bytes == a + b + 4 * N + d
    # without a backend choice (planned with no oracle), GEMM plans count as tiled
    (p,) = cost(plan_kernel(k), {"M": M, "N": N, "K": K}).plans
    assert p.tiled and p.bytes == p.ideal_bytes


def test_spec_minimum_leaves_out_inputs_nothing_reads():
    """A derived backward takes the forward's outputs by name (layernorm_bwd's `y`) but recomputes
    what it needs, and dβ needs no β: the spec minimum counts x, dy, mu, var, gamma read and dx,
    dgamma, dbeta written, not y or beta."""
    from kspec.compile import plan_spec
    from kspec.spec_lang.grad import grad_program
    prog = load_spec(grad_program(load_spec(SPECS / "layernorm.kspec")), is_text=True, file="ln_grad.kspec")
    (sched,) = plan_spec(prog, ("sm90a",), "layernorm_bwd")
    M, N = 8192, 4096
    c = cost(sched, {"M": M, "N": N})
    assert c.minimum_bytes == 3 * M * N * 2 + 2 * M * 4 + N * 2 + 2 * N * 2    # x, dy, dx; mu, var; gamma; dγ, dβ
