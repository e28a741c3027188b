"""A paged K/V pool read on a TPU by JAX's Pallas TPU paged-attention
kernel, as one piece of attention.

  m, s, o = tpu_piece(q, layer)                  # inside a TPU program
  m, s, o = tpu_piece(q, layer, interpret=True)  # its semantics, on a CPU

`jax.experimental.pallas.ops.tpu.paged_attention` runs one query per row
over the row's pages, a compute block of pages at a time copied from HBM
into VMEM by DMA (double-buffered), with the online softmax. Its public
wrapper returns the normalised output, which cannot be merged with the
other pieces of a decode step (the shared prefix, the step's own token).
`tpu_piece` runs the same kernel body (`paged_flash_attention_kernel_
inline_seq_dim`) through its own `pallas_call` and keeps the kernel's
running max m and sum l: the unnormalised piece is (m, l, o * l), in
natural exponentials like `attention._attend_piece`'s.

`paged_attention.piece` picks it by the platform the program is lowered
for (`lax.platform_dependent`), so a deviceless TPU compile on this CPU
gets the kernel and the CPU run gets `pool_piece`. A row of length 0 runs
no block (its outputs would be whatever VMEM held): it gives m at
float32's lowest, s = 0 and o = 0. Table entries past the pool (the free
marker) are clamped to the last page: a compute block copies whole
blocks of pages, masked past the row's length. `paged_attention.view`
is the plain twin tests compare it with (tests/test_paged_kv.py, in
Pallas' TPU interpret mode).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from chunkwise.models import kv_int8

# Pages per compute block (the kernel's DMA unit), at most.
COMPUTE_BLOCK = 8


def supports(q: jax.Array, layer) -> bool:
  """Whether the kernel reads this pool: float pages (int8 K/V is decoded
  by `pool_piece`), pages of a multiple of 8 columns and heads of a
  multiple of 128 lanes (the TPU's (8, 128) tiles)."""
  return (
    layer.k_pages.dtype != kv_int8.INT8
    and layer.page % 8 == 0
    and q.shape[-1] % 128 == 0
  )


def tpu_piece(
  q: jax.Array,
  layer,
  *,
  softcap: float | None = None,
  interpret: bool = False,
  compute_block: int = COMPUTE_BLOCK,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Unnormalised attention of one query per row to its pages.

  Args:
    q: f32[rows, 1, kv_heads, group, head_dim], pre-scaled.
    layer: the pool's `paged_attention.PagedLayer` (rows = q's rows).
    interpret: run in Pallas' TPU interpret mode (on any backend).
  Returns:
    (m, s, o) as `paged_attention.kernel_piece` gives them.
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  from jax.experimental.pallas.ops.tpu.paged_attention import (
    paged_attention_kernel as ops,
  )

  rows, _, kv_heads, group, dim = q.shape
  pages, page = layer.k_pages.shape[1], layer.page
  per_row = layer.table.shape[1]
  block = math.gcd(per_row, compute_block)
  # The kernel reads kv head h's queries as q heads [h * group, ...); a
  # group that is not a multiple of 8 sublanes goes as [.., 1, dim] rows.
  flat = q[:, 0].reshape(rows, kv_heads * group, dim)
  if group % 8:
    flat = flat.reshape(rows, kv_heads * group, 1, dim)
    q_spec = pl.BlockSpec(
      (None, group, None, dim), lambda c, b, h, *_: (b, h, 0, 0)
    )
  else:
    q_spec = pl.BlockSpec((None, group, dim), lambda c, b, h, *_: (b, h, 0))
  kernel = functools.partial(
    ops.paged_flash_attention_kernel_inline_seq_dim,
    pages_per_sequence=per_row,
    batch_size=rows,
    pages_per_compute_block=block,
    mask_value=ops.DEFAULT_MASK_VALUE,
    attn_logits_soft_cap=softcap,
    megacore_mode=None,
  )
  buffer = pltpu.VMEM((2, block, page, dim), layer.k_pages.dtype)
  stats = jax.ShapeDtypeStruct((*flat.shape[:-1], 1), jnp.float32)
  o, m, s = pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      # lengths, the page table, the DMA buffer's index, the first flag
      num_scalar_prefetch=4,
      in_specs=[
        q_spec,
        pl.BlockSpec(memory_space=pl.ANY),
        None,
        pl.BlockSpec(memory_space=pl.ANY),
        None,
      ],
      out_specs=[q_spec, q_spec, q_spec],
      grid=(1, rows, kv_heads),
      scratch_shapes=(
        buffer,
        None,
        pltpu.VMEM((2, block, page, dim), layer.v_pages.dtype),
        None,
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SemaphoreType.DMA((2,)),
      ),
    ),
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "arbitrary", "arbitrary")
    ),
    out_shape=[jax.ShapeDtypeStruct(flat.shape, jnp.float32), stats, stats],
    interpret=pltpu.InterpretParams() if interpret else False,
    name="chunkwise_tpu_paged_attention",
  )(
    layer.lengths.astype(jnp.int32),
    jnp.minimum(layer.table, pages - 1).reshape(-1).astype(jnp.int32),
    jnp.zeros((1,), jnp.int32),
    jnp.ones((1,), jnp.int32),
    flat,
    layer.k_pages,
    None,
    layer.v_pages,
    None,
  )
  shape = (rows, 1, kv_heads, group)
  m, s = m.reshape(shape), s.reshape(shape)
  o = o.reshape(*shape, dim) * s[..., None]
  held = (layer.lengths > 0)[:, None, None, None]
  lowest = jnp.finfo(jnp.float32).min
  return (
    jnp.where(held, m, lowest),
    jnp.where(held, s, 0.0),
    jnp.where(held[..., None], o, 0.0),
  )
