"""`contract(eq, x, w)`: an activation times a weight, the weight read in
place.

`jnp.einsum` orders the contracted letters as a set does, so for
"bthd,hde->bte" it may contract (d, h) and XLA then transposes the weight
[h, d, e] into [d, h, e], a copy of the whole weight per call. Here the
contracted letters follow their order in the weight, which the weight's
row-major layout makes a free reshape to [h·d, e]. Output letters in
another order than x's free letters then w's cost a transpose of the
output (an activation), never of the weight. Letters in both inputs and
the output (batch dims) are not supported. Under invariant numerics
the product runs in `numerics.matmul`: `chunkwise.numerics` (a module
above this one, which imports nothing) registers that as `_override` when
it is imported. A quantized `w` (an int8 `QArray` or GGUF `BlockArray`,
which the collective matmuls pass on as they are) goes to
`models.matmul.weight_matmul`, registered as `_quantized`: the weight read
as stored (the CPU kernel, or the Pallas TPU kernel), never dequantized
whole.

  out = contract("bthd,hde->bte", x, w)     # == jnp.einsum(...)
"""

from __future__ import annotations

import functools

import jax
from jax import lax

# (eq, x, w) -> the product, or None for XLA's dot (set by chunkwise.numerics).
_override = None
# (eq, x, w) -> the product of a quantized w (set by chunkwise.models.matmul).
_quantized = None
# (eq, x, w) -> the product on a TPU through the Pallas kernel
# (an f32 w at precision "highest", or few rows), or None for XLA's dot
# (set by chunkwise.models.matmul).
_tpu = None


@functools.cache
def contract_dims(eq: str):
  """(x's contracted dims, w's contracted dims in w's order, the output
  permutation or None) of `eq`."""
  inputs, out = eq.replace(" ", "").split("->")
  lhs, rhs = inputs.split(",")
  contracted = [c for c in rhs if c in lhs and c not in out]
  free = [c for c in lhs if c not in contracted] + [
    c for c in rhs if c not in contracted
  ]
  if sorted(free) != sorted(out) or len(set(free)) != len(free):
    raise ValueError(
      f"contract {eq!r}: every input letter must be contracted or in the "
      "output, and no letter may be in both inputs and the output"
    )
  order = tuple(free.index(c) for c in out)
  return (
    tuple(lhs.index(c) for c in contracted),
    tuple(rhs.index(c) for c in contracted),
    None if order == tuple(range(len(out))) else order,
  )


def contract(eq: str, x: jax.Array, w: jax.Array, **kwargs) -> jax.Array:
  """`jnp.einsum(eq, x, w)` with the contraction in `w`'s own dim order;
  keyword arguments go to `lax.dot_general` (e.g. `precision`)."""
  if _quantized is not None and hasattr(w, "scale"):
    return _quantized(eq, x, w)
  if _override is not None:
    out = _override(eq, x, w)
    if out is not None:
      return out
  if _tpu is not None and not kwargs:
    out = _tpu(eq, x, w)
    if out is not None:
      return out
  lhs, rhs, order = contract_dims(eq)
  out = lax.dot_general(x, w, ((lhs, rhs), ((), ())), **kwargs)
  return out if order is None else out.transpose(order)
