"""One layer of one piece of attention's context: `PrefixLayer`, the K/V
of a prefix cache (or of the generate loop's buffer) as attention reads
them, with the heads still to cut and int8 K/V still to decode.

  p = PrefixLayer(k, v, lengths)              # [b, S, kv_heads, head_dim]
  p = PrefixLayer(k, v, lengths, heads_major=True)   # [b, kv_heads, S, D]
  p = PrefixLayer(k, v, lengths, heads_major=True, rows=rows)  # rows of k
  p.heads(first, count).sliced().decoded(rotated)
  p.gathered()                                # rows taken out of k and v
  out = merge([(m, s, o), ...])               # pieces' partial sums merged

Its own module so that `attention` and the paths it chooses between
(`invariant_attention`, `paged_attention`, `blocked_attention`) all
import it without importing each other back.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise import numerics
from chunkwise.models import kv_int8


class PrefixLayer(NamedTuple):
  """One layer of a prefix cache: k, v [b, S, kv_heads, head_dim] (a
  `KVCache`'s order), or [b, kv_heads, S, head_dim] where `heads_major`
  (the generate loop's buffer, laid out for attention: read in place,
  where a cache in its own order is transposed every time it is read);
  lengths int32[b]. `first`, `count`: a window of K/V heads still to be
  cut (`heads`), or None. `rows` (heads-major only): int32[b], the rows
  of k and v (of any count) this piece's b rows are, or None (all of
  them, in order): a slot loop's running rows among all its slots, which
  the invariant kernels read where they are and other paths gather
  (`gathered`); lengths are then the b rows' own. `stacked`: (k, v, i),
  the whole [layers, ...] cache these k and v are layer i of, which a
  TPU program's invariant kernel reads in place (a Pallas call is
  handed a copy of a slice: `models.tpu_attention`), or None; any method
  that makes other k and v drops it."""

  k: jax.Array
  v: jax.Array
  lengths: jax.Array
  heads_major: bool = False
  first: jax.Array | int | None = None
  count: int | None = None
  rows: jax.Array | None = None
  stacked: tuple | None = None

  @property
  def batch(self) -> int:
    """Rows of the piece (b)."""
    return self.k.shape[0] if self.rows is None else self.rows.shape[0]

  @property
  def width(self) -> int:
    """Slots per row (S)."""
    return self.k.shape[2 if self.heads_major else 1]

  def heads(self, first, count: int) -> PrefixLayer:
    """K/V heads [first, first + count) (`first` may be traced). Under
    invariant numerics a heads-major buffer keeps them as a window that
    the kernels read in place (a slice of the decode loop's buffer made
    XLA copy the whole buffer every step); so does a fast TPU program's
    stacked cache or buffer (`tpu_decode`: handed a slice, XLA:TPU
    copies it out for the Pallas call)."""
    axis = 1 if self.heads_major else 2
    if self.k.shape[axis] == count:
      return self
    if self.heads_major and numerics.invariant():
      return self._replace(first=first, count=count)
    fast_tpu = numerics.runs_on("tpu") and not numerics.tpu_invariant()
    if fast_tpu and (self.heads_major or self.stacked is not None):
      return self._replace(first=first, count=count)
    return self._replace(first=first, count=count).sliced()

  def as_stored(self) -> tuple[jax.Array, jax.Array, int | None]:
    """A cache piece's keys and values as a TPU stores them and its
    Pallas kernels read them, keys [.., kv, D, S] and values [.., kv, S,
    D]: the whole stacked cache where there is one, with this layer's
    index in it (else None)."""
    if self.stacked is not None:
      keys, values, at = self.stacked  # [layers, b, S, kv, D]
      return (
        jnp.transpose(keys, (0, 1, 3, 4, 2)),
        jnp.swapaxes(values, 2, 3),
        at,
      )
    return jnp.transpose(self.k, (0, 2, 3, 1)), jnp.swapaxes(self.v, 1, 2), None

  def decoded(self, rotated: bool) -> PrefixLayer:
    """Keys and values in attention's space (`kv_int8.as_read`): int8 K/V
    decoded, rotated where attention is (`rotated`), else as stored (the
    piece's own rows only)."""
    if self.k.dtype != kv_int8.INT8 and not rotated:
      return self
    p = self.gathered()
    k, v = kv_int8.as_read(p.k, p.v, rotated)
    return p._replace(k=k, v=v, stacked=None)

  def gathered(self) -> PrefixLayer:
    """The piece's rows taken out of k and v (a copy; self without
    `rows`): what every path but the invariant kernels reads."""
    if self.rows is None:
      return self
    k, v = (
      jnp.take(a, self.rows, axis=0, mode="clip") for a in (self.k, self.v)
    )
    return self._replace(k=k, v=v, rows=None, stacked=None)

  def sliced(self) -> PrefixLayer:
    """The window of heads cut out (self when there is none)."""
    if self.count is None:
      return self
    axis = 1 if self.heads_major else 2
    k, v = (
      lax.dynamic_slice_in_dim(a, self.first, self.count, axis)
      for a in (self.k, self.v)
    )
    return self._replace(k=k, v=v, first=None, count=None, stacked=None)


def merge(pieces) -> jax.Array:
  """Attention's output from its pieces of context's partial sums (m, s,
  o) (max logit, sum of exp(logit - m), exp-weighted values [..., D]),
  all in one layout: each piece weighted by exp(m - the max over pieces),
  in the pieces' order. Every attention path but the invariant ones
  (the CPU's chain, a TPU program's online softmax over tiles of
  positions) merges its pieces so."""
  big_m = pieces[0][0]
  for m, _, _ in pieces[1:]:
    big_m = jnp.maximum(big_m, m)
  total_s = 0.0
  total_o = 0.0
  for m, s, o in pieces:
    w = jnp.exp(m - big_m)
    total_s = total_s + w * s
    total_o = total_o + w[..., None] * o
  return total_o / total_s[..., None]
