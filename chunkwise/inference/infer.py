"""The forward pass over one chunk with prefix caches: the `InferFn`.

An `InferFn` maps (weights, prefix caches, chunk) to a `FullChunkResult`;
prefill and the generate loop are written against this protocol only, so a
hand-computable toy model can drive them in tests (see tests/toy_models.py).

  infer = functools.partial(transformer_infer, hparams)
  full = infer(weights, (prefix_cache,), chunk)   # FullChunkResult

`transformer_infer` runs on one device; `sharded_infer` is the same pass
on one device of a mesh, under the sharded engine's `shard_map`.

Each row's tokens sit at absolute positions `prefix length + t` (RoPE), where
the prefix length sums that row's ancestors in every prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from chunkwise.configs import HParams
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.kv_cache import KVCache, LayerKV, total_lengths
from chunkwise.inference.results import FullChunkResult
from chunkwise.models import Weights, kv_int8, sharded_forward
from chunkwise.models import shard_ops as ops
from chunkwise.models.attention import PrefixLayer, attend
from chunkwise.models.transformer import forward_hidden
from chunkwise.partitioning import Plan

# infer(weights, prefix caches, chunk) -> FullChunkResult
InferFn = Callable[[Any, Sequence[KVCache], Chunk], FullChunkResult]


def positions_of(prefix: Sequence[KVCache], chunk: Chunk) -> jax.Array:
  """int32[batch, time]: absolute position of every token of `chunk`."""
  start = total_lengths([c.lengths for c in prefix], chunk.batch)
  return start[:, None] + jnp.arange(chunk.time, dtype=jnp.int32)[None, :]


def layer_pieces(
  prefix: Sequence[KVCache | LayerKV], layers: int
) -> list[list[PrefixLayer]]:
  """Per layer, what attention reads of each prefix cache (a `KVCache`'s
  layer slice, or a `LayerKV` buffer's own array)."""
  return [[c.layer(i) for c in prefix] for i in range(layers)]


def transformer_infer(
  hparams: HParams,
  weights,
  prefix: Sequence[KVCache],
  chunk: Chunk,
  *,
  cache_dtype=jnp.float32,
  compute_dtype=jnp.float32,
) -> FullChunkResult:
  """Runs the Transformer over `chunk`, attending to `prefix` caches."""
  prefix = tuple(prefix)
  with kv_int8.storing(cache_dtype):
    x, (k, v), head = forward_hidden(
      hparams,
      weights,
      chunk.tokens,
      positions_of(prefix, chunk),
      attend,
      layer_pieces(prefix, hparams.layers),
      dtype=compute_dtype,
    )
  cache = KVCache(
    k=kv_int8.encode(k, cache_dtype),
    v=kv_int8.encode(v, cache_dtype),
    lengths=chunk.lengths,
  )
  return FullChunkResult(hidden=x, head=head, kv_cache=cache)


def sharded_infer(
  plan: Plan,
  hparams: HParams,
  weights: Weights,
  prefix: Sequence[KVCache],
  chunk: Chunk,
  *,
  cache_dtype,
  compute_dtype,
) -> FullChunkResult:
  """The forward pass on one device (an `InferFn` under `shard_map`).

  `chunk` and every cache's `lengths` are replicated; a prefix cache's k/v
  hold this device's block of rows when its batch divides the attention
  shards, else every row (then each device reads the one row its block
  needs). Caches past `plan.prefix_batches` (the generate loop's buffer)
  have the call's batch.
  """
  prefix = tuple(prefix)
  positions = positions_of(prefix, chunk)
  extra = len(prefix) - len(plan.prefix_batches)
  batches = (*plan.prefix_batches, *([plan.batch] * extra))
  n, i = plan.size(plan.attn_batch), ops.index(plan.attn_batch)
  local = []
  for cache, b in zip(prefix, batches, strict=True):
    cache = cache.replace(lengths=ops.local_rows(cache.lengths, n, i))
    if b % n:  # replicated rows: keep the one this block reads
      axis = 0 if isinstance(cache, LayerKV) else 1  # rows
      rows = lambda a, axis=axis: ops.local_rows(a, n, i, axis=axis)
      cache = cache.replace(
        k=jax.tree.map(rows, cache.k), v=jax.tree.map(rows, cache.v)
      )
    local.append(cache)
  with kv_int8.storing(cache_dtype):
    x, (k, v), head = sharded_forward.forward_hidden(
      plan,
      hparams,
      weights,
      chunk.tokens,
      positions,
      layer_pieces(local, hparams.layers),
      compute_dtype,
    )
  cache = KVCache(
    k=kv_int8.encode(k, cache_dtype),
    v=kv_int8.encode(v, cache_dtype),
    lengths=chunk.lengths,
  )
  return FullChunkResult(hidden=x, head=head, kv_cache=cache)
