"""The always-on engine (`model.live_slots`, `chunkwise.serving.Engine`):
requests arriving at any time get the tokens `generate` gives each alone;
cancellation and stop strings free slots; a failure stays with its
request; text pieces join to the decoded text."""

import asyncio
import threading

import numpy as np
import pytest

import chunkwise as cw
from chunkwise import serving
from chunkwise.serving import text as text_lib
from tests.test_continuous import _check, _requests

PENALTY = cw.processors.penalties


def _alone(model, g: serving.Generation, seed: int):
  """`generate` of one serving request alone (its penalties included;
  budget forcing with a constraint, as the server always forces)."""
  prompt = cw.Chunk(
    tokens=np.asarray([g.prompt], np.int32),
    lengths=np.asarray([len(g.prompt)], np.int32),
  )
  tokens, result = model.generate(
    [model.prefill(prompt, adapters=g.adapter)],
    sample_ids=[g.sample_id],
    steps=g.max_new_tokens,
    sampling=cw.Sampling(
      temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, seed=seed
    ),
    stop_ids=tuple(g.stop_ids),
    constraint=g.constraint,
    budget_forcing=g.constraint is not None,
    processors=[
      PENALTY(
        repetition=g.repetition_penalty,
        frequency=g.frequency_penalty,
        context=prompt,
      )
    ],
    top_n=g.top_n,
    adapters=g.adapter,
  )
  n = int(tokens.lengths[0])
  return (
    np.asarray(tokens.tokens[0, :n]).tolist(),
    np.asarray(result.per_token_scores[0, :n]),
    np.asarray(result.top_ids[0, :n]),
  )


def _stepped(loop, arrivals):
  """Runs `loop`, adding arrivals[k] (key, prepared) before step k; returns
  {key: [SlotUpdate, ...]} and the most requests running at once."""
  out, busiest, k = {}, 0, 0
  while k < len(arrivals) or loop.busy:
    for key, prepared in arrivals[k] if k < len(arrivals) else ():
      loop.add(key, prepared)
    k += 1
    for u in loop.step():
      out.setdefault(u.key, []).append(u)
    busiest = max(busiest, loop.running)
  return out, busiest


def test_live_slots_equal_generate_alone(tiny):
  """Requests added while others run (mixed prompts, greedy / sampled,
  stop ids, constraints) equal `generate_many`'s contract: each request's
  tokens, scores and top-n are those of `generate` alone."""
  from tests.test_continuous import _alone as alone

  requests = _requests(tiny, 9, seed=3)
  requests = [r for r in requests if r.tokens] + [
    cw.Request(tokens=[1], sample_id=999, steps=5)
  ]
  loop = tiny.live_slots(slots=3, capacity=64, top_n=3, every=4, stop_width=48)
  ready = [loop.prepare(r) for r in requests]
  # Three arrive at once, the rest one per segment.
  arrivals = [[(i, ready[i]) for i in range(3)]] + [
    [(i, ready[i])] for i in range(3, len(ready))
  ]
  out, busiest = _stepped(loop, arrivals)
  assert busiest == 3 and loop.running == 0 and not loop.busy
  got = {}
  for i, updates in out.items():
    last = updates[-1]
    assert last.finish_reason is not None
    assert all(u.finish_reason is None for u in updates[:-1])
    got[i] = cw.RequestResult(
      index=i,
      tokens=np.concatenate([u.tokens for u in updates]),
      per_token_scores=np.concatenate([u.per_token_scores for u in updates]),
      top_ids=np.concatenate([u.top_ids for u in updates]),
      top_logprobs=np.concatenate([u.top_logprobs for u in updates]),
      finish_reason=last.finish_reason,
    )
    if last.finish_reason == "stop":
      assert last.stop_id in (*requests[i].stop_ids, tiny.eos_id)
  want = [alone(tiny, (), r, top_n=3) for r in requests]
  _check(got, want, "live")


def test_cancel_frees_the_slot_at_the_next_step(tiny):
  loop = tiny.live_slots(slots=2, capacity=64, every=2)
  long = cw.Request(tokens=[1, 5], sample_id=0, steps=40)
  for key in "ab":
    loop.add(key, loop.prepare(long))
  loop.add("c", loop.prepare(long))  # waits: two slots
  loop.step()
  assert (loop.running, loop.waiting) == (2, 1)
  loop.cancel("a")
  loop.cancel("c")
  updates = loop.step()
  assert {u.key for u in updates} == {"b"}
  assert (loop.running, loop.waiting) == (1, 0)
  with pytest.raises(ValueError, match="already in use"):
    loop.add("b", loop.prepare(long))


def test_live_slots_refuse_bad_requests_before_device_work(tiny):
  loop = tiny.live_slots(slots=2, capacity=32, top_n=2)
  with pytest.raises(ValueError, match="over the loop's capacity=32"):
    loop.prepare(cw.Request(tokens=[1] * 20, sample_id=0, steps=20))
  with pytest.raises(ValueError, match="stop_width=8"):
    loop.prepare(
      cw.Request(tokens=[1], sample_id=0, steps=2, stop_ids=range(3, 20))
    )
  with pytest.raises(ValueError, match=r"tokens.*outside"):
    loop.prepare(cw.Request(tokens=[1, 10**6], sample_id=0, steps=2))
  with pytest.raises(ValueError, match="processors"):
    loop.prepare(
      cw.Request(tokens=[1], sample_id=0, steps=2), (PENALTY(),)
    )  # this loop runs none
  with pytest.raises(ValueError, match="slots=3 must be a multiple"):
    cw.InferenceModel.random(
      cw.configs.get("tiny"),
      seed=0,
      mesh=cw.partitioning.make_mesh((2, 2, 2)),
      layout="ws_2d/z",
    ).live_slots(slots=3, capacity=32)


@pytest.fixture(scope="module")
def engine(tiny):
  e = serving.Engine(
    tiny, slots=3, capacity=96, top_n=3, every=4, warm_up=False
  )
  yield e
  assert e.close(grace=5.0)


def _gens(model, n, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    prompt = [model.bos_id, *rng.integers(3, 259, int(rng.integers(1, 9)))]
    out.append(
      serving.Generation(
        prompt=[int(t) for t in prompt],
        max_new_tokens=int(rng.choice([4, 11, 23])),
        temperature=[0.0, 0.9, 0.7][i % 3],
        top_k=[0, 0, 30][i % 3],
        seed=[None, 12, None][i % 3],
        sample_id=i % 2,
        stop_ids=(int(rng.integers(3, 259)),) if i % 4 == 1 else (),
        constraint=cw.constraints.Regex("[a-c]+x") if i % 5 == 2 else None,
        repetition_penalty=[1.0, 1.3][i % 2],
        frequency_penalty=[0.0, 0.4][i % 3 == 1],
        top_n=i % 4,
      )
    )
  return out


def test_engine_streams_equal_generate_alone(tiny, engine):
  """Ten requests submitted from four threads while others run: each
  stream's tokens equal `generate` alone on the same request (its seed,
  reported when it was drawn), scores to float rounding; a constrained
  request's tokens say which its constraint forced."""
  gens = _gens(tiny, 10)
  streams = [None] * len(gens)
  flags = set()

  def submit(idx):
    for i in idx:
      streams[i] = engine.submit(gens[i])

  threads = [
    threading.Thread(target=submit, args=(range(k, 10, 4),)) for k in range(4)
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for g, s in zip(gens, streams, strict=True):
    got = list(s)  # blocks until it ends
    assert s.finish_reason in ("length", "eos_token", "stop_sequence")
    if g.greedy:
      assert s.seed is None
    elif g.seed is not None:
      assert s.seed == g.seed
    ids, scores, top = _alone(tiny, g, s.seed or 0)
    kept = [t for t in got if not (t.special and t is got[-1])]
    if s.finish_reason == "length":
      kept = got
    assert [t.id for t in kept] == ids
    # Invariant numerics: bit-identical to `generate` alone.
    np.testing.assert_array_equal(np.float32([t.logprob for t in kept]), scores)
    assert [[i for i, _ in t.top] for t in kept] == top.tolist()
    assert s.text == "".join(t.text for t in got if not t.special)
    assert [t.forced for t in got] == _forced(engine, g, got)
    flags.update(t.forced for t in got)
  assert flags == {None, True, False}
  assert engine.running == 0 and engine.waiting == 0


def _forced(engine, g, tokens):
  """Which tokens the constraint allowed alone (None without one), from
  its tables' unpacked bits."""
  if g.constraint is None:
    return [None] * len(tokens)
  (prepared, _), state, out = engine.prepare(g), 0, []
  for t in tokens:
    out.append(len(prepared.tables.allowed(state)) == 1)
    state = prepared.tables.step(state, t.id)
  return out


def test_a_drawn_seed_replays(tiny, engine):
  g = serving.Generation(prompt=[1, 40, 41], max_new_tokens=12, temperature=1)
  first = engine.submit(g).wait()
  assert first.seed is not None
  again = engine.submit(
    serving.Generation(
      prompt=g.prompt, max_new_tokens=12, temperature=1, seed=first.seed
    )
  ).wait()
  assert [t.id for t in again.tokens] == [t.id for t in first.tokens]


def test_async_iteration_and_cancel(tiny, engine):
  # A seed whose first 80 tokens hold no EOS: the reader cancels first.
  g = serving.Generation(
    prompt=[1, 7], max_new_tokens=80, temperature=1.0, seed=5
  )

  async def read_some():
    s = engine.submit(g)
    got = []
    async for token in s:
      got.append(token)
      if len(got) >= 5:
        s.cancel()
        break
    return s, got

  s, got = asyncio.run(read_some())
  s.wait(timeout=30)
  assert s.finish_reason == "cancelled" and len(got) >= 5
  assert len(s.tokens) < 80
  assert engine.active == 0 and engine.running == 0


def test_stop_string_ends_the_request_and_frees_its_slot(tiny, engine):
  g = serving.Generation(prompt=[1, 7], max_new_tokens=40, temperature=0)
  free = engine.submit(g).wait()
  text = free.text
  assert len(text) > 6
  stop = text[3:5]
  s = engine.submit(
    serving.Generation(
      prompt=[1, 7], max_new_tokens=40, temperature=0, stop=[stop]
    )
  ).wait()
  assert s.finish_reason == "stop_sequence" and s.stop_sequence == stop
  assert s.text == text[: text.index(stop) + len(stop)]
  assert len(s.tokens) < len(free.tokens)
  assert engine.running == 0


def test_a_failing_request_fails_alone(tiny, engine, monkeypatch):
  """An exception while handling one request's tokens ends that stream
  with an error (and frees its slot); the others finish as usual. One in
  the device step fails the running ones and the engine starts again."""
  original = serving.TokenStream._feed

  def feed(self, update):
    if self.generation.prompt[1] == 66:
      raise RuntimeError("injected fault")
    return original(self, update)

  monkeypatch.setattr(serving.TokenStream, "_feed", feed)
  gens = _gens(tiny, 4, seed=5)
  bad = serving.Generation(prompt=[1, 66, 67], max_new_tokens=30)
  streams = [engine.submit(g) for g in (gens[0], bad, *gens[1:])]
  for s in streams:
    s.wait(timeout=60)
  assert streams[1].finish_reason == "error"
  assert "injected fault" in streams[1].error
  with pytest.raises(serving.GenerationFailed, match="injected"):
    list(streams[1])
  for g, s in zip(gens, [streams[0], *streams[2:]], strict=True):
    assert s.finish_reason != "error"
    assert [t.id for t in s.tokens][: len(_alone(tiny, g, s.seed or 0)[0])] == (
      _alone(tiny, g, s.seed or 0)[0]
    )
  monkeypatch.undo()
  assert engine.running == 0

  from chunkwise.inference.batching import live

  failed = []
  step = live.LiveSlots.step

  def failing_step(self, steps=None):
    # The first step with the request in it (admitting it), whatever the
    # segments' lengths: one step may run all its tokens.
    if not failed and (self.waiting or self.running):
      failed.append(1)
      raise RuntimeError("device fault")
    return step(self, steps)

  monkeypatch.setattr(live.LiveSlots, "step", failing_step)
  s = engine.submit(serving.Generation(prompt=[1, 9], max_new_tokens=30))
  s.wait(timeout=60)
  assert s.finish_reason == "error" and "device fault" in s.error
  after = engine.submit(gens[0]).wait(timeout=60)
  assert [t.id for t in after.tokens][: len(_alone(tiny, gens[0], 0)[0])] == (
    _alone(tiny, gens[0], after.seed or 0)[0]
  )


def test_engine_refuses_bad_requests(tiny, engine):
  with pytest.raises(ValueError, match="top_n=9"):
    engine.submit(serving.Generation(prompt=[1], max_new_tokens=2, top_n=9))
  with pytest.raises(ValueError, match="seed"):
    engine.submit(serving.Generation(prompt=[1], max_new_tokens=2, seed=-1))
  with pytest.raises(ValueError, match="capacity=96"):
    engine.submit(serving.Generation(prompt=[1] * 50, max_new_tokens=60))
  with pytest.raises(ValueError, match=r"penalties\.repetition"):
    engine.submit(
      serving.Generation(prompt=[1], max_new_tokens=2, repetition_penalty=0)
    )


def hold_after_first_tokens(e: serving.Engine) -> threading.Event:
  """Holds `e`'s thread before the segment after the one that gave the
  first tokens, until the returned event is set (tests then see the
  queue as it is, however fast the model is)."""
  started, go, apply = threading.Event(), threading.Event(), e._apply

  def held(*args):
    if started.is_set():
      go.wait(60)
    out = apply(*args)
    if out:  # the first request's first tokens
      started.set()
    return out

  e._apply = held
  return go


def test_overloaded_and_closed(tiny):
  e = serving.Engine(
    tiny, slots=1, capacity=64, max_queue=1, every=2, warm_up=False
  )
  # The first request stays in the slot however fast the model is.
  go = hold_after_first_tokens(e)
  g = serving.Generation(prompt=[1, 3], max_new_tokens=40)
  first = e.submit(g)
  first_tokens = iter(first)
  next(first_tokens)  # running
  e.submit(g)  # waits
  with pytest.raises(serving.Overloaded):
    e.submit(g)
  go.set()
  assert e.close(grace=60.0)
  with pytest.raises(serving.Closed):
    e.submit(g)


def test_pieces_join_to_the_text_and_never_split_a_character():
  vocab = cw.ByteVocabulary()
  ids = [*vocab.encode("añb€"), vocab.EOS]
  d = text_lib.Detokenizer(vocab, specials=[vocab.EOS])
  pieces = [d.add(i) for i in ids]
  assert pieces == ["a", "", "ñ", "b", "", "", "€", ""]
  assert d.is_special(vocab.EOS) and not d.is_special(ids[0])
  d = text_lib.Detokenizer(vocab)
  assert d.add(vocab.encode("€")[0]) == "" and d.flush() == "\ufffd"


def test_the_stop_scanner_is_the_plain_search():
  """`StopScanner` (incremental, one step per character) finds what
  `StopStrings` (its twin, the text searched again) finds, and holds back
  as much, on random texts fed in random pieces."""
  rng = np.random.default_rng(0)
  for _ in range(2000):
    stops = [
      "".join(rng.choice(list("ab\nE"), rng.integers(1, 6)))
      for _ in range(rng.integers(1, 5))
    ]
    plain, scan, text = (
      text_lib.StopStrings(stops),
      text_lib.StopScanner(stops),
      "",
    )
    for _ in range(rng.integers(1, 12)):
      piece = "".join(rng.choice(list("ab\nE"), rng.integers(0, 5)))
      text += piece
      found = plain.find(text, len(piece))
      assert scan.feed(piece) == found, (stops, text)
      if found is not None:
        break
      assert scan.held == len(text) - plain.safe(text), (stops, text)


def test_a_streamed_choice_holds_back_what_may_start_a_stop():
  """`Held` sends each chunk's new text but what may still begin a stop
  string, never a stop string's character, and at the end the rest."""
  from chunkwise.serving import stream as stream_lib
  from chunkwise.serving.faces import openai_api

  class Stream:  # what `Held` reads of a `TokenStream`
    def __init__(self):
      self._chars, self.finish_reason, self.stop_sequence = [], None, None

    def text_after(self, pieces):
      return "".join(self._chars[pieces:]), len(self._chars)

  s, held = Stream(), openai_api.Held(["END"])
  sent = []
  for piece in ["ab", "c E", "N", "x EN"]:
    s._chars.append(piece)
    sent.append(held.delta(s, False))
  assert sent == ["ab", "c ", "", "ENx "]  # "EN" held, then let go
  s._chars.append("D")  # the engine ends on "END"
  s.finish_reason, s.stop_sequence = stream_lib.STOP_SEQUENCE, "END"
  assert held.delta(s, True) == "" and held.sent == len("abc ENx ")
  s, held = Stream(), openai_api.Held(["END"])
  s._chars += ["a E", "N"]
  assert held.delta(s, False) == "a "
  s.finish_reason = stream_lib.LENGTH  # it ended there: all of it
  assert held.delta(s, True) == "EN"


def test_stop_strings_find_and_hold_back():
  s = text_lib.StopStrings(["END", "\n\n"])
  assert s.find("abc EN", 2) is None
  assert s.find("abc END!", 3) == (4, "END")
  assert s.find("a\n\n", 1) == (1, "\n\n")
  assert s.find("a\n\nEND", 1) == (3, "END")  # earlier text was seen before
  assert s.safe("abc EN") == 4  # "EN" may become "END"
  assert s.safe("abc\n") == 3
  assert s.safe("abc") == 3
  assert text_lib.StopStrings([]).safe("x\n") == 2


def test_streamed_logprobs_follow_the_text_shown():
  """A streamed completion's log-probs cover exactly the tokens whose text
  was sent: a token the text has not reached (held back for a stop string,
  or read before its text) waits for a later chunk, never dropped; at the
  end, tokens past the shown text (a stop string's) are left out."""
  from chunkwise.serving.faces import openai_api
  from chunkwise.serving.stream import Token

  class Entries:  # what `CompletionLogprobs.token` is given
    def token(self, t, text):
      return (t.id, text)

  toks = [Token(1, "aa", 0.0, False), Token(2, "b", 0.0, False)]
  toks += [Token(3, "", 0.0, False), Token(4, "EN", 0.0, False)]
  toks += [Token(5, "D!", 0.0, False), Token(0, "", 0.0, True)]
  lp = Entries()
  # 2 characters shown: "b" waits
  assert openai_api.shown_entries(lp, toks, 0, 2, False) == ([(1, "aa")], 1, 2)
  # "aab" shown, "EN" held back (it may start "END"): the empty token goes
  out = openai_api.shown_entries(lp, toks[1:], 2, 3, False)
  assert out == ([(2, "b"), (3, "")], 2, 3)
  # the end, the stop string "END" cut: "EN" is not shown, nor what follows
  out = openai_api.shown_entries(lp, toks[3:], 3, 3, True)
  assert out == ([], 0, 3)
  # the end with all text shown: "D!" and the special token complete it
  out = openai_api.shown_entries(lp, toks[3:], 3, 7, True)
  assert out == ([(4, "EN"), (5, "D!")], 3, 7)
  assert openai_api.completion_entries(lp, toks, 4) == [
    (1, "aa"),
    (2, "b"),
    (3, ""),
    (4, "E"),
  ]


def test_a_fault_fails_one_http_request_and_the_server_goes_on(
  tiny, monkeypatch
):
  """Through HTTP (the server in a thread, `serving.Background`): a fault
  while handling one request's tokens is a 424 GenerationError for it, an
  in-stream error when it streams; the next requests are served."""
  import lorax

  e = serving.Engine(tiny, slots=2, capacity=64, top_n=2, warm_up=False)
  running = serving.Background(
    serving.Context(
      engine=e, model_id="tiny", max_input_tokens=32, max_total_tokens=64
    )
  )
  original = serving.TokenStream._feed
  boom = tiny.vocab.encode("boom")

  def feed(self, update):
    if list(self.generation.prompt[1:]) == boom:
      raise RuntimeError("injected fault")
    return original(self, update)

  monkeypatch.setattr(serving.TokenStream, "_feed", feed)
  try:
    client = lorax.Client(running.url)
    with pytest.raises(lorax.errors.GenerationError, match="injected fault"):
      client.generate("boom", max_new_tokens=8)
    with pytest.raises(lorax.errors.GenerationError, match="injected fault"):
      list(client.generate_stream("boom", max_new_tokens=8))
    fine = client.generate("fine", max_new_tokens=8)
    assert fine.details.generated_tokens >= 1
    assert e.running == 0
  finally:
    running.stop()
  assert e.closing


def test_a_speculating_engine_fast_forwards_constraints(tiny):
  """With forced drafts, a request's constraint fast-forwards: the engine
  compiles it so (`Constraint.fast_forward`) and its tokens are
  `model.generate`'s under that constraint, each forced run appended in
  one pass."""
  schema = cw.constraints.JsonSchema(
    {
      "type": "object",
      "properties": {"name": {"type": "string", "maxLength": 6}},
      "required": ["name"],
    },
    whitespace="compact",
  )
  speculation = cw.Speculation(drafter="forced", k=4, calibrate=False)
  e = serving.Engine(
    tiny, slots=2, capacity=64, warm_up=False, speculation=speculation
  )
  try:
    g = serving.Generation(
      prompt=[1, 40, 41], max_new_tokens=24, temperature=0, constraint=schema
    )
    prepared, _ = e.prepare(g)
    assert prepared.tables.fast_forward
    got = [t.id for t in e.submit(g).wait().tokens]
    assert e.speculation_totals.accepted_tokens >= 5  # '{"name":"'
  finally:
    e.close(grace=30.0)
  want, _ = tiny.generate(
    [tiny.prefill(cw.Chunk.from_lists([[1, 40, 41]]))],
    sample_ids=[0],
    steps=24,
    sampling=cw.Sampling(temperature=0.0),
    constraint=schema.fast_forwarded(),
  )
  # The stream ends with the stop id that `generate` writes after its row.
  n = int(want.lengths[0])
  assert got == np.asarray(want.tokens)[0, : n + 1].tolist()
  assert got[-1] in tiny.eos_ids
