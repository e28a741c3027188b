"""The engine's programs compiled by XLA:TPU on this CPU (libtpu, no TPU:
`chunkwise.simulation.tpu_target`), for a v5e 2x2 slice and a 3-axis v4
2x2x2 one: every layout and collective variant, f32 / bf16 / int8
weights, int8 K/V, the slot loop with LoRA and with speculative
verification, and a paged pool read by JAX's Pallas TPU kernel. Each
compiled program reads its weights in place, updates its K/V in place
(aliased), runs the collectives its layout is designed to, and holds the
planner's share of the weights per chip. A program that does not fit is
reported with the compiler's refusal, not raised."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import chunkwise as cw
from chunkwise.inference.speculation import Speculation
from chunkwise.models import blocks
from chunkwise.partitioning import Layout
from chunkwise.simulation import hlo, tpu_target, weight_reads
from chunkwise.simulation import report as sim_report
from chunkwise.simulation import simulate as sim
from chunkwise.simulation.compiled import compile_depth
from chunkwise.simulation.programs import (
  Case,
  Phase,
  WeightFormat,
  abstract_weights,
)

pytestmark = pytest.mark.skipif(
  not tpu_target.available(), reason="needs libtpu: the 'tpu' extra"
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Small, in the TPU's (8, 128) tiles: head_dim 128, widths of 128s, and
# wide enough for int8 groups of 128 inputs (the planner's count). One
# layer: layers are unrolled (`transformer.run_layers`), each a copy of
# the first's program, and XLA:TPU's compile time grows with their count.
H = cw.configs.get("tiny").replace(
  layers=1,
  d_model=2048,
  heads=16,
  kv_heads=4,
  head_dim=128,
  d_ff=2048,
  vocab=1024,
)
V5E, V4, ONE = "tpu-v5e:2x2", "tpu-v4:2x2x2", "tpu-v5e:1x1"
KINDS = {V5E: "TPU v5 lite", V4: "TPU v4", ONE: "TPU v5 lite"}
# (target, phase, layout, weights, K/V dtype, extras)
CASES = [
  (V5E, Phase.GENERATE, "ws_2d/yz", "bf16", "bfloat16", {}),
  (V5E, Phase.PREFILL, "ws_2d/none", "bf16", "bfloat16", {}),
  (V5E, Phase.GENERATE, "ws_2d/none", "f32", "float32", {}),
  (V5E, Phase.PREFILL, "ws_2d/none", "f32", "float32", {}),
  (V5E, Phase.GENERATE, "ws_1d/none/latency", "int8", "bfloat16", {}),
  (V5E, Phase.SLOTS, "ws_2d/yz", "bf16", "bfloat16", {"adapters": 2}),
  (ONE, Phase.SLOTS, "reference", "bf16", "bfloat16", {"pages": 24}),
  (V5E, Phase.GENERATE, "ws_2d/yz", "Q4_K", "bfloat16", {}),
  # a TPU program's invariant kernels (`numerics.tpu_invariant`), over
  # a cache of 16 key tiles: the one tile a row gathers from it (the
  # cache's last whole tile's) is then 1/16 of it, no K/V-sized copy
  (
    V5E,
    Phase.GENERATE,
    "ws_2d/yz",
    "bf16",
    "bfloat16",
    {"numerics": "invariant", "length": 2048},
  ),
  # With --long (CI's time is bounded): weight-gathered, int8 K/V, v4's
  # 3D torus and its collectives, int8 and Q8_0 prefill, a speculating slot
  # loop (28 s to compile on 2 cores; the adapters' and pages' slot loops
  # run in CI).
  *(
    pytest.param(case, marks=pytest.mark.long)
    for case in [
      (V5E, Phase.GENERATE, "wg", "bf16", "bfloat16", {}),
      (V5E, Phase.GENERATE, "ws_2d/yz", "bf16", "int8", {}),
      (V4, Phase.GENERATE, "ws_2d/yzx", "bf16", "bfloat16", {}),
      (V4, Phase.GENERATE, "ws_2d/yz/latency", "bf16", "bfloat16", {}),
      (V4, Phase.PREFILL, "ws_2d/yz/throughput", "int8", "bfloat16", {}),
      (V4, Phase.PREFILL, "wg", "bf16", "bfloat16", {}),
      (V4, Phase.GENERATE, "ws_1d/z/one_way", "f32", "float32", {}),
      (V4, Phase.PREFILL, "ws_2d/yz/throughput", "Q8_0", "bfloat16", {}),
      (
        V5E,
        Phase.SLOTS,
        "ws_1d/yz",
        "bf16",
        "bfloat16",
        {"speculation": Speculation(drafter="ngram", k=2)},
      ),
    ]
  ),
]


def _id(case) -> str:
  target, phase, layout, weights, kv, extras = case
  return "-".join(
    (target[4:], phase.value, layout, weights, kv, *map(str, extras))
  )


@pytest.fixture(scope="module")
def meshes():
  return {t: tpu_target.Target.parse(t).mesh() for t in (V5E, V4, ONE)}


@pytest.fixture(scope="module", params=CASES, ids=_id)
def compiled(request, meshes):
  target, phase, layout, weights, kv, extras = request.param
  case = Case(
    phase=phase,
    layout=Layout.parse(layout),
    batch=8,
    steps=8,
    weights=WeightFormat(weights),
    **{"length": 120 if phase is Phase.SLOTS else 128, **extras},
  )
  dtypes = dict(
    cache_dtype=jnp.dtype(kv),
    compute_dtype=jnp.float32 if weights == "f32" else jnp.bfloat16,
  )
  mesh = meshes[target]
  return target, mesh, case, dtypes, compile_depth(H, mesh, case, **dtypes)


def _float_decode(case) -> bool:
  """A bf16 or f32 decode step in a weight-stationary layout, without
  adapters, speculation or pages: every product a kernel call."""
  return (
    case.weights.value in ("bf16", "f32")
    and case.phase is not Phase.PREFILL
    and case.layout.kind.value != "wg"
    and not (case.adapters or case.speculation or case.pages)
  )


def test_compiles_for_the_tpu_reading_weights_in_place(compiled):
  target, _, case, _, r = compiled
  assert "error" not in r, r.get("error")
  assert (r["platform"], r["device_kind"]) == ("tpu", KINDS[target])
  copies = r["weight_copies"]  # VMEM prefetches are not copies
  if case.weights.value in blocks.FORMATS:
    # but XLA:TPU lays a GGUF table's f16 scales and offsets out again
    # for the embedding's row gather (1/16 of its codes' bytes, Q4)
    assert all(re.search(r"copy f16\[\d+,\d+\] from", c) for c in copies)
    assert r["memory"]["weight_copies"] <= 0.01 * r["inputs"]["weights"]
    # and no dequantized weight: scratch well under the weights in f32
    kind = case.weights.value
    f32 = r["inputs"]["weights"] * 4 / blocks.bytes_per_value(kind)
    assert r["memory"]["temp"] < f32 / 4
  else:
    assert copies == []
    assert r["memory"]["weight_copies"] == 0
  # Nor laid out again on their way into VMEM at every step: the Pallas
  # kernel reads a few heads of q, k and v as stored ([K, H, D] tiles;
  # reshaped, the f32 decode and the paged loop laid them out again each
  # step; and a weight-stationary float decode step's products all run
  # in the kernel). Left, once a call (the entry computation): int8 and
  # GGUF scales, LoRA factors, q in a speculative pass (more rows than
  # the kernel's), XLA's dots' q in a bf16 prefill, a weight-gathered
  # layer's gathered weights.
  relayouts = r["weight_relayouts"]
  assert all(line.startswith("main.") for line in relayouts), relayouts
  if case.weights.value == "f32" or case.pages or _float_decode(case):
    assert relayouts == []
  # The arguments are the inputs' shards, small ones padded to tiles.
  padding = r["memory"]["argument"] - sum(r["inputs"].values())
  assert 0 <= padding <= 0.02 * r["memory"]["argument"]
  assert r["memory"]["generated_code"] > 0
  # XLA:TPU's own estimate of the time: the decode loops per step.
  key = "once" if case.phase is Phase.PREFILL else "per_iteration"
  assert r["cycles"][key] > 0
  # A step's estimate by kind of op adds up to it; small ops (norms,
  # RoPE, a few rows' softmax) each cost the compiler's floor.
  ops = r["step_ops"]
  assert sum(k["cycles"] for k in ops.values()) == r["cycles"]["per_iteration"]
  if case.phase is not Phase.PREFILL:
    assert ops["small"]["count"] > 0
    floor = ops["small"]["cycles"] / ops["small"]["count"]
    assert 1000 < floor < hlo.SMALL_OP_CYCLES


def test_kv_cache_is_updated_in_place(compiled):
  _, _, case, _, r = compiled
  memory, kv = r["memory"], r["outputs"]["kv_cache"]
  if case.phase is Phase.PREFILL:
    # A prefill writes a new cache: nothing donated.
    assert memory["alias"] == 0 and kv > 0
    return
  # The loop's state (its K/V buffers, or the slots' cache or pool) is
  # donated and written into: every byte of it aliased.
  assert kv > 0 and memory["alias"] >= kv
  # but a scalar or two (each a 512-byte tile)
  assert memory["output"] - memory["alias"] <= 2048


def test_weights_per_chip_are_the_planners_share(compiled):
  target, mesh, case, dtypes, r = compiled
  if case.adapters or case.pages:
    pytest.skip("adapters join the weights; the pool runs unsharded")
  est = sim_report.predict(
    H,
    list(mesh.devices.shape),
    case,
    tpu_target.Target.parse(target).hardware,
    **dtypes,
  )
  assert r["inputs"]["weights"] == pytest.approx(est.weight_bytes, rel=0.02)


def test_each_layout_runs_its_collectives(compiled):
  _, mesh, case, _, r = compiled
  program, ops = r["program_collectives"], r["collectives"]
  kind = case.layout.kind.value
  if case.pages:
    assert program == {} and ops == {}
    return
  if kind == "wg":
    # Weights gathered layer by layer: all-gathers only, of at least every
    # layer's weights (each device holds 1/n of them).
    assert set(program) == {"all-gather"}
    n = math.prod(mesh.devices.shape)
    layer_bytes = sum(
      math.prod(x.shape) * x.dtype.itemsize
      for x in jax.tree.leaves(abstract_weights(H, case.weights).layers)
    )
    assert program["all-gather"]["full_bytes"] >= layer_bytes * (n - 1) / n
    return
  # Weight-stationary: activations reduced and gathered, weights not.
  assert program.keys() & {"reduce-scatter", "all-reduce"}
  if case.layout.collectives.shuffled:
    # The collective matmuls: rings of collective-permutes in the program
    # XLA:TPU compiles.
    assert ops.get("collective-permute", {}).get("count", 0) > 0
  else:
    assert "collective-permute" not in program


def test_programs_call_the_pallas_tpu_kernels_they_should(compiled):
  """The paged pool by JAX's paged-attention kernel; int8 and GGUF-block
  weights (any rows), f32 weights at precision "highest" (any rows: XLA's
  six-pass f32 dot took 50 s to compile for this f32 prefill, the kernel
  5 s) and bf16 ones at decode's few rows through `tpu_kernels.matmul`,
  and no XLA dot of an f32 weight left; a quantized table's rows by
  `take_rows`; none of these in a bf16 prefill. A fast decode step's
  attention is one call a layer over every piece of its context
  (`models.tpu_decode`), but for int8 K/V (read in attention's rotated
  space) and a paged pool's (a speculating loop's passes of one position
  a row take it too; its verifying passes of k + 1 do not)."""
  _, _, case, dtypes, r = compiled
  quantized = case.weights.value not in ("bf16", "f32")
  f32 = case.weights.value == "f32"
  kernels = r["kernels"]
  assert ("chunkwise_tpu_paged_attention" in kernels) == bool(case.pages)
  assert ("chunkwise_tpu_take_rows" in kernels) == quantized
  if not case.speculation:  # (verifying k + 1 tokens a row: 24 rows)
    decode = case.phase is not Phase.PREFILL
    assert ("chunkwise_tpu_matmul" in kernels) == (quantized or decode or f32)
  # Every product: q, k, v, o, gate, up, down and the logits. An f32
  # prefill's (any rows), and a bf16 or f32 decode step's in a
  # weight-stationary layout, their collective matmuls' `contract` too
  # (a ring's product is one call per piece: more).
  if (f32 and case.phase is Phase.PREFILL) or _float_decode(case):
    assert kernels["chunkwise_tpu_matmul"] >= 7 * H.layers + 1
  one_step = case.phase is not Phase.PREFILL and not case.pages
  fast = one_step and case.numerics != "invariant"
  decode = fast and dtypes["cache_dtype"] != jnp.int8
  assert ("chunkwise_tpu_decode_attention" in kernels) == decode
  if decode:
    assert kernels["chunkwise_tpu_decode_attention"] >= H.layers
  assert r["cycles"]["bounded"] > 0 or not set(kernels) - {
    "chunkwise_tpu_paged_attention"
  }


def test_invariant_programs_call_the_invariant_kernels(compiled):
  """Under invariant numerics every weight matmul, every piece of
  attention and every row sum (norms, the log-softmax's and sampling's
  totals) is a Pallas call of fixed tiles, and the prefix cache is read
  where it is (its keys as a TPU stores them: no K/V-sized copy)."""
  _, _, case, _, r = compiled
  kernels = r["kernels"]
  invariant = case.numerics == "invariant"
  assert ("chunkwise_tpu_invariant_attention" in kernels) == invariant
  assert ("chunkwise_tpu_row_sum" in kernels) == invariant
  if not invariant:
    return
  # q, k, v, o, gate, up, down a layer and the logits; the prefix up to
  # its last whole tile, then the rest of the context gathered behind it,
  # a layer; two norms a layer, the final norm, the log-softmax's total.
  assert kernels["chunkwise_tpu_matmul"] >= 7 * H.layers + 1
  assert kernels["chunkwise_tpu_invariant_attention"] >= 2 * H.layers
  assert kernels["chunkwise_tpu_row_sum"] >= 2 * H.layers + 2
  assert r["kv_copies"] == []


def _compiled(mesh, fn, x, w):
  with tpu_target.compiling(mesh):
    return jax.jit(fn).lower(x, w).compile()


def _temp_bytes(mesh, fn, x, w) -> int:
  return _compiled(mesh, fn, x, w).memory_analysis().temp_size_in_bytes


def _reads_in_the_kernel(mesh, eq, x, w) -> None:
  """A k-major form runs the Pallas kernel (`tpu_kernels.matmul`), whose
  cost the compiled call carries; an n-major one XLA's dots."""
  from chunkwise.models import matmul

  compiled = _compiled(mesh, lambda x, w: matmul.weight_matmul(eq, x, w), x, w)
  text = compiled.as_text()
  kmajor = eq.split(",")[1][0] == "e"
  assert ("chunkwise_tpu_matmul" in hlo.tpu_kernels(text)) == kmajor
  cycles = hlo.estimated_cycles(
    text, tpu_target.hardware_of(mesh.devices.flat[0])
  )
  assert cycles["bounded"] == kmajor and cycles["once"] > 0


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize(
  "eq, shape, scale",
  [
    # A k-major projection grouped along its inputs, and PaLM 540B's tied
    # int8 embedding shard unembedding on v4 4x4x4 (36 scale groups, a dot
    # each: three times the compile). In this order, MATRICES' "cover"
    # runs the projection at both row counts and the unembedding at one.
    ("bte,ef->btf", (4608, 8192), (36, 8192)),
    ("bte,ve->btv", (16008, 4608), (16008, 36)),
  ],
)
def test_int8_matmuls_make_no_dequantized_weight(
  meshes, eq, shape, scale, rows
):
  """XLA:TPU does not fuse the int8 weight's scales into its dot: the
  plain twin (dequantize, then contract) holds a weight-sized buffer,
  `weight_matmul` (the Pallas kernel for k-major forms, a dot per scale
  group for n-major ones) none, at one row (a
  batch-1 decode step, which XLA would turn into a multiply-and-reduce
  over the converted weight) as at several."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from chunkwise.models import QArray, matmul

  one = NamedSharding(meshes[ONE], P())
  w = QArray(
    values=jax.ShapeDtypeStruct(shape, jnp.int8, sharding=one),
    scale=jax.ShapeDtypeStruct(scale, jnp.float32, sharding=one),
  )
  x = jax.ShapeDtypeStruct((rows, 1, 4608), jnp.bfloat16, sharding=one)
  dequantized = math.prod(shape) * 2  # bytes of the weight in bf16
  plain = _temp_bytes(meshes[ONE], lambda x, w: matmul.plain(eq, x, w), x, w)
  assert plain >= dequantized
  fn = lambda x, w: matmul.weight_matmul(eq, x, w)
  assert _temp_bytes(meshes[ONE], fn, x, w) < dequantized / 64
  _reads_in_the_kernel(meshes[ONE], eq, x, w)


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0"])  # 4 and 8 bits
@pytest.mark.parametrize(
  "eq, shape, axis",
  [("bte,ef->btf", (4096, 8192), 0), ("bte,ve->btv", (16000, 4096), 1)],
)
def test_gguf_block_matmuls_make_no_dequantized_weight(
  meshes, eq, shape, axis, kind, rows
):
  """GGUF blocks on a TPU (the Pallas kernel, or `matmul.by_block` for
  n-major forms): no buffer of the weight's size, where the plain twin
  (unpack, dequantize, contract) holds at least one f32 copy of it
  (4-bit: three)."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from chunkwise.models import matmul

  one = NamedSharding(meshes[ONE], P())
  w = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
    blocks.template("w", shape, kind, axis),
  )
  x = jax.ShapeDtypeStruct((rows, 1, 4096), jnp.bfloat16, sharding=one)
  f32 = math.prod(shape) * 4
  plain = _temp_bytes(meshes[ONE], lambda x, w: matmul.plain(eq, x, w), x, w)
  assert plain >= f32
  fn = lambda x, w: matmul.weight_matmul(eq, x, w)
  assert _temp_bytes(meshes[ONE], fn, x, w) < f32 / 256
  _reads_in_the_kernel(meshes[ONE], eq, x, w)


def test_a_program_that_does_not_fit_is_a_result(meshes):
  """Too many tokens for one v5e's HBM: XLA:TPU refuses, and the report
  says so (fits false, the compiler's message) instead of raising."""
  case = Case(
    phase=Phase.PREFILL, layout=Layout.parse("wg"), batch=512, length=4096
  )
  target = tpu_target.Target.parse(ONE)
  with pytest.raises(ValueError, match="holding the 1 devices"):
    target.mesh((1, 2, 1))
  mesh = target.mesh((1, 1, 1))
  report = sim.simulate(
    H, mesh, case, depths=(1, 2), hardware="tpu-v5e", target=target
  )
  assert report["fits"] is False
  assert "RESOURCE_EXHAUSTED" in report["error"]
  assert report["predicted"]["memory_bytes"] > target.hbm_bytes
  assert "refused (out of memory" in sim_report.table([report])


def test_two_slices_span_x_over_the_network():
  """--slices: x spans the slices (each slice's chips on y, z), and the
  program compiles for the multi-slice mesh."""
  target = tpu_target.Target.parse(V5E, slices=2)
  mesh = target.mesh()
  assert mesh.devices.shape == (2, 2, 2)
  for i in range(2):
    assert {d.slice_index for d in mesh.devices[i].flat} == {i}
  case = Case(
    phase=Phase.GENERATE, layout=Layout.parse("ws_2d/yzx"), batch=8, length=64
  )
  dtypes = dict(cache_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
  r = compile_depth(H, mesh, case, **dtypes)
  assert "error" not in r and r["weight_copies"] == []
  assert r["memory"]["alias"] >= r["outputs"]["kv_cache"] > 0


def test_targets_parse_and_refuse_what_is_not_a_tpu():
  t = tpu_target.Target.parse("tpu-v4:4x4x4", slices=2)
  assert (t.chips, t.default_mesh(), t.hardware) == (128, (8, 4, 4), "tpu-v4")
  assert tpu_target.Target.parse("TPU-v6e:2x4").default_mesh() == (1, 2, 4)
  for bad, match in [
    ("v5e:2x2", "tpu-<generation>:<topology>"),
    ("tpu-v3:2x2", "not one of v4, v5e, v5p, v6e"),
    ("tpu-v4:2x2", "must be 3 positive sizes"),
    ("tpu-v5e:2x2x2", "must be 2 positive sizes"),
  ]:
    with pytest.raises(ValueError, match=match):
      tpu_target.Target.parse(bad)


def test_vmem_prefetches_are_not_weight_copies():
  """XLA:TPU stages slices of a weight in VMEM (layout S(1)) for its
  matmuls; a copy in HBM is still found."""
  tiled = "{2,1,0:T(8,128)(2,1)}"
  vmem = "{2,1,0:T(8,128)(2,1)S(1)}"
  text = "\n".join(
    [
      "HloModule m",
      "ENTRY %main (p0: bf16[4096,8,128]) -> bf16[4096,8,128] {",
      f"  %p0 = bf16[4096,8,128]{tiled} parameter(0)",
      f"  %s = ((bf16[4096,8,128]{tiled}), bf16[1024,8,128]{vmem}, "
      "s32[]{:S(2)}) slice-start(%p0), slice={[0:1024], [0:8], [0:128]}",
      f"  %d = bf16[1024,8,128]{vmem} slice-done(%s)",
      f"  %v = bf16[4096,8,128]{vmem} copy(%p0)",
      f"  ROOT %c = bf16[4096,8,128]{tiled} copy(%p0)",
      "}",
    ]
  )
  found = weight_reads.weight_copies(text, 1)
  assert len(found) == 1 and "%c = copy" in found[0]
  cycles = hlo.estimated_cycles(
    text.replace(
      "copy(%p0)", 'copy(%p0), backend_config={"estimated_cycles":"7"}'
    )
  )
  assert cycles == {"once": 14, "per_iteration": 0, "unknown": 0, "bounded": 0}
  unknown = text.replace(
    "copy(%p0)",
    'copy(%p0), backend_config={"estimated_cycles":"' + str(2**63 - 1) + '"}',
  )
  assert hlo.estimated_cycles(unknown)["unknown"] == 2


def test_kv_copies_are_relayouts_in_any_memory():
  """A K/V cache copied whole into VMEM in its own layout is a prefetch;
  in another layout (or in HBM) it is laid out again, and found."""
  own = "{4,3,2,1,0:T(8,128)(2,1)}"
  text = "\n".join(
    [
      "HloModule m",
      "ENTRY %main (p0: bf16[2,8,512,4,128], p1: bf16[8,1,512,128]) -> "
      "bf16[2,8,512,4,128] {",
      f"  %p0 = bf16[2,8,512,4,128]{own} parameter(0)",
      "  %p1 = bf16[8,1,512,128]{3,2,1,0:T(8,128)(2,1)} parameter(1)",
      "  %same = bf16[2,8,512,4,128]{4,3,2,1,0:T(8,128)(2,1)S(1)} copy(%p0)",
      # a dimension of size 1 goes anywhere: no byte moves
      "  %one = bf16[8,1,512,128]{3,2,0,1:T(8,128)(2,1)S(1)} copy(%p1)",
      "  %vmem = bf16[2,8,512,4,128]{2,4,1,3,0:T(8,128)(2,1)S(1)} copy(%p0)",
      "  ROOT %hbm = bf16[2,8,512,4,128]{2,4,1,3,0:T(8,128)(2,1)} copy(%p0)",
      "}",
    ]
  )
  found = weight_reads.input_copies(text, [0, 1], what="K/V", staging=False)
  assert [f.split("=")[0].split("%")[1].strip() for f in found] == [
    "hbm",
    "vmem",
  ]
  assert all("from K/V parameter 0" in f for f in found)
  # as weights (staging allowed), only the copy in HBM
  assert len(weight_reads.input_copies(text, [0, 1])) == 1


# A context longer than VMEM holds (v5e: 128 MiB): XLA:TPU cannot stage a
# cache there whole, so one in an order it does not read is copied in HBM.
LONG = dict(length=32768, steps=1024)


def _ws_2d(
  h, mesh, phase: Phase, length: int, steps: int, weights: str = "bf16"
) -> dict:
  """`compile_depth` of 8 rows in ws_2d/yz, `weights`, bf16 K/V."""
  case = Case(
    phase=phase,
    layout=Layout.parse("ws_2d/yz"),
    batch=8,
    length=length,
    steps=steps,
    weights=WeightFormat(weights),
  )
  dtypes = dict(cache_dtype=jnp.dtype("bfloat16"), compute_dtype=jnp.bfloat16)
  return compile_depth(h, mesh, case, **dtypes)


def test_invariant_attention_reads_the_stacked_cache_in_place(meshes):
  """Under invariant numerics each layer's Pallas attention call reads the
  prefix cache's keys and values where they are, the whole stacked cache
  with the layer in its block index (`PrefixLayer.stacked`): handed a
  layer's slice, XLA:TPU copied it out first (197 MiB of temporaries
  here, both K and V in `kv_copies`)."""
  case = Case(
    phase=Phase.GENERATE,
    layout=Layout.parse("ws_2d/none"),
    batch=8,
    length=LONG["length"],
    steps=8,
    numerics="invariant",
  )
  dtypes = dict(cache_dtype=jnp.dtype("bfloat16"), compute_dtype=jnp.bfloat16)
  r = compile_depth(H.replace(layers=2), meshes[V5E], case, **dtypes)
  assert r["kernels"]["chunkwise_tpu_invariant_attention"] == 2 * 2
  assert r["kv_copies"] == []
  assert r["memory"]["temp"] < r["inputs"]["kv_cache"] / 8


@pytest.mark.parametrize(
  "phase", [Phase.GENERATE, pytest.param(Phase.SLOTS, marks=pytest.mark.long)]
)
def test_kv_caches_are_read_where_they_are(meshes, phase):
  """Decode reads a prefix's K/V cache and its own buffers where they are
  (`partitioning.formats` stores them in the orders XLA:TPU reads): no
  copy or relayout of any in HBM, and scratch far below their size.
  Stored row-major, the prefix cache was copied at every call (294 MiB
  here). A generate loop's own buffers (1024 columns) fit in VMEM, where
  XLA:TPU may keep them through the loop: copied in once a call (the
  entry computation), in a sliver of the call's estimated time."""
  length = LONG["length"] - (LONG["steps"] if phase is Phase.SLOTS else 0)
  r = _ws_2d(H, meshes[V5E], phase, length, LONG["steps"])
  assert r["kv_copies"] == []
  assert all(line.startswith("main.") for line in r["kv_staged"])
  cycles = r["cycles"]
  call = cycles["once"] + LONG["steps"] * cycles["per_iteration"]
  assert r["kv_staged_cycles"] <= call / 100
  kv = r["inputs"]["kv_cache"]
  assert kv > 64 << 20
  assert r["memory"]["temp"] < kv / 8


def test_heads_narrower_than_a_group_read_the_cache_in_place(meshes):
  """Rows split over the 4 devices of ws_2d/yz, each gathering 4 query
  heads of a group of 8 (two devices' blocks read one K/V head, as
  Llama-3.1-70B's 4 of 8 on a v5e 4x4): one attention over every head,
  and the prefix cache read where it is. A window of heads per block
  made XLA:TPU hoist each layer's and head's window out of the decode
  loop, a copy of the whole cache in 16 pieces (70B at 32 rows held 5.4
  GiB more than its cache, past a v5e's 16)."""
  h = H.replace(kv_heads=2)
  r = _ws_2d(h, meshes[V5E], Phase.GENERATE, length=2048, steps=8)
  assert r["kv_copies"] == []
  assert r["memory"]["temp"] < r["inputs"]["kv_cache"]  # no copy of it


def test_decode_attention_compiles_with_a_soft_cap_and_a_whole_cache(meshes):
  """The decode step's attention kernel as Mosaic lowers it for a soft
  cap (tanh), 64-wide heads and a cache of 1,000 keys, which 128 does not
  divide (read as one block): one call a layer, no K/V copied."""
  h = H.replace(attn_softcap=50.0, head_dim=64, heads=32, kv_heads=8)
  r = _ws_2d(h, meshes[V5E], Phase.GENERATE, length=1000, steps=8)
  assert "error" not in r, r.get("error")
  assert r["kernels"]["chunkwise_tpu_decode_attention"] == h.layers
  assert r["kv_copies"] == []


def test_one_kv_head_is_read_in_place(meshes):
  """A multiquery model's int8 k and v ([K, 1, D], PaLM's) go to the
  Pallas kernel 2-D (`tpu_kernels.stored.heads_as_stored`), read as stored:
  every product a kernel call, no weight copied. (Read 3-D at PaLM 62B's
  full shapes, XLA:TPU copied each into int8 tiles of four rows holding
  one, 8 MiB a layer: docs/planner.md. These small shapes do not show
  that copy either way; they check the 2-D path.)"""
  h = H.replace(kv_heads=1)
  r = _ws_2d(
    h, meshes[V5E], Phase.GENERATE, length=128, steps=8, weights="int8"
  )
  assert r["weight_copies"] == [], r["weight_copies"]
  assert r["memory"]["weight_copies"] == 0
  assert r["kernels"]["chunkwise_tpu_matmul"] >= 7 * h.layers


def test_quantized_codes_are_stored_as_the_kernel_reads_them(meshes):
  """Two K/V heads a chip and a vocabulary shard that 128 does not divide
  (Llama-3.1-8B's on v5e 2x2: [4096, 2, 128] and [4096, 32064]): left
  to XLA:TPU, their int8 codes are stored head-major and n-major, and
  each call copied them back into the kernel's row-major tiles (here
  the unembedding's, [4096, 8016], 32 MiB a call, 6x the call's other
  work outside its loop; at 8B's full shapes k and v too, in HBM).
  Placed row-major (`partitioning.formats.weights`), no weight is
  copied in HBM and the unembedding is read in place; what XLA:TPU may
  still do is stage a few heads' k and v (1 MiB each) in VMEM in an
  order of its own, once a call."""
  h = H.replace(d_model=4096, kv_heads=8, vocab=32064)
  r = _ws_2d(
    h, meshes[V5E], Phase.GENERATE, length=128, steps=8, weights="int8"
  )
  assert r["weight_copies"] == [], r["weight_copies"]
  table = [
    line
    for line in r["weight_relayouts"]
    if re.search(r" s8\[4096,8016\] from", line)
  ]
  assert table == [], table
  assert r["kernels"]["chunkwise_tpu_matmul"] >= 7 * h.layers


def test_simulate_script_compiles_for_a_tpu_target(tmp_path):
  out = tmp_path / "sim.json"
  run = subprocess.run(
    [
      sys.executable,
      str(ROOT / "scripts" / "simulate.py"),
      "--target=tpu-v5e:2x2",
      "--model=tiny",
      "--phases=generate",
      "--layouts=ws_2d/yz",
      "--batch=8",
      "--context=64",
      "--layers=1,full",
      f"--json_out={out}",
    ],
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert run.returncode == 0, run.stderr[-3000:]
  assert "tpu-v5e:2x2" in run.stdout and "fits" in run.stdout
  (report,) = json.loads(out.read_text())["reports"]
  assert report["target"] == "tpu-v5e:2x2"
  assert report["device_kind"] == "TPU v5 lite"
  assert report["mesh"] == [1, 2, 2]
  assert report["fits"] is True and not report["scaled_depth"]
  assert "full depth" in report["scaling"]
  for field in ("argument", "output", "alias", "temp", "code"):
    assert report[f"{field}_bytes"] > 0, field
  e = report["estimate"]
  assert e["compiler_s"] > 0 and e["interconnect_s"] > 0
  assert e["total_s"] == pytest.approx(e["compiler_s"] + e["interconnect_s"])


def test_the_pallas_kernels_compile_and_are_estimated():
  """`tpu_kernels` compiled by Mosaic for a v5e chip beside XLA's twins
  (`simulation.kernels`): each Pallas call counts at its bytes' and
  flops' bound; int8 codes read in the kernel beat bf16 weights; the
  invariant forms stay within 1.3x of the fast kernel (matmul) and below
  XLA's softmax attention."""
  from chunkwise.simulation import kernels

  # One v5e chip's share of a Llama-3.1-8B MLP weight (4096 x 3584).
  rows = kernels.kernel_costs(
    tpu_target.Target.parse(ONE), context=2048, rows=(1, 8)
  )
  by = {
    (r["op"].split()[0], r["op"].split()[1], r["form"], r["rows"]): r
    for r in rows
  }
  assert all(r["bounded"] for r in rows if "kernel" in r["form"])
  for b in (1, 8):
    int8, bf16 = (
      by["matmul", d, "kernel", b]["seconds"] for d in ("int8", "bf16")
    )
    assert int8 < bf16
    for d in ("int8", "bf16"):
      fast = by["matmul", d, "kernel", b]["seconds"]
      assert by["matmul", d, "invariant kernel", b]["seconds"] <= 1.3 * fast
    attention = [
      r for r in rows if r["op"].startswith("attention") and r["rows"] == b
    ]
    xla, kernel = (
      next(r for r in attention if r["form"] == f)
      for f in ("XLA", "invariant kernel")
    )
    assert kernel["seconds"] < xla["seconds"]
  assert (
    "| matmul int8 4096x3584 | 8 | invariant kernel |"
    in kernels.kernel_table(rows)
  )
