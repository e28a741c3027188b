"""`matmul(x, w, scale, nmajor=...)`: a decode-sized matmul reading the
weight in place, for fast numerics (`chunkwise.models.matmul`).

x: [M, K] (any float dtype; passed as f32). w: int8, bf16 or f32, [K, N]
(k-major) or [N, K] (n-major), or uint8 4-bit codes (`models.blocks`).
scale: f32 (or f16) [G, N] or [N, G], one per group of K / G
consecutive inputs, for an int8 or 4-bit weight (None for a float one).
Returns f32 [M, N]: the invariant kernel's product (`invariant.py`), whose
int8 form rounds x to int16 once per row and group; with few rows it is as
fast as a kernel free to sum in any order, so fast numerics use it too.
Registered for the CPU platform only: call it under
`lax.platform_dependent` with a plain twin for the others.
"""

from __future__ import annotations

import jax

from chunkwise.cpu_kernels.invariant import invariant_matmul


def matmul(
  x, w, scale=None, *, nmajor: bool, offset=None, act8: bool = False
) -> jax.Array:
  """uint8 `w`: 4-bit codes two to a byte along K ([K / 2, N] or
  [N, K / 2]); `offset` (like scale, int8 and 4-bit weights): w = code *
  scale + offset; `act8`: x rounded to int8 per block of 32 inputs, not
  int16 (`invariant_matmul`)."""
  int8 = w.dtype in (jax.numpy.int8, jax.numpy.uint8)
  return invariant_matmul(
    x[None],
    w[None],
    scale[None] if int8 else None,
    nmajor=nmajor,
    offset=None if offset is None else offset[None],
    act8=act8 and int8,
  )[0]
