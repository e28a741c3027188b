"""The planner's ranked layouts for a model on a slice of chips, and the
latency-vs-cost picture per layout family (Pope et al., 2023, Figure 1).

  python scripts/plan.py --model=palm-540b --hardware=tpu-v4 --chips=64
  python scripts/plan.py --model=palm-62b --hardware=tpu-v5e --chips=16 \
      --batch=32 --weights=bf16 --png=
  python scripts/plan.py --paper          # Tables 1-3 beside the planner
  python scripts/plan.py --model=smollm2-135m --hardware=this --chips=1

--hardware=this measures this machine's bandwidth and matmul peak first
(`chunkwise.bench.machine`). Nothing is compiled: the planner is
arithmetic (`chunkwise.planner`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from absl import app, flags

import chunkwise as cw
from chunkwise.jobs.config import parse_mesh
from chunkwise.planner import HARDWARE, paper, pareto

_MODEL = flags.DEFINE_string(
  "model", "palm-540b", "A preset name, or a checkpoint cw.load reads."
)
_HARDWARE = flags.DEFINE_string(
  "hardware",
  "tpu-v4",
  f"One of {', '.join(sorted(HARDWARE))}, or 'this' (measured here).",
)
_CHIPS = flags.DEFINE_integer("chips", 64, "Chips in the slice.")
_BATCH = flags.DEFINE_integer("batch", 64, "Rows served together.")
_PREFILL = flags.DEFINE_integer("prefill_len", 2048, "Prompt tokens per row.")
_GENERATE = flags.DEFINE_integer(
  "generate_len", 64, "Tokens generated per row."
)
_WEIGHTS = flags.DEFINE_enum(
  "weights", "int8", ["int8", "bf16", "f32"], "Weight format."
)
_MESH = flags.DEFINE_string("mesh", None, "Fix the mesh, e.g. 4x4x4.")
_TOP = flags.DEFINE_integer("top", 15, "Candidates printed.")
_PNG = flags.DEFINE_string(
  "png", "plan.png", "Latency-vs-cost picture ('' for none)."
)
_JSON = flags.DEFINE_string("json_out", None, "Also write the rows as JSON.")
_PAD = flags.DEFINE_bool(
  "pad_heads",
  False,
  "Plan for the model with zero heads padded up to a multiple of --chips "
  "(as the paper padded PaLM 540B's 48 heads to 64).",
)
_PAPER = flags.DEFINE_bool(
  "paper", False, "Print the paper's Tables 1-3 beside the planner instead."
)


def _hparams(name: str):
  if name in cw.configs.names():
    return cw.configs.get(name)
  return cw.checkpoints.describe(name).hparams


def _hardware(name: str):
  if name != "this":
    return cw.planner.hardware.get(name)
  from chunkwise.bench import machine

  return machine.measure(runs=3).hardware()


def _paper_report() -> None:
  print("Tables 2 and 3: Pope et al. (2023) beside the planner")
  print(
    f"{'row':<38} {'paper layout':<14} {'planner layout':<14} "
    f"{'mesh':>6} {'latency':>16} {'error':>7} {'MFU':>9}  set"
  )
  for p in paper.predict_rows():
    r = p.row
    used = "fit" if r in paper.FIT_ROWS else "held out"
    print(
      f"{r.label:<38} {r.family + '/' + r.attention:<14} "
      f"{p.family + '/' + p.attention:<14} "
      f"{'x'.join(map(str, p.mesh_shape)):>6} "
      f"{f'{r.latency_s:.3g}s':>7}/{f'{p.latency_s:.3g}s':<7} "
      f"{p.error:>+7.1%} "
      f"{r.mfu:>4.0%}/{p.mfu:<4.0%} {used}"
    )
  print("\nWith ws_1d allowed too (the tables choose between 2D and WG):")
  for r in paper.TABLE_2 + paper.TABLE_3:
    best, change = paper.with_1d(r)
    if change < 0:
      print(f"  {r.label:<38} {best.sharding}, {change:+.1%} time")
  print("\nTable 1: longest context, K/V cache within 30% of HBM (64 chips)")
  for variant, _, b128, b512 in paper.TABLE_1:
    got = [paper.max_context(variant, b) for b in (128, 512)]
    print(
      f"{variant:<22} batch 128: {b128:>6} / {got[0]:<6} "
      f"({got[0] / b128 - 1:+.1%})   batch 512: {b512:>6} / {got[1]:<6} "
      f"({got[1] / b512 - 1:+.1%})"
    )
  print(
    "\n2D beats 1D above",
    paper.crossover_chips(1, 4),
    "chips for d_ff = 4 d_model (paper: √n > d_ff/d_model)",
  )
  print(
    "Weight-gathered switch points (tokens per batch, Figure 3 setting):",
    ", ".join(f"{f} from {t:,}" for t, f in paper.switch_points()),
  )


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _PAPER.value:
    _paper_report()
    return
  h = _hparams(_MODEL.value)
  hw = _hardware(_HARDWARE.value)
  mesh = None
  if _MESH.value:
    mesh = parse_mesh(_MESH.value)
  ranked = cw.planner.plan(
    h,
    hw,
    _CHIPS.value,
    _BATCH.value,
    _PREFILL.value,
    _GENERATE.value,
    _WEIGHTS.value,
    mesh_shape=mesh,
    pad_heads=_PAD.value,
    limit=None,
  )
  print(
    f"{_MODEL.value} on {_CHIPS.value} x {hw.name}: batch {_BATCH.value}, "
    f"prefill {_PREFILL.value}, generate {_GENERATE.value}, "
    f"{_WEIGHTS.value} weights; {len(ranked)} candidates, best first"
  )
  print(cw.planner.table(ranked[: _TOP.value]))
  kinds = {str(c.generate_layout.kind.value) for c in ranked}
  if h.heads % _CHIPS.value and not _PAD.value and "ws_2d" not in kinds:
    print(
      f"(ws_1d and ws_2d split the {h.heads} heads over all {_CHIPS.value} "
      "chips and cannot run this model here; --pad_heads plans for zero "
      "heads padded up, as the paper did)"
    )
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump([c.row() for c in ranked], f, indent=1)
  if _PNG.value:
    from chunkwise.bench import figures

    panels = [
      (
        f"{phase} ({'2048-token prompt' if phase == 'prefill' else 'a step'})",
        pareto.frontier(
          h, hw, _CHIPS.value, phase=phase, weights=_WEIGHTS.value
        ),
      )
      for phase in ("prefill", "generate")
    ]
    figures.pareto_png(
      panels,
      _PNG.value,
      f"{_MODEL.value} on {_CHIPS.value} {hw.name} chips ({_WEIGHTS.value}"
      " weights; batch sizes marked; paper families, heads padded)",
    )
    print(f"wrote {_PNG.value}")


if __name__ == "__main__":
  app.run(main)
