"""Column partials (compiler/rowwise.py `fuse_column_partials`, backends/rowwise gen.py and
colsum.py): a norm backward's dγ/dβ, sums over the rows of values its row kernel computes, are
accumulated per column by the row kernel's row slots and finished by one colsum kernel.  The plans
(`--strict`), the modelled DRAM bytes, and the two generated kernels run on the CPU emulator
(tests/rowwise_emu.h) against an independent float64 numpy backward."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kspec.compile import plan_spec
from kspec.compiler import cost
from kspec.compiler.rowwise import COLUMN_SLOTS
from kspec.spec_lang import load_spec, parse, print_program
from kspec.spec_lang.grad import grad_program
from test_rowwise import recording  # noqa: F401  (the recording driver fixture)

SPECS = Path(__file__).resolve().parent.parent / "specs"
ARCHS = ("sm90a", "sm100a")


# LayerNorm over the last axis of [B, S, N] activations: dγ/dβ sum over (b, s), the row kernel's rows
LAYERNORM_3D = """
kernel layernorm {
  param eps : f32 = 1e-5
  in  x     : bf16[B, S, N]
  in  gamma : bf16[N]
  in  beta  : bf16[N]
  out y     : bf16[B, S, N]
  mu[b, s]     = mean(n) f32(x[b, s, n])
  xc[b, s, n]  = f32(x[b, s, n]) - mu[b, s]
  var[b, s]    = mean(n) xc[b, s, n] * xc[b, s, n]
  y[b, s, n]   = xc[b, s, n] * rsqrt(var[b, s] + eps) * f32(gamma[n]) + f32(beta[n])
}
"""


def _bwd_text(stem: str) -> str:
    spec = load_spec(LAYERNORM_3D, is_text=True) if stem == "layernorm_3d" else load_spec(SPECS / f"{stem}.kspec")
    prog = parse(grad_program(spec))
    return print_program(type(prog)(tuple(k for k in prog.kernels if k.name.endswith("_bwd"))))


@pytest.mark.parametrize("stem, sums", [("layernorm", 2), ("rmsnorm", 1), ("add_rmsnorm", 1), ("layernorm_3d", 2)])
def test_norm_backward_plans_two_kernels(stem, sums):
    prog = load_spec(_bwd_text(stem), is_text=True, file=f"{stem}_bwd.kspec")
    (sched,) = plan_spec(prog, ARCHS, f"{stem.removesuffix('_3d')}_bwd", strict=True)
    assert [p.kind for p in sched.plans] == ["rowwise", "colsum"]
    assert all(c.backend == "rowwise" and not c.fallback for p in sched.plans for c in p.choices.values())
    assert {c.kind for c in sched.plans[1].choices.values()} == {"colsum"}
    rows, fin = sched.plans
    parts = [o for o in rows.ir.ops if o.kind == "partial"]
    assert len(parts) == sums and all(o.shape[0] == COLUMN_SLOTS for o in parts)
    column_sums = [o for p in sched.plans for o in p.ir.ops
                   if o.kind in ("contraction", "reduction") and o.axes == ("n",)]
    assert len(column_sums) == sums and all(o.reduced == ("slot",) for o in column_sums)   # no sum over the rows left
    assert set(fin.reads) == {b for _, b, _ in rows.ir.stores if b.startswith("tmp_")}
    # DRAM bytes: each [M, N] tensor once, plus the partials written once and read once
    M, N = 8192, 4096
    c = cost(sched, {"M": M, "N": N, "B": 4, "S": M // 4})
    mn = {b.name for b in sched.buffers.values()
          if len(b.shape) >= 2 and b.shape[-1] == "N" and b.kind in ("input", "output")}
    read = {n for p in sched.plans for n in p.reads} | {n for p in sched.plans for n in p.writes}
    want = sum(M * N * 2 for n in mn if n in read) + 2 * sums * COLUMN_SLOTS * N * 4
    assert c.plans[0].bytes + c.plans[1].bytes == pytest.approx(want, rel=2e-3)


def _layernorm_bwd64(x, gamma, mu, var, dy, eps):
    """Independent float64 LayerNorm backward from the saved mean and variance."""
    x, gamma, mu, var, dy = (np.asarray(a, np.float64) for a in (x, gamma, mu, var, dy))
    rstd = 1.0 / np.sqrt(var + eps)[:, None]
    xhat = (x - mu[:, None]) * rstd
    gy = dy * gamma[None, :]
    dx = rstd * (gy - gy.mean(axis=1, keepdims=True) - xhat * (gy * xhat).mean(axis=1, keepdims=True))
    return dx, (dy * xhat).sum(axis=0), dy.sum(axis=0)


def _run_layernorm_bwd(M: int, N: int, budget: int | None = None, sms: int | None = None,
                       batch: tuple[int, int] | None = None):
    """batch: (B, S) with B * S == M: LAYERNORM_3D's backward on [B, S, N] tensors."""
    from kspec.numerics import storage_dtype
    from rowwise_harness import EmuKernel, available
    if available():
        pytest.skip(f"cannot emulate row kernels here: {available()}")
    text = _bwd_text("layernorm_3d" if batch else "layernorm")
    rows, fin = EmuKernel(text, is_text=True, plan=0, budget=budget, sms=sms), EmuKernel(text, is_text=True, plan=1)
    rng = np.random.default_rng(M * 1000 + N)
    bf = storage_dtype("bf16")
    x = (rng.standard_normal((M, N)) * 2 + 0.5).astype(bf)
    x64 = x.astype(np.float64)
    arrays = {"x": x, "gamma": rng.standard_normal(N).astype(bf), "beta": rng.standard_normal(N).astype(bf),
              "y": np.zeros((M, N), bf), "mu": x64.mean(axis=1).astype(np.float32),
              "var": x64.var(axis=1).astype(np.float32), "dy": rng.standard_normal((M, N)).astype(bf)}
    scratch = {b.name: np.full(tuple(d if isinstance(d, int) else N for d in b.shape), np.nan, np.float32)
               for b in rows.lowered.ir.buffers if b.role == "intermediate"}
    if batch:
        arrays = {k: v.reshape(batch + v.shape[1:]) if v.shape[:1] == (M,) else v for k, v in arrays.items()}
    got, facts = rows(arrays, outputs=scratch)
    got["dx"] = got["dx"].reshape(M, N)
    if budget is not None:
        assert (facts["cluster"], facts["cache"]) == ((2, 1) if budget > 1024 else (1, 0))
    slots = facts["grid"] // facts["cluster"] * facts["block_y"]        # one thread row per slot
    per_sm = 1024 // (facts["block_x"] * facts["block_y"])             # by registers (shared memory is no limit here)
    assert slots == (COLUMN_SLOTS if sms is None else min(COLUMN_SLOTS, sms * per_sm * facts["block_y"]))
    sums, fin_facts = fin(arrays, outputs={**scratch, "dx": got["dx"]})
    assert fin_facts["grid"] == (N + 31) // 32
    for part in scratch.values():                       # every slot wrote its row; empty slots zeros
        assert np.isfinite(part).all()
        assert not part[M:].any() and not part[slots:].any()
    dx, dgamma, dbeta = _layernorm_bwd64(x, arrays["gamma"], arrays["mu"].reshape(M), arrays["var"].reshape(M),
                                         arrays["dy"].reshape(M, N), 1e-5)
    f = lambda a: np.asarray(a).astype(np.float64)        # noqa: E731
    np.testing.assert_allclose(f(got["dx"]), dx, rtol=2e-2, atol=2e-2 * np.abs(dx).max(initial=0.0))
    np.testing.assert_allclose(f(sums["dgamma"]), dgamma, rtol=1e-2, atol=1e-2 * np.abs(dgamma).max(initial=0.0))
    np.testing.assert_allclose(f(sums["dbeta"]), dbeta, rtol=1e-2, atol=1e-2 * np.abs(dbeta).max(initial=0.0))


@pytest.mark.parametrize("M", [5, 0])
def test_layernorm_backward_fewer_rows_than_slots_on_the_cpu(M):
    """M < P: most slots get no row and write zero partials (M = 0: dγ and dβ are zeros)."""
    _run_layernorm_bwd(M, 40)


@pytest.mark.slow
def test_layernorm_backward_over_two_row_axes_on_the_cpu():
    """[B, S, N]: the slots take the B * S rows in row order, more rows than slots."""
    _run_layernorm_bwd(3 * 101, 24, batch=(3, 101))


@pytest.mark.slow
@pytest.mark.parametrize("M, N", [(300, 45), (517, 64)])
def test_layernorm_backward_rows_not_a_multiple_of_the_slots_on_the_cpu(M, N):
    _run_layernorm_bwd(M, N)


def test_layernorm_backward_on_a_small_gpu_runs_fewer_slots():
    """Told of one SM, the host glue launches only the slots resident at once (8 CTAs of 32 x 4
    threads, 64 registers each: 32 slots): each slot takes more rows, and the partials rows no slot
    ran are zeros."""
    _run_layernorm_bwd(300, 40, sms=1)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [2048, 64])
def test_layernorm_backward_split_rows_and_uncached_rows_on_the_cpu(budget):
    """A small shared-memory budget: the row is split over a cluster, each CTA accumulating its
    slice of the columns (2048), or nothing fits and the slot's row of the partials buffer in global
    memory is the accumulator (64)."""
    _run_layernorm_bwd(40, 200, budget=budget)


# ---------------------------------------------------------------- nvcc: both archs, SASS, launch ABI

@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_norm_backward_kernels_compile_with_vector_loads(arch, tmp_path, kernel_cache):
    """The row kernel keeps its 128-bit loads and stores and warp shuffles and stores the partials;
    the colsum kernel reads them coalesced and folds its thread rows through shared memory.  The host
    glue launches P / TY row-slot CTAs whatever the row count (132 SMs hold them all)."""
    import re

    from conftest import build_emitted
    from test_rowwise import _prepare, _sass

    from kspec.compile import emit_spec
    path = tmp_path / "ln_bwd.kspec"
    path.write_text(_bwd_text("layernorm"))
    em = emit_spec(path, (arch,))
    (rows,), (fin,) = em.plans.values()
    cubin, host, _ = build_emitted(rows.emitted, kernel_cache)
    sass = _sass(cubin)
    assert re.search(r"\bLDG\.E\.(128|ENL2\.256)", sass) and re.search(r"\bSTG\.E\.(128|ENL2\.256)", sass)
    assert re.search(r"\bSHFL\.BFLY", sass) and re.search(r"\bBAR\.SYNC", sass)
    fcubin, fhost, _ = build_emitted(fin.emitted, kernel_cache)
    fsass = _sass(fcubin)
    assert re.search(r"\bLDG\.E\b", fsass) and re.search(r"\bBAR\.SYNC", fsass) and re.search(r"\bSTG\.E\.U16", fsass)
    assert ("column partials", f"up to {COLUMN_SLOTS} row slots") in rows.emitted.config
    desc = rows.lowered.desc
    roles = [r for r, _ in rows.lowered.dims]
    stride_role = {r for r, _, _ in desc.strides}
    ptrs = [0x10000 * (i + 1) for i in range(len(desc.args))]

    def prepare(m, n):
        dims = [m if r == "d0" else n if r in ("d1", *stride_role) else n for r in roles]
        f = _prepare(host, dims, ptrs, len(desc.args), len(desc.dims), len(desc.scalars))
        return f["grid"], f["block"], f["cluster"], f["smem"], (f["vec"], f["cs"], f["cache"])
    for m in (8192, 100, 3):
        grid, block, cluster, smem, (vec, cs, cache) = prepare(m, 4096)
        assert grid[0] * block[1] == COLUMN_SLOTS * cs and (vec, cache) == (1, 1)
        # cached x and dy rows (bf16) plus two f32 accumulators per column, per thread row
        assert smem == block[1] * (4096 + 16) * (2 + 2 + 2 + 4 + 4)


@pytest.mark.nvcc
def test_norm_backward_artifact_launches_the_row_slots_then_the_column_sums(tmp_path, kernel_cache, recording):
    """Through the runtime and a recording driver: one scratch block holds both [P, N] partials
    buffers; the row kernel's launch writes them (P / TY CTAs of TY thread rows on 132 SMs) and
    the colsum kernel's launch reads the same pointers (N / 32 CTAs of 32 x 8 threads)."""
    import struct

    import kspec
    from kspec.compile import compile_spec
    from kspec.runtime import DeviceBuffer
    rec = recording
    path = tmp_path / "ln_bwd.kspec"
    path.write_text(_bwd_text("layernorm"))
    mod = kspec.load(compile_spec(path, ("sm90a",), tmp_path / "out", cache=kernel_cache))
    M, N, base = 1000, 4096, 0x7F0000000000
    mn, vec, row = (M, N), (N,), (M,)
    kinds = [(mn, "bf16"), (vec, "bf16"), (vec, "bf16"), (mn, "bf16"), (row, "f32"), (row, "f32"), (mn, "bf16")]
    args = [DeviceBuffer(base + i * 0x1000000, shape, dt) for i, (shape, dt) in enumerate(kinds)]
    out = mod.layernorm_bwd(*args, eps=1e-5)
    launches = [e for e in rec.log if e[0] == "launch"]
    assert len(launches) == 2
    (_, _, grid, block, cluster, smem, _, raw), (_, _, fgrid, fblock, _, fsmem, _, fraw) = launches
    assert grid[0] * block[1] == COLUMN_SLOTS * cluster[0] and smem > 0
    assert fgrid == (N // 32, 1, 1) and fblock == (32, 8, 1) and fsmem == 8 * 32 * 2 * 4
    scratch = 2 * COLUMN_SLOTS * N * 4                 # the partials, in the call's one scratch block
    assert [e[1] for e in rec.log if e[0] == "alloc" and scratch <= e[1] < scratch + 4096] != []
    plans = mod.manifest.kernels[0].plans
    rows_args, fin_args = list(plans[0].args), list(plans[1].args)
    ptrs = dict(zip(rows_args, struct.unpack_from(f"<{len(rows_args)}Q", raw, 0)))
    fptrs = dict(zip(fin_args, struct.unpack_from(f"<{len(fin_args)}Q", fraw, 0)))
    partials = [a for a in fin_args if a.startswith("tmp_")]
    assert len(partials) == 2 and all(ptrs[a] == fptrs[a] for a in partials)
    assert abs(fptrs[partials[0]] - fptrs[partials[1]]) >= COLUMN_SLOTS * N * 4
    assert ptrs["dx"] == out["dx"].ptr and {fptrs["dgamma"], fptrs["dbeta"]} == {out["dgamma"].ptr, out["dbeta"].ptr}


def test_row_group_a_backend_would_not_build_keeps_its_column_sums_apart():
    """When the oracle says no backend builds the row kernel with the partials, the rewrite is
    undone: the sums over the rows plan as before (the graph the schedule sees has no partial op),
    and a note says why."""
    from kspec.backends import registry
    from kspec.compiler import plan_kernel

    class Refusing(registry.Planner):
        def can_fuse(self, ir, archs):
            if any(o.kind == "partial" for o in ir.ops):
                return "sm90a: refused for the test"
            return super().can_fuse(ir, archs)
    prog = load_spec(_bwd_text("layernorm"), is_text=True, file="layernorm_bwd.kspec")
    sched = plan_kernel(prog.kernel("layernorm_bwd"), ARCHS, Refusing())
    assert "colsum" not in [p.kind for p in sched.plans] and len(sched.plans) == 5
    assert not any(op_kind == "partial" for op_kind in (d["op"].kind for _, d in sched.graph.nodes(data=True)))
    assert any("stay separate kernels: sm90a: refused for the test" in n for n in sched.fusion.notes)
    assert sum(p.kind in ("reduction", "contraction") for p in sched.plans) == 2
