"""Logical axis names: the vocabulary shared by pytree `axes()` and layouts.

Every pytree type (weights, chunks, results, caches) declares once, in a
classmethod `axes()`, which logical axis each dimension of each leaf has. A
layout maps these names to the mesh axes `x`, `y`, `z`; nothing else names
mesh axes. Weights and activations use distinct names because layouts shard
them differently (2D weight-stationary keeps weights' `embed` on x but the
residual stream's embed on x·y).

  from jax.sharding import PartitionSpec as P
  P(EMBED, HEADS, HEAD_DIM)             # one layer's query projection
"""

LAYERS = "layers"  # the layer axis of stacked KV caches (never sharded)
# Weights (one array per layer: no layers axis).
VOCAB = "vocab"  # rows of the embedding table
EMBED = "embed"  # d_model of a weight
HEADS = "heads"  # query heads of a weight
KV_HEADS = "kv_heads"  # key/value heads of a weight
HEAD_DIM = "head_dim"  # width of one head
MLP = "mlp"  # d_ff of a weight
NORM = "norm"  # d_model of a norm scale
ADAPTERS = "adapters"  # stacked LoRA adapters (never sharded)
RANK = "rank"  # a LoRA adapter's rank (never sharded)

# Data crossing the jit boundary. Small per-row data (tokens, lengths,
# scores, top-n) is replicated; KV caches and logits are sharded.
BATCH = "batch"  # rows of a Chunk / ChunkResult / cache lengths
TIME = "time"  # columns of a Chunk / ChunkResult
TOP_N = "top_n"  # the n alternatives of top-n outputs
LOGITS_BATCH = "logits_batch"  # rows of next-token logits
LOGITS_VOCAB = "logits_vocab"  # vocabulary axis of next-token logits
CACHE_BATCH = "cache_batch"  # rows of a KV cache
CACHE_TIME = "cache_time"  # slots of a KV cache
CACHE_HEADS = "cache_heads"  # key/value heads of a KV cache

ALL = (
  LAYERS,
  VOCAB,
  EMBED,
  HEADS,
  KV_HEADS,
  HEAD_DIM,
  MLP,
  NORM,
  ADAPTERS,
  RANK,
  BATCH,
  TIME,
  TOP_N,
  LOGITS_BATCH,
  LOGITS_VOCAB,
  CACHE_BATCH,
  CACHE_TIME,
  CACHE_HEADS,
)
