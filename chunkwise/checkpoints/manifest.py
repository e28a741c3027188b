"""A checkpoint directory and its description, `chunkwise.json`.

  write(directory, tree, meta, files, overwrite)   # all or nothing
  meta = read_meta(directory, "model")             # files checked first

A checkpoint is a directory:

  arrays/          the arrays (`arrays.py`)
  tokenizer.json   the vocabulary, when it is a `TokenizerVocabulary`
  chunkwise.json   written last: what it holds ("model" or "result"), its
                   fields, each array's shape and dtype, and the size and
                   CRC-32 of every file.

Saving writes `<dir>.partial` and renames it to `<dir>` once complete; an
existing checkpoint it replaces is renamed aside first and removed only
after, so an interrupted save leaves the old checkpoint or nothing at
`<dir>`, never a mix (a failed save removes its partial directory). Orbax's
own atomic save covers the arrays alone: the description, which names the
array files' sizes and checksums, can only be written after them, and
Orbax's overwrite deletes the old checkpoint before writing the new one.
Reading checks the description's fields, then every listed file's
presence, size and (with `verify`) CRC-32, and that no unlisted file sits
among the arrays, before Orbax parses a byte.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import zlib
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from chunkwise import untrusted
from chunkwise.checkpoints import arrays
from chunkwise.checkpoints.arrays import ARRAYS
from chunkwise.partitioning.multihost import barrier

META = "chunkwise.json"
FORMAT = "chunkwise-checkpoint"
VERSION = 3
# Version 1 stored each layer weight stacked over layers ("layers.q");
# version 2 stores one array per layer ("layers.0.q"); version 3 int8
# scales per group of inputs (`quantized.group_size`), not per output
# channel as before. All are read.
READS = (1, 2, 3)
# Array dtypes a checkpoint may hold.
DTYPES = ("float32", "bfloat16", "float16", "int8", "uint8", "int32")
# Restored arrays may take this many times the bytes of their files.
MAX_EXPANSION = 256
EXPANSION_FLOOR = 64 << 20  # bytes always allowed


def is_checkpoint(path: str | os.PathLike) -> bool:
  """Whether `path` is a directory saved by `save`."""
  return os.path.isfile(os.path.join(os.fspath(path), META))


def describe_arrays(flat: dict[str, Any]) -> dict:
  return {
    name: {"shape": list(x.shape), "dtype": jnp.dtype(x.dtype).name}
    for name, x in flat.items()
  }


def crc32(path: str) -> int:
  """CRC-32 of a file, read in 16 MiB pieces."""
  crc = 0
  with open(path, "rb") as f:
    while piece := f.read(16 << 20):
      crc = zlib.crc32(piece, crc)
  return crc


def file_sizes(root: str) -> dict[str, int]:
  """Every file under `root` but the description itself, with its size."""
  out = {}
  for parent, _, files in os.walk(root):
    for f in files:
      path = os.path.join(parent, f)
      rel = os.path.relpath(path, root)
      if rel != META:
        out[rel] = os.path.getsize(path)
  return dict(sorted(out.items()))


def write(
  directory, tree, meta: dict, files: dict[str, str], overwrite: bool
) -> str:
  """Saves `tree` and `meta` at `directory` all or nothing (see module)."""
  directory = os.path.abspath(os.fspath(directory))
  if os.path.exists(directory):
    if not overwrite:
      raise FileExistsError(
        f"{directory} already exists; pass overwrite=True to replace it"
      )
    if not is_checkpoint(directory) and (
      not os.path.isdir(directory) or os.listdir(directory)
    ):
      raise ValueError(
        f"{directory} exists and is not a chunkwise checkpoint (no {META}); "
        "refusing to overwrite it"
      )
  partial = directory + ".partial"
  leader = jax.process_index() == 0
  if leader and os.path.exists(partial):
    shutil.rmtree(partial)
  barrier("chunkwise_save_start")
  flat = arrays.flatten(tree)
  try:
    arrays.save(partial, tree)
    if leader:
      for name, text in files.items():
        with open(os.path.join(partial, name), "w") as f:
          f.write(text)
      meta = {
        "format": FORMAT,
        "version": VERSION,
        **meta,
        "arrays": describe_arrays(flat),
        "files": (sizes := file_sizes(partial)),
        "checksums": {rel: crc32(os.path.join(partial, rel)) for rel in sizes},
      }
      # Written last: a directory without it is not a checkpoint.
      with open(os.path.join(partial, META), "w") as f:
        json.dump(meta, f, indent=1)
    barrier("chunkwise_save_written")
    if leader:
      if os.path.exists(directory):
        old = directory + ".replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(directory, old)
        os.rename(partial, directory)
        shutil.rmtree(old)
      else:
        os.rename(partial, directory)
  except BaseException:
    if leader:
      shutil.rmtree(partial, ignore_errors=True)
    raise
  barrier("chunkwise_save_done")
  return directory


def read_meta(
  directory: str | os.PathLike, kind: str, *, verify: bool = True
) -> dict:
  """The checkpoint's description, once every file it lists is present
  with its recorded size and (with `verify`) its CRC-32, and no other file
  sits among the arrays: Orbax never parses a byte chunkwise did not
  write (accidental corruption and naive tampering end here).

  Raises:
    FileNotFoundError: no such directory.
    ValueError: not a chunkwise checkpoint, another kind, or a missing or
      truncated file (named).
  """
  directory = os.fspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint directory {directory}")
  path = os.path.join(directory, META)
  if not os.path.isfile(path):
    raise ValueError(
      f"{directory} is not a chunkwise checkpoint: it has no {META} (a save "
      "that did not finish leaves none)"
    )
  meta = untrusted.read_json(path, what="checkpoint description")
  if meta.get("format") != FORMAT:
    raise ValueError(f"{path} does not describe a {FORMAT}")
  if meta.get("version") not in READS:
    raise ValueError(
      f"{path} has format version {meta.get('version')!r}; this chunkwise "
      f"reads versions {', '.join(map(str, READS))}"
    )
  if meta.get("kind") != kind:
    raise ValueError(
      f"{directory} holds a saved {meta.get('kind')}, expected a {kind}"
    )
  _check_description(path, meta)
  for rel, size in meta["files"].items():
    file = os.path.join(directory, rel)
    if not os.path.isfile(file):
      raise ValueError(
        f"checkpoint {directory} is incomplete: {rel} is missing (expected "
        f"{size} bytes)"
      )
    found = os.path.getsize(file)
    if found != size:
      raise ValueError(
        f"checkpoint {directory} is corrupt: {rel} has {found} bytes, "
        f"expected {size} (truncated or overwritten)"
      )
  if verify:
    _verify_files(directory, meta)
  return meta


def _verify_files(directory: str, meta: dict) -> None:
  """No unlisted file among the arrays, and every file's CRC-32 as saved
  (checkpoints saved before checksums were recorded are only warned
  about)."""
  listed = set(meta["files"])
  found = file_sizes(os.path.join(directory, ARRAYS))
  extra = sorted(
    os.path.join(ARRAYS, rel)
    for rel in found
    if os.path.join(ARRAYS, rel) not in listed
  )
  if extra:
    raise ValueError(
      f"checkpoint {directory} holds files it did not save: "
      f"{', '.join(extra[:3])}"
    )
  sums = meta.get("checksums")
  if sums is None:
    logging.warning("%s was saved without checksums: not verified", directory)
    return
  if not isinstance(sums, dict) or set(sums) != listed:
    raise ValueError(
      f"{os.path.join(directory, META)}: 'checksums' does not list every file"
    )
  for rel, want in sums.items():
    if crc32(os.path.join(directory, rel)) != want:
      raise ValueError(
        f"checkpoint {directory} is corrupt: {rel} does not have its saved "
        "CRC-32 (changed since it was saved)"
      )


def _check_description(path: str, meta: dict) -> None:
  """The description's own fields: file sizes under relative paths inside
  the checkpoint, array shapes and dtypes (ValueError naming the field)."""
  files, arrays = meta.get("files"), meta.get("arrays")
  if not isinstance(files, dict) or not isinstance(arrays, dict):
    raise ValueError(f"{path}: 'files' and 'arrays' must be objects")
  for rel, size in files.items():
    parts = rel.replace("\\", "/").split("/")
    if os.path.isabs(rel) or ".." in parts or rel in ("", META):
      raise ValueError(
        f"{path}: file {rel!r} is not a path inside the checkpoint"
      )
    untrusted.check_int(size, f"files[{rel!r}]", source=path)
  for name, desc in arrays.items():
    where = f"arrays[{name!r}]"
    if not isinstance(desc, dict) or not isinstance(desc.get("shape"), list):
      raise ValueError(f"{path}: {where} has no shape list")
    for d in desc["shape"]:
      untrusted.check_int(d, f"{where}.shape", source=path)
    if desc.get("dtype") not in DTYPES:
      raise ValueError(
        f"{path}: {where}.dtype={desc.get('dtype')!r} is not one of "
        f"{', '.join(DTYPES)}"
      )


def check_bytes(directory: str, meta: dict, targets) -> None:
  """Refuses to allocate far more than the checkpoint stores: restored
  arrays may take at most `MAX_EXPANSION` times the bytes of the array
  files (plus `EXPANSION_FLOOR`); real weights and caches compress by
  under 2x, so more means a tampered description."""
  stored = sum(
    size for rel, size in meta["files"].items() if rel.startswith(ARRAYS)
  )
  need = sum(
    math.prod(t.shape) * jnp.dtype(t.dtype).itemsize
    for t in jax.tree.leaves(targets)
  )
  if need > EXPANSION_FLOOR + MAX_EXPANSION * stored:
    raise ValueError(
      f"checkpoint {directory} would restore {need} bytes of arrays from "
      f"{stored} bytes of files (over {MAX_EXPANSION}x): its description "
      "does not match its data (tampered or corrupt)"
    )
