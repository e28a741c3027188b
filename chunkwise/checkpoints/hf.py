"""Hugging Face checkpoints of the Llama family (Llama, Mistral, Qwen2,
SmolLM): a directory with `config.json`, `*.safetensors` and, optionally,
`tokenizer.json` (+ `tokenizer_config.json` / `chat_template.jinja`).

  imported = hf.read("path/to/SmolLM2-135M")  # Imported(hparams, weights,
                                              #          vocab)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from absl import logging

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


def _read_json(path: str, *, optional: bool = False) -> dict[str, Any]:
  """The JSON object in `path`; {} for a missing `optional` file."""
  if optional and not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON ({e})") from None


def _rope_base(config: Mapping[str, Any], source: str) -> float:
  """RoPE base; transformers 5 nests it (and the scaling) in
  `rope_parameters`, older configs use `rope_theta` / `rope_scaling`."""
  rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind not in (None, "default"):
    raise ValueError(
      f"{source}: RoPE scaling {kind!r} is not supported (only plain RoPE)"
    )
  return float(rope.get("rope_theta", config.get("rope_theta", 10_000.0)))


def hparams_from_config(
  config: Mapping[str, Any], source: str = "config.json"
) -> HParams:
  """`HParams` of a Llama-family `config.json`; rejects what chunkwise
  would compute differently (RoPE scaling, output or MLP biases, partial
  rotary embeddings, unknown activations)."""
  model_type = config.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(
      f"{source}: model_type={model_type!r} is not supported; expected one "
      f"of {', '.join(SUPPORTED_MODEL_TYPES)}"
    )
  act = config.get("hidden_act", "silu")
  if act not in _ACTIVATIONS:
    raise ValueError(
      f"{source}: hidden_act={act!r} is not supported; expected one of "
      f"{', '.join(_ACTIVATIONS)}"
    )
  for flag in ("mlp_bias", "attention_bias"):
    if config.get(flag):
      raise ValueError(f"{source}: {flag}=true is not supported")
  if config.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"{source}: partial rotary embeddings are not supported")
  heads = config["num_attention_heads"]
  max_len = config.get("max_position_embeddings", 2048)
  window = config.get("sliding_window")
  if model_type == "qwen2" and not config.get("use_sliding_window", False):
    window = None
  if window:
    # Sliding-window attention equals full attention up to the window.
    max_len = min(max_len, window)
  return HParams(
    layers=config["num_hidden_layers"],
    d_model=config["hidden_size"],
    heads=heads,
    kv_heads=config.get("num_key_value_heads") or heads,
    head_dim=config.get("head_dim") or config["hidden_size"] // heads,
    d_ff=config["intermediate_size"],
    vocab=config["vocab_size"],
    max_len=max_len,
    block=Block.SEQUENTIAL,
    norm_eps=float(config.get("rms_norm_eps", 1e-6)),
    rope_base=_rope_base(config, source),
    tied_embeddings=bool(config.get("tie_word_embeddings", False)),
    activation=_ACTIVATIONS[act],
    qkv_bias=model_type == "qwen2",
  )


def _first_id(value: Any) -> int | None:
  if isinstance(value, list):
    return int(value[0]) if value else None
  return None if value is None else int(value)


def read_vocab(directory: str, config: Mapping[str, Any]):
  """The directory's tokenizer, or None (with a warning) if it has none."""
  path = os.path.join(directory, "tokenizer.json")
  if not os.path.isfile(path):
    logging.warning(
      "%s has no tokenizer.json: the model has no vocab", directory
    )
    return None
  tok_config = _read_json(
    os.path.join(directory, "tokenizer_config.json"), optional=True
  )
  template = tok_config.get("chat_template")
  template_path = os.path.join(directory, "chat_template.jinja")
  if template is None and os.path.isfile(template_path):
    with open(template_path, encoding="utf-8") as f:
      template = f.read()
  generation = _read_json(
    os.path.join(directory, "generation_config.json"), optional=True
  )
  eos = _first_id(generation.get("eos_token_id", config.get("eos_token_id")))
  return TokenizerVocabulary.from_file(
    path,
    bos_id=_first_id(config.get("bos_token_id")),
    eos_id=eos,
    pad_id=_first_id(config.get("pad_token_id")),
    chat_template=template if isinstance(template, str) else None,
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
  files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
  if not files:
    raise FileNotFoundError(
      f"{directory} has no *.safetensors weights (PyTorch .bin files are "
      "not read; convert them with save_pretrained(safe_serialization=True))"
    )
  tensors = {}
  for name in files:
    for key, value in safetensors.read(os.path.join(directory, name)).items():
      tensors[key.removeprefix("model.")] = value
  weights = llama.to_weights(
    hparams, tensors.__getitem__, tensors, dtype=dtype, source=directory
  )
  return llama.Imported(hparams, weights, read_vocab(directory, config))
