"""`MeshPrograms`: jitted `shard_map` programs on a mesh, built once per
key, and the placing of their inputs (the sharded engine's base).

  programs = MeshPrograms(mesh, precision="highest", numerics="fast")
  program = programs._program(key, per_device, in_specs, out_specs)
  out = programs._call(program, args, out_specs)

With `abstract` inputs (`jax.ShapeDtypeStruct` weights) nothing runs or is
allocated: `_put` gives ShapeDtypeStructs that carry their shardings and
`_call` the outputs' shapes, placed as a real call would place them
(`bench.simulate` compiles model-size programs that way).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from chunkwise import numerics as numerics_lib
from chunkwise.partitioning import formats, resolve_tree
from chunkwise.partitioning.placement import put
from chunkwise.precision import with_precision

# shard_map's varying-axes check stays off for the engine's programs, for
# two reasons that tests/test_sharded_layers.py checks still hold:
#  1. outputs declared replicated (scores, top-n, a K/V cache replicated
#     over the axes attention does not split) are made so by explicit
#     gathers and ring collectives whose replication the checker cannot
#     infer ("out_specs ... require replication which can't be statically
#     inferred");
#  2. the CPU matmul kernel is a `jax.ffi` call whose result carries no
#     varying-axes type, so its `platform_dependent` switch with XLA's dot
#     (whose result does) fails the check ("switch branches must have
#     equal output types"); so does a Pallas TPU kernel's call
#     (`tpu_kernels`: its out shape names no `manual_axis_type`).
# The collective matmuls alone run with the check on (test_collectives.py).
CHECK_VMA = False


class MeshPrograms:
  """The programs a mesh runs: `_programs` maps a key (phase, plan,
  static options) to its jitted `shard_map`."""

  def __init__(
    self, mesh: Mesh, *, precision: str, numerics: str, abstract: bool
  ):
    self.mesh = mesh
    self._precision = precision
    self._numerics = numerics
    # The mesh's devices' platform: what its programs are lowered for.
    self._platform = mesh.devices.flat[0].platform
    self._abstract = abstract
    self._programs: dict = {}
    # id(program) -> its outputs' shardings and formats, where it declares
    # some (`_program`'s out_logical)
    self._out_formats: dict = {}

  def _place(self, tree, logical, rules):
    """`tree` placed with the shardings its `logical` specs resolve to, in
    the order the platform stores each leaf (`formats`); returns (placed
    tree, mesh specs)."""
    specs = resolve_tree(logical, rules)
    return jax.tree.map(
      self._put_as, tree, self._formats(specs, logical)
    ), specs

  def _formats(self, specs, logical):
    """Per leaf of mesh `specs`, its sharding, or its `Format` where this
    platform stores it in another order (`formats.shardings`)."""
    kv_heads = self.hparams.kv_heads  # set by the engine
    return formats.shardings(
      self.mesh, specs, logical, self._platform, kv_heads
    )

  def _put(self, x, spec: P):
    """`x` placed with mesh `spec`."""
    return self._put_as(x, NamedSharding(self.mesh, spec))

  def _put_as(self, x, sharding):
    """`x` placed with a `NamedSharding` or a `Format`; an abstract `x` (a
    ShapeDtypeStruct) becomes one that carries it, and nothing is
    allocated."""
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return put(x, sharding)

  def _call(self, program, args: tuple, out_specs):
    """`program(*args)`; with abstract weights, the outputs' shapes placed
    by `out_specs` (in the formats the program declares), and nothing
    runs (see the module docstring)."""
    if not self._abstract:
      return program(*args)
    out = jax.eval_shape(program, *args)
    formats_of = self._out_formats.get(id(program))
    if formats_of is not None:
      return jax.tree.map(self._put_as, out, formats_of)
    return jax.tree.map(self._put, out, out_specs)

  def _program(
    self,
    key,
    per_device,
    in_specs,
    out_specs,
    out_logical=None,
    out_formats=None,
    **jit_options,
  ):
    """The jitted `shard_map` of `per_device`, built once per `key`. With
    `out_logical` (the outputs' logical specs), outputs the platform
    stores in another order (`formats`) are made in it; `out_formats`
    gives those shardings and formats directly (the weights')."""
    if key not in self._programs:
      outs = out_formats
      if out_logical is not None:
        outs = self._formats(out_specs, out_logical)
      if outs is not None and formats.any_stored(outs):
        jit_options["out_shardings"] = outs
      else:
        outs = None
      self._programs[key] = jax.jit(
        jax.shard_map(
          with_precision(
            numerics_lib.traced(per_device, self._numerics, self._platform),
            self._precision,
          ),
          mesh=self.mesh,
          in_specs=in_specs,
          out_specs=out_specs,
          check_vma=CHECK_VMA,
        ),
        **jit_options,
      )
      if outs is not None:
        self._out_formats[id(self._programs[key])] = outs
    return self._programs[key]
