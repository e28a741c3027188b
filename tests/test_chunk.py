"""Chunk: tokenize, detokenize, token_mask, split_at, pad_to_length."""

import numpy as np
import pytest

import chunkwise as cw


class NoBosVocab:
  """seqio-like vocabulary without BOS (like seqio's test SentencePiece
  model: pad 0, eos 1, bos -1): letters a..z are ids 2..27."""

  bos_id = -1
  eos_id = 1
  pad_id = 0
  vocab_size = 28

  def encode(self, s):
    return [ord(c) - ord("a") + 2 for c in s]

  def decode(self, ids):
    return "".join(chr(i - 2 + ord("a")) for i in ids if i >= 2)


def test_tokenize_first_chunk_prepends_bos_and_pads():
  vocab = cw.ByteVocabulary()
  chunk = cw.Chunk.tokenize(vocab, ["ab", "abcd"], is_first_chunk=True)
  a, b, c, d = (vocab.encode(x)[0] for x in "abcd")
  np.testing.assert_array_equal(
    chunk.tokens, [[vocab.bos_id, a, b, 0, 0], [vocab.bos_id, a, b, c, d]]
  )
  np.testing.assert_array_equal(chunk.lengths, [3, 5])
  assert chunk.tokens.dtype == np.int32 and chunk.lengths.dtype == np.int32


def test_tokenize_continuation_eos_and_pad_length():
  vocab = cw.ByteVocabulary()
  chunk = cw.Chunk.tokenize(vocab, ["a"], append_eos=True, pad_length=4)
  np.testing.assert_array_equal(
    chunk.tokens, [[vocab.encode("a")[0], vocab.eos_id, 0, 0]]
  )
  np.testing.assert_array_equal(chunk.lengths, [2])
  with pytest.raises(ValueError, match="pad_length=1 is shorter"):
    cw.Chunk.tokenize(vocab, ["abc"], pad_length=1)


def test_vocab_without_bos_uses_zero_and_round_trips():
  vocab = NoBosVocab()
  chunk = cw.Chunk.tokenize(vocab, ["cab"], is_first_chunk=True)
  np.testing.assert_array_equal(chunk.tokens, [[0, 4, 2, 3]])
  assert chunk.detokenize(vocab) == ["cab"]
  chunk = cw.Chunk.tokenize(vocab, ["cab"], is_first_chunk=True, bos_id=7)
  assert int(chunk.tokens[0, 0]) == 7


def test_detokenize_ignores_padding():
  vocab = cw.ByteVocabulary()
  texts = ["Cows have 4 legs.", "héllo", ""]
  chunk = cw.Chunk.tokenize(vocab, texts, is_first_chunk=True, pad_length=40)
  assert chunk.detokenize(vocab) == texts
  assert chunk.to_lists()[2] == [vocab.bos_id]


def test_token_mask():
  chunk = cw.Chunk.from_lists([[5, 6, 7], [5]], pad_length=4)
  np.testing.assert_array_equal(
    chunk.token_mask, [[True, True, True, False], [True, False, False, False]]
  )


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4])
def test_split_at(n):
  chunk = cw.Chunk.from_lists([[1, 2, 3], [4]], pad_length=4)
  head, tail = chunk.split_at(n)
  np.testing.assert_array_equal(head.tokens, np.asarray(chunk.tokens)[:, :n])
  np.testing.assert_array_equal(tail.tokens, np.asarray(chunk.tokens)[:, n:])
  np.testing.assert_array_equal(head.lengths, np.minimum([3, 1], n))
  np.testing.assert_array_equal(tail.lengths, np.maximum([3, 1], n) - n)
  assert head.to_lists()[0] + tail.to_lists()[0] == [1, 2, 3]


def test_pad_to_length():
  chunk = cw.Chunk.from_lists([[1, 2], [3]])
  padded = chunk.pad_to_length(5)
  np.testing.assert_array_equal(
    padded.tokens, [[1, 2, 0, 0, 0], [3, 0, 0, 0, 0]]
  )
  np.testing.assert_array_equal(padded.lengths, [2, 1])
  with pytest.raises(ValueError, match="pad_to_length\\(1\\) is shorter"):
    chunk.pad_to_length(1)


def test_bad_tokenize_input():
  vocab = cw.ByteVocabulary()
  with pytest.raises(ValueError, match="list of strings"):
    cw.Chunk.tokenize(vocab, "just a string")
  with pytest.raises(ValueError, match="at least one text"):
    cw.Chunk.tokenize(vocab, [])
  with pytest.raises(ValueError, match="expects strings, got 3"):
    cw.Chunk.tokenize(vocab, ["a", 3])
  with pytest.raises(ValueError, match="split_at\\(9\\) is outside"):
    cw.Chunk.from_lists([[1]]).split_at(9)


def test_byte_vocabulary_round_trip_and_foreign_ids():
  vocab = cw.ByteVocabulary()
  assert vocab.vocab_size == 259
  text = "naïve ✓"
  assert vocab.decode(vocab.encode(text)) == text
  assert vocab.decode([vocab.bos_id, *vocab.encode("a"), vocab.eos_id]) == "a"
  assert vocab.decode([300]) == "\ufffd"
  assert isinstance(vocab, cw.Vocabulary)
