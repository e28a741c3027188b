"""Decode attention over a paged K/V pool: the Pallas kernel against the
plain view, at a model's shapes.

  rows = compare(hparams, rows=16, contexts=[1024, 4096], runs=5)

One layer's attention of `rows` single-token queries to a pool whose rows
each hold `context` columns in scattered pages (`paged_kv.PAGE` columns
each), jitted: `view` gathers each row's pages and reads them as the
fixed slots' buffer is read (`attention._attend_piece`, the plain twin,
what runs on the CPU); `kernel` runs JAX's Pallas GPU paged-attention
kernel (`paged_attention.kernel_piece`; on a GPU only: elsewhere it would
run in Pallas' interpret mode). Reported per context: the median time of
each, their ratio, and the largest difference of the normalised outputs.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise.inference.paging.paged_kv import PAGE
from chunkwise.models import attention
from chunkwise.models import paged_attention as pa


def _layer(hparams, rows: int, context: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  per_row = -(-context // PAGE)
  pages = rows * per_row + 1
  shape = (hparams.kv_heads, pages, PAGE, hparams.head_dim)
  k, v = (jnp.asarray(rng.normal(size=shape), jnp.bfloat16) for _ in range(2))
  table = rng.permutation(pages)[: rows * per_row].reshape(rows, per_row)
  lengths = np.full(rows, context, np.int32)
  layer = pa.PagedLayer(k, v, jnp.asarray(table, jnp.int32), lengths)
  group = hparams.heads // hparams.kv_heads
  q = rng.normal(size=(rows, 1, hparams.kv_heads, group, hparams.head_dim))
  return jnp.asarray(q * hparams.head_dim**-0.5, jnp.float32), layer


@jax.jit
def _view(q, layer):
  view = layer.view()
  mask = jnp.arange(view.width)[None] < layer.lengths[:, None]
  _, s, o = attention._attend_piece(
    q[:, None],
    view.k,
    view.v,
    mask[:, None, None, None, None, :],
    heads_major=True,
  )
  return (o / s[..., None])[:, 0]


@jax.jit
def _kernel(q, layer):
  _, s, o = pa.kernel_piece(q, layer)
  return o / s[..., None]


def _time(fn, args, runs: int) -> float:
  jax.block_until_ready(fn(*args))  # compiles
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def compare(hparams, *, rows: int, contexts, runs: int) -> list[dict]:
  gpu = jax.default_backend() == "gpu"
  out = []
  for context in contexts:
    q, layer = _layer(hparams, rows, context)
    row = {
      "rows": rows,
      "context": context,
      "view_ms": 1e3 * _time(_view, (q, layer), runs),
    }
    if gpu:
      row["kernel_ms"] = 1e3 * _time(_kernel, (q, layer), runs)
      row["kernel_speedup"] = row["view_ms"] / row["kernel_ms"]
      diff = jnp.abs(_kernel(q, layer) - _view(q, layer))
      row["max_abs_diff"] = float(jnp.max(diff))
    out.append(row)
  return out


def lines(result: list[dict]) -> list[str]:
  head = (
    f"paged decode attention, one layer, {result[0]['rows']} rows, "
    f"pages of {PAGE} ({jax.default_backend()}, {jax.devices()[0].device_kind})"
  )
  out = [head, "context  view ms  kernel ms  view/kernel  max |diff|"]
  for r in result:
    if "kernel_ms" in r:
      out.append(
        f"{r['context']:7d}  {r['view_ms']:7.3f}  {r['kernel_ms']:9.3f}  "
        f"{r['kernel_speedup']:10.2f}x  {r['max_abs_diff']:.2e}"
      )
    else:
      out.append(f"{r['context']:7d}  {r['view_ms']:7.3f}  (no GPU)")
  return out
