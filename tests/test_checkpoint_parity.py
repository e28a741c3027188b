"""Imported checkpoints against transformers: tiny random Llama-family
models saved as safetensors, and GGUF files written from them (F32, Q8_0),
must give transformers' logits for a right-padded batch of prompts."""

import json

import numpy as np
import pytest
import tokenizers
import torch
import transformers
from gguf import GGMLQuantizationType as QType

import chunkwise as cw
from chunkwise.inference import transformer_infer
from tests import hf_models

ROWS = [[1, 5, 9, 33, 2, 7, 64, 120, 3], [1, 100, 3], [1, 17, 17, 17, 90]]


def _all_logits(model, rows):
  """Our raw logits f32[batch, time, vocab] (the forward pass prefill runs),
  plus the public prefill result."""
  chunk = cw.Chunk.from_lists(rows)
  full = transformer_infer(model.hparams, model.weights, (), chunk)
  return np.asarray(full.logits), model.prefill(chunk)


def _assert_matches(model, want, rows=ROWS, atol=1e-4):
  got, result = _all_logits(model, rows)
  for b, row in enumerate(rows):
    n = len(row)
    np.testing.assert_allclose(got[b, :n], want[b, :n], rtol=0, atol=atol)
    np.testing.assert_allclose(
      result.next_token_logits[b], want[b, n - 1], rtol=0, atol=atol
    )
    logprobs = torch.log_softmax(torch.tensor(want[b, : n - 1]), -1).numpy()
    np.testing.assert_allclose(
      result.per_token_scores[b, 1:n],
      logprobs[np.arange(n - 1), row[1:]],
      rtol=0,
      atol=atol,
    )


HF_VARIANTS = {
  "llama-gqa-untied": dict(kind="llama", heads=4, kv_heads=2, tied=False),
  "llama-mha-tied": dict(kind="llama", heads=4, kv_heads=4, tied=True),
  "llama-mqa-tied": dict(kind="llama", heads=4, kv_heads=1, tied=True),
  "mistral-gqa": dict(kind="mistral", heads=4, kv_heads=2, sliding_window=64),
  "qwen2-gqa-bias": dict(kind="qwen2", heads=4, kv_heads=2, tied=True),
}


@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_safetensors_checkpoint_matches_transformers(variant, tmp_path):
  reference = hf_models.tiny(**HF_VARIANTS[variant], seed=7)
  reference.save_pretrained(tmp_path)
  model = cw.load(tmp_path)
  c = reference.config
  assert model.hparams.heads == c.num_attention_heads
  assert model.hparams.kv_heads == c.num_key_value_heads
  assert model.hparams.tied_embeddings == c.tie_word_embeddings
  assert model.hparams.qkv_bias == (c.model_type == "qwen2")
  if c.model_type == "mistral":
    assert model.hparams.sliding_window == 64
    assert model.hparams.max_len == c.max_position_embeddings
  _assert_matches(model, hf_models.logits(reference, ROWS))


def test_bfloat16_checkpoint_loads_as_bfloat16_and_float32(tmp_path):
  hf_models.tiny("llama", seed=3).to(torch.bfloat16).save_pretrained(tmp_path)
  reference = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path, dtype=torch.float32
  )
  want = hf_models.logits(reference, ROWS)
  _assert_matches(cw.load(tmp_path), want)
  bf16 = cw.load(tmp_path, dtype="bfloat16")
  assert bf16.weights.layers[0].q.dtype == np.dtype("bfloat16")
  # Same bf16 values, f32 compute: the same logits.
  _assert_matches(bf16, want)


@pytest.mark.parametrize("qtype", [QType.F32, QType.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize(
  "shape", [dict(kv_heads=2, tied=False), dict(kv_heads=4, tied=True)]
)
def test_gguf_matches_transformers_reading_the_same_file(
  qtype, shape, tmp_path
):
  """transformers dequantizes and un-permutes the file on its own."""
  original = hf_models.tiny("llama", **shape, seed=11)
  path = tmp_path / f"tiny.{qtype.name}.gguf"
  hf_models.write_gguf(original, path, qtype)
  reference = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path, gguf_file=path.name, dtype=torch.float32
  ).eval()
  model = cw.load(path)
  assert model.hparams.tied_embeddings == shape["tied"]
  _assert_matches(model, hf_models.logits(reference, ROWS))
  if qtype == QType.F32:
    # Lossless: the file reproduces the original model itself, which shows
    # the Q/K rows were put back in Hugging Face's order.
    _assert_matches(model, hf_models.logits(original, ROWS))


def test_gguf_q8_0_is_close_to_the_unquantized_model(tmp_path):
  original = hf_models.tiny("llama", seed=5)
  path = tmp_path / "tiny.gguf"
  hf_models.write_gguf(original, path, QType.Q8_0)
  got, _ = _all_logits(cw.load(path), ROWS)
  want = hf_models.logits(original, ROWS)
  err = max(
    np.abs(got[b, : len(r)] - want[b, : len(r)]).max()
    for b, r in enumerate(ROWS)
  )
  assert 1e-4 < err < 0.3  # quantized (not bit-equal), but close


def _byte_level_tokenizer_json(path):
  """A trained byte-level BPE, saved as transformers saves tokenizers."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
    add_prefix_space=False
  )
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=120,
    special_tokens=["<unk>", "<s>", "</s>"],
    initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  text = ["the cat sat on the mat", "cows have four legs"] * 20
  tok.train_from_iterator(text, trainer)
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
  )
  fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
  fast.save_pretrained(path)
  return fast


def test_hf_directory_tokenizer_and_chat_template(tmp_path):
  reference = hf_models.tiny("llama", vocab=384, seed=2)
  reference.save_pretrained(tmp_path)
  fast = _byte_level_tokenizer_json(tmp_path)
  model = cw.load(tmp_path)
  vocab = model.vocab
  assert isinstance(vocab, cw.TokenizerVocabulary)
  assert (vocab.bos_id, vocab.eos_id) == (1, 2)  # from config.json
  for text in ["the cat", "  cows\thave\nfour legs", "émoji 🐄 42"]:
    ids = vocab.encode(text)
    assert ids == fast.encode(text, add_special_tokens=False)
    assert vocab.decode(ids) == text
  assert vocab.chat_template == fast.chat_template
  assert vocab.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
  chunk = cw.Chunk.tokenize(vocab, ["the cat sat"], is_first_chunk=True)
  assert chunk.to_lists()[0][0] == 1
  rows = chunk.to_lists()
  _assert_matches(model, hf_models.logits(reference, rows), rows)


def test_unsupported_hf_configs_are_rejected(tmp_path):
  reference = hf_models.tiny("llama", seed=0)
  reference.save_pretrained(tmp_path)
  config_path = tmp_path / "config.json"
  config = json.loads(config_path.read_text())
  for change, message in [
    ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ({"attention_bias": True}, "attention_bias=true"),
    (
      {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}},
      "RoPE scaling 'llama3'",
    ),
    ({"num_hidden_layers": 3}, "missing, e.g. layers.2."),
    ({"intermediate_size": 80}, "has shape (96, 64), expected (80, 64)"),
  ]:
    config_path.write_text(json.dumps({**config, **change}))
    with pytest.raises(
      ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
    ):
      cw.load(tmp_path)
