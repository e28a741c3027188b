"""The prefix cache: full pages of prompts' K/V shared across requests.

The index (lookup, insert, reference counts, LRU eviction under a byte
cap) is tested on small arrays; the slot loops with a cache are held to
the continuous-batching contract: every request equals `generate` run
alone on it, bit for bit (invariant numerics), hits or not."""

import threading
import time

import jax
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.inference.paging import prefix_cache as pc
from chunkwise.partitioning import make_mesh

PAGE = 8


def _kv(columns: int, rows: int = 1, fill: float = 0.0) -> cw.KVCache:
  """K/V of [1 layer, rows, columns, 1 head, 2] whose values name their
  column (+ fill), so a page's contents show where it was cut from."""
  k = np.zeros((1, rows, columns, 1, 2), np.float32)
  k += np.arange(columns, dtype=np.float32)[None, None, :, None, None] + fill
  return cw.KVCache(k=k, v=-k, lengths=np.full(rows, columns, np.int32))


PAGE_BYTES = 2 * PAGE * 2 * 4  # k and v, f32


def test_lookup_finds_the_longest_run_of_whole_pages():
  cache = pc.PrefixCache(1 << 20, page=PAGE)
  prompt = np.arange(30)
  assert cache.lookup(0, prompt).tokens == 0
  cache.insert(0, prompt, _kv(32), row=0, offset=0)
  assert cache.stats.pages == 3 and cache.stats.bytes == 3 * PAGE_BYTES
  hit = cache.lookup(0, prompt)
  assert hit.tokens == 24
  np.testing.assert_array_equal(
    np.asarray(hit.head.k)[0, 0, :24, 0, 0], np.arange(24)
  )
  assert hit.head.k.shape[2] == 32  # 3 pages padded to 4 (masked)
  np.testing.assert_array_equal(hit.head.lengths, [24])
  # Never the last token: a prompt of exactly 3 pages reuses 2.
  assert cache.lookup(0, prompt[:24]).tokens == 16
  # Pages match whole and in order: a change in page 2 keeps page 1.
  other = prompt.copy()
  other[12] = 99
  assert cache.lookup(0, other).tokens == 8
  # Another space (adapter) shares nothing.
  assert cache.lookup(1, prompt).tokens == 0
  s = cache.stats
  assert (s.hit_requests, s.miss_requests) == (3, 2)
  assert s.queries == 30 + 30 + 24 + 30 + 30 and s.hits == 24 + 16 + 8


def test_insert_after_a_hit_stores_the_pages_that_follow():
  """A prompt prefilled after a 16-token hit: its K/V columns start at
  position 16, and only its new full pages are stored (cut right)."""
  cache = pc.PrefixCache(1 << 20, page=PAGE)
  prompt = np.arange(40)
  cache.insert(0, prompt[:20], _kv(20), row=0, offset=0)
  hit = cache.lookup(0, prompt)
  assert hit.tokens == 16
  cache.insert(0, prompt, _kv(24, rows=2, fill=100.0), row=1, offset=16)
  cache.release(hit)
  got = cache.lookup(0, prompt)
  assert got.tokens == 32
  np.testing.assert_array_equal(
    np.asarray(got.head.k)[0, 0, :32, 0, 0],
    np.concatenate([np.arange(16), 100 + np.arange(16)]),
  )


def test_lru_eviction_under_the_byte_cap_spares_pinned_pages():
  """A cap of 3 pages, prompts of 2 full pages each."""
  cache = pc.PrefixCache(3 * PAGE_BYTES, page=PAGE)
  a, b, c = (np.arange(17) + 1000 * i for i in range(3))

  def reused(prompt):
    hit = cache.lookup(0, prompt)
    cache.release(hit)
    return hit.tokens

  cache.insert(0, a, _kv(17), row=0, offset=0)
  hit_a = cache.lookup(0, a)  # pinned until released
  cache.insert(0, b, _kv(17), row=0, offset=0)
  # b's first page fits; its second does not (a's are pinned, b's first
  # is its parent).
  s = cache.stats
  assert (s.pages, s.stored, s.evicted) == (3, 3, 0)
  assert reused(b) == 8
  # c's first page takes the room of b's (the only unreferenced page);
  # its second cannot fit.
  cache.insert(0, c, _kv(17), row=0, offset=0)
  s = cache.stats
  assert (s.pages, s.evicted, s.bytes) == (3, 1, 3 * PAGE_BYTES)
  assert (reused(b), reused(c)) == (0, 8)
  # Unpinned, a's leaf is the least recently used free page (its root is
  # still its leaf's parent): c's second page takes its room.
  cache.release(hit_a)
  cache.insert(0, c, _kv(17), row=0, offset=0)
  assert (reused(c), reused(a)) == (16, 8)
  s = cache.stats
  assert (s.pages, s.evicted, s.bytes) == (3, 2, 3 * PAGE_BYTES)
  # Every refcount is back to its cached children.
  pages = list(cache._pages.values())
  assert all(p.refs == sum(q.parent is p for q in pages) for p in pages)


def test_a_page_over_the_cap_is_not_stored():
  cache = pc.PrefixCache(PAGE_BYTES - 1, page=PAGE)
  cache.insert(0, np.arange(20), _kv(20), row=0, offset=0)
  assert cache.stats.pages == 0 and cache.stats.evicted == 0


def test_bad_sizes_are_refused():
  for bad in (-1, 2.5, True, "1"):
    with pytest.raises(ValueError, match=r"max_bytes=.*non-negative"):
      pc.make(bad)
  for bad in (0, -8, 1.5):
    with pytest.raises(ValueError, match=r"page=.*positive"):
      pc.PrefixCache(100, page=bad)
  assert pc.make(0) is None
  h = cw.configs.get("tiny")
  model = cw.InferenceModel.random(h, seed=0)
  request = cw.Request(tokens=[5, 6], sample_id=0, steps=2)
  with pytest.raises(ValueError, match="max_bytes=-3"):
    model.generate_many([request], slots=1, prefix_cache_bytes=-3)
  with pytest.raises(ValueError, match="max_bytes=-3"):
    model.live_slots(slots=1, capacity=32, prefix_cache_bytes=-3)


def _shared_start(vocab, n, *, start=40, seed=0):
  """Requests whose prompts start with one of two `start`-token system
  prompts (5 full pages of 8), in turn, then differ (a few identical),
  with mixed sampling. Alternating starts put cache hits into slots that
  held the other start (whose stale K/V would show a hit not written)."""
  rng = np.random.default_rng(seed)
  systems = [rng.integers(3, vocab, start).tolist() for _ in range(2)]
  out = []
  for i in range(n):
    n = 8 if i == 5 else int(rng.choice([1, 5, 13]))  # 5: whole pages
    tail = rng.integers(3, vocab, n).tolist()
    tokens = systems[i % 2] + (tail if i % 4 else [7, 8, 9])
    out.append(
      cw.Request(
        tokens=tokens,
        sample_id=i,
        steps=int(rng.choice([4, 9])),
        sampling=cw.Sampling(temperature=float(i % 2), seed=3),
      )
    )
  return out


def _alone(model, r, prefix=()):
  chunk = cw.Chunk.from_lists([r.tokens])
  tokens, result = model.generate(
    [*prefix, model.prefill(chunk, prefix=list(prefix))],
    sample_ids=[r.sample_id],
    steps=r.steps,
    sampling=r.sampling,
  )
  n = int(tokens.lengths[0])
  return (
    np.asarray(tokens.tokens)[0, :n],
    np.asarray(result.per_token_scores)[0, :n],
  )


@pytest.fixture(scope="module")
def shared(tiny):
  requests = _shared_start(tiny.hparams.vocab, 10)
  return requests, [_alone(tiny, r) for r in requests]


def _check(got, want):
  for i, (tokens, scores) in enumerate(want):
    np.testing.assert_array_equal(got[i][0], tokens, err_msg=str(i))
    np.testing.assert_array_equal(got[i][1], scores, err_msg=str(i))


@pytest.fixture
def seen(monkeypatch):
  """Pages of 8 tokens; the tokens each lookup found, in order."""
  monkeypatch.setattr(pc, "PAGE", PAGE)
  found = []
  original = pc.PrefixCache.lookup

  def lookup(self, space, prompt):
    hit = original(self, space, prompt)
    found.append(hit.tokens)
    return hit

  monkeypatch.setattr(pc.PrefixCache, "lookup", lookup)
  return found


def test_generate_many_with_a_prefix_cache_equals_generate_alone(
  tiny, shared, seen
):
  """Ten prompts with one of two 40-token starts through 3 slots: the
  first three (admitted together) miss, every later one reuses 5 cached
  pages,
  and each request is bit for bit `generate` alone."""
  requests, want = shared
  got = {
    r.index: (r.tokens, r.per_token_scores)
    for r in tiny.generate_many(
      requests, slots=3, every=3, prefix_cache_bytes=1 << 20
    )
  }
  _check(got, want)
  assert seen[:3] == [0, 0, 0] and seen[3:] == [40] * 7, seen
  # A cap of 5 pages (one start's): the two starts evict each other, and
  # every request is still `generate` alone.
  del seen[:]
  page = 2 * PAGE * tiny.hparams.kv_heads * tiny.hparams.head_dim * 4
  got = {
    r.index: (r.tokens, r.per_token_scores)
    for r in tiny.generate_many(
      requests,
      slots=3,
      every=3,
      prefix_cache_bytes=5 * page * tiny.hparams.layers,
    )
  }
  _check(got, want)
  assert 0 < seen.count(40) < 7 and seen.count(0) > 3, seen


def test_live_slots_with_a_prefix_cache(monkeypatch, tiny, shared):
  """The server's loop, one request at a time: the first of each start
  misses, the rest hit; a long remainder (pieces of 16) is staged after
  its cached start; cancelling a staged request unpins its pages; every
  request equals `generate` alone."""
  monkeypatch.setattr(pc, "PAGE", PAGE)
  requests, want = shared
  h = tiny.hparams
  model = tiny.with_prefill_chunk(16)
  loop = model.live_slots(
    slots=2, capacity=160, every=2, prefix_cache_bytes=1 << 20
  )
  rng = np.random.default_rng(9)
  long = cw.Request(
    tokens=requests[0].tokens[:40] + rng.integers(3, h.vocab, 30).tolist(),
    sample_id=50,
    steps=5,
  )
  got = {}
  todo = [(i, r) for i, r in enumerate(requests[:5])] + [("long", long)]
  for key, r in todo:
    loop.add(key, loop.prepare(r))
    while loop.busy:
      for u in loop.step():
        tokens, scores = got.get(u.key, ([], []))
        got[u.key] = (
          tokens + u.tokens.tolist(),
          scores + u.per_token_scores.tolist(),
        )
  _check(got, want[:5])
  np.testing.assert_array_equal(got["long"][0], _alone(model, long)[0])
  s = loop.prefix_cache.stats
  assert (s.hit_requests, s.miss_requests) == (4, 2)
  assert s.hits == 4 * 40
  # A staged request cancelled before its last piece gives its pins back.
  gone = cw.Request(
    tokens=long.tokens[:40] + rng.integers(3, h.vocab, 30).tolist(),
    sample_id=51,
    steps=5,
  )
  loop.add("gone", loop.prepare(gone))
  loop.step()
  pinned = [p for p in loop.prefix_cache._pages.values() if p.refs > 1]
  assert pinned, "the staged request pins its start"
  loop.cancel("gone")
  loop.step()
  assert not loop.busy
  chain = sorted(loop.prefix_cache._pages.values(), key=lambda p: p.id)
  assert all(p.refs == sum(q.parent is p for q in chain) for p in chain)
  # The pages `long` stored after its hit (offset 40) are read back.
  again = cw.Request(tokens=[*long.tokens, 5, 6, 7], sample_id=52, steps=5)
  hits = loop.prefix_cache.stats.hits
  loop.add("again", loop.prepare(again))
  tokens = []
  while loop.busy:
    tokens += [t for u in loop.step() for t in u.tokens.tolist()]
  assert loop.prefix_cache.stats.hits - hits == 64
  np.testing.assert_array_equal(tokens, _alone(model, again)[0])


def test_a_hit_before_its_program_is_a_miss_meanwhile(
  monkeypatch, tiny, shared
):
  """`background_hits` (the server's loop): a hit whose prefill after a
  cached start of its width has not run is admitted as a miss (counted as
  one), the same tokens, while a background thread compiles that program;
  then hits of that pair use the cache. Warm-up empties the cache it
  filled and leaves the loop as it was."""
  monkeypatch.setattr(pc, "PAGE", PAGE)
  requests, want = shared
  loop = tiny.live_slots(
    slots=2,
    capacity=160,
    every=2,
    prefix_cache_bytes=1 << 20,
    background_hits=True,
  )
  report = loop.warm_up()
  assert report.requests and loop.prefix_cache.stats == pc.Stats()

  def run(i):
    loop.add(object(), loop.prepare(requests[i]))
    tokens, scores = [], []
    while loop.busy:
      for u in loop.step():
        tokens += u.tokens.tolist()
        scores += u.per_token_scores.tolist()
    np.testing.assert_array_equal(tokens, want[i][0], err_msg=str(i))
    np.testing.assert_array_equal(scores, want[i][1], err_msg=str(i))

  run(0)  # stores its start
  run(2)  # the same start: a hit, but its program is not compiled: a miss
  s = loop.prefix_cache.stats
  assert (s.hit_requests, s.miss_requests, s.hits) == (0, 2, 0)
  deadline = time.monotonic() + 120
  while not loop.heads.compiled:
    assert time.monotonic() < deadline, "not compiled within 120 s"
    time.sleep(0.05)
  run(2)  # the same pair: a hit now
  s = loop.prefix_cache.stats
  assert (s.hit_requests, s.miss_requests) == (1, 2) and s.hits > 0
  # close ends the background thread (a process exiting while it is inside
  # XLA aborts); a later hit of a new pair is then a miss, queued nowhere
  loop.close()
  assert not any(t.name == "chunkwise-heads" for t in threading.enumerate())
  assert loop.heads._thread is None


def test_prefix_cache_on_a_mesh_and_after_a_shared_prefix(tiny, seen):
  """A (2, 2, 2) mesh (ws_2d), requests after a shared `prefix` chunk and
  with speculation (its drafter's history is the whole prompt, so it
  drafts and accepts alike): the same tokens and speculation counts with
  the cache as without it."""
  mesh = make_mesh((2, 2, 2), jax.devices()[:8])
  model = cw.InferenceModel(
    tiny.hparams, tiny.weights, tiny.vocab, mesh=mesh, layout="ws_2d"
  )
  prefix = [model.prefill(cw.Chunk.from_lists([[1, 4, 5]]))]
  requests = _shared_start(tiny.hparams.vocab, 8, start=24, seed=2)
  runs = []
  for size in (0, 1 << 20):
    runs.append(
      {
        r.index: (r.tokens.tolist(), r.speculation)
        for r in model.generate_many(
          requests,
          slots=2,
          prefix=prefix,
          prefix_cache_bytes=size,
          # The counts are compared: one cost model for both runs (timed
          # costs could force other widths in one of them).
          speculation=cw.Speculation(k=2, calibrate=False),
        )
      }
    )
  assert runs[0] == runs[1]
  assert seen == [0, 0] + [24] * 6, seen


def test_generation_job_with_a_prefix_cache_writes_the_same_records(
  tmp_path, seen
):
  """`GenerateJob(prefix_cache_mb=...)`: prompts sharing an instruction,
  three samples each; later prompts and samples reuse cached pages, and
  the output is byte for byte the run without a cache."""
  from chunkwise import jobs

  head = "Answer with one short word, and nothing else at all. " * 2
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("".join(f"{head}Q{i}?\n" for i in range(4)))
  outputs = []
  for mb in (0, 4):
    out = tmp_path / f"out-{mb}.jsonl"
    jobs.run_generate(
      jobs.GenerateJob(
        input=str(prompts),
        output=str(out),
        model=jobs.ModelConfig(name="random:tiny"),
        num_samples=3,
        steps=5,
        slots=2,
        sampling=cw.Sampling(temperature=0.9, seed=1),
        prefix_cache_mb=mb,
        progress=False,
      )
    )
    outputs.append(out.read_bytes())
  assert outputs[0] == outputs[1]
  assert len(seen) == 12 and seen[:2] == [0, 0] and min(seen[2:]) >= PAGE
  with pytest.raises(ValueError, match="prefix_cache_mb=-1"):
    jobs.GenerateJob(input=str(prompts), output="o", prefix_cache_mb=-1)
  with pytest.raises(ValueError, match="needs continuous batching"):
    jobs.GenerateJob(
      input=str(prompts), output="o", prefix_cache_mb=4, static_batching=True
    )
