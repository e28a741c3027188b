"""A minimal, memory-mapped reader of `.safetensors` files.

The format is an 8-byte little-endian header size, a JSON header mapping
each tensor name to its dtype, shape and byte range, then the raw data. It
is read here directly, so bfloat16 tensors come back as `ml_dtypes.bfloat16`
NumPy arrays without going through any framework:

  tensors = read("model.safetensors")   # {name: np.ndarray view (lazy)}
"""

from __future__ import annotations

import math
import os
import struct

import ml_dtypes
import numpy as np

from chunkwise import untrusted

_DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "BF16": ml_dtypes.bfloat16,
  "I64": np.int64,
  "I32": np.int32,
  "I16": np.int16,
  "I8": np.int8,
  "U8": np.uint8,
  "BOOL": np.bool_,
}


# The reference implementation refuses headers over 100 MB too.
MAX_HEADER_BYTES = 100_000_000


def _fail(path: str, what: str) -> ValueError:
  return ValueError(f"{path}: {what} (truncated or corrupt safetensors file)")


def _entry(path: str, name: str, info, data_size: int):
  """(dtype, shape, start, end) of one header entry, every field checked
  against the file before anything is mapped."""
  where = f"tensor {name!r}"
  if not isinstance(info, dict):
    raise _fail(path, f"{where}: header entry is not an object")
  kind = info.get("dtype")
  dtype = _DTYPES.get(kind) if isinstance(kind, str) else None
  if dtype is None:
    raise ValueError(
      f"{path}: {where} has dtype {kind!r}; supported: {', '.join(_DTYPES)}"
    )
  shape, offsets = info.get("shape"), info.get("data_offsets")
  if not isinstance(shape, list) or not all(
    isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**62
    for d in shape
  ):
    raise _fail(path, f"{where}: shape {shape!r} is not a list of sizes")
  if (
    not isinstance(offsets, list)
    or len(offsets) != 2
    or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
  ):
    raise _fail(path, f"{where}: data_offsets {offsets!r} is not [start, end]")
  start, end = offsets
  want = math.prod(shape) * np.dtype(dtype).itemsize
  if not 0 <= start <= end <= data_size or end - start != want:
    raise _fail(
      path,
      f"{where} of shape {tuple(shape)} and dtype {info['dtype']} should "
      f"hold {want} bytes at [{start}, {end}) but the file has {data_size} "
      "data bytes",
    )
  return dtype, tuple(shape), start, end


def read(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Every tensor of the file, as read-only arrays backed by a memory map.

  The header is untrusted: its size, every entry's dtype, shape and byte
  range are checked (ranges inside the data, matching the shape, not
  overlapping) before anything is mapped.

  Raises:
    ValueError: the file is truncated, its header is not a JSON object of
      valid entries, or a tensor has an unknown dtype or a byte range that
      does not match its shape or overlaps another.
  """
  path = os.fspath(path)
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise ValueError(f"{path}: too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > MAX_HEADER_BYTES:
      raise _fail(
        path,
        f"header of {header_len} bytes is over the limit of {MAX_HEADER_BYTES}",
      )
    if 8 + header_len > size:
      raise ValueError(
        f"{path}: header of {header_len} bytes runs past the end of the "
        f"{size}-byte file (truncated?)"
      )
    header = untrusted.loads(
      f.read(header_len), source=f"{path} (header)", expect=dict
    )
  header.pop("__metadata__", None)
  data_size = size - 8 - header_len
  entries = {
    name: _entry(path, name, info, data_size) for name, info in header.items()
  }
  both = untrusted.overlap((s, e, n) for n, (_, _, s, e) in entries.items())
  if both:
    raise _fail(path, f"tensors {both[0]!r} and {both[1]!r} overlap")
  if not data_size:
    data = np.zeros(0, np.uint8)
  else:
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
  return {
    name: data[start:end].view(dtype).reshape(shape)
    for name, (dtype, shape, start, end) in entries.items()
  }
