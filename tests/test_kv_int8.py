"""int8 K/V (`kv_dtype="int8"`, `models.kv_int8`): the packing, every path
that writes or reads it against `generate` alone, a mesh, the jobs, the
server and the planner (the in-place read of int8 pages under fast
numerics: tests/test_paged_kv.py; SmolLM2's quality against f32 K/V:
tests/test_smollm2.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.models import kv_int8
from chunkwise.partitioning import make_mesh
from tests.test_paged_kv import _alone, _requests


def test_packing_rounds_each_vector_by_its_own_scale():
  """A key with one channel 100 times the others: rotated, each vector
  keeps its own scale (max |Hx| / 127), reads back within half a step of
  it per element, and a zero vector reads back zero. Packed int8 passes
  through a second encode; other dtypes are casts."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(5, 3, 64)).astype(np.float32)
  x[..., 7] *= 100.0
  x[0, 0] = 0.0
  packed = kv_int8.encode(jnp.asarray(x), "int8")
  assert packed.dtype == jnp.int8 and packed.shape == (5, 3, 68)
  assert kv_int8.encode(packed, "int8") is packed
  rotated = np.asarray(kv_int8.rotate(jnp.asarray(x)))
  step = np.abs(rotated).max(-1, keepdims=True) / 127
  back = np.asarray(kv_int8.decode(packed))
  assert np.all(np.abs(back - rotated) <= step / 2 + 1e-6)
  assert not back[0, 0].any()
  # In the original space the error is far below the outlier's step.
  plain = np.asarray(kv_int8.rotate(jnp.asarray(back)))
  per_vector = np.abs(x).max(-1, keepdims=True) / 127
  assert np.abs(plain - x).max() < 0.25 * per_vector.max()
  assert kv_int8.bytes_per_vector(64, "int8") == 68
  assert kv_int8.bytes_per_vector(64, "bfloat16") == 128
  assert kv_int8.encode(jnp.asarray(x), "bfloat16").dtype == jnp.bfloat16


@pytest.fixture(scope="module")
def int8(tiny):
  """`tiny`'s weights with int8 K/V."""
  return cw.InferenceModel.random(tiny.hparams, seed=0, kv_dtype="int8")


@pytest.fixture(scope="module")
def alone8(int8):
  requests = _requests(int8.hparams.vocab)
  return requests, [_alone(int8, r) for r in requests]


def test_a_context_cut_anywhere_reads_the_same_int8(tmp_path, tiny, int8):
  """The chunk's own K/V are read as stored: a prompt prefilled whole or in
  two chunks scores bit for bit alike; the caches are packed int8, save
  and load with an int8 model (not an f32 one), and the scores are not
  f32 K/V's."""
  rng = np.random.default_rng(3)
  tokens = rng.integers(3, tiny.hparams.vocab, (2, 24)).tolist()
  whole = int8.prefill(cw.Chunk.from_lists(tokens))
  first = int8.prefill(cw.Chunk.from_lists([t[:10] for t in tokens]))
  rest = int8.prefill(cw.Chunk.from_lists([t[10:] for t in tokens]), [first])
  assert whole.kv_cache.k.dtype == jnp.int8
  assert whole.kv_cache.k.shape[-1] == tiny.hparams.head_dim + 4
  np.testing.assert_array_equal(
    np.asarray(rest.per_token_scores),
    np.asarray(whole.per_token_scores)[:, 10:],
  )
  cw.save(whole, tmp_path / "whole")
  back = cw.load_result(tmp_path / "whole", int8)
  np.testing.assert_array_equal(
    np.asarray(back.kv_cache.k), np.asarray(whole.kv_cache.k)
  )
  with pytest.raises(ValueError, match="shape"):
    cw.load_result(tmp_path / "whole", tiny)
  f32 = np.asarray(tiny.prefill(cw.Chunk.from_lists(tokens)).per_token_scores)
  diff = np.abs(f32[:, 1:] - np.asarray(whole.per_token_scores)[:, 1:])
  assert 0 < diff.max() < 0.1
  # A prefix of the other dtype is read in the reader's space: an f32
  # prefix rotated into an int8 model's, an int8 one rotated back.
  rest_chunk = cw.Chunk.from_lists([t[10:] for t in tokens])
  f32_first = tiny.prefill(cw.Chunk.from_lists([t[:10] for t in tokens]))
  for model, prefix in ((int8, f32_first), (tiny, first)):
    mixed = np.asarray(model.prefill(rest_chunk, [prefix]).per_token_scores)
    assert np.abs(mixed - f32[:, 10:]).max() < 0.1


@pytest.mark.long  # covered by others: run with --long
def test_slots_pages_prefix_cache_and_pieces_equal_generate_alone(
  monkeypatch, int8, alone8
):
  """The continuous-batching contract with int8 K/V: eight requests
  through fixed slots (two also with speculation drafted by the int8
  draft, its scratch buffer int8 K/V too), then four longer ones through 4
  slots over a pool of 5 pages with a prefix cache and prompts prefilled
  in pieces of 8 (chunked prefill): every request bit for bit `generate`
  alone (the drafted ones: the same tokens)."""
  from chunkwise.inference.paging import prefix_cache as pc

  requests, want = alone8
  fixed = {r.index: r for r in int8.generate_many(requests, slots=4, every=8)}
  drafted = {
    r.index: r.tokens
    for r in int8.generate_many(
      requests[:2],
      slots=2,
      every=8,
      speculation=cw.Speculation(drafter="draft", k=3),
    )
  }
  monkeypatch.setattr(pc, "PAGE", 8)
  shared = [
    cw.Request(
      tokens=requests[0].tokens * 3 + r.tokens,
      sample_id=r.sample_id,
      steps=r.steps,
      sampling=r.sampling,
    )
    for r in requests[:4]
  ]
  events = []
  paged = {
    r.index: r
    for r in int8.with_prefill_chunk(8).generate_many(
      shared,
      slots=4,
      every=8,
      kv_pages=5,
      prefix_cache_bytes=1 << 20,
      trace=lambda e, v: events.append(e),
    )
  }
  for i, (tokens, scores) in enumerate(want):
    np.testing.assert_array_equal(fixed[i].tokens, tokens, err_msg=str(i))
    np.testing.assert_array_equal(fixed[i].per_token_scores, scores)
    if i in drafted:
      np.testing.assert_array_equal(drafted[i], tokens, err_msg=str(i))
  for i, r in enumerate(shared):
    tokens, scores = _alone(int8, r)
    np.testing.assert_array_equal(paged[i].tokens, tokens, err_msg=str(i))
    np.testing.assert_array_equal(paged[i].per_token_scores, scores)
  assert "preempted" in events


def test_int8_kv_on_a_mesh_matches_one_device(cpu_devices, int8):
  """ws_2d over 2x2x2 devices (K/V heads and rows sharded, packed int8):
  prefill scores and greedy tokens match the single-device int8 model."""
  sharded = cw.InferenceModel.random(
    int8.hparams,
    seed=0,
    mesh=make_mesh((2, 2, 2)),
    layout="ws_2d",
    kv_dtype="int8",
  )
  rng = np.random.default_rng(5)
  chunk = cw.Chunk.from_lists(
    rng.integers(3, int8.hparams.vocab, (4, 12)).tolist()
  )
  outs = []
  for model in (int8, sharded):
    first = model.prefill(chunk)
    assert first.kv_cache.k.dtype == jnp.int8
    tokens, _ = model.generate(
      [first],
      sample_ids=np.arange(4),
      steps=8,
      sampling=cw.Sampling(temperature=0.0),
    )
    outs.append((np.asarray(first.per_token_scores), tokens.to_lists()))
  np.testing.assert_allclose(outs[0][0], outs[1][0], atol=1e-4)
  assert outs[0][1] == outs[1][1]


def test_bad_kv_dtypes_are_refused_before_any_work(tmp_path):
  from chunkwise import jobs

  h = cw.configs.get("tiny")
  with pytest.raises(ValueError, match="kv_dtype='int4' is not a K/V dtype"):
    cw.InferenceModel.random(h, kv_dtype="int4")
  with pytest.raises(ValueError, match="disagree"):
    cw.InferenceModel.random(h, kv_dtype="int8", cache_dtype="bfloat16")
  with pytest.raises(ValueError, match="kv_dtype='fp8'"):
    cw.load(str(tmp_path / "missing"), kv_dtype="fp8")
  with pytest.raises(ValueError, match="disagree"):
    cw.load(str(tmp_path / "missing"), kv_dtype="int8", cache_dtype="float32")
  with pytest.raises(ValueError, match="custom infer_fn"):
    cw.InferenceModel.random(h, kv_dtype="int8", infer_fn=lambda *a: None)
  with pytest.raises(ValueError, match="kv_dtype='fp8'"):
    jobs.ModelConfig(kv_dtype="fp8")


@pytest.mark.long  # covered by others: run with --long
def test_generation_job_and_server_with_int8_kv(tmp_path, int8, alone8):
  """`--kv_dtype=int8` through the generation job (with and without a
  pool: byte for byte alike, and not the f32 job's bytes) and a server
  engine whose greedy streams equal `generate` alone."""
  from chunkwise import jobs, serving
  from chunkwise.jobs import model_flags

  prompts = tmp_path / "prompts.txt"
  prompts.write_text("".join(f"Item {i}: {'so ' * i}.\n" for i in range(4)))
  outputs = []
  for kv_dtype, pages in (("int8", 0), ("int8", 5), (None, 0)):
    out = tmp_path / f"out-{kv_dtype}-{pages}.jsonl"
    jobs.run_generate(
      jobs.GenerateJob(
        input=str(prompts),
        output=str(out),
        model=jobs.ModelConfig(name="random:tiny", kv_dtype=kv_dtype),
        steps=16,
        slots=4,
        sampling=cw.Sampling(temperature=0.9, seed=1),
        kv_pages=pages,
        progress=False,
      )
    )
    outputs.append(out.read_bytes())
  assert outputs[0] == outputs[1] != outputs[2]
  assert outputs[0].count(b"\n") == 4
  assert "kv_dtype" in model_flags.ModelFlags.__doc__

  requests, _ = alone8
  engine = serving.Engine(int8, slots=4, capacity=128, every=4, warm_up=False)
  try:
    greedy = [r for r in requests if r.sampling.temperature == 0.0]
    streams = [
      engine.submit(
        serving.Generation(
          prompt=[int8.bos_id, *r.tokens],
          max_new_tokens=r.steps,
          temperature=0.0,
        )
      )
      for r in greedy
    ]
    for r, s in zip(greedy, streams, strict=True):
      got = list(s)  # an EOS that ends a stream is not `generate`'s
      if s.finish_reason != "length" and got and got[-1].special:
        got = got[:-1]
      got = [t.id for t in got]
      alone = cw.Request(
        tokens=[int8.bos_id, *r.tokens],
        sample_id=0,
        steps=r.steps,
        sampling=cw.Sampling(temperature=0.0),
      )
      assert got == _alone(int8, alone)[0].tolist()
  finally:
    engine.close()


def test_planner_counts_int8_kv_bytes():
  """The planner's K/V memory: int8 holds (head_dim + 4) bytes per head
  and token, 68/256 of f32's for SmolLM2."""
  from chunkwise.planner import costs

  h = cw.configs.get("smollm2-135m")
  kw = dict(phase="generate", batch=16, tokens=1, context=4096)
  f32, i8 = (
    costs.estimate(
      h, "tpu-v4", (1, 1, 1), "reference", cache_dtype=d, **kw
    ).kv_bytes
    for d in ("f32", "int8")
  )
  assert i8 / f32 == pytest.approx(68 / 256)
