"""Attention to a paged K/V pool: the plain view and the Pallas kernel.

  layer = PagedLayer(k_pages, v_pages, table, lengths)
  layer.view()                      # PrefixLayer: the plain twin
  m, s, o = pool_piece(q, layer)    # decode, read in the pool's order
  m, s, o = kernel_piece(q, layer)  # GPU: JAX's Pallas paged attention
  m, s, o = piece(q, layer)         # the one for the platform

A pool holds fixed-size pages of keys and values, [kv_heads, pages, page,
head_dim] per layer: the layout JAX's Pallas paged-attention kernels read
(`jax.experimental.pallas.ops.gpu.paged_attention`, and the TPU kernels of
`...ops.tpu.paged_attention`). Row b's column c lives at page
table[b, c // page], offset c % page. A table entry past the pool (the
free marker, `pages`) is never read unmasked: columns at or past a row's
length are masked, and a row's pages up to its length are always held.

`view` gathers each row's pages into the heads-major buffer that the slot
loop's fixed slots hold (`PrefixLayer(heads_major=True)`), so every
attention path (blocked, invariant, sharded heads) reads a paged pool
unchanged, and reads the same values a fixed slot would: this is the plain
twin, and what invariant numerics and multi-token chunks read (bit for bit
a fixed slot's result). Its copy costs as much as the attention itself, so
a decode step under fast numerics reads the pool in place: `pool_piece`
on the CPU (each pool page attended by the row holding it, merged per row
by segment sums), `kernel_piece` on a GPU. `kernel_piece` runs the Pallas
GPU kernel's own body (`paged_attention_kernel`) and returns the
unnormalised (m, s, o) that attention merges with the other pieces (the
shared prefix, the chunk's own token); the public `paged_attention`
wrapper normalises its output, which cannot be merged. Tests run the
kernel in Pallas' interpret mode on the CPU, and `pool_piece`, against
`view`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise.models import kv_int8, paged_attention_tpu
from chunkwise.models.prefix_layer import PrefixLayer


class PagedLayer(NamedTuple):
  """One layer of a paged pool, as attention reads it."""

  k_pages: jax.Array  # [kv_heads, pages, page, head_dim]
  v_pages: jax.Array
  table: jax.Array  # int32[rows, pages per row]
  lengths: jax.Array  # int32[rows]

  @property
  def page(self) -> int:
    return self.k_pages.shape[2]

  @property
  def width(self) -> int:
    return self.table.shape[1] * self.page

  def view(self):
    """Each row's pages gathered into [rows, kv_heads, width, head_dim], a
    heads-major `attention.PrefixLayer` (the plain twin). Free entries
    read the last page: masked anyway."""
    last = self.k_pages.shape[1] - 1
    table = jnp.minimum(self.table, last)

    def gather(pool):
      heads, _, page, dim = pool.shape
      rows, per_row = table.shape
      pages = pool[:, table]  # [kv_heads, rows, per_row, page, dim]
      pages = jnp.swapaxes(pages, 0, 1)
      return pages.reshape(rows, heads, per_row * page, dim)

    return PrefixLayer(
      gather(self.k_pages),
      gather(self.v_pages),
      self.lengths,
      heads_major=True,
    )


def pool_piece(
  q: jax.Array, layer: PagedLayer, *, softcap: float | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Unnormalised attention of one query per row to its pages, read in
  the pool's own order (no gather of K/V): every pool page is attended
  by the row that holds it (found from the table), then each row's pages
  merge by segment max and sums. It reads the pool once, as a fixed
  slots' step reads its buffer, whatever rows hold (the plain form of the
  ragged kernels; under fast numerics, on the CPU).

  Args, returns: as `kernel_piece`; a row holding no page gives m = -inf,
  s = 0, o = 0.
  """
  _, pages, page, _ = layer.k_pages.shape
  rows, per_row = layer.table.shape
  owner = (
    jnp.full((pages,), rows, jnp.int32)
    .at[layer.table.ravel()]
    .set(jnp.repeat(jnp.arange(rows, dtype=jnp.int32), per_row), mode="drop")
  )
  index = (
    jnp.zeros((pages,), jnp.int32)
    .at[layer.table.ravel()]
    .set(jnp.tile(jnp.arange(per_row, dtype=jnp.int32), rows), mode="drop")
  )
  held = owner < rows
  row = jnp.minimum(owner, rows - 1)
  qp = q[row, 0]  # [pages, kv_heads, group, D]
  k = kv_int8.decode(layer.k_pages).astype(jnp.float32)
  v = kv_int8.decode(layer.v_pages).astype(jnp.float32)
  logits = jnp.einsum("pkgd,kpsd->pkgs", qp, k)
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  column = index[:, None] * page + jnp.arange(page)[None]  # [pages, page]
  mask = held[:, None] & (column < layer.lengths[row][:, None])
  mask = mask[:, None, None, :]
  logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1)  # [pages, kv_heads, group]
  e = jnp.where(
    mask, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0)[..., None]), 0.0
  )
  s = jnp.sum(e, axis=-1)
  o = jnp.einsum("pkgs,kpsd->pkgd", e, v)
  segment = jnp.where(held, owner, rows)
  big = jax.ops.segment_max(m, segment, num_segments=rows)
  w = jnp.where(jnp.isfinite(m), jnp.exp(m - big[row]), 0.0)
  s = jax.ops.segment_sum(w * s, segment, num_segments=rows)
  o = jax.ops.segment_sum(w[..., None] * o, segment, num_segments=rows)
  return big[:, None], s[:, None], o[:, None]


def read_in_place(time: int, window) -> bool:
  """Whether attention reads a pool with `piece` (else through its
  `view`): one query per row (decode) and no sliding window. Invariant
  numerics read the view too (their kernels define the sums)."""
  return time == 1 and window is None


def piece(q: jax.Array, layer: PagedLayer, *, softcap=None):
  """(m, s, o) of one query per row over its pages: the Pallas kernel on
  a GPU, JAX's Pallas TPU kernel in a program lowered for a TPU
  (`paged_attention_tpu`, chosen at lowering: a deviceless TPU compile
  gets it too), `pool_piece` elsewhere and for int8 K/V (the kernels read
  floats; `pool_piece` decodes int8 pages in place, into the rotated
  space that `attention.attend` then runs in)."""
  if jax.default_backend() == "gpu" and layer.k_pages.dtype != kv_int8.INT8:
    return kernel_piece(q, layer, softcap=softcap)
  if not paged_attention_tpu.supports(q, layer):
    return pool_piece(q, layer, softcap=softcap)
  return lax.platform_dependent(
    q,
    layer,
    tpu=functools.partial(paged_attention_tpu.tpu_piece, softcap=softcap),
    default=functools.partial(pool_piece, softcap=softcap),
  )


def _splits(per_row: int, block: int) -> tuple[int, int]:
  """(k_splits, pages_per_compute_block) that divide a row's pages."""
  block = math.gcd(per_row, block)
  splits = math.gcd(per_row // block, 16)
  return splits, block


def kernel_piece(
  q: jax.Array,
  layer: PagedLayer,
  *,
  softcap: float | None = None,
  interpret: bool = False,
  compute_block: int = 8,
  block_h: int = 16,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Unnormalised attention of one query per row to its pages.

  Args:
    q: f32[rows, 1, kv_heads, group, head_dim], pre-scaled.
    layer: the pool's layer (rows = q's rows).
  Returns:
    (m, s, o) as `attention._attend_piece` gives them: [rows, 1, kv_heads,
    group], the same and [..., head_dim]. A row of length 0 gives m at
    float32's lowest, s = 0 and o = 0 (its weight vanishes in the merge).
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu
  from jax.experimental.pallas.ops.gpu import paged_attention as ops

  _, _, kv_heads, group, dim = q.shape
  per_row = layer.table.shape[1]
  splits, block = _splits(per_row, compute_block)
  part = per_row // splits
  padded = -(-group // block_h) * block_h
  kernel = functools.partial(
    ops.paged_attention_kernel,
    num_heads=group,
    pages_per_compute_block=block,
    mask_value=ops.DEFAULT_MASK_VALUE,
    attn_logits_soft_cap=softcap,
  )
  dtype = layer.k_pages.dtype

  def one_row(q, table, length):  # q [kv_heads, group, dim]
    q = jnp.pad(q, ((0, 0), (0, padded - group), (0, 0))).astype(dtype)
    o, s, m = pl.pallas_call(
      kernel,
      grid=(kv_heads, padded // block_h, splits),
      in_specs=[
        pl.BlockSpec((None, block_h, dim), lambda h, i, k: (h, i, 0)),
        pl.BlockSpec(
          (None, *layer.k_pages.shape[1:]), lambda h, i, k: (h, 0, 0, 0)
        ),
        None,
        pl.BlockSpec(
          (None, *layer.v_pages.shape[1:]), lambda h, i, k: (h, 0, 0, 0)
        ),
        None,
        pl.BlockSpec((None, part), lambda h, i, k: (k, 0)),
        pl.BlockSpec((1,), lambda h, i, k: (0,)),
      ],
      out_specs=[
        pl.BlockSpec((None, None, block_h, dim), lambda h, i, k: (k, h, i, 0)),
        pl.BlockSpec((None, None, block_h), lambda h, i, k: (k, h, i)),
        pl.BlockSpec((None, None, block_h), lambda h, i, k: (k, h, i)),
      ],
      out_shape=[
        jax.ShapeDtypeStruct((splits, kv_heads, padded, dim), jnp.float32),
        jax.ShapeDtypeStruct((splits, kv_heads, padded), jnp.float32),
        jax.ShapeDtypeStruct((splits, kv_heads, padded), jnp.float32),
      ],
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      name="chunkwise_paged_attention",
    )(
      q,
      layer.k_pages,
      None,
      layer.v_pages,
      None,
      table.reshape(splits, part),
      length[None],
    )
    # The kernel's exponentials are base 2 of the same logits (exp2 of
    # (x - m) log2 e): s and o are exp-weighted as `_attend_piece`'s are.
    big = m.max(axis=0)
    w = jnp.exp(m - big[None])
    s = (w * s).sum(axis=0)
    o = (w[..., None] * o).sum(axis=0)
    return big[:, :group], s[:, :group], o[:, :group]

  table = jnp.minimum(layer.table, layer.k_pages.shape[1] - 1)
  m, s, o = jax.vmap(one_row)(q[:, 0], table, layer.lengths)
  return m[:, None], s[:, None], o[:, None]
