"""Meshes with the axes `x`, `y`, `z`, and multi-host start-up.

mesh = make_mesh((2, 2, 2))              # any shape whose product is the
mesh = make_mesh((8, 1, 1), devices)     # number of devices given
initialize_multihost("10.0.0.1:1234", num_processes=2, process_id=0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("x", "y", "z")


def make_mesh(shape: Sequence[int], devices=None) -> Mesh:
  """A mesh of axes ("x", "y", "z") over `devices` (default: all devices,
  of every process, in JAX's order).

  Raises ValueError unless `shape` has three positive ints whose product is
  the number of devices.
  """
  shape = tuple(shape)
  if len(shape) != 3 or not all(
    isinstance(n, int | np.integer) and not isinstance(n, bool) and n > 0
    for n in shape
  ):
    raise ValueError(
      f"mesh shape must be three positive ints (x, y, z), got {shape!r}"
    )
  devices = list(jax.devices() if devices is None else devices)
  if math.prod(shape) != len(devices):
    raise ValueError(
      f"mesh shape {shape} holds {math.prod(shape)} devices but "
      f"{len(devices)} were given"
    )
  grid = np.asarray(devices, dtype=object).reshape(shape)
  return Mesh(grid, AXES)


def parse_mesh(text: str) -> tuple[int, int, int]:
  """'2x2x2' -> (2, 2, 2), the CLIs' --mesh flag."""
  parts = str(text).lower().split("x")
  if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
    raise ValueError(
      f"mesh {text!r} must be three positive ints joined by 'x', e.g. 2x2x2"
    )
  return tuple(int(p) for p in parts)


def initialize_multihost(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  cpu_collectives: str | None = "gloo",
  local_device_count: int | None = None,
) -> None:
  """Starts JAX's multi-controller runtime (`jax.distributed.initialize`).

  Call it once per process, before any other JAX work. With no arguments
  JAX detects the cluster itself (TPU pods, SLURM, ...). On CPU, the
  processes talk through `cpu_collectives` ("gloo" by default; None keeps
  JAX's setting); `local_device_count` forces that many host devices per
  process (tests run two processes of 4 devices on one machine).
  """
  given = (coordinator_address, num_processes, process_id)
  if any(v is not None for v in given) and any(v is None for v in given):
    raise ValueError(
      "coordinator_address, num_processes and process_id go together: "
      f"got {given}; pass all three, or none for automatic detection"
    )
  if num_processes is not None and not (
    isinstance(num_processes, int) and num_processes >= 1
  ):
    raise ValueError(f"num_processes must be an int >= 1, got {num_processes}")
  if process_id is not None and not (
    isinstance(process_id, int) and 0 <= process_id < num_processes
  ):
    raise ValueError(
      f"process_id must be in [0, {num_processes}), got {process_id}"
    )
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  if local_device_count is not None:
    jax.config.update("jax_num_cpu_devices", local_device_count)
  jax.distributed.initialize(
    coordinator_address=coordinator_address,
    num_processes=num_processes,
    process_id=process_id,
  )
