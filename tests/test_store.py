"""Orbax checkpoints of models and results (`cw.save`, `cw.load`,
`cw.load_result`): round trips across meshes and layouts, int8 and bf16
weights, corrupt or mismatched checkpoints, all-or-nothing saves."""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.checkpoints import arrays, manifest, saved_vocab
from chunkwise.models import QArray
from chunkwise.partitioning import make_mesh
from tests import hf_models

ROOT = pathlib.Path(__file__).parents[1]


@pytest.fixture(scope="module")
def tiny():
  return cw.InferenceModel.random(cw.configs.get("tiny"), seed=3)


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
  return cw.save(tiny, tmp_path_factory.mktemp("ckpt") / "tiny")


def _chunk(vocab):
  return cw.Chunk.tokenize(
    vocab, ["Cows have 4 legs.", "A horse", "Hi"], is_first_chunk=True
  )


def _leaves(weights):
  return [np.asarray(x) for x in jax.tree.leaves(weights)]


def _assert_same_weights(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(_leaves(a), _leaves(b), strict=True):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


def _assert_same_result(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _run(model, vocab):
  """Prefill scores and top-n, then sampled tokens after the prompt."""
  first = model.prefill(_chunk(vocab), top_n=4)
  tokens, result = model.generate(
    [first],
    sample_ids=np.arange(3),
    steps=6,
    sampling=cw.Sampling(temperature=0.9, seed=5),
  )
  return first, tokens, result


def test_round_trip_reference_to_ws_2d(tiny, saved):
  mesh = make_mesh((2, 2, 2))
  loaded = cw.load(saved, mesh=mesh, layout="ws_2d")
  assert loaded.hparams == tiny.hparams
  assert (loaded.bos_id, loaded.eos_id) == (tiny.bos_id, tiny.eos_id)
  assert loaded.vocab == tiny.vocab
  # Restored straight into the ws_2d shardings.
  q = loaded.weights.layers[0].q
  assert q.sharding.spec == jax.sharding.PartitionSpec("x", ("y", "z"), None)
  _assert_same_weights(loaded.plain_weights(), tiny.weights)
  # Identical to the original weights placed on the same layout...
  direct = cw.InferenceModel(
    tiny.hparams, tiny.weights, tiny.vocab, mesh=mesh, layout="ws_2d"
  )
  a, b = _run(loaded, tiny.vocab), _run(direct, tiny.vocab)
  _assert_same_result(a, b)
  # ... and the reference's scores and tokens.
  ref = _run(tiny, tiny.vocab)
  np.testing.assert_allclose(
    a[0].per_token_scores, ref[0].per_token_scores, atol=2e-5
  )
  np.testing.assert_array_equal(a[1].tokens, ref[1].tokens)


def test_save_from_a_shuffled_layout_stores_plain_weights(tiny, tmp_path):
  mesh = make_mesh((2, 2, 2))
  model = cw.InferenceModel(
    tiny.hparams,
    tiny.weights,
    tiny.vocab,
    mesh=mesh,
    layout="ws_2d/none/latency",
  )
  assert isinstance(model.weights, cw.models.ShuffledWeights)
  path = cw.save(model, tmp_path / "m")
  _assert_same_weights(cw.load(path).weights, tiny.weights)
  onto = cw.load(path, mesh=mesh, layout="ws_1d/none/throughput")
  _assert_same_result(_run(onto, tiny.vocab)[1], _run(tiny, tiny.vocab)[1])


# HParams fields that checkpoints of versions 1-3 could hold (those before
# the architecture fields of issue 22).
_NAMES = [f.name for f in dataclasses.fields(cw.HParams)]
_FIELDS_BEFORE_ARCHITECTURES = tuple(_NAMES[: _NAMES.index("rope_scaling")])


@pytest.mark.parametrize("version", [1, 2])
def test_older_checkpoints_still_load(tiny, tmp_path, version):
  """Checkpoints saved before layers had arrays of their own (version 1)
  stored each layer weight stacked ("layers.q" [layers, ...]); before int8
  scales were per group (versions 1 and 2) they had one scale per output
  channel. Both load, on one device and straight onto a mesh."""
  weights = tiny.plain_weights()
  for quantize in (False, True):
    specs = cw.models.Weights.axes(tiny.hparams)
    w = (
      cw.models.quantize_weights(weights, specs, grouped=False)
      if quantize
      else weights
    )
    stored = (
      w.replace(layers=cw.models.weights.stack_layers(w.layers))
      if version == 1
      else w
    )
    vocab, files = saved_vocab.to_json(tiny.vocab)
    meta = {
      "version": version,
      "kind": "model",
      # Checkpoints of these versions have no architecture fields.
      "hparams": {
        k: v
        for k, v in tiny.hparams.to_json().items()
        if k in _FIELDS_BEFORE_ARCHITECTURES
      },
      "quantization": "int8" if quantize else None,
      "bos_id": tiny.bos_id,
      "eos_id": tiny.eos_id,
      "vocabulary": vocab,
    }
    path = manifest.write(
      tmp_path / f"v{version}_{quantize}", stored, meta, files, 0
    )
    desc = json.loads((pathlib.Path(path) / manifest.META).read_text())
    assert desc["version"] == version
    name = "layers.q" if version == 1 else "layers.0.q"
    assert (name + ".values" if quantize else name) in desc["arrays"]
    _assert_same_weights(cw.load(path).weights, w)
  mesh = make_mesh((2, 2, 2))
  on_mesh = cw.load(path, mesh=mesh, layout="ws_2d")
  _assert_same_weights(on_mesh.plain_weights(), w)


# long: 30 s of CI time; an int8 checkpoint's save and load are
# test_convert_script_writes_an_int8_checkpoint's, int8 weights on every
# layout tests/test_quantized.py's
@pytest.mark.long
def test_int8_round_trip_across_layouts(saved, tmp_path):
  mesh = make_mesh((2, 2, 2))
  m8 = cw.load(saved, quantize="int8", mesh=mesh, layout="ws_1d")
  q = m8.weights.layers[0].q
  assert isinstance(q, QArray) and q.values.dtype == jnp.int8
  # Scales are split like their output channels (embed is whole in ws_1d).
  assert q.scale.sharding.spec == q.values.sharding.spec
  path = cw.save(m8, tmp_path / "m8")
  meta = json.loads((pathlib.Path(path) / manifest.META).read_text())
  assert meta["quantization"] == "int8"
  assert meta["arrays"]["layers.0.q.values"]["dtype"] == "int8"
  assert meta["arrays"]["embedding.values"]["dtype"] == "int8"
  again = cw.load(path, mesh=mesh, layout="wg/none/throughput")
  _assert_same_weights(again.plain_weights(), m8.plain_weights())
  reference = cw.load(path)
  a, b = _run(again, reference.vocab), _run(reference, reference.vocab)
  np.testing.assert_allclose(
    a[0].per_token_scores, b[0].per_token_scores, atol=2e-5
  )
  np.testing.assert_array_equal(a[1].tokens, b[1].tokens)
  # quantize= on an int8 checkpoint changes nothing.
  _assert_same_weights(
    cw.load(path, quantize="int8").weights, reference.weights
  )


def test_bfloat16_weights_and_cache(saved, tiny):
  model = cw.load(saved, dtype="bfloat16", cache_dtype=jnp.bfloat16)
  assert model.weights.layers[0].q.dtype == jnp.bfloat16
  assert model.weights.final_norm.dtype == jnp.bfloat16
  result = model.prefill(_chunk(tiny.vocab))
  assert result.kv_cache.k.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    result.per_token_scores,
    tiny.prefill(_chunk(tiny.vocab)).per_token_scores,
    atol=0.1,
  )


def test_tokenizer_vocabulary_round_trip(tmp_path):
  gguf = tmp_path / "m.gguf"
  tokens = [f"tok{i}" for i in range(128)]
  hf_models.write_gguf(hf_models.tiny("llama"), gguf, vocab_tokens=tokens)
  model = cw.load(gguf)
  loaded = cw.load(cw.save(model, tmp_path / "ckpt"))
  assert isinstance(loaded.vocab, cw.TokenizerVocabulary)
  assert repr(loaded.vocab) == repr(model.vocab)
  text = "tok5tok77tok3"
  assert loaded.vocab.encode(text) == model.vocab.encode(text)
  assert loaded.vocab.decode([5, 6]) == model.vocab.decode([5, 6])
  assert loaded.vocab.chat_template == model.vocab.chat_template


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
def test_saved_prefix_continues_on_another_mesh(tiny, tmp_path, cache_dtype):
  source = cw.InferenceModel(
    tiny.hparams, tiny.weights, tiny.vocab, cache_dtype=cache_dtype
  )
  few_shot = source.prefill(_chunk(tiny.vocab))
  path = cw.save(few_shot, tmp_path / "prefix")
  mesh = make_mesh((2, 2, 2))
  target = cw.InferenceModel(
    tiny.hparams,
    tiny.weights,
    tiny.vocab,
    mesh=mesh,
    layout="ws_2d/yz",
    cache_dtype=cache_dtype,
  )
  restored = cw.load_result(path, target)
  assert restored.kv_cache.k.dtype == cache_dtype
  _assert_same_result(restored, few_shot)
  tasks = cw.Chunk.tokenize(tiny.vocab, [" and", " or", " then"])

  def continue_from(model, prefix):
    scored = model.prefill(tasks, prefix=[prefix], top_n=3)
    tokens, _ = model.generate(
      [prefix, scored],
      sample_ids=np.arange(3),
      steps=5,
      sampling=cw.Sampling(temperature=0.8, seed=2),
    )
    return scored, tokens

  # Identical to the prefix handed over in memory, on the same model ...
  a, b = continue_from(target, restored), continue_from(target, few_shot)
  _assert_same_result(a, b)
  # ... and, in f32, the reference's continuation.
  if cache_dtype == jnp.float32:
    ref = continue_from(tiny, few_shot)
    np.testing.assert_allclose(
      a[0].per_token_scores, ref[0].per_token_scores, atol=2e-5
    )
    np.testing.assert_array_equal(a[1].tokens, ref[1].tokens)


# -- errors ---------------------------------------------------------------


def _copy(saved, tmp_path):
  dst = tmp_path / "copy"
  shutil.copytree(saved, dst)
  return dst


def _data_files(path):
  meta = json.loads((path / manifest.META).read_text())
  return [f for f in meta["files"] if "/d/" in f or f.startswith("arrays/d")]


def test_missing_file_is_named(saved, tmp_path):
  path = _copy(saved, tmp_path)
  victim = _data_files(path)[0]
  os.remove(path / victim)
  with pytest.raises(ValueError, match=rf"{victim} is missing \(expected"):
    cw.load(path)


def test_truncated_file_is_named(saved, tmp_path):
  path = _copy(saved, tmp_path)
  victim = _data_files(path)[-1]
  size = os.path.getsize(path / victim)
  with open(path / victim, "r+b") as f:
    f.truncate(size // 2)
  with pytest.raises(ValueError, match=rf"{victim} has {size // 2} bytes"):
    cw.load(path)


def test_same_size_corruption_is_named(saved, tmp_path):
  """One flipped byte keeps the file's size: its CRC-32 names it, and an
  unlisted file among the arrays is refused before Orbax reads anything."""
  path = _copy(saved, tmp_path)
  victim = _data_files(path)[-1]
  data = bytearray((path / victim).read_bytes())
  data[len(data) // 2] ^= 0x01
  (path / victim).write_bytes(bytes(data))
  with pytest.raises(ValueError, match=rf"{victim} does not have its saved"):
    cw.load(path)
  data[len(data) // 2] ^= 0x01
  (path / victim).write_bytes(bytes(data))
  (path / arrays.ARRAYS / "planted").write_bytes(b"x")
  with pytest.raises(ValueError, match="holds files it did not save"):
    cw.load(path)


def _edit_meta(path, edit):
  meta = json.loads((path / manifest.META).read_text())
  edit(meta)
  (path / manifest.META).write_text(json.dumps(meta))


def test_shapes_that_do_not_match_the_hparams_are_named(saved, tmp_path):
  path = _copy(saved, tmp_path)
  _edit_meta(path, lambda m: m["hparams"].update(d_ff=64))
  with pytest.raises(
    ValueError,
    match=r"array layers\.0\.gate has shape \(64, 128\), but its "
    r"HParams\(layers=2, d_model=64, .*d_ff=64, \.\.\.\) expect "
    r"\(64, 64\)",
  ):
    cw.load(path)
  _edit_meta(path, lambda m: m["hparams"].update(d_ff=128, kv_heads=3))
  with pytest.raises(ValueError, match=r"bad HParams.*kv_heads=3"):
    cw.load(path)


def test_arrays_of_another_model_are_refused(saved, tmp_path):
  other = cw.InferenceModel.random(
    cw.configs.get("tiny").replace(layers=3), seed=0
  )
  path = _copy(saved, tmp_path)
  other_path = cw.save(other, tmp_path / "other")
  shutil.rmtree(path / arrays.ARRAYS)
  shutil.copytree(
    pathlib.Path(other_path) / arrays.ARRAYS, path / arrays.ARRAYS
  )
  # An attacker who rewrites the manifest and its checksums: the shapes
  # recorded in the arrays themselves still give the swap away.
  sizes = manifest.file_sizes(str(path))
  sums = {rel: manifest.crc32(str(path / rel)) for rel in sizes}
  _edit_meta(path, lambda m: m.update(files=sizes, checksums=sums))
  with pytest.raises(
    ValueError,
    match=r"holds arrays layers\.2\.attn_norm, .* and 4 more that its "
    r"HParams\(layers=2,",
  ):
    cw.load(path)


def test_result_that_does_not_fit_the_model(tiny, tmp_path):
  path = cw.save(tiny.prefill(_chunk(tiny.vocab)), tmp_path / "prefix")
  other = cw.InferenceModel.random(
    cw.configs.get("tiny").replace(kv_heads=4), seed=0
  )
  with pytest.raises(
    ValueError, match=r"array kv_cache\.k has shape \(2, 3, \d+, 2, 16\)"
  ):
    cw.load_result(path, other)
  with pytest.raises(
    ValueError, match=r"holds a saved result, expected a model"
  ):
    cw.load(path)


def test_not_a_checkpoint(tiny, tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match=r"holds no chunkwise\.json"):
    cw.load(tmp_path / "empty")
  with pytest.raises(ValueError, match=r"not a chunkwise checkpoint"):
    cw.load_result(tmp_path / "empty", tiny)
  with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
    cw.load_result(tmp_path / "missing", tiny)


def test_bad_arguments_fail_before_reading(saved):
  with pytest.raises(ValueError, match=r"quantize='int4' is not supported"):
    cw.load(saved, quantize="int4")
  with pytest.raises(ValueError, match="dtype='float16' is not a weight"):
    cw.load(saved, dtype="float16")
  with pytest.raises(ValueError, match="save takes an InferenceModel"):
    cw.save({"a": 1}, "/nonexistent/x")


def test_save_is_all_or_nothing(tiny, tmp_path, monkeypatch):
  target = tmp_path / "ckpt"

  def boom(root):
    raise OSError("disk full")

  monkeypatch.setattr(manifest, "file_sizes", boom)
  with pytest.raises(OSError, match="disk full"):
    cw.save(tiny, target)
  assert not target.exists()
  assert not pathlib.Path(str(target) + ".partial").exists()
  monkeypatch.undo()
  # An interrupted save (a partial directory, no rename) never loads.
  os.makedirs(str(target) + ".partial/arrays")
  with pytest.raises(FileNotFoundError, match="save that did not finish"):
    cw.load(target)
  cw.save(tiny, target)
  assert not pathlib.Path(str(target) + ".partial").exists()
  with pytest.raises(FileExistsError, match="overwrite=True"):
    cw.save(tiny, target)
  cw.save(tiny, target, overwrite=True)
  assert manifest.is_checkpoint(target)
  (tmp_path / "notes").mkdir()
  (tmp_path / "notes" / "a.txt").write_text("keep me")
  with pytest.raises(ValueError, match=r"not a chunkwise checkpoint"):
    cw.save(tiny, tmp_path / "notes", overwrite=True)
  assert (tmp_path / "notes" / "a.txt").read_text() == "keep me"


# -- scripts/convert.py ---------------------------------------------------


def test_convert_script_writes_an_int8_checkpoint(tmp_path):
  gguf = tmp_path / "m.gguf"
  hf_models.write_gguf(hf_models.tiny("llama"), gguf)
  out = tmp_path / "m8"
  run = subprocess.run(
    [
      sys.executable,
      str(ROOT / "scripts" / "convert.py"),
      f"--input={gguf}",
      f"--output={out}",
      "--quantize=int8",
    ],
    capture_output=True,
    text=True,
    check=False,
  )
  assert run.returncode == 0, run.stderr
  model = cw.load(out)
  assert isinstance(model.weights.layers[0].down, QArray)
  direct = cw.load(gguf, quantize="int8")
  _assert_same_weights(model.weights, direct.weights)
  again = subprocess.run(
    [
      sys.executable,
      str(ROOT / "scripts" / "convert.py"),
      f"--input={gguf}",
      f"--output={out}",
    ],
    capture_output=True,
    text=True,
    check=False,
  )
  assert again.returncode == 1
  assert "already exists; pass --overwrite" in again.stderr
