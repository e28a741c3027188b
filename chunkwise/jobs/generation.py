"""Sampling one batch of a generation job: prefill the prompts, generate
`num_samples` rows per prompt from their shared KV caches, one record per
sample.

  records = generate_batch(model, rows, time=32, num_samples=4, steps=64,
                           sampling=cw.Sampling(temperature=0.7), ...)

A record holds `id`, `sample` (0 .. num_samples-1), `text`, `tokens`,
`token_logprobs` (raw log-probs of the sampled tokens) and `finish_reason`:
"stop" when the row produced a stop id (EOS, `stop_ids`) or a stop string,
"length" when it ran all `steps`. A stop string is cut off the text;
`tokens` then end with the token that completed it (the device loop stops
on ids only, so a row runs on past a stop string; its extra tokens are
dropped).

Each sample's id for the RNG contract (DESIGN.md §4.5) is a hash of its
example id and sample index: its tokens depend on neither the batch it
ran in nor the process that ran it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import numpy as np

from chunkwise.inference import ChunkResult, InferenceModel, Sampling
from chunkwise.jobs.examples import Prepared, id_key
from chunkwise.jobs.scoring import chunk_of, floats


def sample_id(example_id, sample: int) -> int:
  """The RNG sample id of sample `sample` of example `example_id`."""
  base = zlib.crc32(id_key(example_id).encode()) & 0x7FFFFFFF
  return base ^ sample  # the samples of one example never collide


def cut_at_stop(vocab, tokens: list[int], stops: Sequence[str]):
  """(tokens, text, stopped): `tokens` up to the one that completes the
  first stop string, and their text before it."""
  text = vocab.decode(tokens)
  if not any(s in text for s in stops):
    return tokens, text, False
  for n in range(1, len(tokens) + 1):
    text = vocab.decode(tokens[:n])
    found = [text.find(s) for s in stops if s in text]
    if found:
      return tokens[:n], text[: min(found)], True
  raise AssertionError("unreachable: the whole text holds a stop string")


def _run(model, prefix, sample_ids, stream, **kwargs):
  """(token lists, score rows) of `generate`; with `stream=(row, print)`,
  through `generate_stream`, printing that row's text as it grows."""
  kwargs["sample_ids"] = sample_ids
  if stream is None:
    chunk, result = model.generate(prefix, **kwargs)
    scores = np.asarray(result.per_token_scores)
    rows = chunk.to_lists()
    return rows, [s[: len(r)] for s, r in zip(scores, rows, strict=True)]
  row, emit = stream
  rows = [[] for _ in sample_ids]
  scores = [[] for _ in sample_ids]
  printed = ""
  for piece, result in model.generate_stream(prefix, every=8, **kwargs):
    piece_scores = np.asarray(result.per_token_scores)
    for b, tokens in enumerate(piece.to_lists()):
      rows[b] += tokens
      scores[b] += list(piece_scores[b, : len(tokens)])
    # A character split between segments decodes to U+FFFD until whole.
    text = model.vocab.decode(rows[row]).rstrip("\ufffd")
    if text.startswith(printed) and len(text) > len(printed):
      emit(text[len(printed) :])
      printed = text
  text = model.vocab.decode(rows[row])  # and bytes that never completed
  if text.startswith(printed) and len(text) > len(printed):
    emit(text[len(printed) :])
  return rows, [np.asarray(s, np.float32) for s in scores]


def generate_batch(
  model: InferenceModel,
  rows: Sequence[Prepared | None],
  *,
  time: int,
  num_samples: int,
  steps: int,
  sampling: Sampling,
  prefix: Sequence[ChunkResult] = (),
  stop_ids: Sequence[int] = (),
  stop_strings: Sequence[str] = (),
  stream: tuple[int, Callable[[str], None]] | None = None,
  constraint=None,
  budget_forcing: bool = False,
) -> list[list[dict] | None]:
  """For each row of `rows`, its `num_samples` records (None for padding
  rows, which repeat the first row). `stream=(i, emit)` passes the text of
  row i's first sample to `emit` as it is generated; `constraint` (one
  `chunkwise.constraints` Constraint for every row) and `budget_forcing`
  go to `generate`."""
  fill = rows[0]
  pad_id = int(getattr(model.vocab, "pad_id", 0) or 0)
  prompts = chunk_of(
    [(fill if r is None else r).tokens for r in rows], time, pad_id
  )
  prompt = model.prefill(prompts, prefix=prefix)
  ids = [
    sample_id((fill if r is None else r).example.id, s)
    for r in rows
    for s in range(num_samples)
  ]
  tokens, scores = _run(
    model,
    [*prefix, prompt],
    np.asarray(ids, np.int32),
    None if stream is None else (stream[0] * num_samples, stream[1]),
    steps=steps,
    sampling=sampling,
    stop_ids=stop_ids,
    constraint=constraint,
    budget_forcing=budget_forcing,
  )
  out: list[list[dict] | None] = []
  for b, row in enumerate(rows):
    if row is None:
      out.append(None)
      continue
    records = []
    for s in range(num_samples):
      i = b * num_samples + s
      kept, text, stopped = cut_at_stop(model.vocab, tokens[i], stop_strings)
      records.append(
        {
          "id": row.example.id,
          "sample": s,
          "text": text,
          "tokens": kept,
          "token_logprobs": floats(scores[i][: len(kept)]),
          "finish_reason": "stop"
          if stopped or len(tokens[i]) < steps
          else "length",
        }
      )
    out.append(records)
  return out
