"""`Collectives`: how sharded matmuls communicate (`Layout.collectives`)."""

from __future__ import annotations

import enum


class Collectives(enum.Enum):
  """How sharded matmuls communicate: XLA's own collectives, or collective
  matmuls around the ring (one-way, latency- or throughput-optimised)."""

  XLA = "xla"  # the naive twins; plain weights
  ONE_WAY = "one_way"  # one ring direction
  LATENCY = "latency"  # half the sequential hops, double-size matmuls
  THROUGHPUT = "throughput"  # both ring directions, half the bytes per link

  @property
  def shuffled(self) -> bool:
    """Whether its weights are reordered (and cut into pieces) per device."""
    return self is not Collectives.XLA

  @classmethod
  def of(cls, variant: Collectives | str) -> Collectives:
    """A member, or the member a lower-case name ("latency") names."""
    try:
      return cls(variant)
    except ValueError:
      names = ", ".join(repr(c.value) for c in cls)
      raise ValueError(
        f"unknown collective variant {variant!r}; one of {names}"
      ) from None
