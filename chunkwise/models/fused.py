"""Collective matmuls in the weight-stationary layouts, and the weight
shuffles their latency and throughput forms need.

`Plan.collectives` picks the variant (`collectives.VARIANTS`); "xla" runs
the naive twins, so every variant goes through the same calls. Fused
matmuls, by layout (ring: the mesh axes the collective runs around):

  ws_2d, ring x (the weights' embed axes)
    q          xn [B, T, E.X] @ q [E.X, H.YZ, D]   reduce-scatter on heads
    gate, up   xn [B, T, E.X] @ [E.X, F.YZ]        reduce-scatter on d_ff
    o          all-gather heads [B, T, H.YZX, D], @ o [H.YZ, D, E.X]
    down       all-gather d_ff [B, T, F.YZX], @ down [F.YZ, E.X]
  ws_1d, ring x·y·z (the residual's embed axes)
    o, down    @ [H.XYZ, D, E] / [F.XYZ, E]        reduce-scatter on embed

Left to XLA: ws_1d's norm all-gather (one gather feeds five matmuls), the
K/V projections' psum over x in ws_2d (K/V heads are not split over x),
and the residual's reduce-scatters over y (embed) and z (batch) in ws_2d.
The weight-gathered layout streams weights instead (`weight_gathered`).

The latency and throughput forms read weight block s at ring step s, so
their weights are reordered once per device (`shuffle`, run by the engine
when it places the weights). Reordered weights travel as `ShuffledWeights`,
whose `tag` names the layout kind, variant and mesh they fit; `unwrap`
refuses them anywhere else, and refuses plain weights where shuffled ones
are needed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from chunkwise import collectives
from chunkwise.models.quantized import QArray
from chunkwise.models.weights import Weights
from chunkwise.partitioning.layout import Collectives, LayoutKind
from chunkwise.partitioning.plan import Plan


@dataclasses.dataclass(frozen=True)
class _Fused:
  op: str  # "reduce_scatter" or "all_gather"
  eq: str  # per layer: x, weight -> out
  letter: str  # the scattered or gathered letter
  subsplit: str | None = None  # throughput halves; None: of each block


_RS, _AG = "reduce_scatter", "all_gather"
FUSED = {
  LayoutKind.WS_2D: {
    "q": _Fused(_RS, "bte,ehd->bthd", "h", "d"),
    "gate": _Fused(_RS, "bte,ef->btf", "f"),
    "up": _Fused(_RS, "bte,ef->btf", "f"),
    "o": _Fused(_AG, "bthd,hde->bte", "h", "d"),
    "down": _Fused(_AG, "btf,fe->bte", "f"),
  },
  LayoutKind.WS_1D: {
    "o": _Fused(_RS, "bthd,hde->bte", "e"),
    "down": _Fused(_RS, "btf,fe->bte", "e"),
  },
}


def ring(plan: Plan) -> tuple[str, ...]:
  """The mesh axes the layout's collective matmuls run around."""
  if plan.kind is LayoutKind.WS_2D:
    return plan.embed_axes
  return tuple(a for a in plan.resid_embed if a not in plan.embed_axes)


def scatters_embed(plan: Plan) -> bool:
  """Whether the layers' output matmuls leave embed already scattered."""
  return plan.kind is LayoutKind.WS_1D


def matmul(plan: Plan, name: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """The fused matmul `name` (a `FUSED` entry) of one layer's weight `w`,
  with `w` cast to the activations' dtype."""
  f = FUSED[plan.kind][name]
  variant = plan.collectives.value
  w = w.astype(x.dtype)
  if f.op == _RS:
    return collectives.matmul_reducescatter(
      variant,
      f.eq,
      x,
      w,
      axes=ring(plan),
      scatter=f.letter,
      subsplit=f.subsplit,
    )
  return collectives.allgather_matmul(
    variant, f.eq, x, w, axes=ring(plan), gather=f.letter, subsplit=f.subsplit
  )


def needs_shuffle(kind: LayoutKind, variant: Collectives) -> bool:
  return kind in FUSED and variant.value in collectives.SHUFFLED


def tag(kind: LayoutKind, variant: Collectives, sizes) -> str:
  """What shuffled weights fit: layout kind, variant and mesh shape."""
  shape = "x".join(str(n) for _, n in sizes)
  return f"{kind.value}/{variant.value} on mesh {shape}"


@struct.dataclass
class ShuffledWeights:
  """`Weights` whose blocks are reordered per device for one collective
  variant; only the layout named by `tag` can run them."""

  weights: Weights
  tag: str = struct.field(pytree_node=False)


@dataclasses.dataclass(frozen=True)
class _Reorder:
  """The block shuffle of one layer's fused weight."""

  fn: Callable[[jax.Array], jax.Array]
  dim: int  # the scattered or gathered dim
  subdim: int | None  # the dim halved by the throughput form

  def inverse(self, w: jax.Array) -> jax.Array:
    """The shuffle undone: its transpose, since it is a permutation.
    Integer arrays (int8 values) go through f32, which holds them exactly."""
    w32 = w.astype(jnp.float32)
    (out,) = jax.linear_transpose(self.fn, w32)(w32)
    return out.astype(w.dtype)

  def apply(self, w, *, inverse: bool = False):
    """The shuffle (or its inverse) of a weight, or of a `QArray`'s values
    and its scales (scales per group are reordered with the groups; a
    scale of size 1 on the reordered dim is the same for every block
    there and stays)."""
    fn = self.inverse if inverse else self.fn
    if not isinstance(w, QArray):
      return fn(w)
    scale = w.scale
    if scale.shape[self.dim] > 1:
      if self.subdim is not None and scale.shape[self.subdim] == 1:
        # The two halves of subdim read dim's blocks in different orders.
        raise ValueError(
          f"cannot reorder scales of shape {scale.shape} along dim "
          f"{self.dim} when dim {self.subdim}, whose halves are reordered "
          "differently, has a single group"
        )
      scale = fn(scale)
    return QArray(values=fn(w.values), scale=scale)


def _reorders(plan: Plan) -> dict[str, _Reorder]:
  """The shuffle of each fused weight of the plan's layout, by name."""
  variant = plan.collectives.value
  out = {}
  for name, f in FUSED[plan.kind].items():
    rletters = f.eq.split(",")[1].split("->")[0]
    shuffle_fn = (
      collectives.shuffle_for_reducescatter
      if f.op == _RS
      else collectives.shuffle_for_allgather
    )
    dim = rletters.index(f.letter)
    subdim = None if f.subsplit is None else rletters.index(f.subsplit)
    fn = functools.partial(
      shuffle_fn, variant, axes=ring(plan), dim=dim, subdim=subdim
    )
    out[name] = _Reorder(fn, dim, subdim)
  return out


def shuffle(plan: Plan, weights: Weights) -> ShuffledWeights:
  """Per device: the weights' local blocks in the order the plan's
  collective matmuls read them."""
  return ShuffledWeights(
    weights=_reorder(plan, weights, inverse=False),
    tag=tag(plan.kind, plan.collectives, plan.sizes),
  )


def unshuffle(plan: Plan, weights: ShuffledWeights) -> Weights:
  """Per device: `shuffle` undone, the weights in plain order again (to
  save them, or to place them for another layout)."""
  return _reorder(plan, unwrap(plan, weights), inverse=True)


def _reorder(plan: Plan, weights: Weights, *, inverse: bool) -> Weights:
  reorders = _reorders(plan)

  def one(layer):
    return layer.replace(
      **{
        name: r.apply(getattr(layer, name), inverse=inverse)
        for name, r in reorders.items()
      }
    )

  return weights.replace(layers=tuple(one(w) for w in weights.layers))


def unwrap(plan: Plan, weights) -> Weights:
  """The weights to compute with under `plan`; raises ValueError when
  shuffled weights meet another layout, or plain ones a shuffling one."""
  want = (
    tag(plan.kind, plan.collectives, plan.sizes)
    if needs_shuffle(plan.kind, plan.collectives)
    else None
  )
  got = weights.tag if isinstance(weights, ShuffledWeights) else None
  if want != got:
    raise ValueError(
      f"weights {'shuffled for ' + got if got else 'in plain order'} cannot "
      f"run layout {plan.kind.value}/{plan.collectives.value} on mesh "
      f"{'x'.join(str(n) for _, n in plan.sizes)}, which needs "
      f"{'weights shuffled for ' + want if want else 'plain weights'}"
    )
  return weights.weights if got else weights
