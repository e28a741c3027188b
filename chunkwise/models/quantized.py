"""int8 weights: symmetric, one f32 scale per group of input channels.

A quantized weight is a `QArray` pytree in place of the array: int8
`values` of the weight's shape and f32 `scale`s of the same rank, so that

  w ≈ values * scale          (each scale repeated over its group),
  scale = max |w| over the group / 127,   |values| <= 127.

A group is `group_size(n, axis)` consecutive entries of the weight's last
contracted (input) axis, of length n, for one index of every other axis:
36 of SmolLM2's 576 embedding inputs, 96 of its 1536 MLP inputs, half a
head (32 of head_dim's 64 inputs) for `o`; at most 128. The scale has
n / group entries on that axis and the weight's size on every other
(per-channel scales had 1 on every contracted axis). Groups divide n / 16
on axes that layouts shard, so any sharding over up to 8 devices, and the
collective matmuls' half blocks, cut whole groups: the scales are sharded
(and shuffled) like the values. An axis whose length 16 does not divide
keeps one group: a scale per output channel, the scheme of checkpoints
saved before groups (store version <= 2, `grouped=False`).

`QArray.astype(dtype)` dequantizes, so per-device code that casts a weight
to the activations' dtype before a matmul (`transformer._mm`,
`fused.matmul`, the streamed matmuls of `weight_gathered`) runs int8
weights unchanged, in every layout and collective variant: each device
dequantizes its own shard. `specs_like` gives the scale the weight's spec
with its size-1 axes unsplit.

  qw = quantize_weights(weights, Weights.axes(h))   # matmul weights, tables
  specs = specs_like(Weights.axes(h), qw)
  nbytes(qw) / nbytes(weights)        # ≈ 0.28 for SmolLM2

Contracted axes per weight (`CONTRACTED`, the grouped one last): embed for
q, k, v, gate, up and the (un)embedding tables (scales per vocabulary row
and group, which is also per output channel when a tied table unembeds);
heads and head_dim for o; mlp for down. Norm scales and biases stay float.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from chunkwise import numerics, tpu_kernels
from chunkwise.models import blocks
from chunkwise.models.blocks import BlockArray, expand
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


class Quantization(enum.Enum):
  """How matmul weights are stored: as loaded (NONE), symmetric int8
  with per-group scales (INT8), or a GGUF file's quantized blocks as they
  are (NATIVE: `models.blocks`)."""

  NONE = "none"
  INT8 = "int8"
  NATIVE = "native"

  @classmethod
  def of(cls, value) -> Quantization:
    """A member from a member, its name ("int8", "none") or None (NONE);
    ValueError naming anything else."""
    if value is None:
      return cls.NONE
    try:
      return cls(value)
    except ValueError:
      raise ValueError(
        f"quantize={value!r} is not supported; expected None, 'int8' or "
        "'native' (a GGUF file's blocks as they are)"
      ) from None


MAX_GROUP = 128
# Groups divide n / 16 along axes that layouts shard (8 shards, each cut in
# halves by the throughput matmuls); head_dim is never sharded, but the
# throughput matmuls halve it.
_SPLITS = {ax.HEAD_DIM: 2}
_DEFAULT_SPLITS = 16


def group_size(n: int, axis: str = ax.EMBED, *, grouped: bool = True) -> int:
  """Entries per scale along a grouped logical `axis` of length n: the
  largest divisor of n / 16 (n / 2 for head_dim) up to `MAX_GROUP`; n
  (one group) when that is not whole, or with `grouped=False`."""
  splits = _SPLITS.get(axis, _DEFAULT_SPLITS)
  if not grouped or n % splits:
    return n
  part = n // splits
  return max(d for d in range(1, MAX_GROUP + 1) if part % d == 0)


@struct.dataclass
class QArray:
  """An int8 weight and its per-group scales (see module doc)."""

  values: jax.Array  # int8, the weight's shape
  scale: jax.Array  # f32, the weight's shape divided by the group sizes

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.values.shape)

  @property
  def ndim(self) -> int:
    return len(self.values.shape)

  def astype(self, dtype) -> jax.Array:
    """The dequantized weight (computed in f32, then cast to `dtype`)."""
    scale = expand(self.scale.astype(jnp.float32), self.shape)
    out = self.values.astype(jnp.float32) * scale
    return out.astype(dtype)


def quantize(w, axes: tuple[int, ...], group: int | None = None) -> QArray:
  """Symmetric int8 of `w`. With a `group` size: one scale per `group`
  entries of the last of the contracted `axes` and per index of every
  other axis; without: one scale per index of the axes not in `axes` (per
  output channel). All-zero groups get scale 1."""
  w32 = jnp.asarray(w, jnp.float32)
  if group is None:
    amax = jnp.max(jnp.abs(w32), axis=axes, keepdims=True)
  else:
    last = axes[-1]
    n = w32.shape[last]
    if n % group:
      raise ValueError(f"group size {group} does not divide axis {last} of {n}")
    split = (*w32.shape[:last], n // group, group, *w32.shape[last + 1 :])
    amax = jnp.max(jnp.abs(w32.reshape(split)), axis=last + 1)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  values = jnp.round(w32 / expand(scale, w32.shape))
  values = jnp.clip(values, -127, 127).astype(jnp.int8)
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
  """Positions of the contracted axes of weight `name` with logical
  `spec`, in `CONTRACTED` order (the grouped axis last)."""
  return tuple(tuple(spec).index(a) for a in CONTRACTED[name] if a in spec)


def quantize_weights(
  weights, specs, *, embedding: bool = True, grouped: bool = True
):
  """Every matmul weight of `weights` as a `QArray` (the embedding and
  unembedding tables too unless `embedding=False`); `specs` is
  `Weights.axes(hparams)`. Already quantized leaves are kept. With
  `grouped=False`, one scale per output channel (store version <= 2)."""

  def one(path, spec, w):
    name = _name(path)
    if w is None or isinstance(w, QArray) or name not in CONTRACTED:
      return w
    if name in TABLES and not embedding:
      return w
    dims = contracted_dims(name, spec)
    if not grouped:
      return quantize(w, dims)
    group = group_size(w.shape[dims[-1]], CONTRACTED[name][-1])
    return quantize(w, dims, group)

  return jax.tree_util.tree_map_with_path(
    one, specs, weights, is_leaf=lambda s: isinstance(s, P)
  )


def scale_spec(
  spec: P, name: str, scale_shape: tuple[int, ...], shape: tuple[int, ...]
) -> P:
  """The logical spec of a `QArray.scale` (or a BlockArray's scale and
  offset) of `scale_shape`, for a weight of `shape`: the weight's, with
  axes where one scale serves several entries (one group, or contracted
  per-channel axes) unsplit; groups are sharded like the inputs they
  scale. Shapes may be a shard's: an axis a shard holds one entry of
  keeps its split."""
  full = (*spec, *(None,) * (len(scale_shape) - len(spec)))
  pairs = zip(full, scale_shape, shape, strict=True)
  return P(*(None if n == 1 and m > 1 else a for a, n, m in pairs))


def specs_like(specs, weights):
  """`specs` (PartitionSpec leaves, e.g. `Weights.axes(h)`) with a
  `QArray(values=spec, scale=scale_spec)` wherever `weights` holds a
  QArray, so the specs have the weights' tree structure."""

  def one(path, spec, w):
    if isinstance(w, QArray):
      return QArray(
        values=spec,
        scale=scale_spec(spec, _name(path), w.scale.shape, w.shape),
      )
    if isinstance(w, BlockArray):
      per_block = scale_spec(spec, _name(path), w.scale.shape, w.shape)
      return w.replace(
        values=spec,
        scale=per_block,
        offset=None if w.offset is None else per_block,
      )
    return spec

  return jax.tree_util.tree_map_with_path(
    one,
    specs,
    weights,
    is_leaf=lambda s: isinstance(s, P),
  )


def shape_like(
  shape: tuple[int, ...], spec: P, name: str, *, grouped: bool = True
) -> tuple:
  """The scale's shape for a weight of `shape` and logical `spec`."""
  last = CONTRACTED[name][-1]

  def one(a, n):
    if a == last:
      return n // group_size(n, a, grouped=grouped)
    return 1 if a in CONTRACTED[name] and not grouped else n

  return tuple(one(a, n) for a, n in zip(spec, shape, strict=True))


def _take(a: jax.Array, ids: jax.Array) -> jax.Array:
  """Rows `ids` of a quantized table's field: on a TPU, an 8- or 16-bit
  2-D field by `tpu_kernels.take_rows` (read in its stored tiling; XLA's
  gather copied the whole field first), else `jnp.take`."""
  plain = lambda a, ids: jnp.take(a, ids, axis=0)
  if a.ndim != 2 or a.dtype.itemsize > 2:
    return plain(a, ids)
  if not numerics.may_run("tpu"):  # a CPU engine's program
    return plain(a, ids)
  return jax.lax.platform_dependent(
    a, ids, default=plain, tpu=lambda a, ids: tpu_kernels.take_rows(a, ids)
  )


def take_rows(table, ids: jax.Array) -> jax.Array:
  """Rows `ids` of an embedding table (a QArray or BlockArray
  dequantizes only those). Ids must already lie inside the table."""
  if isinstance(table, BlockArray):
    return blocks.take_rows(table, ids, take=_take)
  if isinstance(table, QArray):
    rows = _take(table.values, ids).astype(jnp.float32)
    scale = jnp.take(table.scale, ids, axis=0)
    return rows * expand(scale, rows.shape)
  return jnp.take(table, ids, axis=0)


def is_grouped(x) -> bool:
  """An int8 `QArray` or a `BlockArray`: a leaf of values and scales."""
  return isinstance(x, (QArray, BlockArray))


def is_quantized(weights) -> bool:
  return any(
    isinstance(x, QArray) for x in jax.tree.leaves(weights, is_leaf=is_grouped)
  )


def is_blocked(weights) -> bool:
  """Whether any leaf of `weights` is a `BlockArray` (GGUF blocks)."""
  return any(
    isinstance(x, BlockArray)
    for x in jax.tree.leaves(weights, is_leaf=is_grouped)
  )


def nbytes(tree) -> int:
  """Bytes held by the arrays of `tree` (int8 values and scales, blocks'
  codes, scales and offsets included)."""
  return sum(
    int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
  )
