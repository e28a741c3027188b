"""Collective matmuls wired into the layouts: shuffled weights carry their
variant, meet no other layout, and are made when a model is built or
loaded; the plan rejects rings and blocks a variant cannot use."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.models import ShuffledWeights
from chunkwise.partitioning import make_mesh
from tests import hf_models


@pytest.fixture(scope="module")
def tiny_weights():
  return cw.InferenceModel.random(cw.configs.get("tiny"), seed=0).weights


def _chunk():
  tokens = jnp.array([[1, 5, 7, 9, 11, 3], [1, 8, 6, 4, 2, 9]], jnp.int32)
  return cw.Chunk(tokens=tokens, lengths=jnp.array([6, 4]))


def test_shuffling_layouts_store_tagged_weights(tiny_weights):
  h = cw.configs.get("tiny")
  mesh = make_mesh((2, 2, 2))
  plain = cw.InferenceModel(h, tiny_weights, mesh=mesh, layout="ws_2d")
  one_way = cw.InferenceModel(
    h, tiny_weights, mesh=mesh, layout="ws_2d/none/one_way"
  )
  latency = cw.InferenceModel(
    h, tiny_weights, mesh=mesh, layout="ws_2d/none/latency"
  )
  assert not isinstance(plain.weights, ShuffledWeights)
  # one_way reads its blocks in a per-device order too: shuffled, and cut
  # into the two pieces its ring of 2 reads one per step.
  assert str(one_way.weights.tag) == "ws_2d/one_way on mesh 2x2x2"
  pieces = one_way.weights.weights.layers[0].q
  assert isinstance(pieces, cw.models.fused.Pieces)
  assert len(pieces.parts) == 2
  assert isinstance(latency.weights, ShuffledWeights)
  assert str(latency.weights.tag) == "ws_2d/latency on mesh 2x2x2"
  # Blocks really moved: the shuffled q differs from the plain one, but
  # holds the same values (a per-device permutation).
  q_plain = np.asarray(plain.weights.layers[0].q)
  q_shuffled = np.asarray(latency.weights.weights.layers[0].q)
  assert not np.array_equal(q_plain, q_shuffled)
  np.testing.assert_array_equal(
    np.sort(q_plain.ravel()), np.sort(q_shuffled.ravel())
  )
  # Shuffled weights given back to the same layout are not shuffled again.
  again = cw.InferenceModel(
    h, latency.weights, mesh=mesh, layout="ws_2d/none/latency"
  )
  want = plain.prefill(_chunk())
  for model in (latency, again):
    got = model.prefill(_chunk())
    np.testing.assert_allclose(
      got.next_token_logits, want.next_token_logits, atol=1e-5
    )


def test_shuffled_weights_refuse_other_layouts(tiny_weights):
  h = cw.configs.get("tiny")
  mesh = make_mesh((2, 2, 2))
  shuffled = cw.InferenceModel(
    h, tiny_weights, mesh=mesh, layout="ws_2d/none/latency"
  ).weights
  match = (
    r"weights shuffled for ws_2d/latency on mesh 2x2x2 cannot run layout "
    r"ws_2d/throughput on mesh 2x2x2"
  )
  with pytest.raises(ValueError, match=match):
    cw.InferenceModel(h, shuffled, mesh=mesh, layout="ws_2d/none/throughput")
  with pytest.raises(ValueError, match=r"cannot run layout ws_2d/xla"):
    cw.InferenceModel(h, shuffled, mesh=mesh, layout="ws_2d")
  with pytest.raises(ValueError, match=r"on mesh 1x2x4"):
    cw.InferenceModel(
      h, shuffled, mesh=make_mesh((1, 2, 4)), layout="ws_2d/none/latency"
    )
  with pytest.raises(ValueError, match=r"cannot run the reference layout"):
    cw.InferenceModel(h, shuffled)


def test_prefill_and_generate_layouts_each_get_their_weights(tiny_weights):
  h = cw.configs.get("tiny")
  model = cw.InferenceModel(
    h,
    tiny_weights,
    cw.ByteVocabulary(),
    mesh=make_mesh((2, 2, 2)),
    prefill_layout="ws_2d/none/throughput",
    generate_layout="ws_1d/none/latency",
  )
  tags = [
    str(e.weights.tag) for e in (model._prefill_engine, model._generate_engine)
  ]
  assert tags == [
    "ws_2d/throughput on mesh 2x2x2",
    "ws_1d/latency on mesh 2x2x2",
  ]
  reference = cw.InferenceModel(h, tiny_weights, cw.ByteVocabulary())
  outs = []
  for m in (model, reference):
    prompt = m.prefill(_chunk())
    tokens, _ = m.generate(
      [prompt],
      sample_ids=np.arange(4),
      steps=6,
      sampling=cw.Sampling(temperature=0.8, seed=1),
    )
    outs.append(np.asarray(tokens.tokens))
  np.testing.assert_array_equal(outs[0], outs[1])


def test_loading_onto_a_shuffling_layout_shuffles(tmp_path):
  path = tmp_path / "m.gguf"
  hf_models.write_gguf(hf_models.tiny("llama", seed=0), path)
  mesh = make_mesh((2, 2, 1), jax.devices()[:4])
  loaded = cw.load(path, mesh=mesh, layout="ws_2d/none/throughput")
  assert str(loaded.weights.tag) == "ws_2d/throughput on mesh 2x2x1"
  reference = cw.load(path)
  chunk = cw.Chunk(
    tokens=jnp.array([[1, 5, 7, 9, 11, 3]], jnp.int32), lengths=jnp.array([6])
  )
  np.testing.assert_allclose(
    loaded.prefill(chunk).per_token_scores[:, 1:],
    reference.prefill(chunk).per_token_scores[:, 1:],
    atol=1e-4,
  )


def _odd_model():
  """Every width divisible by 3 (and by 2 where the mesh needs it)."""
  return cw.configs.get("tiny").replace(
    d_model=48, heads=6, kv_heads=6, d_ff=96, vocab=336
  )


def test_plan_rejects_what_a_variant_cannot_do():
  mesh3 = make_mesh((3, 1, 1), jax.devices()[:3])
  h = _odd_model()
  with pytest.raises(ValueError, match=r"over x, which has odd size 3"):
    cw.InferenceModel.random(h, mesh=mesh3, layout="ws_2d/none/latency")
  with pytest.raises(ValueError, match=r"over x·y·z, which has odd size 3"):
    cw.InferenceModel.random(h, mesh=mesh3, layout="ws_1d/none/latency")
  # one_way and throughput go around odd rings; wg streams on any ring.
  for layout in (
    "ws_2d/none/one_way",
    "ws_2d/none/throughput",
    "wg/none/latency",
  ):
    cw.InferenceModel.random(h, mesh=mesh3, layout=layout)
  odd_blocks = cw.configs.get("tiny").replace(d_ff=24)  # 24 / 8 = 3
  with pytest.raises(
    ValueError, match=r"halve each device's block of d_ff \(24 / y·z·x = 3"
  ):
    cw.InferenceModel.random(
      odd_blocks, mesh=make_mesh((2, 2, 2)), layout="ws_2d/none/throughput"
    )
  with pytest.raises(ValueError, match=r"d_ff = 20 is not divisible by mesh"):
    cw.InferenceModel.random(
      cw.configs.get("tiny").replace(d_ff=20),
      mesh=make_mesh((2, 2, 2)),
      layout="ws_2d",
    )
