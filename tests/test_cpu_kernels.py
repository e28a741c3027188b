"""The CPU matmul kernel (`chunkwise.cpu_kernels`) against its plain twin."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise import cpu_kernels
from chunkwise.contract import contract_dims
from chunkwise.cpu_kernels import build
from chunkwise.models import matmul
from chunkwise.models.quantized import QArray, quantize

pytestmark = pytest.mark.skipif(
  not cpu_kernels.load(), reason="no C++ compiler: the kernels did not build"
)


def _weight(kind, shape, contracted, group):
  w = jax.random.normal(jax.random.key(len(shape) + shape[-1]), shape) * 0.05
  if kind == "int8":
    return quantize(w, contracted, group)
  if kind == "int8/channel":
    return quantize(w, contracted)
  return w.astype(kind)


CASES = [
  # eq, x shape, w shape, contracted dims of w, group
  ("bte,ef->btf", (1, 1, 64), (64, 96), (0,), 16),  # k-major, decode
  ("bte,ef->btf", (3, 1, 72), (72, 40), (0,), 36),  # groups of 36, 40 cols
  ("bte,ef->btf", (2, 5, 64), (64, 37), (0,), 32),  # 10 rows, odd tail
  ("bthd,hde->bte", (2, 1, 3, 8), (3, 8, 24), (0, 1), 4),  # o: two dims
  ("bte,ve->btv", (1, 1, 72), (203, 72), (1,), 36),  # tied table
  ("bte,ve->btv", (16, 1, 64), (50, 64), (1,), 64),  # 16 rows, one group
  ("bte,ef->btf", (2, 1, 30), (30, 48), (0,), 15),  # odd groups
  ("bte,ve->btv", (2, 1, 30), (9, 30), (1,), 15),
  ("bte,ef->btf", (1, 1, 600), (600, 32), (0,), 24),  # /channel: 600 > 256
  ("bte,ef->btf", (16, 1, 32), (32, 2070), (0,), 16),  # int8: column blocks
  ("bte,ve->btv", (1, 1, 600), (5, 600), (1,), 24),
  # AVX-512 blocks: 4 x 4 n-major with x-row, table-row and input tails;
  # 16-column k-major with an input and a column tail
  ("bte,ve->btv", (6, 1, 40), (11, 40), (1,), 20),
  ("bte,ef->btf", (5, 1, 30), (30, 50), (0,), 15),
]


@pytest.mark.parametrize(
  "kind", ["int8", "int8/channel", "bfloat16", "float32"]
)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0] + str(c[1]))
def test_kernel_matches_plain_twin(case, kind):
  eq, xs, ws, contracted, group = case
  x = jax.random.normal(jax.random.key(1), xs)
  w = _weight(kind, ws, contracted, group)
  assert matmul._form(eq, x, w) is not None
  fast = jax.jit(lambda x, w: matmul.weight_matmul(eq, x, w))
  assert build.INVARIANT_TARGET in fast.lower(x, w).as_text()
  want = matmul.plain(eq, x, w)
  got = fast(x, w)
  assert got.shape == want.shape and got.dtype == want.dtype
  # int8 weights multiply x quantized to int16 per row and weight group:
  # each entry off by at most half of max |x| over its group / 32767.
  slack = _int16_error_bound(eq, x, w) if kind.startswith("int8") else 0
  err = np.abs(np.asarray(got) - np.asarray(want))
  limit = 1e-5 + 1e-5 * np.abs(np.asarray(want)) + 1.01 * slack
  assert np.all(err <= limit), float((err - limit).max())
  if kind.startswith("int8"):  # and the bound is not vacuous
    assert np.max(slack) < 1e-3 * np.max(np.abs(want))


def _int16_error_bound(eq, x, w):
  """sum_k |w[k, n]| * (max |x| over k's group / 32767) / 2 per output."""
  c = len(contract_dims(eq)[1])
  rows, k = math.prod(x.shape[: x.ndim - c]), math.prod(x.shape[x.ndim - c :])
  groups = w.scale.size * k // w.values.size
  xf = np.abs(np.asarray(x, np.float32)).reshape(rows, groups, k // groups)
  half = np.broadcast_to(xf.max(-1, keepdims=True) / 32767 / 2, xf.shape)
  return matmul.plain(
    eq, jnp.asarray(half.reshape(x.shape)), abs(w.astype(jnp.float32))
  )


def test_bf16_activations_cast_back():
  x = jax.random.normal(jax.random.key(2), (1, 1, 64), jnp.bfloat16)
  w = _weight("int8", (64, 32), (0,), 16)
  got = jax.jit(lambda x, w: matmul.weight_matmul("bte,ef->btf", x, w))(x, w)
  assert got.dtype == jnp.bfloat16
  want = matmul.plain("bte,ef->btf", x.astype(jnp.float32), w)
  np.testing.assert_allclose(
    got.astype(jnp.float32), want, rtol=2e-2, atol=2e-2
  )


def test_where_the_plain_twin_runs():
  w = _weight("int8", (64, 32), (0,), 16)
  rows = matmul.MAX_ROWS + 1
  # too many rows: bound by FLOPs, XLA's GEMM
  assert matmul._form("bte,ef->btf", jnp.ones((rows, 1, 64)), w) is None
  # output letters in another order, or the weight's contracted dim inside
  assert matmul._form("bte,ef->bft", jnp.ones((1, 1, 64)), w) is None
  w3 = jnp.ones((4, 64, 8))
  assert matmul._form("bte,hef->bthf", jnp.ones((1, 1, 64)), w3) is None
  # an int weight that is not a QArray
  assert matmul._form("bte,ef->btf", jnp.ones((1, 1, 64)), w.values) is None
  plain = jax.jit(lambda x, w: matmul.weight_matmul("bte,ef->btf", x, w))
  assert (
    build.INVARIANT_TARGET
    not in plain.lower(jnp.ones((rows, 1, 64)), w).as_text()
  )


def test_disabled_by_environment(monkeypatch):
  for off in ("0", "false", "OFF"):
    monkeypatch.setenv("CHUNKWISE_CPU_KERNELS", off)
    assert not build.enabled()
  monkeypatch.setenv("CHUNKWISE_CPU_KERNELS", "1")
  assert build.enabled()


@pytest.mark.parametrize("quantized", [True, False], ids=["int8", "bf16"])
def test_model_decode_same_as_plain_twin(monkeypatch, quantized):
  """A whole model's decode through the kernel and through XLA's dots:
  greedy tokens equal, scores within f32 summation-order noise."""
  h = cw.configs.get("tiny")
  model = cw.InferenceModel.random(h, seed=3)
  weights = model.weights
  if quantized:
    weights = cw.models.quantized.quantize_weights(
      weights, cw.models.Weights.axes(h)
    )
  else:
    weights = jax.tree.map(lambda a: a.astype(jnp.bfloat16), weights)

  def run():
    m = cw.InferenceModel(h, weights, cw.ByteVocabulary())
    chunk = cw.Chunk.tokenize(m.vocab, ["abc", "d"], is_first_chunk=True)
    first = m.prefill(chunk, top_n=2)
    tokens, result = m.generate([first], sample_ids=jnp.arange(2), steps=6)
    return first, tokens, result

  fast = run()
  monkeypatch.setattr(cpu_kernels, "load", lambda: False)
  slow = run()
  np.testing.assert_array_equal(fast[1].tokens, slow[1].tokens)
  for a, b in ((fast[0], slow[0]), (fast[2], slow[2])):
    np.testing.assert_allclose(
      a.per_token_scores, b.per_token_scores, rtol=1e-4, atol=1e-4
    )


def test_qarray_scales_must_cover_free_dims():
  w = _weight("int8", (64, 32), (0,), 16)
  odd = QArray(values=w.values, scale=w.scale[:, :1])
  assert matmul._form("bte,ef->btf", jnp.ones((1, 1, 64)), odd) is None


# The int8 kernel called directly (`cpu_kernels.matmul`) against numpy with
# the dequantized weight: register tiles of x rows (1, 3, 16, 17 rows: whole
# tiles and tails), columns and table rows that are not multiples of the
# tiles (k-major: 32 columns, n-major: 16 table rows), groups even and odd,
# and one group longer than the int32 chunk (256 inputs). k-major shapes
# with at most 2048 columns split weight rows among threads, wider ones
# split columns.
DIRECT = [
  # k, n, group, nmajor
  (576, 1536, 36, False),
  (64, 37, 16, False),
  (30, 50, 15, False),
  (600, 33, 600, False),
  (96, 2070, 32, False),
  (576, 203, 36, True),
  (40, 11, 20, True),
  (30, 9, 15, True),
  (600, 21, 600, True),
  (70, 37, 14, True),
]


def _direct_case(m, k, n, group, nmajor, seed=0):
  rng = np.random.default_rng(seed + 7 * m + k + n)
  x = rng.standard_normal((m, k), np.float32)
  wf = (rng.standard_normal((n, k) if nmajor else (k, n)) * 0.05).astype(
    np.float32
  )
  axis = 1 if nmajor else 0
  q = quantize(jnp.asarray(wf), (axis,), group)
  values = np.asarray(q.values)
  scale = np.asarray(q.scale, np.float32)
  return x, values, scale


def _dequantized(values, scale, nmajor):
  axis = 1 if nmajor else 0
  rep = values.shape[axis] // scale.shape[axis]
  return values.astype(np.float32) * np.repeat(scale, rep, axis=axis)


@pytest.mark.parametrize("m", [1, 3, 16, 17])
@pytest.mark.parametrize(
  "k,n,group,nmajor", DIRECT, ids=lambda v: str(v).replace(" ", "")
)
def test_int8_kernel_direct(m, k, n, group, nmajor):
  x, values, scale = _direct_case(m, k, n, group, nmajor)
  got = np.asarray(
    jax.jit(functools.partial(cpu_kernels.matmul, nmajor=nmajor))(
      x, values, scale
    )
  )
  w = _dequantized(values, scale, nmajor)
  wk = w.T if nmajor else w  # [k, n]
  want = x.astype(np.float64) @ wk.astype(np.float64)
  # x rounded to int16 per row and group: half a step of max |x| / 32767
  xg = np.abs(x).reshape(m, k // group, group).max(-1) / 32767 / 2
  bound = np.repeat(xg, group, axis=1) @ np.abs(wk)
  err = np.abs(got - want)
  limit = 1e-5 + 1e-5 * np.abs(want) + 1.01 * bound
  assert got.shape == (m, n)
  assert np.all(err <= limit), float((err - limit).max())


@pytest.mark.parametrize(
  "k,n,group,nmajor",
  [c for c in DIRECT if c[3] or c[1] <= 2048],
  ids=lambda v: str(v).replace(" ", ""),
)
def test_int8_kernel_rows_independent_of_batch(k, n, group, nmajor):
  """A row's result, bit for bit, whatever the other rows and their
  number (one summation order per row)."""
  x, values, scale = _direct_case(17, k, n, group, nmajor)
  f = jax.jit(functools.partial(cpu_kernels.matmul, nmajor=nmajor))
  full = np.asarray(f(x, values, scale))
  for rows in (slice(0, 1), slice(3, 6), slice(1, 17)):
    np.testing.assert_array_equal(
      np.asarray(f(x[rows], values, scale)), full[rows]
    )


def test_int8_kernel_non_finite_and_zero_rows():
  x, values, scale = _direct_case(16, 576, 200, 36, False)
  x[2, 5] = np.nan
  x[4] = 0
  for nmajor in (False, True):
    v = values.T.copy() if nmajor else values
    s = scale.T.copy() if nmajor else scale
    got = np.asarray(cpu_kernels.matmul(x, v, s, nmajor=nmajor))
    assert np.all(np.isnan(got[2])) and np.all(got[4] == 0)
    assert np.all(np.isfinite(np.delete(got, 2, axis=0)))
