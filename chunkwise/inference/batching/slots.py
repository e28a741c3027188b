"""Slots: the device side of continuous batching (`generate_many`).

  state = init(infer, weights, caches, slots=8, capacity=96, steps=64, ...)
  state = admit(state, prompts, at, prompt_lengths, processor_rows)
  state = run(infer, weights, caches, state, inputs, max_steps, until_free)

A fixed number of slots decode side by side. Each slot holds one request:
its prompt's K/V and the tokens it generated so far in its own rows of one
heads-major buffer per layer (`LayerKV`, `capacity` columns), or, with
`pages`, in the pages its table names in one pool (`PagedKV`, filled by
the host's `page_table`), after an optional shared prefix (the call's
`caches`, batch 1, read in place by every slot). Unlike `generate`'s loop,
where every row writes the same column, each slot writes at its own
length: a slot's request may have started many steps after its
neighbours'.

Every step of `run` is `generate`'s step, row by row (the same sampler, RNG
contract, processors and forward pass): with each row's absolute position
(`inputs.start` + its slot's length), sample id, seed, stop ids and budget,
a request's tokens and scores equal those of `generate` run on it alone. A
row is done at a stop id (finish "stop", the stop token not counted) or
when it has generated its budget (finish "length"); done rows compute
padding until the host frees their slot and `admit` puts the next prompts'
prefill results (`ChunkResult`s of `InferenceModel.prefill`'s engine) into
it. `run` returns to the host after `max_steps`, or, with `until_free`, as
soon as a row finishes: never once per token.

A segment may run some of the slots only (`rows.py`: a bucket of the
running requests), the rest untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

from chunkwise.inference import generate
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.infer import InferFn
from chunkwise.inference.kv_cache import KVCache, LayerKV, by_layer
from chunkwise.inference.logits import LogitsShards
from chunkwise.inference.paging.paged_kv import PAGE, PagedKV
from chunkwise.inference.results import ChunkResult
from chunkwise.inference.sampling import Sampling
from chunkwise.inference.speculation import SpecRows
from chunkwise.partitioning import axes as ax
from chunkwise.processors import StepInfo


def _replicated(tree):
  return jax.tree.map(lambda _: P(), tree)


@struct.dataclass(kw_only=True)
class SlotInputs:
  """Each slot's request settings (host arrays, replaced on admission)."""

  sample_ids: jax.Array  # int32[slots]
  start: jax.Array  # int32[slots]: tokens of the shared prefix
  sampling: Sampling  # per-row arrays, the seed too (uint32[slots])
  stop_ids: jax.Array  # int32[slots, n]: padded with ids >= vocab
  budget: jax.Array  # int32[slots]: most tokens the request generates
  processors: tuple = ()  # the call's processors (arrays traced)

  @classmethod
  def axes(cls, processors: tuple = ()) -> SlotInputs:
    rows = P(ax.BATCH)
    return cls(
      sample_ids=rows,
      start=rows,
      sampling=Sampling(
        temperature=rows, top_k=rows, top_p=rows, min_p=rows, seed=rows
      ),
      stop_ids=P(ax.BATCH, None),
      budget=rows,
      processors=_replicated(processors),
    )


@struct.dataclass(kw_only=True)
class SlotState:
  """What the slots carry between segments (buffers `steps` wide)."""

  # Prompt + generated K/V (fixed slots, or a paged pool); lengths =
  # tokens kept per slot.
  cache: LayerKV | PagedKV
  generated: jax.Array  # int32[slots]: tokens generated (and kept)
  tokens: jax.Array  # int32[slots, steps]
  scores: jax.Array  # f32[slots, steps]
  top_ids: jax.Array  # int32[slots, steps, n]
  top_logprobs: jax.Array  # f32[slots, steps, n]
  next_logits: jax.Array  # f32[slots, vocab]
  done: jax.Array  # bool[slots]: finished, or free
  stopped: jax.Array  # bool[slots]: finished by a stop id
  processor_states: tuple = ()
  spec: SpecRows | None = None  # with speculation (`speculative.slot_run`)

  @classmethod
  def axes(
    cls,
    layers: int,
    processor_states: tuple = (),
    spec: bool = False,
    paged: bool = False,
  ) -> SlotState:
    rows = P(ax.BATCH, ax.TIME)
    top = P(ax.BATCH, ax.TIME, ax.TOP_N)
    return cls(
      cache=(PagedKV if paged else LayerKV).axes(layers),
      generated=P(ax.BATCH),
      tokens=rows,
      scores=rows,
      top_ids=top,
      top_logprobs=top,
      next_logits=P(ax.LOGITS_BATCH, ax.LOGITS_VOCAB),
      done=P(ax.BATCH),
      stopped=P(ax.BATCH),
      processor_states=_replicated(processor_states),
      spec=SpecRows.axes() if spec else None,
    )

  @property
  def slots(self) -> int:
    return self.done.shape[0]


def init(
  infer: InferFn,
  weights,
  caches: Sequence[KVCache],
  *,
  slots: int,
  capacity: int,
  steps: int,
  top_n: int,
  vocab: int,
  shards: LogitsShards | None = None,
  pages: int = 0,
  page: int = PAGE,
) -> SlotState:
  """Every slot free: K/V buffers of `capacity` columns (prompt and
  generated tokens), result buffers of `steps` columns. With `pages`, the
  K/V are one pool of that many pages of `page` columns (`PagedKV`), a
  slot's table addressing up to `capacity` columns."""
  shards = shards or LogitsShards(vocab=vocab)
  step_chunk = Chunk(
    tokens=jnp.zeros((slots, 1), jnp.int32),
    lengths=jnp.ones((slots,), jnp.int32),
  )
  kv = jax.eval_shape(infer, weights, tuple(caches), step_chunk).kv_cache.k
  logits = shards.carried(None, slots, 0, False)
  return SlotState(
    cache=(
      PagedKV.zeros(kv, pages=pages, page=page, columns=capacity, rows=slots)
      if pages
      else LayerKV.zeros(kv, capacity, slots)
    ),
    generated=jnp.zeros((slots,), jnp.int32),
    tokens=jnp.zeros((slots, steps), jnp.int32),
    scores=jnp.zeros((slots, steps), jnp.float32),
    top_ids=jnp.zeros((slots, steps, top_n), jnp.int32),
    top_logprobs=jnp.zeros((slots, steps, top_n), jnp.float32),
    next_logits=jnp.zeros(logits.shape, jnp.float32),  # not weak-typed
    done=jnp.ones((slots,), bool),
    stopped=jnp.zeros((slots,), bool),
  )


def admit(
  state: SlotState,
  prompts: ChunkResult,
  at: jax.Array,
  prompt_lengths: jax.Array,
  processor_rows: tuple,
  prompt_tokens: jax.Array | None = None,
  offset: jax.Array | None = None,
) -> SlotState:
  """Puts prefilled prompts into slots (a global program, any placement).

  Args:
    state: the slots; those at `at` are free.
    prompts: the prefill result of a [rows, T] chunk of prompts (after the
      shared prefix and a cached start of `offset` tokens): its K/V fill
      columns [h, h + T) of the slots' buffers, h = `offset` (traced;
      None: 0).
    at: int32[rows]: each prompt's slot; `state.slots` for padding rows,
      whose writes are dropped.
    prompt_lengths: int32[rows]: each prompt's tokens (the cached start's
      included).
    processor_rows: each processor's initial state for these rows.
    prompt_tokens: int32[rows, n], the whole prompts (with speculation:
      the history its drafter searches).
    offset: where the prompts' K/V start (`put_head` wrote the cached
      start before them).
  """
  cache = state.cache
  cache = cache.put_rows(
    prompts.kv_cache.k, prompts.kv_cache.v, at, offset
  ).replace(
    lengths=cache.lengths.at[at].set(prompt_lengths, mode="drop"),
  )

  def set_rows(old, new):
    return old.at[at].set(new.astype(old.dtype), mode="drop")

  spec = state.spec
  if spec is not None:
    width = min(prompt_tokens.shape[1], spec.history.shape[1])
    zeros = jnp.zeros_like(at)
    spec = spec.replace(
      history=spec.history.at[at]
      .set(0, mode="drop")
      .at[at, :width]
      .set(prompt_tokens[:, :width].astype(jnp.int32), mode="drop"),
      filled=set_rows(spec.filled, prompt_lengths),
      rate=set_rows(spec.rate, jnp.full(at.shape, spec.prior)),
      drafts=set_rows(spec.drafts, zeros),
      draft_tokens=set_rows(spec.draft_tokens, zeros),
      accepted_tokens=set_rows(spec.accepted_tokens, zeros),
      passes=set_rows(spec.passes, zeros),
      steps=set_rows(spec.steps, zeros),
    )
  return state.replace(
    spec=spec,
    cache=cache,
    generated=set_rows(state.generated, jnp.zeros_like(at)),
    next_logits=set_rows(state.next_logits, prompts.next_token_logits),
    done=set_rows(state.done, jnp.zeros(at.shape, bool)),
    stopped=set_rows(state.stopped, jnp.zeros(at.shape, bool)),
    processor_states=jax.tree.map(
      set_rows, state.processor_states, processor_rows
    ),
  )


def put_head(state: SlotState, head: KVCache, at: jax.Array) -> SlotState:
  """The cached start of prompts going into slots `at` (`prefix_cache`,
  batch 1): its K/V fill their columns [0, h) (`admit` then writes the
  rest at offset h; padding rows `state.slots` dropped). One program per
  width of `head`, whatever the rest."""
  return state.replace(cache=state.cache.put_rows(head.k, head.v, at))


def vacate(state: SlotState, at: jax.Array) -> SlotState:
  """Slots `at` freed before they finished (a paged pool's preemption):
  done, holding nothing (`state.slots` for padding rows: dropped)."""
  return state.replace(
    cache=state.cache.replace(
      lengths=state.cache.lengths.at[at].set(0, mode="drop")
    ),
    done=state.done.at[at].set(True, mode="drop"),
    stopped=state.stopped.at[at].set(False, mode="drop"),
  )


def set_columns(buffer: jax.Array, values: jax.Array, cols: jax.Array):
  """buffer[b, cols[b, j]] = values[b, j] (buffer [rows, T, ...], values
  [rows, W, ...]); columns past the buffer are dropped."""
  rows = jnp.arange(cols.shape[0])[:, None]
  return buffer.at[rows, cols].set(values.astype(buffer.dtype), mode="drop")


def _step(
  infer: InferFn,
  shards: LogitsShards,
  kv_rows: Callable[[jax.Array], jax.Array],
  weights,
  caches: tuple[KVCache, ...],
  inputs: SlotInputs,
  state: SlotState,
):
  """One step of every slot: `generate._step` with per-row columns."""
  live = ~state.done
  positions = inputs.start + state.cache.lengths
  info = StepInfo(
    generated=state.generated,
    remaining=inputs.budget - state.generated,
    stop_ids=inputs.stop_ids,
  )
  (token, score, top_ids, top_logprobs), stop, keep, processor_states = (
    generate.draw(
      shards,
      state.next_logits,
      inputs,
      positions,
      state.top_ids.shape[-1],
      state.processor_states,
      info,
      live,
    )
  )
  chunk = Chunk(tokens=token[:, None], lengths=keep.astype(jnp.int32))
  full = infer(weights, (*caches, state.cache), chunk)
  # Results go to each live row's next column; done rows write nothing.
  at = jnp.where(live, state.generated, state.tokens.shape[1])[:, None]
  generated = state.generated + keep.astype(jnp.int32)
  # A kept token's K/V go to its slot's next column, written by the next
  # step (as in `generate`: the write is then the buffer's first use).
  write_at = jnp.where(keep, state.cache.lengths, state.cache.columns)
  new = SlotState(
    cache=state.cache.replace(
      lengths=state.cache.lengths + keep.astype(jnp.int32)
    ),
    generated=generated,
    tokens=set_columns(state.tokens, token[:, None], at),
    scores=set_columns(state.scores, score[:, None], at),
    top_ids=set_columns(state.top_ids, top_ids[:, None], at),
    top_logprobs=set_columns(state.top_logprobs, top_logprobs[:, None], at),
    next_logits=jnp.where(
      shards.rows(keep)[:, None], full.logits[:, 0], state.next_logits
    ),
    done=state.done | stop | (generated >= inputs.budget),
    stopped=state.stopped | (live & stop),
    processor_states=processor_states,
  )
  kv = by_layer(full.kv_cache.k, full.kv_cache.v)
  return new, (*kv, kv_rows(write_at[:, None]))


def run(
  infer: InferFn,
  weights,
  caches: Sequence[KVCache],
  state: SlotState,
  inputs: SlotInputs,
  max_steps: jax.Array,
  until_free: jax.Array,
  shards: LogitsShards | None = None,
  kv_rows: Callable[[jax.Array], jax.Array] | None = None,
) -> SlotState:
  """Runs every slot for up to `max_steps` steps, until every slot is done,
  or, when `until_free`, until one more slot is done than on entry.

  `kv_rows` maps a per-row array to the rows this device holds of the K/V
  buffer (under `shard_map`; identity by default)."""
  caches = tuple(caches)
  shards = shards or LogitsShards(vocab=state.next_logits.shape[-1])
  kv_rows = kv_rows or (lambda x: x)
  cond = running(state, max_steps, until_free)

  def body(carry):
    state, pending, i = carry
    state = state.replace(cache=state.cache.write_columns(*pending))
    state, pending = _step(
      infer, shards, kv_rows, weights, caches, inputs, state
    )
    return state, pending, i + 1

  state, pending, _ = lax.while_loop(
    cond, body, (state, state.cache.nothing(1), jnp.int32(0))
  )
  return state.replace(cache=state.cache.write_columns(*pending))


def running(state: SlotState, max_steps: jax.Array, until_free: jax.Array):
  """The loop's condition on (state, pending, iterations): fewer than
  `max_steps` iterations, a slot still running and, with `until_free`, no
  slot done since entry (`state`)."""
  done_on_entry = jnp.sum(state.done)

  def cond(carry):
    state, _, i = carry
    more = (i < max_steps) & ~jnp.all(state.done)
    return more & ~(until_free & (jnp.sum(state.done) > done_on_entry))

  return cond


def window(state: SlotState, start: jax.Array, width: int):
  """(tokens, scores, top_ids, top_logprobs) of columns [start[b], start[b]
  + width) of each slot's result buffers (clamped to the last column): what
  a live loop hands back after a segment (a global program)."""
  last = state.tokens.shape[1] - 1
  cols = jnp.minimum(start[:, None] + jnp.arange(width)[None, :], last)

  def take(buffer):
    index = cols.reshape(cols.shape + (1,) * (buffer.ndim - 2))
    return jnp.take_along_axis(buffer, index, axis=1)

  return (
    take(state.tokens),
    take(state.scores),
    take(state.top_ids),
    take(state.top_logprobs),
  )
