"""The Pallas TPU kernels (`chunkwise.tpu_kernels`) run in Pallas' TPU
interpret mode on the CPU: `matmul` (weights read as stored: float, int8
codes with group scales, GGUF blocks of 4- and 8-bit codes with scales
and offsets) against the dequantized weight's f32 product, and its
invariant form bit for bit across batch sizes and a row's place in the
batch; `take_rows` against `jnp.take`; `invariant_attend` against
softmax attention, and bit for bit across batches, chunk splits and
cache lengths. Compiled for a TPU with libtpu: tests/test_tpu_compile.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkwise import tpu_kernels
from chunkwise.models import quantized
from chunkwise.models.blocks import BlockArray
from chunkwise.tpu_kernels import stored as stored_weights

K, N = 512, 384


def _blocks(kind, bits, block, offset, seed=0) -> BlockArray:
  rng = np.random.default_rng(seed)
  if bits == 4:
    values = rng.integers(0, 256, (K // 2, N), dtype=np.uint8)
  else:
    values = rng.integers(-128, 128, (K, N), dtype=np.int8)
  groups = (K // block, N)
  scale = rng.uniform(0.001, 0.01, groups).astype(np.float16)
  off = rng.uniform(-0.05, 0.05, groups).astype(np.float16) if offset else None
  return BlockArray(
    values=jnp.asarray(values),
    scale=jnp.asarray(scale),
    offset=None if off is None else jnp.asarray(off),
    axis=0,
    bits=bits,
    kind=kind,
  )


def _weights():
  w = jax.random.normal(jax.random.PRNGKey(0), (K, N), jnp.float32) * 0.05
  return {
    "f32": w,
    "bf16": w.astype(jnp.bfloat16),
    "int8/128": quantized.quantize(w, (0,), 128),
    "int8/32": quantized.quantize(w, (0,), 32),
    "Q4_1": _blocks("Q4_1", 4, 32, True),
    "Q4_0": _blocks("Q4_0", 4, 32, True, seed=1),
    "Q8_0": _blocks("Q8_0", 8, 32, False),
    "Q6_K": _blocks("Q6_K", 8, 16, False),
  }


WEIGHTS = _weights()


def _x(rows, dtype, seed=1):
  return jax.random.normal(jax.random.PRNGKey(seed), (rows, K)).astype(dtype)


@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_matmul_reads_weights_as_stored(name, rows):
  w = WEIGHTS[name]
  dtype = jnp.float32 if name == "f32" else jnp.bfloat16
  x = _x(rows, dtype)
  got = tpu_kernels.matmul(x, w, interpret=True)
  dense = w.astype(jnp.float32) if not isinstance(w, jax.Array) else w
  # The kernel widens codes to x's dtype, as the plain twin casts them.
  want = jnp.dot(
    x.astype(jnp.float32),
    dense.astype(dtype).astype(jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
  )
  assert got.shape == (rows, N) and got.dtype == jnp.float32
  scale = float(jnp.max(jnp.abs(want)))
  np.testing.assert_allclose(got, want, atol=2e-5 * scale * (K**0.5), rtol=0)


def test_columns_that_128_does_not_divide_take_a_partial_tile():
  """A vocabulary shard (32064 of Llama-3.1's 128256 on 4 chips): tiles
  of TILE_N columns, the last one partial."""
  n = stored_weights.TILE_N + 88
  w = jax.random.normal(jax.random.PRNGKey(3), (K, n)) * 0.05
  q = quantized.quantize(w, (0,), 128)
  x = _x(2, jnp.float32)
  got = tpu_kernels.matmul(x, q, interpret=True)
  want = jnp.dot(x, q.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", ["bf16", "int8/128", "Q4_1"])
def test_invariant_rows_do_not_depend_on_the_batch(name):
  w = WEIGHTS[name]
  x = _x(200, jnp.bfloat16, seed=2)  # two tiles of 128 rows
  whole = tpu_kernels.invariant_matmul(x, w, interpret=True)
  for rows in (1, 8, 32):
    part = tpu_kernels.invariant_matmul(x[:rows], w, interpret=True)
    np.testing.assert_array_equal(part, whole[:rows])
  # A row's place in the batch and its neighbours change nothing either.
  moved = jnp.concatenate([_x(3, jnp.bfloat16, seed=9), x[150:151]])
  np.testing.assert_array_equal(
    tpu_kernels.invariant_matmul(moved, w, interpret=True)[3], whole[150]
  )


def test_a_float_table_is_read_n_major():
  """A tied table [N, K] unembeds without a transpose; so does a float
  [K, N] whose N 128 does not divide (a TPU stores it column-major)."""
  table = jax.random.normal(jax.random.PRNGKey(5), (300, K)) * 0.05
  x = _x(3, jnp.float32)
  want = jnp.dot(x, table.T, precision=jax.lax.Precision.HIGHEST)
  got = tpu_kernels.matmul(x, table, nmajor=True, interpret=True)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
  np.testing.assert_array_equal(
    tpu_kernels.matmul(x, table.T, interpret=True), got
  )
  with pytest.raises(ValueError, match="n-major weights in float only"):
    tpu_kernels.matmul(x, WEIGHTS["int8/128"], nmajor=True, interpret=True)


def test_bad_operands_are_named():
  with pytest.raises(ValueError, match=r"x \(3, 100\) must be \[rows, 512\]"):
    tpu_kernels.matmul(jnp.zeros((3, 100)), WEIGHTS["f32"], interpret=True)
  with pytest.raises(ValueError, match="2-D weights"):
    tpu_kernels.matmul(
      jnp.zeros((3, K)), jnp.zeros((K, 2, 100)), interpret=True
    )
  with pytest.raises(ValueError, match="blocks along K"):
    tpu_kernels.Stored.of(WEIGHTS["Q8_0"].replace(axis=1))


def _kernel_precisions(x, w) -> set:
  """The precisions of the dots inside `tpu_kernels.matmul`'s kernel."""
  call = next(
    e
    for e in jax.make_jaxpr(tpu_kernels.matmul)(x, w).eqns
    if e.primitive.name == "pallas_call"
  )
  return {
    e.params["precision"]
    for e in call.params["jaxpr"].eqns
    if e.primitive.name == "dot_general"
  }


def test_f32_products_at_full_precision_at_any_rows():
  """An f32 matmul at precision "highest" (f32's default: the models'
  prefill takes the kernel at any rows then) multiplies its tiles in
  Mosaic's fp32 contraction and counts six MXU passes; "high" too
  (Mosaic has no three-pass form); "default" one bf16 pass. 300 rows:
  two row tiles, the last partial, the weight read once per tile."""
  w = WEIGHTS["f32"]
  x = _x(300, jnp.float32, seed=4)
  highest = (jax.lax.Precision.HIGHEST,) * 2
  for precision, dots, passes in [
    ("highest", highest, 6),
    ("high", highest, 6),
    ("default", (jax.lax.Precision.DEFAULT,) * 2, 1),
  ]:
    with jax.default_matmul_precision(precision):
      assert _kernel_precisions(x, w) == {dots}, precision
      cost = tpu_kernels.cost(300, tpu_kernels.Stored.of(w), x.dtype)
    assert cost.flops == 2 * 300 * K * N * passes
    assert cost.bytes_accessed == 2 * K * N * 4 + 300 * K * 4 + 300 * N * 4
  with jax.default_matmul_precision("highest"):
    got = tpu_kernels.matmul(x, w, interpret=True)
  want = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["f32", "bf16", "int8", "int8/channel"])
@pytest.mark.parametrize("heads", [4, 16])
def test_heads_are_read_as_stored(kind, heads):
  """A [K, H, D] weight (q, k, v: float, or int8 codes with f32 scales
  [G, H, D], in groups of 128 or one per channel) read in its 3-D layout,
  whole heads a tile (8 at a time beyond 8), gives the product of its
  [K, H·D] reshape; 300 rows: two row tiles."""
  k = 2 * K if "channel" in kind else K  # a group of 2 k tiles
  w = jax.random.normal(jax.random.PRNGKey(3), (k, heads, 128)) * 0.05
  dtype = jnp.float32 if kind == "f32" else jnp.bfloat16
  if kind.startswith("int8"):
    w = quantized.quantize(w, (0,), None if "channel" in kind else 128)
  else:
    w = w.astype(dtype)
  x = jax.random.normal(jax.random.PRNGKey(5), (300, k)).astype(dtype)
  assert stored_weights.heads_as_stored(w)
  stored = tpu_kernels.Stored.of(w)
  assert stored.heads == heads and stored.n == heads * 128
  assert stored_weights.tiles(stored)[1] == min(heads, 8) * 128
  got = tpu_kernels.matmul(x, w, interpret=True)
  dense = w.astype(jnp.float32).astype(dtype).astype(jnp.float32)
  want = jnp.dot(
    x.astype(jnp.float32),
    dense.reshape(k, -1),
    precision=jax.lax.Precision.HIGHEST,
  )
  scale = float(jnp.max(jnp.abs(want)))
  np.testing.assert_allclose(got, want, atol=2e-5 * scale * k**0.5, rtol=0)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_one_head_is_read_as_a_2d_weight(kind):
  """A [K, 1, D] weight (a multiquery k or v) goes to the kernel as
  [K, D], its scales [G, D] (`heads_as_stored`: a 3-D one-head operand
  is padded to a tile's rows), and gives its product."""
  w = jax.random.normal(jax.random.PRNGKey(3), (K, 1, 128)) * 0.05
  if kind == "int8":
    w = quantized.quantize(w, (0,), 128)
  else:
    w = w.astype(jnp.bfloat16)
  x = jax.random.normal(jax.random.PRNGKey(5), (8, K)).astype(jnp.bfloat16)
  assert not stored_weights.heads_as_stored(w)
  stored = tpu_kernels.Stored.of(w)
  assert stored.heads == 0 and stored.codes.shape == (K, 128)
  if kind == "int8":
    assert stored.scale.shape == (K // 128, 128) and stored.group == 128
  got = tpu_kernels.matmul(x, w, interpret=True)
  dense = w.astype(jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
  dense = dense.reshape(K, 128)
  want = jnp.dot(
    x.astype(jnp.float32), dense, precision=jax.lax.Precision.HIGHEST
  )
  scale = float(jnp.max(jnp.abs(want)))
  np.testing.assert_allclose(got, want, atol=2e-5 * scale * K**0.5, rtol=0)


def test_cost_counts_the_bytes_the_kernel_reads():
  """The bound reported beside kernels XLA:TPU gives no estimate:
  int8 reads half of bf16's weight bytes, 4-bit codes a quarter plus
  their f16 scales and offsets."""
  b16, i8, q4 = (
    tpu_kernels.cost(8, tpu_kernels.Stored.of(WEIGHTS[n]), jnp.bfloat16)
    for n in ("bf16", "int8/128", "Q4_1")
  )
  assert b16.flops == i8.flops == 2 * 8 * K * N
  x_and_out = 8 * K * 2 + 8 * N * 4  # one column tile of 384
  assert b16.bytes_accessed == K * N * 2 + x_and_out
  assert i8.bytes_accessed == K * N + (K // 128) * N * 4 + x_and_out
  assert q4.bytes_accessed == K * N // 2 + 2 * (K // 32) * N * 2 + x_and_out


@pytest.mark.parametrize(
  "dtype", [jnp.int8, jnp.uint8, jnp.float16, jnp.bfloat16, jnp.float32]
)
def test_take_rows_reads_the_rows_asked_for(dtype):
  """`tpu_kernels.take_rows` (the quantized tables' rows on a TPU) is
  `jnp.take`, bit for bit: ids in any order, repeated, at tile edges, in
  the table's last partial tile."""
  table = jax.random.randint(jax.random.PRNGKey(4), (70, 256), -128, 128)
  table = table.astype(jnp.int8).astype(dtype)
  ids = jnp.array([[0, 31, 32, 69], [5, 5, 64, 8]], jnp.int32)
  got = tpu_kernels.take_rows(table, ids, interpret=True)
  np.testing.assert_array_equal(got, jnp.take(table, ids, axis=0))
  with pytest.raises(ValueError, match="2-D table"):
    tpu_kernels.take_rows(table[None], ids, interpret=True)


def _attention_inputs(b, t, s, seed=0, heads=4, kv_heads=2, d=128):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(keys[0], (b, heads, t, d)) / d**0.5
  k = jax.random.normal(keys[1], (b, kv_heads, s, d))
  v = jax.random.normal(keys[2], (b, kv_heads, s, d))
  return q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)


def _attend():
  """`invariant_attend` in interpret mode, jitted: called eagerly, the
  interpreted kernel is traced and compiled again at every call (5 s
  each here), jitted once a shape."""
  return jax.jit(
    lambda q, k, v, positions: tpu_kernels.invariant_attend(
      q, k, v, positions, interpret=True
    )
  )


def test_invariant_attention_matches_softmax_attention():
  from chunkwise.tpu_kernels import attention

  q, k, v = _attention_inputs(2, 5, 200)
  positions = jnp.array([[3, 4, 5, 6, 7], [150, 160, 170, 180, 199]])
  run = _attend()
  got = run(q, k, v, positions)
  want = attention.reference(q, k, v, positions)
  np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
  # Keys past a row's position change nothing: not read, or weight 0.
  k2 = k.at[0, :, 8:].set(100.0)
  again = run(q, k2, v, positions)
  np.testing.assert_array_equal(again[0], got[0])


def test_invariant_attention_rows_do_not_depend_on_batch_chunks_or_cache():
  """A query row's bits: the same in a batch of 3 as alone, computed in a
  chunk of 5 as one at a time (decode), and over a longer cache."""
  q, k, v = _attention_inputs(3, 5, 300, seed=1)
  positions = jnp.array([[200 + i for i in range(5)]] * 3) - jnp.array(
    [[0], [50], [100]]
  )
  run = _attend()
  whole = run(q, k, v, positions)
  alone = run(q[1:2], k[1:2], v[1:2], positions[1:2])
  np.testing.assert_array_equal(alone[0], whole[1])
  for i in range(5):  # decode: one query at a time
    step = run(q[:, :, i : i + 1], k, v, positions[:, i : i + 1])
    np.testing.assert_array_equal(step[:, :, 0], whole[:, :, i])
  longer = [jnp.pad(a, ((0, 0), (0, 0), (0, 200), (0, 0))) for a in (k, v)]
  np.testing.assert_array_equal(run(q, *longer, positions), whole)


def test_attention_parts_read_transposed_keys_and_bound_rows():
  """`attention.parts` (a piece of context, unnormalised): keys read as
  a TPU stores a cache's ([D, S] a head) give the same bits as [S, D];
  each row sees keys lo..hi only (a window's first key, a prefix's
  length), with a soft cap, as softmax attention over those keys does;
  a row that sees none has sums 0."""
  from chunkwise.tpu_kernels import attention

  q, k, v = _attention_inputs(2, 6, 200, seed=2)
  rows = q.reshape(2, 2, 12, 128)  # 2 query heads a kv head
  hi = jnp.array([[5, 9, 150, 199, 0, 40] * 2, [30] * 12])
  lo = jnp.maximum(hi - 20, 0).at[1, 3].set(31)  # row 3 of batch 1: none

  def run(keys, transposed):
    return jax.jit(
      lambda q, k, v, lo, hi: attention.parts(
        q,
        k,
        v,
        lo,
        hi,
        softcap=5.0,
        keys_transposed=transposed,
        interpret=True,
      )
    )(rows, keys, v, lo, hi)

  m, s, o = run(k, False)
  for got, want in zip(
    run(jnp.swapaxes(k, 2, 3), True), (m, s, o), strict=True
  ):
    np.testing.assert_array_equal(got, want)
  logits = jnp.einsum(
    "bhrd,bhsd->bhrs", rows.astype(jnp.float32), k.astype(jnp.float32)
  )
  logits = 5.0 * jnp.tanh(logits / 5.0)
  key = jnp.arange(200)
  seen = (key >= lo[:, None, :, None]) & (key <= hi[:, None, :, None])
  weights = jnp.where(seen, jnp.exp(logits - m[..., None]), 0.0)
  np.testing.assert_allclose(s, weights.sum(-1), rtol=2e-2, atol=1e-3)
  want_o = jnp.einsum("bhrs,bhsd->bhrd", weights, v.astype(jnp.float32))
  np.testing.assert_allclose(o, want_o, rtol=2e-2, atol=2e-2)
  assert float(s[1, 0, 3]) == 0.0 and not np.asarray(o[1, 0, 3]).any()


def test_attention_parts_carried_over_whole_tiles_are_one_call():
  """`parts` over keys 0..383 in one call equals, bit for bit, `parts`
  over the first tile's keys, then over the rest (their key 0 at
  position 128) going on from those sums (`carry`): a context cut at a
  tile's edge takes the same steps. Rows that see no key of the first
  part (a window past it) come through as if they had started there."""
  from chunkwise.tpu_kernels import attention

  q, k, v = _attention_inputs(2, 6, 384, seed=3)
  rows = q.reshape(2, 2, 12, 128)
  hi = jnp.array([[5, 127, 128, 300, 383, 200] * 2, [383] * 12])
  lo = jnp.where(hi > 250, hi - 40, 0)

  @jax.jit
  def run(k, v, lo, hi, carry=None):
    return attention.parts(rows, k, v, lo, hi, carry=carry, interpret=True)

  whole = run(k, v, lo, hi)
  first = run(k[:, :, :128], v[:, :, :128], lo, jnp.minimum(hi, 127))
  rest = run(k[:, :, 128:], v[:, :, 128:], lo - 128, hi - 128, first)
  for got, want in zip(rest, whole, strict=True):
    np.testing.assert_array_equal(got, want)
  # Merged as the fast path merges pieces, the bits differ.
  alone = run(k[:, :, 128:], v[:, :, 128:], lo - 128, hi - 128)
  m = jnp.maximum(first[0], alone[0])
  w1, w2 = jnp.exp(first[0] - m), jnp.exp(alone[0] - m)
  merged = (w1[..., None] * first[2] + w2[..., None] * alone[2]) / (
    w1 * first[1] + w2 * alone[1]
  )[..., None]
  assert not np.array_equal(merged, whole[2] / whole[1][..., None])
  with pytest.raises(ValueError, match="carry"):
    run(k, v, lo, hi, (first[0], first[1], first[2][..., :64]))


@pytest.mark.parametrize("n", [300, 5000])
def test_row_sums_do_not_depend_on_the_rows(n):
  """`row_sums.row_sum` (one tile of columns, and several with a partial
  last one): jnp.sum's values, and a row's bits the same alone as in 11
  rows; with a shift, the sum of exp(x - shift)."""
  from chunkwise.tpu_kernels import row_sums

  x = jax.random.normal(jax.random.PRNGKey(n), (11, n)) * 3
  shift = x.max(axis=1)
  run = jax.jit(lambda x, s: row_sums.row_sum(x, s, interpret=True))
  plain = jax.jit(lambda x: row_sums.row_sum(x, interpret=True))
  np.testing.assert_allclose(plain(x), x.sum(axis=1), rtol=1e-5, atol=1e-3)
  np.testing.assert_allclose(
    run(x, shift), jnp.exp(x - shift[:, None]).sum(axis=1), rtol=1e-5
  )
  for i in (0, 7, 10):
    np.testing.assert_array_equal(plain(x[i : i + 1])[0], plain(x)[i])
    np.testing.assert_array_equal(
      run(x[i : i + 1], shift[i : i + 1])[0], run(x, shift)[i]
    )
  with pytest.raises(ValueError, match="shift"):
    row_sums.row_sum(x, shift[:3])


def _decode_inputs(seed=0, cache_rows=2):
  """A decode step of 2 rows, 2 kv heads of 4 query heads each: a stacked
  3-layer cache of 256 keys (of 2 rows, lengths 200 and 0, or one row
  shared by both, 200), a loop's buffer of 8 (3 and 8) and the step's own
  key."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  b, kv, d = 2, 2, 128

  def normal(key, shape):
    return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)

  return dict(
    q=normal(ks[0], (b, 1, kv * 4, d)),
    cache=tuple(normal(ks[i], (3, cache_rows, 256, kv, d)) for i in (1, 2)),
    cache_lengths=jnp.array([200, 0][:cache_rows], jnp.int32),
    buffer=(normal(ks[3], (b, kv, 8, d)), normal(ks[4], (b, kv, 8, d))),
    buffer_lengths=jnp.array([3, 8], jnp.int32),
    own=(normal(ks[5], (b, 1, kv, d)), normal(ks[6], (b, 1, kv, d))),
  )


@pytest.mark.parametrize("softcap, cache_rows", [(None, 2), (5.0, 1)])
def test_decode_attention_is_the_merged_pieces(softcap, cache_rows):
  """`models.tpu_decode` (one kernel call: the stacked cache read at its
  layer with keys as a TPU stores them, or one row of it shared by both
  rows, the heads-major buffer, the step's own key) against attention's
  plain path, which attends to each piece and merges their sums; rounded
  to q's dtype as the layer rounds attention's output."""
  from chunkwise import numerics
  from chunkwise.models import attention, tpu_decode
  from chunkwise.models.prefix_layer import PrefixLayer

  x = _decode_inputs(cache_rows=cache_rows)
  ck, cv = x["cache"]
  prefix = [
    PrefixLayer(ck[1], cv[1], x["cache_lengths"], stacked=(ck, cv, 1)),
    PrefixLayer(*x["buffer"], x["buffer_lengths"], heads_major=True),
  ]
  options = attention.Options(softcap=softcap)
  k, v = x["own"]
  want = attention.attend(x["q"], k, v, prefix, options)
  with numerics.tpu_interpret():
    got = jax.jit(
      lambda q, k, v: tpu_decode.attend(
        q, k, v, prefix, options, scale=128**-0.5
      )
    )(x["q"], k, v)
  assert got.shape == want.shape == (2, 1, 8, 128) and got.dtype == jnp.float32
  np.testing.assert_allclose(
    got, want.astype(jnp.bfloat16).astype(jnp.float32), rtol=2e-2, atol=2e-2
  )
  # A window, or more than one position a row: the plain path's (None).
  windowed = attention.Options(window=16)
  assert tpu_decode.attend(x["q"], k, v, prefix, windowed, scale=1.0) is None
  two = jnp.concatenate([k, k], axis=1)
  q2 = jnp.concatenate([x["q"]] * 2, axis=1)
  assert tpu_decode.attend(q2, two, two, prefix, options, scale=1.0) is None


def test_decode_attention_skips_blocks_past_a_rows_keys():
  """A key block past a row's length is neither computed nor (on a TPU)
  read: NaNs there leave its output as it was; keys past the length
  within its last block are masked to exact zeros."""
  from chunkwise.tpu_kernels.decode_attention import Piece, decode

  x = _decode_inputs(seed=1)
  ck, cv = (jnp.swapaxes(a[1], 1, 2) for a in x["cache"])  # [b, kv, S, D]
  q = x["q"].reshape(2, 2, 4, 128)
  own = [jnp.swapaxes(a, 1, 2) for a in x["own"]]
  lengths = jnp.array([100, 128], jnp.int32)

  def run(ck, cv):
    pieces = [
      Piece(ck, cv, lengths),
      Piece(*own, jnp.ones((2,), jnp.int32)),
    ]
    return decode(q, pieces, scale=0.1, out_dtype=jnp.float32, interpret=True)

  first = run(ck, cv)
  assert np.isfinite(np.asarray(first)).all()
  nan = jnp.full_like(ck[:, :, 128:], jnp.nan)
  again = run(ck.at[:, :, 128:].set(nan), cv.at[:, :, 128:].set(nan))
  np.testing.assert_array_equal(again, first)
  other = run(ck.at[0, :, 100:128].set(7.0), cv)  # row 0's masked keys
  np.testing.assert_array_equal(other[0], first[0])


def test_decode_attention_names_bad_pieces():
  from chunkwise.tpu_kernels.decode_attention import Piece, decode

  q = jnp.zeros((1, 2, 4, 128), jnp.bfloat16)
  good = jnp.zeros((1, 2, 256, 128), jnp.bfloat16)
  one = jnp.ones((1,), jnp.int32)
  with pytest.raises(ValueError, match=r"piece 1: k \(1, 2, 128, 256\)"):
    decode(
      q,
      [Piece(good, good, one), Piece(jnp.swapaxes(good, 2, 3), good, one)],
      scale=1.0,
    )
  with pytest.raises(ValueError, match="piece 0: layer 3 of a cache of 2"):
    stacked = jnp.zeros((2, 1, 2, 256, 128), jnp.bfloat16)
    decode(q, [Piece(stacked, stacked, one, layer=3)], scale=1.0)
  with pytest.raises(ValueError, match="at most 1024"):
    odd = jnp.zeros((1, 2, 1100, 128), jnp.bfloat16)
    decode(q, [Piece(odd, odd, one)], scale=1.0)
  with pytest.raises(ValueError, match="at least one piece"):
    decode(q, [], scale=1.0)


def test_decode_attention_reads_a_window_of_kv_heads_where_it_lies():
  """Query heads of one kv head (a device's block narrower than the
  cache's heads) read that head of the stacked cache and of the buffer
  in place (`PrefixLayer.heads`' window kept: a slice is a copy for a
  Pallas call), as the plain path reads the sliced pieces."""
  from chunkwise import numerics
  from chunkwise.models import attention, tpu_decode
  from chunkwise.models.prefix_layer import PrefixLayer

  x = _decode_inputs(seed=3)
  ck, cv = x["cache"]
  prefix = [
    PrefixLayer(
      ck[1], cv[1], x["cache_lengths"], first=1, count=1, stacked=(ck, cv, 1)
    ),
    PrefixLayer(
      *x["buffer"], x["buffer_lengths"], heads_major=True, first=1, count=1
    ),
  ]
  q = x["q"][:, :, 4:]  # the 4 query heads of kv head 1
  k, v = (a[:, :, 1:] for a in x["own"])
  want = attention.attend(q, k, v, prefix, attention.PLAIN)
  with numerics.tpu_interpret():
    got = tpu_decode.attend(q, k, v, prefix, attention.PLAIN, scale=128**-0.5)
  np.testing.assert_allclose(
    got, want.astype(jnp.bfloat16).astype(jnp.float32), rtol=2e-2, atol=2e-2
  )


def test_decode_attention_reads_a_slot_loops_rows_where_they_are():
  """A slot loop's buffer holds every slot; its running rows are a piece
  of `rows` (`PrefixLayer.rows`), which the kernel reads where they lie
  (the plain path gathers them first). One kv head a device: with more,
  a TPU stores the buffer time-major and the plain path reads it
  (`tpu_decode._time_major`)."""
  from chunkwise import numerics
  from chunkwise.models import attention, tpu_decode
  from chunkwise.models.prefix_layer import PrefixLayer

  x = _decode_inputs(seed=4)
  bk, bv = (a[:, 1:] for a in x["buffer"])  # one kv head
  slots = [jnp.concatenate([a, a[::-1] * 0.5, a * -1.0]) for a in (bk, bv)]
  lengths = jnp.array([5, 2], jnp.int32)
  rows = jnp.array([4, 1])
  prefix = [PrefixLayer(*slots, lengths, heads_major=True, rows=rows)]
  q = x["q"][:, :, 4:]  # its 4 query heads
  k, v = (a[:, :, 1:] for a in x["own"])
  want = attention.attend(q, k, v, prefix, attention.PLAIN)
  with numerics.tpu_interpret():
    got = tpu_decode.attend(q, k, v, prefix, attention.PLAIN, scale=128**-0.5)
  assert got is not None
  two_heads = PrefixLayer(*x["buffer"], lengths, heads_major=True, rows=rows)
  assert tpu_decode._time_major(two_heads)
  np.testing.assert_allclose(
    got, want.astype(jnp.bfloat16).astype(jnp.float32), rtol=2e-2, atol=2e-2
  )
