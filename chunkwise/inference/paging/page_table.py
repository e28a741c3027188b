"""`Pages`: the host side of a paged K/V pool (`paged_kv.PagedKV`).

  pages = Pages(pages=512, page=32, slots=32, columns=1024)
  pages.reserve(slot, prompt_columns + ahead)    # admit, if it fits
  preempted = pages.make_room({slot: columns + ahead, ...}, order)
  pages.release(slot)                            # finished
  state.cache.replace(table=pages.table())       # before each program

Which pool pages each slot holds, in the order of its columns. A slot
holds pages for the columns it has written and those its next segment may
write (`grow`), so a write on device always lands in a held page. Pages
are handed out lowest first: the schedule, and so each request's pages,
depend only on the requests, as every process of a multi-host run needs.
"""

from __future__ import annotations

import heapq

import numpy as np

from chunkwise.inference.paging.paged_kv import PAGE


def pool(
  kv_pages: int, *, slots: int, columns: int
) -> tuple[Pages | None, dict]:
  """The host tables of a pool of `kv_pages` pages of `PAGE` columns for
  `slots` slots of up to `columns` columns (None without a pool), and
  the `slot_init` arguments that lay out its device side."""
  if not kv_pages:
    return None, {}
  pages = Pages(pages=kv_pages, page=PAGE, slots=slots, columns=columns)
  return pages, {"pages": kv_pages, "page": PAGE}


def ahead(every: int, speculation) -> int:
  """Columns one segment of `every` steps may add to a running request
  (with `speculation`, up to k + 1 tokens a step)."""
  return every * (1 + (speculation.k if speculation is not None else 0))


class Pages:
  """Which of `pages` pool pages each of `slots` slots holds."""

  def __init__(self, *, pages: int, page: int, slots: int, columns: int):
    if pages < 1 or page < 1:
      raise ValueError(
        f"a pool needs pages >= 1 of >= 1 columns, got {pages=}, {page=}"
      )
    self.pages, self.page = pages, page
    self.per_row = -(-columns // page)
    self._free = list(range(pages))
    heapq.heapify(self._free)
    self._held: list[list[int]] = [[] for _ in range(slots)]
    self.peak = 0  # most pages held at once

  @property
  def free(self) -> int:
    return len(self._free)

  def held(self, slot: int) -> int:
    return len(self._held[slot])

  def needed(self, slot: int, columns: int) -> int:
    """Pages `slot` lacks to hold `columns` columns (at most a table's)."""
    want = min(-(-columns // self.page), self.per_row)
    return max(want - len(self._held[slot]), 0)

  def fits(self, demand: dict[int, int]) -> bool:
    """Whether every slot of `demand` (slot -> columns) can grow at once."""
    return sum(self.needed(s, c) for s, c in demand.items()) <= self.free

  def grow(self, slot: int, columns: int) -> None:
    """`slot` holds pages for `columns` columns (raises if they don't fit:
    check `fits` first)."""
    n = self.needed(slot, columns)
    if n > self.free:
      raise RuntimeError(f"slot {slot} needs {n} pages, {self.free} are free")
    self._held[slot].extend(heapq.heappop(self._free) for _ in range(n))
    self.peak = max(self.peak, self.pages - self.free)

  def release(self, slot: int) -> None:
    for p in self._held[slot]:
      heapq.heappush(self._free, p)
    self._held[slot] = []

  def reserve(self, slot: int, columns: int) -> bool:
    """`grow` if it fits; whether it did (an admission waits otherwise)."""
    if not self.fits({slot: columns}):
      return False
    self.grow(slot, columns)
    return True

  def make_room(self, demand: dict[int, int], order: dict[int, int]):
    """Grows every slot of `demand` (slot -> columns its next segment may
    reach), first preempting the slots admitted last (`order`: slot ->
    admission count) until the rest fit, as vLLM preempts. Returns the
    preempted slots (their pages released), latest first."""
    demand = dict(demand)
    preempted = []
    while demand and not self.fits(demand):
      victim = max(demand, key=order.__getitem__)
      del demand[victim]
      self.release(victim)
      preempted.append(victim)
    for slot, columns in demand.items():
      self.grow(slot, columns)
    return preempted

  def table(self) -> np.ndarray:
    """int32[slots, per_row]: each slot's pages, `pages` past them."""
    out = np.full((len(self._held), self.per_row), self.pages, np.int32)
    for s, held in enumerate(self._held):
      out[s, : len(held)] = held
    return out
