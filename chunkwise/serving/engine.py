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

Failures stay with their request: an exception while handling one
request's tokens ends that stream with an error and frees its slot; one
in the device step ends the streams it was running and starts a fresh
loop, and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from chunkwise import processors as processors_lib
from chunkwise.inference import Chunk, InferenceModel, Request, Sampling
from chunkwise.serving.text import Detokenizer, StopStrings

log = logging.getLogger("chunkwise.serving")

# Finish reasons (TGI's names; the OpenAI routes map them to stop/length).
LENGTH = "length"
EOS = "eos_token"
STOP_SEQUENCE = "stop_sequence"
CANCELLED = "cancelled"
ERROR = "error"
# Decode steps between two hand-overs of tokens: one while no request
# waits for a slot (tokens stream as they are made), more while some wait
# (they cannot start before a slot frees, which ends a segment anyway):
# measured in README "Serving".
DEFAULT_EVERY = 1
DEFAULT_BUSY_EVERY = 8


class Overloaded(RuntimeError):
  """The engine's queue is full (HTTP 429)."""


class Closed(RuntimeError):
  """The engine no longer admits requests (shutting down; HTTP 503)."""


class GenerationFailed(RuntimeError):
  """A request failed while it ran (HTTP 424 / an in-stream error)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generation:
  """One request, as every API is translated into it.

  Attributes:
    prompt: token ids, starting with BOS.
    max_new_tokens: most tokens to generate.
    temperature, top_k, top_p, min_p: the sampler's settings (temperature
      0: greedy).
    seed: fixes the randomness with `sample_id`; None: a random one,
      reported back (greedy requests report none).
    sample_id: which sample of (prompt, seed) this is (OpenAI's n).
    stop: strings that end the request (matched on the text).
    stop_ids: token ids that end it, besides EOS.
    adapter: a served LoRA adapter's name; None: the base model.
    constraint: a `chunkwise.constraints` Regex / JsonSchema / Choice.
    repetition_penalty, presence_penalty, frequency_penalty: vLLM's
      penalties (`chunkwise.processors.penalties`; the prompt counts as
      seen for the repetition penalty).
    top_n: alternatives to report per token (at most the engine's).
  """

  prompt: Sequence[int]
  max_new_tokens: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int | None = None
  sample_id: int = 0
  stop: Sequence[str] = ()
  stop_ids: Sequence[int] = ()
  adapter: str | None = None
  constraint: Any = None
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  top_n: int = 0

  @property
  def greedy(self) -> bool:
    return float(self.temperature) == 0.0


@dataclasses.dataclass(frozen=True)
class Token:
  """One generated token: id, the text it adds, its raw log-prob, whether
  it is special (EOS), and its most likely alternatives [(id, logprob)]."""

  id: int
  text: str
  logprob: float
  special: bool
  top: tuple[tuple[int, float], ...] = ()


class TokenStream:
  """One request's tokens as they come (module docstring): iterate it
  (sync or async) for `Token`s; afterwards `finish_reason`, `seed`,
  `text` and `error` say how it ended. `cancel()` stops it."""

  def __init__(self, engine: Engine, key: int, g: Generation, seed: int):
    self._engine = engine
    self.key = key
    self.generation = g
    self.seed = None if g.greedy else seed
    self.prompt_tokens = len(g.prompt)
    self.tokens: list[Token] = []
    self.finish_reason: str | None = None
    self.stop_sequence: str | None = None
    self.error: str | None = None
    self.submitted = time.monotonic()
    self.admitted_at: float | None = None  # it took a slot
    self.first_token_at: float | None = None
    self.finished_at: float | None = None
    self.arrivals: list[float] = []  # when each token was handed over
    self._cv = threading.Condition()
    self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
    self._text = Detokenizer(engine.model.vocab, specials=engine.model.eos_ids)
    self._stops = StopStrings(g.stop)
    self._chars: list[str] = []  # text so far, joined lazily

  # -- the reader's side --------------------------------------------------

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  @property
  def text(self) -> str:
    """The text of the tokens so far (special tokens add nothing)."""
    return "".join(self._chars)

  def cancel(self) -> None:
    """Stops the request (its slot is freed at the next segment)."""
    if not self.done:
      self._engine._cancel(self)

  def __iter__(self):
    i = 0
    while True:
      with self._cv:
        while i >= len(self.tokens) and not self.done:
          self._cv.wait()
        ready = self.tokens[i:]
        finished = self.done
      yield from ready
      i += len(ready)
      if finished and i >= len(self.tokens):
        break
    self.raise_error()

  async def __aiter__(self):
    i = 0
    loop = asyncio.get_running_loop()
    event = asyncio.Event()
    with self._cv:
      self._waiters.append((loop, event))
    try:
      while True:
        event.clear()
        with self._cv:
          ready = self.tokens[i:]
          finished = self.done
        for token in ready:
          yield token
        i += len(ready)
        if finished and i >= len(self.tokens):
          break
        if not ready:
          await event.wait()
    finally:
      with self._cv:
        self._waiters.remove((loop, event))
    self.raise_error()

  def wait(self, timeout: float | None = None) -> TokenStream:
    """Blocks until the request ends; returns the stream."""
    with self._cv:
      self._cv.wait_for(lambda: self.done, timeout)
    return self

  def gaps(self) -> list[float]:
    """Seconds between consecutive tokens' hand-overs."""
    return [b - a for a, b in itertools.pairwise(self.arrivals)]

  def raise_error(self) -> None:
    if self.finish_reason == ERROR:
      raise GenerationFailed(self.error)

  # -- the engine's side --------------------------------------------------

  def _notify(self) -> None:
    self._cv.notify_all()
    for loop, event in self._waiters:
      loop.call_soon_threadsafe(event.set)

  def _feed(self, update) -> bool:
    """Takes one segment's `SlotUpdate`; returns whether the request is
    over (a stop string or the update's finish)."""
    now = time.monotonic()
    new = []
    g = self.generation
    stopped = None
    rows = zip(
      update.tokens.tolist(),
      update.per_token_scores.tolist(),
      update.top_ids.tolist(),
      update.top_logprobs.tolist(),
      strict=True,
    )
    for token, score, top_ids, top_lp in rows:
      piece = self._text.add(token)
      before = sum(map(len, self._chars))
      self._chars.append(piece)
      found = self._stops.find(self.text, len(piece))
      if found is not None:
        index, stop = found
        piece = piece[: index + len(stop) - before]
        self._chars[-1] = piece
        stopped = stop
      new.append(
        Token(
          token,
          piece,
          finite(score),
          self._text.is_special(token),
          tuple(
            zip(
              top_ids[: g.top_n], map(finite, top_lp[: g.top_n]), strict=False
            )
          ),
        )
      )
      if stopped is not None:
        break
    reason = None
    if stopped is not None:
      reason, self.stop_sequence = STOP_SEQUENCE, stopped
    elif update.finish_reason is not None:
      tail = self._text.flush()
      if tail and new:
        new[-1] = dataclasses.replace(new[-1], text=new[-1].text + tail)
        self._chars.append(tail)
      if update.stop_id is not None:
        sid = update.stop_id
        new.append(
          Token(
            sid,
            self._text.name(sid),
            finite(update.stop_score),
            True,
            tuple(
              zip(
                update.stop_top_ids[: g.top_n].tolist(),
                map(finite, update.stop_top_logprobs[: g.top_n].tolist()),
                strict=False,
              )
            ),
          )
        )
        reason = EOS if sid in self._engine.model.eos_ids else STOP_SEQUENCE
      else:
        reason = LENGTH
    with self._cv:
      if new and self.first_token_at is None:
        self.first_token_at = now
      self.tokens.extend(new)
      self.arrivals.extend([now] * len(new))
      if reason is not None:
        self.finish_reason, self.finished_at = reason, now
      self._notify()
    return reason is not None

  def _end(self, reason: str, error: str | None = None) -> None:
    with self._cv:
      if self.done:
        return
      self.error = error
      self.finish_reason, self.finished_at = reason, time.monotonic()
      self._notify()


def finite(x) -> float:
  """A log-prob for the wire: -inf (a masked token) as -9999, as vLLM."""
  x = float(x)
  return x if np.isfinite(x) else -9999.0


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
    )
    self._loop = self._make()
    self.slots = self._loop.slots
    self._keys = itertools.count()
    self._cv = threading.Condition()
    self._inbox: list[tuple[TokenStream, Any]] = []
    self._cancels: list[TokenStream] = []
    self._active: dict[int, TokenStream] = {}
    self._closing = False
    self._thread = threading.Thread(
      target=self._run, name="chunkwise-engine", daemon=True
    )
    self._thread.start()

  # -- any thread -----------------------------------------------------------

  @property
  def waiting(self) -> int:
    """Requests submitted and not yet in a slot."""
    return len(self._inbox) + self._loop.waiting

  @property
  def running(self) -> int:
    """Requests in slots."""
    return self._loop.running

  @property
  def active(self) -> int:
    """Requests submitted and not finished."""
    return len(self._active) + len(self._inbox)

  def prepare(self, g: Generation):
    """Validates `g` and compiles its constraint (no device work); raises
    ValueError naming the bad field. `submit` calls it."""
    if not isinstance(g, Generation):
      raise ValueError(f"submit takes a Generation, got {g!r}")
    top_n = int(g.top_n)
    if not 0 <= top_n <= self.top_n:
      raise ValueError(
        f"top_n={g.top_n}: this server returns at most {self.top_n} "
        "alternatives per token"
      )
    if not all(isinstance(s, str) for s in g.stop):
      raise ValueError(f"stop must be strings, got {list(g.stop)!r}")
    if g.seed is not None and not 0 <= int(g.seed) < 2**32:
      raise ValueError(f"seed={g.seed} must be in [0, 2**32)")
    seed = int(g.seed) if g.seed is not None else secrets.randbits(31)
    request = Request(
      tokens=list(g.prompt),
      sample_id=int(g.sample_id),
      steps=g.max_new_tokens,
      sampling=Sampling(
        temperature=g.temperature,
        top_k=g.top_k,
        top_p=g.top_p,
        min_p=g.min_p,
        seed=seed,
      ),
      stop_ids=tuple(g.stop_ids),
      constraint=g.constraint,
      adapter=g.adapter,
    )
    penalties = processors_lib.penalties(
      repetition=g.repetition_penalty,
      presence=g.presence_penalty,
      frequency=g.frequency_penalty,
      context=Chunk(
        tokens=np.asarray([g.prompt], np.int32),
        lengths=np.asarray([len(g.prompt)], np.int32),
      ),
    )
    prepared = self._loop.prepare(request, (penalties,), what="request")
    return prepared, seed

  def submit(self, g: Generation, prepared=None) -> TokenStream:
    """Queues `g` (validated first, unless `prepared` is what `prepare`
    returned for it); returns its stream. Raises ValueError (bad request),
    `Overloaded` (queue full) or `Closed` (shutting down)."""
    prepared, seed = prepared or self.prepare(g)
    with self._cv:
      if self._closing:
        raise Closed("the server is shutting down")
      if self.waiting >= self.max_queue:
        raise Overloaded("Model is overloaded")
      stream = TokenStream(self, next(self._keys), g, seed)
      self._inbox.append((stream, prepared))
      self._cv.notify_all()
    return stream

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
    ids = np.asarray([prompt], np.int32)
    chunk = Chunk(tokens=ids, lengths=np.asarray([ids.shape[1]], np.int32))
    r = self.model.prefill(chunk, top_n=top_n, adapters=adapter)
    n = ids.shape[1]
    return (
      np.asarray(r.per_token_scores)[0, :n],
      np.asarray(r.top_ids)[0, :n],
      np.asarray(r.top_logprobs)[0, :n],
    )

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
    self._thread.join(timeout=60)
    return clean

  @property
  def closing(self) -> bool:
    return self._closing

  # -- the engine's thread --------------------------------------------------

  _stop = False

  def _run(self) -> None:
    while True:
      with self._cv:
        while not (
          self._inbox or self._cancels or self._loop.busy or self._stop
        ):
          self._cv.wait()
        if self._stop and not self._loop.busy and not self._inbox:
          break
        inbox, self._inbox = self._inbox, []
        cancels, self._cancels = self._cancels, []
        for stream, prepared in inbox:
          self._active[stream.key] = stream
          self._loop.add(stream.key, prepared)
      for stream in cancels:
        if self._active.pop(stream.key, None) is not None:
          self._loop.cancel(stream.key)
          self._finished(stream, CANCELLED)
      started = time.monotonic()
      try:
        loop = self._loop
        queued = loop.waiting > loop.slots - loop.running  # after admission
        updates = loop.step(self.busy_every if queued else self.every)
      except Exception as e:
        log.exception("the device step failed; restarting the slot loop")
        for stream in list(self._active.values()):
          self._finished(stream, ERROR, f"{type(e).__name__}: {e}")
        self._active.clear()
        self._loop = self._make()
        continue
      for key in self._loop.admitted:
        if key in self._active:
          self._active[key].admitted_at = started
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
          if u.finish_reason is None:
            self._loop.cancel(u.key)
          self._finished(stream, stream.finish_reason)

  def _finished(self, stream: TokenStream, reason: str, error=None) -> None:
    stream._end(reason, error)
    for listener in self._listeners:
      try:
        listener(stream)
      except Exception:
        log.exception("a finish listener failed")
