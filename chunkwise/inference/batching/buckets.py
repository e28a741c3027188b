"""Slot buckets: a slot loop's step costs the requests it runs.

  buckets = Buckets(slots=16)                 # sizes (1, 2, 4, 8, 16)
  rows = buckets.rows(running)                # None: every slot
  inputs = buckets.inputs(inputs, rows)       # the settings of those rows
  state = engine.slot_run(..., inputs, ..., rows=rows)

A slot loop keeps `slots` rows of state (each slot's K/V buffer or page
table, its tokens so far), but a segment need not run them all: it runs
the smallest of a few compiled row counts (the bucket sizes: powers of
two up to `slots`, and `slots`) that holds the slots whose requests are
running, as rows of their own (`rows.take`, `rows.put`: their small
per-row arrays gathered and put back, their K/V read and written where
they are). So a lone request decodes one row, not sixteen, and no row
moves when the set changes: only the list of rows does. With every slot's
bucket (`slots`) the loop runs every slot in order, as it always did.

A row's numbers never depend on the rows beside it under invariant
numerics, so a request's tokens and scores are bit for bit the same
whatever bucket each of its segments ran in (tests/test_continuous.py).
Each size is one compiled program per loop shape; a server compiles them
all before it reports ready (`serving.warmup`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from chunkwise.inference.batching import slots as slots_lib


def default_sizes(slots: int) -> tuple[int, ...]:
  """Powers of two below `slots`, then `slots`."""
  sizes = []
  n = 1
  while n < slots:
    sizes.append(n)
    n *= 2
  return (*sizes, slots)


def check_sizes(sizes: Sequence[int] | None, slots: int) -> tuple[int, ...]:
  """`sizes` checked (ascending, distinct, each in [1, slots], `slots`
  added when missing), or `default_sizes` for None; a ValueError naming
  the bad value otherwise."""
  if sizes is None:
    return default_sizes(slots)
  if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
    raise ValueError(
      f"slot_buckets={sizes!r}: expected a list of row counts, e.g. "
      f"[1, 4, {slots}]"
    )
  out = []
  for s in sizes:
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
      raise ValueError(f"slot_buckets={list(sizes)!r}: {s!r} is not an int")
    if not 1 <= s <= slots:
      raise ValueError(
        f"slot_buckets={list(sizes)!r}: {s} is outside [1, slots={slots}]"
      )
    out.append(int(s))
  return tuple(sorted(set(out) | {slots}))


class Buckets:
  """The bucket sizes of one slot loop and the rows each segment runs.

  Args:
    slots: the loop's slots.
    sizes: the row counts compiled (None: `default_sizes`); `(slots,)`
      runs every slot every segment.
    engine: the loop's generate engine: one without `slot_rows` (a
      sharded one) runs every slot.
  """

  def __init__(self, slots: int, sizes=None, engine=None):
    self.slots = slots
    self.sizes = check_sizes(sizes, slots)
    if engine is not None and not getattr(engine, "slot_rows", False):
      self.sizes = (slots,)

  def size(self, running: int) -> int:
    """The smallest size that holds `running` rows."""
    return next(s for s in self.sizes if s >= running)

  def rows(self, running: np.ndarray) -> np.ndarray | None:
    """The slots a segment runs (bool[slots] `running`: the slots whose
    requests run): int32[size] of them in order, then padding rows
    (`slots`), or None when the size is `slots` (every slot, in order)."""
    live = np.flatnonzero(running)
    size = self.size(len(live))
    if size == self.slots:
      return None
    out = np.full(size, self.slots, np.int32)
    out[: len(live)] = live
    return out

  def inputs(self, inputs: slots_lib.SlotInputs, rows) -> slots_lib.SlotInputs:
    """`inputs` (every slot's) for `rows` only; a padding row reads the
    last slot's settings with no budget (it is done: nothing runs)."""
    if rows is None:
      return inputs
    at = np.minimum(rows, self.slots - 1)

    def take(a):
      return np.asarray(a)[at]

    return inputs.replace(
      sample_ids=take(inputs.sample_ids),
      start=take(inputs.start),
      sampling=jax.tree.map(take, inputs.sampling),
      stop_ids=take(inputs.stop_ids),
      budget=np.where(rows < self.slots, take(inputs.budget), 0).astype(
        np.int32
      ),
    )

  def adapter_ids(self, ids: np.ndarray, rows) -> np.ndarray:
    """Each run row's adapter (-1: the base model, padding rows too)."""
    if rows is None:
      return ids
    return np.where(
      rows < self.slots, ids[np.minimum(rows, self.slots - 1)], -1
    )
