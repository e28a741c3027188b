"""Compile-only simulation (`chunkwise.simulation.simulate`): the engine's own
programs, compiled from abstract weights on the 8 host devices, give
argument bytes equal to the weights' shards, collectives that grow by
whole layers, and allocate nothing; the HLO readers count collectives
in loops; `scripts/simulate.py` runs as documented."""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import chunkwise as cw
from chunkwise.models import QArray, Weights
from chunkwise.partitioning import Layout, make_mesh
from chunkwise.partitioning.placement import shardings_for
from chunkwise.simulation import hlo, weight_reads
from chunkwise.simulation import programs as sim_trace
from chunkwise.simulation import report as sim_report
from chunkwise.simulation import simulate as sim

ROOT = pathlib.Path(__file__).resolve().parent.parent
# PaLM 8B's widths, compiled at 2 and 4 layers (scaled to its 32).
PALM8 = cw.configs.get("palm-8b")
DECODE = sim.Case(
  phase=sim.Phase.GENERATE,
  layout=Layout.parse("ws_2d/yzx"),
  batch=8,
  length=128,
  steps=4,
)
PREFILL = sim.Case(
  phase=sim.Phase.PREFILL, layout=Layout.parse("wg"), batch=8, length=64
)


def _live_bytes() -> int:
  return sum(a.nbytes for a in jax.live_arrays())


@pytest.fixture(scope="module")
def reports(cpu_devices):
  mesh = make_mesh((2, 2, 2), cpu_devices[:8])
  before = _live_bytes()
  out = {
    case.phase: sim.simulate(PALM8, mesh, case, model="palm-8b")
    for case in (DECODE, PREFILL)
  }
  return out, _live_bytes() - before, mesh


def _shard_bytes(hparams, layout, mesh) -> tuple[int, int, int]:
  """(all weights, one layer's, one layer's global) bytes per device, from
  the placement's own shardings of bf16 weights."""
  shardings = shardings_for(Weights.axes(hparams), layout, mesh, hparams)
  shapes = sim_trace.abstract_weights(hparams, sim_trace.WeightFormat.BF16)

  def nbytes(tree, shards=None):
    leaves = jax.tree.leaves(tree)
    shards = jax.tree.leaves(shards) if shards else [None] * len(leaves)
    return sum(
      math.prod(s.shard_shape(x.shape) if s else x.shape) * x.dtype.itemsize
      for x, s in zip(leaves, shards, strict=True)
    )

  layer = shapes.layers[0]
  return (
    nbytes(shapes, shardings),
    nbytes(layer, shardings.layers[0]),
    nbytes(layer),
  )


def test_nothing_is_allocated(reports):
  _, grown, _ = reports
  # The 2- and 4-layer weights alone would be ~1 GB per phase.
  assert grown < 1 << 20


@pytest.mark.parametrize("phase", [sim.Phase.GENERATE, sim.Phase.PREFILL])
def test_arguments_are_the_weights_shards_and_inputs(reports, phase):
  out, _, mesh = reports
  r = out[phase]
  case = DECODE if phase is sim.Phase.GENERATE else PREFILL
  assert [d["layers"] for d in r["compiled"]] == [2, 4]
  assert r["compiled"][0]["program"] == (
    "run" if phase is sim.Phase.GENERATE else "prefill"
  )
  for d in r["compiled"]:
    h = PALM8.replace(layers=d["layers"])
    weights, _, _ = _shard_bytes(h, case.layout, mesh)
    assert d["inputs"]["weights"] == weights
    # Exactly: the compiled arguments are the abstract inputs' shards.
    assert d["memory"]["argument"] == sum(d["inputs"].values())
    assert min(d["trace_s"], d["lower_s"], d["compile_s"]) >= 0
  total, layer, _ = _shard_bytes(PALM8, case.layout, mesh)
  fit = r["scaled"]["inputs"]["weights"]
  assert fit["per_layer"] == layer
  assert fit["total"] == total  # scaled to 32 layers, exact
  assert r["held"]["weights"] == total
  assert "scaled to 32 layers" in r["scaling"]


def test_decode_cache_and_collectives(reports):
  out, _, _ = reports
  r = out[sim.Phase.GENERATE]
  # K/V per device: prefix (128) and loop buffer (4 columns) of 8 rows
  # split over the 8 attention shards (yzx), one K/V head of 256, bf16.
  kv = r["scaled"]["inputs"]["kv_cache"]
  assert kv["per_layer"] == 2 * (128 + 4) * 256 * 2
  program = r["scaled"]["program_collectives"]
  # ws_2d: all-gathers and reduce-scatters of the residual stream and the
  # MLP, all-to-alls moving attention to its rows; whole ops per layer.
  for kind in ("all-gather", "reduce-scatter", "all-to-all"):
    per = program[kind]["count"]["per_layer"]
    assert per >= 1 and per == int(per), kind
    assert program[kind]["full_bytes"]["per_layer"] > 0
  # The decode loop's trip count is data-dependent: one step's worth.
  assert all(d["per_iteration"] > 0 for d in r["compiled"])
  assert "per decode step" in r["collectives_note"]
  # XLA:CPU runs bf16 collectives in f32: twice the program's bytes.
  compiled = r["scaled"]["collectives"]["all-gather"]["full_bytes"]
  assert (
    compiled["per_layer"]
    == 2 * program["all-gather"]["full_bytes"]["per_layer"]
  )


def test_weight_gathered_prefill_gathers_every_layer(reports, cpu_devices):
  out, _, mesh = reports
  r = out[sim.Phase.PREFILL]
  gathers = r["scaled"]["program_collectives"]["all-gather"]
  _, shard, whole = _shard_bytes(PALM8, PREFILL.layout, mesh)
  # In a ring each device receives what it lacks of every weight (the
  # whole layer less its shard) and sends as much; the full-size sides
  # add the intermediate results of gathers done in stages.
  assert gathers["moved_bytes"]["per_layer"] == pytest.approx(
    whole - shard, rel=0.001
  )
  assert gathers["full_bytes"]["per_layer"] >= whole
  assert r["scaled"]["outputs"]["kv_cache"]["per_layer"] == 2 * 64 * 256 * 2


def test_planner_comparison(reports):
  out, _, _ = reports
  for r in out.values():
    if r["predicted"] is None:
      pytest.skip("chunkwise.planner is absent")
    rows = {row["quantity"]: row for row in r["comparison"]}
    assert {"weights", "kv_cache", "temp", "total"} <= set(rows)
    # Same weights and cache bytes: only norms, replicated K/V projections
    # and rounding differ.
    assert abs(rows["weights"]["rel_diff"]) < 0.1
    assert abs(rows["kv_cache"]["rel_diff"]) < 0.01
    sent = rows["collectives per layer, bytes sent"]
    assert abs(sent["rel_diff"]) < 0.1
  text = sim_report.table(list(out.values()))
  assert "palm-8b" in text and "per-layer collectives" in text


def test_int8_weights_are_quantized_shapes():
  h = PALM8.replace(layers=1)
  w = sim_trace.abstract_weights(h, sim_trace.WeightFormat.INT8)
  q = w.layers[0].up
  assert isinstance(q, QArray) and q.values.dtype == jnp.int8
  cw.models.check_shapes(h, w)
  plain = sim_trace.abstract_weights(h, sim_trace.WeightFormat.BF16)
  assert not any(isinstance(x, jax.Array) for x in jax.tree.leaves(w))
  assert cw.models.quantized.nbytes(w) < 0.6 * cw.models.quantized.nbytes(plain)


def test_fit_to_mesh_pads_heads_like_the_paper():
  h = cw.configs.get("palm-540b")
  ws = [Layout.parse("ws_2d/yzx")]

  def mesh(shape):
    return AbstractMesh(shape, ("x", "y", "z"))

  padded = sim.fit_to_mesh(h, ws, mesh((4, 4, 4)))
  assert (padded.heads, padded.vocab) == (64, h.vocab)  # 48 -> 64
  assert sim.fit_to_mesh(h, [Layout.parse("wg")], mesh((4, 4, 4))) == h
  big = sim.fit_to_mesh(h, ws, mesh((4, 8, 8)))
  assert (big.heads, big.vocab) == (256, 256_256)


def test_hlo_collectives_count_loops(cpu_devices):
  """A psum in a loop of known trip count runs that many times; in a loop
  whose count depends on data, once per iteration (times None)."""
  mesh = make_mesh((2, 2, 2), cpu_devices[:8])

  def body(x, n):
    x = lax.fori_loop(0, 3, lambda i, x: lax.psum(x, "x") * 0.5, x)
    return lax.while_loop(
      lambda c: c[1] < n, lambda c: (lax.psum(c[0], "y"), c[1] + 1), (x, 0)
    )[0]

  fn = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(P("z"), P()), out_specs=P("z"), check_vma=False
    )
  )
  x = jax.ShapeDtypeStruct(
    (8, 128), jnp.float32, sharding=NamedSharding(mesh, P("z"))
  )
  lowered = fn.lower(x, jax.ShapeDtypeStruct((), jnp.int32))
  for text in (lowered.compile().as_text(), lowered.as_text(dialect="hlo")):
    ops = [o for o in hlo.collectives(text) if o.kind == "all-reduce"]
    assert sorted(o.times or 0 for o in ops) == [0, 3], text
    for o in ops:
      assert o.operand_bytes == o.result_bytes == 4 * 128 * 4
      assert o.group == 2
      assert o.moved_bytes == 2 * o.full_bytes / 2  # 2 (k-1)/k, k = 2


def test_weight_copy_sizes():
  """A bf16 weight converted to f32 before its dot is copied (4 bytes an
  element); an f32 weight read by the dot, and a lookup, are not."""
  x = jnp.ones((4, 256), jnp.float32)

  def text(fn, w):
    return jax.jit(fn).lower(w, x).compile().as_text()

  w16 = jnp.ones((256, 512), jnp.bfloat16)
  w32 = jnp.ones((256, 512), jnp.float32)
  converted = text(lambda w, x: x @ w.astype(jnp.float32), w16)
  assert weight_reads.weight_copy_sizes(converted, 1)[0] == 256 * 512 * 4
  assert weight_reads.weight_copy_sizes(text(lambda w, x: x @ w, w32), 1) == []
  lookup = text(lambda w, x: jnp.take(w, jnp.arange(4), axis=0), w32)
  assert weight_reads.weight_copy_sizes(lookup, 1) == []


@pytest.mark.long
def test_script(tmp_path):
  """scripts/simulate.py on 16 fake devices: the tiny preset (its 8 heads
  padded to 16 for ws_2d), both phases, two layouts, int8 K/V."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out, png = tmp_path / "sim.json", tmp_path / "sim.png"
  run = subprocess.run(
    [
      sys.executable,
      str(ROOT / "scripts" / "simulate.py"),
      "--model=tiny",
      "--devices=16",
      "--mesh=2x2x4",
      "--layouts=ws_2d/yzx,wg",
      "--batch=16",
      "--prefill_len=16",
      "--generate_steps=2",
      "--layers=1,2",
      "--kv_dtype=int8",
      f"--json_out={out}",
      f"--png={png}",
    ],
    capture_output=True,
    text=True,
    check=False,
    cwd=tmp_path,
    env=env,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  assert "per-layer collectives" in run.stdout
  assert "compiled at 1, 2 layers" in run.stdout
  result = json.loads(out.read_text())
  assert result["padded"] == {"heads": [8, 16]}
  assert "xla_force_host_platform_device_count=16" in result["xla_flags"]
  got = {(r["phase"], r["layout"]) for r in result["reports"]}
  assert got == {
    (p, lay)
    for p in ("prefill", "generate")
    for lay in ("ws_2d/yzx/xla", "wg/none/xla")
  }
  for r in result["reports"]:
    assert r["devices"] == 16 and r["mesh"] == [2, 2, 4]
    assert np.isfinite(r["held"]["total"])
    assert r["cache_dtype"] == "int8"
  assert png.stat().st_size > 10_000


def test_full_depth_is_a_least_squares_line_through_every_depth():
  """Two depths give the line through them; more are fitted by least
  squares, so one program's variation moves the slope less than through
  the end points alone; a falling figure is held at its deepest value."""
  two = sim._fit([(2, 10.0), (4, 14.0)], layers=80)
  assert (two["fixed"], two["per_layer"], two["residual"]) == (6.0, 2.0, 0.0)
  assert two["total"] == 6.0 + 80 * 2.0
  # On the line v = 6 + 2 * depth but for the 2-layer program, 1 cheaper:
  # the line through the end points has slope 13/6 (2.17); least squares
  # 2.15, and its figure at 80 layers is nearer the true one.
  points = [(2, 9.0), (4, 14.0), (6, 18.0), (8, 22.0)]
  four = sim._fit(points, layers=80)
  assert four["per_layer"] == pytest.approx(
    np.polyfit(*zip(*points, strict=True), 1)[0]
  )
  assert 2.0 < four["per_layer"] < 13 / 6
  assert abs(four["total"] - (6 + 80 * 2)) < abs(9 + 78 * 13 / 6 - 166)
  assert 0 < four["residual"] < 1.0 and not four["clamped"]
  falling = sim._fit([(2, 5.0), (4, 4.9), (6, 4.8)], layers=80)
  assert falling["clamped"] and falling["per_layer"] == 0.0
  assert falling["total"] == falling["fixed"] == 4.8
