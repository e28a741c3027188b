"""Hugging Face checkpoints (Llama, Mistral, Qwen2, Gemma 2/3, Phi-3, and
SmolLM; `hf_config.SUPPORTED_MODEL_TYPES`): a directory with `config.json`,
`*.safetensors` and, optionally, `tokenizer.json` (+
`tokenizer_config.json` / `chat_template.jinja` / `generation_config.json`).

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
from chunkwise.checkpoints import hf_tensors, safetensors
from chunkwise.checkpoints.hf_config import (
  GEMMA,
  MAX_SIZE,
  SUPPORTED_MODEL_TYPES,
  hparams_from_config,
)
from chunkwise.checkpoints.tokenizer import TokenizerVocabulary
from chunkwise.configs import HParams

__all__ = [
  "SUPPORTED_MODEL_TYPES",
  "describe",
  "hparams_from_config",
  "is_checkpoint",
  "read",
  "read_vocab",
]


def is_checkpoint(path: str | os.PathLike) -> bool:
  """Whether `path` is a directory holding a Hugging Face `config.json`."""
  return os.path.isfile(os.path.join(path, "config.json"))


def _read_json(path: str, *, optional: bool = False) -> dict[str, Any]:
  """The JSON object in `path`; {} for a missing `optional` file."""
  if optional and not os.path.isfile(path):
    return {}
  return untrusted.read_json(path)


def _first_id(value: Any, key: str, source: str) -> int | None:
  ids = _ids(value, key, source)
  return ids[0] if ids else None


def _ids(value: Any, key: str, source: str) -> tuple[int, ...]:
  """An id or a list of ids (config.json may list several EOS ids)."""
  values = value if isinstance(value, list) else [value]
  return tuple(
    untrusted.check_int(v, key, source=source, hi=MAX_SIZE)
    for v in values
    if v is not None
  )


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
    eos = _ids(generation["eos_token_id"], "eos_token_id", generation_path)
  else:
    eos = _ids(config.get("eos_token_id"), "eos_token_id", config_path)
  return TokenizerVocabulary.from_file(
    path,
    bos_id=_first_id(config.get("bos_token_id"), "bos_token_id", config_path),
    eos_ids=eos,
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


def read(
  directory: str | os.PathLike, *, dtype=jnp.float32
) -> hf_tensors.Imported:
  """Reads a Hugging Face Llama-family directory.

  Raises:
    FileNotFoundError: no `config.json` or no `*.safetensors` in it.
    ValueError: an unsupported architecture, or tensors that are missing,
      misshapen or unexpected (the message names them).
  """
  directory = os.fspath(directory)
  config, hparams = _config(directory)
  vocab = read_vocab(directory, config)
  hf_tensors.check_special_ids(hparams, vocab, directory)
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
  get, shapes = hf_tensors.unfuse(
    hparams, tensors.__getitem__, shapes, directory
  )
  weights = hf_tensors.to_weights(
    hparams,
    get,
    shapes,
    dtype=dtype,
    norm_offset=1.0 if config.get("model_type") in GEMMA else 0.0,
    source=directory,
  )
  return hf_tensors.Imported(hparams, weights, vocab)
