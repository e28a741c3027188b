"""Attention in a TPU program under invariant numerics
(`numerics.tpu_invariant`): a row's context (its prefix caches, the
generate loop's buffer, the chunk's own keys) through the Pallas kernel
`tpu_kernels.attention.parts`, whose tiles have one shape whatever the
batch (8 query rows, 128 keys), as one online softmax over tiles of
absolute positions [128 i, 128 (i + 1)).

  out = attend(q, k, v, [(prefix_layer, start), ...], positions, options)

The first piece (a prefix cache, from position 0) is read in place up to
its last whole tile; the rest (that tile's part, the other pieces, the
chunk's own keys) is gathered into one run of keys from that tile's
first position, read next with the first's sums carried (`parts`'
`carry`). So a row's tiles hold the same keys, in the same order,
however its context was cut into chunks and pieces, and its bits do
not depend on the chunk split, nor on the rows beside it, how many
there are, or how wide the batch's pieces are padded (keys past a
row's own are masked to exact zeros, in blocks that leave its sums as
they were), nor on how long a cache is. The gathered run costs a copy
of every piece but the first, per call (in a decode step: up to 127
keys of the cache, the loop's buffer and the step's key).

The queries are laid out once as each kv head's rows, [b, kv, rows, D],
the kernel's layout; a first piece of fewer rows than the batch (a
prefix broadcast to many rows) is read with the queries as its rows,
and its sums laid out as the batch's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise import numerics, tpu_kernels


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


def _heads_major(layer):
  """k and v of a piece as [b, kv, S, D] (a copy for a cache in its own
  order), its rows taken out."""
  layer = layer.sliced().gathered()
  if layer.heads_major:
    return layer.k, layer.v
  return jnp.swapaxes(layer.k, 1, 2), jnp.swapaxes(layer.v, 1, 2)


def _seam(layer, base: jax.Array):
  """The tile of each row of a piece of whole tiles from slot base[r] (a
  multiple of KEY_BLOCK), k and v as [b, kv, KEY_BLOCK, D], sliced row by
  row where it is (the whole stacked cache at its layer: a gather along
  a TPU cache's time, its keys' minor dim, made XLA:TPU lay the whole
  cache out again)."""
  n = tpu_kernels.attention.KEY_BLOCK
  layer = layer.sliced().gathered()
  if layer.stacked is not None:
    arrays, at = layer.stacked[:2], (layer.stacked[2],)
  else:
    arrays, at = (layer.k, layer.v), ()
  axis = len(at) + (2 if layer.heads_major else 1)
  out = []
  for a in arrays:
    rows = []
    for r in range(layer.batch):
      start = [*at, r] + [0] * (a.ndim - len(at) - 1)
      start[axis] = base[r]
      size = [1] * (len(at) + 1) + list(a.shape[len(at) + 1 :])
      size[axis] = n
      rows.append(lax.dynamic_slice(a, start, size).reshape(size[len(at) :]))
    a = jnp.concatenate(rows)
    out.append(a if layer.heads_major else jnp.swapaxes(a, 1, 2))
  return tuple(out)


def _rest(first, base, rest, k, v, own):
  """The keys and values of a row's context from base[r] (the first
  piece's last whole tile's first position) on, [B, kv, W, D] (W a
  multiple of KEY_BLOCK), each key at its position - base[r]: the first
  piece's part of that tile, every other piece of `rest` ([(layer,
  start)]), then the chunk's own k, v [B, T, kv, D] from position
  own[r]. Slots past a row's last key hold copies of finite keys, which
  the row's bounds mask."""
  batch, time = k.shape[:2]
  b = first.batch
  block = tpu_kernels.attention.KEY_BLOCK
  lengths = jnp.repeat(first.lengths, batch // b)
  # (k and v [b', kv, S, D], position - base of slot 0, keys): the first
  # piece's last tile sliced out where its width is whole tiles, else
  # gathered like the other pieces (its slots from base on).
  if first.width % block:
    sources = [(_heads_major(first), -base, lengths)]
  else:
    sources = [
      (_seam(first, base[:: batch // b]), jnp.zeros_like(base), lengths - base)
    ]
  for layer, start in rest:
    lengths = jnp.repeat(layer.lengths, batch // layer.batch)
    sources.append((_heads_major(layer), start - base, lengths))
  sources.append(
    (
      (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)),
      own - base,
      jnp.full_like(base, time),
    )
  )
  width = block + sum(kv[0].shape[2] for kv, _, _ in sources[1:])
  width = -(-width // block) * block
  slot = jnp.arange(width)[None, :]
  # Each source's keys gathered where they go and selected: one fusion
  # that reads the sources in place (a concatenation of them first was a
  # copy of the loop's buffer a layer).
  out = [None, None]
  for kv, start, count in sources:
    at = slot - start[:, None]  # [B, width], the source's slot
    inside = ((at >= 0) & (at < count[:, None]))[:, None, :, None]
    at = jnp.clip(at, 0, kv[0].shape[2] - 1)
    for i in range(2):
      source = jnp.repeat(kv[i], batch // kv[i].shape[0], axis=0)
      got = jnp.take_along_axis(source, at[:, None, :, None], axis=2)
      out[i] = got if out[i] is None else jnp.where(inside, got, out[i])
  return out


def attend(q, k, v, pieces, positions, options):
  """Attention of q f32[B, T, kv, g, D] (pre-scaled, at `positions` int32
  [B, T]) to `pieces`, each (a decoded `PrefixLayer`, start [B]: its
  slot 0's position, the pieces one row's consecutive context from 0),
  then causally to the chunk's own k, v [B, T, kv, D], within
  `options.window`; f32[B, T, kv * g, D]."""
  batch, time, kv_heads, group, dim = q.shape
  rows = {}  # q as each piece's rows, by the piece's batch

  def run(b, keys, values, lo, hi, transposed, layer=None, carry=None):
    if b not in rows:
      rows[b] = _rows(q, b)
    parts = tpu_kernels.attention.parts(
      rows[b],
      keys,
      values,
      _per_row(lo, b, group),
      _per_row(hi, b, group),
      softcap=options.softcap,
      keys_transposed=transposed,
      layer=layer,
      carry=carry,
      interpret=numerics.interpret(),
    )
    return _as_batch(parts, b, batch, time, group)

  lo = jnp.zeros_like(positions)
  if options.window is not None:
    lo = jnp.maximum(positions - options.window + 1, 0)
  if not pieces:  # the chunk's own keys, from position 0
    carry, base = None, jnp.zeros((batch,), jnp.int32)
    keys, values = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  else:
    first, _ = pieces[0]
    b = first.batch
    block = tpu_kernels.attention.KEY_BLOCK
    base = first.lengths // block * block
    base = jnp.repeat(base, batch // b)
    hi = jnp.broadcast_to(base[:, None] - 1, (batch, time))
    layer = first.sliced().gathered()
    if layer.heads_major:  # a loop's buffer [b, kv, S, D]
      keys, values, at = layer.k, layer.v, None
    else:  # a cache as a TPU stores it (the whole stacked one, at its layer)
      keys, values, at = layer.as_stored()
    carry = run(b, keys, values, lo, hi, not layer.heads_major, at)
    keys, values = _rest(first, base, pieces[1:], k, v, positions[:, 0])
  _, total, out = run(
    batch,
    keys,
    values,
    lo - base[:, None],
    positions - base[:, None],
    False,
    carry=carry,
  )
  out = out / total[..., None]  # [B, kv, T * g, D]
  out = out.reshape(batch, kv_heads, time, group, dim)
  return jnp.moveaxis(out, 1, 2).reshape(batch, time, kv_heads * group, dim)
