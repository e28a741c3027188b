"""One request as every API is translated into it (`Generation`), and its
tokens as they come (`TokenStream` of `Token`s).

  stream = engine.submit(Generation(prompt=ids, max_new_tokens=64))
  for token in stream:             # or `async for token in stream`
    print(token.text, end="")
  stream.finish_reason, stream.seed, stream.text

A stream is fed by the engine's thread (`_feed`: one segment's
`SlotUpdate`, detokenized and checked against the request's stop
strings) and read by any thread or event loop: readers wait on a
condition, async readers on an `asyncio.Event` set from the engine's
thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from chunkwise import processors as processors_lib
from chunkwise.inference import Chunk, Request, Sampling
from chunkwise.serving.text import Detokenizer, StopScanner


class Feeder(Protocol):
  """What a stream needs of the engine that feeds it (`engine.Engine`,
  which imports this module): the served model, and a way to give up its
  slot."""

  model: Any

  def _cancel(self, stream: TokenStream) -> None: ...


# Finish reasons (TGI's names; the OpenAI routes map them to stop/length).
LENGTH = "length"
EOS = "eos_token"
STOP_SEQUENCE = "stop_sequence"
CANCELLED = "cancelled"
ERROR = "error"


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

  def request(self, max_top_n: int, seed: int | None = None):
    """This generation checked (a ValueError names the bad field) and
    translated for the slot loop: (its `Request`, its penalties' logits
    processor, the seed: `seed`, else `self.seed`, else a random one).
    `max_top_n`: the most alternatives the engine returns."""
    top_n = int(self.top_n)
    if not 0 <= top_n <= max_top_n:
      raise ValueError(
        f"top_n={self.top_n}: this server returns at most {max_top_n} "
        "alternatives per token"
      )
    if not all(isinstance(s, str) for s in self.stop):
      raise ValueError(f"stop must be strings, got {list(self.stop)!r}")
    if self.seed is not None and not 0 <= int(self.seed) < 2**32:
      raise ValueError(f"seed={self.seed} must be in [0, 2**32)")
    if seed is None:
      seed = int(self.seed) if self.seed is not None else secrets.randbits(31)
    request = Request(
      tokens=list(self.prompt),
      sample_id=int(self.sample_id),
      steps=self.max_new_tokens,
      sampling=Sampling(
        temperature=self.temperature,
        top_k=self.top_k,
        top_p=self.top_p,
        min_p=self.min_p,
        seed=seed,
      ),
      stop_ids=tuple(self.stop_ids),
      constraint=self.constraint,
      adapter=self.adapter,
    )
    penalties = processors_lib.penalties(
      repetition=self.repetition_penalty,
      presence=self.presence_penalty,
      frequency=self.frequency_penalty,
      context=Chunk(
        tokens=np.asarray([self.prompt], np.int32),
        lengths=np.asarray([len(self.prompt)], np.int32),
      ),
    )
    return request, penalties, seed

  @property
  def greedy(self) -> bool:
    return float(self.temperature) == 0.0


@dataclasses.dataclass(frozen=True)
class Token:
  """One generated token: id, the text it adds, its raw log-prob, whether
  it is special (EOS), its most likely alternatives [(id, logprob)], and
  whether the request's constraint allowed only this token (None: the
  request has no constraint)."""

  id: int
  text: str
  logprob: float
  special: bool
  top: tuple[tuple[int, float], ...] = ()
  forced: bool | None = None


class ConstraintWalk:
  """The request's constraint automaton, walked on the host over the
  tokens it emits (as the device's processor walks it) to say which of
  them it forced, and whether budget forcing (the engine's, within
  `steps`) removed a choice the constraint allowed at any of them before
  the answer was a whole match: `budget` (then the budget, not the model,
  ended the answer)."""

  def __init__(self, tables, steps: int = 0, stop_ids=()):
    self.tables, self.state = tables, 0
    self.steps, self.stop_ids = steps, tuple(stop_ids)
    self.taken, self.budget = 0, False
    self._window = 0 if tables is None else tables.longest + 2

  def forced(self, token: int) -> bool | None:
    """Whether the current state forced `token`; then steps over it."""
    if self.tables is None:
      return None
    forced = self.tables.forced(self.state)
    remaining = self.steps - self.taken
    # Counted only where the answer is not yet whole: at a final state
    # forcing just declines to start more than fits (a second call).
    final = bool(self.tables.final[self.state])
    if not self.budget and not final and remaining <= self._window:
      self.budget = self.tables.budget_narrows(
        self.state, remaining, self.stop_ids
      )
    self.taken += 1
    nxt = self.tables.step(self.state, token)
    self.state = nxt if nxt >= 0 else self.state
    return forced


class TokenStream:
  """One request's tokens as they come (module docstring): iterate it
  (sync or async) for `Token`s; afterwards `finish_reason`, `seed`,
  `text` and `error` say how it ended. `cancel()` stops it."""

  def __init__(
    self, engine: Feeder, key: int, g: Generation, seed: int, tables=None
  ):
    self._engine = engine
    self.key = key
    self.generation = g
    self.drawn_seed = seed  # the seed it runs with (greedy too)
    self.seed = None if g.greedy else seed
    self.prompt_tokens = len(g.prompt)
    self.tokens: list[Token] = []
    self.finish_reason: str | None = None
    self.stop_sequence: str | None = None
    self.error: str | None = None
    self.submitted = time.monotonic()
    self.compile_s = 0.0  # its constraint's compile, before `submitted`
    self.admitted_at: float | None = None  # it took a slot
    self.first_token_at: float | None = None
    self.finished_at: float | None = None
    self.arrivals: list[float] = []  # when each token was handed over
    self._cv = threading.Condition()
    self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
    self._text = Detokenizer(engine.model.vocab, specials=engine.model.eos_ids)
    self._stops = StopScanner(g.stop)
    self._chars: list[str] = []  # text so far, joined lazily
    self._length = 0  # its characters
    self._walk = ConstraintWalk(
      tables,
      g.max_new_tokens,
      (*g.stop_ids, *engine.model.eos_ids),
    )

  # -- the reader's side --------------------------------------------------

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  @property
  def text(self) -> str:
    """The text of the tokens so far (special tokens add nothing)."""
    return "".join(self._chars)

  def text_after(self, pieces: int) -> tuple[str, int]:
    """(the text of the tokens after the first `pieces` pieces, how many
    pieces there are now): a reader that keeps its count reads each
    character once, however long the text grows."""
    chars = self._chars[pieces:]  # (one list read: safe beside `_feed`)
    return "".join(chars), pieces + len(chars)

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
      found = self._stops.feed(piece)
      if found is not None:  # the text ends with the stop string
        index, stop = found
        piece = piece[: index + len(stop) - self._length]
        stopped = stop
      self._chars.append(piece)
      self._length += len(piece)
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
          self._walk.forced(token),
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
        self._length += len(tail)
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
            self._walk.forced(sid),
          )
        )
        reason = EOS if sid in self._engine.model.eos_ids else STOP_SEQUENCE
        if self._walk.budget:  # closed early by budget forcing
          reason = LENGTH
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
