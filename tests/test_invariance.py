"""Invariant numerics (DESIGN.md §4.10): a row's logits, scores, top-n and
tokens are bit-identical whatever else shares its batch, however its
context was cut into chunks and prefixes, and whether a position was
computed by a decode step or by a multi-position pass. Every comparison
is `np.array_equal`.

Random compositions are drawn from fixed seeds (several draws per test);
on one device (a grouped-KV tiny model, a tied-embedding one with soft
caps and a sliding window: the n-major unembedding, tanh and window
masks, and int8 weights under numerics "q8"), on a (2,2,2) mesh with the
ws_2d and weight-gathered layouts, and on SmolLM2.
"""

import dataclasses

import jax
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.inference import results
from chunkwise.partitioning import make_mesh

SAMPLINGS = [
  cw.Sampling(temperature=0.0),
  cw.Sampling(temperature=0.9, seed=7),
  cw.Sampling(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=3),
]


def _capped(h):
  return dataclasses.replace(
    h,
    tied_embeddings=True,
    attn_softcap=30.0,
    final_softcap=20.0,
    sliding_window=5,
  )


def _q8():
  """The tiny model's int8 weights under numerics "q8" (activations rounded
  to int8 per block: `cpu_kernels.invariant_matmul`'s act8)."""
  base = cw.InferenceModel.random(cw.configs.get("tiny"), seed=2)
  axes = cw.models.Weights.axes(base.hparams)
  int8 = cw.models.quantized.quantize_weights(base.weights, axes)
  return cw.InferenceModel(base.hparams, int8, numerics="q8")


MODELS = {
  "tiny": lambda: cw.InferenceModel.random(cw.configs.get("tiny"), seed=0),
  "tiny-capped": lambda: cw.InferenceModel.random(
    _capped(cw.configs.get("tiny")), seed=1
  ),
  "tiny-int8-q8": _q8,
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
  return MODELS[request.param]()


@pytest.fixture(scope="module")
def meshes():
  """The tiny model on a (2,2,2) mesh: ws_2d prefill and generate, and a
  weight-gathered prefill feeding ws_2d."""
  base = MODELS["tiny"]()
  mesh = make_mesh((2, 2, 2))
  return {
    name: cw.InferenceModel(
      base.hparams,
      base.weights,
      mesh=mesh,
      prefill_layout=prefill,
      generate_layout="ws_2d/yz",
    )
    for name, prefill in (("ws_2d", "ws_2d/yz"), ("wg", "wg"))
  }


def _chunk(rows, first=True):
  width = max(1, max(len(r) for r in rows))
  tokens = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    tokens[i, : len(r)] = r
  lengths = np.array([len(r) for r in rows], np.int32)
  return cw.Chunk(tokens=tokens, lengths=lengths)


def _row(result, i, n):
  """Row i's first n positions: scores, top-n and the next-token logits."""
  return (
    np.asarray(result.per_token_scores[i, :n]),
    np.asarray(result.top_ids[i, :n]),
    np.asarray(result.top_logprobs[i, :n]),
    np.asarray(result.next_token_logits[i]),
  )


def _equal(got, want, what):
  names = ("scores", "top_ids", "top_lp", "next")
  for g, w, name in zip(got, want, names, strict=False):
    assert np.array_equal(g, w), (
      f"{what}: {name} differ by {np.abs(g - w).max()}"
    )


def _tokens(rng, vocab, n):
  return [1, *rng.integers(3, vocab, n - 1).tolist()]


def _batch_compositions(model, seed, top_n=3, batches=(2, 3, 5, 8, 17)):
  """A row alone against the row at a random index of a random batch of
  other rows of random lengths (so padding widths differ too)."""
  rng = np.random.default_rng(seed)
  vocab = model.hparams.vocab
  row = _tokens(rng, vocab, int(rng.integers(2, 12)))
  alone = model.prefill(_chunk([row]), top_n=top_n)
  want = _row(alone, 0, len(row))
  for batch in rng.choice(batches, min(3, len(batches)), replace=False):
    others = [
      _tokens(rng, vocab, int(rng.integers(1, 20))) for _ in range(batch - 1)
    ]
    at = int(rng.integers(batch))
    rows = [*others[:at], row, *others[at:]]
    got = model.prefill(_chunk(rows), top_n=top_n)
    _equal(_row(got, at, len(row)), want, f"batch {batch} at {at}")


@pytest.mark.parametrize("seed", [0])
def test_prefill_rows_do_not_depend_on_the_batch(model, seed):
  _batch_compositions(model, seed)


def _in_pieces(model, monkeypatch, rows=4, piece=3):
  """The model's prefill with its logits scored `piece` positions at a time
  (`results.PIECE_BYTES`; a fresh model, so traced anew)."""
  monkeypatch.setattr(
    results, "PIECE_BYTES", 4 * rows * model.hparams.vocab * piece
  )
  layouts = {}
  if model.mesh is not None:
    layouts = dict(
      mesh=model.mesh,
      prefill_layout=model.prefill_layout,
      generate_layout=model.generate_layout,
    )
  return cw.InferenceModel(
    model.hparams,
    model.weights,
    bos_id=model.bos_id,
    numerics=model.numerics,
    **layouts,
  )


def _pieces_equal_whole(model, monkeypatch, seed):
  """A long prefill scored in pieces (a piece a loop iteration, the last
  one padded; rows end in different pieces, one is empty) gives the
  whole-logits prefill's bits, and its next-token logits feed a chunk
  after it alike."""
  rng = np.random.default_rng(seed)
  vocab = model.hparams.vocab
  rows = [_tokens(rng, vocab, n) for n in (11, 4, 1, 7)]
  rows[2] = []
  chunk, after = _chunk(rows), _chunk([[5, 6]] * 4, first=False)
  pieces = _in_pieces(model, monkeypatch)
  assert results.piece_length(len(rows), vocab) == 3 < chunk.time
  for m in (model, pieces):
    got = m.prefill(chunk, top_n=2)
    got = (got, m.prefill(after, prefix=[got], top_n=2))
    if m is model:
      want = got
  for i, n in enumerate(len(r) for r in rows):
    for g, w, what in zip(got, want, ("chunk", "after"), strict=True):
      _equal(_row(g, i, n), _row(w, i, n), f"row {i}'s {what}")


def _unscored_equal_scored(model, seed):
  """prefill(scores=False) gives the scored prefill's next-token logits
  and K/V, bit for bit, and NaN scores; a chunk after it scores alike."""
  rng = np.random.default_rng(seed)
  rows = [_tokens(rng, model.hparams.vocab, n) for n in (9, 3, 6)]
  chunk, after = _chunk(rows), _chunk([[4, 7, 2]] * 3, first=False)
  scored = model.prefill(chunk)
  unscored = model.prefill(chunk, scores=False)
  cut = model.with_prefill_chunk(4).prefill(chunk, scores=False)  # 3 pieces
  for got in (unscored, cut):
    assert np.isnan(np.asarray(got.per_token_scores)).all()
    assert got.top_ids.shape == (3, chunk.time, 0)
    assert np.array_equal(got.next_token_logits, scored.next_token_logits)
  for g, w in zip(
    jax.tree.leaves(unscored.kv_cache),
    jax.tree.leaves(scored.kv_cache),
    strict=True,
  ):
    assert np.array_equal(g, w)
  want = model.prefill(after, prefix=[scored], top_n=2)
  for got in (unscored, cut):
    got = model.prefill(after, prefix=[got], top_n=2)
    for i in range(3):
      _equal(_row(got, i, 3), _row(want, i, 3), f"after row {i}")


def test_prefill_in_pieces_is_the_whole_bit_for_bit(model, monkeypatch):
  _pieces_equal_whole(model, monkeypatch, 6)
  _unscored_equal_scored(model, 8)


def _splits(model, seed, top_n=2):
  """prefill(a + b + c) against a, then b after a, then c after both, at
  random cut points; and a one-row prefix broadcast to several rows."""
  rng = np.random.default_rng(seed)
  row = _tokens(rng, model.hparams.vocab, 13)
  whole = model.prefill(_chunk([row]), top_n=top_n)
  cuts = sorted(rng.choice(np.arange(1, 13), 2, replace=False).tolist())
  pieces = [row[: cuts[0]], row[cuts[0] : cuts[1]], row[cuts[1] :]]
  prefix, parts = [], []
  for piece in pieces:
    result = model.prefill(_chunk([piece]), prefix=prefix, top_n=top_n)
    prefix.append(result)
    parts.append(result)
  got = cw.concat_results(parts)
  _equal(_row(got, 0, 13), _row(whole, 0, 13), f"cuts {cuts}")
  # Prefix broadcasting: the first piece (batch 1) serves three rows.
  tails = [pieces[1], row[cuts[0] : cuts[0] + 1], [*pieces[1][:1], 5, 6]]
  shared = model.prefill(_chunk(tails), prefix=prefix[:1], top_n=top_n)
  for i, tail in enumerate(tails):
    alone = model.prefill(_chunk([tail]), prefix=prefix[:1], top_n=top_n)
    _equal(_row(shared, i, len(tail)), _row(alone, 0, len(tail)), f"row {i}")


@pytest.mark.parametrize("seed", [0])
def test_chunk_splits_and_prefix_broadcasting_are_invisible(model, seed):
  _splits(model, seed)


def test_decode_steps_equal_one_multi_position_pass(model):
  """What speculative verification runs: N generated tokens, prefilled
  again as one chunk after the same prefix, score and rank exactly as the
  decode steps did (greedy: each is the pass's top-1)."""
  rng = np.random.default_rng(5)
  prompt = model.prefill(_chunk([_tokens(rng, model.hparams.vocab, 6)]))
  tokens, steps = model.generate(
    prefix=[prompt],
    sample_ids=np.arange(1),
    steps=9,
    sampling=SAMPLINGS[0],
    top_n=3,
  )
  n = int(tokens.lengths[0])
  again = model.prefill(
    cw.Chunk(tokens=tokens.tokens[:, :n], lengths=tokens.lengths),
    prefix=[prompt],
    top_n=3,
  )
  _equal(_row(again, 0, n)[:3], _row(steps, 0, n)[:3], "verify pass")
  assert np.array_equal(
    np.asarray(again.top_ids[0, 1:n, 0]), np.asarray(tokens.tokens[0, 1:n])
  )


def _generate_compositions(model, seed):
  """A sampled row generated alone against the same row (same sample id)
  among other rows with other prompts and sampling settings."""
  rng = np.random.default_rng(seed)
  vocab = model.hparams.vocab
  row = _tokens(rng, vocab, 5)
  for sampling in SAMPLINGS:
    prefix = model.prefill(_chunk([row]))
    want_tokens, want = model.generate(
      prefix=[prefix],
      sample_ids=np.array([11]),
      steps=8,
      sampling=sampling,
      top_n=2,
    )
    batch = int(rng.choice([2, 3, 6]))
    at = int(rng.integers(batch))
    rows = [_tokens(rng, vocab, int(rng.integers(1, 9))) for _ in range(batch)]
    rows[at] = row
    ids = rng.integers(0, 100, batch)
    ids[at] = 11
    others = cw.Sampling(
      temperature=np.where(np.arange(batch) == at, sampling.temperature, 1.0),
      top_k=np.where(np.arange(batch) == at, sampling.top_k, 5),
      top_p=np.where(np.arange(batch) == at, sampling.top_p, 0.5),
      min_p=np.where(np.arange(batch) == at, sampling.min_p, 0.0),
      seed=sampling.seed,
    )
    tokens, got = model.generate(
      prefix=[model.prefill(_chunk(rows))],
      sample_ids=ids,
      steps=8,
      sampling=others,
      top_n=2,
    )
    n = int(want_tokens.lengths[0])
    assert int(tokens.lengths[at]) == n
    assert np.array_equal(tokens.tokens[at, :n], want_tokens.tokens[0, :n])
    _equal(_row(got, at, n)[:3], _row(want, 0, n)[:3], f"{sampling} at {at}")


def test_generated_rows_do_not_depend_on_the_batch(model):
  _generate_compositions(model, 0)


def test_generate_many_slots_are_bit_identical_to_alone(model):
  rng = np.random.default_rng(2)
  vocab = model.hparams.vocab
  requests = [
    cw.Request(
      tokens=_tokens(rng, vocab, int(rng.integers(1, 7))),
      sample_id=i,
      steps=int(rng.choice([3, 7])),
      sampling=SAMPLINGS[i % 3],
    )
    for i in range(5)
  ]
  want = {}
  for i, r in enumerate(requests):
    prefix = model.prefill(_chunk([r.tokens]))
    tokens, result = model.generate(
      prefix=[prefix],
      sample_ids=np.array([r.sample_id]),
      steps=r.steps,
      sampling=r.sampling,
      top_n=2,
    )
    n = int(tokens.lengths[0])
    want[i] = (
      np.asarray(tokens.tokens[0, :n]),
      np.asarray(result.per_token_scores[0, :n]),
    )
  for slots in (1, 3):
    for got in model.generate_many(requests, slots=slots, top_n=2):
      tokens, scores = want[got.index]
      assert np.array_equal(got.tokens, tokens), (slots, got.index)
      assert np.array_equal(got.per_token_scores, scores), (slots, got.index)


@pytest.mark.parametrize("layout", ["ws_2d", "wg"])
def test_on_a_mesh(meshes, layout, monkeypatch):
  model = meshes[layout]
  # Two batch sizes (each a program of its own on the mesh), neither a
  # multiple of its devices; the single-device tests draw three.
  _batch_compositions(model, 3, top_n=2, batches=(3, 17))
  if layout == "ws_2d":  # chunk splits read the cache alike in every layout
    _splits(model, 4)
  _generate_compositions(model, 5)
  _pieces_equal_whole(model, monkeypatch, 7)
  _unscored_equal_scored(model, 9)


def test_fast_numerics_stay_available_and_names_are_checked(tiny):
  fast = cw.InferenceModel(
    tiny.hparams, tiny.weights, tiny.vocab, bos_id=tiny.bos_id, numerics="fast"
  )
  assert fast.numerics == "fast" and tiny.numerics == "invariant"
  chunk = _chunk([[1, 5, 9, 11]])
  a, b = fast.prefill(chunk), tiny.prefill(chunk)
  np.testing.assert_allclose(a.per_token_scores, b.per_token_scores, atol=1e-5)
  with pytest.raises(ValueError, match=r"top_n=2 .*scores=False"):
    tiny.prefill(chunk, top_n=2, scores=False)
  with pytest.raises(TypeError, match="scores='no' must be True or False"):
    tiny.prefill(chunk, scores="no")
  names = r"numerics='exact'.*invariant, fast, q8"
  with pytest.raises(ValueError, match=names):
    cw.InferenceModel(tiny.hparams, tiny.weights, numerics="exact")
  # int8 weights stay fast unless asked (their invariant prefill is slower).
  int8 = cw.models.quantized.quantize_weights(
    tiny.weights, cw.models.Weights.axes(tiny.hparams)
  )
  assert cw.InferenceModel(tiny.hparams, int8).numerics == "fast"
  asked = cw.InferenceModel(tiny.hparams, int8, numerics="invariant")
  assert asked.numerics == "invariant"


@pytest.mark.slow
@pytest.mark.long
def test_smollm2_rows_splits_and_steps():
  """SmolLM2 (30 f32 layers, tied 49152-word unembedding): a row among 16
  others, and its decode steps against one pass. (Its chunk splits and a
  prefix shared by a batch are bit for bit tests/test_smollm2.py's
  test_chunk_split_invariance and test_batch_packing_invariance.)"""
  smol = cw.load("smollm2-135m")
  assert smol.numerics == "invariant"
  _batch_compositions(smol, 6, top_n=3, batches=(17,))
  test_decode_steps_equal_one_multi_position_pass(smol)
  jax.clear_caches()
