"""The system C++ compiler and the cache of what it builds (no JAX here:
the constraint worker, which never imports chunkwise, loads this file by
its path to build `constraints/regex_dfa.cc`).

  cxx = toolchain.compiler()        # $CXX, else g++, c++ or clang++; None
  path = toolchain.shared_library("regex_dfa", [source], flags)

Built files live in `$CHUNKWISE_KERNEL_CACHE`, else
`~/.cache/chunkwise/kernels`, under a name keyed by the sources, the
compiler's version and the flags. One process compiles while others wait
on a lock; a library is written to a temporary name and renamed into
place, so no process loads half a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
from collections.abc import Sequence


def compiler() -> str | None:
  for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def cache_dir() -> pathlib.Path:
  root = os.environ.get("CHUNKWISE_KERNEL_CACHE")
  if root:
    return pathlib.Path(root)
  return pathlib.Path.home() / ".cache" / "chunkwise" / "kernels"


def version(cxx: str) -> str:
  return subprocess.run(
    [cxx, "--version"], capture_output=True, text=True, check=True
  ).stdout


@contextlib.contextmanager
def locked(directory: pathlib.Path):
  directory.mkdir(parents=True, exist_ok=True)
  with open(directory / "build.lock", "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def shared_library(
  name: str, sources: Sequence[pathlib.Path], flags: Sequence[str], cxx: str
) -> pathlib.Path:
  """`sources` compiled with `cxx` and `flags` into one shared library
  (once per machine: the cached file's path). RuntimeError with the
  compiler's message when it fails."""
  text = b"\0".join(pathlib.Path(s).read_bytes() for s in sources)
  key = hashlib.sha256(
    b"\0".join([text, version(cxx).encode(), *(f.encode() for f in flags)])
  ).hexdigest()[:16]
  out = cache_dir() / f"{name}-{key}.so"
  if out.exists():
    return out
  with locked(out.parent):
    if out.exists():  # built while this process waited
      return out
    fd, work = tempfile.mkstemp(dir=out.parent, suffix=".so")
    os.close(fd)
    try:
      result = subprocess.run(
        [cxx, *flags, *map(str, sources), "-o", work],
        capture_output=True,
        text=True,
        timeout=600,
      )
      if result.returncode:
        raise RuntimeError(result.stderr.strip()[-2000:])
      os.replace(work, out)
    finally:
      with contextlib.suppress(FileNotFoundError):
        os.remove(work)
  return out
