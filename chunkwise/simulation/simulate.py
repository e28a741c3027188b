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
back (`compiled`); beside them, where `chunkwise.planner` is
present, its estimate of the same configuration and the relative
differences (`report`, which also prints the `table`).

Depth: compiling a layer costs time, so a program is compiled at a few
depths (2 and 4 layers by default) and every figure v is fitted as
v = fixed + layers * per_layer, the line through two depths or fitted to
more by least squares (`_fit`), then reported at the model's own depth
("scaled"; the report says so). Arguments (weights, K/V caches) and
collectives are linear in the depth exactly; temporaries and XLA:TPU's
cycles vary a little from program to program, and the slope multiplies
that variation by the depth: more depths (`--layers=2,4,6,8`) average it,
and `residual` says how far the worst depth is from the line.
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

from chunkwise.configs import HParams
from chunkwise.partitioning import Layout
from chunkwise.partitioning.plan import check
from chunkwise.simulation import hlo, tpu_target
from chunkwise.simulation.compiled import (
  INPUT_KINDS,
  METRICS,
  compile_depth,
)
from chunkwise.simulation.programs import (  # noqa: F401 (the cases)
  Case,
  Phase,
  WeightFormat,
)
from chunkwise.simulation.report import compare, predict


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


# What XLA:TPU says when a program does not fit.
_OUT_OF_MEMORY = (
  "RESOURCE_EXHAUSTED",
  "Ran out of memory",
  "exceeds available",
)


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
  """v = fixed + depth * per_layer, fitted to the points by least squares
  (through both of two), at `layers`; `residual`: the worst miss of any
  point. A program's figures vary a little from depth to depth (XLA
  schedules each one afresh), and the slope is multiplied by the model's
  depth: more depths average that variation out. Nothing a layer holds or
  sends shrinks with depth: a negative slope (a scheduler reusing buffers
  a little differently, e.g. temp 0.436 then 0.432 GiB) is taken as 0 and
  the deepest value kept (`clamped`)."""
  n = len(points)
  mean_d = sum(d for d, _ in points) / n
  mean_v = sum(v for _, v in points) / n
  spread = sum((d - mean_d) ** 2 for d, _ in points)
  per = sum((d - mean_d) * (v - mean_v) for d, v in points) / spread
  fixed = mean_v - mean_d * per
  clamped = per < 0
  if clamped:
    per, fixed = 0.0, points[-1][1]
  residual = max(abs(v - fixed - d * per) for d, v in points)
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
    cycles={k: fit(lambda d, k=k: d["cycles"][k]) for k in d0["cycles"]},
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
  target: tpu_target.Target | None = None,
  log=None,
) -> dict:
  """Compiles `case` for `mesh` at each of `depths` (layers) of `hparams`
  and scales the figures to `hparams.layers`; with `hardware`, adds the
  planner's estimate beside them (`compare`); with a TPU `target` (whose
  devices `mesh` holds), what fits and how long a pass takes
  (`_on_target`). A program the compiler refuses is reported with its
  `error` (and `fits` false when it ran out of memory), not raised.
  `log(message)` hears of each compile. Returns a JSON-ready dict (see
  the module docstring)."""
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
    r = results[-1]
    if log:
      log(
        f"  trace {r['trace_s']:.1f} s, lower {r['lower_s']:.1f} s, "
        f"compile {r['compile_s']:.1f} s"
        + (f"; refused: {r['error'][:200]}" if "error" in r else "")
      )
    if "error" in r:
      break  # deeper programs would be refused too
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
    target=str(target) if target is not None else "cpu",
    device_kind=results[0]["device_kind"],
    phase=case.phase.value,
    layout=str(case.layout),
    batch=case.batch,
    length=case.length,
    steps=case.steps if case.phase is Phase.GENERATE else None,
    weights=case.weights.value,
    numerics=case.numerics,
    cache_dtype=jnp.dtype(cache_dtype).name,
    compute_dtype=jnp.dtype(compute_dtype).name,
    compiled=results,
    scaled_depth=depths[-1] != hparams.layers,
    scaling=(
      f"compiled at {', '.join(map(str, depths))} layers"
      + (
        f"; every figure scaled to {hparams.layers} layers as fixed + "
        f"layers * per_layer, "
        + (
          f"the line through the {depths[0]}- and {depths[-1]}-layer programs"
          if len(depths) == 2
          else f"fitted to the {len(depths)} depths by least squares"
        )
        if depths[-1] != hparams.layers
        else " (the model's full depth)"
      )
    ),
  )
  refused = results[-1].get("error")  # the loop stops at a refusal
  if refused is not None:
    out_of_memory = any(k in refused for k in _OUT_OF_MEMORY)
    report.update(error=refused, fits=False if out_of_memory else None)
    est = (
      None
      if hardware is None
      else predict(hparams, report["mesh"], case, hardware, **dtypes)
    )
    report["predicted"] = (
      None
      if est is None
      else dict(
        hardware=hardware, memory_bytes=est.memory_bytes, time_s=est.time_s
      )
    )
    return report
  scaled = _scaled(results, hparams.layers)
  report.update(
    scaled=scaled,
    held=held_bytes(scaled, case.phase),
    collectives_note=(
      "per device; 'program' from the unoptimized HLO (the program's "
      "dtypes), 'compiled' from the optimized HLO (XLA:CPU computes bf16 "
      "collectives in f32 and combines some)"
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
  if target is not None:
    report.update(_on_target(report, target))
  return report


def _on_target(report: dict, target: tpu_target.Target) -> dict:
  """What a TPU compile says per device at the model's depth: memory by
  the compiler's fields, `fits` (everything held, code included, within
  the chip's HBM), and the time of one pass (a prefill, or one decode
  step): the compiler's cycles for compute and memory at the chip's clock,
  plus the planner's interconnect time, beside the planner's own."""
  scaled = report["scaled"]
  memory = {k: v["total"] for k, v in scaled["memory"].items()}
  held = report["held"]["total"] + memory["generated_code"]
  cycles = scaled["cycles"]
  key = "once" if report["phase"] == Phase.PREFILL.value else "per_iteration"
  compiler_s = tpu_target.seconds(cycles[key]["total"], target)
  predicted = report.get("predicted") or {}
  interconnect_s = predicted.get("interconnect_s")
  return dict(
    argument_bytes=memory["argument"],
    output_bytes=memory["output"],
    alias_bytes=memory["alias"],
    temp_bytes=memory["temp"],
    code_bytes=memory["generated_code"],
    held_bytes=held,
    hbm_bytes=target.hbm_bytes,
    fits=held <= target.hbm_bytes,
    estimate=dict(
      compiler_s=compiler_s,
      interconnect_s=interconnect_s,
      total_s=compiler_s + (interconnect_s or 0.0),
      planner_s=predicted.get("time_s"),
      # instructions XLA:TPU gave no estimate, left out of compiler_s
      unestimated=round(cycles["unknown"]["total"]),
      # Pallas calls counted at their bytes' and flops' bound
      bounded=round(cycles.get("bounded", {}).get("total", 0)),
      note=(
        "compiler_s: XLA:TPU's estimated cycles (each op's slower of "
        "compute and memory, collectives left out; a Pallas call, which "
        "it does not estimate, at the slower of its bytes at the HBM "
        "bandwidth and its flops at the peak) at the chip's clock; "
        "interconnect_s: the planner's collective time; total_s: their "
        "sum (no overlap)"
      ),
    ),
  )


def run(
  model: str,
  mesh_shape: Sequence[int] | None,
  cases: Sequence[Case],
  *,
  depths: Sequence[int] = (2, 4),
  pad: bool = True,
  cache_dtype=jnp.bfloat16,
  compute_dtype=jnp.bfloat16,
  hardware: str | None = "tpu-v4",
  target: tpu_target.Target | None = None,
  log=None,
) -> dict:
  """Simulates every case of preset `model` on a mesh of `mesh_shape`:
  over the first of JAX's devices (fake host CPU devices: set
  --xla_force_host_platform_device_count before JAX starts), or over a
  TPU `target`'s devices, compiled by XLA:TPU (`mesh_shape` None: the
  target's `default_mesh`). With `pad`, heads and vocabulary are padded
  for every case's layout (`fit_to_mesh`). Returns {"model", "mesh",
  "target", "padded", "reports"}."""
  from chunkwise import configs
  from chunkwise.partitioning import make_mesh

  if target is not None:
    mesh = target.mesh(mesh_shape)
  else:
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
      target=target,
      log=log,
    )
    for case in cases
  ]
  for r in reports:
    r["padded"] = padded
  return dict(
    model=model,
    mesh=list(mesh.devices.shape),
    target=str(target) if target is not None else "cpu",
    padded=padded,
    reports=reports,
  )
