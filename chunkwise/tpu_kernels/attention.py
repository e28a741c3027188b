"""`attend(q, k, v, positions)`: causal attention whose every query row
gets the same bits whatever the batch, the other rows of its chunk, how
its context was cut into chunks, and how long the cache is: a Pallas TPU
kernel in tiles of fixed shape (invariant numerics on a TPU). `parts` is
its core: one piece of context's unnormalised sums (max, total,
weighted values) for query rows that each see a range of its keys,
going on from the sums over the keys before it if given (`carry`),
which a TPU program under invariant numerics chains over a row's
context (`models.tpu_attention`).

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
in Pallas' interpret mode on the CPU.

  out = attend(q, k, v, positions)   # q [B, H, T, D] pre-scaled, k and v
                                     # [B, KV, S, D] (heads-major, as a TPU
                                     # reads them), positions int32 [B, T]
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

QUERY_ROWS = 8
KEY_BLOCK = 128
_MASKED = -1e30


def _kernel(lo, hi, q, k, v, *refs, **kw):
  if kw["carried"]:  # the sums so far, from the keys before this piece's
    m0, total0, acc0, m_out, total_out, acc_out, m, total, acc = refs
  else:
    m_out, total_out, acc_out, m, total, acc = refs
  kb = pl.program_id(3)

  @pl.when(kb == 0)
  def _():
    if kw["carried"]:
      m[...], total[...], acc[...] = m0[...], total0[...], acc0[...]
    else:
      m[...] = jnp.full(m.shape, _MASKED, jnp.float32)
      total[...] = jnp.zeros(total.shape, jnp.float32)
      acc[...] = jnp.zeros(acc.shape, jnp.float32)

  # keys [KEY_BLOCK, D], or [D, KEY_BLOCK] as a TPU stores a cache's
  dims = (((1,), (0 if kw["transposed"] else 1,)), ((), ()))
  logits = jax.lax.dot_general(
    q[...], k[...], dims, preferred_element_type=jnp.float32
  )
  if kw["softcap"] is not None:
    logits = kw["softcap"] * jnp.tanh(logits / kw["softcap"])
  key = kb * kw["keys"] + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
  logits = jnp.where((key >= lo[...]) & (key <= hi[...]), logits, _MASKED)
  m_new = jnp.maximum(m[...], jnp.max(logits, axis=1, keepdims=True))
  keep = jnp.exp(m[...] - m_new)
  # A masked key's exp(-1e30 - m) is 0, unless the row has seen no key
  # yet (m still -1e30): then it is masked again, so that a block a row
  # cannot see adds exact zeros to its sums.
  p = jnp.where(logits > _MASKED, jnp.exp(logits - m_new), 0.0)
  total[...] = total[...] * keep + jnp.sum(p, axis=1, keepdims=True)
  acc[...] = acc[...] * keep + jnp.dot(
    p.astype(v.dtype), v[...], preferred_element_type=jnp.float32
  )
  m[...] = m_new

  @pl.when(kb == pl.num_programs(3) - 1)
  def _():
    m_out[...] = m[...]
    total_out[...] = total[...]
    acc_out[...] = acc[...]


def attend(q, k, v, positions, *, interpret: bool = False) -> jax.Array:
  """Causal attention of q [B, H, T, D] (pre-scaled) to k, v [B, KV, S,
  D] (H a multiple of KV: query head h reads kv head h // (H / KV)), a
  query at `positions` [B, T] seeing keys 0..position; f32 [B, H, T, D].
  Queries are padded to QUERY_ROWS, keys to KEY_BLOCK (masked)."""
  b, heads, t, d = q.shape
  if k.ndim != 4 or k.shape[0] != b or k.shape[3] != d:
    raise ValueError(
      f"k {k.shape} and v {v.shape} must both be [{b}, kv_heads, S, {d}] "
      f"for q {q.shape}"
    )
  kv_heads = k.shape[1]
  if heads % kv_heads:
    raise ValueError(f"{heads} query heads do not share {kv_heads} kv heads")
  if positions.shape != (b, t):
    raise ValueError(f"positions {positions.shape} must be [{b}, {t}]")
  group = heads // kv_heads
  # The query heads sharing a kv head go as one head's rows (g, t): its
  # keys and values are read once for all of them.
  rows = q.reshape(b, kv_heads, group * t, d)
  hi = jnp.tile(positions, (1, group))
  _, total, acc = parts(rows, k, v, jnp.zeros_like(hi), hi, interpret=interpret)
  return (acc / total[..., None]).reshape(b, heads, t, d)


def parts(
  q,
  k,
  v,
  lo,
  hi,
  *,
  softcap=None,
  keys_transposed: bool = False,
  layer: int | None = None,
  carry: tuple | None = None,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Unnormalised attention of query rows q [b, KV, R, D] (pre-scaled; a
  kv head's rows, whatever they are: query heads, positions, rows of a
  batch sharing a piece) to one piece of context k, v [b, KV, S, D], row
  r seeing keys lo[b, r]..hi[b, r] (int32; an empty range sees none),
  logits capped at `softcap` (c * tanh(logit / c)) first if given: (max
  logit [b, KV, R], sum of exp(logit - max) [b, KV, R], exp-weighted sum
  of values f32[b, KV, R, D]), as the fast path's pieces are merged
  (`models.attention`). A row that sees no key has max -1e30 and sums 0.
  Rows are padded to QUERY_ROWS, keys to KEY_BLOCK (masked). With
  `keys_transposed`, k is [b, KV, D, S]: each head's keys as the [D, S]
  matrix the logits multiply, the order a TPU stores a cache's keys in
  (`partitioning.formats`), read in place. With `layer`, k and v are a
  whole stacked cache, [layers, ...] before those dims, read at that
  layer in place (XLA hands a Pallas call a copy of a slice). With
  `carry`, the (max, total, weighted values) that `parts` returned for
  the same rows over the keys before these, the online softmax goes on
  from them: a context cut into pieces whose keys start at multiples of
  KEY_BLOCK then takes the same steps as in one piece (the chunk split
  invisible: `models.tpu_attention`)."""
  b, kv_heads, rows_in, d = q.shape
  s = v.shape[-2]
  if layer is not None and s % KEY_BLOCK:  # padded: the layer's keys only
    k, v, layer = k[layer], v[layer], None
  if layer is not None:
    if not 0 <= layer < k.shape[0] or v.shape[0] != k.shape[0]:
      raise ValueError(
        f"layer {layer} of k {k.shape} and v {v.shape}: expected one of "
        f"their {k.shape[0]} layers"
      )
    stack = k.shape[:1]
  else:
    stack = ()
  k_one, v_one = k.shape[len(stack) :], v.shape[len(stack) :]
  want = (b, kv_heads, d, s) if keys_transposed else (b, kv_heads, s, d)
  if k_one != want or v_one != (b, kv_heads, s, d):
    raise ValueError(
      f"k {k.shape} must be [{', '.join(map(str, want))}] and v {v.shape} "
      f"[{b}, {kv_heads}, {s}, {d}] for query rows {q.shape}"
    )
  if lo.shape != (b, rows_in) or hi.shape != (b, rows_in):
    raise ValueError(
      f"lo {lo.shape} and hi {hi.shape} must both be [{b}, {rows_in}]"
    )
  if carry is not None:
    shapes = tuple(a.shape for a in carry)
    if shapes != ((b, kv_heads, rows_in), (b, kv_heads, rows_in), q.shape):
      raise ValueError(
        f"carry {shapes} must be the sums of these rows: "
        f"[{b}, {kv_heads}, {rows_in}] twice and {q.shape}"
      )
  tp, sp = (
    -(-rows_in // QUERY_ROWS) * QUERY_ROWS,
    -(-s // KEY_BLOCK) * KEY_BLOCK,
  )
  by_row = ((0, 0), (0, 0), (0, tp - rows_in), (0, 0))
  if tp != rows_in:
    q = jnp.pad(q, by_row)
  carried = ()
  if carry is not None:
    m0, total0, acc0 = (a.astype(jnp.float32) for a in carry)
    carried = (m0[..., None], total0[..., None], acc0)
    if tp != rows_in:
      carried = tuple(jnp.pad(a, by_row) for a in carried)
  if sp != s:
    by_time = ((0, 0), (0, 0), (0, sp - s), (0, 0))  # [b, KV, S, D]
    k = jnp.pad(
      k, (*by_time[:2], (0, 0), (0, sp - s)) if keys_transposed else by_time
    )
    v = jnp.pad(v, by_time)
  # Padded keys lie past every row's last (keys past the piece: masked);
  # padded query rows see none (their rows are dropped).
  bounds = [a.astype(jnp.int32) for a in (lo, jnp.minimum(hi, s - 1))]
  if tp != rows_in:
    bounds = [
      jnp.pad(a, ((0, 0), (0, tp - rows_in)), constant_values=c)
      for a, c in zip(bounds, (0, -1), strict=True)
    ]
  lo, hi = (a[..., None] for a in bounds)
  rows = pl.BlockSpec(
    (None, None, QUERY_ROWS, d), lambda i, h, r, c: (i, h, r, 0)
  )
  at = () if layer is None else (layer,)  # the layer's block, if stacked
  lead = (None,) * (2 + len(at))
  keys = pl.BlockSpec(
    (*lead, KEY_BLOCK, d), lambda i, h, r, c: (*at, i, h, c, 0)
  )
  keys_in = keys
  if keys_transposed:
    keys_in = pl.BlockSpec(
      (*lead, d, KEY_BLOCK), lambda i, h, r, c: (*at, i, h, 0, c)
    )
  bound = pl.BlockSpec((None, QUERY_ROWS, 1), lambda i, h, r, c: (i, r, 0))
  stat = pl.BlockSpec(
    (None, None, QUERY_ROWS, 1), lambda i, h, r, c: (i, h, r, 0)
  )
  stat_vmem = pltpu.VMEM((QUERY_ROWS, 1), jnp.float32)
  m, total, acc = pl.pallas_call(
    functools.partial(
      _kernel,
      keys=KEY_BLOCK,
      softcap=softcap,
      transposed=keys_transposed,
      carried=bool(carried),
    ),
    grid=(b, kv_heads, tp // QUERY_ROWS, sp // KEY_BLOCK),
    in_specs=[bound, bound, rows, keys_in, keys]
    + ([stat, stat, rows] if carried else []),
    out_specs=[stat, stat, rows],
    out_shape=[
      jax.ShapeDtypeStruct((b, kv_heads, tp, 1), jnp.float32),
      jax.ShapeDtypeStruct((b, kv_heads, tp, 1), jnp.float32),
      jax.ShapeDtypeStruct((b, kv_heads, tp, d), jnp.float32),
    ],
    scratch_shapes=[
      stat_vmem,
      stat_vmem,
      pltpu.VMEM((QUERY_ROWS, d), jnp.float32),
    ],
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
    ),
    cost_estimate=pl.CostEstimate(
      flops=4 * b * kv_heads * tp * sp * d,
      transcendentals=b * kv_heads * tp * sp * (1 + (softcap is not None)),
      bytes_accessed=(
        q.size * q.dtype.itemsize
        + b * kv_heads * tp * (d + 2) * 4 * (1 + bool(carried))  # sums
        + 2 * math.prod(k_one) * k.dtype.itemsize * (tp // QUERY_ROWS)
      ),
    ),
    interpret=bool(interpret),
    name="chunkwise_tpu_invariant_attention",
  )(lo, hi, q, k, v, *carried)
  if tp != rows_in:
    m, total, acc = (a[:, :, :rows_in] for a in (m, total, acc))
  return m[..., 0], total[..., 0], acc


def reference(q, k, v, positions) -> jax.Array:
  """The plain twin: XLA's causal softmax attention, f32."""
  group = q.shape[1] // k.shape[1]
  k = jnp.repeat(k, group, axis=1).astype(jnp.float32)
  v = jnp.repeat(v, group, axis=1).astype(jnp.float32)
  logits = jnp.einsum("bhtd,bhsd->bhts", q.astype(jnp.float32), k)
  seen = jnp.arange(k.shape[2]) <= positions[:, None, :, None]
  weights = jax.nn.softmax(jnp.where(seen, logits, _MASKED), axis=-1)
  return jnp.einsum("bhts,bhsd->bhtd", weights, v)
