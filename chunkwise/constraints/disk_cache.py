"""Compiled constraint tables kept on disk, reused across processes.

  key = disk_cache.key(kind, text, vocab_key, stops, width, max_table_mb)
  arrays = disk_cache.load(key)        # None on a miss
  disk_cache.store(key, arrays)        # atomically, then prunes

A table is keyed by everything its build depends on: the constraint's
kind and text, the vocabulary's bytes (`tables.Vocab.key`), stop ids,
logits width, the table-size limit, and the versions of the code that
builds it (outlines-core's version and a hash of `automaton.py`,
`dfa_splice.py` and the native compiler, `regex_dfa.py` and
`regex_dfa.cc`), so a
new release never reads an old layout. Each entry is one `.npz` of plain
arrays (read with `allow_pickle=False`), written to a temporary name and
renamed into place, so a reader never sees half a file. An entry whose
arrays do not fit together (a truncated or edited file) is ignored and
rebuilt. The directory is `$CHUNKWISE_CONSTRAINT_CACHE` (`off`: no disk
cache), else `$XDG_CACHE_HOME/chunkwise/constraints` (default
`~/.cache/...`); the oldest entries are removed past `MAX_BYTES`;
`with disk_cache.off():` bypasses it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile

import numpy as np

from chunkwise.constraints import automaton, dfa_splice, regex_dfa

MAX_BYTES = 2 << 30
FIELDS = ("bits", "token_class", "next_state", "final", "distance")
_ENV = "CHUNKWISE_CONSTRAINT_CACHE"


_off = 0


@contextlib.contextmanager
def off():
  """Neither reads nor writes the disk cache inside (for benchmarks that
  time builds from scratch)."""
  global _off
  _off += 1
  try:
    yield
  finally:
    _off -= 1


def directory() -> str | None:
  """Where entries live (None: the disk cache is off)."""
  if _off:
    return None
  path = os.environ.get(_ENV)
  if path is not None:
    return None if path.strip().lower() in ("", "off", "0") else path
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
    os.path.expanduser("~"), ".cache"
  )
  return os.path.join(base, "chunkwise", "constraints")


@functools.cache
def _code_version() -> str:
  from importlib import metadata

  digest = hashlib.sha256()
  native = os.path.join(os.path.dirname(regex_dfa.__file__), "regex_dfa.cc")
  for path in (
    automaton.__file__,
    dfa_splice.__file__,
    regex_dfa.__file__,
    native,
  ):
    with open(path, "rb") as f:  # the worker's code
      digest.update(f.read())
  source = digest.hexdigest()[:16]
  return f"outlines-core {metadata.version('outlines-core')}, {source}"


def key(
  kind: str,
  text: str,
  vocab_key: str,
  stops: tuple[int, ...],
  width: int,
  max_table_mb: float,
) -> str:
  parts = [_code_version(), kind, text, vocab_key, list(stops), width]
  parts.append(float(max_table_mb))
  return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _path(key: str) -> str | None:
  root = directory()
  return None if root is None else os.path.join(root, key + ".npz")


def _consistent(a: dict) -> bool:
  """Whether the arrays are shaped like one automaton's tables."""
  bits, cls, nxt, final, dist = (a[f] for f in FIELDS)
  n = final.shape[0]
  return (
    bits.dtype == np.uint32
    and cls.dtype == np.int32
    and nxt.dtype == np.int32
    and final.dtype == np.bool_
    and dist.dtype == np.int32
    and bits.ndim == nxt.ndim == 2
    and cls.ndim == final.ndim == dist.ndim == 1
    and bits.shape[0] == nxt.shape[0] == dist.shape[0] == n > 0
    and bits.shape[1] * 32 >= cls.shape[0] > bits.shape[1] * 32 - 32
    and (cls.size == 0 or 0 <= int(cls.min()) <= int(cls.max()) < nxt.shape[1])
    and (nxt.size == 0 or -1 <= int(nxt.min()) <= int(nxt.max()) < n)
  )


def load(key: str) -> dict | None:
  """The entry's `automaton.build` result, or None (a miss, or an entry
  that cannot be read or does not fit together)."""
  out = load_arrays(key, (*FIELDS, "regex", "build_s"))
  if out is None:
    return None
  out["regex"] = str(out["regex"])
  out["build_s"] = float(out["build_s"])
  return out if _consistent(out) else None


def load_arrays(key: str, names) -> dict | None:
  """The entry's arrays `names`, or None (a miss, or an entry that cannot
  be read); the caller checks that they fit together."""
  path = _path(key)
  if path is None or not os.path.exists(path):
    return None
  try:
    with np.load(path, allow_pickle=False) as f:
      out = {name: f[name] for name in names}
  except Exception:  # any unreadable entry is a miss
    return None
  with contextlib.suppress(OSError):
    os.utime(path)  # recently used: pruned last
  return out


def store(key: str, built: dict) -> None:
  """Writes the entry (atomically) and prunes the oldest past MAX_BYTES;
  a directory that cannot be written only means no disk cache."""
  store_arrays(
    key,
    {
      "regex": np.array(built["regex"]),
      "build_s": np.array(built["build_s"]),
      **{name: built[name] for name in FIELDS},
    },
  )


def store_arrays(key: str, arrays: dict) -> None:
  """`store` of any named arrays."""
  path = _path(key)
  if path is None:
    return
  root = os.path.dirname(path)
  try:
    os.makedirs(root, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, suffix=".partial")
    try:
      with os.fdopen(fd, "wb") as f:
        np.savez(f, **arrays)
      os.replace(tmp, path)
    except BaseException:
      with contextlib.suppress(OSError):
        os.remove(tmp)
      raise
    _prune(root)
  except OSError:
    return


def _prune(root: str) -> None:
  entries = []
  for name in os.listdir(root):
    if name.endswith(".npz"):
      with contextlib.suppress(OSError):
        st = os.stat(os.path.join(root, name))
        entries.append((st.st_mtime, st.st_size, name))
  total = sum(size for _, size, _ in entries)
  for _, size, name in sorted(entries):
    if total <= MAX_BYTES:
      break
    with contextlib.suppress(OSError):
      os.remove(os.path.join(root, name))
    total -= size
