"""kspec.torch: `kspec grad` pairs as differentiable torch callables on the CPU (numpy reference):
gradients against plain torch, torch.autograd.gradcheck, torch.compile (fullgraph, forward and
backward), and the Llama-block example's training step (examples/llama_block.py) against the same
block written in plain torch."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from kspec.core import KspecError

torch = pytest.importorskip("torch", reason="torch (CPU is enough) is needed for kspec.torch")
import kspec.torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"


def _example():
    spec = importlib.util.spec_from_file_location("llama_block", ROOT / "examples" / "llama_block.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["llama_block"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_llama_block_gradients_match_plain_torch():
    ex = _example()
    torch.manual_seed(0)
    m = ex.KspecLlamaBlock()
    x = torch.randn(2, 5, m.dim)
    labels = torch.randint(0, m.lm_head.shape[0], (2, 5))
    loss = m.loss(x, labels)
    got = torch.autograd.grad(loss, list(m.parameters()))
    want_loss = ex.torch_loss(m, x, labels)
    want = torch.autograd.grad(want_loss, list(m.parameters()))
    assert abs(float(loss) - float(want_loss)) < 1e-5
    for (name, _), a, b in zip(m.named_parameters(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda s, n=name: f"d{n}: {s}")
    before, after = ex.train_step(m, x, labels)
    assert after < before


def _f32(stem: str) -> str:
    return (SPECS / f"{stem}.kspec").read_text().replace("bf16", "f32").replace("f16", "f32")


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")
def test_gradcheck_through_the_reference():
    """gradcheck in f32 (the reference computes in f32): loose steps and tolerances."""
    torch.manual_seed(1)
    opts = dict(eps=1e-2, atol=2e-2, rtol=2e-2)
    rms = kspec.torch.trainable(_f32("rmsnorm"))
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms(a, b)["y"], (x, w), **opts)
    att = kspec.torch.trainable(_f32("attention_causal").replace("64]", "4]"))
    q, k, v = (torch.randn(1, 2, 3, 4, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda a, b, c: att(a, b, c)["O"], (q, k, v), **opts)
    ce = kspec.torch.trainable(_f32("cross_entropy"))
    logits, label = torch.randn(4, 7, requires_grad=True), torch.tensor([0, 6, 2, 2], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda a: ce(a, label)["loss"], (logits,), **opts)


def test_saved_outputs_carry_no_gradient_and_int_inputs_get_none():
    ce = kspec.torch.trainable(_f32("cross_entropy"))
    assert ce.outputs == ["loss", "mx", "lse_r"] and ce.grad_of_input == {"logits": "dlogits"}
    logits = torch.randn(3, 5, requires_grad=True)
    out = ce(logits, torch.tensor([1, 2, 3], dtype=torch.int32))
    assert out["loss"].requires_grad and not out["mx"].requires_grad
    out["loss"].sum().backward()
    p = torch.softmax(logits.detach(), -1)
    p[torch.arange(3), torch.tensor([1, 2, 3])] -= 1
    torch.testing.assert_close(logits.grad, p, rtol=1e-5, atol=1e-6)


def test_torch_compile_traces_forward_and_backward():
    rms = kspec.torch.trainable(_f32("rmsnorm"))
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)

    def f(a, b):
        return (rms(a, b, eps=1e-5)["y"] * 2.0).square().sum()
    f(x, w).backward()
    want = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    torch.compile(f, fullgraph=True)(x, w).backward()
    torch.testing.assert_close((x.grad, w.grad), want)


def test_pairs_from_a_grad_spec_and_argument_errors(tmp_path):
    from kspec.spec_lang import load_spec
    from kspec.spec_lang.grad import grad_program
    path = tmp_path / "sw_grad.kspec"
    path.write_text(grad_program(load_spec(_f32("swiglu_mlp"), is_text=True), wrt=["X", "Wd"]))
    sw = kspec.torch.trainable(str(path))
    assert sw.name == "swiglu_mlp" and sw.grad_of_input == {"X": "dX", "Wd": "dWd"}
    X, Wg, Wu, Wd = (torch.randn(*s, requires_grad=True) for s in ((3, 4), (5, 4), (5, 4), (2, 5)))
    sw(X, Wg, Wu, Wd)["Y"].sum().backward()
    assert X.grad is not None and Wd.grad is not None and Wg.grad is None
    with pytest.raises(KspecError, match="missing input"):
        sw(X, Wg)
    with pytest.raises(KspecError, match="unexpected argument 'eps'"):
        sw(X, Wg, Wu, Wd, eps=1.0)
    with pytest.raises(KspecError, match="wrt= applies when the pair is derived"):
        kspec.torch.trainable(str(path), wrt=["X"])
