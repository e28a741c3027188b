"""The prefill / generate machinery on the hand-computable successor model.

Expected tokens, scores and lengths are written out by hand.
"""

import numpy as np
import pytest

import chunkwise as cw
from tests.toy_models import successor_model

LN8, LN2 = np.log(0.8), np.log(0.2)
GREEDY = cw.Sampling(temperature=0.0)


def _prompt():
  # Row 0: [BOS 0, 1, 1, 2, 3]; row 1: [BOS 0, 1, 1] + two padding 1s.
  return cw.Chunk(
    tokens=np.array([[0, 1, 1, 2, 3], [0, 1, 1, 1, 1]], np.int32),
    lengths=np.array([5, 3], np.int32),
  )


def test_prefill_scores_by_hand():
  result = successor_model().prefill(_prompt(), top_n=2)
  np.testing.assert_allclose(
    result.per_token_scores,
    [[0, LN8, LN2, LN8, LN8], [0, LN8, LN2, LN2, LN2]],
    rtol=1e-6,
  )
  # Position 0 is scored against the BOS distribution: BOS, then the
  # lowest ids among the tied -inf rest.
  np.testing.assert_array_equal(result.top_ids[0, 0], [0, 1])
  np.testing.assert_array_equal(result.top_ids[0, 4], [3, 2])
  np.testing.assert_allclose(result.top_logprobs[0, 4], [LN8, LN2], rtol=1e-6)
  # next-token logits come from each row's last real token: 3 and 1.
  assert int(np.argmax(result.next_token_logits[0])) == 4
  assert int(np.argmax(result.next_token_logits[1])) == 2


@pytest.mark.parametrize("split", [1, 3, 4])
def test_prefill_split_by_hand(split):
  model = successor_model()
  whole = model.prefill(_prompt())
  head, tail = _prompt().split_at(split)
  first = model.prefill(head)
  second = model.prefill(tail, prefix=[first])
  got = np.concatenate([first.per_token_scores, second.per_token_scores], 1)
  np.testing.assert_allclose(got, whole.per_token_scores, rtol=1e-6)


def test_generate_stops_at_eos_mid_row_and_exits_early():
  calls = []
  model = successor_model(eos_id=9, counter=calls)
  prompt = model.prefill(_prompt())
  calls.clear()
  tokens, result = model.generate(
    [prompt], sample_ids=[0, 1], steps=12, sampling=GREEDY, top_n=2
  )
  # Row 0 continues 3 -> 4..8 and stops at EOS 9 (not counted); row 1
  # continues 1 -> 2..8 and stops at 9. The stop token is written just
  # after the row's tokens; later columns stay 0.
  np.testing.assert_array_equal(
    tokens.tokens,
    [
      [4, 5, 6, 7, 8, 9, 0, 0, 0, 0, 0, 0],
      [2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0, 0],
    ],
  )
  np.testing.assert_array_equal(tokens.lengths, [5, 7])
  np.testing.assert_array_equal(result.kv_cache.lengths, [5, 7])
  np.testing.assert_allclose(
    result.per_token_scores[0, :6], [LN8] * 6, rtol=1e-6
  )
  np.testing.assert_array_equal(result.top_ids[1, 0], [2, 1])
  # All rows stopped after 8 samples: 8 forward steps, not 12.
  assert len(calls) == 8
  # A stopped row's next-token logits are those that produced its stop
  # token, so continuing from the result stops again at once.
  assert int(np.argmax(result.next_token_logits[0])) == 9
  more, _ = model.generate(
    [prompt, result], sample_ids=[0, 1], steps=3, sampling=GREEDY
  )
  np.testing.assert_array_equal(more.lengths, [0, 0])


def test_generate_extra_stop_ids_and_no_early_exit_without_stop():
  calls = []
  model = successor_model(counter=calls)  # no EOS
  prompt = model.prefill(_prompt())
  calls.clear()
  tokens, _ = model.generate(
    [prompt], sample_ids=[0, 1], steps=4, sampling=GREEDY, stop_ids=[5]
  )
  np.testing.assert_array_equal(tokens.tokens, [[4, 5, 0, 0], [2, 3, 4, 5]])
  np.testing.assert_array_equal(tokens.lengths, [1, 3])
  assert len(calls) == 4  # row 1 stops at the last step: no early exit

  calls.clear()
  tokens, _ = model.generate(
    [prompt], sample_ids=[0, 1], steps=6, sampling=GREEDY
  )
  np.testing.assert_array_equal(tokens.lengths, [6, 6])
  np.testing.assert_array_equal(tokens.tokens[0], [4, 5, 6, 7, 8, 9])
  assert len(calls) == 6


def test_unprompted_generation_starts_at_bos():
  model = successor_model()
  tokens, result = model.generate(sample_ids=[0], steps=4, sampling=GREEDY)
  np.testing.assert_array_equal(tokens.tokens, [[0, 1, 2, 3]])
  np.testing.assert_allclose(
    result.per_token_scores, [[0, LN8, LN8, LN8]], rtol=1e-6
  )


def test_sampling_never_picks_impossible_tokens():
  """With all mass on t+1, temperature and filters cannot change tokens."""
  model = successor_model(p_next=1.0)
  prompt = model.prefill(_prompt())
  for sampling in (
    cw.Sampling(temperature=1.5),
    cw.Sampling(temperature=0.7, top_k=3, top_p=0.5, min_p=0.1, seed=4),
  ):
    tokens, result = model.generate(
      [prompt], sample_ids=[3, 8], steps=3, sampling=sampling
    )
    np.testing.assert_array_equal(tokens.tokens, [[4, 5, 6], [2, 3, 4]])
    np.testing.assert_allclose(result.per_token_scores, 0, atol=1e-6)


def test_generate_stream_segments_by_hand():
  calls = []
  model = successor_model(eos_id=9, counter=calls)
  prompt = model.prefill(_prompt())
  calls.clear()
  segments = list(
    model.generate_stream(
      [prompt], sample_ids=[0, 1], steps=12, sampling=GREEDY, every=3
    )
  )
  # Row 1 stops in the third segment (columns 6..8); nothing runs after it
  # and the last segment is empty.
  assert [c.time for c, _ in segments] == [3, 3, 3, 3]
  np.testing.assert_array_equal(
    [c.lengths for c, _ in segments], [[3, 3], [2, 3], [0, 1], [0, 0]]
  )
  np.testing.assert_array_equal(segments[1][0].tokens, [[7, 8, 9], [5, 6, 7]])
  np.testing.assert_array_equal(segments[2][0].tokens, [[0, 0, 0], [8, 9, 0]])
  assert len(calls) == 8
  merged = cw.concat_results([r for _, r in segments])
  np.testing.assert_array_equal(merged.kv_cache.lengths, [5, 7])
  whole, _ = model.generate(
    [prompt], sample_ids=[0, 1], steps=12, sampling=GREEDY
  )
  np.testing.assert_array_equal(
    np.concatenate([c.tokens for c, _ in segments], axis=1), whole.tokens
  )


def test_stream_segments_stay_valid_prefixes():
  """Every segment (not just the last) keeps its arrays and can be
  continued; segment 0 ends after token 6 (row 0) and token 4 (row 1)."""
  model = successor_model(eos_id=9)
  prompt = model.prefill(_prompt())
  segments = list(
    model.generate_stream(
      [prompt], sample_ids=[0, 1], steps=6, sampling=GREEDY, every=3
    )
  )
  first = segments[0][1]
  np.testing.assert_array_equal(
    np.argmax(first.next_token_logits, axis=-1), [7, 5]
  )
  more, _ = model.generate(
    [prompt, first], sample_ids=[0, 1], steps=2, sampling=GREEDY
  )
  np.testing.assert_array_equal(more.tokens, [[7, 8], [5, 6]])


def test_bos_opens_an_unprompted_row_even_when_it_is_eos():
  """GPT-2-style vocabularies use one id for BOS and EOS: the BOS sampled
  at position 0 starts the row; the same id later stops it."""
  model = successor_model(p_next=1.0, eos_id=0)  # bos_id is 0 too
  tokens, _ = model.generate(sample_ids=[0], steps=4, sampling=GREEDY)
  np.testing.assert_array_equal(tokens.tokens, [[0, 1, 2, 3]])
  np.testing.assert_array_equal(tokens.lengths, [4])
  # Later, the id stops a row as usual: 31 -> 0 wraps around to EOS.
  prompt = model.prefill(cw.Chunk.from_lists([[0, 30]]))
  tokens, _ = model.generate([prompt], sample_ids=[0], steps=4, sampling=GREEDY)
  np.testing.assert_array_equal(tokens.tokens, [[31, 0, 0, 0]])
  np.testing.assert_array_equal(tokens.lengths, [1])
