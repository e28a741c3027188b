"""`row_sum(x)`: each row's sum in one fixed order whatever the rows
around it, a Pallas TPU kernel (a TPU program's norms and softmax totals
under invariant numerics: `numerics.row_sum`, `numerics.exp_sum`).

The grid walks tiles of `ROWS` rows by `COLUMNS` columns, the column
tiles in order (the grid's last, "arbitrary" axis), each tile summed
across its lanes by the same Mosaic reduction and added to its rows'
running sums in VMEM. Every tile has one shape whatever the batch, so a
row's operations do not depend on how many rows there are or which
(columns past the row's end, in the last tile, are masked to zero). The
plain twin is `jnp.sum` (XLA picks its own order per shape).

  total = row_sum(x)                 # x [R, N] -> f32 [R]
  total = row_sum(x, shift)          # the sum of exp(x - shift[:, None])
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

ROWS = 8
COLUMNS = 2048


def _kernel(*refs, n, columns, exp):
  if exp:
    x, shift, out, acc = refs
  else:
    x, out, acc = refs
  c = pl.program_id(1)

  @pl.when(c == 0)
  def _():
    acc[...] = jnp.zeros(acc.shape, jnp.float32)

  v = x[...].astype(jnp.float32)
  if exp:
    v = jnp.exp(v - shift[...])
  column = c * columns + jax.lax.broadcasted_iota(jnp.int32, v.shape, 1)
  v = jnp.where(column < n, v, 0.0)
  acc[...] += jnp.sum(v, axis=1, keepdims=True)

  @pl.when(c == pl.num_programs(1) - 1)
  def _():
    out[...] = acc[...]


def row_sum(x, shift=None, *, interpret: bool = False) -> jax.Array:
  """The sum of each row of x [R, N] (of exp(x - shift) with `shift`
  [R]), f32 [R], in an order set by N alone."""
  if x.ndim != 2:
    raise ValueError(f"x {x.shape} must be [rows, columns]")
  r, n = x.shape
  if shift is not None and shift.shape != (r,):
    raise ValueError(f"shift {shift.shape} must be [{r}] for x {x.shape}")
  columns = n if n <= COLUMNS else COLUMNS
  operands = [x]
  in_specs = [pl.BlockSpec((ROWS, columns), lambda i, c: (i, c))]
  if shift is not None:
    operands.append(shift.astype(jnp.float32)[:, None])
    in_specs.append(pl.BlockSpec((ROWS, 1), lambda i, c: (i, 0)))
  out = pl.pallas_call(
    functools.partial(_kernel, n=n, columns=columns, exp=shift is not None),
    grid=(pl.cdiv(r, ROWS), pl.cdiv(n, columns)),
    in_specs=in_specs,
    out_specs=pl.BlockSpec((ROWS, 1), lambda i, c: (i, 0)),
    out_shape=jax.ShapeDtypeStruct((r, 1), jnp.float32),
    scratch_shapes=[pltpu.VMEM((ROWS, 1), jnp.float32)],
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "arbitrary")
    ),
    cost_estimate=pl.CostEstimate(
      flops=2 * r * n,
      transcendentals=r * n if shift is not None else 0,
      bytes_accessed=x.size * x.dtype.itemsize + 8 * r,
    ),
    interpret=bool(interpret),
    name="chunkwise_tpu_row_sum",
  )(*operands)
  return out[:, 0]
