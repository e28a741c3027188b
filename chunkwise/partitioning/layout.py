"""`Layout`: how a model is spread over the mesh axes `x`, `y`, `z`.

  Layout.parse("ws_2d/yz")          # kind / attention batch / collectives
  Layout.parse("wg")                # defaults: attention batch none, xla
  str(Layout.parse("ws_1d"))        # "ws_1d/none/xla"

Kinds (Pope et al., 2023, §3.2):
  reference  weights and activations replicated: the correctness oracle.
  ws_1d      weight-stationary 1D: heads and d_ff over x·y·z, embed whole.
  ws_2d      weight-stationary 2D: heads and d_ff over y·z, embed over x.
  wg         weight-gathered: weights stored as in ws_2d and all-gathered
             layer by layer; the batch is split over every axis.
The attention batch (ws_1d / ws_2d) names the mesh axes over which
attention, and the KV cache, are split by batch instead of by head: with
few K/V heads, head sharding would replicate the cache on every device.
"""

from __future__ import annotations

import dataclasses
import enum

from chunkwise.collectives import Collectives


class LayoutKind(enum.Enum):
  REFERENCE = "reference"
  WS_1D = "ws_1d"
  WS_2D = "ws_2d"
  WG = "wg"


class AttnBatch(enum.Enum):
  """Mesh axes that split attention by batch rows (major to minor)."""

  NONE = "none"
  Z = "z"
  YZ = "yz"
  YZX = "yzx"

  @property
  def axes(self) -> tuple[str, ...]:
    return () if self is AttnBatch.NONE else tuple(self.value)


def _choices(enum_type) -> str:
  return ", ".join(e.value for e in enum_type)


@dataclasses.dataclass(frozen=True)
class Layout:
  """A validated layout; see the module docstring."""

  kind: LayoutKind = LayoutKind.REFERENCE
  attn_batch: AttnBatch = AttnBatch.NONE
  collectives: Collectives = Collectives.XLA

  def __post_init__(self):
    for name, enum_type in (
      ("kind", LayoutKind),
      ("attn_batch", AttnBatch),
      ("collectives", Collectives),
    ):
      if not isinstance(getattr(self, name), enum_type):
        raise ValueError(
          f"Layout.{name} must be a {enum_type.__name__}, got "
          f"{getattr(self, name)!r}"
        )
    if self.attn_batch is not AttnBatch.NONE and self.kind in (
      LayoutKind.REFERENCE,
      LayoutKind.WG,
    ):
      raise ValueError(
        f"attention batch {self.attn_batch.value!r} applies to ws_1d and "
        f"ws_2d only; {self.kind.value} "
        + (
          "shards nothing"
          if self.kind is LayoutKind.REFERENCE
          else "already splits attention by batch over every axis"
        )
      )
    if (
      self.kind is LayoutKind.REFERENCE
      and self.collectives is not Collectives.XLA
    ):
      raise ValueError(
        f"collectives {self.collectives.value!r} need a sharded layout; the "
        "reference layout has no collectives"
      )

  @classmethod
  def parse(cls, text: str | Layout) -> Layout:
    """Parses `kind[/attn_batch[/collectives]]`, e.g. "ws_2d/yz/latency"."""
    if isinstance(text, Layout):
      return text
    if not isinstance(text, str):
      raise ValueError(f"a layout must be a string, got {text!r}")
    parts = text.strip().lower().split("/")
    if not 1 <= len(parts) <= 3 or not all(parts):
      raise ValueError(
        f"layout {text!r} must look like kind[/attn_batch[/collectives]], "
        "e.g. 'ws_2d/yz/latency'"
      )
    fields = []
    for part, enum_type, what in zip(
      parts,
      (LayoutKind, AttnBatch, Collectives),
      ("kind", "attention batch", "collectives"),
      strict=False,
    ):
      try:
        fields.append(enum_type(part))
      except ValueError:
        raise ValueError(
          f"layout {text!r}: unknown {what} {part!r}; expected one of "
          f"{_choices(enum_type)}"
        ) from None
    return cls(*fields)

  def __str__(self) -> str:
    return f"{self.kind.value}/{self.attn_batch.value}/{self.collectives.value}"
