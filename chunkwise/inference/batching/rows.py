"""A segment over some of the slots: the device side of slot buckets
(`buckets.py` chooses them on the host).

  view = take(state, rows)          # rows int32[n] of the slots
  state = put(state, run(..., view, ...), rows)
  run_rows = on_rows(slots.run)     # both around a loop function

The slots' small per-row arrays (results so far, next-token logits, done
flags, processor and speculation states) are gathered into a state of n
rows and put back after; their K/V stay where they are, read and written
in place through the rows' indices (`LayerKV.rows`) or, in a paged pool,
through their page tables. So a step costs the rows it runs, not the
slots, and no K/V moves when the set of running requests changes. A
padding row (index `state.slots`) is free and done: it reads nothing and
its writes are dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise.inference.batching.slots import SlotState
from chunkwise.inference.paging.paged_kv import PagedKV
from chunkwise.inference.speculation import SpecRows


def _take_rows(a: jax.Array, rows: jax.Array, fill=0) -> jax.Array:
  """a[rows] (rows past a: `fill`), by one lax.gather (jnp's indexing
  took milliseconds of tracing per array)."""
  numbers = lax.GatherDimensionNumbers(
    offset_dims=tuple(range(1, a.ndim)),
    collapsed_slice_dims=(0,),
    start_index_map=(0,),
  )
  got = lax.gather(
    a,
    jnp.minimum(rows, a.shape[0] - 1)[:, None],
    numbers,
    (1, *a.shape[1:]),
    mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
  )
  inside = (rows < a.shape[0]).reshape((-1,) + (1,) * (a.ndim - 1))
  return jnp.where(inside, got, jnp.asarray(fill, a.dtype))


def _put_rows(a: jax.Array, new: jax.Array, rows: jax.Array) -> jax.Array:
  """a with a[rows] = new (rows past a dropped), by one lax.scatter."""
  numbers = lax.ScatterDimensionNumbers(
    update_window_dims=tuple(range(1, a.ndim)),
    inserted_window_dims=(0,),
    scatter_dims_to_operand_dims=(0,),
  )
  return lax.scatter(
    a,
    rows[:, None],
    new.astype(a.dtype),
    numbers,
    mode=lax.GatherScatterMode.FILL_OR_DROP,
  )


def take(state: SlotState, rows: jax.Array) -> SlotState:
  """Slots `rows` (int32[n]; `state.slots` for a padding row: free, done,
  holding nothing) as a state of n rows for `run`: its per-row arrays
  gathered, its K/V read and written in place (`LayerKV.rows`; a pool's
  pages through the rows' tables). `put` writes it back."""
  cache = state.cache
  if isinstance(cache, PagedKV):
    pages = cache.k[0].shape[1]
    cache = cache.replace(
      table=_take_rows(cache.table, rows, pages),
      lengths=_take_rows(cache.lengths, rows),
    )
  else:
    cache = cache.replace(lengths=_take_rows(cache.lengths, rows), rows=rows)
  spec = state.spec
  if spec is not None:
    spec = spec.replace(
      **{f: _take_rows(getattr(spec, f), rows) for f in SpecRows.PER_ROW}
    )
  return state.replace(
    cache=cache,
    generated=_take_rows(state.generated, rows),
    tokens=_take_rows(state.tokens, rows),
    scores=_take_rows(state.scores, rows),
    top_ids=_take_rows(state.top_ids, rows),
    top_logprobs=_take_rows(state.top_logprobs, rows),
    next_logits=_take_rows(state.next_logits, rows),
    done=_take_rows(state.done, rows, True),
    stopped=_take_rows(state.stopped, rows),
    processor_states=jax.tree.map(
      lambda a: _take_rows(a, rows), state.processor_states
    ),
    spec=spec,
  )


def put(state: SlotState, view: SlotState, rows: jax.Array) -> SlotState:
  """`state` with `view` (what `run` made of `take(state, rows)`) in its
  slots `rows` (padding rows dropped)."""
  cache = view.cache.replace(
    lengths=_put_rows(state.cache.lengths, view.cache.lengths, rows)
  )
  if isinstance(cache, PagedKV):
    cache = cache.replace(table=state.cache.table)  # the host's
  else:
    cache = cache.replace(rows=None)
  spec = state.spec
  if spec is not None:
    spec = view.spec.replace(
      **{
        f: _put_rows(getattr(spec, f), getattr(view.spec, f), rows)
        for f in SpecRows.PER_ROW
      }
    )

  def back(name):
    return _put_rows(getattr(state, name), getattr(view, name), rows)

  return state.replace(
    cache=cache,
    **{
      name: back(name)
      for name in (
        "generated",
        "tokens",
        "scores",
        "top_ids",
        "top_logprobs",
        "next_logits",
        "done",
        "stopped",
      )
    },
    processor_states=jax.tree.map(
      lambda a, b: _put_rows(a, b, rows),
      state.processor_states,
      view.processor_states,
    ),
    spec=spec,
  )


def on_rows(run_fn: Callable) -> Callable:
  """`run_fn` (`run`, or its speculative twin) over the slots `rows` only
  (a keyword argument, int32[n]): `take`, run, `put`."""

  def run_rows(infer, weights, caches, state, inputs, *args, rows, **kwargs):
    view = run_fn(
      infer, weights, caches, take(state, rows), inputs, *args, **kwargs
    )
    return put(state, view, rows)

  return run_rows
