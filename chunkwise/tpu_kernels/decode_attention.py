"""`decode(q, pieces)`: one decode step's attention, every piece of its
context (the prefix caches, the generate loop's buffer, the step's own
key) in one Pallas TPU call.

XLA:TPU runs a decode step's attention as some fifteen ops a layer: each
piece's logits, softmax sums and weighted values, then the merge of the
pieces (`prefix_layer.merge`), the queries' scaling before and the
output's rounding after. At batch 1 each of them moves a few hundred
bytes and costs the compiler's floor of about 1,800 cycles (1.2 µs on a
v5e), so that attention's small ops cost more than reading its K/V
(docs/planner.md). Here one grid walks the pieces' key blocks in order
for each (row, kv head), with the online softmax in VMEM: the queries
are scaled in the kernel, each piece is read where it lies (a stacked
cache at its layer, keys heads-major or transposed as a TPU stores
them), blocks past a row's length are neither read (their index stays
at the row's last block, which the pipeline does not fetch again) nor
computed, and the output is normalised and rounded once.

  out = decode(q, [Piece(k, v, lengths), ...], scale=D ** -0.5)
  # q [B, KV, R, D]: each kv head's R query rows (its query heads at one
  # position); a piece's k [B, KV, S, D] (or [B, KV, D, S] transposed,
  # or [layers, ...] read at `layer`), v [B, KV, S, D], lengths int32[B]:
  # every row sees the piece's keys 0..length - 1. A piece of b rows (b
  # dividing B: a prefix shared by B / b rows each) serves rows
  # r * B / b .. (r + 1) * B / b - 1, read once for each; with `rows`
  # int32[B], query row i reads the piece's row rows[i] (a slot loop's
  # running rows among all its slots, read where they are).

Every row must see at least one key (a decode step sees its own). The
plain twin is the fast path's pieces merged (`models.attention`), which
tests compare it with in Pallas' interpret mode on the CPU; the
reduction order differs (one online softmax against per-piece sums
merged), so the last bits may too.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

KEY_BLOCK = 128
# A piece whose width KEY_BLOCK does not divide is read as one block, up
# to this many keys (a loop's buffer of a few columns, the step's key).
MAX_WHOLE = 1024
_MASKED = -1e30


class Piece(NamedTuple):
  """One piece of context: k [b, KV, S, D] ([b, KV, D, S] if
  `transposed`), v [b, KV, S, D], both with a leading [layers] if `layer`
  is an int (the whole stacked cache, read at that layer); lengths
  int32[B], per query row (b divides B: row r reads the piece's row
  r // (B / b)), or, with `rows` int32[B], the piece's row rows[r] (of
  any count). `head` (an int or an int32 scalar, traced or not): the
  first of the piece's kv heads the queries' read, a window of as many
  as they have (heads cut where they lie: a slice of a cache is a copy
  for a Pallas call)."""

  k: jax.Array
  v: jax.Array
  lengths: jax.Array
  transposed: bool = False
  layer: int | None = None
  head: jax.Array | int = 0
  rows: jax.Array | None = None

  @property
  def width(self) -> int:
    return self.v.shape[-2]

  @property
  def block(self) -> int:
    """Keys per grid step: KEY_BLOCK, or the whole piece."""
    return KEY_BLOCK if self.width % KEY_BLOCK == 0 else self.width


def reads(piece: Piece) -> bool:
  """Whether `decode` reads the piece: float K/V, its width in whole
  blocks or short enough to read at once."""
  return (
    jnp.issubdtype(piece.k.dtype, jnp.floating)
    and jnp.issubdtype(piece.v.dtype, jnp.floating)
    and (piece.width % KEY_BLOCK == 0 or piece.width <= MAX_WHOLE)
  )


def _kernel(lengths, q, *refs, metas, scale, softcap, blocks):
  kvs, (out, m, total, acc) = refs[: 2 * len(metas)], refs[2 * len(metas) :]
  row, step = pl.program_id(0), pl.program_id(2)

  @pl.when(step == 0)
  def _():
    m[...] = jnp.full(m.shape, _MASKED, jnp.float32)
    total[...] = jnp.zeros(total.shape, jnp.float32)
    acc[...] = jnp.zeros(acc.shape, jnp.float32)

  rows = q[...].astype(jnp.float32) * scale
  for j, (first, count, block, transposed) in enumerate(metas):
    start = (step - first) * block
    length = lengths[j, row]

    @pl.when((step >= first) & (step < first + count) & (start < length))
    def _(j=j, start=start, length=length, transposed=transposed):
      k = kvs[2 * j][...].astype(jnp.float32)
      v = kvs[2 * j + 1][...].astype(jnp.float32)
      dims = (((1,), (0 if transposed else 1,)), ((), ()))
      logits = jax.lax.dot_general(
        rows,
        k,
        dims,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
      )
      if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
      key = start + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
      logits = jnp.where(key < length, logits, _MASKED)
      # The block holds a key the row sees (start < length), so m_new is
      # finite and a masked key's exp(-1e30 - m_new) is exactly 0.
      m_new = jnp.maximum(m[...], jnp.max(logits, axis=1, keepdims=True))
      keep = jnp.exp(m[...] - m_new)
      p = jnp.exp(logits - m_new)
      total[...] = total[...] * keep + jnp.sum(p, axis=1, keepdims=True)
      acc[...] = acc[...] * keep + jax.lax.dot_general(
        p,
        v,
        (((1,), (0,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
      )
      m[...] = m_new

  @pl.when(step == blocks - 1)
  def _():
    out[...] = (acc[...] / total[...]).astype(out.dtype)


def decode(
  q: jax.Array,
  pieces,
  *,
  scale: float,
  softcap: float | None = None,
  out_dtype=None,
  interpret: bool = False,
) -> jax.Array:
  """Attention of q [B, KV, R, D] (not scaled: `scale` is applied in the
  kernel) to `pieces` (`Piece`s in the context's order, each of KV heads
  and B rows or fewer shared), logits capped at `softcap` (c * tanh(logit
  / c)) if given; normalised, [B, KV, R, D] in `out_dtype` (q's by
  default)."""
  b, kv_heads, rows, d = q.shape
  pieces = list(pieces)
  if not pieces:
    raise ValueError("decode attention needs at least one piece of context")
  for i, p in enumerate(pieces):
    lead = () if p.layer is None else p.v.shape[:1]
    s, pb = p.width, p.v.shape[len(lead)]
    kv = p.v.shape[len(lead) + 1]  # the queries' kv_heads, or a window
    want = (*lead, pb, kv) + ((d, s) if p.transposed else (s, d))
    want_v = (*lead, pb, kv, s, d)
    shared = p.rows is None and b % pb
    if p.k.shape != want or p.v.shape != want_v or shared or kv < kv_heads:
      raise ValueError(
        f"piece {i}: k {p.k.shape} must be {want} and v {p.v.shape} "
        f"{want_v}, their {pb} rows dividing the queries' {q.shape} and "
        f"at least its {kv_heads} kv heads"
      )
    if p.layer is not None and not 0 <= p.layer < p.v.shape[0]:
      raise ValueError(
        f"piece {i}: layer {p.layer} of a cache of {p.v.shape[0]} layers"
      )
    if p.lengths.shape != (b,):
      raise ValueError(f"piece {i}: lengths {p.lengths.shape} must be ({b},)")
    if p.rows is not None and p.rows.shape != (b,):
      raise ValueError(f"piece {i}: rows {p.rows.shape} must be ({b},)")
    if not reads(p):
      raise ValueError(
        f"piece {i}: k {p.k.dtype}, v {p.v.dtype}, {s} keys: decode reads "
        f"float K/V of a multiple of {KEY_BLOCK} keys or at most {MAX_WHOLE}"
      )

  # Per piece: each query row's length, then the piece's row it reads,
  # then the first kv head read.
  def where(p):
    lead = 0 if p.layer is None else 1
    rows = p.rows
    if rows is None:
      rows = jnp.arange(b) // (b // p.v.shape[lead])
    rows = jnp.clip(rows, 0, p.v.shape[lead] - 1)  # as a gather's "clip"
    head = jnp.asarray(p.head, jnp.int32)[None]
    return jnp.concatenate(
      [p.lengths.astype(jnp.int32), rows.astype(jnp.int32), head]
    )

  lengths = jnp.stack([where(p) for p in pieces])
  metas, in_specs, first = [], [], 0
  for j, p in enumerate(pieces):
    block, count = p.block, p.width // p.block
    metas.append((first, count, block, p.transposed))
    at = () if p.layer is None else (p.layer,)
    lead = (None,) * (2 + len(at))

    def index(i, h, c, lens, j=j, first=first, count=count, block=block):
      # Within the piece's steps its block; before them its first, after
      # them (or past the row's keys) its last needed: not fetched again.
      last = jnp.maximum((lens[j, i] + block - 1) // block - 1, 0)
      return jnp.clip(c - first, 0, jnp.minimum(count - 1, last))

    def k_map(i, h, c, lens, at=at, j=j, index=index, t=p.transposed):
      n, r, kv = index(i, h, c, lens), lens[j, b + i], h + lens[j, 2 * b]
      return (*at, r, kv, 0, n) if t else (*at, r, kv, n, 0)

    def v_map(i, h, c, lens, at=at, j=j, index=index):
      n, r, kv = index(i, h, c, lens), lens[j, b + i], h + lens[j, 2 * b]
      return (*at, r, kv, n, 0)

    k_block = (*lead, d, block) if p.transposed else (*lead, block, d)
    in_specs += [
      pl.BlockSpec(k_block, k_map),
      pl.BlockSpec((*lead, block, d), v_map),
    ]
    first += count
  blocks = first
  rows_spec = pl.BlockSpec(
    (None, None, rows, d), lambda i, h, c, lens: (i, h, 0, 0)
  )
  out_dtype = q.dtype if out_dtype is None else out_dtype
  kv_bytes = sum(  # a shared piece read again for each row it serves
    2 * b * kv_heads * p.width * d * max(p.k.dtype.itemsize, p.v.dtype.itemsize)
    for p in pieces
  )
  stat = pltpu.VMEM((rows, 1), jnp.float32)
  return pl.pallas_call(
    functools.partial(
      _kernel, metas=tuple(metas), scale=scale, softcap=softcap, blocks=blocks
    ),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, kv_heads, blocks),
      in_specs=[rows_spec, *in_specs],
      out_specs=rows_spec,
      scratch_shapes=[stat, stat, pltpu.VMEM((rows, d), jnp.float32)],
    ),
    out_shape=jax.ShapeDtypeStruct(q.shape, out_dtype),
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "arbitrary")
    ),
    cost_estimate=pl.CostEstimate(
      flops=4 * b * kv_heads * rows * d * sum(p.width for p in pieces),
      transcendentals=b * kv_heads * rows * sum(p.width for p in pieces),
      bytes_accessed=(
        kv_bytes
        + q.size * q.dtype.itemsize
        + math.prod(q.shape) * jnp.dtype(out_dtype).itemsize
      ),
    ),
    interpret=bool(interpret),
    name="chunkwise_tpu_decode_attention",
  )(lengths, q, *[a for p in pieces for a in (p.k, p.v)])
