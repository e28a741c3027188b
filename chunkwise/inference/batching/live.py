"""Live slots: continuous batching for requests that arrive at any time.

  loop = model.live_slots(slots=16, capacity=1024, top_n=5)
  loop.warm_up()                    # every program compiled (`warmup.py`)
  ready = loop.prepare(cw.Request(tokens=ids, sample_id=0, steps=64))
  loop.add("a", ready)              # takes a free slot at the next step
  while loop.busy:
    for u in loop.step():           # admit, decode up to `every` steps
      print(u.key, u.tokens, u.finish_reason)   # new tokens, as produced
  loop.cancel("a")                  # frees its slot at the next step

`generate_many` knows its requests up front; a server does not. This loop
keeps the same device state (`slots.SlotState`) and programs, but takes
requests one by one (`prepare` validates one on the host, any thread, and
compiles its constraint, `live_requests.py`; `add` queues it), and each
`step` hands back the tokens every running request produced in that
segment, not only finished requests. A request's tokens and scores are
those of `generate` run alone on it (DESIGN.md §4.11), whatever runs
beside it: every step is `generate`'s step row by row, and the programs'
shapes depend on the traffic only through the slot bucket a segment runs
(`buckets.py`: the smallest compiled row count holding the running
requests; no row moves) and never on what a row holds (fixed capacity,
top-n, stop-id width, processors). While nothing on the host would
change it, the next segment is queued on the device before the last
one's tokens are read (`segments.py`).

Processors are fixed per loop (`processors=`, e.g. `penalties()`): each
request may bring its own instances of the same processors in the same
order whose loop form (`for_loop()`) is the loop's, so only their state
differs (a request's repetition penalty and prompt, say). Constraints are
the loop's own processor: the distinct tables of the running requests
keep stable grammar ids and are concatenated again when the set changes,
into tables of one shape for up to 64 constraints of 16,384 DFA states
in all (`constraints.LOOP_FLOOR_LAZY`; more compile a new program, once).

`add`, `cancel` and `step` are for one thread; the schedule depends only
on the order of those calls, so processes of a multi-host run that make
the same calls stay in lockstep (`background_hits`, where prefix-cache
hits wait for a background compile, makes it depend on timing: one
process only).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise import constraints as constraints_lib
from chunkwise import processors as processors_lib
from chunkwise.configs import HParams
from chunkwise.inference import long_prefill
from chunkwise.inference.batching import admission, segments, warmup
from chunkwise.inference.batching import heads as heads_lib
from chunkwise.inference.batching.admission import Admission
from chunkwise.inference.batching.buckets import Buckets
from chunkwise.inference.batching.continuous import segment
from chunkwise.inference.batching.live_requests import (
  Intake,
  LoopShape,
  Prepared,
  SlotSettings,
  SlotUpdate,
)
from chunkwise.inference.batching.slot_requests import Request
from chunkwise.inference.engines.engine import Engine, prefix_inputs
from chunkwise.inference.paging import page_table
from chunkwise.inference.paging import prefix_cache as prefix_cache_lib
from chunkwise.inference.results import ChunkResult
from chunkwise.inference.speculation import Speculation, SpeculationStats
from chunkwise.inference.speculation.calibration import Calibration

STOP_WIDTH = 8  # stop ids a request may have (EOS included), by default


_RELEASE = jax.jit(
  lambda state, free: state.replace(done=state.done | free), donate_argnums=0
)


class LiveSlots:
  """An always-on slot loop (module docstring); made by
  `InferenceModel.live_slots`."""

  def __init__(
    self,
    *,
    hparams: HParams,
    prefill_engine: Engine,
    generate_engine: Engine,
    vocabulary,
    eos_ids: Sequence[int],
    bos_id: int,
    served,
    slots_n: int,
    capacity: int,
    top_n: int,
    every: int,
    processors: tuple,
    prefix: tuple[ChunkResult, ...],
    stop_width: int,
    admit_rows: Sequence[int] = (1,),
    speculation: Speculation | None = None,
    piece: int | None = None,
    prefix_cache: prefix_cache_lib.PrefixCache | None = None,
    kv_pages: int = 0,
    preempt: bool = True,
    budget_forcing: bool = False,
    slot_buckets=None,
    background_hits: bool = False,
  ):
    h = hparams
    # Each segment runs the smallest bucket of slots that holds the running
    # requests (`buckets`): a lone request decodes one row.
    self.buckets = Buckets(slots_n, slot_buckets, generate_engine)
    # Full pages of prompts' K/V, shared by the requests that start alike
    # (`prefix_cache`; its `stats` are the server's /metrics counters).
    self.prefix_cache = prefix_cache
    # Prompts longer than this are prefilled one piece per step, their
    # slot held meanwhile (chunked prefill): the other slots keep decoding.
    self._piece = piece or long_prefill.SLOT_COLUMNS
    self._staged: dict[int, tuple[Admission, long_prefill.Staged]] = {}
    self._prefill_engine = prefill_engine
    self._generate_engine = generate_engine
    self._bos_id = bos_id
    self._served = served
    self.slots = slots_n
    self.capacity = capacity
    self.top_n = top_n
    self.every = every
    self.stop_width = stop_width
    # Prompts prefilled per admission call (ascending counts). One: an
    # arrival alone costs its own prefill, not three padding rows' (the
    # other slots wait for it). With more (only where a row's sums do not
    # depend on the rows beside it), short prompts that arrive together
    # share calls (`admission.rows_for`; docs/performance.md, "Serving").
    self.admit_rows = tuple(sorted(set(admit_rows)))
    if not self.admit_rows or self.admit_rows[0] < 1:
      raise ValueError(
        f"admit_rows must be positive row counts, got {admit_rows!r}"
      )
    self._prefix = prefix
    self._start = sum(int(np.asarray(p.lengths)[0]) for p in prefix)
    trie = constraints_lib.loop_trie(vocabulary, h.vocab)
    self._grammars = constraints_lib.GrammarSet(
      h.vocab, force=budget_forcing, trie=trie
    )
    procs, states = processors_lib.check(
      (
        *processors,
        constraints_lib.processor(
          (0,) * slots_n, [], width=h.vocab, force=budget_forcing, trie=trie
        ),
      ),
      batch=slots_n,
      vocab=h.vocab,
      n_stop=stop_width,
      per_row=True,
    )
    self._loop_forms = procs[:-1]
    self._intake = Intake(
      hparams=h,
      vocabulary=vocabulary,
      eos_ids=tuple(eos_ids),
      served=served,
      capacity=capacity,
      stop_width=stop_width,
      prefix=prefix,
      start=self._start,
      budget_forcing=budget_forcing,
      templates=processors,
      loop_forms=self._loop_forms,
    )
    self._caches, self._prev = prefix_inputs(prefix)
    # Hits of the prefix cache whose programs have not run are admitted
    # as misses while a background thread compiles them (`heads.py`).
    self.shape = LoopShape(
      prefill_engine=prefill_engine,
      generate_engine=generate_engine,
      caches=self._caches,
      prev=self._prev,
      start=self._start,
      bos_id=bos_id,
      admit_rows=self.admit_rows,
      # The loop's top-n: its admission prefills are then the programs
      # that score a prompt (`InferenceModel.prefill(top_n=)`, a server's
      # echo), compiled once for both.
      admit_top_n=top_n,
      piece=self._piece,
      capacity=capacity,
      max_len=h.max_len,
      vocab_size=h.vocab,
      vocabulary=vocabulary,
      adapter_names=() if served is None else tuple(served.names),
      adapters_of=self._adapters,
    )
    self._heads = None
    if background_hits and prefix_cache is not None:
      self._heads = heads_lib.Heads(self.shape)
    # With `kv_pages`, the slots' K/V are one pool of pages (`paged_kv`):
    # a request takes a slot once its pages fit, and running requests that
    # outgrow the pool preempt the latest admitted (`page_table`), which
    # runs again later and reports only the tokens it had not reported.
    # That needs a rerun to give the same tokens; without `preempt` (fast
    # numerics, where it may not) a request is admitted once pages for all
    # of its steps fit, and is never preempted.
    self._preempt = preempt
    self.pages, paging = page_table.pool(
      kv_pages, slots=slots_n, columns=capacity
    )
    self.preempted = 0  # requests preempted so far
    state = generate_engine.slot_init(
      self._caches,
      slots=slots_n,
      capacity=capacity,
      steps=capacity,
      top_n=top_n,
      vocab=h.vocab,
      **paging,
    )
    self._state = admission.with_speculation(
      state.replace(processor_states=admission.replicated_like(state, states)),
      speculation,
      capacity,
    )
    self.speculation = speculation
    # Pass costs per bucket size (speculation's calibration).
    self._calibrations: dict[int, Calibration] = {}
    # Counts of every finished request (`SpeculationStats`).
    self.speculation_totals = SpeculationStats()
    # A step's iterations emit up to k + 1 tokens each.
    self._window = page_table.ahead(every, speculation) + 1
    # Host copies of each slot's settings (a free slot: defaults, no budget).
    n = slots_n
    self._key: list[Hashable | None] = [None] * n
    self._grammar = np.zeros(n, np.int32)
    self._settings = SlotSettings(n, stop_width=stop_width, vocab=h.vocab)
    self._read = np.zeros(n, np.int32)  # tokens handed back per slot
    self._generated = np.zeros(n, np.int32)  # at the last look
    self._prepared: list[Prepared | None] = [None] * n
    self._admitted = np.zeros(n, np.int64)  # admission order (preemption)
    self._admissions = 0
    self._reported: dict[Hashable, int] = {}  # preempted: tokens reported
    self._waiting: list[tuple[Hashable, Prepared]] = []
    self._cancelled: set[Hashable] = set()
    self.admitted: list[Hashable] = []  # keys the last step put in slots
    self._ahead: segments.Segment | None = None  # queued behind the last

  def _adapters(self, engine, ids):
    return None if self._served is None else self._served.call(engine, ids)

  def close(self) -> None:
    """Ends this loop's background thread (`background_hits`), waiting for
    its compile in progress; call before the process exits."""
    if self._heads is not None:
      self._heads.close()

  @property
  def heads(self) -> heads_lib.Heads | None:
    """Which prefix-cache hits have their programs (None: without
    `background_hits`)."""
    return self._heads

  def warm_up(self) -> warmup.Report:
    """Compiles (or loads from JAX's persistent cache) every program a
    request can take through this loop, by running placeholder requests
    through it before any real one (`batching/warmup.py`); the loop is
    empty again afterwards. Returns what ran."""
    return warmup.warm_up(self)

  # -- host side, any thread ------------------------------------------------

  def prepare(
    self, request: Request, processors: Sequence = (), what: str = "request"
  ) -> Prepared:
    """Validates `request` for this loop and compiles its constraint, on
    the host (no device work; safe from any thread). `processors` are the
    request's own instances of the loop's processors (same order; empty:
    the loop's). Raises ValueError naming `what` and the bad field."""
    return self._intake.prepare(request, processors, what)

  # -- the loop's thread ----------------------------------------------------

  @property
  def running(self) -> int:
    """Requests in slots."""
    return sum(k is not None for k in self._key)

  @property
  def waiting(self) -> int:
    """Requests added and not yet in a slot."""
    return len(self._waiting)

  @property
  def busy(self) -> bool:
    """Whether a `step` has anything to do."""
    return bool(self._waiting or self.running or self._cancelled or self._ahead)

  def add(self, key: Hashable, prepared: Prepared) -> None:
    """Queues a prepared request under `key` (unique among those added and
    not finished); it takes a free slot at a coming `step`."""
    if not isinstance(prepared, Prepared):
      raise ValueError(
        f"add takes what prepare returned, got {type(prepared).__name__}"
      )
    if key in self._key or any(k == key for k, _ in self._waiting):
      raise ValueError(f"key {key!r} is already in use")
    self._waiting.append((key, prepared))

  def cancel(self, key: Hashable) -> None:
    """Drops a request: a waiting one at once, a running one's slot is
    freed at the next `step` (its remaining tokens are never reported)."""
    self._cancelled.add(key)

  def step(self, steps: int | None = None) -> list[SlotUpdate]:
    """One segment: frees cancelled slots, admits waiting requests into
    free slots, decodes until `steps` (default `every`, at most `every`)
    steps ran or a request finished, and returns what every running
    request produced (finished ones last once, with their finish reason;
    their slots are free again).

    While nothing waits to change (no request waiting or cancelled, no
    prompt in pieces, fixed slots, no speculation), the next segment is
    queued on the device behind this one before this one's tokens are
    read (`segments.py`): the device never waits for the host between
    two segments. Requests added meanwhile take their slots one segment
    later; a cancelled request's slot is free at once, its tokens not
    reported."""
    steps = self.every if steps is None else max(1, min(steps, self.every))
    if self._ahead is not None:  # queued by the last step
      seg, self._ahead = self._ahead, None
      self.admitted = []
      self._drop_cancelled()  # their slots free now, their tokens unread
    else:
      seg = self._begin(steps)
      if seg is None:
        return []
    if self._chains(seg):
      self._ahead = self._dispatch(seg.live, seg.run, steps, seg.generated)
    return self._collect(seg)

  def _chains(self, seg: segments.Segment) -> bool:
    """Whether the segment after `seg` may be queued before `seg` is read,
    as `seg` ran (its rows, inputs): every request it runs still runs (as
    far as the host knows: one that finished makes the next segment choose
    its rows again), and the host has nothing to change at its start."""
    running = all(self._key[s] is not None for s in np.flatnonzero(seg.live))
    return running and not (
      self._waiting
      or self._cancelled
      or self._staged
      or self.pages is not None
      or self.speculation is not None
    )

  def _begin(self, steps: int) -> segments.Segment | None:
    """The host's changes (cancellations, preemptions, admissions, a piece
    of a long prompt), then a segment of the running requests (None when
    none runs)."""
    self._drop_cancelled()
    if self._make_room():  # a preempted request waits a segment
      self.admitted = []
    else:
      self._admit_waiting()
    self._state = admission.with_table(self._state, self.pages)
    self._state, _ = admission.advance_staged(
      self._state, self._staged, self.prefix_cache
    )
    live = np.array(
      [k is not None and s not in self._staged for s, k in enumerate(self._key)]
    )
    if not live.any():
      return None
    start = admission.replicated_like(self._state, self._read.copy())
    return self._dispatch(live, self._run_args(live), steps, start)

  def _run_args(self, live: np.ndarray) -> dict:
    """How a segment of the `live` slots runs: its rows (a bucket), their
    inputs and adapters on device, speculation's calibration."""
    engine = self._generate_engine
    rows = self.buckets.rows(live)
    inputs = self._settings.inputs(
      self._start, live, (*self._loop_forms, self._grammars.processor())
    )
    ids = np.where(live, self._settings.adapter, -1).astype(np.int32)
    return dict(
      calibration=self._calibration(rows),
      inputs=admission.replicated_like(
        self._state, self.buckets.inputs(inputs, rows)
      ),
      adapters=self._adapters(engine, self.buckets.adapter_ids(ids, rows)),
      rows=rows,
    )

  def _dispatch(self, live, run: dict, steps: int, start) -> segments.Segment:
    """Queues a segment (`run`: its rows, inputs, adapters, calibration)
    and its report (the slots' windows from `start`: int32[slots] on
    device), without waiting for either."""
    self._state = segment(
      self._generate_engine,
      run["calibration"],
      self._caches,
      self._state,
      run["inputs"],
      jnp.int32(steps),
      adapters=run["adapters"],
      speculation=self.speculation,
      rows=run["rows"],
    )
    report = segments.report(self._state, start, self._window)
    return segments.Segment(live=live, run=run, report=report)

  def _calibration(self, rows) -> Calibration | None:
    """Speculation's pass costs for a segment of `rows` (None: plain)."""
    if self.speculation is None:
      return None
    size = self.slots if rows is None else len(rows)
    if size not in self._calibrations:
      self._calibrations[size] = Calibration(self.speculation, size)
    return self._calibrations[size]

  def _drop_cancelled(self) -> None:
    if not self._cancelled:
      return
    self._waiting = [
      (k, p) for k, p in self._waiting if k not in self._cancelled
    ]
    for k in self._cancelled:
      self._reported.pop(k, None)
    free = np.array([k in self._cancelled for k in self._key])
    self._cancelled.clear()
    if free.any():
      for s in np.flatnonzero(free):
        self._free(int(s))
      self._state = _RELEASE(
        self._state, admission.replicated_like(self._state, free)
      )

  def _make_room(self) -> bool:
    """Pages for every running request's next segment, preempting the
    latest admitted where they don't fit (back to the queue's front).
    Whether it preempted."""
    if self.pages is None:
      return False
    running = [
      s
      for s, k in enumerate(self._key)
      if k is not None and s not in self._staged
    ]
    demand = {
      s: self._columns(self._prepared[s], int(self._generated[s]))
      for s in running
    }
    preempted = self.pages.make_room(demand, dict(enumerate(self._admitted)))
    if not preempted:
      return False
    for s in preempted:  # latest first: the earliest ends up in front
      key = self._key[s]
      self._reported[key] = int(self._read[s])
      self._waiting.insert(0, (key, self._prepared[s]))
      self._free(s)
    self.preempted += len(preempted)
    self._state = admission.vacate(
      self._state, admission.replicated_like(self._state, np.int32(preempted))
    )
    return True

  def _columns(self, p: Prepared, generated: int) -> int:
    """Columns a request may reach by the end of its next segment (all
    of its steps' without preemption)."""
    if not self._preempt:
      return p.prompt.size + p.steps
    return p.prompt.size + generated + self._window - 1

  def _free(self, s: int) -> None:
    self._key[s] = None
    self._prepared[s] = None
    if self.pages is not None:
      self.pages.release(s)
    a, _ = self._staged.pop(s, (None, None))
    if a is not None and a.hit is not None:
      self.prefix_cache.release(a.hit)
    self._grammars.give_back(int(self._grammar[s]))
    self._grammar[s] = 0
    self._settings.budget[s] = 0

  def _admit_waiting(self) -> None:
    free = [s for s, k in enumerate(self._key) if k is None]
    take = self._waiting[: len(free)]
    if self.pages is not None:  # in order, while their pages fit
      for j, ((_, p), s) in enumerate(zip(take, free, strict=False)):
        if not self.pages.reserve(s, self._columns(p, 0)):
          take = take[:j]
          break
    self.admitted = [key for key, _ in take]
    if not take:
      return
    self._waiting = self._waiting[len(take) :]
    admissions = []
    for (key, p), s in zip(take, free, strict=False):
      g = self._grammars.take(p.tables)
      self._key[s], self._grammar[s] = key, g
      self._settings.seat(s, p)
      # A preempted request runs again from its prompt (the same tokens)
      # and reports only those past what it reported before.
      self._read[s] = self._reported.pop(key, 0)
      self._generated[s] = 0
      self._prepared[s] = p
      self._admitted[s] = self._admissions
      self._admissions += 1
      # The constraint processor's state: (grammar, automaton state 0).
      states = (*p.processor_state, (np.int32([g]), np.int32([0])))
      a = Admission(
        prompt=p.prompt,
        adapter_id=p.adapter_id,
        slot=s,
        processor_state=states,
      ).looked_up(self.prefix_cache)
      if self._heads is not None:
        a = self._heads.admissible(a, self.prefix_cache)
      if a.prompt.size - a.cached > self._piece:
        self._staged[s] = (
          a,
          admission.stage(
            a,
            self._caches,
            self._prev,
            self._prefill_engine,
            self._bos_id,
            self._adapters,
            self._piece,
            self.capacity,
            top_n=self.top_n,
          ),
        )
      else:
        admissions.append(a)
    self._state = admission.with_table(self._state, self.pages)
    if not admissions:
      return
    self._state = admission.prefill_into(
      self._state,
      admissions,
      self._caches,
      self._prev,
      self._prefill_engine,
      self._bos_id,
      self._adapters,
      rows=self.admit_rows,
      cache=self.prefix_cache,
      top_n=self.top_n,
    )

  def _collect(self, seg: segments.Segment) -> list[SlotUpdate]:
    """What `seg` produced for each request still running (waits for
    it); frees the slots of those that finished."""
    state = self._state
    done, stopped, generated, window = jax.device_get(seg.report)
    updates = []
    self._generated = np.asarray(generated, np.int32).copy()
    for s in np.flatnonzero(seg.live):
      if self._key[s] is None or self._key[s] in self._cancelled:
        continue  # finished in the segment before, or cancelled since
      k = max(int(generated[s] - self._read[s]), 0)
      finished = bool(done[s])
      if not k and not finished:
        continue
      stop = finished and bool(stopped[s])
      counts = None
      if finished and state.spec is not None:
        counts = state.spec.stats(s)
        self.speculation_totals += counts
      updates.append(
        SlotUpdate.read(
          self._key[s],
          window,
          s,
          k,
          finished=finished,
          stop=stop,
          speculation=counts,
        )
      )
      self._read[s] = max(generated[s], self._read[s])
      if finished:
        self._free(int(s))
    return updates
