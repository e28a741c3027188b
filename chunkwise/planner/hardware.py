"""Accelerators as the planner sees them: peak FLOP/s, HBM and links.

  hw = HARDWARE["tpu-v4"]
  hw.flops                 # bf16 FLOP/s per chip (dense)
  hw.collective_bandwidth(("x", "y"), {"x": 4, "y": 4, "z": 4})

Sources: Google Cloud's TPU system-architecture pages and the JAX
"scaling book" (How to Scale Your Model, ch. 2) for the TPUs; NVIDIA's
A100 / H100 / H200 datasheets (SXM, dense bf16) for the GPUs. Pope et al.
(2023) measured on TPU v4: 275 TFLOP/s bf16, 32 GiB HBM, 3D torus.

Links. A TPU's mesh axes are laid on its torus's physical dimensions; a
collective over one axis runs a bidirectional ring over two links per
chip, over two axes four, and so on up to the torus's dimensions. GPUs
talk through NVSwitch inside a node of `domain` GPUs (every group gets the
full NVLink bandwidth) and over the data-centre network (`dcn`, per GPU)
beyond it.

`measured(...)` makes one from a benchmark's measurements
(`chunkwise.bench.machine.hardware()` does it for the machine it runs on).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence

GiB = 1 << 30


class Topology(enum.Enum):
  TORUS = "torus"  # TPU ICI: `torus_dims` physical dimensions
  SWITCH = "switch"  # NVLink through NVSwitch, then the network
  NONE = "none"  # one device (this machine)


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One chip and its links (all rates per chip, one direction)."""

  name: str
  flops: float  # bf16 (or the compute dtype's) peak FLOP/s, dense
  hbm_bytes: float  # memory capacity
  hbm_bandwidth: float  # bytes/s
  link_bandwidth: float = 0.0  # bytes/s per link (torus) or per GPU (switch)
  topology: Topology = Topology.NONE
  torus_dims: int = 0  # physical torus dimensions (TPU)
  domain: int = 1  # chips per NVSwitch domain (GPU)
  dcn_bandwidth: float = 0.0  # bytes/s per chip beyond the domain
  int8_flops: float | None = None  # int8 peak, where it differs
  # TPU clock: bf16 peak over the MXUs' multiply-adds per cycle (the unit
  # of XLA:TPU's `estimated_cycles`); 0 where unknown.
  clock_hz: float = 0.0
  source: str = ""

  def __post_init__(self):
    for name in ("flops", "hbm_bytes", "hbm_bandwidth"):
      value = getattr(self, name)
      if not (isinstance(value, int | float) and value > 0):
        raise ValueError(f"Hardware.{name} must be positive, got {value!r}")

  def collective_bandwidth(
    self, axes: Sequence[str], sizes: Mapping[str, int]
  ) -> float:
    """Bytes/s one chip moves in a ring collective over mesh `axes`."""
    busy = [a for a in axes if sizes[a] > 1]
    if not busy:
      return math.inf
    if self.topology is Topology.TORUS:
      # A mesh axis longer than the torus's side spans several of its
      # physical dimensions (the side: chips ** (1 / dims)).
      chips = math.prod(sizes.values())
      side = max(2, round(chips ** (1 / self.torus_dims)))
      spans = sum(
        max(1, math.ceil(math.log(sizes[a], side) - 1e-9)) for a in busy
      )
      dims = min(spans, self.torus_dims)
      return 2 * dims * self.link_bandwidth  # both ring directions
    if self.topology is Topology.SWITCH:
      group = math.prod(sizes[a] for a in busy)
      if group <= self.domain:
        return self.link_bandwidth
      return self.dcn_bandwidth or self.link_bandwidth
    raise ValueError(
      f"hardware {self.name!r} has no links: it is one device, so a mesh "
      f"over {'·'.join(busy)} cannot run on it"
    )

  def hops(self, axes: Sequence[str], sizes: Mapping[str, int]) -> float:
    """Sequential steps of one ring collective over `axes` (bidirectional
    rings: half of each axis); one step through a switch."""
    busy = [sizes[a] for a in axes if sizes[a] > 1]
    if not busy:
      return 0.0
    if self.topology is Topology.SWITCH:
      return float(len(busy))
    return float(sum(max(1, k // 2) for k in busy))


def measured(
  name: str, *, flops: float, hbm_bytes: float, hbm_bandwidth: float
) -> Hardware:
  """One device measured by a benchmark (no links)."""
  return Hardware(
    name=name,
    flops=flops,
    hbm_bytes=hbm_bytes,
    hbm_bandwidth=hbm_bandwidth,
    source="measured by chunkwise.bench.machine",
  )


_SCALING_BOOK = "JAX scaling book ch. 2 / Google Cloud TPU docs"

HARDWARE: dict[str, Hardware] = {
  "tpu-v4": Hardware(
    "tpu-v4",
    flops=275e12,
    int8_flops=275e12,
    hbm_bytes=32 * GiB,
    hbm_bandwidth=1.2e12,
    link_bandwidth=4.5e10,
    topology=Topology.TORUS,
    torus_dims=3,
    clock_hz=1.05e9,  # peak / (2 cores x 4 MXUs of 128x128 x 2 flops)
    source=_SCALING_BOOK + "; Pope et al. 2023 §4",
  ),
  "tpu-v5e": Hardware(
    "tpu-v5e",
    flops=197e12,
    int8_flops=394e12,
    hbm_bytes=16 * GiB,
    hbm_bandwidth=8.1e11,
    link_bandwidth=4.5e10,
    topology=Topology.TORUS,
    torus_dims=2,
    clock_hz=1.5e9,  # peak / (4 MXUs of 128x128 x 2 flops)
    source=_SCALING_BOOK,
  ),
  "tpu-v5p": Hardware(
    "tpu-v5p",
    flops=459e12,
    int8_flops=918e12,
    hbm_bytes=96 * GiB,
    hbm_bandwidth=2.76e12,
    link_bandwidth=9e10,
    topology=Topology.TORUS,
    torus_dims=3,
    clock_hz=1.75e9,  # peak / (2 cores x 4 MXUs of 128x128 x 2 flops)
    source=_SCALING_BOOK,
  ),
  "tpu-v6e": Hardware(
    "tpu-v6e",
    flops=918e12,
    int8_flops=1836e12,
    hbm_bytes=32 * GiB,
    hbm_bandwidth=1.64e12,
    link_bandwidth=9e10,
    topology=Topology.TORUS,
    torus_dims=2,
    clock_hz=1.75e9,  # peak / (4 MXUs of 256x256 x 2 flops)
    source=_SCALING_BOOK,
  ),
  "a100": Hardware(
    "a100",
    flops=312e12,
    int8_flops=624e12,
    hbm_bytes=80e9,
    hbm_bandwidth=2.039e12,
    link_bandwidth=300e9,
    topology=Topology.SWITCH,
    domain=8,
    dcn_bandwidth=25e9,
    source="NVIDIA A100 datasheet (SXM 80GB); NVLink 600 GB/s both ways",
  ),
  "h100": Hardware(
    "h100",
    flops=989e12,
    int8_flops=1979e12,
    hbm_bytes=80e9,
    hbm_bandwidth=3.35e12,
    link_bandwidth=450e9,
    topology=Topology.SWITCH,
    domain=8,
    dcn_bandwidth=50e9,
    source="NVIDIA H100 datasheet (SXM); NVLink 900 GB/s both ways",
  ),
  "h200": Hardware(
    "h200",
    flops=989e12,
    int8_flops=1979e12,
    hbm_bytes=141e9,
    hbm_bandwidth=4.8e12,
    link_bandwidth=450e9,
    topology=Topology.SWITCH,
    domain=8,
    dcn_bandwidth=50e9,
    source="NVIDIA H200 datasheet (SXM); NVLink 900 GB/s both ways",
  ),
}


def get(name: str | Hardware) -> Hardware:
  """`HARDWARE[name]`; unknown names raise and list the known ones."""
  if isinstance(name, Hardware):
    return name
  try:
    return HARDWARE[name]
  except (KeyError, TypeError):
    raise ValueError(
      f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE))} "
      "(or a planner.Hardware, e.g. chunkwise.bench.machine.hardware())"
    ) from None
