"""Continuous batching: many requests through a fixed number of slots.

  requests = [cw.Request(tokens=ids, sample_id=i, steps=64) for ...]
  for r in model.generate_many(requests, slots=16, prefix=[few_shot]):
    print(r.index, r.finish_reason, vocab.decode(r.tokens.tolist()))

The host side of `slots`: every request is validated before any device
work (`slot_requests.check_many`), then the slots are kept full. Free
slots take the next waiting requests in order: their prompts are
prefilled after the shared prefix, up to four at once, and put into the
slots (`admission.py`, shared with `live.LiveSlots`); the slots then
decode on device until one of them finishes (or `every` steps pass), the
host collects what finished, and so on. Results are yielded as requests
finish (in request order among those finishing together).

The contract: a request's tokens equal, and its scores match (to float
rounding), `generate(prefix + [prefill(its prompt)], sample_ids=[its id],
steps=its steps, ...)` run alone, whatever the slots, the order and the
other requests. For a given number of slots its results are bit-identical
whatever the order and the other requests (every program's shapes are the
same; rows never mix), which batch jobs rely on to resume. The schedule
depends only on the requests (never on timing), so every process of a
multi-host run makes the same one.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise.configs import HParams
from chunkwise.inference import long_prefill
from chunkwise.inference.batching import slots
from chunkwise.inference.batching.admission import (
  Admission,
  advance_staged,
  prefill_into,
  replicated_like,
  stage,
  vacate,
  with_speculation,
  with_table,
)
from chunkwise.inference.batching.buckets import Buckets
from chunkwise.inference.batching.slot_requests import (  # noqa: F401 (re-exported)
  CAPACITY_STEP,
  FINISH_LENGTH,
  FINISH_STOP,
  SAMPLING_FIELDS,
  Request,
  RequestResult,
  _Checked,
  check_many,
  check_request,
  columns_needed,
  prompt_bucket,
  slot_capacity,
)
from chunkwise.inference.engines.engine import (
  Engine,
  compiled_programs,
  prefix_inputs,
)
from chunkwise.inference.paging import page_table, prefix_cache
from chunkwise.inference.results import ChunkResult
from chunkwise.inference.speculation.calibration import Calibration


def run_many(
  call: _Checked,
  prefix: tuple[ChunkResult, ...],
  *,
  prefill_engine: Engine,
  generate_engine: Engine,
  hparams: HParams,
  slots_n: int,
  top_n: int,
  bos_id: int,
  every: int,
  progress: bool = False,
  trace: Callable[[str, list[int]], None] | None = None,
  served=None,
  speculation=None,
  piece: int | None = None,
  cache: prefix_cache.PrefixCache | None = None,
  pages: int = 0,
  buckets: Buckets | None = None,
) -> Iterator[RequestResult]:
  """The scheduler (module docstring) over a validated call; `trace` (for
  benchmarks) is told ("first_token", requests) at the host sync after the
  segment that computed their first tokens, and ("steps", [k]) after each
  segment of k decode steps. `served` (an `adapters.AdapterSet`) runs
  each request's adapter. A prompt longer than `piece` columns (default
  `long_prefill.SLOT_COLUMNS`) is prefilled one piece per segment, its
  slot held meanwhile (chunked prefill: the other slots keep decoding).
  With a prefix `cache`, a prompt prefills only what follows its longest
  cached start (`prefix_cache`), and its full pages are stored there.

  With `pages`, the slots' K/V are one pool of that many pages
  (`paged_kv`): a request is admitted when its prompt's pages and its next
  segment's fit, and before each segment every running request gets the
  pages its next `every` steps may fill; where they don't fit, the
  requests admitted last are preempted, to be run again from their
  prompts when pages free up (the same tokens under invariant numerics,
  where a request's result never depends on its neighbours or when it
  ran; under fast numerics, a rerun's, which may differ at a near tie).

  Each segment runs the smallest of `buckets` (default: every slot) that
  holds the running requests (`buckets.py`)."""

  def adapters_of(engine, ids):
    return None if served is None else served.call(engine, ids)

  caches, prev = prefix_inputs(prefix)
  n = len(call.prompts)
  pool, paging = page_table.pool(pages, slots=slots_n, columns=call.capacity)
  state = generate_engine.slot_init(
    caches,
    slots=slots_n,
    capacity=call.capacity,
    steps=call.capacity,
    top_n=top_n,
    vocab=hparams.vocab,
    **paging,
  )
  ahead = page_table.ahead(every, speculation)
  admitted = {}  # slot -> admission count (the latest is preempted first)
  tick = itertools.count()
  generated = np.zeros(slots_n, np.int64)
  # Free slots hold request 0's initial processor states.
  state = state.replace(
    processor_states=replicated_like(
      state,
      jax.tree.map(
        lambda s: np.repeat(s[:1], slots_n, axis=0), call.processor_states
      ),
    )
  )
  state = with_speculation(state, speculation, call.capacity)
  buckets = buckets or Buckets(slots_n, (slots_n,))
  calibrations: dict[int, Calibration] = {}  # per bucket size
  occupant = np.full(slots_n, -1)
  before = np.zeros(slots_n, np.int64)  # tokens per slot at the last look
  waiting = collections.deque(range(n))
  piece = piece or long_prefill.SLOT_COLUMNS
  staged: dict[int, tuple[Admission, long_prefill.Staged]] = {}  # by slot
  held: dict[int, int] = {}  # the request each staged slot holds

  def admission(i: int, slot: int) -> Admission:
    return Admission(
      prompt=call.prompts[i],
      adapter_id=int(call.adapter_ids[i]),
      slot=slot,
      processor_state=jax.tree.map(
        lambda s: s[i : i + 1], call.processor_states
      ),
    )

  bar = _progress_bar(n, progress)
  try:
    while waiting or (occupant >= 0).any() or staged:
      preempted = []
      if pool is not None:
        running = np.flatnonzero(occupant >= 0)
        preempted = pool.make_room(
          {
            int(s): call.prompts[occupant[s]].size + int(generated[s]) + ahead
            for s in running
          },
          admitted,
        )
        for s in preempted:
          waiting.appendleft(int(occupant[s]))
          occupant[s] = -1
        if preempted:
          state = vacate(state, replicated_like(state, np.int32(preempted)))
          if trace is not None:
            trace("preempted", [waiting[j] for j in range(len(preempted))])
      free = [s for s in np.flatnonzero(occupant < 0) if s not in staged]
      if pool is not None and preempted:
        free = []  # a preempted request waits a segment (no churn)
      take = []
      while waiting and free:
        i = waiting[0]
        if pool is not None and not pool.reserve(
          int(free[0]), call.prompts[i].size + ahead
        ):
          break  # in order: the next request waits for pages
        i, slot = waiting.popleft(), int(free.pop(0))
        admitted[slot] = next(tick)
        a = admission(i, slot).looked_up(cache)
        if a.prompt.size - a.cached > piece:
          staged[slot] = (
            a,
            stage(
              a,
              caches,
              prev,
              prefill_engine,
              bos_id,
              adapters_of,
              piece,
              call.capacity,
            ),
          )
          held[slot] = i
        else:
          take.append((i, a))
      state = with_table(state, pool)
      if take:
        state = prefill_into(
          state,
          [a for _, a in take],
          caches,
          prev,
          prefill_engine,
          bos_id,
          adapters_of,
          cache=cache,
        )
      state, slot = advance_staged(state, staged, cache)
      take = [(i, a.slot) for i, a in take]
      if slot is not None:
        take.append((held.pop(slot), slot))
      for i, slot in take:
        occupant[slot], before[slot] = i, 0
      take = [i for i, _ in take]
      rows = buckets.rows(occupant >= 0)
      inputs = buckets.inputs(_inputs(call, occupant), rows)
      ids = np.where(occupant >= 0, call.adapter_ids[occupant], -1)
      ids = buckets.adapter_ids(ids.astype(np.int32), rows)
      size = slots_n if rows is None else len(rows)
      if speculation is not None and size not in calibrations:
        calibrations[size] = Calibration(speculation, size)
      state = segment(
        generate_engine,
        calibrations.get(size),
        caches,
        state,
        inputs,
        jnp.int32(every),
        adapters=adapters_of(generate_engine, ids),
        speculation=speculation,
        rows=rows,
      )
      done, stopped, generated = jax.device_get(
        (state.done, state.stopped, state.generated)
      )
      if trace is not None:
        if take:
          trace("first_token", take)
        trace("held", [int((occupant >= 0).sum())])
        ran = np.where(occupant >= 0, generated - before, 0)
        trace("steps", [int(ran.max(initial=0))])
        before = generated.copy()
      finished = np.flatnonzero(done & (occupant >= 0))
      if not finished.size:
        continue
      tokens, scores, top_ids, top_lp = jax.device_get(
        (state.tokens, state.scores, state.top_ids, state.top_logprobs)
      )
      for s in sorted(finished, key=lambda s: occupant[s]):
        k = int(generated[s])
        yield RequestResult(
          index=int(occupant[s]),
          tokens=tokens[s, :k],
          per_token_scores=scores[s, :k],
          top_ids=top_ids[s, :k],
          top_logprobs=top_lp[s, :k],
          finish_reason=FINISH_STOP if stopped[s] else FINISH_LENGTH,
          speculation=None if state.spec is None else state.spec.stats(s),
        )
        occupant[s] = -1
        if pool is not None:
          pool.release(s)
        bar.update(1)
  finally:
    bar.close()


def _inputs(call: _Checked, occupant: np.ndarray) -> slots.SlotInputs:
  """Each slot's settings (a free slot: request 0's, with no budget)."""
  who = np.maximum(occupant, 0)
  return slots.SlotInputs(
    sample_ids=call.sample_ids[who],
    start=np.full(who.shape, call.start, np.int32),
    sampling=jax.tree.map(lambda x: x[who], call.sampling),
    stop_ids=call.stop_ids[who],
    budget=np.where(occupant >= 0, call.steps[who], 0).astype(np.int32),
    processors=call.processors,
  )


def _progress_bar(total: int, show: bool):
  """A tqdm bar (the notebook's widget where there is one) on process 0."""
  from tqdm.auto import tqdm

  return tqdm(
    total=total,
    unit="request",
    disable=not show or jax.process_index() != 0,
  )


def segment(engine, calibration, caches, state, inputs, every, rows=None, **kw):
  """One segment of a slot loop (`slot_run`) over the slots `rows` (None:
  all), its speculative passes costed by `calibration` (None without
  speculation)."""
  if rows is not None:
    kw["rows"] = replicated_like(state, rows)

  def run(state):
    return engine.slot_run(caches, state, inputs, every, jnp.bool_(True), **kw)

  if calibration is None:
    return run(state)
  return calibration.run(state, run, lambda: compiled_programs(engine))
