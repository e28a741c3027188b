"""The JAX Transformer against a plain NumPy twin, for both block kinds,
multiquery / grouped / multihead attention, tied and untied embeddings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.configs import Activation, Block
from tests import numpy_reference


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


VARIANTS = [
  # (block, kv_heads, tied, norm_scale, activation, qkv_bias)
  (Block.SEQUENTIAL, 2, False, True, Activation.SILU, False),
  (Block.SEQUENTIAL, 8, True, True, Activation.SILU, False),
  (Block.SEQUENTIAL, 1, False, False, Activation.GELU, False),
  (Block.SEQUENTIAL, 2, True, True, Activation.SILU, True),
  (Block.PARALLEL, 1, True, True, Activation.SILU, False),
  (Block.PARALLEL, 2, False, True, Activation.GELU, True),
  (Block.PARALLEL, 8, True, False, Activation.SILU, False),
]


@pytest.mark.parametrize(
  "block, kv_heads, tied, norm_scale, activation, qkv_bias", VARIANTS
)
def test_prefill_matches_numpy_twin(
  block, kv_heads, tied, norm_scale, activation, qkv_bias
):
  h = cw.configs.get("tiny").replace(
    block=block,
    kv_heads=kv_heads,
    tied_embeddings=tied,
    norm_scale=norm_scale,
    activation=activation,
    rope_base=500.0,
    qkv_bias=qkv_bias,
  )
  model = cw.InferenceModel.random(h, seed=3)
  rows = [[1, 50, 60, 70, 80, 90, 100], [1, 7, 300]]
  chunk = cw.Chunk.from_lists(rows)
  result = model.prefill(chunk, top_n=3)
  for b, row in enumerate(rows):
    want = numpy_reference.logits(h, model.weights, row)
    np.testing.assert_allclose(
      result.next_token_logits[b], want[-1], rtol=1e-4, atol=1e-4
    )
    logprobs = _log_softmax(want)
    np.testing.assert_allclose(
      result.per_token_scores[b, 1 : len(row)],
      logprobs[np.arange(len(row) - 1), row[1:]],
      rtol=1e-4,
      atol=1e-4,
    )


def test_bf16_weights_cache_and_activations_stay_close_to_f32():
  h = cw.configs.get("tiny")
  f32 = cw.InferenceModel.random(h, seed=4)
  bf16 = cw.InferenceModel(
    h,
    jax.tree.map(lambda x: x.astype(jnp.bfloat16), f32.weights),
    f32.vocab,
    cache_dtype=jnp.bfloat16,
    compute_dtype=jnp.bfloat16,
  )
  chunk = cw.Chunk.tokenize(f32.vocab, ["abc def", "xy"], is_first_chunk=True)
  want, got = f32.prefill(chunk), bf16.prefill(chunk)
  assert got.kv_cache.k.dtype == jnp.bfloat16
  mask = np.asarray(chunk.token_mask)
  np.testing.assert_allclose(
    np.asarray(got.per_token_scores)[mask],
    np.asarray(want.per_token_scores)[mask],
    atol=0.1,
  )
  tokens, result = bf16.generate(
    [got], sample_ids=[0, 1], steps=4, sampling=cw.Sampling(temperature=0.0)
  )
  assert result.kv_cache.k.dtype == jnp.bfloat16
  assert np.isfinite(np.asarray(result.per_token_scores)).all()
  assert tokens.lengths.shape == (2,)


def test_layers_traced_once_are_the_layers_traced_apart(monkeypatch, tiny):
  """`traced_once` (one trace of a layer, inlined by XLA at each of its
  calls) computes what tracing every layer apart does, bit for bit: a
  prefill's scores, top-n and K/V, and a decode step's tokens."""
  from chunkwise.models import transformer

  chunk = cw.Chunk.from_lists([[1, 5, 9, 30, 2], [1, 7, 7]])

  def run():
    model = cw.InferenceModel.random(tiny.hparams, seed=3)  # fresh programs
    r = model.prefill(chunk, top_n=3)
    tokens, _ = model.generate(
      [r], sample_ids=[0, 1], steps=4, sampling=cw.Sampling(temperature=0.8)
    )
    return [
      np.asarray(a)
      for a in (
        r.per_token_scores,
        r.top_ids,
        r.top_logprobs,
        r.kv_cache.k,
        tokens.tokens,
      )
    ]

  once = run()
  monkeypatch.setattr(transformer, "TRACE_ONCE", False)
  apart = run()
  for a, b in zip(once, apart, strict=True):
    np.testing.assert_array_equal(a, b)
