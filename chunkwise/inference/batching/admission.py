"""Admission: the host putting prompts into free slots, for both slot loops
(`continuous.run_many` and `live.LiveSlots`).

A request taking a slot becomes an `Admission` (its prompt, adapter, slot
and its processors' initial states), looked up in the prefix cache for
its longest cached start. Prompts are prefilled after the shared prefix
in groups (`prefill_into`: `admit_rows` rows, or a live loop's few row
counts where rows are invariant, columns padded to a power of two of at
least 8, so few programs compile and no prompt's K/V depend on its
neighbours') and written into their slots (`slots.admit`);
a long one is staged instead, prefilled one piece per segment (`stage`,
`advance_staged`) while the other slots decode.

Beside it, the host's other edits of the slots' state that both loops
make: preempted slots freed (`vacate`), the paged pool's table put on
device (`with_table`), empty speculation rows (`with_speculation`), and
host arrays placed where the slots' own are (`replicated_like`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise.inference import long_prefill
from chunkwise.inference.batching import slots
from chunkwise.inference.batching.slot_requests import prompt_bucket
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.engines.engine import Engine
from chunkwise.inference.paging import page_table, prefix_cache
from chunkwise.inference.speculation import SpecRows
from chunkwise.partitioning.placement import put

ADMIT_ROWS = 4  # prompts prefilled per call (see `admit_rows`)
# A live loop under row-invariant numerics prefills prompts this short
# (their length bucket) that arrive together several to a call (`rows_for`).
GROUP_WIDTH = 64


_ADMIT: dict = {}  # one admission program per placement of the slots


def replicated_like(state: slots.SlotState, tree):
  """Host arrays placed where the slots' small per-row arrays are: on a
  mesh replicated over every device (of every process)."""
  where = state.done.sharding
  if not isinstance(where, jax.sharding.NamedSharding):
    return jax.tree.map(lambda x: jax.device_put(x, where), tree)
  where = jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(lambda x: put(x, where), tree)


def admit_programs() -> int:
  """Admission programs compiled so far (for benchmarks)."""
  return sum(p._cache_size() for p in _ADMIT.values())


def _program(fn, state):
  """`fn` (a program over the slots' state, donated) jitted once per
  placement of the state."""
  shardings = jax.tree.map(lambda x: x.sharding, state)
  key = jax.tree.flatten(shardings)
  key = (fn.__name__, tuple(key[0]), key[1])
  if key not in _ADMIT:
    _ADMIT[key] = jax.jit(fn, donate_argnums=0, out_shardings=shardings)
  return _ADMIT[key]


def _admit(state, prompts, at, lengths, rows, tokens, head=None):
  """`slots.admit` of prompts after a cached start (`head`, written first
  by `slots.put_head`: one program per width of it) or none. The prompts'
  tokens go as wide as a slot: one admission program per prompt width,
  whatever the cached start and the whole prompt's length."""
  wide = np.zeros((tokens.shape[0], state.tokens.shape[1]), np.int32)
  n = min(tokens.shape[1], wide.shape[1])
  wide[:, :n] = tokens[:, :n]
  offset = np.int32(0)
  if head is not None:
    at_head = replicated_like(state, at)
    state = _program(slots.put_head, state)(state, head, at_head)
    offset = head.lengths[0]
  at, lengths, rows, wide = replicated_like(state, (at, lengths, rows, wide))
  return _program(slots.admit, state)(
    state, prompts, at, lengths, rows, wide, offset
  )


def warm_heads(state, template, widths):
  """`slots.put_head` of a cached start of each of `widths` (zeros like
  the prefix cache's page `template`: a [layers, 1, page, ...] array),
  its writes dropped: the program of each width compiled (warm-up)."""
  for width in widths:
    blank = jnp.zeros_like(template)
    pages = (blank,) * (width // template.shape[2])
    head = prefix_cache.join(pages, pages, 0)
    at = replicated_like(state, np.int32([state.slots]))  # dropped
    state = _program(slots.put_head, state)(state, head, at)
  return state


vacate = jax.jit(slots.vacate, donate_argnums=0)


def with_table(state: slots.SlotState, pool: page_table.Pages | None):
  """`state` with the pool's page table (a paged pool) on device."""
  if pool is None:
    return state
  table = replicated_like(state, pool.table())
  return state.replace(cache=state.cache.replace(table=table))


def with_speculation(state: slots.SlotState, speculation, capacity: int):
  """`state` with empty speculation rows (history `capacity` wide) when
  `speculation` is set."""
  if speculation is None:
    return state
  empty = np.zeros((state.slots, capacity), np.int32)
  rows = SpecRows.start(empty, np.zeros(state.slots, np.int32), speculation)
  return state.replace(spec=replicated_like(state, rows))


def admit_rows(slots_n: int) -> int:
  """Rows of every admission prefill: a fixed width, so that a prompt's
  K/V never depend on the prompts admitted with it (matmuls of the same
  shape round each row alike), only on the call's slots."""
  return min(ADMIT_ROWS, slots_n)


def row_counts(width: int, sizes: Sequence[int]) -> Sequence[int]:
  """The loop's row counts `sizes` (ascending) that an admission prefill
  of prompts `width` wide (their length bucket) may take: all of them up
  to `GROUP_WIDTH`, the first past it (a long prompt's prefill costs its
  rows whatever they hold)."""
  return sizes if width <= GROUP_WIDTH else sizes[:1]


def rows_for(waiting: int, width: int, sizes: Sequence[int]) -> int:
  """Rows of the next admission prefill of `waiting` prompts of one group
  (their length bucket `width`): the smallest of its `row_counts` that
  holds them all (the largest if none does)."""
  counts = row_counts(width, sizes)
  return next((r for r in counts if r >= waiting), counts[-1])


@dataclasses.dataclass(frozen=True)
class Admission:
  """One prompt going into a free slot: its ids (after the shared prefix),
  its adapter's stack index (-1: base), its slot, and each processor's
  initial state for it (leading axis 1)."""

  prompt: np.ndarray
  adapter_id: int
  slot: int
  processor_state: tuple
  hit: prefix_cache.Hit | None = None  # its cached start, pinned

  @property
  def cached(self) -> int:
    """Tokens of the prompt whose K/V come from the prefix cache."""
    return 0 if self.hit is None else self.hit.tokens

  @property
  def head(self):
    """The cached start's K/V (a batch-1 `KVCache`), or None."""
    return self.hit.head if self.cached else None

  def looked_up(self, cache: prefix_cache.PrefixCache | None) -> Admission:
    """This admission with its prompt's longest cached prefix."""
    if cache is None:
      return self
    return dataclasses.replace(
      self, hit=cache.lookup(self.adapter_id, self.prompt)
    )

  def store(self, cache, kv, row: int) -> None:
    """Stores the full pages of its prompt (row `row` of `kv`, the K/V of
    what followed the cached start) and unpins its hit."""
    if cache is None:
      return
    cache.insert(self.adapter_id, self.prompt, kv, row=row, offset=self.cached)
    if self.hit is not None:  # (a hit admitted as a miss has none)
      cache.release(self.hit)


def prefill_into(
  state: slots.SlotState,
  admissions: Sequence[Admission],
  caches,
  prev,
  engine: Engine,
  bos_id: int,
  adapters_of,
  rows: int | Sequence[int] | None = None,
  cache: prefix_cache.PrefixCache | None = None,
  top_n: int = 0,
) -> slots.SlotState:
  """Prefills `admissions` after the shared prefix and puts them into
  their slots: prefills of `rows` rows (default `admit_rows`; several
  counts: each call's `rows_for` its group, only where every row's sums
  are the same whatever the rows) per group of prompts of the same length
  bucket and cached start (only what follows `Admission.looked_up`'s start
  is prefilled; the full pages of what was go into the prefix `cache`).
  `top_n`: the alternatives the prefill computes (unused here; a live loop
  asks for its own top-n, so that its admission prefills are the programs
  that score a prompt)."""
  sizes = (rows or admit_rows(state.slots),) if not _many(rows) else rows
  groups: dict[tuple[int, int], list[Admission]] = {}
  for a in admissions:
    key = (prompt_bucket(a.prompt.size - a.cached), _head_key(a))
    groups.setdefault(key, []).append(a)
  for (time, key), group in sorted(groups.items()):
    # A cached start's prefills take the first count (`heads.py` compiles
    # those in the background).
    own = sizes if key == -1 else sizes[:1]
    lo = 0
    while lo < len(group):
      rows = rows_for(len(group) - lo, time, own)
      part = group[lo : lo + rows]
      lo += len(part)
      head, skip = part[0].head, part[0].cached
      lengths = np.zeros(rows, np.int32)
      tokens = np.zeros((rows, time), np.int32)
      widest = max(a.prompt.size for a in part)
      whole = np.zeros((rows, prompt_bucket(widest)), np.int32)
      slots_at = np.full(rows, state.slots, np.int32)  # padding: dropped
      ids = np.full(rows, -1, np.int32)
      for j, a in enumerate(part):
        lengths[j] = a.prompt.size - skip
        tokens[j, : lengths[j]] = a.prompt[skip:]
        whole[j, : a.prompt.size] = a.prompt
        slots_at[j], ids[j] = a.slot, a.adapter_id
      ids = np.where(lengths > 0, ids, -1).astype(np.int32)
      result = engine.prefill(
        caches if head is None else (*caches, head),
        prev if head is None else None,
        Chunk(tokens=tokens, lengths=lengths),
        top_n=top_n,
        bos_id=bos_id,
        adapters=adapters_of(engine, ids),
      )
      # Padding rows repeat the first admission's states (never used).
      fill = [part[min(j, len(part) - 1)].processor_state for j in range(rows)]
      processor_rows = jax.tree.map(lambda *s: np.concatenate(s, axis=0), *fill)
      state = _admit(
        state,
        result,
        slots_at,
        np.where(lengths > 0, lengths + skip, 0).astype(np.int32),
        processor_rows,
        whole,
        head,
      )
      for j, a in enumerate(part):
        a.store(cache, result.kv_cache, j)
  return state


def _many(rows) -> bool:
  return rows is not None and not isinstance(rows, int)


def _head_key(a: Admission) -> int:
  """Admissions with the same cached start share one prefill (-1: none)."""
  return -1 if not a.cached else a.hit.key


def stage(
  a: Admission,
  caches,
  prev,
  engine: Engine,
  bos_id: int,
  adapters_of,
  width: int,
  columns: int,
  top_n: int = 0,
) -> long_prefill.Staged:
  """`a`'s prompt (after its cached start, if any), to be prefilled after
  the shared prefix one piece of `width` columns at a time (chunked
  prefill), padded to a whole number of pieces, into a buffer of the
  slots' `columns`: its programs are the same whatever its length (a loop
  compiles them once, at warm-up), and the pieces' attention skips the
  buffer's unfilled columns."""
  run = functools.partial(
    engine.prefill,
    top_n=top_n,
    bos_id=bos_id,
    adapters=adapters_of(engine, np.int32([a.adapter_id])),
  )
  rest = a.prompt[a.cached :]
  chunk = Chunk(
    tokens=rest[None].astype(np.int32), lengths=np.int32([rest.size])
  ).pad_to_length(-(-rest.size // width) * width)
  if a.head is not None:
    caches, prev = (*caches, a.head), None
  return long_prefill.Staged(
    run,
    caches,
    prev,
    chunk,
    width=width,
    columns=max(columns, chunk.time),
    scores=False,
  )


def advance_staged(
  state: slots.SlotState,
  staged: dict[int, tuple[Admission, long_prefill.Staged]],
  cache: prefix_cache.PrefixCache | None = None,
) -> tuple[slots.SlotState, int | None]:
  """One piece of the longest-held staged prompt (`staged`: by slot);
  after its last, the prompt goes into its slot and leaves `staged` (its
  full pages into the prefix `cache`). Returns the state and that slot
  (None while pieces remain)."""
  if not staged:
    return state, None
  slot, (a, pending) = next(iter(staged.items()))
  result = pending.advance()
  if result is None:
    return state, None
  del staged[slot]
  state = _admit(
    state,
    result,
    np.int32([a.slot]),
    np.int32([a.prompt.size]),
    a.processor_state,
    a.prompt[None].astype(np.int32),
    a.head,
  )
  a.store(cache, result.kv_cache, 0)
  return state, slot
