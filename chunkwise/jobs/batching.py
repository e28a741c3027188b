"""Length-bucketed batches for batch jobs, the same on every process.

  for batch in batches(lengths, batch_size=8, limit=2048):
    batch.indices    # which examples, longest first; None pads the batch
    batch.time       # the padded length: a power of two (at least 16)

Examples are sorted by length, longest first (a job that runs out of
memory does so on its first batch), and cut into batches of `batch_size`
rows; the last batch is filled with padding rows so every call has the
same batch size. Each batch's time is its longest row rounded up to a
power of two (capped by `limit`), so a job compiles a handful of
programs. The plan is a pure function of its arguments: every process of
a multi-host job computes the same one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

MIN_TIME = 16


@dataclasses.dataclass(frozen=True)
class Batch:
  indices: tuple[int | None, ...]  # None: a padding row
  time: int

  @property
  def rows(self) -> list[int]:
    """The indices of the real rows."""
    return [i for i in self.indices if i is not None]


def bucket(length: int, limit: int) -> int:
  """`length` rounded up to a power of two of at least `MIN_TIME`, at most
  `limit` (never below `length`)."""
  time = MIN_TIME
  while time < length:
    time *= 2
  return max(length, min(time, limit))


def batches(
  lengths: Sequence[int], *, batch_size: int, limit: int
) -> list[Batch]:
  """The batches (see the module docstring) of examples of `lengths`."""
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size}: expected at least 1")
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  out = []
  for start in range(0, len(order), batch_size):
    rows = order[start : start + batch_size]
    pad = (None,) * (batch_size - len(rows))
    out.append(Batch((*rows, *pad), bucket(lengths[rows[0]], limit)))
  return out


def owned(batch: Batch, process: int, processes: int) -> list[int]:
  """Positions in `batch` of the rows process `process` of `processes`
  writes: contiguous blocks of `batch_size / processes` rows."""
  size = len(batch.indices) // processes
  block = range(process * size, (process + 1) * size)
  return [r for r in block if batch.indices[r] is not None]
