"""Continuous against static batching on one long-tailed workload.

  requests = workload(model, prompt, n=256, long=256, seed=0)
  report = compare(model, prompt, requests, slots=16, runs=1)

The workload: `n` requests after one shared prompt (prefilled once, the
prefix of every request), each with its own few-token task suffix and
sample id, sampled at temperature 0.7; 80% have budgets of 8-32 tokens and
20% of `long` tokens (budgets stand in for stopping at EOS, so the
lengths, not the model, make the tail). Both modes generate exactly the
same tokens (the `generate_many` contract); what differs is the time:

  static:     batches of `slots` requests in order, each one
              `generate_stream` (8-step segments) run until every row has
              stopped or used its budget; a request is done when the
              segment holding its last token returns;
  continuous: `generate_many(requests, slots=slots)`; a request is done
              when it is yielded.

Per mode: tokens/s (tokens kept: up to a stop id or the budget), time to
first token and latency percentiles over requests (all submitted at time
0; each time is the host's first look after the event), slot occupancy
(kept tokens per slot-step) and the programs compiled.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

import numpy as np

from chunkwise.inference import Chunk, InferenceModel, Request, Sampling
from chunkwise.inference.batching import continuous as continuous_lib
from chunkwise.inference.batching.admission import admit_programs
from chunkwise.inference.engines.engine import compiled_programs


def workload(
  model: InferenceModel,
  n: int,
  *,
  long: int,
  seed: int = 0,
  short: tuple[int, int] = (8, 32),
  long_share: float = 0.2,
) -> list[Request]:
  """`n` requests; a `long_share` of them with budget `long`, the rest
  uniform in `short` (seeded)."""
  rng = np.random.default_rng(seed)
  is_long = rng.random(n) < long_share
  budgets = np.where(is_long, long, rng.integers(short[0], short[1] + 1, n))
  vocab = model.vocab
  return [
    Request(
      tokens=vocab.encode(f" Task {i}:"),
      sample_id=i,
      steps=int(budgets[i]),
      sampling=Sampling(temperature=0.7, seed=seed),
    )
    for i in range(n)
  ]


def _percentiles(values: Sequence[float]) -> dict:
  v = np.asarray(values)
  return {f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}


def _programs(model: InferenceModel) -> int:
  """Programs compiled so far by the model's engines and admissions."""
  engines = {id(e): e for e in model.engines}.values()
  return sum(map(compiled_programs, engines)) + admit_programs()


def run_static(
  model, prefix, requests, slots: int, steps: int, batches=None
) -> dict:
  """Batches in order, each streamed with one program of `steps` columns
  (8-column segments) and left once every row has stopped or used its
  budget (a row's tokens past its budget are not counted)."""
  longest = max(len(r.tokens) for r in requests)  # one prefill program
  start = time.perf_counter()
  first, done, tokens, ran = {}, {}, 0, 0
  starts = range(0, len(requests), slots)
  for lo in starts[:batches]:
    batch = requests[lo : lo + slots]
    lengths = np.array([len(r.tokens) for r in batch], np.int32)
    ids = np.zeros((len(batch), longest), np.int32)
    for j, r in enumerate(batch):
      ids[j, : lengths[j]] = r.tokens
    tasks = model.prefill(Chunk(tokens=ids, lengths=lengths), prefix=prefix)
    budgets = np.array([r.steps for r in batch])
    got = np.zeros(len(batch), np.int64)  # tokens kept (up to the budget)
    ended = np.zeros(len(batch), bool)  # at a stop id or its budget
    column = 0
    for piece, _ in model.generate_stream(
      [*prefix, tasks],
      sample_ids=[r.sample_id for r in batch],
      steps=steps,
      sampling=Sampling(
        temperature=np.array([r.sampling.temperature for r in batch]),
        seed=batch[0].sampling.seed,
      ),
      every=8,
    ):
      kept = np.asarray(piece.lengths)  # waits for the segment
      now = time.perf_counter() - start
      width = piece.tokens.shape[1]
      column += width
      for j in range(len(batch)):
        first.setdefault(lo + j, now)
        if ended[j]:
          continue
        got[j] = min(got[j] + kept[j], budgets[j])
        if kept[j] < width or got[j] >= budgets[j]:
          ended[j] = True
          done[lo + j] = now
      if ended.all():
        break
    tokens += int(got.sum())
    ran += column
  total = time.perf_counter() - start
  return _summary("static", total, tokens, ran * slots, first, done)


def run_continuous(
  model, prefix, requests, slots: int, capacity=None, kv_pages=0, every=64
) -> dict:
  start = time.perf_counter()
  first, done, tokens, steps = {}, {}, 0, [0]
  held, preempted = [], [0]

  def trace(event, values):
    now = time.perf_counter() - start
    if event == "steps":
      steps[0] += values[0]
    elif event == "held":
      held.append(values[0])
    elif event == "preempted":
      preempted[0] += len(values)
    else:
      for i in values:
        first[i] = now

  for r in model.generate_many(
    requests,
    slots=slots,
    prefix=prefix,
    trace=trace,
    capacity=capacity,
    kv_pages=kv_pages,
    every=every,
  ):
    done[r.index] = time.perf_counter() - start
    tokens += r.tokens.shape[0]
  total = time.perf_counter() - start
  mode = f"paged x{slots}" if kv_pages else "continuous"
  return _summary(mode, total, tokens, steps[0] * slots, first, done) | {
    "held_max": max(held, default=0),
    "held_mean": float(np.mean(held)) if held else 0.0,
    "preempted": preempted[0],
  }


def _summary(mode, total, tokens, slot_steps, first, done) -> dict:
  return {
    "mode": mode,
    "seconds": total,
    "tokens": tokens,
    "tokens_per_s": tokens / total,
    "occupancy": tokens / max(slot_steps, 1),
    "ttft_s": _percentiles(list(first.values())),
    "latency_s": _percentiles(list(done.values())),
  }


def compare(
  model: InferenceModel,
  prompt: Sequence[int],
  requests: Sequence[Request],
  *,
  slots: int,
  runs: int = 1,
) -> dict:
  """Both modes: a warm-up of each on a few requests (it compiles), then
  `runs` of each side by side (static, continuous, static, ...); the
  median run of each mode is reported, with every run's tokens/s."""
  chunk = Chunk(
    tokens=np.asarray([prompt], np.int32),
    lengths=np.array([len(prompt)], np.int32),
  )
  prefix = [model.prefill(chunk)]
  requests = list(requests)
  longest = max(r.steps for r in requests)
  capacity = continuous_lib.slot_capacity(requests)
  before = _programs(model)
  # Warm-up: the static program, and every admission size (a power of two
  # up to `slots`: a call of k requests admits k at once).
  run_static(model, prefix, requests, slots, longest, batches=1)
  # Warm-up: the static program, and each prompt bucket's admission.
  by_bucket = {}
  for r in requests:
    by_bucket.setdefault(continuous_lib.prompt_bucket(len(r.tokens)), r)
  run_continuous(
    model,
    prefix,
    [
      dataclasses.replace(r, sample_id=j, steps=2)
      for j, r in enumerate(by_bucket.values())
    ],
    slots,
    capacity,
  )
  timed = {"static": [], "continuous": []}
  for _ in range(runs):
    timed["static"].append(run_static(model, prefix, requests, slots, longest))
    timed["continuous"].append(
      run_continuous(model, prefix, requests, slots, capacity)
    )
  out = {
    "workload": {
      "requests": len(requests),
      "long_requests": sum(r.steps == longest for r in requests),
      "longest": longest,
      "slots": slots,
      "tokens": timed["continuous"][0]["tokens"],
    },
    "runs": runs,
  }
  out |= _side_by_side(timed, "static", "continuous")
  out["programs_compiled"] = _programs(model) - before
  return out


def _side_by_side(timed: dict, base: str, other: str) -> dict:
  """Each mode's median run (by tokens/s, with every run's), and the
  median of `other` / `base` tokens/s over runs made side by side."""
  out = {}
  for mode, rows in timed.items():
    middle = sorted(rows, key=lambda r: r["tokens_per_s"])[len(rows) // 2]
    out[mode] = middle | {
      "tokens_per_s_runs": [r["tokens_per_s"] for r in rows]
    }
  ratios = [
    b["tokens_per_s"] / a["tokens_per_s"]
    for a, b in zip(timed[base], timed[other], strict=True)
  ]
  out["speedup"] = statistics.median(ratios)
  out["speedup_runs"] = ratios
  return out


def compare_paged(
  model: InferenceModel,
  prompt: Sequence[int],
  requests: Sequence[Request],
  *,
  slots: int,
  paged_slots: int,
  runs: int = 1,
  every: int = 16,
) -> dict:
  """Fixed slots against a paged pool of the same K/V memory: `slots`
  slots of the workload's capacity, and `paged_slots` slots sharing
  slots * capacity columns in pages (`generate_many(kv_pages=)`), side by
  side `runs` times after a warm-up of each; medians, with requests held
  at once (per segment) and preemptions."""
  from chunkwise.inference.paging.paged_kv import PAGE

  chunk = Chunk(
    tokens=np.asarray([prompt], np.int32),
    lengths=np.array([len(prompt)], np.int32),
  )
  prefix = [model.prefill(chunk)]
  requests = list(requests)
  capacity = continuous_lib.slot_capacity(requests)
  pages = slots * capacity // PAGE
  modes = {
    "fixed": dict(slots=slots),
    "paged": dict(slots=paged_slots, kv_pages=pages),
  }
  warm = [dataclasses.replace(r, steps=2) for r in requests[:paged_slots]]
  for kw in modes.values():
    run_continuous(model, prefix, warm, capacity=capacity, every=every, **kw)
  timed = {mode: [] for mode in modes}
  for _ in range(runs):
    for mode, kw in modes.items():
      timed[mode].append(
        run_continuous(
          model, prefix, requests, capacity=capacity, every=every, **kw
        )
      )
  out = {
    "workload": {
      "requests": len(requests),
      "capacity": capacity,
      "kv_columns": slots * capacity,
      "pages": pages,
      "every": every,
    },
    "runs": runs,
  }
  return out | _side_by_side(timed, "fixed", "paged")


def paged_table(result: dict) -> str:
  w = result["workload"]
  lines = [
    f"paged K/V: {w['requests']} requests, {w['kv_columns']} K/V columns "
    f"({w['pages']} pages) either way, capacity {w['capacity']}, every "
    f"{w['every']}, median of {result['runs']} run(s)",
    "mode     slots  held max/mean  preempted   tok/s  TTFT p50 s",
  ]
  for mode in ("fixed", "paged"):
    r = result[mode]
    slots = r["mode"].split("x")[-1] if mode == "paged" else "-"
    lines.append(
      f"{mode:<8} {slots:>5}  {r['held_max']:4d} / {r['held_mean']:5.1f}"
      f"  {r['preempted']:9d}  {r['tokens_per_s']:6.1f}  "
      f"{r['ttft_s']['p50']:9.1f}"
    )
  lines.append(f"paged / fixed: {result['speedup']:.2f}x tokens/s")
  return "\n".join(lines)


def table(result: dict) -> str:
  """The comparison as a text table."""
  w = result["workload"]
  lines = [
    f"continuous batching: {w['requests']} requests ({w['long_requests']} "
    f"of {w['longest']} tokens), {w['slots']} slots, {w['tokens']} tokens, "
    f"median of {result['runs']} run(s)",
    "mode        tok/s  occupancy  TTFT p50/p90/p99 s"
    "      latency p50/p90/p99 s",
  ]
  for mode in ("static", "continuous"):
    r = result[mode]
    t, lat = r["ttft_s"], r["latency_s"]
    lines.append(
      f"{mode:<10} {r['tokens_per_s']:6.1f}  {r['occupancy']:9.2f}  "
      f"{t['p50']:6.1f} {t['p90']:6.1f} {t['p99']:6.1f}    "
      f"{lat['p50']:6.1f} {lat['p90']:6.1f} {lat['p99']:6.1f}"
    )
  lines.append(
    f"continuous / static: {result['speedup']:.2f}x tokens/s; programs "
    f"compiled: {result['programs_compiled']}"
  )
  return "\n".join(lines)
