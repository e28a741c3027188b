"""int8 weights: the quantizer, shape checks, shuffles, and every layout and
collective variant against the single-device int8 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.models import QArray, Weights, check_shapes, fused, quantized
from chunkwise.partitioning import make_mesh


def test_quantize_is_symmetric_per_output_channel():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(2, 8, 3, 4)).astype(np.float32)  # [L, E, H, D]
  w[1, :, 2, 1] = 0.0  # an all-zero channel
  q = quantized.quantize(w, (1,))
  assert q.values.dtype == jnp.int8 and q.scale.shape == (2, 1, 3, 4)
  amax = np.abs(w).max(axis=1, keepdims=True)
  np.testing.assert_allclose(
    q.scale, np.where(amax > 0, amax / 127, 1), rtol=1e-6
  )
  assert np.abs(np.asarray(q.values)).max() == 127
  back = np.asarray(q.astype(jnp.float32))
  assert np.all(np.abs(back - w) <= np.asarray(q.scale) / 2 + 1e-7)
  np.testing.assert_array_equal(back[1, :, 2, 1], 0)


def test_quantize_groups_scale_their_own_inputs():
  """One scale per group of the last contracted axis and per index of
  every other axis (the other contracted ones included)."""
  rng = np.random.default_rng(1)
  w = rng.normal(size=(12, 3, 5)).astype(np.float32)  # [in, heads, out]
  w[4:8, 1, 2] = 0.0  # an all-zero group
  q = quantized.quantize(w, (1, 0), group=4)  # grouped axis 0 (last listed)
  assert q.scale.shape == (3, 3, 5)
  groups = np.abs(w).reshape(3, 4, 3, 5).max(axis=1)
  np.testing.assert_allclose(
    q.scale, np.where(groups > 0, groups / 127, 1), rtol=1e-6
  )
  back = np.asarray(q.astype(jnp.float32))
  scale = np.repeat(np.asarray(q.scale), 4, axis=0)
  assert np.all(np.abs(back - w) <= scale / 2 + 1e-7)
  np.testing.assert_array_equal(back[4:8, 1, 2], 0)
  with pytest.raises(ValueError, match="group size 5 does not divide"):
    quantized.quantize(w, (0,), group=5)


@pytest.mark.parametrize(
  "n, axis, grouped, size",
  [
    (576, "embed", True, 36),  # SmolLM2's d_model
    (1536, "mlp", True, 96),
    (4096, "embed", True, 128),  # capped
    (64, "head_dim", True, 32),  # half a head (throughput halves)
    (200, "embed", True, 200),  # 16 does not divide: one group
    (576, "embed", False, 576),
  ],
)
def test_group_sizes(n, axis, grouped, size):
  assert quantized.group_size(n, axis, grouped=grouped) == size


def test_quantize_weights_covers_every_matmul_weight():
  h = cw.configs.get("tiny")
  w = cw.models.init_random(h, jax.random.key(0))
  q = quantized.quantize_weights(w, Weights.axes(h))
  for name in ("q", "k", "v", "o", "gate", "up", "down"):
    for layer in q.layers:
      assert isinstance(getattr(layer, name), QArray), name
  assert isinstance(q.embedding, QArray) and isinstance(q.unembedding, QArray)
  assert not isinstance(q.layers[0].attn_norm, QArray)
  # Groups: half a head for o, d_model / 16 inputs for the tables.
  assert q.layers[0].o.scale.shape == (h.heads, 2, h.d_model)
  assert q.unembedding.scale.shape == (16, h.vocab)
  assert q.layers[0].down.scale.shape == (16, h.d_model)
  check_shapes(h, q)
  # The tiny preset's groups hold 4-16 inputs, so its f32 scales cost up
  # to as much as the int8 values; SmolLM2's (32-96 inputs) cost 9%.
  ratio = quantized.nbytes(q) / quantized.nbytes(w)
  assert 0.25 < ratio < 0.5
  keep = quantized.quantize_weights(w, Weights.axes(h), embedding=False)
  assert not isinstance(keep.embedding, QArray)
  bad = q.replace(
    layers=(
      q.layers[0].replace(
        q=QArray(values=q.layers[0].q.values, scale=q.layers[0].q.scale[:, :1])
      ),
      *q.layers[1:],
    )
  )
  with pytest.raises(
    ValueError, match=r"int8 weight \.layers\[0\]\.q .* scales"
  ):
    check_shapes(h, bad)


def test_shuffle_and_unshuffle_move_values_and_scales_together():
  h = cw.configs.get("tiny")
  w = cw.models.init_random(h, jax.random.key(1))
  q = quantized.quantize_weights(w, Weights.axes(h))
  mesh = make_mesh((2, 2, 2))
  for layout in ("ws_2d/none/throughput", "ws_1d/none/latency"):
    model = cw.InferenceModel(h, q, mesh=mesh, layout=layout)
    assert isinstance(model.weights, cw.models.ShuffledWeights)
    if layout.startswith("ws_2d"):  # q is cut into its ring pieces
      pieces = model.weights.weights.layers[0].q
      assert isinstance(pieces, fused.Pieces) and len(pieces.parts) == 2
      moved = fused.join(pieces).values
      assert moved.shape == q.layers[0].q.values.shape
      assert not np.array_equal(
        np.asarray(moved), np.asarray(q.layers[0].q.values)
      )
    for a, b in zip(
      jax.tree.leaves(model.plain_weights()), jax.tree.leaves(q), strict=True
    ):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("scale_rows", [1, 2, 4])
def test_pieces_cut_values_and_scales_together(scale_rows):
  """A QArray cut into ring pieces and joined again is unchanged, whether
  its scale is shared along the cut dim (one row) or cut with it (as many
  rows as pieces included)."""
  w = QArray(
    values=jnp.arange(32, dtype=jnp.int8).reshape(8, 4),
    scale=jnp.arange(1, 4 * scale_rows + 1, dtype=jnp.float32).reshape(
      scale_rows, 4
    ),
  )
  pieces = fused.split(w, 0, 2)
  assert pieces.shared == (scale_rows == 1)
  for i, part in enumerate(pieces.parts):
    np.testing.assert_array_equal(part.values, w.values[4 * i : 4 * i + 4])
  back = fused.join(pieces)
  np.testing.assert_array_equal(back.values, w.values)
  np.testing.assert_array_equal(back.scale, w.scale)
  with pytest.raises(ValueError, match="would split a group"):
    fused.split(w.replace(scale=jnp.ones((3, 4))), 0, 2)


@pytest.fixture(scope="module")
def int8_reference():
  h = cw.configs.get("tiny")
  w = cw.models.init_random(h, jax.random.key(2))
  q = quantized.quantize_weights(w, Weights.axes(h))
  model = cw.InferenceModel(h, q, cw.ByteVocabulary())
  return model, _run(model)


def _run(model):
  chunk = cw.Chunk.tokenize(
    model.vocab,
    ["Cows have 4 legs.", "Hello", "xyz", "12"],
    is_first_chunk=True,
  )
  first = model.prefill(chunk, top_n=3)
  tokens, result = model.generate(
    [first],
    sample_ids=np.arange(4),
    steps=5,
    sampling=cw.Sampling(temperature=0.9, seed=4),
  )
  return first, tokens, result


# The CPU kernel multiplies int8 weights by activations rounded to int16
# per group (2^-16 of the group's largest): f32 noise between layouts can
# flip a rounding, so scores agree to ~1e-4, not to f32 noise.
_ATOL = 2e-4


def _int8_grid():
  """Every layout kind with every collective variant, less two that run
  no int8 code another case lacks: wg dequantizes its local shard before
  streaming it alike in one_way and latency, and attention's batch
  sharding (ws_2d/yz) does not change the fused matmuls (ws_2d's)."""
  for kind in ["ws_1d", "ws_2d", "ws_2d/yz", "wg"]:
    for variant in ["xla", "one_way", "latency", "throughput"]:
      if (kind, variant) == ("wg", "latency"):
        continue
      if kind == "ws_2d/yz" and variant != "xla":
        continue
      yield pytest.param(kind, variant, id=f"{kind}-{variant}")


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "variant"), list(_int8_grid()))
def test_int8_every_layout_and_variant(int8_reference, kind, variant):
  reference, (first, tokens, result) = int8_reference
  attn = kind.split("/")[1] if "/" in kind else "none"
  layout = f"{kind.split('/')[0]}/{attn}/{variant}"
  model = cw.InferenceModel(
    reference.hparams,
    reference.weights,
    reference.vocab,
    mesh=make_mesh((2, 2, 2)),
    layout=layout,
  )
  got_first, got_tokens, got_result = _run(model)
  np.testing.assert_allclose(
    got_first.per_token_scores, first.per_token_scores, atol=_ATOL
  )
  np.testing.assert_array_equal(got_first.top_ids, first.top_ids)
  np.testing.assert_array_equal(got_tokens.tokens, tokens.tokens)
  np.testing.assert_array_equal(got_tokens.lengths, tokens.lengths)
  np.testing.assert_allclose(
    got_result.per_token_scores, result.per_token_scores, atol=_ATOL
  )


@pytest.mark.parametrize("tied", [True, False])
def test_grouped_matmul_equals_the_dequantized_one(tied):
  """TPU's int8 matmul (`matmul.grouped`: a dot per scale group of the
  int8 values, then the scales) against `plain` (the weight dequantized
  first) for every weight of the model and the equation it runs in:
  the same sums in another order, so equal to f32 rounding."""
  from chunkwise.models import matmul

  h = cw.configs.get("tiny").replace(
    d_model=256,
    d_ff=512,
    heads=4,
    kv_heads=2,
    head_dim=128,
    tied_embeddings=tied,
  )
  w = quantized.quantize_weights(
    cw.models.init_random(h, jax.random.key(0)), Weights.axes(h)
  )
  layer = w.layers[0]
  x = jax.random.normal(jax.random.key(1), (2, 3, 256), jnp.float32)
  xh = jax.random.normal(jax.random.key(2), (2, 3, 4, 128), jnp.float32)
  xf = jax.random.normal(jax.random.key(3), (2, 3, 512), jnp.float32)
  cases = [
    ("bte,ehd->bthd", x, layer.q),
    ("bte,ehd->bthd", x, layer.k),
    ("bthd,hde->bte", xh, layer.o),
    ("bte,ef->btf", x, layer.gate),
    ("btf,fe->bte", xf, layer.down),
    ("bte,ve->btv", x, w.embedding)
    if tied
    else ("bte,ev->btv", x, w.unembedding),
  ]
  one = x[:1, :1]  # one row: padded to two inside (see `grouped`)
  cases.append(("bte,ef->btf", one, layer.gate))
  for eq, a, q in cases:
    assert isinstance(q, QArray)
    # the grouped axis really is grouped (else the test shows nothing)
    assert any(
      1 < g < n for g, n in zip(q.scale.shape, q.shape, strict=True)
    ), eq
    want = matmul.plain(eq, a, q)
    got = matmul.grouped(eq, a, q)
    np.testing.assert_allclose(
      got, want, rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max())
    )


def test_int8_scales_of_one_head_per_shard_are_gathered():
  """Four K/V heads over wg's four head shards: each shard holds one
  head, so its scales have size 1 there and must still be gathered
  (they are a split axis, not a shared scale)."""
  h = cw.configs.get("tiny").replace(heads=8, kv_heads=4)
  w = cw.models.init_random(h, jax.random.key(3))
  q = quantized.quantize_weights(w, Weights.axes(h))
  reference = cw.InferenceModel(h, q, cw.ByteVocabulary())
  sharded = cw.InferenceModel(
    h,
    q,
    cw.ByteVocabulary(),
    mesh=make_mesh((2, 2, 2)),
    layout="wg/none/xla",
  )
  chunk = cw.Chunk.tokenize(
    reference.vocab, ["Cows have 4"], is_first_chunk=True
  )
  np.testing.assert_allclose(
    sharded.prefill(chunk).per_token_scores,
    reference.prefill(chunk).per_token_scores,
    atol=_ATOL,
  )


def test_quality_against_a_reference_distribution():
  """`quality.against_reference` (compare_llamacpp --quality's measure):
  the model's own distributions are at KL 0 and agree everywhere; a
  flattened copy is not; a reference of the wrong shape is named."""
  from chunkwise.checkpoints import quality

  h = cw.configs.get("tiny")
  model = cw.InferenceModel.random(h, seed=1)
  texts = ["hello there", "a longer text, for a second row"]
  chunks, order = quality._batches(model.vocab, texts)
  own = np.exp(quality._distributions(model, chunks))
  rows = quality.token_rows(model.vocab, texts)
  starts = np.cumsum([0] + [len(rows[t]) - 1 for t in order])
  by_text = {t: own[starts[i] : starts[i + 1]] for i, t in enumerate(order)}
  reference = np.concatenate([by_text[t] for t in range(len(texts))])
  same = quality.against_reference(model, texts, reference)
  assert same["top1_agreement"] == 1.0
  assert same["positions"] == sum(len(r) - 1 for r in rows)
  assert abs(same["mean_kl"]) < 1e-6
  flat = 0.5 * reference + 0.5 / h.vocab
  assert quality.against_reference(model, texts, flat)["mean_kl"] > 1e-3
  with pytest.raises(ValueError, match=r"shape \(3, .*expected"):
    quality.against_reference(model, texts, reference[:3])
