"""The logits-processor interface: per-row state in, state out, on device.

The generate loop applies processors between the raw next-token logits and
the sampler, then advances their state with the sampled tokens:

  state = proc.init(batch, vocab)                # host: per-row arrays
  logits = proc.apply(state_of_rows, logits, info)   # masked / biased
  state = proc.update(state, tokens, info)       # every row's new state

A processor is a `flax.struct` dataclass: its array fields are traced
arguments of the compiled loop (new values of the same shapes do not
recompile), its `pytree_node=False` fields are static. Scores
(`per_token_scores`, top-n) are always taken from the *raw* logits
(DESIGN.md §4.1): processors only change which token is drawn.

Rules a processor keeps:
  * `init` returns a pytree of arrays whose leading axis is the batch;
  * `apply` and `update` are jittable (no Python branching on values, no
    host calls) and keep shapes and dtypes;
  * `apply` sees only the rows in `logits` (the loop hands it those rows of
    the state), `update` sees all rows; the loop itself keeps the old state
    of rows that are done, and skips both calls at a row's position 0
    (the BOS that opens an unprompted row).

`check(processors, batch=B, vocab=V, n_stop=n)` validates settings, traces
every call abstractly and raises ValueError naming the processor that is
not jittable or changes a shape, before any device work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass(kw_only=True)
class StepInfo:
  """What the loop knows about the rows at this step.

  Attributes:
    generated: int32[rows]: tokens each row has generated (and kept) so far
      in this call.
    remaining: int32[] or int32[rows]: columns left in this call's buffer
      (or each row's budget), this one included (a row that has not stopped
      after `remaining` more tokens ends with finish_reason "length").
    stop_ids: int32[n] or int32[rows, n]: the ids that end a row (EOS and
      `stop_ids`); per row in continuous batching, where each request has
      its own (padded with ids >= vocab, which match no token).

  `generate` passes the shared forms, `generate_many` the per-row ones; a
  processor reads them through `remaining_rows` and `stop_rows`, which
  broadcast against [rows, vocab] either way.
  """

  generated: jax.Array
  remaining: jax.Array
  stop_ids: jax.Array

  def stop_mask(self, vocab: int) -> jax.Array:
    """bool[vocab] (shared stop ids) or bool[rows, vocab] (per row): True
    at the stop ids."""
    if self.stop_ids.ndim == 1:
      return jnp.zeros(vocab, bool).at[self.stop_ids].set(True)
    rows = jnp.arange(self.stop_ids.shape[0])[:, None]
    return (
      jnp.zeros((self.stop_ids.shape[0], vocab), bool)
      .at[rows, self.stop_ids]
      .set(True, mode="drop")
    )

  def stop_rows(self, vocab: int) -> jax.Array:
    """bool[1 or rows, vocab]: `stop_mask` shaped to broadcast over rows."""
    mask = self.stop_mask(vocab)
    return mask[None, :] if mask.ndim == 1 else mask

  def remaining_rows(self) -> jax.Array:
    """`remaining` shaped to broadcast against [rows, vocab]."""
    return self.remaining[:, None] if self.remaining.ndim else self.remaining

  def for_rows(self, rows) -> StepInfo:
    """The info of some rows: `rows` maps a per-row array to those rows."""
    return self.replace(
      generated=rows(self.generated),
      remaining=rows(self.remaining) if self.remaining.ndim else self.remaining,
      stop_ids=rows(self.stop_ids)
      if self.stop_ids.ndim == 2
      else self.stop_ids,
    )


class LogitsProcessor(struct.PyTreeNode):
  """Base class of logits processors (see the module docstring)."""

  def validate(self, vocab: int) -> None:
    """Raises ValueError for settings that do not fit a `vocab`-wide model
    (called on the host before any device work)."""
    del vocab

  def init(self, batch: int, vocab: int) -> Any:
    """The initial per-row state (arrays with leading axis `batch`)."""
    del batch, vocab
    return ()

  def for_loop(self) -> LogitsProcessor:
    """The processor the compiled loop carries. Settings that only `init`
    reads (and copies into the state) are dropped here, so that new values
    of them do not recompile the loop."""
    return self

  def apply(self, state: Any, logits: jax.Array, info: StepInfo) -> jax.Array:
    """f32[rows, V] logits -> f32[rows, V] (-inf forbids a token)."""
    raise NotImplementedError

  def update(self, state: Any, tokens: jax.Array, info: StepInfo) -> Any:
    """The state after every row drew `tokens` (int32[batch])."""
    del tokens, info
    return state


def keep_rows(keep: jax.Array, new: Any, old: Any) -> Any:
  """`new` where keep[b], else `old`, leaf by leaf (leading axis: rows)."""

  def pick(n, o):
    mask = keep.reshape(keep.shape + (1,) * (n.ndim - 1))
    return jnp.where(mask, n, o)

  return jax.tree.map(pick, new, old)


def as_tuple(processors) -> tuple:
  """A call's `processors` argument (one LogitsProcessor or a sequence of
  them) as a tuple; raises ValueError for anything else."""
  if isinstance(processors, LogitsProcessor):
    return (processors,)
  if isinstance(processors, (str, bytes)) or not isinstance(
    processors, Sequence
  ):
    raise ValueError(
      f"processors must be a list of chunkwise LogitsProcessors, got "
      f"{processors!r}"
    )
  return tuple(processors)


def check(
  processors: Sequence[LogitsProcessor],
  *,
  batch: int,
  vocab: int,
  n_stop: int,
  per_row: bool = False,
) -> tuple[tuple[LogitsProcessor, ...], tuple[Any, ...]]:
  """Validates processors on the host; returns (processors, init states).

  With `per_row`, they are traced with per-row `remaining` and `stop_ids`
  (`StepInfo`), as continuous batching runs them.

  Raises ValueError naming a processor that is not a `LogitsProcessor`,
  whose state has the wrong leading axis, or whose `apply` / `update` cannot
  be traced by `jax.jit` or changes a shape or dtype.
  """
  if isinstance(processors, LogitsProcessor):
    processors = (processors,)
  processors = tuple(processors)
  states = []
  for p in processors:
    if not isinstance(p, LogitsProcessor):
      raise ValueError(
        f"processors must be chunkwise LogitsProcessor instances "
        f"(chunkwise.processors), got {p!r}"
      )
    p.validate(vocab)
    state = jax.tree.map(np.asarray, p.init(batch, vocab))
    for leaf in jax.tree.leaves(state):
      if leaf.ndim == 0 or leaf.shape[0] != batch:
        raise ValueError(
          f"{type(p).__name__}.init({batch}, {vocab}) must return arrays "
          f"with a leading axis of {batch} rows, got shape {leaf.shape}"
        )
    info = StepInfo(
      generated=jax.ShapeDtypeStruct((batch,), jnp.int32),
      remaining=jax.ShapeDtypeStruct((batch,) if per_row else (), jnp.int32),
      stop_ids=jax.ShapeDtypeStruct(
        (batch, n_stop) if per_row else (n_stop,), jnp.int32
      ),
    )
    logits = jax.ShapeDtypeStruct((batch, vocab), jnp.float32)
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state
    )
    name = type(p).__name__
    p = p.for_loop()
    try:
      out = jax.eval_shape(
        lambda p, s, x, i: p.apply(s, x, i), p, abstract, logits, info
      )
      new = jax.eval_shape(
        lambda p, s, t, i: p.update(s, t, i), p, abstract, tokens, info
      )
    except Exception as e:
      raise ValueError(
        f"logits processor {name} is not jittable: its apply/update must "
        f"use jax.numpy on traced values only ({type(e).__name__}: {e})"
      ) from e
    if (out.shape, out.dtype) != (logits.shape, logits.dtype):
      raise ValueError(
        f"{name}.apply must return f32{list(logits.shape)} logits, got "
        f"{out.dtype}{list(out.shape)}"
      )
    if jax.tree.structure(new) != jax.tree.structure(abstract) or any(
      (a.shape, a.dtype) != (b.shape, b.dtype)
      for a, b in zip(
        jax.tree.leaves(new), jax.tree.leaves(abstract), strict=True
      )
    ):
      raise ValueError(
        f"{name}.update must return a state of the same structure, shapes "
        f"and dtypes as init's"
      )
    states.append(state)
  return tuple(p.for_loop() for p in processors), tuple(states)


def _same(a, b, *, values: bool = True) -> bool:
  """Whether two pytrees have one structure and leaves of the same shapes
  and dtypes (and, with `values`, equal values)."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  if ta != tb:
    return False
  for x, y in zip(la, lb, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape or x.dtype != y.dtype:
      return False
    if values and not np.array_equal(x, y):
      return False
  return True


def request_states(
  templates: Sequence[LogitsProcessor],
  loop_forms: Sequence[LogitsProcessor],
  given,
  vocab: int,
  what: str,
) -> tuple:
  """Each processor's initial state for one request of a long-running
  loop (leading axis 1): the request's own instance's (`given`, one per
  template, in order), else the template's. A request's instance must run
  the loop's program (`for_loop()` equal to the template's): only its
  state may differ. Raises ValueError naming `what` otherwise."""
  names = ", ".join(type(p).__name__ for p in templates) or "none"
  given = as_tuple(given)
  if given and len(given) != len(templates):
    raise ValueError(
      f"{what} gives {len(given)} processors; this loop runs "
      f"{len(templates)} ({names}): give one instance of each, in that "
      "order, or none"
    )
  states = []
  for i, template in enumerate(templates):
    p = given[i] if given else template
    if not isinstance(p, LogitsProcessor) or not _same(
      p.for_loop(), loop_forms[i]
    ):
      raise ValueError(
        f"{what}: processors[{i}] is {p!r}; this loop runs {names}: a "
        "request's processor must differ from the loop's only in its state "
        "(init), not in its loop form"
      )
    p.validate(vocab)
    state = jax.tree.map(np.asarray, p.init(1, vocab))
    like = jax.tree.map(np.asarray, template.init(1, vocab))
    if not _same(state, like, values=False):
      raise ValueError(
        f"{what}: processors[{i}] ({type(p).__name__}) has a state of other "
        "shapes than the loop's"
      )
    states.append(state)
  return tuple(states)
