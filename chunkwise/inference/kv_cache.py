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
from jax import lax
from jax.sharding import PartitionSpec as P

from chunkwise import numerics
from chunkwise.models import kv_int8
from chunkwise.models.attention import PrefixLayer
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

  def layer(self, i: int) -> PrefixLayer:
    """Layer i, as attention reads it (in a TPU program, with the whole
    cache, which its kernels read in place: `PrefixLayer.stacked`)."""
    on_tpu = numerics.tpu_invariant() or numerics.runs_on("tpu")
    stacked = (self.k, self.v, i) if on_tpu else None
    return PrefixLayer(self.k[i], self.v[i], self.lengths, stacked=stacked)

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


def by_layer(k: jax.Array, v: jax.Array):
  """A step's K/V ([layers, ...] each) as a decode loop carries it to the
  next step's write: one array a layer. Carried stacked, a TPU program
  wrote every layer's k and v into the stack (two small ops a layer)
  only to slice them out again for the write."""
  return tuple(k), tuple(v)


@struct.dataclass(kw_only=True)
class LayerKV:
  """The generate loop's K/V buffer: one array per layer, heads-major.

  Attention reads it in place every step: a `KVCache`'s stacked
  [layers, batch, time, kv_heads, head_dim] arrays made XLA copy each
  layer's slice and transpose it (kv heads ahead of time) every step, a
  quarter of a batch-16 SmolLM2 decode step on the CPU.
  """

  k: tuple[jax.Array, ...]  # per layer [batch, kv_heads, time, head_dim]
  v: tuple[jax.Array, ...]
  lengths: jax.Array  # int32[batch], or the rows' (`rows`)
  # Some rows of the buffer, read and written where they are (a slot
  # loop's running requests among all its slots: `rows.take`): int32[n],
  # each row's index in k and v (past them: a padding row, never written);
  # None: every row, in order.
  rows: jax.Array | None = None

  @classmethod
  def axes(cls, layers: int) -> LayerKV:
    spec = P(ax.CACHE_BATCH, ax.CACHE_HEADS, ax.CACHE_TIME, ax.HEAD_DIM)
    return cls(k=(spec,) * layers, v=(spec,) * layers, lengths=P(ax.BATCH))

  @classmethod
  def zeros(cls, like: jax.ShapeDtypeStruct, time: int, rows: int) -> LayerKV:
    """An empty buffer of `time` slots for K/V shaped like `like` (a
    `KVCache.k`: [layers, batch, any, kv_heads, head_dim], as this device
    holds it) and the lengths of `rows` rows (all of them)."""
    layers, batch, _, heads, dim = like.shape
    shape = (batch, heads, time, dim)
    zeros = tuple(jnp.zeros(shape, like.dtype) for _ in range(layers))
    return cls(k=zeros, v=zeros, lengths=jnp.zeros((rows,), jnp.int32))

  @property
  def columns(self) -> int:
    """Columns per row."""
    return self.k[0].shape[2]

  def layer(self, i: int) -> PrefixLayer:
    """Layer i, as attention reads it (in place)."""
    return PrefixLayer(
      self.k[i], self.v[i], self.lengths, heads_major=True, rows=self.rows
    )

  def write(self, k: jax.Array, v: jax.Array, at: jax.Array) -> LayerKV:
    """Slots [at, at + time) of every row set to `k`, `v` (a `KVCache`'s
    [layers, batch, time, kv_heads, head_dim])."""

    def put(buffers, new):
      return tuple(
        lax.dynamic_update_slice_in_dim(
          b, jnp.swapaxes(kv_int8.encode(n, b.dtype), 1, 2), at, axis=2
        )
        for b, n in zip(buffers, new, strict=True)
      )

    return self.replace(k=put(self.k, k), v=put(self.v, v))

  def write_columns(self, k: jax.Array, v: jax.Array, cols: jax.Array):
    """Column cols[b, j] of row b set to k, v [layers, rows, W, kv_heads,
    head_dim] (this device's rows; rows write at their own columns, as
    the slots and speculative loops do); columns past the buffer are
    dropped, and so are a padding row's (`rows`)."""
    rows = jnp.arange(cols.shape[0]) if self.rows is None else self.rows
    n, width = cols.shape
    # (row, column) of every value: one lax.scatter per layer, its indices
    # built once (`b.at[rows, :, cols]` took 4 ms of tracing per layer).
    at = jnp.stack(
      [jnp.broadcast_to(rows[:, None], (n, width)), cols], axis=-1
    ).reshape(n * width, 2)
    numbers = lax.ScatterDimensionNumbers(
      update_window_dims=(1, 2),
      inserted_window_dims=(0, 2),
      scatter_dims_to_operand_dims=(0, 2),
    )

    def put(buffers, new):  # new [layers, n, W, kv_heads, head_dim]
      out = []
      for b, x in zip(buffers, new, strict=True):
        x = kv_int8.encode(x, b.dtype).reshape(n * width, *x.shape[2:])
        out.append(
          lax.scatter(
            b,
            at,
            x,
            numbers,
            indices_are_sorted=False,
            unique_indices=False,
            mode=lax.GatherScatterMode.FILL_OR_DROP,
          )
        )
      return tuple(out)

    return self.replace(k=put(self.k, k), v=put(self.v, v))

  def put_rows(self, k, v, rows: jax.Array, offset=None) -> LayerKV:
    """Columns [offset, offset + W) of rows `rows` set to k, v ([layers, 1
    or len(rows), W, kv_heads, head_dim], clipped to the buffer; `offset`
    None: 0, static, may be traced); rows past the buffer are dropped (an
    admission's padding rows)."""
    width = min(k.shape[2], self.k[0].shape[2])

    def put(buffers, new):
      out = []
      for b, n in zip(buffers, new[:, :, :width], strict=True):
        n = jnp.swapaxes(kv_int8.encode(n, b.dtype), 1, 2)
        n = jnp.broadcast_to(n, (rows.size, *n.shape[1:]))
        if offset is None:
          out.append(b.at[rows, :, :width].set(n, mode="drop"))
        else:
          cols = offset + jnp.arange(width)
          out.append(
            b.at[rows[:, None], :, cols[None]].set(
              jnp.swapaxes(n, 1, 2), mode="drop"
            )
          )
      return tuple(out)

    return self.replace(k=put(self.k, k), v=put(self.v, v))

  def nothing(self, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(k, v, cols) of a `write_columns` of `width` columns that writes
    nothing (every column past the buffer): a loop's first pending write."""
    rows, heads, time, dim = self.k[0].shape
    if self.rows is not None:
      rows = self.rows.shape[0]
    zeros = jnp.zeros((len(self.k), rows, width, heads, dim), self.k[0].dtype)
    return *by_layer(zeros, zeros), jnp.full((rows, width), time, jnp.int32)

  def read(self, at: jax.Array, time: int) -> tuple[jax.Array, jax.Array]:
    """Slots [at, at + time) as a `KVCache`'s k, v (traced `at`)."""

    def get(buffers):
      return jnp.stack(
        [
          jnp.swapaxes(lax.dynamic_slice_in_dim(b, at, time, axis=2), 1, 2)
          for b in buffers
        ]
      )

    return get(self.k), get(self.v)

  def cache(self, begin: int, end: int, lengths: jax.Array) -> KVCache:
    """Slots [begin, end) as a `KVCache` (the public order), with
    `lengths`. Static slices: an index on the device would have to be
    read back, which waits for every computation queued before it."""

    def get(buffers):
      return jnp.stack(
        [jnp.swapaxes(b[:, :, begin:end], 1, 2) for b in buffers]
      )

    return KVCache(k=get(self.k), v=get(self.v), lengths=lengths)


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
