"""Collective matmuls: matmuls fused with their all-gather or reduce-scatter,
scheduled around a ring of devices so communication overlaps compute
(Pope et al., 2023, §3.3 and appendix A), with the weight pre-shuffles the
bidirectional forms need.

Per-device functions for code under `jax.shard_map`; they take mesh axis
names and import nothing else of chunkwise. Each fused form has a naive
twin (`*_naive`: XLA's collective plus einsum) that tests compare it with.
Variants are `Collectives` members (`Layout.collectives`; their
lower-case names are accepted too):

  XLA         the naive twin; plain weights
  ONE_WAY     one ring direction
  LATENCY     half the sequential hops, double-size matmuls
  THROUGHPUT  both ring directions, half the bytes per link

The ring forms read one weight piece per step (`pieces` of them), in an
order that depends on the device: their weights are shuffled once per
device, and best cut into those pieces (`ring.split`) so that each step
reads its piece in place instead of slicing it out of the weight:

  lat = Collectives.LATENCY
  wq_shuffled = shuffle_for_reducescatter(lat, wq, axes=("x",), dim=1)
  wq_pieces = ring.split(wq_shuffled, 1, pieces(lat, ring_size))
  y = matmul_reducescatter(lat, "bte,ehd->bthd", x, wq_pieces,
                           axes=("x",), scatter="h")

The weight-gathered layout's streamed matmuls need no shuffle; their
throughput form sends each shard in halves, best cut once
(`split_for_stream_throughput`).
"""

from __future__ import annotations

import jax

from chunkwise.collectives.all_gather import (
  allgather_matmul_latency,
  allgather_matmul_naive,
  allgather_matmul_one_way,
  allgather_matmul_throughput,
  shuffle_for_allgather_latency,
  shuffle_for_allgather_one_way,
  shuffle_for_allgather_throughput,
)
from chunkwise.collectives.reduce_scatter import (
  matmul_reducescatter_latency,
  matmul_reducescatter_naive,
  matmul_reducescatter_one_way,
  matmul_reducescatter_throughput,
  shuffle_for_reducescatter_latency,
  shuffle_for_reducescatter_one_way,
  shuffle_for_reducescatter_throughput,
)
from chunkwise.collectives.ring import Axes
from chunkwise.collectives.streaming import (
  split_for_stream_throughput,
  stream_matmul_latency,
  stream_matmul_naive,
  stream_matmul_one_way,
  stream_matmul_throughput,
)
from chunkwise.collectives.variants import Collectives

VARIANTS = tuple(Collectives)
# Variants whose weights are reordered (and cut into pieces) per device.
SHUFFLED = tuple(c for c in Collectives if c.shuffled)


def pieces(variant: Collectives | str, n: int) -> int:
  """How many weight pieces a ring of n devices reads in `variant` (one
  per step): N/2 for latency, N for the other ring forms, 1 (the weight
  whole) for "xla" or a ring of one."""
  variant = Collectives.of(variant)
  if variant is Collectives.XLA or n == 1:
    return 1
  return n // 2 if variant is Collectives.LATENCY else n


def matmul_reducescatter(
  variant: Collectives | str,
  eq: str,
  lhs: jax.Array,
  rhs: jax.Array,
  *,
  axes: Axes,
  scatter: str,
  subsplit: str | None = None,
) -> jax.Array:
  """einsum then reduce-scatter over `axes` along output letter `scatter`,
  in the given variant (rhs shuffled for the variants in SHUFFLED)."""
  variant = Collectives.of(variant)
  kw = dict(axes=tuple(axes), scatter=scatter)
  if variant is Collectives.XLA:
    return matmul_reducescatter_naive(eq, lhs, rhs, **kw)
  if variant is Collectives.ONE_WAY:
    return matmul_reducescatter_one_way(eq, lhs, rhs, **kw)
  if variant is Collectives.LATENCY:
    return matmul_reducescatter_latency(eq, lhs, rhs, **kw)
  return matmul_reducescatter_throughput(eq, lhs, rhs, subsplit=subsplit, **kw)


def allgather_matmul(
  variant: Collectives | str,
  eq: str,
  lhs: jax.Array,
  rhs: jax.Array,
  *,
  axes: Axes,
  gather: str,
  subsplit: str | None = None,
) -> jax.Array:
  """All-gather of lhs over `axes` along contracted letter `gather`, then
  einsum, in the given variant."""
  variant = Collectives.of(variant)
  kw = dict(axes=tuple(axes), gather=gather)
  if variant is Collectives.XLA:
    return allgather_matmul_naive(eq, lhs, rhs, **kw)
  if variant is Collectives.ONE_WAY:
    return allgather_matmul_one_way(eq, lhs, rhs, **kw)
  if variant is Collectives.LATENCY:
    return allgather_matmul_latency(eq, lhs, rhs, **kw)
  return allgather_matmul_throughput(eq, lhs, rhs, subsplit=subsplit, **kw)


def stream_matmul(
  variant: Collectives | str,
  eq: str,
  lhs: jax.Array,
  rhs: jax.Array,
  *,
  rhs_axes,
) -> jax.Array:
  """einsum with a weight split over `rhs_axes`, streamed (or gathered for
  "xla")."""
  variant = Collectives.of(variant)
  if variant is Collectives.XLA:
    return stream_matmul_naive(eq, lhs, rhs, rhs_axes=rhs_axes)
  if variant is Collectives.ONE_WAY:
    return stream_matmul_one_way(eq, lhs, rhs, rhs_axes=rhs_axes)
  if variant is Collectives.LATENCY:
    return stream_matmul_latency(eq, lhs, rhs, rhs_axes=rhs_axes)
  return stream_matmul_throughput(eq, lhs, rhs, rhs_axes=rhs_axes)


def shuffle_for_reducescatter(
  variant: Collectives | str,
  rhs: jax.Array,
  *,
  axes: Axes,
  dim: int,
  subdim=None,
) -> jax.Array:
  """The rhs of `matmul_reducescatter(variant, ...)` with the scattered
  letter at `dim` (and the subsplit letter at `subdim`); unchanged for
  "xla", which reads plain weights."""
  variant = Collectives.of(variant)
  if variant is Collectives.ONE_WAY:
    return shuffle_for_reducescatter_one_way(rhs, axes=tuple(axes), dim=dim)
  if variant is Collectives.LATENCY:
    return shuffle_for_reducescatter_latency(rhs, axes=tuple(axes), dim=dim)
  if variant is Collectives.THROUGHPUT:
    return shuffle_for_reducescatter_throughput(
      rhs, axes=tuple(axes), dim=dim, subdim=subdim
    )
  return rhs


def shuffle_for_allgather(
  variant: Collectives | str,
  rhs: jax.Array,
  *,
  axes: Axes,
  dim: int,
  subdim=None,
) -> jax.Array:
  """The rhs of `allgather_matmul(variant, ...)` with the gathered letter at
  `dim` (and the subsplit letter at `subdim`)."""
  variant = Collectives.of(variant)
  if variant is Collectives.ONE_WAY:
    return shuffle_for_allgather_one_way(rhs, axes=tuple(axes), dim=dim)
  if variant is Collectives.LATENCY:
    return shuffle_for_allgather_latency(rhs, axes=tuple(axes), dim=dim)
  if variant is Collectives.THROUGHPUT:
    return shuffle_for_allgather_throughput(
      rhs, axes=tuple(axes), dim=dim, subdim=subdim
    )
  return rhs


__all__ = [
  "SHUFFLED",
  "VARIANTS",
  "Collectives",
  "allgather_matmul",
  "allgather_matmul_latency",
  "allgather_matmul_naive",
  "allgather_matmul_one_way",
  "allgather_matmul_throughput",
  "matmul_reducescatter",
  "matmul_reducescatter_latency",
  "matmul_reducescatter_naive",
  "matmul_reducescatter_one_way",
  "matmul_reducescatter_throughput",
  "pieces",
  "shuffle_for_allgather",
  "shuffle_for_allgather_latency",
  "shuffle_for_allgather_one_way",
  "shuffle_for_allgather_throughput",
  "shuffle_for_reducescatter",
  "shuffle_for_reducescatter_latency",
  "shuffle_for_reducescatter_one_way",
  "shuffle_for_reducescatter_throughput",
  "split_for_stream_throughput",
  "stream_matmul",
  "stream_matmul_latency",
  "stream_matmul_naive",
  "stream_matmul_one_way",
  "stream_matmul_throughput",
]
