"""Agreement between the processes of a multi-controller job.

  barrier("chunkwise-job-written")      # every process reaches it
  agree(error)                          # raises on every process if any
                                        # process had an error
  same_everywhere(digest, "the processes planned different batches")

All of them do nothing with one process, and use
`jax.experimental.multihost_utils` with several; every process raises, or
none does. Batch jobs and checkpoint saves share them.
"""

from __future__ import annotations

import jax
import numpy as np

_ERROR_BYTES = 1024


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name`."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def agree(error: str | None, raise_as: type[Exception] = ValueError) -> None:
  """Raises `raise_as` on every process if any process passes an error (the
  first failing process's message, up to 1024 bytes, where this one has
  none), so that no process waits forever in a later collective."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    mine = np.zeros(_ERROR_BYTES, np.uint8)
    data = (error or "").encode()[:_ERROR_BYTES]
    mine[: len(data)] = np.frombuffer(data, np.uint8)
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    failed = [row for row in everyone if row.any()]
    if failed and error is None:
      error = bytes(failed[0]).rstrip(b"\0").decode(errors="replace")
  if error is not None:
    raise raise_as(error)


def same_everywhere(
  digest: bytes, message: str, raise_as: type[Exception] = ValueError
) -> None:
  """Raises `raise_as(message)` on every process unless every process
  passes the same `digest` (gathered to all: `multihost_utils.assert_equal`
  would raise only where the value differs from process 0's)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    mine = np.frombuffer(digest, np.uint8)
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    if not (everyone == mine).all():
      raise raise_as(message)


def is_multiprocess() -> bool:
  """Whether this is one process of several (`jax.distributed`)."""
  return jax.process_count() > 1


def broadcast_bytes(data: bytes | None) -> bytes:
  """Process 0's `data` on every process (the others pass None): its
  length, then the bytes padded to a power of two (few programs)."""
  if not is_multiprocess():
    if data is None:
      raise ValueError("broadcast_bytes: process 0 must give the data")
    return data
  from jax.experimental import multihost_utils

  mine = data if jax.process_index() == 0 else b""
  if jax.process_index() == 0 and data is None:
    raise ValueError("broadcast_bytes: process 0 must give the data")
  n = int(multihost_utils.broadcast_one_to_all(np.int32(len(mine))))
  size = 1 << max(6, (n - 1).bit_length())
  buffer = np.zeros(size, np.uint8)
  buffer[: len(mine)] = np.frombuffer(mine, np.uint8)
  buffer = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
  return bytes(buffer[:n])
