"""`matmul(x, w, scale, nmajor=...)`: `matmul.cc` called through `jax.ffi`.

x: [M, K] (any float dtype; passed as f32). w: int8, bf16 or f32, [K, N]
(k-major) or [N, K] (n-major). scale: f32 [G, N] or [N, G], one per group
of K / G consecutive inputs (ones of [1, N] / [N, 1] for a float weight).
Returns f32 [M, N] = x @ (w * scale repeated over its groups). The kernel
is registered for the CPU platform only: call it under
`lax.platform_dependent` with a plain twin for the others
(`chunkwise.models.matmul`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from chunkwise.cpu_kernels import build


def matmul(x, w, scale, *, nmajor: bool) -> jax.Array:
  m = x.shape[0]
  n = w.shape[0] if nmajor else w.shape[1]
  return jax.ffi.ffi_call(
    build.TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32)
  )(x.astype(jnp.float32), w, scale.astype(jnp.float32), nmajor=int(nmajor))
