"""A generation job's samples: `generate_items` runs every sample through
continuous batching (`InferenceModel.generate_many`: `slots` rows, a
finished sample's row taking the next one), the default; with
`static_batching`, `generate_batch` samples one batch at a time (prefill
the prompts, generate `num_samples` rows per prompt from their shared KV
caches, one record per sample). `generation.run_generate` runs the job.

  records = generate_batch(model, rows, time=32, num_samples=4, steps=64,
                           sampling=cw.Sampling(temperature=0.7), ...)

A record holds `id`, `adapter` (the LoRA adapter's name; absent for the
base model), `sample` (0 .. num_samples-1), `text`, `tokens`,
`token_logprobs` (raw log-probs of the sampled tokens) and `finish_reason`:
"stop" when the row produced a stop id (EOS, `stop_ids`) or a stop string,
"length" when it ran all `steps`. A stop string is cut off the text;
`tokens` then end with the token that completed it (the device loop stops
on ids only, so a row runs on past a stop string; its extra tokens are
dropped).

Rows of different adapters share batches (each row runs its example's
adapter). Continuous batching continues one batch-1 shared prefix in
every slot, so with `--shared_prefix` the samples of each adapter run in
turn (one `generate_many` each, in the order the adapters first appear);
without one, all in one.

Each sample's id for the RNG contract (DESIGN.md §4.5) is a hash of its
example id and sample index: its tokens depend on neither the batch it
ran in nor the process that ran it.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Sequence

import numpy as np

from chunkwise import constraints
from chunkwise.inference import (
  ChunkResult,
  InferenceModel,
  Request,
  Sampling,
  Speculation,
  SpeculationStats,
)
from chunkwise.jobs import adapters
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


def record_key(record: dict) -> str:
  """(id, sample); KeyError for a record that is not a sample."""
  if "finish_reason" not in record:
    raise KeyError("finish_reason")
  return id_key([record["id"], record["sample"]])


def _run(model, prefix, sample_ids, stream, on_stats, **kwargs):
  """(token lists, score rows) of `generate`; with `stream=(row, print)`,
  through `generate_stream`, printing that row's text as it grows.
  `on_stats` gets the call's speculation counts (with `speculation`)."""
  kwargs["sample_ids"] = sample_ids
  if stream is None:
    chunk, result = model.generate(prefix, **kwargs)
    if result.speculation is not None:
      on_stats(result.speculation)
    scores = np.asarray(result.per_token_scores)
    rows = chunk.to_lists()
    return rows, [s[: len(r)] for s, r in zip(scores, rows, strict=True)]
  row, emit = stream
  rows = [[] for _ in sample_ids]
  scores = [[] for _ in sample_ids]
  printed, result = "", None
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
  if result is not None and result.speculation is not None:
    on_stats(result.speculation)  # the last segment's: the call's
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
  speculation: Speculation | None = None,
  on_stats: Callable[[SpeculationStats], None] = lambda _: None,
) -> list[list[dict] | None]:
  """For each row of `rows`, its `num_samples` records (None for padding
  rows, which repeat the first row). `stream=(i, emit)` passes the text of
  row i's first sample to `emit` as it is generated; `constraint` (one
  `chunkwise.constraints` Constraint for every row) and `budget_forcing`
  go to `generate`; `speculation` drafts from each row's prompt, and
  `on_stats` gets its counts. Each row runs its example's adapter;
  `prefix` must have been computed with them."""
  fill = rows[0]
  pad_id = int(getattr(model.vocab, "pad_id", 0) or 0)
  prompts = chunk_of(
    [(fill if r is None else r).tokens for r in rows], time, pad_id
  )
  names = adapters.of_rows(rows)
  prompt = model.prefill(
    prompts, prefix=prefix, adapters=adapters.call_arg(names)
  )
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
    on_stats,
    speculation=speculation
    and dataclasses.replace(speculation, context=prompts),
    steps=steps,
    sampling=sampling,
    stop_ids=stop_ids,
    constraint=constraint,
    budget_forcing=budget_forcing,
    adapters=adapters.call_arg([n for n in names for _ in range(num_samples)]),
  )
  out: list[list[dict] | None] = []
  for b, row in enumerate(rows):
    if row is None:
      out.append(None)
      continue
    records = []
    for s in range(num_samples):
      i = b * num_samples + s
      records.append(
        _record(
          model.vocab,
          row,
          s,
          tokens[i],
          scores[i],
          stopped=len(tokens[i]) < steps,
          stop_strings=stop_strings,
          constraint=constraint,
        )
      )
    out.append(records)
  return out


def _record(
  vocab,
  row: Prepared,
  s: int,
  tokens,
  scores,
  *,
  stopped,
  stop_strings,
  constraint,
) -> dict:
  """Sample `s` of `row`: its tokens and scores cut at a stop string."""
  kept, text, cut = cut_at_stop(vocab, list(tokens), stop_strings)
  record = {
    "id": row.example.id,
    **adapters.record_field(row),
    "sample": s,
    "text": text,
    "tokens": kept,
    "token_logprobs": floats(np.asarray(scores)[: len(kept)]),
    "finish_reason": "stop" if cut or stopped else "length",
  }
  if isinstance(constraint, constraints.JsonSchema):
    # What the automaton could not enforce is flagged, never hidden.
    check = constraint.validate(text)
    record["schema_valid"] = check.valid
    record["schema_error"] = check.error
  return record


def generate_items(
  model: InferenceModel,
  prefix: adapters.SharedPrefix | Sequence[ChunkResult],
  work: Sequence[tuple[Prepared, int]],
  *,
  slots: int,
  capacity: int,
  steps: int,
  sampling: Sampling,
  stop_ids: Sequence[int] = (),
  stop_strings: Sequence[str] = (),
  constraint=None,
  budget_forcing: bool = False,
  stream: tuple[object, Callable[[str], None]] | None = None,
  speculation: Speculation | None = None,
  on_stats: Callable[[SpeculationStats], None] = lambda _: None,
  prefix_cache_bytes: int = 0,
  kv_pages: int = 0,
):
  """Continuous batching: every (prompt, sample index) of `work` through
  `model.generate_many` in `slots` rows, each running its example's
  adapter; yields (position in `work`, [record]) as samples finish.
  `prefix` is the job's `adapters.SharedPrefix` (or a prefix list every
  request continues); `stream=(example id, emit)` passes that example's
  first sample to `emit` when it finishes; `speculation` drafts from each
  request's prompt, and `on_stats` gets each request's counts; prompts
  that start alike share `prefix_cache_bytes` of cached pages; with
  `kv_pages`, the slots share one pool of that many K/V pages."""
  for group, prefix_list in _groups(prefix, work):
    requests = [
      Request(
        tokens=work[i][0].tokens,
        sample_id=sample_id(work[i][0].example.id, work[i][1]),
        steps=steps,
        sampling=sampling,
        stop_ids=tuple(stop_ids),
        constraint=constraint,
        adapter=work[i][0].example.adapter,
      )
      for i in group
    ]
    for r in model.generate_many(
      requests,
      slots=slots,
      prefix=prefix_list,
      budget_forcing=budget_forcing,
      capacity=capacity,
      speculation=speculation,
      prefix_cache_bytes=prefix_cache_bytes,
      kv_pages=kv_pages,
    ):
      if r.speculation is not None:
        on_stats(r.speculation)
      position = group[r.index]
      yield (
        position,
        [
          _item_record(
            model, work[position], r, stop_strings, constraint, stream
          )
        ],
      )


def _groups(prefix, work):
  """[(positions in `work`, prefix list)] of `generate_items`' calls: one
  for all without a shared prefix (or with a plain list), else one per
  adapter (a batch-1 prefix serves only its own adapter), in the order
  the adapters first appear in `work`."""
  if not isinstance(prefix, adapters.SharedPrefix):
    return [(list(range(len(work))), list(prefix))]
  if not prefix.results:
    return [(list(range(len(work))), [])]
  groups: dict[str | None, list[int]] = {}
  for i, (row, _) in enumerate(work):
    groups.setdefault(row.example.adapter, []).append(i)
  return [(group, prefix.rows([name])) for name, group in groups.items()]


def _item_record(model, item, r, stop_strings, constraint, stream) -> dict:
  """The record of `generate_items`' request result `r` of `item`."""
  row, s = item
  record = _record(
    model.vocab,
    row,
    s,
    r.tokens.tolist(),
    r.per_token_scores,
    stopped=r.finish_reason == "stop",
    stop_strings=stop_strings,
    constraint=constraint,
  )
  if stream is not None and s == 0 and row.example.id == stream[0]:
    stream[1](record["text"] + "\n")
  return record
