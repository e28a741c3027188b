"""Hugging Face checkpoints of the Llama family (Llama, Mistral, Qwen2,
SmolLM): a directory with `config.json`, `*.safetensors` and, optionally,
`tokenizer.json` (+ `tokenizer_config.json` / `chat_template.jinja`).

  imported = hf.read("path/to/SmolLM2-135M")  # Imported(hparams, weights,
                                              #          vocab)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from absl import logging

from chunkwise import untrusted
from chunkwise.checkpoints import llama, safetensors
from chunkwise.checkpoints.tokenizer import TokenizerVocabulary
from chunkwise.configs import Activation, Block, HParams

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_ACTIVATIONS = {
  "silu": Activation.SILU,
  "swish": Activation.SILU,
  "gelu_pytorch_tanh": Activation.GELU,
  "gelu_new": Activation.GELU,
}


def is_checkpoint(path: str | os.PathLike) -> bool:
  """Whether `path` is a directory holding a Hugging Face `config.json`."""
  return os.path.isfile(os.path.join(path, "config.json"))


# Largest size (width, depth, length) a config may declare.
MAX_SIZE = 1 << 40


def _read_json(path: str, *, optional: bool = False) -> dict[str, Any]:
  """The JSON object in `path`; {} for a missing `optional` file."""
  if optional and not os.path.isfile(path):
    return {}
  return untrusted.read_json(path)


class _Config:
  """Typed reads of a config.json: each names the file and the key."""

  def __init__(self, config: Mapping[str, Any], source: str):
    self.config = config
    self.source = source

  def get(self, key: str, default: Any = None) -> Any:
    return self.config.get(key, default)

  def size(self, key: str, default: Any = None) -> int:
    value = self.config.get(key, default)
    if value is None:
      raise ValueError(f"{self.source}: {key} is missing")
    return untrusted.check_int(
      value, key, source=self.source, lo=1, hi=MAX_SIZE
    )

  def number(self, key: str, default: float, where=None) -> float:
    where = self.config if where is None else where
    return untrusted.check_float(
      where.get(key, default), key, source=self.source
    )

  def mapping(self, key: str) -> Mapping[str, Any]:
    value = self.config.get(key) or {}
    if not isinstance(value, Mapping):
      raise ValueError(
        f"{self.source}: {key} is {type(value).__name__}, expected an object"
      )
    return value


def _rope_base(config: _Config) -> float:
  """RoPE base; transformers 5 nests it (and the scaling) in
  `rope_parameters`, older configs use `rope_theta` / `rope_scaling`."""
  rope = config.mapping("rope_parameters") or config.mapping("rope_scaling")
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind not in (None, "default"):
    raise ValueError(
      f"{config.source}: RoPE scaling {kind!r} is not supported (only plain "
      "RoPE)"
    )
  if "rope_theta" in rope:
    return config.number("rope_theta", 0.0, where=rope)
  return config.number("rope_theta", 10_000.0)


def hparams_from_config(
  config: Mapping[str, Any], source: str = "config.json"
) -> HParams:
  """`HParams` of a Llama-family `config.json`; rejects what chunkwise
  would compute differently (RoPE scaling, output or MLP biases, partial
  rotary embeddings, unknown activations) and sizes that are not positive
  integers (each error names the key)."""
  if not isinstance(config, Mapping):
    raise ValueError(f"{source}: expected a JSON object")
  c = _Config(config, source)
  model_type = config.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(
      f"{source}: model_type={model_type!r} is not supported; expected one "
      f"of {', '.join(SUPPORTED_MODEL_TYPES)}"
    )
  act = config.get("hidden_act", "silu")
  if not isinstance(act, str) or act not in _ACTIVATIONS:
    raise ValueError(
      f"{source}: hidden_act={act!r} is not supported; expected one of "
      f"{', '.join(_ACTIVATIONS)}"
    )
  for flag in ("mlp_bias", "attention_bias"):
    if config.get(flag):
      raise ValueError(f"{source}: {flag}=true is not supported")
  if c.number("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"{source}: partial rotary embeddings are not supported")
  heads = c.size("num_attention_heads")
  d_model = c.size("hidden_size")
  max_len = c.size("max_position_embeddings", 2048)
  window = config.get("sliding_window")
  if model_type == "qwen2" and not config.get("use_sliding_window", False):
    window = None
  if window:
    # Sliding-window attention equals full attention up to the window.
    max_len = min(max_len, c.size("sliding_window"))
  # Optional keys given as null or 0 take their defaults (as in transformers).
  kv_heads = config.get("num_key_value_heads") and c.size("num_key_value_heads")
  head_dim = config.get("head_dim") and c.size("head_dim")
  fields = dict(
    layers=c.size("num_hidden_layers"),
    d_model=d_model,
    heads=heads,
    kv_heads=kv_heads or heads,
    head_dim=head_dim or max(d_model // heads, 1),
    d_ff=c.size("intermediate_size"),
    vocab=c.size("vocab_size"),
    max_len=max_len,
    block=Block.SEQUENTIAL,
    norm_eps=c.number("rms_norm_eps", 1e-6),
    rope_base=_rope_base(c),
    tied_embeddings=bool(config.get("tie_word_embeddings", False)),
    activation=_ACTIVATIONS[act],
    qkv_bias=model_type == "qwen2",
  )
  with untrusted.named(source):
    return HParams(**fields)


def _first_id(value: Any, key: str, source: str) -> int | None:
  if isinstance(value, list):
    value = value[0] if value else None
  if value is None:
    return None
  return untrusted.check_int(value, key, source=source, hi=MAX_SIZE)


def read_vocab(directory: str, config: Mapping[str, Any]):
  """The directory's tokenizer, or None (with a warning) if it has none."""
  path = os.path.join(directory, "tokenizer.json")
  if not os.path.isfile(path):
    logging.warning(
      "%s has no tokenizer.json: the model has no vocab", directory
    )
    return None
  config_path = os.path.join(directory, "tokenizer_config.json")
  tok_config = _read_json(config_path, optional=True)
  template = tok_config.get("chat_template")
  source = f"{config_path}: chat_template"
  if isinstance(template, list):  # named templates: use "default"
    named = {
      t.get("name"): t.get("template")
      for t in template
      if isinstance(t, Mapping)
    }
    template = named.get("default")
    source += "[default]"
  template_path = os.path.join(directory, "chat_template.jinja")
  if template is None and os.path.isfile(template_path):
    template = untrusted.read_bytes(
      template_path, max_bytes=untrusted.CONFIG_BYTES, what="chat template"
    ).decode("utf-8", errors="replace")
    source = template_path
  if template is not None and not isinstance(template, str):
    raise ValueError(f"{source} is not a string")
  generation_path = os.path.join(directory, "generation_config.json")
  generation = _read_json(generation_path, optional=True)
  config_path = os.path.join(directory, "config.json")
  if "eos_token_id" in generation:
    eos = _first_id(generation["eos_token_id"], "eos_token_id", generation_path)
  else:
    eos = _first_id(config.get("eos_token_id"), "eos_token_id", config_path)
  return TokenizerVocabulary.from_file(
    path,
    bos_id=_first_id(config.get("bos_token_id"), "bos_token_id", config_path),
    eos_id=eos,
    pad_id=_first_id(config.get("pad_token_id"), "pad_token_id", config_path),
    chat_template=template,
    chat_template_source=source,
  )


def _config(directory: str) -> tuple[dict[str, Any], HParams]:
  config_path = os.path.join(directory, "config.json")
  if not os.path.isfile(config_path):
    raise FileNotFoundError(
      f"{directory} is not a Hugging Face checkpoint: no config.json"
    )
  config = _read_json(config_path)
  return config, hparams_from_config(config, config_path)


def describe(directory: str | os.PathLike) -> tuple[HParams, Any]:
  """(HParams, vocabulary) of a Hugging Face directory, without reading its
  weights."""
  directory = os.fspath(directory)
  config, hparams = _config(directory)
  return hparams, read_vocab(directory, config)


def read(directory: str | os.PathLike, *, dtype=jnp.float32) -> llama.Imported:
  """Reads a Hugging Face Llama-family directory.

  Raises:
    FileNotFoundError: no `config.json` or no `*.safetensors` in it.
    ValueError: an unsupported architecture, or tensors that are missing,
      misshapen or unexpected (the message names them).
  """
  directory = os.fspath(directory)
  config, hparams = _config(directory)
  vocab = read_vocab(directory, config)
  llama.check_special_ids(hparams, vocab, directory)
  files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
  if not files:
    raise FileNotFoundError(
      f"{directory} has no *.safetensors weights (PyTorch .bin files are "
      "not read; convert them with save_pretrained(safe_serialization=True))"
    )
  tensors = {}
  for name in files:
    path = os.path.join(directory, name)
    for key, value in safetensors.read(path).items():
      key = key.removeprefix("model.")
      if key in tensors:
        raise ValueError(f"{path}: tensor {key} is also in another file")
      tensors[key] = value
  shapes = {name: value.shape for name, value in tensors.items()}
  weights = llama.to_weights(
    hparams, tensors.__getitem__, shapes, dtype=dtype, source=directory
  )
  return llama.Imported(hparams, weights, vocab)
