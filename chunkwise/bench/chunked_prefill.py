"""Inter-token latency of decoding slots while a long prompt is admitted.

  report = compare(model, prompt, long_length=8192, steps=48)

Two slots, one token per segment (`every=1`, as a streaming server hands
tokens back): request A decodes `steps` tokens from `prompt`; B, short,
finishes after 4 and frees its slot for C, a prompt of `long_length`
random ids, so C is admitted while A decodes. A's inter-token latency is
the time between consecutive segments (the host syncs where its tokens
arrive) while it runs. Both schedules run on the same model, interleaved:
- `whole`: C prefilled at once at admission (the slot loop before chunked
  prefill: admission prefills a fixed number of rows, here 2, the width
  of C's length bucket), every slot waiting for it;
- `pieces`: C prefilled one piece per segment (`long_prefill.Staged`), A
  decoding between pieces.
Both give the same tokens (checked).
"""

from __future__ import annotations

import time

import numpy as np

from chunkwise.bench import timing
from chunkwise.inference import InferenceModel, Request, Sampling

# No prompt is "long" for this piece width: the whole schedule.
_WHOLE = 1 << 30


def _requests(model: InferenceModel, prompt, long_length: int, steps: int):
  h = model.hparams
  long = timing.token_ids(
    batch=1, length=long_length, vocab=h.vocab, bos_id=model.bos_id, seed=1
  )[0]
  greedy = Sampling(temperature=0.0)
  return [
    Request(tokens=list(prompt), sample_id=0, steps=steps, sampling=greedy),
    Request(tokens=list(prompt), sample_id=1, steps=4, sampling=greedy),
    Request(tokens=long.tolist(), sample_id=2, steps=4, sampling=greedy),
  ]


def _run(model: InferenceModel, requests, piece: int | None) -> dict:
  model = model.with_prefill_chunk(piece)
  events = []

  def trace(kind, values):
    if kind == "steps":
      events.append(time.perf_counter())

  start = time.perf_counter()
  results = {
    r.index: r
    for r in model.generate_many(
      requests, slots=2, every=1, capacity=None, trace=trace
    )
  }
  wall = time.perf_counter() - start
  # Segment k hands A its token k: A's gaps are between its n segments.
  gaps = np.diff(np.asarray(events[: int(results[0].tokens.size)]))
  return {
    "piece": None if piece == _WHOLE else piece,
    "wall_s": wall,
    "itl_p50_ms": float(np.percentile(gaps, 50) * 1e3),
    "itl_p99_ms": float(np.percentile(gaps, 99) * 1e3),
    "itl_max_ms": float(gaps.max() * 1e3),
    "tokens": {i: r.tokens.tolist() for i, r in results.items()},
  }


def compare(
  model: InferenceModel,
  prompt,
  *,
  long_length: int,
  steps: int,
  piece: int | None = None,
) -> dict:
  """Both schedules (after one warm-up run of each), side by side."""
  requests = _requests(model, prompt, long_length, steps)
  schedules = {"whole": _WHOLE, "pieces": piece}
  for p in schedules.values():  # compile
    _run(model, requests, p)
  got = {name: _run(model, requests, p) for name, p in schedules.items()}
  same = got["whole"].pop("tokens") == got["pieces"].pop("tokens")
  return {
    "long_length": long_length,
    "steps": steps,
    "same_tokens": same,
    "schedules": got,
    "itl_p99_ratio": got["whole"]["itl_p99_ms"] / got["pieces"]["itl_p99_ms"],
  }


def lines(report: dict) -> list[str]:
  out = [
    f"chunked prefill: decode ITL while a {report['long_length']}-token "
    f"prompt is admitted (2 slots, every=1)"
  ]
  for name, r in report["schedules"].items():
    out.append(
      f"  {name:<7} ITL p50 {r['itl_p50_ms']:8.1f} ms  p99 "
      f"{r['itl_p99_ms']:8.1f} ms  max {r['itl_max_ms']:8.1f} ms  "
      f"(wall {r['wall_s']:.1f} s)"
    )
  out.append(
    f"  p99 whole / pieces: {report['itl_p99_ratio']:.1f}x; same tokens: "
    f"{report['same_tokens']}"
  )
  return out
