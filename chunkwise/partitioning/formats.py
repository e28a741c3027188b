"""Formats: the order a platform stores an array's elements in, where it is
not the array's own (row-major) order. The array and every value read
from it are the same; only its bytes in memory move.

  shardings = formats.shardings(mesh, specs, logical, platform, kv_heads)

gives each leaf its `NamedSharding`, or a `Format` (layout and sharding)
where `platform` stores the leaf (known by its logical axes and its field
name) in another order. An engine places its inputs and declares its
programs' outputs with them (`MeshPrograms`); `jax.jit` compiles a
program for the layouts its arguments have.

On a TPU the K/V caches are stored as XLA:TPU's attention reads and the
decode loop writes them:
  `KVCache.k` [layers, batch, time, kv_heads, head_dim]
      stored [layers, batch, kv_heads, head_dim, time]: each head's keys
      are the [head_dim, time] matrix its queries' logits multiply;
  `KVCache.v` stored [layers, batch, kv_heads, time, head_dim];
  a decode loop's buffers (`LayerKV`, [batch, kv_heads, time, head_dim])
      stored [batch, time, kv_heads, head_dim] where a device holds
      several heads: a step writes one time slot of every head, a tile
      of XLA:TPU's.
Where a generate loop's buffers fit in VMEM (a short generate's),
XLA:TPU keeps them there through the loop, copied in heads-major once a
call: 0.004% of the call's estimated time in `tests/test_tpu_compile.py`
(1024 columns, `compile_depth`'s `kv_staged`); a slot loop's, as long as
the context, stay in HBM and are read in place.
Quantized weights' codes are stored row-major on a TPU (`weights`), the
order the Pallas kernel reads; XLA:TPU's own choice for some shapes was
another, which every call copied back.
In the row-major order XLA:TPU copied every prefix cache into its order
at each call (a K/V-sized temporary: 294 MiB at 2 layers, 32k columns,
`tests/test_tpu_compile.py`'s model), and the decode loop's buffers in
and out of the loop. Elsewhere (the CPU) arrays keep the row-major
order, which its attention reads in place.
"""

from __future__ import annotations

import jax
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from chunkwise.partitioning import axes as ax

# Platforms whose programs store K/V in the orders above (tests add "cpu"
# to run the same placements and programs on this machine).
STORING = {"tpu"}

_TIME_MAJOR = (ax.CACHE_TIME, ax.CACHE_HEADS, ax.HEAD_DIM)
_HEADS_MAJOR = (ax.CACHE_HEADS, ax.CACHE_TIME, ax.HEAD_DIM)


def stored_order(
  name: str | None, logical: P, platform: str, local_heads: int = 1
) -> tuple[int, ...] | None:
  """The order (major to minor) `platform` stores an array in, given its
  field `name` ("k", "v"), its `logical` axes and the K/V heads each
  device holds; None: row-major."""
  if platform not in STORING or name not in ("k", "v"):
    return None
  names = tuple(logical)
  n = len(names)
  lead = tuple(range(n - 3))
  if names[-3:] == _TIME_MAJOR:  # a KVCache's
    time, heads, dim = n - 3, n - 2, n - 1
    return lead + ((heads, dim, time) if name == "k" else (heads, time, dim))
  if names[-3:] == _HEADS_MAJOR and local_heads > 1:
    # A LayerKV's, (heads, time) swapped; one head per device is already
    # time-major, and a tile of (1, head_dim) rows would be half padding.
    return (*lead, n - 2, n - 3, n - 1)
  return None


def _field(path) -> str | None:
  """The name of the innermost dataclass field on a tree path."""
  return next(
    (k.name for k in reversed(path) if isinstance(k, jax.tree_util.GetAttrKey)),
    None,
  )


def shardings(mesh, specs, logical, platform: str, kv_heads: int):
  """Per leaf of mesh `specs` (resolved from the tree of `logical` specs,
  which names its fields), its `NamedSharding` on `mesh`, or a `Format`
  where `platform` stores it in another order (`stored_order`; the model
  has `kv_heads` K/V heads)."""

  def one(path, spec: P, axes: P):
    sharding = NamedSharding(mesh, spec)
    heads = kv_heads
    if ax.CACHE_HEADS in tuple(axes):
      split = spec[tuple(axes).index(ax.CACHE_HEADS)] or ()
      for a in (split,) if isinstance(split, str) else split:
        heads //= mesh.shape[a]
    order = stored_order(_field(path), axes, platform, heads)
    if order is None:
      return sharding
    return Format(Layout(major_to_minor=order), sharding)

  return jax.tree_util.tree_map_with_path(
    one, specs, logical, is_leaf=lambda s: isinstance(s, P)
  )


def weights(mesh, specs, shapes, platform: str):
  """Per leaf of the weights' mesh `specs` (`shapes`: the weights, or
  their shapes), its `NamedSharding` on `mesh`, or on a TPU a `Format`
  storing quantized codes (an int8 `QArray`'s or a GGUF `BlockArray`'s
  `values`) row-major, as the Pallas kernel reads them, where XLA:TPU
  would choose another order: a shard [K, N] whose N 128 does not divide
  (it went n-major), and one [K, H, D] of a few heads (head-major).
  Each call copied those back (Llama-3.1-8B int8 decode on v5e 2x2: its
  unembedding shard [4096, 32064], 125 MiB, and each 2-head k and v
  [4096, 2, 128], 2 MiB: 0.3 GiB of temporaries and 1.5 ms a call,
  `tests/test_tpu_compile.py`). Row-major pads such a shard to whole
  tiles (2 heads to 4 rows); other codes keep XLA:TPU's order, which
  pads less (one head [K, 1, D] is read 2-D in it)."""

  def one(path, spec: P, leaf):
    sharding = NamedSharding(mesh, spec)
    if platform not in STORING or _field(path) != "values":
      return sharding
    local = sharding.shard_shape(tuple(leaf.shape))
    n = len(local)
    if not ((n == 2 and local[1] % 128) or (n == 3 and 1 < local[1] < 8)):
      return sharding
    return Format(Layout(major_to_minor=tuple(range(n))), sharding)

  return jax.tree_util.tree_map_with_path(
    one, specs, shapes, is_leaf=lambda s: isinstance(s, P)
  )


def any_stored(tree) -> bool:
  """Whether a tree of `shardings` holds a `Format`."""
  return any(isinstance(s, Format) for s in jax.tree.leaves(tree))
