"""Prefill: run a chunk after its prefixes and score every token.

  result = prefill(infer, weights, caches, prev_logits, chunk, top_n=5,
                   bos_id=0)

`caches` are the prefixes' KV caches in order and `prev_logits` the last
prefix's `next_token_logits` (None for a first chunk). The public entry point
is `InferenceModel.prefill`, which validates and compiles this function.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from chunkwise.inference.chunk import Chunk
from chunkwise.inference.forward import InferFn
from chunkwise.inference.kv_cache import KVCache
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
) -> ChunkResult:
  """Forward pass over `chunk`, then scores, top-n and next-token logits."""
  full = infer(weights, tuple(caches), chunk)
  return full.to_chunk_result(prev_logits, chunk, top_n=top_n, bos_id=bos_id)
