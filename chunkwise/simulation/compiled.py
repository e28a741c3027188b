"""One simulated program, compiled: the phase's program, traced on
abstract inputs (`programs`), lowered and compiled for a mesh of
fake host devices or a TPU slice's (`tpu_target`), and what the compiled
program holds and sends per device (`compile_depth`). `simulate` calls it
at a few depths and scales the figures to the model's.

What is read, per device:
  memory       `Compiled.memory_analysis()`: argument, output, alias
               (outputs written into donated arguments), temp, generated
               code (XLA:CPU reports 0); and the compiler's copies of whole
               weights (`weight_reads.weight_copy_sizes`: XLA:CPU's f32
               twins of bf16 / int8 weights for its dots), their sum and
               largest; `weight_copies` and `kv_copies` list the
               instructions that copy a weight or lay a K/V cache out
               again, `weight_relayouts` those that stage a weight in
               VMEM in another layout than it is stored (a relayout at
               every call or step), `kv_staged` a decode loop's own
               buffers kept in VMEM through the loop (`_kv_reads`);
  inputs       the abstract arguments' shard bytes by kind (weights, K/V
               caches, other), whose sum is the compiled argument size
               (XLA:TPU pads small arrays to its tiles);
  collectives  of the compiled HLO (`hlo.collectives`; XLA:CPU runs bf16
               collectives in f32 and combines some) and of the
               unoptimized HLO ("program": the dtypes the program asks
               for, which an accelerator's compiler keeps), per kind:
               count, operand, result, full-size and sent bytes, and the
               program's collectives by shape. The generate loop runs
               until every row stops, a trip count unknown when
               compiling: its collectives are one step's;
  cycles       XLA:TPU's estimated cycles (`hlo.estimated_cycles`; a
               Pallas call, which it does not estimate, bounded by the
               bytes and flops the call declares), a decode step's by
               kind of op (`step_ops`: kernels, small ops, the rest), and
               the Pallas kernels it calls, with their call sites
               (`hlo.tpu_kernels`).
A program the compiler refuses (XLA:TPU: out of HBM or VMEM) gives its
message as `error` instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from chunkwise.simulation import hlo, tpu_target, weight_reads
from chunkwise.simulation.programs import trace

MEMORY_FIELDS = ("argument", "output", "alias", "temp", "generated_code")
INPUT_KINDS = ("weights", "kv_cache", "other")
# Per collective kind; moved: what each device sends (`hlo.Collective`).
METRICS = (
  "count",
  "operand_bytes",
  "result_bytes",
  "full_bytes",
  "moved_bytes",
)


def _shard_bytes(x) -> int:
  shape = x.shape if x.sharding is None else x.sharding.shard_shape(x.shape)
  return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def _is_kv(path) -> bool:
  """Whether a leaf's path names a K/V cache's array (a `k` or `v`
  field)."""
  return bool({getattr(key, "name", None) for key in path} & {"k", "v"})


def _kv_params(args: Sequence) -> tuple[list[int], list[int]]:
  """Parameter numbers of the K/V arrays among a program's `args` (those
  past the weights, its first argument): (caches, the decode loop's own
  per-layer buffers: a `LayerKV`'s `k[i]`, `v[i]`)."""
  leaves = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
  caches, own = [], []
  for i, (path, _) in enumerate(leaves):
    if path[0].idx and _is_kv(path):
      layered = isinstance(path[-1], jax.tree_util.SequenceKey)
      (own if layered else caches).append(i)
  return caches, own


def _kv_reads(text: str, args: Sequence) -> dict:
  """`kv_copies`: K/V laid out again, a copy of a cache in HBM or into
  VMEM in another layout (`partitioning.formats` stores them as read),
  or a copy of a decode loop's own buffer in HBM; `kv_staged`: a loop's
  own buffers that XLA:TPU keeps in VMEM through the loop, copied there
  in the layout it reads them (where they fit: a short generate's), and
  `kv_staged_cycles` the estimated cycles of those copies."""
  caches, own = _kv_params(args)

  def found(numbers, staging):
    return weight_reads.input_copies(text, numbers, what="K/V", staging=staging)

  in_hbm = found(own, staging=True)
  staged = sorted(set(found(own, staging=False)) - set(in_hbm))
  names = [line.split("%", 1)[1].split(" ", 1)[0] for line in staged]
  return dict(
    kv_copies=sorted(found(caches, staging=False) + in_hbm),
    kv_staged=staged,
    kv_staged_cycles=hlo.cycles_of(text, names),
  )


def _by_kind(trees: Sequence, first_is_weights: bool) -> dict[str, int]:
  """Per-device bytes of `trees` (placed abstract values): weights (the
  first tree, when `first_is_weights`), K/V caches (any `k` or `v`
  field), other."""
  out = dict.fromkeys(INPUT_KINDS, 0)
  for i, tree in enumerate(trees):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if first_is_weights and i == 0:
        kind = "weights"
      elif _is_kv(path):
        kind = "kv_cache"
      else:
        kind = "other"
      out[kind] += _shard_bytes(leaf)
  return out


def _summary(ops: Sequence[hlo.Collective]) -> dict:
  """Per kind: count, operand, result and full-size bytes per device, each
  op weighted by its executions (once per iteration of a loop of unknown
  trip count)."""
  out = {}
  for op in ops:
    n = 1 if op.times is None else op.times
    row = out.setdefault(op.kind, dict.fromkeys(METRICS, 0))
    row["count"] += n
    row["operand_bytes"] += n * op.operand_bytes
    row["result_bytes"] += n * op.result_bytes
    row["full_bytes"] += n * op.full_bytes
    row["moved_bytes"] += n * op.moved_bytes
  return {k: out[k] for k in hlo.COLLECTIVE_KINDS if k in out}


def _kinds_of(ops: Sequence[hlo.Collective]) -> dict[str, int]:
  """Executions of each (kind, result shape, group size): the program's
  collectives by what they move."""
  out: dict[str, int] = {}
  for op in ops:
    key = f"{op.kind} {op.shape} group {op.group}"
    out[key] = out.get(key, 0) + (1 if op.times is None else op.times)
  return out


def _refusal(error: Exception) -> str:
  """The compiler's message, without the traceback JAX appends."""
  text = str(error).strip()
  return text.split("\n\nThe stack trace")[0][:2000]


def compile_depth(hparams, mesh, case, **dtypes) -> dict:
  """Traces, lowers and compiles the phase's program at `hparams`' depth
  for `mesh`'s devices (fake host CPUs, or a TPU slice's from
  `tpu_target`); returns its figures (see the module docstring). Where
  the compiler refuses the program (XLA:TPU: out of HBM or VMEM), the
  figures are `error` with its message instead."""
  device = mesh.devices.flat[0]
  call = trace(hparams, mesh, case, **dtypes)
  with tpu_target.compiling(mesh):
    start = time.perf_counter()
    lowered = call.program.lower(*call.args)
    lowered_at = time.perf_counter()
    head = dict(
      layers=hparams.layers,
      program=call.name,
      platform=device.platform,
      device_kind=device.device_kind,
      trace_s=call.trace_s,
      lower_s=lowered_at - start,
    )
    try:
      compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      return dict(
        head, compile_s=time.perf_counter() - lowered_at, error=_refusal(e)
      )
  compiled_at = time.perf_counter()
  mem = compiled.memory_analysis()
  memory = {f: int(getattr(mem, f"{f}_size_in_bytes")) for f in MEMORY_FIELDS}
  text = compiled.as_text()
  n_weights = len(jax.tree.leaves(call.args[0]))
  # Buffers the compiler makes out of whole weights, in temp (XLA:CPU
  # converts bf16 and int8 weights to f32 for its dots): their sum, and
  # the largest (temp holds at least that one).
  copies = weight_reads.weight_copy_sizes(text, n_weights)
  memory["weight_copies"] = sum(copies)
  memory["largest_weight_copy"] = max(copies, default=0)
  weight_copies = weight_reads.weight_copies(text, n_weights)
  ops = hlo.collectives(text)
  program_ops = hlo.collectives(lowered.as_text(dialect="hlo"))
  return dict(
    head,
    compile_s=compiled_at - lowered_at,
    memory=memory,
    weight_copies=weight_copies,
    weight_relayouts=sorted(
      set(weight_reads.input_copies(text, range(n_weights), staging=False))
      - set(weight_copies)
    ),
    **_kv_reads(text, call.args),
    cycles=hlo.estimated_cycles(text, tpu_target.hardware_of(device)),
    step_ops=hlo.step_ops(text, tpu_target.hardware_of(device)),
    kernels=hlo.tpu_kernels(text),
    inputs=_by_kind(call.args, first_is_weights=True),
    outputs=_by_kind([call.out], first_is_weights=False),
    collectives=_summary(ops),
    program_collectives=_summary(program_ops),
    program_ops=_kinds_of(program_ops),
    # Collectives inside a loop whose trip count the compiler does not
    # know (the decode loop): counted once, i.e. per decode step.
    per_iteration=sum(op.times is None for op in ops),
  )
