"""The `Weights` pytree: every parameter, one `Layer` of arrays per layer.

Each layer's weights are arrays of their own (not slices of a stacked
`[layers, ...]` array), so the forward pass reads every weight in place:
XLA copies a slice of a stacked array before a matmul uses it, which
read each weight byte twice and wrote it once per decode step (DESIGN §6).
Each type declares its logical axes once in `axes(hparams)`; layouts map
those names to mesh axes.

  h = configs.get("tiny")
  w = init_random(h, jax.random.key(0))
  len(w.layers)                     # h.layers
  w.layers[0].q.shape               # (d_model, heads, head_dim)
  Weights.axes(h).layers[0].q       # P('embed', 'heads', 'head_dim')

Conventions (all matmuls contract the *first* axis):
  q:  [embed, heads, head_dim]              k, v: [embed, kv_heads, head_dim]
  o:  [heads, head_dim, embed]
  gate, up: [embed, mlp]                    down: [mlp, embed]
  embedding: [vocab, embed]                 unembedding: [embed, vocab]
Query heads are grouped by K/V head: query head i uses K/V head
i // (heads // kv_heads), as in Hugging Face's `repeat_kv`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from chunkwise.configs import Block, HParams
from chunkwise.models import blocks, quantized
from chunkwise.models.blocks import BlockArray
from chunkwise.models.quantized import QArray
from chunkwise.partitioning import axes as ax


@struct.dataclass(kw_only=True)
class Layer:
  """One layer's parameters."""

  q: jax.Array  # [embed, heads, head_dim]
  k: jax.Array  # [embed, kv_heads, head_dim]
  v: jax.Array  # [embed, kv_heads, head_dim]
  o: jax.Array  # [heads, head_dim, embed]
  gate: jax.Array  # [embed, mlp]
  up: jax.Array  # [embed, mlp]
  down: jax.Array  # [mlp, embed]
  # RMSNorm scales; None without learned scales. A parallel block has one
  # norm in front of both branches (attn_norm), so mlp_norm is None there.
  attn_norm: jax.Array | None = None  # [embed]
  mlp_norm: jax.Array | None = None  # [embed]
  # Projection biases (HParams.qkv_bias, as in Qwen2); None without them.
  q_bias: jax.Array | None = None  # [heads, head_dim]
  k_bias: jax.Array | None = None  # [kv_heads, head_dim]
  v_bias: jax.Array | None = None  # [kv_heads, head_dim]
  # Norms of the branches' outputs (HParams.post_norms, Gemma 2/3).
  post_attn_norm: jax.Array | None = None  # [embed]
  post_mlp_norm: jax.Array | None = None  # [embed]
  # Per-head norms of queries and keys (HParams.qk_norm, Gemma 3).
  q_norm: jax.Array | None = None  # [head_dim]
  k_norm: jax.Array | None = None  # [head_dim]
  # LoRA adapters (`models.lora.LayerLoRA`): set only inside a forward
  # pass (`lora.attach`); None in stored and placed weights.
  lora: Any = None

  @classmethod
  def axes(cls, hparams: HParams) -> Layer:
    norm = P(ax.NORM) if hparams.norm_scale else None
    sequential = hparams.block == Block.SEQUENTIAL
    kv_bias = P(ax.KV_HEADS, ax.HEAD_DIM)
    return cls(
      q=P(ax.EMBED, ax.HEADS, ax.HEAD_DIM),
      k=P(ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM),
      v=P(ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM),
      o=P(ax.HEADS, ax.HEAD_DIM, ax.EMBED),
      gate=P(ax.EMBED, ax.MLP),
      up=P(ax.EMBED, ax.MLP),
      down=P(ax.MLP, ax.EMBED),
      attn_norm=norm,
      mlp_norm=norm if sequential else None,
      q_bias=P(ax.HEADS, ax.HEAD_DIM) if hparams.qkv_bias else None,
      k_bias=kv_bias if hparams.qkv_bias else None,
      v_bias=kv_bias if hparams.qkv_bias else None,
      post_attn_norm=norm if hparams.post_norms else None,
      post_mlp_norm=norm if hparams.post_norms else None,
      q_norm=P(ax.HEAD_DIM) if hparams.qk_norm else None,
      k_norm=P(ax.HEAD_DIM) if hparams.qk_norm else None,
    )


@struct.dataclass(kw_only=True)
class Weights:
  """A whole decoder-only Transformer."""

  embedding: jax.Array  # [vocab, embed]
  layers: tuple[Layer, ...]  # one per layer, first to last
  final_norm: jax.Array | None = None  # [embed]; None without learned scales
  unembedding: jax.Array | None = None  # [embed, vocab]; None when tied

  @classmethod
  def axes(cls, hparams: HParams) -> Weights:
    """Same tree as the weights of `hparams`; leaves are logical specs."""
    return cls(
      embedding=P(ax.VOCAB, ax.EMBED),
      layers=(Layer.axes(hparams),) * hparams.layers,
      final_norm=P(ax.NORM) if hparams.norm_scale else None,
      unembedding=(None if hparams.tied_embeddings else P(ax.EMBED, ax.VOCAB)),
    )


def shape_of(hparams: HParams, spec: P) -> tuple[int, ...]:
  """The shape `hparams` gives a weight of logical axes `spec`."""
  size = {
    ax.VOCAB: hparams.vocab,
    ax.EMBED: hparams.d_model,
    ax.NORM: hparams.d_model,
    ax.HEADS: hparams.heads,
    ax.KV_HEADS: hparams.kv_heads,
    ax.HEAD_DIM: hparams.head_dim,
    ax.MLP: hparams.d_ff,
  }
  return tuple(size[name] for name in spec)


def check_shapes(hparams: HParams, weights: Weights) -> None:
  """Raises ValueError naming the first leaf whose shape `hparams` rejects
  (int8 `QArray` leaves: int8 values of the weight's shape and scales of
  that shape with 1 on the contracted axes)."""
  specs = Weights.axes(hparams)
  want = jax.tree.structure(specs)
  got = jax.tree.structure(weights, is_leaf=_is_q)
  if want != got:
    raise ValueError(
      f"weights do not have the structure HParams asks for (norm_scale="
      f"{hparams.norm_scale}, block={hparams.block.value}, tied_embeddings="
      f"{hparams.tied_embeddings}, qkv_bias={hparams.qkv_bias}, post_norms="
      f"{hparams.post_norms}, qk_norm={hparams.qk_norm}): expected "
      f"{want}, got {got}"
    )
  for (path, spec), leaf in zip(
    jax.tree_util.tree_leaves_with_path(specs),
    jax.tree.leaves(weights, is_leaf=_is_q),
    strict=True,
  ):
    expected = shape_of(hparams, spec)
    name = jax.tree_util.keystr(path)
    if tuple(leaf.shape) != expected:
      raise ValueError(
        f"weight {name} has shape {tuple(leaf.shape)}, expected {expected} "
        f"{tuple(spec)} for these HParams"
      )
    if isinstance(leaf, BlockArray):
      blocks.check(leaf, name)
    elif isinstance(leaf, QArray):
      short = name.rsplit(".", 1)[-1]
      scales = {
        quantized.shape_like(expected, spec, short, grouped=g)
        for g in (True, False)
      }
      if leaf.values.dtype != jnp.int8 or tuple(leaf.scale.shape) not in scales:
        raise ValueError(
          f"int8 weight {name} has values of dtype {leaf.values.dtype} and "
          f"scales of shape {tuple(leaf.scale.shape)}; expected int8 values "
          f"and scales of shape {' or '.join(map(str, sorted(scales)))} "
          "(per group of inputs, or per output channel)"
        )


def _is_q(x) -> bool:
  return quantized.is_grouped(x)


def init_random(hparams: HParams, key: jax.Array, dtype=jnp.float32) -> Weights:
  """Random weights with activations of unit scale at every layer.

  Projections are N(0, 1/fan_in); the embedding is N(0, 1/d_model) so that
  next-token logits have unit scale; learned norm scales are 1 + N(0, 0.1²)
  so tests notice a scale that is dropped or applied twice; biases are
  N(0, 0.1²).
  """
  specs = Weights.axes(hparams)
  leaves, treedef = jax.tree.flatten(specs)
  paths = [
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_leaves_with_path(specs)
  ]
  keys = jax.random.split(key, len(leaves))
  fan_in = {
    ax.EMBED: hparams.d_model,
    ax.HEADS: hparams.heads * hparams.head_dim,
    ax.MLP: hparams.d_ff,
  }
  out = []
  for path, spec, k in zip(paths, leaves, keys, strict=True):
    shape = shape_of(hparams, spec)
    noise = jax.random.normal(k, shape, jnp.float32)
    if spec[-1] == ax.NORM or path.endswith("_norm"):
      value = 1.0 + 0.1 * noise
    elif path.endswith("_bias"):
      value = 0.1 * noise
    elif path.endswith(".embedding") or path.endswith(".unembedding"):
      value = noise / jnp.sqrt(hparams.d_model)
    else:
      # The first axis is the contracted one.
      value = noise / jnp.sqrt(fan_in[spec[0]])
    out.append(value.astype(dtype))
  return jax.tree.unflatten(treedef, out)


def stack_layers(layers: tuple[Layer, ...]) -> Layer:
  """The layers' arrays stacked on a new leading axis (`QArray`s stack
  their values and scales): the storage form of checkpoints saved before
  layers had arrays of their own."""
  return jax.tree.map(lambda *a: jnp.stack(a), *layers)


def unstack_layers(stacked: Layer) -> tuple[Layer, ...]:
  """`stack_layers` undone: one `Layer` per index of the leading axis."""
  n = jax.tree.leaves(stacked)[0].shape[0]
  return tuple(jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n))
