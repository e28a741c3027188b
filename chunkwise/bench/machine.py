"""The machine's physical limits, measured in the same run as the model:
memory read bandwidth (a jitted sum over an array much larger than the
caches) and peak matmul FLOP/s (a large square matmul).

  limits = measure(bandwidth_bytes=512 << 20, matmul_size=2048, runs=5)
  limits.bandwidth      # bytes/s, median of `runs`
  limits.peak_flops     # FLOP/s, median of `runs`
"""

from __future__ import annotations

import dataclasses
import os
import platform

import jax
import jax.numpy as jnp

from chunkwise.bench.timing import median_seconds


@dataclasses.dataclass(frozen=True)
class Limits:
  bandwidth: float  # bytes/s read from memory
  peak_flops: float  # FLOP/s of a large f32 matmul
  bandwidth_bytes: int  # size of the array summed
  matmul_size: int  # n of the n x n x n matmul

  def describe(self) -> dict:
    return {
      "bandwidth_gb_s": self.bandwidth / 1e9,
      "peak_matmul_gflop_s": self.peak_flops / 1e9,
      "bandwidth_array_mib": self.bandwidth_bytes / 2**20,
      "matmul_size": self.matmul_size,
      "cpu_count": os.cpu_count(),
      "processor": platform.processor() or platform.machine(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": jax.device_count(),
    }


def bandwidth(nbytes: int, runs: int) -> float:
  """Bytes/s of a jitted f32 sum over `nbytes` (median of `runs`)."""
  n = max(nbytes // 4, 1)
  x = jnp.ones((n,), jnp.float32) * 1e-3
  total = jax.jit(lambda a: jnp.sum(a))
  seconds = median_seconds(lambda: total(x), runs)
  return 4 * n / seconds


def peak_flops(size: int, runs: int) -> float:
  """FLOP/s of a jitted f32 [size, size] @ [size, size] (median)."""
  a = jnp.ones((size, size), jnp.float32)
  b = jnp.ones((size, size), jnp.float32) * 1e-3
  matmul = jax.jit(jnp.matmul)
  seconds = median_seconds(lambda: matmul(a, b), runs)
  return 2 * size**3 / seconds


def measure(
  *, bandwidth_bytes: int = 512 << 20, matmul_size: int = 2048, runs: int = 5
) -> Limits:
  for name, value in (
    ("bandwidth_bytes", bandwidth_bytes),
    ("matmul_size", matmul_size),
    ("runs", runs),
  ):
    if value < 1:
      raise ValueError(f"{name}={value}: expected a positive integer")
  return Limits(
    bandwidth=bandwidth(bandwidth_bytes, runs),
    peak_flops=peak_flops(matmul_size, runs),
    bandwidth_bytes=bandwidth_bytes,
    matmul_size=matmul_size,
  )
