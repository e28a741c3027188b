"""Real checkpoints: GGUF and Hugging Face import, tokenizers, `load`."""

from chunkwise.checkpoints import gguf, hf, llama, safetensors
from chunkwise.checkpoints.llama import Imported
from chunkwise.checkpoints.load import EMBEDDED, embedded_path, load
from chunkwise.checkpoints.tokenizer import TokenizerVocabulary

__all__ = [
  "EMBEDDED",
  "Imported",
  "TokenizerVocabulary",
  "embedded_path",
  "gguf",
  "hf",
  "llama",
  "load",
  "safetensors",
]
