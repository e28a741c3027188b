"""Per-device Transformer math: norms, RoPE, the gated MLP, both block kinds.

Attention over KV caches is not here: `forward` takes an `attend` callback
(the inference package supplies one that reads prefix caches), so this module
knows nothing of caches, chunks or sampling. Everything is written for one
device's view of the arrays; sharded layouts add collectives around it.

  def attend(q, k, v, per_layer):  # q [B,T,H,D] k,v [B,T,KVH,D] -> [B,T,H,D]
    ...
  logits, (k, v) = forward(h, weights, tokens, positions, attend, per_layer)
  # logits f32[B, T, vocab]; k, v [layers, B, T, kv_heads, head_dim]
  x, (k, v), head = forward_hidden(...)  # head(x[:, t0:t1]): those logits

Numerics follow Hugging Face's Llama: RMSNorm in f32, scale applied after
normalisation; RoPE angles `position * base**(-2i/head_dim)` in f32 with the
rotate-half pairing (i, i + head_dim/2); logits in f32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from chunkwise import numerics
from chunkwise.configs import Activation, Block, HParams
from chunkwise.models import lora, rope
from chunkwise.models.attention import Options
from chunkwise.models.matmul import weight_matmul
from chunkwise.models.quantized import take_rows
from chunkwise.models.weights import Layer, Weights

# attend(q, k, v, per_layer, options) -> attention output [batch, time,
# heads, head_dim]
# q: [batch, time, heads, head_dim], RoPE applied, not yet scaled.
# k, v: [batch, time, kv_heads, head_dim], this chunk's keys (RoPE applied).
# per_layer: this layer's slice of the `per_layer` pytree given to `forward`.
# options: the layer's `attention.Options` (query scale, soft cap, window).
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, Any, Options], jax.Array]


def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float) -> jax.Array:
  """x / rms(x) (in f32), times the learned scale when there is one."""
  x32 = x.astype(jnp.float32)
  if numerics.fixed_sums():
    mean = numerics.last_sum(x32 * x32) / x.shape[-1]
  else:
    mean = jnp.mean(x32 * x32, axis=-1, keepdims=True)
  normed = x32 * lax.rsqrt(mean + eps)
  if scale is not None:
    normed = normed * scale.astype(jnp.float32)
  return normed.astype(x.dtype)


def _activation(kind: Activation, x: jax.Array) -> jax.Array:
  if kind == Activation.SILU:
    return numerics.silu(x)
  return numerics.gelu_tanh(x)


def _mm(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """`contract` with the weight cast to the activation dtype (a `QArray`
  dequantizes to it); decode-sized matmuls on CPU read the weight in
  place (`models.matmul`)."""
  return weight_matmul(spec, x, w)


def _bias(x: jax.Array, bias: jax.Array | None) -> jax.Array:
  """x [B, T, heads, head_dim] plus a per-head bias, when there is one."""
  return x if bias is None else x + bias.astype(x.dtype)


def mlp(hparams: HParams, w: Layer, x: jax.Array, mm=_mm) -> jax.Array:
  """Gated MLP: (act(x @ gate) * (x @ up)) @ down. x: [B, T, embed].
  LoRA adapters (`w.lora`) add their deltas to each projection."""
  d = lora.deltas(w.lora, "gate_up", x)
  gate = lora.add(mm("bte,ef->btf", x, w.gate), d.get("gate"))
  up = lora.add(mm("bte,ef->btf", x, w.up), d.get("up"))
  hidden = _activation(hparams.activation, gate) * up
  d = lora.deltas(w.lora, "down", hidden)
  return lora.add(mm("btf,fe->bte", hidden, w.down), d.get("down"))


def attention(
  hparams: HParams,
  w: Layer,
  x: jax.Array,
  positions: jax.Array,
  attend: AttendFn,
  per_layer: Any,
  site: Site,
  mm=_mm,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """Projections, RoPE, `attend`, output projection. x is already normed.

  Returns the attention branch [B, T, embed] and this chunk's (k, v), each
  [B, T, kv_heads, head_dim], for the caller to cache.
  """
  d = lora.deltas(w.lora, "qkv", x)
  q = _bias(lora.add(mm("bte,ehd->bthd", x, w.q), d.get("q")), w.q_bias)
  k = _bias(lora.add(mm("bte,ehd->bthd", x, w.k), d.get("k")), w.k_bias)
  v = _bias(lora.add(mm("bte,ehd->bthd", x, w.v), d.get("v")), w.v_bias)
  q, k = position_heads(hparams, w, q, k, positions, positions, site.rotation)
  out = attend(q, k, v, per_layer, site.options).astype(x.dtype)
  d = lora.deltas(w.lora, "o", out)  # out: [B, T, heads, head_dim]
  return lora.add(mm("bthd,hde->bte", out, w.o), d.get("o")), (k, v)


def position_heads(
  hparams: HParams,
  w: Layer,
  q: jax.Array,
  k: jax.Array,
  q_positions: jax.Array,
  k_positions: jax.Array,
  rotation: rope.Rotation,
) -> tuple[jax.Array, jax.Array]:
  """Per-head norms (`qk_norm`) and RoPE of queries and keys."""
  if hparams.qk_norm:
    q = rms_norm(q, w.q_norm, hparams.norm_eps)
    k = rms_norm(k, w.k_norm, hparams.norm_eps)
  return (
    rope.rotate(q, q_positions, rotation),
    rope.rotate(k, k_positions, rotation),
  )


class Site(NamedTuple):
  """What one layer computes differently from another: its RoPE and its
  attention options (`sites` makes them for a call)."""

  rotation: rope.Rotation
  options: Options


def sites(hparams: HParams, positions: jax.Array) -> tuple[Site, ...]:
  """Every layer's `Site` for a call at `positions` (all of its rows)."""
  rotations = rope.per_layer(hparams, positions)
  return tuple(Site(r, Options.of(hparams, i)) for i, r in enumerate(rotations))


def block(
  hparams: HParams,
  w: Layer,
  x: jax.Array,
  positions: jax.Array,
  attend: AttendFn,
  per_layer: Any,
  site: Site,
  mm=_mm,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """One Transformer layer (w is one layer's slice). Returns (x, (k, v)).

  `mm(eq, x, weight)` computes every projection (the weight-gathered
  layout passes one that streams sharded weights)."""
  eps = hparams.norm_eps
  if hparams.block == Block.PARALLEL:
    normed = rms_norm(x, w.attn_norm, eps)
    attn, kv = attention(
      hparams, w, normed, positions, attend, per_layer, site, mm
    )
    return x + attn + mlp(hparams, w, normed, mm), kv
  attn, kv = attention(
    hparams,
    w,
    rms_norm(x, w.attn_norm, eps),
    positions,
    attend,
    per_layer,
    site,
    mm,
  )
  x = x + _post_norm(attn, w.post_attn_norm, eps)
  out = mlp(hparams, w, rms_norm(x, w.mlp_norm, eps), mm)
  return x + _post_norm(out, w.post_mlp_norm, eps), kv


def _post_norm(x: jax.Array, scale: jax.Array | None, eps: float):
  """A branch's output normed before the residual add (`post_norms`)."""
  return x if scale is None else rms_norm(x, scale, eps)


def scale_embedded(hparams: HParams, x: jax.Array) -> jax.Array:
  """x times `embed_scale` rounded to x's dtype (as Gemma does)."""
  if hparams.embed_scale is None:
    return x
  return x * jnp.asarray(hparams.embed_scale, x.dtype)


def softcap(logits: jax.Array, cap: float | None) -> jax.Array:
  """cap * tanh(logits / cap); logits unchanged without a cap."""
  return logits if cap is None else cap * numerics.tanh(logits / cap)


def embed(weights: Weights, tokens: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Token ids int32[B, T] -> residual stream [B, T, embed].

  Ids outside the table (padding may hold anything) are clipped, not turned
  into NaN: a NaN key or value in a masked slot would still poison the
  attention sums (0 * NaN = NaN).
  """
  ids = jnp.clip(tokens, 0, weights.embedding.shape[0] - 1)
  return take_rows(weights.embedding, ids).astype(dtype)


def unembed(hparams: HParams, weights: Weights, x: jax.Array) -> jax.Array:
  """Final norm, then f32 logits [B, T, vocab]."""
  normed = rms_norm(x, weights.final_norm, hparams.norm_eps)
  normed = normed.astype(jnp.float32)
  if weights.unembedding is None:
    logits = weight_matmul("bte,ve->btv", normed, weights.embedding)
  else:
    logits = weight_matmul("bte,ev->btv", normed, weights.unembedding)
  return softcap(logits, hparams.final_softcap)


def forward_hidden(
  hparams: HParams,
  weights: Weights,
  tokens: jax.Array,
  positions: jax.Array,
  attend: AttendFn,
  per_layer: Any = None,
  dtype=jnp.float32,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """The whole model over one chunk, layer after layer.

  Args:
    tokens: int32[B, T].
    positions: int32[B, T], absolute positions (for RoPE).
    attend: see `AttendFn`.
    per_layer: one entry per layer (e.g. its pieces of the prefix KV
      caches), or None; `attend` gets layer i's entry.
    dtype: activation dtype of the residual stream.
  Returns:
    (x, (k, v), head): the last layer's output x [B, T, d_model]; k, v,
    each [layers, B, T, kv_heads, head_dim], the chunk's keys and values;
    and `head`, which maps x (or any slice of its positions) to f32 logits
    [B, t, vocab], each position on its own (`unembed`).
  """
  weights, adapters = lora.unwrap(weights)
  weights = lora.attach(weights, adapters)
  x = scale_embedded(hparams, embed(weights, tokens, dtype))
  layer_sites = sites(hparams, positions)

  def one(x, w, positions, extra, site):
    return block(hparams, w, x, positions, attend, extra, site)

  layer = traced_once(one) if TRACE_ONCE else one

  def step(i, x, w, extra):
    return layer(x, w, positions, extra, layer_sites[i])

  x, kv = run_layers(step, x, weights.layers, per_layer)
  return x, kv, functools.partial(unembed, hparams, weights)


def forward(*args, **kwargs) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """`forward_hidden`, then every position's logits: (logits f32[B, T,
  vocab], (k, v))."""
  x, kv, head = forward_hidden(*args, **kwargs)
  return head(x), kv


# Layers traced once (`traced_once`); False traces each layer apart, the
# plain twin (tests/test_transformer.py: the same numbers, bit for bit).
TRACE_ONCE = True


def traced_once(fn: Callable) -> Callable:
  """`fn`, traced once for every call whose arguments have the same
  shapes and static parts (a nested `jit`; XLA inlines its calls, so the
  program is the one the plain calls make). A 30-layer model's layers then
  trace once, not 30 times: half of a SmolLM2 program's tracing and
  lowering, which a server pays for every program at every start (its
  compiled code comes from the persistent cache; its traces do not).

  Arrays are traced; anything else in the arguments (bools, ints, None,
  options) is static, part of the key."""

  def inner(key, *dynamic):
    tree, statics = key
    it = iter(dynamic)
    leaves = [next(it) if s is _DYNAMIC else s for s in statics]
    return fn(*jax.tree.unflatten(tree, leaves))

  jitted = jax.jit(inner, static_argnums=0)

  def call(*args):
    leaves, tree = jax.tree.flatten(args)
    dynamic = [
      isinstance(a, (jax.Array, np.ndarray, np.generic)) for a in leaves
    ]
    statics = tuple(
      _DYNAMIC if d else a for a, d in zip(leaves, dynamic, strict=True)
    )
    arrays = [a for a, d in zip(leaves, dynamic, strict=True) if d]
    return jitted((tree, statics), *arrays)

  return call


_DYNAMIC = object()  # `traced_once`'s placeholder for a traced leaf


def run_layers(step, x, layers, per_layer):
  """`x, kv_i = step(i, x, layers[i], per_layer[i])` for every layer in turn
  (`per_layer` None: None), unrolled: each layer's weights are arrays of
  their own, read in place by its matmuls (a scan over stacked weights
  copies every slice first). Returns the final x and the layers' (k, v)
  stacked on a leading axis."""
  kvs = []
  for i, w in enumerate(layers):
    x, kv = step(i, x, w, None if per_layer is None else per_layer[i])
    kvs.append(kv)
  return x, jax.tree.map(lambda *a: jnp.stack(a), *kvs)
