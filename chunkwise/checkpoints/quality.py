"""How close a quantized model stays to its float original, measured on
texts: next-token top-1 agreement, KL divergence and weight bytes
(`scripts/int8_quality.py` prints it; a SmolLM2 test guards it).

  report = measure(cw.load(name), cw.load(name, quantize="int8"), texts)

Every position that predicts a token of a text (all but its BOS) counts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from chunkwise.inference import Chunk
from chunkwise.models import quantized


def read_texts(path: str) -> list[str]:
  """The "text" of each line of a JSON-lines file."""
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
  tokenized = [
    Chunk.tokenize(original.vocab, [t], is_first_chunk=True) for t in texts
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
