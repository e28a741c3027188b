"""`models.schedule.after`: no value changes, and XLA:CPU no longer casts
every layer's weights (or copies every layer's cache slice) at a program's
start (compile-time buffer sizes, not timings)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkwise.models import schedule
from chunkwise.models.matmul import AFTER_ROWS, plain


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_after_changes_no_value(dtype):
  a = jnp.array([1.5, -0.0, np.inf, -np.inf, np.nan, 3e-39], jnp.float32)
  ints = jnp.array([0, -1, 7], jnp.int8)
  for first in (0.0, -0.0, np.nan, -np.nan, np.inf, 1e-45, -2.5):
    x = jnp.full((2, 3), first, dtype)
    got_a, got_i = jax.jit(schedule.after)(x, (a, ints))
    np.testing.assert_array_equal(
      np.asarray(got_a).view(np.uint32), np.asarray(a).view(np.uint32)
    )
    np.testing.assert_array_equal(got_i, ints)


def test_casts_wait_for_their_layer():
  """Sixteen layers of bf16 weights under f32 activations: with the plain
  matmul's casts after their layer's input, the program's temporaries
  hold about one cast weight, not sixteen."""
  layers, d = 16, 256
  weights = [jax.ShapeDtypeStruct((d, 4 * d), jnp.bfloat16)] * layers
  x = jax.ShapeDtypeStruct((AFTER_ROWS, d), jnp.float32)
  one = d * 4 * d * 4  # bytes of one weight cast to f32

  def forward(matmul):
    def f(x, weights):
      for w in weights:
        x = jnp.tanh(matmul(x, w))[:, :d]
      return x

    return f

  def eager(x, w):
    return x @ w.astype(x.dtype)

  def temp(fn):
    compiled = jax.jit(forward(fn)).lower(x, weights).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  if jax.default_backend() != "cpu":
    pytest.skip("the hoisting is XLA:CPU's")
  assert temp(eager) >= layers * one  # what the schedule guards against
  assert temp(lambda x, w: plain("bd,de->be", x, w)) < 3 * one


def test_blocked_attention_copies_one_layer_of_a_long_cache_at_a_time(
  monkeypatch,
):
  """A piece prefilled after a wide stacked `KVCache` (the long-prompt
  buffer): each layer's slice, which the key-block loop takes whole, is
  copied when its layer runs, not every layer's at the start."""
  import dataclasses

  import chunkwise as cw
  from chunkwise.models import blocked_attention as blocked

  if jax.default_backend() != "cpu":
    pytest.skip("the hoisting is XLA:CPU's")
  monkeypatch.setattr(blocked, "MIN_TIME", 1)
  monkeypatch.setattr(blocked, "MIN_LOGITS", 0)
  monkeypatch.setattr(blocked, "BLOCK", 64)
  h = dataclasses.replace(cw.configs.get("tiny"), layers=12, max_len=8192)
  model = cw.InferenceModel.random(h, seed=0, numerics="fast")
  engine = model._prefill_engine
  width = 4096
  shape = (h.layers, 1, width, h.kv_heads, h.head_dim)
  buffer = cw.KVCache(
    k=jax.ShapeDtypeStruct(shape, jnp.float32),
    v=jax.ShapeDtypeStruct(shape, jnp.float32),
    lengths=jax.ShapeDtypeStruct((1,), jnp.int32),
  )
  chunk = cw.Chunk(
    tokens=jnp.zeros((1, 64), jnp.int32), lengths=jnp.full((1,), 64)
  )
  compiled = engine._prefill.lower(
    engine.weights, (buffer,), None, chunk, top_n=0, bos_id=1
  ).compile()
  layer = 2 * width * h.kv_heads * h.head_dim * 4  # k and v, one layer
  assert compiled.memory_analysis().temp_size_in_bytes < 3 * layer


def test_decode_sized_casts_stay_hoisted_out_of_loops():
  """Fewer than `AFTER_ROWS` rows (decode): the cast is not tied to x, so
  XLA keeps it out of a loop's body (made once per call) instead of a
  select over the cast weight at every step; a prefill's is tied."""
  w = jnp.ones((8, 8), jnp.bfloat16)

  def primitives(rows):
    x = jnp.ones((rows, 8), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x, w: plain("bd,de->be", x, w))(x, w)
    return {e.primitive.name for e in jaxpr.jaxpr.eqns}

  if jax.default_backend() != "cpu":
    pytest.skip("the tie is XLA:CPU's")
  assert "bitcast_convert_type" not in primitives(16)
  assert "bitcast_convert_type" not in primitives(AFTER_ROWS - 1)
  assert "bitcast_convert_type" in primitives(AFTER_ROWS)
