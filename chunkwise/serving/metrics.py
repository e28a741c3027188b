"""The server's Prometheus metrics under TGI's and vLLM's names.

  metrics = Metrics(engine, model_id="smollm2-135m")
  metrics.finished(stream)          # the engine's on_finish
  metrics.failed("validation")      # a request refused before it ran
  text = metrics.exposition()       # GET /metrics

vLLM's names (`vllm:*`, label `model_name`) are prometheus_client
metrics; TGI's counters have no `_total` suffix, which prometheus_client's
Counter always adds, so they are written by a collector as untyped
samples of the exact names (`tgi_request_count`, ...). Gauges (queue,
running, slot use) are read from the engine when scraped.
"""

from __future__ import annotations

import collections
import threading

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
  CounterMetricFamily,
  GaugeMetricFamily,
  Metric,
)

from chunkwise.serving.engine import Engine
from chunkwise.serving.stream import CANCELLED, ERROR, TokenStream

prometheus_client.disable_created_metrics()

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_COMPILE = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30)
_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)


class Metrics:
  """Counters and histograms of one server (module docstring)."""

  def __init__(self, engine: Engine, *, model_id: str):
    self.engine = engine
    self.model_id = model_id
    self.registry = CollectorRegistry(auto_describe=True)
    self._lock = threading.Lock()
    self._tgi = collections.Counter()
    self._failures = collections.Counter()
    self._adapters = collections.Counter()
    r, label = self.registry, ["model_name"]

    def hist(name, doc, buckets, labels=label):
      return Histogram(name, doc, labels, buckets=buckets, registry=r)

    self.ttft = hist("vllm:time_to_first_token_seconds", "TTFT.", _LATENCY)
    self.itl = hist(
      "vllm:inter_token_latency_seconds", "Between two tokens.", _LATENCY
    )
    self.e2e = hist(
      "vllm:e2e_request_latency_seconds", "Request latency.", _LATENCY
    )
    self.compile = hist(
      "chunkwise:constraint_compile_seconds",
      "Compiling a constrained request's schema, regex or tools (before "
      "it is queued: not in its time to first token).",
      _COMPILE,
    )
    self.queue = hist(
      "vllm:request_queue_time_seconds", "Time before a slot.", _LATENCY
    )
    self.loop_lag = hist(
      "chunkwise:event_loop_lag_seconds",
      "How late the event loop ran a timer (`launch.watch_loop`): work "
      "on the loop, which only moves bytes, delays every client.",
      _LATENCY,
      [],
    )
    self.max_loop_lag = 0.0
    self.prompt_tokens = Counter(
      "vllm:prompt_tokens", "Prompt tokens.", label, registry=r
    )
    self.generation_tokens = Counter(
      "vllm:generation_tokens", "Generated tokens.", label, registry=r
    )
    self.success = Counter(
      "vllm:request_success",
      "Finished requests.",
      [*label, "finished_reason"],
      registry=r,
    )
    self.tgi_duration = hist("tgi_request_duration", "E2E.", _LATENCY, [])
    self.tgi_queue = hist("tgi_request_queue_duration", "Queue.", _LATENCY, [])
    self.tgi_inference = hist(
      "tgi_request_inference_duration", "Inference.", _LATENCY, []
    )
    self.tgi_per_token = hist(
      "tgi_request_mean_time_per_token_duration", "Per token.", _LATENCY, []
    )
    self.tgi_generated = hist(
      "tgi_request_generated_tokens", "Generated.", _TOKENS, []
    )
    self.tgi_input = hist("tgi_request_input_length", "Input.", _TOKENS, [])
    r.register(_Collector(self))

  def lagged(self, seconds: float) -> None:
    self.loop_lag.observe(seconds)
    self.max_loop_lag = max(self.max_loop_lag, seconds)

  def received(self) -> None:
    with self._lock:
      self._tgi["tgi_request_count"] += 1

  def failed(self, kind: str) -> None:
    """A request refused or failed (`kind`: validation, overloaded, ...)."""
    with self._lock:
      self._failures[kind] += 1

  def finished(self, s: TokenStream) -> None:
    """Records a stream that ended (the engine's `on_finish`)."""
    m = self.model_id
    g = s.generation
    with self._lock:
      self._adapters[g.adapter or ""] += 1
    if g.constraint is not None:  # compiled, whatever came after
      self.compile.labels(m).observe(s.compile_s)
    if s.finish_reason == ERROR:
      self.failed("generation")
      return
    if s.finish_reason == CANCELLED:
      self.failed("cancelled")
      return
    with self._lock:
      self._tgi["tgi_request_success"] += 1
    n = len(s.tokens)
    end = s.finished_at or s.submitted
    first = s.first_token_at or end
    self.prompt_tokens.labels(m).inc(s.prompt_tokens)
    self.generation_tokens.labels(m).inc(n)
    self.success.labels(m, s.finish_reason).inc()
    self.ttft.labels(m).observe(first - s.submitted)
    self.e2e.labels(m).observe(end - s.submitted)
    if s.admitted_at is not None:
      self.queue.labels(m).observe(s.admitted_at - s.submitted)
      self.tgi_queue.observe(s.admitted_at - s.submitted)
      self.tgi_inference.observe(end - s.admitted_at)
    for gap in s.gaps():
      self.itl.labels(m).observe(gap)
    self.tgi_duration.observe(end - s.submitted)
    if n > 1:
      self.tgi_per_token.observe((end - first) / (n - 1))
    self.tgi_generated.observe(n)
    self.tgi_input.observe(s.prompt_tokens)

  def exposition(self) -> bytes:
    return prometheus_client.generate_latest(self.registry)


class _Collector:
  """TGI's counters (exact names) and the gauges read at scrape time."""

  def __init__(self, metrics: Metrics):
    self.m = metrics

  def describe(self):
    return []

  def collect(self):
    m, engine = self.m, self.m.engine
    with m._lock:
      tgi = dict(m._tgi)
      failures = dict(m._failures)
      adapters = dict(m._adapters)
    for name in ("tgi_request_count", "tgi_request_success"):
      metric = Metric(name, name.replace("_", " "), "unknown")
      metric.add_sample(name, {}, float(tgi.get(name, 0)))
      yield metric
    metric = Metric("tgi_request_failure", "Failed requests", "unknown")
    for kind, count in sorted(failures.items()):
      metric.add_sample("tgi_request_failure", {"err": kind}, float(count))
    yield metric
    label = [m.model_id]
    gauges = (
      ("tgi_queue_size", "Waiting requests.", engine.waiting, None),
      ("tgi_batch_current_size", "Running requests.", engine.running, None),
      ("vllm:num_requests_running", "Running.", engine.running, label),
      ("vllm:num_requests_waiting", "Waiting.", engine.waiting, label),
      (
        "vllm:kv_cache_usage_perc",
        "Slots in use (fraction).",
        engine.running / engine.slots,
        label,
      ),
      ("chunkwise_slots", "Slots.", engine.slots, label),
    )
    for name, doc, value, labels in gauges:
      g = GaugeMetricFamily(
        name, doc, labels=["model_name"] if labels else None
      )
      if labels:
        g.add_metric(labels, value)
      else:
        g.add_metric([], value)
      yield g
    g = GaugeMetricFamily(
      "chunkwise_adapter_requests",
      "Requests per adapter so far ('' is the base model).",
      labels=["model_name", "adapter"],
    )
    for name, count in sorted(adapters.items()):
      g.add_metric([m.model_id, name], count)
    yield g
    g = GaugeMetricFamily(
      "vllm:lora_requests_info",
      "Adapters served.",
      labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    served = ",".join(engine.model.adapters)
    g.add_metric([served, "", str(len(engine.model.adapters))], 1.0)
    yield g
    yield GaugeMetricFamily(
      "chunkwise:event_loop_lag_max_seconds",
      "The latest the event loop ever ran a timer.",
      value=m.max_loop_lag,
    )
    if engine.speculation is not None:
      yield from _speculation(m.model_id, engine.speculation_totals)
    stats = engine.prefix_cache_stats
    if stats is not None:
      yield from _prefix_cache(m.model_id, stats, engine.prefix_cache_compiling)
    pages = engine.kv_pages_stats
    if pages is not None:
      yield from _kv_pages(m.model_id, *pages)


def _kv_pages(model_id: str, held: int, total: int, preempted: int):
  """vLLM's K/V cache use (a fraction, as vLLM v1 reports it) and
  preemptions, and the pool's pages."""
  label = ["model_name"]
  for name, doc, value in (
    (
      "vllm:kv_cache_usage_perc",
      "Share of K/V pages held (0-1).",
      held / total,
    ),
    ("chunkwise_kv_pages_held", "K/V pages held by requests.", held),
    ("chunkwise_kv_pages", "K/V pages in the pool.", total),
  ):
    g = GaugeMetricFamily(name, doc, labels=label)
    g.add_metric([model_id], float(value))
    yield g
  c = CounterMetricFamily(
    "vllm:num_preemptions",
    "Requests preempted (run again later).",
    labels=label,
  )
  c.add_metric([model_id], float(preempted))
  yield c


def _speculation(model_id: str, totals):
  """vLLM's speculative decoding counters (`acceptance_metrics.md`): mean
  acceptance length = 1 + accepted / drafts, acceptance rate = accepted /
  draft tokens."""
  for name, doc, value in (
    ("vllm:spec_decode_num_drafts", "Drafts verified.", totals.drafts),
    (
      "vllm:spec_decode_num_draft_tokens",
      "Draft tokens verified.",
      totals.draft_tokens,
    ),
    (
      "vllm:spec_decode_num_accepted_tokens",
      "Draft tokens accepted.",
      totals.accepted_tokens,
    ),
  ):
    c = CounterMetricFamily(name, doc, labels=["model_name"])
    c.add_metric([model_id], float(value))
    yield c


def _prefix_cache(model_id: str, stats, compiling: int = 0):
  """vLLM's prefix cache counters (prompt tokens looked up and found), the
  requests that found some or none, what the cache holds, and the prefills
  after a cached start compiling in the background."""
  label = ["model_name"]
  for name, doc, value in (
    ("vllm:prefix_cache_queries", "Prompt tokens looked up.", stats.queries),
    ("vllm:prefix_cache_hits", "Prompt tokens found cached.", stats.hits),
    (
      "chunkwise_prefix_cache_evictions",
      "Cached pages evicted.",
      stats.evicted,
    ),
  ):
    c = CounterMetricFamily(name, doc, labels=label)
    c.add_metric([model_id], float(value))
    yield c
  c = CounterMetricFamily(
    "chunkwise_prefix_cache_requests",
    "Requests that found a cached start (hit) or none (miss).",
    labels=["model_name", "result"],
  )
  c.add_metric([model_id, "hit"], float(stats.hit_requests))
  c.add_metric([model_id, "miss"], float(stats.miss_requests))
  yield c
  for name, doc, value in (
    ("chunkwise_prefix_cache_pages", "Pages cached.", stats.pages),
    ("chunkwise_prefix_cache_bytes", "K/V bytes cached.", stats.bytes),
    (
      "chunkwise_prefix_cache_compiling",
      "Prefill programs after a cached start of a new width compiling in "
      "the background; hits of those widths are served as misses meanwhile.",
      compiling,
    ),
  ):
    g = GaugeMetricFamily(name, doc, labels=label)
    g.add_metric([model_id], float(value))
    yield g
