"""Matmul precision: what every matmul and einsum of a model computes with.

A model's `precision` is one of

  "highest"  full f32 products (the default for f32 compute): scores match
             the CPU reference on every backend.
  "high"     GPU: bf16_3x where the backend has it (≈ f32); TPU: 3 bf16
             passes; CPU: as "highest".
  "default"  the backend's fastest: GPUs run f32 matmuls as TF32 (10-bit
             mantissa: scores move by ~1e-3 and greedy tokens can split
             from the CPU's), TPUs as one bf16 pass; CPU: as "highest".

bf16 compute defaults to "default" (its products are bf16 already). The
setting applies while a program is traced, through JAX's
`default_matmul_precision`, so it reaches every `lax.dot_general`,
`jnp.einsum` and fused collective matmul of the forward pass, the logits
and the sampling code alike, and a model's programs are compiled once per
precision. The CPU int8 / bf16 kernels (`chunkwise.cpu_kernels`) compute
in f32 whatever the setting.

  with_precision(fn, resolve(None, jnp.float32))   # traces fn at "highest"
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

PRECISIONS = ("default", "high", "highest")


def resolve(precision: str | None, compute_dtype) -> str:
  """`precision` checked, or the default for `compute_dtype`."""
  if precision is None:
    if jnp.dtype(compute_dtype) == jnp.float32:
      return "highest"
    return "default"
  if precision not in PRECISIONS:
    raise ValueError(
      f"precision={precision!r} is not a matmul precision; expected None "
      f"or one of {', '.join(PRECISIONS)}"
    )
  return precision


def with_precision(fn, precision: str):
  """`fn` traced under `jax.default_matmul_precision(precision)`."""

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    with jax.default_matmul_precision(precision):
      return fn(*args, **kwargs)

  return traced
