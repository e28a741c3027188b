"""How `tiled_matmul` reads a weight: `Stored`, a weight as the kernel
takes it (a float array, int8 codes with group scales, or GGUF blocks of 4-
or 8-bit codes with f16 scales and offsets; k-major, or n-major for a tied
float table; [K, H, D] for a projection's heads), and `tiles`, the (k, n)
tiles the kernel's grid walks over it.

  stored = Stored.of(w)          # ValueError naming any other weight
  tk, tn = tiles(stored)         # codes' rows a k tile, outputs a tile
  heads_as_stored(w)             # read [K, H, D] as stored, not 2-D
"""

from __future__ import annotations

import dataclasses
import math

import jax

# Tile sizes: outputs per tile (lanes), inputs per tile (codes' rows).
TILE_N = 512
TILE_K = 512


@dataclasses.dataclass(frozen=True)
class Stored:
  """A k-major weight as the kernel reads it: `codes` [K / per_byte, N]
  (float, int8, or uint8 holding two 4-bit codes along K: entry 2i low,
  2i + 1 high), `scale` and `offset` [K / group, N] or None, `group`
  inputs per scale."""

  codes: jax.Array
  scale: jax.Array | None
  offset: jax.Array | None
  group: int
  bits: int | None  # 4 or 8 for codes, None for a float weight
  nmajor: bool = False  # a float weight stored [N, K]

  @property
  def k(self) -> int:
    if self.nmajor:
      return self.codes.shape[1]
    return self.codes.shape[0] * (2 if self.bits == 4 else 1)

  @property
  def n(self) -> int:
    if self.heads:
      return self.heads * self.codes.shape[2]
    return self.codes.shape[0 if self.nmajor else 1]

  @property
  def heads(self) -> int:
    """H of a [K, H, D] weight read as it is stored; 0 for 2-D."""
    return self.codes.shape[1] if self.codes.ndim == 3 else 0

  @classmethod
  def of(cls, w, nmajor: bool = False) -> Stored:
    """A 2-D k-major weight: an array, an int8 QArray (`values`, `scale`)
    or a BlockArray (with `bits`, `axis`) whose blocks run along axis 0;
    with `nmajor`, a float array [N, K]; a [K, H, D] weight, float or
    int8 with f32 scales [G, H, D] (`heads_as_stored`: heads of a
    projection, read as stored; one head as [K, D]). ValueError naming
    anything else."""
    if _heads_form(w, nmajor):
      scaled = hasattr(w, "scale")  # int8 [K, H, D], f32 scales [G, H, D]
      codes, scale = (w.values, w.scale) if scaled else (w, None)
      if not heads_as_stored(w, nmajor):  # one head: [K, D], free
        codes = codes.reshape(codes.shape[0], -1)
        scale = None if scale is None else scale.reshape(scale.shape[0], -1)
      group = w.shape[0] // scale.shape[0] if scaled else w.shape[0]
      return cls(codes, scale, None, group, 8 if scaled else None)
    if w.ndim != 2:
      raise ValueError(
        f"tpu_kernels.matmul takes 2-D weights [K, N], or [K, H, D] ones "
        f"(float, or int8 with f32 scales [G, H, D]) with D a multiple of "
        f"128, got {w.shape}"
      )
    if nmajor:
      if hasattr(w, "scale"):
        raise ValueError(
          "tpu_kernels.matmul reads n-major weights in float only"
        )
      return cls(w, None, None, w.shape[1], None, nmajor=True)
    if hasattr(w, "bits"):  # models.blocks.BlockArray
      if w.axis != 0:
        raise ValueError(
          f"tpu_kernels.matmul takes blocks along K (axis 0), got axis {w.axis}"
        )
      return cls(w.values, w.scale, w.offset, w.block, w.bits)
    if hasattr(w, "scale"):  # models.quantized.QArray
      groups, n = w.scale.shape
      if n != w.shape[1]:
        raise ValueError(
          f"tpu_kernels.matmul needs a scale per output column, got scale "
          f"{w.scale.shape} for weight {w.shape}"
        )
      return cls(w.values, w.scale, None, w.shape[0] // groups, 8)
    return cls(w, None, None, w.shape[0], None)


def heads_as_stored(w, nmajor: bool = False) -> bool:
  """Whether `matmul` reads `w` as a 3-D [K, H, D] weight (q, k, v: whole
  heads a tile, as stored): a float array, or an int8 QArray with f32
  scales [G, H, D], D a multiple of 128, and more than one head. One
  head (a multiquery k or v) goes 2-D: [K, 1, D] to [K, D] is free in any
  layout, where a 3-D operand pads its one row of each (4, 128) int8 tile
  to four (PaLM 62B int8 decode: 8 MiB of copies a layer, 0.5 GiB)."""
  return _heads_form(w, nmajor) and w.shape[1] > 1


def _heads_form(w, nmajor: bool) -> bool:
  """A [K, H, D] weight `matmul` takes, any H (`heads_as_stored`)."""
  if nmajor or w.ndim != 3 or w.shape[2] % 128 or hasattr(w, "bits"):
    return False
  if not hasattr(w, "scale"):
    return True
  scale = w.scale
  return (
    scale.ndim == 3
    and tuple(scale.shape[1:]) == tuple(w.shape[1:])
    and w.shape[0] % scale.shape[0] == 0
    and scale.dtype.itemsize == 4
  )


def scales_per_tile(stored: Stored) -> bool:
  """Whether scales (and offsets) go in blocks of a k tile's groups: 16-bit
  ones do (Mosaic loads a row of them only at a static index, so a tile
  holds a multiple of their 16-row tiling), 32-bit ones stay resident for
  the whole column tile, read a row at a time at the tile's offset."""
  return stored.scale is not None and stored.scale.dtype.itemsize < 4


def tiles(stored: Stored) -> tuple[int, int]:
  """(k tile in codes' rows, n tile): the largest of at most TILE_K /
  TILE_N that divide the weight, whole groups (16 of them for per-tile
  scales), and keep the TPU's (8, 128) tiling (else the whole axis, which
  Mosaic also accepts)."""
  if stored.nmajor:  # K along lanes: 128s, else whole
    k = stored.k
    tk = next((t for t in range(TILE_K, 0, -128) if k % t == 0), k)
    tn = stored.n if stored.n <= TILE_N else TILE_N
    return tk, tn
  rows = stored.codes.shape[0]
  if stored.heads:  # whole heads: all of them up to 8, else 8 at a time
    h = stored.heads
    heads_a_tile = h if h <= 8 or h % 8 else 8
    # whole scale groups a tile (one per channel: the whole K)
    step = math.lcm(stored.group if stored.bits else 1, 128)
    tk = next(
      (t for t in range(TILE_K, 0, -128) if t % step == 0 and rows % t == 0),
      rows,
    )
    return tk, heads_a_tile * stored.codes.shape[2]
  # codes' rows per scale group (a float weight has no groups: its tiles
  # need not hold whole K, whose double-buffered [K, TILE_N] tiles were
  # 28 MiB of VMEM for a whole 14336-row weight, over v5e's 16 MiB)
  per = stored.group // (2 if stored.bits == 4 else 1) if stored.bits else 1
  step = math.lcm(per * (16 if scales_per_tile(stored) else 1), 128)
  tk = next(
    (t for t in range(TILE_K, 0, -step) if t % step == 0 and rows % t == 0),
    rows,
  )
  n = stored.n
  # Columns that 128 does not divide (a vocabulary's shard): TILE_N wide,
  # the last tile partial (Pallas pads its reads, masks its writes).
  tn = next((t for t in range(TILE_N, 0, -128) if n % t == 0), min(n, TILE_N))
  return tk, tn
