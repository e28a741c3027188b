"""Serving: the always-on engine and its HTTP faces.

  engine = chunkwise.serving.Engine(model, slots=16)
  for token in engine.submit(Generation(prompt=ids, max_new_tokens=32)):
    print(token.text, end="")

`engine` runs continuous batching for requests that arrive at any time
and streams their tokens; `http` serves it to TGI / LoRAX and OpenAI
clients (`scripts/serve.py`).
"""

from chunkwise.serving.api import ApiError, Context
from chunkwise.serving.engine import (
  DEFAULT_BUSY_EVERY,
  DEFAULT_EVERY,
  DEFAULT_PREFIX_CACHE_BYTES,
  Engine,
)
from chunkwise.serving.http import Server
from chunkwise.serving.launch import Background, serve
from chunkwise.serving.stream import (
  Closed,
  Generation,
  GenerationFailed,
  Overloaded,
  Token,
  TokenStream,
)

__all__ = [
  "DEFAULT_BUSY_EVERY",
  "DEFAULT_EVERY",
  "DEFAULT_PREFIX_CACHE_BYTES",
  "ApiError",
  "Background",
  "Closed",
  "Context",
  "Engine",
  "Generation",
  "GenerationFailed",
  "Overloaded",
  "Server",
  "Token",
  "TokenStream",
  "serve",
]
