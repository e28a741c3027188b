"""Attention under invariant numerics: every operation depends only on the
query and the keys and values at their absolute positions.

`attention.attend` takes this path when `numerics.invariant()`; its other
paths (XLA's dots, merged by their softmax statistics) are the fast twin
that tests compare it with. A query block of 16 rows or more (tokens x
group) with f32 or bf16 keys and values and no soft cap runs in one kernel
call (`_fused`: `numerics.attend`, `cpu_kernels.invariant_attend`), whose
plain twin, bit for bit, is `_chain`: the logits and the values as
`numerics.batched` products (`cpu_kernels.invariant_matmul`) with the max
and the mask between them in XLA.

  out = attend(q, k, v, [(prefix_layer, mask), ...], blocks, softcap)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from chunkwise import numerics
from chunkwise.models.prefix_layer import PrefixLayer

# A masked logit (as `attention`'s): exp(_MASKED - max) is exactly 0.
_MASKED = -1e30


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  prefix: list,
  blocks: list,
  softcap: float | None,
) -> jax.Array:
  """Attention whose every operation depends only on the query and the
  keys and values at their absolute positions (invariant numerics).

  For each query, the logits of every key of every piece come first (one
  FMA chain over head_dim each: `numerics.batched`, n-major), then their
  exact max. exp(logit - max) (taken by the values' kernel itself)
  weights the values in one FMA chain per output over the keys in
  position order, piece after piece (the accumulator carried from one
  kernel call to the next), with the weights' sum chained beside them
  (`ones`). A masked key's weight is exactly 0 and adds nothing, so
  padding, and where one piece ends and the next begins, change no
  operation; query blocks of the chunk skip the keys after their last row
  (and, with a window, before their first row's), all masked.

  Args:
    q: f32[B, T, kv_heads, group, D], pre-scaled.
    k, v: [B, T, kv_heads, D] the chunk's keys and values.
    prefix: (PrefixLayer, mask) per prefix piece, in position order: b
      rows (b | B), mask bool broadcastable to [b, B/b, T, 1, 1, S].
    blocks: the chunk's query blocks, (start, end, first, seen) each
      (`attention._query_blocks`).
    softcap: the layer's attention-logit soft cap, or None.
  Returns:
    f32[B, T, heads, D].
  """
  batch, time, kv_heads, group, dim = q.shape

  # [b, kv, S, D] (with a window of heads still to read, if any)
  def heads_major(p: PrefixLayer) -> PrefixLayer:
    if p.heads_major:
      return p
    p = p.sliced().gathered()
    return p._replace(k=jnp.swapaxes(p.k, 1, 2), v=jnp.swapaxes(p.v, 1, 2))

  major = [heads_major(p) for p, _ in prefix]
  kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  parts = []
  for start, end, first, seen in blocks:
    # A prefix piece's keys past its lengths are masked: the kernels stop
    # each row's chains at its length (`valid`), the same bits.
    pieces = [
      (
        (p.k, p.v, p.first, p.rows, p.lengths),
        mask if mask.shape[2] == 1 else mask[:, :, start:end],
      )
      for p, (_, mask) in zip(major, prefix, strict=True)
    ]
    chunk = (kh[:, :, first:end], vh[:, :, first:end], None, None, None)
    pieces.append((chunk, seen[None, None, :, None, None, :]))
    dtypes = [a.dtype for piece, _ in pieces for a in piece[:2]]
    if fuses(dtypes, (end - start) * group, softcap):
      parts.append(_fused(q[:, start:end], pieces))
    else:
      parts.append(_chain(q[:, start:end], pieces, softcap))
  out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
  return out.reshape(batch, time, kv_heads * group, dim)


# Query rows (tokens x group) from which a block takes the fused kernel:
# it computes a vector of rows at a time (16 on AVX-512), so decode's few
# rows stay with the matmul kernels, which read each key once per row.
FUSED_ROWS = 16
_FUSED_DTYPES = (jnp.float32, jnp.bfloat16)


def fuses(dtypes, rows: int, softcap: float | None) -> bool:
  """Whether a query block of `rows` rows (tokens x group) over keys and
  values of `dtypes` runs as one kernel call (`_fused`): the same
  operations as `_chain`, bit for bit (tests/test_invariant_attention.py),
  for f32 or bf16 keys and values, no soft cap and enough rows."""
  return (
    softcap is None
    and rows >= FUSED_ROWS
    and all(jnp.dtype(d) in _FUSED_DTYPES for d in dtypes)
  )


def _fused(q: jax.Array, pieces: list) -> jax.Array:
  """`_chain` in one call on the CPU (`numerics.attend`): every query's
  logits, their max and its weighted values stay in cache instead of
  passing through memory between kernels; elsewhere `_chain`. Returns
  f32[B, T, kv, group, D]."""
  batch, time, kv_heads, group, dim = q.shape
  queries = jnp.swapaxes(q, 1, 2).reshape(batch, kv_heads, time * group, dim)
  args = []
  for (k, v, first, rows, _), mask in pieces:
    if rows is not None:  # the fused kernel reads rows in order: gathered
      k, v = (jnp.take(a, rows, axis=0, mode="clip") for a in (k, v))
    mask = jnp.asarray(mask, jnp.bool_)
    mask = mask.reshape((1,) * (6 - mask.ndim) + mask.shape)
    args.append((k, v, 0 if first is None else first, mask[:, :, :, 0, 0]))
  acc = numerics.attend(
    queries,
    args,
    group=group,
    twin=lambda: _chain_sums(q, pieces, None).reshape(
      batch, kv_heads, time * group, dim + 1
    ),
  )
  return _finish(acc.reshape(batch, kv_heads, time, group, dim + 1))


def _finish(acc: jax.Array) -> jax.Array:
  """[B, kv, T, group, D + 1] chains -> f32[B, T, kv, group, D]."""
  dim = acc.shape[-1] - 1
  return jnp.swapaxes(acc[..., :dim] / acc[..., dim:], 1, 2)


def _chain(q: jax.Array, pieces: list, softcap: float | None) -> jax.Array:
  """`attend` of queries q [B, T, kv, group, D] to `pieces`
  ((k, v [b', kv', S, D], first head or None, rows int32[b] of k and v or
  None, lengths int32[b] or None), mask), in order. Returns f32[B, T, kv,
  group, D]."""
  return _finish(_chain_sums(q, pieces, softcap))


def _chain_sums(q: jax.Array, pieces: list, softcap: float | None) -> jax.Array:
  """`_chain`'s weighted values and, last, the weights' sum: f32[B, kv,
  T, group, D + 1]."""
  batch, time, kv_heads, group, dim = q.shape

  def common(a, b):  # [b, kv, r, T, group, ...] -> [B, kv, T, group, ...]
    a = jnp.moveaxis(a, 2, 1)
    return a.reshape(batch, *a.shape[2:])

  def view(a, b):  # the inverse
    a = a.reshape(b, batch // b, *a.shape[1:])
    return jnp.moveaxis(a, 1, 2)

  queries = jnp.swapaxes(q, 1, 2)  # [B, kv, T, group, D]
  scored = []
  for piece, mask in pieces:
    k, v, first, at, valid = piece
    window = None if first is None else (first, kv_heads)
    b = k.shape[0] if at is None else at.shape[0]
    width = k.shape[2]
    rows = batch // b * time * group
    read = dict(heads=window, rows=at, valid=valid)
    logits = numerics.batched(
      view(queries, b).reshape(b * kv_heads, rows, dim),
      k,  # [b', kv', S, D], read as it is
      nmajor=True,
      **read,
    ).reshape(b, kv_heads, batch // b, time, group, width)
    if softcap is not None:
      logits = softcap * numerics.tanh(logits / softcap)
    mask = jnp.moveaxis(mask, 3, 1)  # [b, 1, r, T, 1, S]
    scored.append((jnp.where(mask, logits, _MASKED), v, b, read))
  top = None
  for logits, _, b, _ in scored:
    m = common(jnp.max(logits, axis=-1), b)
    top = m if top is None else jnp.maximum(top, m)
  acc = None
  for logits, v, b, read in scored:
    # A masked logit is _MASKED: exp(_MASKED - top) is exactly 0 (every
    # query sees itself, so top is a real logit). The kernel takes the
    # exp of logits - top itself (`shift`).
    rows, width = batch // b * time * group, v.shape[2]
    start = None
    if acc is not None:
      start = view(acc, b).reshape(b * kv_heads, rows, dim + 1)
    out = numerics.batched(
      logits.reshape(b * kv_heads, rows, width),
      v,
      start,
      nmajor=False,
      ones=True,
      shift=view(top, b).reshape(b * kv_heads, rows),
      **read,
    )
    acc = common(out.reshape(b, kv_heads, batch // b, time, group, -1), b)
  return acc
