"""What a forward pass returns: `FullChunkResult` (internal) and `ChunkResult`.

`FullChunkResult` holds what every position's logits are computed from
(they would be large: [batch, time, vocab] f32) and stays inside the
compiled function. `to_chunk_result` turns it into the `ChunkResult` users
get, computing the logits a piece of positions at a time:

  per_token_scores[b, t] = ln p(tokens[b, t] | everything before it)
  top_ids[b, t], top_logprobs[b, t]: the n most likely tokens at position t
      (for the same distribution), lower id first among ties
  next_token_logits[b]   = raw logits after position lengths[b] - 1
  kv_cache               = the chunk's keys and values

Position t is scored with the logits produced at t - 1; position 0 with the
previous chunk's `next_token_logits`, or, for a first chunk, a distribution
with all mass on BOS (so BOS scores 0). Splitting text into chunks therefore
never changes a score.

  merged = concat_results([few_shot, task])   # one ChunkResult, compacted
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

from chunkwise import numerics
from chunkwise.configs import HParams
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.kv_cache import KVCache, repeat_each
from chunkwise.models import kv_int8
from chunkwise.partitioning import axes as ax


@struct.dataclass(kw_only=True)
class ChunkResult:
  """Scores, top-n alternatives, next-token logits and KV cache of a chunk."""

  per_token_scores: jax.Array  # f32[batch, time], natural log
  top_ids: jax.Array  # int32[batch, time, n]
  top_logprobs: jax.Array  # f32[batch, time, n]
  next_token_logits: jax.Array  # f32[batch, vocab]
  kv_cache: KVCache
  # The LoRA adapter each row ran (None: every row the base model); not
  # an array: a prefix serves only rows of its own adapter.
  adapters: tuple | None = struct.field(pytree_node=False, default=None)
  # A generate call's `speculation.SpeculationStats` (None without
  # speculation): counts of the call so far, on each of its segments.
  speculation: object = struct.field(pytree_node=False, default=None)

  @classmethod
  def axes(cls) -> ChunkResult:
    return cls(
      per_token_scores=P(ax.BATCH, ax.TIME),
      top_ids=P(ax.BATCH, ax.TIME, ax.TOP_N),
      top_logprobs=P(ax.BATCH, ax.TIME, ax.TOP_N),
      next_token_logits=P(ax.LOGITS_BATCH, ax.LOGITS_VOCAB),
      kv_cache=KVCache.axes(),
    )

  @property
  def batch(self) -> int:
    return self.per_token_scores.shape[0]

  @property
  def time(self) -> int:
    return self.per_token_scores.shape[1]

  @property
  def lengths(self) -> jax.Array:
    """int32[batch]: valid positions per row (those of the KV cache)."""
    return self.kv_cache.lengths

  @property
  def top_n(self) -> int:
    return self.top_ids.shape[2]

  @classmethod
  def shapes(
    cls, hparams: HParams, *, batch: int, time: int, top_n: int, cache_dtype
  ) -> ChunkResult:
    """The `jax.ShapeDtypeStruct`s of a result of `batch` rows and `time`
    positions: what prefill returns, and what a saved result restores."""
    dim = kv_int8.width(hparams.head_dim, cache_dtype)
    kv = (hparams.layers, batch, time, hparams.kv_heads, dim)
    f32, i32 = jnp.float32, jnp.int32
    return cls(
      per_token_scores=jax.ShapeDtypeStruct((batch, time), f32),
      top_ids=jax.ShapeDtypeStruct((batch, time, top_n), i32),
      top_logprobs=jax.ShapeDtypeStruct((batch, time, top_n), f32),
      next_token_logits=jax.ShapeDtypeStruct((batch, hparams.vocab), f32),
      kv_cache=KVCache(
        k=jax.ShapeDtypeStruct(kv, cache_dtype),
        v=jax.ShapeDtypeStruct(kv, cache_dtype),
        lengths=jax.ShapeDtypeStruct((batch,), i32),
      ),
    )

  @classmethod
  def empty(
    cls,
    hparams: HParams,
    prev_logits: jax.Array | None,
    *,
    batch: int,
    top_n: int,
    cache_dtype,
    bos_id: int,
  ) -> ChunkResult:
    """The result of a chunk of no positions after a prefix whose last
    next-token logits are `prev_logits` (None: none, the BOS distribution):
    nothing to score, and the logits carried over."""
    shapes = cls.shapes(
      hparams, batch=batch, time=0, top_n=top_n, cache_dtype=cache_dtype
    )
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return zeros.replace(
      next_token_logits=carried_logits(
        prev_logits, batch, vocab=hparams.vocab, bos_id=bos_id
      )
    )


@jax.tree_util.register_pytree_node_class
class FullChunkResult:
  """Every position's raw logits, or what they are computed from, and the
  chunk's KV cache (internal).

  A model's `InferFn` returns `hidden` (the last layer's output, time on
  axis 1) and its `head` (hidden positions -> f32 logits, each position on
  its own); a toy returns its `logits` whole. `logits` is every
  position's, computed when read; `to_chunk_result` computes them a piece
  of positions at a time, so a long prefill never holds them all.
  """

  def __init__(
    self,
    *,
    kv_cache: KVCache,
    logits: jax.Array | None = None,
    hidden: jax.Array | None = None,
    head=None,
  ):
    if (logits is None) == (hidden is None) or (hidden is None) != (
      head is None
    ):
      raise ValueError(
        "FullChunkResult takes either logits, or hidden with its head"
      )
    self.kv_cache, self._logits, self.hidden, self.head = (
      kv_cache,
      logits,
      hidden,
      head,
    )

  def tree_flatten(self):
    return (self.kv_cache, self._logits, self.hidden), self.head

  @classmethod
  def tree_unflatten(cls, head, children):
    full = object.__new__(cls)  # children may be placeholders, unchecked
    full.kv_cache, full._logits, full.hidden = children
    full.head = head
    return full

  @property
  def vocab(self) -> int:
    """The logits' last axis (this device's part of it under `shard_map`)."""
    if self._logits is not None:
      return self._logits.shape[2]
    return _vocab(self.head, self.hidden)

  @property
  def logits(self) -> jax.Array:
    """f32[batch, time, vocab]: logits for the *next* token."""
    return self.head(self.hidden) if self._logits is None else self._logits

  def to_chunk_result(
    self,
    prev_logits: jax.Array | None,
    chunk: Chunk,
    *,
    top_n: int = 0,
    bos_id: int = 0,
    shards=None,
    prev_split: bool = True,
    scores: bool = True,
  ) -> ChunkResult:
    """Scores the chunk's tokens; see the module docstring.

    Args:
      prev_logits: f32[b, vocab] with b | batch, the previous chunk's
        `next_token_logits`; None for a first chunk (BOS distribution).
      chunk: the tokens that were run.
      top_n: how many alternatives to return per position (static).
      bos_id: the model's BOS id.
      shards: under `shard_map`, a `logits.LogitsShards` saying how this
        device's logits are cut (the chunk is replicated, `prev_logits` cut
        like the logits when `prev_split`, else replicated rows); the
        returned scores and top-n are then gathered to every device.
      scores: False computes the next-token logits alone (the logits of
        one position a row): `per_token_scores` are then NaN and top-n
        is empty (top_n must be 0).
    """
    if not scores and top_n:
      raise ValueError(f"top_n={top_n} needs scores; got scores=False")
    if shards is None:
      prev_logits = carried_logits(
        prev_logits, chunk.batch, vocab=self.vocab, bos_id=bos_id
      )
      tokens, lengths, score = chunk.tokens, chunk.lengths, score_tokens
    else:
      prev_logits = shards.carried(prev_logits, chunk.batch, bos_id, prev_split)
      tokens, lengths = shards.rows(chunk.tokens), shards.rows(chunk.lengths)
      score = shards.score
    # Token t is scored by the logits before it: the first by the carried
    # logits, the rest by this chunk's own. Scored apart (concatenating the
    # logits, or slicing off their last row, copied every logit); the last
    # row scores a dummy token and is dropped.
    following = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    last = jnp.maximum(lengths - 1, 0)
    if scores:
      rest, next_logits = self._scored(following, last, top_n, score)
      scored, top_ids, top_logprobs = (
        jnp.concatenate([first, rest[:, :-1]], axis=1)
        for first, rest in zip(
          score(prev_logits[:, None], tokens[:, :1], top_n), rest, strict=True
        )
      )
    else:
      next_logits = self._at(last)
      scored = jnp.full(tokens.shape, jnp.nan, jnp.float32)
      top_ids = jnp.zeros((*tokens.shape, 0), jnp.int32)
      top_logprobs = jnp.zeros((*tokens.shape, 0), jnp.float32)
    next_logits = jnp.where((lengths > 0)[:, None], next_logits, prev_logits)
    if shards is not None:
      scored, top_ids, top_logprobs = (
        shards.gather_rows(x) for x in (scored, top_ids, top_logprobs)
      )
    return ChunkResult(
      per_token_scores=scored,
      top_ids=top_ids,
      top_logprobs=top_logprobs,
      next_token_logits=next_logits,
      kv_cache=self.kv_cache,
    )

  def _at(self, last: jax.Array) -> jax.Array:
    """f32[rows, vocab]: each row's logits at position `last[row]`."""
    if self._logits is not None:
      return jnp.take_along_axis(self._logits, last[:, None, None], axis=1)[
        :, 0
      ]
    at = last.reshape(-1, 1, *([1] * (self.hidden.ndim - 2)))
    return self.head(jnp.take_along_axis(self.hidden, at, axis=1))[:, 0]

  def _scored(self, following, last, top_n, score):
    """(score(logits, following, top_n), the logits at `last` [rows,
    vocab]), over pieces of `piece_length` positions in a loop when the
    logits are not given whole: only one piece's logits are ever held."""
    if self._logits is not None:
      logits = self._logits
    else:
      rows, time = self.hidden.shape[:2]
      piece = piece_length(rows, self.vocab)
      if time > piece:
        return _scored_in_pieces(
          self.head, self.hidden, following, last, piece, top_n, score
        )
      logits = self.head(self.hidden)
    at_last = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    return score(logits, following, top_n), at_last


# The f32 logits one piece of a prefill may hold (`piece_length`): a
# 512-token SmolLM2 prefill's whole logits were 96 MiB, most of its peak
# resident memory beyond the weights.
PIECE_BYTES = 16 << 20


def piece_length(rows: int, vocab: int) -> int:
  """Positions per piece of `to_chunk_result`'s scoring loop."""
  return max(1, PIECE_BYTES // (4 * rows * vocab))


def _scored_in_pieces(head, hidden, following, last, piece, top_n, score):
  """`FullChunkResult._scored` a piece of positions per loop iteration:
  the logits of each position are the same whatever piece computes them
  (the head and the scoring treat each position on its own). Under
  `shard_map` the head may give its logits other rows than the hidden
  states' (a layout that splits the logits' rows and not the
  residual's): `following` and `last` have the logits' rows."""
  time = hidden.shape[1]
  count = -(-time // piece)
  pad = count * piece - time

  def pieces(x):  # [rows, time, ...] -> [count, rows, piece, ...]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], count, piece, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)

  def step(at_last, xs):
    i, h, tokens = xs
    logits = head(h)
    at = last - i * piece
    here = jnp.take_along_axis(
      logits, jnp.clip(at, 0, piece - 1)[:, None, None], axis=1
    )[:, 0]
    inside = ((at >= 0) & (at < piece))[:, None]
    return jnp.where(inside, here, at_last), score(logits, tokens, top_n)

  rows, _, vocab = jax.eval_shape(head, hidden[:, :1]).shape
  at_last, scored = lax.scan(
    step,
    jnp.zeros((rows, vocab), jnp.float32),
    (jnp.arange(count), pieces(hidden), pieces(following)),
  )

  def whole(x):  # [count, rows, piece, ...] -> [rows, time, ...]
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], count * piece, *x.shape[3:])[:, :time]

  return tuple(whole(x) for x in scored), at_last


def _vocab(head, hidden: jax.Array) -> int:
  return jax.eval_shape(head, hidden[:, :1]).shape[2]


def carried_logits(
  prev_logits: jax.Array | None, batch: int, *, vocab: int, bos_id: int
) -> jax.Array:
  """f32[batch, vocab]: the logits that precede a chunk's first token.

  The previous chunk's next-token logits repeated to `batch` rows, or, with
  no previous chunk, a distribution with all mass on BOS (0 there, -inf
  elsewhere), so that a first chunk's BOS scores 0.
  """
  if prev_logits is None:
    prev_logits = jnp.where(jnp.arange(vocab) == bos_id, 0.0, -jnp.inf)[None]
  return repeat_each(prev_logits.astype(jnp.float32), batch)


def exp_sum(x: jax.Array, shift: jax.Array) -> jax.Array:
  """sum(exp(x - shift)) over the last axis, keeping it (size 1); shift
  [..., 1].

  On the CPU summed by a matrix-vector product with ones: XLA:CPU's fused
  exp-and-reduce took twice as long (112 ms of a 512-token prefill's 1.1 s,
  over its 49152-word vocabulary). XLA:CPU computes f32 dots in f32 at any
  `precision`, so the product follows the model's setting (tests check
  every dot carries it); elsewhere, where a "default" dot may round to
  bf16 or TF32, the sum is a plain reduction. Under invariant numerics:
  `numerics.exp_sum` (one pass, the sums in a fixed order per row).
  """
  if numerics.fixed_sums():
    return numerics.exp_sum(x, shift)
  e = jnp.exp(x - shift)

  def by_matvec(e):
    return jnp.einsum("...v,v->...", e, jnp.ones(e.shape[-1], e.dtype))

  total = lax.platform_dependent(
    e, cpu=by_matvec, default=lambda e: jnp.sum(e, axis=-1)
  )
  return total[..., None]


def score_tokens(
  logits: jax.Array, tokens: jax.Array, top_n: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Log-probs of `tokens` under `logits`, and the top-n alternatives.

  Args:
    logits: f32[..., vocab], raw logits of the distribution of each token.
    tokens: int32[...].
    top_n: static number of alternatives.
  Returns:
    scores f32[...], top_ids int32[..., n], top_logprobs f32[..., n]; ties
    are broken by the lower token id (`lax.top_k` guarantees it).
  """
  # log_softmax as jax.nn computes it, (x - max) - log(sum(exp(x - max))),
  # for the picked and the top-n entries only: the [..., vocab] log-probs
  # are never stored.
  logits = logits.astype(jnp.float32)
  top = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  log_total = numerics.log(exp_sum(logits, top))
  safe = jnp.clip(tokens, 0, logits.shape[-1] - 1)  # padding may be anything
  picked = pick(logits, safe)
  scores = ((picked - top) - log_total)[..., 0]
  if top_n:
    best, top_ids = top_k(logits, top_n)
    top_logprobs = (best - top) - log_total
  else:
    top_logprobs = jnp.zeros((*tokens.shape, 0), jnp.float32)
    top_ids = jnp.zeros((*tokens.shape, 0), jnp.int32)
  return scores, top_ids.astype(jnp.int32), top_logprobs


def pick(x: jax.Array, ids: jax.Array) -> jax.Array:
  """`x[..., ids]` keeping the last axis (x [..., V], ids [...] in range).

  On the CPU a gather. On a TPU, with V a multiple of 128, in two steps:
  the gather of each id's row of 128 lanes from x viewed [..., V / 128,
  128], then the id's lane by a max over those 128 (the others at -inf:
  the value, bit for bit). XLA:TPU laid a one-entry gather's operand out
  with its few rows along the lanes, 64 times its size at 2 rows (PaLM
  62B's int8 decode: 125 MiB for 2 x 256128 logits); a masked max over
  the whole vocabulary instead cost Llama-3.1-8B's batch-1 step 6% (a
  pass over every logit). Both forms give the same values
  (tests/test_results.py)."""
  v = x.shape[-1]
  if not numerics.runs_on("tpu") or v % 128:
    return jnp.take_along_axis(x, ids[..., None], axis=-1)
  rows = x.reshape(*x.shape[:-1], v // 128, 128)
  row = jnp.take_along_axis(rows, (ids // 128)[..., None, None], axis=-2)
  lane = lax.broadcasted_iota(jnp.int32, row.shape, row.ndim - 1)
  hit = lane == (ids % 128)[..., None, None]
  return jnp.max(jnp.where(hit, row, -jnp.inf), axis=-1)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k` over x's last axis, as rows of a 2-D array: of a [1, T,
  vocab] prefill's logits XLA:CPU sorted every row whole (2.2 s for 256
  SmolLM2 positions), of [T, vocab] it keeps the k best (14 ms)."""
  values, ids = lax.top_k(x.reshape(-1, x.shape[-1]), k)
  shape = (*x.shape[:-1], k)
  return values.reshape(shape), ids.reshape(shape)


def _check_concat(results: Sequence[ChunkResult]) -> None:
  if not results:
    raise ValueError("concat_results needs at least one ChunkResult")
  first = results[0]
  batches = [r.batch for r in results]
  for prev, nxt in itertools.pairwise(batches):
    if nxt % prev:
      raise ValueError(
        f"prefix batch sizes {batches} must divide each other in order "
        f"(b0 | b1 | ... ); {prev} does not divide {nxt}"
      )
  for i, r in enumerate(results[1:], 1):
    if r.top_n != first.top_n:
      raise ValueError(
        f"results[{i}] has top_n={r.top_n} but results[0] has "
        f"top_n={first.top_n}; concatenated results need one n"
      )
    if r.kv_cache.k.dtype != first.kv_cache.k.dtype:
      raise ValueError(
        f"results[{i}] holds {r.kv_cache.k.dtype.name} K/V but results[0] "
        f"{first.kv_cache.k.dtype.name}; concatenated results need one "
        "kv_dtype"
      )
    want = (first.kv_cache.k.shape[0], *first.kv_cache.k.shape[3:])
    got = (r.kv_cache.k.shape[0], *r.kv_cache.k.shape[3:])
    if (
      want != got
      or r.next_token_logits.shape[1:] != first.next_token_logits.shape[1:]
    ):
      raise ValueError(
        f"results[{i}] comes from another model: KV cache (layers, "
        f"kv_heads, head_dim) {got} and vocab "
        f"{r.next_token_logits.shape[1]} vs {want} and "
        f"{first.next_token_logits.shape[1]}"
      )


@jax.jit
def _concat(results: tuple[ChunkResult, ...]) -> ChunkResult:
  batch = results[-1].batch

  def rows(x, axis=0):
    return repeat_each(x, batch, axis)

  lengths = [rows(r.lengths) for r in results]
  total_time = sum(r.time for r in results)
  # For every output slot, the column of the concatenated inputs it comes
  # from: piece i's valid slots are packed after pieces 0..i-1's.
  slot = jnp.arange(total_time)[None, :]  # [1, total]
  source = jnp.zeros((batch, total_time), jnp.int32)
  start = jnp.zeros((batch, 1), jnp.int32)
  column = 0
  for r, n in zip(results, lengths, strict=True):
    inside = (slot >= start) & (slot < start + n[:, None])
    source = jnp.where(inside, column + slot - start, source)
    start = start + n[:, None]
    column += r.time

  def gather(parts, axis):
    """Packs `parts` (batch on axis - 1, time on `axis`) along time."""
    cat = jnp.concatenate(parts, axis=axis)
    others = (*range(axis - 1), *range(axis + 1, cat.ndim))
    idx = jnp.broadcast_to(
      jnp.expand_dims(source, others),
      (*cat.shape[:axis], total_time, *cat.shape[axis + 1 :]),
    )
    return jnp.take_along_axis(cat, idx, axis=axis)

  cache = KVCache(
    k=gather([rows(r.kv_cache.k, 1) for r in results], 2),
    v=gather([rows(r.kv_cache.v, 1) for r in results], 2),
    lengths=start[:, 0],
  )
  return ChunkResult(
    per_token_scores=gather([rows(r.per_token_scores) for r in results], 1),
    top_ids=gather([rows(r.top_ids) for r in results], 1),
    top_logprobs=gather([rows(r.top_logprobs) for r in results], 1),
    next_token_logits=results[-1].next_token_logits,
    kv_cache=cache,
  )


def concat_results(results: Sequence[ChunkResult]) -> ChunkResult:
  """Merges a prefix list into one ChunkResult, as if run as one chunk.

  Each row's valid positions are packed left (padding moves to the end),
  earlier, smaller batches are repeated to the last one's batch, and the
  next-token logits are the last result's. Prefilling with `[merged]` as the
  prefix equals prefilling with the original list.
  """
  results = tuple(results)
  _check_concat(results)
  batch = results[-1].batch
  tagged = [r for r in results if r.adapters is not None]
  rows = {_rows_adapters(r, batch) for r in tagged}
  if len(rows) > 1 or (tagged and len(tagged) != len(results)):
    raise ValueError(
      "concat_results: the results ran different adapters per row ("
      + "; ".join(str(r.adapters) for r in results)
      + "); only results of the same rows' adapters can be merged"
    )
  merged = _concat(
    tuple(r.replace(adapters=None, speculation=None) for r in results)
  )
  return merged.replace(adapters=rows.pop() if rows else None)


def _rows_adapters(result: ChunkResult, batch: int) -> tuple:
  """A result's per-row adapters repeated to `batch` rows."""
  k = batch // result.batch
  return tuple(a for a in result.adapters for _ in range(k))
