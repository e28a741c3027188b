"""Speculative twins of the two device loops: `generate.run` and `slots.run`.

  state = state.replace(spec=SpecRows.start(history, filled, prior))
  state = run(infer, weights, caches, state, inputs, stop_at, spec=spec)
  state = slot_run(infer, weights, caches, slot_state, slot_inputs,
                   max_steps, until_free, spec=spec)

Each iteration (`_iterate`), for every live row: draw y0 exactly as the
plain step does (`generate.draw`); draft what may follow it
(`speculation`: prompt lookup over the row's history, processor-forced
tokens) and pick the pass width for the batch (`speculation.choose_width`;
width 0 is the plain step), or, for the int8 draft (`draft.py`), pick the
width first and run that many draft steps; run that pass (`verify.check`,
one compiled branch per width under `lax.switch`); write what it emitted
to the row's next columns. Rows advance by different amounts, so every row
writes at its own columns, as the slots always do; a step's K/V are
written by the next iteration, as in the plain loops (the write is then
the buffer's first use). The loops end on the same conditions as their
plain twins, so `finish`, `segment`, `window` and the slots' host side
read the state unchanged; tests compare both twins token for token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise.inference import draft, generate, slots, speculation, verify
from chunkwise.inference.kv_cache import KVCache, LayerKV
from chunkwise.inference.logits import LogitsShards
from chunkwise.inference.speculation import SpecRows, Speculation


def _set(buffer: jax.Array, values: jax.Array, cols: jax.Array) -> jax.Array:
  """buffer[b, cols[b, j]] = values[b, j] (buffer [rows, T, ...], values
  [rows, W, ...]); columns past the buffer are dropped."""
  rows = jnp.arange(cols.shape[0])[:, None]
  return buffer.at[rows, cols].set(values.astype(buffer.dtype), mode="drop")


def _write(cache: LayerKV, k, v, cols: jax.Array) -> LayerKV:
  """K/V [layers, rows, W, heads, dim] into columns cols[b, j] of this
  device's rows (columns past the buffer are dropped)."""
  rows = jnp.arange(cols.shape[0])[:, None]

  def put(buffers, new):
    return tuple(
      b.at[rows, :, cols].set(n.astype(b.dtype), mode="drop")
      for b, n in zip(buffers, new, strict=True)
    )

  return cache.replace(k=put(cache.k, k), v=put(cache.v, v))


def _nothing(cache: LayerKV, width: int):
  """A pending write that writes nothing (every column past the buffer)."""
  b, heads, time, dim = cache.k[0].shape
  zeros = jnp.zeros((len(cache.k), b, width, heads, dim), cache.k[0].dtype)
  return zeros, zeros, jnp.full((b, width), time, jnp.int32)


def _iterate(
  infer,
  shards: LogitsShards,
  spec: Speculation,
  weights,
  caches: tuple[KVCache, ...],
  inputs,
  state,
  rows: verify.Rows,
  draft_weights,
) -> tuple[verify.Verified, SpecRows]:
  """One iteration (module docstring) of a loop's `state` (a `LoopState`
  or `SlotState`): what every row emitted, padded to `spec.k` + 1
  positions, and the rows' speculation state after it. `draft_weights`:
  the "draft" drafter's (None for the others)."""
  buffer, next_logits = state.cache, state.next_logits
  processor_states, rows_spec = state.processor_states, state.spec
  top_n = state.top_ids.shape[-1]
  first = generate.draw(
    shards,
    next_logits,
    inputs,
    rows.positions,
    top_n,
    processor_states,
    rows.info(0),
    rows.live,
  )
  (y0, *_), _, keep0, states = first
  k = spec.k
  history = rows_spec.history
  # Drafting sees y0 as the row's last token.
  seen = _set(
    history,
    y0[:, None],
    jnp.where(keep0, rows_spec.filled, history.shape[1])[:, None],
  )
  filled = rows_spec.filled + keep0.astype(jnp.int32)
  pick = None
  if spec.drafter == "draft":
    # The draft proposes up to k: the width is chosen before it runs.
    counts = jnp.where(keep0, jnp.clip(k, 0, rows.room - 1), 0)
    pick = speculation.choose_width(spec, rows.live, counts, rows_spec.rate)
    drafts = draft.propose(
      infer,
      shards,
      draft_weights,
      caches,
      buffer,
      inputs,
      rows,
      y0,
      keep0,
      width=k,
      steps=jnp.asarray(spec.widths, jnp.int32)[pick],
    )
  elif spec.drafter == "ngram":
    drafts, counts = speculation.ngram_drafts(
      seen, filled, k, spec.ngram_min, spec.ngram_max
    )
  else:
    drafts = jnp.zeros((y0.shape[0], k), jnp.int32)
    counts = jnp.zeros_like(y0)
  sure = jnp.zeros_like(counts)
  if spec.forced and inputs.processors:
    drafts, counts, sure = verify.forced(
      inputs.processors,
      states,
      rows,
      keep0,
      drafts,
      counts,
      shards.vocab,
      only=spec.drafter == "forced",
    )
  # Position j of a pass writes column generated + j: within the room.
  counts = jnp.where(keep0, jnp.clip(counts, 0, rows.room - 1), 0)
  if pick is None:
    pick = speculation.choose_width(
      spec, rows.live, counts, rows_spec.rate, jnp.minimum(sure, counts)
    )

  def branch(w):
    def verified():
      return verify.check(
        infer,
        shards,
        weights,
        caches,
        buffer,
        inputs,
        rows,
        first,
        drafts[:, :w],
        jnp.minimum(counts, w),
        next_logits,
      ).padded(k)

    return verified

  out = lax.switch(pick, [branch(w) for w in spec.widths])
  width = jnp.asarray(spec.widths, jnp.int32)[pick]
  offered = jnp.minimum(counts, width)
  # Rows with drafts that the batch did not verify drift to the prior.
  seen_offered = jnp.where(width > 0, offered, -(counts > 0).astype(jnp.int32))
  j = jnp.arange(k + 1)[None, :]
  live = rows.live.astype(jnp.int32)
  rows_spec = rows_spec.replace(
    history=_set(
      history,
      out.tokens,
      jnp.where(j < out.kept[:, None], rows_spec.filled[:, None] + j, 1 << 30),
    ),
    filled=rows_spec.filled + out.kept,
    rate=speculation.update_rate(
      rows_spec.rate, seen_offered, out.accepted, rows_spec.prior
    ),
    drafts=rows_spec.drafts + (offered > 0).astype(jnp.int32),
    draft_tokens=rows_spec.draft_tokens + offered,
    accepted_tokens=rows_spec.accepted_tokens + out.accepted,
    passes=rows_spec.passes + live * (width > 0).astype(jnp.int32),
    steps=rows_spec.steps + live,
  )
  return out, rows_spec


def _columns(
  out: verify.Verified, column: jax.Array, kv_column: jax.Array, past: int
):
  """(result columns, K/V columns) int32[rows, k + 1] of what `out`
  emitted (from each row's `column`) and kept (from its `kv_column`);
  past the buffers (dropped) for the rest."""
  j = jnp.arange(out.tokens.shape[1])[None, :]
  emitted = jnp.where(out.emitted, column[:, None] + j, past)
  kept = jnp.where(j < out.kept[:, None], kv_column[:, None] + j, 1 << 30)
  return emitted, kept


def _emit(state, out: verify.Verified, cols: jax.Array):
  """`state`'s result buffers with what `out` emitted at `cols`."""
  return state.replace(
    tokens=_set(state.tokens, out.tokens, cols),
    scores=_set(state.scores, out.scores, cols),
    top_ids=_set(state.top_ids, out.top_ids, cols),
    top_logprobs=_set(state.top_logprobs, out.top_logprobs, cols),
  )


def run(
  infer,
  weights,
  caches: Sequence[KVCache],
  state: generate.LoopState,
  inputs: generate.LoopInputs,
  stop_at: jax.Array,
  draft_weights=None,
  *,
  spec: Speculation,
  shards: LogitsShards | None = None,
  kv_rows: Callable[[jax.Array], jax.Array] | None = None,
) -> generate.LoopState:
  """`generate.run` with speculation: runs until every row has stopped or
  filled `stop_at` columns (no row passes it, so a segment ends where the
  plain loop's does and its next-token logits are its last column's).
  `draft_weights`: the "draft" drafter's (`draft.py`).

  `kv_rows` maps a per-row array to the rows this device holds of the K/V
  buffer (under `shard_map`; identity by default)."""
  caches = tuple(caches)
  shards = shards or LogitsShards(vocab=state.next_logits.shape[-1])
  kv_rows = kv_rows or (lambda x: x)
  steps = state.tokens.shape[1]
  limit = jnp.minimum(stop_at, steps)

  def live(state):
    return ~state.done & (state.cache.lengths < limit)

  def body(carry):
    state, pending = carry
    state = state.replace(cache=_write(state.cache, *pending))
    lengths = state.cache.lengths
    rows = verify.Rows(
      positions=inputs.start + lengths,
      generated=lengths,
      remaining=steps - lengths,
      room=limit - lengths,
      live=live(state),
      stop_ids=inputs.stop_ids,
    )
    out, rows_spec = _iterate(
      infer, shards, spec, weights, caches, inputs, state, rows, draft_weights
    )
    cols, at = _columns(out, lengths, lengths, steps)
    new_lengths = lengths + out.kept
    state = _emit(state, out, cols).replace(
      step=jnp.max(new_lengths),
      cache=state.cache.replace(lengths=new_lengths),
      next_logits=out.next_logits,
      done=state.done | out.stopped,
      processor_states=out.processor_states,
      spec=rows_spec,
    )
    return state, (out.k, out.v, kv_rows(at))

  state, pending = lax.while_loop(
    lambda carry: jnp.any(live(carry[0])),
    body,
    (state, _nothing(state.cache, spec.k + 1)),
  )
  return state.replace(cache=_write(state.cache, *pending))


def slot_run(
  infer,
  weights,
  caches: Sequence[KVCache],
  state: slots.SlotState,
  inputs: slots.SlotInputs,
  max_steps: jax.Array,
  until_free: jax.Array,
  draft_weights=None,
  *,
  spec: Speculation,
  shards: LogitsShards | None = None,
  kv_rows: Callable[[jax.Array], jax.Array] | None = None,
) -> slots.SlotState:
  """`slots.run` with speculation (`max_steps` counts iterations)."""
  caches = tuple(caches)
  shards = shards or LogitsShards(vocab=state.next_logits.shape[-1])
  kv_rows = kv_rows or (lambda x: x)
  width = state.tokens.shape[1]
  cond = slots.running(state, max_steps, until_free)

  def body(carry):
    state, pending, i = carry
    state = state.replace(cache=_write(state.cache, *pending))
    rows = verify.Rows(
      positions=inputs.start + state.cache.lengths,
      generated=state.generated,
      remaining=inputs.budget - state.generated,
      room=inputs.budget - state.generated,
      live=~state.done,
      stop_ids=inputs.stop_ids,
    )
    out, rows_spec = _iterate(
      infer, shards, spec, weights, caches, inputs, state, rows, draft_weights
    )
    cols, at = _columns(out, state.generated, state.cache.lengths, width)
    generated = state.generated + out.kept
    state = _emit(state, out, cols).replace(
      cache=state.cache.replace(lengths=state.cache.lengths + out.kept),
      generated=generated,
      next_logits=out.next_logits,
      done=state.done | out.stopped | (generated >= inputs.budget),
      stopped=state.stopped | out.stopped,
      processor_states=out.processor_states,
      spec=rows_spec,
    )
    return state, (out.k, out.v, kv_rows(at)), i + 1

  state, pending, _ = lax.while_loop(
    cond, body, (state, _nothing(state.cache, spec.k + 1), jnp.int32(0))
  )
  return state.replace(cache=_write(state.cache, *pending))
