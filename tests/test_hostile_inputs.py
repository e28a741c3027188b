"""Model files and inputs are untrusted: every loader refuses hostile input
with a ValueError naming the file and the field, before allocating more
than the file justifies (tests/fuzz_inputs.py fuzzes all of them)."""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import chunkwise as cw
from chunkwise.checkpoints import gguf_file, hf, manifest, safetensors
from tests import fuzz_inputs


def test_fuzz_every_loader(request, tmp_path):
  """100 mutants per format in CI (`--long`: thousands); the
  outcome counts are printed (`pytest -s`)."""
  cases = 3000 if request.config.getoption("--long") else 100
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(os.path.dirname(__file__), "fuzz_inputs.py"),
      f"--cases={cases}",
      "--json",
    ],
    capture_output=True,
    text=True,
    timeout=4 * 60 * 60 if cases > 250 else 900,
    cwd=tmp_path,
  )
  assert proc.returncode in (0, 1), (
    f"the fuzzer died (exit {proc.returncode}); its last lines:\n"
    + "\n".join(proc.stderr.splitlines()[-20:])
  )
  report = json.loads(proc.stdout.splitlines()[-1])
  print(json.dumps(report["formats"], indent=1))
  assert not report["pwned"]
  assert report["unexpected"] == []
  assert set(report["formats"]) == set(fuzz_inputs.FORMATS)
  for name, r in report["formats"].items():
    outcomes = r["outcomes"]
    assert sum(outcomes.values()) == cases, name
    rejected = sum(n for k, n in outcomes.items() if k.startswith("rejected"))
    assert rejected >= cases // 4, (name, outcomes)  # mutants really bite


# -- GGUF -------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_seed(tmp_path_factory):
  path = tmp_path_factory.mktemp("gguf") / "seed.gguf"
  fuzz_inputs.write_gguf(path)
  data = path.read_bytes()
  return data, {name: at for at, _, name in fuzz_inputs.gguf_fields(data)}


def _patched(tmp_path, data, at, fmt, value):
  out = bytearray(data)
  struct.pack_into(fmt, out, at, value)
  path = tmp_path / "m.gguf"
  path.write_bytes(bytes(out))
  return path


@pytest.mark.parametrize(
  "field, fmt, value, reason",
  [
    ("tensor_count", "<Q", 2**62, r"tensor count=\d+ needs at least"),
    ("kv_count", "<Q", 2**40, r"metadata count=\d+ needs at least"),
    ("key0.len", "<Q", 2**64 - 1, r"length of metadata key #0=\d+ needs"),
    ("tokenizer.ggml.tokens.count", "<Q", 2**61, "corrupt count"),
    ("tensor3.n_dims", "<I", 9, "has 9 dimensions; expected 1 to 4"),
    ("tensor3.dim0", "<Q", 2**50, "does not fit the .*-byte data section"),
    ("tensor3.dim1", "<Q", 0, "each must be positive"),
    ("tensor3.offset", "<Q", 2**63, "does not fit the .*-byte data section"),
    ("tensor3.offset", "<Q", 1, "does not fit"),
    ("tensor3.type", "<I", 1000, "unknown GGML type 1000"),
    ("tokenizer.ggml.tokens.item_type", "<I", 77, "unknown value type 77"),
  ],
)
def test_gguf_counts_sizes_and_offsets_are_checked(
  tmp_path, gguf_seed, field, fmt, value, reason
):
  data, fields = gguf_seed
  path = _patched(tmp_path, data, fields[field], fmt, value)
  with pytest.raises(gguf_file.GGUFError, match=reason) as e:
    cw.load(path)
  assert str(path) in str(e.value)


def test_gguf_overlapping_tensors_and_big_endian(tmp_path, gguf_seed):
  data, fields = gguf_seed
  (first,) = struct.unpack_from("<Q", data, fields["tensor3.offset"])
  path = _patched(tmp_path, data, fields["tensor4.offset"], "<Q", first)
  with pytest.raises(ValueError, match="overlap"):
    cw.load(path)
  path = _patched(tmp_path, data, 4, ">I", 3)
  with pytest.raises(ValueError, match="big-endian"):
    cw.load(path)


def test_gguf_reader_agrees_with_the_gguf_package(gguf_seed, tmp_path):
  """Our bounded reader is a twin of gguf.GGUFReader on valid files."""
  import gguf

  path = tmp_path / "m.gguf"
  path.write_bytes(gguf_seed[0])
  ours = gguf_file.open_file(path)
  theirs = gguf.GGUFReader(str(path))
  assert ours.metadata == {
    k: f.contents()
    for k, f in theirs.fields.items()
    if not k.startswith("GGUF.")
  }
  for t in theirs.tensors:
    info = ours.tensors[t.name]
    assert info.qtype == t.tensor_type and info.dims == tuple(t.shape)
    np.testing.assert_array_equal(ours.raw(t.name), t.data)


def test_gguf_absurd_hyperparameters_are_refused_cheaply(tmp_path, gguf_seed):
  data, fields = gguf_seed
  at = fields["llama.block_count.type"] + 4  # the uint32 value
  path = _patched(tmp_path, data, at, "<I", 2**31)
  with pytest.raises(ValueError, match=r"layers=2147483648 exceeds"):
    cw.load(path)
  # Deep, but a depth HParams allows: the missing tensors are counted, not
  # listed.
  path = _patched(tmp_path, data, at, "<I", 60_000)
  with pytest.raises(ValueError, match=r"\d+ tensor\(s\) missing"):
    cw.load(path)


# -- Hugging Face directories ----------------------------------------------


@pytest.fixture
def hf_dir(tmp_path):
  fuzz_inputs.write_hf_dir(tmp_path / "hf")
  return tmp_path / "hf"


def _edit_json(path, **changes):
  value = json.loads(path.read_text())
  value.update(changes)
  path.write_text(json.dumps(value))


@pytest.mark.parametrize(
  "change, reason",
  [
    ({"num_hidden_layers": 10**13}, r"num_hidden_layers=\d+ is not an int"),
    ({"num_hidden_layers": 2**30}, r"num_hidden_layers|layers=\d+ exceeds"),
    ({"num_hidden_layers": 60_000}, r"\d+ tensor\(s\) missing"),
    ({"hidden_size": "64"}, "hidden_size='64' is not an integer"),
    ({"rms_norm_eps": [1]}, r"rms_norm_eps=\[1\] is not a finite number"),
    ({"rope_scaling": "linear"}, "rope_scaling is str, expected an object"),
    ({"bos_token_id": True}, "bos_token_id=True is not an integer"),
    ({"num_attention_heads": None}, "num_attention_heads is missing"),
  ],
)
def test_hf_config_values_are_typed_and_bounded(hf_dir, change, reason):
  _edit_json(hf_dir / "config.json", **change)
  with pytest.raises(ValueError, match=reason) as e:
    cw.load(hf_dir)
  assert str(hf_dir) in str(e.value)


def test_hf_json_files_nesting_and_size(hf_dir, monkeypatch):
  (hf_dir / "config.json").write_text(
    '{"a": ' + "[" * 10**5 + "]" * 10**5 + "}"
  )
  with pytest.raises(ValueError, match=r"config\.json: JSON nested too deep"):
    cw.load(hf_dir)
  (hf_dir / "tokenizer.json").write_text("[" * 10**5)
  from chunkwise.checkpoints import tokenizer

  with pytest.raises(ValueError, match=r"tokenizer\.json is not a valid"):
    tokenizer.TokenizerVocabulary.from_file(hf_dir / "tokenizer.json")
  monkeypatch.setattr(tokenizer, "MAX_TOKENIZER_BYTES", 10)
  with pytest.raises(ValueError, match="over the limit of 10"):
    tokenizer.TokenizerVocabulary.from_file(hf_dir / "tokenizer.json")


def _header(path):
  data = path.read_bytes()
  (n,) = struct.unpack_from("<Q", data)
  return json.loads(data[8 : 8 + n]), data[8 + n :]


def _write_header(path, header, body):
  head = json.dumps(header).encode()
  path.write_bytes(struct.pack("<Q", len(head)) + head + body)


def _overlap(a, b):
  b.update(data_offsets=a["data_offsets"], shape=a["shape"])


@pytest.mark.parametrize(
  "edit, reason",
  [
    (_overlap, "overlap"),
    (lambda a, b: a.update(data_offsets=[0, 2**62]), "should hold"),
    (lambda a, b: a.update(shape=[2**40, 2**40]), "should hold"),
    (lambda a, b: a.update(shape="big"), "is not a list of sizes"),
    (lambda a, b: a.update(data_offsets=[5]), r"is not \[start, end\]"),
    (lambda a, b: a.update(dtype=None), "has dtype None"),
  ],
)
def test_safetensors_ranges_are_checked(hf_dir, edit, reason):
  path = hf_dir / "model.safetensors"
  header, body = _header(path)
  names = sorted(k for k in header if k != "__metadata__")
  edit(header[names[0]], header[names[1]])
  _write_header(path, header, body)
  with pytest.raises(ValueError, match=reason) as e:
    safetensors.read(path)
  assert str(path) in str(e.value)


def test_safetensors_header_size_is_bounded(hf_dir):
  path = hf_dir / "model.safetensors"
  path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
  with pytest.raises(ValueError, match="over the limit"):
    safetensors.read(path)


def test_hf_describe_reads_a_hostile_template_without_running_it(hf_dir):
  _edit_json(
    hf_dir / "tokenizer_config.json",
    chat_template="{{ cycler.__init__.__globals__.os.system('id') }}",
  )
  _, vocab = hf.describe(hf_dir)
  with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_"):
    vocab.apply_chat_template([{"role": "user", "content": "hi"}])


# -- Orbax checkpoints --------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny):
  root = tmp_path_factory.mktemp("saved")
  cw.save(tiny, root / "model")
  return root / "model"


def _copy(src, dst):
  import shutil

  shutil.copytree(src, dst)
  return dst


@pytest.mark.parametrize(
  "edit, reason",
  [
    (
      lambda m: m["files"].update({"../../etc/passwd": 10}),
      "not a path inside",
    ),
    (lambda m: m["files"].update({"/etc/passwd": 10}), "not a path inside"),
    (
      lambda m: m.update(vocabulary={"kind": "tokenizer", "file": "/etc/x"}),
      "the vocabulary file is '/etc/x'",
    ),
    (
      lambda m: m["arrays"]["layers.0.q"].update(dtype="object"),
      "dtype='object'",
    ),
    (lambda m: m["hparams"].update(layers="2"), "bad HParams"),
    (lambda m: m.update(bos_id=-5), r"bos_id=-5 is not an integer"),
    (lambda m: m.update(hparams=[1]), "bad HParams"),
  ],
)
def test_orbax_description_is_checked(tmp_path, saved, edit, reason):
  path = _copy(saved, tmp_path / "ckpt")
  meta = json.loads((path / "chunkwise.json").read_text())
  edit(meta)
  (path / "chunkwise.json").write_text(json.dumps(meta))
  with pytest.raises(ValueError, match=reason):
    cw.load(path)


def test_orbax_files_are_verified_before_orbax_reads_them(tmp_path, saved):
  path = _copy(saved, tmp_path / "ckpt")
  meta = json.loads((path / "chunkwise.json").read_text())
  data = max(meta["files"], key=meta["files"].get)  # the largest: array data
  raw = bytearray((path / data).read_bytes())
  raw[len(raw) // 2] ^= 1
  (path / data).write_bytes(bytes(raw))
  with pytest.raises(ValueError, match=f"{data} does not have its saved CRC"):
    cw.load(path)
  path = _copy(saved, tmp_path / "ckpt2")
  (path / "arrays" / "extra").write_bytes(b"x")
  with pytest.raises(ValueError, match="holds files it did not save"):
    cw.load(path)


def test_orbax_declared_sizes_are_bounded_by_the_stored_bytes(
  tmp_path, saved, monkeypatch
):
  monkeypatch.setattr(manifest, "MAX_EXPANSION", 0)
  monkeypatch.setattr(manifest, "EXPANSION_FLOOR", 0)
  with pytest.raises(ValueError, match=r"would restore \d+ bytes of arrays"):
    cw.load(saved)
