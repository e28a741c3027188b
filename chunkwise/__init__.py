"""chunkwise: sharded, incremental Transformer inference in JAX.

  import chunkwise as cw
  model = cw.load("smollm2-135m")   # or cw.InferenceModel.random(...)
  prompt = model.prefill(cw.Chunk.tokenize(model.vocab, ["Cows have"],
                                           is_first_chunk=True))
  tokens, result = model.generate([prompt], sample_ids=[0, 1], steps=8,
                                  sampling=cw.Sampling(temperature=0.7))
  print(tokens.detokenize(model.vocab), result.per_token_scores)

See DESIGN.md (the contract) for the semantics every name below keeps.
"""

from chunkwise import (
  checkpoints,
  configs,
  constraints,
  models,
  partitioning,
  planner,
  processors,
)
from chunkwise.checkpoints import (
  TokenizerVocabulary,
  load,
  load_adapter,
  load_result,
  save,
)
from chunkwise.configs import HParams
from chunkwise.inference import (
  ByteVocabulary,
  Chunk,
  ChunkResult,
  InferenceModel,
  KVCache,
  Request,
  RequestResult,
  Sampling,
  Speculation,
  SpeculationStats,
  Vocabulary,
  concat_results,
)
from chunkwise.partitioning import AttnBatch, Collectives, Layout, LayoutKind

__all__ = [
  "AttnBatch",
  "ByteVocabulary",
  "Chunk",
  "ChunkResult",
  "Collectives",
  "HParams",
  "InferenceModel",
  "KVCache",
  "Layout",
  "LayoutKind",
  "Request",
  "RequestResult",
  "Sampling",
  "Speculation",
  "SpeculationStats",
  "TokenizerVocabulary",
  "Vocabulary",
  "checkpoints",
  "concat_results",
  "configs",
  "constraints",
  "load",
  "load_adapter",
  "load_result",
  "models",
  "partitioning",
  "planner",
  "processors",
  "save",
]

__version__ = "0.1.0"
