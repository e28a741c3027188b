"""Layouts, rules, the strict resolver, meshes and per-call plans."""

import dataclasses

import jax
import pytest
from jax.sharding import PartitionSpec as P

import chunkwise as cw
from chunkwise.partitioning import Plan, make_mesh, parse_mesh, resolve
from chunkwise.partitioning import axes as ax
from chunkwise.partitioning import plan as plan_lib
from chunkwise.partitioning.rules import data_rules, weight_rules


def test_layout_parse_defaults_and_round_trip():
  lay = cw.Layout.parse("ws_2d")
  assert lay.kind is cw.LayoutKind.WS_2D
  assert lay.attn_batch is cw.AttnBatch.NONE
  assert lay.collectives is cw.Collectives.XLA
  full = cw.Layout.parse("WS_2D/yz/latency")
  assert full == cw.Layout(
    cw.LayoutKind.WS_2D, cw.AttnBatch.YZ, cw.Collectives.LATENCY
  )
  assert cw.Layout.parse(str(full)) == full
  assert str(cw.Layout()) == "reference/none/xla"
  assert cw.AttnBatch.YZX.axes == ("y", "z", "x")


@pytest.mark.parametrize(
  "text, message",
  [
    ("ws_3d", r"unknown kind 'ws_3d'; expected one of reference, ws_1d"),
    ("ws_2d/q", r"unknown attention batch 'q'"),
    ("ws_2d/z/fast", r"unknown collectives 'fast'"),
    ("ws_2d/z/xla/extra", r"kind\[/attn_batch\[/collectives\]\]"),
    ("wg/z", r"applies to ws_1d and ws_2d only"),
    ("reference/none/latency", r"need a sharded layout"),
    (3, r"must be a string"),
  ],
)
def test_layout_parse_errors(text, message):
  with pytest.raises(ValueError, match=message):
    cw.Layout.parse(text)


def test_resolver_is_strict():
  rules = weight_rules(cw.LayoutKind.WS_2D, kv_sharded=True) | data_rules()
  assert resolve(P(ax.LAYERS, ax.EMBED, ax.HEADS, None), rules) == P(
    None, "x", ("y", "z"), None
  )
  with pytest.raises(ValueError, match=r"logical axis 'nonsense'.*no rule"):
    resolve(P("nonsense"), rules)
  with pytest.raises(ValueError, match=r"mesh axis 'y' is used twice"):
    resolve(P(ax.HEADS, ax.MLP), rules)


def test_make_mesh_any_shape_and_errors():
  mesh = make_mesh((2, 1, 4))
  assert mesh.axis_names == ("x", "y", "z")
  assert dict(mesh.shape) == {"x": 2, "y": 1, "z": 4}
  three = make_mesh((1, 1, 3), jax.devices()[:3])
  assert three.devices.size == 3
  with pytest.raises(ValueError, match=r"holds 4 devices but 8 were given"):
    make_mesh((2, 2, 1))
  with pytest.raises(ValueError, match=r"three positive ints"):
    make_mesh((8, 1))
  assert parse_mesh("2x2x2") == (2, 2, 2)
  with pytest.raises(ValueError, match=r"'2x2' must be three positive ints"):
    parse_mesh("2x2")


def test_mesh_that_does_not_divide_names_dimension_size_layout_and_axes():
  h = dataclasses.replace(cw.configs.get("tiny"), heads=6, kv_heads=2)
  model = cw.InferenceModel.random(cw.configs.get("tiny"))
  with pytest.raises(
    ValueError,
    match=r"layout ws_2d/none/xla on mesh 2x2x2: heads = 6 is not divisible "
    r"by mesh axes y·z·x \(size 8\)",
  ):
    plan_lib.check(cw.Layout.parse("ws_2d"), make_mesh((2, 2, 2)), h)
  with pytest.raises(
    ValueError, match=r"d_model = 36 is not divisible by mesh axes x \(size 8\)"
  ):
    plan_lib.check(
      cw.Layout.parse("wg"),
      make_mesh((8, 1, 1)),
      dataclasses.replace(h, heads=8, d_model=36),
    )
  with pytest.raises(ValueError, match=r"vocab = 300 .* x·y·z \(size 8\)"):
    cw.InferenceModel.random(
      dataclasses.replace(cw.configs.get("tiny"), vocab=300),
      mesh=make_mesh((2, 2, 2)),
      layout="ws_1d",
    )
  with pytest.raises(ValueError, match=r"d_ff = 20 is not divisible by"):
    cw.InferenceModel(
      dataclasses.replace(model.hparams, d_ff=20),
      None,
      mesh=make_mesh((2, 2, 2)),
      layout="ws_2d/none/latency",
    )
  with pytest.raises(ValueError, match=r"infer_fn replaces the reference"):
    cw.InferenceModel(
      model.hparams,
      model.weights,
      mesh=make_mesh((2, 2, 2)),
      layout="wg",
      infer_fn=lambda *a: None,
    )


def test_plan_splits_what_divides_and_replicates_small_prefixes():
  h = cw.configs.get("tiny")  # 2 K/V heads: do not divide 4 head shards
  mesh = make_mesh((2, 2, 2))
  lay = cw.Layout.parse("ws_2d/yzx")
  big = Plan.make(lay, mesh, h, batch=8, prefix_batches=(1, 2))
  assert big.attn_batch == ("y", "z", "x")
  assert big.resid_batch == ("z",)
  assert big.rules()[ax.CACHE_BATCH] == ("y", "z", "x")
  # A batch-1 prefix is replicated, not rejected.
  assert big.prefix_rules(1)[ax.CACHE_BATCH] == ()
  small = Plan.make(lay, mesh, h, batch=1)
  assert small.attn_batch == () and small.resid_batch == ()
  # Batch 6 with a batch-3 prefix: only axes whose size divides both.
  odd = Plan.make(lay, mesh, h, batch=6, prefix_batches=(3,))
  assert odd.attn_batch == ()
  wg = Plan.make(cw.Layout.parse("wg"), mesh, h, batch=4)
  assert wg.resid_batch == ("x", "y") and wg.logits_batch == ("x", "y")
  # No attention batch asked for, K/V heads that do not divide: by batch.
  auto = Plan.make(cw.Layout.parse("ws_1d"), mesh, h, batch=8)
  assert auto.kv_axes == () and auto.attn_batch == ("x", "y", "z")
  two = Plan.make(cw.Layout.parse("ws_1d"), make_mesh((2, 1, 4)), h, batch=8)
  assert two.attn_batch == ("x", "z")
  divides = Plan.make(
    cw.Layout.parse("ws_2d"), make_mesh((4, 2, 1)), h, batch=8
  )
  assert divides.kv_axes == ("y", "z") and divides.attn_batch == ()


def test_initialize_multihost_rejects_partial_arguments():
  with pytest.raises(ValueError, match=r"go together"):
    cw.partitioning.initialize_multihost("127.0.0.1:1234")
  with pytest.raises(ValueError, match=r"process_id must be in \[0, 2\)"):
    cw.partitioning.initialize_multihost("127.0.0.1:1", 2, 5)
