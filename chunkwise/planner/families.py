"""Layout families: how one phase cuts the weights and the residual
stream on an x·y·z mesh, as the cost model (`costs`) reads it.

  s = sharding(hparams, (4, 4, 4), "ws_2d/yzx/latency", batch=64)
  s.family, s.attention, s.chips
  paper_sharding(hparams, (4, 4, 4), "wg_xy", attention="batch", batch=64)

Families (n chips = x·y·z; each one's collectives per layer are in
`communication`):
  reference  one chip, nothing cut.
  ws_1d      every matrix split over n on its heads / d_ff side.
  ws_2d      E over x, heads / d_ff over y·z.
  wg_x, wg_xy, wg_xyz
             weights stored as ws_2d and all-gathered, one matrix at a
             time, over the named axes (N chips); the batch is split over
             them and the R = n/N chips left run ws_1d on their rows. Only
             wg_xyz is a chunkwise layout (`LayoutKind.WG`); wg_x and
             wg_xy are the paper's and are modelled for comparison.
Attention is split by batch over `attn_split` chips (an all-to-all of
queries and outputs; the K/V cache divided), else by heads: K/V heads
that do not divide the head shards are then replicated (the paper's
"baseline multiquery").
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping

from chunkwise.configs import HParams

XYZ = ("x", "y", "z")


class Family(enum.Enum):
  REFERENCE = "reference"
  WS_1D = "ws_1d"
  WS_2D = "ws_2d"
  WG_X = "wg_x"
  WG_XY = "wg_xy"
  WG_XYZ = "wg_xyz"

  @property
  def gathered(self) -> tuple[str, ...]:
    """Mesh axes the weights are all-gathered over (weight-gathered)."""
    return {
      Family.WG_X: ("x",),
      Family.WG_XY: ("x", "y"),
      Family.WG_XYZ: XYZ,
    }.get(self, ())


@dataclasses.dataclass(frozen=True)
class Sharding:
  """How one phase cuts the model on a mesh."""

  family: Family
  sizes: tuple[tuple[str, int], ...]
  attn_axes: tuple[str, ...] = ()  # attention split by batch over these
  overlapped: bool = True  # collectives hidden behind matmuls (looped)
  layout: object = None  # the chunkwise Layout, when the family has one
  heads: int = 0  # query heads after padding (0: the model's)

  @property
  def chips(self) -> int:
    return math.prod(dict(self.sizes).values())

  def size(self, axes) -> int:
    sizes = dict(self.sizes)
    return math.prod(sizes[a] for a in axes)

  @property
  def attention(self) -> str:
    return "batch" if self.size(self.attn_axes) > 1 else "head"

  def __str__(self) -> str:
    if self.layout is not None:
      return str(self.layout)
    return f"{self.family.value}/attn-{self.attention}"


def mesh_sizes(mesh_shape) -> tuple[tuple[str, int], ...]:
  shape = tuple(int(s) for s in mesh_shape)
  if len(shape) != 3 or min(shape) < 1:
    raise ValueError(
      f"mesh_shape must be three positive sizes (x, y, z), got {mesh_shape!r}"
    )
  return tuple(zip(XYZ, shape, strict=True))


def sharding(
  hparams: HParams, mesh_shape, layout, *, batch: int, prefix_batch=None
) -> Sharding:
  """The sharding chunkwise runs for `layout` (a `Layout` or its string)
  on a mesh of `mesh_shape` with `batch` rows: the attention batch split
  that `partitioning.Plan` picks for that batch. Raises ValueError when
  the layout cannot run there (`partitioning.plan.check`'s message)."""
  from jax.sharding import AbstractMesh

  from chunkwise.partitioning import Layout, LayoutKind
  from chunkwise.partitioning import plan as plan_lib

  sizes = mesh_sizes(mesh_shape)
  layout = Layout.parse(layout)
  mesh = AbstractMesh(tuple(s for _, s in sizes), XYZ)
  if layout.kind is LayoutKind.REFERENCE:
    if math.prod(s for _, s in sizes) != 1:
      raise ValueError(
        f"the reference layout runs on one chip, not a {mesh_shape} mesh"
      )
    return Sharding(Family.REFERENCE, sizes, layout=layout)
  plan_lib.check(layout, mesh, hparams)
  prefixes = () if prefix_batch is None else (prefix_batch,)
  plan = plan_lib.Plan.make(
    layout, mesh, hparams, batch=batch, prefix_batches=prefixes
  )
  family = {
    LayoutKind.WS_1D: Family.WS_1D,
    LayoutKind.WS_2D: Family.WS_2D,
    LayoutKind.WG: Family.WG_XYZ,
  }[layout.kind]
  from chunkwise.collectives import Collectives

  return Sharding(
    family,
    sizes,
    attn_axes=tuple(plan.attn_batch),
    overlapped=layout.collectives is not Collectives.XLA,
    layout=layout,
  )


def paper_sharding(
  hparams: HParams, mesh_shape, family, *, attention: str, batch: int
) -> Sharding:
  """A family as the paper runs it: looped collectives, heads padded up
  to a multiple of the head shards, attention by `attention` ("head" or
  "batch": split over as many chips as the batch allows)."""
  family = Family(family)
  sizes = mesh_sizes(mesh_shape)
  n = math.prod(s for _, s in sizes)
  shards = _head_shards(family, dict(sizes))
  heads = -(-hparams.heads // shards) * shards
  attn: tuple[str, ...] = ()
  if attention == "batch" or family is Family.WG_XYZ:
    chosen: list[str] = []
    for a, s in sizes:
      if s > 1 and batch % (math.prod(dict(sizes)[c] for c in chosen) * s) == 0:
        chosen.append(a)
    attn = tuple(chosen)
  elif attention != "head":
    raise ValueError(f"attention must be 'head' or 'batch', got {attention!r}")
  del n
  return Sharding(family, sizes, attn_axes=attn, overlapped=True, heads=heads)


def _head_shards(family: Family, sizes: Mapping[str, int]) -> int:
  if family is Family.REFERENCE:
    return 1
  if family is Family.WS_1D:
    return math.prod(sizes.values())
  rest = [a for a in XYZ if a not in family.gathered]
  if family is Family.WS_2D:
    return math.prod(sizes.values())  # queries cut over y·z, then x
  return math.prod(sizes[a] for a in rest) if rest else 1
