"""`Plan`: which mesh axes split what, for one layout, model and call.

A layout fixes where the weights live; the batch of a call decides the rest
(a batch-1 prefix cannot be split over 4 devices). `Plan.make` validates the
layout against the model once, then chooses per call:

  resid_batch  axes splitting the residual stream's rows,
  attn_batch   axes splitting attention and the KV cache by rows (empty:
               attention is split by head),
taking axes from the layout's preference list greedily while the call's
batch, and every prefix's batch, stay compatible (b % n == 0: the prefix is
split too; n % b == 0: it is replicated and each device reads its row).

  plan = Plan.make(layout, mesh, hparams, batch=8, prefix_batches=(1, 2))
  plan.rules()            # logical name -> mesh axes, for this call
  plan.prefix_rules(1)    # the same for a batch-1 prefix (replicated rows)

Shapes in comments use the paper's notation: [batch.Z, time, embed.XY] is
split over z on batch and over x·y on embed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jax.sharding import Mesh

from chunkwise.configs import HParams
from chunkwise.partitioning import axes as ax
from chunkwise.partitioning import rules as rules_lib
from chunkwise.partitioning.layout import (
  AttnBatch,
  Collectives,
  Layout,
  LayoutKind,
)

XYZ = ("x", "y", "z")
YZX = ("y", "z", "x")


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static sharding decisions of one call (hashable: a jit static arg)."""

  kind: LayoutKind
  sizes: tuple[tuple[str, int], ...]  # (("x", nx), ("y", ny), ("z", nz))
  collectives: Collectives = Collectives.XLA  # how sharded matmuls talk
  batch: int = 1  # rows of the call
  prefix_batches: tuple[int, ...] = ()  # rows of each prefix, in order
  # Weights.
  embed_axes: tuple[str, ...] = ()
  head_axes: tuple[str, ...] = ()  # query heads, K/V heads if kv_axes, d_ff
  vocab_axes: tuple[str, ...] = ()  # embedding rows
  kv_axes: tuple[str, ...] = ()  # K/V heads of the weights; () replicated
  # Activations.
  q_axes: tuple[str, ...] = ()  # query heads after projection
  resid_batch: tuple[str, ...] = ()
  resid_embed: tuple[str, ...] = ()
  attn_batch: tuple[str, ...] = ()
  logits_batch: tuple[str, ...] = ()
  logits_vocab: tuple[str, ...] = ()

  def size(self, axes: Sequence[str]) -> int:
    sizes = dict(self.sizes)
    return math.prod(sizes[a] for a in axes)

  @property
  def cache_heads(self) -> tuple[str, ...]:
    """Axes splitting the KV cache's heads: the weights' K/V head axes when
    attention is split by head, else none (each device holds all heads of
    its rows)."""
    if self.attn_batch or self.kind is LayoutKind.WG:
      return ()
    return self.kv_axes

  def _rules(self, cache_batch, logits_batch) -> dict:
    return rules_lib.weight_rules(
      self.kind, kv_sharded=bool(self.kv_axes)
    ) | rules_lib.data_rules(
      logits_batch=logits_batch,
      logits_vocab=self.logits_vocab,
      cache_batch=cache_batch,
      cache_heads=self.cache_heads,
    )

  def rules(self) -> dict:
    """Rules for this call's own arrays (batch = the call's batch)."""
    return self._rules(self.attn_batch, self.logits_batch)

  def prefix_rules(self, batch: int) -> dict:
    """Rules for a prefix of `batch` rows: split like the call's rows when
    the batch divides, else replicated."""

    def fit(axes):
      return axes if batch % self.size(axes) == 0 else ()

    return self._rules(fit(self.attn_batch), fit(self.logits_batch))

  @classmethod
  def make(
    cls,
    layout: Layout,
    mesh: Mesh,
    hparams: HParams,
    *,
    batch: int,
    prefix_batches: Sequence[int] = (),
  ) -> Plan:
    """The plan of one call; `check` must have accepted the layout."""
    sizes = tuple((a, int(mesh.shape[a])) for a in XYZ)
    base = _weights(layout.kind, hparams, dict(sizes))
    prefix_batches = tuple(int(b) for b in prefix_batches)
    plan = cls(
      kind=layout.kind,
      sizes=sizes,
      collectives=layout.collectives,
      batch=int(batch),
      prefix_batches=prefix_batches,
      **base,
    )
    fits = _greedy(dict(sizes), batch, prefix_batches)
    if layout.kind in _RESIDUAL:
      embed, rows = _RESIDUAL[layout.kind]
      # Query heads and logits leave their matmuls partial over the embed
      # axes and are reduce-scattered over them: split over the weights'
      # head (vocab) axes, then the embed axes.
      plan = dataclasses.replace(
        plan,
        q_axes=plan.head_axes + plan.embed_axes,
        resid_batch=_greedy(dict(sizes), batch, ())(rows),
        resid_embed=embed,
        logits_vocab=plan.vocab_axes + plan.embed_axes,
      )
      return dataclasses.replace(
        plan, attn_batch=fits(_attn_candidates(plan, layout))
      )
    if layout.kind is LayoutKind.WG:
      rows = fits(XYZ)
      return dataclasses.replace(
        plan, resid_batch=rows, attn_batch=rows, logits_batch=rows
      )
    return plan


# Weight-stationary residual stream: (embed axes, preferred batch axes).
_RESIDUAL = {
  LayoutKind.WS_1D: (XYZ, ()),
  LayoutKind.WS_2D: (("x", "y"), ("z",)),
}


def _weights(kind: LayoutKind, hparams: HParams, sizes) -> dict:
  table = rules_lib.weight_rules(kind, kv_sharded=True)
  heads = table[ax.HEADS]
  n = math.prod(sizes[a] for a in heads)
  return dict(
    embed_axes=table[ax.EMBED],
    head_axes=heads,
    vocab_axes=table[ax.VOCAB],
    kv_axes=heads if hparams.kv_heads % n == 0 else (),
  )


def _attn_candidates(plan: Plan, layout: Layout) -> tuple[str, ...]:
  """The layout's attention batch axes; with none given, K/V heads that do
  not divide the head shards are split by batch instead (when it fits)."""
  if layout.attn_batch is not AttnBatch.NONE:
    return layout.attn_batch.axes
  if not plan.kv_axes and plan.size(plan.head_axes) > 1:
    return plan.q_axes
  return ()


def _greedy(sizes, batch: int, prefix_batches: Sequence[int]):
  """Returns f(candidates) -> the candidate axes (in order) that split
  `batch` and stay compatible with every prefix batch."""

  def pick(candidates):
    chosen: list[str] = []
    for a in candidates:
      if sizes[a] == 1:
        continue
      n = math.prod(sizes[c] for c in (*chosen, a))
      if batch % n == 0 and all(
        b % n == 0 or n % b == 0 for b in prefix_batches
      ):
        chosen.append(a)
    return tuple(chosen)

  return pick


def _requirements(kind: LayoutKind, h: HParams):
  """(dimension, size, axes) that must divide, per layout."""
  if kind is LayoutKind.WS_1D:
    return [
      ("heads", h.heads, XYZ),
      ("d_ff", h.d_ff, XYZ),
      ("vocab", h.vocab, XYZ),
      ("d_model", h.d_model, XYZ),
    ]
  if kind is LayoutKind.WS_2D:
    return [
      ("heads", h.heads, YZX),
      ("d_ff", h.d_ff, YZX),
      ("vocab", h.vocab, YZX),
      ("d_model", h.d_model, ("x", "y")),
    ]
  if kind is LayoutKind.WG:
    return [
      ("heads", h.heads, ("y", "z")),
      ("d_ff", h.d_ff, ("y", "z")),
      ("vocab", h.vocab, ("y", "z")),
      ("d_model", h.d_model, ("x",)),
    ]
  return []


def check(layout: Layout, mesh: Mesh, hparams: HParams) -> None:
  """Raises ValueError if the mesh does not divide a sharded dimension (the
  message names the dimension, its size, the layout and the mesh axes)."""
  if tuple(mesh.axis_names) != XYZ:
    raise ValueError(
      f"the mesh must have axes ('x', 'y', 'z'), got {mesh.axis_names}; "
      "use chunkwise.partitioning.make_mesh"
    )
  sizes = {a: int(mesh.shape[a]) for a in XYZ}
  shape = "x".join(str(sizes[a]) for a in XYZ)
  for dim, size, axes in _requirements(layout.kind, hparams):
    n = math.prod(sizes[a] for a in axes)
    if size % n:
      raise ValueError(
        f"layout {layout} on mesh {shape}: {dim} = {size} is not divisible "
        f"by mesh axes {'·'.join(axes)} (size {n})"
      )
  _check_collectives(layout, sizes, shape, hparams)
  if layout.kind in _RESIDUAL:
    table = rules_lib.weight_rules(layout.kind, kv_sharded=True)
    axes = table[ax.HEADS] + table[ax.EMBED]  # a device's query heads
    local = hparams.heads // math.prod(sizes[a] for a in axes)
    group = hparams.heads // hparams.kv_heads
    if local % group and group % local:
      raise ValueError(
        f"layout {layout} on mesh {shape}: each device holds {local} query "
        f"heads but {group} query heads share a K/V head (heads = "
        f"{hparams.heads}, kv_heads = {hparams.kv_heads}); one must divide "
        "the other"
      )


def _check_collectives(layout: Layout, sizes, shape: str, h: HParams) -> None:
  """The ring sizes and block halves the collective matmuls need (see
  `models.fused` for which matmuls each layout fuses)."""
  if layout.kind not in _RESIDUAL or layout.collectives in (
    Collectives.XLA,
    Collectives.ONE_WAY,
  ):
    return
  if layout.kind is LayoutKind.WS_2D:
    ring, blocks = ("x",), [("d_ff", h.d_ff, YZX)]
  else:
    ring, blocks = XYZ, [("d_model", h.d_model, XYZ)]
  n = math.prod(sizes[a] for a in ring)
  if n == 1:
    return
  if layout.collectives is Collectives.LATENCY and n % 2:
    raise ValueError(
      f"layout {layout} on mesh {shape}: the latency collectives pair the "
      f"blocks of the ring over {'·'.join(ring)}, which has odd size {n}; "
      "use one_way or throughput"
    )
  if layout.collectives is Collectives.THROUGHPUT:
    for dim, size, axes in blocks:
      m = size // math.prod(sizes[a] for a in axes)
      if m % 2:
        raise ValueError(
          f"layout {layout} on mesh {shape}: the throughput collectives "
          f"halve each device's block of {dim} ({size} / "
          f"{'·'.join(axes)} = {m}, odd); use one_way or latency"
        )
