"""Choosing layouts: every mesh shape and layout pair, ranked.

  candidates = plan(cw.configs.get("palm-62b"), "tpu-v4", chips=16,
                    batch=32, prefill_len=2048, generate_len=64,
                    weights="int8")
  best = candidates[0]
  best.prefill_layout, best.generate_layout, best.mesh_shape
  print(table(candidates[:10]))

A candidate is a mesh shape with one layout per phase. Its latency is
the prefill plus `generate_len` decode steps (at the mean context); its
memory the weights (twice when the two layouts cannot share one
placement), the K/V cache at the full context and the larger phase's
activations and gathered weights. Candidates that fit the chip come
first, fastest first; the rest follow, bound by "capacity".
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from chunkwise.configs import HParams
from chunkwise.planner import costs, sizes
from chunkwise.planner import hardware as hw_lib
from chunkwise.planner.calibration import FITTED, Overheads

COLLECTIVES = ("xla", "one_way", "latency", "throughput")
ATTN = ("none", "z", "yz", "yzx")


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One mesh shape and a layout per phase, with its predictions."""

  mesh_shape: tuple[int, int, int]
  prefill: costs.Estimate
  generate: costs.Estimate
  generate_len: int
  memory_per_chip_bytes: float
  fits: bool

  @property
  def prefill_layout(self):
    return self.prefill.sharding.layout

  @property
  def generate_layout(self):
    return self.generate.sharding.layout

  @property
  def prefill_s(self) -> float:
    return self.prefill.time_s

  @property
  def generate_step_s(self) -> float:
    return self.generate.time_s

  @property
  def latency_s(self) -> float:
    return self.prefill_s + self.generate_len * self.generate_step_s

  @property
  def chips(self) -> int:
    return math.prod(self.mesh_shape)

  @property
  def prefill_mfu(self) -> float:
    return self.prefill.mfu

  @property
  def generate_mfu(self) -> float:
    return self.generate.mfu

  @property
  def cost_chip_s_per_token(self) -> float:
    """Chip-seconds per generated token (decode steps only)."""
    return self.chips * self.generate_step_s / self.generate.batch

  @property
  def bound(self) -> str:
    """What limits it: "capacity" when it does not fit, else the bound of
    the phase that takes longer ("flops", "hbm" or "ici")."""
    if not self.fits:
      return "capacity"
    gen = self.generate_len * self.generate_step_s
    return (self.prefill if self.prefill_s >= gen else self.generate).bound

  def row(self) -> dict:
    """The table row (plain values)."""
    return {
      "mesh": "x".join(map(str, self.mesh_shape)),
      "prefill_layout": str(self.prefill.sharding),
      "generate_layout": str(self.generate.sharding),
      "prefill_s": self.prefill_s,
      "generate_step_s": self.generate_step_s,
      "latency_s": self.latency_s,
      "prefill_mfu": self.prefill_mfu,
      "generate_mfu": self.generate_mfu,
      "chip_s_per_token": self.cost_chip_s_per_token,
      "memory_gb": self.memory_per_chip_bytes / 1e9,
      "bound": self.bound,
      "prefill_bound": self.prefill.bound,
      "generate_bound": self.generate.bound,
    }


def mesh_shapes(chips: int) -> list[tuple[int, int, int]]:
  """Every (x, y, z) with x·y·z = chips."""
  if not isinstance(chips, int) or chips < 1:
    raise ValueError(f"chips must be a positive integer, got {chips!r}")
  divisors = [d for d in range(1, chips + 1) if chips % d == 0]
  return [
    (x, y, chips // (x * y))
    for x in divisors
    for y in divisors
    if (chips // x) % y == 0
  ]


def layouts(chips: int) -> list[str]:
  """The chunkwise layouts worth trying on `chips` devices."""
  if chips == 1:
    return ["reference"]
  out = [f"ws_1d/{a}/{c}" for a in ATTN for c in COLLECTIVES]
  out += [f"ws_2d/{a}/{c}" for a in ATTN for c in COLLECTIVES]
  return [*out, "wg"]


def _placement(layout) -> tuple:
  """Layouts with equal keys share one weight placement."""
  from chunkwise.models.fused import needs_shuffle
  from chunkwise.partitioning import LayoutKind

  kind = layout.kind
  group = "2d" if kind in (LayoutKind.WS_2D, LayoutKind.WG) else kind.value
  if needs_shuffle(kind, layout.collectives):
    return (group, kind, layout.collectives)
  return (group,)


def _check(hparams, hardware, chips, batch, prefill_len, generate_len):
  if not isinstance(hparams, HParams):
    raise ValueError(f"hparams must be an HParams, got {hparams!r}")
  hw = hw_lib.get(hardware)
  for name, value, low in (
    ("chips", chips, 1),
    ("batch", batch, 1),
    ("prefill_len", prefill_len, 1),
    ("generate_len", generate_len, 0),
  ):
    if not isinstance(value, int) or value < low:
      raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
  if prefill_len + generate_len > hparams.max_len:
    raise ValueError(
      f"prefill_len + generate_len = {prefill_len + generate_len} exceeds "
      f"the model's max_len {hparams.max_len}"
    )
  return hw


def plan(
  hparams: HParams,
  hardware,
  chips: int,
  batch: int,
  prefill_len: int,
  generate_len: int,
  weights: str = "bf16",
  *,
  mesh_shape: Sequence[int] | None = None,
  cache_dtype: str = "bf16",
  act_dtype: str = "bf16",
  all_logits: bool = True,
  overheads: Overheads = FITTED,
  pad_heads: bool = False,
  limit: int | None = 20,
) -> list[Candidate]:
  """Ranked candidates (see the module docstring) for serving `batch`
  rows of `prefill_len` prompt tokens and `generate_len` new ones on
  `chips` chips of `hardware` (a name in `HARDWARE` or a `Hardware`);
  `mesh_shape` fixes the mesh (else every shape is tried). Raises
  ValueError for bad arguments, or when no layout can run the model on
  any mesh of `chips` (each layout's reason named). `pad_heads` plans
  for the model with its query heads padded with zero heads to a
  multiple of `chips`, as the paper padded PaLM 540B's 48 heads to 64 (the
  layouts that split heads over every chip then run it; MFU still counts
  the real parameters)."""
  hw = _check(hparams, hardware, chips, batch, prefill_len, generate_len)
  params = hparams.num_params()
  if pad_heads and hparams.heads % chips:
    hparams = hparams.replace(heads=-(-hparams.heads // chips) * chips)
  weights = {"bfloat16": "bf16", "float32": "f32"}.get(weights, weights)
  sizes.dtype_bytes(weights)
  shapes = [tuple(mesh_shape)] if mesh_shape is not None else mesh_shapes(chips)
  if mesh_shape is not None and math.prod(shapes[0]) != chips:
    raise ValueError(
      f"mesh_shape {tuple(mesh_shape)} does not hold {chips} chips"
    )
  kw = dict(
    weights=weights,
    cache_dtype=cache_dtype,
    act_dtype=act_dtype,
    overheads=overheads,
  )
  context = prefill_len + generate_len
  out, reasons = [], {}
  for shape in shapes:
    pre, gen = [], []
    for name in layouts(chips):
      try:
        p = costs.estimate(
          hparams,
          hw,
          shape,
          name,
          phase="prefill",
          batch=batch,
          tokens=prefill_len,
          context=prefill_len / 2,
          max_context=prefill_len,
          all_logits=all_logits,
          **kw,
        )
        g = costs.estimate(
          hparams,
          hw,
          shape,
          name,
          phase="generate",
          batch=batch,
          tokens=1,
          context=prefill_len + generate_len / 2,
          max_context=context,
          **kw,
        )
      except ValueError as e:
        reasons[name.split("/")[0]] = str(e)
        continue
      pre.append(dataclasses.replace(p, params=params))
      gen.append(dataclasses.replace(g, params=params))
    for p, g in itertools.product(pre, gen):
      out.append(_candidate(shape, p, g, generate_len, hw))
  if not out:
    raise ValueError(
      f"no layout runs {hparams.layers}-layer model on {chips} chips: "
      + "; ".join(reasons.values())
    )
  out.sort(key=lambda c: (not c.fits, c.latency_s, c.memory_per_chip_bytes))
  return out if limit is None else out[:limit]


def _candidate(shape, p, g, generate_len, hw) -> Candidate:
  copies = (
    1 if _placement(p.sharding.layout) == _placement(g.sharding.layout) else 2
  )
  memory = (
    p.weight_bytes * copies
    + g.kv_bytes
    + max(
      p.activation_bytes + p.gathered_bytes,
      g.activation_bytes + g.gathered_bytes,
    )
  )
  return Candidate(
    mesh_shape=tuple(shape),
    prefill=p,
    generate=g,
    generate_len=generate_len,
    memory_per_chip_bytes=memory,
    fits=memory <= hw.hbm_bytes,
  )


def table(candidates: Sequence[Candidate]) -> str:
  """A fixed-width text table of `candidates`, one per line."""
  head = (
    f"{'#':>3} {'mesh':>8} {'prefill layout':<24} {'generate layout':<24} "
    f"{'prefill':>9} {'step':>9} {'MFU p/g':>9} {'chip·s/tok':>10} "
    f"{'GB/chip':>8} bound"
  )
  lines = [head]
  for i, c in enumerate(candidates):
    r = c.row()
    lines.append(
      f"{i + 1:>3} {r['mesh']:>8} {r['prefill_layout']:<24} "
      f"{r['generate_layout']:<24} {_s(r['prefill_s']):>9} "
      f"{_s(r['generate_step_s']):>9} "
      f"{r['prefill_mfu']:>4.0%}/{r['generate_mfu']:<4.0%} "
      f"{r['chip_s_per_token']:>10.3g} {r['memory_gb']:>8.1f} {r['bound']}"
    )
  return "\n".join(lines)


def _s(seconds: float) -> str:
  if seconds >= 1:
    return f"{seconds:.2f} s"
  if seconds >= 1e-3:
    return f"{seconds * 1e3:.1f} ms"
  return f"{seconds * 1e6:.0f} µs"
