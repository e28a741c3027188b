"""DESIGN.md §4 item 10: bad input raises ValueError before device work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw


@pytest.fixture(scope="module")
def model():
  return cw.InferenceModel.random(cw.configs.get("tiny"), seed=0)


@pytest.fixture(scope="module")
def prompt(model):
  return model.prefill(
    cw.Chunk.tokenize(model.vocab, ["ab", "abc"], is_first_chunk=True)
  )


@pytest.fixture
def no_device_work(model, monkeypatch):
  """Any compiled program running during the test fails it."""

  def forbidden(*args, **kwargs):
    raise AssertionError("device work started before validation")

  for engine in (model._prefill_engine, model._generate_engine):
    for name in ("prefill", "init", "run"):
      monkeypatch.setattr(engine, name, forbidden)
  return model


def _gen(model, prefix, **changes):
  args = dict(sample_ids=[0, 1], steps=4, sampling=cw.Sampling())
  args.update(changes)
  return model.generate(prefix, **args)


def test_bad_input_token_ids_outside_vocab(no_device_work):
  model = no_device_work
  for bad in (320, -1):
    chunk = cw.Chunk.from_lists([[1, 5, bad]])
    with pytest.raises(
      ValueError,
      match=f"token id {bad} at row 0, "
      r"position 2 is outside the model's vocabulary "
      r"\[0, 320\)",
    ):
      model.prefill(chunk)
  # Padding positions are not checked: they are never scored.
  chunk = cw.Chunk(
    tokens=np.array([[1, 999]], np.int32), lengths=np.array([1], np.int32)
  )
  with pytest.raises(AssertionError, match="device work"):
    model.prefill(chunk)


def test_padding_may_hold_any_id(model):
  """Out-of-vocabulary padding changes nothing, not even through a prefix."""
  results = []
  for pad in (0, 999, -5000):
    chunk = cw.Chunk(
      tokens=np.array([[1, 50, 60, pad]], np.int32),
      lengths=np.array([3], np.int32),
    )
    first = model.prefill(chunk)
    second = model.prefill(cw.Chunk.from_lists([[70, 71]]), prefix=[first])
    results.append((first, second))
  for first, second in results:
    assert np.isfinite(second.per_token_scores).all()
    np.testing.assert_array_equal(
      first.per_token_scores[:, :3], results[0][0].per_token_scores[:, :3]
    )
    np.testing.assert_array_equal(
      second.per_token_scores, results[0][1].per_token_scores
    )


def test_bad_input_prefix_batch_sizes_do_not_divide(no_device_work, prompt):
  model = no_device_work
  chunk3 = cw.Chunk.from_lists([[5], [6], [7]])
  with pytest.raises(
    ValueError,
    match="prefix\\[0\\] has batch 2, which does not divide the call's batch 3",
  ):
    model.prefill(chunk3, prefix=[prompt])
  with pytest.raises(ValueError, match="does not divide the call's batch 3"):
    _gen(model, [prompt], sample_ids=[0, 1, 2])
  with pytest.raises(ValueError, match="single ChunkResult"):
    model.prefill(chunk3, prefix=prompt)


def test_bad_input_total_length_over_max_len(no_device_work, prompt):
  model = no_device_work
  long = cw.Chunk.from_lists([[5] * 512, [5]])
  with pytest.raises(
    ValueError,
    match=r"row 0 would reach 515 tokens .* "
    "over the model's max_len=512",
  ):
    model.prefill(long, prefix=[prompt])
  with pytest.raises(
    ValueError,
    match="row 1 would reach 514 tokens "
    r"\(prefixes plus 510 steps\)",
  ):
    _gen(model, [prompt], steps=510)


@pytest.mark.parametrize(
  "sampling, message",
  [
    (cw.Sampling(temperature=-0.5), "temperature must be finite and >= 0"),
    (cw.Sampling(temperature=float("nan")), "temperature must not be NaN"),
    (cw.Sampling(temperature=np.array([1.0, np.nan])), "must not be NaN"),
    (cw.Sampling(temperature=np.inf), "temperature must be finite"),
    (cw.Sampling(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (cw.Sampling(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (cw.Sampling(top_k=-1), "top_k must be a non-negative integer"),
    (cw.Sampling(top_k=2.5), "top_k must be a non-negative integer"),
    (cw.Sampling(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (cw.Sampling(seed=-3), r"seed must be an int in \[0, 2\*\*32\)"),
    (
      cw.Sampling(temperature=np.ones(3)),
      r"shape \(2,\) \(one per row\), "
      r"got shape \(3,\)",
    ),
    (cw.Sampling(temperature="hot"), "temperature must be numeric"),
  ],
)
def test_bad_input_sampling(no_device_work, prompt, sampling, message):
  with pytest.raises(ValueError, match=message):
    _gen(no_device_work, [prompt], sampling=sampling)


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(steps=0), "steps must be >= 1, got 0"),
    (dict(steps=2.0), "steps must be an int, got 2.0"),
    (dict(sample_ids=[0, -1]), r"sample_ids contains -1, outside \[0, "),
    (dict(sample_ids=[[0, 1]]), "sample_ids must be a 1-D sequence"),
    (dict(sample_ids=[]), "sample_ids is empty"),
    (dict(stop_ids=[400]), r"stop_ids contains 400, outside \[0, 320\)"),
    (dict(stop_ids=5), r"stop_ids must be a 1-D sequence of ints, got 5"),
    (dict(top_n=-1), r"top_n must be in \[0, 320\], got -1"),
    (dict(sampling=dict(temperature=1)), "must be a chunkwise Sampling"),
  ],
)
def test_bad_input_generate_arguments(no_device_work, prompt, changes, message):
  with pytest.raises(ValueError, match=message):
    _gen(no_device_work, [prompt], **changes)


def test_bad_input_stream_every(no_device_work, prompt):
  with pytest.raises(ValueError, match="every must be >= 1, got 0"):
    no_device_work.generate_stream(
      [prompt], sample_ids=[0, 1], steps=4, sampling=cw.Sampling(), every=0
    )


def test_bad_input_chunk_shapes(no_device_work):
  model = no_device_work
  with pytest.raises(
    ValueError,
    match=r"Chunk.lengths\[1\]=5 is outside "
    r"\[0, 3\]",
  ):
    model.prefill(
      cw.Chunk(
        tokens=np.ones((2, 3), np.int32), lengths=np.array([1, 5], np.int32)
      )
    )
  with pytest.raises(ValueError, match=r"Chunk.lengths must be int\[2\]"):
    model.prefill(
      cw.Chunk(
        tokens=np.ones((2, 3), np.int32), lengths=np.array([1], np.int32)
      )
    )
  with pytest.raises(ValueError, match=r"Chunk\.tokens must be int"):
    model.prefill(
      cw.Chunk(
        tokens=np.ones((2, 3), np.float32), lengths=np.array([1, 1], np.int32)
      )
    )
  with pytest.raises(ValueError, match=r"top_n must be in \[0, 320\]"):
    model.prefill(cw.Chunk.from_lists([[1]]), top_n=321)


def test_bad_mesh_and_layout_are_rejected(model):
  assert model.mesh is None and model.layout == cw.Layout.parse("reference")
  with pytest.raises(ValueError, match=r"mesh must be a jax.sharding.Mesh"):
    cw.InferenceModel(model.hparams, model.weights, mesh="2x2x2")
  with pytest.raises(ValueError, match=r"ws_2d/none/xla .* needs a mesh"):
    cw.InferenceModel(model.hparams, model.weights, layout="ws_2d")
  with pytest.raises(ValueError, match=r"unknown kind 'ws_3d'"):
    cw.InferenceModel(model.hparams, model.weights, layout="ws_3d")


def test_bad_input_prefix_from_another_model(no_device_work):
  other = cw.InferenceModel.random(cw.configs.get("tiny-parallel"))
  foreign = other.prefill(cw.Chunk.from_lists([[1, 2]]))
  with pytest.raises(
    ValueError,
    match="prefix\\[0\\] does not fit this "
    r"model: KV cache \(layers, kv_heads, head_dim\) = "
    r"\(2, 1, 16\)",
  ):
    no_device_work.prefill(cw.Chunk.from_lists([[3]]), prefix=[foreign])


def test_bad_weights_and_ids_at_construction(model):
  h = model.hparams
  with pytest.raises(
    ValueError,
    match=r"weight .layers\[0\].q has shape "
    r"\(64, 8, 16\), expected \(64, 4, 16\)",
  ):
    cw.InferenceModel(h.replace(heads=4), model.weights)
  with pytest.raises(ValueError, match="do not have the structure"):
    cw.InferenceModel(h.replace(tied_embeddings=True), model.weights)
  with pytest.raises(ValueError, match=r"eos_id=999 is outside"):
    cw.InferenceModel(h, model.weights, eos_id=999)
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.weights)
  cw.InferenceModel(h, bf16)  # dtype is free; shapes are what matter
