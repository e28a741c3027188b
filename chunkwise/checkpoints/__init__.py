"""Real checkpoints: GGUF and Hugging Face import, tokenizers, `load`, and
chunkwise's own Orbax checkpoints of models and results (`save`,
`load_result`)."""

from chunkwise.checkpoints import gguf, hf, llama, safetensors, store
from chunkwise.checkpoints.llama import Imported
from chunkwise.checkpoints.load import (
  EMBEDDED,
  RANDOM,
  Description,
  describe,
  describe_random,
  embedded_path,
  load,
)
from chunkwise.checkpoints.store import load_result, save
from chunkwise.checkpoints.tokenizer import TokenizerVocabulary

__all__ = [
  "EMBEDDED",
  "RANDOM",
  "Description",
  "Imported",
  "TokenizerVocabulary",
  "describe",
  "describe_random",
  "embedded_path",
  "gguf",
  "hf",
  "llama",
  "load",
  "load_result",
  "safetensors",
  "save",
  "store",
]
