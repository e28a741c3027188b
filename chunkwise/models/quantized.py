"""int8 weights: symmetric, one f32 scale per output channel.

A quantized weight is a `QArray` pytree in place of the array: int8
`values` of the weight's shape and f32 `scale`s of the same rank with
size 1 on the contracted (input) axes, so that

  w ≈ values * scale          (broadcast), |values| <= 127,
  scale = max |w| over the contracted axes / 127.

`QArray.astype(dtype)` dequantizes, so per-device code that casts a weight
to the activations' dtype before a matmul (`transformer._mm`,
`fused.matmul`, the streamed matmuls of `weight_gathered`) runs int8
weights unchanged, in every layout and collective variant: each device
dequantizes its own shard. Sharding follows the weight's logical axes:
`specs_like` gives the scale the weight's spec with the contracted axes
unsplit (they have size 1).

  qw = quantize_weights(weights)      # every matmul weight and the embedding
  specs = specs_like(Weights.axes(h), qw)
  nbytes(qw) / nbytes(weights)        # ≈ 0.25

Contracted axes per weight (`CONTRACTED`): embed for q, k, v, gate, up and
the (un)embedding tables (one scale per vocabulary row, which is also per
output channel when a tied table unembeds); heads and head_dim for o; mlp
for down. Norm scales and biases stay in float.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from chunkwise.partitioning import axes as ax

CONTRACTED = {
  "q": (ax.EMBED,),
  "k": (ax.EMBED,),
  "v": (ax.EMBED,),
  "gate": (ax.EMBED,),
  "up": (ax.EMBED,),
  "o": (ax.HEADS, ax.HEAD_DIM),
  "down": (ax.MLP,),
  "embedding": (ax.EMBED,),
  "unembedding": (ax.EMBED,),
}
TABLES = ("embedding", "unembedding")
SCHEMES = ("int8",)


@struct.dataclass
class QArray:
  """An int8 weight and its per-output-channel scales (see module doc)."""

  values: jax.Array  # int8, the weight's shape
  scale: jax.Array  # f32, the weight's shape with 1 on contracted axes

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.values.shape)

  @property
  def ndim(self) -> int:
    return len(self.values.shape)

  def astype(self, dtype) -> jax.Array:
    """The dequantized weight (computed in f32, then cast to `dtype`)."""
    out = self.values.astype(jnp.float32) * self.scale.astype(jnp.float32)
    return out.astype(dtype)


def quantize(w, axes: tuple[int, ...]) -> QArray:
  """Symmetric int8 of `w` with one scale per index of the axes not in
  `axes` (the contracted ones). All-zero channels get scale 1."""
  w32 = jnp.asarray(w, jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=axes, keepdims=True)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  values = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
  return QArray(values=values, scale=scale)


def key_name(key) -> str:
  """A pytree path entry as a plain string (attribute, dict key or
  sequence index: `layers[3].q` is named "layers.3.q")."""
  for attr in ("name", "key", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _name(path) -> str:
  return key_name(path[-1])


def contracted_dims(name: str, spec: P) -> tuple[int, ...]:
  """Positions of the contracted axes of weight `name` with logical `spec`."""
  return tuple(i for i, a in enumerate(spec) if a in CONTRACTED[name])


def quantize_weights(weights, specs, *, embedding: bool = True):
  """Every matmul weight of `weights` as a `QArray` (the embedding and
  unembedding tables too unless `embedding=False`); `specs` is
  `Weights.axes(hparams)`. Already quantized leaves are kept."""

  def one(path, spec, w):
    name = _name(path)
    if w is None or isinstance(w, QArray) or name not in CONTRACTED:
      return w
    if name in TABLES and not embedding:
      return w
    return quantize(w, contracted_dims(name, spec))

  return jax.tree_util.tree_map_with_path(
    one, specs, weights, is_leaf=lambda s: isinstance(s, P)
  )


def scale_spec(spec: P, name: str) -> P:
  """The logical spec of a `QArray.scale`: contracted axes unsplit."""
  return P(*(None if a in CONTRACTED[name] else a for a in spec))


def specs_like(specs, weights):
  """`specs` (PartitionSpec leaves, e.g. `Weights.axes(h)`) with a
  `QArray(values=spec, scale=scale_spec)` wherever `weights` holds a
  QArray, so the specs have the weights' tree structure."""

  def one(path, spec, w):
    if isinstance(w, QArray):
      return QArray(values=spec, scale=scale_spec(spec, _name(path)))
    return spec

  return jax.tree_util.tree_map_with_path(
    one,
    specs,
    weights,
    is_leaf=lambda s: isinstance(s, P),
  )


def shape_like(shape: tuple[int, ...], spec: P, name: str) -> tuple:
  """The scale's shape for a weight of `shape` and logical `spec`."""
  return tuple(
    1 if a in CONTRACTED[name] else n for a, n in zip(spec, shape, strict=True)
  )


def take_rows(table, ids: jax.Array) -> jax.Array:
  """Rows `ids` of an embedding table (a QArray dequantizes only those).
  Ids must already lie inside the table."""
  if isinstance(table, QArray):
    rows = jnp.take(table.values, ids, axis=0).astype(jnp.float32)
    return rows * jnp.take(table.scale, ids, axis=0)
  return jnp.take(table, ids, axis=0)


def is_quantized(weights) -> bool:
  return any(
    isinstance(x, QArray)
    for x in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QArray))
  )


def nbytes(tree) -> int:
  """Bytes held by the arrays of `tree` (int8 values and scales included)."""
  return sum(
    int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
  )
