"""LoRA adapters: many low-rank fine-tunes of one base model in one batch.

An `Adapter` holds, per layer and per target matrix, A [inputs..., r] and
B [r, outputs...] in the base weight's own axis order, with the scale
(alpha / r, or alpha / sqrt(r) for rsLoRA) folded into B: the adapted
weight is W + A @ B (`merged`). `stack` puts several adapters side by
side, [n, ...] per target (ranks padded with zeros to the largest, n
padded with zero adapters to a power of two so one more adapter does not
recompile), and an `AdapterBatch` pairs the stacks with each row's
adapter (`ids`, -1 for the base model).

The forward passes see a layer's stacks and the rows' ids as
`Layer.lora` (`attach`), and add to each targeted projection

  delta = ((x @ A[n]) masked to each row's own n) @ B[n]

computed for every adapter at once and masked, not gathered per row
(Punica's BGMV reads each row's weights; on CPU and for a few adapters
reading every adapter's small A and B once is cheaper than copying them
per row). A row of the base model gets an exact zero.

  `delta(eq, x, lora, name)`            one projection, plain arrays
  `project` / `expand`                  its two halves, for sharded layers
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


@struct.dataclass
class LayerLoRA:
  """One layer's stacked adapters, as the forward pass reads them."""

  a: dict  # target -> [n, inputs..., r]
  b: dict  # target -> [n, r, outputs...]
  ids: jax.Array | None = None  # int32[rows]: adapter of each row, -1 base

  @property
  def count(self) -> int:
    return next(iter(self.a.values())).shape[0]

  @staticmethod
  def axes(targets: Sequence[str]) -> LayerLoRA:
    """Logical specs (the stacks split like their base weight, the
    adapter and rank axes replicated; ids replicated)."""
    return LayerLoRA(
      a={t: P(ax.ADAPTERS, *_IO[t][0], ax.RANK) for t in targets},
      b={t: P(ax.ADAPTERS, ax.RANK, *_IO[t][1]) for t in targets},
      ids=P(),
    )


@struct.dataclass
class AdapterBatch:
  """Every layer's stacks and the rows' adapters: what a call reads."""

  layers: tuple[LayerLoRA, ...]
  ids: jax.Array  # int32[rows]

  @staticmethod
  def axes(targets: Sequence[str], layers: int) -> AdapterBatch:
    one = LayerLoRA.axes(targets).replace(ids=None)
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
  """Host stacks [bucket(len(adapters)), ...] per layer and target (the
  union of the adapters' targets; ranks padded to the largest)."""
  targets = tuple(t for t in TARGETS if any(t in a.targets for a in adapters))
  rank = max(a.rank for a in adapters)
  n = bucket(len(adapters))
  out = []
  for i in range(hparams.layers):
    a_stacks, b_stacks = {}, {}
    for t in targets:
      sa, sb = shapes(hparams, t, rank)
      a_all = np.zeros((n, *sa), np.float32)
      b_all = np.zeros((n, *sb), np.float32)
      for j, adapter in enumerate(adapters):
        if t in adapter.layers[i]:
          a, b = adapter.layers[i][t]
          a_all[j, ..., : adapter.rank] = a
          b_all[j, : adapter.rank] = b
      a_stacks[t] = jnp.asarray(a_all, dtype)
      b_stacks[t] = jnp.asarray(b_all, dtype)
    out.append(LayerLoRA(a=a_stacks, b=b_stacks))
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


def project(eq: str, x: jax.Array, a: jax.Array) -> jax.Array:
  """x @ A for every adapter: [keep..., n, r] (`eq` is the base
  projection's einsum)."""
  xs, contract, keep, _, _ = _split(eq)
  return jnp.einsum(f"{xs},n{contract}r->{keep}nr", x, a.astype(x.dtype))


def expand(eq: str, xa: jax.Array, b: jax.Array, ids: jax.Array) -> jax.Array:
  """(x @ A) masked to each row's adapter, @ B: the projection's delta
  (rows are the first axis of `xa`)."""
  _, _, keep, produce, out = _split(eq)
  n = xa.shape[-2]
  mask = (ids[:, None] == jnp.arange(n)[None, :]).astype(xa.dtype)
  mask = mask.reshape(mask.shape[0], *(1,) * (len(keep) - 1), n, 1)
  return jnp.einsum(
    f"{keep}nr,nr{produce}->{out}", xa * mask, b.astype(xa.dtype)
  )


def delta(eq: str, x: jax.Array, lora, name: str):
  """The adapters' delta to projection `name` (`eq`: its einsum), or None
  when the layer has no adapters or none targets it."""
  if lora is None or name not in lora.a:
    return None
  return expand(eq, project(eq, x, lora.a[name]), lora.b[name], lora.ids)


def add(y: jax.Array, d) -> jax.Array:
  return y if d is None else y + d.astype(y.dtype)
