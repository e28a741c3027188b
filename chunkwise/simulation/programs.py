"""What the simulation compiles: the engine's `jit(shard_map(...))`
program of a phase, traced on abstract inputs built as `InferenceModel`
builds its real ones (`trace`).

Nothing is allocated at model size. The weights are `ShapeDtypeStruct`s
(`abstract_weights`; int8 ones are `QArray`s of them, as
`quantize_weights` makes). `ShardedEngine` built on abstract weights
places them (each carries the `NamedSharding` the engine gives it) and
traces exactly the programs it would run, without running them;
`_Compiling` records those calls, and the phase's program (`prefill`,
the generate loop `run`, the slot loop's `slot_run` / `spec_slot_run`)
is returned with its recorded arguments. A paged pool runs without a
mesh: its slot loop is the reference engine's jitted program, its
arguments placed on the mesh's one device.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from chunkwise.bench import adapters as bench_adapters
from chunkwise.configs import HParams
from chunkwise.inference import generate, speculation
from chunkwise.inference.batching import slots as slots_lib
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.engines.engine import make_engines
from chunkwise.inference.engines.sharded_engine import ShardedEngine
from chunkwise.inference.kv_cache import KVCache
from chunkwise.inference.paging import paged_kv
from chunkwise.inference.sampling import Sampling
from chunkwise.models import (
  Weights,
  blocks,
  check_shapes,
  kv_int8,
  lora,
  quantized,
)
from chunkwise.models.weights import shape_of
from chunkwise.partitioning import Layout
from chunkwise.precision import resolve as resolve_precision


class Phase(enum.Enum):
  PREFILL = "prefill"  # program "prefill" of a chunk without prefix
  GENERATE = "generate"  # program "run": the decode loop after a prefix
  # program "slot_run" (with speculation "spec_slot_run", which verifies
  # drafts): the slot loop's segment, `batch` slots of `length` + `steps`
  # columns
  SLOTS = "slots"


class WeightFormat(enum.Enum):
  """How the simulated weights are stored."""

  F32 = "f32"
  BF16 = "bf16"
  INT8 = "int8"  # QArrays: int8 values, f32 group scales; norms bf16
  # GGUF blocks kept as they are (`models.blocks`): every matmul weight
  # and table in that type, blocked along its last contracted axis
  Q4_0 = "Q4_0"
  Q4_K = "Q4_K"
  Q8_0 = "Q8_0"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
  """One program to simulate."""

  phase: Phase
  layout: Layout
  batch: int
  length: int  # prefill: tokens per row; generate: the prefix's tokens
  steps: int = 8  # generate: decode steps (columns of the loop's buffer)
  weights: WeightFormat = WeightFormat.BF16
  # slots: speculative decoding (a `Speculation`), and LoRA adapters
  # (that many random rank-8 adapters on every target, each row its own)
  speculation: object = None
  adapters: int = 0
  # slots: the K/V in one paged pool of that many pages (on one device: a
  # pool runs without a mesh, by the reference engine's programs)
  pages: int = 0
  # "fast", or "invariant": a TPU program's invariant kernels
  # (`numerics.tpu_invariant`)
  numerics: str = "fast"

  def __str__(self) -> str:
    what = (
      f"L={self.length}"
      if self.phase is Phase.PREFILL
      else f"C={self.length} S={self.steps}"
    )
    extra = "".join(
      (
        f" spec={self.speculation.drafter}/k{self.speculation.k}"
        if self.speculation is not None
        else "",
        f" lora={self.adapters}" if self.adapters else "",
        f" pages={self.pages}" if self.pages else "",
        f" {self.numerics}" if self.numerics != "fast" else "",
      )
    )
    return (
      f"{self.phase.value} {self.layout} B={self.batch} {what} "
      f"{self.weights.value}{extra}"
    )


def abstract_weights(hparams: HParams, fmt: WeightFormat) -> Weights:
  """The weights of `hparams` as unplaced `ShapeDtypeStruct`s (int8:
  `QArray`s of them, with the scales `quantize_weights` gives; a GGUF
  type: `BlockArray`s of them)."""
  specs = Weights.axes(hparams)
  dtype = jnp.float32 if fmt is WeightFormat.F32 else jnp.bfloat16
  plain = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(shape_of(hparams, s), dtype),
    specs,
    is_leaf=lambda s: isinstance(s, P),
  )
  if fmt.value in blocks.FORMATS:

    def blocked(path, spec, w):
      name = quantized.key_name(path[-1])
      if name not in quantized.CONTRACTED:
        return w
      axis = quantized.contracted_dims(name, spec)[-1]
      return blocks.template(name, w.shape, fmt.value, axis)

    return jax.tree_util.tree_map_with_path(
      blocked, specs, plain, is_leaf=lambda s: isinstance(s, P)
    )
  if fmt is not WeightFormat.INT8:
    return plain
  return jax.eval_shape(
    functools.partial(quantized.quantize_weights, specs=specs), plain
  )


@dataclasses.dataclass(frozen=True)
class _Call:
  name: str  # the program's key name: "prefill", "init", "run", ...
  program: object  # the engine's jitted program
  args: tuple  # placed abstract arguments
  out: object  # placed abstract results
  trace_s: float


class _Compiling(ShardedEngine):
  """`ShardedEngine` driven with abstract inputs: every program call is
  traced (not run) and recorded in `calls`."""

  def __init__(self, *args, **kwargs):
    self.calls: list[_Call] = []
    super().__init__(*args, **kwargs)

  def _call(self, program, args, out_specs):
    start = time.perf_counter()
    out = super()._call(program, args, out_specs)
    key = next(k[0] for k, p in self._programs.items() if p is program)
    name = key if isinstance(key, str) else key[0]  # ("spec_slot_run", ..)
    seconds = time.perf_counter() - start
    self.calls.append(_Call(name, program, args, out, seconds))
    return out


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def trace(hparams, mesh, case, *, cache_dtype, compute_dtype) -> _Call:
  """The phase's program call, traced by the engine on abstract inputs
  built as `InferenceModel` builds its real ones."""
  if case.pages:
    return _trace_paged(
      hparams, mesh, case, cache_dtype=cache_dtype, compute_dtype=compute_dtype
    )
  weights = abstract_weights(hparams, case.weights)
  check_shapes(hparams, weights)
  engine = _Compiling(
    hparams,
    weights,
    mesh,
    case.layout,
    cache_dtype=cache_dtype,
    compute_dtype=compute_dtype,
    precision=resolve_precision(None, compute_dtype),
    numerics=case.numerics,
  )
  b = case.batch
  if case.phase is Phase.SLOTS:
    return _trace_slots(engine, hparams, case)
  if case.phase is Phase.PREFILL:
    chunk = Chunk(
      tokens=_sds((b, case.length), jnp.int32), lengths=_sds((b,), jnp.int32)
    )
    engine.prefill((), None, chunk, top_n=0, bos_id=0)
    return engine.calls[-1]
  h = hparams
  # int8 K/V carry each vector's scale on the last axis (`kv_int8`).
  width = kv_int8.width(h.head_dim, cache_dtype)
  kv = _sds((h.layers, b, case.length, h.kv_heads, width), cache_dtype)
  caches = (KVCache(k=kv, v=kv, lengths=_sds((b,), jnp.int32)),)
  prev = _sds((b, h.vocab), jnp.float32)
  state = engine.init(
    caches, prev, batch=b, steps=case.steps, top_n=0, vocab=h.vocab, bos_id=0
  )
  inputs = jax.eval_shape(
    lambda c: generate.loop_inputs(
      c, np.arange(b), Sampling().for_batch(b), np.zeros((1,), np.int32)
    ),
    caches,
  )
  engine.run(caches, state, inputs, _sds((), jnp.int32))
  return engine.calls[-1]


def _slot_inputs(b: int) -> slots_lib.SlotInputs:
  """Abstract settings of `b` slots (each its own, the seed too)."""
  rows = _sds((b,), jnp.int32)
  return slots_lib.SlotInputs(
    sample_ids=rows,
    start=rows,
    sampling=jax.tree.map(
      lambda x: _sds((b,), x.dtype),
      jax.eval_shape(lambda: Sampling().for_batch(b)),
    ),
    stop_ids=_sds((b, 1), jnp.int32),
    budget=rows,
  )


def _trace_paged(hparams, mesh, case, *, cache_dtype, compute_dtype) -> _Call:
  """The slot loop's segment over a pool of `case.pages` pages on the one
  device of `mesh`, by the reference engine's jitted `slots.run` (its
  arguments placed on that device)."""
  if mesh.devices.size != 1 or case.speculation or case.adapters:
    raise ValueError(
      f"a paged pool runs on one device without speculation or adapters; "
      f"got a mesh of {mesh.devices.size} for {case}"
    )
  one = jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])
  weights = abstract_weights(hparams, case.weights)
  _, engine = make_engines(
    hparams,
    weights,
    None,
    (Layout(), Layout()),
    infer_fn=None,
    cache_dtype=cache_dtype,
    compute_dtype=compute_dtype,
    precision=resolve_precision(None, compute_dtype),
  )
  b = case.batch
  state = jax.eval_shape(
    functools.partial(
      engine._slot_init,
      slots=b,
      capacity=case.length + case.steps,
      steps=case.steps,
      top_n=0,
      vocab=hparams.vocab,
      pages=case.pages,
      page=paged_kv.PAGE,
    ),
    weights,
    (),
  )
  args = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
    (
      weights,
      (),
      state,
      _slot_inputs(b),
      _sds((), jnp.int32),
      _sds((), jnp.bool_),
    ),
  )
  start = time.perf_counter()
  out = jax.eval_shape(engine._slot_run, *args)
  return _Call(
    "slot_run", engine._slot_run, args, out, time.perf_counter() - start
  )


def _trace_slots(engine: _Compiling, hparams, case) -> _Call:
  """The slot loop's segment: `batch` free slots of `length` + `steps`
  columns after no shared prefix, run with the case's speculation and
  adapters (each row its own)."""
  b = case.batch
  capacity = case.length + case.steps
  state = engine.slot_init(
    (),
    slots=b,
    capacity=capacity,
    steps=case.steps,
    top_n=0,
    vocab=hparams.vocab,
  )
  spec = case.speculation
  if spec is not None:
    spec = spec.checked()
    # Empty speculation rows, as admission starts them (the engine places
    # them with the state).
    rows = jax.eval_shape(
      lambda: speculation.SpecRows.start(
        np.zeros((b, capacity), np.int32),
        np.zeros((b,), np.int32),
        spec,
      )
    )
    state = state.replace(spec=rows)
  inputs = _slot_inputs(b)
  adapters = None
  if case.adapters:
    stacks = jax.eval_shape(
      lambda: lora.stack(
        hparams,
        [
          bench_adapters.random_adapter(hparams, 8, seed)
          for seed in range(case.adapters)
        ],
      )
    )
    # each row's adapter
    adapters = (engine.place_adapters(stacks), _sds((b,), jnp.int32))
  engine.slot_run(
    (),
    state,
    inputs,
    _sds((), jnp.int32),
    _sds((), jnp.bool_),
    adapters=adapters,
    speculation=spec,
  )
  return engine.calls[-1]
