"""The architectures users bring (Llama 3.1+, Qwen2.5, Gemma 2/3, Phi-3,
Mistral) against transformers: tiny random models of each, saved as
safetensors, give transformers' logits on a padded batch and across a
prefix split, the same greedy tokens for 32 steps past their sliding
window and pretraining context, and the same results on every layout."""

import functools
import json

import numpy as np
import pytest
import torch
import transformers

import chunkwise as cw
from chunkwise.configs import RopeScaling
from chunkwise.inference import transformer_infer
from chunkwise.partitioning import make_mesh
from tests import hf_models
from tests.test_layouts import _assert_same, _scenario

_RNG = np.random.default_rng(0)
# Longer than every window (8) and pretraining context (16).
ROWS = [[1, *_RNG.integers(3, 127, n - 1).tolist()] for n in (40, 23, 33)]
ATOL = 1e-4


@functools.cache
def _saved(name):
  """(directory of a tiny model's safetensors, chunkwise's model of it)."""
  import tempfile

  directory = tempfile.mkdtemp(prefix=f"arch-{name}-")
  hf_models.tiny_architecture(name, seed=3).save_pretrained(directory)
  return directory, cw.load(directory)


def _pair(name):
  """(transformers model, chunkwise model) of the same weights. The
  transformers model is fresh on every call: its "dynamic" RoPE keeps the
  longest sequence it has seen, so a shared one would depend on test
  order."""
  directory, model = _saved(name)
  reference = transformers.AutoModelForCausalLM.from_pretrained(
    directory, dtype=torch.float32
  ).eval()
  return reference, model


def _scores(logits, rows):
  """transformers' log-probability of each next token, per row."""
  out = []
  for b, row in enumerate(rows):
    lp = torch.log_softmax(torch.tensor(logits[b, : len(row) - 1]), -1)
    out.append(lp.numpy()[np.arange(len(row) - 1), row[1:]])
  return out


@pytest.mark.parametrize("name", sorted(hf_models.ARCHITECTURES))
def test_matches_transformers_on_a_padded_batch_and_a_prefix_split(name):
  reference, model = _pair(name)
  want = hf_models.logits(reference, ROWS)
  chunk = cw.Chunk.from_lists(ROWS)
  got = np.asarray(
    transformer_infer(model.hparams, model.weights, (), chunk).logits
  )
  for b, row in enumerate(ROWS):
    np.testing.assert_allclose(
      got[b, : len(row)], want[b, : len(row)], rtol=0, atol=ATOL
    )
  # The same rows in two calls: the second attends to the first's cache,
  # its window reaching back into it (transformers with its cache does the
  # same: one call's length sets dynamic and longrope frequencies).
  want = hf_models.split_logits(_pair(name)[0], ROWS, 12)
  head, tail = chunk.split_at(12)
  first = model.prefill(head)
  second = model.prefill(tail, prefix=[first])
  scores = np.concatenate(
    [np.asarray(first.per_token_scores), np.asarray(second.per_token_scores)],
    axis=1,
  )
  for b, (row, expect) in enumerate(
    zip(ROWS, _scores(want, ROWS), strict=True)
  ):
    np.testing.assert_allclose(
      scores[b, 1 : len(row)], expect, rtol=0, atol=ATOL
    )
  np.testing.assert_allclose(
    second.next_token_logits[0], want[0, len(ROWS[0]) - 1], rtol=0, atol=ATOL
  )


@pytest.mark.parametrize("name", sorted(hf_models.ARCHITECTURES))
def test_greedy_tokens_match_transformers_past_the_window(name):
  """A 20-token prompt: already past the pretraining context (16), so
  longrope does not switch factors mid-generation (transformers' generate
  then recomputes Phi-3's cache, which chunkwise's prefixes never do: see
  `chunkwise.models.rope`)."""
  reference, model = _pair(name)
  prompt = ROWS[1][:20]
  with torch.no_grad():
    out = reference.generate(
      torch.tensor([prompt]),
      max_new_tokens=32,
      do_sample=False,
      eos_token_id=None,
      pad_token_id=0,
    )
  want = out[0, len(prompt) :].numpy()
  assert len(want) == 32
  prefix = model.prefill(cw.Chunk.from_lists([prompt]))
  tokens, _ = model.generate(
    [prefix],
    sample_ids=[0],
    steps=32,
    sampling=cw.Sampling(temperature=0.0),
    stop_ids=(),
  )
  got = np.asarray(tokens.tokens[0, : int(tokens.lengths[0])])
  n = len(got)  # the model's own EOS (if any) ends it early
  assert n >= 16, got
  np.testing.assert_array_equal(got, want[:n])


# Every feature at once, on shapes every layout of 8 devices divides.
EVERYTHING = cw.configs.get("tiny").replace(
  layers=4,
  sliding_window=5,
  sliding_layers=(0, 2),
  local_rope_base=100.0,
  rotary_dim=12,
  rope_scaling=RopeScaling(
    kind="longrope",
    original_max_len=12,
    factor=4.0,
    short_factors=(1.0, 1.2, 1.5, 2.0, 2.5, 3.0),
    long_factors=(1.0, 2.0, 3.0, 4.0, 6.0, 8.0),
  ),
  query_scale=0.2,
  attn_softcap=5.0,
  final_softcap=8.0,
  embed_scale=8.0,
  post_norms=True,
  qk_norm=True,
)


@functools.cache
def _everything_reference():
  return _scenario(cw.InferenceModel.random(EVERYTHING, seed=0))


@pytest.mark.parametrize(
  "layout",
  [
    "ws_1d",
    "ws_2d/yz",
    "wg",
    "ws_2d",
    "ws_2d/yzx",
    "ws_2d/yz/throughput",
  ],
)
def test_every_layout_runs_every_feature(layout):
  model = cw.InferenceModel.random(
    EVERYTHING, seed=0, mesh=make_mesh((2, 2, 2)), layout=layout
  )
  _assert_same(_scenario(model), _everything_reference())


def test_a_prefix_older_than_the_window_is_masked():
  """With a window of 5 in both layers, a token reaches back 2 x 4
  positions (a layer's window, then the window of what it attends to): a
  prefix further behind has no effect on later tokens (in prefill and in
  the generate loop), while the same model without a window sees it."""
  h = cw.configs.get("tiny").replace(sliding_window=5)
  model = cw.InferenceModel.random(h, seed=0)
  plain = cw.InferenceModel(h.replace(sliding_window=None), model.weights)
  old = [[1, 10, 11, 12], [1, 13, 14, 15]]
  other = [[1, 90, 91, 92], [1, 93, 94, 95]]
  middle = cw.Chunk.from_lists([[20, 21, 22, 23, 24, 25, 26, 27, 28]] * 2)
  last = cw.Chunk.from_lists([[30, 31, 32]] * 2)

  def run(m, first):
    a = m.prefill(cw.Chunk.from_lists(first))
    b = m.prefill(middle, prefix=[a])
    c = m.prefill(last, prefix=[a, b])
    tokens, _ = m.generate(
      [a, b, c],
      sample_ids=[0, 1],
      steps=6,
      sampling=cw.Sampling(temperature=0.0),
    )
    return np.asarray(c.per_token_scores), np.asarray(tokens.tokens)

  same = run(model, old), run(model, other)
  np.testing.assert_array_equal(same[0][0], same[1][0])
  np.testing.assert_array_equal(same[0][1], same[1][1])
  seen = run(plain, old), run(plain, other)
  assert np.abs(seen[0][0] - seen[1][0]).max() > 1e-3


def test_architecture_hparams_survive_save_and_load(tmp_path):
  model = cw.InferenceModel.random(EVERYTHING, seed=1)
  path = cw.save(model, tmp_path / "everything")
  meta = json.loads((tmp_path / "everything" / "chunkwise.json").read_text())
  assert meta["hparams"]["rope_scaling"]["kind"] == "longrope"
  loaded = cw.load(path)
  assert loaded.hparams == EVERYTHING
  chunk = cw.Chunk.from_lists([[1, 5, 6, 7, 8, 9, 10, 11]])
  np.testing.assert_array_equal(
    loaded.prefill(chunk).per_token_scores,
    model.prefill(chunk).per_token_scores,
  )


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(model_type="mixtral"), "model_type='mixtral' is not supported"),
    (dict(model_type="gemma3"), "model_type='gemma3' is not supported"),
    (dict(model_type="deepseek_v3"), "model_type='deepseek_v3'"),
    (dict(attention_bias=True), "attention_bias=true is not supported"),
    (dict(mlp_bias=True), "mlp_bias=true is not supported"),
    (
      dict(rope_parameters=dict(rope_type="mrope", rope_theta=1e4)),
      "RoPE scaling 'mrope' is not supported",
    ),
    (dict(partial_rotary_factor=0.01), "partial_rotary_factor=0.01"),
    (dict(layer_types=["chunked_attention"] * 4), "layer_types holds"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (
      dict(
        rope_parameters=dict(
          rope_type="longrope",
          rope_theta=1e4,
          short_factor=[1.0] * 3,
          long_factor=[1.0] * 3,
          original_max_position_embeddings=16,
        )
      ),
      "short_factor has 3 entries, expected 8",
    ),
  ],
)
def test_what_chunkwise_would_compute_differently_is_refused(
  change, message, tmp_path
):
  reference, _ = _pair("mistral-window")
  reference.save_pretrained(tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    cw.load(tmp_path)


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(rotary_dim=7), "rotary_dim=7 must be an even int"),
    (dict(sliding_layers=(0,)), "sliding_layers needs a sliding_window"),
    (dict(sliding_window=4, sliding_layers=(9,)), "sliding_layers=\\(9,\\)"),
    (dict(attn_softcap=-1.0), "attn_softcap must be > 0"),
    (
      dict(rope_scaling=dict(kind="llama3", factor=8.0)),
      "needs original_max_len",
    ),
    (dict(rope_scaling=dict(kind="nonesuch")), "kind='nonesuch'"),
    (
      dict(rope_scaling=dict(kind="factors", short_factors=(1.0,) * 3)),
      "has 3 factors, expected rotary width / 2 = 8",
    ),
  ],
)
def test_hparams_name_bad_architecture_fields(fields, message):
  with pytest.raises(ValueError, match=message):
    cw.configs.get("tiny").replace(**fields)


# llama.cpp has no "dynamic" RoPE and runs Mistral as llama (no window);
# Gemma files carry no query_pre_attn_scalar (1/sqrt(head_dim) is used).
GGUF_ARCHITECTURES = {
  "llama-3.1": {},
  "llama-linear": {},
  "qwen2-yarn": {},
  "phi3-longrope": {},
  "phi3-partial-rotary": {},
  "gemma2": dict(query_pre_attn_scalar=16),
  "gemma3": dict(query_pre_attn_scalar=16),
}


@pytest.mark.parametrize("name", sorted(GGUF_ARCHITECTURES))
def test_gguf_written_as_llama_cpp_does_matches_transformers(name, tmp_path):
  reference = hf_models.tiny_architecture(
    name, seed=5, **GGUF_ARCHITECTURES[name]
  )
  path = tmp_path / f"{name}.gguf"
  hf_models.write_gguf_architecture(reference, path)
  model = cw.load(path)
  want = hf_models.logits(reference, ROWS)
  got = np.asarray(
    transformer_infer(
      model.hparams, model.weights, (), cw.Chunk.from_lists(ROWS)
    ).logits
  )
  for b, row in enumerate(ROWS):
    np.testing.assert_allclose(
      got[b, : len(row)], want[b, : len(row)], rtol=0, atol=ATOL
    )


def test_every_eos_id_stops_generation(tmp_path):
  """Llama 3 instruct lists several EOS ids in generation_config.json: all
  of them stop `generate`, and they survive `cw.save`."""
  reference, _ = _pair("llama-3.1")
  reference.save_pretrained(tmp_path / "hf")
  _byte_tokenizer(tmp_path / "hf")
  rows = cw.Chunk.from_lists([ROWS[0][:20]] * 3)
  sampling = cw.Sampling(temperature=1.0, seed=4)
  base = cw.load(tmp_path / "hf")
  plain = cw.InferenceModel(base.hparams, base.weights, eos_ids=())
  drawn, _ = plain.generate(
    [plain.prefill(rows)], sample_ids=[0, 1, 2], steps=24, sampling=sampling
  )
  drawn = np.asarray(drawn.tokens)
  # Two more EOS ids: tokens rows 1 and 2 draw early on.
  extra = [int(drawn[1, 3]), int(drawn[2, 5])]
  eos = list(dict.fromkeys([2, *extra]))
  (tmp_path / "hf" / "generation_config.json").write_text(
    json.dumps({"eos_token_id": eos})
  )
  model = cw.load(tmp_path / "hf")
  assert model.eos_ids == tuple(eos) and model.eos_id == 2
  got, _ = model.generate(
    [model.prefill(rows)], sample_ids=[0, 1, 2], steps=24, sampling=sampling
  )
  for row in range(3):
    stops = [i for i, t in enumerate(drawn[row]) if t in eos]
    assert int(got.lengths[row]) == (stops[0] if stops else 24)
  assert int(got.lengths[1]) <= 3 and int(got.lengths[2]) <= 5
  saved = cw.load(cw.save(model, tmp_path / "saved"))
  assert saved.eos_ids == tuple(eos)


def _byte_tokenizer(directory):
  """A tokenizer.json of 128 single-character tokens (no merges)."""
  import tokenizers

  vocab = {chr(0x100 + i): i for i in range(128)}
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  tok.save(str(directory / "tokenizer.json"))


def test_config_files_in_older_and_newer_spellings():
  """Real config.json files predate transformers 5: `rope_theta` +
  `rope_scaling`, Gemma 3's `rope_local_base_freq` and
  `sliding_window_pattern`, Gemma 2 without `layer_types`, Phi-3's "su";
  Qwen2 slides from `max_window_layers` on."""
  from chunkwise.checkpoints.hf_config import hparams_from_config

  base = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=12,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
  )
  llama = hparams_from_config(
    dict(
      base,
      model_type="llama",
      rope_theta=5e5,
      rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=32,
      ),
    )
  )
  assert llama.rope_base == 5e5 and llama.rope_scaling.kind.value == "llama3"
  gemma3 = hparams_from_config(
    dict(
      base,
      model_type="gemma3_text",
      rope_theta=1e6,
      rope_local_base_freq=1e4,
      rope_scaling=None,
      sliding_window=8,
      sliding_window_pattern=6,
      query_pre_attn_scalar=16,
    )
  )
  assert gemma3.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
  assert gemma3.rope(0) == (1e4, None) and gemma3.rope(5) == (1e6, None)
  assert gemma3.qk_norm and gemma3.post_norms and gemma3.embed_scale == 8.0
  gemma2 = hparams_from_config(
    dict(base, model_type="gemma2", sliding_window=8, query_pre_attn_scalar=4)
  )
  assert gemma2.sliding_layers == tuple(range(0, 12, 2))
  assert gemma2.query_scale == 0.5 and gemma2.tied_embeddings
  phi3 = hparams_from_config(
    dict(
      base,
      model_type="phi3",
      original_max_position_embeddings=32,
      rope_scaling=dict(
        type="su", short_factor=[1.0] * 8, long_factor=[2.0] * 8
      ),
    )
  )
  assert phi3.rope_scaling.kind.value == "longrope"
  assert phi3.rope_scaling.factor == 4.0  # 128 / 32
  qwen2 = hparams_from_config(
    dict(
      base,
      model_type="qwen2",
      use_sliding_window=True,
      sliding_window=8,
      max_window_layers=10,
    )
  )
  assert qwen2.sliding_window == 8 and qwen2.sliding_layers == (10, 11)
  off = hparams_from_config(
    dict(base, model_type="qwen2", use_sliding_window=False, sliding_window=8)
  )
  assert off.sliding_window is None


@pytest.mark.parametrize("rotary", [16, 12])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rotation_is_each_pair_rotated(rotary, dtype):
  """`rope.rotate` gives each pair (i, i + rotary / 2) x1 cos - x2 sin
  and x2 cos + x1 sin (cos and sin scaled), the dims past the rotary
  width as they were; a TPU program's form over whole heads
  (`_whole_heads`, one elementwise expression) is the same products and
  sums, which XLA may fuse into multiply-adds differently: within a
  rounding of it."""
  import jax
  import jax.numpy as jnp

  from chunkwise.models import rope

  x = jax.random.normal(jax.random.PRNGKey(0), (2, 37, 3, 16)).astype(dtype)
  positions = jnp.arange(2 * 37).reshape(2, 37) * 61
  r = rope.Rotation(1.0 / (1e4 ** (jnp.arange(0, rotary, 2) / rotary)), 0.75)

  def pairs(x, positions):
    angles = positions.astype(jnp.float32)[..., None] * r.inv_freq
    sin = (jnp.sin(angles) * r.scale)[:, :, None, :]
    cos = (jnp.cos(angles) * r.scale)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : rotary // 2], x32[..., rotary // 2 : rotary]
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin, x32[..., rotary:]]
    return jnp.concatenate(rotated, axis=-1).astype(dtype), sin, cos

  want, sin, cos = jax.jit(pairs)(x, positions)
  got = jax.jit(lambda x, p: rope.rotate(x, p, r))(x, positions)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  x32 = x.astype(jnp.float32)
  whole = jax.jit(rope._whole_heads)(x32[..., :rotary], sin, cos)
  tol = 1e-6 if dtype == "float32" else 1e-2  # a bf16 rounding may flip
  np.testing.assert_allclose(
    np.asarray(whole.astype(dtype), np.float32),
    np.asarray(want[..., :rotary], np.float32),
    rtol=tol,
    atol=tol,
  )
