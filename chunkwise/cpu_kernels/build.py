"""Compiles the CPU kernels once per machine and registers them with XLA.

`matmul.cc` and `invariant.cc` (with `pool.h`) are compiled with the
system C++ compiler (`$CXX`, else g++ or c++; `-O3 -march=native`) into
one library, against the XLA FFI headers that jaxlib ships,
into a cache directory keyed by the source, the compiler, the headers'
jaxlib version and the CPU's features: `$CHUNKWISE_KERNEL_CACHE`, else
`~/.cache/chunkwise/kernels`. The library is written to a temporary name
and renamed into place, so concurrent processes never load half a file.

Without a compiler, or when compiling fails, `load()` logs one warning and
returns False: every matmul then takes the plain XLA path. Setting
`CHUNKWISE_CPU_KERNELS=0` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax
import jaxlib

TARGET = "chunkwise_matmul"
INVARIANT_TARGET = "chunkwise_invariant_matmul"
UNARY_TARGET = "chunkwise_invariant_unary"
EXP_SUM_TARGET = "chunkwise_invariant_exp_sum"
_HERE = pathlib.Path(__file__).parent
_SOURCES = (_HERE / "matmul.cc", _HERE / "invariant.cc")
_HEADERS = (_HERE / "pool.h",)
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")

log = logging.getLogger(__name__)


def enabled() -> bool:
  """False when `CHUNKWISE_CPU_KERNELS` is 0/false/off."""
  value = os.environ.get("CHUNKWISE_CPU_KERNELS", "1").strip().lower()
  return value not in ("0", "false", "off", "no")


def _compiler() -> str | None:
  for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def _cpu_features() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return line
  except OSError:
    pass
  return ""


def _cache_dir() -> pathlib.Path:
  root = os.environ.get("CHUNKWISE_KERNEL_CACHE")
  if root:
    return pathlib.Path(root)
  return pathlib.Path.home() / ".cache" / "chunkwise" / "kernels"


def _compile(cxx: str) -> pathlib.Path:
  source = b"\0".join(p.read_bytes() for p in (*_SOURCES, *_HEADERS))
  version = subprocess.run(
    [cxx, "--version"], capture_output=True, text=True, check=True
  ).stdout
  key = hashlib.sha256(
    b"\0".join(
      s.encode() if isinstance(s, str) else s
      for s in (source, version, jaxlib.__version__, _cpu_features(), *_FLAGS)
    )
  ).hexdigest()[:16]
  out = _cache_dir() / f"matmul-{key}.so"
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.NamedTemporaryFile(
    dir=out.parent, suffix=".so", delete=False
  ) as tmp:
    partial = pathlib.Path(tmp.name)
  try:
    result = subprocess.run(
      [
        cxx,
        *_FLAGS,
        f"-I{jax.ffi.include_dir()}",
        *map(str, _SOURCES),
        "-o",
        str(partial),
      ],
      capture_output=True,
      text=True,
      timeout=300,
    )
    if result.returncode:
      raise RuntimeError(result.stderr.strip()[-2000:])
    os.replace(partial, out)
  finally:
    partial.unlink(missing_ok=True)
  return out


@functools.cache
def load() -> bool:
  """Whether the kernels are compiled and registered (once per process)."""
  if not enabled():
    return False
  cxx = _compiler()
  if cxx is None:
    log.warning(
      "chunkwise: no C++ compiler found ($CXX, g++, c++, clang++); int8 and "
      "bf16 decode matmuls run as XLA dots of dequantized weights"
    )
    return False
  try:
    library = ctypes.cdll.LoadLibrary(str(_compile(cxx)))
    for target, symbol in (
      (TARGET, library.ChunkwiseMatmul),
      (INVARIANT_TARGET, library.ChunkwiseInvariantMatmul),
      (UNARY_TARGET, library.ChunkwiseInvariantUnary),
      (EXP_SUM_TARGET, library.ChunkwiseInvariantExpSum),
    ):
      jax.ffi.register_ffi_target(
        target, jax.ffi.pycapsule(symbol), platform="cpu"
      )
  except (OSError, RuntimeError, subprocess.SubprocessError) as e:
    log.warning(
      "chunkwise: the CPU kernels did not build (%s); matmuls run as XLA "
      "dots of dequantized weights",
      str(e).splitlines()[-1] if str(e) else type(e).__name__,
    )
    return False
  return True
