"""Arrays of a checkpoint: Orbax storage named by pytree path.

  flat = flatten(weights)          # {"layers.0.q": array, ...}
  shapes = stored_shapes(dir)      # from Orbax's metadata, no array data
  check_arrays(dir, meta, {name: shape}, "its HParams(...)")
  weights = restore(dir, targets)  # into ShapeDtypeStruct targets' shardings

The arrays live in the checkpoint's `arrays/` directory, saved with
`orbax.checkpoint.StandardCheckpointer` (whose own save writes a temporary
directory and renames it when complete). Empty arrays are not stored
(Orbax refuses them); their shapes are in the checkpoint's description.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise.models import quantized

ARRAYS = "arrays"


def _checkpointer():
  """Orbax's checkpointer, imported on first use: importing Orbax (and
  TensorStore) costs every process 25 MiB of resident memory, and most
  never read or write a checkpoint."""
  import orbax.checkpoint as ocp

  return ocp.StandardCheckpointer()


def flatten(tree) -> dict[str, Any]:
  """{"layers.0.q": leaf, ...}: every leaf by its pytree path."""
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  return {
    ".".join(quantized.key_name(k) for k in path): leaf for path, leaf in leaves
  }


def unflatten(like, flat: dict[str, Any]):
  """`like`'s tree with its leaves taken from `flat` by path."""
  names = list(flatten(like))
  return jax.tree.unflatten(jax.tree.structure(like), [flat[n] for n in names])


def nest(flat: dict[str, Any]) -> dict:
  """{"a.b": x} -> {"a": {"b": x}}: the tree Orbax stores."""
  out: dict = {}
  for name, leaf in flat.items():
    *parents, last = name.split(".")
    node = out
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = leaf
  return out


def stored_shapes(directory: str) -> dict[str, tuple[int, ...]]:
  """Each array's shape as Orbax's own metadata records it."""
  path = os.path.join(directory, ARRAYS)
  try:
    with _checkpointer() as ckpt:
      tree = ckpt.metadata(path).item_metadata.tree
  except Exception as e:  # Orbax raises many kinds
    raise ValueError(
      f"checkpoint {directory}: cannot read the arrays' metadata: {e}"
    ) from e
  return {n: tuple(m.shape) for n, m in flatten(tree).items()}


def check_arrays(
  directory: str, meta: dict, want: dict[str, tuple], what: str
) -> None:
  """Raises ValueError naming the first array whose stored shape is not
  the one `what` (e.g. "HParams(layers=2, ...)") expects."""
  stored = stored_shapes(directory)
  for name, desc in meta["arrays"].items():  # empty arrays are not stored
    if 0 in desc["shape"]:
      stored[name] = tuple(desc["shape"])
  for name, shape in want.items():
    if name not in stored:
      raise ValueError(
        f"checkpoint {directory} has no array {name}: {what} expect one of "
        f"shape {shape}"
      )
    if stored[name] != tuple(shape):
      raise ValueError(
        f"checkpoint {directory}: array {name} has shape {stored[name]}, "
        f"but {what} expect {tuple(shape)}"
      )
  extra = sorted(set(stored) - set(want))
  if extra:
    more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
    raise ValueError(
      f"checkpoint {directory} holds arrays {', '.join(extra[:5])}{more} "
      f"that {what} do not have"
    )


def restore(directory: str, targets):
  """Orbax restore of every array into its `ShapeDtypeStruct` target."""
  flat = flatten(targets)
  stored = {n: t for n, t in flat.items() if np.prod(t.shape)}
  try:
    with _checkpointer() as ckpt:
      restored = ckpt.restore(os.path.join(directory, ARRAYS), nest(stored))
  except Exception as e:  # Orbax raises many kinds
    raise ValueError(
      f"checkpoint {directory}: cannot read its arrays: {e}"
    ) from e
  out = {
    n: jax.device_put(jnp.zeros(t.shape, t.dtype), t.sharding)
    for n, t in flat.items()
    if n not in stored
  }
  return unflatten(targets, {**out, **flatten(restored)})


def save(directory: str, tree) -> None:
  """Saves `tree`'s non-empty arrays under `directory`/arrays (Orbax
  refuses empty ones, e.g. top-n of n = 0: their shapes are recorded in the
  description and they are made again by `restore`)."""
  stored = {n: x for n, x in flatten(tree).items() if x.size}
  ckpt = _checkpointer()
  ckpt.save(os.path.join(directory, ARRAYS), nest(stored))
  ckpt.wait_until_finished()
  ckpt.close()
