"""Requests of continuous batching and their validation on the host.

  request = cw.Request(tokens=ids, sample_id=0, steps=64)
  prompt, stops = check_request(hparams, request, "requests[0]", ...)
  call, prefix, slots, top_n = check_many(hparams, requests, ...)

`Request` and `RequestResult` are what `generate_many` takes and yields
(and, one at a time, what `live_slots` takes); `check_request` validates
one request (every field named in its error), `check_many` a whole
`generate_many` call (constraints compiled, processors traced) before any
device work. `prompt_bucket` and `columns_needed` say how many columns of
a slot a request takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from chunkwise import constraints as constraints_lib
from chunkwise import processors as processors_lib
from chunkwise.configs import HParams
from chunkwise.inference import adapters as adapters_lib
from chunkwise.inference import checks
from chunkwise.inference.results import ChunkResult
from chunkwise.inference.sampling import Sampling

# Default capacities are rounded up to a multiple of this, so calls whose
# longest request differs a little share their compiled programs.
CAPACITY_STEP = 64
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
  """One generation: a prompt and how to continue it.

  Attributes:
    tokens: the prompt's ids, continuing the call's `prefix`; without a
      prefix they start with BOS, as a first Chunk does.
    sample_id: fixes the request's randomness with its seed and positions
      (DESIGN.md §4.5); unique within a call.
    steps: most tokens to generate.
    sampling: scalar settings (`Sampling()`: temperature 1, seed 0).
    stop_ids: ids that end it, besides the model's EOS.
    constraint: a `chunkwise.constraints` Regex / JsonSchema / Choice.
    adapter: the LoRA adapter it runs (`model.with_adapters`); None: the
      base model.
  """

  tokens: Sequence[int]
  sample_id: int
  steps: int
  sampling: Sampling = dataclasses.field(default_factory=Sampling)
  stop_ids: Sequence[int] = ()
  constraint: Any = None
  adapter: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestResult:
  """What one request generated (numpy; the stop token excluded).

  Attributes:
    index: the request's position in the call's `requests`.
    tokens: int32[n]: the generated tokens.
    per_token_scores: f32[n]: their log-probabilities (raw logits).
    top_ids, top_logprobs: [n, top_n]: the most likely alternatives.
    finish_reason: "stop" (a stop id came) or "length" (`steps` ran out).
    speculation: with `speculation=`, the request's
      `SpeculationStats` (else None).
  """

  index: int
  tokens: np.ndarray
  per_token_scores: np.ndarray
  top_ids: np.ndarray
  top_logprobs: np.ndarray
  finish_reason: str
  speculation: object = None


@dataclasses.dataclass(frozen=True)
class _Checked:
  """A validated call: every request's settings as host arrays."""

  prompts: list[np.ndarray]
  sample_ids: np.ndarray  # int32[n]
  steps: np.ndarray  # int32[n]
  sampling: Sampling  # per-request arrays; seed uint32[n]
  stop_ids: np.ndarray  # int32[n, n_stop], padded with `vocab`
  processors: tuple
  processor_states: tuple  # leading axis: requests
  start: int  # tokens of the shared prefix
  capacity: int  # K/V (and result) columns of a slot
  adapter_ids: np.ndarray | None = None  # int32[n]: stack index, -1 base


def _bucket(n: int, minimum: int) -> int:
  return max(minimum, 1 << max(0, n - 1).bit_length())


def prompt_bucket(length: int) -> int:
  """Columns a prompt of `length` tokens is padded to when prefilled."""
  return _bucket(length, 8)


def columns_needed(prompt: int, steps: int) -> int:
  return max(prompt_bucket(prompt), prompt + steps)


def _round_up(n: int) -> int:
  return -(-n // CAPACITY_STEP) * CAPACITY_STEP


def slot_capacity(requests: Sequence[Request]) -> int:
  """`generate_many`'s default capacity for `requests`."""
  return _round_up(
    max(columns_needed(len(r.tokens), r.steps) for r in requests)
  )


def _as_request(i: int, r) -> Request:
  if not isinstance(r, Request):
    raise ValueError(f"requests[{i}] must be a chunkwise Request, got {r!r}")
  return r


def check_request(
  hparams: HParams,
  r: Request,
  what: str,
  *,
  start: int,
  has_prefix: bool,
  eos_ids: Sequence[int],
) -> tuple[np.ndarray, np.ndarray]:
  """Validates one request after a shared prefix of `start` tokens;
  returns (its prompt ids, its stop ids with the EOS ids, sorted). Raises
  ValueError naming `what` and the bad field."""
  h = hparams
  tokens = checks.check_ids(f"{what}.tokens", r.tokens, h, vocab=True)
  if not has_prefix and tokens.size == 0:
    raise ValueError(
      f"{what}.tokens is empty: without a prefix a prompt starts with BOS"
    )
  checks.check_ids(f"{what}.sample_id", [r.sample_id], h, vocab=False)
  steps = checks.check_count(f"{what}.steps", r.steps, minimum=1)
  total = start + tokens.size + steps
  if total > h.max_len:
    raise ValueError(
      f"{what} needs {total} positions (prefix {start} + prompt "
      f"{tokens.size} + steps {steps}), over the slot capacity, the "
      f"model's max_len={h.max_len}"
    )
  if not isinstance(r.sampling, Sampling):
    raise ValueError(
      f"{what}.sampling must be a chunkwise Sampling, got {r.sampling!r}"
    )
  try:
    r.sampling.for_batch(1)
  except ValueError as e:
    raise ValueError(f"{what}: {e}") from e
  if any(np.ndim(getattr(r.sampling, f)) for f in SAMPLING_FIELDS):
    raise ValueError(f"{what}.sampling must hold scalars (one request)")
  stop = checks.check_ids(f"{what}.stop_ids", r.stop_ids, h, vocab=True)
  return tokens, np.unique(np.append(stop, eos_ids)).astype(np.int32)


def check_many(
  hparams: HParams,
  requests: Sequence[Request],
  *,
  slots_n,
  prefix: Sequence[ChunkResult],
  top_n,
  processors,
  budget_forcing: bool,
  eos_ids: Sequence[int],
  vocabulary,
  batch_split: int,
  capacity: int | None = None,
  adapter_names: Sequence[str] = (),
) -> tuple[_Checked, tuple[ChunkResult, ...], int, int]:
  """Validates a `generate_many` call on the host (constraints compiled,
  processors traced); raises ValueError naming the first bad request or
  argument. Returns (the call, prefix, slots, top_n)."""
  h = hparams
  if isinstance(requests, Request) or not isinstance(requests, Sequence):
    raise ValueError(
      f"requests must be a list of chunkwise Requests, got "
      f"{type(requests).__name__}"
    )
  requests = [_as_request(i, r) for i, r in enumerate(requests)]
  if not requests:
    raise ValueError("requests is empty: generate_many needs at least one")
  n_slots = checks.check_count("slots", slots_n, minimum=1)
  if n_slots % batch_split:
    raise ValueError(
      f"slots={n_slots} must be a multiple of the layout's batch split "
      f"{batch_split} (the mesh axes that split attention's rows)"
    )
  top_n = checks.check_count("top_n", top_n, minimum=0, maximum=h.vocab)
  prefix = checks.check_prefix(prefix, 1, h)
  if any(p.batch != 1 for p in prefix):
    raise ValueError(
      f"generate_many's prefix is shared by every request: each of its "
      f"results must have batch 1, got batches {[p.batch for p in prefix]}"
    )
  start = sum(int(np.asarray(p.lengths)[0]) for p in prefix)
  names, adapter_ids = adapters_lib.rows_of(
    [r.adapter for r in requests], len(requests), tuple(adapter_names)
  )
  for i, name in enumerate(names):
    try:
      adapters_lib.check_prefix(prefix, [name])
    except ValueError as e:
      raise ValueError(f"requests[{i}]: {e}") from None
  prompts, stops, seen = [], [], {}
  for i, r in enumerate(requests):
    what = f"requests[{i}]"
    tokens, stop = check_request(
      h, r, what, start=start, has_prefix=bool(prefix), eos_ids=eos_ids
    )
    sid = int(r.sample_id)
    if sid in seen:
      raise ValueError(
        f"{what}.sample_id={sid} is already used by "
        f"requests[{seen[sid]}]: sample ids are unique within a call"
      )
    seen[sid] = i
    stops.append(stop)
    prompts.append(tokens)
  n = len(requests)
  width = max(1, max(s.size for s in stops))
  stop_ids = np.full((n, width), h.vocab, np.int32)
  for i, s in enumerate(stops):
    stop_ids[i, : s.size] = s
  steps = np.array([r.steps for r in requests], np.int32)
  procs = processors_lib.as_tuple(processors)
  masking = constraints_lib.for_rows(
    [r.constraint for r in requests],
    stop_ids=[s.tolist() for s in stops],
    steps=steps.tolist(),
    has_prefix=[bool(prefix) or p.size > 0 for p in prompts],
    vocabulary=vocabulary,
    width=h.vocab,
    budget_forcing=budget_forcing,
  )
  if masking is not None:
    procs = (*procs, masking)
  procs, states = processors_lib.check(
    procs, batch=n, vocab=h.vocab, n_stop=width, per_row=True
  )
  sampling = Sampling(
    **{
      f: np.array([getattr(r.sampling.for_batch(1), f)[0] for r in requests])
      for f in SAMPLING_FIELDS
    },
    seed=np.array([r.sampling.for_batch(1).seed for r in requests], np.uint32),
  )
  needs = [
    columns_needed(p.size, int(s)) for p, s in zip(prompts, steps, strict=True)
  ]
  if capacity is None:
    capacity = _round_up(max(needs))
  capacity = checks.check_count("capacity", capacity, minimum=1)
  for i, need in enumerate(needs):
    if need > capacity:
      raise ValueError(
        f"requests[{i}] needs {need} columns (prompt {prompts[i].size}, "
        f"padded to {prompt_bucket(prompts[i].size)}, + steps {steps[i]}), "
        f"over the slot capacity={capacity}"
      )
  call = _Checked(
    prompts=prompts,
    sample_ids=np.array([r.sample_id for r in requests], np.int32),
    steps=steps,
    sampling=sampling,
    stop_ids=stop_ids,
    processors=procs,
    processor_states=states,
    start=start,
    capacity=capacity,
    adapter_ids=adapter_ids,
  )
  return call, prefix, n_slots, top_n
