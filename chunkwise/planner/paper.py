"""Pope et al. (2023) measured, and the planner's predictions beside it.

  for p in predict_rows(TABLE_2 + TABLE_3):
    print(p.row.label, p.family, p.latency_s, p.row.latency_s, p.error)
  max_context("optimized multiquery", batch=128)   # Table 1
  crossover_chips(d_model=1, d_ff=4)               # 2D beats 1D above 16
  switch_points()                                  # 2D -> X -> XY -> XYZ

Tables 2 and 3 (PaLM 540B and 62B on TPU v4): prefill of 2048 tokens and
64 decode steps, each row's chips, batch, feed-forward layout, attention
sharding, weight format, MFU and latency (helper-verified against the
arXiv PDF). Table 2 fits the overheads (`calibration.FITTED`); Table 3
validates them. For each row the planner searches every paper family
(ws_1d, ws_2d, wg_x, wg_xy, wg_xyz), attention by head or by batch and
every mesh shape of the row's chips, with heads padded to the head shards
(the paper padded PaLM 540B's 48 heads to 64), keeping what fits in HBM,
and reports the fastest.
"""

from __future__ import annotations

import dataclasses

from chunkwise.configs import get as get_preset
from chunkwise.planner import costs
from chunkwise.planner import hardware as hw_lib
from chunkwise.planner.calibration import FITTED, Overheads
from chunkwise.planner.communication import layer_collectives
from chunkwise.planner.families import (
  XYZ,
  Family,
  Sharding,
  mesh_sizes,
  paper_sharding,
)
from chunkwise.planner.search import mesh_shapes
from chunkwise.planner.sizes import Shapes

PREFILL_LEN = 2048
DECODE_STEPS = 64
# The layouts Tables 2 and 3 choose among: 2D weight-stationary and the
# weight-gathered family (the paper keeps 1D for small slices; with 1D
# allowed the planner would pick it for PaLM 62B's 8- and 16-chip rows,
# whose 2D layouts move more bytes: see docs/planner.md).
FAMILIES = ("ws_2d", "wg_x", "wg_xy", "wg_xyz")
FAMILIES_ALL = ("ws_1d", *FAMILIES)


@dataclasses.dataclass(frozen=True)
class Row:
  table: str
  model: str
  chips: int
  batch: int
  phase: str  # "prefill" (2048 tokens) or "generate" (64 steps)
  family: str
  attention: str  # "head" | "batch"
  weights: str  # "int8" | "bf16"
  mfu: float
  latency_s: float

  @property
  def label(self) -> str:
    return (
      f"{self.model} {self.phase} b{self.batch} on {self.chips} "
      f"({self.weights})"
    )


def _rows(table, model, chips, batch, family, attention, weights, mfu, latency):
  phases = ("prefill", "generate", "prefill", "generate")
  return tuple(
    Row(table, model, *values)
    for values in zip(
      chips,
      batch,
      phases,
      family,
      attention,
      weights,
      mfu,
      latency,
      strict=True,
    )
  )


_FFN = ("ws_2d", "ws_2d", "wg_xyz", "ws_2d")
_ATTN = ("head", "batch", "batch", "batch")
_WEIGHTS = ("int8", "int8", "bf16", "bf16")

TABLE_2 = _rows(
  "2",
  "palm-540b",
  (64, 64, 64, 64),
  (1, 64, 512, 512),
  _FFN,
  _ATTN,
  _WEIGHTS,
  (0.43, 0.14, 0.76, 0.33),
  (0.29, 1.82, 85.2, 6.0),
)
TABLE_3 = _rows(
  "3",
  "palm-62b",
  (16, 16, 32, 8),
  (1, 32, 512, 512),
  _FFN,
  _ATTN,
  _WEIGHTS,
  (0.36, 0.08, 0.73, 0.37),
  (0.16, 0.73, 20.2, 5.1),
)
FIT_ROWS = TABLE_2
VALIDATION_ROWS = TABLE_3

# Table 1: (variant, d_head, max context at batch 128, at batch 512).
TABLE_1 = (
  ("multihead", 128, 1320, 330),
  ("baseline multiquery", 256, 660, 165),
  ("optimized multiquery", 256, 43_000, 10_700),
)


def row_estimates(row: Row, overheads: Overheads = FITTED, hardware="tpu-v4"):
  """Every (family, attention, mesh) the planner considers for `row`,
  as Estimates of one pass; those that do not fit are dropped."""
  return estimates(
    get_preset(row.model),
    row.chips,
    row.batch,
    row.phase,
    weights=row.weights,
    overheads=overheads,
    hardware=hardware,
  )


def estimates(
  hparams,
  chips: int,
  batch: int,
  phase: str,
  *,
  weights: str,
  families=FAMILIES,
  prefill_len: int = PREFILL_LEN,
  decode_steps: int = DECODE_STEPS,
  overheads: Overheads = FITTED,
  hardware="tpu-v4",
):
  """Estimates of one pass (a prefill of `prefill_len`, or a decode step
  after it) for every paper family, attention split and mesh shape of
  `chips` that fits in HBM."""
  hw = hw_lib.get(hardware)
  if phase == "prefill":
    pass_kw = dict(
      tokens=prefill_len, context=prefill_len / 2, max_context=prefill_len
    )
  else:
    pass_kw = dict(
      tokens=1,
      context=prefill_len + decode_steps / 2,
      max_context=prefill_len + decode_steps,
    )
  out = []
  for shape in mesh_shapes(chips):
    for family in families:
      for attention in ("head", "batch"):
        if family.startswith("wg") and attention == "head":
          continue
        s = paper_sharding(
          hparams, shape, family, attention=attention, batch=batch
        )
        if _degenerate(s):
          continue
        if attention == "batch" and s.size(s.attn_axes) == 1:
          continue  # the batch cannot be split: the same as by head
        est = costs.estimate(
          hparams,
          hw,
          shape,
          s,
          phase=phase,
          batch=batch,
          weights=weights,
          all_logits=False,
          overheads=overheads,
          **pass_kw,
        )
        if est.memory_bytes <= hw.hbm_bytes:
          out.append(est)
  return out


def _degenerate(s: Sharding) -> bool:
  """A 2D or partly gathered mesh with a size-1 side is another family
  (ws_2d with x = 1 is ws_1d; wg_x with y·z = 1 is wg_xyz)."""
  f = s.family
  if f is Family.WS_2D:
    return s.size(("x",)) == 1 or s.size(("y", "z")) == 1
  if f in (Family.WG_X, Family.WG_XY):
    rest = tuple(a for a in XYZ if a not in f.gathered)
    return s.size(f.gathered) == 1 or s.size(rest) == 1
  return False


@dataclasses.dataclass(frozen=True)
class Prediction:
  row: Row
  estimate: costs.Estimate

  @property
  def family(self) -> str:
    return self.estimate.sharding.family.value

  @property
  def attention(self) -> str:
    return self.estimate.sharding.attention

  @property
  def mesh_shape(self) -> tuple[int, ...]:
    return tuple(s for _, s in self.estimate.sharding.sizes)

  @property
  def latency_s(self) -> float:
    steps = 1 if self.row.phase == "prefill" else DECODE_STEPS
    return steps * self.estimate.time_s

  @property
  def mfu(self) -> float:
    return self.estimate.mfu

  @property
  def error(self) -> float:
    """Predicted latency / published - 1."""
    return self.latency_s / self.row.latency_s - 1

  @property
  def layout_matches(self) -> bool:
    return (self.family, self.attention) == (
      self.row.family,
      self.row.attention,
    )


def predict(row: Row, overheads: Overheads = FITTED) -> Prediction:
  """The planner's choice (the fastest estimate that fits) for `row`."""
  options = row_estimates(row, overheads)
  if not options:
    raise ValueError(f"nothing fits for {row.label}")
  return Prediction(row, min(options, key=lambda e: e.time_s))


def with_1d(row: Row, overheads: Overheads = FITTED):
  """(the fastest estimate with ws_1d allowed too, its time relative to
  `predict(row)`'s - 1)."""
  options = estimates(
    get_preset(row.model),
    row.chips,
    row.batch,
    row.phase,
    weights=row.weights,
    families=FAMILIES_ALL,
    overheads=overheads,
  )
  best = min(options, key=lambda e: e.time_s)
  return best, best.time_s / predict(row, overheads).estimate.time_s - 1


def predict_rows(rows=TABLE_2 + TABLE_3, overheads: Overheads = FITTED):
  return [predict(r, overheads) for r in rows]


def refit(rows=FIT_ROWS):
  """Fits the overheads to `rows`' published latencies, each row at the
  paper's own layout (`calibration.fit`); returns (Overheads, rms log
  error)."""
  from chunkwise.planner import calibration

  points, measured = [], []
  for row in rows:
    est = _paper_layout(row)
    mult = 1 if row.phase == "prefill" else DECODE_STEPS
    points.append((est, hw_lib.get("tpu-v4"), mult))
    measured.append(row.latency_s)
  start, _ = calibration.fit(points, measured)
  return calibration.refine(points, measured, start)


def _paper_layout(row: Row, overheads: Overheads = FITTED) -> costs.Estimate:
  """The fastest mesh for the row's published family and attention."""
  options = [
    e
    for e in row_estimates(row, overheads)
    if (e.sharding.family.value, e.sharding.attention)
    == (row.family, row.attention)
  ]
  return min(options, key=lambda e: e.time_s)


def max_context(
  variant: str,
  batch: int,
  *,
  model: str = "palm-540b",
  chips: int = 64,
  hardware="tpu-v4",
  kv_fraction: float = 0.3,
  cache_dtype: str = "bf16",
) -> int:
  """Table 1: the longest context whose K/V cache stays within
  `kv_fraction` of each chip's HBM. Variants: "multihead" (d_head 128,
  heads padded to 64 like the paper's 540B, split over the chips by
  head), "baseline multiquery" (one K/V head, split by head: every chip
  holds it whole) and "optimized multiquery" (split by batch)."""
  h = get_preset(model)
  hw = hw_lib.get(hardware)
  if variant == "multihead":
    heads = -(-h.heads // chips) * chips if h.heads < chips else h.heads
    h = h.replace(heads=heads, kv_heads=heads, head_dim=128)
    attention = "head"
  elif variant == "baseline multiquery":
    attention = "head"
  elif variant == "optimized multiquery":
    attention = "batch"
  else:
    raise ValueError(
      f"unknown attention variant {variant!r}; expected one of "
      f"{', '.join(v for v, *_ in TABLE_1)}"
    )
  shape = _cube(chips)
  s = paper_sharding(h, shape, "ws_2d", attention=attention, batch=batch)
  est = costs.estimate(
    h,
    hw,
    shape,
    s,
    phase="generate",
    batch=batch,
    tokens=1,
    context=1,
    cache_dtype=cache_dtype,
  )
  return int(kv_fraction * hw.hbm_bytes // est.kv_bytes)


def _cube(chips: int) -> tuple[int, int, int]:
  side = round(chips ** (1 / 3))
  if side**3 == chips:
    return (side, side, side)
  return (1, 1, chips)


def _ffn_comm(family: str, d_model: int, d_ff: int, shape, tokens: float):
  """Full-size bytes one chip moves per layer of a plain feed-forward
  layer (one E x F matrix in, one out: the paper's §3.2 analysis)."""
  m = Shapes(
    layers=1,
    E=d_model,
    F=d_ff,
    H=0,
    Hkv=0,
    K=0,
    V=1,
    sequential=False,
    params=0,
    widths=(d_ff, d_ff),
  )
  s = Sharding(Family(family), mesh_sizes(shape))
  return sum(c[2] for c in layer_collectives(s, m, tokens, ab=1, wb=1))


def crossover_chips(d_model: int, d_ff: int, max_chips: int = 4096) -> int:
  """The most chips at which 1D weight-stationary moves no more bytes
  than the best 2D mesh (2D is strictly cheaper above it): 16 for
  d_ff = 4 d_model, where the paper's rule √n > d_ff/d_model says the
  same; in general this model gives n > 4 d_ff / d_model."""
  n, last = 1, 1
  while n <= max_chips:
    one = _ffn_comm("ws_1d", d_model, d_ff, (n, 1, 1), 1.0)
    two = min(
      _ffn_comm("ws_2d", d_model, d_ff, (x, n // x, 1), 1.0)
      for x in range(1, n + 1)
      if n % x == 0
    )
    if one <= two + 1e-9 * one:
      last = n
    n *= 2
  return last


def switch_points(
  d_model: int = 16_384, d_ff: int = 65_536, shape=(4, 4, 4), tokens=None
) -> list[tuple[int, str]]:
  """The paper's Figure 3 setting: for each batch size in tokens, the
  layout (ws_2d, wg_x, wg_xy, wg_xyz) moving the fewest bytes per chip
  per layer (weights and activations at one byte each); returns the
  (tokens, family) pairs where the choice changes."""
  tokens = tokens or [2**k for k in range(8, 24)]
  out: list[tuple[int, str]] = []
  for t in tokens:
    best = min(
      ("ws_2d", "wg_x", "wg_xy", "wg_xyz"),
      key=lambda f: _ffn_comm(f, d_model, d_ff, shape, float(t)),
    )
    if not out or out[-1][1] != best:
      out.append((t, best))
  return out
