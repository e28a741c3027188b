"""Block-quantized weights as GGUF files hold them: small integer codes in
blocks of 16 or 32 inputs, each block with its own scale (and offset).

A `BlockArray` stands in for a matmul weight or an embedding table, like
an int8 `QArray` (`models.quantized`) does, with

  w = code * scale + offset      (scale and offset repeated over a block)

along the weight's grouped `axis` (its last contracted axis: the input
channels). llama.cpp's formats map onto it without rounding anything but
the K-quants' sub-block scales (`checkpoints.gguf_blocks`):

  format  bits  block  code            scale     offset
  Q4_0    4     32     0..15           d         -8 d
  Q4_1    4     32     0..15           d         m
  Q4_K    4     32     0..15           d sc      -dmin m     (f16-rounded)
  Q5_0    8     32     -16..15         d         none
  Q5_1    8     32     0..31           d         m
  Q5_K    8     32     0..31           d sc      -dmin m     (f16-rounded)
  Q6_K    8     16     -32..31         d sc      none        (f16-rounded)
  Q8_0    8     32     -128..127       d         none

4-bit codes are packed two to a byte along the grouped axis (entry 2i in
the low nibble, 2i + 1 in the high one), so `values` has half the
weight's length there; 5-, 6- and 8-bit codes take an int8 each. Scales
and offsets are f16 arrays of the weight's shape with the grouped axis
divided by the block size. Every field is cut along every axis in whole
blocks, so a layout's shards and a collective matmul's pieces and
shuffles treat the fields like a QArray's values and scales.

`astype(dtype)` dequantizes (in f32, then cast): the plain twin that
every layout, backend and numerics mode can run; `take_rows` reads only
the embedding rows it needs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

FORMATS = {  # GGUF type name: (bits of storage, block size)
  "Q4_0": (4, 32),
  "Q4_1": (4, 32),
  "Q4_K": (4, 32),
  "Q5_0": (8, 32),
  "Q5_1": (8, 32),
  "Q5_K": (8, 32),
  "Q6_K": (8, 16),
  "Q8_0": (8, 32),
}


# Formats whose blocks carry an offset (the others' is zero).
OFFSET = ("Q4_0", "Q4_1", "Q4_K", "Q5_1", "Q5_K")


def bytes_per_value(kind: str) -> float:
  """Bytes a weight entry of GGUF type `kind` takes as a BlockArray: its
  code, plus an f16 scale (and offset) per block."""
  bits, block = FORMATS[kind]
  per_block = 2 * (2 if kind in OFFSET else 1)
  return bits / 8 + per_block / block


def expand(scale: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """A scale repeated over its groups, broadcastable against `shape`."""
  for i, (s, n) in enumerate(zip(scale.shape, shape, strict=True)):
    if s not in (1, n):
      scale = jnp.repeat(scale, n // s, axis=i, total_repeat_length=n)
  return scale


def unpack(values, axis: int, bits: int):
  """Codes one per entry: 4-bit ones unpacked (low nibble first) along
  `axis`; others as they are. NumPy or JAX arrays alike."""
  if bits != 4:
    return values
  lib = jnp if isinstance(values, jax.Array) else np
  lo, hi = values & 15, values >> 4
  pairs = lib.stack([lo, hi], axis=axis + 1)
  shape = list(values.shape)
  shape[axis] *= 2
  return pairs.reshape(shape)


def entries(shape, axis: int, bits: int) -> tuple[int, ...]:
  """The weight's shape from its stored codes' `shape`."""
  return tuple(
    n * (2 if i == axis and bits == 4 else 1) for i, n in enumerate(shape)
  )


def pack(codes, axis: int):
  """4-bit codes (0..15, uint8) two to a byte along `axis`."""
  lib = jnp if isinstance(codes, jax.Array) else np
  even = lib.take(codes, lib.arange(0, codes.shape[axis], 2), axis=axis)
  odd = lib.take(codes, lib.arange(1, codes.shape[axis], 2), axis=axis)
  return (even | (odd << 4)).astype(lib.uint8)


@struct.dataclass
class BlockArray:
  """A block-quantized weight (see module doc)."""

  values: jax.Array  # uint8 (4-bit pairs) or int8 codes
  scale: jax.Array  # f16 per block
  offset: jax.Array | None  # f16 per block, or None (zero)
  axis: int = struct.field(pytree_node=False)  # the grouped axis
  bits: int = struct.field(pytree_node=False)  # 4 or 8 per stored code
  kind: str = struct.field(pytree_node=False)  # the GGUF type, "Q4_K"

  @property
  def shape(self) -> tuple[int, ...]:
    """The weight's shape (4-bit values hold two entries per byte)."""
    return entries(self.values.shape, self.axis, self.bits)

  @property
  def ndim(self) -> int:
    return len(self.values.shape)

  @property
  def block(self) -> int:
    """Entries per scale along the grouped axis."""
    return self.shape[self.axis] // self.scale.shape[self.axis]

  def astype(self, dtype) -> jax.Array:
    """The dequantized weight (computed in f32, then cast to `dtype`)."""
    codes = unpack(self.values, self.axis, self.bits).astype(jnp.float32)
    out = codes * expand(self.scale.astype(jnp.float32), self.shape)
    if self.offset is not None:
      out = out + expand(self.offset.astype(jnp.float32), self.shape)
    return out.astype(dtype)

  def fields(self) -> dict:
    """The arrays, by field name (offset only when there is one)."""
    out = {"values": self.values, "scale": self.scale}
    if self.offset is not None:
      out["offset"] = self.offset
    return out


def check(w: BlockArray, name: str) -> None:
  """ValueError naming `name` unless `w`'s fields agree with its format."""
  if w.kind not in FORMATS:
    raise ValueError(
      f"weight {name} has block type {w.kind!r}; supported: "
      f"{', '.join(FORMATS)}"
    )
  bits, block = FORMATS[w.kind]
  want = np.uint8 if bits == 4 else np.int8
  if w.bits != bits or jnp.dtype(w.values.dtype) != want:
    raise ValueError(
      f"weight {name} ({w.kind}) has {w.bits}-bit values of dtype "
      f"{w.values.dtype}; expected {bits}-bit {np.dtype(want).name}"
    )
  groups = list(w.shape)
  if groups[w.axis] % block:
    raise ValueError(
      f"weight {name} ({w.kind}) has {groups[w.axis]} entries on its grouped "
      f"axis {w.axis}, not a multiple of its block of {block}"
    )
  groups[w.axis] //= block
  for field in ("scale", "offset"):
    value = getattr(w, field)
    if value is not None and tuple(value.shape) != tuple(groups):
      raise ValueError(
        f"weight {name} ({w.kind}) has {field} of shape {tuple(value.shape)}; "
        f"expected {tuple(groups)} (one per block of {block})"
      )


def take_rows(table: BlockArray, ids: jax.Array, take=None) -> jax.Array:
  """Rows `ids` of a block-quantized table (grouped along its last axis),
  dequantized in f32; `take(field, ids)` reads a field's rows (default
  `jnp.take`)."""
  take = take or (lambda a, ids: jnp.take(a, ids, axis=0))
  rows = jax.tree.map(lambda a: take(a, ids), table)
  moved = rows.replace(axis=table.axis + ids.ndim - 1)
  return moved.astype(jnp.float32)


def nbytes(w: BlockArray) -> int:
  """Bytes of the codes, scales and offsets."""
  return sum(
    math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
    for a in w.fields().values()
  )


def template(name: str, shape, kind: str, axis: int) -> BlockArray:
  """The `ShapeDtypeStruct`s of a `BlockArray` of weight `shape` in GGUF
  type `kind`, blocked along `axis` (ValueError naming `name` unless the
  axis exists and holds whole blocks)."""
  if not 0 <= axis < len(shape):
    raise ValueError(
      f"weight {name} has {len(shape)} axes; its blocks' axis {axis} "
      "does not exist"
    )
  bits, block = FORMATS[kind]
  values, groups = list(shape), list(shape)
  if bits == 4:
    values[axis] //= 2
  groups[axis] //= block
  f16 = jax.ShapeDtypeStruct(tuple(groups), jnp.float16)
  w = BlockArray(
    values=jax.ShapeDtypeStruct(
      tuple(values), jnp.uint8 if bits == 4 else jnp.int8
    ),
    scale=f16,
    offset=f16 if kind in OFFSET else None,
    axis=axis,
    bits=bits,
    kind=kind,
  )
  check(w, name)  # whole blocks
  return w
