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

The ring forms (one_way, latency, throughput) read one weight piece per
ring step, in an order that depends on the device, so their weights are
reordered once per device and cut into those pieces (`shuffle`, run by the
engine when it places the weights): a `Pieces` per fused weight, each
piece an array of its own that its step's matmul reads in place (DESIGN
§6: no slice of a weight per step). The weight-gathered layout's
throughput form sends each weight shard in halves: its weights are cut in
two once the same way. Such weights travel as `ShuffledWeights`, whose
`tag` names the layout kind, variant and mesh they fit; `unwrap` refuses
them anywhere else, and refuses plain weights where shuffled ones are
needed. `unshuffle` joins and reorders them back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from chunkwise import collectives
from chunkwise.collectives import ring as ring_ops
from chunkwise.collectives import streaming
from chunkwise.models.blocks import BlockArray
from chunkwise.models.quantized import is_grouped
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


def matmul(plan: Plan, name: str, x: jax.Array, w) -> jax.Array:
  """The fused matmul `name` (a `FUSED` entry) of one layer's weight `w`
  (an array, or `Pieces` for the ring forms): a float weight cast to the
  activations' dtype, a quantized one passed on as stored (each product
  of it `weight_matmul`'s, through `contract`)."""
  f = FUSED[plan.kind][name]
  variant = plan.collectives
  w = _as_read(w, x.dtype)
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


def _as_read(w, dtype):
  """A weight (or its Pieces) as the collective matmuls read it: floats
  cast to `dtype`, quantized ones as they are."""
  parts = w.parts if isinstance(w, Pieces) else None
  first = w if parts is None else parts[0]
  if not is_grouped(first):
    return w.astype(dtype)
  return w if parts is None else parts


def needs_shuffle(kind: LayoutKind, variant: Collectives) -> bool:
  if kind is LayoutKind.WG:
    return variant is Collectives.THROUGHPUT
  return kind in FUSED and variant.shuffled


# The weight-gathered layout's streamed matrices.
STREAMED = ("q", "k", "v", "o", "gate", "up", "down")


@struct.dataclass
class Pieces:
  """A weight (array or `QArray`) cut along `dim` into the pieces a
  collective matmul reads one per ring step. A QArray's scales are cut
  with their values, or, when `shared` (one scale along `dim`), repeated
  in every piece."""

  parts: tuple
  dim: int = struct.field(pytree_node=False)
  shared: bool = struct.field(pytree_node=False, default=False)

  def astype(self, dtype) -> tuple:
    """The pieces cast (int8 ones dequantized), as a tuple."""
    return tuple(p.astype(dtype) for p in self.parts)


def _scales(w) -> tuple[str, ...]:
  """The per-group fields of a QArray or BlockArray."""
  if isinstance(w, BlockArray) and w.offset is not None:
    return ("scale", "offset")
  return ("scale",)


def split(w, dim: int, count: int) -> Pieces:
  """`w` (array, QArray or BlockArray) cut into `count` pieces along
  `dim`."""
  if not is_grouped(w):
    return Pieces(ring_ops.split(w, dim, count), dim)
  fields = {"values": ring_ops.split(w.values, dim, count)}
  shared = w.scale.shape[dim] == 1
  for name in _scales(w):
    scale = getattr(w, name)
    if shared:
      fields[name] = (scale,) * count
    elif scale.shape[dim] % count:
      raise ValueError(
        f"cannot cut scales of shape {scale.shape} into {count} pieces "
        f"along dim {dim}: the pieces would split a group"
      )
    else:
      fields[name] = ring_ops.split(scale, dim, count)
  parts = tuple(
    w.replace(**{name: cut[i] for name, cut in fields.items()})
    for i in range(count)
  )
  return Pieces(parts, dim, shared)


def join(p: Pieces):
  """`split` undone."""
  first = p.parts[0]
  if not is_grouped(first):
    return ring_ops.join(p.parts, p.dim)
  fields = {"values": ring_ops.join(tuple(q.values for q in p.parts), p.dim)}
  for name in _scales(first):
    scales = tuple(getattr(q, name) for q in p.parts)
    fields[name] = scales[0] if p.shared else ring_ops.join(scales, p.dim)
  return first.replace(**fields)


@dataclasses.dataclass(frozen=True)
class ShuffleTag:
  """What shuffled weights fit: a layout kind, a collective variant and a
  mesh shape (`str`: "ws_2d/latency on mesh 2x2x2")."""

  kind: LayoutKind
  collectives: Collectives
  mesh: tuple[int, ...]

  def __str__(self) -> str:
    shape = "x".join(str(n) for n in self.mesh)
    return f"{self.kind.value}/{self.collectives.value} on mesh {shape}"


def tag(kind: LayoutKind, variant: Collectives, sizes) -> ShuffleTag:
  """The tag of weights shuffled for `kind` and `variant` on a mesh of
  `sizes` ((axis, size) pairs)."""
  return ShuffleTag(kind, Collectives.of(variant), tuple(n for _, n in sizes))


@struct.dataclass
class ShuffledWeights:
  """`Weights` whose blocks are reordered per device for one collective
  variant; only the layout its `tag` names can run them."""

  weights: Weights
  tag: ShuffleTag = struct.field(pytree_node=False)


@dataclasses.dataclass(frozen=True)
class _Reorder:
  """The block shuffle of one layer's fused weight, and the pieces it is
  then cut into."""

  fn: Callable[[jax.Array], jax.Array] | None  # None: order kept
  dim: int  # the scattered or gathered dim (the cut one)
  subdim: int | None  # the dim halved by the throughput form
  count: int  # pieces

  def inverse(self, w: jax.Array) -> jax.Array:
    """The shuffle undone: its transpose, since it is a permutation.
    Integer arrays (int8 values) go through f32, which holds them exactly."""
    w32 = w.astype(jnp.float32)
    (out,) = jax.linear_transpose(self.fn, w32)(w32)
    return out.astype(w.dtype)

  def reorder(self, w, *, inverse: bool = False):
    """The shuffle (or its inverse) of a weight, or of a `QArray`'s values
    and its scales (scales per group are reordered with the groups; a
    scale of size 1 on the reordered dim is the same for every block
    there and stays)."""
    if self.fn is None:
      return w
    fn = self.inverse if inverse else self.fn
    if not is_grouped(w):
      return fn(w)
    fields = {"values": fn(w.values)}
    for name in _scales(w):
      scale = getattr(w, name)
      if scale.shape[self.dim] > 1:
        if self.subdim is not None and scale.shape[self.subdim] == 1:
          # The two halves of subdim read dim's blocks in different orders.
          raise ValueError(
            f"cannot reorder scales of shape {scale.shape} along dim "
            f"{self.dim} when dim {self.subdim}, whose halves are reordered "
            "differently, has a single group"
          )
        fields[name] = fn(scale)
    return w.replace(**fields)

  def apply(self, w):
    """Reordered, then cut into pieces (kept whole for a single piece)."""
    w = self.reorder(w)
    return w if self.count == 1 else split(w, self.dim, self.count)


def _reorders(plan: Plan, layer=None) -> dict[str, _Reorder]:
  """The shuffle of each reordered weight of the plan's layout, by name
  (for the weight-gathered layout, of the shard shapes in `layer`, a
  `Layer` of arrays or shapes as each device holds them)."""
  variant = plan.collectives
  if plan.kind is LayoutKind.WG:
    out = {}
    for name in STREAMED:
      w = getattr(layer, name)
      dim = streaming.halving_dim(w.shape)
      out[name] = _Reorder(None, dim, None, 2)
    return out
  n = plan.size(ring(plan))
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
    out[name] = _Reorder(fn, dim, subdim, collectives.pieces(variant, n))
  return out


def shuffle(plan: Plan, weights: Weights) -> ShuffledWeights:
  """Per device: the weights' local blocks in the order the plan's
  collective matmuls read them, cut into their pieces."""

  def one(layer):
    reorders = _reorders(plan, layer)
    return layer.replace(
      **{name: r.apply(getattr(layer, name)) for name, r in reorders.items()}
    )

  return ShuffledWeights(
    weights=weights.replace(layers=tuple(one(w) for w in weights.layers)),
    tag=tag(plan.kind, plan.collectives, plan.sizes),
  )


def unshuffle(plan: Plan, weights: ShuffledWeights) -> Weights:
  """Per device: `shuffle` undone, the weights in plain order again (to
  save them, or to place them for another layout)."""
  weights = unwrap(plan, weights)

  def one(layer):
    plain = joined(layer)
    reorders = _reorders(plan, plain)
    return plain.replace(
      **{
        name: r.reorder(getattr(plain, name), inverse=True)
        for name, r in reorders.items()
      }
    )

  return weights.replace(layers=tuple(one(w) for w in weights.layers))


def joined(tree):
  """`tree` (weights, a layer, or their shapes) with every `Pieces`
  joined back into one array or QArray, in shuffled order."""
  return jax.tree.map(
    lambda x: join(x) if isinstance(x, Pieces) else x,
    tree,
    is_leaf=lambda x: isinstance(x, Pieces),
  )


def shuffled_specs(plan: Plan, specs: Weights, shapes: Weights) -> Weights:
  """Mesh `specs` of plain weights turned into those of their shuffled
  form: each reordered weight's spec repeated for its pieces (every piece
  is sharded like the weight). `shapes` are the plain weights (or their
  shapes), to find the shards' shapes."""
  sizes = dict(plan.sizes)

  def local(shape, spec):
    out = list(shape)
    for i, axes in enumerate(spec):
      for a in (
        () if axes is None else (axes,) if isinstance(axes, str) else axes
      ):
        out[i] //= sizes[a]
    return jax.ShapeDtypeStruct(tuple(out), jnp.float32)

  def one(layer_specs, layer):
    shards = layer.replace(
      **{
        name: local(
          getattr(layer, name).shape,
          _values(getattr(layer_specs, name)),
        )
        for name in STREAMED
      }
    )
    out = {}
    for name, r in _reorders(plan, shards).items():
      spec = getattr(layer_specs, name)
      if r.count == 1:
        continue
      shared = is_grouped(spec) and getattr(layer, name).scale.shape[r.dim] == 1
      out[name] = Pieces((spec,) * r.count, r.dim, shared)
    return layer_specs.replace(**out)

  return specs.replace(
    layers=tuple(
      one(sp, w) for sp, w in zip(specs.layers, shapes.layers, strict=True)
    )
  )


def _values(spec):
  return spec.values if is_grouped(spec) else spec


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
      f"weights {f'shuffled for {got}' if got else 'in plain order'} cannot "
      f"run layout {plan.kind.value}/{plan.collectives.value} on mesh "
      f"{'x'.join(str(n) for _, n in plan.sizes)}, which needs "
      f"{f'weights shuffled for {want}' if want else 'plain weights'}"
    )
  return weights.weights if got else weights
