"""Weights where a layout puts them: abstract templates, their shardings,
and int8 quantization computed where the float weights already live.

  template = abstract_weights(hparams, quantized_names, jnp.bfloat16)
  targets = with_shardings(template, weight_shardings(h, mesh, layout,
                                                      template))
  weights = quantize_placed(h, mesh, layout, weights)   # int8, in place

Every loader (GGUF, Hugging Face, chunkwise checkpoints) quantizes through
`quantize_placed`, so int8 weights are made the same way on any device.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from chunkwise.configs import HParams
from chunkwise.models import Weights, blocks, quantized
from chunkwise.models.weights import shape_of, stack_layers
from chunkwise.partitioning import LayoutKind
from chunkwise.partitioning.placement import shardings_for


def block_formats(weights) -> dict[str, dict]:
  """{name: {"kind": "Q4_K", "axis": 1}} for each `BlockArray` weight: what
  a checkpoint's description records to restore it."""
  leaves = jax.tree_util.tree_leaves_with_path(
    weights, is_leaf=quantized.is_grouped
  )
  return {
    ".".join(quantized.key_name(k) for k in path): {
      "kind": w.kind,
      "axis": w.axis,
    }
    for path, w in leaves
    if isinstance(w, blocks.BlockArray)
  }


def parse_block_formats(formats, source: str) -> dict[str, tuple[str, int]]:
  """A description's "blocks" entry checked: {name: (kind, axis)}."""
  if formats is None:
    return {}
  if not isinstance(formats, dict):
    raise ValueError(f"{source}: 'blocks' is not an object")
  out = {}
  for name, f in formats.items():
    kind = f.get("kind") if isinstance(f, dict) else None
    axis = f.get("axis") if isinstance(f, dict) else None
    if kind not in blocks.FORMATS or type(axis) is not int or axis < 0:
      raise ValueError(
        f"{source}: blocks entry {name!r} is {f!r}; expected "
        f'{{"kind": one of {", ".join(blocks.FORMATS)}, "axis": an axis}}'
      )
    out[name] = (kind, axis)
  return out


def abstract_weights(
  h: HParams,
  quantized_names: set[str],
  dtype,
  *,
  stacked: bool = False,
  grouped: bool = True,
  blocked: dict[str, tuple[str, int]] | None = None,
) -> Weights:
  """ShapeDtypeStructs of the weights: QArray leaves for the names saved
  as int8 (scales per group, or per output channel without `grouped`),
  BlockArray leaves for those in `blocked` ({name: (GGUF type, grouped
  axis)}), `dtype` for the float ones; with `stacked`, the layers stacked
  as format version 1 stored them (names "layers.q", not "layers.0.q")."""
  blocked = blocked or {}

  def one(path, spec):
    shape = shape_of(h, spec)
    name = ".".join(quantized.key_name(k) for k in path)
    if stacked:
      name = re.sub(r"^layers\.\d+\.", "layers.", name)
    if name in blocked:
      return blocks.template(name, shape, *blocked[name])
    if name in quantized_names:
      leaf = quantized.key_name(path[-1])
      return quantized.QArray(
        values=jax.ShapeDtypeStruct(shape, jnp.int8),
        scale=jax.ShapeDtypeStruct(
          quantized.shape_like(shape, spec, leaf, grouped=grouped),
          jnp.float32,
        ),
      )
    return jax.ShapeDtypeStruct(shape, dtype)

  out = jax.tree_util.tree_map_with_path(
    one,
    Weights.axes(h),
    is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec),
  )
  if stacked:
    out = out.replace(layers=jax.eval_shape(stack_layers, out.layers))
  return out


def with_shardings(template, shardings):
  """`template`'s ShapeDtypeStructs with `shardings` (one, or a tree)."""
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, template)
  return jax.tree.map(
    lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=s),
    template,
    shardings,
  )


def weight_shardings(h: HParams, mesh, layout, like):
  """Where `layout` keeps weights shaped like `like`: JAX's default device
  for the reference layout, else the layout's shardings on `mesh`."""
  if layout.kind is LayoutKind.REFERENCE:
    return SingleDeviceSharding(jax.devices()[0])
  axes = quantized.specs_like(Weights.axes(h), like)
  return shardings_for(axes, layout, mesh, h)


def quantize_placed(h: HParams, mesh, layout, weights):
  """int8 weights from placed float ones, computed where they live."""
  specs = Weights.axes(h)
  fn = lambda w: quantized.quantize_weights(w, specs)
  out = weight_shardings(h, mesh, layout, jax.eval_shape(fn, weights))
  return jax.jit(fn, out_shardings=out)(weights)
