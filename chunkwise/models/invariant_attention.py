"""Attention under invariant numerics: every operation depends only on the
query and the keys and values at their absolute positions.

`attention.attend` takes this path when `numerics.invariant()`; its other
paths (XLA's dots, merged by their softmax statistics) are the fast twin
that tests compare it with. The fixed-order kernels are
`numerics.batched` (`cpu_kernels.invariant_matmul` on the CPU).

  out = attend(q, k, v, [(prefix_layer, mask), ...], blocks, softcap)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from chunkwise import numerics

if TYPE_CHECKING:
  from chunkwise.models.attention import PrefixLayer

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
    p = p.sliced()
    return p._replace(k=jnp.swapaxes(p.k, 1, 2), v=jnp.swapaxes(p.v, 1, 2))

  major = [heads_major(p) for p, _ in prefix]
  kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  parts = []
  for start, end, first, seen in blocks:
    pieces = [
      (
        (p.k, p.v, p.first),
        mask if mask.shape[2] == 1 else mask[:, :, start:end],
      )
      for p, (_, mask) in zip(major, prefix, strict=True)
    ]
    chunk = (kh[:, :, first:end], vh[:, :, first:end], None)
    pieces.append((chunk, seen[None, None, :, None, None, :]))
    parts.append(_chain(q[:, start:end], pieces, softcap))
  out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
  return out.reshape(batch, time, kv_heads * group, dim)


def _chain(q: jax.Array, pieces: list, softcap: float | None) -> jax.Array:
  """`attend` of queries q [B, T, kv, group, D] to `pieces`
  ((k, v [b, kv', S, D], head window (first, count) or None), mask), in
  order. Returns f32[B, T, kv, group, D]."""
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
    k, v = piece[0], piece[1]
    window = None if piece[2] is None else (piece[2], kv_heads)
    b, width = k.shape[0], k.shape[2]
    rows = batch // b * time * group
    logits = numerics.batched(
      view(queries, b).reshape(b * kv_heads, rows, dim),
      k,  # [b, kv', S, D], read as it is
      nmajor=True,
      heads=window,
    ).reshape(b, kv_heads, batch // b, time, group, width)
    if softcap is not None:
      logits = softcap * numerics.tanh(logits / softcap)
    mask = jnp.moveaxis(mask, 3, 1)  # [b, 1, r, T, 1, S]
    scored.append((jnp.where(mask, logits, _MASKED), v, b, window))
  top = None
  for logits, _, b, _ in scored:
    m = common(jnp.max(logits, axis=-1), b)
    top = m if top is None else jnp.maximum(top, m)
  acc = None
  for logits, v, b, window in scored:
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
      heads=window,
      shift=view(top, b).reshape(b * kv_heads, rows),
    )
    acc = common(out.reshape(b, kv_heads, batch // b, time, group, -1), b)
  out = acc[..., :dim] / acc[..., dim:]  # [B, kv, T, group, D]
  return jnp.swapaxes(out, 1, 2)
