"""JAX's persistent compilation cache for long-lived processes: a server
that restarts loads its compiled programs from disk instead of compiling
them again (`scripts/serve.py` turns it on by default).

  path = compile_cache.enable()      # the default directory (below)
  compile_cache.enable("")           # off
  with compile_cache.counting() as counts:
    ...                              # programs compiled or loaded
  counts.hits, counts.misses

The directory is, in order: the `path` given, `$CHUNKWISE_COMPILATION_CACHE`,
`$JAX_COMPILATION_CACHE_DIR`, `$XDG_CACHE_HOME/chunkwise/jax`,
`~/.cache/chunkwise/jax`. Entries are keyed by the program, the compiler
options, the jaxlib version and the CPU (JAX's own key), so a stale one is
never used; the directory may be deleted at any time. Every program is
stored, however quick to compile: the server's small ones add up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import threading

import jax

ENV = "CHUNKWISE_COMPILATION_CACHE"


def default_dir() -> str:
  """Where the cache lives unless a path is given (module docstring)."""
  for name in (ENV, "JAX_COMPILATION_CACHE_DIR"):
    if os.environ.get(name):
      return os.environ[name]
  base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
  return str(pathlib.Path(base) / "chunkwise" / "jax")


def enable(path: str | None = None) -> str | None:
  """Turns the persistent cache on at `path` (None: `default_dir()`; "":
  off); returns the directory used, or None when off. Call it before the
  first program compiles."""
  if path == "":
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  path = path or default_dir()
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return path


@dataclasses.dataclass
class Counts:
  """Programs loaded from the persistent cache (`hits`) and compiled
  (`misses`) while counting."""

  hits: int = 0
  misses: int = 0


_EVENTS = {
  "/jax/compilation_cache/cache_hits": "hits",
  "/jax/compilation_cache/cache_misses": "misses",
}
_LOCK = threading.Lock()
_ACTIVE: list[Counts] = []
_LISTENING = False


def _event(name: str, **_) -> None:
  field = _EVENTS.get(name)
  if field is None:
    return
  with _LOCK:
    for counts in _ACTIVE:
      setattr(counts, field, getattr(counts, field) + 1)


@contextlib.contextmanager
def counting():
  """Counts the cache's hits and misses inside (every thread's)."""
  global _LISTENING
  counts = Counts()
  with _LOCK:
    if not _LISTENING:
      jax.monitoring.register_event_listener(_event)
      _LISTENING = True
    _ACTIVE.append(counts)
  try:
    yield counts
  finally:
    with _LOCK:
      _ACTIVE.remove(counts)
