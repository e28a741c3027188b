"""Speculative twins of the two device loops: `generate.run` and `slots.run`.

  state = state.replace(spec=SpecRows.start(history, filled, spec))
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

from chunkwise.inference import generate, speculation
from chunkwise.inference.batching import slots
from chunkwise.inference.kv_cache import KVCache, by_layer
from chunkwise.inference.logits import LogitsShards
from chunkwise.inference.speculation import SpecRows, Speculation, draft, verify


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
  seen = slots.set_columns(
    history,
    y0[:, None],
    jnp.where(keep0, rows_spec.filled, history.shape[1])[:, None],
  )
  filled = rows_spec.filled + keep0.astype(jnp.int32)
  # Position j of a pass writes column generated + j: within the room.
  most = jnp.where(keep0, jnp.clip(k, 0, rows.room - 1), 0)
  forcing = spec.forced and bool(inputs.processors)

  def force(drafts, counts):
    if not forcing:
      return drafts, counts, jnp.zeros_like(counts)
    return verify.forced(
      inputs.processors,
      states,
      rows,
      keep0,
      drafts,
      counts,
      shards.vocab,
      only=spec.drafter == "forced",
    )

  if spec.drafter == "draft":
    # The draft proposes up to k: the width is chosen before it runs.
    pick = speculation.choose_width(
      spec,
      rows.live,
      most,
      rows_spec.rate,
      cost=rows_spec.cost,
      force=rows_spec.force,
    )
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
    drafts, counts, _ = force(drafts, most)
    counts = jnp.minimum(counts, most)
    tried = most > 0
  else:

    def proposed():
      if spec.drafter == "ngram":
        drafts, counts = speculation.ngram_drafts(
          seen, filled, k, spec.ngram_min, spec.ngram_max
        )
      else:
        drafts = jnp.zeros((y0.shape[0], k), jnp.int32)
        counts = jnp.zeros_like(y0)
      return force(drafts, counts)

    def skipped():
      zeros = jnp.zeros_like(y0)
      return jnp.zeros((y0.shape[0], k), jnp.int32), zeros, zeros

    # Drafting takes time too: skipped when even k drafts per row, taken
    # at the rows' rates (sure, where processors may force them), could
    # not pay for a pass, as in a wide batch at the prior rate.
    worth = (
      speculation.choose_width(
        spec,
        rows.live,
        most,
        rows_spec.rate,
        most if forcing else None,
        cost=rows_spec.cost,
        force=rows_spec.force,
      )
      > 0
    )
    drafts, counts, sure = lax.cond(worth, proposed, skipped)
    counts = jnp.minimum(counts, most)
    pick = speculation.choose_width(
      spec,
      rows.live,
      counts,
      rows_spec.rate,
      jnp.minimum(sure, counts),
      cost=rows_spec.cost,
      force=rows_spec.force,
    )
    tried = jnp.where(worth, counts > 0, keep0)

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
  # Rows with drafts that the batch did not verify (or did not draft, as
  # it could not pay) drift to the prior.
  seen_offered = jnp.where(width > 0, offered, -tried.astype(jnp.int32))
  j = jnp.arange(k + 1)[None, :]
  live = rows.live.astype(jnp.int32)
  rows_spec = rows_spec.replace(
    history=slots.set_columns(
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
    tokens=slots.set_columns(state.tokens, out.tokens, cols),
    scores=slots.set_columns(state.scores, out.scores, cols),
    top_ids=slots.set_columns(state.top_ids, out.top_ids, cols),
    top_logprobs=slots.set_columns(state.top_logprobs, out.top_logprobs, cols),
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
    state = state.replace(cache=state.cache.write_columns(*pending))
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
    return state, (*by_layer(out.k, out.v), kv_rows(at))

  state, pending = lax.while_loop(
    lambda carry: jnp.any(live(carry[0])),
    body,
    (state, state.cache.nothing(spec.k + 1)),
  )
  return state.replace(cache=state.cache.write_columns(*pending))


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
    state = state.replace(cache=state.cache.write_columns(*pending))
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
    return state, (*by_layer(out.k, out.v), kv_rows(at)), i + 1

  state, pending, _ = lax.while_loop(
    cond, body, (state, state.cache.nothing(spec.k + 1), jnp.int32(0))
  )
  return state.replace(cache=state.cache.write_columns(*pending))
