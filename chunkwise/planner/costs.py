"""The cost model: FLOPs, HBM bytes, communication and memory of one
forward pass on one chip, for a layout family on a mesh (Pope et al.,
2023, §3), and its time under fitted overheads (`calibration`).

  s = sharding(hparams, (4, 4, 4), "ws_2d/yzx/latency", batch=64)
  est = estimate(hparams, "tpu-v4", (4, 4, 4), "ws_2d/yzx/latency",
                 phase="generate", batch=64, tokens=1, context=2080,
                 weights="int8")
  est.time_s, est.bound, est.memory_bytes, est.comm_bytes_per_layer

Notation: B rows, L tokens per row in this pass (the prefill length, 1
for a decode step), C the K/V positions attended, E d_model, F d_ff, n
chips = x·y·z. A layer's weight matmuls read `in_width` = 2F + (H + 2Hkv)K
columns (gate, up, q, k, v) and `out_width` = F + HK rows (down, o).

Families (how the weights and the residual stream are cut):
  reference  one chip, nothing cut.
  ws_1d      every matrix split over n on its heads / d_ff side; per layer
             an all-gather and a reduce-scatter of [BL, E] over x·y·z.
  ws_2d      E over x, heads / d_ff over y·z: all-gather over yz of
             [BL, E/X], reduce-scatter over x of [BL, in_width/YZ],
             all-gather over x of [BL, out_width/YZ], reduce-scatter over
             yz of [BL, E/X] (a sequential block does the E pair twice).
  wg_x, wg_xy, wg_xyz
             weights stored as ws_2d and all-gathered, one matrix at a
             time, over the named axes (N chips); the batch is split over
             them and the R = n/N chips left run ws_1d on their rows. Only
             wg_xyz is a chunkwise layout (`LayoutKind.WG`); wg_x and
             wg_xy are the paper's and are modelled for comparison.
Attention is split by batch over `attn_split` chips (an all-to-all of
queries and outputs; the K/V cache divided), else by heads: K/V heads
that do not divide the head shards are then replicated (the paper's
"baseline multiquery").

Every figure is per chip. Communication is counted on the full-size side
of each collective (an all-gather's result, a reduce-scatter's operand,
an all-to-all's operand): a ring moves (k-1)/k of it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping

from chunkwise.configs import Block, HParams
from chunkwise.planner import hardware as hw_lib
from chunkwise.planner.calibration import FITTED, Overheads

XYZ = ("x", "y", "z")

DTYPE_BYTES = {
  "int8": 1,
  "bf16": 2,
  "bfloat16": 2,
  "f16": 2,
  "float16": 2,
  "f32": 4,
  "float32": 4,
}


def dtype_bytes(name) -> int:
  key = getattr(name, "name", name)
  key = str(key).lower()
  if key not in DTYPE_BYTES:
    raise ValueError(
      f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_BYTES)}"
    )
  return DTYPE_BYTES[key]


def kv_bytes_per_value(name, head_dim: int) -> float:
  """Bytes a K/V cache of dtype `name` holds per key (or value) element:
  int8 K/V also keeps a 4-byte f32 scale per token and head
  (`chunkwise.models.kv_int8`)."""
  size = dtype_bytes(name)
  return size * (1 + 4 / head_dim) if size == 1 else float(size)


class Family(enum.Enum):
  REFERENCE = "reference"
  WS_1D = "ws_1d"
  WS_2D = "ws_2d"
  WG_X = "wg_x"
  WG_XY = "wg_xy"
  WG_XYZ = "wg_xyz"

  @property
  def gathered(self) -> tuple[str, ...]:
    """Mesh axes the weights are all-gathered over (weight-gathered)."""
    return {
      Family.WG_X: ("x",),
      Family.WG_XY: ("x", "y"),
      Family.WG_XYZ: XYZ,
    }.get(self, ())


class Phase(enum.Enum):
  PREFILL = "prefill"
  GENERATE = "generate"


@dataclasses.dataclass(frozen=True)
class Sharding:
  """How one phase cuts the model on a mesh."""

  family: Family
  sizes: tuple[tuple[str, int], ...]
  attn_axes: tuple[str, ...] = ()  # attention split by batch over these
  overlapped: bool = True  # collectives hidden behind matmuls (looped)
  layout: object = None  # the chunkwise Layout, when the family has one
  heads: int = 0  # query heads after padding (0: the model's)

  @property
  def chips(self) -> int:
    return math.prod(dict(self.sizes).values())

  def size(self, axes) -> int:
    sizes = dict(self.sizes)
    return math.prod(sizes[a] for a in axes)

  @property
  def attention(self) -> str:
    return "batch" if self.size(self.attn_axes) > 1 else "head"

  def __str__(self) -> str:
    if self.layout is not None:
      return str(self.layout)
    return f"{self.family.value}/attn-{self.attention}"


def _mesh_sizes(mesh_shape) -> tuple[tuple[str, int], ...]:
  shape = tuple(int(s) for s in mesh_shape)
  if len(shape) != 3 or min(shape) < 1:
    raise ValueError(
      f"mesh_shape must be three positive sizes (x, y, z), got {mesh_shape!r}"
    )
  return tuple(zip(XYZ, shape, strict=True))


def sharding(
  hparams: HParams, mesh_shape, layout, *, batch: int, prefix_batch=None
) -> Sharding:
  """The sharding chunkwise runs for `layout` (a `Layout` or its string)
  on a mesh of `mesh_shape` with `batch` rows: the attention batch split
  that `partitioning.Plan` picks for that batch. Raises ValueError when
  the layout cannot run there (`partitioning.plan.check`'s message)."""
  from jax.sharding import AbstractMesh

  from chunkwise.partitioning import Layout, LayoutKind
  from chunkwise.partitioning import plan as plan_lib

  sizes = _mesh_sizes(mesh_shape)
  layout = Layout.parse(layout)
  mesh = AbstractMesh(tuple(s for _, s in sizes), XYZ)
  if layout.kind is LayoutKind.REFERENCE:
    if math.prod(s for _, s in sizes) != 1:
      raise ValueError(
        f"the reference layout runs on one chip, not a {mesh_shape} mesh"
      )
    return Sharding(Family.REFERENCE, sizes, layout=layout)
  plan_lib.check(layout, mesh, hparams)
  prefixes = () if prefix_batch is None else (prefix_batch,)
  plan = plan_lib.Plan.make(
    layout, mesh, hparams, batch=batch, prefix_batches=prefixes
  )
  family = {
    LayoutKind.WS_1D: Family.WS_1D,
    LayoutKind.WS_2D: Family.WS_2D,
    LayoutKind.WG: Family.WG_XYZ,
  }[layout.kind]
  from chunkwise.collectives import Collectives

  return Sharding(
    family,
    sizes,
    attn_axes=tuple(plan.attn_batch),
    overlapped=layout.collectives is not Collectives.XLA,
    layout=layout,
  )


def paper_sharding(
  hparams: HParams, mesh_shape, family, *, attention: str, batch: int
) -> Sharding:
  """A family as the paper runs it: looped collectives, heads padded up
  to a multiple of the head shards, attention by `attention` ("head" or
  "batch": split over as many chips as the batch allows)."""
  family = Family(family)
  sizes = _mesh_sizes(mesh_shape)
  n = math.prod(s for _, s in sizes)
  shards = _head_shards(family, dict(sizes))
  heads = -(-hparams.heads // shards) * shards
  attn: tuple[str, ...] = ()
  if attention == "batch" or family is Family.WG_XYZ:
    chosen: list[str] = []
    for a, s in sizes:
      if s > 1 and batch % (math.prod(dict(sizes)[c] for c in chosen) * s) == 0:
        chosen.append(a)
    attn = tuple(chosen)
  elif attention != "head":
    raise ValueError(f"attention must be 'head' or 'batch', got {attention!r}")
  del n
  return Sharding(family, sizes, attn_axes=attn, overlapped=True, heads=heads)


def _head_shards(family: Family, sizes: Mapping[str, int]) -> int:
  if family is Family.REFERENCE:
    return 1
  if family is Family.WS_1D:
    return math.prod(sizes.values())
  rest = [a for a in XYZ if a not in family.gathered]
  if family is Family.WS_2D:
    return math.prod(sizes.values())  # queries cut over y·z, then x
  return math.prod(sizes[a] for a in rest) if rest else 1


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The sizes the arithmetic reads, from HParams (heads maybe padded)."""

  layers: int
  E: int
  F: int
  H: int
  Hkv: int
  K: int
  V: int
  sequential: bool
  params: int  # the model's own count (MFU's numerator)
  widths: tuple[int, int] | None = None  # (in, out) if not the layer's

  @classmethod
  def of(cls, h: HParams, heads: int = 0) -> Shapes:
    return cls(
      layers=h.layers,
      E=h.d_model,
      F=h.d_ff,
      H=heads or h.heads,
      Hkv=h.kv_heads,
      K=h.head_dim,
      V=h.vocab,
      sequential=h.block is Block.SEQUENTIAL,
      params=h.num_params(),
    )

  @property
  def in_width(self) -> int:
    if self.widths:
      return self.widths[0]
    return 2 * self.F + (self.H + 2 * self.Hkv) * self.K

  @property
  def out_width(self) -> int:
    if self.widths:
      return self.widths[1]
    return self.F + self.H * self.K

  @property
  def layer_params(self) -> int:
    return self.E * (self.in_width + self.out_width)

  @property
  def largest_matrix(self) -> int:
    return self.E * max(self.F, self.H * self.K)

  @property
  def kv_width(self) -> int:
    """K and V values per token per layer."""
    return 2 * self.Hkv * self.K


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str  # "all-gather" | "reduce-scatter" | "all-to-all"
  axes: tuple[str, ...]
  bytes: float  # full-size side, per chip
  weights: bool = False  # gathers weights (can run a layer ahead)


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


def _ring(kind, axes, nbytes, weights, sizes, hw):
  """(Collective, seconds at the links' peak, ring steps), or Nones."""
  k = math.prod(sizes[a] for a in axes)
  if k <= 1 or nbytes <= 0:
    return None, 0.0, 0.0
  seconds = nbytes * (k - 1) / k / hw.collective_bandwidth(axes, sizes)
  c = Collective(kind, tuple(axes), nbytes, weights)
  return c, seconds, hw.hops(axes, sizes)


def _layer_collectives(s: Sharding, m: Shapes, tokens: float, ab: int, wb):
  """(kind, axes, full-size bytes, gathers weights) of one layer's
  collectives."""
  sizes = dict(s.sizes)
  f = s.family
  e_pairs = 2 if m.sequential else 1
  out = []
  n = s.chips
  if f is Family.WS_1D:
    for _ in range(e_pairs):
      out.append(("all-gather", XYZ, tokens * m.E * ab, False))
      out.append(("reduce-scatter", XYZ, tokens * m.E * ab, False))
  elif f is Family.WS_2D:
    X, YZ = sizes["x"], sizes["y"] * sizes["z"]
    for _ in range(e_pairs):
      out.append(("all-gather", ("y", "z"), tokens * m.E / X * ab, False))
      out.append(("reduce-scatter", ("y", "z"), tokens * m.E / X * ab, False))
    out.append(("reduce-scatter", ("x",), tokens * m.in_width / YZ * ab, False))
    out.append(("all-gather", ("x",), tokens * m.out_width / YZ * ab, False))
  elif f.gathered:
    N = s.size(f.gathered)
    rest = tuple(a for a in XYZ if a not in f.gathered)
    R = n // N
    # Each stored matrix is gathered to a 1/R piece of itself.
    out.append(("all-gather", f.gathered, m.layer_params * wb / R, True))
    rows = tokens / N
    for _ in range(e_pairs):
      out.append(("all-gather", rest, rows * m.E * ab, False))
      out.append(("reduce-scatter", rest, rows * m.E * ab, False))
  if s.size(s.attn_axes) > 1 and f in (Family.WS_1D, Family.WS_2D):
    # Queries to their rows' devices and outputs back.
    q = tokens * m.H * m.K * ab / n
    out.append(("all-to-all", s.attn_axes, q, False))
    out.append(("all-to-all", s.attn_axes, q, False))
  return out


# int8 weights carry an f32 scale per group of at most 128 inputs
# (`models.quantized`).
INT8_GROUP = 128


def weight_bytes_per_value(name) -> float:
  """Bytes a stored weight value takes: int8 counts its group scales."""
  size = dtype_bytes(name)
  return size + 4 / INT8_GROUP if size == 1 else float(size)


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
  for kind, axes, nbytes, gathers in _layer_collectives(s, m, T, ab, wb):
    c, sec, hop = _ring(kind, axes, nbytes, gathers, sizes, hw)
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
  total_weights = m.layers * m.layer_params + m.V * m.E
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
