"""Attention in a TPU program under invariant numerics
(`numerics.tpu_invariant`): each piece of context (a prefix cache, the
generate loop's buffer, the chunk's own keys) through the Pallas kernel
`tpu_kernels.attention.parts`, whose tiles have one shape whatever the
batch (8 query rows, 128 keys from the piece's first), then merged as
the fast path merges pieces (`models.attention`).

  m, s, o = piece(q, prefix_layer, lo, softcap)   # a prefix's keys
  m, s, o = causal(q, k, v, options)              # the chunk's own

A row's bits then do not depend on the rows beside it, how many there
are, or how wide the batch's pieces are padded (keys past a row's own
are masked to exact zeros, in blocks that leave its sums as they were),
nor on how long a cache is. They do depend on how its context was cut
into pieces: a chunk split elsewhere merges other pieces (on the CPU
the invariant kernels chain every key in position order across pieces,
which a TPU's MXU tiles do not: docs/numerics.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from chunkwise import numerics
from chunkwise.models.prefix_layer import PrefixLayer
from chunkwise.tpu_kernels import attention as kernel


def _rows(q: jax.Array, b: int) -> jax.Array:
  """q f32[B, T, kv, g, D] as each kv head's rows for a piece of b rows:
  [b, kv, (B / b) * T * g, D], rows in (batch row, position, head)
  order."""
  batch, time, kv_heads, group, dim = q.shape
  q = q.reshape(b, batch // b, time, kv_heads, group, dim)
  return q.transpose(0, 3, 1, 2, 4, 5).reshape(b, kv_heads, -1, dim)


def _back(parts, batch: int, time: int, group: int):
  """`kernel.parts`' (m, s, o) of rows `_rows` made, as the fast path's
  pieces: [B, T, kv, g] (o: [..., D])."""
  m, s, o = parts
  b, kv_heads = m.shape[:2]

  def one(a):
    a = a.reshape(b, kv_heads, batch // b, time, group, *a.shape[3:])
    a = jnp.moveaxis(a, 1, 3)  # [b, r, T, kv, g, ...]
    return a.reshape(batch, time, kv_heads, group, *a.shape[5:])

  return one(m), one(s), one(o)


def _per_row(bound: jax.Array, b: int, group: int) -> jax.Array:
  """A bound per query position [B, T] as `_rows`' rows: [b, (B / b) * T
  * g]."""
  batch, time = bound.shape
  bound = jnp.broadcast_to(bound[..., None], (batch, time, group))
  return bound.reshape(b, -1)


def piece(
  q: jax.Array, layer: PrefixLayer, lo: jax.Array, softcap: float | None
):
  """(m, s, o) of q f32[B, T, kv, g, D] (pre-scaled) to a piece of prefix
  (decoded: `PrefixLayer.decoded`), its row b's keys 0..lengths[b] - 1
  seen from every position, none before lo [B, T] (a window's first key,
  in the piece's own slots; 0 without one)."""
  batch, time, _, group, _ = q.shape
  layer = layer.sliced().gathered()
  b = layer.batch
  # A cache's keys [b, S, kv, D] as a TPU stores them, [b, kv, D, S]
  # (`partitioning.formats`: read in place); a loop buffer's heads-major.
  transposed = not layer.heads_major
  if transposed:
    k = jnp.transpose(layer.k, (0, 2, 3, 1))
    v = jnp.swapaxes(layer.v, 1, 2)
  else:
    k, v = layer.k, layer.v
  hi = jnp.repeat(layer.lengths - 1, batch // b)[:, None]
  hi = jnp.broadcast_to(hi, (batch, time))
  parts = kernel.parts(
    _rows(q, b),
    k,
    v,
    _per_row(lo, b, group),
    _per_row(hi, b, group),
    softcap=softcap,
    keys_transposed=transposed,
    interpret=numerics.interpret(),
  )
  return _back(parts, batch, time, group)


def causal(q: jax.Array, k: jax.Array, v: jax.Array, options):
  """(m, s, o) of q f32[B, T, kv, g, D] (pre-scaled) to the chunk's own
  k, v [B, T, kv, D], causally (and within `options.window`)."""
  batch, time, _, group, _ = q.shape
  position = jnp.broadcast_to(jnp.arange(time, dtype=jnp.int32), (batch, time))
  lo = jnp.zeros_like(position)
  if options.window is not None:
    lo = jnp.maximum(position - options.window + 1, 0)
  parts = kernel.parts(
    _rows(q, batch),
    jnp.swapaxes(k, 1, 2),
    jnp.swapaxes(v, 1, 2),
    _per_row(lo, batch, group),
    _per_row(position, batch, group),
    softcap=options.softcap,
    interpret=numerics.interpret(),
  )
  return _back(parts, batch, time, group)
