"""Slot buckets (`inference/batching/buckets.py`): a slot loop's segment
runs the smallest compiled row count that holds its running requests, and
a request's tokens and scores are bit for bit `generate`'s alone whatever
buckets its segments ran in: as its neighbours finish (the bucket shrinks
under it), as others arrive (it grows), with paged K/V and speculation."""

import jax
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.inference.batching import admission
from chunkwise.inference.batching import buckets as buckets_lib


def _request(i, steps, vocab):
  rng = np.random.default_rng(i)
  return cw.Request(
    tokens=rng.integers(3, vocab, 3 + i % 4).tolist(),
    sample_id=10 + i,
    steps=steps,
    sampling=[cw.Sampling(temperature=0.0), cw.Sampling(temperature=0.9)][
      i % 2
    ],
  )


def _alone(model, r):
  prefix = model.prefill(cw.Chunk.from_lists([r.tokens]))
  tokens, result = model.generate(
    [prefix], sample_ids=[r.sample_id], steps=r.steps, sampling=r.sampling
  )
  n = int(tokens.lengths[0])
  return (
    np.asarray(tokens.tokens[0, :n]),
    np.asarray(result.per_token_scores[0, :n]),
  )


@pytest.fixture
def sizes(monkeypatch, tiny):
  """The row count of every segment the tiny model's generate engine
  runs (len(rows), or every slot: None)."""
  seen = []
  engine = tiny._generate_engine
  run = engine.slot_run

  def counted(*args, rows=None, **kwargs):
    seen.append(None if rows is None else int(np.asarray(rows).size))
    return run(*args, rows=rows, **kwargs)

  monkeypatch.setattr(engine, "slot_run", counted)
  return seen


def test_sizes_and_rows():
  assert buckets_lib.default_sizes(16) == (1, 2, 4, 8, 16)
  assert buckets_lib.default_sizes(3) == (1, 2, 3)
  assert buckets_lib.default_sizes(1) == (1,)
  assert buckets_lib.check_sizes([4, 1], 6) == (1, 4, 6)
  b = buckets_lib.Buckets(8)
  running = np.zeros(8, bool)
  running[[2, 5, 6]] = True
  np.testing.assert_array_equal(b.rows(running), [2, 5, 6, 8])  # 8: padding
  assert b.rows(np.ones(8, bool)) is None  # every slot, in order
  assert buckets_lib.Buckets(8, (8,)).rows(running) is None
  for bad, match in (
    ([0, 4], "outside"),
    ([9], "outside"),
    ([1.5], "not an int"),
    ("1,2", "list of row counts"),
  ):
    with pytest.raises(ValueError, match=match):
      buckets_lib.check_sizes(bad, 8)


def test_generate_many_shrinks_under_running_requests(tiny, sizes):
  """Budgets of 2 to 40 steps through 4 slots: the long requests keep
  running as the bucket shrinks from 4 rows to 1; the same bits as with
  every slot each segment and as `generate` alone."""
  vocab = tiny.hparams.vocab
  requests = [_request(i, s, vocab) for i, s in enumerate([40, 2, 5, 24, 9, 3])]
  want = [_alone(tiny, r) for r in requests]
  got = {r.index: r for r in tiny.generate_many(requests, slots=4, every=2)}
  assert {None, 1, 2} <= set(sizes), sizes  # None: all 4 slots
  sizes.clear()
  every = {
    r.index: r
    for r in tiny.generate_many(requests, slots=4, every=2, slot_buckets=[4])
  }
  assert set(sizes) == {None}
  for i, (tokens, scores) in enumerate(want):
    for g in (got[i], every[i]):
      np.testing.assert_array_equal(g.tokens, tokens, err_msg=str(i))
      np.testing.assert_array_equal(g.per_token_scores, scores, err_msg=str(i))


@pytest.mark.parametrize("variant", ["fixed", "paged", "speculation"])
def test_live_slots_grow_and_shrink(tiny, sizes, variant):
  """Requests arriving one by one into an 8-slot live loop (buckets 1, 2,
  4 as they come), then finishing (4, 2, 1): each request's tokens and scores,
  reported segment by segment, are `generate`'s alone."""
  vocab = tiny.hparams.vocab
  requests = [_request(i, s, vocab) for i, s in enumerate([40, 12, 16, 6, 10])]
  want = [_alone(tiny, r) for r in requests]
  extra = {
    "fixed": {},
    "paged": {"kv_pages": 12},
    "speculation": {"speculation": cw.Speculation(k=3)},
  }[variant]
  loop = tiny.live_slots(slots=8, capacity=64, every=2, **extra)
  assert loop.buckets.sizes == (1, 2, 4, 8)
  got = {i: ([], []) for i in range(len(requests))}
  # (a loop queues its next segment before it reads the last one: an
  # arrival runs from the segment after the next)
  arrivals = {0: [0], 3: [1], 6: [2, 3], 9: [4]}
  step = 0
  while step in arrivals or loop.busy:
    for i in arrivals.get(step, []):
      loop.add(i, loop.prepare(requests[i]))
    for u in loop.step():
      got[u.key][0].extend(u.tokens.tolist())
      got[u.key][1].extend(u.per_token_scores.tolist())
    step += 1
  assert {1, 2, 4} <= set(sizes), sizes
  assert sizes[-1] == 1 and sizes.index(4) < len(sizes) - 1, str(
    sizes
  )  # shrank
  for i, (tokens, scores) in enumerate(want):
    np.testing.assert_array_equal(got[i][0], tokens, err_msg=str(i))
    np.testing.assert_array_equal(np.float32(got[i][1]), scores, err_msg=str(i))


def test_a_mesh_runs_every_slot(tiny):
  """A sharded loop's rows are split over the attention batch: it runs
  every slot, whatever it is asked."""
  mesh = cw.partitioning.make_mesh((1, 1, 2), jax.devices()[:2])
  model = cw.InferenceModel(
    tiny.hparams,
    tiny.weights,
    mesh=mesh,
    layout=cw.Layout.parse("ws_2d/z"),
  )
  loop = model.live_slots(slots=4, capacity=32, slot_buckets=[1, 2])
  assert loop.buckets.sizes == (4,)


def test_prompts_arriving_together_share_an_admission(tiny, monkeypatch):
  """Six short prompts added at once to an 8-slot live loop: under
  invariant numerics they are prefilled four to a call (rows 1 or 4, the
  last call padded), and each request's tokens and scores are still
  `generate`'s alone; a lone arrival takes one row. Under fast numerics,
  where a row's sums may depend on its neighbours, every admission takes
  one row."""
  vocab = tiny.hparams.vocab
  requests = [_request(i, 6, vocab) for i in range(7)]
  want = [_alone(tiny, r) for r in requests]
  rows = []
  engine = tiny._prefill_engine
  prefill = engine.prefill

  def counted(caches, prev, chunk, **kwargs):
    rows.append(int(chunk.tokens.shape[0]))
    return prefill(caches, prev, chunk, **kwargs)

  monkeypatch.setattr(engine, "prefill", counted)
  loop = tiny.live_slots(slots=8, capacity=32, every=2)
  assert loop.admit_rows == (1, 4)
  got = {i: ([], []) for i in range(len(requests))}
  for i, r in enumerate(requests[:6]):
    loop.add(i, loop.prepare(r))
  step = 0
  while loop.busy or step < 2:
    if step == 1:  # alone, while the six decode
      loop.add(6, loop.prepare(requests[6]))
    for u in loop.step():
      got[u.key][0].extend(u.tokens.tolist())
      got[u.key][1].extend(u.per_token_scores.tolist())
    step += 1
  assert rows == [4, 4, 1], rows
  for i, (tokens, scores) in enumerate(want):
    np.testing.assert_array_equal(got[i][0], tokens, err_msg=str(i))
    np.testing.assert_array_equal(np.float32(got[i][1]), scores, err_msg=str(i))
  fast = cw.InferenceModel.random(tiny.hparams, seed=0, numerics="fast")
  assert fast.live_slots(slots=8, capacity=32).admit_rows == (1,)
  assert admission.rows_for(3, 16, (1, 4)) == 4
  assert admission.rows_for(9, 16, (1, 4)) == 4
  assert admission.rows_for(1, 16, (1, 4)) == 1
  assert admission.rows_for(3, 2 * admission.GROUP_WIDTH, (1, 4)) == 1
