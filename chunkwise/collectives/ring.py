"""Ring helpers shared by the collective matmuls (per device, under
`jax.shard_map`).

A ring is a tuple of mesh axes; its devices are numbered by their block
index over those axes (`lax.axis_index(axes)`, the order `PartitionSpec`
uses), and a shift by +1 sends device d's value to device d + 1.

  n, d = size(axes), index(axes)
  x = shift(x, axes, +1)              # now holds device d - 1's value
  w = take_blocks(w, dim, n, order)   # blocks of `dim` reordered

A collective matmul reads its weight one piece per ring step. It takes
the weight (`Rhs`) either whole, the pieces consecutive along `dim` and
sliced out at each step (a copy per piece and step), or already cut into
a tuple of pieces (`split`), each read in place by its step's matmul:

  pieces = split(w, dim, count)      # once, when the weights are placed
  step_piece(pieces, dim, s, count)  # pieces[s]; a slice of an array
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

Axes = tuple[str, ...]
# A weight whole, or cut into the pieces its ring steps read (see module).
Rhs = jax.Array | tuple[jax.Array, ...]


def size(axes: Axes) -> int:
  return math.prod(lax.axis_size(a) for a in axes)


def index(axes: Axes) -> jax.Array:
  return lax.axis_index(tuple(axes)) if axes else jnp.int32(0)


def shift(x: jax.Array, axes: Axes, offset: int) -> jax.Array:
  """Device d's `x` sent to device d + offset (mod the ring size), d being
  the block index over `axes` in the order given."""
  axes = tuple(axes)
  sizes = [lax.axis_size(a) for a in axes]
  n = math.prod(sizes)
  # ppermute numbers devices in the mesh's axis order, whatever the order
  # of `axes`; translate ring positions to those numbers.
  names = jax.sharding.get_abstract_mesh().axis_names
  mesh_order = sorted(axes, key=names.index)

  def device(j):
    coords = {}
    for a, s in zip(reversed(axes), reversed(sizes), strict=True):
      coords[a], j = j % s, j // s
    out = 0
    for a in mesh_order:
      out = out * lax.axis_size(a) + coords[a]
    return out

  perm = [(device(j), device((j + offset) % n)) for j in range(n)]
  return lax.ppermute(x, axes, perm)


def parse(eq: str) -> tuple[str, str, str]:
  """'bte,ehd->bthd' -> ('bte', 'ehd', 'bthd')."""
  inputs, _, out = eq.replace(" ", "").partition("->")
  lhs, _, rhs = inputs.partition(",")
  if not out or not rhs or "." in eq:
    raise ValueError(
      f"einsum {eq!r}: expected an explicit two-operand equation like "
      "'bte,ehd->bthd'"
    )
  return lhs, rhs, out


def block_size(x: Rhs, dim: int, n: int, what: str) -> int:
  """The size of one of n blocks along `dim` of `x` (an array, or pieces
  joined along `dim`); a ValueError naming `what` when n does not divide
  it."""
  shape = whole_shape(x, dim)
  if shape[dim] % n:
    raise ValueError(
      f"{what}: dimension {dim} of shape {shape} has size {shape[dim]}, "
      f"not divisible by the ring size {n}"
    )
  return shape[dim] // n


def halves(x: jax.Array, dim: int, what: str) -> tuple[jax.Array, jax.Array]:
  if x.shape[dim] % 2:
    raise ValueError(
      f"{what}: dimension {dim} of shape {x.shape} has odd size "
      f"{x.shape[dim]}; the bidirectional form splits it in halves"
    )
  return tuple(jnp.split(x, 2, axis=dim))


def split(x: jax.Array, dim: int, count: int) -> tuple[jax.Array, ...]:
  """`x` cut into `count` equal consecutive pieces along `dim`."""
  block_size(x, dim, count, "split")
  return tuple(jnp.split(x, count, axis=dim))


def join(pieces: Rhs, dim: int) -> jax.Array:
  """`split` undone (an array is returned as is)."""
  if not isinstance(pieces, tuple):
    return pieces
  if len(pieces) == 1:  # one piece (possibly a quantized weight's)
    return pieces[0]
  return jnp.concatenate(pieces, axis=dim)


def whole_shape(rhs: Rhs, dim: int) -> tuple[int, ...]:
  """The shape of `rhs`, or of its pieces joined along `dim`."""
  if not isinstance(rhs, tuple):
    return rhs.shape
  shape = list(rhs[0].shape)
  shape[dim] = sum(p.shape[dim] for p in rhs)
  return tuple(shape)


def step_piece(rhs: Rhs, dim: int, s: int, count: int) -> jax.Array:
  """Piece s of `count` along `dim`: read in place when `rhs` is already
  split into `count` pieces, else sliced out of the array."""
  if not isinstance(rhs, tuple):
    m = block_size(rhs, dim, count, "step_piece")
    return lax.slice_in_dim(rhs, s * m, (s + 1) * m, axis=dim)
  if len(rhs) != count:
    raise ValueError(
      f"a weight cut into {len(rhs)} pieces cannot feed a ring of "
      f"{count} steps; split it for this layout"
    )
  return rhs[s]


def take_blocks(w: jax.Array, dim: int, n: int, order) -> jax.Array:
  """`w` with its n blocks along `dim` in `order` (block i <- order[i])."""
  m = w.shape[dim] // n
  split = w.reshape((*w.shape[:dim], n, m, *w.shape[dim + 1 :]))
  taken = jnp.take(split, jnp.asarray(order), axis=dim)
  return taken.reshape((*w.shape[:dim], len(order) * m, *w.shape[dim + 1 :]))


def combine_halves(
  first: jax.Array,
  second: jax.Array,
  dim: int,
  subdim: int,
  n: int,
) -> jax.Array:
  """First half along `subdim` from `first`, second half from `second`.

  When `subdim == dim` the halves are taken inside each of the n blocks of
  `dim` (each block's first half from `first`, second half from `second`).
  """
  if subdim != dim:
    a, _ = halves(first, subdim, "subsplit")
    _, b = halves(second, subdim, "subsplit")
    return jnp.concatenate([a, b], axis=subdim)
  m = first.shape[dim] // n
  shape = (*first.shape[:dim], n, 2, m // 2, *first.shape[dim + 1 :])
  if m % 2:
    raise ValueError(
      f"subsplit: blocks of size {m} along dimension {dim} cannot be halved"
    )
  a = first.reshape(shape)
  b = second.reshape(shape)
  pick = jnp.arange(2).reshape((1, 2) + (1,) * (len(shape) - dim - 2))
  return jnp.where(pick == 0, a, b).reshape(first.shape)


def ordered(axes: Sequence[Axes]) -> Axes:
  """The union of several axis tuples, in order of first appearance."""
  out: list[str] = []
  for group in axes:
    out.extend(a for a in group if a not in out)
  return tuple(out)
