"""The always-on engine: requests at any time, tokens as they are made.

  engine = Engine(model, slots=16, capacity=1024, top_n=5)
  stream = engine.submit(Generation(prompt=ids, max_new_tokens=64,
                                    temperature=0.7))
  for token in stream:             # or `async for token in stream`
    print(token.text, end="")
  print(stream.finish_reason, stream.seed)
  engine.close()

One thread runs a `LiveSlots` loop (`chunkwise.inference`): it takes
what `submit` queued (a thread-safe inbox, validated and compiled in the
submitting thread first), runs one segment (`every` decode steps, or less
when a request finishes), and hands each request's new tokens to its
`TokenStream`, detokenized, checked against its stop strings. A stream
whose reader goes away is cancelled (`stream.cancel()`): its slot is
free at the next segment. A stop string ends a request the same way.

The contract: a request's tokens equal, and its scores match to float
rounding, `model.generate` run alone on the same prompt, seed, sampling,
adapter, constraint, stop ids and penalties, whatever else is running
(each request is one row of `generate`'s step; DESIGN.md §4.11). A
sampled request without a seed gets a random one, reported in
`stream.seed` so that it can be replayed.

Before it admits anything the engine warms up (`LiveSlots.warm_up`, in
its thread): every program a request can take is compiled, or loaded
from JAX's persistent compilation cache, so no request waits for a
compile. Until then `ready` is False, and `submit` and `score` wait for
it (the HTTP server answers 503 "starting" instead).

Failures stay with their request: an exception while handling one
request's tokens ends that stream with an error and frees its slot; one
in the device step ends the streams it was running and starts a fresh
loop, and the engine keeps serving. On a pod every process reports each
segment whether it succeeded, so a failure on any process fails the same
requests everywhere and every process restarts its loop together.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from chunkwise import processors as processors_lib
from chunkwise.inference import (
  Chunk,
  InferenceModel,
  SpeculationStats,
  prompt_bucket,
)
from chunkwise.partitioning import multihost
from chunkwise.serving import decisions
from chunkwise.serving.stream import (
  CANCELLED,
  ERROR,
  Closed,
  Generation,
  Overloaded,
  TokenStream,
)

log = logging.getLogger("chunkwise.serving")

# Decode steps between two hand-overs of tokens: one while no request
# waits for a slot (tokens stream as they are made), more while some wait
# (they cannot start before a slot frees, which ends a segment anyway):
# measured in docs/performance.md, "Serving".
DEFAULT_EVERY = 1
DEFAULT_BUSY_EVERY = 8
# K/V of cached prompt pages: 256 MiB holds ~11k tokens of SmolLM2 (f32).
DEFAULT_PREFIX_CACHE_BYTES = 256 << 20
_HEARTBEAT_S = 2.0  # an idle pod's process 0 shares an empty decision


def _pod() -> bool:
  return multihost.is_multiprocess()


class Engine:
  """The always-on engine (module docstring).

  Args:
    model: an `InferenceModel` (with its adapters, `with_adapters`).
    slots: requests decoded side by side.
    capacity: columns per slot: a prompt (padded to a power of two, at
      least 8) plus its max_new_tokens must fit; default: the model's
      max_len, at most 2048.
    top_n: most alternatives a request may ask for per token.
    every: decode steps between two hand-overs of tokens while no request
      waits for a slot.
    busy_every: decode steps between hand-overs while requests wait (a
      request that finishes ends a segment early either way).
    max_queue: requests waiting for a slot before `submit` raises
      `Overloaded`.
    on_finish: called (in the engine's thread) with each stream that ends
      (more with `listen`).
    speculation: a `cw.Speculation` (no context: each request drafts from
      its prompt and tokens); tokens are unchanged, `speculation_totals`
      counts what finished requests drafted and accepted (/metrics). With
      its forced drafts (`forced`, the default), every request's
      constraint fast-forwards (`Constraint.fast_forward`): its forced
      runs are appended in one pass.
    prefix_cache_bytes: K/V of prompts' full pages kept for the requests
      that start alike (a system prompt, a few-shot head): each prefills
      only what follows its longest cached start; 0: none. Counted in
      `prefix_cache_stats` (/metrics).
    kv_pages: the slots share one pool of this many K/V pages (paged K/V,
      one device; at least `capacity` / 32): `slots` may then exceed what
      fixed rows of `capacity` columns fit; 0: fixed slots. Its use and
      preemptions are in `kv_pages_stats` (/metrics).
    slot_buckets: the row counts a segment may run (`model.live_slots`;
      None: powers of two up to `slots`): a step costs the requests
      running, not `slots`.
    warm_up: compile every program before admitting requests (`ready`);
      False: each compiles when a request first needs it.
  """

  def __init__(
    self,
    model: InferenceModel,
    *,
    slots: int = 16,
    capacity: int | None = None,
    top_n: int = 5,
    every: int = DEFAULT_EVERY,
    busy_every: int = DEFAULT_BUSY_EVERY,
    max_queue: int = 256,
    on_finish: Callable[[TokenStream], None] | None = None,
    speculation=None,
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    kv_pages: int = 0,
    slot_buckets=None,
    warm_up: bool = True,
  ):
    if model.vocab is None:
      raise ValueError("serving needs a model with a vocabulary")
    self.model = model
    self.capacity = capacity or min(model.hparams.max_len, 2048)
    self.max_queue = max_queue
    self.top_n = top_n
    self.every, self.busy_every = every, busy_every
    self._listeners = [on_finish] if on_finish is not None else []
    self._make = lambda: model.live_slots(
      slots=slots,
      capacity=self.capacity,
      top_n=top_n,
      every=max(every, busy_every),
      processors=(processors_lib.penalties(),),
      speculation=speculation,
      prefix_cache_bytes=prefix_cache_bytes,
      kv_pages=kv_pages,
      # A constrained answer (JSON schema, regex, choice, tool call) is
      # closed within max_tokens: never a cut-off value.
      budget_forcing=True,
      slot_buckets=slot_buckets,
      # No request waits for a hit's compile (one process: on a pod every
      # process must make the same schedule).
      background_hits=not _pod(),
    )
    self._loop = self._make()
    # Set once every program is compiled (or at once without warm-up).
    self._ready = threading.Event()
    self._warm = warm_up
    self.warmup = None  # what the warm-up ran (`warmup.Report`)
    self.speculation = self._loop.speculation  # checked, or None
    # Counts of every request that finished (`SpeculationStats`), for
    # /metrics; replaced whole, so a reader in another thread sees a sum.
    self.speculation_totals = SpeculationStats()
    self.slots = self._loop.slots
    self._keys = itertools.count()
    self._cv = threading.Condition()
    self._inbox: list[tuple[TokenStream, Any]] = []
    self._cancels: list[TokenStream] = []
    self._active: dict[int, TokenStream] = {}
    self._closing = False
    self._dropped: list[int] = []  # keys ended here, to cancel in the loop
    self._scores: list = []  # a pod's prompt scorings: (future, args)
    self.leader = jax.process_index() == 0
    self._thread = None
    if self.leader:
      self._thread = threading.Thread(
        target=self._run, name="chunkwise-engine", daemon=True
      )
      self._thread.start()

  # -- any thread -----------------------------------------------------------

  @property
  def ready(self) -> bool:
    """Whether the engine admits requests (warm-up done)."""
    return self._ready.is_set()

  def wait_ready(self, timeout: float | None = None) -> bool:
    """Waits for `ready` (up to `timeout` seconds); returns it."""
    return self._ready.wait(timeout)

  @property
  def prefix_cache_stats(self):
    """The prefix cache's counts (`prefix_cache.Stats`), None without
    one."""
    cache = self._loop.prefix_cache
    return None if cache is None else cache.stats

  @property
  def prefix_cache_compiling(self) -> int:
    """Prefills after a cached start compiling in the background (hits
    of their widths are served as misses meanwhile)."""
    heads = self._loop.heads
    return 0 if heads is None else heads.pending

  @property
  def kv_pages_stats(self) -> tuple[int, int, int] | None:
    """(pages held, pages in the pool, requests preempted so far) of a
    paged pool, None with fixed slots."""
    pages = self._loop.pages
    if pages is None:
      return None
    return pages.pages - pages.free, pages.pages, self._loop.preempted

  @property
  def waiting(self) -> int:
    """Requests submitted and not yet in a slot, and scorings not run."""
    return len(self._inbox) + self._loop.waiting + len(self._scores)

  @property
  def running(self) -> int:
    """Requests in slots."""
    return self._loop.running

  @property
  def active(self) -> int:
    """Requests submitted and not finished."""
    return len(self._active) + len(self._inbox)

  def prepare(self, g: Generation, *, seed: int | None = None):
    """Validates `g` and compiles its constraint (no device work); raises
    ValueError naming the bad field. Returns (what `submit` takes, the
    seed: `seed`, else `g.seed`, else a random one)."""
    if not isinstance(g, Generation):
      raise ValueError(f"submit takes a Generation, got {g!r}")
    request, penalties, seed = g.request(self.top_n, seed)
    if self.speculation is not None and self.speculation.forced:
      request = _fast_forwarded(request)
    prepared = self._loop.prepare(request, (penalties,), what="request")
    return prepared, seed

  def submit(self, g: Generation, prepared=None) -> TokenStream:
    """Queues `g` (validated first, unless `prepared` is what `prepare`
    returned for it); returns its stream. Raises ValueError (bad request),
    `Overloaded` (queue full) or `Closed` (shutting down)."""
    if not self.leader:
      raise Closed("requests go to process 0")
    self._check_ready()
    prepared, seed = prepared or self.prepare(g)
    with self._cv:
      if self._closing:
        raise Closed("the server is shutting down")
      if self.waiting >= self.max_queue:
        raise Overloaded("Model is overloaded")
      stream = TokenStream(self, next(self._keys), g, seed, prepared.tables)
      stream.compile_s = prepared.compile_s
      self._inbox.append((stream, prepared))
      self._cv.notify_all()
    return stream

  def _check_ready(self) -> None:
    """Waits for the warm-up (a closed engine: at once)."""
    while not self._ready.wait(0.1):
      if self._closing:
        raise Closed("the server is shutting down")

  def listen(self, on_finish: Callable[[TokenStream], None]) -> None:
    """Calls `on_finish` (in the engine's thread) with each stream that
    ends, as `on_finish=` does."""
    self._listeners.append(on_finish)

  def _cancel(self, stream: TokenStream) -> None:
    with self._cv:
      self._cancels.append(stream)
      self._cv.notify_all()

  def score(self, prompt: Sequence[int], *, top_n: int, adapter=None):
    """The prompt's own log-probs (`model.prefill`): (scores f32[n],
    top_ids int32[n, top_n], top_logprobs f32[n, top_n]); BOS scores 0."""
    if not 0 <= top_n <= max(self.top_n, 0):
      raise ValueError(
        f"top_n={top_n}: this server returns at most {self.top_n} "
        "alternatives per token"
      )
    self._check_ready()
    # Through the queue, run by the engine's thread between segments (in
    # a pod every process runs it): a scoring waits and counts as one
    # request, so a flood of them is refused (`Overloaded`) like one of
    # generations, and never runs beside the loop's step.
    done = concurrent.futures.Future()
    with self._cv:
      if self._closing:
        raise Closed("the server is shutting down")
      if self.waiting >= self.max_queue:
        raise Overloaded("Model is overloaded")
      self._scores.append((done, (list(map(int, prompt)), top_n, adapter)))
      self._cv.notify_all()
    return done.result()

  def _score_now(self, prompt, top_n: int, adapter):
    """Scores `prompt` as wide as its length bucket, with the engine's
    `top_n` (then cut to `top_n`): one program per bucket and adapter use,
    the loop's admission prefill's up to its piece width, compiled at
    warm-up."""
    ids = np.asarray([prompt], np.int32)
    n = ids.shape[1]
    chunk = Chunk(tokens=ids, lengths=np.asarray([n], np.int32))
    chunk = chunk.pad_to_length(
      max(n, min(prompt_bucket(n), self.model.hparams.max_len))
    )
    r = self.model.prefill(chunk, top_n=self.top_n, adapters=adapter)
    arrays = (r.per_token_scores, r.top_ids, r.top_logprobs)
    if _pod():
      from jax.experimental import multihost_utils

      arrays = multihost_utils.process_allgather(arrays, tiled=True)
    scores, top_ids, top_lp = (np.asarray(a)[0, :n] for a in arrays)
    return scores, top_ids[:, :top_n], top_lp[:, :top_n]

  def _warm_scoring(self) -> int:
    """Compiles the scoring of a prompt of each length bucket a request
    may send (`score`'s programs) that the loop's warm-up does not: up to
    the loop's piece width, scoring runs the loop's admission prefills.
    Returns how many."""
    n, count = self._loop.shape.piece + 1, 0
    while n <= self.capacity:
      width = max(n, min(prompt_bucket(n), self.model.hparams.max_len))
      if _pod():  # every process runs the same programs
        self._score_now([self.model.bos_id] * n, self.top_n, None)
      else:
        self.model.compile_prefill(width, top_n=self.top_n)
      count += 1
      n = prompt_bucket(n) + 1
    return count

  def close(self, grace: float | None = 0.0) -> bool:
    """Stops admitting; waits up to `grace` seconds (None: for ever) for
    running requests, cancels what is left, ends the thread. Returns
    whether every request finished on its own."""
    with self._cv:
      self._closing = True
      self._cv.notify_all()
    deadline = None if grace is None else time.monotonic() + grace
    clean = True
    while self.active:
      if deadline is not None and time.monotonic() >= deadline:
        clean = False
        for s in list(self._active.values()) + [s for s, _ in self._inbox]:
          s.cancel()
        break
      time.sleep(0.01)
    with self._cv:
      self._stop = True
      self._cv.notify_all()
    if self._thread is not None:
      self._thread.join(timeout=60)
    self._loop.close()  # its background compiles, before the process exits
    return clean

  @property
  def closing(self) -> bool:
    return self._closing

  # -- the engine's thread (process 0) and followers (the others) ---------

  _stop = False
  _failed: str | None = None  # this process's last step failed: the error

  def _warm_up(self) -> None:
    """Compiles every program a request can take (each process of a pod
    its own), then admits requests."""
    try:
      if self._warm:
        log.info("warming up: compiling every program a request can need")
        if _pod():  # every process runs the same programs, in one order
          self.warmup = self._loop.warm_up()
          scored = self._warm_scoring()
        else:
          with concurrent.futures.ThreadPoolExecutor(1) as pool:
            scoring = pool.submit(self._warm_scoring)  # beside the loop's
            self.warmup = self._loop.warm_up()
            scored = scoring.result()
        log.info(
          "warm-up done: %s; prompt scoring at %d more lengths",
          self.warmup,
          scored,
        )
    except Exception:
      log.exception("warm-up failed; programs compile as requests need them")
      self._loop.close()
      self._loop = self._make()
    finally:
      self._ready.set()

  def _run(self) -> None:
    """Process 0: decides each segment, shares the decision, applies it,
    hands the tokens to their streams."""
    self._warm_up()
    while True:
      with self._cv:
        while not (
          self._inbox
          or self._cancels
          or self._dropped
          or self._scores
          or self._loop.busy
          or self._stop
          or self._failed
        ):
          if not self._cv.wait(timeout=_HEARTBEAT_S) and _pod():
            break  # followers hear from process 0 now and then
        stop = self._stop and not self._loop.busy and not self._inbox
        # After a failed step the next segment restarts every process's
        # loop: what waits is admitted after it.
        inbox, self._inbox = (
          ([], self._inbox) if self._failed else (self._inbox, [])
        )
        cancels, self._cancels = self._cancels, []
        scores, self._scores = self._scores, []
        for stream, _ in inbox:
          self._active[stream.key] = stream
      gone = [s for s in cancels if self._active.pop(s.key, None) is not None]
      prepared = {stream.key: p for stream, p in inbox}
      d = decisions.Decision(
        add=tuple((s.key, s.generation, s.drawn_seed) for s, _ in inbox),
        cancel=tuple(s.key for s in gone) + tuple(self._dropped),
        steps=self._steps(len(inbox)),
        stop=stop,
        score=tuple(args for _, args in scores),
      )
      self._dropped = []
      for stream in gone:
        self._finished(stream, CANCELLED)
      updates = self._apply(
        decisions.share(d), prepared, [f for f, _ in scores]
      )
      if d.stop:
        break
      for u in updates:
        stream = self._active.get(u.key)
        if stream is None:
          continue
        try:
          over = stream._feed(u)
        except Exception as e:
          log.exception("request %s failed", u.key)
          over = True
          stream._end(ERROR, f"{type(e).__name__}: {e}")
        if over:
          del self._active[u.key]
          if u.finish_reason is None:  # a stop string or a failure
            self._dropped.append(u.key)
          self._finished(stream, stream.finish_reason)

  def _steps(self, adding: int) -> int:
    """Steps of the coming segment: `busy_every` while requests will still
    wait for a slot after it admits, else `every`."""
    loop = self._loop
    queued = loop.waiting + adding > loop.slots - loop.running
    return self.busy_every if queued else self.every

  def _apply(self, d: decisions.Decision, prepared: dict, futures=()) -> list:
    """Applies a shared decision to this process's loop and runs its
    segment (every process runs the same programs on the same data);
    prompt scorings first, their results to `futures` (process 0).

    Before the segment's step every process of a pod says, in one small
    collective, whether it admitted and cancelled as told and whether its
    last step succeeded. If any did not, every process starts a fresh loop
    together and process 0 ends the requests it ran with that process's
    error: no process is left waiting in a program another will not run."""
    for i, (prompt, top_n, adapter) in enumerate(d.score):
      try:
        result = self._score_now(prompt, top_n, adapter)
      except Exception as e:
        result = e
      if futures:
        if isinstance(result, Exception):
          futures[i].set_exception(result)
        else:
          futures[i].set_result(result)
    error, self._failed = self._failed, None
    try:
      for key, g, seed in d.add:
        ready = prepared.get(key)
        if ready is None:  # a follower compiles the request itself
          ready, _ = self.prepare(g, seed=seed)
        self._loop.add(key, ready)
      for key in d.cancel:
        self._loop.cancel(key)
    except Exception as e:
      log.exception("admitting the segment's requests failed")
      error = f"process {jax.process_index()}: {type(e).__name__}: {e}"
    error = decisions.agree(error)
    if error is not None:
      self._restart(error)
      return []
    if d.stop or not self._loop.busy:
      return []
    started = time.monotonic()
    try:
      updates = self._loop.step(d.steps)
    except Exception as e:
      log.exception("the device step failed; restarting the slot loop")
      error = f"process {jax.process_index()}: {type(e).__name__}: {e}"
      if _pod():  # every process restarts after the next agreement
        self._failed = error
      else:
        self._restart(error)
      return []
    for key in self._loop.admitted:  # a preempted one: its first time
      if key in self._active and self._active[key].admitted_at is None:
        self._active[key].admitted_at = started
    for u in updates:
      if u.speculation is not None:
        self.speculation_totals = self.speculation_totals + u.speculation
    return updates

  def _restart(self, error: str) -> None:
    """A fresh loop; the requests this process ran end with `error`."""
    for stream in list(self._active.values()):
      self._finished(stream, ERROR, error)
    self._active.clear()
    self._loop.close()
    self._loop = self._make()

  def follow(self) -> None:
    """Processes other than 0 of a pod: applies process 0's decisions in
    lockstep until it stops."""
    if self.leader:
      raise ValueError("follow() is for processes other than 0")
    self._warm_up()
    while True:
      d = decisions.share(None)
      self._apply(d, {})
      if d.stop:
        return

  def _finished(self, stream: TokenStream, reason: str, error=None) -> None:
    stream._end(reason, error)
    for listener in self._listeners:
      try:
        listener(stream)
      except Exception:
        log.exception("a finish listener failed")


def _fast_forwarded(request):
  """`request` with its constraint fast-forwarding (`Constraint.
  fast_forward`): a loop that drafts forced tokens appends each forced
  run in one pass."""
  if request.constraint is None:
    return request
  return dataclasses.replace(
    request, constraint=request.constraint.fast_forwarded()
  )
