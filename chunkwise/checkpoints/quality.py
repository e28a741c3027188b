"""How close a quantized model stays to its float original, measured on
texts: next-token top-1 agreement, KL divergence, weight bytes and K/V
bytes per token (`scripts/int8_quality.py` prints it; SmolLM2 tests guard
int8 weights and int8 K/V).

  report = measure(cw.load(name), cw.load(name, quantize="int8"), texts)
  report = measure(cw.load(name), cw.load(name, kv_dtype="int8"), texts)

Every position that predicts a token of a text (all but its BOS) counts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import jax
import numpy as np

from chunkwise import numerics
from chunkwise.inference import Chunk, transformer_infer
from chunkwise.models import kv_int8, quantized


def read_texts(path: str) -> list[str]:
  """The "text" of each line of a JSON-lines file."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line)["text"] for line in f if line.strip()]


_BUCKET = 128  # texts are batched by length, padded to multiples of this


def _batches(vocab, texts):
  """Chunks of the texts, batched by length rounded up to `_BUCKET` (a
  few programs, little padding), shortest first."""
  lengths = [
    int(Chunk.tokenize(vocab, [t], is_first_chunk=True).lengths[0])
    for t in texts
  ]
  groups: dict[int, list[int]] = {}
  for i, n in enumerate(lengths):
    groups.setdefault(-(-n // _BUCKET) * _BUCKET, []).append(i)
  chunks = []
  for width, idx in sorted(groups.items()):
    chunk = Chunk.tokenize(vocab, [texts[i] for i in idx], is_first_chunk=True)
    chunks.append(chunk.pad_to_length(width))
  return chunks


def _distributions(model, chunks):
  """Next-token log-probs [positions, vocab] of every row of every chunk
  (all but BOS), from the plain single-device forward over the model's
  own (possibly quantized) weights, K/V dtype (int8 K/V: every attention
  reads keys and values as stored) and numerics (invariant: the same
  numbers whatever the machine's threads): a full log-softmax, not a
  vocabulary-wide top-n."""
  hparams = model.hparams
  weights = jax.device_put(model.plain_weights(), jax.devices()[0])

  def log_probs(weights, chunk):
    full = transformer_infer(
      hparams, weights, (), chunk, cache_dtype=model.cache_dtype
    )
    return jax.nn.log_softmax(full.logits, axis=-1)

  log_probs = jax.jit(numerics.traced(log_probs, model.numerics))

  out = []
  for chunk in chunks:
    lps = np.asarray(log_probs(weights, chunk))
    out += [lps[r, : int(n) - 1] for r, n in enumerate(chunk.lengths)]
  return np.concatenate(out)


def measure(original, candidate, texts: Sequence[str]) -> dict:
  """Top-1 agreement, KL(original ‖ candidate), weight bytes and K/V
  bytes per token."""
  chunks = _batches(original.vocab, list(texts))
  p = _distributions(original, chunks)
  q = _distributions(candidate, chunks)
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
    "original_kv_bytes_per_token": _kv_bytes(original),
    "candidate_kv_bytes_per_token": _kv_bytes(candidate),
  }


def _kv_bytes(model) -> int:
  """K/V bytes one token holds in `model`'s caches (every layer)."""
  h = model.hparams
  per_head = kv_int8.bytes_per_vector(h.head_dim, model.cache_dtype)
  return 2 * h.layers * h.kv_heads * per_head
