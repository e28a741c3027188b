"""TPU slices without a TPU: the devices of a TPU topology as libtpu
describes them (`jax.experimental.topologies`), for compiling the
engine's programs with XLA:TPU ahead of time on any machine (the `tpu`
extra installs libtpu).

  target = Target.parse("tpu-v5e:2x2")      # or "tpu-v4:4x4x4", slices=2
  mesh = target.mesh()                       # (1, 2, 2) on the 2x2 torus
  compiled = jax.jit(f).lower(*abstract_args).compile()   # for TPU v5 lite
  target.hbm_bytes, target.hardware          # 16 GiB, "tpu-v5e"
  seconds(hlo.estimated_cycles(compiled.as_text()), target)

Nothing runs: the devices exist only to be compiled for. A mesh's axes
follow the torus (`mesh_utils.create_device_mesh` orders each axis's
devices as a ring); with `slices`, x spans the slices (data-centre
network) and y, z the chips of each slice. v4 and v5p chips are
compiled as one "megacore" device each, as a live slice runs them.

Pitfalls this module handles (each cost a failed compile): libtpu looks
for its workers unless `TPU_WORKER_HOSTNAMES` is set; a 1x1 topology
needs `chips_per_host_bounds=(1, 1, 1)`; Pallas TPU kernels read the TPU
generation from the mesh in context, so lowering happens under
`jax.set_mesh(mesh)` (`compiling`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re

import jax

from chunkwise.planner import hardware as hardware_lib

# generation -> (planner hardware, chip config, torus dimensions)
GENERATIONS = {
  "v4": ("tpu-v4", "megacore", 3),
  "v5e": ("tpu-v5e", None, 2),
  "v5p": ("tpu-v5p", "megacore", 3),
  "v6e": ("tpu-v6e", None, 2),
}
_NAME = re.compile(r"^tpu-(?P<gen>[a-z0-9]+):(?P<topo>\d+(?:x\d+){1,2})$")


def available() -> bool:
  """Whether libtpu is installed (the `tpu` extra)."""
  try:
    import libtpu  # noqa: F401
  except ImportError:
    return False
  return True


@dataclasses.dataclass(frozen=True)
class Target:
  """A TPU generation, its per-slice topology ("2x2", "4x4x4") and the
  number of slices."""

  generation: str
  topology: str
  slices: int = 1

  def __post_init__(self):
    if self.generation not in GENERATIONS:
      raise ValueError(
        f"TPU generation {self.generation!r} is not one of "
        f"{', '.join(GENERATIONS)}"
      )
    dims = self.dims
    want = GENERATIONS[self.generation][2]
    if len(dims) != want or not all(d > 0 for d in dims):
      raise ValueError(
        f"topology {self.topology!r} of {self.generation} must be {want} "
        "positive sizes joined by 'x', e.g. "
        + ("'2x2x2'" if want == 3 else "'2x2'")
      )
    if not (isinstance(self.slices, int) and self.slices >= 1):
      raise ValueError(f"slices must be a positive int, got {self.slices!r}")

  @classmethod
  def parse(cls, text: str, slices: int = 1) -> Target:
    """'tpu-v5e:2x2' -> Target("v5e", "2x2", slices)."""
    m = _NAME.match(str(text).strip().lower())
    if not m:
      raise ValueError(
        f"target {text!r} must look like tpu-<generation>:<topology>, e.g. "
        f"tpu-v5e:2x2 or tpu-v4:4x4x4 (generations: {', '.join(GENERATIONS)})"
      )
    return cls(m.group("gen"), m.group("topo"), slices)

  def __str__(self) -> str:
    tail = f"x{self.slices} slices" if self.slices > 1 else ""
    return f"tpu-{self.generation}:{self.topology}{tail}"

  @property
  def dims(self) -> tuple[int, ...]:
    return tuple(int(d) for d in self.topology.split("x"))

  @property
  def chips(self) -> int:
    return math.prod(self.dims) * self.slices

  @property
  def hardware(self) -> str:
    """The planner's name for the chip ("tpu-v5e")."""
    return GENERATIONS[self.generation][0]

  @property
  def hbm_bytes(self) -> float:
    return hardware_lib.get(self.hardware).hbm_bytes

  def default_mesh(self) -> tuple[int, int, int]:
    """(x, y, z) over the torus: a 2D slice's dimensions on y and z, a
    3D slice's on x, y, z; slices multiply x."""
    dims = self.dims if len(self.dims) == 3 else (1, *self.dims)
    return (dims[0] * self.slices, dims[1], dims[2])

  def devices(self) -> list:
    """The slice's devices, described by libtpu (nothing is attached)."""
    if not available():
      raise ValueError(
        f"compiling for {self} needs libtpu: pip install 'chunkwise[tpu]'"
      )
    from jax.experimental import topologies

    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # Compiling touches no chip: other processes may compile beside it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    _, config, _ = GENERATIONS[self.generation]
    kwargs = {} if config is None else {"chip_config_name": config}
    if math.prod(self.dims) == 1:
      kwargs["chips_per_host_bounds"] = (1, 1, 1)
    topology = topologies.get_topology_desc(
      topology_name=f"{self.generation}:{self.topology}",
      platform="tpu",
      num_slices=self.slices,
      **kwargs,
    )
    return list(topology.devices)

  def mesh(self, shape=None) -> jax.sharding.Mesh:
    """A mesh of axes (x, y, z) over the target's devices (`shape`, default
    `default_mesh`), each axis a ring of the torus where it can be."""
    from jax.experimental import mesh_utils

    from chunkwise.partitioning.mesh import AXES

    shape = tuple(shape or self.default_mesh())
    if len(shape) != 3 or math.prod(shape) != self.chips:
      raise ValueError(
        f"mesh {shape} must be three sizes holding the {self.chips} "
        f"devices of {self}"
      )
    devices = self.devices()
    if self.slices > 1:
      if shape[0] % self.slices:
        raise ValueError(
          f"mesh {shape}: x ({shape[0]}) must be a multiple of the "
          f"{self.slices} slices it spans"
        )
      grid = mesh_utils.create_hybrid_device_mesh(
        (shape[0] // self.slices, *shape[1:]),
        (self.slices, 1, 1),
        devices,
      )
    else:
      try:
        grid = mesh_utils.create_device_mesh(shape, devices)
      except NotImplementedError:
        # An axis across physical dimensions (2x2x4 as 2, 2, 4 where the
        # torus orders them otherwise): rings that split a dimension.
        grid = mesh_utils.create_device_mesh(
          shape, devices, allow_split_physical_axes=True
        )
    return jax.sharding.Mesh(grid, AXES)


def compiling(mesh):
  """The context to lower a program for `mesh` in: Pallas TPU kernels read
  their TPU generation from it (a CPU mesh needs none)."""
  if mesh.devices.flat[0].platform != "tpu":
    return contextlib.nullcontext()
  return jax.set_mesh(mesh)


# libtpu's device_kind -> the planner's chip
_KINDS = {
  "TPU v4": "tpu-v4",
  "TPU v5 lite": "tpu-v5e",
  "TPU v5": "tpu-v5p",
  "TPU v5p": "tpu-v5p",
  "TPU v6 lite": "tpu-v6e",
}


def hardware_of(device) -> hardware_lib.Hardware | None:
  """The planner's chip of a (TPU) device, None for any other."""
  name = _KINDS.get(getattr(device, "device_kind", None))
  return None if name is None else hardware_lib.get(name)


def seconds(cycles: float, target: Target) -> float:
  """`cycles` (XLA:TPU's `estimated_cycles`) at the chip's clock."""
  return cycles / hardware_lib.get(target.hardware).clock_hz
