"""`cw.load_adapter` against PEFT: an adapter saved by `save_pretrained`,
folded into chunkwise's base weights with `lora.merged`, must equal the
Hugging Face import of PEFT's own `merge_and_unload()` model, for every
layer and target (and leave the others alone). Hand-edited configs and
tensors check each refusal."""

import copy
import dataclasses
import json
import shutil

import numpy as np
import peft
import pytest
import torch
from safetensors.numpy import load_file, save_file

import chunkwise as cw
from chunkwise.checkpoints import adapters, hf
from chunkwise.models import lora
from tests import hf_models

ALL = [f"{m}_proj" for m in ("q", "k", "v", "o", "gate", "up", "down")]
PREFIX = "base_model.model.model.layers."


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """(the tiny torch model: 2 layers, 4 heads, 2 KV heads, d_ff 96; its
  chunkwise import)."""
  model = hf_models.tiny("llama", heads=4, kv_heads=2, vocab=300, seed=1)
  directory = tmp_path_factory.mktemp("base")
  model.save_pretrained(directory)
  return model, hf.read(directory)


def _adapt(base, directory, seed=0, **config):
  """Saves a PEFT adapter (random A and B) of the base model in
  `directory`/adapter; returns the import of its merged model's weights."""
  torch.manual_seed(seed)
  config = dict(r=4, lora_alpha=8, init_lora_weights=False) | config
  model = peft.get_peft_model(copy.deepcopy(base[0]), peft.LoraConfig(**config))
  model.save_pretrained(directory / "adapter")
  model.merge_and_unload().save_pretrained(directory / "merged")
  return hf.read(directory / "merged").weights


@pytest.fixture(scope="module")
def full(base, tmp_path_factory):
  """An adapter of all seven targets: (its directory, merged weights)."""
  directory = tmp_path_factory.mktemp("full")
  return directory / "adapter", _adapt(base, directory, target_modules=ALL)


def _assert_merges_to(adapter, base_weights, want):
  for i, (layer, wanted) in enumerate(
    zip(base_weights.layers, want.layers, strict=True)
  ):
    for t in lora.TARGETS:
      w, got = np.asarray(getattr(layer, t)), np.asarray(getattr(wanted, t))
      if t in adapter.layers[i]:
        w = lora.merged(w, *adapter.layers[i][t])
        assert not np.allclose(got, np.asarray(getattr(layer, t)), atol=1e-3)
      np.testing.assert_allclose(w, got, atol=1e-5, err_msg=f"{i} {t}")


def test_all_targets_match_peft_merge(base, full):
  directory, merged = full
  hparams = base[1].hparams
  adapter = cw.load_adapter(directory, hparams)
  assert adapter.rank == 4 and adapter.targets == lora.TARGETS
  assert adapter.source == str(directory)
  assert adapter.config["target_modules"]
  assert len(adapter.layers) == hparams.layers
  adapter.check(hparams)
  _assert_merges_to(adapter, base[1].weights, merged)


VARIANTS = {
  "rslora": dict(target_modules=ALL, use_rslora=True, lora_alpha=6),
  "regex": dict(target_modules=r".*\.(q_proj|down_proj)"),
  "last-layer": dict(target_modules=ALL, layers_to_transform=[1]),
  "q-and-v": dict(target_modules=["q_proj", "v_proj"], r=3),
}
TARGETS = {
  "rslora": lora.TARGETS,
  "regex": ("q", "down"),
  "last-layer": lora.TARGETS,
  "q-and-v": ("q", "v"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_peft_merge(base, tmp_path, variant):
  merged = _adapt(base, tmp_path, **VARIANTS[variant])
  adapter = cw.load_adapter(tmp_path / "adapter", base[1].hparams)
  assert adapter.targets == TARGETS[variant]
  if variant == "last-layer":
    assert adapter.layers[0] == {}
  _assert_merges_to(adapter, base[1].weights, merged)


def test_without_hparams_fit_gives_the_same_adapter(base, full):
  hparams = base[1].hparams
  flat = cw.load_adapter(full[0])
  a, b = flat.layers[0]["o"]
  assert a.shape == (hparams.heads * hparams.head_dim, 4)
  assert b.shape == (4, hparams.d_model)
  fitted = adapters.fit(flat, hparams)
  direct = cw.load_adapter(full[0], hparams)
  assert fitted.checksum == direct.checksum == flat.checksum
  for got, want in zip(fitted.layers, direct.layers, strict=True):
    for t in lora.TARGETS:
      np.testing.assert_array_equal(got[t][0], want[t][0])
      np.testing.assert_array_equal(got[t][1], want[t][1])
  with pytest.raises(
    ValueError, match=r"layer 0 down: A \(96, 4\).*\(128, 4\)"
  ):
    adapters.fit(flat, dataclasses.replace(hparams, d_ff=128))
  short = dataclasses.replace(flat, layers=flat.layers[:1])
  assert len(adapters.fit(short, hparams).layers) == 2
  with pytest.raises(ValueError, match="3 layers; the model has 2"):
    adapters.fit(dataclasses.replace(flat, layers=(*flat.layers, {})), hparams)


def test_checksum_is_stable_and_follows_the_tensors(base, full, tmp_path):
  hparams = base[1].hparams
  first = cw.load_adapter(full[0], hparams)
  assert first.checksum == cw.load_adapter(full[0], hparams).checksum
  edited = _copy(full[0], tmp_path)
  tensors = load_file(edited / adapters.WEIGHTS_FILE)
  name = PREFIX + "1.mlp.up_proj.lora_B.weight"
  tensors[name] = tensors[name].copy()
  tensors[name][3, 2] += 1e-3
  save_file(tensors, edited / adapters.WEIGHTS_FILE)
  assert cw.load_adapter(edited, hparams).checksum != first.checksum


def _copy(directory, tmp_path):
  out = tmp_path / "edited"
  shutil.copytree(directory, out)
  return out


def _edit_config(directory, **changes):
  path = directory / adapters.CONFIG_FILE
  path.write_text(json.dumps(json.loads(path.read_text()) | changes))


CONFIG_REFUSALS = {
  "not-lora": (dict(peft_type="IA3"), "peft_type='IA3'"),
  "dora": (dict(use_dora=True), "use_dora=True.*DoRA"),
  "rank-pattern": (
    dict(rank_pattern={"q_proj": 8}),
    "rank_pattern=.*unsupported.*'q_proj'",
  ),
  "alpha-pattern": (
    dict(alpha_pattern={"v_proj": 32}),
    "alpha_pattern=.*unsupported.*'v_proj'",
  ),
  "bias": (dict(bias="lora_only"), "bias='lora_only'"),
  "modules-to-save": (
    dict(modules_to_save=["lm_head"]),
    r"modules_to_save=\['lm_head'\]",
  ),
  "fan-in-fan-out": (dict(fan_in_fan_out=True), "fan_in_fan_out=True"),
  "lora-bias": (dict(lora_bias=True), "lora_bias=True.*variant"),
  "head-and-embedding": (
    dict(target_modules=["q_proj", "lm_head", "embed_tokens"]),
    "'lm_head', 'embed_tokens'.*cannot adapt",
  ),
  "rank": (
    dict(r=8),
    r"lora_A.weight has shape \(4, (\d+)\), expected \(8, \1\)",
  ),
  "layers": (
    dict(layers_to_transform=[0]),
    r"layers.1.*outside layers_to_transform \[0\]",
  ),
  "targets": (
    dict(target_modules=["q_proj", "k_proj"]),
    r"adapts model\.layers\.0\.mlp\.down_proj, which target_modules",
  ),
  "rank-type": (dict(r="4"), "r='4' is not an integer"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_REFUSALS))
def test_refuses_configs(base, full, tmp_path, case):
  changes, message = CONFIG_REFUSALS[case]
  edited = _copy(full[0], tmp_path)
  _edit_config(edited, **changes)
  with pytest.raises(ValueError, match=message):
    cw.load_adapter(edited, base[1].hparams)


def _tensor_edits():
  q, k = "0.self_attn.q_proj.lora_", "0.self_attn.k_proj.lora_"
  r = np.ones((4, 64), np.float32)

  def add(**new):
    return lambda t: t | {k: v for k, v in new.items()}

  def drop(*names):
    return lambda t: {k: v for k, v in t.items() if not k.endswith(names)}

  def replace(name, value):
    return lambda t: t | {PREFIX + name: value}

  return {
    "lm-head": (
      add(
        **{
          "base_model.model.lm_head.lora_A.weight": r,
          "base_model.model.lm_head.lora_B.weight": r.T.copy(),
        }
      ),
      "adapts lm_head, which chunkwise cannot adapt",
    ),
    "embedding": (
      add(**{"base_model.model.model.embed_tokens.lora_embedding_A": r}),
      "adapts model.embed_tokens, which chunkwise cannot adapt",
    ),
    "other-tensor": (
      add(**{PREFIX + "0.self_attn.q_proj.lora_magnitude_vector": r[0]}),
      "lora_magnitude_vector is not a LoRA A or B weight|cannot adapt",
    ),
    "missing-b": (
      drop(q + "B.weight"),
      "lora_B of layer 0's q_proj is missing",
    ),
    "missing-layer": (
      drop(
        "1.self_attn.k_proj.lora_A.weight", "1.self_attn.k_proj.lora_B.weight"
      ),
      "no LoRA tensors for model.layers.1.self_attn.k_proj",
    ),
    "shape": (
      replace(k + "B.weight", np.ones((64, 4), np.float32)),
      r"k_proj.lora_B.weight has shape \(64, 4\), expected \(32, 4\)",
    ),
    "nan": (
      replace(q + "A.weight", np.full((4, 64), np.nan, np.float32)),
      "q_proj.lora_A.weight holds NaN",
    ),
    "int": (
      replace(q + "A.weight", np.ones((4, 64), np.int32)),
      "q_proj.lora_A.weight has dtype int32",
    ),
    "layer-past-model": (
      add(
        **{
          PREFIX + "7.self_attn.q_proj.lora_A.weight": r,
          PREFIX + "7.self_attn.q_proj.lora_B.weight": r.T.copy(),
        }
      ),
      "is for layer 7; the model has 2 layers",
    ),
  }


TENSOR_REFUSALS = _tensor_edits()


@pytest.mark.parametrize("case", sorted(TENSOR_REFUSALS))
def test_refuses_tensors(base, full, tmp_path, case):
  edit, message = TENSOR_REFUSALS[case]
  edited = _copy(full[0], tmp_path)
  path = edited / adapters.WEIGHTS_FILE
  save_file(edit(load_file(path)), path)
  with pytest.raises(ValueError, match=message):
    cw.load_adapter(edited, base[1].hparams)


def test_refuses_a_model_it_does_not_fit(base, full):
  hparams = base[1].hparams
  with pytest.raises(ValueError, match=r"down_proj.lora_A.weight.*\(4, 128\)"):
    cw.load_adapter(full[0], dataclasses.replace(hparams, d_ff=128))
  with pytest.raises(
    ValueError, match=r"no LoRA tensors for model\.layers\.2\..*another model"
  ):
    cw.load_adapter(full[0], dataclasses.replace(hparams, layers=3))


def test_refuses_missing_files_and_pickles(full, tmp_path):
  with pytest.raises(FileNotFoundError, match="no adapter directory"):
    cw.load_adapter(tmp_path / "nowhere")
  edited = _copy(full[0], tmp_path)
  (edited / adapters.WEIGHTS_FILE).unlink()
  with pytest.raises(ValueError, match=r"no adapter_model.safetensors"):
    cw.load_adapter(edited)
  # Unpickling this would raise something else than the refusal.
  (edited / "adapter_model.bin").write_bytes(b"\x80\x04not a pickle")
  with pytest.raises(ValueError, match=r"adapter_model.bin is a pickle"):
    cw.load_adapter(edited)
  (edited / adapters.CONFIG_FILE).unlink()
  with pytest.raises(FileNotFoundError, match=r"no adapter_config.json"):
    cw.load_adapter(edited)


def test_fused_phi3_modules_match_peft_merge(tmp_path):
  """Phi-3's qkv_proj and gate_up_proj: one A, B cut like the base."""
  model = hf_models.tiny_architecture("phi3-partial-rotary", seed=2)
  model.save_pretrained(tmp_path / "base")
  imported = hf.read(tmp_path / "base")
  fused = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
  merged = _adapt((model, imported), tmp_path, target_modules=fused)
  adapter = cw.load_adapter(tmp_path / "adapter", imported.hparams)
  assert adapter.targets == lora.TARGETS
  _assert_merges_to(adapter, imported.weights, merged)
  with pytest.raises(ValueError, match="qkv_proj adapter needs the model"):
    cw.load_adapter(tmp_path / "adapter")
