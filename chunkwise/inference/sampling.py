"""`Sampling` parameters, their validation, and the sampler.

  Sampling(temperature=0.7, top_p=0.95)          # one setting for all rows
  Sampling(temperature=jnp.array([0., 1.]))      # per-row: greedy, then T=1

Every field is traced, so new values never recompile. The sampler acts on
raw logits in this order: temperature, top-k, top-p, min-p (as in Hugging
Face's warpers); rows with temperature 0 take the argmax of the raw logits
(the lower id among ties). A token is then drawn as

  jax.random.categorical(token_key(seed, sample_id, position), filtered)

in vocabulary order, where `token_key` is the RNG contract (DESIGN.md §4.5):
a token's randomness depends only on the seed, its sample id and its
absolute position, never on batch packing, chunking, mesh or layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from chunkwise import numerics


@struct.dataclass(kw_only=True)
class Sampling:
  """How to turn next-token logits into a token.

  Attributes:
    temperature: >= 0; 0 means greedy. Scalar or one per row.
    top_k: keep the k most likely tokens (0 keeps all). Scalar or per row.
    top_p: keep the smallest set of most likely tokens whose probability
      reaches top_p, in (0, 1] (1 keeps all). Scalar or per row.
    min_p: keep tokens with probability >= min_p times the most likely
      one's, in [0, 1] (0 keeps all). Scalar or per row.
    seed: base of every token's key, an int in [0, 2**32).
  """

  temperature: float | jax.Array = 1.0
  top_k: int | jax.Array = 0
  top_p: float | jax.Array = 1.0
  min_p: float | jax.Array = 0.0
  seed: int | jax.Array = 0

  def for_batch(self, batch: int) -> Sampling:
    """Validates on the host and broadcasts every field to `batch` rows.

    Raises ValueError naming the bad field and value. The result has numpy
    leaves (f32/int32[batch], seed uint32[]) so one compiled program serves
    scalar and per-row settings alike.
    """

    def rows(name, value, dtype):
      arr = np.asarray(value)
      if arr.dtype == object or not (
        np.issubdtype(arr.dtype, np.number) or arr.dtype == bool
      ):
        raise ValueError(f"Sampling.{name} must be numeric, got {value!r}")
      if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != batch):
        raise ValueError(
          f"Sampling.{name} must be a scalar or have shape ({batch},) "
          f"(one per row), got shape {arr.shape}"
        )
      if np.any(np.isnan(arr.astype(np.float64))):
        raise ValueError(f"Sampling.{name} must not be NaN, got {value!r}")
      return arr

    temperature = rows("temperature", self.temperature, np.float32)
    if np.any(temperature < 0) or np.any(np.isinf(temperature)):
      raise ValueError(
        f"Sampling.temperature must be finite and >= 0 (0 is greedy), got "
        f"{self.temperature!r}"
      )
    top_k = rows("top_k", self.top_k, np.int32)
    if np.any(top_k < 0) or np.any(top_k != np.round(top_k)):
      raise ValueError(
        f"Sampling.top_k must be a non-negative integer (0 keeps all "
        f"tokens), got {self.top_k!r}"
      )
    top_p = rows("top_p", self.top_p, np.float32)
    if np.any(top_p <= 0) or np.any(top_p > 1):
      raise ValueError(f"Sampling.top_p must be in (0, 1], got {self.top_p!r}")
    min_p = rows("min_p", self.min_p, np.float32)
    if np.any(min_p < 0) or np.any(min_p > 1):
      raise ValueError(f"Sampling.min_p must be in [0, 1], got {self.min_p!r}")
    seed = np.asarray(self.seed)
    if (
      seed.ndim != 0
      or not np.issubdtype(seed.dtype, np.integer)
      or not 0 <= int(seed) < 2**32
    ):
      raise ValueError(
        f"Sampling.seed must be an int in [0, 2**32), got {self.seed!r}"
      )

    def full(arr, dtype):
      return np.broadcast_to(arr, (batch,)).astype(dtype)

    return Sampling(
      temperature=full(temperature, np.float32),
      top_k=full(np.clip(top_k, 0, 2**31 - 1), np.int32),
      top_p=full(top_p, np.float32),
      min_p=full(min_p, np.float32),
      seed=np.uint32(int(seed)),
    )


def token_keys(
  seed: jax.Array, sample_ids: jax.Array, positions: jax.Array
) -> jax.Array:
  """The RNG contract: key[i] = fold_in(fold_in(key(seed), sample_ids[i]),
  positions[i]). `seed` is one for all rows or one per row (continuous
  batching); typed keys, shape [batch]."""

  def one(seed, sample_id, position):
    base = jax.random.key(seed)
    return jax.random.fold_in(jax.random.fold_in(base, sample_id), position)

  seeds = jnp.broadcast_to(seed, jnp.shape(sample_ids))
  return jax.vmap(one)(seeds, sample_ids, positions)


def in_vocab_order(ranked: jax.Array, order: jax.Array) -> jax.Array:
  """`ranked[b, r]` (values of row b's r-th ranked token) back in vocabulary
  order, where `order[b, r]` is that token's id. On the CPU through the
  inverse permutation (a scatter, then a gather: linear); on a TPU by
  sorting `order` with `ranked` beside it. XLA:TPU laid the scatter's few
  rows out along the 128 lanes, 64 times their size at 2 rows (PaLM
  62B's int8 decode: a 125 MiB buffer for 2 x 256128 ids, and 6% of a
  step's estimate). Both give the same values: `order` is a permutation
  (tests/test_sampling.py)."""
  if numerics.runs_on("tpu"):
    return lax.sort((order, ranked), dimension=ranked.ndim - 1, num_keys=1)[1]
  position = jnp.arange(order.shape[-1])[None, :]
  rank = (
    jnp.zeros_like(order)
    .at[jnp.arange(order.shape[0])[:, None], order]
    .set(position)
  )
  return jnp.take_along_axis(ranked, rank, axis=-1)


def filter_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
  """Temperature, then top-k, top-p and min-p masks (-inf), in vocab order.

  Args:
    logits: f32[batch, vocab] raw logits.
    sampling: per-row arrays (see `Sampling.for_batch`).
  Returns:
    f32[batch, vocab]: logits / temperature with filtered tokens at -inf
    (rows with temperature 0 are scaled by 1; the caller takes their argmax).
  """
  temperature = sampling.temperature[:, None]
  scaled = logits / jnp.where(temperature > 0, temperature, 1.0)

  def apply_filters(scaled):
    # One stable descending sort serves all three filters; ties keep the
    # lower token id first, as everywhere else.
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    position = jnp.arange(scaled.shape[-1])[None, :]
    top_k = sampling.top_k[:, None]
    keep = (top_k == 0) | (position < top_k)
    kept = jnp.where(keep, ranked, -jnp.inf)
    if numerics.fixed_sums():  # sums in a fixed order per row
      e = numerics.exp(kept - ranked[:, :1])
      probs = e / numerics.last_sum(e)
      mass_before = numerics.cumsum(probs) - probs
    else:
      probs = jax.nn.softmax(kept, axis=-1)
      mass_before = jnp.cumsum(probs, axis=-1) - probs
    # Guards on "off" values keep unfiltered rows bit-identical whether or
    # not another row of the batch switches the filters on.
    top_p = sampling.top_p[:, None]
    keep &= (top_p >= 1) | (mass_before < top_p)
    # p_i >= min_p * p_max  <=>  logit_i - logit_max >= ln(min_p).
    min_p = sampling.min_p[:, None]
    keep &= (min_p == 0) | (ranked - ranked[:, :1] >= numerics.log(min_p))
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    return in_vocab_order(keep, order)

  active = (
    jnp.any(sampling.top_k > 0)
    | jnp.any(sampling.top_p < 1)
    | jnp.any(sampling.min_p > 0)
  )
  # The sort costs vocab*log(vocab) per row and step; skip it when unused.
  # The branches return the mask, not the logits: with `scaled` itself
  # returned by one branch, XLA:TPU laid the cond's operand out with the
  # rows along the lanes (PaLM 62B's int8 decode: 125 MiB for 2 x 256128).
  keep = lax.cond(
    active, apply_filters, lambda s: jnp.ones(s.shape, jnp.bool_), scaled
  )
  return jnp.where(keep, scaled, -jnp.inf)


def sample(logits: jax.Array, keys: jax.Array, sampling: Sampling) -> jax.Array:
  """Draws one token per row. logits f32[batch, vocab] -> int32[batch]."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def draw(logits):
    filtered = filter_logits(logits, sampling)
    drawn = numerics.categorical(keys, filtered)
    return jnp.where(sampling.temperature > 0, drawn.astype(jnp.int32), greedy)

  return lax.cond(
    jnp.any(sampling.temperature > 0), draw, lambda _: greedy, logits
  )
