"""Continuous batching (`generate_many`): every request equals `generate` run
on it alone, whatever the slots, the arrival order and the other requests;
on one device, a (2,2,2) mesh and SmolLM2; bad input raises first."""

import functools

import jax
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.partitioning import make_mesh

C = cw.constraints
CHOICE = C.Choice(["yes", "no", "maybe"])
INTEGER = C.Regex(r"-?(0|[1-9][0-9]*)")


def _requests(model, n, seed):
  """A mix: prompts of 0-7 tokens, 3-16 steps, greedy and sampled (with
  filters), many stop ids or none, some constrained."""
  rng = np.random.default_rng(seed)
  vocab = model.hparams.vocab
  out = []
  for i in range(n):
    length = int(rng.choice([0, 1, 3, 7]))
    sampling = [
      cw.Sampling(temperature=0.0),
      cw.Sampling(temperature=1.0, seed=int(rng.integers(100))),
      cw.Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=5),
    ][i % 3]
    constraint = [None, None, CHOICE, None, INTEGER][i % 5]
    # 40 of ~300 ids stop a row: sampled rows stop within a few tokens
    # (constrained ones stop at EOS: stop ids are not spelled).
    stops = rng.choice(np.arange(3, 259), 40, replace=False)
    stops = stops if i % 4 and constraint is None else ()
    out.append(
      cw.Request(
        tokens=rng.integers(3, 259, length).tolist(),
        sample_id=int(100 + 7 * i),
        steps=int(rng.choice([3, 9, 16])),
        sampling=sampling,
        stop_ids=tuple(int(s) for s in stops),
        constraint=constraint,
      )
    )
  assert vocab >= 259
  return out


def _alone(model, prefix, request, **kwargs):
  """`generate` of one request after `prefix` and its prompt (padded to
  16 columns: padding changes no number, and prompts of nearby lengths
  share one compiled prefill)."""
  prompt = np.asarray(request.tokens, np.int32)[None]
  chunk = cw.Chunk(tokens=prompt, lengths=np.array([prompt.shape[1]], np.int32))
  chunk = chunk.pad_to_length(-(-prompt.shape[1] // 16) * 16)
  full = (
    [*prefix, model.prefill(chunk, prefix=prefix)] if prompt.size else prefix
  )
  forcing = kwargs.pop("budget_forcing", False) and request.constraint
  tokens, result = model.generate(
    list(full),
    sample_ids=[request.sample_id],
    steps=request.steps,
    sampling=request.sampling,
    stop_ids=request.stop_ids,
    constraint=request.constraint,
    budget_forcing=bool(forcing),
    **kwargs,
  )
  n = int(tokens.lengths[0])
  return dict(
    tokens=np.asarray(tokens.tokens[0, :n]),
    scores=np.asarray(result.per_token_scores[0, :n]),
    top_ids=np.asarray(result.top_ids[0, :n]),
    top_logprobs=np.asarray(result.top_logprobs[0, :n]),
    finish="length" if n == request.steps else "stop",
  )


def _check(got, want, what, exact=True):
  """Bit-identical (invariant numerics, DESIGN.md §4.10); tokens and top
  ids equal and log-probs within 1e-5 where `exact` is False (another
  mesh: §4.9)."""
  assert sorted(got) == list(range(len(want))), what
  for i, w in enumerate(want):
    g = got[i]
    assert g.index == i
    for name in ("tokens", "scores", "top_ids", "top_logprobs"):
      have = g.per_token_scores if name == "scores" else getattr(g, name)
      if exact or name in ("tokens", "top_ids"):
        np.testing.assert_array_equal(have, w[name], err_msg=f"{what} {i}")
      else:
        np.testing.assert_allclose(have, w[name], atol=1e-5, err_msg=what)
    assert g.finish_reason == w["finish"], (what, i)


@functools.cache
def _few_shot(model):
  chunk = cw.Chunk.tokenize(
    model.vocab, ["few shot: a b c"], is_first_chunk=True
  )
  return model.prefill(chunk)


PROCESSORS = (
  cw.processors.penalties(presence=0.5),
  cw.processors.min_tokens(2),
)


@pytest.fixture(scope="module")
def mixed(tiny):
  requests = _requests(tiny, 12, seed=0)
  prefix = [_few_shot(tiny)]
  kwargs = dict(top_n=2, processors=PROCESSORS, budget_forcing=True)
  want = [_alone(tiny, prefix, r, **kwargs) for r in requests]
  return requests, prefix, kwargs, want


def test_requests_equal_generate_alone(tiny, mixed):
  requests, prefix, kwargs, want = mixed
  finishes = {w["finish"] for w in want}
  assert finishes == {"stop", "length"}, finishes  # both kinds are covered
  for slots in (1, 3, 8):
    got = {
      r.index: r
      for r in tiny.generate_many(
        requests, slots=slots, prefix=prefix, **kwargs
      )
    }
    _check(got, want, f"slots={slots}")


def test_arrival_order_and_neighbours_do_not_matter(tiny, mixed):
  """Reversed, and with other requests interleaved: the same outputs."""
  requests, prefix, kwargs, want = mixed
  others = _requests(tiny, 6, seed=1)
  others = [
    cw.Request(
      tokens=r.tokens,
      sample_id=r.sample_id + 1,  # 100 + 7i + 1: unique
      steps=r.steps,
      sampling=r.sampling,
      stop_ids=r.stop_ids,
      constraint=r.constraint,
    )
    for r in others
  ]
  mixed_in = []
  for i, r in enumerate(reversed(requests)):
    mixed_in.append(r)
    if i < len(others):
      mixed_in.append(others[i])
  position = {id(r): j for j, r in enumerate(mixed_in)}
  out = {
    r.index: r
    for r in tiny.generate_many(mixed_in, slots=4, prefix=prefix, **kwargs)
  }
  got = {i: out[position[id(r)]] for i, r in enumerate(requests)}
  got = {
    i: cw.RequestResult(**{**g.__dict__, "index": i}) for i, g in got.items()
  }
  _check(got, want, "reversed and mixed")
  # With the same slots, bit-identical (what resumed batch jobs rely on).
  alone = {
    r.index: r
    for r in tiny.generate_many(requests, slots=4, prefix=prefix, **kwargs)
  }
  for i, g in got.items():
    for field in ("tokens", "per_token_scores", "top_ids", "top_logprobs"):
      np.testing.assert_array_equal(
        getattr(g, field), getattr(alone[i], field), err_msg=f"{i} {field}"
      )


def test_without_prefix_prompts_start_with_bos(tiny):
  requests = [
    cw.Request(
      tokens=[tiny.bos_id, *r.tokens],
      sample_id=r.sample_id,
      steps=r.steps,
      sampling=r.sampling,
      stop_ids=r.stop_ids,
    )
    for r in _requests(tiny, 4, seed=2)
  ]
  want = [_alone(tiny, [], r) for r in requests]
  got = {r.index: r for r in tiny.generate_many(requests, slots=2)}
  _check(got, want, "no prefix")


def test_mesh_batch_sharded_matches_one_device(tiny, mixed):
  requests, _, kwargs, want = mixed
  model = cw.InferenceModel(
    tiny.hparams,
    tiny.weights,
    tiny.vocab,
    mesh=make_mesh((2, 2, 2)),
    layout="ws_2d/yz",
  )
  mesh_prefix = [
    model.prefill(
      cw.Chunk.tokenize(model.vocab, ["few shot: a b c"], is_first_chunk=True)
    )
  ]
  got = {
    r.index: r
    for r in model.generate_many(
      requests[:8], slots=4, prefix=mesh_prefix, **kwargs
    )
  }
  _check(got, want[:8], "ws_2d/yz on (2,2,2)", exact=False)


def test_bad_input_raises_before_device_work(tiny):
  ok = cw.Request(tokens=[5, 6], sample_id=0, steps=4)
  prefix = [_few_shot(tiny)]
  cases = {
    "over the slot capacity": [
      cw.Request(tokens=[5] * 10, sample_id=0, steps=tiny.hparams.max_len)
    ],
    "already used by requests[0]": [ok, ok],
    "requests[1] must be a chunkwise Request": [ok, "text"],
    "requests is empty": [],
    "requests[0].tokens contains": [
      cw.Request(tokens=[tiny.hparams.vocab], sample_id=0, steps=2)
    ],
    "requests[0].steps": [cw.Request(tokens=[5], sample_id=0, steps=0)],
    "requests[0]: Sampling.temperature": [
      cw.Request(
        tokens=[5], sample_id=0, steps=2, sampling=cw.Sampling(temperature=-1.0)
      )
    ],
  }
  for message, requests in cases.items():
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
      list(tiny.generate_many(requests, slots=2, prefix=prefix))
  with pytest.raises(ValueError, match="slots"):
    list(tiny.generate_many([ok], slots=0, prefix=prefix))
  with pytest.raises(ValueError, match="batch 1"):
    two = tiny.prefill(
      cw.Chunk.tokenize(tiny.vocab, ["a", "b"], is_first_chunk=True)
    )
    list(tiny.generate_many([ok], slots=2, prefix=[two]))
  with pytest.raises(ValueError, match="without a prefix"):
    list(
      tiny.generate_many([cw.Request(tokens=[], sample_id=0, steps=2)], slots=1)
    )
  mesh_model = cw.InferenceModel(
    tiny.hparams,
    tiny.weights,
    tiny.vocab,
    mesh=make_mesh((2, 2, 2)),
    layout="ws_2d/yz",
  )
  with pytest.raises(
    ValueError, match="multiple of the layout's batch split 4"
  ):
    list(mesh_model.generate_many([ok], slots=6, prefix=()))


@pytest.mark.slow
@pytest.mark.long
def test_smollm2_three_devices_match_generate_alone():
  """A 3-device ws_2d mesh, 2 slots, bit-identical to `generate` alone on
  the same mesh (one device's slots are test_requests_equal_generate_alone's,
  and SmolLM2's through the server test_serving_smollm2's)."""
  smol = cw.load("smollm2-135m")
  vocab = smol.vocab
  prompts = [
    "Q: 3+3? A:",
    "Q: What is the capital of France? A:",
    " Q: Name a colour. A:",
  ]
  requests = [
    cw.Request(
      tokens=vocab.encode(p),
      sample_id=i,
      steps=12,  # one `generate` program for `_alone`
      sampling=cw.Sampling(temperature=float(i % 2), seed=3),
      stop_ids=tuple(vocab.encode("\n")),
    )
    for i, p in enumerate(prompts)
  ]
  mesh_model = cw.InferenceModel(
    smol.hparams,
    smol.weights,
    vocab,
    mesh=make_mesh((1, 1, 3), jax.devices()[:3]),
    layout="ws_2d",
    bos_id=smol.bos_id,
    eos_id=smol.eos_id,
  )
  mesh_prefix = mesh_model.prefill(
    cw.Chunk.tokenize(vocab, ["Q: 2+2? A: 4.\n"], is_first_chunk=True)
  )
  want = [_alone(mesh_model, [mesh_prefix], r, top_n=3) for r in requests]
  got = {
    r.index: r
    for r in mesh_model.generate_many(
      requests, slots=2, prefix=[mesh_prefix], top_n=3
    )
  }
  # Invariant numerics: two slots are bit-identical to one request alone.
  _check(got, want, str(mesh_model.generate_layout))
