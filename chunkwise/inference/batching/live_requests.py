"""A live loop's requests: each validated alone, on the host, into a
`Prepared` (`LiveSlots.prepare`, from any thread), and reported segment by
segment as `SlotUpdate`s (`LiveSlots.step`).

  ready = loop.prepare(cw.Request(tokens=ids, sample_id=0, steps=64))
  loop.add("a", ready)
  for u in loop.step():
    print(u.key, u.tokens, u.finish_reason)

A loop's shapes never change with its traffic, so a request is checked
against the loop's fixed settings (`Intake`: capacity, stop-id width,
processors, adapters, shared prefix) on top of what every request is
checked for (`slot_requests.check_request`); its constraint is compiled
here too, off the loop's thread.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from chunkwise import constraints as constraints_lib
from chunkwise import processors as processors_lib
from chunkwise.configs import HParams
from chunkwise.inference import adapters as adapters_lib
from chunkwise.inference.batching import slot_requests, slots
from chunkwise.inference.batching.slot_requests import Request
from chunkwise.inference.results import ChunkResult
from chunkwise.inference.sampling import Sampling
from chunkwise.inference.speculation import SpeculationStats


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepared:
  """A request validated for one loop (`LiveSlots.prepare`)."""

  prompt: np.ndarray  # int32[n]
  stop_ids: np.ndarray  # int32[stop_width], padded with ids >= vocab
  sample_id: int
  steps: int
  sampling: Sampling  # numpy scalars
  adapter_id: int  # stack index, -1: the base model
  processor_state: tuple  # each of the loop's `processors`' states, [1, ...]
  tables: Any  # constraints.Tables or None
  compile_s: float = 0.0  # seconds compiling its constraint (0: none)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlotUpdate:
  """What one request produced in a `step` (numpy).

  Attributes:
    key: the request's key (`add`).
    tokens: int32[k]: tokens generated since the last update (kept ones:
      a stop token is not among them).
    per_token_scores: f32[k]; top_ids, top_logprobs: [k, top_n].
    finish_reason: None while running, then "stop" (a stop id was drawn)
      or "length" (its steps ran out).
    stop_id: the stop token drawn (finish "stop"), else None; its score
      and alternatives in `stop_score`, `stop_top_ids`, `stop_top_logprobs`.
    speculation: with a speculating loop, the finished request's counts.
  """

  key: Hashable
  tokens: np.ndarray
  per_token_scores: np.ndarray
  top_ids: np.ndarray
  top_logprobs: np.ndarray
  finish_reason: str | None = None
  stop_id: int | None = None
  stop_score: float | None = None
  stop_top_ids: np.ndarray | None = None
  stop_top_logprobs: np.ndarray | None = None
  speculation: SpeculationStats | None = None

  @classmethod
  def read(
    cls,
    key: Hashable,
    window: tuple,
    s: int,
    k: int,
    *,
    finished: bool,
    stop: bool,
    speculation: SpeculationStats | None = None,
  ) -> SlotUpdate:
    """Slot `s`'s update: its `k` new tokens from `window` (tokens, scores,
    top ids, top logprobs: [slots, columns, ...] from the slot's first
    unreported token), then the stop token when it drew one (`stop`)."""
    tokens, scores, top_ids, top_lp = window
    reason = None
    if finished:
      reason = (
        slot_requests.FINISH_STOP if stop else slot_requests.FINISH_LENGTH
      )
    return cls(
      key=key,
      tokens=tokens[s, :k],
      per_token_scores=scores[s, :k],
      top_ids=top_ids[s, :k],
      top_logprobs=top_lp[s, :k],
      finish_reason=reason,
      stop_id=int(tokens[s, k]) if stop else None,
      stop_score=float(scores[s, k]) if stop else None,
      stop_top_ids=top_ids[s, k] if stop else None,
      stop_top_logprobs=top_lp[s, k] if stop else None,
      speculation=speculation,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopShape:
  """What a live loop is made of, for those that compile its programs
  ahead of its requests (`warmup.py`, `heads.py`): its engines, the shared
  prefix as they read it, how prompts are prefilled (rows per admission,
  piece width), its slots' columns and the model's limits."""

  prefill_engine: Any
  generate_engine: Any
  caches: tuple  # the shared prefix's K/V caches
  prev: Any  # its last next-token logits, or None
  start: int  # its tokens
  bos_id: int
  admit_rows: tuple[int, ...]  # ascending (`admission.rows_for`)
  admit_top_n: int  # alternatives an admission prefill computes
  piece: int  # longer prompts are prefilled in pieces this wide
  capacity: int  # columns per slot
  max_len: int
  vocab_size: int
  vocabulary: Any
  adapter_names: tuple[str, ...]
  adapters_of: Any  # (engine, ids) -> the engines' `adapters` argument


@dataclasses.dataclass(frozen=True, kw_only=True)
class Intake:
  """A loop's fixed settings that each of its requests is checked against
  (`LiveSlots.prepare`)."""

  hparams: HParams
  vocabulary: Any
  eos_ids: tuple[int, ...]
  served: Any  # adapters.AdapterSet or None
  capacity: int
  stop_width: int
  prefix: tuple[ChunkResult, ...]
  start: int  # tokens of the prefix
  budget_forcing: bool  # constrained requests close within their steps
  templates: tuple  # the loop's processors, as given
  loop_forms: tuple  # their loop forms (`for_loop()`)

  def prepare(
    self, request: Request, processors: Sequence = (), what: str = "request"
  ) -> Prepared:
    """`request` validated and its constraint compiled (see
    `LiveSlots.prepare`)."""
    h = self.hparams
    if not isinstance(request, Request):
      raise ValueError(f"{what} must be a chunkwise Request, got {request!r}")
    prompt, stops = slot_requests.check_request(
      h,
      request,
      what,
      start=self.start,
      has_prefix=bool(self.prefix),
      eos_ids=self.eos_ids,
    )
    if stops.size > self.stop_width:
      raise ValueError(
        f"{what} has {stops.size} stop ids (EOS included), over this "
        f"loop's stop_width={self.stop_width}"
      )
    need = slot_requests.columns_needed(prompt.size, int(request.steps))
    if need > self.capacity:
      raise ValueError(
        f"{what} needs {need} columns (prompt {prompt.size}, padded to "
        f"{slot_requests.prompt_bucket(prompt.size)}, + steps {request.steps}),"
        f" over the loop's capacity={self.capacity}"
      )
    known = () if self.served is None else self.served.names
    names, ids = adapters_lib.rows_of([request.adapter], 1, known)
    adapters_lib.check_prefix(self.prefix, names)
    states = processors_lib.request_states(
      self.templates, self.loop_forms, processors, h.vocab, what
    )
    tables, compile_s = None, 0.0
    if request.constraint is not None:
      start = time.perf_counter()
      try:
        (_,), (tables,) = constraints_lib.compile_rows(
          [request.constraint],
          batch=1,
          vocabulary=self.vocabulary,
          stop_ids=stops.tolist(),
          width=h.vocab,
        )
      except ValueError as e:
        raise ValueError(f"{what}.constraint: {e}") from e
      if self.budget_forcing:  # a prompt's request: every step its own
        constraints_lib.check_room(
          tables, int(request.steps), f"{what}.steps={request.steps}"
        )
      compile_s = time.perf_counter() - start
    padded = np.full(self.stop_width, h.vocab, np.int32)
    padded[: stops.size] = stops
    sampling = request.sampling.for_batch(1)
    return Prepared(
      prompt=prompt,
      stop_ids=padded,
      sample_id=int(request.sample_id),
      steps=int(request.steps),
      sampling=Sampling(
        **{
          f: np.asarray(getattr(sampling, f))[0]
          for f in slot_requests.SAMPLING_FIELDS
        },
        seed=np.uint32(sampling.seed),
      ),
      adapter_id=int(ids[0]),
      processor_state=states,
      tables=tables,
      compile_s=compile_s,
    )


class SlotSettings:
  """Host copies of each slot's request settings, what its decode steps
  read (`slots.SlotInputs`); a free slot has defaults and no budget."""

  def __init__(self, n: int, *, stop_width: int, vocab: int):
    self.sample_ids = np.zeros(n, np.int32)
    self.sampling = Sampling(
      temperature=np.ones(n, np.float32),
      top_k=np.zeros(n, np.int32),
      top_p=np.ones(n, np.float32),
      min_p=np.zeros(n, np.float32),
      seed=np.zeros(n, np.uint32),
    )
    self.stop_ids = np.full((n, stop_width), vocab, np.int32)
    self.budget = np.zeros(n, np.int32)
    self.adapter = np.full(n, -1, np.int32)

  def seat(self, s: int, p: Prepared) -> None:
    """Slot `s` runs `p` from now on."""
    self.sample_ids[s] = p.sample_id
    for f in (*slot_requests.SAMPLING_FIELDS, "seed"):
      getattr(self.sampling, f)[s] = getattr(p.sampling, f)
    self.stop_ids[s] = p.stop_ids
    self.budget[s] = p.steps
    self.adapter[s] = p.adapter_id

  def inputs(
    self, start: int, live: np.ndarray, processors: tuple
  ) -> slots.SlotInputs:
    """The decode steps' inputs, with a budget only for `live` slots."""
    return slots.SlotInputs(
      sample_ids=self.sample_ids,
      start=np.full(live.shape, start, np.int32),
      sampling=self.sampling,
      stop_ids=self.stop_ids,
      budget=np.where(live, self.budget, 0).astype(np.int32),
      processors=processors,
    )
