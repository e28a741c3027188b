"""How close a quantized model stays to its float original: next-token
top-1 agreement and KL divergence over a fixed set of English and code
texts, the weights' bytes and the K/V bytes per token.

  python scripts/int8_quality.py                       # SmolLM2, int8
  python scripts/int8_quality.py --quantize=none --kv_dtype=int8  # int8 K/V
  python scripts/int8_quality.py --quantize=native     # GGUF Q4_1 blocks
  python scripts/int8_quality.py --model=path/to/ckpt --texts=more.jsonl

Every position that predicts a token of a text (all but its BOS) counts:
top-1 agreement is the share of positions where both models' most likely
next token is the same; KL is KL(float ‖ quantized) of the full next-token
distributions, in nats. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from absl import app, flags

TEXTS = os.path.join(os.path.dirname(__file__), "data", "eval_texts.jsonl")

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Preset name or path.")
_TEXTS = flags.DEFINE_string("texts", TEXTS, "JSONL of {id, text}.")
_QUANTIZE = flags.DEFINE_enum(
  "quantize",
  "int8",
  ["int8", "native", "none"],
  "The candidate's weight quantization (native: a GGUF file's blocks as "
  "they are, against the same file dequantized to f32).",
)
_KV_DTYPE = flags.DEFINE_enum(
  "kv_dtype",
  "float32",
  ["float32", "bfloat16", "int8"],
  "The candidate's K/V dtype (the original's is float32).",
)
_DTYPE = flags.DEFINE_enum(
  "dtype", "float32", ["float32", "bfloat16"], "The original's weight dtype."
)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import chunkwise as cw
  from chunkwise.checkpoints import quality

  texts = quality.read_texts(_TEXTS.value)
  original = cw.load(_MODEL.value, dtype=_DTYPE.value)
  candidate = cw.load(
    _MODEL.value,
    dtype=_DTYPE.value,
    quantize=_QUANTIZE.value,
    kv_dtype=_KV_DTYPE.value,
  )
  print(json.dumps(quality.measure(original, candidate, texts), indent=1))


if __name__ == "__main__":
  app.run(main)
