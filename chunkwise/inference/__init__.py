"""Chunks, results, KV caches, attention, sampling, vocabularies and the
`InferenceModel` that prefills and generates."""

from chunkwise.inference.attention import attend
from chunkwise.inference.batching.continuous import (
  Request,
  RequestResult,
  slot_capacity,
)
from chunkwise.inference.batching.live import LiveSlots
from chunkwise.inference.batching.live_requests import Prepared, SlotUpdate
from chunkwise.inference.batching.slot_requests import prompt_bucket
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.infer import InferFn, transformer_infer
from chunkwise.inference.kv_cache import KVCache
from chunkwise.inference.model import InferenceModel
from chunkwise.inference.results import (
  ChunkResult,
  FullChunkResult,
  concat_results,
)
from chunkwise.inference.sampling import Sampling
from chunkwise.inference.speculation import Speculation, SpeculationStats
from chunkwise.inference.vocabularies import (
  ByteVocabulary,
  Vocabulary,
  bos_id_of,
  eos_id_of,
  eos_ids_of,
  random_model_vocab,
)

__all__ = [
  "ByteVocabulary",
  "Chunk",
  "ChunkResult",
  "FullChunkResult",
  "InferFn",
  "InferenceModel",
  "KVCache",
  "LiveSlots",
  "Prepared",
  "Request",
  "RequestResult",
  "Sampling",
  "SlotUpdate",
  "Speculation",
  "SpeculationStats",
  "Vocabulary",
  "attend",
  "bos_id_of",
  "concat_results",
  "eos_id_of",
  "eos_ids_of",
  "prompt_bucket",
  "random_model_vocab",
  "slot_capacity",
  "transformer_infer",
]
