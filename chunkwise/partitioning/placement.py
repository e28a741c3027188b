"""Placement: where arrays live on a mesh, and putting them there.

  shardings = shardings_for(Weights.axes(hparams), layout, mesh, hparams)
  weights = jax.tree.map(put, weights, shardings)

`shardings_for` resolves a tree of logical `PartitionSpec`s (e.g. the
weights' axes) to `NamedSharding`s under a layout's rules: where a
checkpoint is restored into, and where an engine places its weights. `put`
places one value with one sharding, from the host or from another sharding.
`check_placement` validates a mesh and the layouts of both phases before
anything is placed.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental.layout import Format
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from chunkwise.configs import HParams
from chunkwise.partitioning.layout import Layout, LayoutKind
from chunkwise.partitioning.plan import Plan, check
from chunkwise.partitioning.rules import resolve_tree


def named(mesh: Mesh, specs):
  """A tree of mesh `PartitionSpec`s as `NamedSharding`s on `mesh`."""
  return jax.tree.map(
    lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)
  )


def shardings_for(
  axes, layout: Layout, mesh: Mesh, hparams: HParams, *, batch: int = 1
):
  """The `NamedSharding`s that `layout` on `mesh` gives arrays whose logical
  axes are `axes` (a tree of `PartitionSpec`s of logical names), for a call
  of `batch` rows (weights do not depend on it)."""
  plan = Plan.make(layout, mesh, hparams, batch=batch)
  return named(mesh, resolve_tree(axes, plan.rules()))


def put(x, sharding: NamedSharding | Format) -> jax.Array:
  """Places `x` with `sharding` (or a `Format`: a layout and sharding),
  from the host or from another sharding (also across processes: host
  values must be equal on every process)."""
  where = sharding.sharding if isinstance(sharding, Format) else sharding
  if isinstance(x, jax.Array) and (
    not x.is_fully_addressable or where.is_fully_addressable
  ):
    return jax.device_put(x, sharding)
  host = np.asarray(x)
  return jax.make_array_from_callback(
    host.shape, sharding, lambda index: host[index]
  )


def check_placement(
  mesh,
  layout=None,
  prefill_layout=None,
  generate_layout=None,
  hparams: HParams | None = None,
):
  """Validates a mesh and layouts; returns (prefill layout, generate layout).

  `layout` sets both phases; `prefill_layout` / `generate_layout` override
  it per phase. Layouts may be `Layout`s or strings ("ws_2d/yz"). Without a
  mesh only the reference layout runs. With `hparams`, the mesh must divide
  every dimension each layout shards.
  """
  base = Layout() if layout is None else Layout.parse(layout)
  phases = tuple(
    base if given is None else Layout.parse(given)
    for given in (prefill_layout, generate_layout)
  )
  if mesh is not None and not isinstance(mesh, Mesh):
    raise ValueError(
      f"mesh must be a jax.sharding.Mesh (see chunkwise.partitioning."
      f"make_mesh), got {mesh!r}"
    )
  for phase, lay in zip(("prefill", "generate"), phases, strict=True):
    if lay.kind is LayoutKind.REFERENCE:
      continue
    if mesh is None:
      raise ValueError(
        f"{phase} layout {lay} shards the model and needs a mesh; pass "
        "mesh=chunkwise.partitioning.make_mesh(...)"
      )
    if hparams is not None:
      check(lay, mesh, hparams)
  return phases
