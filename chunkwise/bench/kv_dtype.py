"""Decode speed and K/V bytes by K/V dtype, side by side in one run.

  rows = compare(model, rows=16, contexts=[4096], steps=16, runs=3)

For each context, `rows` rows after a prefix holding `context` tokens of
K/V each, and a greedy `generate` of `steps` tokens after it, with the
model's weights and float32 K/V against int8 K/V (`kv_dtype`, one model
each, sharing the weights). The prefix's keys and values are drawn at
random and stored in each dtype (what they hold does not change how long
a step takes; a prefill of 16 x 4096 tokens would take minutes on the
CPU). The two are timed alternately, the median of `runs` calls after a
compiling one. Reported per context: tokens/s of each, their ratio, and
the bytes of the prefix's K/V.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise.inference import ChunkResult, InferenceModel, Sampling
from chunkwise.models import kv_int8

DTYPES = ("float32", "int8")


def _prefix(model, rows: int, context: int, seed: int) -> ChunkResult:
  h = model.hparams
  empty = ChunkResult.shapes(
    h, batch=rows, time=context, top_n=0, cache_dtype=model.cache_dtype
  )
  shape = (h.layers, rows, context, h.kv_heads, h.head_dim)

  @jax.jit
  def draw(key):
    k, v = jax.random.normal(key, (2, *shape), jnp.float32)
    return kv_int8.encode(k, model.cache_dtype), kv_int8.encode(
      v, model.cache_dtype
    )

  k, v = draw(jax.random.key(seed))
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), empty)
  cache = zeros.kv_cache.replace(
    k=k, v=v, lengths=jnp.full((rows,), context, jnp.int32)
  )
  return zeros.replace(kv_cache=cache)


def _decode(model, prefix, rows: int, steps: int) -> float:
  start = time.perf_counter()
  tokens, _ = model.generate(
    [prefix],
    sample_ids=np.arange(rows),
    steps=steps,
    sampling=Sampling(temperature=0.0),
  )
  jax.block_until_ready(tokens.tokens)
  return time.perf_counter() - start


def compare(
  model: InferenceModel,
  *,
  rows: int,
  contexts,
  steps: int,
  runs: int,
  seed: int = 0,
) -> list[dict]:
  weights = model.plain_weights()
  models = {
    d: InferenceModel(
      model.hparams,
      weights,
      model.vocab,
      kv_dtype=d,
      mesh=model.mesh,
      prefill_layout=model.prefill_layout,
      generate_layout=model.generate_layout,
      numerics=model.numerics,
      precision=model.precision,
      compute_dtype=model.compute_dtype,
    )
    for d in DTYPES
  }
  out = []
  for context in contexts:
    prefixes = {d: _prefix(m, rows, context, seed) for d, m in models.items()}
    times = {d: [] for d in DTYPES}
    for d in DTYPES:  # compiles
      _decode(models[d], prefixes[d], rows, steps)
    for _ in range(runs):
      for d in DTYPES:
        times[d].append(_decode(models[d], prefixes[d], rows, steps))
    row = {
      "rows": rows,
      "context": context,
      "steps": steps,
      "numerics": model.numerics,
    }
    for d in DTYPES:
      cache = prefixes[d].kv_cache
      row[f"{d}_tokens_per_s"] = rows * steps / statistics.median(times[d])
      row[f"{d}_kv_bytes"] = int(cache.k.nbytes + cache.v.nbytes)
    row["int8_speed_ratio"] = (
      row["int8_tokens_per_s"] / row["float32_tokens_per_s"]
    )
    row["int8_bytes_ratio"] = row["int8_kv_bytes"] / row["float32_kv_bytes"]
    out.append(row)
    del prefixes
  return out


def lines(result: list[dict]) -> list[str]:
  first = result[0]
  out = [
    f"decode by K/V dtype, {first['rows']} rows, {first['steps']} greedy "
    f"steps after the context ({first['numerics']} numerics)",
    "context  f32 tok/s  int8 tok/s  int8/f32  f32 K/V MB  int8 K/V MB",
  ]
  for r in result:
    out.append(
      f"{r['context']:7d}  {r['float32_tokens_per_s']:9.1f}  "
      f"{r['int8_tokens_per_s']:10.1f}  {r['int8_speed_ratio']:7.2f}x  "
      f"{r['float32_kv_bytes'] / 2**20:10.1f}  "
      f"{r['int8_kv_bytes'] / 2**20:11.1f}"
    )
  return out
