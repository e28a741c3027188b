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

from chunkwise import untrusted
from chunkwise.checkpoints import gguf_file, llama
from chunkwise.checkpoints.gguf_tokenizer import (
  byte_level_bpe,
  sentencepiece_bpe,
)
from chunkwise.checkpoints.tokenizer import TokenizerVocabulary
from chunkwise.configs import Block, HParams

SUPPORTED_ARCHITECTURES = ("llama",)
# Largest size (width, depth, length) a file may declare.
MAX_SIZE = 1 << 40

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


def _int(meta: Mapping[str, Any], key: str, source: str, default=None) -> int:
  value = meta.get(key, default)
  if value is None:
    raise ValueError(f"{source}: metadata {key} is missing")
  if isinstance(value, list):
    raise ValueError(
      f"{source}: {key} varies by layer ({value[:4]}...); not supported"
    )
  return untrusted.check_int(value, key, source=source, lo=1, hi=MAX_SIZE)


def _float(meta: Mapping[str, Any], key: str, source: str, default) -> float:
  return untrusted.check_float(meta.get(key, default), key, source=source)


def hparams_from_metadata(
  meta: Mapping[str, Any], vocab: int, tied: bool, source: str
) -> HParams:
  """`HParams` of a `llama`-architecture file; rejects what chunkwise would
  compute differently (RoPE scaling, partial rotary embeddings) and sizes
  that are not positive integers."""
  arch = meta.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
      f"{source}: general.architecture={arch!r} is not supported; expected "
      f"one of {', '.join(SUPPORTED_ARCHITECTURES)}"
    )

  def key(name: str, default: Any = None) -> int:
    return _int(meta, f"{arch}.{name}", source, default)

  scaling = meta.get(f"{arch}.rope.scaling.type", "none")
  if scaling not in (None, "none"):
    raise ValueError(
      f"{source}: RoPE scaling {scaling!r} is not supported (only plain RoPE)"
    )
  d_model = key("embedding_length")
  heads = key("attention.head_count")
  head_dim = key("attention.key_length", max(d_model // heads, 1))
  rotary = key("rope.dimension_count", head_dim)
  if rotary != head_dim:
    raise ValueError(
      f"{source}: rope.dimension_count={rotary} differs from head_dim="
      f"{head_dim}; partial rotary embeddings are not supported"
    )
  with untrusted.named(source):
    return HParams(
      layers=key("block_count"),
      d_model=d_model,
      heads=heads,
      kv_heads=key("attention.head_count_kv", heads),
      head_dim=head_dim,
      d_ff=key("feed_forward_length"),
      vocab=vocab,
      max_len=key("context_length"),
      block=Block.SEQUENTIAL,
      norm_eps=_float(
        meta, f"{arch}.attention.layer_norm_rms_epsilon", source, None
      ),
      rope_base=_float(meta, f"{arch}.rope.freq_base", source, 10_000.0),
      tied_embeddings=tied,
    )


def _list(
  meta: Mapping[str, Any], key: str, kind: type, source: str, n=None
) -> list:
  """`meta[key]`, checked to be a list of `kind` (of length `n`)."""
  value = meta.get(key)
  if not isinstance(value, list) or not all(
    isinstance(v, kind) and not isinstance(v, bool) for v in value
  ):
    raise ValueError(
      f"{source}: metadata {key} is not a list of {kind.__name__}"
    )
  if n is not None and len(value) != n:
    raise ValueError(
      f"{source}: metadata {key} has {len(value)} entries, expected one per "
      f"token ({n})"
    )
  return value


def _optional_id(meta: Mapping[str, Any], key: str, source: str):
  value = meta.get(key)
  if value is None:
    return None
  return untrusted.check_int(value, key, source=source, hi=MAX_SIZE)


def vocab_from_metadata(
  meta: Mapping[str, Any], source: str
) -> TokenizerVocabulary | None:
  """The tokenizer the `tokenizer.ggml.*` fields describe (None if none);
  every field's type and length is checked first."""
  kind = meta.get("tokenizer.ggml.model")
  if kind is None or kind == "none":
    logging.warning("%s has no tokenizer: the model has no vocab", source)
    return None
  tokens = _list(meta, "tokenizer.ggml.tokens", str, source)
  if "tokenizer.ggml.token_type" in meta:
    types = _list(meta, "tokenizer.ggml.token_type", int, source, len(tokens))
  else:
    types = [1] * len(tokens)
  unk = _optional_id(meta, "tokenizer.ggml.unknown_token_id", source)
  if unk is not None and unk >= len(tokens):
    raise ValueError(
      f"{source}: tokenizer.ggml.unknown_token_id={unk} is outside the "
      f"{len(tokens)} tokens"
    )
  template = meta.get("tokenizer.chat_template")
  if template is not None and not isinstance(template, str):
    raise ValueError(f"{source}: tokenizer.chat_template is not a string")
  try:
    if kind == "gpt2":
      pre = meta.get("tokenizer.ggml.pre")
      if pre is None:
        logging.warning("%s names no pre-tokenizer; using GPT-2's", source)
        pre = "gpt2"
      merges = (
        _list(meta, "tokenizer.ggml.merges", str, source)
        if "tokenizer.ggml.merges" in meta
        else []
      )
      tokenizer = byte_level_bpe(tokens, merges, types, pre)
    elif kind == "llama":
      tokenizer = sentencepiece_bpe(
        tokens,
        _list(meta, "tokenizer.ggml.scores", float, source, len(tokens)),
        types,
        unk_id=unk,
        add_space_prefix=bool(
          meta.get("tokenizer.ggml.add_space_prefix", True)
        ),
      )
    else:
      raise ValueError(
        f"tokenizer.ggml.model={kind!r} is not supported; expected "
        "'gpt2' (byte-level BPE) or 'llama' (SentencePiece BPE)"
      )
    return TokenizerVocabulary(
      tokenizer,
      bos_id=_optional_id(meta, "tokenizer.ggml.bos_token_id", source),
      eos_id=_optional_id(meta, "tokenizer.ggml.eos_token_id", source),
      pad_id=_optional_id(meta, "tokenizer.ggml.padding_token_id", source),
      unk_id=unk,
      chat_template=template,
      chat_template_source=f"{source}: tokenizer.chat_template",
    )
  except ValueError as e:
    if source in str(e):
      raise
    raise ValueError(f"{source}: {e}") from None
  except Exception as e:  # the tokenizers library raises plain Exception
    raise ValueError(
      f"{source}: the tokenizer metadata is invalid: {e}"
    ) from None


def _open(path: str | os.PathLike):
  """(GGUF file, tensors by HF name, HParams); reads no tensor data."""
  f = gguf_file.open_file(path)
  path = f.path
  tensors = {hf_name(name): info for name, info in f.tensors.items()}
  embedding = tensors.get("embed_tokens.weight")
  if embedding is None:
    raise ValueError(f"{path}: no token_embd.weight tensor")
  if len(embedding.shape) != 2:
    raise ValueError(
      f"{path}: token_embd.weight has shape {embedding.shape}, expected "
      "[vocab, d_model]"
    )
  hparams = hparams_from_metadata(
    f.metadata,
    vocab=embedding.shape[0],
    tied="lm_head.weight" not in tensors,
    source=path,
  )
  return f, tensors, hparams


def describe(path: str | os.PathLike) -> tuple[HParams, Any]:
  """(HParams, vocabulary) of a GGUF file, without reading its weights."""
  f, _, hparams = _open(path)
  return hparams, vocab_from_metadata(f.metadata, f.path)


def read(path: str | os.PathLike, *, dtype=jnp.float32) -> llama.Imported:
  """Reads a `llama`-architecture GGUF file.

  Every tensor's declared shape is checked against the HParams before any
  is dequantized (see also `gguf_file`).

  Raises:
    FileNotFoundError: no such file.
    ImportError: the `gguf` package is missing (pip install gguf).
    ValueError: not a GGUF file, a malformed one, an unsupported
      architecture, quantization or tokenizer, or tensors that are
      missing or misshapen.
  """
  f, tensors, hparams = _open(path)
  vocab = vocab_from_metadata(f.metadata, f.path)
  llama.check_special_ids(hparams, vocab, f.path)

  def get(name: str) -> np.ndarray:
    value = f.dequantize(tensors[name].name)
    heads = {"q_proj.weight": hparams.heads, "k_proj.weight": hparams.kv_heads}
    for suffix, n in heads.items():
      if name.endswith(suffix):
        return unpermute_rows(value, n)
    return value

  shapes = {name: info.shape for name, info in tensors.items()}
  weights = llama.to_weights(hparams, get, shapes, dtype=dtype, source=f.path)
  return llama.Imported(hparams, weights, vocab)
