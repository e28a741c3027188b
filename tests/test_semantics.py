"""DESIGN.md §4, one test per item (1-8), on random tiny models.

Models: the Llama-style preset (grouped KV heads), the PaLM-style preset
(multiquery) and a multihead variant, so both block kinds and kv_heads in
{1, 2, heads} go through every path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from tests import numpy_reference

TEXTS = ["Cows have four legs.", "Hi", "The sum of 2 and 3 is 5"]
GREEDY = cw.Sampling(temperature=0.0)

MODELS = {
  "tiny": lambda: cw.InferenceModel.random(cw.configs.get("tiny"), seed=0),
  "tiny-parallel": lambda: cw.InferenceModel.random(
    cw.configs.get("tiny-parallel"), seed=1
  ),
  "tiny-mha": lambda: cw.InferenceModel.random(
    cw.configs.get("tiny").replace(kv_heads=8), seed=2
  ),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
  return MODELS[request.param]()


@pytest.fixture(scope="module")
def llama():
  return MODELS["tiny"]()


def _first(model, texts=TEXTS, **kwargs):
  return cw.Chunk.tokenize(model.vocab, texts, is_first_chunk=True, **kwargs)


def _masked(x, chunk):
  return np.where(np.asarray(chunk.token_mask), np.asarray(x), 0.0)


def _log_softmax(x):
  return np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))


# 1. Scores ------------------------------------------------------------------


def test_scores_bos_scores_zero(model):
  result = model.prefill(_first(model))
  np.testing.assert_array_equal(result.per_token_scores[:, 0], 0.0)


def test_scores_equal_log_softmax_of_preceding_logits(model):
  """Against the NumPy twin's logits of each whole row: the chunk after a
  prefix is scored by the logits one position earlier, the first of its
  tokens by the prefix's next-token logits."""
  chunk = _first(model)
  head, tail = chunk.split_at(5)
  prefix = model.prefill(head)
  result = model.prefill(tail, prefix=[prefix])
  for b, row in enumerate(chunk.to_lists()):
    logprobs = _log_softmax(
      numpy_reference.logits(model.hparams, model.weights, row)
    )
    n = len(row)  # "Hi" (3 tokens) lies wholly in the head
    np.testing.assert_allclose(
      result.per_token_scores[b, : max(n - 5, 0)],
      logprobs[np.arange(4, n - 1), row[5:]],
      rtol=1e-4,
      atol=1e-4,
    )
    np.testing.assert_allclose(
      prefix.per_token_scores[b, 1 : min(n, 5)],
      logprobs[np.arange(min(n, 5) - 1), row[1:5]],
      rtol=1e-4,
      atol=1e-4,
    )


# 2. Chunk splitting is invisible --------------------------------------------


# 23 leaves one column in which only the longest row has a token; 0 and 24
# (the chunk's width) leave a piece of zero columns.
@pytest.mark.parametrize("splits", [(1,), (3,), (7,), (2, 9), (23,), (0, 24)])
def test_chunk_splitting_is_invisible(model, splits):
  chunk = _first(model)
  whole = model.prefill(chunk, top_n=4)
  prefix, rest = [], chunk
  for cut in (*np.diff((0, *splits)), None):
    head, rest = rest.split_at(int(cut)) if cut is not None else (rest, None)
    prefix.append(model.prefill(head, prefix=prefix, top_n=4))
  scores = np.concatenate([r.per_token_scores for r in prefix], axis=1)
  top_ids = np.concatenate([r.top_ids for r in prefix], axis=1)
  top_lp = np.concatenate([r.top_logprobs for r in prefix], axis=1)
  mask = np.asarray(chunk.token_mask)
  np.testing.assert_allclose(
    _masked(scores, chunk),
    _masked(whole.per_token_scores, chunk),
    rtol=1e-5,
    atol=1e-5,
  )
  np.testing.assert_array_equal(top_ids[mask], np.asarray(whole.top_ids)[mask])
  np.testing.assert_allclose(
    top_lp[mask], np.asarray(whole.top_logprobs)[mask], rtol=1e-5, atol=1e-5
  )
  np.testing.assert_allclose(
    prefix[-1].next_token_logits, whole.next_token_logits, rtol=1e-5, atol=1e-5
  )
  # The merged prefix list is as good as the list itself.
  merged = cw.concat_results(prefix)
  np.testing.assert_allclose(
    _masked(merged.per_token_scores, chunk),
    _masked(whole.per_token_scores, chunk),
    rtol=1e-5,
    atol=1e-5,
  )
  np.testing.assert_array_equal(merged.kv_cache.lengths, chunk.lengths)
  more = cw.Chunk.tokenize(model.vocab, [" and", " so", " on"])
  after_list = model.prefill(more, prefix=prefix)
  after_merged = model.prefill(more, prefix=[merged])
  np.testing.assert_allclose(
    _masked(after_merged.per_token_scores, more),
    _masked(after_list.per_token_scores, more),
    rtol=1e-5,
    atol=1e-5,
  )


# 3. Next-token logits -------------------------------------------------------


def test_next_token_logits_at_last_position_and_carried_over(llama):
  chunk = _first(llama)
  result = llama.prefill(chunk)
  for b, n in enumerate(np.asarray(chunk.lengths)):
    head, _ = cw.Chunk.from_lists([chunk.to_lists()[b]]).split_at(int(n))
    alone = llama.prefill(head)
    np.testing.assert_allclose(
      result.next_token_logits[b],
      alone.next_token_logits[0],
      rtol=1e-5,
      atol=1e-5,
    )
  # A row of length 0 carries the last prefix's logits over.
  prev = llama.prefill(_first(llama, TEXTS[:2]))
  nxt = llama.prefill(cw.Chunk.from_lists([[70, 71], []]), prefix=[prev])
  np.testing.assert_array_equal(
    nxt.next_token_logits[1], prev.next_token_logits[1]
  )


# 4. Padding and prefix batch broadcasting -----------------------------------


def test_padded_rows_equal_their_unpadded_selves(model):
  chunk = _first(model, pad_length=40)
  batch = model.prefill(chunk, top_n=3)
  for b, text in enumerate(TEXTS):
    alone = model.prefill(_first(model, [text]), top_n=3)
    n = alone.time
    np.testing.assert_allclose(
      batch.per_token_scores[b, :n],
      alone.per_token_scores[0],
      rtol=1e-5,
      atol=1e-5,
    )
    np.testing.assert_array_equal(batch.top_ids[b, :n], alone.top_ids[0])
    np.testing.assert_allclose(
      batch.next_token_logits[b],
      alone.next_token_logits[0],
      rtol=1e-5,
      atol=1e-5,
    )


def test_prefix_batch_broadcasting(model):
  """Batch 1 -> 2 -> 4: row r of a batch-b prefix serves rows r*(B/b) ..
  (r+1)*(B/b)-1 ("repeat each"), and equals running each row alone."""
  vocab = model.vocab
  shared = model.prefill(_first(model, ["Q: what is 2+2?"]))
  middles = ["A: 4.", "A: four"]
  mid = model.prefill(cw.Chunk.tokenize(vocab, middles), prefix=[shared])
  lasts = [" Q1", " Q2 longer", " Q3", " Q4!"]
  last = model.prefill(
    cw.Chunk.tokenize(vocab, lasts), prefix=[shared, mid], top_n=2
  )
  for row, text in enumerate(lasts):
    full = _first(model, ["Q: what is 2+2?" + middles[row // 2] + text])
    alone = model.prefill(full, top_n=2)
    n = len(vocab.encode(text))
    np.testing.assert_allclose(
      last.per_token_scores[row, :n],
      alone.per_token_scores[0, -n:],
      rtol=1e-5,
      atol=1e-5,
    )
    np.testing.assert_allclose(
      last.next_token_logits[row],
      alone.next_token_logits[0],
      rtol=1e-5,
      atol=1e-5,
    )


# 5. RNG contract ------------------------------------------------------------

SAMPLE = cw.Sampling(temperature=1.0, top_p=0.9, seed=7)


def test_rng_contract_independent_of_batch_packing(model):
  """Sample id 4 alone gives the tokens it gets inside a batch of 6."""
  vocab = model.vocab
  shared = model.prefill(_first(model, ["Facts:"]))
  tasks = [" Cows have", " Fish have", " Birds have"]
  task_r = model.prefill(cw.Chunk.tokenize(vocab, tasks), prefix=[shared])
  tokens, result = model.generate(
    [shared, task_r], sample_ids=np.arange(6), steps=10, sampling=SAMPLE
  )
  # Sample 4 belongs to task 2 (two samples per task, repeat-each).
  alone_task = model.prefill(
    cw.Chunk.tokenize(vocab, [tasks[2]]), prefix=[shared]
  )
  alone, alone_r = model.generate(
    [shared, alone_task], sample_ids=[4], steps=10, sampling=SAMPLE
  )
  assert alone.to_lists()[0] == tokens.to_lists()[4]
  np.testing.assert_allclose(
    alone_r.per_token_scores[0],
    result.per_token_scores[4],
    rtol=1e-5,
    atol=1e-5,
  )
  # Different sample ids of the same task do differ (the test has teeth).
  assert tokens.to_lists()[4] != tokens.to_lists()[5]


def test_rng_contract_independent_of_splitting_generation(model):
  prompt = model.prefill(_first(model, TEXTS[:2]))
  whole, _ = model.generate(
    [prompt], sample_ids=[3, 9], steps=12, sampling=SAMPLE
  )
  first, first_r = model.generate(
    [prompt], sample_ids=[3, 9], steps=5, sampling=SAMPLE
  )
  second, _ = model.generate(
    [prompt, first_r], sample_ids=[3, 9], steps=7, sampling=SAMPLE
  )
  np.testing.assert_array_equal(
    np.concatenate([first.tokens, second.tokens], axis=1), whole.tokens
  )
  # Splitting the prompt instead of the generation changes nothing either.
  head, tail = _first(model, TEXTS[:2]).split_at(4)
  head_r = model.prefill(head)
  tail_r = model.prefill(tail, prefix=[head_r])
  again, _ = model.generate(
    [head_r, tail_r], sample_ids=[3, 9], steps=12, sampling=SAMPLE
  )
  np.testing.assert_array_equal(again.tokens, whole.tokens)


def test_rng_contract_key_formula(llama):
  """key = fold_in(fold_in(key(seed), sample_id), position), drawn with
  jax.random.categorical from the raw logits (no filters), at every step."""
  chunk = _first(llama, TEXTS[:2])
  prompt = llama.prefill(chunk)
  sampling = cw.Sampling(temperature=1.0, seed=11)
  tokens, _ = llama.generate(
    [prompt], sample_ids=[5, 2], steps=4, sampling=sampling
  )
  for row, sample_id in enumerate([5, 2]):
    prompt_row = chunk.to_lists()[row]
    generated = tokens.to_lists()[row]
    for step, token in enumerate(generated):
      before = llama.prefill(
        cw.Chunk.from_lists([prompt_row + generated[:step]])
      )
      key = jax.random.fold_in(
        jax.random.fold_in(jax.random.key(11), sample_id),
        len(prompt_row) + step,
      )
      want = jax.random.categorical(key, before.next_token_logits[0])
      assert token == int(want), (row, step)


# 6-7. Generation; greedy generation is consistent with scoring --------------


def test_generation_result_is_a_valid_prefix(model):
  """Prefilling the generated tokens after the prompt reproduces the
  generated scores and next-token logits: the loop's KV writes are right."""
  prompt_chunk = _first(model, TEXTS[:2])
  prompt = model.prefill(prompt_chunk)
  tokens, result = model.generate(
    [prompt], sample_ids=[0, 1], steps=9, sampling=SAMPLE, top_n=3
  )
  np.testing.assert_array_equal(result.kv_cache.lengths, tokens.lengths)
  again = model.prefill(tokens, prefix=[prompt], top_n=3)
  np.testing.assert_allclose(
    _masked(again.per_token_scores, tokens),
    _masked(result.per_token_scores, tokens),
    rtol=1e-5,
    atol=1e-5,
  )
  np.testing.assert_allclose(
    again.next_token_logits, result.next_token_logits, rtol=1e-5, atol=1e-5
  )
  mask = np.asarray(tokens.token_mask)
  np.testing.assert_array_equal(
    np.asarray(again.top_ids)[mask], np.asarray(result.top_ids)[mask]
  )


def test_greedy_generation_is_consistent_with_scoring(model):
  prompt_chunk = _first(model, TEXTS[:2])
  prompt = model.prefill(prompt_chunk)
  tokens, _ = model.generate(
    [prompt], sample_ids=[0, 1], steps=16, sampling=GREEDY
  )
  for b in range(2):
    row = prompt_chunk.to_lists()[b] + tokens.to_lists()[b]
    scratch = model.prefill(cw.Chunk.from_lists([row]), top_n=1)
    n = len(prompt_chunk.to_lists()[b])
    generated = np.asarray(scratch.top_ids)[0, n:, 0]
    np.testing.assert_array_equal(generated, tokens.to_lists()[b])


def test_generate_stream_concatenation_equals_generate(model):
  prompt = model.prefill(_first(model, TEXTS))
  args = dict(sample_ids=np.arange(6), steps=13, sampling=SAMPLE, top_n=2)
  tokens, result = model.generate([prompt], **args)
  segments = list(model.generate_stream([prompt], every=4, **args))
  assert [c.time for c, _ in segments] == [4, 4, 4, 1]
  np.testing.assert_array_equal(
    np.concatenate([c.tokens for c, _ in segments], 1), tokens.tokens
  )
  np.testing.assert_array_equal(
    sum(c.lengths for c, _ in segments), tokens.lengths
  )
  merged = cw.concat_results([r for _, r in segments])
  np.testing.assert_array_equal(
    merged.per_token_scores, result.per_token_scores
  )
  np.testing.assert_array_equal(merged.top_ids, result.top_ids)
  np.testing.assert_array_equal(
    merged.next_token_logits, result.next_token_logits
  )


def test_top_k_1_equals_greedy(llama):
  prompt = llama.prefill(_first(llama))
  greedy, _ = llama.generate(
    [prompt], sample_ids=[0, 1, 2], steps=10, sampling=GREEDY
  )
  for seed in (0, 1):
    top1, _ = llama.generate(
      [prompt],
      sample_ids=[0, 1, 2],
      steps=10,
      sampling=cw.Sampling(temperature=2.0, top_k=1, seed=seed),
    )
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)


# 8. Top-n -------------------------------------------------------------------


def test_top_n_sorted_with_ties_to_the_lower_id(llama):
  chunk = _first(llama)
  result = llama.prefill(chunk, top_n=5)
  prev = llama.prefill(chunk.split_at(6)[0])
  logprobs = _log_softmax(prev.next_token_logits)
  order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :5]
  valid = np.asarray(chunk.lengths) > 6  # position 6 is padding in "Hi"
  np.testing.assert_array_equal(
    np.asarray(result.top_ids)[valid, 6], order[valid]
  )
  np.testing.assert_allclose(
    np.asarray(result.top_logprobs)[valid, 6],
    np.take_along_axis(logprobs, order, -1)[valid],
    rtol=1e-5,
    atol=1e-5,
  )
  # An all-zero model gives a uniform distribution: ids 0..n-1, -ln V each.
  h = llama.hparams
  zero = cw.InferenceModel(
    h, jax.tree.map(jnp.zeros_like, llama.weights), llama.vocab
  )
  result = zero.prefill(chunk, top_n=4)
  np.testing.assert_array_equal(
    result.top_ids[:, 1:], np.broadcast_to([0, 1, 2, 3], (3, chunk.time - 1, 4))
  )
  np.testing.assert_allclose(
    result.top_logprobs[:, 1:], -np.log(h.vocab), rtol=1e-6
  )
  # At a first chunk's position 0 all mass is on BOS; the rest tie at -inf.
  np.testing.assert_array_equal(
    result.top_ids[0, 0],
    [llama.bos_id, *[i for i in range(4) if i != llama.bos_id][:3]],
  )
