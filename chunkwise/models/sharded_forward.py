"""The whole model on one device's shards: embed, layers, unembed.

  x, (k, v), head = forward_hidden(plan, hparams, weights, tokens,
                                   positions, per_layer, dtype)
  logits = head(x)  # or head(x[:, t0:t1]): those positions' logits

`plan.kind` picks the per-device layer code (`weight_stationary` for ws_1d
and ws_2d, `weight_gathered` for wg). Inputs: the weights' local shards
(`fused.ShuffledWeights` where the plan's collectives need them),
token ids and absolute positions [B, T] of every row (replicated), and per
layer the prefix caches' `attention.PrefixLayer`s cut to this device's
attention rows. Outputs: logits split as `plan.logits_batch`
/ `plan.logits_vocab` say, and the chunk's (k, v) [layers, rows, T, heads,
D] split like the KV cache.
"""

from __future__ import annotations

import functools

import jax

from chunkwise.configs import HParams
from chunkwise.models import (
  fused,
  lora,
  transformer,
  weight_gathered,
  weight_stationary,
)
from chunkwise.models.weights import Weights
from chunkwise.partitioning.layout import LayoutKind
from chunkwise.partitioning.plan import Plan


def layers_module(plan: Plan):
  if plan.kind is LayoutKind.WG:
    return weight_gathered
  if plan.kind in (LayoutKind.WS_1D, LayoutKind.WS_2D):
    return weight_stationary
  raise ValueError(f"no per-device layers for layout kind {plan.kind}")


def forward_hidden(
  plan: Plan,
  hparams: HParams,
  weights: Weights,
  tokens: jax.Array,
  positions: jax.Array,
  per_layer,
  dtype,
):
  mod = layers_module(plan)
  weights, adapters = lora.unwrap(weights)
  weights = lora.attach(fused.unwrap(plan, weights), adapters)
  x = mod.embed(plan, hparams, weights, tokens, dtype)
  sites = transformer.sites(hparams, positions)

  def step(i, x, w, pieces):
    return mod.layer(plan, hparams, w, x, positions, pieces, sites[i])

  x, kv = transformer.run_layers(step, x, weights.layers, per_layer)
  return x, kv, functools.partial(mod.unembed, plan, hparams, weights)
