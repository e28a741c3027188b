"""Logical axis names, layouts, rules, meshes and multi-host start-up."""

from chunkwise.partitioning import axes
from chunkwise.partitioning.layout import (
  AttnBatch,
  Collectives,
  Layout,
  LayoutKind,
)
from chunkwise.partitioning.mesh import (
  initialize_multihost,
  make_mesh,
  parse_mesh,
)
from chunkwise.partitioning.placement import (
  check_placement,
  put,
  shardings_for,
)
from chunkwise.partitioning.plan import Plan
from chunkwise.partitioning.rules import resolve, resolve_tree

__all__ = [
  "AttnBatch",
  "Collectives",
  "Layout",
  "LayoutKind",
  "Plan",
  "axes",
  "check_placement",
  "initialize_multihost",
  "make_mesh",
  "parse_mesh",
  "put",
  "resolve",
  "resolve_tree",
  "shardings_for",
]
