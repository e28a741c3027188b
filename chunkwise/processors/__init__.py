"""Logits processors applied inside the generate loop (see `base`).

tokens, result = model.generate(
    [prompt], sample_ids=[0, 1], steps=32,
    processors=[cw.processors.penalties(presence=0.5),
                cw.processors.min_tokens(4)])
"""

from chunkwise.processors.base import (
  LogitsProcessor,
  StepInfo,
  as_tuple,
  check,
  keep_rows,
  request_states,
)
from chunkwise.processors.builtin import (
  LogitBias,
  MinTokens,
  Penalties,
  TokenAllow,
  TokenBan,
  allow_tokens,
  ban_tokens,
  logit_bias,
  min_tokens,
  penalties,
)

__all__ = [
  "LogitBias",
  "LogitsProcessor",
  "MinTokens",
  "Penalties",
  "StepInfo",
  "TokenAllow",
  "TokenBan",
  "allow_tokens",
  "as_tuple",
  "ban_tokens",
  "check",
  "keep_rows",
  "logit_bias",
  "min_tokens",
  "penalties",
  "request_states",
]
