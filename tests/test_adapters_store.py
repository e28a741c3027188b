"""LoRA adapters in chunkwise checkpoints: `cw.save` of a model serving
adapters stores them beside its weights, `cw.load` restores a model that
serves the same adapters (names, checksums, outputs bit for bit, on one
device and on a mesh); saved results keep their rows' adapters; corrupt
or tampered adapter arrays are refused; checkpoints without adapters load
as before."""

import json
import shutil

import numpy as np
import pytest

import chunkwise as cw
from chunkwise.checkpoints import manifest, saved_adapters
from chunkwise.models import lora
from chunkwise.partitioning import make_mesh
from tests.test_adapters import prompts, random_adapter

GREEDY = cw.Sampling(temperature=0.0)
ROWS = ["a", None, "b", "c"]


def _adapters(h):
  """Three adapters of different ranks and targets; "c" adapts layer 0
  only (as PEFT's layers_to_transform leaves a layer without tensors)."""
  c = random_adapter(h, 3, 3, targets=("k", "gate", "up"))
  c = lora.Adapter(
    rank=3,
    layers=(c.layers[0], *({},) * (h.layers - 1)),
    targets=c.targets,
    source="/somewhere/c",
    config={"peft_type": "LORA", "r": 3, "layers_to_transform": [0]},
  )
  return {
    "a": random_adapter(h, 4, 1),
    "b": random_adapter(h, 2, 2, targets=("q", "v", "o", "down")),
    "c": c,
  }


@pytest.fixture(scope="module")
def served():
  h = cw.configs.get("tiny")
  base = cw.InferenceModel.random(h, seed=3)
  return base, base.with_adapters(_adapters(h))


@pytest.fixture(scope="module")
def saved(served, tmp_path_factory):
  return cw.save(served[1], tmp_path_factory.mktemp("ckpt") / "served")


def _meta(path):
  with open(f"{path}/{manifest.META}") as f:
    return json.load(f)


def _edit_meta(path, edit):
  meta = _meta(path)
  edit(meta)
  with open(f"{path}/{manifest.META}", "w") as f:
    json.dump(meta, f)


def _copy(saved, tmp_path):
  return shutil.copytree(saved, tmp_path / "copy")


def _run(model, chunk, rows=ROWS):
  first = model.prefill(chunk, adapters=rows, top_n=3)
  tokens, result = model.generate(
    [first], sample_ids=np.arange(4), steps=4, sampling=GREEDY, adapters=rows
  )
  return first, tokens, result


def _assert_same(a, b):
  for x, y in zip(a, b, strict=True):
    if isinstance(x, cw.ChunkResult):
      assert x.adapters == y.adapters
      for u, v in (
        (x.per_token_scores, y.per_token_scores),
        (x.top_ids, y.top_ids),
        (x.next_token_logits, y.next_token_logits),
      ):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    else:
      np.testing.assert_array_equal(np.asarray(x.tokens), np.asarray(y.tokens))


def _assert_same_adapters(got, want):
  assert list(got) == list(want)
  for name, adapter in want.items():
    g = got[name]
    assert g.checksum == adapter.checksum
    assert (g.rank, g.targets, g.source) == (
      adapter.rank,
      adapter.targets,
      adapter.source,
    )
    assert dict(g.config) == dict(adapter.config)
    for gl, wl in zip(g.layers, adapter.layers, strict=True):
      assert list(gl) == list(wl)
      for t in wl:
        np.testing.assert_array_equal(gl[t][0], wl[t][0])
        np.testing.assert_array_equal(gl[t][1], wl[t][1])


def test_round_trip_serves_the_same_adapters(served, saved):
  base, model = served
  meta = _meta(saved)
  assert [e["name"] for e in meta["adapters"]] == ["a", "b", "c"]
  assert meta["adapters"][2]["layers"] == [["k", "gate", "up"], []]
  assert meta["adapters"][2]["config"]["layers_to_transform"] == [0]
  assert meta["arrays"]["adapters.1.0.o.a"] == {
    "shape": [8, 16, 2],
    "dtype": "float32",
  }
  assert not any(n.startswith("adapters.2.1.") for n in meta["arrays"])
  loaded = cw.load(saved)
  _assert_same_adapters(loaded.adapters, model.adapters)
  chunk = prompts(base)
  _assert_same(_run(loaded, chunk), _run(model, chunk))
  # Base rows of the loaded model are the base model's.
  np.testing.assert_array_equal(
    np.asarray(loaded.prefill(chunk).per_token_scores),
    np.asarray(base.prefill(chunk).per_token_scores),
  )


def test_loads_onto_a_mesh_layout(served, saved):
  base, model = served
  mesh = make_mesh((2, 2, 2))
  loaded = cw.load(saved, mesh=mesh, layout="ws_2d")
  _assert_same_adapters(loaded.adapters, model.adapters)
  direct = cw.InferenceModel(
    base.hparams, base.weights, base.vocab, mesh=mesh, layout="ws_2d"
  ).with_adapters(model.adapters)
  chunk = prompts(base)
  _assert_same(_run(loaded, chunk), _run(direct, chunk))
  ref = _run(model, chunk)
  np.testing.assert_allclose(
    np.asarray(_run(loaded, chunk)[0].per_token_scores),
    np.asarray(ref[0].per_token_scores),
    atol=2e-4,
  )


def test_bfloat16_weights_keep_their_dtype_beside_f32_adapters(
  served, tmp_path
):
  base, model = served
  bf16 = cw.load(cw.save(base, tmp_path / "b"), dtype="bfloat16")
  bf16 = bf16.with_adapters(model.adapters)
  path = cw.save(bf16, tmp_path / "bf16")
  loaded = cw.load(path)  # dtype as saved: the weights', not the adapters'
  assert loaded.weights.layers[0].q.dtype == np.dtype("bfloat16")
  _assert_same_adapters(loaded.adapters, model.adapters)


def test_saved_result_keeps_its_rows_adapters(served, saved, tmp_path):
  base, model = served
  loaded = cw.load(saved)
  chunk = prompts(base)
  head, tail = chunk.split_at(3)
  prefix = model.prefill(head, adapters=ROWS)
  path = cw.save(prefix, tmp_path / "prefix")
  assert _meta(path)["adapters"] == ROWS
  restored = cw.load_result(path, loaded)
  assert restored.adapters == tuple(ROWS)
  want = model.prefill(tail, prefix=[prefix], adapters=ROWS)
  got = loaded.prefill(tail, prefix=[restored], adapters=ROWS)
  np.testing.assert_array_equal(
    np.asarray(got.per_token_scores), np.asarray(want.per_token_scores)
  )
  with pytest.raises(ValueError, match="row 0 runs adapter 'b' but"):
    loaded.prefill(tail, prefix=[restored], adapters="b")
  # A result of base rows only records none, as before.
  plain = cw.save(base.prefill(head), tmp_path / "plain")
  assert "adapters" not in _meta(plain)
  assert cw.load_result(plain, loaded).adapters is None
  _edit_meta(path, lambda m: m.update(adapters=["a", 3, None, None]))
  with pytest.raises(ValueError, match="'adapters' is not a list of 4"):
    cw.load_result(path, loaded)


def test_checkpoint_without_adapters_loads_as_before(served, tmp_path):
  base, _ = served
  path = cw.save(base, tmp_path / "base")
  meta = _meta(path)
  assert "adapters" not in meta
  assert not any(saved_adapters.is_adapter_array(n) for n in meta["arrays"])
  loaded = cw.load(path)
  assert loaded.adapters == {}
  chunk = prompts(base)
  np.testing.assert_array_equal(
    np.asarray(loaded.prefill(chunk).per_token_scores),
    np.asarray(base.prefill(chunk).per_token_scores),
  )


def test_corrupt_adapter_arrays_are_refused(served, saved, tmp_path):
  """A flipped byte fails the files' CRC-32s; arrays replaced under a
  rewritten file list fail the adapter's own checksum; a description
  that drops or reshapes the adapters no longer matches the arrays."""
  base, model = served
  path = _copy(saved, tmp_path)
  victims = [f for f in _meta(path)["files"] if "/d/" in f]
  for victim in victims:
    data = bytearray((path / victim).read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / victim).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{victim} does not have its saved"):
      cw.load(path)
    data[len(data) // 2] ^= 0x01
    (path / victim).write_bytes(bytes(data))
  # Adapter "a" with one number changed, saved under the original's
  # description (every file's size and CRC-32 rewritten to match).
  a = model.adapters["a"]
  q_a, q_b = a.layers[1]["q"]
  q_a = q_a.copy()
  q_a[0, 0] += 1.0
  changed = lora.Adapter(
    rank=a.rank,
    layers=(a.layers[0], {**a.layers[1], "q": (q_a, q_b)}),
    targets=a.targets,
    source=a.source,
    config=a.config,
  )
  forged = cw.save(
    base.with_adapters({**model.adapters, "a": changed}), tmp_path / "forged"
  )
  checksum = model.adapters["a"].checksum
  _edit_meta(forged, lambda m: m["adapters"][0].update(checksum=checksum))
  with pytest.raises(ValueError, match=r"corrupt: adapter 'a' has checksum"):
    cw.load(forged)
  # Dropping the description leaves arrays nothing expects; another rank
  # no longer fits them.
  _edit_meta(path, lambda m: m["adapters"][0].update(rank=3))
  with pytest.raises(
    ValueError,
    match=r"array adapters\.0\.0\.q\.a has shape \(64, 4\), but its "
    r"HParams\(.*\) and 3 adapters expect \(64, 3\)",
  ):
    cw.load(path)
  _edit_meta(path, lambda m: m.pop("adapters"))
  with pytest.raises(ValueError, match=r"holds arrays adapters\.0\.0\."):
    cw.load(path)


@pytest.mark.parametrize(
  "edit, match",
  [
    (lambda e: e.update(name=""), r"adapters\[0\]\.name='' is not a name"),
    (lambda e: e.update(rank=0), r"rank=0 is not an integer"),
    (lambda e: e.update(targets=["q", "x"]), r"targets=.* is not a list"),
    (lambda e: e["layers"].pop(), r"'layers' is not a list of 2 lists"),
    (lambda e: e["layers"][0].append("k"), r"layers\[0\]=.* distinct"),
    (lambda e: e.update(checksum=None), r"checksum is not a string"),
    (lambda e: e.update(config=[1]), r"config is not an object"),
  ],
  ids=["name", "rank", "targets", "layers", "layer", "checksum", "config"],
)
def test_bad_adapter_descriptions_are_named(saved, tmp_path, edit, match):
  path = _copy(saved, tmp_path)
  _edit_meta(path, lambda m: edit(m["adapters"][0]))
  with pytest.raises(ValueError, match=match):
    cw.load(path)
