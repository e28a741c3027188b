"""Prefill on one device: run a chunk after its prefixes and score every token.

  result = prefill(infer, weights, caches, prev_logits, chunk, top_n=5,
                   bos_id=0)

`caches` are the prefixes' KV caches in order and `prev_logits` the last
prefix's `next_token_logits` (None for a first chunk). Every engine
compiles this one function: the reference engine as it is, the sharded
engine under `shard_map` with the device's `LogitsShards`. The public entry
point is `InferenceModel.prefill`, which validates first.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from chunkwise.inference.chunk import Chunk
from chunkwise.inference.infer import InferFn
from chunkwise.inference.kv_cache import KVCache
from chunkwise.inference.logits import LogitsShards
from chunkwise.inference.results import ChunkResult


def prefill(
  infer: InferFn,
  weights,
  caches: Sequence[KVCache],
  prev_logits: jax.Array | None,
  chunk: Chunk,
  *,
  top_n: int,
  bos_id: int,
  shards: LogitsShards | None = None,
  prev_split: bool = True,
  scores: bool = True,
) -> ChunkResult:
  """Forward pass over `chunk`, then scores, top-n and next-token logits.

  Under `shard_map`, `shards` says how this device's logits are cut and
  `prev_split` whether `prev_logits` is cut like them (see
  `FullChunkResult.to_chunk_result`); without `scores` only the
  next-token logits are computed (the scores are NaN)."""
  full = infer(weights, tuple(caches), chunk)
  return full.to_chunk_result(
    prev_logits,
    chunk,
    top_n=top_n,
    bos_id=bos_id,
    shards=shards,
    prev_split=prev_split,
    scores=scores,
  )
