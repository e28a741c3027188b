"""Multi-LoRA: rows of different adapters in one batch equal the merged
model of their adapter, base rows equal the model without adapters, on
one device and on every layout of a 2x2x2 mesh."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.inference.engines.engine import compiled_programs
from chunkwise.models import lora
from chunkwise.partitioning import make_mesh

GREEDY = cw.Sampling(temperature=0.0)
ROWS = ["a", None, "b", "a"]
# Layouts x collective variants on (2, 2, 2): every per-device layer code
# path (weight-stationary 1D and 2D, attention by head and by batch,
# weight-gathered; XLA's collectives and the fused ring forms).
MESH_LAYOUTS = [
  "ws_1d",
  "ws_1d/none/throughput",
  "ws_2d",
  "ws_2d/yzx",
  "ws_2d/z/latency",
  "ws_2d/yz/one_way",
  "ws_2d/none/throughput",
  "wg",
  "wg/none/one_way",
]


def random_adapter(h, rank, seed, targets=lora.TARGETS, scale=0.2):
  rng = np.random.default_rng(seed)
  layers = []
  for _ in range(h.layers):
    pairs = {}
    for t in targets:
      sa, sb = lora.shapes(h, t, rank)
      pairs[t] = (
        (scale * rng.normal(size=sa)).astype(np.float32),
        (scale * rng.normal(size=sb)).astype(np.float32),
      )
    layers.append(pairs)
  return lora.Adapter(rank=rank, layers=tuple(layers), targets=tuple(targets))


def merge(weights, adapter):
  layers = []
  for layer, pairs in zip(weights.layers, adapter.layers, strict=True):
    merged = {
      t: jnp.asarray(lora.merged(np.asarray(getattr(layer, t)), a, b))
      for t, (a, b) in pairs.items()
    }
    layers.append(layer.replace(**merged))
  return weights.replace(layers=tuple(layers))


@functools.cache
def case(preset):
  """(base model, {name: adapter}, served model, merged model per name)."""
  h = cw.configs.get(preset)
  base = cw.InferenceModel.random(h, seed=3)
  adapters = {
    "a": random_adapter(h, 4, 1),
    "b": random_adapter(h, 2, 2, targets=("q", "v", "o", "down")),
  }
  merged = {
    n: cw.InferenceModel(h, merge(base.weights, a), base.vocab)
    for n, a in adapters.items()
  }
  return base, adapters, base.with_adapters(adapters), merged


def prompts(model, batch=4):
  rng = np.random.default_rng(5)
  rows = [
    [model.bos_id, *rng.integers(3, model.hparams.vocab, 3 + 2 * i)]
    for i in range(batch)
  ]
  return cw.Chunk.from_lists(rows)


@pytest.mark.parametrize("preset", ["tiny", "tiny-parallel"])
def test_each_row_equals_its_merged_model(preset):
  base, _, served, merged = case(preset)
  chunk = prompts(base)
  got = served.prefill(chunk, adapters=ROWS, top_n=3)
  assert got.adapters == tuple(ROWS)
  tokens, gen = served.generate(
    [got], sample_ids=np.arange(4), steps=6, sampling=GREEDY, adapters=ROWS
  )
  for r, name in enumerate(ROWS):
    ref = merged[name] if name else base
    want = ref.prefill(chunk, top_n=3)
    mask = np.asarray(chunk.token_mask)[r]
    np.testing.assert_allclose(
      np.asarray(got.per_token_scores)[r][mask],
      np.asarray(want.per_token_scores)[r][mask],
      atol=1e-4,
    )
    np.testing.assert_array_equal(
      np.asarray(got.top_ids)[r][mask], np.asarray(want.top_ids)[r][mask]
    )
    want_tokens, want_gen = ref.generate(
      [want], sample_ids=np.arange(4), steps=6, sampling=GREEDY
    )
    np.testing.assert_array_equal(
      np.asarray(tokens.tokens)[r], np.asarray(want_tokens.tokens)[r]
    )
    np.testing.assert_allclose(
      np.asarray(gen.per_token_scores)[r],
      np.asarray(want_gen.per_token_scores)[r],
      atol=1e-4,
    )


def test_base_rows_are_bit_identical_to_the_model_without_adapters():
  base, _, served, _ = case("tiny")
  chunk = prompts(base)
  got = served.prefill(chunk, adapters=ROWS)
  plain = base.prefill(chunk)
  for r in (1,):
    np.testing.assert_array_equal(
      np.asarray(got.per_token_scores)[r], np.asarray(plain.per_token_scores)[r]
    )
    np.testing.assert_array_equal(
      np.asarray(got.next_token_logits)[r],
      np.asarray(plain.next_token_logits)[r],
    )
  # All-base calls of the served model run the base programs.
  again = served.prefill(chunk)
  assert again.adapters is None
  np.testing.assert_array_equal(
    np.asarray(again.per_token_scores), np.asarray(plain.per_token_scores)
  )


@pytest.mark.parametrize("layout", MESH_LAYOUTS)
def test_every_layout_gives_the_single_device_result(layout, cpu_devices):
  base, adapters, served, _ = case("tiny-parallel")
  chunk = prompts(base, batch=8)
  rows = ["a", None, "b", "a", "b", "b", None, "a"]
  want = served.prefill(chunk, adapters=rows)
  want_tokens, _ = served.generate(
    [want], sample_ids=np.arange(8), steps=4, sampling=GREEDY, adapters=rows
  )
  mesh_model = cw.InferenceModel(
    base.hparams,
    base.weights,
    base.vocab,
    mesh=make_mesh((2, 2, 2)),
    layout=layout,
  ).with_adapters(adapters)
  got = mesh_model.prefill(chunk, adapters=rows)
  mask = np.asarray(chunk.token_mask)
  np.testing.assert_allclose(
    np.asarray(got.per_token_scores)[mask],
    np.asarray(want.per_token_scores)[mask],
    atol=2e-4,
  )
  tokens, _ = mesh_model.generate(
    [got], sample_ids=np.arange(8), steps=4, sampling=GREEDY, adapters=rows
  )
  np.testing.assert_array_equal(
    np.asarray(tokens.tokens), np.asarray(want_tokens.tokens)
  )


def test_a_prefix_serves_only_its_own_adapter():
  base, _, served, _ = case("tiny")
  chunk = prompts(base)
  prefix = served.prefill(chunk, adapters=ROWS)
  with pytest.raises(ValueError, match="row 0 runs the base model but"):
    served.prefill(chunk, prefix=[prefix])
  with pytest.raises(ValueError, match="computed with adapter 'a'"):
    served.generate([prefix], sample_ids=np.arange(4), steps=2, adapters="b")
  # A batch-1 prefix made with "a" serves rows of "a" only.
  one = served.prefill(prompts(base, batch=1), adapters="a")
  served.prefill(chunk, prefix=[one], adapters="a")
  with pytest.raises(ValueError, match="row 1 runs the base model"):
    served.prefill(chunk, prefix=[one], adapters=["a", None, "a", "a"])
  # The base model refuses adapters it does not serve.
  with pytest.raises(ValueError, match=r"unknown adapter 'a'.*with_adapters"):
    base.prefill(chunk, adapters="a")
  with pytest.raises(ValueError, match="unknown adapter 'c'"):
    served.prefill(chunk, adapters=["a", "c", None, None])
  with pytest.raises(ValueError, match="3 entries for a batch of 4"):
    served.prefill(chunk, adapters=["a", None, "b"])
  # concat_results keeps the rows' adapters; mixing them is refused.
  first, second = chunk.split_at(2)
  a = served.prefill(first, adapters=ROWS)
  b = served.prefill(second, prefix=[a], adapters=ROWS)
  assert cw.concat_results([a, b]).adapters == tuple(ROWS)
  with pytest.raises(ValueError, match="different adapters per row"):
    cw.concat_results([a, base.prefill(second, prefix=[base.prefill(first)])])


def test_adapters_that_do_not_fit_are_refused():
  base, adapters, _, _ = case("tiny")
  other = random_adapter(cw.configs.get("tiny-parallel"), 2, 9)
  fit = r"adapter 'x': .* (expected|do not fit)"
  with pytest.raises(ValueError, match=fit):
    base.with_adapters({"x": other})
  with pytest.raises(ValueError, match="non-empty"):
    base.with_adapters({})
  with pytest.raises(ValueError, match="must be a chunkwise Adapter"):
    base.with_adapters({"x": "path/to/adapter"})
  assert set(base.with_adapters(adapters).adapters) == {"a", "b"}
  assert base.adapters == {}


def test_one_more_adapter_in_the_bucket_does_not_recompile():
  base, adapters, _, _ = case("tiny")
  h = base.hparams
  three = {**adapters, "c": random_adapter(h, 3, 4)}
  four = {**three, "d": random_adapter(h, 4, 6, targets=("gate", "up"))}
  chunk = prompts(base)
  first = base.with_adapters(three)
  first.prefill(chunk, adapters=["c", None, "a", "b"])
  engine = first.engines[0]
  before = compiled_programs(engine)
  second = base.with_adapters(four)
  assert lora.bucket(3) == lora.bucket(4) == 4
  # The same targets (q..down) and rank stacks: the program is reused.
  second.prefill(chunk, adapters=["d", "c", None, "a"])
  assert compiled_programs(engine) == before


def test_continuous_batching_runs_each_requests_adapter():
  base, _, served, _ = case("tiny")
  chunk = prompts(base)
  lengths = np.asarray(chunk.lengths)
  requests = [
    cw.Request(
      tokens=np.asarray(chunk.tokens)[i, : lengths[i]].tolist(),
      sample_id=i,
      steps=5,
      sampling=GREEDY,
      adapter=ROWS[i],
    )
    for i in range(4)
  ]
  results = sorted(
    served.generate_many(requests, slots=2), key=lambda r: r.index
  )
  want, _ = served.generate(
    [served.prefill(chunk, adapters=ROWS)],
    sample_ids=np.arange(4),
    steps=5,
    sampling=GREEDY,
    adapters=ROWS,
  )
  for r in results:
    np.testing.assert_array_equal(
      r.tokens, np.asarray(want.tokens)[r.index][: len(r.tokens)]
    )
  with pytest.raises(ValueError, match="unknown adapter 'z'"):
    list(
      served.generate_many(
        [cw.Request(tokens=[1, 2], sample_id=0, steps=2, adapter="z")],
        slots=1,
      )
    )
