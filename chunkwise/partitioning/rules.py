"""Rules: logical axis names -> mesh axes, and the strict resolver.

A rules table maps *every* logical name (see `axes`) to a tuple of mesh
axes (empty: replicated). `resolve` turns a pytree's logical specs into
mesh `PartitionSpec`s:

  table = weight_rules(LayoutKind.WS_2D, kv_sharded=True)
  resolve(P("layers", "embed", "heads", "head_dim"), table)
  # -> P(None, "x", ("y", "z"), None)

Unknown names and a mesh axis used twice in one spec are errors, never a
silent "replicated".
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from jax.sharding import PartitionSpec as P

from chunkwise.partitioning import axes as ax
from chunkwise.partitioning.layout import LayoutKind

Rules = Mapping[str, tuple[str, ...]]

XYZ = ("x", "y", "z")
YZ = ("y", "z")

# Where each layout keeps the weights: (embed, heads/mlp, vocab rows).
_WEIGHTS = {
  LayoutKind.REFERENCE: ((), (), ()),
  LayoutKind.WS_1D: ((), XYZ, XYZ),
  LayoutKind.WS_2D: (("x",), YZ, YZ),
  LayoutKind.WG: (("x",), YZ, YZ),
}


def weight_rules(kind: LayoutKind, *, kv_sharded: bool) -> dict:
  """The weights' rules of a layout; K/V heads follow the query heads when
  `kv_sharded` (they divide the head shards), else they are replicated."""
  embed, heads, vocab = _WEIGHTS[kind]
  return {
    ax.LAYERS: (),
    ax.VOCAB: vocab,
    ax.EMBED: embed,
    ax.HEADS: heads,
    ax.KV_HEADS: heads if kv_sharded else (),
    ax.HEAD_DIM: (),
    ax.MLP: heads,
    ax.NORM: (),
    ax.ADAPTERS: (),
    ax.RANK: (),
  }


def data_rules(
  *,
  logits_batch: tuple[str, ...] = (),
  logits_vocab: tuple[str, ...] = (),
  cache_batch: tuple[str, ...] = (),
  cache_heads: tuple[str, ...] = (),
) -> dict:
  """Rules of the data crossing the jit boundary (see `axes`)."""
  return {
    ax.BATCH: (),
    ax.TIME: (),
    ax.TOP_N: (),
    ax.LOGITS_BATCH: logits_batch,
    ax.LOGITS_VOCAB: logits_vocab,
    ax.CACHE_BATCH: cache_batch,
    ax.CACHE_TIME: (),
    ax.CACHE_HEADS: cache_heads,
  }


def _entry(axes: tuple[str, ...]):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def resolve(spec: P, rules: Rules) -> P:
  """One logical spec -> mesh spec; see the module docstring."""
  out = []
  used: dict[str, str] = {}
  for name in spec:
    if name is None:
      out.append(None)
      continue
    if name not in rules:
      raise ValueError(
        f"logical axis {name!r} (in {spec}) has no rule; known: {sorted(rules)}"
      )
    mesh_axes = tuple(rules[name])
    for a in mesh_axes:
      if a in used:
        raise ValueError(
          f"mesh axis {a!r} is used twice in {spec}: by {used[a]!r} and "
          f"{name!r}"
        )
      used[a] = name
    out.append(_entry(mesh_axes))
  return P(*out)


def resolve_tree(tree, rules: Rules):
  """`resolve` on every PartitionSpec leaf of a pytree (None leaves stay)."""
  return jax.tree.map(
    lambda s: resolve(s, rules),
    tree,
    is_leaf=lambda s: isinstance(s, P),
  )
