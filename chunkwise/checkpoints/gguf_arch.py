"""GGUF architectures: `{arch}.*` metadata -> `HParams`, llama.cpp's tensor
names -> Hugging Face's, as llama.cpp's converter writes each of:

  llama   Llama 1-3.3, SmolLM, Mistral (converted as llama); Q/K rows
          permuted for llama.cpp's adjacent-pair RoPE (undone on read);
          Llama 3.1+ frequency factors in the `rope_freqs` tensor
  qwen2   Qwen2 / Qwen2.5: Q/K/V biases
  gemma2  sliding window on even layers, soft caps, sandwich norms
  gemma3  sliding window on all but every 6th layer (local RoPE base
          10000), Q/K norms, sandwich norms
  phi3    fused `attn_qkv` and `ffn_up` (gate then up), LongRoPE factors
          in `rope_factors_short` / `rope_factors_long`

Gemma's norm scales are stored with the 1 of (1 + w) added. Attention is
scaled by 1/sqrt(head_dim), except for Gemma 2/3 27B (1/sqrt(d_model /
heads)), which is what llama.cpp does: the files carry no
`query_pre_attn_scalar`. Anything else is refused with the key named.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from chunkwise import untrusted
from chunkwise.configs import Activation, Block, HParams
from chunkwise.configs.rope import RopeKind, RopeScaling

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma2", "gemma3", "phi3")
GEMMA = ("gemma2", "gemma3")
# Tensors that hold RoPE frequency factors (read into HParams, not weights).
ROPE_TENSORS = (
  "rope_freqs.weight",
  "rope_factors_short.weight",
  "rope_factors_long.weight",
)
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
  "attn_q.bias": "self_attn.q_proj.bias",
  "attn_k.bias": "self_attn.k_proj.bias",
  "attn_v.bias": "self_attn.v_proj.bias",
  "attn_qkv.weight": "self_attn.qkv_proj.weight",
  "attn_output.weight": "self_attn.o_proj.weight",
  "attn_q_norm.weight": "self_attn.q_norm.weight",
  "attn_k_norm.weight": "self_attn.k_norm.weight",
  "post_attention_norm.weight": "post_attention_layernorm.weight",
  "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
  "ffn_gate.weight": "mlp.gate_proj.weight",
  "ffn_up.weight": "mlp.up_proj.weight",
  "ffn_down.weight": "mlp.down_proj.weight",
}
# Where an architecture names a tensor differently from the table above.
_ARCH_NAMES = {
  "gemma2": {"ffn_norm.weight": "pre_feedforward_layernorm.weight"},
  "gemma3": {"ffn_norm.weight": "pre_feedforward_layernorm.weight"},
  "phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"},
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
# Gemma 2 / 3 27B scale queries by 1/sqrt(d_model / heads) (llama.cpp tells
# them by depth).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_LOCAL_BASE = 10_000.0


def hf_name(name: str, arch: str = "llama") -> str:
  """llama.cpp's tensor name -> Hugging Face's (unknown names unchanged)."""
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  match = _LAYER.fullmatch(name)
  if match:
    rest = match.group(2)
    table = {**_LAYER_NAMES, **_ARCH_NAMES.get(arch, {})}
    if rest in table:
      return f"layers.{match.group(1)}.{table[rest]}"
  return name


def permutes_qk(arch: str) -> bool:
  """Whether the converter permuted Q/K rows (llama.cpp's "normal" RoPE)."""
  return arch == "llama"


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


def _optional(meta: Mapping[str, Any], key: str, source: str) -> float | None:
  value = meta.get(key)
  if value is None:
    return None
  value = untrusted.check_float(value, key, source=source)
  return value if value > 0 else None


def _scaling(
  meta: Mapping[str, Any],
  arch: str,
  source: str,
  rotary: int,
  context: int,
  tensor: Callable[[str], np.ndarray | None],
) -> RopeScaling | None:
  kind = meta.get(f"{arch}.rope.scaling.type", "none")
  original = meta.get(f"{arch}.rope.scaling.original_context_length")
  original = (
    None
    if original is None
    else _int(meta, f"{arch}.rope.scaling.original_context_length", source)
  )
  attn_factor = _optional(meta, f"{arch}.rope.scaling.attn_factor", source)

  def factors(name: str) -> tuple[float, ...]:
    values = np.asarray(tensor(name), np.float64).reshape(-1)
    if values.shape[0] != rotary // 2:
      raise ValueError(
        f"{source}: {name} has {values.shape[0]} factors, expected "
        f"{rotary // 2} (half the rotary dims)"
      )
    return tuple(float(v) for v in values)

  with untrusted.named(source):
    if tensor("rope_factors_long.weight") is not None:
      short = factors("rope_factors_short.weight")
      original = original or context
      return RopeScaling(
        kind=RopeKind.LONGROPE,
        factor=context / original,
        original_max_len=original,
        attention_factor=attn_factor,
        short_factors=short,
        long_factors=factors("rope_factors_long.weight"),
      )
    if tensor("rope_freqs.weight") is not None:
      if kind not in (None, "none"):
        raise ValueError(
          f"{source}: rope_freqs together with {arch}.rope.scaling.type="
          f"{kind!r} is not supported"
        )
      return RopeScaling(
        kind=RopeKind.FACTORS, short_factors=factors("rope_freqs.weight")
      )
    if kind in (None, "none"):
      return None
    if kind not in ("linear", "yarn"):
      raise ValueError(
        f"{source}: {arch}.rope.scaling.type={kind!r} is not supported; "
        "expected none, linear, yarn (or rope_freqs / rope_factors tensors)"
      )
    if meta.get(f"{arch}.rope.scaling.factor") is None:
      raise ValueError(
        f"{source}: metadata {arch}.rope.scaling.factor is missing (needed "
        f"by {arch}.rope.scaling.type={kind!r})"
      )
    factor = _float(meta, f"{arch}.rope.scaling.factor", source, None)
    if kind == "linear":
      return RopeScaling(kind=RopeKind.LINEAR, factor=factor)
    if kind == "yarn":
      return RopeScaling(
        kind=RopeKind.YARN,
        factor=factor,
        original_max_len=original or context,
        attention_factor=attn_factor,
      )
  raise ValueError(
    f"{source}: {arch}.rope.scaling.type={kind!r} is not supported; "
    "expected none, linear, yarn (or rope_freqs / rope_factors tensors)"
  )


def _sliding(
  meta: Mapping[str, Any], arch: str, source: str, layers: int
) -> tuple[int | None, tuple[int, ...] | None]:
  window = meta.get(f"{arch}.attention.sliding_window")
  if not window:
    return None, None
  window = _int(meta, f"{arch}.attention.sliding_window", source)
  pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
  if isinstance(pattern, list):
    if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
      raise ValueError(
        f"{source}: {arch}.attention.sliding_window_pattern must list one "
        f"bool per layer ({layers})"
      )
    sliding = tuple(i for i, p in enumerate(pattern) if p)
  else:
    if pattern is None:
      pattern = {"gemma2": 2, "gemma3": 6}.get(arch, 1)
    period = _int(
      {"p": pattern}, "p", f"{source}: {arch}.attention.sliding_window_pattern"
    )
    # llama.cpp: layer i slides when i % period < period - 1 (1: every one).
    sliding = tuple(
      i for i in range(layers) if period == 1 or i % period < period - 1
    )
  if not sliding:
    return None, None
  return window, None if len(sliding) == layers else sliding


def hparams_from_metadata(
  meta: Mapping[str, Any],
  vocab: int,
  tied: bool,
  source: str,
  tensor: Callable[[str], np.ndarray | None] = lambda name: None,
) -> HParams:
  """`HParams` of a file of a supported architecture; rejects what
  chunkwise would compute differently and sizes that are not positive
  integers. `tensor(name)` returns a RoPE factor tensor (`ROPE_TENSORS`)
  or None where the file has none."""
  arch = meta.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
      f"{source}: general.architecture={arch!r} is not supported; expected "
      f"one of {', '.join(SUPPORTED_ARCHITECTURES)}"
    )

  def key(name: str, default: Any = None) -> int:
    return _int(meta, f"{arch}.{name}", source, default)

  gemma = arch in GEMMA
  layers = key("block_count")
  d_model = key("embedding_length")
  heads = key("attention.head_count")
  head_dim = key("attention.key_length", max(d_model // heads, 1))
  if key("attention.value_length", head_dim) != head_dim:
    raise ValueError(
      f"{source}: {arch}.attention.value_length differs from key_length; "
      "not supported"
    )
  rotary = key("rope.dimension_count", head_dim)
  if rotary > head_dim or rotary % 2:
    raise ValueError(
      f"{source}: {arch}.rope.dimension_count={rotary} must be even and at "
      f"most head_dim={head_dim}"
    )
  context = key("context_length")
  window, sliding = _sliding(meta, arch, source, layers)
  query_scale = _optional(meta, f"{arch}.attention.scale", source)
  if gemma and query_scale is None and layers == _GEMMA_27B_LAYERS[arch]:
    query_scale = (d_model / heads) ** -0.5
  local_base = None
  if arch == "gemma3" and window is not None:
    local_base = _float(
      meta, f"{arch}.rope.freq_base_swa", source, _GEMMA3_LOCAL_BASE
    )
  with untrusted.named(source):
    return HParams(
      layers=layers,
      d_model=d_model,
      heads=heads,
      kv_heads=key("attention.head_count_kv", heads),
      head_dim=head_dim,
      d_ff=key("feed_forward_length"),
      vocab=vocab,
      max_len=context,
      block=Block.SEQUENTIAL,
      norm_eps=_float(
        meta, f"{arch}.attention.layer_norm_rms_epsilon", source, None
      ),
      rope_base=_float(meta, f"{arch}.rope.freq_base", source, 10_000.0),
      tied_embeddings=tied,
      activation=Activation.GELU if gemma else Activation.SILU,
      qkv_bias=arch == "qwen2",
      rope_scaling=_scaling(meta, arch, source, rotary, context, tensor),
      rotary_dim=None if rotary == head_dim else rotary,
      sliding_window=window,
      sliding_layers=sliding,
      local_rope_base=local_base,
      query_scale=query_scale,
      attn_softcap=_optional(meta, f"{arch}.attn_logit_softcapping", source),
      final_softcap=_optional(meta, f"{arch}.final_logit_softcapping", source),
      embed_scale=d_model**0.5 if gemma else None,
      post_norms=gemma,
      qk_norm=arch == "gemma3",
    )
