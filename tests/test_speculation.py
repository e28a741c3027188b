"""Speculative decoding changes no token (DESIGN.md §4.11): with
`speculation=`, every call returns exactly what it returns without it
(`np.array_equal` on tokens, scores, top-n, next-token logits and K/V),
whatever the drafter proposed, and its counts show drafts were verified.

Drafts come from an "oracle" context (the prompt, then the call's own
output without speculation: long runs of accepted drafts, so blocks cross
stops and budgets) beside rows drafting from random tokens with 1-token
matches (garbage: mostly rejected) and rows with no context at all.
"""

import dataclasses

import numpy as np
import pytest

import chunkwise as cw
from chunkwise.partitioning import make_mesh
from tests.test_adapters import random_adapter

SAMPLINGS = {
  "greedy": cw.Sampling(temperature=0.0),
  "temperature": cw.Sampling(temperature=0.9, seed=7),
  "filters": cw.Sampling(
    temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=3
  ),
}
# Passes nearly free beside the weights (an accelerator's ridge point):
# every row with drafts is verified, whatever the batch (these costs, not
# this CPU's timed ones: `calibrate=False`).
SPEC = dict(
  k=6, ngram_min=1, ngram_max=3, widths=(2, 6), weight_rows=1e3, calibrate=False
)
# The int8 draft, with every row drafting 4 tokens each iteration.
DRAFT = dict(
  drafter="draft",
  k=4,
  widths=(4,),
  weight_rows=1e3,
  draft_cost=0,
  calibrate=False,
)


def _chunk(rows):
  width = max(1, max(len(r) for r in rows))
  tokens = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    tokens[i, : len(r)] = r
  return cw.Chunk(
    tokens=tokens, lengths=np.array([len(r) for r in rows], np.int32)
  )


def _prompts(batch=4, seed=0):
  rng = np.random.default_rng(seed)
  rows = []
  for b in range(batch):
    half = list(rng.integers(3, 60, 5 + b))
    rows.append([1, *half, *half])  # a repeat: n-grams to look up
  return _chunk(rows)


def _context(prompt, tokens, seed=1):
  """Rows 0 and 1 draft from their prompt then the expected output (the
  oracle), row 2 from random tokens, row 3 from nothing."""
  rng = np.random.default_rng(seed)
  rows = []
  lengths, out_lengths = np.asarray(prompt.lengths), np.asarray(tokens.lengths)
  for b in range(prompt.tokens.shape[0]):
    if b % 4 < 2:
      out = np.asarray(tokens.tokens)[b, : out_lengths[b] + 1]
      rows.append([*np.asarray(prompt.tokens)[b, : lengths[b]], *out])
    elif b % 4 == 2:
      rows.append(list(rng.integers(3, 60, 40)))
    else:
      rows.append([])
  return _chunk(rows)


def assert_same(a, b):
  (ta, ra), (tb, rb) = a, b
  for x, y in [
    (ta.tokens, tb.tokens),
    (ta.lengths, tb.lengths),
    (ra.per_token_scores, rb.per_token_scores),
    (ra.top_ids, rb.top_ids),
    (ra.top_logprobs, rb.top_logprobs),
    (ra.next_token_logits, rb.next_token_logits),
    (ra.kv_cache.lengths, rb.kv_cache.lengths),
  ]:
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # K/V past a row's length is unspecified; the kept columns are equal.
  mask = np.asarray(ta.token_mask)[None, :, :, None, None]
  for x, y in [(ra.kv_cache.k, rb.kv_cache.k), (ra.kv_cache.v, rb.kv_cache.v)]:
    np.testing.assert_array_equal(
      np.where(mask, np.asarray(x), 0), np.where(mask, np.asarray(y), 0)
    )


def _both(model, prefix, prompt, *, steps, spec=SPEC, **kwargs):
  """(plain, speculative) results of the same call; the oracle context
  comes from the plain one."""
  plain = model.generate(prefix, steps=steps, **kwargs)
  speculation = cw.Speculation(context=_context(prompt, plain[0]), **spec)
  return plain, model.generate(
    prefix, steps=steps, speculation=speculation, **kwargs
  )


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_tokens_equal_without_speculation(tiny, sampling):
  prompt = _prompts()
  pre = tiny.prefill(prompt)
  plain, spec = _both(
    tiny,
    [pre],
    prompt,
    steps=30,
    sample_ids=np.arange(4),
    sampling=SAMPLINGS[sampling],
    top_n=3,
  )
  assert_same(plain, spec)
  stats = spec[1].speculation
  assert plain[1].speculation is None
  assert stats.accepted_tokens >= 20, stats  # the oracle rows' drafts
  assert stats.draft_tokens > stats.accepted_tokens, stats  # garbage
  assert stats.mean_acceptance_length > 2
  assert 0 < stats.acceptance_rate < 1


def test_stops_and_budgets_inside_a_block(tiny):
  """A stop id that an accepted block runs into ends the row there, a
  budget ends mid-block, and a stream of speculative segments concatenates
  to the plain call."""
  prompt = _prompts()
  pre = tiny.prefill(prompt)
  kwargs = dict(sample_ids=np.arange(4), sampling=SAMPLINGS["temperature"])
  free, _ = tiny.generate([pre], steps=20, **kwargs)
  stop = int(np.asarray(free.tokens)[0, 9])  # deep inside an oracle block
  plain, spec = _both(tiny, [pre], prompt, steps=13, stop_ids=[stop], **kwargs)
  assert_same(plain, spec)
  assert int(plain[0].lengths[0]) <= 9  # it did stop row 0
  speculation = cw.Speculation(context=_context(prompt, plain[0]), **SPEC)
  segments = list(
    tiny.generate_stream(
      [pre],
      steps=13,
      every=5,
      stop_ids=[stop],
      speculation=speculation,
      **kwargs,
    )
  )
  tokens = cw.Chunk(
    tokens=np.concatenate([np.asarray(t.tokens) for t, _ in segments], 1),
    lengths=sum(np.asarray(t.lengths) for t, _ in segments),
  )
  np.testing.assert_array_equal(tokens.tokens, plain[0].tokens)
  np.testing.assert_array_equal(tokens.lengths, plain[0].lengths)
  merged = cw.concat_results([r for _, r in segments])
  np.testing.assert_array_equal(
    merged.per_token_scores[:, :13] * tokens.token_mask,
    plain[1].per_token_scores * tokens.token_mask,
  )
  np.testing.assert_array_equal(
    segments[-1][1].next_token_logits, plain[1].next_token_logits
  )
  # Each segment is a valid prefix: its logits are its last column's.
  again, _ = tiny.generate(
    [pre, segments[0][1]],
    steps=8,
    sample_ids=np.arange(4),
    sampling=cw.Sampling(temperature=0.0),
  )
  after, _ = tiny.generate(
    [pre, _prefix_of(tiny, pre, plain, 5)],
    steps=8,
    sample_ids=np.arange(4),
    sampling=cw.Sampling(temperature=0.0),
  )
  np.testing.assert_array_equal(again.tokens, after.tokens)


def _prefix_of(model, pre, plain, n):
  """The plain output's first n columns, prefilled."""
  tokens, _ = plain
  cut = cw.Chunk(
    tokens=np.asarray(tokens.tokens)[:, :n],
    lengths=np.minimum(np.asarray(tokens.lengths), n),
  )
  return model.prefill(cut, prefix=[pre])


def test_constraints_penalties_and_forced_drafts(tiny):
  """A JSON schema (its forced tokens are drafts, always accepted) and
  penalties: the processors see the drafts' state before each position and
  keep only the emitted tokens'."""
  schema = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}},
    "required": ["name"],
  }
  prompt = cw.Chunk.tokenize(
    tiny.vocab, ["ab", "cd", "ef", "gh"], is_first_chunk=True
  )
  pre = tiny.prefill(prompt)
  kwargs = dict(
    sample_ids=np.arange(4),
    sampling=SAMPLINGS["filters"],
    steps=24,
    top_n=2,
    constraint=[cw.constraints.JsonSchema(schema), None, None, None],
    processors=[cw.processors.penalties(repetition=1.3, frequency=0.2)],
    budget_forcing=True,
  )
  plain = tiny.generate([pre], **kwargs)
  forced = tiny.generate(
    [pre],
    speculation=cw.Speculation(drafter="forced", k=4, weight_rows=1e3),
    **kwargs,
  )
  assert_same(plain, forced)
  assert forced[1].speculation.accepted_tokens >= 5  # '{"name": "' at least
  assert forced[1].speculation.acceptance_rate == 1.0
  speculation = cw.Speculation(context=_context(prompt, plain[0]), **SPEC)
  assert_same(plain, tiny.generate([pre], speculation=speculation, **kwargs))
  text = plain[0].detokenize(tiny.vocab)[0]
  assert text.startswith('{"name"'), text


@pytest.mark.parametrize("sampling", ["greedy", "filters"])
def test_int8_draft_model(tiny, sampling):
  """The int8 copy of the weights drafts (reading the target's K/V): the
  tokens are the target's, stops and budgets end rows inside a block, and
  most drafts are accepted (the same key draws the same token where the
  two distributions are close)."""
  prompt = _prompts()
  pre = tiny.prefill(prompt)
  kwargs = dict(sample_ids=np.arange(4), sampling=SAMPLINGS[sampling], top_n=3)
  free, _ = tiny.generate([pre], steps=20, **kwargs)
  stop = int(np.asarray(free.tokens)[1, 7])
  for steps, stops in ((24, ()), (13, [stop])):
    plain = tiny.generate([pre], steps=steps, stop_ids=stops, **kwargs)
    spec = tiny.generate(
      [pre],
      steps=steps,
      stop_ids=stops,
      speculation=cw.Speculation(**DRAFT),
      **kwargs,
    )
    assert_same(plain, spec)
  assert int(plain[0].lengths[1]) <= 7  # the stop ended row 1
  stats = spec[1].speculation
  assert stats.passes == stats.steps > 0, stats  # every iteration drafted
  assert stats.acceptance_rate > 0.5, stats


def test_adapters():
  base = cw.InferenceModel.random(cw.configs.get("tiny"), seed=0)
  h = base.hparams
  model = base.with_adapters({"a": random_adapter(h, 4, 1)})
  prompt = _prompts()
  rows = ["a", None, "a", None]
  pre = model.prefill(prompt, adapters=rows)
  plain, spec = _both(
    model,
    [pre],
    prompt,
    steps=16,
    sample_ids=np.arange(4),
    sampling=SAMPLINGS["temperature"],
    adapters=rows,
  )
  assert_same(plain, spec)
  assert spec[1].speculation.accepted_tokens > 0


def test_on_a_mesh(cpu_devices):
  base = cw.InferenceModel.random(cw.configs.get("tiny"), seed=0)
  model = cw.InferenceModel(
    base.hparams,
    base.weights,
    mesh=make_mesh((2, 2, 2)),
    prefill_layout="ws_2d/yz",
    generate_layout="ws_2d/yz",
  )
  prompt = _prompts()
  pre = model.prefill(prompt)
  plain, spec = _both(
    model,
    [pre],
    prompt,
    steps=16,
    sample_ids=np.arange(4),
    sampling=SAMPLINGS["filters"],
    top_n=2,
  )
  assert_same(plain, spec)
  assert spec[1].speculation.accepted_tokens > 0
  # The int8 draft's weights are placed (and shuffled) for the layout too.
  drafted = model.generate(
    [pre],
    steps=16,
    sample_ids=np.arange(4),
    sampling=SAMPLINGS["filters"],
    top_n=2,
    speculation=cw.Speculation(**DRAFT),
  )
  assert_same(plain, drafted)
  assert drafted[1].speculation.accepted_tokens > 0


def test_generate_many_with_several_slots(tiny):
  """Each request drafts from its own prompt and tokens (greedy rows of the
  random model fall into loops, which prompt lookup catches)."""
  # Four requests over three slots (one waits for a slot), greedy and
  # sampled, of three budgets.
  prompt = _prompts(4)
  requests = [
    cw.Request(
      tokens=np.asarray(prompt.tokens)[b, : int(prompt.lengths[b])],
      sample_id=b,
      steps=16 + b % 3,
      sampling=SAMPLINGS["greedy" if b % 2 else "temperature"],
    )
    for b in range(4)
  ]
  plain = {r.index: r for r in tiny.generate_many(requests, slots=3, top_n=2)}
  for settings in (SPEC, DRAFT):
    spec = {
      r.index: r
      for r in tiny.generate_many(
        requests, slots=3, top_n=2, speculation=cw.Speculation(**settings)
      )
    }
    for i, r in plain.items():
      _same_request(spec[i], r)
      assert r.speculation is None and spec[i].speculation.steps > 0
    assert sum(s.speculation.accepted_tokens for s in spec.values()) > 0


def _same_request(got, want):
  """Two `RequestResult`s of one request: equal, bit for bit."""
  assert got.finish_reason == want.finish_reason
  for name in ("tokens", "per_token_scores", "top_ids", "top_logprobs"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def test_prompt_lookup_and_width_choice():
  """The drafter proposes what followed the latest earlier occurrence of
  the longest suffix; the width follows expected tokens per cost."""
  from chunkwise.inference import speculation as s

  history = np.array(
    [
      [5, 6, 7, 9, 5, 6, 7, 8, 5, 6, 0, 0],
      [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0],
    ],
    np.int32,
  )
  drafts, counts = s.ngram_drafts(history, np.int32([10, 4]), 3, 1, 3)
  # Row 0 ends "5 6": its latest earlier occurrence is followed by 7 8 5.
  np.testing.assert_array_equal(drafts[0], [7, 8, 5])
  assert counts.tolist() == [3, 0]  # row 1's "4" never occurred before
  drafts, counts = s.ngram_drafts(history, np.int32([9, 4]), 8, 1, 3)
  np.testing.assert_array_equal(drafts[0, :4], [6, 7, 8, 5])  # after "5"
  assert counts[0] == 4  # up to the end of the history

  def width(batch, count, rate):
    pick = s.choose_width(
      spec,
      np.ones(batch, bool),
      np.full(batch, count, np.int32),
      np.full(batch, rate, np.float32),
    )
    return spec.widths[int(pick)]

  spec = cw.Speculation(k=8, weight_rows=20.0).checked()
  assert spec.widths == (0, 2, 4, 8)

  assert width(1, 8, 0.9) == 8 and width(1, 8, 0.5) == 4
  assert width(1, 1, 0.5) == 2
  assert width(1, 0, 0.9) == 0  # nothing drafted: a plain step
  assert width(16, 8, 0.5) == 0  # wide batches draft where it pays
  assert width(16, 8, 0.99) == 8
  # Forced drafts are sure: one row's four pay for a batch of 4.
  pick = s.choose_width(
    spec,
    np.ones(4, bool),
    np.int32([4, 0, 0, 0]),
    np.full(4, 0.5, np.float32),
    np.int32([4, 0, 0, 0]),
  )
  assert spec.widths[int(pick)] == 4
  # The int8 draft's steps cost half a plain step each: it drafts when
  # its drafts are likely accepted, and a short pass pays best.
  spec = cw.Speculation(drafter="draft", k=8, draft_cost=0.5).checked()
  assert width(1, 8, 0.5) == 0 and width(1, 8, 0.9) == 2
  assert width(1, 8, 0.99) == 8


class _Device:
  """A device where a pass of width w costs (1 + w)^2 plain steps: wide
  passes do not pay. Its clock charges a call forced to width w as 12
  such passes (what the host would time)."""

  def __init__(self, calibration):
    self.calibration, self.now, self.started = calibration, 0.0, None

  def __call__(self):
    if self.started is None:  # a call starts: it runs the forced width
      _, force = self.calibration.costs()
      self.width = self.calibration.spec.widths[force]
      self.started = self.now
      return self.now
    self.started = None  # it ended
    self.now += 12 * (1 + self.width) ** 2
    return self.now


def test_wrong_cost_constants_recover_once_passes_are_timed(tiny):
  """Constants that make every pass look free (weight_rows=1e6) on a
  device where wide passes cost more than they give: the first calls
  force each width once and are timed, then the loop drafts no more. The
  tokens never change, and the same run on this CPU's real clock ends
  with every width timed and those times used."""
  from chunkwise.inference.speculation.calibration import Calibration

  prompt = _chunk([[1, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]])
  pre = tiny.prefill(prompt)
  kwargs = dict(sample_ids=np.arange(1), steps=12, sampling=SAMPLINGS["greedy"])
  plain = tiny.generate([pre], **kwargs)
  spec = cw.Speculation(k=4, weight_rows=1e6)
  calibration = Calibration(spec.checked(), rows=1)
  calibration.clock = _Device(calibration)
  tiny._calibrations[(spec.checked(), 1)] = calibration
  passes = []
  for _ in range(6):  # 1 compile + 3 widths timed (0, 2, 4) + 2 after
    got = tiny.generate([pre], speculation=spec, **kwargs)
    assert_same(plain, got)
    passes.append(got[1].speculation.passes)
  assert passes[0] > 0  # the wrong constants: every iteration drafts
  assert calibration.done
  # Per-iteration costs: the device's 12 (1 + w)^2 a call, over the
  # call's iterations (12 plain steps; fewer, where drafts were kept).
  assert calibration.seconds[0] == 1
  assert 9 <= calibration.seconds[1] < calibration.seconds[2]
  assert passes[-2:] == [0, 0]  # recovered: plain steps only
  # This CPU's clock: the same calls time every width and use the times.
  real = cw.Speculation(k=4, weight_rows=1e6, ngram_max=2)
  for _ in range(5):
    assert_same(plain, tiny.generate([pre], speculation=real, **kwargs))
  timed = tiny._calibrations[(real.checked(), 1)]
  assert timed.done and (timed.seconds > 0).all()
  cost, force = timed.costs()
  assert force == -1 and np.array_equal(cost, timed.seconds.astype(np.float32))


def test_bad_speculation_is_refused_before_any_work(tiny):
  pre = tiny.prefill(_prompts())
  kwargs = dict(sample_ids=np.arange(4), steps=4)
  for bad, match in [
    ("ngram", "must be a chunkwise.Speculation"),
    (cw.Speculation(drafter="eagle"), "drafter must be one of"),
    (cw.Speculation(k=0), r"k must be in \[1, 64\]"),
    (cw.Speculation(k=4, widths=(2,)), "must include k=4"),
    (cw.Speculation(ngram_min=3, ngram_max=2), "ngram_max must be in"),
    (cw.Speculation(context=_chunk([[1, 2]] * 3)), "does not divide"),
    (cw.Speculation(drafter="draft", draft_cost=-1), "draft_cost must be"),
  ]:
    with pytest.raises(ValueError, match=match):
      tiny.generate([pre], speculation=bad, **kwargs)
  h = tiny.hparams
  int8 = cw.InferenceModel(
    h,
    cw.models.quantized.quantize_weights(
      tiny.weights, cw.models.Weights.axes(h)
    ),
  )
  with pytest.raises(ValueError, match="int8 already"):
    int8.generate([], speculation=cw.Speculation(drafter="draft"), **kwargs)
  with pytest.raises(ValueError, match="requests draft from their own"):
    tiny.generate_many(
      [cw.Request(tokens=[1, 2], sample_id=0, steps=2)],
      slots=1,
      speculation=cw.Speculation(context=_chunk([[1]])),
    )


def test_server_engine_and_its_metrics(tiny):
  """A speculating serving engine: each stream equals `generate` alone on
  its request; /metrics has vLLM's speculative decoding counters."""
  from chunkwise import serving
  from chunkwise.serving import metrics as metrics_lib
  from tests.test_serving_engine import _alone, _gens

  # Two slots of 32 columns (a prompt of at most 9 tokens, 11 new ones):
  # its warm-up compiles every program of a speculating engine, and a
  # small loop has fewer row counts and prompt buckets to compile.
  engine = serving.Engine(
    tiny,
    slots=2,
    capacity=32,
    top_n=3,
    every=4,
    speculation=cw.Speculation(**SPEC),
  )
  try:
    gens = [
      g if i % 2 else dataclasses.replace(g, temperature=0.0, top_k=0)
      for i, g in enumerate(_gens(tiny, 4, seed=3))
    ]
    streams = [engine.submit(g) for g in gens]
    for g, s in zip(gens, streams, strict=True):
      got = list(s)
      ids, scores, top = _alone(tiny, g, s.seed or 0)
      kept = got if s.finish_reason == "length" else got[: len(ids)]
      assert [t.id for t in kept] == ids
      np.testing.assert_array_equal(
        np.float32([t.logprob for t in kept]), scores
      )
      assert [[i for i, _ in t.top] for t in kept] == top.tolist()
    totals = engine.speculation_totals
    assert totals.steps > 0 and totals.accepted_tokens > 0, totals
    text = metrics_lib.Metrics(engine, model_id="m").exposition().decode()
    for name, value in (
      ("drafts", totals.drafts),
      ("draft_tokens", totals.draft_tokens),
      ("accepted_tokens", totals.accepted_tokens),
    ):
      line = f'vllm:spec_decode_num_{name}_total{{model_name="m"}} {value:.1f}'
      assert line in text, text[-600:]
  finally:
    assert engine.close(grace=5.0)
