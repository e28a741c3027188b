"""GGUF's quantized blocks kept as they are (`quantize="native"`,
`models.blocks`, `checkpoints.gguf_blocks`): decoding against the gguf
package, loading, every layout against the dequantized twin, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as QType

import chunkwise as cw
from chunkwise import numerics
from chunkwise.checkpoints import gguf_blocks
from chunkwise.models import blocks, quantized
from chunkwise.models.blocks import BlockArray
from chunkwise.partitioning import make_mesh
from chunkwise.planner import sizes
from tests import hf_models
from tests.test_adapters import random_adapter

_K = ("Q4_K", "Q5_K", "Q6_K")


def _raw(kind: str, shape, seed=0):
  """Blocks of `kind` for a [rows, cols] tensor: the gguf package's
  quantizer where it has one, random blocks (the K-quants) otherwise."""
  w = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
  try:
    return quants.quantize(w, QType[kind])
  except NotImplementedError:
    return hf_models.random_blocks(shape, QType[kind], 1.0, seed)


@pytest.mark.parametrize("kind", list(blocks.FORMATS))
def test_blocks_decode_to_what_gguf_dequantizes(kind):
  raw = _raw(kind, (6, 512))
  want = quants.dequantize(raw, QType[kind])
  host = gguf_blocks.decode(raw, kind, (6, 512))
  bits, block = blocks.FORMATS[kind]
  assert host.values.shape == (6, 512 * bits // 8)
  assert host.scale.shape == (6, 512 // block)
  got = host.dequantize()
  if kind in _K:  # sub-block scale and min rounded to f16: 2^-11 each
    codes = blocks.unpack(host.values, 1, bits).astype(np.float32)
    reps = np.repeat(np.abs(host.scale.astype(np.float32)), block, axis=1)
    bound = 2.0**-11 * (np.abs(codes) * reps + np.abs(want - codes * reps))
    assert np.all(np.abs(got - want) <= bound * 1.01 + 1e-12)
    assert not np.array_equal(got, want) or kind == "Q6_K"
  else:  # exactly llama.cpp's values
    np.testing.assert_array_equal(got, want)
  device = host.to_device()
  np.testing.assert_array_equal(np.asarray(device.astype(jnp.float32)), got)
  ids = jnp.array([[4, 0], [2, 5]])
  np.testing.assert_array_equal(
    np.asarray(blocks.take_rows(device, ids)), got[np.asarray(ids)]
  )


def test_host_blocks_move_like_the_tensor():
  """`.T`, the reshapes `hf_tensors` makes, row slices and row maps keep
  each entry with its own scale."""
  host = gguf_blocks.decode(_raw("Q4_1", (6, 128)), "Q4_1", (6, 128))
  full = host.dequantize()
  moved = host.T.reshape(2, 64, 6)  # o: [heads * head_dim, d] -> heads
  assert moved.axis == 1
  np.testing.assert_array_equal(moved.dequantize(), full.T.reshape(2, 64, 6))
  np.testing.assert_array_equal(host[2:5].dequantize(), full[2:5])
  flip = host.map_rows(lambda a: a[::-1])
  np.testing.assert_array_equal(flip.dequantize(), full[::-1])
  with pytest.raises(ValueError, match="whole blocks"):
    host.T.reshape(8, 16, 6)  # blocks of 32 would straddle the new axis
  with pytest.raises(ValueError, match="blocks"):
    host.T[1:3]


# Every block format in one model, two layers, inputs a multiple of 512
# (so 8 shards, each halved by the throughput matmuls, hold whole blocks).
_TYPES = {
  "attn_q": QType.Q4_K,
  "attn_k": QType.Q6_K,
  "attn_v": QType.Q5_K,
  "attn_output": QType.Q4_0,
  "ffn_gate": QType.Q4_1,
  "ffn_up": QType.Q5_0,
  "ffn_down": QType.Q5_1,
  "token_embd": QType.Q8_0,
  "output": QType.Q6_K,
}


def _qtype(name: str):
  return _TYPES.get(name.split(".")[-2], QType.F32)


def _tiny(tied: bool):
  return hf_models.tiny(
    "llama",
    heads=8,
    kv_heads=4,
    vocab=256,
    tied=tied,
    hidden_size=512,
    intermediate_size=1024,
    head_dim=64,
  )


@pytest.fixture(scope="module")
def blocked_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("blocks") / "every-format.gguf"
  hf_models.write_gguf(_tiny(False), path, qtypes=_qtype)
  return path


def _dequantized(model):
  """The model with every BlockArray dequantized to f32 (the plain twin
  of the same values)."""
  weights = jax.tree.map(
    lambda w: w.astype(jnp.float32) if isinstance(w, BlockArray) else w,
    model.plain_weights(),
    is_leaf=lambda w: isinstance(w, BlockArray),
  )
  return cw.InferenceModel(model.hparams, weights, model.vocab)


def _chunk():
  return cw.Chunk(
    tokens=jnp.array([[1, 5, 7, 9, 11, 3, 200], [1, 17, 4, 250, 0, 0, 0]]),
    lengths=jnp.array([7, 4]),
  )


def _run(model):
  first = model.prefill(_chunk(), top_n=3)
  tokens, result = model.generate(
    [first], sample_ids=np.arange(2), steps=4, sampling=cw.Sampling()
  )
  return first, tokens, result


@pytest.fixture(scope="module")
def blocked(blocked_file):
  native = cw.load(blocked_file, quantize="native")
  return native, _run(native)


# On the CPU the kernel reads the blocks in place and rounds x to int16
# per block (`cpu_kernels`): scores agree with the dequantized twin's to
# ~1e-4, not to f32 noise.
_ATOL = 5e-4


def test_native_load_keeps_every_format(blocked_file, blocked):
  native, _ = blocked
  layer = native.weights.layers[1]
  kinds = {
    name: getattr(layer, name).kind
    for name in ("q", "k", "v", "o", "gate", "up", "down")
  }
  assert kinds == {
    "q": "Q4_K",
    "k": "Q6_K",
    "v": "Q5_K",
    "o": "Q4_0",
    "gate": "Q4_1",
    "up": "Q5_0",
    "down": "Q5_1",
  }
  assert native.weights.embedding.kind == "Q8_0"
  assert native.weights.unembedding.kind == "Q6_K"
  assert layer.o.axis == 1 and layer.o.shape == (8, 64, 512)
  f32 = cw.load(blocked_file)
  ratio = quantized.nbytes(native.weights) / quantized.nbytes(f32.weights)
  assert ratio < 0.25  # 4.5 to 9 bits a weight, norms in f32
  # The same values as the dequantizing reader (K-quant scales: f16).
  got = native.prefill(_chunk()).per_token_scores
  want = f32.prefill(_chunk()).per_token_scores
  np.testing.assert_allclose(got, want, atol=2e-2)


def test_native_runs_like_its_dequantized_twin(blocked):
  native, (got_first, got_tokens, got_result) = blocked
  first, tokens, result = _run(_dequantized(native))
  np.testing.assert_allclose(
    got_first.per_token_scores, first.per_token_scores, atol=_ATOL
  )
  np.testing.assert_array_equal(got_tokens.tokens, tokens.tokens)
  np.testing.assert_allclose(
    got_result.per_token_scores, result.per_token_scores, atol=_ATOL
  )


def _layouts():
  for layout in [
    "ws_1d/none/xla",
    "ws_2d/yz/one_way",
    "ws_2d/none/throughput",
    "wg/none/throughput",
  ]:
    yield pytest.param(layout, id=layout.replace("/", "-"))
  for layout in ["ws_1d/none/latency", "ws_2d/yzx/latency", "wg/none/xla"]:
    yield pytest.param(
      layout, id=layout.replace("/", "-"), marks=pytest.mark.long
    )


@pytest.mark.parametrize("layout", list(_layouts()))
def test_native_every_layout(blocked_file, blocked, layout):
  _, (first, tokens, result) = blocked
  model = cw.load(
    blocked_file, quantize="native", mesh=make_mesh((2, 2, 2)), layout=layout
  )
  got_first, got_tokens, got_result = _run(model)
  np.testing.assert_allclose(
    got_first.per_token_scores, first.per_token_scores, atol=_ATOL
  )
  np.testing.assert_array_equal(got_first.top_ids, first.top_ids)
  np.testing.assert_array_equal(got_tokens.tokens, tokens.tokens)
  np.testing.assert_allclose(
    got_result.per_token_scores, result.per_token_scores, atol=_ATOL
  )


def test_native_tied_table_unembeds(tmp_path):
  path = tmp_path / "tied.gguf"
  hf_models.write_gguf(_tiny(True), path, qtypes=_qtype)
  native = cw.load(path, quantize="native")
  assert native.weights.unembedding is None
  with numerics.scope("fast"):
    want = _dequantized(native).prefill(_chunk()).per_token_scores
    got = native.prefill(_chunk()).per_token_scores
  np.testing.assert_allclose(got, want, atol=_ATOL)


def test_unsupported_block_types_are_named(tmp_path):
  path = tmp_path / "q2.gguf"
  model = hf_models.tiny("llama", head_dim=64, hidden_size=256)

  def qtypes(name):
    return QType.Q2_K if "ffn_up" in name else QType.Q8_0

  hf_models.write_gguf(model, path, qtypes=qtypes)
  with pytest.raises(ValueError, match=r"ffn_up.weight has type Q2_K.*Q4_K"):
    cw.load(path, quantize="native")
  with pytest.raises(ValueError, match=r"not supported natively.*Q8_0"):
    block, size = GGML_QUANT_SIZES[QType.Q2_K]
    gguf_blocks.decode(np.zeros((1, size), np.uint8), "Q2_K", (1, block))


def test_bad_block_arrays_are_refused():
  host = gguf_blocks.decode(_raw("Q4_0", (4, 64)), "Q4_0", (4, 64))
  good = host.to_device()
  blocks.check(good, "w")
  with pytest.raises(ValueError, match="scale of shape"):
    blocks.check(good.replace(scale=good.scale[:, :1]), "w")
  with pytest.raises(ValueError, match="block type 'Q3_K'"):
    blocks.check(good.replace(kind="Q3_K"), "w")
  with pytest.raises(ValueError, match="expected 4-bit uint8"):
    blocks.check(good.replace(values=good.values.astype(jnp.int8)), "w")


def test_native_is_refused_where_it_cannot_be(blocked):
  with pytest.raises(ValueError, match=r"quantize='nf4'.*'int8' or 'native'"):
    cw.load("x", quantize="nf4")


def test_saved_blocks_restore_as_blocks_on_any_layout(blocked, tmp_path):
  native, (first, tokens, _) = blocked
  path = cw.save(native, tmp_path / "native")
  restored = cw.load(
    path, mesh=make_mesh((2, 2, 2)), layout="ws_2d/none/throughput"
  )
  want = jax.tree.leaves(native.plain_weights())
  got = jax.tree.leaves(restored.plain_weights())
  assert [x.dtype for x in got] == [x.dtype for x in want]
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  assert restored.plain_weights().layers[1].q.kind == "Q4_K"
  got_first, got_tokens, _ = _run(restored)
  np.testing.assert_allclose(
    got_first.per_token_scores, first.per_token_scores, atol=_ATOL
  )
  np.testing.assert_array_equal(got_tokens.tokens, tokens.tokens)
  with pytest.raises(ValueError, match=r"holds GGUF blocks.*'native' or None"):
    cw.load(path, quantize="int8")
  f32 = cw.save(_dequantized(native), tmp_path / "f32")
  with pytest.raises(ValueError, match=r"keeps GGUF blocks.*float weights"):
    cw.load(f32, quantize="native")


def test_lora_on_native_blocks_matches_its_dequantized_twin(blocked):
  native, _ = blocked
  h = native.hparams
  adapter = random_adapter(h, 4, 1, scale=0.05)
  rows = ["a", None]
  got = native.with_adapters({"a": adapter}).prefill(
    _chunk(), adapters=rows, top_n=3
  )
  want = (
    _dequantized(native)
    .with_adapters({"a": adapter})
    .prefill(_chunk(), adapters=rows, top_n=3)
  )
  np.testing.assert_allclose(
    got.per_token_scores, want.per_token_scores, atol=_ATOL
  )
  plain = native.prefill(_chunk()).per_token_scores
  assert not np.allclose(got.per_token_scores[0], plain[0], atol=1e-2)
  np.testing.assert_array_equal(got.per_token_scores[1], plain[1])


def test_tpu_block_matmul_equals_the_dequantized_one(blocked):
  """A TPU's block matmul (`matmul.by_block`: a dot per block, 4-bit
  nibbles against x's even and odd entries, then scales and offsets)
  against `plain` (the blocks dequantized first), every format in the
  equation its weight runs in, at one row and at several."""
  from chunkwise.models import matmul

  native, _ = blocked
  w = native.plain_weights()
  layer = w.layers[1]
  table = gguf_blocks.decode(_raw("Q4_0", (256, 512)), "Q4_0", (256, 512))
  key = iter(jax.random.split(jax.random.key(1), 16))
  x = lambda *s: jax.random.normal(next(key), s, jnp.float32)
  cases = [
    ("bte,ehd->bthd", x(2, 3, 512), layer.q),
    ("bte,ehd->bthd", x(1, 1, 512), layer.k),
    ("bte,ehd->bthd", x(2, 3, 512), layer.v),
    ("bthd,hde->bte", x(1, 1, 8, 64), layer.o),
    ("bte,ef->btf", x(2, 3, 512), layer.gate),
    ("bte,ef->btf", x(1, 1, 512), layer.up),
    ("btf,fe->bte", x(2, 3, 1024), layer.down),
    ("bte,ev->btv", x(1, 1, 512), w.unembedding),
    ("bte,ve->btv", x(2, 3, 512), w.embedding),
    ("bte,ve->btv", x(1, 1, 512), table.to_device()),
  ]
  kinds = set()
  for eq, a, b in cases:
    kinds.add(b.kind)
    want = matmul.plain(eq, a, b)
    got = jax.jit(matmul.by_block, static_argnums=0)(eq, a, b)
    np.testing.assert_allclose(
      got, want, rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max())
    )
  assert kinds == set(blocks.FORMATS)


@pytest.mark.parametrize("kind", list(blocks.FORMATS))
def test_planner_counts_what_blocks_hold(kind):
  host = gguf_blocks.decode(_raw(kind, (4, 256)), kind, (4, 256))
  per_value = sizes.weight_bytes_per_value(kind)
  assert per_value * 4 * 256 == blocks.nbytes(host.to_device())
  assert per_value < sizes.weight_bytes_per_value("bf16")


def test_planning_a_native_load_counts_the_file_blocks(blocked_file):
  from chunkwise.checkpoints import gguf

  # gate, up and down hold 512 x 1024 entries a layer each, the most
  assert gguf.block_type(blocked_file) in ("Q4_1", "Q5_0", "Q5_1")
  hf_models.write_gguf(
    hf_models.tiny("llama"), blocked_file.parent / "none.gguf"
  )
  assert gguf.block_type(blocked_file.parent / "none.gguf") is None


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_cpu_matmul_reads_the_blocks_in_place(kind):
  """On the CPU `weight_matmul` hands the codes, f16 scales and offsets
  to the kernel (no dequantized weight in the program), within the int16
  rounding of x of the plain twin."""
  from chunkwise.models import matmul

  w = gguf_blocks.decode(_raw(kind, (48, 256)), kind, (48, 256)).T
  w = w.to_device()  # k-major [256, 48]
  x = jnp.asarray(
    np.random.default_rng(1).normal(size=(2, 3, 256)), jnp.float32
  )
  fn = jax.jit(lambda x, w: matmul.weight_matmul("btk,kn->btn", x, w))
  text = fn.lower(x, w).as_text()
  assert "chunkwise_invariant_matmul" in text
  got = np.asarray(fn(x, w))
  want = np.asarray(matmul.plain("btk,kn->btn", x, w))
  np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max())
  assert not np.array_equal(got, want)  # the kernel, not the twin, ran


def test_native_q8_rows_are_invariant_and_near_int16(blocked_file, blocked):
  """numerics="q8" over every block format (x rounded to int8 per block):
  a row's scores the same bits alone as beside another, and near the
  int16 activations' (the invariant default's) scores."""
  _, (first, _, _) = blocked
  q8 = cw.load(blocked_file, quantize="native", numerics="q8")
  assert q8.numerics == "q8"
  both = q8.prefill(_chunk(), top_n=3)
  alone = q8.prefill(
    cw.Chunk(tokens=_chunk().tokens[1:], lengths=_chunk().lengths[1:]), top_n=3
  )
  np.testing.assert_array_equal(
    both.per_token_scores[1:], alone.per_token_scores
  )
  np.testing.assert_array_equal(both.top_ids[1:], alone.top_ids)
  got, want = both.per_token_scores[:, 1:], first.per_token_scores[:, 1:]
  assert not np.array_equal(got, want)
  np.testing.assert_allclose(got, want, atol=0.05)
