"""The sampler: temperature, top-k, top-p, min-p in that order; greedy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise import numerics
from chunkwise.inference.sampling import (
  filter_logits,
  in_vocab_order,
  sample,
  token_keys,
)

PROBS = np.array([0.05, 0.5, 0.15, 0.3], np.float32)  # ranks: 1, 3, 2, 0


def _kept(probs=PROBS, **kwargs):
  sampling = cw.Sampling(**kwargs).for_batch(1)
  out = filter_logits(jnp.log(jnp.asarray(probs))[None], sampling)[0]
  return sorted(np.flatnonzero(np.isfinite(np.asarray(out))).tolist())


@pytest.mark.parametrize(
  "kwargs, kept",
  [
    (dict(), [0, 1, 2, 3]),
    (dict(top_k=1), [1]),
    (dict(top_k=3), [1, 2, 3]),
    (dict(top_k=99), [0, 1, 2, 3]),
    (dict(top_p=0.75), [1, 3]),  # 0.5 + 0.3 reaches 0.75
    (dict(top_p=0.85), [1, 2, 3]),
    (dict(top_p=0.1), [1]),  # the most likely token always survives
    (dict(min_p=0.35), [1, 3]),  # p >= 0.35 * 0.5
    (dict(min_p=0.25), [1, 2, 3]),
    # top-p acts on the top-k survivors, renormalised: 0.625, 0.375.
    (dict(top_k=2, top_p=0.6), [1]),
    # min-p acts after top-p: top-p 0.6 keeps {0.5, 0.3}, then 0.3 passes
    # min-p 0.35 (>= 0.175). The other order would keep only 0.5.
    (dict(top_p=0.6, min_p=0.35), [1, 3]),
    # temperature first: at T=2 the probabilities flatten, so top-p keeps
    # more; at T=0.5 they sharpen.
    (dict(temperature=2.0, top_p=0.75), [1, 2, 3]),
    (dict(temperature=0.5, top_p=0.75), [1, 3]),
  ],
)
def test_filters(kwargs, kept):
  assert _kept(**kwargs) == kept


def test_unfiltered_rows_ignore_their_neighbours_filters():
  """A peaked row whose cumulative mass reaches 1.0 in f32 keeps its whole
  vocabulary even when another row in the batch uses top-k."""
  logits = jnp.zeros((2, 320)).at[:, 7].set(25.0)
  alone = filter_logits(logits[1:], cw.Sampling().for_batch(1))
  mixed = filter_logits(
    logits, cw.Sampling(top_k=np.array([3, 0])).for_batch(2)
  )
  np.testing.assert_array_equal(mixed[1], alone[0])
  assert np.isfinite(np.asarray(mixed[1])).all()
  assert np.isfinite(np.asarray(mixed[0])).sum() == 3


def test_the_tpus_sort_puts_ranked_values_back_as_the_scatter_does():
  """`in_vocab_order`'s TPU form (a sort of the permutation, the values
  beside it) against its CPU twin (the inverse permutation's scatter):
  the same values, for a mask and for floats."""
  rng = np.random.default_rng(0)
  order = jnp.asarray(np.stack([rng.permutation(1000) for _ in range(3)]))
  for ranked in (
    jnp.asarray(rng.random((3, 1000)) < 0.3),
    jnp.asarray(rng.standard_normal((3, 1000)), jnp.float32),
  ):
    plain = jax.jit(in_vocab_order)(ranked, order)
    tpu = jax.jit(numerics.traced(in_vocab_order, "fast", "tpu"))(ranked, order)
    np.testing.assert_array_equal(tpu, plain)
    # and it is the vocabulary order: value of token t at t
    want = np.zeros_like(np.asarray(ranked))
    np.put_along_axis(want, np.asarray(order), np.asarray(ranked), axis=-1)
    np.testing.assert_array_equal(plain, want)


def test_top_k_ties_keep_the_lower_id():
  probs = np.array([0.1, 0.3, 0.3, 0.3], np.float32)
  assert _kept(probs, top_k=1) == [1]
  assert _kept(probs, top_k=2) == [1, 2]


def test_temperature_scales_logits():
  logits = jnp.array([[1.0, 2.0, -3.0]])
  out = filter_logits(logits, cw.Sampling(temperature=0.5).for_batch(1))
  np.testing.assert_allclose(out, logits / 0.5)


def test_greedy_rows_take_the_argmax_lowest_id_first():
  logits = jnp.array([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 5.0, 0.0]])
  sampling = cw.Sampling(temperature=np.array([0.0, 0.0])).for_batch(2)
  keys = token_keys(np.uint32(0), jnp.arange(2), jnp.zeros(2, jnp.int32))
  np.testing.assert_array_equal(sample(logits, keys, sampling), [1, 0])
  # Mixed rows: greedy stays greedy next to a sampled row.
  sampling = cw.Sampling(temperature=np.array([0.0, 1.0]), top_k=1).for_batch(2)
  np.testing.assert_array_equal(sample(logits, keys, sampling), [1, 0])


def test_draws_follow_the_filtered_tempered_distribution():
  """Empirical frequencies over 4000 sample ids match p^(1/T), restricted
  to the survivors of the filters and renormalised."""
  n = 4000
  logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS)), (n, 4))
  keys = token_keys(np.uint32(3), jnp.arange(n), jnp.full(n, 5, jnp.int32))
  for kwargs, keep in (
    (dict(temperature=2.0), [0, 1, 2, 3]),
    (dict(temperature=1.0, top_k=3), [1, 2, 3]),
    # tempered: 0.09 / 0.25 >= 0.2 > 0.0225 / 0.25
    (dict(temperature=0.5, min_p=0.2), [1, 3]),
  ):
    sampling = cw.Sampling(**kwargs).for_batch(n)
    drawn = np.asarray(sample(logits, keys, sampling))
    want = np.zeros(4)
    want[keep] = PROBS[keep] ** (1 / kwargs["temperature"])
    want /= want.sum()
    freq = np.bincount(drawn, minlength=4) / n
    np.testing.assert_allclose(freq, want, atol=0.03)


def test_token_keys_follow_the_contract():
  keys = token_keys(np.uint32(9), jnp.array([4, 7]), jnp.array([10, 2]))
  for key, sample_id, position in zip(keys, (4, 7), (10, 2), strict=True):
    want = jax.random.fold_in(
      jax.random.fold_in(jax.random.key(9), sample_id), position
    )
    np.testing.assert_array_equal(
      jax.random.key_data(key), jax.random.key_data(want)
    )


def test_new_values_do_not_recompile():
  model = cw.InferenceModel.random(cw.configs.get("tiny"))
  prompt = model.prefill(cw.Chunk.from_lists([[1, 50, 60]]))
  for sampling in (
    cw.Sampling(temperature=0.5),
    cw.Sampling(top_k=3),
    cw.Sampling(temperature=np.array([0.3]), top_p=0.5, min_p=0.1, seed=12),
  ):
    model.generate([prompt], sample_ids=[0], steps=3, sampling=sampling)
  assert model._generate_engine._run._cache_size() == 1
