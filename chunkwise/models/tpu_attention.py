"""Attention in a TPU program under invariant numerics
(`numerics.tpu_invariant`): each piece of context (a prefix cache, the
generate loop's buffer, the chunk's own keys) through the Pallas kernel
`tpu_kernels.attention.parts`, whose tiles have one shape whatever the
batch (8 query rows, 128 keys from the piece's first), the pieces'
partial sums merged as the fast path merges them (`models.attention`).

  out = attend(q, k, v, [(prefix_layer, lo), ...], options)

A row's bits then do not depend on the rows beside it, how many there
are, or how wide the batch's pieces are padded (keys past a row's own
are masked to exact zeros, in blocks that leave its sums as they were),
nor on how long a cache is. They do depend on how its context was cut
into pieces: a chunk split elsewhere merges other pieces (on the CPU
the invariant kernels chain every key in position order across pieces,
which a TPU's MXU tiles do not: docs/numerics.md).

The queries are laid out once as each kv head's rows, [b, kv, rows, D],
the kernel's layout, and the pieces merged in it; a piece of fewer rows
than the batch (a prefix broadcast to many rows) is merged after its
sums are laid out as the batch's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from chunkwise import numerics
from chunkwise.models.prefix_layer import merge
from chunkwise.tpu_kernels import attention as kernel


def _rows(a: jax.Array, b: int) -> jax.Array:
  """a [B, T, kv, g, ...] as each kv head's rows for a piece of b rows:
  [b, kv, (B / b) * T * g, ...], rows in (batch row, position, head)
  order."""
  batch, time, kv_heads, group = a.shape[:4]
  rest = a.shape[4:]
  a = a.reshape(b, batch // b, time, kv_heads, group, *rest)
  a = jnp.moveaxis(a, 3, 1)
  return a.reshape(b, kv_heads, -1, *rest)


def _per_row(bound: jax.Array, b: int, group: int):
  """A bound per query position [B, T] as `_rows`' rows, [b, (B / b) *
  T * g] (the same for every kv head)."""
  batch, time = bound.shape
  bound = jnp.broadcast_to(bound[..., None], (batch, time, group))
  return bound.reshape(b, -1)


def _as_batch(parts, b: int, batch: int, time: int, group: int):
  """(m, s, o) of a piece of b rows, laid out as the batch's pieces:
  [B, kv, T * g, ...]."""
  if b == batch:
    return parts

  def one(a):
    kv_heads = a.shape[1]
    a = a.reshape(b, kv_heads, batch // b, time * group, *a.shape[3:])
    a = jnp.moveaxis(a, 2, 1)
    return a.reshape(batch, kv_heads, time * group, *a.shape[4:])

  return tuple(one(a) for a in parts)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, pieces, options):
  """Attention of q f32[B, T, kv, g, D] (pre-scaled) to `pieces`, each
  (a decoded `PrefixLayer`, lo [B, T]: the piece's first slot each
  position sees, 0 without a window; its row b's slots 0..lengths[b] -
  1 seen), then causally to the chunk's own k, v [B, T, kv, D] (within
  `options.window`); f32[B, T, kv * g, D]."""
  batch, time, kv_heads, group, dim = q.shape
  rows = {}  # q as each piece's rows, by the piece's batch

  def run(b, keys, values, lo, hi, transposed, layer=None):
    if b not in rows:
      rows[b] = _rows(q, b)
    parts = kernel.parts(
      rows[b],
      keys,
      values,
      _per_row(lo, b, group),
      _per_row(hi, b, group),
      softcap=options.softcap,
      keys_transposed=transposed,
      layer=layer,
      interpret=numerics.interpret(),
    )
    return _as_batch(parts, b, batch, time, group)

  merged = []
  for layer, lo in pieces:
    layer = layer.sliced().gathered()
    b = layer.batch
    at = None
    if layer.heads_major:  # a loop's buffer [b, kv, S, D]
      keys, values = layer.k, layer.v
    elif layer.stacked is not None:  # the whole cache, read at its layer
      keys, values, at = layer.stacked
      keys = jnp.transpose(keys, (0, 1, 3, 4, 2))
      values = jnp.swapaxes(values, 2, 3)
    else:  # a cache's [b, S, kv, D]: keys as a TPU stores them, [b, kv, D, S]
      keys = jnp.transpose(layer.k, (0, 2, 3, 1))
      values = jnp.swapaxes(layer.v, 1, 2)
    hi = jnp.repeat(layer.lengths - 1, batch // b)[:, None]
    hi = jnp.broadcast_to(hi, (batch, time))
    merged.append(run(b, keys, values, lo, hi, not layer.heads_major, at))
  position = jnp.broadcast_to(jnp.arange(time, dtype=jnp.int32), (batch, time))
  lo = jnp.zeros_like(position)
  if options.window is not None:
    lo = jnp.maximum(position - options.window + 1, 0)
  merged.append(
    run(
      batch,
      jnp.swapaxes(k, 1, 2),
      jnp.swapaxes(v, 1, 2),
      lo,
      position,
      False,
    )
  )
  out = merge(merged)  # [B, kv, T * g, D]
  out = out.reshape(batch, kv_heads, time, group, dim)
  return jnp.moveaxis(out, 1, 2).reshape(batch, time, kv_heads * group, dim)
