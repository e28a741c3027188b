"""Scoring jobs: `run_score` runs a whole `ScoreJob`; `score_batch` scores
one batch (prefill, then one record per row).

  summary = run_score(ScoreJob(input="texts.jsonl", output="out.jsonl"))
  records = score_batch(model, rows, time=64, prefix=shared, top_n=5)

A record holds `id`, `adapter` (the LoRA adapter's name; absent for the
base model), `num_tokens` (scored tokens), `logprob` (their sum,
natural log), `token_logprobs`, and optionally `tokens` (ids) and `top_n`
(`ids`, `logprobs` and decoded `tokens` of the n most likely tokens at
each scored position). Scores are the model's raw log-probs (DESIGN.md
§4.1). Floats are written as the shortest decimal that reads back as the
same float32, so equal results give byte-equal files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from chunkwise.inference import Chunk, ChunkResult, InferenceModel
from chunkwise.jobs import adapters, driver, examples, job_setup
from chunkwise.jobs.config import ScoreJob
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
  the first row so every batch has the same shape). Each row runs its
  example's adapter; `prefix` must have been computed with them."""
  fill = rows[0].tokens
  pad_id = int(getattr(model.vocab, "pad_id", 0) or 0)
  chunk = chunk_of(
    [fill if r is None else r.tokens for r in rows], time, pad_id
  )
  result = model.prefill(
    chunk,
    prefix=prefix,
    top_n=top_n,
    adapters=adapters.call_arg(adapters.of_rows(rows)),
  )
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
      **adapters.record_field(row),
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


def encode(described, prefix: list[int], example: examples.Example):
  """(row, scored_from): BOS (unless a shared prefix holds it), the
  context, then the scored text."""
  vocab = described.vocab
  head = [] if prefix else [described.bos_id]
  if example.ids is not None:  # seqio: inputs, then the scored targets
    head += example.context_ids
    return head + list(example.ids), len(head)
  if example.context:
    head += vocab.encode(example.context)
  return head + list(vocab.encode(example.text)), len(head)


def summarize(setup: job_setup.Setup, run: driver.Run) -> dict:
  """Totals over the whole output; speed over this run's examples."""
  records = run.output.records()
  tokens = sum(r["num_tokens"] for r in records)
  nll = -sum(r["logprob"] for r in records) / max(tokens, 1)
  new = sum(
    len(p.tokens) - p.scored_from
    for p in map(setup.prepared.__getitem__, run.todo)
  )
  return driver.summary(
    setup,
    run,
    new_tokens=new,
    examples=len(records),
    tokens=tokens,
    mean_nll=round(nll, 6),
    perplexity=round(math.exp(nll), 4),
  )


def run_score(job: ScoreJob) -> dict | None:
  """Scores every example of `job.input` into `job.output` (resumable,
  multi-host; see `driver`). Returns the summary on process 0 (None on the
  others): examples, tokens, mean NLL per token, perplexity, and this
  run's counts and tokens/s. Raises `job_setup.JobError` (one line) before
  any device work for a bad job, input or output."""
  if not isinstance(job, ScoreJob):
    raise job_setup.JobError(f"run_score needs a ScoreJob, got {job!r}")
  setup = job_setup.setup(job, encode)
  vocab = setup.described.hparams.vocab
  if job.top_n > vocab:
    raise job_setup.JobError(
      f"--top_n={job.top_n} exceeds the vocabulary ({vocab})"
    )

  def run_batch(model, prefix, rows, batch):
    records = score_batch(
      model,
      rows,
      time=batch.time,
      prefix=prefix,
      top_n=job.top_n,
      with_tokens=job.tokens,
    )
    return [None if r is None else [r] for r in records]

  run = driver.run(
    setup,
    keys=lambda p: [examples.id_key(p.example.id)],
    run_batch=run_batch,
    settings={"script": "score", "top_n": job.top_n, "tokens": job.tokens},
  )
  return summarize(setup, run) if run.process == 0 else None
