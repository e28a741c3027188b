"""One speculative pass: the tokens of [y0, d1..dw] the target keeps.

  first = generate.draw(...)                     # y0, as a plain step
  drafts, counts = forced(...)                   # processor-forced drafts
  out = check(infer, shards, weights, caches, buffer, inputs, rows, first,
              drafts, counts, next_logits)

`check` runs one forward pass over each row's [y0, d1..dw] (row b's first
1 + counts[b] positions; none for a row that stopped or is done) after the
prefixes and the loop's K/V buffer. At position j >= 1 it draws the token
the target draws there: from the pass's logits after position j - 1, with
the key of the row's position + j (DESIGN.md §4.5), through the processors
with their states advanced over y0, d1..d_{j-1}. Draft d_j is accepted
while it equals that token and every draft before it was accepted; the
first position whose token differs ends the row's pass (that token is the
next iteration's y0: its logits become the row's next-token logits, so
the next plain or speculative step draws it again, identically).

A row emits y0 and its accepted drafts, in order; the first stop id among
them is emitted (written) but not kept (counted), and ends the row, as in
`generate`. Only kept tokens' K/V are written, their logits carried and
the processors' states advanced over them, so nothing of a rejected or
stopped position reaches a result, a prefix or a later call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from chunkwise.inference.chunk import Chunk
from chunkwise.inference.generate import is_stop
from chunkwise.inference.logits import LogitsShards
from chunkwise.processors import StepInfo, keep_rows


@struct.dataclass(kw_only=True)
class Rows:
  """Where each row stands before an iteration (all rows, replicated)."""

  positions: jax.Array  # int32[rows]: absolute position of y0
  generated: jax.Array  # int32[rows]: tokens kept so far in this call
  remaining: jax.Array  # int32[rows]: columns left, y0's included
  room: jax.Array  # int32[rows]: columns this iteration may fill (<= that)
  live: jax.Array  # bool[rows]: draws y0 in this iteration
  stop_ids: jax.Array  # int32[n] (shared) or int32[rows, n] (per row)

  def info(self, j: int) -> StepInfo:
    """The processors' view of position j of the pass."""
    return StepInfo(
      generated=self.generated + j,
      remaining=self.remaining - j,
      stop_ids=self.stop_ids,
    )


def _advance(processors, states, token, info, keep):
  """Processor states after `token`, where `keep`."""
  new = tuple(
    p.update(s, token, info) for p, s in zip(processors, states, strict=True)
  )
  return keep_rows(keep, new, states)


def forced(
  processors: tuple,
  states: tuple,
  rows: Rows,
  first_keep: jax.Array,
  drafts: jax.Array,
  counts: jax.Array,
  vocab: int,
  *,
  only: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Drafts with every processor-forced token put in: walking positions
  1..w with the processors' states (after y0, in `states`), where they
  allow one token only it is the draft; elsewhere the drafter's proposal
  stands (`only`: nothing does). Returns (drafts, counts, sure): `sure`
  counts each row's leading forced drafts, which are always accepted."""
  width = drafts.shape[1]
  out, count, alive = [], jnp.zeros_like(counts), first_keep
  sure, certain = jnp.zeros_like(counts), first_keep
  blank = jnp.zeros((drafts.shape[0], vocab), jnp.float32)
  for j in range(1, width + 1):
    info = rows.info(j)
    x = blank
    for p, s in zip(processors, states, strict=True):
      x = p.apply(s, x, info)
    allowed = x > -jnp.inf
    is_forced = jnp.sum(allowed, axis=-1) == 1
    proposed = (j <= counts) & (not only)
    draft = jnp.where(is_forced, jnp.argmax(allowed, axis=-1), drafts[:, j - 1])
    draft = draft.astype(jnp.int32)
    alive = alive & (is_forced | proposed)
    out.append(draft)
    count = count + alive.astype(jnp.int32)
    certain = certain & is_forced
    sure = sure + certain.astype(jnp.int32)
    going = alive & ~is_stop(draft, rows.stop_ids, rows.positions + j)
    states = _advance(processors, states, draft, info, going)
    alive = going
    certain = certain & going
  return jnp.stack(out, axis=1), count, sure


@struct.dataclass(kw_only=True)
class Verified:
  """What one pass emits per row ([rows, w + 1] over y0, d1..dw)."""

  tokens: jax.Array  # int32[rows, w + 1]
  scores: jax.Array  # f32[rows, w + 1]
  top_ids: jax.Array  # int32[rows, w + 1, n]
  top_logprobs: jax.Array  # f32[rows, w + 1, n]
  emitted: jax.Array  # bool[rows, w + 1]: written to the row's columns
  kept: jax.Array  # int32[rows]: emitted tokens counted (all but a stop)
  stopped: jax.Array  # bool[rows]: a stop id was emitted
  accepted: jax.Array  # int32[rows]: drafts emitted
  next_logits: jax.Array  # this device's rows: after the last kept token
  processor_states: tuple
  k: jax.Array  # [layers, rows here, w + 1, kv_heads, head_dim]
  v: jax.Array

  def padded(self, width: int) -> Verified:
    """Padded to `width` + 1 positions (nothing emitted past w)."""
    extra = width + 1 - self.tokens.shape[1]

    def pad(x, axis=1):
      widths = [(0, 0)] * x.ndim
      widths[axis] = (0, extra)
      return jnp.pad(x, widths)

    return self.replace(
      tokens=pad(self.tokens),
      scores=pad(self.scores),
      top_ids=pad(self.top_ids),
      top_logprobs=pad(self.top_logprobs),
      emitted=pad(self.emitted),
      k=pad(self.k, 2),
      v=pad(self.v, 2),
    )


def check(
  infer,
  shards: LogitsShards,
  weights,
  caches: tuple,
  buffer,
  inputs,
  rows: Rows,
  first: tuple,
  drafts: jax.Array,
  counts: jax.Array,
  next_logits: jax.Array,
) -> Verified:
  """The pass (module docstring). `first` is `generate.draw`'s output for
  y0; drafts int32[rows, w], counts int32[rows] (<= w, and < each row's
  remaining columns)."""
  (y0, score0, top0, logprob0), stop0, keep0, states = first
  width = drafts.shape[1]
  top_n = top0.shape[-1]
  chunk = Chunk(
    tokens=jnp.concatenate([y0[:, None], drafts], axis=1),
    lengths=jnp.where(keep0, 1 + counts, 0).astype(jnp.int32),
  )
  full = infer(weights, (*caches, buffer), chunk)
  logits = full.logits
  processors = inputs.processors
  if width and not processors:
    # One draw over every drafted position: rows are independent.
    def rep(x):
      return x if x.ndim == 0 else jnp.repeat(x, width, axis=0)

    at = rows.positions[:, None] + jnp.arange(1, width + 1)[None, :]
    flat = shards.sample(
      logits[:, :width].reshape(-1, logits.shape[-1]),
      jax.tree.map(rep, inputs.sampling),
      rep(inputs.sample_ids),
      at.reshape(-1),
      top_n,
    )
    drawn = [x.reshape(drafts.shape + x.shape[1:]) for x in flat]
  tokens, scores, tops, logprobs = [y0], [score0], [top0], [logprob0]
  emitted, kept_any = [rows.live], keep0
  kept = keep0.astype(jnp.int32)
  stopped = rows.live & stop0
  for j in range(1, width + 1):
    if processors:
      y, score, top, logprob = shards.sample(
        logits[:, j - 1],
        inputs.sampling,
        inputs.sample_ids,
        rows.positions + j,
        top_n,
        processors,
        states,
        rows.info(j),
      )
    else:
      y, score, top, logprob = (x[:, j - 1] for x in drawn)
    emit = kept_any & (j <= counts) & (y == drafts[:, j - 1])
    stop = is_stop(y, rows.stop_ids, rows.positions + j)
    keep = emit & ~stop
    if processors:
      states = _advance(processors, states, y, rows.info(j), keep)
    tokens.append(y)
    scores.append(score)
    tops.append(top)
    logprobs.append(logprob)
    emitted.append(emit)
    kept = kept + keep.astype(jnp.int32)
    stopped = stopped | (emit & stop)
    kept_any = keep
  emitted = jnp.stack(emitted, axis=1)
  last = jnp.maximum(shards.rows(kept) - 1, 0)
  after = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
  return Verified(
    tokens=jnp.stack(tokens, axis=1),
    scores=jnp.stack(scores, axis=1),
    top_ids=jnp.stack(tops, axis=1),
    top_logprobs=jnp.stack(logprobs, axis=1),
    emitted=emitted,
    kept=kept,
    stopped=stopped,
    accepted=jnp.sum(emitted[:, 1:], axis=1).astype(jnp.int32),
    next_logits=jnp.where(
      (shards.rows(kept) > 0)[:, None], after.astype(jnp.float32), next_logits
    ),
    processor_states=states,
    k=full.kv_cache.k,
    v=full.kv_cache.v,
  )
