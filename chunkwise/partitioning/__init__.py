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
from chunkwise.partitioning.plan import Plan
from chunkwise.partitioning.rules import resolve, resolve_tree

__all__ = [
  "AttnBatch",
  "Collectives",
  "Layout",
  "LayoutKind",
  "Plan",
  "axes",
  "initialize_multihost",
  "make_mesh",
  "parse_mesh",
  "resolve",
  "resolve_tree",
]
