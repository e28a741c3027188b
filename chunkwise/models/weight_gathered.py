"""Per-device layers of the weight-gathered layout.

Weights are stored as in ws_2d ([E.X, H.YZ], ...); activations never move.
With the "xla" collectives each layer's weights are all-gathered whole just
before use; with the collective-matmul variants every projection streams
its weight shards around the ring instead (`collectives.stream_matmul`:
q/k/v/wi contract embed shards and place head or d_ff shards, o/wo contract
head or d_ff shards and place embed shards), and only the small norm scales
and biases are gathered. The batch is split over the plan's row axes
(x·y·z when the batch allows), so each device runs the plain per-device
math of `models.transformer` on its own rows:

  residual [B.XYZ, T, E]; logits [B.XYZ, T, V]; KV cache [B.XYZ, S, KVH]

`positions` are given for every row (replicated) and cut here; `prefix`
caches arrive already cut to this device's rows.
"""

from __future__ import annotations

import dataclasses

import jax

from chunkwise import collectives
from chunkwise.configs import HParams
from chunkwise.models import fused, lora, transformer
from chunkwise.models import shard_ops as ops
from chunkwise.models.attention import attend
from chunkwise.models.quantized import specs_like
from chunkwise.models.weights import Layer, Weights
from chunkwise.partitioning.layout import Collectives
from chunkwise.partitioning.plan import Plan


def _rows(plan: Plan, x: jax.Array) -> jax.Array:
  return ops.local_rows(
    x, plan.size(plan.resid_batch), ops.index(plan.resid_batch)
  )


def _whole(plan: Plan, tree, specs):
  return ops.gather_weights(tree, specs, plan.rules())


def _gathered(plan: Plan, hparams: HParams, weights: Weights, name: str):
  """`weights` with the table `name` gathered whole (only the table the
  caller reads: the others stay sharded)."""
  specs = specs_like(Weights.axes(hparams), lora.detach(weights))
  spec = getattr(specs, name)
  return weights.replace(**{name: _whole(plan, getattr(weights, name), spec)})


def embed(
  plan: Plan, hparams: HParams, weights: Weights, tokens: jax.Array, dtype
) -> jax.Array:
  """Token ids [B, T] (replicated) -> residual [B.rows, T, E]."""
  whole = _gathered(plan, hparams, weights, "embedding")
  x = transformer.embed(whole, _rows(plan, tokens), dtype)
  return transformer.scale_embedded(hparams, x)


def unembed(
  plan: Plan, hparams: HParams, weights: Weights, x: jax.Array
) -> jax.Array:
  """Final norm, then f32 logits [B.rows, T, V]."""
  tied = weights.unembedding is None
  name = "embedding" if tied else "unembedding"
  whole = _gathered(plan, hparams, weights, name)
  return transformer.unembed(hparams, whole, x)


def layer(
  plan: Plan,
  hparams: HParams,
  w: Layer,
  x: jax.Array,
  positions: jax.Array,
  prefix,
  site: transformer.Site,
):
  """One layer on this device's rows; returns (x, (k, v))."""
  adapters = _adapters(plan, w.lora)  # gathered whole, ids of these rows
  w = w.replace(lora=None)
  logical = Layer.axes(hparams)
  specs = specs_like(logical, w)
  rows = _rows(plan, positions)
  if plan.collectives is Collectives.XLA:
    whole = _whole(plan, w, specs).replace(lora=adapters)
    return transformer.block(hparams, whole, x, rows, attend, prefix, site)
  rules = plan.rules()
  streamed = {}
  for name in _MATRICES:
    spec = getattr(logical, name)  # a QArray's values and the array alike
    axes = tuple(() if n is None else tuple(rules[n]) for n in spec)
    streamed[name] = _Streamed(getattr(w, name), axes)
  small = w.replace(**{name: None for name in _MATRICES})
  small_specs = specs.replace(**{name: None for name in _MATRICES})
  local = _whole(plan, small, small_specs).replace(**streamed, lora=adapters)
  variant = plan.collectives

  def mm(eq, x, w: _Streamed):
    weight = w.array.astype(x.dtype)
    if isinstance(w.array, fused.Pieces):  # throughput: halves cut once
      weight = collectives.streaming.Halves(*weight, w.array.dim)
    return collectives.stream_matmul(
      variant, eq, x, weight, rhs_axes=w.rhs_axes
    )

  return transformer.block(hparams, local, x, rows, attend, prefix, site, mm)


_MATRICES = ("q", "k", "v", "o", "gate", "up", "down")


def _adapters(plan: Plan, lo):
  """A layer's LoRA stacks gathered whole (they are small) and the ids of
  this device's rows; None without adapters."""
  if lo is None:
    return None
  specs = lora.LayerLoRA.axes(lo.targets, lo.rank).replace(ids=None)
  stacks = _whole(plan, lo.replace(ids=None), specs)
  return stacks.replace(ids=_rows(plan, lo.ids))


@dataclasses.dataclass(frozen=True)
class _Streamed:
  """A weight's local shard (array or `QArray`) and the mesh axes
  splitting each dimension."""

  array: jax.Array
  rhs_axes: tuple[tuple[str, ...], ...]
