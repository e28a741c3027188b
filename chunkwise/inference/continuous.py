"""Continuous batching: many requests through a fixed number of slots.

  requests = [cw.Request(tokens=ids, sample_id=i, steps=64) for ...]
  for r in model.generate_many(requests, slots=16, prefix=[few_shot]):
    print(r.index, r.finish_reason, vocab.decode(r.tokens.tolist()))

The host side of `slots`: validates every request before any device work,
then keeps the slots full. Free slots take the next waiting requests in
order: their prompts are prefilled after the shared prefix, up to four at
once (always four rows, columns padded to a power of two of at least 8,
so few programs compile and no prompt's K/V depend on its neighbours')
and put into the slots (`slots.admit`); the slots then
decode on device until one of them finishes (or `every` steps pass), the
host collects what finished, and so on. Results are yielded as requests
finish (in request order among those finishing together).

The contract: a request's tokens equal, and its scores match (to float
rounding), `generate(prefix + [prefill(its prompt)], sample_ids=[its id],
steps=its steps, ...)` run alone, whatever the slots, the order and the
other requests. For a given number of slots its results are bit-identical
whatever the order and the other requests (every program's shapes are the
same; rows never mix), which batch jobs rely on to resume. The schedule
depends only on the requests (never on timing), so every process of a
multi-host run makes the same one.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise import constraints as constraints_lib
from chunkwise import processors as processors_lib
from chunkwise.configs import HParams
from chunkwise.inference import adapters as adapters_lib
from chunkwise.inference import checks, slots
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.engine import Engine, prefix_inputs
from chunkwise.inference.results import ChunkResult
from chunkwise.inference.sampling import Sampling
from chunkwise.partitioning.placement import put

# Default capacities are rounded up to a multiple of this, so calls whose
# longest request differs a little share their compiled programs.
CAPACITY_STEP = 64
ADMIT_ROWS = 4  # prompts prefilled per call (see `admit_rows`)
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
  """

  index: int
  tokens: np.ndarray
  per_token_scores: np.ndarray
  top_ids: np.ndarray
  top_logprobs: np.ndarray
  finish_reason: str


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


_ADMIT: dict = {}  # one admission program per placement of the slots


def replicated_like(state: slots.SlotState, tree):
  """Host arrays placed where the slots' small per-row arrays are: on a
  mesh replicated over every device (of every process)."""
  where = state.done.sharding
  if not isinstance(where, jax.sharding.NamedSharding):
    return jax.tree.map(lambda x: jax.device_put(x, where), tree)
  where = jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(lambda x: put(x, where), tree)


def admit_programs() -> int:
  """Admission programs compiled so far (for benchmarks)."""
  return sum(p._cache_size() for p in _ADMIT.values())


def _admit(state, prompts, at, lengths, rows):
  at, lengths, rows = replicated_like(state, (at, lengths, rows))
  shardings = jax.tree.map(lambda x: x.sharding, state)
  key = jax.tree.flatten(shardings)
  key = (tuple(key[0]), key[1])
  if key not in _ADMIT:
    _ADMIT[key] = jax.jit(
      slots.admit, donate_argnums=0, out_shardings=shardings
    )
  return _ADMIT[key](state, prompts, at, lengths, rows)


def run_many(
  call: _Checked,
  prefix: tuple[ChunkResult, ...],
  *,
  prefill_engine: Engine,
  generate_engine: Engine,
  hparams: HParams,
  slots_n: int,
  top_n: int,
  bos_id: int,
  every: int,
  progress: bool = False,
  trace: Callable[[str, list[int]], None] | None = None,
  served=None,
) -> Iterator[RequestResult]:
  """The scheduler (module docstring) over a validated call; `trace` (for
  benchmarks) is told ("first_token", requests) at the host sync after the
  segment that computed their first tokens, and ("steps", [k]) after each
  segment of k decode steps. `served` (an `adapters.AdapterSet`) runs
  each request's adapter."""

  def adapters_of(engine, ids):
    return None if served is None else served.call(engine, ids)

  caches, prev = prefix_inputs(prefix)
  n = len(call.prompts)
  state = generate_engine.slot_init(
    caches,
    slots=slots_n,
    capacity=call.capacity,
    steps=call.capacity,
    top_n=top_n,
    vocab=hparams.vocab,
  )
  # Free slots hold request 0's initial processor states.
  state = state.replace(
    processor_states=replicated_like(
      state,
      jax.tree.map(
        lambda s: np.repeat(s[:1], slots_n, axis=0), call.processor_states
      ),
    )
  )
  occupant = np.full(slots_n, -1)
  before = np.zeros(slots_n, np.int64)  # tokens per slot at the last look
  waiting = collections.deque(range(n))
  bar = _progress_bar(n, progress)
  try:
    while waiting or (occupant >= 0).any():
      free = np.flatnonzero(occupant < 0)
      if waiting and free.size:
        take = [waiting.popleft() for _ in range(min(free.size, len(waiting)))]
        state = prefill_into(
          state,
          [
            Admission(
              prompt=call.prompts[i],
              adapter_id=int(call.adapter_ids[i]),
              slot=int(slot),
              processor_state=jax.tree.map(
                lambda s, i=i: s[i : i + 1], call.processor_states
              ),
            )
            for i, slot in zip(take, free[: len(take)], strict=True)
          ],
          caches,
          prev,
          prefill_engine,
          bos_id,
          adapters_of,
        )
        occupant[free[: len(take)]] = take
        before[free[: len(take)]] = 0
      else:
        take = []
      inputs = _inputs(call, occupant)
      ids = np.where(occupant >= 0, call.adapter_ids[occupant], -1)
      state = generate_engine.slot_run(
        caches,
        state,
        inputs,
        jnp.int32(every),
        jnp.bool_(True),
        adapters=adapters_of(generate_engine, ids.astype(np.int32)),
      )
      done, stopped, generated = jax.device_get(
        (state.done, state.stopped, state.generated)
      )
      if trace is not None:
        if take:
          trace("first_token", take)
        ran = np.where(occupant >= 0, generated - before, 0)
        trace("steps", [int(ran.max(initial=0))])
        before = generated.copy()
      finished = np.flatnonzero(done & (occupant >= 0))
      if not finished.size:
        continue
      tokens, scores, top_ids, top_lp = jax.device_get(
        (state.tokens, state.scores, state.top_ids, state.top_logprobs)
      )
      for s in sorted(finished, key=lambda s: occupant[s]):
        k = int(generated[s])
        yield RequestResult(
          index=int(occupant[s]),
          tokens=tokens[s, :k],
          per_token_scores=scores[s, :k],
          top_ids=top_ids[s, :k],
          top_logprobs=top_lp[s, :k],
          finish_reason=FINISH_STOP if stopped[s] else FINISH_LENGTH,
        )
        occupant[s] = -1
        bar.update(1)
  finally:
    bar.close()


def admit_rows(slots_n: int) -> int:
  """Rows of every admission prefill: a fixed width, so that a prompt's
  K/V never depend on the prompts admitted with it (matmuls of the same
  shape round each row alike), only on the call's slots."""
  return min(ADMIT_ROWS, slots_n)


@dataclasses.dataclass(frozen=True)
class Admission:
  """One prompt going into a free slot: its ids (after the shared prefix),
  its adapter's stack index (-1: base), its slot, and each processor's
  initial state for it (leading axis 1)."""

  prompt: np.ndarray
  adapter_id: int
  slot: int
  processor_state: tuple


def prefill_into(
  state: slots.SlotState,
  admissions: Sequence[Admission],
  caches,
  prev,
  engine: Engine,
  bos_id: int,
  adapters_of,
) -> slots.SlotState:
  """Prefills `admissions` after the shared prefix and puts them into
  their slots: one prefill of `admit_rows` rows per group of prompts of
  the same length bucket."""
  rows = admit_rows(state.slots)
  groups: dict[int, list[Admission]] = {}
  for a in admissions:
    groups.setdefault(prompt_bucket(a.prompt.size), []).append(a)
  for time, group in sorted(groups.items()):
    for lo in range(0, len(group), rows):
      part = group[lo : lo + rows]
      lengths = np.zeros(rows, np.int32)
      tokens = np.zeros((rows, time), np.int32)
      slots_at = np.full(rows, state.slots, np.int32)  # padding: dropped
      ids = np.full(rows, -1, np.int32)
      for j, a in enumerate(part):
        lengths[j] = a.prompt.size
        tokens[j, : lengths[j]] = a.prompt
        slots_at[j], ids[j] = a.slot, a.adapter_id
      ids = np.where(lengths > 0, ids, -1).astype(np.int32)
      result = engine.prefill(
        caches,
        prev,
        Chunk(tokens=tokens, lengths=lengths),
        top_n=0,
        bos_id=bos_id,
        adapters=adapters_of(engine, ids),
      )
      # Padding rows repeat the first admission's states (never used).
      fill = [part[min(j, len(part) - 1)].processor_state for j in range(rows)]
      processor_rows = jax.tree.map(lambda *s: np.concatenate(s, axis=0), *fill)
      state = _admit(state, result, slots_at, lengths, processor_rows)
  return state


def _inputs(call: _Checked, occupant: np.ndarray) -> slots.SlotInputs:
  """Each slot's settings (a free slot: request 0's, with no budget)."""
  who = np.maximum(occupant, 0)
  return slots.SlotInputs(
    sample_ids=call.sample_ids[who],
    start=np.full(who.shape, call.start, np.int32),
    sampling=jax.tree.map(lambda x: x[who], call.sampling),
    stop_ids=call.stop_ids[who],
    budget=np.where(occupant >= 0, call.steps[who], 0).astype(np.int32),
    processors=call.processors,
  )


def _progress_bar(total: int, show: bool):
  """A tqdm bar (the notebook's widget where there is one) on process 0."""
  from tqdm.auto import tqdm

  return tqdm(
    total=total,
    unit="request",
    disable=not show or jax.process_index() != 0,
  )
