"""A minimal, memory-mapped reader of `.safetensors` files.

The format is an 8-byte little-endian header size, a JSON header mapping
each tensor name to its dtype, shape and byte range, then the raw data. It
is read here directly, so bfloat16 tensors come back as `ml_dtypes.bfloat16`
NumPy arrays without going through any framework:

  tensors = read("model.safetensors")   # {name: np.ndarray view (lazy)}
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

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


def read(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Every tensor of the file, as read-only arrays backed by a memory map.

  Raises:
    ValueError: the file is truncated, its header is not valid JSON, or a
      tensor has an unknown dtype or a byte range that does not match its
      shape.
  """
  path = os.fspath(path)
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise ValueError(f"{path}: too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", head)
    if 8 + header_len > size:
      raise ValueError(
        f"{path}: header of {header_len} bytes runs past the end of the "
        f"{size}-byte file (truncated?)"
      )
    try:
      header = json.loads(f.read(header_len))
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: header is not valid JSON ({e})") from None
  header.pop("__metadata__", None)
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
  out = {}
  for name, info in header.items():
    dtype = _DTYPES.get(info["dtype"])
    if dtype is None:
      raise ValueError(
        f"{path}: tensor {name!r} has dtype {info['dtype']!r}; supported: "
        f"{', '.join(_DTYPES)}"
      )
    start, end = info["data_offsets"]
    shape = tuple(info["shape"])
    want = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if end - start != want or end > data.size:
      raise ValueError(
        f"{path}: tensor {name!r} of shape {shape} and dtype "
        f"{info['dtype']} should hold {want} bytes at [{start}, {end}) but "
        f"the file has {data.size} data bytes (truncated or corrupt)"
      )
    out[name] = data[start:end].view(dtype).reshape(shape)
  return out
