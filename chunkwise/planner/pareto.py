"""Latency against cost, one curve per layout family (the paper's
Figure 1): for each batch size, each family's fastest mesh.

  curves = frontier(cw.configs.get("palm-540b"), "tpu-v4", 64,
                    phase="generate", weights="int8")
  curves["ws_2d"]   # [Point(batch=1, latency_s=..., cost=..., mfu=...), ...]

Families are the paper's (ws_1d, ws_2d, wg_x, wg_xy, wg_xyz, heads padded
to the head shards as the paper padded PaLM 540B's 48 to 64), attention
by batch where the batch splits, else by head. Latency is a whole
prefill or one decode step; cost is chip-seconds per token.
"""

from __future__ import annotations

import dataclasses

from chunkwise.planner import paper
from chunkwise.planner.calibration import FITTED, Overheads

BATCHES = tuple(2**k for k in range(11))  # 1 .. 1024


@dataclasses.dataclass(frozen=True)
class Point:
  batch: int
  latency_s: float
  cost: float  # chip-seconds per token
  mfu: float
  mesh_shape: tuple[int, ...]
  layout: str


def frontier(
  hparams,
  hardware,
  chips: int,
  *,
  phase: str = "generate",
  weights: str = "int8",
  batches=BATCHES,
  prefill_len: int = paper.PREFILL_LEN,
  overheads: Overheads = FITTED,
) -> dict[str, list[Point]]:
  """{family: points by batch} for `phase` on `chips` chips; a batch
  that does not fit a family is left out of its curve."""
  curves: dict[str, list[Point]] = {f: [] for f in paper.FAMILIES_ALL}
  for batch in batches:
    options = paper.estimates(
      hparams,
      chips,
      batch,
      phase,
      weights=weights,
      families=paper.FAMILIES_ALL,
      prefill_len=prefill_len,
      overheads=overheads,
      hardware=hardware,
    )
    best: dict = {}
    for e in options:
      f = e.sharding.family.value
      if f not in best or e.time_s < best[f].time_s:
        best[f] = e
    for f, e in best.items():
      tokens = e.batch * e.tokens
      curves[f].append(
        Point(
          batch=batch,
          latency_s=e.time_s,
          cost=e.sharding.chips * e.time_s / tokens,
          mfu=e.mfu,
          mesh_shape=tuple(s for _, s in e.sharding.sizes),
          layout=str(e.sharding),
        )
      )
  return {f: pts for f, pts in curves.items() if pts}
