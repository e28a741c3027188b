"""The load test's arithmetic (`scripts/load_test.py`): each response's
timings summed up per rate, runs reduced to medians, the report's table.

  s = summary(results, work, want)   # one run: tok/s, TTFT, ITL, e2e, checks
  m = median_of([s1, s2, s3])        # medians of the rates, sums of errors
  print(table(report))

A result is one request's record: `submitted` / `ended` times, the
`times` its tokens arrived, their `ids`, `error`, and the final event's
`details`; `want[k]` are request k's tokens from `generate_many`.
"""

from __future__ import annotations

import itertools
import statistics

import numpy as np


def percentiles(values) -> dict:
  if not len(values):
    return {"p50": None, "p90": None, "p99": None}
  v = np.asarray(values, np.float64)
  return {f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}


def summary(results, work, want) -> dict:
  tokens = sum(len(r["times"]) for r in results)
  first = min(r["submitted"] for r in results)
  last = max(r.get("ended", r["submitted"]) for r in results)
  ok = [r for r in results if r["error"] is None]
  lost = sum(1 for r in ok if "details" not in r)
  truncated = sum(
    1
    for r in ok
    if "details" in r and r["details"]["generated_tokens"] != len(r["times"])
  )
  mismatched = sum(
    1
    for k, r in enumerate(results)
    if r["error"] is None and r["ids"] != want[k]
  )
  gaps = [b - a for r in ok for a, b in itertools.pairwise(r["times"])]
  return {
    "requests": len(results),
    "tokens": tokens,
    "seconds": last - first,
    "tokens_per_s": tokens / (last - first),
    "requests_per_s": len(results) / (last - first),
    "ttft_s": percentiles(
      [r["times"][0] - r["submitted"] for r in ok if r["times"]]
    ),
    "itl_s": percentiles(gaps),
    "e2e_s": percentiles([r["ended"] - r["submitted"] for r in ok]),
    "errors": len(results) - len(ok),
    "lost": lost,
    "truncated": truncated,
    "mismatched": mismatched,
  }


def median_of(runs: list[dict]) -> dict:
  out = dict(runs[0])
  for key in ("tokens_per_s", "requests_per_s", "seconds"):
    out[key] = statistics.median(r[key] for r in runs)
  for key in ("ttft_s", "itl_s", "e2e_s"):
    out[key] = {
      q: statistics.median(r[key][q] for r in runs) for q in runs[0][key]
    }
  for key in ("errors", "lost", "truncated", "mismatched"):
    out[key] = sum(r[key] for r in runs)
  out["runs"] = len(runs)
  return out


def cache_delta(before, after) -> dict | None:
  if after is None:
    return None
  return {k: after[k] - before.get(k, 0.0) for k in after}


def table(report: dict) -> str:
  rows = [
    "| prefix cache | rate | tok/s | vs generate_many | "
    "TTFT p50 / p90 / p99 (s) | inter-token p50 / p90 / p99 (s) | "
    "e2e p50 / p99 (s) | cache hits / misses | errors | lost | "
    "truncated | mismatched |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  base = report["generate_many"]["tokens_per_s"]
  for r in report["rates"]:
    f = lambda d, qs: " / ".join(f"{d[q]:.3f}" for q in qs)
    mb = r.get("prefix_cache_mb", 0)
    c = r.get("prefix_cache")
    cache = (
      "-"
      if c is None
      else (f"{c['hit_requests']:.0f} / {c['miss_requests']:.0f}")
    )
    rows.append(
      f"| {f'{mb} MiB' if mb else 'off'} | {r['rate']} | "
      f"{r['tokens_per_s']:.1f} | "
      f"{r['tokens_per_s'] / base:.2f}x | "
      f"{f(r['ttft_s'], ('p50', 'p90', 'p99'))} | "
      f"{f(r['itl_s'], ('p50', 'p90', 'p99'))} | "
      f"{f(r['e2e_s'], ('p50', 'p99'))} | {cache} | "
      f"{r['errors']} | {r['lost']} | "
      f"{r['truncated']} | {r['mismatched']} |"
    )
  return "\n".join(rows)
