"""`KVCache`: keys and values of one chunk, every layer, ready to attend to.

  cache.k, cache.v   # [layers, batch, time, kv_heads, head_dim]
  cache.lengths      # int32[batch]; slots >= lengths[b] are masked

A list of caches (the prefixes of a call) may have growing batch sizes
b0 | b1 | ... | B. Row r of a batch-b cache serves rows r*(B/b) ..
(r+1)*(B/b)-1 of the batch-B call ("repeat each", not "tile"); attention
reshapes its queries so the smaller cache is read in place, never copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from chunkwise.partitioning import axes as ax


@struct.dataclass(kw_only=True)
class KVCache:
  """RoPE'd keys and values of one chunk for every layer."""

  k: jax.Array  # [layers, batch, time, kv_heads, head_dim]
  v: jax.Array  # [layers, batch, time, kv_heads, head_dim]
  lengths: jax.Array  # int32[batch]

  @classmethod
  def axes(cls) -> KVCache:
    spec = P(
      ax.LAYERS, ax.CACHE_BATCH, ax.CACHE_TIME, ax.CACHE_HEADS, ax.HEAD_DIM
    )
    # Lengths are per-row counts, replicated like every small per-row array.
    return cls(k=spec, v=spec, lengths=P(ax.BATCH))

  @property
  def batch(self) -> int:
    return self.k.shape[1]

  @property
  def time(self) -> int:
    return self.k.shape[2]

  @classmethod
  def zeros(
    cls,
    *,
    layers: int,
    batch: int,
    time: int,
    kv_heads: int,
    head_dim: int,
    dtype=jnp.float32,
  ) -> KVCache:
    shape = (layers, batch, time, kv_heads, head_dim)
    return cls(
      k=jnp.zeros(shape, dtype),
      v=jnp.zeros(shape, dtype),
      lengths=jnp.zeros((batch,), jnp.int32),
    )


def repeat_each(x: jax.Array, batch: int, axis: int = 0) -> jax.Array:
  """Broadcasts `x` (batch b on `axis`) to `batch` rows, repeating each row
  batch/b times: the prefix batch broadcasting rule."""
  b = x.shape[axis]
  if batch % b:
    raise ValueError(f"batch {b} does not divide batch {batch}")
  return x if b == batch else jnp.repeat(x, batch // b, axis=axis)


def total_lengths(lengths: Sequence[jax.Array], batch: int) -> jax.Array:
  """int32[batch]: each row's token count over a list of prefix lengths
  (each int32[b_i], b_i | batch), i.e. the absolute position of the row's
  next token."""
  total = jnp.zeros((batch,), jnp.int32)
  for n in lengths:
    total = total + repeat_each(n.astype(jnp.int32), batch)
  return total
