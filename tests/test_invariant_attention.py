"""Attention's chains in one call (`cpu_kernels.invariant_attend`,
`invariant_attention._fused`): every instruction set's path bit for bit
the portable definition, and the fused call bit for bit its plain twin
(`_chain`: a logits kernel, the max, a values kernel per piece)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise import cpu_kernels, numerics
from chunkwise.models import invariant_attention

pytestmark = pytest.mark.skipif(
  not cpu_kernels.load(), reason="no C++ compiler: the kernels did not build"
)

PATHS = [n for n in cpu_kernels.isa.available() if n != "portable"]

# B, kv, T, group, D, pieces: (b, heads, first, S, dtype, mask) with mask
# "causal" (the chunk's own keys: T == S), "rows" ([b, B / b, 1, S]: each
# row's padding), "all" ([1, 1, 1, 1]) or "random" (full [b, B / b, T, S]).
C, R, A, X = "causal", "rows", "all", "random"
CASES = [
  (1, 3, 40, 3, 64, [(1, 3, 0, 40, "f32", C)]),
  (2, 2, 37, 4, 64, [(1, 5, 2, 70, "f32", R), (2, 2, 0, 37, "bf16", C)]),
  (2, 1, 9, 5, 40, [(2, 1, 0, 130, "bf16", X), (2, 1, 0, 9, "f32", C)]),
  (1, 2, 50, 1, 72, [(1, 2, 0, 200, "f32", A), (1, 2, 0, 50, "f32", C)]),
  (4, 1, 6, 3, 16, [(2, 3, 1, 65, "f32", R), (4, 1, 0, 6, "f32", C)]),
  (1, 1, 3, 1, 128, [(1, 1, 0, 1, "f32", A), (1, 1, 0, 3, "f32", C)]),
  # logits spread over hundreds: weights below exp's range (exactly 0)
  (1, 2, 33, 2, 64, [(1, 2, 0, 33, "f32", C)], 40.0),
]


def _case(case, seed=0):
  batch, kv, time, group, dim, specs, *scale = case
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, time, kv, group, dim)).astype(np.float32)
  q = jnp.asarray(q * (scale[0] if scale else 1) / np.sqrt(dim))
  pieces = []
  for b, heads, first, width, dtype, how in specs:
    k, v = (
      jnp.asarray(rng.standard_normal((b, heads, width, dim)), jnp.float32)
      for _ in range(2)
    )
    if dtype == "bf16":
      k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    if how == "causal":
      mask = jnp.arange(time)[:, None] >= jnp.arange(width)[None]
      mask = mask[None, None]
    elif how == "rows":
      lengths = rng.integers(1, width + 1, (b, batch // b))
      mask = jnp.asarray(np.arange(width) < lengths[..., None])[:, :, None]
    elif how == "all":
      mask = jnp.ones((1, 1, 1, width), bool)
    else:
      mask = jnp.asarray(rng.random((b, batch // b, time, width)) < 0.6)
      mask = mask.at[..., 0].set(True)  # every query sees a key
    pieces.append((k, v, first, mask))
  return q, pieces


def _kernel(q, pieces, isa):
  batch, time, kv, group, dim = q.shape
  queries = jnp.swapaxes(q, 1, 2).reshape(batch, kv, time * group, dim)
  return np.asarray(
    jax.jit(
      lambda q: cpu_kernels.invariant_attend(q, pieces, group=group, isa=isa)
    )(queries)
  )


def _exact(q, pieces):
  """f64 softmax attention of the pieces' keys each query sees."""
  batch, time, kv, _, _ = q.shape
  qf = np.asarray(q, np.float64)
  logits, values = [], []
  for k, v, first, mask in pieces:
    b = k.shape[0]
    k, v = (
      np.repeat(np.asarray(a.astype(jnp.float32), np.float64), batch // b, 0)
      for a in (k, v)
    )
    k, v = k[:, first : first + kv], v[:, first : first + kv]
    m = np.broadcast_to(mask, (b, batch // b, time, k.shape[2]))
    m = m.reshape(batch, time, k.shape[2])
    lg = np.einsum("btkgd,bksd->btkgs", qf, k)
    logits.append(np.where(m[:, :, None, None], lg, -np.inf))
    values.append(v)
  lg = np.concatenate(logits, -1)
  w = np.exp(lg - lg.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  return np.einsum("btkgs,bksd->btkgd", w, np.concatenate(values, 2))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_path_is_the_definition(case):
  q, pieces = _case(case)
  defined = _kernel(q, pieces, "portable")
  for isa in PATHS:
    got = _kernel(q, pieces, isa)
    assert np.array_equal(got.view(np.int32), defined.view(np.int32)), isa
  batch, time, kv, group, dim = q.shape
  out = defined.reshape(batch, kv, time, group, dim + 1)
  got = np.swapaxes(out[..., :dim] / out[..., dim:], 1, 2)
  np.testing.assert_allclose(got, _exact(q, pieces), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fused_is_its_plain_twin_bit_for_bit(case):
  q, specs = _case(case, seed=1)
  pieces = [((k, v, first, None, None), mask) for k, v, first, mask in specs]
  time = q.shape[1]
  # The twin reads a head window of a [b, heads, S, D] piece in place
  # only as a traced first head, as the model hands it over.
  twin_pieces = [
    (
      (
        k,
        v,
        None if k.shape[1] == q.shape[2] else jnp.int32(first),
        None,
        None,
      ),
      mask,
    )
    for (k, v, first, _, _), mask in pieces
  ]
  masks = [m.reshape((*m.shape[:3], 1, 1, *m.shape[3:])) for _, m in pieces]
  fused_pieces = [(p, m) for (p, _), m in zip(pieces, masks, strict=True)]
  twin_pieces = [(p, m) for (p, _), m in zip(twin_pieces, masks, strict=True)]
  with numerics.scope("invariant"):
    fused = jax.jit(lambda q: invariant_attention._fused(q, fused_pieces))(q)
    plain = jax.jit(lambda q: invariant_attention._chain(q, twin_pieces, None))(
      q
    )
  assert fused.shape == plain.shape == q.shape
  assert np.array_equal(
    np.asarray(fused).view(np.int32), np.asarray(plain).view(np.int32)
  ), time


def test_bad_pieces_are_refused():
  q, pieces = _case(CASES[1])
  k, v, first, mask = pieces[0]
  with pytest.raises(Exception, match="k and v shapes disagree"):
    _kernel(q, [(k, v[:, :, :-1], first, mask), pieces[1]], None)
  with pytest.raises(Exception, match="mask dims"):
    _kernel(q, [(k, v, first, mask[:, :, :, :-1]), pieces[1]], None)
  with pytest.raises(Exception, match="disagree with q"):
    _kernel(q, [(k, v, 4, mask), pieces[1]], None)


def test_a_model_prefill_is_the_same_fused_or_not(monkeypatch):
  """A prefill with a shared prefix and padded rows, then decoding: the
  same bits when every block takes the per-piece kernels."""
  rng = np.random.default_rng(0)
  ids = rng.integers(3, cw.configs.get("tiny").vocab, (2, 60)).astype(np.int32)

  def run():  # a model of its own: programs compiled afresh
    model = cw.InferenceModel.random(cw.configs.get("tiny"), seed=0)
    few = model.prefill(
      cw.Chunk(tokens=jnp.asarray(ids[:1, :20]), lengths=jnp.asarray([20]))
    )
    chunk = cw.Chunk(
      tokens=jnp.asarray(ids[:, 20:]), lengths=jnp.asarray([40, 23])
    )
    rest = model.prefill(chunk, prefix=[few])
    return [np.asarray(few.per_token_scores), np.asarray(rest.per_token_scores)]

  fused = run()
  monkeypatch.setattr(invariant_attention, "FUSED_ROWS", 1 << 30)
  plain = run()
  for a, b in zip(fused, plain, strict=True):
    assert np.array_equal(a.view(np.int32), b.view(np.int32))
