"""The planner beside the compiler: `compare` puts `chunkwise.planner`'s
estimate of a simulated configuration next to what the compiled programs
hold and send (`simulate`), with their relative differences; `table`
prints simulation reports for reading.

  print(table([simulate(h, mesh, case, model="palm-540b")]))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp

from chunkwise.simulation import hlo
from chunkwise.simulation.programs import Case, Phase

GiB = 1 << 30

_DTYPE_NAMES = {
  "bfloat16": "bf16",
  "float32": "f32",
  "float16": "f16",
  "int8": "int8",
}


def predict(hparams, mesh_shape, case: Case, hardware: str, **dtypes):
  """The planner's estimate of `case` (None when `chunkwise.planner` is
  absent). A prefill of L tokens attends to L/2 positions on average and
  holds L; a decode step (the generate loop's, or the slot loop's) to
  C + S/2 and holds C + S."""
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
    phase="prefill" if case.phase is Phase.PREFILL else "generate",
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
    # One pass (a prefill, or one decode step): the planner's time, and
    # its interconnect part (activations' collectives and weight gathers,
    # at the links' peak).
    time_s=est.time_s,
    interconnect_s=est.layers * (est.layer_comm_s + est.layer_weight_comm_s),
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
    "(XLA:CPU's f32 twins for its dots; XLA:TPU makes none), part of "
    "temp; diff: total vs the planner's; compile s: lower + compile at "
    "the deepest depth)",
  ]
  for r in reports:
    pred = (r.get("predicted") or {}).get("memory_bytes")
    config = _config(r)
    compile_s = sum(d["lower_s"] + d["compile_s"] for d in r["compiled"][-1:])
    if "error" in r:
      why = "out of memory" if r["fits"] is False else "error"
      lines.append(
        f"{r['model']:<10} {'x'.join(map(str, r['mesh'])):<6} {config:<44} "
        f"{compile_s:>9.1f} refused ({why}; "
        f"planner {_gib(pred)} GiB): {r['error'].splitlines()[0][:120]}"
      )
      continue
    held = r["held"]
    rel = None if not pred else (held["total"] - pred) / pred
    lines.append(
      f"{r['model']:<10} {'x'.join(map(str, r['mesh'])):<6} {config:<44} "
      f"{compile_s:>9.1f} {_gib(held['weights']):>8} "
      f"{_gib(held['kv_cache']):>7} {_gib(held['temp']):>7} "
      f"{_gib(held['largest_weight_copy']):>7} {_gib(held['total']):>7} "
      f"{_gib(pred):>7} {_pct(rel):>6}"
    )
  lines.append("")
  lines.append(
    "per-layer collectives, MiB per device (program dtypes / compiled) "
    "vs planner:"
  )
  for r in reports:
    if "error" in r:
      continue
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
  on_tpu = [r for r in reports if "estimate" in r]
  if on_tpu:
    lines += ["", _tpu_table(on_tpu)]
  return "\n".join(lines)


def _config(r: dict) -> str:
  return (
    f"{r['phase']} {r['layout']} B={r['batch']} "
    + (
      f"L={r['length']}"
      if r["phase"] == "prefill"
      else f"C={r['length']}+{r['steps']}"
    )
    + f" {r['weights']}"
    + ("" if r.get("numerics", "fast") == "fast" else f" {r['numerics']}")
  )


def _ms(x) -> str:
  return "-" if x is None else f"{1e3 * x:.2f}"


def _marks(estimate: dict) -> str:
  """'+': some ops left out (no estimate); '~': Pallas calls bounded."""
  return ("+" if estimate.get("unestimated") else "") + (
    "~" if estimate.get("bounded") else ""
  )


def _tpu_table(reports: Sequence[dict]) -> str:
  """Per TPU report: what the compiler holds per chip (GiB), whether it
  fits the chip's HBM, and one pass's time (ms): the compiler's cycles,
  the planner's interconnect, their sum, the planner's whole estimate."""
  lines = [
    f"{'target':<16} {'configuration':<44} {'args':>6} {'temp':>6} "
    f"{'code':>6} {'held':>6} {'HBM':>6} {'fits':>5} {'xla ms':>8} "
    f"{'ici ms':>8} {'sum ms':>8} {'plan ms':>8}",
    "  (GiB per chip at full depth; ms per pass: a prefill, or one decode "
    "step; xla: XLA:TPU's estimated cycles at the chip's clock, '+' where "
    "some ops have no estimate, '~' where Pallas calls count at their "
    "bytes' and flops' bound)",
  ]
  for r in reports:
    e = r["estimate"]
    lines.append(
      f"{r['target']:<16} {_config(r):<44} {_gib(r['argument_bytes']):>6} "
      f"{_gib(r['temp_bytes']):>6} {_gib(r['code_bytes']):>6} "
      f"{_gib(r['held_bytes']):>6} {_gib(r['hbm_bytes']):>6} "
      f"{'yes' if r['fits'] else 'NO':>5} "
      f"{_ms(e['compiler_s']) + _marks(e):>8} "
      f"{_ms(e['interconnect_s']):>8} {_ms(e['total_s']):>8} "
      f"{_ms(e['planner_s']):>8}"
    )
  return "\n".join(lines)
