"""What a value and a layer take: bytes per value of each dtype (int8
weights and K/V counting their f32 scales) and the model's widths as the
cost model's arithmetic reads them (`Shapes`).
"""

from __future__ import annotations

import dataclasses

from chunkwise.configs import Block, HParams
from chunkwise.models import blocks

DTYPE_BYTES = {
  "int8": 1,
  "bf16": 2,
  "bfloat16": 2,
  "f16": 2,
  "float16": 2,
  "f32": 4,
  "float32": 4,
}


def dtype_bytes(name) -> int:
  key = getattr(name, "name", name)
  key = str(key).lower()
  if key not in DTYPE_BYTES:
    raise ValueError(
      f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_BYTES)}"
    )
  return DTYPE_BYTES[key]


def kv_bytes_per_value(name, head_dim: int) -> float:
  """Bytes a K/V cache of dtype `name` holds per key (or value) element:
  int8 K/V also keeps a 4-byte f32 scale per token and head
  (`chunkwise.models.kv_int8`)."""
  size = dtype_bytes(name)
  return size * (1 + 4 / head_dim) if size == 1 else float(size)


# int8 weights carry an f32 scale per group of at most 128 inputs
# (`models.quantized`).
INT8_GROUP = 128


def weight_bytes_per_value(name) -> float:
  """Bytes a stored weight value takes: int8 counts its group scales; a
  GGUF block type kept natively ("Q4_K", `models.blocks`) its codes, f16
  scales and offsets."""
  if str(name).upper() in blocks.FORMATS:
    return blocks.bytes_per_value(str(name).upper())
  size = dtype_bytes(name)
  return size + 4 / INT8_GROUP if size == 1 else float(size)


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The sizes the arithmetic reads, from HParams (heads maybe padded)."""

  layers: int
  E: int
  F: int
  H: int
  Hkv: int
  K: int
  V: int
  sequential: bool
  params: int  # the model's own count (MFU's numerator)
  widths: tuple[int, int] | None = None  # (in, out) if not the layer's
  tied: bool = True  # one [V, E] table embeds and unembeds

  @classmethod
  def of(cls, h: HParams, heads: int = 0) -> Shapes:
    return cls(
      layers=h.layers,
      E=h.d_model,
      F=h.d_ff,
      H=heads or h.heads,
      Hkv=h.kv_heads,
      K=h.head_dim,
      V=h.vocab,
      sequential=h.block is Block.SEQUENTIAL,
      params=h.num_params(),
      tied=h.tied_embeddings,
    )

  @property
  def in_width(self) -> int:
    if self.widths:
      return self.widths[0]
    return 2 * self.F + (self.H + 2 * self.Hkv) * self.K

  @property
  def out_width(self) -> int:
    if self.widths:
      return self.widths[1]
    return self.F + self.H * self.K

  @property
  def layer_params(self) -> int:
    return self.E * (self.in_width + self.out_width)

  @property
  def largest_matrix(self) -> int:
    return self.E * max(self.F, self.H * self.K)

  @property
  def kv_width(self) -> int:
    """K and V values per token per layer."""
    return 2 * self.Hkv * self.K
