"""One training step of a Llama-style decoder block whose RMSNorms, causal attention, SwiGLU MLP
and loss are kspec kernels, differentiated by `kspec grad` (kspec.torch.trainable).

    python examples/llama_block.py            # CPU: the kernels run through the numpy reference

The projections (QKV, output, LM head) stay torch matmuls; RoPE is left out.  On a GPU, compile
each pair (`kspec grad` then `kspec compile`) and pass artifact= to kspec.torch.trainable: the same
code then launches the compiled kernels for CUDA tensors.  The specs are written in f32 here so a
CPU step is exact enough to compare with plain torch (tests/test_torch_train.py does).
"""
from __future__ import annotations

import math

import torch

import kspec.torch

RMSNORM = """
kernel rmsnorm {
  param eps : f32 = 1e-6
  in  x : f32[M, N]
  in  w : f32[N]
  out y : f32[M, N]
  ms[m]   = mean(n) x[m, n] * x[m, n]
  y[m, n] = x[m, n] * rsqrt(ms[m] + eps) * w[n]
}
"""
ATTENTION = """
kernel attention {
  param scale : f32 = 0.25
  in  Q : f32[B, H, S, D]
  in  K : f32[B, H, S, D]
  in  V : f32[B, H, S, D]
  out O : f32[B, H, S, D]
  s[b, h, i, j] = scale * sum(e) Q[b, h, i, e] * K[b, h, j, e]
  p[b, h, i, j] = softmax(j, causal=i) s[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[b, h, j, e]
}
"""
SWIGLU = """
kernel swiglu {
  in  X  : f32[M, K]
  in  Wg : f32[F, K]
  in  Wu : f32[F, K]
  in  Wd : f32[N, F]
  out Y  : f32[M, N]
  h[m, f] = silu(sum(k) X[m, k] * Wg[f, k]) * sum(k) X[m, k] * Wu[f, k]
  Y[m, n] = sum(f) h[m, f] * Wd[n, f]
}
"""
CROSS_ENTROPY = """
kernel xent {
  in  logits : f32[M, V]
  in  label  : i32[M]
  out loss   : f32[M]
  mx[m]   = max(v) logits[m, v]
  lse[m]  = log(sum(v) exp(logits[m, v] - mx[m])) + mx[m]
  loss[m] = lse[m] - logits[m, label[m]]
}
"""


class KspecLlamaBlock(torch.nn.Module):
    def __init__(self, dim=32, heads=4, hidden=48, vocab=40, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def w(*shape):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) / math.sqrt(shape[-1]))
        self.heads, self.dim = heads, dim
        self.norm1, self.norm2, self.norm_f = (torch.nn.Parameter(1.0 + 0.1 * torch.randn(dim, generator=g))
                                               for _ in range(3))
        self.wqkv, self.wo = w(3 * dim, dim), w(dim, dim)
        self.wg, self.wu, self.wd = w(hidden, dim), w(hidden, dim), w(dim, hidden)
        self.lm_head = w(vocab, dim)
        self.rmsnorm = kspec.torch.trainable(RMSNORM)
        self.attention = kspec.torch.trainable(ATTENTION)
        self.swiglu = kspec.torch.trainable(SWIGLU)
        self.xent = kspec.torch.trainable(CROSS_ENTROPY)

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        B, S, E = x.shape
        H, D = self.heads, E // self.heads
        flat = x.reshape(B * S, E)
        a = self.rmsnorm(flat, self.norm1)["y"]
        q, k, v = (t.reshape(B, S, H, D).transpose(1, 2).contiguous() for t in (a @ self.wqkv.T).split(E, -1))
        o = self.attention(q, k, v, scale=1.0 / math.sqrt(D))["O"]
        h = flat + o.transpose(1, 2).reshape(B * S, E) @ self.wo.T
        h = h + self.swiglu(self.rmsnorm(h, self.norm2)["y"], self.wg, self.wu, self.wd)["Y"]
        logits = self.rmsnorm(h, self.norm_f)["y"] @ self.lm_head.T
        return self.xent(logits, labels.reshape(-1).to(torch.int32))["loss"].mean()


def torch_loss(m: KspecLlamaBlock, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The same block in plain torch (the reference the example and its test compare with)."""
    def rms(t, w):
        return t * torch.rsqrt((t * t).mean(-1, keepdim=True) + 1e-6) * w
    B, S, E = x.shape
    H, D = m.heads, E // m.heads
    flat = x.reshape(B * S, E)
    q, k, v = (t.reshape(B, S, H, D).transpose(1, 2) for t in (rms(flat, m.norm1) @ m.wqkv.T).split(E, -1))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = flat + o.transpose(1, 2).reshape(B * S, E) @ m.wo.T
    a = rms(h, m.norm2)
    h = h + (torch.nn.functional.silu(a @ m.wg.T) * (a @ m.wu.T)) @ m.wd.T
    logits = rms(h, m.norm_f) @ m.lm_head.T
    return torch.nn.functional.cross_entropy(logits, labels.reshape(-1))


def train_step(m: KspecLlamaBlock, x, labels, lr=0.1) -> tuple[float, float]:
    """One SGD step; returns the loss before and after it."""
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    opt.zero_grad()
    loss = m.loss(x, labels)
    loss.backward()
    opt.step()
    with torch.no_grad():
        after = m.loss(x, labels)
    return float(loss.detach()), float(after)


def main() -> None:
    torch.manual_seed(0)
    m = KspecLlamaBlock()
    x = torch.randn(2, 6, m.dim)
    labels = torch.randint(0, m.lm_head.shape[0], (2, 6))
    before, after = train_step(m, x, labels)
    print(f"loss {before:.4f} -> {after:.4f} after one SGD step (kspec kernels through the numpy reference)")


if __name__ == "__main__":
    main()
