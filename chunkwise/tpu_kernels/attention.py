"""`attend(q, k, v, positions)`: causal attention whose every query row
gets the same bits whatever the batch, the other rows of its chunk, how
its context was cut into chunks, and how long the cache is: a Pallas TPU
kernel in tiles of fixed shape (invariant numerics on a TPU).

Each grid step takes `QUERY_ROWS` query rows of one kv head (its query
heads' rows side by side, so its keys and values are read once for all
of them) and `KEY_BLOCK` keys of the cache, in key order (the grid's
last, "arbitrary" axis), and carries each row's running max, total and
weighted values in VMEM (the online softmax). The products and the row
reductions have the same shapes in every call, so a row's operations do
not depend on its neighbours; a key after the row's position is masked
to -1e30, whose exp(-1e30 - max) is exactly 0 and whose max moves
nothing, so blocks that a row cannot see (a longer cache, or keys
written by a later chunk) leave its bits as they were. The plain twin
is XLA's softmax attention (`reference`), which tests compare it with
in Pallas' TPU interpret mode on the CPU.

  out = attend(q, k, v, positions)   # q [B, H, T, D] pre-scaled, k and v
                                     # [B, KV, S, D] (heads-major, as a TPU
                                     # reads them), positions int32 [B, T]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

QUERY_ROWS = 8
KEY_BLOCK = 128
_MASKED = -1e30


def _kernel(pos, q, k, v, out, m, total, acc, *, keys):
  kb = pl.program_id(3)

  @pl.when(kb == 0)
  def _():
    m[...] = jnp.full(m.shape, _MASKED, jnp.float32)
    total[...] = jnp.zeros(total.shape, jnp.float32)
    acc[...] = jnp.zeros(acc.shape, jnp.float32)

  dims = (((1,), (1,)), ((), ()))
  logits = jax.lax.dot_general(
    q[...], k[...], dims, preferred_element_type=jnp.float32
  )
  key = kb * keys + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
  logits = jnp.where(key <= pos[...], logits, _MASKED)
  m_new = jnp.maximum(m[...], jnp.max(logits, axis=1, keepdims=True))
  keep = jnp.exp(m[...] - m_new)
  p = jnp.exp(logits - m_new)
  total[...] = total[...] * keep + jnp.sum(p, axis=1, keepdims=True)
  acc[...] = acc[...] * keep + jnp.dot(
    p.astype(v.dtype), v[...], preferred_element_type=jnp.float32
  )
  m[...] = m_new

  @pl.when(kb == pl.num_programs(3) - 1)
  def _():
    out[...] = acc[...] / total[...]


def attend(q, k, v, positions, *, interpret: bool = False) -> jax.Array:
  """Causal attention of q [B, H, T, D] (pre-scaled) to k, v [B, KV, S,
  D] (H a multiple of KV: query head h reads kv head h // (H / KV)), a
  query at `positions` [B, T] seeing keys 0..position; f32 [B, H, T, D].
  Queries are padded to QUERY_ROWS, keys to KEY_BLOCK (masked)."""
  b, heads, t, d = q.shape
  kv_heads, s = k.shape[1], k.shape[2]
  if k.shape != (b, kv_heads, s, d) or v.shape != k.shape:
    raise ValueError(
      f"k {k.shape} and v {v.shape} must both be [{b}, kv_heads, S, {d}] "
      f"for q {q.shape}"
    )
  if heads % kv_heads:
    raise ValueError(f"{heads} query heads do not share {kv_heads} kv heads")
  if positions.shape != (b, t):
    raise ValueError(f"positions {positions.shape} must be [{b}, {t}]")
  group = heads // kv_heads
  # The query heads sharing a kv head go as one head's rows (g, t): its
  # keys and values are read once for all of them.
  q = q.reshape(b, kv_heads, group * t, d)
  positions = jnp.tile(positions, (1, group))
  rows_in = group * t
  tp, sp = (
    -(-rows_in // QUERY_ROWS) * QUERY_ROWS,
    -(-s // KEY_BLOCK) * KEY_BLOCK,
  )
  q = jnp.pad(q, ((0, 0), (0, 0), (0, tp - rows_in), (0, 0)))
  k = jnp.pad(k, ((0, 0), (0, 0), (0, sp - s), (0, 0)))
  v = jnp.pad(v, ((0, 0), (0, 0), (0, sp - s), (0, 0)))
  # Padded keys lie past every position they would be masked by; padded
  # queries see key 0 only (their rows are dropped).
  pos = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, tp - rows_in)))
  pos = jnp.minimum(pos, s - 1)[..., None]  # keys past the cache: masked
  rows = pl.BlockSpec(
    (None, None, QUERY_ROWS, d), lambda i, h, r, c: (i, h, r, 0)
  )
  keys = pl.BlockSpec(
    (None, None, KEY_BLOCK, d), lambda i, h, r, c: (i, h, c, 0)
  )
  stat = pltpu.VMEM((QUERY_ROWS, 1), jnp.float32)
  out = pl.pallas_call(
    functools.partial(_kernel, keys=KEY_BLOCK),
    grid=(b, kv_heads, tp // QUERY_ROWS, sp // KEY_BLOCK),
    in_specs=[
      pl.BlockSpec((None, QUERY_ROWS, 1), lambda i, h, r, c: (i, r, 0)),
      rows,
      keys,
      keys,
    ],
    out_specs=rows,
    out_shape=jax.ShapeDtypeStruct((b, kv_heads, tp, d), jnp.float32),
    scratch_shapes=[stat, stat, pltpu.VMEM((QUERY_ROWS, d), jnp.float32)],
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
    ),
    cost_estimate=pl.CostEstimate(
      flops=4 * b * kv_heads * tp * sp * d,
      transcendentals=b * kv_heads * tp * sp,
      bytes_accessed=(
        q.size * (q.dtype.itemsize + 4)  # q read, f32 out written
        + 2 * k.size * k.dtype.itemsize * (tp // QUERY_ROWS)
      ),
    ),
    interpret=pltpu.InterpretParams() if interpret else False,
    name="chunkwise_tpu_invariant_attention",
  )(pos, q, k, v)
  return out[:, :, :rows_in].reshape(b, heads, t, d)


def reference(q, k, v, positions) -> jax.Array:
  """The plain twin: XLA's causal softmax attention, f32."""
  group = q.shape[1] // k.shape[1]
  k = jnp.repeat(k, group, axis=1).astype(jnp.float32)
  v = jnp.repeat(v, group, axis=1).astype(jnp.float32)
  logits = jnp.einsum("bhtd,bhsd->bhts", q.astype(jnp.float32), k)
  seen = jnp.arange(k.shape[2]) <= positions[:, None, :, None]
  weights = jax.nn.softmax(jnp.where(seen, logits, _MASKED), axis=-1)
  return jnp.einsum("bhts,bhsd->bhtd", weights, v)
