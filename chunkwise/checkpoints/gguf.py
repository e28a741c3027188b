"""GGUF files (llama.cpp's format) of the `llama` architecture.

  imported = gguf.read("SmolLM2-135M-Instruct.Q4_1.gguf")
  imported.hparams            # from the `llama.*` metadata
  imported.weights            # dequantized, Q/K rows un-permuted
  imported.vocab.chat_template

Tensors are dequantized with the `gguf` package's own routines (F32, F16,
BF16, Q8_0, Q4_0, Q4_1, the K-quants, ...), one at a time. llama.cpp's
converter permutes the rows of `attn_q` / `attn_k` so that its RoPE rotates
adjacent pairs (2i, 2i+1); chunkwise, like Hugging Face, rotates the halves
(i, i + head_dim/2), so those rows are permuted back. The tokenizer is
rebuilt from the `tokenizer.ggml.*` metadata (see `tokenizer.py`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from absl import logging

from chunkwise.checkpoints import llama
from chunkwise.checkpoints.tokenizer import (
  TokenizerVocabulary,
  byte_level_bpe,
  sentencepiece_bpe,
)
from chunkwise.configs import Block, HParams

SUPPORTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
  "token_embd.weight": "embed_tokens.weight",
  "output_norm.weight": "norm.weight",
  "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
  "attn_norm.weight": "input_layernorm.weight",
  "ffn_norm.weight": "post_attention_layernorm.weight",
  "attn_q.weight": "self_attn.q_proj.weight",
  "attn_k.weight": "self_attn.k_proj.weight",
  "attn_v.weight": "self_attn.v_proj.weight",
  "attn_output.weight": "self_attn.o_proj.weight",
  "ffn_gate.weight": "mlp.gate_proj.weight",
  "ffn_up.weight": "mlp.up_proj.weight",
  "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(name: str) -> str:
  """llama.cpp's tensor name -> Hugging Face's (unknown names unchanged)."""
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  match = _LAYER.fullmatch(name)
  if match and match.group(2) in _LAYER_NAMES:
    return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
  return name


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row order: within each head, rows come as
  interleaved pairs (0, D/2, 1, D/2+1, ...); Hugging Face has halves."""
  rows = w.shape[0]
  return (
    w.reshape(heads, rows // heads // 2, 2, *w.shape[1:])
    .swapaxes(1, 2)
    .reshape(w.shape)
  )


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """The inverse of `unpermute_rows` (what llama.cpp's converter does)."""
  rows = w.shape[0]
  return (
    w.reshape(heads, 2, rows // heads // 2, *w.shape[1:])
    .swapaxes(1, 2)
    .reshape(w.shape)
  )


def metadata(reader) -> dict[str, Any]:
  """Every key/value field of a `gguf.GGUFReader`, as Python values."""
  return {name: field.contents() for name, field in reader.fields.items()}


def hparams_from_metadata(
  meta: Mapping[str, Any], vocab: int, tied: bool, source: str
) -> HParams:
  """`HParams` of a `llama`-architecture file; rejects what chunkwise would
  compute differently (RoPE scaling, partial rotary embeddings)."""
  arch = meta.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
      f"{source}: general.architecture={arch!r} is not supported; expected "
      f"one of {', '.join(SUPPORTED_ARCHITECTURES)}"
    )

  def key(name: str, default: Any = None) -> Any:
    value = meta.get(f"{arch}.{name}", default)
    if value is None:
      raise ValueError(f"{source}: metadata {arch}.{name} is missing")
    if isinstance(value, list):
      raise ValueError(
        f"{source}: {arch}.{name} varies by layer ({value[:4]}...); not "
        "supported"
      )
    return value

  scaling = meta.get(f"{arch}.rope.scaling.type", "none")
  if scaling not in (None, "none"):
    raise ValueError(
      f"{source}: RoPE scaling {scaling!r} is not supported (only plain RoPE)"
    )
  d_model = int(key("embedding_length"))
  heads = int(key("attention.head_count"))
  head_dim = int(key("attention.key_length", d_model // heads))
  rotary = int(key("rope.dimension_count", head_dim))
  if rotary != head_dim:
    raise ValueError(
      f"{source}: rope.dimension_count={rotary} differs from head_dim="
      f"{head_dim}; partial rotary embeddings are not supported"
    )
  return HParams(
    layers=int(key("block_count")),
    d_model=d_model,
    heads=heads,
    kv_heads=int(key("attention.head_count_kv", heads)),
    head_dim=head_dim,
    d_ff=int(key("feed_forward_length")),
    vocab=vocab,
    max_len=int(key("context_length")),
    block=Block.SEQUENTIAL,
    norm_eps=float(key("attention.layer_norm_rms_epsilon")),
    rope_base=float(key("rope.freq_base", 10_000.0)),
    tied_embeddings=tied,
  )


def vocab_from_metadata(
  meta: Mapping[str, Any], source: str
) -> TokenizerVocabulary | None:
  """The tokenizer the `tokenizer.ggml.*` fields describe (None if none)."""
  kind = meta.get("tokenizer.ggml.model")
  if kind is None or kind == "none":
    logging.warning("%s has no tokenizer: the model has no vocab", source)
    return None
  tokens = meta["tokenizer.ggml.tokens"]
  types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
  unk = meta.get("tokenizer.ggml.unknown_token_id")
  if kind == "gpt2":
    pre = meta.get("tokenizer.ggml.pre")
    if pre is None:
      logging.warning("%s names no pre-tokenizer; using GPT-2's", source)
      pre = "gpt2"
    tokenizer = byte_level_bpe(
      tokens, meta.get("tokenizer.ggml.merges", []), types, pre
    )
  elif kind == "llama":
    tokenizer = sentencepiece_bpe(
      tokens,
      meta["tokenizer.ggml.scores"],
      types,
      unk_id=unk,
      add_space_prefix=meta.get("tokenizer.ggml.add_space_prefix", True),
    )
  else:
    raise ValueError(
      f"{source}: tokenizer.ggml.model={kind!r} is not supported; expected "
      "'gpt2' (byte-level BPE) or 'llama' (SentencePiece BPE)"
    )
  return TokenizerVocabulary(
    tokenizer,
    bos_id=meta.get("tokenizer.ggml.bos_token_id"),
    eos_id=meta.get("tokenizer.ggml.eos_token_id"),
    pad_id=meta.get("tokenizer.ggml.padding_token_id"),
    unk_id=unk,
    chat_template=meta.get("tokenizer.chat_template"),
  )


def dequantize(tensor) -> np.ndarray:
  """A `gguf.ReaderTensor` as float32 in NumPy order ([out, in])."""
  from gguf import quants

  try:
    return np.asarray(
      quants.dequantize(tensor.data, tensor.tensor_type), np.float32
    )
  except NotImplementedError:
    raise ValueError(
      f"tensor {tensor.name} has type {tensor.tensor_type.name}, which the "
      "gguf package cannot dequantize"
    ) from None


def _open(path: str | os.PathLike):
  """(metadata, tensors by HF name, HParams) of a GGUF file; reads no
  tensor data."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no GGUF file at {path}")
  try:
    import gguf
  except ImportError as e:
    raise ImportError(
      "reading GGUF files needs the gguf package: pip install gguf "
      "(or chunkwise[gguf])"
    ) from e
  try:
    reader = gguf.GGUFReader(path)
  except (ValueError, OSError) as e:
    raise ValueError(f"{path} is not a readable GGUF file: {e}") from None
  meta = metadata(reader)
  tensors = {hf_name(t.name): t for t in reader.tensors}
  embedding = tensors.get("embed_tokens.weight")
  if embedding is None:
    raise ValueError(f"{path}: no token_embd.weight tensor")
  hparams = hparams_from_metadata(
    meta,
    vocab=int(embedding.shape[-1]),  # GGUF shapes are [in, out]
    tied="lm_head.weight" not in tensors,
    source=path,
  )
  return meta, tensors, hparams


def describe(path: str | os.PathLike) -> tuple[HParams, Any]:
  """(HParams, vocabulary) of a GGUF file, without reading its weights."""
  meta, _, hparams = _open(path)
  return hparams, vocab_from_metadata(meta, os.fspath(path))


def read(path: str | os.PathLike, *, dtype=jnp.float32) -> llama.Imported:
  """Reads a `llama`-architecture GGUF file.

  Raises:
    FileNotFoundError: no such file.
    ImportError: the `gguf` package is missing (pip install gguf).
    ValueError: not a GGUF file, an unsupported architecture, quantization
      or tokenizer, or tensors that are missing or misshapen.
  """
  path = os.fspath(path)
  meta, tensors, hparams = _open(path)

  def get(name: str) -> np.ndarray:
    value = dequantize(tensors[name])
    heads = {"q_proj.weight": hparams.heads, "k_proj.weight": hparams.kv_heads}
    for suffix, n in heads.items():
      # A misshapen tensor is left as it is for to_weights to report.
      if name.endswith(suffix) and value.shape[0] == n * hparams.head_dim:
        return unpermute_rows(value, n)
    return value

  weights = llama.to_weights(hparams, get, tensors, dtype=dtype, source=path)
  return llama.Imported(hparams, weights, vocab_from_metadata(meta, path))
