"""The device's physical limits, measured in the same run as the model:
memory read bandwidth and peak matmul FLOP/s at each (dtype, precision)
the benchmark's models compute with.

  limits = measure(bandwidth_bytes=512 << 20, matmul_size=2048, runs=5,
                   matmuls=(("float32", "highest"), ("bfloat16", "default")))
  limits.bandwidth                      # bytes/s, median of `runs`
  limits.peak("bfloat16", "default")    # FLOP/s, median of `runs`

Both are timed on the device, not the host: one program runs the work
once and another `1 + REPEATS` times in a chain (each pass depends on the
previous one, so nothing is computed once for all), and the difference of
their medians is the device time of `REPEATS` passes.
Dispatch and host synchronisation cancel out: timing one 512 MiB sum from
the host on an H100 said half the real HBM bandwidth, since the launch
took as long as the sum.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from chunkwise.bench.timing import median_seconds
from chunkwise.precision import resolve as resolve_precision

# Extra passes of the timed loop: enough that the device time dominates
# the noise of two host-timed calls.
REPEATS = 8
MATMUL_DTYPES = ("float32", "bfloat16")


def _key(dtype, precision: str) -> str:
  return f"{jnp.dtype(dtype).name}/{precision}"


@dataclasses.dataclass(frozen=True)
class Limits:
  bandwidth: float  # bytes/s read from device memory
  peaks: dict  # "dtype/precision" -> FLOP/s of a large square matmul
  bandwidth_bytes: int  # size of the array read
  matmul_size: int  # n of the n x n x n matmul

  def peak(self, dtype, precision: str) -> float:
    """FLOP/s of matmuls in `dtype` at `precision` (measured by `measure`;
    asking for one it did not measure raises)."""
    key = _key(dtype, precision)
    if key not in self.peaks:
      raise ValueError(
        f"no peak measured for {key}; measured: {sorted(self.peaks)}"
      )
    return self.peaks[key]

  def hardware(self, dtype="float32", precision="highest"):
    """This device as the planner's `Hardware` ("this machine"): the
    measured bandwidth and matmul peak at (`dtype`, `precision`), the
    memory `chunkwise.memory` says is free, no links."""
    from chunkwise import memory, planner

    return planner.measured(
      f"this machine ({jax.devices()[0].device_kind})",
      flops=self.peak(dtype, precision),
      hbm_bytes=memory.free_bytes(),
      hbm_bandwidth=self.bandwidth,
    )

  def describe(self) -> dict:
    device = jax.devices()[0]
    return {
      "bandwidth_gb_s": self.bandwidth / 1e9,
      "peak_matmul_gflop_s": {k: v / 1e9 for k, v in self.peaks.items()},
      "bandwidth_array_mib": self.bandwidth_bytes / 2**20,
      "matmul_size": self.matmul_size,
      "timing": f"on device: chains of 1 and {1 + REPEATS} passes",
      "cpu_count": os.cpu_count(),
      "processor": platform.processor() or platform.machine(),
      "device_kind": device.device_kind,
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": jax.device_count(),
    }


def chain(step: Callable[[jax.Array, jax.Array], jax.Array], n: int):
  """A jitted (carry, operand) -> carry applying `step` `n` times in a row
  (unrolled: XLA:CPU would run a loop body on one thread)."""

  def run(c, w):
    for _ in range(n):
      c = step(c, w)
    return c

  return jax.jit(run)


def device_seconds(
  step: Callable[[jax.Array, jax.Array], jax.Array],
  init: jax.Array,
  operand: jax.Array,
  runs: int,
) -> float:
  """Device seconds of one `step(carry, operand)` -> carry of the same
  shape: the median of a loop of `1 + REPEATS` steps minus that of one
  step, over `REPEATS` (never below a nanosecond). `operand` is an
  argument of the program, not a constant folded into it."""

  one, many = chain(step, 1), chain(step, 1 + REPEATS)
  t_one = median_seconds(lambda: one(init, operand), runs)
  t_many = median_seconds(lambda: many(init, operand), runs)
  return max((t_many - t_one) / REPEATS, 1e-9)


def bandwidth(nbytes: int, runs: int) -> float:
  """Bytes/s of reading an f32 array of `nbytes` once per pass: each pass
  sums it scaled by a number that depends on the previous pass."""
  n = max(nbytes // 4, 1)
  x = jnp.full((n,), 1e-3, jnp.float32)
  return 4 * n / device_seconds(read_step, jnp.float32(1.0), x, runs)


def read_step(s: jax.Array, x: jax.Array) -> jax.Array:
  """One pass reading all of `x`; s stays 1 + O(1e-30) (a real
  dependence on the previous pass, no growth)."""
  return 1.0 + 1e-30 * jnp.sum(x * s)


def peak_flops(size: int, runs: int, dtype="float32", precision="highest"):
  """FLOP/s of a [size, size] @ [size, size] matmul in `dtype` at
  `precision`, chained pass to pass (b = 1/size keeps values at 1)."""
  if jnp.dtype(dtype).name not in MATMUL_DTYPES:
    raise ValueError(f"dtype={dtype!r}: expected one of {MATMUL_DTYPES}")
  precision = resolve_precision(precision, dtype)  # checked
  b = jnp.full((size, size), 1.0 / size, dtype)
  a = jnp.ones((size, size), dtype)
  step = functools.partial(jnp.matmul, precision=precision)
  return 2 * size**3 / device_seconds(step, a, b, runs)


def measure(
  *,
  bandwidth_bytes: int = 512 << 20,
  matmul_size: int = 2048,
  runs: int = 5,
  matmuls: Sequence[tuple[str, str]] = (("float32", "highest"),),
) -> Limits:
  for name, value in (
    ("bandwidth_bytes", bandwidth_bytes),
    ("matmul_size", matmul_size),
    ("runs", runs),
  ):
    if value < 1:
      raise ValueError(f"{name}={value}: expected a positive integer")
  if not matmuls:
    raise ValueError("matmuls is empty: expected (dtype, precision) pairs")
  peaks = {
    _key(dtype, precision): peak_flops(matmul_size, runs, dtype, precision)
    for dtype, precision in dict.fromkeys(matmuls)
  }
  return Limits(
    bandwidth=bandwidth(bandwidth_bytes, runs),
    peaks=peaks,
    bandwidth_bytes=bandwidth_bytes,
    matmul_size=matmul_size,
  )
