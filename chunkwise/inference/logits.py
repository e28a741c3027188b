"""Logits split over devices: scores, top-n, carried logits and sampling.

A device holds logits [rows, ..., vocab/nv]: rows split over `batch_axes`,
vocabulary over `vocab_axes` (both empty: the plain, unsharded case, which
uses `results.score_tokens` and `sampling.sample` directly).

  shards = LogitsShards(vocab=V, batch_axes=("x",), vocab_axes=("y", "z"),
                        sizes={"x": 2, "y": 2, "z": 2})
  scores, top_ids, top_logprobs = shards.score(logits, tokens, top_n)

Scores use a log-softmax whose max and sum are reduced over the vocabulary
shards; top-n keeps each shard's n best and picks the n best of those, so
ties still go to the lower token id (shards hold ascending id ranges).
Sampling needs whole rows: an all-to-all over the vocabulary shards turns
[rows, V/nv] into [rows/nv, V] (an all-gather when rows do not divide), the
plain sampler draws each row with its own key, and tokens are gathered back
to every device. Hence sampled tokens equal the unsharded ones.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise import numerics
from chunkwise.inference.kv_cache import repeat_each
from chunkwise.inference.results import exp_sum, pick, score_tokens, top_k
from chunkwise.inference.sampling import Sampling, sample, token_keys
from chunkwise.models import shard_ops as ops
from chunkwise.processors import StepInfo


@dataclasses.dataclass(frozen=True)
class LogitsShards:
  """How this device's logits are cut; the default is not cut at all."""

  vocab: int
  batch_axes: tuple[str, ...] = ()
  vocab_axes: tuple[str, ...] = ()
  sizes: tuple[tuple[str, int], ...] = ()

  @property
  def n_rows(self) -> int:
    return ops.size(self.batch_axes, dict(self.sizes))

  @property
  def n_vocab(self) -> int:
    return ops.size(self.vocab_axes, dict(self.sizes))

  def rows(self, x: jax.Array, axis: int = 0) -> jax.Array:
    """This device's rows of a replicated per-row array."""
    return ops.local_rows(x, self.n_rows, ops.index(self.batch_axes), axis)

  def gather_rows(self, x: jax.Array) -> jax.Array:
    """Every row, from each device's rows (the inverse of `rows`)."""
    return ops.all_gather(x, self.batch_axes, axis=0)

  def _offset(self) -> jax.Array:
    return ops.index(self.vocab_axes) * (self.vocab // self.n_vocab)

  def carried(
    self, prev_logits: jax.Array | None, batch: int, bos_id: int, split: bool
  ) -> jax.Array:
    """This device's block of `results.carried_logits`: the previous
    chunk's logits (split over rows when `split`, else replicated rows) or
    the BOS distribution, for `batch` (global) rows."""
    local = batch // self.n_rows
    if prev_logits is None:
      ids = jnp.arange(self.vocab // self.n_vocab) + self._offset()
      bos = jnp.where(ids == bos_id, 0.0, -jnp.inf)[None]
      return jnp.broadcast_to(bos, (local, bos.shape[1]))
    if not split:
      prev_logits = self.rows(prev_logits)
    return repeat_each(prev_logits.astype(jnp.float32), local)

  def score(
    self, logits: jax.Array, tokens: jax.Array, top_n: int
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`results.score_tokens` over vocabulary shards.

    Args:
      logits: f32[rows, T, V/nv]; tokens: int32[rows, T] (this device's
        rows); top_n: static.
    Returns:
      scores [rows, T], top_ids [rows, T, n], top_logprobs [rows, T, n].
    """
    if not self.vocab_axes:
      return score_tokens(logits, tokens, top_n)
    axes = self.vocab_axes
    logits = logits.astype(jnp.float32)
    # log_softmax as jax.nn computes it: (x - max) - log(sum(exp(x - max))).
    top = ops.pmax(jnp.max(logits, axis=-1, keepdims=True), axes)
    top = lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    log_total = numerics.log(ops.psum(exp_sum(logits, top), axes))
    width = logits.shape[-1]
    ids = jnp.clip(tokens, 0, self.vocab - 1) - self._offset()
    inside = (ids >= 0) & (ids < width)
    mine = pick(logits, jnp.clip(ids, 0, width - 1))
    mine = ((mine - top) - log_total)[..., 0]
    scores = ops.psum(jnp.where(inside, mine, 0.0), axes)
    if not top_n:
      empty = (*tokens.shape, 0)
      return (
        scores,
        jnp.zeros(empty, jnp.int32),
        jnp.zeros(empty, jnp.float32),
      )
    # Each shard's best min(n, width); their union holds the global top n.
    values, idx = top_k(logits, min(top_n, width))
    values = ops.all_gather(values, axes, axis=-1)
    idx = ops.all_gather(idx + self._offset(), axes, axis=-1)
    best, chosen = top_k(values, top_n)
    best = (best - top) - log_total
    return scores, jnp.take_along_axis(idx, chosen, axis=-1), best

  def sample(
    self,
    logits: jax.Array,
    sampling: Sampling,
    sample_ids: jax.Array,
    positions: jax.Array,
    top_n: int,
    processors: tuple = (),
    states: tuple = (),
    info: StepInfo | None = None,
  ):
    """Draws a token for every row and scores it.

    Args:
      logits: f32[rows, V/nv], this device's next-token logits.
      sampling: per-row settings of all B rows (replicated).
      sample_ids, positions: int32[B], every row's (replicated).
      top_n: static.
      processors, states, info: logits processors, their per-row states
        and the step's `StepInfo` (all B rows, replicated). They act on
        whole rows, after the rows are regrouped, on this device's rows
        only; rows at position 0 (the BOS step) are left raw.
    Returns:
      (token, score, top_ids, top_logprobs) for all B rows, replicated.
    """
    rows = logits.shape[0]
    split = self.n_vocab if rows % self.n_vocab == 0 else 1
    if split > 1:
      whole = ops.all_to_all(logits, self.vocab_axes, split=0, concat=1)
      sub = ops.index(self.vocab_axes)
    else:
      whole = ops.all_gather(logits, self.vocab_axes, axis=1)
      sub = jnp.int32(0)
    count = rows // split
    first = ops.index(self.batch_axes) * rows + sub * count

    def mine(x):
      if x.ndim == 0:
        return x
      return lax.dynamic_slice_in_dim(x, first, count)

    mine_sampling = jax.tree.map(mine, sampling)  # seeds too, when per row
    keys = token_keys(mine_sampling.seed, mine(sample_ids), mine(positions))
    drawn_from = whole
    if processors:
      local = info.for_rows(mine)
      for processor, state in zip(processors, states, strict=True):
        drawn_from = processor.apply(
          jax.tree.map(mine, state), drawn_from, local
        )
      drawn_from = jnp.where((mine(positions) > 0)[:, None], drawn_from, whole)
    # Scores and top-n stay those of the raw logits (DESIGN.md §4.1).
    token = sample(drawn_from, keys, mine_sampling)
    score, top_ids, top_logprobs = score_tokens(whole, token, top_n)
    out = (token, score, top_ids, top_logprobs)
    if split > 1:
      out = tuple(ops.all_gather(x, self.vocab_axes, axis=0) for x in out)
    return tuple(self.gather_rows(x) for x in out)
