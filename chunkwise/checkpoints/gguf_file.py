"""The GGUF container, read with every count, size and offset checked.

  f = gguf_file.open_file("model.gguf")
  f.metadata["llama.block_count"]      # Python values (lists for arrays)
  f.tensors["token_embd.weight"].shape  # NumPy order: [out, in]
  f.dequantize("token_embd.weight")    # float32, read from a memory map

A GGUF file is: magic "GGUF", version (2 or 3), tensor count, key/value
count; the key/value pairs (typed scalars, strings, arrays); one info
record per tensor (name, dimensions, GGML type, offset); then, aligned to
`general.alignment` (32 by default), the tensor data.

Model files are untrusted, so nothing here believes a count or a length
before checking it against the bytes that are left: a string may not run
past the end of the file, an array of n items needs at least n times its
item size, a tensor's bytes (computed from its dimensions and its type's
block size) must lie inside the data section without overlapping another
tensor, dimensions are at most 4 and positive, and offsets are aligned.
Every violation is a `ValueError` naming the file, the byte offset and
the field. Only tensor data is memory-mapped; nothing is allocated beyond
what the file's own bytes hold. The `gguf` package supplies the type
table and the dequantization routines.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from chunkwise import untrusted

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
# Arrays may hold arrays; nothing real nests deeper than this.
MAX_ARRAY_NESTING = 4

# GGUF value types: struct format of a scalar (None: string / array).
_SCALARS = {
  0: "<B",  # UINT8
  1: "<b",  # INT8
  2: "<H",  # UINT16
  3: "<h",  # INT16
  4: "<I",  # UINT32
  5: "<i",  # INT32
  6: "<f",  # FLOAT32
  7: "<?",  # BOOL
  10: "<Q",  # UINT64
  11: "<q",  # INT64
  12: "<d",  # FLOAT64
}
_NUMPY = {
  0: "<u1",
  1: "<i1",
  2: "<u2",
  3: "<i2",
  4: "<u4",
  5: "<i4",
  6: "<f4",
  7: "?",
  10: "<u8",
  11: "<i8",
  12: "<f8",
}
STRING, ARRAY = 8, 9


class GGUFError(ValueError):
  """A malformed GGUF file; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One tensor's record: `dims` in GGUF order (innermost first),
  `offset` from the start of the file, `nbytes` of data."""

  name: str
  qtype: Any  # gguf.GGMLQuantizationType
  dims: tuple[int, ...]
  offset: int
  nbytes: int

  @property
  def shape(self) -> tuple[int, ...]:
    """NumPy order (outermost first), e.g. [out, in] for a matmul."""
    return tuple(reversed(self.dims))


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFFile:
  """What `open_file` read: metadata, tensor records and the data map."""

  path: str
  version: int
  metadata: Mapping[str, Any]
  tensors: Mapping[str, TensorInfo]
  _data: np.ndarray  # uint8 memory map of the whole file
  _map: Any = None  # the mmap under _data (None: bytes)

  def raw(self, name: str) -> np.ndarray:
    """A tensor's bytes as the `gguf` package's dequantizers take them:
    typed for float / int types, uint8 rows of blocks otherwise."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    info = self.tensors[name]
    data = self._data[info.offset : info.offset + info.nbytes]
    typed = {
      GGMLQuantizationType.F32: np.float32,
      GGMLQuantizationType.F16: np.float16,
      GGMLQuantizationType.F64: np.float64,
      GGMLQuantizationType.I8: np.int8,
      GGMLQuantizationType.I16: np.int16,
      GGMLQuantizationType.I32: np.int32,
      GGMLQuantizationType.I64: np.int64,
    }.get(info.qtype)
    if typed is not None:
      return data.view(typed).reshape(info.shape)
    block, size = GGML_QUANT_SIZES[info.qtype]
    *outer, inner = info.shape
    return data.reshape(*outer, inner // block * size)

  def release(self, name: str) -> None:
    """Drops a tensor's pages from this process's resident memory, once
    what was read from them is copied: a reader that reads tensor after
    tensor then holds one tensor's pages, not the whole file's. The bytes
    stay readable (a later read faults them in again from the file)."""
    if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
      return
    info = self.tensors[name]
    start = info.offset - info.offset % mmap.PAGESIZE
    end = min(info.offset + info.nbytes, len(self._map))
    if end > start:
      self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

  def dequantize(self, name: str) -> np.ndarray:
    """A tensor as float32 in NumPy order (ValueError for a type the
    `gguf` package cannot dequantize)."""
    from gguf import quants

    info = self.tensors[name]
    try:
      out = quants.dequantize(self.raw(name), info.qtype)
    except NotImplementedError:
      raise GGUFError(
        f"{self.path}: tensor {name} has type {info.qtype.name}, which the "
        "gguf package cannot dequantize"
      ) from None
    return np.asarray(out, np.float32).reshape(info.shape)


class _Cursor:
  """Reads little-endian fields from a buffer, never past its end."""

  def __init__(self, buf, path: str):
    self.buf = buf
    self.size = len(buf)
    self.at = 0
    self.path = path

  def fail(self, what: str) -> GGUFError:
    return GGUFError(f"{self.path}: {what} (at byte {self.at})")

  def need(self, n: int, what: str) -> None:
    if n < 0 or self.at + n > self.size:
      raise self.fail(
        f"{what} needs {n} bytes but the {self.size}-byte file has "
        f"{self.size - self.at} left (truncated or corrupt)"
      )

  def scalar(self, fmt: str, what: str):
    n = struct.calcsize(fmt)
    self.need(n, what)
    (value,) = struct.unpack_from(fmt, self.buf, self.at)
    self.at += n
    return value

  def count(self, what: str, item_bytes: int) -> int:
    """A uint64 count of items that take at least `item_bytes` each."""
    n = self.scalar("<Q", what)
    left = self.size - self.at
    if n * item_bytes > left:
      raise self.fail(
        f"{what}={n} needs at least {n * item_bytes} bytes but only {left} "
        "are left (corrupt count)"
      )
    return n

  def string(self, what: str) -> str:
    n = self.count(f"length of {what}", 1)
    raw = bytes(self.buf[self.at : self.at + n])
    self.at += n
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise self.fail(f"{what} is not valid UTF-8 ({e.reason})") from None

  def value(self, kind: int, what: str, nesting: int = 0) -> Any:
    if kind in _SCALARS:
      return self.scalar(_SCALARS[kind], what)
    if kind == STRING:
      return self.string(what)
    if kind != ARRAY:
      raise self.fail(f"{what} has unknown value type {kind}")
    if nesting >= MAX_ARRAY_NESTING:
      raise self.fail(
        f"{what}: arrays nested more than {MAX_ARRAY_NESTING} deep"
      )
    item = self.scalar("<I", f"item type of {what}")
    if item in _NUMPY:
      width = np.dtype(_NUMPY[item]).itemsize
      n = self.count(f"length of {what}", width)
      out = np.frombuffer(self.buf, _NUMPY[item], n, self.at).tolist()
      self.at += n * width
      return out
    if item == STRING:
      n = self.count(f"length of {what}", 8)
      return [self.string(f"{what}[{i}]") for i in range(n)]
    if item == ARRAY:
      n = self.count(f"length of {what}", 12)
      return [self.value(ARRAY, f"{what}[{i}]", nesting + 1) for i in range(n)]
    raise self.fail(f"{what} has arrays of unknown value type {item}")


def open_file(path: str | os.PathLike) -> GGUFFile:
  """Reads and checks a GGUF file's metadata and tensor records (module
  docstring); tensor data stays on disk, memory-mapped.

  Raises:
    FileNotFoundError: no such file.
    ImportError: the `gguf` package is missing.
    GGUFError (a ValueError): anything malformed, named.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no GGUF file at {path}")
  try:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
  except ImportError as e:
    raise ImportError(
      "reading GGUF files needs the gguf package: pip install gguf "
      "(or chunkwise[gguf])"
    ) from e
  size = os.path.getsize(path)
  if size < 24:
    raise GGUFError(f"{path}: {size} bytes is too short for a GGUF header")
  with open(path, "rb") as f:
    # Closed when the last array reading it is garbage-collected.
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  return _parse(path, buf, GGML_QUANT_SIZES, GGMLQuantizationType)


def _parse(path, buf, quant_sizes, qtypes) -> GGUFFile:
  cur = _Cursor(memoryview(buf), path)
  if bytes(cur.buf[:4]) != MAGIC:
    raise GGUFError(f"{path} is not a GGUF file (it does not start with GGUF)")
  cur.at = 4
  version = cur.scalar("<I", "version")
  if version not in VERSIONS:
    swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
    hint = " (a big-endian file?)" if swapped in VERSIONS else ""
    raise GGUFError(
      f"{path}: GGUF version {version}{hint} is not supported; expected "
      f"{' or '.join(map(str, VERSIONS))}"
    )
  # A tensor record takes at least 24 bytes, a key/value pair 13.
  n_tensors = cur.count("tensor count", 24)
  n_kv = cur.count("metadata count", 13)
  metadata: dict[str, Any] = {}
  for i in range(n_kv):
    key = cur.string(f"metadata key #{i}")
    kind = cur.scalar("<I", f"value type of {key!r}")
    if key in metadata:
      raise cur.fail(f"metadata key {key!r} appears twice")
    metadata[key] = cur.value(kind, f"metadata {key!r}")
  alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
  if (
    isinstance(alignment, bool)
    or not isinstance(alignment, int)
    or not 1 <= alignment <= 1 << 16
    or alignment & (alignment - 1)
  ):
    raise cur.fail(
      f"general.alignment={alignment!r} is not a power of two in [1, 65536]"
    )
  records = []
  for i in range(n_tensors):
    name = cur.string(f"name of tensor #{i}")
    n_dims = cur.scalar("<I", f"dimension count of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
      raise cur.fail(
        f"tensor {name!r} has {n_dims} dimensions; expected 1 to {MAX_DIMS}"
      )
    dims = tuple(
      cur.scalar("<Q", f"dimension {d} of tensor {name!r}")
      for d in range(n_dims)
    )
    raw_type = cur.scalar("<I", f"type of tensor {name!r}")
    offset = cur.scalar("<Q", f"offset of tensor {name!r}")
    records.append((name, dims, raw_type, offset))
  data_start = -(-cur.at // alignment) * alignment
  data_size = cur.size - data_start
  tensors: dict[str, TensorInfo] = {}
  for name, dims, raw_type, offset in records:
    where = f"tensor {name!r}"
    if name in tensors:
      raise GGUFError(f"{path}: {where} appears twice")
    try:
      qtype = qtypes(raw_type)
      block, type_size = quant_sizes[qtype]
    except (ValueError, KeyError):
      raise GGUFError(
        f"{path}: {where} has unknown GGML type {raw_type}"
      ) from None
    if any(d < 1 for d in dims) or dims[0] % block:
      raise GGUFError(
        f"{path}: {where} has dimensions {list(dims)}; each must be "
        f"positive and the first a multiple of {qtype.name}'s block of "
        f"{block}"
      )
    elements = 1
    for d in dims:
      elements *= d
    nbytes = elements // block * type_size
    if offset % alignment or offset + nbytes > data_size:
      raise GGUFError(
        f"{path}: {where} ({qtype.name}, dimensions {list(dims)}: "
        f"{nbytes} bytes) at data offset {offset} does not fit the "
        f"{max(data_size, 0)}-byte data section aligned to {alignment} "
        "(truncated or corrupt)"
      )
    tensors[name] = TensorInfo(name, qtype, dims, data_start + offset, nbytes)
  both = untrusted.overlap(
    (t.offset, t.offset + t.nbytes, t.name) for t in tensors.values()
  )
  if both:
    raise GGUFError(f"{path}: tensors {both[0]!r} and {both[1]!r} overlap")
  data = np.frombuffer(buf, np.uint8)
  return GGUFFile(
    path,
    version,
    metadata,
    tensors,
    data,
    buf if isinstance(buf, mmap.mmap) else None,
  )
