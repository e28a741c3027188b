"""Per-device layers of the weight-stationary layouts (1D and 2D).

One implementation serves both: the `Plan` names the mesh axes, and every
collective over an empty axis tuple is the identity. Weights never move;
activations are gathered before a matmul and reduce-scattered after it.

  ws_2d (axes: weights embed X, heads/d_ff/vocab YZ; residual [B.Z, T, E.XY])
    norm      [B.Z, T, E.XY] -all_gather y-> [B.Z, T, E.X], mean of
              squares psum'd over x -all_gather z-> xn [B, T, E.X]
    q         xn @ q [E.X, H.YZ] = [B, T, H.YZ]{x unreduced}
              -psum_scatter x on heads-> [B, T, H.YZX]
    k, v      xn @ k [E.X, KVH(.YZ)] -psum x-> [B, T, KVH(.YZ)]
    attention by head, or by batch: all_to_all q heads -> rows
    o         all_gather x on heads, @ o [H.YZ, E.X] = [B, T, E.X]{yz}
    mlp       xn @ gate/up [E.X, F.YZ] -psum_scatter x on d_ff->
              [B, T, F.YZX]; all_gather x, @ down [F.YZ, E.X]
              = [B, T, E.X]{yz unreduced}
    reduce    -psum_scatter y on embed, z on batch-> [B.Z, T, E.XY]
  ws_1d (weights embed whole, heads/d_ff/vocab XYZ; residual [B, T, E.XYZ])
    the same steps with x·y·z in place of y·z and nothing on x: norm
    all-gathers the residual; o and down psum-scatter xyz on embed.
  The reduce-scatters and all-gathers next to a matmul run as collective
  matmuls in the plan's variant (`fused`: XLA's own for "xla").
  Embedding: each device looks up the ids of its vocabulary rows (zeros
  elsewhere) and the result is reduced like a layer's output. Unembedding:
  xn @ table [V.YZ, E.X] -psum_scatter x on vocab-> logits [B, T, V.YZX].

`prefix` holds, per prefix cache, this layer's `attention.PrefixLayer`
already cut to this device's attention rows (see
`inference.sharded_engine`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise import numerics
from chunkwise.configs import Block, HParams
from chunkwise.models import fused, lora
from chunkwise.models import shard_ops as ops
from chunkwise.models.attention import Options, PrefixLayer, attend
from chunkwise.models.matmul import weight_matmul
from chunkwise.models.quantized import take_rows
from chunkwise.models.transformer import (
  Site,
  _activation,
  _bias,
  _mm,
  position_heads,
  scale_embedded,
  softcap,
)
from chunkwise.models.weights import Layer, Weights
from chunkwise.partitioning.plan import Plan


def _minus(axes, drop):
  return tuple(a for a in axes if a not in drop)


def _sizes(plan: Plan) -> dict:
  return dict(plan.sizes)


def norm(
  plan: Plan, hparams: HParams, x: jax.Array, scale: jax.Array | None
) -> jax.Array:
  """RMSNorm of the residual [B.rb, T, E.re] -> xn [B, T, E.embed]."""
  x = ops.all_gather(x, _minus(plan.resid_embed, plan.embed_axes), axis=2)
  x32 = x.astype(jnp.float32)
  squares = ops.psum(numerics.last_sum(x32 * x32), plan.embed_axes)
  normed = x32 * lax.rsqrt(squares / hparams.d_model + hparams.norm_eps)
  if scale is not None:
    n = plan.size(plan.embed_axes)
    local = ops.block(scale, n, ops.index(plan.embed_axes), axis=0)
    normed = normed * local.astype(jnp.float32)
  normed = normed.astype(x.dtype)
  return ops.all_gather(normed, plan.resid_batch, axis=0)


def residual_norm(
  plan: Plan, hparams: HParams, x: jax.Array, scale: jax.Array | None
) -> jax.Array:
  """RMSNorm of a branch's output in the residual's layout [B.rb, T, E.re]
  (`post_norms`): x unchanged without a scale."""
  if scale is None:
    return x
  x32 = x.astype(jnp.float32)
  squares = ops.psum(numerics.last_sum(x32 * x32), plan.resid_embed)
  normed = x32 * lax.rsqrt(squares / hparams.d_model + hparams.norm_eps)
  n = plan.size(plan.resid_embed)
  local = ops.block(scale, n, ops.index(plan.resid_embed), axis=0)
  return (normed * local.astype(jnp.float32)).astype(x.dtype)


def reduce(
  plan: Plan, partial: jax.Array, embed_scattered: bool = False
) -> jax.Array:
  """[B, T, E.embed]{head axes unreduced} -> residual [B.rb, T, E.re].

  With `embed_scattered` the embed scatter is already done (the output
  matmul fused it, see `fused.scatters_embed`)."""
  scatter = _minus(plan.resid_embed, plan.embed_axes)
  out = partial
  if not embed_scattered:
    out = ops.psum_scatter(out, scatter, axis=2)
  out = ops.psum_scatter(out, plan.resid_batch, axis=0)
  rest = _minus(plan.head_axes, (*scatter, *plan.resid_batch))
  return ops.psum(out, rest)


def embed(
  plan: Plan, hparams: HParams, weights: Weights, tokens: jax.Array, dtype
) -> jax.Array:
  """Token ids [B, T] (replicated) -> residual [B.rb, T, E.re]."""
  table = weights.embedding  # [V.vocab, E.embed]
  rows = table.shape[0]
  ids = jnp.clip(tokens, 0, hparams.vocab - 1)
  ids = ids - ops.index(plan.vocab_axes) * rows
  inside = (ids >= 0) & (ids < rows)
  found = take_rows(table, jnp.clip(ids, 0, rows - 1))
  partial = jnp.where(inside[..., None], found, 0).astype(dtype)
  return scale_embedded(hparams, reduce(plan, partial))


def unembed(
  plan: Plan, hparams: HParams, weights: Weights, x: jax.Array
) -> jax.Array:
  """Final norm, then f32 logits [B, T, V.(vocab axes + embed axes)]."""
  xn = norm(plan, hparams, x, weights.final_norm).astype(jnp.float32)
  if weights.unembedding is None:
    partial = weight_matmul("bte,ve->btv", xn, weights.embedding)
  else:
    partial = weight_matmul("bte,ev->btv", xn, weights.unembedding)
  logits = ops.psum_scatter(partial, plan.embed_axes, axis=2)
  return softcap(logits, hparams.final_softcap)


def _blocks_in_order(plan: Plan, sizes, width: int, heads: int) -> bool:
  """Whether, rows split over `plan.attn_batch`, the query heads gathered
  from the device at coordinates j are block j of every head in order
  (the query axes that split are among the attention batch's, in its
  order), blocks of `width` of the model's `heads` query heads."""
  q_axes = [a for a in plan.q_axes if sizes[a] > 1]
  if not set(q_axes) <= set(plan.attn_batch):
    return False
  blocks = list(ops.coordinates(plan.attn_batch, sizes))
  order = [ops.static_index(q_axes, sizes, c) for c in blocks]
  return order == list(range(len(blocks))) and len(blocks) * width == heads


def heads_attention(
  plan: Plan,
  hparams: HParams,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  prefix,
  options: Options,
) -> jax.Array:
  """Attention of this device's query heads.

  Args:
    q: [B, T, hq, D], heads split over `plan.q_axes`, RoPE applied.
    k, v: the chunk's keys and values for this device's attention rows:
      [B, T, kvh, D] with K/V heads split over `plan.cache_heads` (by head),
      or [B/na, T, kv_heads, D] (by batch over `plan.attn_batch`).
    prefix: per prefix cache its `PrefixLayer`, rows and heads like k, v.
  Returns:
    f32[B, T, hq, D].
  """
  sizes = _sizes(plan)
  hq = q.shape[2]
  group = hparams.heads // hparams.kv_heads
  if plan.attn_batch:
    # [B, T, hq] -> [B/na, T, na*hq]: na blocks of hq heads, block j from
    # the device whose attention-batch coordinates are j's.
    q = ops.all_to_all(q, plan.attn_batch, split=0, concat=2)
    starts = [
      ops.index_with(plan.q_axes, sizes, c) * hq
      for c in ops.coordinates(plan.attn_batch, sizes)
    ]
    kv_start = 0
  else:
    starts = [ops.index(plan.q_axes) * hq]
    kv_start = ops.index(plan.cache_heads) * k.shape[2]
  width = hq
  if hparams.kv_heads == 1:  # one K/V head serves every query head
    starts, width = starts[:1], q.shape[2]
  count = width // group if width % group == 0 else 1
  in_order = plan.attn_batch and hparams.kv_heads > 1
  if in_order and _blocks_in_order(plan, sizes, width, hparams.heads):
    # The blocks together are every query head in order (block j's read
    # K/V heads [j*width/group, ...), or, narrower than a group, share
    # one): one attention over all (windows of a prefix's heads made
    # XLA:TPU copy the whole prefix cache, each window of each layer
    # hoisted out of the decode loop: Llama-3.1-70B at 32 rows on a v5e
    # 4x4, 4 query heads a device against groups of 8).
    out = attend(q, k, v, prefix, options)
    return ops.all_to_all(out, plan.attn_batch, split=2, concat=0)
  outs = []
  for j, start in enumerate(starts):
    first = start // group - kv_start

    def select(a, first=first):
      if a.shape[2] == count:
        return a
      return lax.dynamic_slice_in_dim(a, first, count, axis=2)

    layer_prefix = [PrefixLayer(*p).heads(first, count) for p in prefix]
    outs.append(
      attend(
        q[:, :, j * width : (j + 1) * width],
        select(k),
        select(v),
        layer_prefix,
        options,
      )
    )
  out = jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]
  return ops.all_to_all(out, plan.attn_batch, split=2, concat=0)


def attention(
  plan: Plan,
  hparams: HParams,
  w: Layer,
  xn: jax.Array,
  positions: jax.Array,
  prefix,
  site: Site,
):
  """xn [B, T, E.embed] -> ([B, T, E.embed]{head axes unreduced}, (k, v))."""
  embed_axes = plan.embed_axes
  lo = w.lora
  # The adapters' x @ A of q, k and v at once, reduced over the embed
  # axes while it is rank-sized.
  xa = _reduced(lora.project(lo, "qkv", xn), embed_axes)
  xa = lora.masked(xa, None if lo is None else lo.ids)
  q = _matmul(plan, "q", "bte,ehd->bthd", xn, w.q, lo, xa)  # [B, T, H.q_axes]
  if w.q_bias is not None:
    n = plan.size(embed_axes)
    q = _bias(q, ops.block(w.q_bias, n, ops.index(embed_axes), axis=0))
  wk, wv, bk, bv = w.k, w.v, w.k_bias, w.v_bias
  rows, row_positions = xn, positions
  row_xa = xa  # masked by row already: cut with the rows
  # Attention split by batch: this device's rows with every K/V head. The
  # embed contraction is split over embed_axes, so rows are first cut over
  # the other attention axes (equal along embed_axes), then over the
  # embed axes among them (the minor ones) once the psum is done.
  inner = tuple(a for a in plan.attn_batch if a in embed_axes)
  outer = plan.attn_batch[: len(plan.attn_batch) - len(inner)]
  if inner != plan.attn_batch[len(outer) :]:
    raise ValueError(
      f"attention batch axes {plan.attn_batch} must list {inner} last"
    )
  if plan.attn_batch:
    rows = ops.local_rows(xn, plan.size(outer), ops.index(outer))
    row_positions = ops.local_rows(
      positions, plan.size(plan.attn_batch), ops.index(plan.attn_batch)
    )
    wk, wv = (
      jax.tree.map(lambda a: ops.all_gather(a, plan.kv_axes, axis=1), w)
      for w in (wk, wv)
    )
    if bk is not None:
      bk, bv = (ops.all_gather(a, plan.kv_axes, axis=0) for a in (bk, bv))
    if lo is not None:
      if xa is not None:
        row_xa = ops.local_rows(xa, plan.size(outer), ops.index(outer))
      lo = lo.replace(
        b={
          t: ops.all_gather(b, plan.kv_axes, axis=2) if t in ("k", "v") else b
          for t, b in lo.b.items()
        }
      )

  def project(w, bias, name):
    out = ops.psum(_mm("bte,ehd->bthd", rows, w), embed_axes)
    if lo is not None:
      out = lora.add(out, lora.expand(lo, name, row_xa))
    out = ops.block(out, plan.size(inner), ops.index(inner), axis=0)
    return _bias(out, bias)

  k, v = project(wk, bk, "k"), project(wv, bv, "v")
  q, k = position_heads(
    hparams, w, q, k, positions, row_positions, site.rotation
  )
  out = heads_attention(plan, hparams, q, k, v, prefix, site.options)
  out = out.astype(xn.dtype)
  # all-gather embed_axes on heads, then @ o (ws_2d); @ o, then
  # reduce-scatter on embed (ws_1d)
  delta = _lora_out(plan, out, lo, "o")
  return _matmul(plan, "o", "bthd,hde->bte", out, w.o), (k, v), delta


def mlp(plan: Plan, hparams: HParams, w: Layer, xn: jax.Array):
  """xn [B, T, E.embed] -> [B, T, E.embed]{head axes unreduced} (ws_2d)
  or [B, T, E.XYZ] (ws_1d, embed scattered by the fused matmul), and the
  adapters' delta of `down` in the residual's layout (or None)."""
  lo = w.lora
  xa = _reduced(lora.project(lo, "gate_up", xn), plan.embed_axes)
  xa = lora.masked(xa, None if lo is None else lo.ids)
  gate = _matmul(plan, "gate", "bte,ef->btf", xn, w.gate, lo, xa)
  up = _matmul(plan, "up", "bte,ef->btf", xn, w.up, lo, xa)
  hidden = _activation(hparams.activation, gate) * up
  delta = _lora_out(plan, hidden, lo, "down")
  return _matmul(plan, "down", "btf,fe->bte", hidden, w.down), delta


def _matmul(plan: Plan, name: str, eq: str, x: jax.Array, w, lo=None, xa=None):
  """The layer's matmul `name`: fused with its collective where the
  layout fuses it (`fused.FUSED`), else plain. An input-side projection
  (q, gate, up: [B, T, E.embed] in, out split over the head axes, then
  the embed axes) adds the adapters' delta from its group's `xa` (x @ A
  already reduced over the embed axes): @ B's shard, cut like the
  output."""
  if name in fused.FUSED[plan.kind]:
    out = fused.matmul(plan, name, x, w)
  else:
    out = _mm(eq, x, w)
  d = None if lo is None else lora.expand(lo, name, xa)
  if d is None:
    return out
  n = plan.size(plan.embed_axes)
  d = ops.block(d, n, ops.index(plan.embed_axes), axis=2)
  return out + d.astype(out.dtype)


def _reduced(xa, axes):
  return None if xa is None else ops.psum(xa, axes)


def _lora_out(plan: Plan, x: jax.Array, lo, name: str):
  """The adapters' delta of an output-side projection (o, down) in the
  residual's layout [B.rb, T, E.re], or None. `x` is split over the head
  axes, then the embed axes, on its contracted (third) axis, like A's
  rows once cut over the embed axes; B's columns are split over the
  embed axes like the projection's output."""
  if lo is None or name not in lo.a:
    return None
  n = plan.size(plan.embed_axes)
  a = ops.block(lo.a[name], n, ops.index(plan.embed_axes), axis=0)
  xa = lora.project(lo.replace(a={name: a}), name, x)
  xa = ops.psum(xa, (*plan.head_axes, *plan.embed_axes))
  d = lora.expand(lo, name, lora.masked(xa, lo.ids))  # [B, T, E.embed]
  rest = _minus(plan.resid_embed, plan.embed_axes)
  d = ops.block(d, plan.size(rest), ops.index(rest), axis=2)
  return ops.local_rows(
    d, plan.size(plan.resid_batch), ops.index(plan.resid_batch)
  )


def layer(
  plan: Plan,
  hparams: HParams,
  w: Layer,
  x: jax.Array,
  positions: jax.Array,
  prefix,
  site: Site,
):
  """One layer on the residual [B.rb, T, E.re]; returns (x, (k, v))."""
  scattered = fused.scatters_embed(plan)
  if hparams.block == Block.PARALLEL:
    xn = norm(plan, hparams, x, w.attn_norm)
    attn, kv, d_o = attention(plan, hparams, w, xn, positions, prefix, site)
    out, d_down = mlp(plan, hparams, w, xn)
    out = lora.add(lora.add(reduce(plan, attn + out, scattered), d_o), d_down)
    return x + out, kv
  xn = norm(plan, hparams, x, w.attn_norm)
  attn, kv, d_o = attention(plan, hparams, w, xn, positions, prefix, site)
  attn = lora.add(reduce(plan, attn, scattered), d_o)
  x = x + residual_norm(plan, hparams, attn, w.post_attn_norm)
  xn = norm(plan, hparams, x, w.mlp_norm)
  out, d_down = mlp(plan, hparams, w, xn)
  out = lora.add(reduce(plan, out, scattered), d_down)
  return x + residual_norm(plan, hparams, out, w.post_mlp_norm), kv
