"""Prints the scheduled op sequence of one sharded layer: the collectives
(collective-permute, all-gather, reduce-scatter, all-reduce, all-to-all)
and the matmuls (dot, or a fusion containing one), in the order the
compiled program runs them. Shows whether a collective-matmul variant
really interleaves its ring hops with its matmuls.

  python scripts/collective_hlo.py --layout=ws_2d/none/latency --mesh=2x2x2
  python scripts/collective_hlo.py --layout=ws_2d --mesh=2x2x2 --full_hlo

Runs on host CPU devices (forced to the mesh size) or on accelerators.
"""

import os
import re
from collections.abc import Sequence

from absl import app, flags

_LAYOUT = flags.DEFINE_string("layout", "ws_2d/none/latency", "Layout.")
_MESH = flags.DEFINE_string("mesh", "2x2x2", "Mesh shape XxYxZ.")
_PRESET = flags.DEFINE_string("preset", "tiny", "Model preset.")
_BATCH = flags.DEFINE_integer("batch", 8, "Rows.")
_TIME = flags.DEFINE_integer("time", 1, "Tokens per row.")
_FULL = flags.DEFINE_bool("full_hlo", False, "Print the whole HLO too.")

_OPS = (
  "collective-permute",
  "all-gather",
  "reduce-scatter",
  "all-reduce",
  "all-to-all",
)


def _layer_program(layout, mesh, hparams, batch, time):
  import functools

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from chunkwise import models, partitioning
  from chunkwise.models import weight_stationary, weights
  from chunkwise.partitioning import plan as plan_lib

  plan_lib.check(layout, mesh, hparams)
  plan = partitioning.Plan.make(layout, mesh, hparams, batch=batch)
  rules = plan.rules()
  w_specs = partitioning.resolve_tree(weights.Layer.axes(hparams), rules)
  full = models.init_random(hparams, jax.random.key(0))
  one = full.layers[0]
  one = jax.tree.map(
    lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), one, w_specs
  )
  x_spec = P(plan.resid_batch or None, None, plan.resid_embed)
  x = jax.device_put(
    jnp.ones((batch, time, hparams.d_model)), NamedSharding(mesh, x_spec)
  )
  positions = jnp.zeros((batch, time), jnp.int32)

  def per_device(w, x, positions):
    out, _ = weight_stationary.layer(plan, hparams, w, x, positions, [])
    return out

  fn = jax.jit(
    jax.shard_map(
      functools.partial(per_device),
      mesh=mesh,
      in_specs=(w_specs, x_spec, P()),
      out_specs=x_spec,
      check_vma=False,
    )
  )
  return fn.lower(one, x, positions).compile()


def op_sequence(hlo: str) -> list[str]:
  """Collectives and matmuls of the entry computation, in schedule order
  (fusions are looked into for a dot)."""
  bodies, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      name, bodies[head.group(1)] = head.group(1), []
    elif name is not None:
      bodies[name].append(line)
  fused_dots = {
    n for n, lines in bodies.items() if any(" dot(" in x for x in lines)
  }
  entry = next(
    n for n in bodies if re.search(rf"^ENTRY %?{re.escape(n)} ", hlo, re.M)
  )
  seq = []
  for line in bodies[entry]:
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+ ([\w\-]+)\(", line)
    if not m:
      continue
    op = m.group(2)
    if op.startswith(_OPS):
      seq.append(op.removesuffix("-start").removesuffix("-done"))
    elif op == "dot":
      seq.append("dot")
    elif op == "fusion":
      called = re.search(r"calls=%?([\w.\-]+)", line)
      if called and called.group(1) in fused_dots:
        seq.append("dot")
  return seq


def main(argv: Sequence[str]) -> None:
  del argv
  n = 1
  for s in _MESH.value.split("x"):
    n *= int(s)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={n}"
  )
  import chunkwise as cw
  from chunkwise.partitioning import make_mesh, parse_mesh

  layout = cw.Layout.parse(_LAYOUT.value)
  mesh = make_mesh(parse_mesh(_MESH.value))
  hparams = cw.configs.get(_PRESET.value)
  compiled = _layer_program(layout, mesh, hparams, _BATCH.value, _TIME.value)
  hlo = compiled.as_text()
  if _FULL.value:
    print(hlo)
  seq = op_sequence(hlo)
  print(f"{layout} on mesh {_MESH.value}, one {_PRESET.value} layer:")
  print(" ".join(seq))
  print({op: seq.count(op) for op in sorted(set(seq))})


if __name__ == "__main__":
  app.run(main)
