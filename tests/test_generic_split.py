"""The generic backend's split reductions (backends/generic/split.py): a sum, mean or dot product over
several contiguous reduced axes around a few kept elements (ALiBi's slope gradient) runs one CTA per
output and a share of its elements, not one thread per output; planned as no fallback, and on a
threaded CPU emulation of the generated CUDA (tests/test_grad_plans.py's) equal to numpy in float64."""
from __future__ import annotations

import numpy as np
import pytest

from kspec.compile import emit_spec, plan_spec
from kspec.spec_lang import load_spec
from kspec.spec_lang.grad import grad_program

SPECS = """
kernel slope_grad {
  in  ds : f32[B, H, S, T]
  out dslope : f32[H]
  dslope[h] = sum(b, i, j) ds[b, h, i, j] * f32(j - i)
}
kernel head_dot {
  in  x : bf16[B, H, S, E]
  in  y : bf16[B, H, S, E]
  out d : f32[H]
  d[h] = sum(b, s, e) f32(x[b, h, s, e]) * f32(y[b, h, s, e])
}
kernel head_mean {
  in  x : f32[B, H, S]
  out mu : f32[H]
  mu[h] = mean(b, s) x[b, h, s]
}
kernel head_max {
  in  x : f32[B, H, S]
  out mx : f32[H]
  mx[h] = max(b, s) x[b, h, s]
}
"""


def _choice(sched):
    (p,) = sched.plans
    (c,) = {c.backend: c for c in p.choices.values()}.values()
    return p, c


@pytest.mark.parametrize("kernel", ["slope_grad", "head_dot", "head_mean"])
def test_split_reductions_are_no_fallback(kernel):
    (sched,) = plan_spec(load_spec(SPECS, is_text=True), ("sm90a", "sm100a"), kernel, strict=True)
    p, c = _choice(sched)
    assert c.backend == "generic" and not c.fallback


def test_max_over_strided_heads_stays_a_loud_loop():
    """No float atomic max: the loop path, printed as a fallback (and refused by --strict)."""
    (sched,) = plan_spec(load_spec(SPECS, is_text=True), ("sm90a",), "head_max")
    p, c = _choice(sched)
    assert c.fallback and "one thread per output element" in c.fallback


def test_alibi_backward_slope_gradient_is_a_split_reduction():
    """The derived ALiBi backward's `dslope[h] = sum(b, i, j) ds * (j - i)` is no loop kernel."""
    from pathlib import Path
    spec = Path(__file__).resolve().parent.parent / "specs" / "attention_alibi.kspec"
    prog = load_spec(grad_program(load_spec(spec)), is_text=True, file="alibi_grad.kspec")
    (sched,) = plan_spec(prog, ("sm90a", "sm100a"), "attention_alibi_bwd")
    (p,) = [p for p in sched.plans if "dslope" in p.writes]
    assert p.kind == "reduction" and not any(c.fallback for c in p.choices.values())


def _emulate(tmp_path, kernel, sizes, rng):
    """Run the generated kernel of `kernel` on the CPU emulation; (arrays by name, launch grid)."""
    from generic_emu import emulate
    path = tmp_path / "s.kspec"
    path.write_text(SPECS)
    em = emit_spec(path, ("sm90a",), kernel)
    ((ep,),) = [eps for eps in em.plans.values()]
    assert "kspec_split_" in ep.emitted.source and ep.emitted.init
    arrays, _, grid, _ = emulate(ep, sizes, rng, tmp_path)
    return arrays, grid


def test_slope_gradient_runs_on_the_cpu(tmp_path):
    """H = 3 outputs, 2*40*70 = 5600 elements each: split over 3 CTAs per output (at least 8
    elements a thread), the partials added atomically, equal to float64 numpy."""
    rng = np.random.default_rng(7)
    sizes = {"B": 2, "H": 3, "S": 40, "T": 70}
    arrays, grid = _emulate(tmp_path, "slope_grad", sizes, rng)
    assert grid == 3 * 3
    (ds,) = [v for v in arrays.values() if v.ndim == 4]
    (out,) = [v for v in arrays.values() if v.ndim == 1]
    i = np.arange(sizes["S"])[:, None]
    j = np.arange(sizes["T"])[None, :]
    want = (ds.astype(np.float64) * (j - i)).sum(axis=(0, 2, 3))
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-3)


def test_head_dot_and_mean_run_on_the_cpu(tmp_path):
    """A dot product of bf16 operands and a mean (each partial divided by the element count), with
    one split per output where the elements are few (B*S = 10)."""
    rng = np.random.default_rng(8)
    sizes = {"B": 2, "H": 5, "S": 30, "E": 64}
    (tmp_path / "dot").mkdir()
    arrays, grid = _emulate(tmp_path / "dot", "head_dot", sizes, rng)
    assert grid == 5 * 2                              # 3840 elements: 2 splits of at least 2048
    x, y = [v.astype(np.float64) for v in arrays.values() if v.ndim == 4]
    (out,) = [v for v in arrays.values() if v.ndim == 1]
    np.testing.assert_allclose(out, (x * y).sum(axis=(0, 2, 3)), rtol=1e-4, atol=1e-3)
    sizes = {"B": 2, "H": 4, "S": 5}
    (tmp_path / "mean").mkdir()
    arrays, grid = _emulate(tmp_path / "mean", "head_mean", sizes, rng)
    assert grid == 4
    (x,) = [v.astype(np.float64) for v in arrays.values() if v.ndim == 3]
    (out,) = [v for v in arrays.values() if v.ndim == 1]
    np.testing.assert_allclose(out, x.mean(axis=(0, 2)), rtol=1e-5, atol=1e-6)
