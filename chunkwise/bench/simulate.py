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

The program of each case is traced and compiled from abstract weights,
allocating nothing at model size, and its memory and collectives read
back (`simulate_compile`); beside them, where `chunkwise.planner` is
present, its estimate of the same configuration and the relative
differences (`simulate_report`, which also prints the `table`).

Depth: compiling a layer costs time, so a program is compiled at a few
depths (2 and 4 layers by default) and every figure v is fitted as
v = fixed + layers * per_layer through the first and last depth (`_fit`),
then reported at the model's own depth ("scaled"; the report says so).
Arguments (weights, K/V caches) and collectives are linear in the depth
exactly; a third depth, where given, measures how far temp is from it.
The program's collectives that each layer adds are reported by shape.

XLA:CPU's defaults schedule every layer's all-gathers first and hoist the
f32 weight copies out of the decode loop, which an accelerator compiler
bounding its memory would not: `scripts/simulate.py` compiles with its
memory-minimizing scheduler and without loop-invariant code motion unless
told otherwise (XLA flags are read once, before JAX starts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from chunkwise.bench import hlo
from chunkwise.bench.simulate_compile import (
  INPUT_KINDS,
  METRICS,
  Case,
  Phase,
  compile_depth,
)
from chunkwise.bench.simulate_report import compare
from chunkwise.configs import HParams
from chunkwise.partitioning import Layout
from chunkwise.partitioning.plan import check


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
    zero = dict.fromkeys(METRICS, 0)
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
      compile_depth(hparams.replace(layers=d), mesh, case, **dtypes)
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
