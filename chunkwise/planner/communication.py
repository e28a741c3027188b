"""The collectives of one layer per layout family (`families`), and their
time on the chip's links.

Per layer (notation as in `costs`):
  ws_1d   an all-gather and a reduce-scatter of [BL, E] over x·y·z.
  ws_2d   all-gather over yz of [BL, E/X], reduce-scatter over x of
          [BL, in_width/YZ], all-gather over x of [BL, out_width/YZ],
          reduce-scatter over yz of [BL, E/X] (a sequential block does
          the E pair twice).
  wg_*    each stored matrix all-gathered over the family's axes to a 1/R
          piece of itself, then ws_1d's pair over the other axes on the
          BL/N rows.
Attention split by batch adds an all-to-all of queries and one of
outputs. Bytes are counted on the full-size side of each collective (an
all-gather's result, a reduce-scatter's operand, an all-to-all's
operand): a ring moves (k-1)/k of it.
"""

from __future__ import annotations

import dataclasses
import math

from chunkwise.planner.families import XYZ, Family, Sharding
from chunkwise.planner.sizes import Shapes


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str  # "all-gather" | "reduce-scatter" | "all-to-all"
  axes: tuple[str, ...]
  bytes: float  # full-size side, per chip
  weights: bool = False  # gathers weights (can run a layer ahead)


def ring(kind, axes, nbytes, weights, sizes, hw):
  """(Collective, seconds at the links' peak, ring steps), or Nones."""
  k = math.prod(sizes[a] for a in axes)
  if k <= 1 or nbytes <= 0:
    return None, 0.0, 0.0
  seconds = nbytes * (k - 1) / k / hw.collective_bandwidth(axes, sizes)
  c = Collective(kind, tuple(axes), nbytes, weights)
  return c, seconds, hw.hops(axes, sizes)


def layer_collectives(s: Sharding, m: Shapes, tokens: float, ab: int, wb):
  """(kind, axes, full-size bytes, gathers weights) of one layer's
  collectives."""
  sizes = dict(s.sizes)
  f = s.family
  e_pairs = 2 if m.sequential else 1
  out = []
  n = s.chips
  if f is Family.WS_1D:
    for _ in range(e_pairs):
      out.append(("all-gather", XYZ, tokens * m.E * ab, False))
      out.append(("reduce-scatter", XYZ, tokens * m.E * ab, False))
  elif f is Family.WS_2D:
    X, YZ = sizes["x"], sizes["y"] * sizes["z"]
    for _ in range(e_pairs):
      out.append(("all-gather", ("y", "z"), tokens * m.E / X * ab, False))
      out.append(("reduce-scatter", ("y", "z"), tokens * m.E / X * ab, False))
    out.append(("reduce-scatter", ("x",), tokens * m.in_width / YZ * ab, False))
    out.append(("all-gather", ("x",), tokens * m.out_width / YZ * ab, False))
  elif f.gathered:
    N = s.size(f.gathered)
    rest = tuple(a for a in XYZ if a not in f.gathered)
    R = n // N
    # Each stored matrix is gathered to a 1/R piece of itself.
    out.append(("all-gather", f.gathered, m.layer_params * wb / R, True))
    rows = tokens / N
    for _ in range(e_pairs):
      out.append(("all-gather", rest, rows * m.E * ab, False))
      out.append(("reduce-scatter", rest, rows * m.E * ab, False))
  if s.size(s.attn_axes) > 1 and f in (Family.WS_1D, Family.WS_2D):
    # Queries to their rows' devices and outputs back.
    q = tokens * m.H * m.K * ab / n
    out.append(("all-to-all", s.attn_axes, q, False))
    out.append(("all-to-all", s.attn_axes, q, False))
  return out
