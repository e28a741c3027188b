"""The server at the library's speed (`scripts/load_test.py --suite=speed`):
the figures a new user sees, each beside the library call that does the
same work in the same process, side by side, runs alternating.

  report = measure(model, start=..., stream=..., concurrency=(1, 4, 16))
  print(table(report))

- start-up: seconds from launching the server to its first ready line,
  on an empty persistent compilation cache (cold), then `runs` times on
  the one that start filled (cached; the median);
- time to first token of the first request after ready and of the tenth
  (medians over those starts);
- a lone request's tokens/s through the server beside `model.generate`
  on the same prompt and settings (prefill included on both sides);
- c requests at once (each `concurrency`): aggregate tokens/s and
  inter-token p50 / p99 beside `generate_many` of the same requests
  through the server's slots; the server's tokens are checked against
  `generate_many`'s.

`start(cache_dir)` launches a server and returns it once ready (an object
with `stop()`); `stream(server, prompt, budget, sample_id)` streams one
request and returns its record (`load.summary`'s: submitted, times, ids,
ended, error). Both come from the script (it starts scripts/serve.py).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time

import numpy as np

import chunkwise as cw
from chunkwise.bench import load

SAMPLING = dict(temperature=0.7, seed=0)


def prompts(n: int) -> list[str]:
  """Prompts that keep a small model going (counting)."""
  return [
    f"Count: {10 * i + 1}, {10 * i + 2}, {10 * i + 3}, {10 * i + 4},"
    for i in range(n)
  ]


def _ids(model, text: str) -> list[int]:
  return [model.bos_id, *model.vocab.encode(text)]


def _generate(model, text: str, budget: int, sample_id: int):
  """`model.generate` on one prompt, prefill included: (tokens, seconds)."""
  start = time.perf_counter()
  prefix = model.prefill(cw.Chunk.from_lists([_ids(model, text)]))
  tokens, _ = model.generate(
    [prefix],
    sample_ids=[sample_id],
    steps=budget,
    sampling=cw.Sampling(**SAMPLING),
  )
  n = int(np.asarray(tokens.lengths)[0])
  out = np.asarray(tokens.tokens)[0, :n].tolist()
  return out, time.perf_counter() - start


def _requests(model, texts, budget: int) -> list[cw.Request]:
  return [
    cw.Request(
      tokens=_ids(model, t),
      sample_id=i,
      steps=budget,
      sampling=cw.Sampling(**SAMPLING),
    )
    for i, t in enumerate(texts)
  ]


def _many(model, requests, slots: int):
  """`generate_many`: (tokens per request, seconds)."""
  start = time.perf_counter()
  out = {
    r.index: r.tokens.tolist()
    for r in model.generate_many(requests, slots=slots)
  }
  return [out[i] for i in range(len(requests))], time.perf_counter() - start


async def _at_once(stream, server, texts, budget):
  return await asyncio.gather(
    *(stream(server, t, budget, i) for i, t in enumerate(texts))
  )


def measure(
  model,
  *,
  start,
  stream,
  slots: int,
  budget: int = 64,
  concurrency=(1, 4, 16),
  runs: int = 3,
  startup: bool = True,
) -> dict:
  """Every figure of the module docstring (a JSON-able dict)."""
  report = {"slots": slots, "budget": budget, "runs": runs}
  cache = tempfile.mkdtemp(prefix="chunkwise-compilation-cache-")
  if startup:
    began = time.perf_counter()
    start(cache).stop()
    report["startup_cold_s"] = time.perf_counter() - began
  texts = prompts(max(concurrency))
  starts, firsts, tenths = [], [], []
  for k in range(runs):  # each start: its first ten requests, one by one
    began = time.perf_counter()
    server = start(cache)
    starts.append(time.perf_counter() - began)
    ten = [
      asyncio.run(stream(server, texts[0], budget, 100 + j)) for j in range(10)
    ]
    firsts.append(ten[0]["times"][0] - ten[0]["submitted"])
    tenths.append(ten[9]["times"][0] - ten[9]["submitted"])
    if k < runs - 1:
      server.stop()
  key = "startup_cached_s" if startup else "startup_s"
  report[key] = statistics.median(starts)
  report["ttft_first_s"] = statistics.median(firsts)
  report["ttft_tenth_s"] = statistics.median(tenths)
  try:
    report["lone"] = _lone(model, server, stream, texts[0], budget, runs)
    report["concurrent"] = [
      _concurrent(model, server, stream, texts[:c], budget, slots, runs)
      for c in concurrency
    ]
  finally:
    server.stop()
  return report


def _lone(model, server, stream, text, budget, runs) -> dict:
  _generate(model, text, budget, 0)  # compiled, not timed
  library, served, same = [], [], True
  for _ in range(runs):
    tokens, seconds = _generate(model, text, budget, 0)
    library.append(len(tokens) / seconds)
    r = asyncio.run(stream(server, text, budget, 0))
    served.append(len(r["ids"]) / (r["ended"] - r["submitted"]))
    same &= r["ids"] == tokens and r["error"] is None
  return {
    "generate_tokens_per_s": statistics.median(library),
    "server_tokens_per_s": statistics.median(served),
    "ratio": statistics.median(
      s / g for s, g in zip(served, library, strict=True)
    ),
    "same_tokens": same,
  }


def _concurrent(model, server, stream, texts, budget, slots, runs) -> dict:
  requests = _requests(model, texts, budget)
  want, _ = _many(model, requests, slots)  # compiled, not timed
  library, served = [], []
  for _ in range(runs):
    got, seconds = _many(model, requests, slots)
    library.append(sum(map(len, got)) / seconds)
    results = asyncio.run(_at_once(stream, server, texts, budget))
    served.append(load.summary(results, texts, want))
  summary = load.median_of(served)
  return {
    "requests": len(texts),
    "generate_many_tokens_per_s": statistics.median(library),
    "server_tokens_per_s": summary["tokens_per_s"],
    "ratio": summary["tokens_per_s"] / statistics.median(library),
    "itl_p50_s": summary["itl_s"]["p50"],
    "itl_p99_s": summary["itl_s"]["p99"],
    "mismatched": summary["mismatched"],
    "errors": summary["errors"],
  }


def table(report: dict) -> str:
  """The report as the markdown of docs/performance.md#serving."""
  rows = ["| what | server | library | ratio |", "|---|---|---|---|"]
  if "startup_cold_s" in report:
    rows.append(
      f"| ready after start-up, cold / cached compilation cache | "
      f"{report['startup_cold_s']:.1f} s / "
      f"{report['startup_cached_s']:.1f} s | | |"
    )
  rows.append(
    f"| time to first token, first request after ready / tenth | "
    f"{report['ttft_first_s'] * 1000:.0f} ms / "
    f"{report['ttft_tenth_s'] * 1000:.0f} ms | | "
    f"{report['ttft_first_s'] / report['ttft_tenth_s']:.2f}x |"
  )
  lone = report["lone"]
  rows.append(
    f"| a lone request, tok/s (`model.generate`) | "
    f"{lone['server_tokens_per_s']:.1f} | "
    f"{lone['generate_tokens_per_s']:.1f} | {lone['ratio']:.2f}x |"
  )
  for c in report["concurrent"]:
    rows.append(
      f"| {c['requests']} at once, aggregate tok/s (`generate_many`); "
      f"inter-token p50 / p99 "
      f"{c['itl_p50_s'] * 1000:.0f} / {c['itl_p99_s'] * 1000:.0f} ms | "
      f"{c['server_tokens_per_s']:.1f} | "
      f"{c['generate_many_tokens_per_s']:.1f} | {c['ratio']:.2f}x |"
    )
  return "\n".join(rows)
