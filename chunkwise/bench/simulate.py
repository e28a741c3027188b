"""Compile-only simulation at pod scale: the engine's programs compiled for
a mesh of fake host devices from abstract weights, and read back.

  # before JAX starts: XLA_FLAGS=--xla_force_host_platform_device_count=64
  h = configs.get("palm-540b")
  mesh = make_mesh((4, 4, 4))
  case = Case(phase=Phase.GENERATE, layout=Layout.parse("ws_2d/yzx"),
              batch=64, length=2048, steps=64, weights=WeightFormat.INT8)
  h = fit_to_mesh(h, [case.layout], mesh)   # 48 heads padded to 64
  report = simulate(h, mesh, case, depths=(2, 4), model="palm-540b")
  report["held"]["total"]           # bytes per device at 118 layers
  print(table([report]))
  # or: run("palm-540b", (4, 4, 4), [case]) pads and simulates each case

Nothing is allocated at model size. The weights are `ShapeDtypeStruct`s
(`abstract_weights`; int8 ones are `QArray`s of them, as
`quantize_weights` makes). `ShardedEngine` built on abstract weights
places them (each carries the `NamedSharding` the engine gives it) and
traces exactly the `jit(shard_map(...))` programs it would run, without
running them; `_Compiling` records those calls, and the program of the
phase (`prefill`, or the generate loop `run`) is lowered and compiled for
its recorded arguments.

Depth: compiling a layer costs time, so a program is compiled at a few
depths (2 and 4 layers by default) and every figure v is fitted as
v = fixed + layers * per_layer through the first and last depth (`_fit`),
then reported at the model's own depth ("scaled"; the report says so).
Arguments (weights, K/V caches) and collectives are linear in the depth
exactly; a third depth, where given, measures how far temp is from it.

What is read, per device:
  memory       `Compiled.memory_analysis()`: argument, output, alias
               (outputs written into donated arguments), temp, generated
               code (XLA:CPU reports 0); and the compiler's copies of whole
               weights (`hlo.weight_copy_sizes`: XLA:CPU's f32 twins of
               bf16 / int8 weights for its dots), their sum and largest;
  inputs       the abstract arguments' shard bytes by kind (weights, K/V
               caches, other), whose sum is the compiled argument size;
  collectives  of the compiled HLO (`hlo.collectives`; XLA:CPU runs bf16
               collectives in f32 and combines some) and of the
               unoptimized HLO ("program": the dtypes the program asks
               for, which an accelerator's compiler keeps), per kind:
               count, operand, result, full-size and sent bytes, and the
               program's collectives that each layer adds, by shape. The
               generate loop runs until every row stops, a trip count
               unknown when compiling: its collectives are one step's.
Beside them, where `chunkwise.planner` is present, its estimate of the
same configuration and the relative differences (`compare`).

XLA:CPU's defaults schedule every layer's all-gathers first and hoist the
f32 weight copies out of the decode loop, which an accelerator compiler
bounding its memory would not: `scripts/simulate.py` compiles with its
memory-minimizing scheduler and without loop-invariant code motion unless
told otherwise (XLA flags are read once, before JAX starts).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from chunkwise.bench import hlo
from chunkwise.configs import HParams
from chunkwise.inference import generate
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.kv_cache import KVCache
from chunkwise.inference.sampling import Sampling
from chunkwise.inference.sharded_engine import ShardedEngine
from chunkwise.models import Weights, check_shapes, quantized
from chunkwise.models.weights import shape_of
from chunkwise.partitioning import Layout
from chunkwise.partitioning.plan import check
from chunkwise.precision import resolve as resolve_precision

GiB = 1 << 30
MEMORY_FIELDS = ("argument", "output", "alias", "temp", "generated_code")
INPUT_KINDS = ("weights", "kv_cache", "other")
# Per collective kind; moved: what each device sends (`hlo.Collective`).
_METRICS = (
  "count",
  "operand_bytes",
  "result_bytes",
  "full_bytes",
  "moved_bytes",
)


class Phase(enum.Enum):
  PREFILL = "prefill"  # program "prefill" of a chunk without prefix
  GENERATE = "generate"  # program "run": the decode loop after a prefix


class WeightFormat(enum.Enum):
  """How the simulated weights are stored."""

  F32 = "f32"
  BF16 = "bf16"
  INT8 = "int8"  # QArrays: int8 values, f32 group scales; norms bf16


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
  """One program to simulate."""

  phase: Phase
  layout: Layout
  batch: int
  length: int  # prefill: tokens per row; generate: the prefix's tokens
  steps: int = 8  # generate: decode steps (columns of the loop's buffer)
  weights: WeightFormat = WeightFormat.BF16

  def __str__(self) -> str:
    what = (
      f"L={self.length}"
      if self.phase is Phase.PREFILL
      else f"C={self.length} S={self.steps}"
    )
    return (
      f"{self.phase.value} {self.layout} B={self.batch} {what} "
      f"{self.weights.value}"
    )


def abstract_weights(hparams: HParams, fmt: WeightFormat) -> Weights:
  """The weights of `hparams` as unplaced `ShapeDtypeStruct`s (int8:
  `QArray`s of them, with the scales `quantize_weights` gives)."""
  specs = Weights.axes(hparams)
  dtype = jnp.float32 if fmt is WeightFormat.F32 else jnp.bfloat16
  plain = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(shape_of(hparams, s), dtype),
    specs,
    is_leaf=lambda s: isinstance(s, P),
  )
  if fmt is not WeightFormat.INT8:
    return plain
  return jax.eval_shape(
    functools.partial(quantized.quantize_weights, specs=specs), plain
  )


def fit_to_mesh(
  hparams: HParams, layouts: Sequence[Layout], mesh: Mesh | AbstractMesh
) -> HParams:
  """`hparams` with the fewest query heads, then vocabulary rows, added
  that let every layout shard the model on `mesh` (Pope et al. padded
  PaLM 540B's 48 heads to 64 for 64 chips); `hparams` itself when they
  already do. Raises the layout check's ValueError when no padding of
  those two helps (e.g. d_ff does not divide)."""
  n = math.prod(mesh.shape.values())
  steps = [d for d in range(1, n + 1) if n % d == 0]

  def up(value, d):
    return -(-value // d) * d

  options = sorted(
    {(up(hparams.heads, a), up(hparams.vocab, b)) for a in steps for b in steps}
  )
  for heads, vocab in options:
    candidate = hparams.replace(heads=heads, vocab=vocab)
    try:
      for layout in layouts:
        check(layout, mesh, candidate)
    except ValueError:
      continue
    return candidate
  for layout in layouts:
    check(layout, mesh, hparams)
  return hparams


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
    name = next(k[0] for k, p in self._programs.items() if p is program)
    seconds = time.perf_counter() - start
    self.calls.append(_Call(name, program, args, out, seconds))
    return out


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _trace(hparams, mesh, case, *, cache_dtype, compute_dtype) -> _Call:
  """The phase's program call, traced by the engine on abstract inputs
  built as `InferenceModel` builds its real ones."""
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
  )
  b = case.batch
  if case.phase is Phase.PREFILL:
    chunk = Chunk(
      tokens=_sds((b, case.length), jnp.int32), lengths=_sds((b,), jnp.int32)
    )
    engine.prefill((), None, chunk, top_n=0, bos_id=0)
    return engine.calls[-1]
  h = hparams
  kv = _sds((h.layers, b, case.length, h.kv_heads, h.head_dim), cache_dtype)
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


def _shard_bytes(x) -> int:
  shape = x.shape if x.sharding is None else x.sharding.shard_shape(x.shape)
  return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def _by_kind(trees: Sequence, first_is_weights: bool) -> dict[str, int]:
  """Per-device bytes of `trees` (placed abstract values): weights (the
  first tree, when `first_is_weights`), K/V caches (any `k` or `v`
  field), other."""
  out = dict.fromkeys(INPUT_KINDS, 0)
  for i, tree in enumerate(trees):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      names = {getattr(key, "name", None) for key in path}
      if first_is_weights and i == 0:
        kind = "weights"
      elif names & {"k", "v"}:
        kind = "kv_cache"
      else:
        kind = "other"
      out[kind] += _shard_bytes(leaf)
  return out


def _summary(ops: Sequence[hlo.Collective]) -> dict:
  """Per kind: count, operand, result and full-size bytes per device, each
  op weighted by its executions (once per iteration of a loop of unknown
  trip count)."""
  out = {}
  for op in ops:
    n = 1 if op.times is None else op.times
    row = out.setdefault(op.kind, dict.fromkeys(_METRICS, 0))
    row["count"] += n
    row["operand_bytes"] += n * op.operand_bytes
    row["result_bytes"] += n * op.result_bytes
    row["full_bytes"] += n * op.full_bytes
    row["moved_bytes"] += n * op.moved_bytes
  return {k: out[k] for k in hlo.COLLECTIVE_KINDS if k in out}


def _kinds_of(ops: Sequence[hlo.Collective]) -> dict[str, int]:
  """Executions of each (kind, result shape, group size): the program's
  collectives by what they move."""
  out: dict[str, int] = {}
  for op in ops:
    key = f"{op.kind} {op.shape} group {op.group}"
    out[key] = out.get(key, 0) + (1 if op.times is None else op.times)
  return out


def _per_layer_ops(depths: Sequence[dict]) -> dict[str, float]:
  """The program's collectives that each layer adds (`_kinds_of` of the
  deepest program less the shallowest, per layer)."""
  first, last = depths[0], depths[-1]
  span = last["layers"] - first["layers"]
  out = {}
  for key, n in last["program_ops"].items():
    per = (n - first["program_ops"].get(key, 0)) / span
    if per:
      out[key] = per
  return out


def _compile_depth(hparams, mesh, case, **dtypes) -> dict:
  """Traces, lowers and compiles the phase's program at `hparams`' depth;
  returns its figures (see the module docstring)."""
  call = _trace(hparams, mesh, case, **dtypes)
  start = time.perf_counter()
  lowered = call.program.lower(*call.args)
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  compiled_at = time.perf_counter()
  mem = compiled.memory_analysis()
  memory = {f: int(getattr(mem, f"{f}_size_in_bytes")) for f in MEMORY_FIELDS}
  text = compiled.as_text()
  n_weights = len(jax.tree.leaves(call.args[0]))
  # Buffers the compiler makes out of whole weights, in temp (XLA:CPU
  # converts bf16 and int8 weights to f32 for its dots): their sum, and
  # the largest (temp holds at least that one).
  copies = hlo.weight_copy_sizes(text, n_weights)
  memory["weight_copies"] = sum(copies)
  memory["largest_weight_copy"] = max(copies, default=0)
  ops = hlo.collectives(text)
  program_ops = hlo.collectives(lowered.as_text(dialect="hlo"))
  return dict(
    layers=hparams.layers,
    program=call.name,
    trace_s=call.trace_s,
    lower_s=lowered_at - start,
    compile_s=compiled_at - lowered_at,
    memory=memory,
    inputs=_by_kind(call.args, first_is_weights=True),
    outputs=_by_kind([call.out], first_is_weights=False),
    collectives=_summary(ops),
    program_collectives=_summary(program_ops),
    program_ops=_kinds_of(program_ops),
    # Collectives inside a loop whose trip count the compiler does not
    # know (the decode loop): counted once, i.e. per decode step.
    per_iteration=sum(op.times is None for op in ops),
  )


def _fit(points: Sequence[tuple[int, float]], layers: int) -> dict:
  """v = fixed + depth * per_layer through the first and last points, at
  `layers`; `residual`: the worst miss of the points between. Nothing a
  layer holds or sends shrinks with depth: a negative slope (a scheduler
  reusing buffers a little differently, e.g. temp 0.436 then 0.432 GiB)
  is taken as 0 and the deepest value kept (`clamped`)."""
  (d0, v0), (d1, v1) = points[0], points[-1]
  per = (v1 - v0) / (d1 - d0)
  clamped = per < 0
  if clamped:
    per = 0.0
  fixed = v1 - d1 * per
  residual = max(
    (abs(v - fixed - d * per) for d, v in points[1:-1]), default=0.0
  )
  return dict(
    fixed=fixed,
    per_layer=per,
    total=fixed + layers * per,
    residual=residual,
    clamped=clamped,
  )


def _scaled(depths: Sequence[dict], layers: int) -> dict:
  def fit(get):
    return _fit([(d["layers"], get(d)) for d in depths], layers)

  d0 = depths[0]

  def collectives(key):
    kinds = {k for d in depths for k in d[key]}
    zero = dict.fromkeys(_METRICS, 0)
    return {
      kind: {
        metric: fit(lambda d, k=kind, m=metric: d[key].get(k, zero)[m])
        for metric in zero
      }
      for kind in hlo.COLLECTIVE_KINDS
      if kind in kinds
    }

  return dict(
    layers=layers,
    depths=[d["layers"] for d in depths],
    memory={f: fit(lambda d, f=f: d["memory"][f]) for f in d0["memory"]},
    inputs={k: fit(lambda d, k=k: d["inputs"][k]) for k in INPUT_KINDS},
    outputs={k: fit(lambda d, k=k: d["outputs"][k]) for k in INPUT_KINDS},
    collectives=collectives("collectives"),
    program_collectives=collectives("program_collectives"),
    program_ops_per_layer=_per_layer_ops(depths),
  )


def held_bytes(scaled: dict, phase: Phase) -> dict[str, float]:
  """Per-device bytes held at the model's depth, by what holds them:
  weights, K/V cache (the prefix and loop buffer a decode reads, or the
  cache a prefill writes), temporaries, and the rest of the arguments and
  outputs; `total` is arguments + outputs - aliased + temp.
  `weight_copies`: bytes of the compiler's copies of whole weights (in
  temp; all live at once only where the compiler hoists them), and the
  largest of them, which temp holds at some point."""
  total = {k: v["total"] for k, v in scaled["memory"].items()}
  ins = {k: v["total"] for k, v in scaled["inputs"].items()}
  outs = {k: v["total"] for k, v in scaled["outputs"].items()}
  # The loop's state is donated: its outputs are its arguments.
  kv = ins["kv_cache"] + (outs["kv_cache"] if phase is Phase.PREFILL else 0)
  whole = total["argument"] + total["output"] - total["alias"] + total["temp"]
  return dict(
    weights=ins["weights"],
    kv_cache=kv,
    temp=total["temp"],
    other=whole - ins["weights"] - kv - total["temp"],
    total=whole,
    weight_copies=total["weight_copies"],
    largest_weight_copy=total["largest_weight_copy"],
  )


def simulate(
  hparams: HParams,
  mesh: Mesh,
  case: Case,
  *,
  depths: Sequence[int] = (2, 4),
  cache_dtype=jnp.bfloat16,
  compute_dtype=jnp.bfloat16,
  model: str = "",
  hardware: str | None = "tpu-v4",
  log=None,
) -> dict:
  """Compiles `case` for `mesh` at each of `depths` (layers) of `hparams`
  and scales the figures to `hparams.layers`; with `hardware`, adds the
  planner's estimate beside them (`compare`). `log(message)` hears of each
  compile. Returns a JSON-ready dict (see the module docstring)."""
  depths = sorted(set(depths))
  if len(depths) < 2:
    raise ValueError(f"need two depths or more to scale, got {depths}")
  dtypes = dict(cache_dtype=cache_dtype, compute_dtype=compute_dtype)
  results = []
  for d in depths:
    if log:
      log(f"{model} {case}: compiling at {d} layers")
    results.append(
      _compile_depth(hparams.replace(layers=d), mesh, case, **dtypes)
    )
    if log:
      r = results[-1]
      log(
        f"  trace {r['trace_s']:.1f} s, lower {r['lower_s']:.1f} s, "
        f"compile {r['compile_s']:.1f} s"
      )
  scaled = _scaled(results, hparams.layers)
  report = dict(
    model=model,
    # The integer fields: widths, depth, heads, vocabulary, max_len.
    hparams={
      k: v
      for k, v in vars(hparams).items()
      if isinstance(v, int) and not isinstance(v, bool)
    },
    mesh=list(mesh.devices.shape),
    devices=int(mesh.devices.size),
    phase=case.phase.value,
    layout=str(case.layout),
    batch=case.batch,
    length=case.length,
    steps=case.steps if case.phase is Phase.GENERATE else None,
    weights=case.weights.value,
    cache_dtype=jnp.dtype(cache_dtype).name,
    compute_dtype=jnp.dtype(compute_dtype).name,
    compiled=results,
    scaled=scaled,
    held=held_bytes(scaled, case.phase),
    scaling=(
      f"compiled at {', '.join(map(str, depths))} layers; every figure "
      f"scaled to {hparams.layers} layers as fixed + layers * per_layer "
      f"(per_layer from the {depths[0]}- and {depths[-1]}-layer programs)"
    ),
    collectives_note=(
      "per device; 'program' from the unoptimized HLO (the program's "
      "dtypes), 'compiled' from XLA:CPU's optimized HLO, which computes "
      "bf16 collectives in f32 and combines some"
      + (
        "; the decode loop's trip count is unknown at compile time: "
        "collectives are per decode step"
        if case.phase is Phase.GENERATE
        else ""
      )
    ),
  )
  if hardware is not None:
    report.update(compare(report, hparams, case, hardware, **dtypes))
  return report


_DTYPE_NAMES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


def predict(hparams, mesh_shape, case: Case, hardware: str, **dtypes):
  """The planner's estimate of `case` (None when `chunkwise.planner` is
  absent). A prefill of L tokens attends to L/2 positions on average and
  holds L; a decode step to C + S/2 and holds C + S."""
  try:
    from chunkwise import planner
  except ImportError:
    return None
  if case.phase is Phase.PREFILL:
    tokens, context, held = case.length, case.length / 2, case.length
  else:
    tokens = 1
    context = case.length + case.steps / 2
    held = case.length + case.steps
  names = {k: _DTYPE_NAMES[jnp.dtype(v).name] for k, v in dtypes.items()}
  return planner.estimate(
    hparams,
    hardware,
    tuple(mesh_shape),
    case.layout,
    phase=case.phase.value,
    batch=case.batch,
    tokens=tokens,
    context=context,
    max_context=held,
    weights=case.weights.value,
    cache_dtype=names["cache_dtype"],
    act_dtype=names["compute_dtype"],
  )


def _row(quantity, compiled, predicted, note=""):
  rel = None if not predicted else (compiled - predicted) / predicted
  return dict(
    quantity=quantity,
    compiled=compiled,
    predicted=predicted,
    rel_diff=rel,
    note=note,
  )


def compare(report: dict, hparams, case: Case, hardware: str, **dtypes):
  """{"predicted": the planner's figures, "comparison": rows of (quantity,
  compiled, predicted, relative difference)}; empty without a planner."""
  est = predict(hparams, report["mesh"], case, hardware, **dtypes)
  if est is None:
    return dict(predicted=None, comparison=[])
  held = report["held"]
  comm = dict(est.comm_bytes_per_layer)
  predicted = dict(
    hardware=hardware,
    weight_bytes=est.weight_bytes,
    kv_bytes=est.kv_bytes,
    activation_bytes=est.activation_bytes,
    gathered_bytes=est.gathered_bytes,
    memory_bytes=est.memory_bytes,
    comm_bytes_per_layer=comm,
  )
  temp = est.activation_bytes + est.gathered_bytes
  rows = [
    _row("weights", held["weights"], est.weight_bytes),
    _row("kv_cache", held["kv_cache"], est.kv_bytes),
    _row("temp", held["temp"], temp, "planner: activations + gathered"),
    _row(
      "temp less the largest weight copy",
      held["temp"] - held["largest_weight_copy"],
      temp,
      "XLA:CPU's f32 copy of a weight for its dot; an accelerator reads "
      "bf16 / int8 weights in the matmul",
    ),
    _row("total", held["total"], est.memory_bytes),
  ]
  program = report["scaled"]["program_collectives"]

  def per_layer(kind, metric):
    return program.get(kind, {}).get(metric, {}).get("per_layer", 0.0)

  for kind in hlo.COLLECTIVE_KINDS:
    got = per_layer(kind, "full_bytes")
    if got or comm.get(kind):
      rows.append(_row(f"{kind} per layer", got, comm.get(kind, 0.0)))
  sizes = dict(zip("xyz", report["mesh"], strict=True))
  moved = 0.0
  for c in est.collectives:
    k = math.prod(sizes[a] for a in c.axes)
    moved += (2 if c.kind == "all-reduce" else 1) * c.bytes * (k - 1) / k
  predicted["moved_bytes_per_layer"] = moved
  rows.append(
    _row(
      "collectives per layer, bytes sent",
      sum(per_layer(kind, "moved_bytes") for kind in hlo.COLLECTIVE_KINDS),
      moved,
      "ring: (k-1)/k of the full side per group of k (all-reduce twice)",
    )
  )
  return dict(predicted=predicted, comparison=rows)


def _gib(x) -> str:
  return "-" if x is None else f"{x / GiB:.2f}"


def _pct(x) -> str:
  return "-" if x is None else f"{100 * x:+.0f}%"


def table(reports: Sequence[dict]) -> str:
  """A readable summary: memory per device at full depth (GiB, compiled
  and predicted), then per-layer collectives (MiB per device)."""
  lines = [
    f"{'model':<10} {'mesh':<6} {'configuration':<44} {'compile s':>9} "
    f"{'weights':>8} {'kv':>7} {'temp':>7} {'copy':>7} {'total':>7} "
    f"{'pred':>7} {'diff':>6}",
    "  (GiB per device at full depth; copy: the largest copy of a weight "
    "(XLA:CPU's f32 twins for its dots), part of temp; diff: total vs the "
    "planner's; compile s: lower + compile at the deepest depth)",
  ]
  for r in reports:
    held = r["held"]
    pred = (r.get("predicted") or {}).get("memory_bytes")
    rel = None if not pred else (held["total"] - pred) / pred
    config = (
      f"{r['phase']} {r['layout']} B={r['batch']} "
      + (
        f"L={r['length']}"
        if r["phase"] == "prefill"
        else f"C={r['length']}+{r['steps']}"
      )
      + f" {r['weights']}"
    )
    compile_s = sum(d["lower_s"] + d["compile_s"] for d in r["compiled"][-1:])
    lines.append(
      f"{r['model']:<10} {'x'.join(map(str, r['mesh'])):<6} {config:<44} "
      f"{compile_s:>9.1f} {_gib(held['weights']):>8} "
      f"{_gib(held['kv_cache']):>7} {_gib(held['temp']):>7} "
      f"{_gib(held['largest_weight_copy']):>7} {_gib(held['total']):>7} "
      f"{_gib(pred):>7} {_pct(rel):>6}"
    )
  lines.append("")
  lines.append(
    "per-layer collectives, MiB per device (program dtypes / XLA:CPU "
    "compiled) vs planner:"
  )
  for r in reports:
    comm = (r.get("predicted") or {}).get("comm_bytes_per_layer", {})
    parts = []
    for kind in hlo.COLLECTIVE_KINDS:
      prog = r["scaled"]["program_collectives"].get(kind)
      comp = r["scaled"]["collectives"].get(kind)
      if not prog and not comp and not comm.get(kind):
        continue

      def mib(fit):
        return 0.0 if not fit else fit["full_bytes"]["per_layer"] / (1 << 20)

      pred = comm.get(kind)
      parts.append(
        f"{kind} {mib(prog):.2f}/{mib(comp):.2f}"
        + ("" if pred is None else f" vs {pred / (1 << 20):.2f}")
      )
    lines.append(
      f"  {r['model']} {r['phase']} {r['layout']}: " + "; ".join(parts)
    )
  return "\n".join(lines)


def run(
  model: str,
  mesh_shape: Sequence[int],
  cases: Sequence[Case],
  *,
  depths: Sequence[int] = (2, 4),
  pad: bool = True,
  cache_dtype=jnp.bfloat16,
  compute_dtype=jnp.bfloat16,
  hardware: str | None = "tpu-v4",
  log=None,
) -> dict:
  """Simulates every case of preset `model` on a mesh of `mesh_shape`
  over the first devices of JAX's (fake host CPU devices: set
  --xla_force_host_platform_device_count before JAX starts). With `pad`,
  heads and vocabulary are padded for every case's layout
  (`fit_to_mesh`). Returns {"model", "mesh", "padded", "reports"}."""
  from chunkwise import configs
  from chunkwise.partitioning import make_mesh

  mesh_shape = tuple(int(n) for n in mesh_shape)
  n = math.prod(mesh_shape)
  devices = jax.devices()
  if len(devices) < n:
    raise ValueError(
      f"mesh {mesh_shape} needs {n} devices but JAX has {len(devices)}; "
      f"set XLA_FLAGS=--xla_force_host_platform_device_count={n} before "
      "JAX starts"
    )
  mesh = make_mesh(mesh_shape, devices[:n])
  real = configs.get(model)
  hparams = fit_to_mesh(real, [c.layout for c in cases], mesh) if pad else real
  padded = {
    k: [getattr(real, k), getattr(hparams, k)]
    for k in ("heads", "vocab")
    if getattr(real, k) != getattr(hparams, k)
  }
  if padded and log:
    log(f"padded for the mesh (from, to): {padded}")
  reports = [
    simulate(
      hparams,
      mesh,
      case,
      depths=depths,
      cache_dtype=cache_dtype,
      compute_dtype=compute_dtype,
      model=model,
      hardware=hardware,
      log=log,
    )
    for case in cases
  ]
  for r in reports:
    r["padded"] = padded
  return dict(
    model=model, mesh=list(mesh_shape), padded=padded, reports=reports
  )
