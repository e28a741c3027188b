"""Engines: weights placed for one layout, and their compiled programs.

  prefill_engine, generate_engine = make_engines(
      hparams, weights, mesh, (prefill_layout, generate_layout), ...)
  result = prefill_engine.prefill(caches, prev_logits, chunk, top_n=0,
                                  bos_id=1)
  state = generate_engine.init(caches, prev_logits, batch=8, steps=16, ...)
  state = generate_engine.run(caches, state, inputs, stop_at)

`InferenceModel` validates a call on the host, then hands it to the engine
of its phase; every engine follows the `Engine` protocol below and compiles
the same per-device functions (`prefill.prefill`, `generate.init`,
`generate.run`). `ReferenceEngine` runs them with `jax.jit` on JAX's default
device; `sharded_engine.ShardedEngine` runs them under `shard_map` on a
mesh, with the weights split (and reordered for collective matmuls) as the
layout says.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from chunkwise import numerics as numerics_lib
from chunkwise.configs import HParams
from chunkwise.inference import checks, generate, prefill
from chunkwise.inference.batching import rows as rows_lib
from chunkwise.inference.batching import slots as slots_lib
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.engines.sharded_engine import ShardedEngine
from chunkwise.inference.infer import InferFn, transformer_infer
from chunkwise.inference.kv_cache import KVCache
from chunkwise.inference.results import ChunkResult
from chunkwise.inference.speculation import speculative
from chunkwise.models import Weights, check_shapes, fused, lora, quantized
from chunkwise.partitioning import Layout, LayoutKind
from chunkwise.precision import with_precision


@runtime_checkable
class Engine(Protocol):
  """Weights placed for one layout, and the programs that read them.

  Inputs are validated by the caller; the engine only places and runs.
  """

  weights: Weights | fused.ShuffledWeights  # as placed

  def plain_weights(self) -> Weights:
    """The weights in plain block order, as placed."""
    ...

  def result_shardings(self, batch: int):
    """Where `prefill` of `batch` rows puts its ChunkResult (one sharding
    or a ChunkResult tree of them)."""
    ...

  def prefill(
    self,
    caches: Sequence[KVCache],
    prev: jax.Array | None,
    chunk: Chunk,
    *,
    top_n: int,
    bos_id: int,
  ) -> ChunkResult:
    """`prefill.prefill` of `chunk` after prefix `caches`, whose last
    next-token logits are `prev`."""
    ...

  def init(
    self,
    caches: Sequence[KVCache],
    prev: jax.Array | None,
    *,
    batch: int,
    steps: int,
    top_n: int,
    vocab: int,
    bos_id: int,
  ) -> generate.LoopState:
    """`generate.init`: the loop's state before its first step."""
    ...

  def run(
    self,
    caches: Sequence[KVCache],
    state: generate.LoopState,
    inputs: generate.LoopInputs,
    stop_at: jax.Array,
    adapters=None,
    speculation=None,
  ) -> generate.LoopState:
    """`generate.run` up to column `stop_at` (the state is donated); with
    a checked `Speculation`, `speculative.run`."""
    ...

  def slot_init(
    self,
    caches: Sequence[KVCache],
    *,
    slots: int,
    capacity: int,
    steps: int,
    top_n: int,
    vocab: int,
  ) -> slots_lib.SlotState:
    """`slots.init`: every slot free, after the shared prefix `caches`."""
    ...

  def slot_run(
    self,
    caches: Sequence[KVCache],
    state: slots_lib.SlotState,
    inputs: slots_lib.SlotInputs,
    max_steps: jax.Array,
    until_free: jax.Array,
    adapters=None,
    speculation=None,
    rows=None,
  ) -> slots_lib.SlotState:
    """`slots.run` (the state is donated); with a checked `Speculation`,
    `speculative.slot_run`. With `rows` (int32[n], the slots to run;
    `inputs` and `adapters` then have n rows), the other slots are left
    as they are (`rows.on_rows`); engines without `slot_rows` take None
    only."""
    ...


class ReferenceEngine:
  """The reference layout: the per-device functions jitted, no mesh."""

  def __init__(
    self,
    infer_fn: InferFn,
    weights,
    *,
    precision: str,
    numerics: str,
    hparams: HParams | None = None,
    platform: str | None = None,
  ):
    self.weights = weights
    self._hparams = hparams  # None: a custom infer_fn (no draft weights)
    self._draft = None

    def traced(fn):
      return with_precision(
        numerics_lib.traced(
          functools.partial(fn, infer_fn), numerics, platform
        ),
        precision,
      )

    self._prefill = jax.jit(
      traced(prefill.prefill), static_argnames=("top_n", "bos_id", "scores")
    )
    self._init = jax.jit(
      traced(generate.init),
      static_argnames=("batch", "steps", "top_n", "vocab", "bos_id"),
    )
    # The loop state is donated: segments of generate_stream reuse buffers.
    self._run = jax.jit(traced(generate.run), donate_argnames=("state",))
    self._slot_init = jax.jit(
      traced(slots_lib.init),
      static_argnames=(
        "slots",
        "capacity",
        "steps",
        "top_n",
        "vocab",
        "pages",
        "page",
      ),
    )
    self._slot_run = jax.jit(traced(slots_lib.run), donate_argnames=("state",))
    self._spec_run, self._spec_slot_run = (
      jax.jit(traced(fn), static_argnames=("spec",), donate_argnames=("state",))
      for fn in (speculative.run, speculative.slot_run)
    )
    # Some slots only (a bucket of the running requests: `rows.on_rows`).
    self._rows_run = jax.jit(
      traced(rows_lib.on_rows(slots_lib.run)), donate_argnames=("state",)
    )
    self._spec_rows_run = jax.jit(
      traced(rows_lib.on_rows(speculative.slot_run)),
      static_argnames=("spec",),
      donate_argnames=("state",),
    )

  # A slot loop may run a bucket of its slots (`slot_run(rows=)`).
  slot_rows = True

  def plain_weights(self):
    return self.weights

  def draft_weights(self):
    """The "draft" drafter's weights: these in int8, made on first use."""
    if self._draft is None:
      if self._hparams is None:
        raise ValueError(
          'Speculation(drafter="draft") needs the Transformer\'s weights; '
          "this engine runs a custom infer_fn"
        )
      specs = Weights.axes(self._hparams)
      self._draft = jax.jit(lambda w: quantized.quantize_weights(w, specs))(
        self.weights
      )
    return self._draft

  def _draft_for(self, speculation):
    """`draft_weights()` when `speculation` drafts with them, else None."""
    if speculation.drafter != "draft":
      return None
    return self.draft_weights()

  def result_shardings(self, batch: int):
    """Where results live: JAX's default device."""
    del batch
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def place_adapters(self, stacks):
    """LoRA stacks (`lora.stack`) on JAX's default device."""
    return jax.device_put(stacks)

  def _weights(self, adapters):
    """The programs' weights: with adapters (placed stacks, each row's
    adapter), `lora.Adapted`."""
    if adapters is None:
      return self.weights
    stacks, ids = adapters
    batch = lora.AdapterBatch(stacks, jnp.asarray(ids, jnp.int32))
    return lora.Adapted(self.weights, batch)

  def prefill(
    self,
    caches,
    prev,
    chunk,
    *,
    top_n,
    bos_id,
    scores: bool = True,
    adapters=None,
    compile_only: bool = False,
  ):
    """With `compile_only`, compiles the program and returns None."""
    args = (self._weights(adapters), caches, prev, chunk)
    static = dict(top_n=top_n, bos_id=bos_id, scores=scores)
    if compile_only:
      self._prefill.lower(*args, **static).compile()
      return None
    return self._prefill(*args, **static)

  def init(self, caches, prev, adapters=None, **static):
    return self._init(self._weights(adapters), caches, prev, **static)

  def run(
    self, caches, state, inputs, stop_at, adapters=None, speculation=None
  ):
    weights = self._weights(adapters)
    if speculation is not None:
      return self._spec_run(
        weights,
        caches,
        state,
        inputs,
        stop_at,
        self._draft_for(speculation),
        spec=speculation,
      )
    return self._run(weights, caches, state, inputs, stop_at)

  def slot_init(self, caches, adapters=None, **static):
    # Committed to the device, as every later program's output is: an
    # uncommitted state would compile the admission program a second time
    # once the loop's first segment has committed it.
    state = self._slot_init(self._weights(adapters), caches, **static)
    return jax.device_put(state, self.result_shardings(0))

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
    compile_only: bool = False,
  ):
    """With `compile_only`, compiles the program (or loads it from the
    persistent cache) and returns None: `state` may then be abstract
    (`jax.ShapeDtypeStruct`s with their shardings), nothing runs."""
    args = (self._weights(adapters), caches, state, inputs, max_steps)
    if speculation is not None:
      draft = self._draft_for(speculation)
      fn, args = self._spec_slot_run, (*args, until_free, draft)
      kwargs = dict(spec=speculation)
      if rows is not None:
        fn, kwargs = self._spec_rows_run, dict(kwargs, rows=rows)
    else:
      fn, args, kwargs = self._slot_run, (*args, until_free), {}
      if rows is not None:
        fn, kwargs = self._rows_run, dict(rows=rows)
    if compile_only:
      fn.lower(*args, **kwargs).compile()
      return None
    return fn(*args, **kwargs)


def make_engines(
  hparams: HParams,
  weights,
  mesh,
  phases: tuple[Layout, Layout],
  *,
  infer_fn: InferFn | None,
  cache_dtype,
  compute_dtype,
  precision: str,
  numerics: str = "fast",
  platform: str | None = None,
) -> tuple[Engine, Engine]:
  """The (prefill, generate) engines of validated `phases` on `mesh`; one
  engine when both phases share a layout. Weights placed for one layout
  are reused by the other where the placement allows it. The reference
  layout reads `weights` as given, with `infer_fn` (None: the
  Transformer's `transformer_infer`). `platform`: the one platform the
  reference engine's programs run on, where the caller knows it (their
  kernel calls then trace its branch only; None: every platform's). A
  sharded engine's programs run on its mesh's platform.

  Raises ValueError, before placing anything, for weights that do not fit
  `hparams`, an `infer_fn` with a sharded layout, or shuffled weights with
  the reference layout.
  """
  sharded = [p for p in phases if p.kind is not LayoutKind.REFERENCE]
  if infer_fn is not None and sharded:
    raise ValueError(
      f"infer_fn replaces the reference forward pass only; layouts "
      f"{[str(p) for p in sharded]} need the Transformer's"
    )
  shuffled = isinstance(weights, fused.ShuffledWeights)
  if shuffled and len(sharded) < len(phases):
    raise ValueError(
      f"weights shuffled for {weights.tag} cannot run the reference "
      "layout, which needs plain weights"
    )
  custom = infer_fn is not None
  if infer_fn is None:
    check_shapes(
      hparams,
      jax.eval_shape(fused.joined, weights.weights) if shuffled else weights,
    )
    infer_fn = functools.partial(
      transformer_infer,
      hparams,
      cache_dtype=cache_dtype,
      compute_dtype=compute_dtype,
    )
  engines: dict[Layout, Engine] = {}
  for lay in phases:
    if lay in engines:
      continue
    if lay.kind is LayoutKind.REFERENCE:
      engines[lay] = ReferenceEngine(
        infer_fn,
        weights,
        precision=precision,
        numerics=numerics,
        hparams=None if custom else hparams,
        platform=platform,
      )
      continue
    # Weights already placed by another layout are reused, unless shuffled
    # for another layout's collectives.
    placed = [
      e.weights
      for e in engines.values()
      if not isinstance(e.weights, fused.ShuffledWeights)
      or e.weights.tag == shuffle_tag(lay, mesh)
    ]
    engines[lay] = ShardedEngine(
      hparams,
      placed[0] if placed else weights,
      mesh,
      lay,
      cache_dtype=cache_dtype,
      compute_dtype=compute_dtype,
      precision=precision,
      numerics=numerics,
    )
  return engines[phases[0]], engines[phases[1]]


def prefix_inputs(prefix: Sequence[ChunkResult]):
  """What an engine reads of a call's prefix: (its KV caches, the last
  one's next-token logits or None)."""
  caches = tuple(p.kv_cache for p in prefix)
  return caches, (prefix[-1].next_token_logits if prefix else None)


# Arguments of the generate methods that `checks.check_generate` does not
# take.
_NOT_CHECKED = ("self", "prefix", "every", "adapters", "speculation")


def start_loop(
  engine: Engine,
  hparams: HParams,
  prefix: Sequence[ChunkResult],
  args: dict,
  *,
  eos_ids: tuple[int, ...],
  bos_id: int,
  vocabulary,
  adapters=None,
):
  """Validates a generate call (`checks.check_generate` of `args`, the
  generate method's `locals()`: constraints compiled, processors traced)
  before any device work, then starts its loop: returns (prefix caches,
  loop state, loop inputs) for `engine.run`."""
  call = checks.check_generate(
    hparams,
    prefix,
    eos_ids=eos_ids,
    vocabulary=vocabulary,
    **{k: v for k, v in args.items() if k not in _NOT_CHECKED},
  )
  caches, prev = prefix_inputs(call.prefix)
  state = engine.init(
    caches,
    prev,
    batch=call.batch,
    steps=call.steps,
    top_n=call.top_n,
    vocab=hparams.vocab,
    bos_id=bos_id,
    adapters=adapters,
  )
  state = state.replace(
    processor_states=jax.tree.map(jnp.asarray, call.processor_states)
  )
  inputs = generate.loop_inputs(
    caches, call.sample_ids, call.sampling, call.stop_ids, call.processors
  )
  return caches, state, inputs


def stream(
  engine: Engine,
  caches,
  state,
  inputs,
  steps: int,
  every: int,
  adapters=None,
  speculation=None,
) -> Iterator[tuple[Chunk, ChunkResult]]:
  """Runs the loop in segments of `every` columns, yielding each segment
  (`generate.segment`). Once every row has stopped, nothing more runs: the
  remaining (empty) segments are cut from the final state. With
  `speculation`, each segment carries the call's counts so far."""
  done = False
  for begin in range(0, steps, every):
    end = min(begin + every, steps)
    if not done:
      state = engine.run(
        caches, state, inputs, jnp.int32(end), adapters, speculation
      )
      done = bool(jnp.all(state.done))
    yield finished(state, begin, end)


def finished(
  state: generate.LoopState, begin: int, end: int
) -> tuple[Chunk, ChunkResult]:
  """`generate.segment`, with the speculation counts of the loop so far."""
  tokens, result = generate.segment(state, begin, end)
  if state.spec is not None:
    result = result.replace(speculation=state.spec.stats())
  return tokens, result


def compiled_programs(engine: Engine) -> int:
  """How many programs `engine` has compiled so far (its jitted functions'
  cache sizes; for benchmarks)."""
  fns = [*vars(engine).values(), *getattr(engine, "_programs", {}).values()]
  return sum(f._cache_size() for f in fns if hasattr(f, "_cache_size"))


def shuffle_tag(layout: Layout, mesh) -> fused.ShuffleTag:
  """The `ShuffledWeights.tag` that `layout` on `mesh` reads."""
  sizes = tuple((a, int(mesh.shape[a])) for a in mesh.axis_names)
  return fused.tag(layout.kind, layout.collectives, sizes)
