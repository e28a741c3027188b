"""Logical axis names; layouts, rules and meshes build on them."""

from chunkwise.partitioning import axes

__all__ = ["axes"]
