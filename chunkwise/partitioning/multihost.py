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
