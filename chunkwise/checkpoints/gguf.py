"""GGUF files (llama.cpp's format) of the architectures in `gguf_arch`.

  imported = gguf.read("SmolLM2-135M-Instruct.Q4_1.gguf")
  imported.hparams            # from the `{arch}.*` metadata
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
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from absl import logging

from chunkwise import untrusted
from chunkwise.checkpoints import gguf_blocks, gguf_file, hf_tensors
from chunkwise.checkpoints.gguf_arch import (
  MAX_SIZE,
  ROPE_TENSORS,
  SUPPORTED_ARCHITECTURES,
  hf_name,
  hparams_from_metadata,
  permutes_qk,
)
from chunkwise.checkpoints.gguf_tokenizer import (
  byte_level_bpe,
  sentencepiece_bpe,
)
from chunkwise.checkpoints.tokenizer import TokenizerVocabulary
from chunkwise.configs import HParams

__all__ = [
  "SUPPORTED_ARCHITECTURES",
  "describe",
  "hf_name",
  "hparams_from_metadata",
  "permute_rows",
  "read",
  "unpermute_rows",
  "vocab_from_metadata",
]


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
      eos_ids=[
        i
        for i in (
          _optional_id(meta, f"tokenizer.ggml.{name}_token_id", source)
          for name in ("eos", "eot", "eom")
        )
        if i is not None
      ],
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
  """(GGUF file, tensors by HF name, HParams); reads no tensor data but
  RoPE frequency factors."""
  f = gguf_file.open_file(path)
  path = f.path
  arch = f.metadata.get("general.architecture")
  tensors = {
    hf_name(name, arch): info
    for name, info in f.tensors.items()
    if name not in ROPE_TENSORS
  }
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
    tensor=lambda name: f.dequantize(name) if name in f.tensors else None,
  )
  return f, tensors, hparams


def describe(path: str | os.PathLike) -> tuple[HParams, Any]:
  """(HParams, vocabulary) of a GGUF file, without reading its weights."""
  f, _, hparams = _open(path)
  return hparams, vocab_from_metadata(f.metadata, f.path)


def block_type(path: str | os.PathLike) -> str | None:
  """The block format holding most of a GGUF file's weights as
  `quantize="native"` keeps them ("Q4_K"), None for a float file (what
  the planner counts bytes by)."""
  f = gguf_file.open_file(path)
  counts: dict[str, int] = {}
  for info in f.tensors.values():
    if gguf_blocks.supported(info.qtype.name):
      n = int(np.prod(info.shape))
      counts[info.qtype.name] = counts.get(info.qtype.name, 0) + n
  return max(counts, key=counts.get) if counts else None


def read(
  path: str | os.PathLike, *, dtype=jnp.float32, native: bool = False
) -> hf_tensors.Imported:
  """Reads a GGUF file of a supported architecture (`gguf_arch`).

  With `native`, quantized tensors (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
  Q5_K, Q6_K) stay in their blocks as `models.blocks.BlockArray`s
  (`gguf_blocks`); float tensors become `dtype`. Without, every tensor is
  dequantized to `dtype`.

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
  hf_tensors.check_special_ids(hparams, vocab, f.path)

  permuted = permutes_qk(f.metadata.get("general.architecture"))

  if native:
    gguf_blocks.check_types(f, tensors.values())

  def get(name: str):
    info = tensors[name]
    if native and gguf_blocks.supported(info.qtype.name):
      value = gguf_blocks.decode(f.raw(info.name), info.qtype.name, info.shape)
    else:
      value = f.dequantize(info.name)
    f.release(info.name)  # its pages, read: a view faults them in again
    heads = {"q_proj.weight": hparams.heads, "k_proj.weight": hparams.kv_heads}
    for suffix, n in heads.items():
      if permuted and name.endswith(suffix):
        if isinstance(value, gguf_blocks.HostBlocks):
          return value.map_rows(lambda a, n=n: unpermute_rows(a, n))
        return unpermute_rows(value, n)
    return value

  shapes = {name: info.shape for name, info in tensors.items()}
  get, shapes = hf_tensors.unfuse(hparams, get, shapes, f.path)
  weights = hf_tensors.to_weights(
    hparams, get, shapes, dtype=dtype, source=f.path
  )
  return hf_tensors.Imported(hparams, weights, vocab)
