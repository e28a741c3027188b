"""The invariant CPU kernels (`cpu_kernels.invariant_*`): every
instruction set's path this CPU runs bit for bit equal to the portable C++
definition, independent of the rows beside a row, and close to the exact
math. (The AArch64 path runs under qemu: tests/test_kernels_arm.py.)"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkwise import cpu_kernels, numerics
from chunkwise.contract import contract
from chunkwise.models.quantized import QArray, quantize

pytestmark = pytest.mark.skipif(
  not cpu_kernels.load(), reason="no C++ compiler: the kernels did not build"
)

_matmul = jax.jit(
  cpu_kernels.invariant_matmul,
  static_argnames=("nmajor", "ones", "isa", "act8"),
)
# The vector paths this CPU runs (each compared with "portable").
PATHS = [n for n in cpu_kernels.isa.available() if n != "portable"]
paths = pytest.mark.parametrize("isa", PATHS or ["portable"])


def _operands(rng, g, m, k, n, kind, nmajor, groups):
  x = rng.standard_normal((g, m, k)).astype(np.float32)
  shape = (g, n, k) if nmajor else (g, k, n)
  w = rng.standard_normal(shape).astype(np.float32)
  scale = None
  if kind == "int8":
    w = rng.integers(-127, 128, shape).astype(np.int8)
    sshape = (g, n, groups) if nmajor else (g, groups, n)
    scale = jnp.asarray(rng.random(sshape).astype(np.float32) * 0.02)
  w = jnp.asarray(w).astype(jnp.bfloat16 if kind == "bf16" else w.dtype)
  return jnp.asarray(x), w, scale


def _reference(x, w, scale, acc, nmajor, ones):
  """f64 math of the dequantized weight (value x scale), and the bound on
  an int8 weight's error from rounding x to int16 per row and group: half
  a step (max |x| over the group / 32767) times sum |w| (else 0)."""
  wf = np.asarray(w.astype(jnp.float32), np.float64)
  xf = np.asarray(x, np.float64)
  bound = 0
  if scale is not None:
    s = np.asarray(scale, np.float64)
    axis = 2 if nmajor else 1
    group = wf.shape[axis] // s.shape[axis]
    wf = wf * np.repeat(s, group, axis=axis)
    g, m, k = xf.shape
    half = np.abs(xf).reshape(g, m, k // group, group).max(-1) / 32767 / 2
    wk = np.swapaxes(wf, 1, 2) if nmajor else wf
    bound = np.einsum("gmk,gkn->gmn", np.repeat(half, group, axis=2), abs(wk))
  wk = np.swapaxes(wf, 1, 2) if nmajor else wf
  if ones:
    wk = np.concatenate([wk, np.ones((*wk.shape[:2], 1), wk.dtype)], axis=2)
  out = np.einsum("gmk,gkn->gmn", xf, wk)
  return (out if acc is None else out + np.asarray(acc)), bound


CASES = [
  # g, m, k, n, kind, nmajor, groups, acc, ones
  (1, 1, 576, 200, "f32", False, 1, False, False),  # decode rows: stream
  (1, 33, 96, 70, "f32", False, 1, False, False),  # packed tiles, col tail
  (1, 100, 64, 130, "f32", False, 1, False, False),  # two row bands
  (3, 13, 70, 64, "f32", False, 1, True, True),  # attention's values
  (2, 40, 37, 64, "f32", False, 1, True, True),  # ... 5-vector tiles
  (1, 300, 600, 130, "f32", False, 1, True, False),  # panels of 256 inputs
  (1, 7, 72, 40, "int8", False, 2, False, False),  # groups of 36
  (1, 50, 72, 33, "int8", False, 4, False, False),
  (1, 17, 30, 50, "int8", False, 2, False, False),  # odd groups (15)
  (1, 3, 600, 70, "int8", False, 1, False, False),  # chunks of 256 inputs
  (2, 9, 64, 200, "int8", False, 2, True, False),  # from acc
  (1, 5, 576, 30, "bf16", False, 1, False, False),
  (1, 1, 70, 203, "f32", True, 1, False, False),  # tied unembedding
  (1, 9, 64, 50, "f32", True, 1, False, False),  # 4 x 4 tiles, trees
  (3, 3, 64, 37, "f32", True, 1, False, False),  # attention logits
  (1, 18, 72, 9, "int8", True, 2, False, False),
  (1, 18, 30, 37, "int8", True, 2, False, False),  # odd groups, 3 blocks
  (1, 3, 600, 21, "int8", True, 1, False, False),
  (1, 2, 40, 11, "bf16", True, 1, False, False),
]


def _check(case, isa, seed):
  g, m, k, n, kind, nmajor, groups, with_acc, ones = case
  rng = np.random.default_rng(seed)
  x, w, scale = _operands(rng, g, m, k, n, kind, nmajor, groups)
  acc = None
  if with_acc:
    acc = jnp.asarray(rng.standard_normal((g, m, n + ones)), jnp.float32)
  got = _matmul(x, w, scale, acc, nmajor=nmajor, ones=ones, isa=isa)
  defined = _matmul(x, w, scale, acc, nmajor=nmajor, ones=ones, isa="portable")
  assert np.array_equal(got, defined), (isa, case)
  want, bound = _reference(x, w, scale, acc, nmajor, ones)
  err = np.abs(np.asarray(got, np.float64) - want)
  limit = 1e-5 + 1e-5 * k * np.abs(want).max() + 1.01 * bound
  assert np.all(err <= limit), float((err - limit).max())
  if kind == "int8":  # and the bound is not vacuous
    assert np.max(bound) < 1e-3 * np.max(np.abs(want))
  # Each row alone: the same bits as among the others.
  for r in {0, m // 2, m - 1}:
    part = None if acc is None else acc[:, r : r + 1]
    alone = _matmul(
      x[:, r : r + 1], w, scale, part, nmajor=nmajor, ones=ones, isa=isa
    )
    assert np.array_equal(alone[:, 0], got[:, r]), r


@paths
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matmul_is_its_definition_row_by_row(case, isa):
  _, m, k, n = case[:4]
  _check(case, isa, m * k + n)


@paths
def test_random_shapes_are_their_definition(isa):
  """Tails of every tile and block: shapes drawn at random (seeded)."""
  rng = np.random.default_rng(7)
  for i in range(24):
    kind = ["f32", "bf16", "int8"][i % 3]
    nmajor = bool(i // 3 % 2)
    m = int(rng.choice([1, 2, 3, 5, 8, 17, 33, 40]))
    n = int(rng.integers(1, 150))
    groups = int(rng.choice([1, 2, 3])) if kind == "int8" else 1
    k = groups * int(rng.integers(1, 70))
    ones = kind != "int8" and not nmajor and bool(rng.integers(2))
    acc = not nmajor and bool(rng.integers(2))
    _check((1, m, k, n, kind, nmajor, groups, acc, ones), isa, i)


@paths
@pytest.mark.parametrize(
  "g, m, k, n, ones",
  [(3, 13, 70, 64, True), (1, 40, 300, 65, True), (2, 2, 9, 5, False)],
)
def test_shift_is_exp_then_the_product(g, m, k, n, ones, isa):
  """x enters as exp(x - shift), bit for bit `invariant_unary`'s exp of
  x - shift followed by the product (attention's values pass)."""
  rng = np.random.default_rng(k)
  x = jnp.asarray(rng.standard_normal((g, m, k)).astype(np.float32) * 4)
  top = x.max(-1)
  v = jnp.asarray(rng.standard_normal((g, k, n)).astype(np.float32))
  acc = jnp.asarray(rng.standard_normal((g, m, n + ones)).astype(np.float32))
  for nmajor, w in ((False, v), (True, jnp.swapaxes(v, 1, 2))):
    if ones and nmajor:
      continue
    e = cpu_kernels.invariant_unary(x - top[..., None], "exp", isa=isa)
    want = _matmul(e, w, None, acc, nmajor=nmajor, ones=ones, isa=isa)
    got = cpu_kernels.invariant_matmul(
      x, w, None, acc, nmajor=nmajor, ones=ones, shift=top, isa=isa
    )
    assert np.array_equal(got, want)
    defined = cpu_kernels.invariant_matmul(
      x, w, None, acc, nmajor=nmajor, ones=ones, shift=top, isa="portable"
    )
    assert np.array_equal(got, defined)


def test_bad_shapes_are_refused():
  x = jnp.ones((1, 2, 8))
  with pytest.raises(Exception, match="x and w shapes disagree"):
    _matmul(x, jnp.ones((1, 9, 4)), nmajor=False)
  with pytest.raises(Exception, match="ones needs a k-major"):
    _matmul(x, jnp.ones((1, 4, 8)), nmajor=True, ones=True)
  with pytest.raises(Exception, match="shift needs a float weight"):
    cpu_kernels.invariant_matmul(
      x, jnp.ones((1, 8, 4)), nmajor=False, shift=jnp.ones((1, 3))
    )
  with pytest.raises(ValueError, match="isa='sse9'"):
    _matmul(x, jnp.ones((1, 8, 4)), nmajor=False, isa="sse9")


def _ulps(a, b):
  a, b = np.float32(a), np.float32(b)
  return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32))


@paths
@pytest.mark.parametrize("op", ["exp", "log"])
def test_exp_and_log_are_one_routine_for_every_element(op, isa):
  rng = np.random.default_rng(0)
  if op == "exp":
    x = np.concatenate([rng.uniform(-87, 88.7, 5000), rng.normal(0, 3, 5000)])
  else:
    x = np.concatenate([rng.uniform(1.2e-38, 1e38, 5000), rng.random(5000)])
  x = x.astype(np.float32)
  got = np.asarray(cpu_kernels.invariant_unary(x, op, isa=isa))
  assert np.array_equal(got, cpu_kernels.invariant_unary(x, op, isa="portable"))
  want = getattr(np, op)(x.astype(np.float64)).astype(np.float32)
  assert _ulps(got, want).max() <= 1
  for start, size in ((0, 1), (3, 7), (5, 16), (1, 33)):  # any slice alike
    part = cpu_kernels.invariant_unary(x[start : start + size], op, isa=isa)
    assert np.array_equal(part, got[start : start + size])


@pytest.mark.parametrize("isa", ["portable", *PATHS])
def test_exp_and_log_edges(isa):
  special = np.float32([0, -0.0, np.inf, -np.inf, np.nan, 89.0, -88.0, 1e-45])
  exp = np.asarray(cpu_kernels.invariant_unary(special, "exp", isa=isa))
  np.testing.assert_array_equal(exp[:4], [1, 1, np.inf, 0])
  assert np.isnan(exp[4]) and exp[5] == np.inf and exp[6] == 0  # flushed
  log = np.asarray(cpu_kernels.invariant_unary(special, "log", isa=isa))
  np.testing.assert_array_equal(
    log[[0, 1, 2, 7]], [-np.inf] * 2 + [np.inf] * 1 + [-np.inf]
  )
  assert np.isnan(log[3]) and np.isnan(log[4])  # log(-inf), log(nan)
  with pytest.raises(ValueError, match="op='sin'"):
    cpu_kernels.invariant_unary(special, "sin")


@paths
def test_row_sums_and_exp_sum_in_one_pass(isa):
  rng = np.random.default_rng(1)
  for m, k in ((5, 49152), (3, 70), (17, 16), (2, 5), (4, 23)):
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32) * 5)
    shift = x.max(-1)
    got = cpu_kernels.invariant_exp_sum(x, shift, isa=isa)
    e = cpu_kernels.invariant_unary(x - shift[:, None], "exp", isa=isa)
    assert np.array_equal(got, cpu_kernels.invariant_row_sum(e, isa=isa))
    assert np.array_equal(
      got, cpu_kernels.invariant_exp_sum(x, shift, isa="portable")
    )
    sums = cpu_kernels.invariant_row_sum(x, isa=isa)
    defined = cpu_kernels.invariant_row_sum(x, isa="portable")
    assert np.array_equal(sums, defined)
    exact = np.sum(np.asarray(x, np.float64), axis=-1)
    bound = 1e-6 * np.sum(np.abs(np.asarray(x, np.float64)), axis=-1)
    assert np.all(np.abs(sums - exact) <= bound)


@pytest.mark.parametrize(
  "eq, xs, ws, dims",
  [
    ("bte,ehd->bthd", (2, 3, 16), (16, 4, 8), (0,)),  # k-major, two free
    ("bthd,hde->bte", (2, 3, 4, 8), (4, 8, 16), (0, 1)),  # two contracted
    ("bte,ve->btv", (2, 3, 16), (40, 16), (1,)),  # n-major
    ("bte,hef->bthf", (1, 2, 16), (3, 16, 8), (1,)),  # contracted inside
  ],
)
def test_numerics_matmul_is_contract(eq, xs, ws, dims):
  x = jax.random.normal(jax.random.key(0), xs)
  w = jax.random.normal(jax.random.key(1), ws)
  want = contract(eq, x, w)
  with numerics.scope("invariant"):
    got = jax.jit(lambda x, w: contract(eq, x, w))(x, w)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  q = quantize(w, dims, 4)
  assert isinstance(q, QArray)
  with numerics.scope("invariant"):
    got = jax.jit(lambda x, w: numerics.matmul(eq, x, w))(x, q)
  # x rounded to int16 per row and group: at most half a step of max |x|
  # (over all x here) / 32767 per input, times sum |w|.
  deq = q.astype(x.dtype)
  step = float(jnp.abs(x).max()) / 32767 / 2
  slack = step * contract(eq, jnp.ones_like(x), jnp.abs(deq))
  err = jnp.abs(got - contract(eq, x, deq))
  assert bool(jnp.all(err <= 1e-5 + 1e-5 * jnp.abs(got) + 1.01 * slack))


def test_a_window_of_heads_is_read_in_place():
  """heads=(first, count) of a w [b, kv, S, D] equals slicing it first."""
  rng = np.random.default_rng(3)
  w = jnp.asarray(rng.standard_normal((2, 4, 9, 16)).astype(np.float32))
  x = jnp.asarray(rng.standard_normal((4, 5, 16)).astype(np.float32))
  first = jnp.array([1], jnp.int32)
  got = cpu_kernels.invariant_matmul(x, w, nmajor=True, heads=(first, 2))
  want = cpu_kernels.invariant_matmul(x, w[:, 1:3], nmajor=True)
  assert np.array_equal(got, want)
  e = jnp.asarray(rng.random((4, 5, 9)).astype(np.float32))
  got = cpu_kernels.invariant_matmul(
    e, w, nmajor=False, ones=True, heads=(first, 2)
  )
  want = cpu_kernels.invariant_matmul(e, w[:, 1:3], nmajor=False, ones=True)
  assert np.array_equal(got, want)
  with pytest.raises(Exception, match="heads window out of range"):
    cpu_kernels.invariant_matmul(
      x, w, nmajor=True, heads=(jnp.array([3], jnp.int32), 2)
    )


@paths
@pytest.mark.parametrize("m", [3, 40])  # decode rows (streams), packed tiles
def test_a_cache_is_read_by_row_up_to_its_valid_keys(m, isa):
  """rows= reads a [b, kv, S, D] cache's rows where they are, valid= stops
  each row's chains at its valid keys: the logits, then the values pass
  (shifted, with the ones column) of the rows gathered and cut to their
  keys, bit for bit, whatever the keys past them hold; a row of 0 keys
  gives its starts, and the portable loops define the same."""
  rng = np.random.default_rng(m)
  b, kv, s, d, count = 5, 3, 70, 16, 2
  cache = jnp.asarray(rng.standard_normal((b, kv, s, d)), jnp.float32)
  rows = jnp.array([3, 0, 4, 9], jnp.int32)  # 9: past the cache (clamped)
  valid = jnp.array([70, 1, 33, 0], jnp.int32)
  q = jnp.asarray(rng.standard_normal((4 * count, m, d)), jnp.float32)
  first = jnp.array([1], jnp.int32)
  start = jnp.asarray(rng.standard_normal((4 * count, m, d + 1)), jnp.float32)
  window = (first, count)

  def logits_of(q, w, **kw):
    return cpu_kernels.invariant_matmul(q, w, nmajor=True, **kw)

  def values_of(x, w, start, top, **kw):  # attention's values pass
    return cpu_kernels.invariant_matmul(
      x, w, None, start, nmajor=False, ones=True, shift=top, **kw
    )

  read = dict(heads=window, rows=rows, valid=valid)
  logits = logits_of(q, cache, isa=isa, **read)
  top = jnp.max(logits, -1)
  out = values_of(logits, cache, start, top, isa=isa, **read)
  for path in ("portable", isa):
    assert np.array_equal(logits_of(q, cache, isa=path, **read), logits), path
    again = values_of(logits, cache, start, top, isa=path, **read)
    assert np.array_equal(again, out), path
  gathered = cache[np.clip(np.asarray(rows), 0, b - 1)]
  for r in range(4):
    n = int(valid[r])
    g = slice(r * count, (r + 1) * count)
    one = gathered[r : r + 1, 1 : 1 + count, :n]
    assert np.array_equal(logits[g, :, :n], logits_of(q[g], one, isa=isa)), r
    assert not np.any(logits[g, :, n:]), r  # past the keys: +0
    want = values_of(logits[g, :, :n], one, start[g], top[g], isa=isa)
    assert np.array_equal(out[g], want), r
  # The values pass over every key, those past a row's valid ones masked
  # (exp(-1e30 - top) = 0): what attention computed before, the same bits.
  masked = jnp.where(
    jnp.arange(s) < jnp.repeat(valid, count)[:, None, None], logits, -1e30
  )
  whole = values_of(masked, gathered, start, top, heads=window, isa=isa)
  assert np.array_equal(whole, out)
  with pytest.raises(Exception, match="one entry per row"):
    cpu_kernels.invariant_matmul(
      q, cache, nmajor=True, heads=(first, count), rows=rows[:3]
    )


def _cpu_flags() -> set[str]:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return set(line.split(":", 1)[1].split())
  except OSError:
    pass
  return set()


@pytest.mark.skipif(
  cpu_kernels.build.machine() != "x86_64", reason="x86-64's paths"
)
def test_the_paths_are_what_the_cpu_reports():
  """Every path /proc/cpuinfo's flags allow is compiled and chosen (the
  best by default), and none beyond them."""
  flags = _cpu_flags()
  want = ["portable"]
  if {"avx2", "fma"} <= flags:
    want.append("avx2")
    if "avx_vnni" in flags:  # /proc/cpuinfo's name for AVX-VNNI
      want.append("avx2_vnni")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
      want.append("avx512")
      if "avx512_vnni" in flags:
        want.append("avx512_vnni")
  assert list(cpu_kernels.isa.available()) == want
  assert cpu_kernels.isa.current() == want[-1]


def _in_child(env: dict) -> subprocess.CompletedProcess:
  """A process with `env` that prints its kernel path, then the default
  numerics of a tiny model and those it runs when invariant is asked for
  (and whether that model's prefill works)."""
  code = (
    "import chunkwise as cw\n"
    "from chunkwise import cpu_kernels\n"
    "cpu_kernels.load()\n"
    "print(cpu_kernels.isa.current())\n"
    "h = cw.configs.get('tiny')\n"
    "m = cw.InferenceModel.random(h, seed=0)\n"
    "e = cw.InferenceModel(h, m.weights, m.vocab, numerics='invariant')\n"
    "chunk = cw.Chunk.tokenize(e.vocab, ['ab'], is_first_chunk=True)\n"
    "e.prefill(chunk)\n"
    "print(m.numerics, e.numerics)\n"
  )
  return subprocess.run(
    [sys.executable, "-c", code],
    env={**os.environ, **env},
    capture_output=True,
    text=True,
    timeout=300,
  )


def test_a_process_picks_its_path_by_environment():
  """CHUNKWISE_CPU_ISA picks the path; where it is the portable one (no
  vector path), the default numerics are fast, said once with the CPU's
  name, and invariant numerics still run when asked for."""
  out = _in_child({"CHUNKWISE_CPU_ISA": "portable"})
  assert out.returncode == 0, out.stderr
  assert out.stdout.split()[-3:] == ["portable", "fast", "invariant"]
  assert out.stderr.count("no vector path") == 1
  assert cpu_kernels.isa.cpu_name() in out.stderr
  if PATHS:  # the best path is the default elsewhere
    out = _in_child({"CHUNKWISE_CPU_ISA": PATHS[0]})
    assert out.stdout.split()[-3:] == [PATHS[0], "invariant", "invariant"]
  out = _in_child({"CHUNKWISE_CPU_ISA": "avx1024"})
  assert out.returncode != 0
  assert "CHUNKWISE_CPU_ISA='avx1024'" in out.stderr
  assert cpu_kernels.isa.cpu_name() in out.stderr


# GGUF blocks (`models.blocks`): 4-bit codes two to a byte along K or int8
# codes, f16 scales and offsets per block (w = code * scale + offset).
BLOCK_CASES = [
  # m, k, n, bits, nmajor, block, offset
  (1, 576, 200, 4, False, 32, True),  # decode, Q4_1-like
  (7, 64, 40, 4, False, 32, False),  # Q4_0 without its offset folded in
  (33, 96, 70, 4, False, 16, True),  # tiles and a column tail
  (3, 576, 37, 4, True, 32, True),  # a tied 4-bit table
  (5, 96, 50, 8, False, 32, True),  # Q5_1-like
  (2, 64, 21, 8, True, 16, False),  # Q6_K-like
  (18, 256, 33, 8, False, 32, False),  # Q8_0
]


@paths
@pytest.mark.parametrize("case", BLOCK_CASES, ids=str)
def test_block_matmul_is_its_definition(case, isa):
  m, k, n, bits, nmajor, block, with_offset = case
  rng = np.random.default_rng(m * k + n)
  x = jnp.asarray(rng.standard_normal((1, m, k)).astype(np.float32))
  codes = (
    rng.integers(0, 16, (n, k)) if bits == 4 else rng.integers(-32, 32, (n, k))
  )
  groups = (n, k // block)
  scale = rng.uniform(1e-3, 2e-2, groups).astype(np.float16)
  offset = rng.uniform(-0.1, 0.1, groups).astype(np.float16)
  dequant = codes * np.repeat(scale.astype(np.float64), block, axis=1)
  if with_offset:
    dequant = dequant + np.repeat(offset.astype(np.float64), block, axis=1)
  if bits == 4:  # even k in the low nibble
    values = (codes[:, 0::2] | codes[:, 1::2] << 4).astype(np.uint8)
  else:
    values = codes.astype(np.int8)
  if not nmajor:
    values, scale, offset = values.T, scale.T, offset.T

  def run(isa, rows=slice(None)):
    return _matmul(
      x[:, rows],
      jnp.asarray(values)[None],
      jnp.asarray(scale)[None],
      None,
      nmajor=nmajor,
      isa=isa,
      offset=jnp.asarray(offset)[None] if with_offset else None,
    )

  got = run(isa)
  assert np.array_equal(got, run("portable")), isa
  # f32 scales and offsets of the same values: the same bits
  widened = _matmul(
    x,
    jnp.asarray(values)[None],
    jnp.asarray(scale, jnp.float32)[None],
    None,
    nmajor=nmajor,
    isa=isa,
    offset=jnp.asarray(offset, jnp.float32)[None] if with_offset else None,
  )
  assert np.array_equal(got, widened)
  # the dequantized weight times x, but for x rounded to int16 per block
  xf = np.asarray(x[0], np.float64)
  want = xf @ dequant.T
  half = np.abs(xf).reshape(m, k // block, block).max(-1) / 32767 / 2
  bound = np.repeat(half, block, axis=1) @ np.abs(dequant).T
  err = np.abs(np.asarray(got[0], np.float64) - want)
  assert np.all(err <= 1e-5 * k * np.abs(want).max() + 1.01 * bound)
  assert np.max(bound) < 1e-3 * np.max(np.abs(want))
  for r in {0, m - 1}:  # each row alone: the same bits
    assert np.array_equal(run(isa, slice(r, r + 1))[0, 0], got[0, r])


def test_bad_block_operands_are_refused():
  x = jnp.ones((1, 2, 64))
  w = jnp.zeros((1, 32, 8), jnp.uint8)
  s = jnp.ones((1, 2, 8), jnp.float16)
  with pytest.raises(Exception, match="offset needs"):
    _matmul(x, w, s, None, nmajor=False, offset=jnp.ones((1, 1, 8)))
  with pytest.raises(Exception, match="x and w shapes disagree"):
    _matmul(x, jnp.zeros((1, 64, 8), jnp.uint8), s, None, nmajor=False)
  with pytest.raises(Exception, match="one dtype"):
    _matmul(x, w, s, None, nmajor=False, offset=jnp.ones((1, 2, 8)))


# 8-bit activations (`act8`, numerics "q8"): x rounded to int8 per block
# of 32 inputs (or of the whole group where it is not a multiple of 32).
ACT8_CASES = [
  # m, k, n, kind, nmajor, group, offset, f16 scales
  (1, 576, 200, "u4", False, 32, True, True),  # decode, Q4_1-like
  (9, 576, 70, "u4", False, 32, False, True),  # Q4_0, a column tail
  (5, 128, 64, "u4", False, 16, True, False),  # u4 blocks of 16
  (3, 576, 37, "u4", True, 32, True, True),  # a tied 4-bit table
  (1, 576, 130, "int8", False, 576, False, False),  # our int8: 18 blocks
  (17, 96, 33, "int8", False, 32, True, True),  # Q5_1-like, row tiles
  (2, 64, 21, "int8", True, 16, False, True),  # Q6_K-like table
  (6, 192, 40, "int8", True, 64, False, False),  # groups of 2 blocks
  (4, 72, 50, "int8", False, 12, False, False),  # blocks of 12
  (3, 36, 20, "int8", True, 6, False, False),  # 6: the portable loops
  (3, 96, 20, "u4", True, 16, False, True),  # n-major u4 of 16: portable
  # 8 rows and more: x86 tiles read each strip's quads from a packed copy
  (12, 128, 70, "u4", False, 16, True, False),  # u4 blocks of 16, a tail
  (8, 576, 130, "int8", False, 576, False, False),  # our int8, packed
  (10, 72, 50, "int8", False, 12, True, True),  # blocks of 12, packed
]


def _act8_operands(rng, m, k, n, kind, nmajor, group, with_offset, half):
  x = rng.standard_normal((1, m, k)).astype(np.float32)
  x[0, 0, :4] = [0.0, -0.0, 30.0, -30.0]  # a block with a large max
  if m > 1:
    x[0, 1, : min(k, 32)] = 0  # a block of zeros: sx = 0
  if kind == "u4":
    codes = rng.integers(0, 16, (n, k))
    values = (codes[:, 0::2] | codes[:, 1::2] << 4).astype(np.uint8)
  else:  # every int8 code, -128 included
    codes = rng.integers(-128, 128, (n, k))
    values = codes.astype(np.int8)
  groups = (n, k // group)
  dtype = np.float16 if half else np.float32
  scale = rng.uniform(1e-3, 2e-2, groups).astype(dtype)
  offset = rng.uniform(-0.1, 0.1, groups).astype(dtype)
  dequant = codes * np.repeat(scale.astype(np.float64), group, axis=1)
  if with_offset:
    dequant = dequant + np.repeat(offset.astype(np.float64), group, axis=1)
  else:
    offset = None
  if not nmajor:
    values, scale = values.T, scale.T
    offset = None if offset is None else offset.T
  return x, values, scale, offset, dequant


@paths
@pytest.mark.parametrize("case", ACT8_CASES, ids=str)
def test_act8_is_its_definition(case, isa):
  m, k, n, _, nmajor, group = case[:6]
  rng = np.random.default_rng(m * k + n)
  x, values, scale, offset, dequant = _act8_operands(rng, *case)

  def run(isa, rows=slice(None), act8=True):
    return np.asarray(
      _matmul(
        jnp.asarray(x)[:, rows],
        jnp.asarray(values)[None],
        jnp.asarray(scale)[None],
        None,
        nmajor=nmajor,
        isa=isa,
        offset=None if offset is None else jnp.asarray(offset)[None],
        act8=act8,
      )
    )

  got = run(isa)
  assert np.array_equal(got, run("portable")), isa
  for r in {0, m // 2, m - 1}:  # each row alone: the same bits
    assert np.array_equal(run(isa, slice(r, r + 1))[0, 0], got[0, r]), r
  # The exact product but for x rounded to int8 per block: half a step
  # (max |x| over the block / 127) times sum |w| over the block.
  block = 32 if group % 32 == 0 else group
  xf = np.asarray(x[0], np.float64)
  want = xf @ dequant.T
  half = np.abs(xf).reshape(m, k // block, block).max(-1) / 127 / 2
  bound = np.repeat(half, block, axis=1) @ np.abs(dequant).T
  err = np.abs(got[0].astype(np.float64) - want)
  assert np.all(err <= 1e-5 * k * np.abs(want).max() + 1.01 * bound)
  # a bound that is not vacuous (the u4 codes, all positive, make sum |w|
  # large against the sums themselves)
  assert np.max(bound) < 0.25 * np.max(np.abs(want))
  int16 = run(isa, act8=False)
  assert not np.array_equal(int16, got)


def test_act8_is_refused_where_it_cannot_apply():
  x = jnp.ones((1, 2, 64))
  with pytest.raises(Exception, match=r"act8.*needs an int8 or u4 weight"):
    _matmul(x, jnp.ones((1, 64, 8)), None, None, nmajor=False, act8=True)
