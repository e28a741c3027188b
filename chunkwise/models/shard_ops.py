"""Per-device helpers for code running under `jax.shard_map`.

Every collective takes a tuple of mesh axes and is the identity for an
empty tuple, so one function serves all layouts (and a mesh axis of size 1
costs nothing). Blocks are taken in the order of the axes given: the block
index over ("y", "z") is y * |z| + z, as in `PartitionSpec(("y", "z"))`.

  x = all_gather(x, ("y",), axis=2)           # [B, T, E.XY] -> [B, T, E.X]
  x = psum_scatter(x, ("x",), axis=2)         # {x unreduced} -> split on x
  rows = local_rows(lengths, n, index(axes))  # replicated rows -> my rows
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

Axes = tuple[str, ...]


def index(axes: Axes) -> jax.Array:
  """This device's block index over `axes` (0 for no axes)."""
  return lax.axis_index(tuple(axes)) if axes else jnp.int32(0)


def index_with(
  axes: Axes, sizes: Mapping[str, int], fixed: Mapping[str, int]
) -> jax.Array:
  """The block index over `axes` of the device that differs from this one
  only in the coordinates `fixed` gives (axis -> coordinate)."""
  out = jnp.int32(0)
  for a in axes:
    coord = fixed[a] if a in fixed else lax.axis_index(a)
    out = out * sizes[a] + coord
  return out


def static_index(
  axes: Axes, sizes: Mapping[str, int], fixed: Mapping[str, int]
) -> int:
  """`index_with` where `fixed` gives every axis, as a Python int (under
  jit `index_with`'s jnp arithmetic is traced even on constants)."""
  out = 0
  for a in axes:
    out = out * sizes[a] + fixed[a]
  return out


def coordinates(axes: Axes, sizes: Mapping[str, int]):
  """Every coordinate combination of `axes`, in block-index order."""
  for combo in itertools.product(*(range(sizes[a]) for a in axes)):
    yield dict(zip(axes, combo, strict=True))


def all_gather(x: jax.Array, axes: Axes, axis: int) -> jax.Array:
  if not axes:
    return x
  return lax.all_gather(x, tuple(axes), axis=axis, tiled=True)


def psum(x: jax.Array, axes: Axes) -> jax.Array:
  return lax.psum(x, tuple(axes)) if axes else x


def pmax(x: jax.Array, axes: Axes) -> jax.Array:
  return lax.pmax(x, tuple(axes)) if axes else x


def psum_scatter(x: jax.Array, axes: Axes, axis: int) -> jax.Array:
  if not axes:
    return x
  return lax.psum_scatter(x, tuple(axes), scatter_dimension=axis, tiled=True)


def all_to_all(x: jax.Array, axes: Axes, split: int, concat: int) -> jax.Array:
  """Splits `split` over `axes` and joins their blocks along `concat`."""
  if not axes:
    return x
  return lax.all_to_all(x, tuple(axes), split, concat, tiled=True)


def block(x: jax.Array, n: int, i: jax.Array, axis: int) -> jax.Array:
  """Block `i` of `n` equal blocks of `x` along `axis`."""
  if n == 1:
    return x
  size = x.shape[axis] // n
  return lax.dynamic_slice_in_dim(x, i * size, size, axis=axis)


def local_rows(x: jax.Array, n: int, i: jax.Array, axis: int = 0) -> jax.Array:
  """The rows of a replicated array that serve block `i` of `n` when a
  batch is split in `n` blocks and `x`'s rows are broadcast to it ("repeat
  each", DESIGN.md §4.4). `x` has b rows with b % n == 0 (its own block)
  or n % b == 0 (the one row every local row reads)."""
  b = x.shape[axis]
  if n == 1:
    return x
  if b % n == 0:
    return block(x, n, i, axis)
  if n % b:
    raise ValueError(f"{b} rows cannot serve {n} blocks: neither divides")
  return lax.dynamic_slice_in_dim(x, i // (n // b), 1, axis=axis)


def gather_weights(tree, specs, rules: Mapping[str, Sequence[str]]):
  """All-gathers every leaf of `tree` along the mesh axes its logical spec
  (a PartitionSpec leaf of `specs`, same tree) maps to: a sharded layer's
  weights made whole, as the weight-gathered layout needs."""
  leaves, treedef = jax.tree.flatten(tree)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
  out = []
  for leaf, spec in zip(leaves, spec_leaves, strict=True):
    for dim, name in enumerate(spec):
      axes = tuple(rules[name]) if name is not None else ()
      leaf = all_gather(leaf, axes, axis=dim)
    out.append(leaf)
  return jax.tree.unflatten(treedef, out)


def size(axes: Axes, sizes: Mapping[str, int]) -> int:
  return math.prod(sizes[a] for a in axes)
