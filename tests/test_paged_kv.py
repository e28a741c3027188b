"""Paged K/V: the pool, its page tables, the Pallas kernel against the
plain view, and `generate_many(kv_pages=)` with preemption against
`generate` alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.inference.kv_cache import LayerKV
from chunkwise.inference.paging import page_table
from chunkwise.inference.paging.paged_kv import PAGE, PagedKV
from chunkwise.models import attention
from chunkwise.models import paged_attention as pa
from chunkwise.models import paged_attention_tpu as pa_tpu


def _pool(rng, *, heads=2, pages=24, page=16, dim=64, rows=3, per_row=4):
  """A random pool and a table of distinct pages (row 0 holds one)."""
  k, v = (
    jnp.asarray(rng.normal(size=(heads, pages, page, dim)), jnp.float32)
    for _ in range(2)
  )
  table = rng.permutation(pages)[: rows * per_row].reshape(rows, per_row)
  table[0, 1:] = pages
  return k, v, jnp.asarray(table, jnp.int32)


def _plain_piece(q, layer, softcap):
  """(m, s, o) of the plain view (the pool's pages gathered per row) read
  by `attention._attend_piece`, in f32."""
  view = layer.view()
  mask = jnp.arange(view.width)[None] < layer.lengths[:, None]
  want = attention._attend_piece(
    q[:, None],
    view.k.astype(jnp.float32),
    view.v.astype(jnp.float32),
    mask[:, None, None, None, None, :],
    softcap=softcap,
    heads_major=True,
  )
  return tuple(a[:, 0] for a in want)


@pytest.mark.parametrize("group, softcap, block", [(3, None, 8), (16, 30.0, 2)])
def test_the_pallas_kernel_equals_the_plain_view(group, softcap, block):
  """JAX's Pallas GPU kernel body (interpret mode here; compiled on a
  GPU) gives the (m, s, o) of the plain view read by `_attend_piece`, for
  a row within one page, an empty row and a full row, in one split of
  4-page blocks or two splits of 2-page blocks (merged across splits);
  and an empty row's weight vanishes in the merge."""
  rng = np.random.default_rng(0)
  k, v, table = _pool(rng)
  lengths = jnp.array([5, 0, 64], jnp.int32)
  layer = pa.PagedLayer(k, v, table, lengths)
  q = jnp.asarray(rng.normal(size=(3, 1, 2, group, 64)), jnp.float32)
  interpret = jax.default_backend() != "gpu"
  assert pa._splits(4, block) == ((1, 4) if block == 8 else (2, 2))
  m, s, o = pa.kernel_piece(
    q, layer, softcap=softcap, interpret=interpret, compute_block=block
  )
  m2, s2, o2 = _plain_piece(q, layer, softcap)
  for row in (0, 2):
    np.testing.assert_allclose(m[row], m2[row], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
      o[row] / s[row][..., None], o2[row] / s2[row][..., None], atol=1e-5
    )
  assert float(s[1].max()) == 0 and float(o[1].max()) == 0
  assert float(m[1].max()) < -1e30  # exp(m - M) = 0 beside any real logit
  # The CPU's read in place (fast numerics): the same, and nothing for a
  # row holding no page.
  m, s, o = pa.pool_piece(q, layer, softcap=softcap)
  for row in (0, 2):
    np.testing.assert_allclose(m[row], m2[row], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
      o[row] / s[row][..., None], o2[row] / s2[row][..., None], atol=1e-5
    )
  assert float(s[1].max()) == 0 and float(o[1].max()) == 0


@pytest.mark.parametrize(
  "group, softcap, block, dtype",
  [(8, None, 4, jnp.float32), (2, 30.0, 2, jnp.bfloat16)],
)
def test_the_pallas_tpu_kernel_equals_the_plain_view(
  group, softcap, block, dtype
):
  """JAX's Pallas TPU paged-attention kernel body, run by `tpu_piece` in
  the TPU interpret mode, gives the plain view's (m, s, o): a row within
  one page (the free marker in its table), an empty row, a full row; in
  compute blocks of 4 pages or 2, q heads per K/V head a multiple of 8 or
  not, f32 or bf16 pages. The kernel's dots run at the TPU's default
  precision (one bf16 pass, f32 sums), so the inputs are bf16 values:
  logits and weights agree to f32 rounding, outputs (weights rounded to
  bf16 for the second dot) to bf16's."""
  rng = np.random.default_rng(1)

  def bf16(x):
    return x.astype(jnp.bfloat16).astype(dtype)

  k, v, table = _pool(rng, dim=128)
  k, v = bf16(k), bf16(v)
  lengths = jnp.array([5, 0, 64], jnp.int32)
  layer = pa.PagedLayer(k, v, table, lengths)
  q = bf16(jnp.asarray(rng.normal(size=(3, 1, 2, group, 128)), jnp.float32))
  q = q.astype(jnp.float32)
  assert pa_tpu.supports(q, layer)
  m, s, o = pa_tpu.tpu_piece(
    q, layer, softcap=softcap, interpret=True, compute_block=block
  )
  m2, s2, o2 = _plain_piece(q, layer, softcap)
  for row in (0, 2):
    np.testing.assert_allclose(m[row], m2[row], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s[row], s2[row], rtol=1e-4)
    np.testing.assert_allclose(
      o[row] / s[row][..., None], o2[row] / s2[row][..., None], atol=2e-2
    )
  assert float(s[1].max()) == 0 and float(o[1].max()) == 0
  assert float(m[1].max()) < -1e30
  # int8 pages, and heads off the 128 lanes, stay with `pool_piece`.
  assert not pa_tpu.supports(q[..., :64], layer._replace(k_pages=k[..., :64]))


def test_pool_writes_read_back_as_fixed_slots_do():
  """The same admissions and column writes into a `PagedKV` and a
  `LayerKV`: every row's held columns read back equal (the view is the
  fixed slot's buffer), and writes past a row's pages are dropped."""
  rng = np.random.default_rng(1)
  rows, columns = 3, 4 * 8
  like = jax.ShapeDtypeStruct((2, rows, 1, 2, 8), jnp.float32)
  fixed = LayerKV.zeros(like, columns, rows)
  paged = PagedKV.zeros(like, pages=7, page=8, columns=columns, rows=rows)
  pages = page_table.Pages(pages=7, page=8, slots=rows, columns=columns)
  for slot, cols in ((2, 20), (0, 9), (1, 3)):
    assert pages.reserve(slot, cols)
  paged = paged.replace(table=jnp.asarray(pages.table()))
  new = jnp.asarray(rng.normal(size=(2, 2, 12, 2, 8)), jnp.float32)
  at = jnp.array([2, 0])
  fixed, paged = (c.put_rows(new, new + 1, at) for c in (fixed, paged))
  fixed, paged = (
    c.put_rows(new[:, :1, :3], new[:, :1, :3], jnp.array([1]), 2)
    for c in (fixed, paged)
  )
  cols = jnp.array([[12, 13], [9, 10], [0, 1]])
  step = jnp.asarray(rng.normal(size=(2, 3, 2, 2, 8)), jnp.float32)
  fixed, paged = (c.write_columns(step, -step, cols) for c in (fixed, paged))
  held = np.array([16, 8, 24])  # columns of the pages each row holds
  for i in range(2):
    want, got = fixed.layer(i), paged.layer(i).view()
    for a, b in ((want.k, got.k), (want.v, got.v)):
      for r in range(rows):
        np.testing.assert_array_equal(a[r, :, : held[r]], b[r, :, : held[r]])
  # Row 0 holds 2 pages: its column 16 (a third page) went nowhere.
  before = [np.asarray(x) for x in paged.k]
  write = jnp.ones((2, 3, 1, 2, 8))
  paged = paged.write_columns(write, write, jnp.array([[16], [32], [99]]))
  for a, b in zip(before, paged.k, strict=True):
    np.testing.assert_array_equal(a, b)


def test_pages_hand_out_the_lowest_and_preempt_the_latest():
  pages = page_table.Pages(pages=5, page=4, slots=3, columns=16)
  assert pages.reserve(0, 5) and pages.reserve(1, 4)  # 2 + 1 pages
  assert not pages.reserve(2, 16)  # 4 pages, 2 free
  assert pages.table().tolist() == [[0, 1, 5, 5], [2, 5, 5, 5], [5] * 4]
  assert pages.reserve(2, 1)
  # Growing 0 to 4 pages and 1 to 2 needs 3 more, 1 is free: the latest
  # admitted (2) goes, then 1.
  out = pages.make_room({0: 16, 1: 8, 2: 4}, {0: 0, 1: 1, 2: 2})
  assert out == [2, 1] and pages.held(0) == 4 and pages.free == 1
  assert pages.peak == 4
  with pytest.raises(ValueError, match="pages=0"):
    page_table.Pages(pages=0, page=4, slots=1, columns=4)


def _requests(vocab, n=8, seed=1):
  """Short and long budgets, greedy and sampled: the long ones outgrow a
  small pool mid-run."""
  rng = np.random.default_rng(seed)
  return [
    cw.Request(
      tokens=rng.integers(3, vocab, int(rng.choice([4, 13]))).tolist(),
      sample_id=i,
      steps=int(rng.choice([5, 40, 70])),
      sampling=cw.Sampling(temperature=float(i % 2), seed=3),
    )
    for i in range(n)
  ]


def _alone(model, r):
  tokens, result = model.generate(
    [model.prefill(cw.Chunk.from_lists([r.tokens]))],
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
def alone(tiny):
  """`_requests` and each one's `generate` alone."""
  requests = _requests(tiny.hparams.vocab)
  return requests, [_alone(tiny, r) for r in requests]


def test_generate_many_with_paged_kv_equals_generate_alone(tiny, alone):
  """Eight requests through 4 slots over a pool of 4 pages (one request's
  128 columns): requests wait for pages, the latest admitted is preempted
  when the running ones outgrow the pool and runs again later, and every
  request is bit for bit `generate` alone; with speculation as well."""
  requests, want = alone
  events = []
  got = {
    r.index: r
    for r in tiny.generate_many(
      requests,
      slots=4,
      every=8,
      kv_pages=4,
      trace=lambda e, v: events.append((e, v)),
    )
  }
  for i, (tokens, scores) in enumerate(want):
    np.testing.assert_array_equal(got[i].tokens, tokens, err_msg=str(i))
    np.testing.assert_array_equal(got[i].per_token_scores, scores)
  assert [v for e, v in events if e == "preempted"], events
  assert max(v[0] for e, v in events if e == "held") >= 2
  spec = {
    r.index: r.tokens
    for r in tiny.generate_many(
      requests, slots=4, every=8, kv_pages=5, speculation=cw.Speculation(k=3)
    )
  }
  for i, (tokens, _) in enumerate(want):
    np.testing.assert_array_equal(spec[i], tokens, err_msg=str(i))


# How far a paged request's scores may be from a fixed slot's under fast
# numerics, by K/V dtype. Both read the same stored values (one
# `kv_int8.decode`), but sum in different orders: XLA's dot over the
# slot's buffer against `pool_piece`'s pages merged by segment sums, ~1e-7
# apart. With f32 K/V that stays float rounding (2e-6 at most over 20
# request sets, AMD EPYC). With int8 K/V the next token's K/V are rounded
# to int8 codes, and a value within 1e-7 of a rounding boundary takes the
# next code in one path: one element of one stored vector moves by a whole
# step (its vector's max / 127), as int8 K/V's own error against f32 does.
# Measured, forcing the AVX2 path and XLA's AVX2 code (`CHUNKWISE_CPU_ISA=
# avx2 XLA_FLAGS=--xla_cpu_max_isa=AVX2`, 20 request sets): 17 sets within
# 3e-6, three at 7e-5 to 2.1e-4; an AMD EPYC Zen 3 saw 5.7e-4. A read that
# is wrong, not merely rounded otherwise, moves them by far more: one key
# left out of each row's read (the last) moved some score by 0.5 to 3.
FAST_PAGED_ATOL = {"float32": 1e-4, "int8": 2e-3}


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_fast_numerics_read_the_pool_in_place(tiny, kv_dtype):
  """Under fast numerics a decode step reads the pool in place
  (`pool_piece`, which decodes int8 pages there): on one pool, what the
  plain view reads to float rounding; end to end, the tokens of fixed
  slots and their scores within `FAST_PAGED_ATOL` (int8 codes may round
  apart, see there)."""
  from chunkwise.models import kv_int8

  rng = np.random.default_rng(1)
  k, v, table = _pool(rng)
  k, v = kv_int8.encode(k, kv_dtype), kv_int8.encode(v, kv_dtype)
  layer = pa.PagedLayer(k, v, table, jnp.array([5, 0, 64], jnp.int32))
  q = jnp.asarray(rng.normal(size=(3, 1, 2, 3, 64)), jnp.float32)
  m, s, o = pa.pool_piece(q, layer)
  decoded = layer._replace(k_pages=kv_int8.decode(k), v_pages=kv_int8.decode(v))
  m2, s2, o2 = _plain_piece(q, decoded, None)
  for row in (0, 2):
    np.testing.assert_allclose(m[row], m2[row], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
      o[row] / s[row][..., None], o2[row] / s2[row][..., None], atol=1e-5
    )
  fast = cw.InferenceModel.random(
    tiny.hparams, seed=0, numerics="fast", kv_dtype=kv_dtype
  )
  requests = _requests(tiny.hparams.vocab, n=6, seed=2)
  fixed = {r.index: r for r in fast.generate_many(requests, slots=3)}
  calls = []
  original = pa.pool_piece

  def counted(*args, **kwargs):
    calls.append(1)
    return original(*args, **kwargs)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(pa, "pool_piece", counted)
    paged = {
      r.index: r for r in fast.generate_many(requests, slots=3, kv_pages=6)
    }
  assert calls  # traced once per layer of the decode step
  for i in fixed:
    np.testing.assert_array_equal(paged[i].tokens, fixed[i].tokens)
    np.testing.assert_allclose(
      paged[i].per_token_scores,
      fixed[i].per_token_scores,
      atol=FAST_PAGED_ATOL[kv_dtype],
    )


def test_paged_kv_after_a_cached_start_and_in_pieces(monkeypatch, tiny):
  """Pages of a request whose start comes from the prefix cache (the
  head's columns, then the rest at an offset) and of one prefilled in
  pieces of 16 (chunked prefill): `generate_many` over a small pool is
  bit for bit `generate` alone."""
  from chunkwise.inference.paging import prefix_cache as pc

  monkeypatch.setattr(pc, "PAGE", 8)
  rng = np.random.default_rng(4)
  start = rng.integers(3, tiny.hparams.vocab, 24).tolist()
  requests = [
    cw.Request(
      tokens=start + rng.integers(3, tiny.hparams.vocab, n).tolist(),
      sample_id=i,
      steps=int(rng.choice([6, 30])),
      sampling=cw.Sampling(temperature=float(i % 2), seed=5),
    )
    for i, n in enumerate([3, 3, 30, 3, 30, 3])
  ]
  want = [_alone(tiny, r) for r in requests]
  events = []
  got = {
    r.index: r
    for r in tiny.with_prefill_chunk(16).generate_many(
      requests,
      slots=3,
      every=4,
      kv_pages=4,
      prefix_cache_bytes=1 << 20,
      trace=lambda e, v: events.append(e),
    )
  }
  for i, (tokens, scores) in enumerate(want):
    np.testing.assert_array_equal(got[i].tokens, tokens, err_msg=str(i))
    np.testing.assert_array_equal(got[i].per_token_scores, scores)
  assert "preempted" in events


def test_live_slots_under_fast_numerics_never_preempt(tiny):
  """A rerun need not repeat tokens already streamed under fast numerics:
  there the live loop admits a request only once pages for all of its
  steps fit, and never preempts; its tokens are fixed slots'."""
  fast = cw.InferenceModel.random(tiny.hparams, seed=0, numerics="fast")
  requests = _requests(tiny.hparams.vocab)
  want = {r.index: r.tokens for r in fast.generate_many(requests, slots=4)}
  loop = fast.live_slots(slots=4, capacity=128, every=8, kv_pages=5)
  for i, r in enumerate(requests):
    loop.add(i, loop.prepare(r))
  got, busiest = {}, 0
  while loop.busy:
    for u in loop.step():
      got[u.key] = [*got.get(u.key, []), *u.tokens.tolist()]
    busiest = max(busiest, loop.running)
  assert loop.preempted == 0 and loop.pages.peak <= 5 and busiest >= 2
  for i, tokens in want.items():
    assert got[i] == tokens.tolist(), i


def test_bad_kv_pages_are_refused(tiny):
  request = cw.Request(tokens=[5, 6], sample_id=0, steps=100)
  with pytest.raises(ValueError, match=r"kv_pages=1 cannot hold .* 4 pages"):
    tiny.generate_many([request], slots=2, kv_pages=1)
  with pytest.raises(ValueError, match="kv_pages must be >= 0, got -2"):
    tiny.generate_many([request], slots=2, kv_pages=-2)
  with pytest.raises(ValueError, match=r'kv_pages=8 with .*drafter="draft"'):
    tiny.live_slots(
      slots=2,
      capacity=128,
      kv_pages=8,
      speculation=cw.Speculation(drafter="draft"),
    )
  assert PAGE == 32


def test_generation_job_with_paged_kv_writes_the_same_records(tmp_path):
  """`GenerateJob(kv_pages=...)`: four slots over a pool of 5 pages (a
  sample may need 4 of the job's 128 columns, so samples wait and are
  preempted), byte for byte the output of fixed slots; bad values are
  refused when the job is made, a pool too small when it runs."""
  from chunkwise import jobs

  prompts = tmp_path / "prompts.txt"
  prompts.write_text(
    "".join(f"Question {i}: {'why ' * i}?\n" for i in range(5))
  )
  outputs = []
  for pages in (0, 5):
    out = tmp_path / f"out-{pages}.jsonl"
    jobs.run_generate(
      jobs.GenerateJob(
        input=str(prompts),
        output=str(out),
        model=jobs.ModelConfig(name="random:tiny"),
        num_samples=2,
        steps=40,
        slots=4,
        sampling=cw.Sampling(temperature=0.9, seed=1),
        kv_pages=pages,
        progress=False,
      )
    )
    outputs.append(out.read_bytes())
  assert outputs[0] == outputs[1] and outputs[0].count(b"\n") == 10
  with pytest.raises(jobs.JobError, match="kv_pages=3 cannot hold one"):
    jobs.run_generate(
      jobs.GenerateJob(
        input=str(prompts),
        output=str(tmp_path / "small.jsonl"),
        model=jobs.ModelConfig(name="random:tiny"),
        steps=40,
        kv_pages=3,
        progress=False,
      )
    )
  with pytest.raises(ValueError, match="kv_pages=-1"):
    jobs.GenerateJob(input=str(prompts), output="o", kv_pages=-1)
  with pytest.raises(ValueError, match="needs continuous batching"):
    jobs.GenerateJob(
      input=str(prompts), output="o", kv_pages=4, static_batching=True
    )


def test_live_slots_with_paged_kv_report_each_token_once(tiny, alone):
  """The server's loop over a pool of 5 pages: eight requests arriving at
  once through 4 slots; those preempted run again and report only tokens
  they had not reported, so each request's updates join to `generate`
  alone; a request cancelled while waiting for pages never runs; every
  page is free at the end."""
  requests, want = alone
  loop = tiny.live_slots(slots=4, capacity=128, every=8, kv_pages=5)
  for i, r in enumerate(requests):
    loop.add(i, loop.prepare(r))
  loop.add("gone", loop.prepare(requests[0]))
  loop.cancel("gone")
  out = {}
  while loop.busy:
    for u in loop.step():
      out.setdefault(u.key, []).append(u)
  assert loop.preempted > 0 and "gone" not in out
  assert loop.pages.free == 5 and loop.pages.peak == 5
  for i, (tokens, scores) in enumerate(want):
    updates = out[i]
    assert [u.finish_reason is None for u in updates[:-1]] == [True] * (
      len(updates) - 1
    )
    np.testing.assert_array_equal(
      np.concatenate([u.tokens for u in updates]), tokens, err_msg=str(i)
    )
    np.testing.assert_array_equal(
      np.concatenate([u.per_token_scores for u in updates]), scores
    )


def test_server_engine_with_paged_kv_shows_its_pool_in_metrics(tiny):
  """`serving.Engine(kv_pages=)`: streams equal `generate` alone, and
  /metrics carries vLLM's K/V use and preemption counters."""
  from chunkwise import serving
  from chunkwise.serving.metrics import Metrics

  engine = serving.Engine(
    tiny, slots=4, capacity=128, every=4, kv_pages=5, warm_up=False
  )
  try:
    requests = [
      cw.Request(
        tokens=[tiny.bos_id, *r.tokens],
        sample_id=0,
        steps=r.steps,
        sampling=cw.Sampling(temperature=0.0),
      )
      for r in _requests(tiny.hparams.vocab)[:6]
    ]
    streams = [
      engine.submit(
        serving.Generation(
          prompt=r.tokens, max_new_tokens=r.steps, temperature=0.0
        )
      )
      for r in requests
    ]
    for r, s in zip(requests, streams, strict=True):
      got = list(s)  # an EOS that ends a stream is not `generate`'s
      if s.finish_reason != "length" and got and got[-1].special:
        got = got[:-1]
      assert [t.id for t in got] == _alone(tiny, r)[0].tolist()
    text = Metrics(engine, model_id="tiny").exposition().decode()
    held, total, preempted = engine.kv_pages_stats
    assert (held, total) == (0, 5) and preempted > 0
    assert 'vllm:kv_cache_usage_perc{model_name="tiny"} 0.0' in text
    assert (
      f'vllm:num_preemptions_total{{model_name="tiny"}} {preempted}.0' in text
    )
  finally:
    engine.close()
  with pytest.raises(ValueError, match="kv_pages=2 cannot hold"):
    serving.Engine(tiny, slots=4, capacity=128, kv_pages=2, warm_up=False)
