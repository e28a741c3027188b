"""How close a quantized model stays to its float original: next-token
top-1 agreement and KL divergence over a fixed set of English and code
texts, and the weights' bytes.

  python scripts/int8_quality.py                       # SmolLM2, int8
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

import numpy as np
from absl import app, flags

TEXTS = os.path.join(os.path.dirname(__file__), "data", "eval_texts.jsonl")

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Preset name or path.")
_TEXTS = flags.DEFINE_string("texts", TEXTS, "JSONL of {id, text}.")
_QUANTIZE = flags.DEFINE_enum(
  "quantize", "int8", ["int8"], "The candidate's quantization."
)
_DTYPE = flags.DEFINE_enum(
  "dtype", "float32", ["float32", "bfloat16"], "The original's weight dtype."
)


def read_texts(path: str) -> list[str]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line)["text"] for line in f if line.strip()]


def _distributions(model, chunks):
  """Per text: next-token log-probs [positions, vocab] (all but BOS)."""
  vocab = model.hparams.vocab
  out = []
  for chunk in chunks:
    result = model.prefill(chunk, top_n=vocab)
    n = int(chunk.lengths[0])
    ids = np.asarray(result.top_ids[0, 1:n])
    lps = np.asarray(result.top_logprobs[0, 1:n])
    full = np.empty((n - 1, vocab), np.float32)
    np.put_along_axis(full, ids, lps, axis=1)
    out.append(full)
  return out


def measure(original, candidate, texts: Sequence[str]) -> dict:
  """Top-1 agreement, KL(original ‖ candidate) and weight bytes."""
  import chunkwise as cw
  from chunkwise.models import quantized

  tokenized = [
    cw.Chunk.tokenize(original.vocab, [t], is_first_chunk=True) for t in texts
  ]
  width = max(c.time for c in tokenized)
  chunks = [c.pad_to_length(width) for c in tokenized]  # one program
  p = np.concatenate(_distributions(original, chunks))
  q = np.concatenate(_distributions(candidate, chunks))
  kl = np.sum(np.exp(p) * (p - q), axis=-1)
  agree = np.argmax(p, axis=-1) == np.argmax(q, axis=-1)
  original_bytes = quantized.nbytes(original.plain_weights())
  candidate_bytes = quantized.nbytes(candidate.plain_weights())
  return {
    "texts": len(texts),
    "positions": int(p.shape[0]),
    "top1_agreement": float(np.mean(agree)),
    "mean_kl": float(np.mean(kl)),
    "max_kl": float(np.max(kl)),
    "original_weight_bytes": original_bytes,
    "candidate_weight_bytes": candidate_bytes,
    "bytes_ratio": candidate_bytes / original_bytes,
  }


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import chunkwise as cw

  texts = read_texts(_TEXTS.value)
  original = cw.load(_MODEL.value, dtype=_DTYPE.value)
  candidate = cw.load(
    _MODEL.value, dtype=_DTYPE.value, quantize=_QUANTIZE.value
  )
  print(json.dumps(measure(original, candidate, texts), indent=1))


if __name__ == "__main__":
  app.run(main)
