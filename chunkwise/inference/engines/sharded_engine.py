"""The sharded engine: one jitted `shard_map` program per phase and plan.

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

Per device, `infer.sharded_infer` is an `InferFn`: it cuts the prefix
caches to this device's attention rows and runs `models.sharded_forward`;
prefill scores and the generate loop samples through `logits.LogitsShards`, so
prefill and generate are the same code as the reference engine's
(`engine.ReferenceEngine`).

An engine of abstract weights (`jax.ShapeDtypeStruct` leaves) runs
nothing: its methods take abstract inputs too and return their outputs'
shapes, placed as a real call would place them (`ShapeDtypeStruct`s that
carry the shardings), and nothing is allocated. `bench.simulate` drives
the engine that way to compile its programs at model size without the
weights.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from chunkwise.configs import HParams
from chunkwise.inference import generate, prefill
from chunkwise.inference.batching import slots as slots_lib
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.engines.mesh_programs import MeshPrograms
from chunkwise.inference.infer import sharded_infer
from chunkwise.inference.kv_cache import KVCache
from chunkwise.inference.logits import LogitsShards
from chunkwise.inference.results import ChunkResult
from chunkwise.inference.speculation import speculative
from chunkwise.models import (
  Weights,
  fused,
  lora,
  quantized,
)
from chunkwise.models import shard_ops as ops
from chunkwise.partitioning import Layout, Plan, formats, resolve_tree
from chunkwise.partitioning import axes as ax
from chunkwise.partitioning.placement import named


class ShardedEngine(MeshPrograms):
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
    precision: str,
    numerics: str = "fast",
  ):
    super().__init__(
      mesh,
      precision=precision,
      numerics=numerics,
      abstract=any(
        isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(weights)
      ),
    )
    self.hparams = hparams
    self.layout = layout
    self._dtypes = dict(cache_dtype=cache_dtype, compute_dtype=compute_dtype)
    self._draft = None  # (weights, specs) of the "draft" drafter
    # Where weights live depends on the layout only, never on a call.
    plan = self.plan(1)
    shuffled = isinstance(weights, fused.ShuffledWeights)
    plain = (
      jax.eval_shape(fused.joined, weights.weights) if shuffled else weights
    )
    logical = quantized.specs_like(Weights.axes(hparams), plain)
    want = (
      fused.tag(plan.kind, plan.collectives, plan.sizes)
      if fused.needs_shuffle(plan.kind, plan.collectives)
      else None
    )
    specs = resolve_tree(logical, plan.rules())
    self._plain_specs = specs  # of the weights in plain order
    if shuffled:
      fused.unwrap(plan, weights)  # raises unless shuffled for this layout
      specs = fused.ShuffledWeights(
        fused.shuffled_specs(plan, specs, plain), tag=weights.tag
      )
    self.weights = jax.tree.map(
      self._put_as,
      weights,
      formats.weights(self.mesh, specs, weights, self._platform),
    )
    self._weight_specs = specs
    if want is not None and not shuffled:
      # Reordered and cut once here; every program then reads the pieces
      # in place.
      shuffled_specs = fused.ShuffledWeights(
        fused.shuffled_specs(plan, specs, weights), tag=want
      )
      program = functools.partial(
        self._program,
        per_device=functools.partial(fused.shuffle, plan),
        in_specs=(self._weight_specs,),
        out_specs=shuffled_specs,
      )
      out_formats = None
      if self._platform in formats.STORING:  # elsewhere: no shapes traced
        shapes = jax.eval_shape(program(("shuffled shapes",)), self.weights)
        out_formats = formats.weights(
          self.mesh, shuffled_specs, shapes, self._platform
        )
      shuffle = program(("shuffle",), out_formats=out_formats)
      self.weights = self._call(shuffle, (self.weights,), shuffled_specs)
      self._weight_specs = shuffled_specs

  def plain_weights(self) -> Weights:
    """The weights in plain block order, placed as they are (shuffled
    weights are reordered back on every device)."""
    if not isinstance(self.weights, fused.ShuffledWeights):
      return self.weights
    unshuffle = self._program(
      ("unshuffle",),
      functools.partial(fused.unshuffle, self.plan(1)),
      (self._weight_specs,),
      self._plain_specs,
    )
    return self._call(unshuffle, (self.weights,), self._plain_specs)

  def draft_weights(self):
    """(weights, specs) of the "draft" drafter: these weights in int8,
    placed (and shuffled) for this layout; made on first use."""
    if self._draft is None:
      specs = Weights.axes(self.hparams)
      fn = lambda w: quantized.quantize_weights(w, specs)
      plain = self.plain_weights()
      q = jax.eval_shape(fn, plain) if self._abstract else jax.jit(fn)(plain)
      engine = ShardedEngine(
        self.hparams,
        q,
        self.mesh,
        self.layout,
        **self._dtypes,
        precision=self._precision,
        numerics=self._numerics,
      )
      self._draft = engine.weights, engine._weight_specs
    return self._draft

  def place_adapters(self, stacks):
    """LoRA stacks (`lora.stack`) placed like their base weights (the
    adapter and rank axes replicated)."""
    specs = self._adapter_specs(stacks)
    return jax.tree.map(self._put, stacks, specs)

  def _adapter_specs(self, stacks):
    one = lora.LayerLoRA.axes(stacks[0].targets, stacks[0].rank)
    one = one.replace(ids=None)
    return resolve_tree((one,) * len(stacks), self.plan(1).rules())

  def _weights(self, adapters):
    """(the programs' weights argument, its specs, a program-key part):
    with adapters (placed stacks, each row's adapter), `lora.Adapted`."""
    if adapters is None:
      return self.weights, self._weight_specs, None
    stacks, ids = adapters
    targets = (stacks[0].targets, stacks[0].rank)
    specs = self._adapter_specs(stacks)
    if not isinstance(ids, jax.ShapeDtypeStruct):  # abstract: compiling
      ids = jnp.asarray(ids, jnp.int32)
    ids = self._put(ids, P())
    return (
      lora.Adapted(self.weights, lora.AdapterBatch(stacks, ids)),
      lora.Adapted(self._weight_specs, lora.AdapterBatch(specs, P())),
      targets,
    )

  def result_shardings(self, batch: int) -> ChunkResult:
    """Where `prefill` of a batch of `batch` rows puts its ChunkResult."""
    return named(
      self.mesh, resolve_tree(ChunkResult.axes(), self.plan(batch).rules())
    )

  def plan(self, batch: int, prefix_batches: Sequence[int] = ()) -> Plan:
    return Plan.make(
      self.layout,
      self.mesh,
      self.hparams,
      batch=batch,
      prefix_batches=tuple(prefix_batches),
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
    """Places prefix caches and the carried logits (each split like the
    call's rows when its batch divides them, see `Plan.prefix_rules`).

    Returns ((caches, prev), (cache specs, prev spec), prev_split), where
    prev_split says whether `prev` is split over rows like the logits.
    """
    placed = [
      self._place(c, KVCache.axes(), plan.prefix_rules(c.batch)) for c in caches
    ]
    caches = tuple(c for c, _ in placed)
    cache_specs = tuple(spec for _, spec in placed)
    if prev is None:
      return (caches, None), (cache_specs, P()), False
    rules = plan.prefix_rules(prev.shape[0])
    logical = ChunkResult.axes().next_token_logits
    prev, prev_spec = self._place(prev, logical, rules)
    prev_split = rules[ax.LOGITS_BATCH] == plan.logits_batch
    return (caches, prev), (cache_specs, prev_spec), prev_split

  def prefill(
    self,
    caches,
    prev,
    chunk: Chunk,
    *,
    top_n: int,
    bos_id: int,
    scores: bool = True,
    adapters=None,
    compile_only: bool = False,
  ):
    plan = self.plan(chunk.batch, [c.batch for c in caches])
    weights, weight_specs, adapter_key = self._weights(adapters)
    (caches, prev), (cache_specs, prev_spec), prev_split = self._prefix_args(
      plan, caches, prev
    )
    rules = plan.rules()
    chunk, chunk_spec = self._place(chunk, Chunk.axes(), rules)
    per_device = functools.partial(
      prefill.prefill,
      self._infer(plan),
      top_n=top_n,
      bos_id=bos_id,
      shards=self._shards(plan),
      prev_split=prev_split,
      scores=scores,
    )

    out_specs = resolve_tree(ChunkResult.axes(), rules)
    key = (plan, top_n, bos_id, scores, prev is not None, adapter_key)
    program = self._program(
      ("prefill", *key),
      per_device,
      (weight_specs, cache_specs, prev_spec, chunk_spec),
      out_specs,
      out_logical=ChunkResult.axes(),
    )
    if compile_only:
      program.lower(weights, caches, prev, chunk).compile()
      return None
    return self._call(program, (weights, caches, prev, chunk), out_specs)

  def init(
    self, caches, prev, *, batch, steps, top_n, vocab, bos_id, adapters=None
  ):
    plan = self.plan(batch, [c.batch for c in caches])
    weights, weight_specs, adapter_key = self._weights(adapters)
    (caches, prev), (cache_specs, prev_spec), prev_split = self._prefix_args(
      plan, caches, prev
    )
    per_device = functools.partial(
      generate.init,
      self._infer(plan),
      batch=batch,
      steps=steps,
      top_n=top_n,
      vocab=vocab,
      bos_id=bos_id,
      shards=self._shards(plan),
      prev_split=prev_split,
    )
    out_logical = generate.LoopState.axes(self.hparams.layers)
    out_specs = resolve_tree(out_logical, plan.rules())
    program = self._program(
      ("init", plan, steps, top_n, bos_id, prev is not None, adapter_key),
      per_device,
      (weight_specs, cache_specs, prev_spec),
      out_specs,
      out_logical=out_logical,
    )
    return self._call(program, (weights, caches, prev), out_specs)

  def run(
    self, caches, state, inputs, stop_at, adapters=None, speculation=None
  ):
    plan = self.plan(state.tokens.shape[0], [c.batch for c in caches])
    if speculation is None:
      name, fn, extra = "run", generate.run, {}
    else:
      name = ("spec_run", speculation)
      fn = functools.partial(speculative.run, spec=speculation)
      extra = dict(kv_rows=self._kv_rows(plan))
    draft = self._draft_for(speculation)
    per_device = functools.partial(
      fn, self._infer(plan), shards=self._shards(plan), **extra
    )
    return self._loop(
      name,
      plan,
      per_device,
      caches,
      state,
      generate.LoopState.axes(
        self.hparams.layers, state.processor_states, state.spec is not None
      ),
      inputs,
      generate.LoopInputs.axes(inputs.processors),
      stop_at,
      adapters=adapters,
      draft=draft,
    )

  def _draft_for(self, speculation):
    """`draft_weights()` when `speculation` drafts with them, else None."""
    if speculation is None or speculation.drafter != "draft":
      return None
    return self.draft_weights()

  def _kv_rows(self, plan: Plan):
    """Maps a per-row array to the rows of the K/V buffer this device
    holds."""
    n, i = plan.size(plan.attn_batch), plan.attn_batch
    return lambda x: ops.local_rows(x, n, ops.index(i))

  def slot_init(
    self, caches, *, slots: int, capacity, steps, top_n, vocab, adapters=None
  ):
    plan = self.plan(slots, [c.batch for c in caches])
    weights, weight_specs, adapter_key = self._weights(adapters)
    (caches, _), (cache_specs, _), _ = self._prefix_args(plan, caches, None)
    per_device = functools.partial(
      slots_lib.init,
      self._infer(plan),
      slots=slots,
      capacity=capacity,
      steps=steps,
      top_n=top_n,
      vocab=vocab,
      shards=self._shards(plan),
    )
    out_logical = slots_lib.SlotState.axes(self.hparams.layers)
    out_specs = resolve_tree(out_logical, plan.rules())
    program = self._program(
      ("slot_init", plan, capacity, steps, top_n, adapter_key),
      per_device,
      (weight_specs, cache_specs),
      out_specs,
      out_logical=out_logical,
    )
    return self._call(program, (weights, caches), out_specs)

  # Every slot of a loop runs each segment: a slot loop's rows are sharded
  # over the attention batch, so buckets of them are not offered here.
  slot_rows = False

  def slot_run(
    self,
    caches,
    state,
    inputs,
    max_steps,
    until_free,
    adapters=None,
    speculation=None,
    rows=None,
  ):
    if rows is not None:
      raise ValueError(
        "a sharded engine runs every slot of a loop (slot_rows is False)"
      )
    plan = self.plan(state.slots, [c.batch for c in caches])
    if speculation is None:
      name, fn = "slot_run", slots_lib.run
    else:
      name = ("spec_slot_run", speculation)
      fn = functools.partial(speculative.slot_run, spec=speculation)
    draft = self._draft_for(speculation)
    per_device = functools.partial(
      fn,
      self._infer(plan),
      shards=self._shards(plan),
      kv_rows=self._kv_rows(plan),
    )
    return self._loop(
      name,
      plan,
      per_device,
      caches,
      state,
      slots_lib.SlotState.axes(
        self.hparams.layers, state.processor_states, state.spec is not None
      ),
      inputs,
      slots_lib.SlotInputs.axes(inputs.processors),
      max_steps,
      until_free,
      adapters=adapters,
      draft=draft,
    )

  def _loop(
    self,
    name,
    plan,
    per_device,
    caches,
    state,
    state_axes,
    inputs,
    inputs_axes,
    *scalars,
    adapters=None,
    draft=None,
  ):
    """Runs a loop program `per_device(weights, caches, state, inputs,
    *scalars[, draft weights])` that returns the state (donated); `draft`
    is `draft_weights()` or None."""
    (caches, _), (cache_specs, _), _ = self._prefix_args(plan, caches, None)
    weights, weight_specs, adapter_key = self._weights(adapters)
    rules = plan.rules()
    inputs, inputs_spec = self._place(inputs, inputs_axes, rules)
    scalars, scalar_specs = self._place(scalars, (P(),) * len(scalars), rules)
    # Processor states join the state on the host: place them too.
    state, state_spec = self._place(state, state_axes, rules)
    program = self._program(
      (
        name,
        plan,
        jax.tree.structure(inputs.processors),
        jax.tree.structure(state.processor_states),
        adapter_key,
      ),
      per_device,
      (
        weight_specs,
        cache_specs,
        state_spec,
        inputs_spec,
        *scalar_specs,
        *([] if draft is None else [draft[1]]),
      ),
      state_spec,
      out_logical=state_axes,
      donate_argnums=(2,),
    )
    args = (weights, caches, state, inputs, *scalars)
    return self._call(
      program, args + (() if draft is None else (draft[0],)), state_spec
    )
