"""A plain NumPy Transformer, written from the math, as the oracle for the
JAX model: one sequence at a time, no caches, no scan, float64."""

import numpy as np

from chunkwise.configs import Activation, Block


def _rms_norm(x, scale, eps):
  out = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  return out if scale is None else out * scale


def _rope(x, base):
  """x [T, heads, D]; token t sits at position t."""
  time, _, dim = x.shape
  inv_freq = base ** (-np.arange(0, dim, 2) / dim)
  angle = np.arange(time)[:, None] * inv_freq[None, :]  # [T, D/2]
  cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
  x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _act(kind, x):
  if kind == Activation.SILU:
    return x / (1 + np.exp(-x))
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _project(xn, lw, name):
  out = np.einsum("te,ehd->thd", xn, lw[name])
  bias = lw.get(f"{name}_bias")
  return out if bias is None else out + bias


def _attention(h, lw, xn, causal):
  q = _rope(_project(xn, lw, "q"), h.rope_base)
  k = _rope(_project(xn, lw, "k"), h.rope_base)
  v = _project(xn, lw, "v")
  group = h.heads // h.kv_heads
  out = np.zeros_like(q)
  for head in range(h.heads):
    kv = head // group
    s = q[:, head] @ k[:, kv].T / np.sqrt(h.head_dim)
    s = np.where(causal, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    out[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
  return np.einsum("thd,hde->te", out, lw["o"])


def _mlp(h, lw, xn):
  hidden = _act(h.activation, xn @ lw["gate"]) * (xn @ lw["up"])
  return hidden @ lw["down"]


def logits(h, weights, tokens):
  """f64[T, vocab]: next-token logits after each of `tokens` (one row)."""
  table = np.asarray(weights.embedding, np.float64)
  x = table[np.asarray(tokens)]
  time = len(tokens)
  causal = np.tril(np.ones((time, time), bool))
  for layer in weights.layers:
    lw = {
      k: (None if v is None else np.asarray(v, np.float64))
      for k, v in vars(layer).items()
    }
    if h.block == Block.PARALLEL:
      xn = _rms_norm(x, lw["attn_norm"], h.norm_eps)
      x = x + _attention(h, lw, xn, causal) + _mlp(h, lw, xn)
    else:
      x = x + _attention(
        h, lw, _rms_norm(x, lw["attn_norm"], h.norm_eps), causal
      )
      x = x + _mlp(h, lw, _rms_norm(x, lw["mlp_norm"], h.norm_eps))
  final = (
    None
    if weights.final_norm is None
    else np.asarray(weights.final_norm, np.float64)
  )
  x = _rms_norm(x, final, h.norm_eps)
  if weights.unembedding is None:
    return x @ table.T
  return x @ np.asarray(weights.unembedding, np.float64)
