"""Matmul fused with a reduce-scatter (per device, under `jax.shard_map`).

Every device holds a partial product `lhs @ rhs` (e.g. the embed
contraction split over the ring); the goal is block d of its sum over the
ring, block d taken along the output dimension `scatter` (a letter of the
rhs, i.e. of the weights):

  out_d = sum over devices of einsum(eq, lhs, rhs[block d of scatter])

The naive twin computes the whole product and calls `lax.psum_scatter`. The
fused forms compute one block at a time and pass a partial sum around the
ring while the next block's matmul runs (N = ring size, d = ring index):

  one_way     step s computes block (d - 1 - s) mod N, adds the partial
              sum received from d - 1 and sends it to d + 1: N matmuls,
              N - 1 sequential hops.
  latency     step j computes two blocks in one matmul of twice the size;
              the first joins a sum travelling +1, the second one
              travelling -1: N/2 steps and N/2 sequential hops. N even.
  throughput  the output is split in halves along `subsplit` (a letter of
              the rhs and the output; by default halves of each `scatter`
              block); one half travels +1, the other -1, so each link
              carries half the bytes: N - 1 hops.

Every form reads piece s (of N, or N/2 for latency) at step s: its weights
are reordered once, per device, by the matching `shuffle_*` function, so
the schedule reads fixed pieces instead of device-dependent slices; cut
into those pieces (`ring.split`), each is read in place.

All functions are per device and take mesh axis names; a ring of size 1
(or no axes) is a plain einsum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise.collectives import ring
from chunkwise.collectives.ring import Axes
from chunkwise.contract import contract


def _letters(eq: str, scatter: str):
  lhs, rhs, out = ring.parse(eq)
  if scatter not in rhs or scatter not in out or scatter in lhs:
    raise ValueError(
      f"einsum {eq!r}: the scattered letter {scatter!r} must appear in the "
      "rhs and the output only"
    )
  return lhs, rhs, out


def matmul_reducescatter_naive(
  eq: str, lhs: jax.Array, rhs: jax.Array, *, axes: Axes, scatter: str
) -> jax.Array:
  """einsum, then `lax.psum_scatter` over `axes` along `scatter`."""
  _, _, out = _letters(eq, scatter)
  product = contract(eq, lhs, rhs)
  if not axes:
    return product
  return lax.psum_scatter(
    product, tuple(axes), scatter_dimension=out.index(scatter), tiled=True
  )


def matmul_reducescatter_one_way(
  eq: str, lhs: jax.Array, rhs: ring.Rhs, *, axes: Axes, scatter: str
) -> jax.Array:
  """One-way ring; `rhs` shuffled by `shuffle_for_reducescatter_one_way`."""
  _, rletters, _ = _letters(eq, scatter)
  n = ring.size(axes)
  if n == 1:
    return contract(eq, lhs, ring.join(rhs, 0))
  dim = rletters.index(scatter)
  ring.block_size(rhs, dim, n, "matmul_reducescatter_one_way rhs")

  def part(s):  # original block (d - 1 - s) mod N
    return contract(eq, lhs, ring.step_piece(rhs, dim, s, n))

  acc = part(0)
  for s in range(1, n):
    p = part(s)  # independent of the hop: overlaps with it
    acc = ring.shift(acc, axes, +1) + p
  return acc


def matmul_reducescatter_latency(
  eq: str, lhs: jax.Array, rhs: ring.Rhs, *, axes: Axes, scatter: str
) -> jax.Array:
  """Two blocks per step, two sums in opposite directions; `rhs` shuffled
  by `shuffle_for_reducescatter_latency`."""
  _, rletters, out = _letters(eq, scatter)
  n = ring.size(axes)
  if n == 1:
    return contract(eq, lhs, ring.join(rhs, 0))
  if n % 2:
    raise ValueError(
      f"matmul_reducescatter_latency: ring {axes} has odd size {n}; the "
      "latency form pairs blocks and needs an even ring"
    )
  dim, odim = rletters.index(scatter), out.index(scatter)
  ring.block_size(rhs, dim, n, "matmul_reducescatter_latency rhs")

  def part(j):  # [block a_j, block b_j] along `scatter`
    p = contract(eq, lhs, ring.step_piece(rhs, dim, j, n // 2))
    return jnp.split(p, 2, axis=odim)

  plus, minus = part(0)
  for j in range(1, n // 2):
    p_plus, p_minus = part(j)
    plus = ring.shift(plus, axes, +1) + p_plus
    minus = ring.shift(minus, axes, -1) + p_minus
  return ring.shift(plus, axes, +1) + minus


def matmul_reducescatter_throughput(
  eq: str,
  lhs: jax.Array,
  rhs: ring.Rhs,
  *,
  axes: Axes,
  scatter: str,
  subsplit: str | None = None,
) -> jax.Array:
  """Halves of the output in opposite directions; `rhs` shuffled by
  `shuffle_for_reducescatter_throughput` with the same `subsplit`."""
  _, rletters, out = _letters(eq, scatter)
  subsplit = subsplit or scatter
  _subsplit_dim(eq, scatter, subsplit)
  n = ring.size(axes)
  if n == 1:
    return contract(eq, lhs, ring.join(rhs, 0))
  dim, sdim = rletters.index(scatter), out.index(subsplit)
  ring.block_size(rhs, dim, n, "matmul_reducescatter_throughput rhs")

  def part(s):
    p = contract(eq, lhs, ring.step_piece(rhs, dim, s, n))
    return ring.halves(p, sdim, "matmul_reducescatter_throughput output")

  plus, minus = part(0)
  for s in range(1, n):
    p_plus, p_minus = part(s)
    plus = ring.shift(plus, axes, +1) + p_plus
    minus = ring.shift(minus, axes, -1) + p_minus
  return jnp.concatenate([plus, minus], axis=sdim)


def _subsplit_dim(eq: str, scatter: str, subsplit: str) -> int:
  _, rletters, out = ring.parse(eq)
  if subsplit not in rletters or subsplit not in out:
    raise ValueError(
      f"einsum {eq!r}: subsplit letter {subsplit!r} must appear in the rhs "
      "and the output"
    )
  return rletters.index(subsplit)


def shuffle_for_reducescatter_one_way(
  rhs: jax.Array, *, axes: Axes, dim: int
) -> jax.Array:
  """Per device: block s along `dim` becomes original block
  (d - 1 - s) mod N."""
  n = ring.size(axes)
  if n == 1:
    return rhs
  ring.block_size(rhs, dim, n, "shuffle_for_reducescatter_one_way")
  d = ring.index(axes)
  return ring.take_blocks(rhs, dim, n, (d - 1 - jnp.arange(n)) % n)


def shuffle_for_reducescatter_latency(
  rhs: jax.Array, *, axes: Axes, dim: int
) -> jax.Array:
  """Per device: chunk j (blocks 2j, 2j+1 along `dim`) becomes the original
  blocks [(d - j - N/2) mod N, (d + j + N/2 + 1) mod N]."""
  n = ring.size(axes)
  if n == 1:
    return rhs
  if n % 2:
    raise ValueError(
      f"shuffle_for_reducescatter_latency: ring {axes} has odd size {n}"
    )
  ring.block_size(rhs, dim, n, "shuffle_for_reducescatter_latency")
  d = ring.index(axes)
  order = []
  for j in range(n // 2):
    order += [(d - j - n // 2) % n, (d + j + n // 2 + 1) % n]
  return ring.take_blocks(rhs, dim, n, jnp.stack(order))


def shuffle_for_reducescatter_throughput(
  rhs: jax.Array, *, axes: Axes, dim: int, subdim: int | None = None
) -> jax.Array:
  """Per device: block s along `dim` takes its first half along `subdim`
  from original block (d - 1 - s) mod N and its second half from block
  (d + 1 + s) mod N (`subdim` defaults to `dim`: halves of each block)."""
  n = ring.size(axes)
  if n == 1:
    return rhs
  ring.block_size(rhs, dim, n, "shuffle_for_reducescatter_throughput")
  d = ring.index(axes)
  steps = jnp.arange(n)
  plus = ring.take_blocks(rhs, dim, n, (d - 1 - steps) % n)
  minus = ring.take_blocks(rhs, dim, n, (d + 1 + steps) % n)
  subdim = dim if subdim is None else subdim
  return ring.combine_halves(plus, minus, dim, subdim, n)
