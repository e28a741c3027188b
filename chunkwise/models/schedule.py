"""`after(x, a)`: `a`, computed no earlier than `x`.

XLA:CPU computes whatever reads only a program's parameters as soon as it
can: every layer's weight cast (bf16 or int8 weights under f32
activations) and every layer's slice of a stacked K/V cache that a loop
reads (a `while` takes its operands whole) run at the program's start,
all live at once. For Llama-3.2-1B prefilling a piece after a 32k-token
buffer that is 4.9 GB of cast weights and 2.1 GB of cache slices beside
the weights and the cache themselves. An optimization barrier does not
help: XLA:CPU removes barriers before scheduling. What does is a data
dependency: a select of `a` on a predicate of x's first element that
always holds (its bits with the lowest set are never 0). The select fuses
with what computes `a` (the cast, the slice), so nothing is copied that
was not copied already, no value changes, and NaNs cannot spread from x.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_INTS = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def after(x: jax.Array, a):
  """`a` (an array or a pytree of them) computed once `x` is."""
  first = x.reshape(-1)[0]
  bits = lax.bitcast_convert_type(first, _INTS[first.dtype.itemsize])
  keep = (bits | 1) != 0
  return jax.tree.map(lambda v: jnp.where(keep, v, jnp.zeros((), v.dtype)), a)
