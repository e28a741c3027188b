"""Tensors with Hugging Face names and orientation -> `Weights`.

Both importers hand over tensors named as in Hugging Face's causal LMs
(`LlamaForCausalLM`, `Gemma2ForCausalLM`, ...) without the `model.` prefix,
in PyTorch's [out, in] orientation; the GGUF importer renames llama.cpp's
tensors and undoes their Q/K row permutation first. Fused tensors (Phi-3's
`qkv_proj` and `gate_up_proj`) are split by `unfuse`. This module checks
every shape against `HParams` and transposes to chunkwise's
contraction-first layout:

  q_proj [heads*head_dim, d_model]   -> Layer.q [layers, d_model, heads,
                                                 head_dim]
  o_proj [d_model, heads*head_dim]   -> Layer.o [layers, heads, head_dim,
                                                 d_model]
  gate_proj / up_proj [d_ff, d_model] -> [layers, d_model, d_ff]
  down_proj [d_model, d_ff]          -> [layers, d_ff, d_model]
  lm_head [vocab, d_model]           -> Weights.unembedding [d_model, vocab]

Norms: `input_layernorm` is the attention's; with `post_norms` (Gemma 2/3)
`post_attention_layernorm` and `post_feedforward_layernorm` norm the
branches' outputs and `pre_feedforward_layernorm` is the MLP's, otherwise
`post_attention_layernorm` is the MLP's. Gemma's checkpoints store norm
scales w for (1 + w): the importer passes `norm_offset=1` (llama.cpp's
GGUF files store 1 + w already).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from chunkwise.checkpoints import gguf_blocks
from chunkwise.configs import HParams
from chunkwise.models import Layer, Weights, check_shapes

# Tensors some checkpoints carry that the model recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class Imported:
  """What an importer returns: shapes, weights and the tokenizer."""

  hparams: HParams
  weights: Weights
  vocab: Any  # a Vocabulary, or None when the checkpoint has no tokenizer


# Layer norm fields -> their tensor names, without and with post_norms.
_NORMS = {
  False: {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
  },
  True: {
    "attn_norm": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
  },
}


def _layer_names(hparams: HParams, i: int) -> dict[str, tuple[int, ...]]:
  d, dh = hparams.d_model, hparams.head_dim
  q, kv = hparams.heads * dh, hparams.kv_heads * dh
  p = f"layers.{i}."
  names = {
    p + "self_attn.q_proj.weight": (q, d),
    p + "self_attn.k_proj.weight": (kv, d),
    p + "self_attn.v_proj.weight": (kv, d),
    p + "self_attn.o_proj.weight": (d, q),
    p + "mlp.gate_proj.weight": (hparams.d_ff, d),
    p + "mlp.up_proj.weight": (hparams.d_ff, d),
    p + "mlp.down_proj.weight": (d, hparams.d_ff),
  }
  for tensor in _NORMS[hparams.post_norms].values():
    names[p + tensor + ".weight"] = (d,)
  if hparams.qk_norm:
    names[p + "self_attn.q_norm.weight"] = (dh,)
    names[p + "self_attn.k_norm.weight"] = (dh,)
  if hparams.qkv_bias:
    names[p + "self_attn.q_proj.bias"] = (q,)
    names[p + "self_attn.k_proj.bias"] = (kv,)
    names[p + "self_attn.v_proj.bias"] = (kv,)
  return names


def expected_shapes(
  hparams: HParams, layers: int | None = None
) -> dict[str, tuple[int, ...]]:
  """Every tensor name a checkpoint for `hparams` holds, with its shape
  (of the first `layers` layers only, if given)."""
  names = {
    "embed_tokens.weight": (hparams.vocab, hparams.d_model),
    "norm.weight": (hparams.d_model,),
  }
  if not hparams.tied_embeddings:
    names["lm_head.weight"] = (hparams.vocab, hparams.d_model)
  for i in range(hparams.layers if layers is None else layers):
    names.update(_layer_names(hparams, i))
  return names


def check_names(
  hparams: HParams, available: Collection[str], source: str
) -> dict[str, tuple[int, ...]]:
  """Raises ValueError for missing tensors and for ones the model would
  silently drop (a bias or a norm this architecture has no place for).
  Returns `expected_shapes(hparams)`.

  Only as many layers are listed as the tensors could fill, so a file
  that declares absurdly many layers is refused without listing them."""
  per_layer = len(_layer_names(hparams, 0))
  listed = min(hparams.layers, len(available) // per_layer + 1)
  want = expected_shapes(hparams, listed)
  missing = sorted(set(want) - set(available))
  if missing:
    count = len(missing) + (hparams.layers - listed) * per_layer
    raise ValueError(
      f"{source}: {count} tensor(s) missing, e.g. "
      f"{', '.join(missing[:5])} (for {hparams})"
    )
  extra = sorted(
    name
    for name in set(available) - set(want)
    if not name.endswith(IGNORED_SUFFIXES)
    and not (hparams.tied_embeddings and name == "lm_head.weight")
  )
  if extra:
    raise ValueError(
      f"{source}: tensor(s) this Llama-family model has no place for: "
      f"{', '.join(extra[:5])}"
    )
  return want


def check_special_ids(hparams: HParams, vocab, source: str) -> None:
  """The tokenizer's BOS / EOS / pad ids must be rows of the embedding
  (checked before any weight is read)."""
  for name in ("bos_id", "eos_id", "pad_id"):
    value = getattr(vocab, name, None)
    if value is not None and not 0 <= value < hparams.vocab:
      raise ValueError(
        f"{source}: the tokenizer's {name}={value} is outside the model's "
        f"{hparams.vocab} embedding rows"
      )


def _check_shape(name, shape, want, hparams, source) -> None:
  if shape != want:
    raise ValueError(
      f"{source}: tensor {name} has shape {shape}, expected {want} for "
      f"{hparams}"
    )


# Fused tensor -> (its parts, each part's rows as a function of HParams).
_FUSED = {
  "self_attn.qkv_proj.weight": (
    (
      "self_attn.q_proj.weight",
      "self_attn.k_proj.weight",
      "self_attn.v_proj.weight",
    ),
    lambda h: (
      h.heads * h.head_dim,
      h.kv_heads * h.head_dim,
      h.kv_heads * h.head_dim,
    ),
  ),
  "mlp.gate_up_proj.weight": (
    ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    lambda h: (h.d_ff, h.d_ff),
  ),
}


def _blocked(value) -> bool:
  """A tensor kept in its quantized blocks (`gguf_blocks.HostBlocks`)."""
  return isinstance(value, gguf_blocks.HostBlocks)


def unfuse(
  hparams: HParams,
  get: Callable[[str], np.ndarray],
  shapes: Mapping[str, tuple[int, ...]],
  source: str,
) -> tuple[Callable[[str], np.ndarray], dict[str, tuple[int, ...]]]:
  """(get, shapes) with every fused tensor (`qkv_proj`, `gate_up_proj`)
  replaced by its parts, cut by rows in order (q, k, v; gate, up); a fused
  tensor whose rows do not add up is refused before anything is read."""
  shapes = dict(shapes)
  parts: dict[str, tuple[str, int, int]] = {}
  for name in list(shapes):
    for fused, (names, rows_of) in _FUSED.items():
      if not name.endswith("." + fused):
        continue
      layer = name[: -len(fused)]
      rows = rows_of(hparams)
      shape = tuple(shapes.pop(name))
      if len(shape) != 2 or shape[0] != sum(rows):
        raise ValueError(
          f"{source}: tensor {name} has shape {shape}, expected "
          f"({sum(rows)}, {hparams.d_model}) for {hparams}"
        )
      start = 0
      for part, n in zip(names, rows, strict=True):
        shapes[layer + part] = (n, shape[1])
        parts[layer + part] = (name, start, start + n)
        start += n
  if not parts:
    return get, shapes
  last: dict[str, np.ndarray] = {}

  def get_part(name: str) -> np.ndarray:
    if name not in parts:
      return get(name)
    fused, start, end = parts[name]
    if fused not in last:
      last.clear()
      value = get(fused)
      last[fused] = value if _blocked(value) else np.asarray(value)
    return last[fused][start:end]

  return get_part, shapes


def to_weights(
  hparams: HParams,
  get: Callable[[str], np.ndarray],
  available: Collection[str],
  *,
  dtype=jnp.float32,
  norm_offset: float = 0.0,
  source: str = "checkpoint",
) -> Weights:
  """Builds `Weights` of `dtype` from Hugging Face-named tensors.

  Args:
    hparams: the model's shapes (already read from the checkpoint).
    get: returns a tensor by name (may dequantize on the fly).
    available: every tensor name the checkpoint holds; a mapping of
      names to their declared shapes has every shape checked before any
      tensor is fetched (nothing is read or allocated for a checkpoint
      whose shapes do not fit).
    dtype: the weights' dtype.
    norm_offset: added to every norm scale (1 for Gemma's (1 + w) norms,
      in f32, before the cast to `dtype`).
    source: names the checkpoint in error messages.
  """
  shapes = check_names(hparams, available, source)
  if isinstance(available, Mapping):
    for name, shape in shapes.items():
      _check_shape(name, tuple(available[name]), shape, hparams, source)
  target = np.dtype(jnp.dtype(dtype))

  def fetch(name: str) -> np.ndarray:
    value = get(name)
    if not _blocked(value):
      value = np.asarray(value)
    _check_shape(name, value.shape, shapes[name], hparams, source)
    return value

  def put(value: np.ndarray) -> jnp.ndarray:
    if _blocked(value):  # quantized blocks kept (`gguf_blocks`)
      return value.to_device()
    return jnp.asarray(value.astype(target, copy=False))

  def norm(name: str) -> jnp.ndarray:
    value = fetch(name)
    if norm_offset:
      value = value.astype(np.float32) + np.float32(norm_offset)
    return put(value)

  h, kvh, dh = hparams.heads, hparams.kv_heads, hparams.head_dim
  d = hparams.d_model
  attn = "self_attn."

  def layer(i: int) -> Layer:
    def one(suffix: str, reshape: Callable[[np.ndarray], np.ndarray]):
      return put(reshape(fetch(f"layers.{i}.{suffix}")))

    out = Layer(
      q=one(attn + "q_proj.weight", lambda w: w.T.reshape(d, h, dh)),
      k=one(attn + "k_proj.weight", lambda w: w.T.reshape(d, kvh, dh)),
      v=one(attn + "v_proj.weight", lambda w: w.T.reshape(d, kvh, dh)),
      o=one(attn + "o_proj.weight", lambda w: w.T.reshape(h, dh, d)),
      gate=one("mlp.gate_proj.weight", np.transpose),
      up=one("mlp.up_proj.weight", np.transpose),
      down=one("mlp.down_proj.weight", np.transpose),
      **{
        field: norm(f"layers.{i}.{tensor}.weight")
        for field, tensor in _NORMS[hparams.post_norms].items()
      },
    )
    if hparams.qk_norm:
      out = out.replace(
        q_norm=norm(f"layers.{i}.{attn}q_norm.weight"),
        k_norm=norm(f"layers.{i}.{attn}k_norm.weight"),
      )
    if hparams.qkv_bias:
      out = out.replace(
        q_bias=one(attn + "q_proj.bias", lambda b: b.reshape(h, dh)),
        k_bias=one(attn + "k_proj.bias", lambda b: b.reshape(kvh, dh)),
        v_bias=one(attn + "v_proj.bias", lambda b: b.reshape(kvh, dh)),
      )
    return out

  layers = tuple(layer(i) for i in range(hparams.layers))
  weights = Weights(
    embedding=put(fetch("embed_tokens.weight")),
    layers=layers,
    final_norm=norm("norm.weight"),
    unembedding=(
      None if hparams.tied_embeddings else put(fetch("lm_head.weight").T)
    ),
  )
  check_shapes(hparams, weights)
  return weights
