"""`matmul(x, w, scale, nmajor=...)`: a decode-sized matmul reading the
weight in place, for fast numerics (`chunkwise.models.matmul`).

x: [M, K] (any float dtype; passed as f32). w: int8, bf16 or f32, [K, N]
(k-major) or [N, K] (n-major). scale: f32 [G, N] or [N, G], one per group
of K / G consecutive inputs, for an int8 weight (None for a float one).
Returns f32 [M, N]: the invariant kernel's product (`invariant.py`), whose
int8 form rounds x to int16 once per row and group; with few rows it is as
fast as a kernel free to sum in any order, so fast numerics use it too.
Registered for the CPU platform only: call it under
`lax.platform_dependent` with a plain twin for the others.
"""

from __future__ import annotations

import jax

from chunkwise.cpu_kernels.invariant import invariant_matmul


def matmul(x, w, scale=None, *, nmajor: bool) -> jax.Array:
  int8 = w.dtype == jax.numpy.int8
  return invariant_matmul(
    x[None], w[None], scale[None] if int8 else None, nmajor=nmajor
  )[0]
