"""Rotary position embeddings: frequencies per layer, and the rotation.

  rotations = rope.per_layer(hparams, positions)  # one per layer, made once
  q = rope.rotate(q, positions, rotations[i])     # [B, T, heads, head_dim]

A `Rotation` is the inverse frequencies (f32[rotary_dim / 2]) of one layer
and the multiplier of its cos and sin (YaRN's and LongRoPE's attention
factor; 1 otherwise). The frequencies follow transformers' formulas for
each `RopeScaling` kind, computed in f32 as transformers computes them.
Two kinds depend on the call: "dynamic" grows its base and "longrope"
switches to its long factors once the call's longest position (the max of
`positions` over every row, padding included) passes the pretraining
context, so `per_layer` is given the whole call's positions, before any
layout cuts them into rows. Keys cached by earlier calls keep the rotation
they were made with, as in transformers' forward with a cache and in vLLM;
transformers' `generate` for Phi-3 instead recomputes its whole cache when
a sequence crosses the pretraining context. Prefill a sequence that will
cross it in one call (or start past it) to get that model's full-sequence
numbers.

Rotation is rotate-half over the first `rotary_dim` dims of each head (the
pairs (i, i + rotary_dim / 2)); the other dims pass through unchanged.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise import numerics
from chunkwise.configs import HParams
from chunkwise.configs.rope import RopeKind, RopeScaling


class Rotation(NamedTuple):
  """One layer's RoPE: inverse frequencies and the cos/sin multiplier."""

  inv_freq: jax.Array  # f32[rotary_dim / 2]
  scale: jax.Array | float  # f32[] or 1.0


def _base_inv_freq(base: float, dim: int) -> jax.Array:
  """1 / base^(2i / dim) in f32, by XLA as every chunkwise release has
  computed it (numpy's pow differs in the last bit)."""
  return 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def _llama3(inv: jax.Array, s: RopeScaling) -> jax.Array:
  old = s.original_max_len
  low_wavelen = old / s.low_freq_factor
  high_wavelen = old / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
  smooth = (old / wavelen - s.low_freq_factor) / (
    s.high_freq_factor - s.low_freq_factor
  )
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return jnp.where(medium, smoothed, scaled)


def _yarn_scale(s: RopeScaling) -> float:
  if s.attention_factor is not None:
    return s.attention_factor

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if s.mscale and s.mscale_all_dim:
    return mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
  return mscale(s.factor)


def _yarn(base: float, dim: int, s: RopeScaling) -> jax.Array:
  def correction_dim(rotations):
    return (dim * math.log(s.original_max_len / (rotations * 2 * math.pi))) / (
      2 * math.log(base)
    )

  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = jnp.clip(
    (jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1
  )
  extrapolation = 1 - ramp
  pos = base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  inv_extra = 1.0 / pos
  inv_inter = 1.0 / (s.factor * pos)
  return inv_inter * (1 - extrapolation) + inv_extra * extrapolation


def _longrope_scale(s: RopeScaling) -> float:
  if s.attention_factor is not None:
    return s.attention_factor
  if s.factor <= 1.0:
    return 1.0
  return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_len))


def rotation(
  base: float, scaling: RopeScaling | None, dim: int, seq_len: jax.Array
) -> Rotation:
  """The `Rotation` of RoPE with `base` and `scaling` over `dim` rotated
  dims, for a call whose longest position + 1 is `seq_len` (int32[])."""
  if scaling is None:
    return Rotation(_base_inv_freq(base, dim), 1.0)
  kind = scaling.kind
  if kind == RopeKind.LINEAR:
    return Rotation(_base_inv_freq(base, dim) / scaling.factor, 1.0)
  if kind == RopeKind.LLAMA3:
    return Rotation(_llama3(_base_inv_freq(base, dim), scaling), 1.0)
  if kind == RopeKind.YARN:
    return Rotation(_yarn(base, dim, scaling), _yarn_scale(scaling))
  exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
  if kind == RopeKind.FACTORS:
    factors = jnp.asarray(scaling.short_factors, jnp.float32)
    return Rotation(1.0 / (factors * base**exponents), 1.0)
  if kind == RopeKind.LONGROPE:
    factors = jnp.where(
      seq_len > scaling.original_max_len,
      jnp.asarray(scaling.long_factors, jnp.float32),
      jnp.asarray(scaling.short_factors, jnp.float32),
    )
    return Rotation(1.0 / (factors * base**exponents), _longrope_scale(scaling))
  if kind == RopeKind.DYNAMIC:
    original = scaling.original_max_len
    length = jnp.maximum(seq_len, original).astype(jnp.float32)
    grown = base * (
      (scaling.factor * length / original) - (scaling.factor - 1)
    ) ** (dim / (dim - 2))
    return Rotation(1.0 / (grown**exponents), 1.0)
  raise ValueError(f"no RoPE for scaling kind {kind}")


def per_layer(hparams: HParams, positions: jax.Array) -> tuple[Rotation, ...]:
  """Every layer's `Rotation` for a call at `positions` (int32[B, T], all
  of the call's rows); layers with the same RoPE share one."""
  seq_len = jnp.max(positions, initial=0) + 1
  made: dict = {}
  out = []
  for i in range(hparams.layers):
    key = hparams.rope(i)
    if key not in made:
      made[key] = rotation(*key, hparams.rotary_width, seq_len)
    out.append(made[key])
  return tuple(out)


def _sin_cos(angles: jax.Array, heads: int) -> tuple[jax.Array, jax.Array]:
  """sin and cos of `angles`, computed once per angle on the CPU.

  Fused into the rotation, XLA:CPU evaluates both for every head and both
  halves of every row (7% of a 512-token prefill); its optimization barrier
  is removed before fusion, so a conditional (whose branches agree) is what
  stores them. Few rows (decode) keep the fused form: no extra thunk.
  """

  def plain(a):
    return jnp.sin(a), jnp.cos(a)

  if angles.size * heads < 4096:
    return plain(angles)

  def stored(a):
    return lax.cond(jnp.isnan(a.ravel()[0]), plain, plain, a)

  return lax.platform_dependent(angles, cpu=stored, default=plain)


def rotate(x: jax.Array, positions: jax.Array, r: Rotation) -> jax.Array:
  """Rotary position embedding, rotate-half layout.

  Args:
    x: [batch, time, heads, head_dim].
    positions: int32[batch, time], absolute positions of the tokens.
    r: the layer's `Rotation`.
  Returns:
    x with each pair (i, i + rotary_dim/2) of its first rotary_dim dims
    rotated by position * inv_freq[i] (cos and sin times `r.scale`).
  """
  rotary = 2 * r.inv_freq.shape[0]
  # Highest precision: a bf16 angle would round position 257 to 256.
  angles = positions.astype(jnp.float32)[..., None] * r.inv_freq  # [B,T,D/2]
  sin, cos = _sin_cos(angles, x.shape[2])
  if not (isinstance(r.scale, float) and r.scale == 1.0):
    sin, cos = sin * r.scale, cos * r.scale
  sin, cos = sin[:, :, None, :], cos[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32[..., :rotary], 2, axis=-1)
  if numerics.runs_on("tpu"):
    out = _whole_heads(x32[..., :rotary], sin, cos)
  else:
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  if rotary < x.shape[-1]:
    out = jnp.concatenate([out, x32[..., rotary:]], axis=-1)
  return out.astype(x.dtype)


def _whole_heads(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
  """The rotation of x (the rotary dims, f32) in a TPU program: (x1, x2)
  * (cos, cos) + (x2, x1) *
  (-sin, sin), one elementwise expression over whole heads, where the two
  halves computed apart and concatenated were two small ops more a layer
  for XLA:TPU. The same products and sums as the pairs' x1 cos - x2 sin
  and x2 cos + x1 sin (`rotate`'s form elsewhere, its plain twin); the
  compiler may fuse them into multiply-adds differently, so the last bit
  may differ (XLA:CPU does)."""
  x1, x2 = jnp.split(x, 2, axis=-1)
  swapped = jnp.concatenate([x2, x1], axis=-1)
  cos2 = jnp.concatenate([cos, cos], axis=-1)
  sin2 = jnp.concatenate([-sin, sin], axis=-1)
  return x * cos2 + swapped * sin2
