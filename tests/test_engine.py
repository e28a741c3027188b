"""The engine contract: both engines follow `Engine`, results have the shapes
`ChunkResult.shapes` says, and chained calls never wait on the device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.inference.engines import engine as engine_lib
from chunkwise.partitioning import make_mesh

GREEDY = cw.Sampling(temperature=0.0)


@pytest.fixture(scope="module")
def sharded(tiny):
  return cw.InferenceModel(
    tiny.hparams,
    tiny.weights,
    tiny.vocab,
    mesh=make_mesh((2, 2, 2)),
    layout="ws_2d/yz",
  )


@jax.jit
def _late(tree, x):
  """`tree` unchanged, but ready only after seconds of matmuls on `x`."""
  x = jax.lax.fori_loop(0, 40, lambda i, x: jnp.tanh(x @ x), x)
  never = jnp.sum(x) == 1234.5  # False, unknown until the loop is done
  return jax.tree.map(lambda a: jnp.where(never, 0, a).astype(a.dtype), tree)


def _chain(model, first):
  """generate -> prefill after `first`, each call on the previous one's
  device results; returns (generated tokens, last result)."""
  more = cw.Chunk.tokenize(model.vocab, [" four legs.", " there"])
  tokens, r2 = model.generate(
    [first], sample_ids=np.arange(2), steps=4, sampling=GREEDY
  )
  return tokens, model.prefill(more, prefix=[first, r2], top_n=2)


@pytest.mark.parametrize("which", ["reference", "ws_2d/yz"])
def test_chained_calls_do_not_wait_for_the_previous_one(tiny, sharded, which):
  """Validation reads host inputs and static shapes only: generate and
  prefill on a result that is still being computed return at once (had a
  check read its lengths, the call would have waited for it)."""
  model = tiny if which == "reference" else sharded
  # Made on one device (the sharded model places it on its mesh), so the
  # slow matmuls run once, not on every device.
  first = tiny.prefill(
    cw.Chunk.tokenize(tiny.vocab, ["Cows have", "Hi"], is_first_chunk=True)
  )
  x = jnp.full((1536, 1536), 1e-3, jnp.float32)
  want_tokens, want = _chain(model, _late(first, x))  # compiles everything
  jax.block_until_ready(want)
  late = _late(first, x)
  tokens, out = _chain(model, late)
  assert not late.kv_cache.lengths.is_ready(), "the chain waited for it"
  np.testing.assert_array_equal(tokens.tokens, want_tokens.tokens)
  np.testing.assert_array_equal(out.per_token_scores, want.per_token_scores)


def test_engines_follow_the_protocol(tiny, sharded):
  for model in (tiny, sharded):
    for engine in (model._prefill_engine, model._generate_engine):
      assert isinstance(engine, engine_lib.Engine), type(engine)
  assert isinstance(tiny._prefill_engine, engine_lib.ReferenceEngine)
  assert not isinstance(sharded._prefill_engine, engine_lib.ReferenceEngine)


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
def test_result_shapes_are_what_prefill_returns(tiny, cache_dtype):
  """`ChunkResult.shapes` (what a saved result is restored into) and
  `ChunkResult.empty` match a real prefill's result leaf for leaf."""
  model = cw.InferenceModel(
    tiny.hparams, tiny.weights, tiny.vocab, cache_dtype=cache_dtype
  )
  chunk = cw.Chunk.tokenize(model.vocab, ["ab", "cde"], is_first_chunk=True)
  result = model.prefill(chunk, top_n=3)
  want = jax.tree.map(lambda a: (a.shape, a.dtype), result)
  shapes = cw.ChunkResult.shapes(
    model.hparams,
    batch=chunk.batch,
    time=chunk.time,
    top_n=3,
    cache_dtype=cache_dtype,
  )
  assert jax.tree.map(lambda s: (s.shape, s.dtype), shapes) == want
  empty = model.prefill(chunk.split_at(0)[0], prefix=[result], top_n=3)
  assert empty.time == 0 and empty.top_n == 3
  assert empty.kv_cache.k.dtype == cache_dtype
  np.testing.assert_array_equal(
    empty.next_token_logits, result.next_token_logits
  )


def test_length_check_reads_lengths_only_when_widths_could_overflow(tiny):
  """A prefix padded wider than its rows: the widths alone would exceed
  max_len, so the call waits for the lengths (a control for the test
  above) and goes ahead; a row that really overflows is still named."""
  h = tiny.hparams
  wide = cw.Chunk.from_lists([[1, 5, 6], [1]], pad_length=h.max_len - 4)
  ok = cw.Chunk.from_lists([[7] * 8, [7] * 8])
  x = jnp.full((1536, 1536), 1e-3, jnp.float32)
  prefix = _late(tiny.prefill(wide), x)
  assert tiny.prefill(ok, prefix=[prefix]).time == 8
  prefix = _late(tiny.prefill(wide), x)
  tiny.prefill(ok, prefix=[prefix])
  assert prefix.kv_cache.lengths.is_ready(), "the check read no lengths"
  long = cw.Chunk.from_lists([[7] * (h.max_len - 2), [7]])
  with pytest.raises(ValueError, match=r"row 0 would reach 513 tokens"):
    tiny.prefill(long, prefix=[prefix])
