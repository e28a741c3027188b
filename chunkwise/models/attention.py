"""Attention over a list of prefix KV caches plus the current chunk.

Each piece of context (every prefix cache, then the chunk itself) is attended
to separately, producing unnormalised outputs with their softmax statistics
(running max m, sum s); the pieces are merged exactly:

  M = max_i m_i,   out = sum_i exp(m_i - M) o_i / sum_i exp(m_i - M) s_i

Within the chunk attention is causal; in a cache, slots >= lengths are
masked. A cache with batch b < B serves B/b consecutive query rows ("repeat
each"): queries are reshaped to [b, B/b, ...] so the cache is read in place.
Grouped-query attention: query head h reads K/V head h // (heads/kv_heads).

  out = attend(q, k, v, [(cache_k, cache_v, cache_lengths), ...], options)

`Options` carry a layer's query scale, attention-logit soft cap and sliding
window. A window needs every key's position: the pieces are one row's
consecutive context, so slot j of piece i sits at position (lengths of the
pieces before i) + j, and the chunk's row r at (all prefix lengths) + r:
keys more than `window - 1` positions behind a query are masked, in prefix
caches as in the chunk.

A long chunk (`blocked_attention.wanted`) reads its context in key blocks
instead (`blocked_attention`): the same result, bit for bit under
invariant numerics, with O(T · block) memory; this module's unblocked
path is its plain twin. Under invariant numerics on the CPU a chunk whose
keys and values are f32 or bf16 (and no soft cap) skips the key blocks:
`invariant_attention`'s fused kernel keeps a tile of queries' logits in
cache and never writes [T, S] out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from chunkwise import numerics
from chunkwise.configs import HParams
from chunkwise.models import (
  blocked_attention,
  invariant_attention,
  kv_int8,
  paged_attention,
  tpu_attention,
  tpu_decode,
)
from chunkwise.models.prefix_layer import PrefixLayer, merge

# A masked logit: finite so that an all-masked piece gives m = _MASKED
# (not NaN); its weight exp(_MASKED - M) then vanishes in the merge.
_MASKED = -1e30


class Options(NamedTuple):
  """One layer's attention options (static).

  scale: multiplies queries (None: head_dim^-1/2); softcap: logits become
  softcap * tanh(logits / softcap); window: keys at most window - 1
  positions behind the query are attended (None: all)."""

  scale: float | None = None
  softcap: float | None = None
  window: int | None = None

  @classmethod
  def of(cls, hparams: HParams, layer: int) -> Options:
    return cls(hparams.query_scale, hparams.attn_softcap, hparams.window(layer))


PLAIN = Options()


def _attend_piece(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  *,
  softcap: float | None = None,
  rows_see_a_key: bool = False,
  heads_major: bool = False,
) -> tuple[jax.Array, ...]:
  """Unnormalised attention of q to one piece of context.

  Args:
    q: f32[b, r, T, kv_heads, group, D], pre-scaled.
    k, v: [b, S, kv_heads, D], or [b, kv_heads, S, D] if `heads_major`.
    mask: bool, broadcastable to [b, r, T, kv_heads, group, S].
    rows_see_a_key: every query row has at least one unmasked key (causal
      attention within a chunk), so masked logits need no second select:
      exp(_MASKED - m) is already 0.
  Returns:
    (m, s, o): max logit [b, r, T, kv_heads, group], sum of exp(logit - m)
    (same shape) and the exp-weighted sum of values [..., D].
  """
  # Heads first, keys last: both einsums are then plain batched matmuls
  # ([rows, D] x [D, S] and [rows, S] x [S, D]) and the softmax runs over
  # the minor axis. Written over k's own [b, S, kv_heads, D] order, XLA:CPU
  # made the logits [kv_heads, S, rows] and transposed them twice a layer
  # (a quarter of a 512-token prefill).
  qh = jnp.moveaxis(q, 3, 1)  # [b, kv_heads, r, T, group, D]
  if heads_major:  # read in place
    vh = v.astype(jnp.float32)
    logits = jnp.einsum("bkrtgd,bksd->bkrtgs", qh, k.astype(jnp.float32))
  else:
    kh = jnp.transpose(k.astype(jnp.float32), (0, 2, 3, 1))  # [b, kv, D, S]
    vh = jnp.transpose(v.astype(jnp.float32), (0, 2, 1, 3))  # [b, kv, S, D]
    logits = jnp.einsum("bkrtgd,bkds->bkrtgs", qh, kh)
  mask = jnp.moveaxis(mask, 3, 1)
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  logits = jnp.where(mask, logits, _MASKED)
  m = jnp.max(logits, axis=-1)
  e = jnp.exp(logits - m[..., None])
  if not rows_see_a_key:  # an all-masked row has m = _MASKED: exp(0) = 1
    e = jnp.where(mask, e, 0.0)
  s = jnp.sum(e, axis=-1)
  o = jnp.einsum("bkrtgs,bksd->bkrtgd", e, vh)
  return jnp.moveaxis(m, 1, 3), jnp.moveaxis(s, 1, 3), jnp.moveaxis(o, 1, 3)


# Query blocks of the chunk's causal attention (block i reads only the keys
# up to its own last row, skipping the masked upper triangle's blocks): at
# least this many rows each, and at most this many blocks.
_BLOCK_ROWS = 128
_MAX_BLOCKS = 8


def _query_blocks(time: int, window: int | None):
  """The chunk's query blocks: (start, end, first, seen) per block, rows
  [start, end) reading keys [first, end) (those before the block's end and,
  with a window, none before its first row's), seen the causal (and
  window) mask bool[end - start, end - first]."""
  blocks = max(1, min(_MAX_BLOCKS, time // _BLOCK_ROWS))
  rows = -(-time // blocks)
  for start in range(0, time, rows):
    end = min(start + rows, time)
    first = 0 if window is None else max(0, start - window + 1)
    behind = (start + jnp.arange(end - start))[:, None] - jnp.arange(first, end)
    seen = behind >= 0  # every row sees itself, window or not
    if window is not None:
      seen &= behind < window
    yield start, end, first, seen


def _attend_causal(
  q: jax.Array, k: jax.Array, v: jax.Array, options: Options
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`_attend_piece` of the chunk to itself, causally (and within the
  window, if any).

  Long chunks are cut into query blocks, each reading the keys before its
  end (and, with a window, none before its first row's window): with n
  blocks, (n + 1) / 2n of the full [T, T] logits are computed (a 512-token
  chunk: 4 blocks, 5/8).

  Args:
    q: f32[B, T, kv_heads, group, D], pre-scaled.
    k, v: [B, T, kv_heads, D].
  Returns:
    (m, s, o) as `_attend_piece`, without its `r` axis.
  """
  parts = []
  for start, end, first, seen in _query_blocks(q.shape[1], options.window):
    parts.append(
      _attend_piece(
        q[:, None, start:end],
        k[:, first:end],
        v[:, first:end],
        seen[None, None, :, None, None, :],
        softcap=options.softcap,
        rows_see_a_key=True,
      )
    )
  return tuple(
    jnp.concatenate([p[i][:, 0] for p in parts], axis=1) for i in range(3)
  )


def _repeat_rows(x: jax.Array, batch: int) -> jax.Array:
  """Per-row values of a piece of b rows for the `batch` query rows it
  serves (row r reads piece row r // (batch / b))."""
  return jnp.repeat(x, batch // x.shape[0], axis=0)


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  prefix: Sequence[PrefixLayer] = (),
  options: Options = PLAIN,
) -> jax.Array:
  """Causal attention of a chunk to its prefixes and itself.

  In a forward pass that stores int8 K/V (`kv_int8.storing`) it runs in
  the Hadamard-rotated space the int8 K/V is stored in: queries rotated
  in, the chunk's own keys and values rotated and rounded as they will be
  stored, the output rotated back (the same attention in exact
  arithmetic).

  Args:
    q: [B, T, heads, D] queries (RoPE applied, not scaled).
    k, v: [B, T, kv_heads, D] the chunk's keys and values.
    prefix: one `PrefixLayer` (or (k, v, lengths)) per prefix cache,
      batches dividing B.
    options: the layer's `Options`.
  Returns:
    f32[B, T, heads, D].
  """
  if not kv_int8.rotating():
    return _attend(q, k, v, prefix, options, rotated=False)
  q, k, v = kv_int8.rotate(q), kv_int8.as_stored(k), kv_int8.as_stored(v)
  return kv_int8.rotate(_attend(q, k, v, prefix, options, rotated=True))


def _attend(q, k, v, prefix, options: Options, *, rotated: bool):
  """`attend` in attention's space (rotated: int8 K/V's)."""
  batch, time, heads, dim = q.shape
  # A TPU program's invariant pieces: `tpu_attention`.
  tpu_invariant = numerics.tpu_invariant()
  # A paged pool is read in place where it can be (`paged_attention.piece`),
  # else through its gathered view (the plain twin), like any heads-major
  # buffer. int8 K/V (`kv_int8`) is decoded into attention's space.
  kernels = [
    p
    for p in prefix
    if isinstance(p, paged_attention.PagedLayer)
    and paged_attention.read_in_place(time, options.window)
    and not numerics.invariant()
    and not tpu_invariant
    and (p.k_pages.dtype == kv_int8.INT8) == rotated
  ]
  prefix = [
    (
      p.view() if isinstance(p, paged_attention.PagedLayer) else PrefixLayer(*p)
    ).decoded(rotated)
    for p in prefix
    if not any(p is k for k in kernels)
  ]
  kv_heads = k.shape[2]
  group = heads // kv_heads
  scale = dim**-0.5 if options.scale is None else options.scale
  if (
    not rotated
    and not kernels
    and not tpu_invariant
    and not numerics.invariant()
    and numerics.runs_on("tpu")
  ):  # a fast TPU program's decode step: one kernel call (`tpu_decode`)
    out = tpu_decode.attend(q, k, v, prefix, options, scale=scale)
    if out is not None:
      return out
  q = q.astype(jnp.float32) * scale
  q = q.reshape(batch, time, kv_heads, group, dim)
  window = options.window
  if window is not None or tpu_invariant:
    # Each piece's first slot's position, per query row.
    starts, start = [], jnp.zeros((batch,), jnp.int32)
    for piece in prefix:
      starts.append(start)
      start = start + _repeat_rows(piece.lengths, batch)
    q_positions = start[:, None] + jnp.arange(time)  # [B, T]

  # Under invariant numerics the fused kernel holds a query tile's logits
  # alone, so a long chunk needs no key blocks.
  fused = numerics.invariant() and invariant_attention.fuses(
    [a.dtype for p in prefix for a in (p.k, p.v)] + [k.dtype, v.dtype],
    time * group,
    options.softcap,
  )
  if (
    not kernels
    and not fused
    and not tpu_invariant
    and blocked_attention.wanted(time, time + sum(p.width for p in prefix))
  ):
    live = [(p.sliced().gathered(), i) for i, p in enumerate(prefix) if p.width]
    return blocked_attention.attend(
      q,
      k,
      v,
      [p for p, _ in live],
      None if window is None else [starts[i] for _, i in live],
      None if window is None else q_positions,
      options,
      _attend_piece,
    )
  pieces = []
  for i, piece in enumerate(prefix):
    lengths, width = piece.lengths, piece.width
    if width == 0:  # a zero-width prefix holds nothing to attend to
      continue
    b = piece.batch
    # [b, S] -> [b, 1, 1, 1, 1, S]
    mask = jnp.arange(width)[None, :] < lengths[:, None]
    mask = mask[:, None, None, None, None, :]
    if window is not None:
      k_positions = starts[i][:, None] + jnp.arange(width)  # [B, S]
      near = q_positions[:, :, None] - k_positions[:, None, :] < window
      mask = mask & near.reshape(b, batch // b, time, 1, 1, width)
    if numerics.invariant():
      pieces.append((piece, mask))
      continue
    if tpu_invariant:
      pieces.append((piece, starts[i]))
      continue
    piece = piece.sliced().gathered()
    m, s, o = _attend_piece(
      q.reshape(b, batch // b, *q.shape[1:]),
      piece.k,
      piece.v,
      mask,
      softcap=options.softcap,
      heads_major=piece.heads_major,
    )
    pieces.append(
      (
        m.reshape(batch, time, kv_heads, group),
        s.reshape(batch, time, kv_heads, group),
        o.reshape(batch, time, kv_heads, group, dim),
      )
    )
  if numerics.invariant():
    blocks = list(_query_blocks(time, options.window))
    return invariant_attention.attend(q, k, v, pieces, blocks, options.softcap)
  if tpu_invariant:
    return tpu_attention.attend(q, k, v, pieces, q_positions, options)
  for piece in kernels:  # one query per row: q's rows are the pool's
    pieces.append(paged_attention.piece(q, piece, softcap=options.softcap))
  pieces.append(_attend_causal(q, k, v, options))
  return merge(pieces).reshape(batch, time, heads, dim)
