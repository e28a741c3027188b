"""All-gather fused with a matmul (per device, under `jax.shard_map`).

The lhs is split over the ring along a contracted letter `gather` (device j
holds block j); the rhs holds that letter whole. The goal is

  out = einsum(eq, all_gather(lhs along gather), rhs)
      = sum over j of einsum(eq, lhs_j, rhs[block j of gather])

The naive twin calls `lax.all_gather` then einsum. The fused forms pass lhs
blocks around the ring and multiply each with the matching rhs block while
the next one travels (N = ring size, d = ring index):

  one_way     step s holds device (d - s)'s block, received from d - 1:
              N matmuls, N - 1 sequential hops.
  latency     one hop first, so a device holds d - 1's block and its own;
              each of N/2 steps multiplies both (a matmul of twice the
              contraction) and moves one block +1 and the other -1:
              N/2 hops. N even.
  throughput  the lhs block is halved along `subsplit` (a contracted
              letter; by default halves of each `gather` block); the halves
              travel in opposite directions, so each link carries half the
              bytes: N - 1 hops.

Which rhs block a step reads depends on the device, so each form's weights
are reordered once, per device, by the matching `shuffle_*` function: step
s then reads piece s (of N, or N/2 for latency) of the shuffled rhs, or
the rhs already cut into those pieces (`ring.split`), read in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise.collectives import ring
from chunkwise.collectives.ring import Axes
from chunkwise.contract import contract


def _letters(eq: str, gather: str):
  lhs, rhs, out = ring.parse(eq)
  if gather not in lhs or gather not in rhs or gather in out:
    raise ValueError(
      f"einsum {eq!r}: the gathered letter {gather!r} must be contracted "
      "(in the lhs and rhs, not the output)"
    )
  return lhs, rhs, out


def allgather_matmul_naive(
  eq: str, lhs: jax.Array, rhs: jax.Array, *, axes: Axes, gather: str
) -> jax.Array:
  """`lax.all_gather` of lhs over `axes` along `gather`, then einsum."""
  lletters, _, _ = _letters(eq, gather)
  if axes:
    lhs = lax.all_gather(
      lhs, tuple(axes), axis=lletters.index(gather), tiled=True
    )
  return contract(eq, lhs, rhs)


def _rhs_block(eq, lhs, rhs, axes, gather, n, what):
  lletters, rletters, _ = _letters(eq, gather)
  dim = rletters.index(gather)
  m = ring.block_size(rhs, dim, n, f"{what} rhs")
  if lhs.shape[lletters.index(gather)] != m:
    raise ValueError(
      f"{what}: lhs {lhs.shape} holds {lhs.shape[lletters.index(gather)]} "
      f"of {gather!r}, expected rhs size {m * n} / ring size {n} = {m}"
    )
  return lletters, dim, m


def allgather_matmul_one_way(
  eq: str, lhs: jax.Array, rhs: ring.Rhs, *, axes: Axes, gather: str
) -> jax.Array:
  """One-way ring; `rhs` shuffled by `shuffle_for_allgather_one_way`."""
  n = ring.size(axes)
  if n == 1:
    return contract(eq, lhs, ring.join(rhs, 0))
  _, dim, _ = _rhs_block(eq, lhs, rhs, axes, gather, n, "allgather_one_way")
  acc = contract(eq, lhs, ring.step_piece(rhs, dim, 0, n))
  cur = lhs
  for s in range(1, n):
    cur = ring.shift(cur, axes, +1)  # device (d - s)'s block
    acc = acc + contract(eq, cur, ring.step_piece(rhs, dim, s, n))
  return acc


def allgather_matmul_latency(
  eq: str, lhs: jax.Array, rhs: ring.Rhs, *, axes: Axes, gather: str
) -> jax.Array:
  """Two blocks per step from both directions; `rhs` shuffled by
  `shuffle_for_allgather_latency`."""
  n = ring.size(axes)
  if n == 1:
    return contract(eq, lhs, ring.join(rhs, 0))
  if n % 2:
    raise ValueError(
      f"allgather_matmul_latency: ring {axes} has odd size {n}; the latency "
      "form pairs blocks and needs an even ring"
    )
  lletters, dim, _ = _rhs_block(
    eq, lhs, rhs, axes, gather, n, "allgather_latency"
  )
  ldim = lletters.index(gather)
  fwd = ring.shift(lhs, axes, +1)  # device d - 1's block
  bwd = lhs
  acc = None
  for j in range(n // 2):
    if j:
      fwd = ring.shift(fwd, axes, +1)  # device d - 1 - j's
      bwd = ring.shift(bwd, axes, -1)  # device d + j's
    x = jnp.concatenate([fwd, bwd], axis=ldim)
    p = contract(eq, x, ring.step_piece(rhs, dim, j, n // 2))
    acc = p if acc is None else acc + p
  return acc


def allgather_matmul_throughput(
  eq: str,
  lhs: jax.Array,
  rhs: ring.Rhs,
  *,
  axes: Axes,
  gather: str,
  subsplit: str | None = None,
) -> jax.Array:
  """Halves of each lhs block in opposite directions; `rhs` shuffled by
  `shuffle_for_allgather_throughput` with the same `subsplit`."""
  subsplit = subsplit or gather
  n = ring.size(axes)
  if n == 1:
    return contract(eq, lhs, ring.join(rhs, 0))
  lletters, dim, _ = _rhs_block(
    eq, lhs, rhs, axes, gather, n, "allgather_throughput"
  )
  _subsplit_dim(eq, gather, subsplit)
  sdim = lletters.index(subsplit)
  top, bottom = ring.halves(lhs, sdim, "allgather_throughput lhs")
  acc = None
  for s in range(n):
    if s:
      top = ring.shift(top, axes, +1)  # device d - s's first half
      bottom = ring.shift(bottom, axes, -1)  # device d + s's second half
    x = jnp.concatenate([top, bottom], axis=sdim)
    p = contract(eq, x, ring.step_piece(rhs, dim, s, n))
    acc = p if acc is None else acc + p
  return acc


def _subsplit_dim(eq: str, gather: str, subsplit: str) -> int:
  lhs, rhs, out = ring.parse(eq)
  if subsplit not in lhs or subsplit not in rhs or subsplit in out:
    raise ValueError(
      f"einsum {eq!r}: subsplit letter {subsplit!r} must be contracted (in "
      "the lhs and rhs, not the output)"
    )
  return rhs.index(subsplit)


def shuffle_for_allgather_one_way(
  rhs: jax.Array, *, axes: Axes, dim: int
) -> jax.Array:
  """Per device: block s along `dim` becomes original block (d - s) mod N."""
  n = ring.size(axes)
  if n == 1:
    return rhs
  ring.block_size(rhs, dim, n, "shuffle_for_allgather_one_way")
  d = ring.index(axes)
  return ring.take_blocks(rhs, dim, n, (d - jnp.arange(n)) % n)


def shuffle_for_allgather_latency(
  rhs: jax.Array, *, axes: Axes, dim: int
) -> jax.Array:
  """Per device: chunk j (blocks 2j, 2j+1 along `dim`) becomes the original
  blocks [(d - 1 - j) mod N, (d + j) mod N]."""
  n = ring.size(axes)
  if n == 1:
    return rhs
  if n % 2:
    raise ValueError(
      f"shuffle_for_allgather_latency: ring {axes} has odd size {n}"
    )
  ring.block_size(rhs, dim, n, "shuffle_for_allgather_latency")
  d = ring.index(axes)
  order = []
  for j in range(n // 2):
    order += [(d - 1 - j) % n, (d + j) % n]
  return ring.take_blocks(rhs, dim, n, jnp.stack(order))


def shuffle_for_allgather_throughput(
  rhs: jax.Array, *, axes: Axes, dim: int, subdim: int | None = None
) -> jax.Array:
  """Per device: block s along `dim` takes its first half along `subdim`
  from original block (d - s) mod N and its second half from block
  (d + s) mod N (`subdim` defaults to `dim`: halves of each block)."""
  n = ring.size(axes)
  if n == 1:
    return rhs
  ring.block_size(rhs, dim, n, "shuffle_for_allgather_throughput")
  d = ring.index(axes)
  steps = jnp.arange(n)
  first = ring.take_blocks(rhs, dim, n, (d - steps) % n)
  second = ring.take_blocks(rhs, dim, n, (d + steps) % n)
  subdim = dim if subdim is None else subdim
  return ring.combine_halves(first, second, dim, subdim, n)
