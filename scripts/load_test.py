"""Load test of the server: Poisson arrivals through streaming HTTP clients.

  python scripts/load_test.py                      # SmolLM2, 16 slots
  python scripts/load_test.py --requests=64 --rates=1,0.5,0.25 --runs=2
  python scripts/load_test.py --soak_seconds=600 --disconnect_share=0.3
  python scripts/load_test.py --suite=speed        # the server's defaults

`--suite=speed` (chunkwise/bench/serving_speed.py) measures what a new
user of `scripts/serve.py` sees, with its defaults, each figure beside
the library doing the same work: start-up on a cold and on a filled
compilation cache, the first request's time to first token against the
tenth's, a lone request against `model.generate`, and --concurrency
requests at once against `generate_many`.

The default suite (`rates`):

Starts `scripts/serve.py` on a free loopback port and replays the
long-tailed workload of `benchmark.py --continuous` (80% of budgets 8-32
tokens, 20% of --long; sampled at temperature 0.7, one seed per request)
through `/generate_stream`, one aiohttp client per request:

  1. `generate_many` runs the same requests in this process (same slots),
     timed after a warm-up run: the throughput the server is held to;
  2. rate 1 means saturation: every request arrives at once; the requests
     per second it sustains set the other rates (0.5: Poisson arrivals at
     half of that), each run --runs times (the table shows medians);
  3. every response is checked: its final event (details) arrived, its
     token count matches, and its tokens equal `generate_many`'s.

Per rate: throughput (generated tokens / makespan), time to first token,
inter-token latency (between two events of one stream) and end-to-end
latency percentiles, errors, lost or truncated responses, mismatches.
--soak_seconds runs clients back to back for that long (bounded), a
--disconnect_share of them closing their stream early; at the end every
slot must be free again, and the server's RSS growth since the start of
the soak is reported. Loopback only; every run is bounded in requests
and time, then stops the server (SIGTERM) and checks it exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import numpy as np
from absl import app, flags

import chunkwise as cw
from chunkwise import jobs, serving
from chunkwise.bench import continuous as bench_continuous
from chunkwise.bench import load, serving_speed
from chunkwise.cpu_kernels.isa import cpu_name
from chunkwise.inference import slot_capacity
from chunkwise.models.kv_int8 import DTYPES as KV_DTYPES

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.serving_helpers import ROOT, Server

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model to serve.")
_SLOTS = flags.DEFINE_integer("slots", 16, "Slots of the server.")
_REQUESTS = flags.DEFINE_integer("requests", 64, "Requests per rate run.")
_LONG = flags.DEFINE_integer("long", 128, "Budget of the long 20%.")
_RATES = flags.DEFINE_list(
  "rates", ["1", "0.5", "0.25"], "Arrival rates as fractions of saturation."
)
_RUNS = flags.DEFINE_integer("runs", 1, "Runs per rate (medians shown).")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")
_PROMPT = flags.DEFINE_string(
  "prompt",
  "The following are short answers to tasks.",
  "Text every request starts with (then ' Task i:').",
)
_SYSTEM = flags.DEFINE_integer(
  "system_prompt_tokens",
  0,
  "Tokens of a system prompt (cut from scripts/data/eval_texts.jsonl) that "
  "every request starts with, before --prompt (0: none).",
  lower_bound=0,
)
_CACHE_MB = flags.DEFINE_list(
  "prefix_cache_mb",
  [str(serving.DEFAULT_PREFIX_CACHE_BYTES >> 20)],
  "--prefix_cache_mb of the server; several: one server each, side by "
  "side in the table (0: no prefix cache).",
)
_EVERY = flags.DEFINE_integer("every", None, "--every of the server.")
_BUSY_EVERY = flags.DEFINE_integer(
  "busy_every", None, "--busy_every of the server."
)
_SOAK = flags.DEFINE_integer(
  "soak_seconds", 0, "Also soak the server this long (0: no soak)."
)
_SOAK_CLIENTS = flags.DEFINE_integer(
  "soak_clients", 24, "Concurrent clients of the soak."
)
_DISCONNECT = flags.DEFINE_float(
  "disconnect_share", 0.3, "Share of soak clients that leave mid-stream."
)
_TIMEOUT = flags.DEFINE_integer(
  "timeout", 900, "Most seconds of one rate run before it is abandoned."
)
_KV_DTYPE = flags.DEFINE_enum(
  "kv_dtype",
  "float32",
  list(KV_DTYPES),
  "How the server's K/V caches are stored (its --kv_dtype; generate_many "
  "runs with the same).",
)
_OUTPUT = flags.DEFINE_string("output", "load_test.json", "JSON results.")
_SUITE = flags.DEFINE_enum(
  "suite",
  "rates",
  ["rates", "speed"],
  "rates: Poisson arrival rates against generate_many (the module "
  "docstring); speed: the server's defaults against the library "
  "(start-up, first tokens, a lone request, --concurrency at once).",
)
_CONCURRENCY = flags.DEFINE_list(
  "concurrency", ["1", "4", "16"], "--suite=speed: requests at once."
)
_SPEED_TOKENS = flags.DEFINE_integer(
  "speed_tokens",
  64,
  "--suite=speed: tokens each request generates.",
  lower_bound=1,
)
_STARTUP = flags.DEFINE_bool(
  "startup",
  True,
  "--suite=speed: time a cold start-up (an empty compilation cache) "
  "before the cached one.",
)


def _system_prompt(model, tokens: int) -> str:
  """Text of about `tokens` tokens from the evaluation texts ('' for 0)."""
  if not tokens:
    return ""
  path = os.path.join(ROOT, "scripts", "data", "eval_texts.jsonl")
  with open(path) as f:
    text = " ".join(json.loads(line)["text"] for line in f)
  ids = model.vocab.encode(text)
  if len(ids) < tokens:
    raise app.UsageError(
      f"--system_prompt_tokens={tokens}: the texts have {len(ids)} tokens"
    )
  return model.vocab.decode(ids[:tokens]) + "\n"


def _workload(model):
  """(inputs text, token ids, budget, sample id) per request; one seed."""
  requests = bench_continuous.workload(
    model, _REQUESTS.value, long=_LONG.value, seed=_SEED.value
  )
  system = _system_prompt(model, _SYSTEM.value)
  out = []
  for i, r in enumerate(requests):
    text = system + _PROMPT.value + f" Task {i}:"
    ids = [model.bos_id, *model.vocab.encode(text)]
    out.append((text, ids, r.steps, r.sample_id))
  return out


def _requests(work):
  return [
    cw.Request(
      tokens=ids,
      sample_id=sample_id,
      steps=budget,
      sampling=cw.Sampling(temperature=0.7, seed=_SEED.value),
    )
    for _, ids, budget, sample_id in work
  ]


def _baseline(model, work, capacity, cache_mb):
  """generate_many on the same requests: (tokens per request, tokens/s)."""
  requests = _requests(work)
  kwargs = dict(
    slots=_SLOTS.value, capacity=capacity, prefix_cache_bytes=cache_mb << 20
  )
  list(model.generate_many(requests, **kwargs))
  start = time.perf_counter()
  results = list(model.generate_many(requests, **kwargs))
  seconds = time.perf_counter() - start
  tokens = {r.index: r.tokens.tolist() for r in results}
  return tokens, sum(map(len, tokens.values())) / seconds, seconds


async def _one(session, url, text, budget, sample_id, leave_after=None):
  """Streams one request; returns its measurements."""
  body = {
    "inputs": text,
    "parameters": {
      "max_new_tokens": budget,
      "do_sample": True,
      "temperature": 0.7,
      "seed": _SEED.value,
      "sample_id": sample_id,
    },
  }
  out = {
    "submitted": time.perf_counter(),
    "times": [],
    "ids": [],
    "error": None,
  }
  try:
    async with session.post(url + "/generate_stream", json=body) as r:
      if r.status != 200:
        out["error"] = f"{r.status}: {(await r.text())[:200]}"
        return out
      async for line in r.content:
        if not line.startswith(b"data:"):
          continue
        event = json.loads(line[5:])
        if "error" in event:
          out["error"] = event["error"]
          break
        out["times"].append(time.perf_counter())
        out["ids"].append(event["token"]["id"])
        if event.get("details"):
          out["details"] = event["details"]
          if event["details"]["finish_reason"] == "eos_token":
            out["ids"].pop()  # the stop token: not among generate's
        if leave_after is not None and len(out["times"]) >= leave_after:
          out["left"] = True
          break
  except Exception as e:  # a lost connection counts as an error
    out["error"] = f"{type(e).__name__}: {e}"
  out["ended"] = time.perf_counter()
  return out


async def _rate_run(url, work, rate, seed):
  import aiohttp

  rng = np.random.default_rng(seed)
  if rate is None:
    starts = np.zeros(len(work))
  else:
    starts = np.cumsum(rng.exponential(1.0 / rate, len(work)))
  timeout = aiohttp.ClientTimeout(total=_TIMEOUT.value)
  connector = aiohttp.TCPConnector(limit=0)
  async with aiohttp.ClientSession(timeout=timeout, connector=connector) as s:
    t0 = time.perf_counter()

    async def at(k):
      await asyncio.sleep(max(0.0, t0 + starts[k] - time.perf_counter()))
      text, _, budget, sample_id = work[k]
      return await _one(s, url, text, budget, sample_id)

    return await asyncio.wait_for(
      asyncio.gather(*(at(k) for k in range(len(work)))), _TIMEOUT.value
    )


def _rss_kib(pid: int) -> int:
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1])
  return 0


async def _soak(server, work, seconds):
  import aiohttp

  rng = np.random.default_rng(_SEED.value + 7)
  deadline = time.perf_counter() + seconds
  counts = {"done": 0, "left": 0, "errors": 0}
  timeout = aiohttp.ClientTimeout(total=_TIMEOUT.value)

  async def client(c):
    async with aiohttp.ClientSession(timeout=timeout) as s:
      k = c
      while time.perf_counter() < deadline:
        text, _, budget, sample_id = work[k % len(work)]
        leave = (
          int(rng.integers(1, 8)) if rng.random() < _DISCONNECT.value else None
        )
        r = await _one(
          s, server.url, text, budget, sample_id, leave_after=leave
        )
        key = "errors" if r["error"] else ("left" if r.get("left") else "done")
        counts[key] += 1
        k += _SOAK_CLIENTS.value

  await asyncio.gather(*(client(c) for c in range(_SOAK_CLIENTS.value)))
  return counts


def _cache_counts(server) -> dict | None:
  """The server's prefix cache counters from /metrics (None: no cache)."""
  _, text = server.get("/metrics")
  names = {
    "vllm:prefix_cache_queries_total": "queried_tokens",
    "vllm:prefix_cache_hits_total": "hit_tokens",
    'result="hit"': "hit_requests",
    'result="miss"': "miss_requests",
  }
  out = {}
  for line in text.decode().splitlines():
    for name, key in names.items():
      if not line.startswith("#") and name in line.split(" ")[0]:
        out[key] = float(line.rsplit(" ", 1)[1])
  return out or None


def _speed() -> None:
  """`--suite=speed` (chunkwise/bench/serving_speed.py)."""
  try:
    concurrency = [int(c) for c in _CONCURRENCY.value]
  except ValueError:
    raise app.UsageError(
      f"--concurrency={','.join(_CONCURRENCY.value)}: not integers"
    ) from None
  if _RUNS.value < 1 or min(concurrency) < 1:
    raise app.UsageError("--runs and --concurrency must be >= 1")
  model = jobs.load_served(
    jobs.ModelConfig(name=_MODEL.value, kv_dtype=_KV_DTYPE.value)
  )
  flags_ = [
    f"--model={_MODEL.value}",
    f"--slots={_SLOTS.value}",
    f"--kv_dtype={_KV_DTYPE.value}",
  ]

  def start(cache):
    return Server(*flags_, f"--compilation_cache={cache}", timeout=900)

  async def stream(server, text, budget, sample_id):
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=_TIMEOUT.value)
    async with aiohttp.ClientSession(timeout=timeout) as s:
      return await _one(s, server.url, text, budget, sample_id)

  report = serving_speed.measure(
    model,
    start=start,
    stream=stream,
    slots=_SLOTS.value,
    budget=_SPEED_TOKENS.value,
    concurrency=concurrency,
    runs=_RUNS.value,
    startup=_STARTUP.value,
  )
  report.update(model=_MODEL.value, server_flags=flags_, machine=cpu_name())
  with open(_OUTPUT.value, "w") as f:
    json.dump(report, f, indent=1)
  print(serving_speed.table(report))


def main(argv):
  del argv
  if _SUITE.value == "speed":
    return _speed()
  rates = []
  for r in _RATES.value:
    try:
      value = float(r)
    except ValueError:
      raise app.UsageError(f"--rates: {r!r} is not a number") from None
    if not 0 < value <= 1:
      raise app.UsageError(f"--rates: {r} must be in (0, 1]")
    rates.append(value)
  if 1.0 not in rates:  # the other rates are fractions of it
    rates.append(1.0)
  if _REQUESTS.value < 1 or _RUNS.value < 1 or _SLOTS.value < 1:
    raise app.UsageError("--requests, --runs and --slots must be >= 1")
  caches = []
  for mb in _CACHE_MB.value:
    if not mb.isdigit():
      raise app.UsageError(
        f"--prefix_cache_mb: {mb!r} is not a number of MiB (0: none)"
      )
    caches.append(int(mb))
  model = jobs.load_served(
    jobs.ModelConfig(name=_MODEL.value, kv_dtype=_KV_DTYPE.value)
  )
  work = _workload(model)
  capacity = max(slot_capacity(_requests(work)), 128)
  want_tokens, base_tps, base_s = _baseline(model, work, capacity, max(caches))
  want = [want_tokens[k] for k in range(len(work))]
  print(f"generate_many: {base_tps:.1f} tokens/s ({base_s:.1f} s)", flush=True)
  flags_ = [
    f"--model={_MODEL.value}",
    f"--slots={_SLOTS.value}",
    f"--max_total_tokens={capacity}",
    f"--max_queue={max(256, 2 * _REQUESTS.value)}",
    f"--kv_dtype={_KV_DTYPE.value}",
  ]
  if _EVERY.value:
    flags_.append(f"--every={_EVERY.value}")
  if _BUSY_EVERY.value:
    flags_.append(f"--busy_every={_BUSY_EVERY.value}")
  report = {
    "model": _MODEL.value,
    "slots": _SLOTS.value,
    "requests": _REQUESTS.value,
    "system_prompt_tokens": _SYSTEM.value,
    "kv_dtype": _KV_DTYPE.value,
    "server_flags": flags_,
    "generate_many": {
      "tokens_per_s": base_tps,
      "seconds": base_s,
      "prefix_cache_mb": max(caches),
    },
    "rates": [],
  }
  codes = []
  for n, mb in enumerate(caches):
    server = Server(*flags_, f"--prefix_cache_mb={mb}")
    try:
      _serve(server, report, work, want, rates, mb, n == len(caches) - 1)
    finally:
      codes.append(server.stop())
    if codes[-1] != 0:
      print(server.log()[-3000:], file=sys.stderr)
  report["server_exit_code"] = max(codes)
  with open(_OUTPUT.value, "w") as f:
    json.dump(report, f, indent=1)
  print(load.table(report))
  if max(codes) != 0:
    sys.exit(1)


def _serve(server, report, work, want, rates, mb, soak):
  """The rate runs (and, with `soak`, the soak) against one server."""
  # Warm-up (not timed): stores the prompts' pages; a hit of a new pair of
  # widths is served as a miss until its prefill compiles in the
  # background, so run it until none compiles any more.
  for _ in range(2):
    asyncio.run(_rate_run(server.url, work[: _SLOTS.value], None, 0))
    if _cache_counts(server) is not None:
      server.wait_for("chunkwise_prefix_cache_compiling", 0.0, timeout=300)
  saturation = None
  for fraction in sorted(rates, reverse=True):
    runs = []
    before = _cache_counts(server)
    for k in range(_RUNS.value):
      rate = None if fraction == 1 else fraction * saturation
      results = asyncio.run(
        _rate_run(server.url, work, rate, _SEED.value + 100 * k)
      )
      runs.append(load.summary(results, work, want))
    summary = load.median_of(runs)
    if fraction == 1:
      saturation = summary["requests_per_s"]
    summary["rate"] = (
      "saturation (all at once)"
      if fraction == 1
      else f"{fraction:g} x ({fraction * saturation:.2f} req/s)"
    )
    summary["prefix_cache_mb"] = mb
    summary["prefix_cache"] = load.cache_delta(before, _cache_counts(server))
    report["rates"].append(summary)
    print(json.dumps(summary), flush=True)
  if soak and _SOAK.value:
    start_rss = _rss_kib(server.proc.pid)
    counts = asyncio.run(_soak(server, work, _SOAK.value))
    server.wait_for("vllm:num_requests_running", 0.0, timeout=120)
    server.wait_for("vllm:num_requests_waiting", 0.0, timeout=120)
    end_rss = _rss_kib(server.proc.pid)
    report["soak"] = {
      "seconds": _SOAK.value,
      **counts,
      "rss_start_mib": start_rss / 1024,
      "rss_end_mib": end_rss / 1024,
      "rss_growth": end_rss / start_rss - 1,
      "slots_free_at_end": True,
    }
    print(json.dumps(report["soak"]), flush=True)


if __name__ == "__main__":
  app.run(main)
