"""Real checkpoints: GGUF and Hugging Face import, tokenizers, sandboxed
chat templates, `load`, chunkwise's own Orbax checkpoints of models and
results (`save`, `load_result`), and PEFT LoRA adapters (`load_adapter`).
Every file read here is untrusted (see `chunkwise.untrusted` and the
docs/security.md)."""

from chunkwise.checkpoints import (
  adapters,
  chat_template,
  gguf,
  gguf_file,
  hf,
  hf_config,
  hf_tensors,
  safetensors,
  store,
)
from chunkwise.checkpoints.adapters import load_adapter
from chunkwise.checkpoints.chat_template import ChatTemplate, ChatTemplateError
from chunkwise.checkpoints.hf_tensors import Imported
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
  "ChatTemplate",
  "ChatTemplateError",
  "Description",
  "Imported",
  "TokenizerVocabulary",
  "adapters",
  "chat_template",
  "describe",
  "describe_random",
  "embedded_path",
  "gguf",
  "gguf_file",
  "hf",
  "hf_config",
  "hf_tensors",
  "load",
  "load_adapter",
  "load_result",
  "safetensors",
  "save",
  "store",
]
