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

from chunkwise.bench import hlo
from chunkwise.bench.simulate_compile import Case, Phase

GiB = 1 << 30

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
