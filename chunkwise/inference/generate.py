"""The generate loop: sample, then step, on device until every row stops.

  state = init(infer, weights, caches, prev_logits, batch=B, steps=16, ...)
  state = run(infer, weights, caches, state, inputs, stop_at=16)
  tokens, result = finish(state)             # (Chunk, ChunkResult)

Each iteration of the `lax.while_loop`:
  1. key_b = fold_in(fold_in(key(seed), sample_ids[b]), position_b), where
     position_b counts row b's tokens so far, prefixes included;
  2. token = sample(processed, key, sampling), where `processed` are the
     next logits after the logits processors (`chunkwise.processors`:
     bans, penalties, constraints...); its score and top-n are taken from
     the raw logits; the processors' per-row states then see the token;
  3. a row whose token is a stop id is done: the stop token is written at
     column `lengths[b]` but not counted, and its next-token logits freeze
     (the BOS that opens an unprompted row at position 0 never stops it);
  4. one forward step of the [B, 1] token chunk against the prefixes plus
     the tokens generated so far (this buffer is just one more prefix),
     writing K/V into slot `step`.
The loop ends at `stop_at` or as soon as every row is done. Because `run`
can be resumed from its state, `generate_stream` runs the very same program
in segments: its output concatenates to exactly what one call returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

from chunkwise.inference.chunk import Chunk
from chunkwise.inference.infer import InferFn
from chunkwise.inference.kv_cache import (
  KVCache,
  LayerKV,
  by_layer,
  total_lengths,
)
from chunkwise.inference.logits import LogitsShards
from chunkwise.inference.results import ChunkResult
from chunkwise.inference.sampling import Sampling
from chunkwise.inference.speculation import SpecRows
from chunkwise.partitioning import axes as ax
from chunkwise.processors import StepInfo, keep_rows


@struct.dataclass(kw_only=True)
class LoopInputs:
  """What stays fixed during one generation."""

  sample_ids: jax.Array  # int32[batch]
  start: jax.Array  # int32[batch]: tokens before the first generated one
  sampling: Sampling  # per-row arrays
  stop_ids: jax.Array  # int32[n_stop]
  processors: tuple = ()  # LogitsProcessors (their arrays are traced)

  @classmethod
  def axes(cls, processors: tuple = ()) -> LoopInputs:
    """Processors' arrays (e.g. constraint tables) are replicated."""
    rows = P(ax.BATCH)
    return cls(
      sample_ids=rows,
      start=rows,
      sampling=Sampling(
        temperature=rows, top_k=rows, top_p=rows, min_p=rows, seed=P()
      ),
      stop_ids=P(None),
      processors=_replicated(processors),
    )


def _replicated(tree):
  return jax.tree.map(lambda _: P(), tree)


@struct.dataclass(kw_only=True)
class LoopState:
  """Everything the loop carries; buffers are `steps` columns wide."""

  step: jax.Array  # int32[]: the next column to write
  tokens: jax.Array  # int32[batch, steps]
  scores: jax.Array  # f32[batch, steps]
  top_ids: jax.Array  # int32[batch, steps, n]
  top_logprobs: jax.Array  # f32[batch, steps, n]
  cache: LayerKV  # generated K/V; lengths = tokens kept per row
  next_logits: jax.Array  # f32[batch, vocab]
  done: jax.Array  # bool[batch]
  processor_states: tuple = ()  # one per-row state per processor
  spec: SpecRows | None = None  # with speculation (`speculative.run`)

  @classmethod
  def axes(
    cls, layers: int, processor_states: tuple = (), spec: bool = False
  ) -> LoopState:
    """Small per-row buffers (processor and speculation states too) are
    replicated; the KV buffer (of `layers` arrays) and the logits are split
    like any KV cache and next-token logits."""
    rows = P(ax.BATCH, ax.TIME)
    top = P(ax.BATCH, ax.TIME, ax.TOP_N)
    return cls(
      step=P(),
      tokens=rows,
      scores=rows,
      top_ids=top,
      top_logprobs=top,
      cache=LayerKV.axes(layers),
      next_logits=P(ax.LOGITS_BATCH, ax.LOGITS_VOCAB),
      done=P(ax.BATCH),
      processor_states=_replicated(processor_states),
      spec=SpecRows.axes() if spec else None,
    )


def init(
  infer: InferFn,
  weights,
  caches: Sequence[KVCache],
  prev_logits: jax.Array | None,
  *,
  batch: int,
  steps: int,
  top_n: int,
  vocab: int,
  bos_id: int,
  shards: LogitsShards | None = None,
  prev_split: bool = True,
) -> LoopState:
  """An empty state; the first token is sampled from `prev_logits` (the last
  prefix's next-token logits, or the BOS distribution without prefix).

  Under `shard_map`, `shards` says how this device holds logits (see
  `logits.LogitsShards`) and `prev_split` whether `prev_logits` is cut like
  them; the KV buffer takes this device's shape of the cache `infer` makes.
  """
  shards = shards or LogitsShards(vocab=vocab)
  next_logits = shards.carried(prev_logits, batch, bos_id, prev_split)
  # The buffer takes whatever K/V shape and dtype `infer` produces.
  step_chunk = Chunk(
    tokens=jnp.zeros((batch, 1), jnp.int32),
    lengths=jnp.ones((batch,), jnp.int32),
  )
  kv = jax.eval_shape(infer, weights, tuple(caches), step_chunk).kv_cache.k
  cache = LayerKV.zeros(kv, steps, batch)
  return LoopState(
    step=jnp.zeros((), jnp.int32),
    tokens=jnp.zeros((batch, steps), jnp.int32),
    scores=jnp.zeros((batch, steps), jnp.float32),
    top_ids=jnp.zeros((batch, steps, top_n), jnp.int32),
    top_logprobs=jnp.zeros((batch, steps, top_n), jnp.float32),
    cache=cache,
    next_logits=next_logits,
    done=jnp.zeros((batch,), bool),
  )


def _write_column(
  buffer: jax.Array, column: jax.Array, step: jax.Array
) -> jax.Array:
  """buffer[:, step] = column (buffer [batch, steps, ...])."""
  return lax.dynamic_update_index_in_dim(buffer, column, step, axis=1)


def _step(
  infer: InferFn,
  shards: LogitsShards,
  weights,
  caches: tuple[KVCache, ...],
  inputs: LoopInputs,
  state: LoopState,
) -> LoopState:
  i = state.step
  live = ~state.done
  positions = inputs.start + state.cache.lengths
  info = StepInfo(
    generated=state.cache.lengths,
    remaining=state.tokens.shape[1] - i,
    stop_ids=inputs.stop_ids,
  )
  (token, score, top_ids, top_logprobs), stop, keep, processor_states = draw(
    shards,
    state.next_logits,
    inputs,
    positions,
    state.top_ids.shape[-1],
    state.processor_states,
    info,
    live,
  )

  chunk = Chunk(tokens=token[:, None], lengths=keep.astype(jnp.int32))
  full = infer(weights, (*caches, state.cache), chunk)
  # Column i of the buffer is written by the next step (`_write_pending`),
  # before anything reads the buffer; this step returns it.
  cache = state.cache.replace(
    lengths=state.cache.lengths + keep.astype(jnp.int32)
  )

  def column(new, old):
    mask = live.reshape(live.shape + (1,) * (new.ndim - 1))
    return _write_column(old, jnp.where(mask, new, 0).astype(old.dtype), i)

  step_state = LoopState(
    step=i + 1,
    tokens=column(token, state.tokens),
    scores=column(score, state.scores),
    top_ids=column(top_ids, state.top_ids),
    top_logprobs=column(top_logprobs, state.top_logprobs),
    cache=cache,
    next_logits=jnp.where(
      shards.rows(keep)[:, None], full.logits[:, 0], state.next_logits
    ),
    done=state.done | stop,
    processor_states=processor_states,
  )
  return step_state, by_layer(full.kv_cache.k, full.kv_cache.v)


def draw(
  shards: LogitsShards,
  next_logits: jax.Array,
  inputs,
  positions: jax.Array,
  top_n: int,
  processor_states: tuple,
  info: StepInfo,
  live: jax.Array,
):
  """A step's tokens for every row, and what they stop (shared by this loop
  and `slots`'s). `inputs` has the rows' sample_ids, sampling, processors.

  Returns ((token, score, top_ids, top_logprobs), stop, keep, processor
  states): `stop` where the token is a stop id (of `info.stop_ids`, shared
  or per row), `keep` where a live row keeps its token.
  """
  token, score, top_ids, top_logprobs = shards.sample(
    next_logits,
    inputs.sampling,
    inputs.sample_ids,
    positions,
    top_n,
    inputs.processors,
    processor_states,
    info,
  )
  # Position 0 always holds BOS (the only token the BOS distribution allows):
  # it starts a sequence and never stops one, even where BOS is also EOS.
  stop = is_stop(token, info.stop_ids, positions)
  keep = live & ~stop
  processor_states = keep_rows(
    keep & (positions > 0),
    tuple(
      p.update(s, token, info)
      for p, s in zip(inputs.processors, processor_states, strict=True)
    ),
    processor_states,
  )
  return (token, score, top_ids, top_logprobs), stop, keep, processor_states


def is_stop(token: jax.Array, stop_ids: jax.Array, positions: jax.Array):
  """Where `token` (int32[rows]) is a stop id (shared int32[n] or per row
  int32[rows, n]); never at position 0 (the BOS that opens a row)."""
  stop_ids = stop_ids if stop_ids.ndim == 2 else stop_ids[None, :]
  return jnp.any(token[:, None] == stop_ids, axis=-1) & (positions > 0)


def _write_pending(state: LoopState, pending) -> LoopState:
  """Writes `pending` (the K/V of column step - 1) into the buffer.

  The loop writes a step's K/V at the start of the next step, so in every
  step the write is the buffer's first use and the reads come after it:
  written at the end of the step that computes it, XLA could schedule the
  write before the last layers' reads and so copied the whole buffer
  twice a step (the K/V of a step are computed in each layer before its
  attention reads the buffer)."""
  at = jnp.maximum(state.step - 1, 0)
  return state.replace(cache=state.cache.write(*pending, at))


def run(
  infer: InferFn,
  weights,
  caches: Sequence[KVCache],
  state: LoopState,
  inputs: LoopInputs,
  stop_at: jax.Array,
  shards: LogitsShards | None = None,
) -> LoopState:
  """Runs the loop from `state.step` until `stop_at` or all rows are done;
  the returned state's K/V buffer holds every column computed so far."""
  caches = tuple(caches)
  shards = shards or LogitsShards(vocab=state.next_logits.shape[-1])
  limit = jnp.minimum(stop_at, state.tokens.shape[1])

  def cond(carry):
    state, _ = carry
    return (state.step < limit) & ~jnp.all(state.done)

  def body(carry):
    state = _write_pending(*carry)
    return _step(infer, shards, weights, caches, inputs, state)

  # Nothing is pending on entry: column step - 1 is already written (or,
  # at step 0, about to be), so its own contents are written back.
  pending = by_layer(*state.cache.read(jnp.maximum(state.step - 1, 0), 1))
  return _write_pending(*lax.while_loop(cond, body, (state, pending)))


def loop_inputs(
  caches: Sequence[KVCache],
  sample_ids: jax.Array,
  sampling: Sampling,
  stop_ids: jax.Array,
  processors: tuple = (),
) -> LoopInputs:
  """The loop's constant inputs; `start` sums each row's prefix lengths."""
  sample_ids = jnp.asarray(sample_ids, jnp.int32)
  return LoopInputs(
    sample_ids=sample_ids,
    start=total_lengths([c.lengths for c in caches], sample_ids.shape[0]),
    sampling=sampling,
    stop_ids=jnp.asarray(stop_ids, jnp.int32),
    processors=tuple(processors),
  )


def segment(
  state: LoopState, begin: int, end: int
) -> tuple[Chunk, ChunkResult]:
  """Columns [begin, end) of the state as a (Chunk, ChunkResult) pair."""
  lengths = jnp.clip(state.cache.lengths - begin, 0, end - begin)
  cache = state.cache.cache(begin, end, lengths)
  chunk = Chunk(tokens=state.tokens[:, begin:end], lengths=lengths)
  result = ChunkResult(
    per_token_scores=state.scores[:, begin:end],
    top_ids=state.top_ids[:, begin:end],
    top_logprobs=state.top_logprobs[:, begin:end],
    # A copy: the state is donated to the next segment's run.
    next_token_logits=jnp.copy(state.next_logits),
    kv_cache=cache,
  )
  return chunk, result


def finish(state: LoopState) -> tuple[Chunk, ChunkResult]:
  """The whole buffer as a (Chunk, ChunkResult) pair."""
  return segment(state, 0, state.tokens.shape[1])
