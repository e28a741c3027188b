"""FullChunkResult.to_chunk_result and concat_results, by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise import numerics
from chunkwise.inference.results import FullChunkResult, pick


def test_to_chunk_result_by_hand():
  """The reference's chunk test: BOS scores 0, ties to the lower id."""
  chunk = cw.Chunk.from_lists([[0, 1, 2]])
  probs = np.array(
    [[[0, 0.6, 0.3, 0.1], [0, 0.05, 0.85, 0.1], [0.1, 0.15, 0.2, 0.55]]],
    np.float32,
  )
  with np.errstate(divide="ignore"):
    logits = jnp.asarray(np.log(probs))
  cache = cw.KVCache.zeros(layers=1, batch=1, time=3, kv_heads=1, head_dim=2)
  result = FullChunkResult(logits=logits, kv_cache=cache).to_chunk_result(
    None, chunk, top_n=4, bos_id=0
  )
  np.testing.assert_allclose(
    result.per_token_scores, np.log([[1, 0.6, 0.85]]), rtol=1e-6
  )
  np.testing.assert_array_equal(
    result.top_ids[0], [[0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 1, 0]]
  )
  np.testing.assert_allclose(
    np.exp(result.top_logprobs[0]),
    [[1, 0, 0, 0], [0.6, 0.3, 0.1, 0], [0.85, 0.1, 0.05, 0]],
    rtol=1e-6,
    atol=1e-7,
  )
  np.testing.assert_array_equal(result.next_token_logits, logits[:, -1])


def _result(scores, lengths):
  """A ChunkResult whose scores, top ids and K/V encode (row, slot)."""
  scores = np.asarray(scores, np.float32)
  batch, time = scores.shape
  kv = np.broadcast_to(scores[None, :, :, None, None], (2, batch, time, 1, 3))
  return cw.ChunkResult(
    per_token_scores=jnp.asarray(scores),
    top_ids=jnp.asarray(scores[..., None].astype(np.int32)),
    top_logprobs=jnp.asarray(scores[..., None]),
    next_token_logits=jnp.asarray(scores[:, :1] * np.ones((1, 5))),
    kv_cache=cw.KVCache(
      k=jnp.asarray(kv),
      v=jnp.asarray(-kv),
      lengths=jnp.asarray(lengths, jnp.int32),
    ),
  )


def test_concat_results_packs_rows_and_repeats_each():
  a = _result([[1, 2, 0]], [2])  # batch 1, one padding slot
  b = _result([[10, 0], [20, 21]], [1, 2])  # batch 2
  c = _result([[30, 31, 0, 0], [40, 0, 0, 0]], [2, 1])
  merged = cw.concat_results([a, b, c])
  # Row r of a batch-1 prefix serves both rows; valid slots packed left.
  want = [[1, 2, 10, 30, 31], [1, 2, 20, 21, 40]]
  np.testing.assert_array_equal(merged.kv_cache.lengths, [5, 5])
  np.testing.assert_array_equal(merged.per_token_scores[:, :5], want)
  np.testing.assert_array_equal(merged.top_ids[:, :5, 0], want)
  np.testing.assert_array_equal(merged.kv_cache.k[1, :, :5, 0, 2], want)
  np.testing.assert_array_equal(
    merged.kv_cache.v[0, :, :5, 0, 0], -np.array(want)
  )
  np.testing.assert_array_equal(merged.next_token_logits, c.next_token_logits)
  assert merged.time == 3 + 2 + 4


def test_concat_results_errors():
  a = _result([[1, 2]], [2])
  with pytest.raises(ValueError, match="at least one"):
    cw.concat_results([])
  with pytest.raises(ValueError, match="3 does not divide 2"):
    cw.concat_results(
      [_result(np.ones((3, 1)), [1, 1, 1]), _result(np.ones((2, 1)), [1, 1])]
    )
  other_n = a.replace(
    top_ids=a.top_ids[..., :0], top_logprobs=a.top_logprobs[..., :0]
  )
  with pytest.raises(
    ValueError, match="top_n=0 but results\\[0\\] has top_n=1"
  ):
    cw.concat_results([a, other_n])


def test_the_tpus_two_step_pick_equals_the_gather():
  """`pick`'s TPU form (a row of 128 lanes gathered, then a masked max)
  against its CPU twin (one gather): the same bits, -inf and -0.0
  included, at every lane and row of 128, for 1-D to 3-D ids; a width
  that 128 does not divide takes the gather on a TPU too."""
  rng = np.random.default_rng(0)
  for shape in ((3, 1024), (2, 5, 384), (2, 200)):
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 7] = -np.inf
    x[..., 9] = -0.0
    ids = rng.integers(0, shape[-1], shape[:-1]).astype(np.int32)
    ids.flat[0], ids.flat[-1] = 7, 9
    x, ids = jnp.asarray(x), jnp.asarray(ids)
    plain = jax.jit(pick)(x, ids)
    tpu = jax.jit(numerics.traced(pick, "fast", "tpu"))(x, ids)
    assert plain.shape == (*shape[:-1], 1)
    np.testing.assert_array_equal(np.signbit(tpu), np.signbit(plain))
    np.testing.assert_array_equal(tpu, plain)
    want = np.take_along_axis(np.asarray(x), np.asarray(ids)[..., None], -1)
    np.testing.assert_array_equal(plain, want)
