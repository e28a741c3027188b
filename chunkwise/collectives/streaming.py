"""Weight-streaming matmuls of the weight-gathered layout (per device).

Activations stay put (each device holds its own rows, every feature); the
weight is split over mesh axes (`rhs_axes[i]`: the axes splitting rhs
dimension i, e.g. q [E.X, H.YZ, D] has (("x",), ("y", "z"), ())). Instead
of all-gathering the weight (the naive twin), its shards travel around the
ring of all those axes and each device multiplies its activations with
every shard as it passes: a contracted dimension picks the matching slice
of the lhs, an output dimension places the product at the shard's offset.
This serves the q / wi projections (shards contract over embed, place
heads or d_ff) and o / wo (contract heads or d_ff, place embed) alike.

  one_way     shards travel +1: N steps, N - 1 hops.
  latency     copies travel +1 and -1, two shards per step: about N/2
              hops.
  throughput  each shard is halved along `subsplit` (an rhs letter); the
              halves travel in opposite directions: half the bytes per
              link, N - 1 hops.

A device computes which shard it holds from the ring position, so no form
needs shuffled weights. The throughput form sends halves of the shard: cut
once (`split_for_stream_throughput`, a `Halves`) they are read in place;
an array is halved at every call (a copy of the shard).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise.collectives import ring
from chunkwise.collectives.ring import Axes
from chunkwise.contract import contract


def stream_matmul_naive(
  eq: str, lhs: jax.Array, rhs: jax.Array, *, rhs_axes: Sequence[Axes]
) -> jax.Array:
  """All-gathers the weight over its axes, then einsum."""
  for dim, axes in enumerate(rhs_axes):
    if axes:
      rhs = lax.all_gather(rhs, tuple(axes), axis=dim, tiled=True)
  return contract(eq, lhs, rhs)


@dataclasses.dataclass(frozen=True)
class Halves:
  """A weight shard cut in two along `dim` (a pytree of the halves)."""

  first: jax.Array
  second: jax.Array
  dim: int = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    return ring.whole_shape((self.first, self.second), self.dim)

  @property
  def ndim(self) -> int:
    return self.first.ndim

  @property
  def dtype(self):
    return self.first.dtype

  def astype(self, dtype) -> Halves:
    return Halves(self.first.astype(dtype), self.second.astype(dtype), self.dim)


jax.tree_util.register_dataclass(Halves)


def halving_dim(shape: Sequence[int]) -> int:
  """The rhs dimension the throughput form halves: the first of even size."""
  even = [i for i, size in enumerate(shape) if size % 2 == 0]
  if not even:
    raise ValueError(
      f"stream_matmul_throughput: no rhs dimension of {tuple(shape)} can be "
      "halved"
    )
  return even[0]


def split_for_stream_throughput(rhs: jax.Array) -> Halves:
  """A weight shard cut once into the halves `stream_matmul_throughput`
  sends, along `halving_dim`."""
  dim = halving_dim(rhs.shape)
  return Halves(*ring.halves(rhs, dim, "split_for_stream_throughput"), dim)


class _Stream:
  """Where a shard (or half shard) from a given ring position goes."""

  def __init__(self, eq, lhs, rhs, rhs_axes):
    self.eq = eq
    self.lletters, self.rletters, self.out = ring.parse(eq)
    if len(rhs_axes) != rhs.ndim:
      raise ValueError(
        f"rhs_axes {rhs_axes} must name axes for each of the rhs's "
        f"{rhs.ndim} dimensions"
      )
    for letter, axes in zip(self.rletters, rhs_axes, strict=True):
      if axes and letter not in self.out and letter not in self.lletters:
        raise ValueError(f"einsum {eq!r}: rhs letter {letter!r} is summed")
    self.lhs = lhs
    self.rhs_axes = tuple(tuple(a) for a in rhs_axes)
    self.axes = ring.ordered(self.rhs_axes)
    self.n = ring.size(self.axes)
    self.d = ring.index(self.axes)
    self.local = rhs.shape
    full = {}
    for letter, dim in zip(self.lletters, lhs.shape, strict=True):
      full[letter] = dim
    for letter, dim, axes in zip(
      self.rletters, rhs.shape, self.rhs_axes, strict=True
    ):
      full[letter] = dim * ring.size(axes)
    self.out_shape = tuple(full[c] for c in self.out)
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    self.acc = jnp.zeros(self.out_shape, dtype)

  def _coords(self, src):
    """Coordinates of ring position `src` on each of the ring's axes."""
    coords, rest = {}, src
    for a in reversed(self.axes):
      size = lax.axis_size(a)
      coords[a] = rest % size
      rest = rest // size
    return coords

  def add(self, piece, src, half: tuple[int, int] | None = None):
    """Adds the product of `piece`, the shard of ring position `src` (or
    half `half[1]` of it along rhs dimension `half[0]`)."""
    coords = self._coords(src % self.n)
    lhs = self.lhs
    out_start = [0] * len(self.out)
    for dim, (letter, axes) in enumerate(
      zip(self.rletters, self.rhs_axes, strict=True)
    ):
      start = jnp.int32(0)
      for a in axes:
        start = start * lax.axis_size(a) + coords[a]
      start = start * self.local[dim]
      if half is not None and half[0] == dim:
        start = start + half[1] * piece.shape[dim]
      elif not axes:
        continue
      if letter in self.out:
        out_start[self.out.index(letter)] = start
      if letter in self.lletters:
        lhs = lax.dynamic_slice_in_dim(
          lhs, start, piece.shape[dim], axis=self.lletters.index(letter)
        )
    p = contract(self.eq, lhs, piece)
    old = lax.dynamic_slice(self.acc, out_start, p.shape)
    self.acc = lax.dynamic_update_slice(self.acc, old + p, out_start)


def stream_matmul_one_way(eq, lhs, rhs, *, rhs_axes):
  """Shards travel +1 around the ring."""
  st = _Stream(eq, lhs, rhs, rhs_axes)
  cur = rhs
  for s in range(st.n):
    if s:
      cur = ring.shift(cur, st.axes, +1)
    st.add(cur, st.d - s)
  return st.acc


def stream_matmul_latency(eq, lhs, rhs, *, rhs_axes):
  """Copies travel both ways; two shards per step."""
  st = _Stream(eq, lhs, rhs, rhs_axes)
  st.add(rhs, st.d)
  fwd = bwd = rhs
  for k in range(1, st.n // 2 + 1):
    fwd = ring.shift(fwd, st.axes, +1)
    st.add(fwd, st.d - k)
    if k < st.n - k:
      bwd = ring.shift(bwd, st.axes, -1)
      st.add(bwd, st.d + k)
  return st.acc


def stream_matmul_throughput(eq, lhs, rhs, *, rhs_axes, subsplit=None):
  """Halves of each shard travel in opposite directions. `rhs` is the
  shard, halved here along `subsplit` (an rhs letter; by default
  `halving_dim`), or a `Halves` cut once, read in place."""
  st = _Stream(eq, lhs, rhs, rhs_axes)
  if isinstance(rhs, Halves):
    dim, first, second = rhs.dim, rhs.first, rhs.second
  else:
    dim = (
      halving_dim(rhs.shape)
      if subsplit is None
      else st.rletters.index(subsplit)
    )
    first, second = ring.halves(rhs, dim, "stream_matmul_throughput rhs")
  for s in range(st.n):
    if s:
      first = ring.shift(first, st.axes, +1)
      second = ring.shift(second, st.axes, -1)
    st.add(first, st.d - s, (dim, 0))
    st.add(second, st.d + s, (dim, 1))
  return st.acc
