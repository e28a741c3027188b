"""Timed prefill and decode: one warm-up call (it compiles), then the
median of `runs` calls, each waited for with `block_until_ready`.

  ids = token_ids(batch=8, length=512, vocab=model.hparams.vocab, bos_id=1)
  point = prefill(model, ids, runs=3)
  point = decode(model, prompt_ids, batch=16, steps=128, runs=3)
  point.tokens_per_s, point.ms_per_step, point.compile_s

Decode is greedy and timed from a prefilled prompt (the prefill is not in
the time); a row that meets a stop id stops, so the loop's steps are
counted, not assumed.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from chunkwise.inference import Chunk, InferenceModel, Sampling


def timed(
  fn: Callable[[], object], runs: int, sync: Callable[[], None] | None = None
) -> tuple[float, list[float]]:
  """(seconds of a first, warm-up call; seconds of each of `runs` calls).
  Each call is waited for before the clock is read: JAX arrays with
  `block_until_ready`, other frameworks' queued work with `sync`."""

  def once() -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    if sync is not None:
      sync()
    return time.perf_counter() - start

  first = once()
  return first, [once() for _ in range(runs)]


def median_seconds(fn: Callable[[], object], runs: int) -> float:
  return statistics.median(timed(fn, runs)[1])


@dataclasses.dataclass(frozen=True)
class Point:
  """One timed configuration of a phase."""

  phase: str  # "prefill" or "decode"
  batch: int
  length: int  # tokens per row of the prompt (prefill: of the chunk)
  steps: int  # decode loop iterations run (0 for prefill)
  tokens: int  # tokens prefilled or generated per call
  first_s: float  # the first call: compile + run
  times: tuple[float, ...]  # each timed call
  # decode: the first prefill of its prompt (compile + run), untimed else
  prefill_first_s: float = 0.0

  @property
  def seconds(self) -> float:
    return statistics.median(self.times)

  @property
  def compile_s(self) -> float:
    """The first call's time beyond a warm call's: mostly compilation."""
    return max(self.first_s - self.seconds, 0.0)

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.seconds

  @property
  def ms_per_step(self) -> float:
    """Decode: latency of one loop step (one token per row)."""
    return 1e3 * self.seconds / max(self.steps, 1)

  def describe(self) -> dict:
    out = {
      "phase": self.phase,
      "batch": self.batch,
      "length": self.length,
      "tokens": self.tokens,
      "first_s": self.first_s,
      "compile_s": self.compile_s,
      "seconds": self.seconds,
      "times": list(self.times),
      "tokens_per_s": self.tokens_per_s,
    }
    if self.phase == "decode":
      out.update(
        steps=self.steps,
        ms_per_step=self.ms_per_step,
        prefill_first_s=self.prefill_first_s,
        # A fresh program's first prefill + generate: compiles and runs.
        first_calls_s=self.prefill_first_s + self.first_s,
      )
    return out


def token_ids(
  *, batch: int, length: int, vocab: int, bos_id: int, seed: int = 0
) -> np.ndarray:
  """int32[batch, length] random ids (fixed by `seed`) after BOS."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, size=(batch, length), dtype=np.int32)
  ids[:, 0] = bos_id
  return ids


def _chunk(ids: np.ndarray) -> Chunk:
  ids = np.asarray(ids, np.int32)
  return Chunk(
    tokens=jax.numpy.asarray(ids),
    lengths=jax.numpy.full((ids.shape[0],), ids.shape[1], np.int32),
  )


def prefill(model: InferenceModel, ids: np.ndarray, runs: int) -> Point:
  """Times `model.prefill` of the rows `ids` (int[batch, length])."""
  chunk = _chunk(ids)
  return timed_prefill(lambda: model.prefill(chunk), ids.shape, runs)


def timed_prefill(fn, shape: tuple[int, int], runs: int, sync=None) -> Point:
  """Times `fn`, a prefill of `shape` = (batch, length) tokens (waited for
  with `sync` too, see `timed`)."""
  first, times = timed(fn, runs, sync)
  batch, length = shape
  return Point(
    phase="prefill",
    batch=batch,
    length=length,
    steps=0,
    tokens=batch * length,
    first_s=first,
    times=tuple(times),
  )


def prompt_prefix(
  model: InferenceModel, prompt: Sequence[int], batch: int, adapters=None
):
  """`batch` copies of `prompt`, prefilled (with each row's `adapters`)."""
  ids = np.tile(np.asarray(prompt, np.int32)[None], (batch, 1))
  return model.prefill(_chunk(ids), adapters=adapters)


def greedy(model: InferenceModel, prefix, steps: int, constraint=None):
  """A call of greedy `generate` after `prefix` (under `constraint`, if
  given); returns (Chunk, result)."""
  batch = prefix.per_token_scores.shape[0]
  sample_ids = np.arange(batch, dtype=np.int32)
  sampling = Sampling(temperature=0.0)
  return lambda: model.generate(
    [prefix],
    sample_ids=sample_ids,
    steps=steps,
    sampling=sampling,
    constraint=constraint,
  )


def decode(
  model: InferenceModel,
  prompt: Sequence[int],
  *,
  batch: int,
  steps: int,
  runs: int,
  constraint=None,
) -> Point:
  """Times greedy `model.generate` of `steps` tokens for `batch` copies of
  `prompt` (already prefilled, outside the time), under `constraint`."""
  start = time.perf_counter()
  prefix = jax.block_until_ready(prompt_prefix(model, prompt, batch))
  prefill_first = time.perf_counter() - start
  call = greedy(model, prefix, steps, constraint)
  lengths = []

  def run():
    tokens, result = call()
    lengths.append(tokens.lengths)
    return result

  first, times = timed(run, runs)
  kept = np.asarray(lengths[-1])
  # A row that stops ran one more step (the one that sampled its stop).
  ran = int(min(steps, kept.max() + (kept.max() < steps)))
  return Point(
    phase="decode",
    batch=batch,
    length=len(prompt),
    steps=ran,
    tokens=int(kept.sum()),
    first_s=first,
    times=tuple(times),
    prefill_first_s=prefill_first,
  )
