"""`take_rows(table, ids)`: rows of a 2-D array read where they lie, by a
Pallas TPU kernel.

XLA:TPU gathers rows of an int8 table only from its (8, 128) tiling, while
a parameter is stored in int8's own (32, 128) one: every decode step
copied the whole embedding table (32064 x 4096 int8 per v5e chip of a 2x2
slice for Llama-3.1-8B, ~1.2 ms of a step in XLA:TPU's estimate) to read
one row. Here each id's grid step DMAs the one tile of rows holding it
(`_ROWS[itemsize]` rows: a tile of the stored layout) and keeps the row
it asked for (a select and an exact sum: the other rows add zeros). The
plain twin is `jnp.take(table, ids, axis=0)`.

  rows = take_rows(table, ids)        # table [V, W]; ids int32 [n]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Rows per stored tile, by bytes per element (32-bit, 16-bit, 8-bit).
_ROWS = {4: 8, 2: 16, 1: 32}


def _kernel(ids, table, out, *, rows):
  i = pl.program_id(0)
  row = ids[i] % rows
  tile = table[...]
  wide = tile.astype(jnp.float32 if tile.dtype == jnp.float32 else jnp.int32)
  picked = jax.lax.broadcasted_iota(jnp.int32, wide.shape, 0) == row
  found = jnp.sum(jnp.where(picked, wide, 0), axis=0, keepdims=True)
  out[...] = found.astype(out.dtype)


def take_rows(table: jax.Array, ids: jax.Array, *, interpret=False):
  """table[ids] for a 2-D `table` (8-, 16- or 32-bit: f16 and bf16 as
  their bits) and int32 ids of any shape, each in [0, V)."""
  if table.ndim != 2:
    raise ValueError(f"take_rows reads a 2-D table, got {table.shape}")
  dtype = table.dtype
  if dtype in (jnp.float16, jnp.bfloat16):  # moved as their bits
    bits = jax.lax.bitcast_convert_type(table, jnp.int16)
    out = take_rows(bits, ids, interpret=interpret)
    return jax.lax.bitcast_convert_type(out, dtype)
  if dtype.itemsize not in _ROWS:
    raise ValueError(f"take_rows reads 8-, 16- or 32-bit tables, got {dtype}")
  rows = _ROWS[dtype.itemsize]
  flat = ids.reshape(-1).astype(jnp.int32)
  n, width = flat.shape[0], table.shape[1]
  out = pl.pallas_call(
    lambda ids, t, o: _kernel(ids, t, o, rows=rows),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(n,),
      in_specs=[
        pl.BlockSpec((rows, width), lambda i, ids: (ids[i] // rows, 0))
      ],
      out_specs=pl.BlockSpec((None, 1, width), lambda i, ids: (i, 0, 0)),
    ),
    out_shape=jax.ShapeDtypeStruct((n, 1, width), dtype),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
    cost_estimate=pl.CostEstimate(
      flops=0,
      transcendentals=0,
      bytes_accessed=n * (rows + 1) * width * dtype.itemsize,
    ),
    interpret=bool(interpret),
    name="chunkwise_tpu_take_rows",
  )(flat, table)
  return out.reshape(*ids.shape, width)
