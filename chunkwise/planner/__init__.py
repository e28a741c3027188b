"""The analytic planner: which layout, mesh and batch for a model on a
slice of chips (Pope et al., 2023, §3), before anything is compiled.

  import chunkwise as cw
  best = cw.planner.plan(cw.configs.get("palm-62b"), "tpu-v4", chips=16,
                         batch=32, prefill_len=2048, generate_len=64,
                         weights="int8")[0]
  best.prefill_layout, best.generate_layout, best.mesh_shape
  best.prefill_s, best.generate_step_s, best.memory_per_chip_bytes, best.bound
  cw.planner.HARDWARE["tpu-v4"]

Modules: `hardware` (chips and links), `families` (how each layout
family cuts the model), `sizes` (bytes per value, the model's widths),
`communication` (each family's collectives per layer), `costs` (FLOPs,
bytes, collectives and memory of one pass), `calibration` (the fitted
overhead terms), `search` (`plan`: every mesh and layout pair, ranked),
`choice` (what `layout="auto"` runs), `paper` (the published tables and
the planner's predictions beside them). Plain Python and numpy: nothing
is compiled.
"""

from chunkwise.planner.calibration import FITTED, Overheads
from chunkwise.planner.costs import Estimate, estimate
from chunkwise.planner.families import Family, Sharding
from chunkwise.planner.hardware import HARDWARE, Hardware, Topology, measured
from chunkwise.planner.search import Candidate, mesh_shapes, plan, table

__all__ = [
  "FITTED",
  "HARDWARE",
  "Candidate",
  "Estimate",
  "Family",
  "Hardware",
  "Overheads",
  "Sharding",
  "Topology",
  "estimate",
  "measured",
  "mesh_shapes",
  "plan",
  "table",
]
