"""`PagedKV`: the slot loop's K/V in one pool of pages (paged K/V).

  cache = PagedKV.zeros(like, pages=512, page=32, columns=1024, rows=32)
  cache = cache.replace(table=table)      # the host's `page_table.Pages`
  cache.layer(i)                          # a `PagedLayer`, as attention reads

Fixed slots (`LayerKV`) reserve `capacity` columns per slot, written or
not; a pool reserves pages only as a request's columns fill them, so the
same memory holds more requests when their lengths vary (vLLM's
PagedAttention). Each layer's pool is [kv_heads, pages, page, head_dim]
(the layout of JAX's Pallas paged-attention kernels); `table[r, j]` is the
pool page holding row r's columns [j * page, (j + 1) * page), or `pages`
(past the pool) where the row holds none: writes there are dropped, and
reads are masked by the row's length. The host owns the table
(`page_table.Pages`) and hands it in before every program that reads or
writes the pool.

Same interface as `LayerKV` where the slot loop uses it (`layer`,
`write_columns`, `nothing`, `put_rows`), so `slots` and speculation run
over either unchanged, and read the same values: a paged request's tokens
equal a fixed slot's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from chunkwise.inference.kv_cache import by_layer
from chunkwise.models import kv_int8
from chunkwise.models.paged_attention import PagedLayer
from chunkwise.partitioning import axes as ax

# Columns per page: vLLM's default block is 16 tokens; at 32 a SmolLM2
# page holds 60 KiB per layer, and a row's table stays short.
PAGE = 32


@struct.dataclass(kw_only=True)
class PagedKV:
  """Every layer's pool of K/V pages and each row's page table."""

  k: tuple[jax.Array, ...]  # per layer [kv_heads, pages, page, head_dim]
  v: tuple[jax.Array, ...]
  table: jax.Array  # int32[rows, columns // page]; `pages`: none held
  lengths: jax.Array  # int32[rows]

  @classmethod
  def axes(cls, layers: int) -> PagedKV:
    spec = P(ax.CACHE_HEADS, None, None, ax.HEAD_DIM)
    return cls(
      k=(spec,) * layers,
      v=(spec,) * layers,
      table=P(ax.BATCH, None),
      lengths=P(ax.BATCH),
    )

  @classmethod
  def zeros(
    cls,
    like: jax.ShapeDtypeStruct,
    *,
    pages: int,
    page: int,
    columns: int,
    rows: int,
  ) -> PagedKV:
    """An empty pool of `pages` pages of `page` columns for K/V shaped
    like `like` (a `KVCache.k`: [layers, batch, any, kv_heads, head_dim]),
    with tables of up to `columns` columns per row, every entry free."""
    layers, _, _, heads, dim = like.shape
    zeros = tuple(
      jnp.zeros((heads, pages, page, dim), like.dtype) for _ in range(layers)
    )
    return cls(
      k=zeros,
      v=zeros,
      table=jnp.full((rows, -(-columns // page)), pages, jnp.int32),
      lengths=jnp.zeros((rows,), jnp.int32),
    )

  @property
  def page(self) -> int:
    return self.k[0].shape[2]

  @property
  def columns(self) -> int:
    """Columns a row's table can address (the fixed slots' capacity)."""
    return self.table.shape[1] * self.page

  def layer(self, i: int) -> PagedLayer:
    return PagedLayer(self.k[i], self.v[i], self.table, self.lengths)

  def _where(self, rows: jax.Array, cols: jax.Array):
    """(page, offset) of column cols[j, w] of row rows[j] (rows and cols
    past the table: page `pages`, a dropped write)."""
    pages = self.k[0].shape[1]
    j = cols // self.page
    inside = (rows[:, None] < self.table.shape[0]) & (j < self.table.shape[1])
    page = jnp.where(
      inside,
      self.table[
        jnp.minimum(rows, self.table.shape[0] - 1)[:, None],
        jnp.minimum(j, self.table.shape[1] - 1),
      ],
      pages,
    )
    return page, cols % self.page

  def put_rows(self, k, v, rows: jax.Array, offset=None) -> PagedKV:
    """`LayerKV.put_rows`: columns [offset, offset + W) of rows `rows` set
    to k, v [layers, 1 or len(rows), W, kv_heads, head_dim]."""
    cols = jnp.arange(k.shape[2])[None] + (0 if offset is None else offset)
    return self._scatter(
      k, v, rows, jnp.broadcast_to(cols, (rows.size, k.shape[2]))
    )

  def _scatter(self, k, v, rows: jax.Array, cols: jax.Array) -> PagedKV:
    """Column cols[j, w] of row rows[j] set to k, v [layers, 1 or
    len(rows), W, kv_heads, head_dim]; rows, columns or pages past the
    pool are dropped."""
    page, offset = self._where(rows, cols)

    def put(pools, new):
      out = []
      for pool, n in zip(pools, new, strict=True):
        n = kv_int8.encode(n, pool.dtype)
        n = jnp.broadcast_to(n, (rows.size, *n.shape[1:]))
        # [rows, W, kv_heads, dim] -> [kv_heads, rows, W, dim]
        n = jnp.moveaxis(n, 2, 0)
        out.append(pool.at[:, page, offset].set(n, mode="drop"))
      return tuple(out)

    return self.replace(k=put(self.k, k), v=put(self.v, v))

  def write_columns(self, k, v, cols: jax.Array) -> PagedKV:
    """`LayerKV.write_columns`: column cols[b, j] of row b set to k, v."""
    return self._scatter(k, v, jnp.arange(cols.shape[0]), cols)

  def nothing(self, width: int):
    """`LayerKV.nothing`: a pending write of `width` columns that writes
    nothing."""
    heads, _, _, dim = self.k[0].shape
    rows = self.table.shape[0]
    zeros = jnp.zeros((len(self.k), rows, width, heads, dim), self.k[0].dtype)
    columns = jnp.full((rows, width), self.columns, jnp.int32)
    return *by_layer(zeros, zeros), columns
