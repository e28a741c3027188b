"""Attention of a long chunk in query blocks × key blocks: O(T · block)
memory rather than a query block's whole [rows, S] logits.

`attention.attend` takes this path for long chunks (`wanted`). Query blocks
of `BLOCK` rows run in a `lax.scan`; each reads its context in key blocks
of `BLOCK` keys in a `fori_loop` whose bounds skip the blocks every row of
the query block has masked: the chunk's keys after the block's last row
(and, with a window, before its first row's window), and a prefix cache's
slots past its longest row.

- fast numerics: the online softmax merge; a block's (m, s, o) join the
  running ones as M = max(m, m'), s ← e^(m-M) s + e^(m'-M) s', o likewise.
  The plain twin is `attention`'s unblocked path (tests compare the two
  within tolerance).
- invariant numerics: two passes over the same blocks. The first takes the
  exact max of every logit (keeping the logits for the second when a
  query block's fit `KEPT_LOGITS`); the second chains exp(logit - max) · v over
  the keys in position order, the accumulator carried from block to block
  (`cpu_kernels.invariant_matmul`'s chain from `acc`). Every output is the
  same sequence of operations as the unblocked path's, so the two are
  bit for bit equal (tests check it); a skipped block's keys are masked,
  which would only have added exact zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from chunkwise import numerics
from chunkwise.models import schedule

# Query rows per query block and keys per key block.
BLOCK = 512
# Chunks of at least this many rows, whose logits over the whole context
# take at least `MIN_LOGITS` per head, take the blocked path.
MIN_TIME = 256
MIN_LOGITS = 1 << 21
# Invariant numerics: a query block's logits over a piece are kept between
# the max pass and the chain pass up to this many bytes (else recomputed).
KEPT_LOGITS = 1 << 28


def wanted(time: int, context: int) -> bool:
  """Whether a chunk of `time` rows over `context` keys (prefixes and
  itself) takes the blocked path."""
  return time >= MIN_TIME and time * context >= MIN_LOGITS


def _pad_to(x: jax.Array, axis: int, size: int) -> jax.Array:
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def _blocks(n: int) -> int:
  return -(-n // BLOCK)


class _Piece:
  """One piece of context in key blocks: k, v [b, kv, S', D] (heads
  major) or [b, S', kv, D] (time major, a `KVCache`'s order), padded to
  whole blocks, its rows' lengths, the first slot's absolute position per
  query row (with a window), and whether it is the chunk itself (causal).
  A time-major piece is read as it is and each key block turned heads
  major on its own: turning a 32k-token cache whole would copy it (2 GB
  for Llama-3.2-1B, every layer's copy live at once)."""

  def __init__(self, k, v, lengths, start, causal, heads_major=True):
    self.axis = 2 if heads_major else 1
    width = _blocks(k.shape[self.axis]) * BLOCK
    self.k = _pad_to(k, self.axis, width)
    self.v = _pad_to(v, self.axis, width)
    self.b = k.shape[0]
    self.lengths = lengths
    self.start = start
    self.causal = causal
    self.count = width // BLOCK

  def key_range(self, i, window):
    """The key blocks [lo, hi) query block i may see."""
    if self.causal:  # the chunk's keys up to the block's last row
      if window is None:
        return 0, i + 1
      return jnp.maximum(i * BLOCK - window + 1, 0) // BLOCK, i + 1
    return 0, (jnp.max(self.lengths) + BLOCK - 1) // BLOCK

  def block(self, j):
    """Keys and values of key block j: [b, kv, BLOCK, D]."""
    blocks = (
      lax.dynamic_slice_in_dim(a, j * BLOCK, BLOCK, axis=self.axis)
      for a in (self.k, self.v)
    )
    if self.axis == 2:
      return tuple(blocks)
    return tuple(jnp.swapaxes(a, 1, 2) for a in blocks)

  def mask(self, i, j, q_pos, batch, window):
    """bool [b, r, BLOCK, 1, 1, BLOCK]: which keys of block j the rows of
    query block i see (r = batch / b query rows per piece row)."""
    cols = j * BLOCK + jnp.arange(BLOCK)
    r = batch // self.b
    if self.causal:
      rows = i * BLOCK + jnp.arange(BLOCK)
      behind = rows[:, None] - cols[None, :]
      seen = behind >= 0
      if window is not None:
        seen &= behind < window
      return jnp.broadcast_to(seen, (self.b, r, BLOCK, BLOCK))[
        :, :, :, None, None, :
      ]
    seen = cols[None, :] < self.lengths[:, None]  # [b, BLOCK]
    seen = seen[:, None, None, :]
    if window is not None:
      k_pos = self.start[:, None] + cols  # [batch, BLOCK]
      near = q_pos[:, :, None] - k_pos[:, None, :] < window
      seen = seen & near.reshape(self.b, r, BLOCK, BLOCK)
    return jnp.broadcast_to(seen, (self.b, r, BLOCK, BLOCK))[
      :, :, :, None, None, :
    ]


def attend(q, k, v, prefix, starts, q_positions, options, piece_fn):
  """Blocked attention of the chunk to `prefix` and itself.

  Args:
    q: f32[B, T, kv_heads, group, D], pre-scaled.
    k, v: [B, T, kv_heads, D] the chunk's keys and values.
    prefix: `PrefixLayer`s with at least one slot, heads cut.
    starts, q_positions: each prefix's first slot's absolute position per
      query row [B] and the queries' positions [B, T] (with a window;
      else None).
    options: the layer's `attention.Options`.
    piece_fn: `attention._attend_piece` (fast numerics).
  Returns:
    f32[B, T, kv_heads * group, D].
  """
  batch, time, kv_heads, group, dim = q.shape
  pieces = []
  for n, p in enumerate(prefix):
    start = None if starts is None else starts[n]
    pk, pv = p.k, p.v
    if not p.heads_major:  # a `KVCache`'s layer slice: copied in turn
      pk, pv = schedule.after(q, (pk, pv))
    pieces.append(
      _Piece(pk, pv, p.lengths, start, False, heads_major=p.heads_major)
    )
  pieces.append(
    _Piece(jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), None, None, True)
  )
  count = _blocks(time)
  qb = _pad_to(q, 1, count * BLOCK)
  qb = jnp.moveaxis(qb.reshape(batch, count, BLOCK, *q.shape[2:]), 1, 0)
  if q_positions is None:
    pos = jnp.zeros((count, batch, BLOCK), jnp.int32)
  else:
    pos = _pad_to(q_positions, 1, count * BLOCK)
    pos = jnp.moveaxis(pos.reshape(batch, count, BLOCK), 1, 0)
  invariant = numerics.invariant()

  def query_block(_, xs):
    qi, i, q_pos = xs
    if invariant:
      out = _invariant_block(qi, i, q_pos, pieces, options)
    else:
      out = _fast_block(qi, i, q_pos, pieces, options, piece_fn)
    return None, out

  _, out = lax.scan(
    query_block, None, (qb, jnp.arange(count, dtype=jnp.int32), pos)
  )
  out = jnp.moveaxis(out, 0, 1).reshape(batch, count * BLOCK, *out.shape[3:])
  return out[:, :time].reshape(batch, time, kv_heads * group, dim)


def _fast_block(qi, i, q_pos, pieces, options, piece_fn):
  """Online softmax over the key blocks of every piece: f32[B, BLOCK,
  kv_heads, group, D]."""
  batch = qi.shape[0]
  shape = qi.shape[:-1]
  state = (
    jnp.full(shape, -1e30, jnp.float32),
    jnp.zeros(shape, jnp.float32),
    jnp.zeros(qi.shape, jnp.float32),
  )
  for p in pieces:
    view = qi.reshape(p.b, batch // p.b, *qi.shape[1:])

    def body(j, state, p=p, view=view):
      kj, vj = p.block(j)
      m, s, o = piece_fn(
        view,
        kj,
        vj,
        p.mask(i, j, q_pos, batch, options.window),
        softcap=options.softcap,
        heads_major=True,
      )
      m, s, o = (a.reshape(batch, *a.shape[2:]) for a in (m, s, o))
      m0, s0, o0 = state
      top = jnp.maximum(m0, m)
      a, c = jnp.exp(m0 - top), jnp.exp(m - top)
      return top, a * s0 + c * s, a[..., None] * o0 + c[..., None] * o

    lo, hi = p.key_range(i, options.window)
    state = lax.fori_loop(lo, hi, body, state)
  _, s, o = state
  return o / s[..., None]


def _invariant_block(qi, i, q_pos, pieces, options):
  """`invariant_attention._chain` over key blocks: the exact max of every logit,
  then one chain of exp(logit - max) · v (and its sum) over the keys in
  position order. f32[B, BLOCK, kv_heads, group, D]."""
  batch, rows, kv_heads, group, dim = qi.shape
  queries = jnp.swapaxes(qi, 1, 2)  # [B, kv, BLOCK, group, D]

  def view(a, b):  # [B, kv, ...] -> [b, kv, B/b, ...]
    a = a.reshape(b, batch // b, *a.shape[1:])
    return jnp.moveaxis(a, 1, 2)

  def common(a, b):  # the inverse
    a = jnp.moveaxis(a, 2, 1)
    return a.reshape(batch, *a.shape[2:])

  def logits_of(p, j):
    kj, vj = p.block(j)
    per = batch // p.b * rows * group
    logits = numerics.batched(
      view(queries, p.b).reshape(p.b * kv_heads, per, dim), kj, nmajor=True
    ).reshape(p.b, kv_heads, batch // p.b, rows, group, BLOCK)
    if options.softcap is not None:
      logits = options.softcap * numerics.tanh(logits / options.softcap)
    mask = jnp.moveaxis(p.mask(i, j, q_pos, batch, options.window), 3, 1)
    return jnp.where(mask, logits, -1e30), vj

  # A piece's logits for this query block are kept from the first pass to
  # the second when they fit `KEPT_LOGITS` bytes, else computed again.
  kept = []
  top = jnp.full((batch, kv_heads, rows, group), -1e30, jnp.float32)
  for p in pieces:
    shape = (p.b, kv_heads, batch // p.b, rows, group, p.count * BLOCK)
    keep = 4 * np.prod(shape) <= KEPT_LOGITS

    def most(j, carry, p=p, keep=keep):
      top, store = carry
      logits, _ = logits_of(p, j)
      if keep:
        store = lax.dynamic_update_slice_in_dim(store, logits, j * BLOCK, 5)
      return jnp.maximum(top, common(jnp.max(logits, axis=-1), p.b)), store

    store = jnp.zeros(shape if keep else (0,), jnp.float32)
    top, store = lax.fori_loop(
      *p.key_range(i, options.window), most, (top, store)
    )
    kept.append(store if keep else None)
  acc = jnp.zeros((batch, kv_heads, rows, group, dim + 1), jnp.float32)
  for p, store in zip(pieces, kept, strict=True):

    def chain(j, acc, p=p, store=store):
      if store is None:
        logits, vj = logits_of(p, j)
      else:
        logits = lax.dynamic_slice_in_dim(store, j * BLOCK, BLOCK, 5)
        vj = p.block(j)[1]
      per = batch // p.b * rows * group
      out = numerics.batched(  # exp(logits - top) taken in the kernel
        logits.reshape(p.b * kv_heads, per, BLOCK),
        vj,
        view(acc, p.b).reshape(p.b * kv_heads, per, dim + 1),
        nmajor=False,
        ones=True,
        shift=view(top, p.b).reshape(p.b * kv_heads, per),
      )
      return common(
        out.reshape(p.b, kv_heads, batch // p.b, rows, group, dim + 1), p.b
      )

    acc = lax.fori_loop(*p.key_range(i, options.window), chain, acc)
  out = acc[..., :dim] / acc[..., dim:]  # [B, kv, BLOCK, group, D]
  return jnp.swapaxes(out, 1, 2)
