"""LoRA adapters: many low-rank fine-tunes of one base model in one batch.

An `Adapter` holds, per layer and per target matrix, A [inputs..., r] and
B [r, outputs...] in the base weight's own axis order, with the scale
(alpha / r, or alpha / sqrt(r) for rsLoRA) folded into B: the adapted
weight is W + A @ B (`merged`). `stack` puts several adapters side by
side (ranks padded with zeros to the largest, n padded with zero
adapters to a power of two so one more adapter does not recompile): A
[inputs..., n, r] concatenated on r over the targets that read the same
input (`GROUPS`: q/k/v, gate/up), B [n, r, outputs...] per target; an
`AdapterBatch` pairs the stacks with each row's adapter (`ids`, -1 for
the base model).

The forward passes see a layer's stacks and the rows' ids as
`Layer.lora` (`attach`), and add to each targeted projection

  delta = ((x @ A[n]) masked to each row's own n) @ B[n]

computed for every adapter at once and masked, not gathered per row
(Punica's BGMV reads each row's weights; on CPU and for a few adapters
reading every adapter's small A and B once is cheaper than copying them
per row). A row of the base model gets an exact zero.

  `deltas(lora, group, x)`        a group's deltas, plain arrays
  `project` / `expand`            the halves, for sharded layers (x @ A
                                  is reduced over split inputs between)
Both matmuls go through `models.matmul.weight_matmul` (the CPU kernel at
decode sizes: A's inputs and B's n·r lead their arrays).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from chunkwise.configs import HParams
from chunkwise.models.matmul import weight_matmul
from chunkwise.partitioning import axes as ax

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")

# The base weight's logical axes split into inputs and outputs (the
# einsum of `transformer`: inputs are contracted).
_IO = {
  "q": ((ax.EMBED,), (ax.HEADS, ax.HEAD_DIM)),
  "k": ((ax.EMBED,), (ax.KV_HEADS, ax.HEAD_DIM)),
  "v": ((ax.EMBED,), (ax.KV_HEADS, ax.HEAD_DIM)),
  "o": ((ax.HEADS, ax.HEAD_DIM), (ax.EMBED,)),
  "gate": ((ax.EMBED,), (ax.MLP,)),
  "up": ((ax.EMBED,), (ax.MLP,)),
  "down": ((ax.MLP,), (ax.EMBED,)),
}


def shapes(hparams: HParams, name: str, rank: int):
  """(A shape, B shape) of target `name` at `rank`."""
  size = {
    ax.EMBED: hparams.d_model,
    ax.HEADS: hparams.heads,
    ax.KV_HEADS: hparams.kv_heads,
    ax.HEAD_DIM: hparams.head_dim,
    ax.MLP: hparams.d_ff,
  }
  ins, outs = _IO[name]
  return (
    (*(size[a] for a in ins), rank),
    (rank, *(size[a] for a in outs)),
  )


@dataclasses.dataclass(frozen=True, eq=False)
class Adapter:
  """One LoRA adapter (host arrays, f32), the scale folded into B.

  layers[i][name] = (A, B) for each target `name` of layer i (a layer
  may have none: `layers_to_transform`)."""

  rank: int
  layers: tuple[Mapping[str, tuple[np.ndarray, np.ndarray]], ...]
  targets: tuple[str, ...]
  source: str = ""  # where it was read from
  config: Mapping = dataclasses.field(default_factory=dict)

  def check(self, hparams: HParams) -> None:
    """Raises ValueError, naming the matrix, when the adapter does not fit
    a model of `hparams`."""
    if len(self.layers) != hparams.layers:
      raise ValueError(
        f"adapter {self.source or ''} has {len(self.layers)} layers; the "
        f"model has {hparams.layers}"
      )
    for i, layer in enumerate(self.layers):
      for name, (a, b) in layer.items():
        if name not in TARGETS:
          raise ValueError(
            f"adapter target {name!r} (layer {i}) is not one of {TARGETS}"
          )
        want = shapes(hparams, name, self.rank)
        if (tuple(a.shape), tuple(b.shape)) != want:
          raise ValueError(
            f"adapter {self.source or ''} layer {i} {name}: A {a.shape} "
            f"and B {b.shape}, expected {want[0]} and {want[1]} for this "
            f"model at rank {self.rank}"
          )

  @property
  def checksum(self) -> str:
    """SHA-256 (first 16 hex digits) of the rank, targets and arrays."""
    h = hashlib.sha256(f"{self.rank}:{','.join(self.targets)}".encode())
    for i, layer in enumerate(self.layers):
      for name in sorted(layer):
        a, b = layer[name]
        h.update(f"{i}.{name}".encode())
        h.update(np.ascontiguousarray(a, np.float32).tobytes())
        h.update(np.ascontiguousarray(b, np.float32).tobytes())
    return h.hexdigest()[:16]

  @property
  def nbytes(self) -> int:
    return sum(
      a.nbytes + b.nbytes for ly in self.layers for a, b in ly.values()
    )


def fit(adapter: Adapter, hparams: HParams) -> Adapter:
  """`adapter` in the layout of a model of `hparams`: each A and B
  reshaped to `shapes` (heads split from the flat [in, r] / [r, out] that
  `load_adapter` gives without hparams; a no-op on fitted arrays) and the
  layers padded with empty entries to the model's count.

  Raises:
    ValueError: the adapter has more layers than the model, or a matrix
      whose size does not fit (the message names it).
  """
  if len(adapter.layers) > hparams.layers:
    raise ValueError(
      f"adapter {adapter.source} has {len(adapter.layers)} layers; the "
      f"model has {hparams.layers}"
    )
  empty = ({},) * (hparams.layers - len(adapter.layers))
  layers = []
  for i, layer in enumerate((*adapter.layers, *empty)):
    fitted = {}
    for name, (a, b) in layer.items():
      if name not in TARGETS:
        raise ValueError(
          f"adapter target {name!r} (layer {i}) is not one of {TARGETS}"
        )
      want_a, want_b = shapes(hparams, name, adapter.rank)
      if (a.size, a.shape[-1], b.size, b.shape[0]) != (
        math.prod(want_a),
        adapter.rank,
        math.prod(want_b),
        adapter.rank,
      ):
        raise ValueError(
          f"adapter {adapter.source} layer {i} {name}: A {a.shape} and B "
          f"{b.shape} do not fit {want_a} and {want_b} (this model at "
          f"rank {adapter.rank})"
        )
      fitted[name] = (a.reshape(want_a), b.reshape(want_b))
    layers.append(fitted)
  out = dataclasses.replace(adapter, layers=tuple(layers))
  out.check(hparams)
  return out


def merged(weight: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """W + A @ B in W's axis order (A's last and B's first axis: the rank)."""
  return weight + np.tensordot(a, b, axes=([-1], [0])).astype(weight.dtype)


# Targets whose A read the same input, stacked side by side (one x @ A
# for the group; `a` is keyed by group, `b` by target).
GROUPS = {
  "qkv": ("q", "k", "v"),
  "gate_up": ("gate", "up"),
  "o": ("o",),
  "down": ("down",),
}
GROUP_OF = {t: g for g, ts in GROUPS.items() for t in ts}
# Each target's base projection (`transformer`'s einsums).
EQS = {
  "q": "bte,ehd->bthd",
  "k": "bte,ehd->bthd",
  "v": "bte,ehd->bthd",
  "o": "bthd,hde->bte",
  "gate": "bte,ef->btf",
  "up": "bte,ef->btf",
  "down": "btf,fe->bte",
}


@struct.dataclass
class LayerLoRA:
  """One layer's stacked adapters, as the forward pass reads them:
  a[group] [inputs..., n, r · targets in the group], b[target] [n, r,
  outputs...], ids int32[rows] (-1: the base model)."""

  a: dict
  b: dict
  ids: jax.Array | None = None
  targets: tuple = struct.field(pytree_node=False, default=())
  rank: int = struct.field(pytree_node=False, default=0)

  def members(self, group: str) -> tuple[str, ...]:
    return tuple(t for t in GROUPS[group] if t in self.targets)

  @staticmethod
  def axes(targets: Sequence[str], rank: int) -> LayerLoRA:
    """Logical specs (A split like its base weight's inputs, B like its
    outputs, the adapter and rank axes replicated; ids replicated)."""
    targets = tuple(targets)
    groups = {GROUP_OF[t] for t in targets}
    return LayerLoRA(
      a={
        g: P(*_IO[GROUPS[g][0]][0], ax.ADAPTERS, ax.RANK)
        for g in GROUPS
        if g in groups
      },
      b={t: P(ax.ADAPTERS, ax.RANK, *_IO[t][1]) for t in targets},
      ids=P(),
      targets=targets,
      rank=rank,
    )


@struct.dataclass
class AdapterBatch:
  """Every layer's stacks and the rows' adapters: what a call reads."""

  layers: tuple[LayerLoRA, ...]
  ids: jax.Array  # int32[rows]

  @staticmethod
  def axes(targets: Sequence[str], rank: int, layers: int) -> AdapterBatch:
    one = LayerLoRA.axes(targets, rank).replace(ids=None)
    return AdapterBatch(layers=(one,) * layers, ids=P())


@struct.dataclass
class Adapted:
  """Weights (plain or shuffled) and a call's `AdapterBatch`: what the
  engines pass as a program's weights when a call has adapters."""

  weights: object
  batch: AdapterBatch


def unwrap(weights):
  """(weights, AdapterBatch or None) of a program's weights argument."""
  if isinstance(weights, Adapted):
    return weights.weights, weights.batch
  return weights, None


def bucket(count: int) -> int:
  """Stacked adapters for `count` adapters: the next power of two."""
  return 1 << max(0, (count - 1).bit_length())


def stack(
  hparams: HParams, adapters: Sequence[Adapter], dtype=jnp.float32
) -> tuple[LayerLoRA, ...]:
  """Stacks per layer (see `LayerLoRA`) of `bucket(len(adapters))`
  adapters: the union of the adapters' targets, ranks padded with zeros
  to the largest, missing adapters and targets zero."""
  targets = tuple(t for t in TARGETS if any(t in a.targets for a in adapters))
  rank = max(a.rank for a in adapters)
  n = bucket(len(adapters))
  out = []
  for i in range(hparams.layers):
    a_parts, b_stacks = {}, {}
    for t in targets:
      sa, sb = shapes(hparams, t, rank)
      a_all = np.zeros((*sa[:-1], n, rank), np.float32)
      b_all = np.zeros((n, *sb), np.float32)
      for j, adapter in enumerate(adapters):
        if t in adapter.layers[i]:
          a, b = adapter.layers[i][t]
          a_all[..., j, : adapter.rank] = a
          b_all[j, : adapter.rank] = b
      a_parts.setdefault(GROUP_OF[t], []).append(a_all)
      b_stacks[t] = jnp.asarray(b_all, dtype)
    a_stacks = {
      g: jnp.asarray(np.concatenate(parts, axis=-1), dtype)
      for g, parts in a_parts.items()
    }
    out.append(LayerLoRA(a=a_stacks, b=b_stacks, targets=targets, rank=rank))
  return tuple(out)


def attach(weights, batch: AdapterBatch | None):
  """`weights` (a `Weights`) with each layer's `lora` set to its stacks
  and the rows' ids; unchanged without a batch."""
  if batch is None:
    return weights
  layers = tuple(
    layer.replace(lora=lo.replace(ids=batch.ids))
    for layer, lo in zip(weights.layers, batch.layers, strict=True)
  )
  return weights.replace(layers=layers)


def detach(weights):
  """`weights` with every layer's `lora` back to None."""
  if all(layer.lora is None for layer in weights.layers):
    return weights
  return weights.replace(
    layers=tuple(layer.replace(lora=None) for layer in weights.layers)
  )


def _split(eq: str):
  """'bte,ehd->bthd' -> ('bte', 'e', 'bt', 'hd', 'bthd')."""
  inputs, out = eq.split("->")
  x, w = inputs.split(",")
  contract = "".join(c for c in x if c in w)
  keep = "".join(c for c in x if c not in w)
  produce = "".join(c for c in w if c not in x)
  return x, contract, keep, produce, out


def project(lo: LayerLoRA | None, group: str, x: jax.Array):
  """x @ A of every adapter of `group` (x: the group's input, rows
  first): [rows, ..., n, r · members], or None without that group."""
  if lo is None or group not in lo.a:
    return None
  xs, contract, keep, _, _ = _split(EQS[GROUPS[group][0]])
  return weight_matmul(f"{xs},{contract}nr->{keep}nr", x, lo.a[group])


def masked(xa, ids: jax.Array):
  """`xa` ([rows, ..., n, r]) zero outside each row's own adapter (all of
  it for a row of the base model, id -1)."""
  if xa is None:
    return None
  n = xa.shape[-2]
  mask = (ids[:, None] == jnp.arange(n)[None, :]).astype(xa.dtype)
  return xa * mask.reshape(mask.shape[0], *(1,) * (xa.ndim - 3), n, 1)


def expand(lo: LayerLoRA, target: str, xa) -> jax.Array | None:
  """`target`'s delta from its group's `xa` (`project`, reduced where the
  input was split, then `masked`): its rank slice @ B."""
  if xa is None or target not in lo.b:
    return None
  i = lo.members(GROUP_OF[target]).index(target)
  xa = xa[..., i * lo.rank : (i + 1) * lo.rank]
  _, _, keep, produce, out = _split(EQS[target])
  return weight_matmul(f"{keep}nr,nr{produce}->{out}", xa, lo.b[target])


def deltas(lo: LayerLoRA | None, group: str, x: jax.Array) -> dict:
  """{target: delta} of every adapted target of `group` (plain arrays:
  one device, or this device's rows with the stacks whole)."""
  xa = masked(project(lo, group, x), None if lo is None else lo.ids)
  if xa is None:
    return {}
  return {t: expand(lo, t, xa) for t in lo.members(group)}


def add(y: jax.Array, d) -> jax.Array:
  return y if d is None else y + d.astype(y.dtype)
