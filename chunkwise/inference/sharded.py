"""Sharded execution: one jitted `shard_map` program per phase and plan.

  engine = ShardedEngine(hparams, weights, mesh, Layout.parse("ws_2d/yz"))
  result = engine.prefill(caches, prev_logits, chunk, top_n=0, bos_id=1)
  state = engine.init(caches, prev_logits, batch=8, steps=16, ...)
  state = engine.run(caches, state, inputs, stop_at)

For every call the engine makes a `Plan` from the batch sizes (which axes
split rows, attention and the cache), derives every input and output
`PartitionSpec` from the pytrees' logical axes and the plan's rules, places
the inputs with those shardings (`jax.device_put` reshards a result made
under another layout) and runs the per-device program. Small per-row arrays
(tokens, lengths, scores) are replicated on every device; weights, KV
caches and logits are split.

Per device, `sharded_infer` is an `InferFn`: it cuts the prefix caches to
this device's attention rows and runs `models.sharded.forward`; prefill
scores and the generate loop samples through `logits.LogitsShards`, so
prefill and generate are the same code as the single-device reference.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from chunkwise.configs import HParams
from chunkwise.inference import generate
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.forward import positions_of
from chunkwise.inference.kv_cache import KVCache
from chunkwise.inference.logits import LogitsShards
from chunkwise.inference.results import ChunkResult, FullChunkResult
from chunkwise.models import Weights, sharded
from chunkwise.models import shard_ops as ops
from chunkwise.partitioning import Layout, Plan, resolve_tree


def sharded_infer(
  plan: Plan,
  hparams: HParams,
  weights: Weights,
  prefix: Sequence[KVCache],
  chunk: Chunk,
  *,
  cache_dtype,
  compute_dtype,
) -> FullChunkResult:
  """The forward pass on one device (an `InferFn` under `shard_map`).

  `chunk` and every cache's `lengths` are replicated; a prefix cache's k/v
  hold this device's block of rows when its batch divides the attention
  shards, else every row (then each device reads the one row its block
  needs). Caches past `plan.prefix_batches` (the generate loop's buffer)
  have the call's batch.
  """
  prefix = tuple(prefix)
  positions = positions_of(prefix, chunk)
  extra = len(prefix) - len(plan.prefix_batches)
  batches = (*plan.prefix_batches, *([plan.batch] * extra))
  n, i = plan.size(plan.attn_batch), ops.index(plan.attn_batch)
  local = []
  for cache, b in zip(prefix, batches, strict=True):
    k, v = cache.k, cache.v
    if b % n:  # replicated rows: keep the one this block reads
      k, v = (ops.local_rows(a, n, i, axis=1) for a in (k, v))
    local.append((k, v, ops.local_rows(cache.lengths, n, i)))
  logits, (k, v) = sharded.forward(
    plan, hparams, weights, chunk.tokens, positions, local, compute_dtype
  )
  cache = KVCache(
    k=k.astype(cache_dtype), v=v.astype(cache_dtype), lengths=chunk.lengths
  )
  return FullChunkResult(logits=logits, kv_cache=cache)


def _put(x, sharding: NamedSharding):
  """Places `x` with `sharding`, from the host or from another sharding
  (also across processes: host values must be equal on every process)."""
  if isinstance(x, jax.Array) and (
    not x.is_fully_addressable or sharding.is_fully_addressable
  ):
    return jax.device_put(x, sharding)
  host = np.asarray(x)
  return jax.make_array_from_callback(
    host.shape, sharding, lambda index: host[index]
  )


class ShardedEngine:
  """Weights placed on a mesh with one layout, and its compiled programs."""

  def __init__(
    self,
    hparams: HParams,
    weights: Weights,
    mesh: Mesh,
    layout: Layout,
    *,
    cache_dtype,
    compute_dtype,
  ):
    self.hparams = hparams
    self.mesh = mesh
    self.layout = layout
    self._dtypes = dict(cache_dtype=cache_dtype, compute_dtype=compute_dtype)
    self._specs = Weights.axes(hparams)
    plan = self.plan(1)
    self.weights = self.place(weights, self._specs, plan.rules())
    self._programs: dict = {}

  def plan(self, batch: int, prefix_batches: Sequence[int] = ()) -> Plan:
    return Plan.make(
      self.layout,
      self.mesh,
      self.hparams,
      batch=batch,
      prefix_batches=tuple(prefix_batches),
    )

  def place(self, tree, specs, rules):
    """`tree` placed with the shardings its logical `specs` resolve to."""
    mesh_specs = resolve_tree(specs, rules)
    return jax.tree.map(
      lambda x, s: _put(x, NamedSharding(self.mesh, s)), tree, mesh_specs
    )

  def _shards(self, plan: Plan) -> LogitsShards:
    return LogitsShards(
      vocab=self.hparams.vocab,
      batch_axes=plan.logits_batch,
      vocab_axes=plan.logits_vocab,
      sizes=plan.sizes,
    )

  def _infer(self, plan: Plan):
    return functools.partial(sharded_infer, plan, self.hparams, **self._dtypes)

  def _prefix_args(self, plan: Plan, caches, prev):
    """Places prefix caches and the carried logits; returns (args, specs)."""
    cache_specs, placed = [], []
    for cache in caches:
      rules = plan.prefix_rules(cache.batch)
      spec = resolve_tree(KVCache.axes(), rules)
      placed.append(self.place(cache, KVCache.axes(), rules))
      cache_specs.append(spec)
    prev_spec = P()
    if prev is not None:
      rules = plan.prefix_rules(prev.shape[0])
      logical = ChunkResult.axes().next_token_logits
      prev_spec = resolve_tree(logical, rules)
      prev = self.place(prev, logical, rules)
    return (tuple(placed), prev), (tuple(cache_specs), prev_spec)

  def _weight_spec(self, plan: Plan):
    return resolve_tree(self._specs, plan.rules())

  def _compile(self, key, build):
    if key not in self._programs:
      self._programs[key] = build()
    return self._programs[key]

  def _prev_split(self, plan: Plan, has_prev: bool) -> bool:
    if not has_prev:
      return False
    n = plan.size(plan.logits_batch)
    return plan.prefix_batches[-1] % n == 0

  def prefill(self, caches, prev, chunk: Chunk, *, top_n: int, bos_id: int):
    plan = self.plan(chunk.batch, [c.batch for c in caches])
    (caches, prev), (cache_specs, prev_spec) = self._prefix_args(
      plan, caches, prev
    )
    rules = plan.rules()
    chunk = self.place(chunk, Chunk.axes(), rules)
    has_prev = prev is not None

    def build():
      infer = self._infer(plan)
      shards = self._shards(plan)
      prev_split = self._prev_split(plan, has_prev)

      def per_device(weights, caches, prev, chunk):
        full = infer(weights, caches, chunk)
        return full.to_chunk_result(
          prev,
          chunk,
          top_n=top_n,
          bos_id=bos_id,
          shards=shards,
          prev_split=prev_split,
        )

      return jax.jit(
        jax.shard_map(
          per_device,
          mesh=self.mesh,
          in_specs=(
            self._weight_spec(plan),
            cache_specs,
            prev_spec,
            resolve_tree(Chunk.axes(), rules),
          ),
          out_specs=resolve_tree(ChunkResult.axes(), rules),
          # Outputs declared replicated are made so by explicit gathers.
          check_vma=False,
        )
      )

    program = self._compile(("prefill", plan, top_n, bos_id, has_prev), build)
    return program(self.weights, caches, prev, chunk)

  def init(self, caches, prev, *, batch, steps, top_n, vocab, bos_id):
    plan = self.plan(batch, [c.batch for c in caches])
    (caches, prev), (cache_specs, prev_spec) = self._prefix_args(
      plan, caches, prev
    )
    has_prev = prev is not None

    def build():
      init = functools.partial(
        generate.init,
        self._infer(plan),
        batch=batch,
        steps=steps,
        top_n=top_n,
        vocab=vocab,
        bos_id=bos_id,
        shards=self._shards(plan),
        prev_split=self._prev_split(plan, has_prev),
      )
      return jax.jit(
        jax.shard_map(
          init,
          mesh=self.mesh,
          in_specs=(self._weight_spec(plan), cache_specs, prev_spec),
          out_specs=resolve_tree(generate.LoopState.axes(), plan.rules()),
          check_vma=False,
        )
      )

    key = ("init", plan, steps, top_n, bos_id, has_prev)
    return self._compile(key, build)(self.weights, caches, prev)

  def run(self, caches, state, inputs, stop_at):
    plan = self.plan(state.tokens.shape[0], [c.batch for c in caches])
    (caches, _), (cache_specs, _) = self._prefix_args(plan, caches, None)
    rules = plan.rules()
    inputs = self.place(inputs, generate.LoopInputs.axes(), rules)

    def build():
      run = functools.partial(generate.run, self._infer(plan))

      def per_device(weights, caches, state, inputs, stop_at):
        return run(weights, caches, state, inputs, stop_at, self._shards(plan))

      state_spec = resolve_tree(generate.LoopState.axes(), rules)
      return jax.jit(
        jax.shard_map(
          per_device,
          mesh=self.mesh,
          in_specs=(
            self._weight_spec(plan),
            cache_specs,
            state_spec,
            resolve_tree(generate.LoopInputs.axes(), rules),
            P(),
          ),
          out_specs=state_spec,
          check_vma=False,
        ),
        donate_argnums=(2,),
      )

    program = self._compile(("run", plan), build)
    return program(
      self.weights, caches, state, inputs, _put(stop_at, self._replicated())
    )

  def _replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())
