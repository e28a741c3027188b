"""A decode step of the slot loop against one of plain `generate`, at the
same batch and context.

  report = compare(model, prompt, slots=16, capacity=320, runs=3)

- `generate`: `slots` rows after `prompt` (one per sample id), sampled; its
  step is the difference of two calls' times over the difference of their
  steps (64 and `capacity` - 16), so that the prefill, the loop's start
  and the host's look cancel; its K/V buffer widens to ~`capacity`.
- `slots`: `live_slots` of `slots` rows and `capacity` columns (the
  attention reads every column, filled or not), every slot holding a
  request of the same prompt that outlasts the measurement; after its
  admission, segments of `every` steps (fewer where a request draws EOS),
  each timed with its host look: a step is a segment's time over the
  steps it ran.

What this leaves out is what a continuous run adds around its steps:
admission prefills and the host's looks when a request finishes (the
`--continuous` comparison counts those).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from chunkwise.inference import Chunk, InferenceModel, Request, Sampling

_SHORT = 64  # the shorter generate call's steps
_EVERY = 16  # steps per slot-loop segment


def _generate_step(model, prompt, slots: int, capacity: int, runs: int):
  chunk = Chunk.from_lists([list(prompt)] * slots)
  prefix = [model.prefill(chunk)]
  sampling = Sampling(temperature=0.7, seed=1)
  long = capacity - 16

  def call(steps):
    start = time.perf_counter()
    tokens, _ = model.generate(
      prefix, sample_ids=np.arange(slots), steps=steps, sampling=sampling
    )
    ran = int(np.max(tokens.lengths))
    if ran != steps:
      raise RuntimeError(f"generate ran {ran} of {steps} steps")
    return time.perf_counter() - start

  call(_SHORT), call(long)  # compile
  per_step = []
  for _ in range(runs):
    short_s, long_s = call(_SHORT), call(long)
    per_step.append((long_s - short_s) / (long - _SHORT))
  return per_step


def _slot_step(model, prompt, slots: int, capacity: int, runs: int):
  loop = model.live_slots(slots=slots, capacity=capacity, every=_EVERY)
  steps = capacity - len(prompt)
  for i in range(slots):
    request = Request(
      tokens=list(prompt),
      sample_id=i,
      steps=steps,
      sampling=Sampling(temperature=0.7, seed=1),
    )
    loop.add(i, loop.prepare(request))
  loop.step(), loop.step()  # admission; compile
  per_step = []
  # Every segment runs its `every` steps: no request ends within the
  # 2 + 2 * runs segments (`check`).
  for _ in range(2 * runs):
    start = time.perf_counter()
    updates = loop.step()
    seconds = time.perf_counter() - start
    # A request that draws EOS ends its segment early: count the steps
    # that ran (its stop token among them).
    ran = max(len(u.tokens) + (u.finish_reason == "stop") for u in updates)
    per_step.append(seconds / ran)
  return per_step


def check(
  slots: int, capacity: int, prompt_length: int, max_len: int, runs: int
):
  """Raises ValueError for sizes this comparison cannot run."""
  segments = 2 + 2 * runs
  need = max(_SHORT + 32, prompt_length + _EVERY * segments)
  if not need <= capacity <= max_len:
    raise ValueError(
      f"capacity={capacity}: expected {need} to {max_len} columns (the "
      f"{prompt_length}-token prompt, then more than 64 steps and "
      f"{segments} segments of {_EVERY}, within the model's max_len)"
    )
  if slots < 1:
    raise ValueError(f"slots={slots}: expected at least 1")


def compare(
  model: InferenceModel, prompt, *, slots: int, capacity: int, runs: int
) -> dict:
  """Both step costs (medians of `runs`, after compiling), side by side."""
  check(slots, capacity, len(prompt), model.hparams.max_len, runs)
  generate = _generate_step(model, prompt, slots, capacity, runs)
  loop = _slot_step(model, prompt, slots, capacity, runs)
  g, s = statistics.median(generate), statistics.median(loop)
  return {
    "slots": slots,
    "capacity": capacity,
    "generate_ms": g * 1e3,
    "slots_ms": s * 1e3,
    "ratio": s / g,
    "generate_runs_ms": [x * 1e3 for x in generate],
    "slots_runs_ms": [x * 1e3 for x in loop],
  }


def lines(report: dict) -> list[str]:
  return [
    f"decode step at batch {report['slots']}, capacity "
    f"{report['capacity']}: generate {report['generate_ms']:.1f} ms, "
    f"slot loop {report['slots_ms']:.1f} ms "
    f"({report['ratio']:.2f}x generate)"
  ]
