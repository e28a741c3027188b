"""The overhead terms that turn the cost model's work into seconds, and
how they are fitted to published measurements.

  work    = max(t_flops, t_hbm, t_gather)
  t_layer = work + t_comm - overlap · min(work, t_comm)   (looped collectives)
          = work + t_comm                                (XLA's collectives)
          + hops · hop_s + layer_s
t_gather is the weight-gathered layouts' all-gather of the next layer's
weights, which needs no activation and runs behind this layer's work;
t_comm the activations' collectives, on the critical path unless a
looped collective matmul hides part of them.
  t_flops = flops / (peak · eta(rows))
  eta     = eta_max · rows / (rows + rows_half)
  t_hbm   = bytes / (bandwidth · eta_hbm)
  t_pass  = layers · t_layer + the embedding's and logits' max(t_flops, t_hbm)

Six terms: the best matmul efficiency `eta_max`, the rows per matmul at
which it halves `rows_half`, the fraction of HBM bandwidth reached
`eta_hbm`, the share of the shorter of work and communication that the
looped collective matmuls hide `overlap`, the latency of one ring step
`hop_s`, and a fixed cost per layer `layer_s`. `fit` chooses them by
least squares on log latencies over a grid (numpy only); `FITTED` holds
the result of fitting them to the rows of `paper.FIT_ROWS` (Table 2:
PaLM 540B), and `tests/test_planner.py` refits and compares. Table 3
(PaLM 62B) is held out to validate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Overheads:
  eta_max: float = 0.8
  rows_half: float = 64.0
  eta_hbm: float = 0.85
  overlap: float = 0.5
  hop_s: float = 5e-6
  layer_s: float = 20e-6

  def eta(self, rows):
    return self.eta_max * rows / (rows + self.rows_half)

  def timed(self, est, hw):
    """`est` with its times and bound filled in for hardware `hw`."""
    t_f = est.layer_flops / (hw.flops * self.eta(est.rows))
    t_m = est.layer_hbm_bytes / (hw.hbm_bandwidth * self.eta_hbm)
    t_c = est.layer_comm_s
    work = max(t_f, t_m, est.layer_weight_comm_s)
    hidden = self.overlap if est.sharding.overlapped else 0.0
    layer = work + t_c - hidden * min(work, t_c)
    extra = est.layer_hops * self.hop_s + self.layer_s
    head = max(
      est.head_flops / (hw.flops * self.eta(max(est.batch, 1))),
      est.head_hbm_bytes / (hw.hbm_bandwidth * self.eta_hbm),
    )
    total = est.layers * (layer + extra) + head
    parts = {"flops": t_f, "hbm": t_m, "ici": t_c + est.layer_weight_comm_s}
    bound = max(parts, key=parts.get)
    if est.memory_bytes > hw.hbm_bytes:
      bound = "capacity"
    return dataclasses.replace(
      est,
      compute_s=est.layers * t_f,
      memory_s=est.layers * t_m,
      comm_s=est.layers * t_c,
      overhead_s=est.layers * extra,
      time_s=total,
      bound=bound,
    )


# `paper.refit()` on paper.FIT_ROWS (Table 2: PaLM 540B on 64 TPU v4),
# rms log error 0.092; tests/test_planner.py refits and compares.
FITTED = Overheads(
  eta_max=0.67,
  rows_half=32.0,
  eta_hbm=0.875,
  overlap=0.0,
  hop_s=5e-6,
  layer_s=30e-6,
)


GRID = {
  "eta_max": np.linspace(0.6, 1.0, 21),
  "rows_half": np.array([0, 16, 32, 64, 128, 256, 512, 1024], float),
  "eta_hbm": np.linspace(0.6, 1.0, 9),
  "overlap": np.linspace(0.0, 1.0, 6),
  "hop_s": np.array([0, 1, 2, 3, 5, 7, 10, 15, 20, 30], float) * 1e-6,
  "layer_s": np.array([0, 5, 10, 20, 30, 50, 75, 100, 150, 200], float) * 1e-6,
}


def fit(
  points: Sequence, measured: Sequence[float], grid=None
) -> tuple[Overheads, float]:
  """Overheads minimising the squared log error of `points` (Estimates,
  timed or not, with their hardware: (estimate, hardware, multiplier)
  triples, the multiplier turning one pass into the measured quantity)
  against `measured` seconds; returns (overheads, rms log error)."""
  grid = GRID if grid is None else grid
  names = list(grid)
  axes = np.meshgrid(
    *(np.asarray(grid[k], float) for k in names), indexing="ij"
  )
  p = {k: a.ravel() for k, a in zip(names, axes, strict=True)}
  err = np.zeros_like(p["eta_max"])
  for (est, hw, mult), target in zip(points, measured, strict=True):
    eta = p["eta_max"] * est.rows / (est.rows + p["rows_half"])
    t_f = est.layer_flops / (hw.flops * eta)
    t_m = est.layer_hbm_bytes / (hw.hbm_bandwidth * p["eta_hbm"])
    work = np.maximum(np.maximum(t_f, t_m), est.layer_weight_comm_s)
    hidden = p["overlap"] if est.sharding.overlapped else 0.0
    layer = (
      work + est.layer_comm_s - hidden * np.minimum(work, est.layer_comm_s)
    )
    layer = layer + est.layer_hops * p["hop_s"] + p["layer_s"]
    eta_b = p["eta_max"] * est.batch / (est.batch + p["rows_half"])
    head = np.maximum(
      est.head_flops / (hw.flops * eta_b),
      est.head_hbm_bytes / (hw.hbm_bandwidth * p["eta_hbm"]),
    )
    total = mult * (est.layers * layer + head)
    err += np.log(total / target) ** 2
  best = int(np.argmin(err))
  chosen = Overheads(**{k: float(p[k][best]) for k in names})
  return chosen, float(np.sqrt(err[best] / len(measured)))


def refine(points, measured, start: Overheads, rounds: int = 2):
  """`fit` again on a finer grid around `start`."""
  result, rms = start, None
  for _ in range(rounds):
    grid = {}
    for k, values in GRID.items():
      v = getattr(result, k)
      step = (values.max() - values.min()) / (4 * (len(values) - 1))
      grid[k] = np.clip(v + step * np.arange(-3, 4), values.min(), None)
    result, rms = fit(points, measured, grid)
  return result, rms
