"""The cost model: FLOPs, HBM bytes, communication and memory of one
forward pass on one chip, for a layout family on a mesh (Pope et al.,
2023, §3), and its time under fitted overheads (`calibration`).

  est = estimate(hparams, "tpu-v4", (4, 4, 4), "ws_2d/yzx/latency",
                 phase="generate", batch=64, tokens=1, context=2080,
                 weights="int8")
  est.time_s, est.bound, est.memory_bytes, est.comm_bytes_per_layer

Notation: B rows, L tokens per row in this pass (the prefill length, 1
for a decode step), C the K/V positions attended, E d_model, F d_ff, n
chips = x·y·z. A layer's weight matmuls read `in_width` = 2F + (H + 2Hkv)K
columns (gate, up, q, k, v) and `out_width` = F + HK rows (down, o).

The pieces it adds up: `families` (how each layout family cuts the
model: `Sharding`), `sizes` (bytes per value, the model's widths) and
`communication` (each family's collectives per layer and their time).
Every figure is per chip.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from chunkwise.configs import HParams
from chunkwise.planner import hardware as hw_lib
from chunkwise.planner.calibration import FITTED, Overheads
from chunkwise.planner.communication import (
  Collective,
  layer_collectives,
  ring,
)
from chunkwise.planner.families import Family, Sharding, sharding
from chunkwise.planner.sizes import (
  Shapes,
  dtype_bytes,
  kv_bytes_per_value,
  weight_bytes_per_value,
)


class Phase(enum.Enum):
  PREFILL = "prefill"
  GENERATE = "generate"


@dataclasses.dataclass(frozen=True)
class Estimate:
  """One forward pass (a prefill, or one decode step) on one chip."""

  phase: Phase
  sharding: Sharding
  batch: int
  tokens: int
  # Work per layer and outside the layers (embedding, logits).
  layer_flops: float
  layer_hbm_bytes: float
  layer_comm_s: float  # activations' collectives, at the links' peak
  layer_weight_comm_s: float  # weight gathers, at the links' peak
  layer_hops: float
  collectives: tuple[Collective, ...]  # one layer's
  rows: float  # rows of each weight matmul
  head_flops: float
  head_hbm_bytes: float
  layers: int
  params: int  # the model's (MFU's numerator)
  peak: float  # the chip's FLOP/s
  # Memory held (bytes).
  weight_bytes: float
  kv_bytes: float
  activation_bytes: float
  gathered_bytes: float
  # Under the overheads.
  compute_s: float = 0.0
  memory_s: float = 0.0
  comm_s: float = 0.0
  overhead_s: float = 0.0
  time_s: float = 0.0
  bound: str = ""

  @property
  def memory_bytes(self) -> float:
    return (
      self.weight_bytes
      + self.kv_bytes
      + self.activation_bytes
      + self.gathered_bytes
    )

  @property
  def mfu(self) -> float:
    """2 · params · tokens / (chips · peak · time): the paper's MFU."""
    tokens = self.batch * self.tokens
    return (
      2 * self.params * tokens / (self.sharding.chips * self.peak * self.time_s)
    )

  @property
  def comm_bytes_per_layer(self) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in self.collectives:
      out[c.kind] = out.get(c.kind, 0.0) + c.bytes
    return out


def _kv_weight_split(s: Sharding, m: Shapes) -> int:
  """Ways the K/V projection weights are split among chips."""
  sizes = dict(s.sizes)
  if s.family is Family.REFERENCE:
    return 1
  if s.family is Family.WS_1D:
    return s.chips if m.Hkv % s.chips == 0 else 1
  yz = sizes["y"] * sizes["z"]
  return sizes["x"] * (yz if m.Hkv % yz == 0 else 1)


def _kv_split(s: Sharding, m: Shapes) -> int:
  """Ways the K/V cache is divided among chips."""
  if s.family is Family.REFERENCE:
    return 1
  if s.family.gathered:
    return (
      s.chips
      if s.family is Family.WG_XYZ
      else max(s.size(s.attn_axes), s.size(s.family.gathered))
    )
  a = s.size(s.attn_axes)
  if a > 1:
    return a
  shards = s.chips
  return (
    shards
    if m.Hkv % shards == 0
    else math.gcd(m.Hkv, shards)
    if (m.Hkv >= shards)
    else 1
  )


def estimate(
  hparams: HParams,
  hardware,
  mesh_shape,
  layout,
  *,
  phase: str | Phase,
  batch: int,
  tokens: int,
  context: float,
  max_context: int | None = None,
  weights: str = "bf16",
  cache_dtype: str = "bf16",
  act_dtype: str = "bf16",
  all_logits: bool = True,
  overheads: Overheads = FITTED,
) -> Estimate:
  """One pass of `batch` rows x `tokens` tokens attending to `context`
  positions on average (`max_context`, default `context`, sizes the K/V
  cache held); `layout` is a chunkwise `Layout` (or string) or a
  `Sharding`. `all_logits`: a prefill computes every position's logits
  (chunkwise's scores) rather than the last one's."""
  hw = hw_lib.get(hardware)
  phase = Phase(phase)
  if isinstance(layout, Sharding):
    s = layout
  else:
    s = sharding(hparams, mesh_shape, layout, batch=batch)
  m = Shapes.of(hparams, s.heads)
  sizes = dict(s.sizes)
  n = s.chips
  wb, cb, ab = (
    weight_bytes_per_value(weights),
    kv_bytes_per_value(cache_dtype, m.K),
    dtype_bytes(act_dtype),
  )
  B, L = int(batch), int(tokens)
  if B < 1 or L < 1:
    raise ValueError(f"batch and tokens must be positive, got {B} and {L}")
  C = float(context)
  C_max = float(max_context if max_context is not None else context)
  T = B * L
  kv_split = _kv_split(s, m)
  N = s.size(s.family.gathered) if s.family.gathered else 1
  # Work of one layer.
  layer_flops = (2 * T * m.layer_params + 4 * T * C * m.H * m.K) / n
  # K/V projections whose heads do not divide the head shards are kept
  # whole on every head shard (chunkwise and the paper alike).
  kv_weights = m.E * m.kv_width * wb
  kv_extra = kv_weights * (1 / _kv_weight_split(s, m) - 1 / n)
  weight_reads = m.layer_params * wb * N / n + (0 if N > 1 else kv_extra)
  kv_reads = B * (C + (L if phase is Phase.PREFILL else 0)) * m.kv_width * cb
  act_traffic = 2 * ab * T * (2 * m.E + m.in_width + m.out_width) / n
  layer_hbm = weight_reads + kv_reads / kv_split + act_traffic
  collectives, comm_s, weight_s, hops = [], 0.0, 0.0, 0.0
  for kind, axes, nbytes, gathers in layer_collectives(s, m, T, ab, wb):
    c, sec, hop = ring(kind, axes, nbytes, gathers, sizes, hw)
    if c is not None:
      collectives.append(c)
      hops += hop
      if gathers:
        weight_s += sec
      else:
        comm_s += sec
  rows = T / N
  # Embedding gather (free) and the logits matmul over the vocabulary.
  logit_rows = T if (phase is Phase.PREFILL and all_logits) else B
  head_flops = 2 * logit_rows * m.E * m.V / n
  head_hbm = m.V * m.E * wb / n + 4 * logit_rows * m.V / n
  # Memory held.
  # The embedding and, untied, the unembedding (the compiler counts both).
  total_weights = m.layers * m.layer_params + (1 if m.tied else 2) * m.V * m.E
  weight_bytes = total_weights * wb / n + m.layers * kv_extra
  kv_bytes = m.layers * B * C_max * m.kv_width * cb / kv_split
  activation_bytes = (
    ab * T * (2 * m.E + m.in_width) / n + 4 * logit_rows * m.V / n
  )
  gathered = 2 * m.largest_matrix * wb * N / n if s.family.gathered else 0.0
  if s.family.gathered and s.layout is not None:
    # chunkwise's weight-gathered layout gathers the whole embedding
    # table to embed and unembed its rows.
    gathered += m.V * m.E * wb
  est = Estimate(
    phase=phase,
    sharding=s,
    batch=B,
    tokens=L,
    layer_flops=layer_flops,
    layer_hbm_bytes=layer_hbm,
    layer_comm_s=comm_s,
    layer_weight_comm_s=weight_s,
    layer_hops=hops,
    collectives=tuple(collectives),
    rows=rows,
    head_flops=head_flops,
    head_hbm_bytes=head_hbm,
    layers=m.layers,
    params=m.params,
    peak=hw.flops,
    weight_bytes=weight_bytes,
    kv_bytes=kv_bytes,
    activation_bytes=activation_bytes,
    gathered_bytes=gathered,
  )
  return overheads.timed(est, hw)


def mfu(hparams: HParams, hardware, chips: int, tokens: float, seconds: float):
  """Model FLOPs utilisation: 2 · params · tokens / (chips · peak · time)
  (the paper's definition: attention FLOPs not counted)."""
  hw = hw_lib.get(hardware)
  return 2 * hparams.num_params() * tokens / (chips * hw.flops * seconds)
