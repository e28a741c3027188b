"""What both constraint processors (`processor.py`'s eager tables,
`walk.py`'s lazy DFAs) share: each row's (grammar, state), the
power-of-two buckets their tables are padded to, and budget
forcing on the device: once few columns remain, a token is allowed only
if the automaton can still reach a final state and emit a stop id in
the columns left (`distance[next] + 2 <= remaining`), so every
constrained row ends with a stop within its steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def bucket(n: int, minimum: int) -> int:
  """The power of two at least `n` (and `minimum`) a table is padded to."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


class RowGrammars:
  """A constraint processor's per-row state, (grammar ids, states), from
  its `row_grammar` (a field the loop drops: new rows' grammars do not
  recompile it); states start at 0."""

  def init(self, batch, vocab):
    g = np.asarray(self.row_grammar, np.int32)
    return (g, np.zeros(batch, np.int32))

  def for_loop(self):
    return self.replace(row_grammar=())


def close_within(allowed, far_of, g, info, max_distance) -> jax.Array:
  """`allowed` (bool[rows, V]) narrowed to the tokens whose next state's
  distance (`far_of()`: int32[rows, V], computed only when some row needs
  it) fits the row's remaining columns; stop ids always fit, and free
  rows (grammar 0) are left alone."""
  is_stop = info.stop_rows(allowed.shape[-1])

  def closing(allowed):
    fits = (far_of() + 2 <= info.remaining_rows()) | is_stop
    return allowed & (fits | (g == 0)[:, None])

  # Only a shortcut: with more columns left on every constrained row,
  # every token fits (free rows, and a loop's empty slots, ignored).
  left = jnp.where(g > 0, info.remaining, jnp.iinfo(jnp.int32).max)
  return lax.cond(
    jnp.min(left) <= max_distance + 2, closing, lambda a: a, allowed
  )
