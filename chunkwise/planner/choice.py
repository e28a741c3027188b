"""`layout="auto"`: the planner's best layout per phase for a mesh.

  choice = choose(hparams, (2, 2, 2), Workload(batch=8, prefill_len=512,
                                                generate_len=64))
  choice.prefill_layout, choice.generate_layout   # Layouts
  print(choice)                                    # the ranked table

`InferenceModel(..., layout="auto", mesh=mesh, workload=...)`, `cw.load`
and the jobs (`--layout=auto`) call `resolve`; the decision is logged
(logger "chunkwise.planner") and kept on the model (`model.layout_choice`).
The hardware is the mesh's devices (`hardware_of`): a TPU or GPU by its
device kind, else `CPU_HOST` (host devices sharing one CPU: every chip
and link is a share of the same machine, so the choice mostly avoids
communication).
"""

from __future__ import annotations

import dataclasses
import logging

from chunkwise.configs import HParams
from chunkwise.planner import hardware as hw_lib
from chunkwise.planner import search

AUTO = "auto"
log = logging.getLogger("chunkwise.planner")

# Fake host devices on one CPU: modest figures, links as fast as memory.
CPU_HOST = hw_lib.Hardware(
  "cpu-host",
  flops=1e11,
  hbm_bytes=16e9,
  hbm_bandwidth=2e10,
  link_bandwidth=1e10,
  topology=hw_lib.Topology.SWITCH,
  domain=1 << 20,
  source="placeholder for host CPU devices (no measurement)",
)

_KINDS = (  # device_kind substring (lower case) -> HARDWARE name
  ("v6", "tpu-v6e"),
  ("v5 lite", "tpu-v5e"),
  ("v5e", "tpu-v5e"),
  ("v5", "tpu-v5p"),
  ("v4", "tpu-v4"),
  ("h200", "h200"),
  ("h100", "h100"),
  ("a100", "a100"),
)


def hardware_of(devices) -> hw_lib.Hardware:
  """The planner's hardware for a list of JAX devices."""
  kind = str(getattr(devices[0], "device_kind", "")).lower()
  for key, name in _KINDS:
    if key in kind:
      return hw_lib.HARDWARE[name]
  return CPU_HOST


@dataclasses.dataclass(frozen=True)
class Workload:
  """What the model will mostly run: rows per call, prompt tokens and
  generated tokens per row."""

  batch: int = 1
  prefill_len: int = 512
  generate_len: int = 64

  def __post_init__(self):
    for name in ("batch", "prefill_len", "generate_len"):
      value = getattr(self, name)
      low = 0 if name == "generate_len" else 1
      if not isinstance(value, int) or value < low:
        raise ValueError(
          f"Workload.{name} must be an integer >= {low}, got {value!r}"
        )

  def fitted(self, max_len: int) -> Workload:
    """The same, shortened to fit a model of `max_len` positions."""
    prefill = max(1, min(self.prefill_len, max_len - 1))
    generate = max(0, min(self.generate_len, max_len - prefill))
    return dataclasses.replace(self, prefill_len=prefill, generate_len=generate)


@dataclasses.dataclass(frozen=True)
class Choice:
  """The chosen candidate and the ranking it came from."""

  candidates: tuple[search.Candidate, ...]
  workload: Workload
  hardware: hw_lib.Hardware

  @property
  def best(self) -> search.Candidate:
    return self.candidates[0]

  @property
  def prefill_layout(self):
    return self.best.prefill_layout

  @property
  def generate_layout(self):
    return self.best.generate_layout

  @property
  def mesh_shape(self) -> tuple[int, int, int]:
    return self.best.mesh_shape

  def __str__(self) -> str:
    w = self.workload
    return (
      f"layout=auto on {self.hardware.name}, batch {w.batch}, prefill "
      f"{w.prefill_len}, generate {w.generate_len}: prefill "
      f"{self.prefill_layout}, generate {self.generate_layout}, mesh "
      f"{'x'.join(map(str, self.mesh_shape))}\n" + search.table(self.candidates)
    )


def choose(
  hparams: HParams,
  mesh_shape,
  workload: Workload = Workload(),
  *,
  weights: str = "bf16",
  hardware=CPU_HOST,
  limit: int = 10,
  cache_dtype: str = "bf16",
) -> Choice:
  """The best layouts for a mesh of `mesh_shape` running `workload`
  (shortened to the model's max_len) with `weights` ("int8", "bf16",
  "f32") and K/V of `cache_dtype` on `hardware`; `limit` candidates are
  kept."""
  w = workload.fitted(hparams.max_len)
  shape = tuple(int(s) for s in mesh_shape)
  chips = shape[0] * shape[1] * shape[2]
  ranked = search.plan(
    hparams,
    hardware,
    chips,
    w.batch,
    w.prefill_len,
    w.generate_len,
    weights,
    mesh_shape=shape,
    cache_dtype=cache_dtype,
    limit=limit,
  )
  return Choice(tuple(ranked), w, hw_lib.get(hardware))


def is_auto(*layouts) -> bool:
  return any(isinstance(x, str) and x.strip().lower() == AUTO for x in layouts)


def resolve(
  hparams: HParams,
  mesh,
  layout=None,
  prefill_layout=None,
  generate_layout=None,
  *,
  workload: Workload | None = None,
  weights: str = "bf16",
  cache_dtype: str = "bf16",
):
  """Replaces "auto" among the layout arguments by the planner's choice
  for `mesh` (a Mesh or None); returns (layout, prefill_layout,
  generate_layout, Choice or None). Without a mesh "auto" is the
  reference layout (one device). Explicit per-phase layouts win over
  "auto" for their phase."""
  if not is_auto(layout, prefill_layout, generate_layout):
    return layout, prefill_layout, generate_layout, None
  if workload is not None and not isinstance(workload, Workload):
    raise ValueError(f"workload must be a planner Workload, got {workload!r}")
  if mesh is None:
    log.info("layout=auto without a mesh: the reference layout")

    def plain(x):
      return "reference" if is_auto(x) else x

    return plain(layout), plain(prefill_layout), plain(generate_layout), None
  shape = tuple(int(mesh.shape[a]) for a in ("x", "y", "z"))
  choice = choose(
    hparams,
    shape,
    workload or Workload(),
    weights=weights,
    hardware=hardware_of(list(mesh.devices.flat)),
    cache_dtype=cache_dtype,
  )
  log.info("%s", choice)

  def pick(given, chosen):
    if is_auto(given) or (given is None and is_auto(layout)):
      return chosen
    return layout if given is None else given

  pre = pick(prefill_layout, choice.prefill_layout)
  gen = pick(generate_layout, choice.generate_layout)
  return None, pre, gen, choice


def weights_name(weights) -> str:
  """ "int8", "bf16" or "f32" for a Weights pytree (its largest leaf)."""
  import jax

  leaves = jax.tree.leaves(weights)
  if not leaves:
    return "bf16"
  big = max(leaves, key=lambda x: getattr(x, "size", 0))
  name = str(getattr(big, "dtype", "bfloat16"))
  return {"int8": "int8", "float32": "f32"}.get(name, "bf16")
