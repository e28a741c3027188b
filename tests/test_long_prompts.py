"""Long prompts: key-blocked attention and prefill in pieces.

Both keep a plain twin: blocked attention is compared with the unblocked
path it replaces for long chunks (bit for bit under invariant numerics,
within rounding under fast), and a chunk prefilled in pieces with the same
chunk prefilled at once. Small blocks and pieces stand in for long ones:
the code paths are the same, only the sizes differ."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise import numerics
from chunkwise.models import attention
from chunkwise.models import blocked_attention as blocked
from chunkwise.models.attention import Options, PrefixLayer
from chunkwise.partitioning import make_mesh


def _unblocked(monkeypatch):
  monkeypatch.setattr(blocked, "MIN_TIME", 10**9)


def _blocked(monkeypatch, block=8):
  monkeypatch.setattr(blocked, "MIN_TIME", 1)
  monkeypatch.setattr(blocked, "MIN_LOGITS", 0)
  monkeypatch.setattr(blocked, "BLOCK", block)


OPTIONS = [
  Options(),
  Options(window=11),
  Options(softcap=5.0),
  Options(scale=0.3, softcap=3.0, window=30),
]


@pytest.mark.parametrize("mode", ["invariant", "fast"])
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_blocked_attention_equals_the_unblocked(monkeypatch, mode, options):
  """37 queries (not a whole number of blocks) over two prefix caches of
  2 and 4 rows ("repeat each" for 4 queries rows), one row of them empty,
  then themselves: blocks of 8 rows and keys, some skipped."""
  rng = np.random.default_rng(0)
  batch, time, heads, kv_heads, dim = 4, 37, 4, 2, 8

  def normal(*shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)

  q = normal(batch, time, heads, dim)
  k, v = normal(batch, time, kv_heads, dim), normal(batch, time, kv_heads, dim)
  prefix = [
    PrefixLayer(
      normal(2, 20, kv_heads, dim), normal(2, 20, kv_heads, dim), [13, 20]
    ),
    PrefixLayer(
      normal(4, 9, kv_heads, dim), normal(4, 9, kv_heads, dim), [0, 9, 3, 5]
    ),
  ]
  prefix = [p._replace(lengths=jnp.asarray(p.lengths)) for p in prefix]

  def run():
    with numerics.scope(mode):
      return jax.jit(
        lambda q, k, v: attention.attend(q, k, v, prefix, options)
      )(q, k, v)

  _unblocked(monkeypatch)
  want = run()
  _blocked(monkeypatch)
  got = run()
  if mode == "invariant":
    np.testing.assert_array_equal(got, want)
    # The logits computed again in the second pass rather than kept.
    monkeypatch.setattr(blocked, "KEPT_LOGITS", 0)
    np.testing.assert_array_equal(run(), want)
  else:
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_long_chunks_take_the_blocked_path():
  """Which chunks are blocked: long ones over enough context; decode steps
  (one query row over a long cache) never."""
  assert blocked.wanted(2048, 2048)
  assert blocked.wanted(256, 8192)  # a slot loop's piece after 8k
  assert not blocked.wanted(1024, 1024)
  assert not blocked.wanted(1, 1 << 20)


def _rows(vocab, lengths, seed=0):
  rng = np.random.default_rng(seed)
  return cw.Chunk.from_lists(
    [rng.integers(3, vocab, n).tolist() for n in lengths]
  )


def _valid(result, chunk):
  """The result at the chunk's valid positions (padding is unspecified)."""
  mask = np.asarray(chunk.token_mask)
  cache = result.kv_cache
  return [
    np.asarray(result.per_token_scores)[mask],
    np.asarray(result.top_ids)[mask],
    np.asarray(result.top_logprobs)[mask],
    np.asarray(result.next_token_logits),
    np.asarray(cache.k)[:, mask],
    np.asarray(cache.v)[:, mask],
    np.asarray(cache.lengths),
  ]


def _compare(got, want, exact):
  for a, b in zip(got, want, strict=True):
    assert a.shape == b.shape
    if exact:
      np.testing.assert_array_equal(a, b)
    else:
      np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)


@pytest.mark.parametrize("mode", ["invariant", "fast"])
def test_prefill_in_pieces_equals_one_chunk(monkeypatch, mode):
  """Rows of 70, 45 and 3 tokens after a prefix, cut into pieces of 16
  columns (the last narrower; the short row ends in the first piece),
  with blocked attention of blocks of 8: the one-chunk prefill's scores,
  top-n, carried logits and K/V, and the same tokens generated after."""
  h = cw.configs.get("tiny")
  whole = cw.InferenceModel.random(h, seed=0, numerics=mode)
  pieces = cw.InferenceModel.random(h, seed=0, numerics=mode, prefill_chunk=16)
  chunk = _rows(h.vocab, (70, 45, 3))
  head = cw.Chunk.from_lists([[1, 5, 6], [1, 7], [1, 8, 9]])
  outs = []
  for model in (whole, pieces):
    _blocked(monkeypatch) if model is pieces else _unblocked(monkeypatch)
    prefix = [model.prefill(head)]
    result = model.prefill(chunk, prefix=prefix, top_n=3)
    tokens, _ = model.generate(
      [*prefix, result],
      sample_ids=np.arange(3),
      steps=6,
      sampling=cw.Sampling(temperature=0.8, seed=2),
    )
    outs.append((_valid(result, chunk), tokens.to_lists(), result.time))
  _compare(outs[1][0], outs[0][0], exact=mode == "invariant")
  assert outs[1][1] == outs[0][1]
  assert outs[1][2] == outs[0][2] == 70


def test_prefill_in_pieces_on_a_mesh(monkeypatch):
  """The (2, 2, 2) mesh's ws_2d layout: the buffer is made and written
  where the pieces' K/V are, and the result is the one-chunk prefill's on
  the same mesh, bit for bit."""
  h = cw.configs.get("tiny")
  mesh = make_mesh((2, 2, 2), jax.devices()[:8])
  base = cw.InferenceModel.random(h, seed=0, mesh=mesh, layout="ws_2d")
  pieces = cw.InferenceModel(
    h, base.weights, base.vocab, mesh=mesh, layout="ws_2d", prefill_chunk=24
  )
  chunk = _rows(h.vocab, (50, 33), seed=1)
  _unblocked(monkeypatch)
  want = base.prefill(chunk, top_n=2)
  _blocked(monkeypatch)
  got = pieces.prefill(chunk, top_n=2)
  _compare(_valid(got, chunk), _valid(want, chunk), exact=True)


def test_bad_prefill_chunk_is_refused():
  h = cw.configs.get("tiny")
  for bad in (0, -4, 2.5, True, "16"):
    with pytest.raises(ValueError, match=r"prefill_chunk=.*positive number"):
      cw.InferenceModel.random(h, prefill_chunk=bad)


def test_generate_many_prefills_long_prompts_between_decode_steps(
  monkeypatch,
):
  """Chunked prefill in the slot loop: a prompt longer than `prefill_chunk`
  (50 tokens, pieces of 16) is prefilled one piece per segment while the
  other slot keeps decoding, and every request still equals `generate`
  alone, bit for bit."""
  _blocked(monkeypatch)
  h = cw.configs.get("tiny")
  model = cw.InferenceModel.random(h, seed=0, prefill_chunk=16)
  rng = np.random.default_rng(3)
  shapes = [(6, 12), (50, 12), (6, 12)]
  requests = [
    cw.Request(
      tokens=rng.integers(3, h.vocab, n).tolist(),
      sample_id=i,
      steps=steps,
      sampling=cw.Sampling(temperature=float(i % 2), seed=1),
    )
    for i, (n, steps) in enumerate(shapes)
  ]
  prefix = [model.prefill(cw.Chunk.from_lists([[1, 4, 5]]))]
  events = []
  got = {
    r.index: r
    for r in model.generate_many(
      requests,
      slots=2,
      prefix=prefix,
      every=2,
      trace=lambda kind, xs: events.append((kind, list(xs))),
    )
  }
  # While request 1's four pieces were prefilled, request 0 decoded.
  at = events.index(("first_token", [1]))
  decoded = sum(xs[0] for kind, xs in events[:at] if kind == "steps")
  assert decoded >= 6, events
  for i, r in enumerate(requests):
    chunk = cw.Chunk.from_lists([r.tokens])
    tokens, result = model.generate(
      [*prefix, model.prefill(chunk, prefix=prefix)],
      sample_ids=[r.sample_id],
      steps=r.steps,
      sampling=r.sampling,
    )
    n = int(tokens.lengths[0])
    np.testing.assert_array_equal(
      got[i].tokens, np.asarray(tokens.tokens)[0, :n]
    )
    np.testing.assert_array_equal(
      got[i].per_token_scores, np.asarray(result.per_token_scores)[0, :n]
    )


def test_live_slots_prefill_long_prompts_between_steps(monkeypatch):
  """The server's loop: a 50-token prompt (pieces of 16) added while
  another request decodes takes its slot at once and is prefilled one
  piece per step; the other keeps producing tokens meanwhile, and both
  equal `generate` alone."""
  _blocked(monkeypatch)
  h = cw.configs.get("tiny")
  model = cw.InferenceModel.random(h, seed=0, prefill_chunk=16)
  rng = np.random.default_rng(4)
  requests = {
    "short": cw.Request(
      tokens=rng.integers(3, h.vocab, 6).tolist(), sample_id=0, steps=12
    ),
    "long": cw.Request(
      tokens=rng.integers(3, h.vocab, 50).tolist(),
      sample_id=1,
      steps=6,
      sampling=cw.Sampling(temperature=1.0, seed=2),
    ),
  }
  loop = model.live_slots(slots=2, capacity=80, every=1)
  loop.add("short", loop.prepare(requests["short"]))
  got = {key: [] for key in requests}
  order = []
  for update in loop.step():
    got[update.key] += update.tokens.tolist()
  loop.add("long", loop.prepare(requests["long"]))
  while loop.busy:
    for update in loop.step():
      got[update.key] += update.tokens.tolist()
      order.append((update.key, len(update.tokens)))
  assert order[:3] == [("short", 1)] * 3, order  # the long one's pieces
  for key, r in requests.items():
    chunk = cw.Chunk.from_lists([r.tokens])
    tokens, _ = model.generate(
      [model.prefill(chunk)],
      sample_ids=[r.sample_id],
      steps=r.steps,
      sampling=r.sampling,
    )
    assert got[key] == tokens.to_lists()[0], key
