"""A long chunk prefilled in pieces: the same result, bounded memory.

A chunk's prefill holds its logits, f32[batch, time, vocab], before
scoring them: 1.6 GB for one 8192-token SmolLM2 prompt, 17 GB for a
32768-token Llama-3 one. `InferenceModel.prefill` therefore cuts a chunk
longer than its `prefill_chunk` columns into pieces of that many columns
(`Chunk.split_at` semantics) and runs them in turn:

  result = prefill(first piece, prefix)
  buffer = zeros K/V as wide as the whole chunk; the first piece's written
  for each later piece: result = prefill(piece, prefix + [buffer filled
    so far]); its K/V written into the buffer at its columns; the
    next-token logits carry from piece to piece

Every piece after the first is one compiled program (the buffer's width
is fixed; attention skips the key blocks past what is filled, see
`models.blocked_attention`), the piece's K/V is written in place (the
buffer is donated), and the result's cache is the buffer itself: nothing
is concatenated. Under invariant numerics the result is bit for bit the
one-chunk prefill (tests/test_long_prompts.py); under fast numerics it is
within the tolerance of a chunk split.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise.configs import HParams
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.kv_cache import KVCache
from chunkwise.inference.results import ChunkResult
from chunkwise.models import kv_int8

# Pieces hold at most this many bytes of f32 logits (batch x columns x
# vocab), and between these many columns.
LOGIT_BYTES = 1 << 28
MIN_COLUMNS = 1024
MAX_COLUMNS = 4096
# The slot loops' pieces: one runs between two decode segments, so its
# time bounds the other slots' inter-token latency.
SLOT_COLUMNS = 512


def columns(hparams: HParams, batch: int) -> int:
  """The default piece width for a batch of `batch` rows: a power of two
  whose logits fit `LOGIT_BYTES`, within [MIN_COLUMNS, MAX_COLUMNS]."""
  fit = LOGIT_BYTES // (4 * hparams.vocab * max(batch, 1))
  width = MIN_COLUMNS
  while width * 2 <= min(fit, MAX_COLUMNS):
    width *= 2
  return width


def check_columns(value) -> int | None:
  """`prefill_chunk` checked: None (the default width) or a positive int."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(
      f"prefill_chunk={value!r}: expected a positive number of columns "
      "(or None for the default)"
    )
  return value


def _write(buffer: KVCache, piece: KVCache, at: int) -> KVCache:
  return _write_at(buffer, piece, jnp.int32(at))


@functools.partial(jax.jit, donate_argnums=0)
def _write_at(buffer: KVCache, piece: KVCache, at: jax.Array) -> KVCache:
  """`piece`'s K/V written into `buffer` at column `at` (in place)."""
  k, v = (
    lax.dynamic_update_slice_in_dim(b, kv_int8.encode(p, b.dtype), at, axis=2)
    for b, p in ((buffer.k, piece.k), (buffer.v, piece.v))
  )
  return buffer.replace(k=k, v=v)


class Staged:
  """A long chunk prefilled one piece per `advance` call (the slot loop
  interleaves them with the other slots' decode steps).

    staged = Staged(run, caches, prev, chunk, width=1024)
    while (result := staged.advance()) is None:
      ...  # other work between pieces
  """

  def __init__(
    self,
    run,
    caches,
    prev,
    chunk: Chunk,
    *,
    width: int,
    columns: int | None = None,
    scores: bool = True,
  ):
    """`columns`: the buffer's width (at least the chunk's; default the
    chunk's): a loop's pieces then compile once for every chunk length.
    Without `scores` the result holds none (nothing is joined: a slot
    loop reads its K/V and next-token logits only)."""
    if columns is not None and columns < chunk.time:
      raise ValueError(
        f"a staged chunk of {chunk.time} columns needs a buffer of at least "
        f"as many, got columns={columns}"
      )
    self._run = run
    self._caches = tuple(caches)
    self._prev = prev
    self._chunk = chunk
    self._rest = chunk
    self._width = width
    self._columns = chunk.time if columns is None else columns
    self._scores = scores
    self._at = 0
    self._buffer = None
    self._parts = []

  @property
  def done(self) -> bool:
    return self._at >= self._chunk.time

  def advance(self) -> ChunkResult | None:
    """Prefills the next piece; the whole chunk's result after the last
    one (None before)."""
    if self.done:
      raise ValueError("every piece of this chunk is prefilled already")
    chunk, at = self._chunk, self._at
    piece, self._rest = self._rest.split_at(min(self._width, self._rest.time))
    caches = self._caches
    if self._buffer is not None:
      filled = jnp.minimum(jnp.asarray(chunk.lengths), at).astype(jnp.int32)
      caches = (*caches, self._buffer.replace(lengths=filled))
    result = self._run(caches, self._prev, piece)
    if self._buffer is None:
      # As wide as the chunk, placed like the first piece's K/V (so every
      # later piece reads it, and `_write` writes it, where it is).
      self._buffer = _zeros_like(result.kv_cache, self._columns)
    self._buffer = _write(self._buffer, result.kv_cache, at)
    # Committed where it is, as every later piece's is (the second piece's
    # would not be, and would compile the pieces' program a second time).
    self._prev = jax.device_put(
      result.next_token_logits, result.next_token_logits.sharding
    )
    # The piece's K/V are in the buffer now: keep only its scores.
    if self._scores or not self._parts:
      self._parts.append(result.replace(kv_cache=None))
    self._at = at + piece.time
    if not self.done:
      return None
    parts, self._parts = self._parts, []
    if not self._scores:  # none: the first piece's, cut to zero columns
      parts = [jax.tree.map(lambda a: a[:, :0], parts[0])]
    return ChunkResult(
      per_token_scores=_joined(parts, "per_token_scores"),
      top_ids=_joined(parts, "top_ids"),
      top_logprobs=_joined(parts, "top_logprobs"),
      next_token_logits=result.next_token_logits,
      kv_cache=self._buffer.replace(
        lengths=jnp.asarray(chunk.lengths, jnp.int32)
      ),
    )


def prefill(run, caches, prev, chunk: Chunk, *, width: int) -> ChunkResult:
  """`run(caches, prev, piece)` (one engine prefill) over `chunk` in
  pieces of `width` columns; the result as if `chunk` ran at once."""
  staged = Staged(run, caches, prev, chunk, width=width)
  while (result := staged.advance()) is None:
    pass
  return result


def _zeros_like(kv: KVCache, time: int) -> KVCache:
  """Zero K/V of `time` columns, `kv`'s dtype and placement."""
  shape = (*kv.k.shape[:2], time, *kv.k.shape[3:])
  k, v = (jnp.zeros(shape, kv.k.dtype, device=kv.k.sharding) for _ in "kv")
  return kv.replace(k=k, v=v)


def _joined(parts, name: str) -> jax.Array:
  return jnp.concatenate([getattr(p, name) for p in parts], axis=1)
