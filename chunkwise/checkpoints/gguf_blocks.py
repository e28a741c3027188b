"""GGUF's quantized blocks read into `models.blocks.BlockArray` fields,
without dequantizing (the layouts are ggml's `ggml-common.h`).

  host = decode(raw_rows, "Q4_K")      # HostBlocks: NumPy codes, scales
  host.T.reshape(d, h, dh)             # the moves `hf_tensors` makes
  host.to_device()                     # a BlockArray

Codes come out one per entry in the tensor's order (NumPy [out, in], the
blocks along `in`), then 4-bit ones are packed two to a byte. Scales are
llama.cpp's d (f16) for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, so those blocks
dequantize to exactly what llama.cpp computes; the K-quants' sub-block
scale d * sc and min dmin * m are computed in f32 and rounded to f16
(relative error at most 2^-11 each).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from chunkwise.models import blocks

# GGUF type name: bytes per block of 32 (legacy) or 256 (K) entries.
_BYTES = {
  "Q4_0": 18,
  "Q4_1": 20,
  "Q5_0": 22,
  "Q5_1": 24,
  "Q8_0": 34,
  "Q4_K": 144,
  "Q5_K": 176,
  "Q6_K": 210,
}


def _f16(b: np.ndarray, start: int) -> np.ndarray:
  """The f16 at byte `start` of every block, as an [n, 1] array."""
  return b[:, start : start + 2].copy().view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
  """ggml's 32-entry nibble block: entries j (low) and j + 16 (high)."""
  return np.concatenate([qs & 15, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
  """Bit i of a little-endian uint32 (bytes [n, 4]) for i < 32: [n, 32]."""
  return np.unpackbits(qh, axis=1, bitorder="little")


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K / Q5_K's 8 six-bit scales and mins from their 12 bytes."""
  s = s.astype(np.uint8)
  sc = np.empty((s.shape[0], 8), np.uint8)
  mn = np.empty_like(sc)
  sc[:, :4] = s[:, 0:4] & 63
  mn[:, :4] = s[:, 4:8] & 63
  sc[:, 4:] = (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)
  mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
  return sc, mn


def _to_f16(x: np.ndarray, kind: str) -> np.ndarray:
  out = x.astype(np.float16)
  if not np.all(np.isfinite(out)):
    raise ValueError(f"a {kind} block's scale does not fit in f16: {x.max()}")
  return out


def _decode_blocks(b: np.ndarray, kind: str):
  """(codes [n, QK], scale [n, QK / block], offset or None) of n blocks."""
  if kind in ("Q4_0", "Q4_1"):
    d = _f16(b, 0)
    start = 2 if kind == "Q4_0" else 4
    codes = _nibbles(b[:, start : start + 16])
    offset = -8 * d if kind == "Q4_0" else _f16(b, 2)
    return codes, d, offset
  if kind in ("Q5_0", "Q5_1"):
    d = _f16(b, 0)
    start = 2 if kind == "Q5_0" else 4
    high = _high_bits(b[:, start : start + 4])
    codes = (_nibbles(b[:, start + 4 : start + 20]) | (high << 4)).astype(
      np.int8
    )
    if kind == "Q5_0":
      return codes - np.int8(16), d, None
    return codes, d, _f16(b, 2)
  if kind == "Q8_0":
    return b[:, 2:34].copy().view(np.int8), _f16(b, 0), None
  if kind in ("Q4_K", "Q5_K"):
    d = _f16(b, 0).astype(np.float32)
    dmin = _f16(b, 2).astype(np.float32)
    sc, mn = _k_scales(b[:, 4:16])
    qs = b[:, 16:144] if kind == "Q4_K" else b[:, 48:176]
    chunks = qs.reshape(-1, 4, 32)
    codes = np.stack([chunks & 15, chunks >> 4], axis=2).reshape(-1, 256)
    if kind == "Q5_K":
      high = np.unpackbits(b[:, 16:48, None], axis=2, bitorder="little")
      # bit j of qh[l] is the fifth bit of entry 32 j + l
      codes = codes | (high.transpose(0, 2, 1).reshape(-1, 256) << 4)
      codes = codes.astype(np.int8)
    scale = _to_f16(d * sc, kind)
    offset = _to_f16(-(dmin * mn), kind)
    return codes, scale, offset
  if kind == "Q6_K":
    ql = b[:, 0:128].reshape(-1, 2, 64)
    qh = b[:, 128:192].reshape(-1, 2, 32)
    lo = np.concatenate([ql & 15, ql >> 4], axis=2)  # l, l+32, l+64, l+96
    hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    codes = (lo | (hi.reshape(-1, 2, 128) << 4)).astype(np.int8) - np.int8(32)
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = _f16(b, 208).astype(np.float32)
    return codes.reshape(-1, 256), _to_f16(d * sc, kind), None
  raise _unsupported(kind)


def _unsupported(kind: str) -> ValueError:
  return ValueError(
    f"GGUF block type {kind} is not supported natively; supported: "
    f"{', '.join(_BYTES)} (or load with quantize=None to dequantize)"
  )


FLOATS = ("F32", "F16", "BF16")


def supported(kind: str) -> bool:
  return kind in _BYTES


def check_types(f, infos) -> None:
  """ValueError naming the first tensor whose type is neither a float
  nor a block format kept natively (before any tensor is read)."""
  for info in infos:
    kind = info.qtype.name
    if kind not in _BYTES and kind not in FLOATS:
      raise ValueError(
        f"{f.path}: tensor {info.name} has type {kind}, which chunkwise "
        f"cannot keep natively; supported: {', '.join(_BYTES)} and "
        f"{', '.join(FLOATS)} (quantize=None dequantizes it instead)"
      )


@dataclasses.dataclass(frozen=True)
class HostBlocks:
  """A BlockArray's fields in NumPy, with the moves a checkpoint reader
  makes of a [out, in] tensor (`.T`, `reshape`, row slices, row maps)."""

  values: np.ndarray
  scale: np.ndarray
  offset: np.ndarray | None
  axis: int
  kind: str

  @property
  def bits(self) -> int:
    return blocks.FORMATS[self.kind][0]

  @property
  def shape(self) -> tuple[int, ...]:
    return blocks.entries(self.values.shape, self.axis, self.bits)

  def _map(self, fn, axis: int) -> HostBlocks:
    offset = None if self.offset is None else fn(self.offset)
    return HostBlocks(fn(self.values), fn(self.scale), offset, axis, self.kind)

  @property
  def T(self) -> HostBlocks:
    return self._map(lambda a: a.T, self.ndim - 1 - self.axis)

  def transpose(self, axes=None) -> HostBlocks:
    """`np.transpose` of a 2-D tensor."""
    if axes is not None and tuple(axes) != (1, 0):
      raise ValueError(f"only 2-D transposes are supported, not {axes}")
    return self.T

  @property
  def ndim(self) -> int:
    return self.values.ndim

  def __getitem__(self, rows: slice) -> HostBlocks:
    """Rows (leading axis) of a tensor grouped along another axis."""
    if self.axis == 0:
      raise ValueError("cannot slice rows of a tensor along its blocks")
    return self._map(lambda a: a[rows], self.axis)

  def map_rows(self, fn) -> HostBlocks:
    """`fn` (a reorder of the leading axis) applied to every field."""
    if self.axis == 0:
      raise ValueError("cannot reorder a tensor's blocks")
    return self._map(fn, self.axis)

  def reshape(self, *shape) -> HostBlocks:
    """A reshape that splits or keeps axes: the grouped axis maps to the
    innermost new axis inside its span, which keeps whole blocks."""
    shape = tuple(shape[0]) if len(shape) == 1 else tuple(shape)
    old = self.shape
    if math.prod(shape) != math.prod(old):
      raise ValueError(f"cannot reshape {old} into {shape}")
    before = math.prod(old[: self.axis])
    span_end = before * old[self.axis]
    size, axis = 1, None
    for i, n in enumerate(shape):
      size *= n
      if size > before and size <= span_end:
        axis = i
    block = old[self.axis] // self.scale.shape[self.axis]
    if axis is None or shape[axis] % block or math.prod(shape[:axis]) < before:
      raise ValueError(f"cannot reshape {old} into {shape} by whole blocks")

    def cut(n: int):
      return tuple(m // n if i == axis else m for i, m in enumerate(shape))

    pack = 2 if self.bits == 4 else 1
    offset = None if self.offset is None else self.offset.reshape(cut(block))
    return HostBlocks(
      self.values.reshape(cut(pack)),
      self.scale.reshape(cut(block)),
      offset,
      axis,
      self.kind,
    )

  def to_device(self) -> blocks.BlockArray:
    return blocks.BlockArray(
      values=jnp.asarray(self.values),
      scale=jnp.asarray(self.scale),
      offset=None if self.offset is None else jnp.asarray(self.offset),
      axis=self.axis,
      bits=self.bits,
      kind=self.kind,
    )

  def dequantize(self) -> np.ndarray:
    """The f32 values (for tests and the plain readers)."""
    codes = blocks.unpack(self.values, self.axis, self.bits)
    reps = self.shape[self.axis] // self.scale.shape[self.axis]
    out = codes.astype(np.float32) * np.repeat(
      self.scale.astype(np.float32), reps, axis=self.axis
    )
    if self.offset is not None:
      out += np.repeat(self.offset.astype(np.float32), reps, axis=self.axis)
    return out


def decode(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> HostBlocks:
  """The blocks of a tensor of NumPy `shape` (blocks along its last axis)
  from its raw bytes (`GGUFFile.raw`)."""
  if kind not in _BYTES:
    raise _unsupported(kind)
  size = _BYTES[kind]
  b = np.ascontiguousarray(raw).reshape(-1, size)
  codes, scale, offset = _decode_blocks(b, kind)
  bits, block = blocks.FORMATS[kind]
  *outer, k = shape
  codes = codes.reshape(*outer, k)
  if bits == 4:
    codes = blocks.pack(codes.astype(np.uint8), len(shape) - 1)
  groups = (*outer, k // block)
  return HostBlocks(
    codes,
    scale.reshape(groups),
    None if offset is None else offset.reshape(groups),
    len(shape) - 1,
    kind,
  )
