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


def token_rows(vocab, texts: Sequence[str]) -> list[list[int]]:
  """Each text's token ids (BOS first), as every measure here reads it."""
  out = []
  for t in texts:
    chunk = Chunk.tokenize(vocab, [t], is_first_chunk=True)
    out.append([int(x) for x in chunk.tokens[0, : int(chunk.lengths[0])]])
  return out


def _batches(vocab, texts):
  """(chunks of the texts batched by length rounded up to `_BUCKET`: a
  few programs, little padding, shortest first; the texts' indices in
  the order the chunks hold them)."""
  lengths = [len(r) for r in token_rows(vocab, texts)]
  groups: dict[int, list[int]] = {}
  for i, n in enumerate(lengths):
    groups.setdefault(-(-n // _BUCKET) * _BUCKET, []).append(i)
  chunks, order = [], []
  for width, idx in sorted(groups.items()):
    chunk = Chunk.tokenize(vocab, [texts[i] for i in idx], is_first_chunk=True)
    chunks.append(chunk.pad_to_length(width))
    order += idx
  return chunks, order


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
  chunks, _ = _batches(original.vocab, list(texts))
  p = _distributions(original, chunks)
  q = _distributions(candidate, chunks)
  original_bytes = quantized.nbytes(original.plain_weights())
  candidate_bytes = quantized.nbytes(candidate.plain_weights())
  return {
    **_agreement(np.exp(p), p, q, len(texts)),
    "original_weight_bytes": original_bytes,
    "candidate_weight_bytes": candidate_bytes,
    "bytes_ratio": candidate_bytes / original_bytes,
    "original_kv_bytes_per_token": _kv_bytes(original),
    "candidate_kv_bytes_per_token": _kv_bytes(candidate),
  }


def _agreement(p, log_p, log_q, texts: int) -> dict:
  """Top-1 agreement and KL(p ‖ q) over positions (rows)."""
  kl = np.sum(p * (log_p - log_q), axis=-1)
  agree = np.argmax(p, axis=-1) == np.argmax(log_q, axis=-1)
  return {
    "texts": texts,
    "positions": int(p.shape[0]),
    "top1_agreement": float(np.mean(agree)),
    "mean_kl": float(np.mean(kl)),
    "max_kl": float(np.max(kl)),
  }


def _kv_bytes(model) -> int:
  """K/V bytes one token holds in `model`'s caches (every layer)."""
  h = model.hparams
  per_head = kv_int8.bytes_per_vector(h.head_dim, model.cache_dtype)
  return 2 * h.layers * h.kv_heads * per_head


def against_reference(model, texts: Sequence[str], reference) -> dict:
  """Top-1 agreement and KL(reference ‖ model) against another program's
  next-token distributions along the same tokens (`token_rows`):
  `reference` [positions, vocab] holds the probabilities after each
  prefix of each text (all but the last token of each), texts in order."""
  texts = list(texts)
  rows = token_rows(model.vocab, texts)
  want = (sum(len(r) - 1 for r in rows), model.hparams.vocab)
  if tuple(reference.shape) != want:
    raise ValueError(
      f"the reference's distributions have shape {tuple(reference.shape)}; "
      f"expected {want} (one per token after each text's first)"
    )
  chunks, order = _batches(model.vocab, texts)
  q = _distributions(model, chunks)
  starts = np.cumsum([0] + [len(r) - 1 for r in rows])
  p = np.concatenate([reference[starts[t] : starts[t + 1]] for t in order])
  p = p.astype(np.float64)
  p /= p.sum(axis=-1, keepdims=True)  # llama.cpp's f32 sums: 1 +- 1e-4
  return _agreement(p, np.log(np.where(p > 0, p, 1.0)), q, len(texts))
