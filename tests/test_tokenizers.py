"""Tokenizers: SentencePiece vocabularies stored in GGUF metadata (against
the sentencepiece library), the byte-level pre-tokenizer splits (against
transformers' and SmolLM2's own definitions), and seqio's
SentencePieceVocabulary used unchanged by `Chunk.tokenize`."""

import os

import gguf
import numpy as np
import pytest
import sentencepiece as spm
import tokenizers
from tokenizers import pre_tokenizers
from transformers.integrations.gguf import gguf_tokenizer_mapping

import chunkwise as cw
from chunkwise.checkpoints import gguf as cw_gguf
from chunkwise.checkpoints import gguf_file, gguf_tokenizer
from chunkwise.checkpoints import tokenizer as cw_tokenizer

STRINGS = [
  "Hello world",
  " leading space",
  "  two leading spaces and trailing  ",
  "tabs\tand\nnewlines\n\n",
  "digits 12345, 3.14159 and 2024-11-21",
  "emoji 🐄🤗 and accents: café naïve Ünïcödé",
  "don't you'll WE'RE",
]

CORPUS = [
  "the quick brown fox jumps over the lazy dog",
  "cows have four legs and fish have none",
  "the sum of two and three is five",
  "hello world, hello there, general kenobi",
] * 30


_USER_DEFINED = ("<start_of_turn>", "<end_of_turn>")


def _train_spm(directory, **options):
  prefix = str(directory / "bpe")
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(CORPUS),
    model_prefix=prefix,
    model_type="bpe",
    vocab_size=400,
    byte_fallback=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    split_digits=True,
    minloglevel=2,
    **options,
  )
  return spm.SentencePieceProcessor(model_file=prefix + ".model")


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
  """A small SentencePiece BPE model trained here (byte fallback on, no
  normalization, so every string round-trips)."""
  return _train_spm(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def gemma_style_model(tmp_path_factory):
  """SentencePiece as Gemma's: no dummy space prefix, chat-turn markers as
  user-defined pieces."""
  return _train_spm(
    tmp_path_factory.mktemp("gemma-spm"),
    add_dummy_prefix=False,
    user_defined_symbols=list(_USER_DEFINED),
  )


def _spm_token_type(sp, i):
  if sp.IsUnknown(i):
    return gguf_tokenizer.UNKNOWN
  if sp.IsControl(i):
    return gguf_tokenizer.CONTROL
  if sp.IsByte(i):
    return gguf_tokenizer.BYTE
  if sp.IsUnused(i):
    return gguf_tokenizer.UNUSED
  if sp.IdToPiece(i) in _USER_DEFINED:
    return gguf_tokenizer.USER_DEFINED
  return gguf_tokenizer.NORMAL


def _write_spm_gguf(sp, path, add_space_prefix=True):
  """The tokenizer fields llama.cpp's converter writes for a SentencePiece
  model, in a GGUF file with no tensors."""
  n = sp.GetPieceSize()
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_tokenizer_model("llama")
  writer.add_token_list([sp.IdToPiece(i) for i in range(n)])
  writer.add_token_scores([sp.GetScore(i) for i in range(n)])
  writer.add_token_types([_spm_token_type(sp, i) for i in range(n)])
  writer.add_bos_token_id(sp.bos_id())
  writer.add_eos_token_id(sp.eos_id())
  writer.add_unk_token_id(sp.unk_id())
  writer.add_add_space_prefix(add_space_prefix)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def test_sentencepiece_gguf_vocab_matches_sentencepiece(
  sentencepiece_model, tmp_path
):
  sp = sentencepiece_model
  path = tmp_path / "spm.gguf"
  _write_spm_gguf(sp, path)
  meta = gguf_file.open_file(path).metadata
  vocab = cw_gguf.vocab_from_metadata(meta, str(path))
  assert (vocab.bos_id, vocab.eos_id, vocab.unk_id) == (1, 2, 0)
  assert vocab.vocab_size == sp.GetPieceSize()
  for text in [*STRINGS, *CORPUS[:4]]:
    want = sp.EncodeAsIds(text)
    assert vocab.encode(text) == want, text
    assert vocab.decode(want) == sp.DecodeIds(want) == text
  # Byte fallback really was exercised.
  assert any(sp.IsByte(i) for i in vocab.encode("🐄"))


def test_gemma_style_sentencepiece_gguf_vocab_matches_sentencepiece(
  gemma_style_model, tmp_path
):
  """Gemma 2/3 GGUF files describe their SentencePiece vocabulary without
  a space prefix, with user-defined turn markers matched whole."""
  sp = gemma_style_model
  path = tmp_path / "gemma.gguf"
  _write_spm_gguf(sp, path, add_space_prefix=False)
  vocab = cw_gguf.vocab_from_metadata(
    gguf_file.open_file(path).metadata, str(path)
  )
  turn = "<start_of_turn>user\nHello world<end_of_turn>\n"
  for text in [*STRINGS, turn, "<start_of_turn>model\n12345"]:
    want = sp.EncodeAsIds(text)
    assert vocab.encode(text) == want, text
    assert vocab.decode(want) == sp.DecodeIds(want)
  assert sp.PieceToId("<start_of_turn>") in vocab.encode(turn)
  assert vocab.encode(" leading")[0] == sp.EncodeAsIds(" leading")[0]


def _pieces(pre_tokenizer, text):
  return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


def _ours(pre):
  return pre_tokenizers.Sequence(
    [
      *(
        pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated")
        for r in gguf_tokenizer.PRE_TOKENIZER_SPLITS[pre]
      ),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
  )


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_pre_tokenizer_splits_match_transformers(pre):
  split = gguf_tokenizer_mapping.GGUF_PRE_TOKENIZER_SPLITS[pre]
  reference = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
  )
  for text in STRINGS:
    assert _pieces(_ours(pre), text) == _pieces(reference, text), text
  assert _pieces(_ours("llama-bpe"), "12345") == ["123", "45"]


def test_smollm_pre_tokenizer_matches_smollm2_tokenizer_json():
  """SmolLM2's tokenizer.json: single digits, then GPT-2's byte level."""
  reference = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]
  )
  for text in STRINGS:
    assert _pieces(_ours("smollm"), text) == _pieces(reference, text), text


def test_bytes_to_unicode_is_gpt2s_map():
  table = cw_tokenizer.bytes_to_unicode()
  assert len(set(table.values())) == 256
  assert (table[ord(" ")], table[ord("\n")], table[ord("A")]) == ("Ġ", "Ċ", "A")


def test_unknown_pre_tokenizer_is_rejected():
  with pytest.raises(ValueError, match=r"tokenizer.ggml.pre='nonesuch'"):
    gguf_tokenizer.byte_level_bpe(["a"], [], [1], "nonesuch")


def test_seqio_sentencepiece_vocabulary_works_unchanged():
  import seqio  # the `seqio` extra; imported here as it brings TensorFlow

  path = os.path.join(
    os.path.dirname(seqio.__file__),
    "test_data/sentencepiece/sentencepiece.model",
  )
  vocab = seqio.SentencePieceVocabulary(path)
  assert (vocab.vocab_size, vocab.bos_id, vocab.eos_id) == (26, -1, 1)
  texts = ["this is a test", "a tea"]
  chunk = cw.Chunk.tokenize(vocab, texts, is_first_chunk=True, append_eos=True)
  rows = chunk.to_lists()
  for text, row in zip(texts, rows, strict=True):
    # No BOS in the vocabulary: the model's default BOS, 0, as in T5.
    assert row == [0, *vocab.encode(text), 1]
  assert np.asarray(chunk.tokens)[1, len(rows[1]) :].tolist() == [0] * (
    chunk.time - len(rows[1])
  )
  assert chunk.detokenize(vocab) == texts
  model = cw.InferenceModel.random(
    cw.configs.get("tiny").replace(vocab=26), vocab=vocab
  )
  assert (model.bos_id, model.eos_id) == (0, 1)
  prompt = model.prefill(cw.Chunk.tokenize(vocab, texts, is_first_chunk=True))
  tokens, _ = model.generate(
    [prompt], sample_ids=np.arange(4), steps=6, sampling=cw.Sampling()
  )
  for row, text in zip(
    tokens.to_lists(), tokens.detokenize(vocab), strict=True
  ):
    assert text == vocab.decode(row)
    assert 1 not in row[:-1]  # generation stops at seqio's EOS
