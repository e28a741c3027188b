"""Attention over prefix caches: hand-computed cases and a plain twin."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkwise.inference.attention import attend


def _hand_case():
  """4 positions, 2 heads, head_dim 4 (the reference's attention test).

  Keys are one-hot positions; queries (x100, so softmax is nearly hard)
  make head 0 attend 50/50 to positions i and i-1 and head 1 to i and i-2;
  the causal mask removes the wrapped-around targets.
  """
  k = np.eye(4, dtype=np.float32)[:, None, :]  # [T, kv_heads=1, D]
  v = np.arange(1, 17, dtype=np.float32).reshape(4, 1, 4)
  q = np.zeros((4, 2, 4), np.float32)
  for i in range(4):
    q[i, 0, [i, (i - 1) % 4]] = 1
    q[i, 1, [i, (i - 2) % 4]] = 1
  # attend() scales by 1/sqrt(D) = 1/2; x200 gives effective logits of 100.
  q *= 200
  v0, v1, v2, v3 = v[:, 0]
  expected = np.stack(
    [
      np.stack([v0, v0]),
      np.stack([(v0 + v1) / 2, v1]),
      np.stack([(v1 + v2) / 2, (v0 + v2) / 2]),
      np.stack([(v2 + v3) / 2, (v1 + v3) / 2]),
    ]
  )  # [T, heads, D]
  return q, k, v, expected


def test_attend_hand_computed():
  q, k, v, expected = _hand_case()
  out = attend(q[None], k[None], v[None])
  np.testing.assert_allclose(out[0], expected, rtol=1e-6)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_attend_incremental_broadcasts_prefix(split):
  """A batch-1 cache of the first `split` positions serves a batch of 2."""
  q, k, v, expected = _hand_case()
  cache_k = np.broadcast_to(k[None, :split], (1, split, 1, 4))
  cache_v = np.broadcast_to(v[None, :split], (1, split, 1, 4))
  batch2 = lambda x: np.broadcast_to(x[None, split:], (2, *x[split:].shape))
  # The cache's attention sees the prefix; the causal mask only the chunk's
  # own earlier positions, so wrap-around targets are still removed.
  out = attend(
    batch2(q),
    batch2(k),
    batch2(v),
    [(cache_k, cache_v, np.array([split], np.int32))],
  )
  for row in range(2):
    np.testing.assert_allclose(out[row], expected[split:], rtol=1e-6)


def _plain_attention(q, k_all, v_all, visible):
  """Full softmax over explicitly concatenated keys (the plain twin).

  q [B, T, H, D]; k_all, v_all [B, S, KVH, D]; visible bool[B, T, S].
  """
  heads, kv_heads = q.shape[2], k_all.shape[2]
  k_rep = np.repeat(k_all, heads // kv_heads, axis=2)
  v_rep = np.repeat(v_all, heads // kv_heads, axis=2)
  logits = np.einsum("bthd,bshd->bhts", q, k_rep) / np.sqrt(q.shape[-1])
  logits = np.where(visible[:, None], logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("bhts,bshd->bthd", weights, v_rep)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_attend_matches_plain_softmax_over_all_keys(kv_heads):
  """Two prefixes (batch 1, then 2) with padding, a batch-4 chunk."""
  rng = np.random.default_rng(0)
  heads, dim, time = 4, 8, 3
  normal = lambda *s: rng.standard_normal(s).astype(np.float32)
  p0 = (
    normal(1, 5, kv_heads, dim),
    normal(1, 5, kv_heads, dim),
    np.array([4], np.int32),
  )
  p1 = (
    normal(2, 3, kv_heads, dim),
    normal(2, 3, kv_heads, dim),
    np.array([3, 0], np.int32),
  )  # row 1 of this prefix is empty
  q = normal(4, time, heads, dim)
  k, v = normal(4, time, kv_heads, dim), normal(4, time, kv_heads, dim)
  out = attend(q, k, v, [p0, p1])

  expected = []
  for b in range(4):
    r0, r1 = b // 4, b // 2  # repeat-each: prefix row serving query row b
    n0, n1 = p0[2][r0], p1[2][r1]
    k_all = np.concatenate([p0[0][r0, :n0], p1[0][r1, :n1], k[b]])
    v_all = np.concatenate([p0[1][r0, :n0], p1[1][r1, :n1], v[b]])
    visible = np.ones((time, len(k_all)), bool)
    visible[:, n0 + n1 :] = np.tril(np.ones((time, time), bool))
    expected.append(
      _plain_attention(q[b : b + 1], k_all[None], v_all[None], visible[None])[0]
    )
  np.testing.assert_allclose(out, np.stack(expected), rtol=1e-5, atol=1e-6)


def test_attend_does_not_copy_prefix_to_the_batch():
  """The batch-1 prefix is contracted in place: no array holding the 64
  prefix slots for all 4 rows, with a head_dim (8) last, appears."""
  q = jnp.zeros((4, 1, 2, 8))
  k = v = jnp.zeros((4, 1, 1, 8))
  pk = pv = jnp.zeros((1, 64, 1, 8))
  lengths = jnp.array([64], jnp.int32)
  jaxpr = jax.make_jaxpr(attend)(q, k, v, [(pk, pv, lengths)])
  shapes = {tuple(var.aval.shape) for eqn in jaxpr.eqns for var in eqn.outvars}
  assert not any(4 in s and 64 in s and s[-1] == 8 for s in shapes), sorted(
    shapes
  )


@pytest.mark.parametrize("time", [300, 1100])
def test_long_chunk_attends_in_causal_blocks(time):
  """A long chunk's causal attention is cut into query blocks (300 rows: 2
  of 150; 1100: 8, the last shorter) that skip the masked keys, and still
  equals the plain softmax, with a prefix of 5 slots (4 valid) beside it."""
  rng = np.random.default_rng(1)
  normal = lambda *s: rng.standard_normal(s).astype(np.float32)
  q, k, v = normal(1, time, 4, 8), normal(1, time, 2, 8), normal(1, time, 2, 8)
  prefix = (normal(1, 5, 2, 8), normal(1, 5, 2, 8), np.array([4], np.int32))
  out = attend(q, k, v, [prefix])

  k_all = np.concatenate([prefix[0][:, :4], k], axis=1)
  v_all = np.concatenate([prefix[1][:, :4], v], axis=1)
  visible = np.ones((time, 4 + time), bool)
  visible[:, 4:] = np.tril(np.ones((time, time), bool))
  expected = _plain_attention(q, k_all, v_all, visible[None])
  np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)

  jaxpr = jax.make_jaxpr(attend)(q, k, v, [prefix])
  shapes = {tuple(var.aval.shape) for eqn in jaxpr.eqns for var in eqn.outvars}
  assert not any(s.count(time) >= 2 for s in shapes), "no [T, T] logits"
  assert any(s[-1] == time and s.count(time) == 1 for s in shapes)
