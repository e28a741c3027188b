"""Scoring one batch of a scoring job: prefill, then one record per row.

  records = score_batch(model, rows, time=64, prefix=shared, top_n=5)

A record holds `id`, `num_tokens` (scored tokens), `logprob` (their sum,
natural log), `token_logprobs`, and optionally `tokens` (ids) and `top_n`
(`ids`, `logprobs` and decoded `tokens` of the n most likely tokens at
each scored position). Scores are the model's raw log-probs (DESIGN.md
§4.1). Floats are written as the shortest decimal that reads back as the
same float32, so equal results give byte-equal files.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from chunkwise.inference import Chunk, ChunkResult, InferenceModel
from chunkwise.jobs.examples import Prepared


def floats(values: np.ndarray) -> list:
  """float32 values as Python floats with their shortest round-trip
  decimal (nested lists for arrays of rank > 1)."""
  values = np.asarray(values, np.float32)
  if values.ndim > 1:
    return [floats(v) for v in values]
  return [float(str(v)) for v in values]


def chunk_of(rows: Sequence[Sequence[int]], time: int, pad_id: int) -> Chunk:
  """A chunk of `rows`, padded to `time` columns."""
  return Chunk.from_lists(rows, pad_id=pad_id, pad_length=time)


def score_batch(
  model: InferenceModel,
  rows: Sequence[Prepared | None],
  *,
  time: int,
  prefix: Sequence[ChunkResult] = (),
  top_n: int = 0,
  with_tokens: bool = False,
) -> list[dict | None]:
  """One record per row of `rows` (None for padding rows, which repeat
  the first row so every batch has the same shape)."""
  fill = rows[0].tokens
  pad_id = int(getattr(model.vocab, "pad_id", 0) or 0)
  chunk = chunk_of(
    [fill if r is None else r.tokens for r in rows], time, pad_id
  )
  result = model.prefill(chunk, prefix=prefix, top_n=top_n)
  scores = np.asarray(result.per_token_scores)
  top_ids = np.asarray(result.top_ids)
  top_logprobs = np.asarray(result.top_logprobs)
  records: list[dict | None] = []
  for b, row in enumerate(rows):
    if row is None:
      records.append(None)
      continue
    span = slice(row.scored_from, len(row.tokens))
    values = scores[b, span]
    record = {
      "id": row.example.id,
      "num_tokens": len(values),
      "logprob": float(np.sum(values, dtype=np.float64)),
      "token_logprobs": floats(values),
    }
    if with_tokens:
      record["tokens"] = row.tokens[span]
    if top_n:
      ids = top_ids[b, span]
      record["top_n"] = {
        "ids": ids.tolist(),
        "logprobs": floats(top_logprobs[b, span]),
        "tokens": [[model.vocab.decode([int(t)]) for t in r] for r in ids],
      }
    records.append(record)
  return records
