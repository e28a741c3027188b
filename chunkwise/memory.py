"""Device memory: what the default device can still hold, checked before
anything large is allocated on it.

  check_fits("random llama3-8b weights (float32)", 32.1e9)
  # ValueError: random llama3-8b weights (float32) too large: they need
  # 32.1 GB, the device (cpu) has 21.9 GB free

Accelerators report their allocator's limit and use; on the CPU it is the
host's available memory (/proc/meminfo's MemAvailable). Asking starts
JAX's backend: a multi-process job asks after `jax.distributed.initialize`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp


def free_bytes() -> int:
  """Bytes this process's first device can still allocate (a local
  device: with several processes, `jax.devices()[0]` may be another
  process's, whose memory this one cannot read)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_random_weights(params: int, dtype) -> None:
  """`check_fits` for `params` random weights of `dtype`, drawn on the
  device (`InferenceModel.random`; the batch jobs ask before any output)."""
  dtype = jnp.dtype(dtype)
  check_fits(
    f"random weights ({params / 1e9:.3g}B parameters, {dtype.name})",
    params * dtype.itemsize,
  )


def check_fits(what: str, need: float) -> None:
  """Raises ValueError, in one line, when `need` bytes for `what` exceed
  the default device's free memory."""
  free = free_bytes()
  if need > free:
    raise ValueError(
      f"{what} too large: they need {need / 1e9:.1f} GB, the device "
      f"({jax.default_backend()}) has {free / 1e9:.1f} GB free"
    )
