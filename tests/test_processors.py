"""Logits processors in the generate loop: each built-in against a numpy
re-computation of what it must do, raw scores, and clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.processors import StepInfo

V = 8


def _info(rows=2, generated=0):
  return StepInfo(
    generated=jnp.full((rows,), generated, jnp.int32),
    remaining=jnp.int32(10),
    stop_ids=jnp.array([2], jnp.int32),
  )


def _apply(proc, logits, **info):
  procs, states = cw.processors.check(
    [proc], batch=logits.shape[0], vocab=V, n_stop=1
  )
  out = procs[0].apply(states[0], jnp.asarray(logits), _info(**info))
  return np.asarray(out), procs[0], states[0]


LOGITS = np.array([[1.0, -2.0, 0.5, 3.0, -1.0, 0.0, 2.0, -0.5]] * 2, np.float32)


def test_ban_allow_bias():
  out, _, _ = _apply(cw.processors.ban_tokens([3, 6]), LOGITS)
  want = LOGITS.copy()
  want[:, [3, 6]] = -np.inf
  np.testing.assert_array_equal(out, want)
  out, _, _ = _apply(cw.processors.allow_tokens([0, 5]), LOGITS)
  keep = np.isin(np.arange(V), [0, 5, 2])  # the stop id 2 stays allowed
  np.testing.assert_array_equal(out, np.where(keep, LOGITS, -np.inf))
  out, _, _ = _apply(cw.processors.allow_tokens([0], stops=False), LOGITS)
  assert np.isfinite(out).sum() == 2 and np.isfinite(out[:, 0]).all()
  out, _, _ = _apply(cw.processors.logit_bias({1: 5.0, 4: -np.inf}), LOGITS)
  want = LOGITS.copy()
  want[:, 1] += 5.0
  want[:, 4] = -np.inf
  np.testing.assert_array_equal(out, want)


def test_penalties_match_numpy():
  context = cw.Chunk(
    tokens=jnp.array([[0, 1, 0], [4, 4, 4]], jnp.int32),
    lengths=jnp.array([2, 1], jnp.int32),
  )
  proc = cw.processors.penalties(
    repetition=[2.0, 1.5], presence=0.5, frequency=0.25, context=context
  )
  procs, states = cw.processors.check([proc], batch=2, vocab=V, n_stop=1)
  p, state = procs[0], states[0]
  for tokens in ([3, 3], [3, 6], [7, 3]):
    state = p.update(state, jnp.array(tokens, jnp.int32), _info())
  out = np.asarray(p.apply(state, jnp.asarray(LOGITS), _info()))
  counts = np.zeros((2, V))
  for tokens in ([3, 3], [3, 6], [7, 3]):
    counts[[0, 1], tokens] += 1
  seen = counts > 0
  seen[0, [0, 1]] = True
  seen[1, 4] = True
  want = LOGITS.astype(np.float64).copy()
  for b, r in enumerate([2.0, 1.5]):
    x = want[b]
    x[seen[b]] = np.where(x[seen[b]] > 0, x[seen[b]] / r, x[seen[b]] * r)
  want -= 0.5 * (counts > 0) + 0.25 * counts
  np.testing.assert_allclose(out, want, rtol=1e-6)


def test_min_tokens_blocks_stops_per_row():
  proc = cw.processors.min_tokens([3, 0])
  out, p, state = _apply(proc, LOGITS, generated=2)
  assert out[0, 2] == -np.inf and out[1, 2] == LOGITS[1, 2]
  info = _info(generated=3)
  out = np.asarray(p.apply(state, jnp.asarray(LOGITS), info))
  np.testing.assert_array_equal(out, LOGITS)


def test_generate_with_processors_keeps_raw_scores(tiny):
  """Banned ids are never drawn, min_tokens delays EOS, and the scores are
  the raw log-probs of the drawn tokens (a rescore with prefill agrees)."""
  vocab = tiny.vocab
  prompt = cw.Chunk.tokenize(vocab, ["ab", "cd"], is_first_chunk=True)
  pre = tiny.prefill(prompt)
  banned = list(range(3 + ord("a"), 3 + ord("z") + 1))
  tokens, result = tiny.generate(
    [pre],
    sample_ids=jnp.arange(2),
    steps=12,
    sampling=cw.Sampling(temperature=1.0, seed=3),
    processors=[
      cw.processors.ban_tokens(banned),
      cw.processors.min_tokens(12),
      cw.processors.logit_bias({300: -1e9}),
    ],
  )
  got = np.asarray(tokens.tokens)
  assert not np.isin(got, banned).any()
  assert not np.isin(got, [300]).any()
  assert (np.asarray(tokens.lengths) == 12).all()  # no EOS before 12
  rescored = tiny.prefill(tokens, prefix=[pre])
  np.testing.assert_allclose(
    result.per_token_scores, rescored.per_token_scores, atol=1e-5
  )


def test_penalty_changes_greedy_and_no_processor_is_bit_identical(tiny):
  pre = tiny.prefill(cw.Chunk.tokenize(tiny.vocab, ["x"], is_first_chunk=True))
  kwargs = dict(
    sample_ids=jnp.arange(1), steps=16, sampling=cw.Sampling(temperature=0.0)
  )
  plain, plain_r = tiny.generate([pre], **kwargs)
  neutral, neutral_r = tiny.generate(
    [pre], processors=[cw.processors.penalties()], **kwargs
  )
  np.testing.assert_array_equal(plain.tokens, neutral.tokens)
  np.testing.assert_array_equal(
    plain_r.per_token_scores, neutral_r.per_token_scores
  )
  strong, _ = tiny.generate(
    [pre], processors=[cw.processors.penalties(frequency=100.0)], **kwargs
  )
  row = np.asarray(strong.tokens)[0, : int(strong.lengths[0])]
  assert len(set(row.tolist())) == len(row)  # nothing drawn twice


class _Peeks(cw.processors.LogitsProcessor):
  def apply(self, state, logits, info):
    if float(logits[0, 0]) > 0:  # a host read: not jittable
      return logits
    return logits


class _BadShape(cw.processors.LogitsProcessor):
  def apply(self, state, logits, info):
    return logits[:, :-1]


def test_processor_errors(tiny):
  kwargs = dict(sample_ids=jnp.arange(2), steps=4)
  with pytest.raises(ValueError, match="_Peeks is not jittable"):
    tiny.generate(processors=[_Peeks()], **kwargs)
  with pytest.raises(ValueError, match=r"_BadShape.apply must return"):
    tiny.generate(processors=[_BadShape()], **kwargs)
  with pytest.raises(ValueError, match="LogitsProcessor"):
    tiny.generate(processors=[lambda x: x], **kwargs)
  with pytest.raises(ValueError, match="token id 999 is outside"):
    tiny.generate(processors=[cw.processors.ban_tokens([999])], **kwargs)
  with pytest.raises(ValueError, match=r"repetition must be finite and > 0"):
    tiny.generate(processors=[cw.processors.penalties(repetition=0)], **kwargs)
  with pytest.raises(ValueError, match=r"shape \(2,\)"):
    tiny.generate(processors=[cw.processors.min_tokens([1, 2, 3])], **kwargs)
  with pytest.raises(ValueError, match="budget_forcing=True needs"):
    tiny.generate(budget_forcing=True, **kwargs)
  assert jax.tree.leaves(cw.processors.penalties().for_loop()) == []
