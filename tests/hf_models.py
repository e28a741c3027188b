"""Tiny random Hugging Face models, and GGUF files written from them the
way llama.cpp's converter writes them, for parity tests against
transformers (the reference nobody here wrote)."""

import math

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as QType
from gguf import quants

from chunkwise.checkpoints.gguf import permute_rows

CONFIGS = {
  "llama": transformers.LlamaConfig,
  "mistral": transformers.MistralConfig,
  "qwen2": transformers.Qwen2Config,
}


def tiny(
  kind="llama", *, heads=4, kv_heads=2, tied=False, vocab=128, seed=0, **kw
):
  """A 2-layer model with every parameter random (norm scales near 1,
  biases near 0 but not equal to them), so a dropped scale, bias or
  transpose cannot hide."""
  sizes = dict(hidden_size=64, intermediate_size=96, head_dim=16)
  config = CONFIGS[kind](
    vocab_size=vocab,
    num_hidden_layers=2,
    num_attention_heads=heads,
    num_key_value_heads=kv_heads,
    rope_theta=500.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    tie_word_embeddings=tied,
    **{**sizes, **kw},
  )
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  _randomize(model, seed)
  return model


# Tiny models of each architecture: 4 layers, windows of 8 positions and
# pretraining contexts of 16, so 40-token rows reach past every window and
# switch every length-dependent RoPE to its long form.
ARCHITECTURES = {
  "llama-3.1": (
    transformers.LlamaConfig,
    dict(
      rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
      )
    ),
  ),
  "llama-linear": (
    transformers.LlamaConfig,
    dict(rope_scaling=dict(rope_type="linear", factor=4.0)),
  ),
  "llama-dynamic": (
    transformers.LlamaConfig,
    dict(
      max_position_embeddings=16,
      rope_scaling=dict(rope_type="dynamic", factor=4.0),
    ),
  ),
  "qwen2-yarn": (
    transformers.Qwen2Config,
    dict(
      rope_scaling=dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=16
      )
    ),
  ),
  "mistral-window": (transformers.MistralConfig, dict(sliding_window=8)),
  "phi3-longrope": (
    transformers.Phi3Config,
    dict(
      original_max_position_embeddings=16,
      rope_scaling=dict(
        type="longrope",
        short_factor=[1.0, 1.1, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5],
        long_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0],
      ),
      sliding_window=8,
    ),
  ),
  "phi3-partial-rotary": (
    transformers.Phi3Config,
    dict(partial_rotary_factor=0.5),
  ),
  "gemma2": (
    transformers.Gemma2Config,
    dict(
      sliding_window=8,
      query_pre_attn_scalar=24,
      attn_logit_softcapping=3.0,
      final_logit_softcapping=2.0,
    ),
  ),
  "gemma3": (
    transformers.Gemma3TextConfig,
    dict(
      sliding_window=8,
      query_pre_attn_scalar=24,
      layer_types=["sliding_attention", "full_attention"] * 2,
      rope_parameters=dict(
        sliding_attention=dict(rope_type="default", rope_theta=100.0),
        full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e3),
      ),
    ),
  ),
}


def tiny_architecture(name, *, seed=0, **changes):
  """A 4-layer random model of `ARCHITECTURES[name]` (parameters as in
  `tiny`; Gemma's stored norm scales w near 0, for scales 1 + w)."""
  cls, kw = ARCHITECTURES[name]
  config = cls(
    **{
      **dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
      ),
      **kw,
      **changes,
    }
  )
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  offset = 0.0 if config.model_type.startswith("gemma") else 1.0
  _randomize(model, seed, norm_offset=offset)
  return model


def _randomize(model, seed, norm_offset=1.0):
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=generator)
      if name.endswith("norm.weight"):
        p.copy_(norm_offset + 0.1 * noise)
      elif name.endswith(".bias"):
        p.copy_(0.1 * noise)
      else:
        p.copy_(noise / math.sqrt(p.shape[-1]))


def _padded(rows):
  width = max(len(r) for r in rows)
  ids = torch.zeros((len(rows), width), dtype=torch.long)
  mask = torch.zeros((len(rows), width), dtype=torch.long)
  for i, row in enumerate(rows):
    ids[i, : len(row)] = torch.tensor(row)
    mask[i, : len(row)] = 1
  return ids, mask


def logits(model, rows):
  """f32[batch, time, vocab] of a right-padded batch (attention mask set)."""
  ids, mask = _padded(rows)
  with torch.no_grad():
    return model(input_ids=ids, attention_mask=mask).logits.numpy()


def split_logits(model, rows, at):
  """`logits` computed in two calls, columns [0, at) and then the rest
  with the first call's cache (as a chat continues a conversation): RoPE
  that depends on a call's length ("dynamic", "longrope") differs from
  one call's."""
  ids, mask = _padded(rows)
  with torch.no_grad():
    first = model(
      input_ids=ids[:, :at], attention_mask=mask[:, :at], use_cache=True
    )
    second = model(
      input_ids=ids[:, at:],
      attention_mask=mask,
      past_key_values=first.past_key_values,
    )
  return torch.cat([first.logits, second.logits], dim=1).numpy()


_GGUF_NAMES = {
  "input_layernorm.weight": "attn_norm.weight",
  "post_attention_layernorm.weight": "ffn_norm.weight",
  "self_attn.q_proj.weight": "attn_q.weight",
  "self_attn.k_proj.weight": "attn_k.weight",
  "self_attn.v_proj.weight": "attn_v.weight",
  "self_attn.o_proj.weight": "attn_output.weight",
  "mlp.gate_proj.weight": "ffn_gate.weight",
  "mlp.up_proj.weight": "ffn_up.weight",
  "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensors(model):
  """llama.cpp's names and row order for a Llama model's tensors."""
  c = model.config
  out = {}
  for name, value in model.state_dict().items():
    value = value.float().numpy()
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
      out["token_embd.weight"] = value
    elif name == "norm.weight":
      out["output_norm.weight"] = value
    elif name == "lm_head.weight":
      if not c.tie_word_embeddings:
        out["output.weight"] = value
    else:
      _, layer, rest = name.split(".", 2)
      if rest == "self_attn.q_proj.weight":
        value = permute_rows(value, c.num_attention_heads)
      elif rest == "self_attn.k_proj.weight":
        value = permute_rows(value, c.num_key_value_heads)
      out[f"blk.{layer}.{_GGUF_NAMES[rest]}"] = value
  return out


def _writer(c, path, arch):
  """A GGUFWriter with the sizes every architecture states."""
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(c.num_hidden_layers)
  writer.add_context_length(c.max_position_embeddings)
  writer.add_embedding_length(c.hidden_size)
  writer.add_feed_forward_length(c.intermediate_size)
  writer.add_head_count(c.num_attention_heads)
  writer.add_head_count_kv(c.num_key_value_heads)
  writer.add_layer_norm_rms_eps(c.rms_norm_eps)
  writer.add_vocab_size(c.vocab_size)
  return writer


def write_gguf(
  model,
  path,
  qtype=QType.F32,
  vocab_tokens=None,
  *,
  edit_metadata=None,
  drop=(),
  rows=None,
  qtypes=None,
):
  """Writes `model` as a llama-architecture GGUF; matrices in `qtype`
  (or `qtypes(name)` per tensor: types the gguf package cannot quantize,
  the K-quants, get `random_blocks` of the tensor's scale), norms in F32.
  `vocab_tokens`: optional byte-level token list (tokenizer model "gpt2",
  no merges). To write broken files: `edit_metadata(writer)`
  adds fields or tensors, `drop` leaves tensors out, `rows` ({name: n})
  keeps only a tensor's first n rows."""
  c = model.config
  writer = _writer(c, path, "llama")
  writer.add_rope_dimension_count(c.head_dim)
  writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
  if vocab_tokens is not None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(vocab_tokens)
    writer.add_token_types([1] * len(vocab_tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
  if edit_metadata is not None:
    edit_metadata(writer)
  for name, value in gguf_tensors(model).items():
    if name in drop:
      continue
    if rows and name in rows:
      value = value[: rows[name]]
    kind = qtype if qtypes is None else qtypes(name)
    if value.ndim == 2 and kind != QType.F32:
      try:
        raw = quants.quantize(value, kind)
      except NotImplementedError:
        seed = sum(map(ord, name))
        raw = random_blocks(value.shape, kind, np.abs(value).mean(), seed)
      writer.add_tensor(name, raw, raw_dtype=kind)
    else:
      writer.add_tensor(name, np.ascontiguousarray(value, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def random_blocks(shape, kind, mean_abs, seed):
  """Raw blocks of `kind` (a K-quant) for a tensor of `shape`: random
  codes, sub-block scales and mins, with f16 super-block scales set so
  that entries have about `mean_abs` magnitude."""
  rng = np.random.default_rng(seed)
  block, size = gguf.GGML_QUANT_SIZES[kind]
  rows, cols = shape
  b = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)

  def put(at, value):
    scale = rng.uniform(0.5, 1.5, (len(b), 1)) * value
    b[:, at : at + 2] = scale.astype(np.float16).view(np.uint8)

  if kind == QType.Q6_K:  # d * sc * (q - 32): |sc| ~ 64, |q - 32| ~ 16
    put(208, mean_abs / (64 * 16))
  else:  # d * sc * q - dmin * m: sc, m ~ 32, q ~ 8 (Q4) or 16 (Q5)
    q = 8 if kind == QType.Q4_K else 16
    put(0, mean_abs / (32 * q))
    put(2, mean_abs / 32)
  return b.reshape(rows, -1)


_GGUF_ARCH = {
  "llama": "llama",
  "mistral": "llama",
  "qwen2": "qwen2",
  "gemma2": "gemma2",
  "gemma3_text": "gemma3",
  "phi3": "phi3",
}
_GGUF_LAYER_NAMES = {
  **_GGUF_NAMES,
  "self_attn.q_proj.bias": "attn_q.bias",
  "self_attn.k_proj.bias": "attn_k.bias",
  "self_attn.v_proj.bias": "attn_v.bias",
  "self_attn.qkv_proj.weight": "attn_qkv.weight",
  "self_attn.q_norm.weight": "attn_q_norm.weight",
  "self_attn.k_norm.weight": "attn_k_norm.weight",
  "mlp.gate_up_proj.weight": "ffn_up.weight",
  "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def _llama3_rope_freqs(c):
  """llama.cpp's `rope_freqs` for Llama 3.1+ scaling: each frequency's
  divisor."""
  p = c.rope_parameters
  dim = c.head_dim
  base = p["rope_theta"]
  freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  old = p["original_max_position_embeddings"]
  low, high, factor = p["low_freq_factor"], p["high_freq_factor"], p["factor"]
  out = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < old / high:
      out.append(1.0)
    elif wavelen > old / low:
      out.append(factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(out, np.float32)


def write_gguf_architecture(model, path):
  """Writes `model` (any of `ARCHITECTURES`) in F32 as llama.cpp's
  converter lays it out for its architecture: names, Q/K row order
  (llama only), Gemma's norms stored as 1 + w, Phi-3's fused tensors,
  RoPE scaling keys and factor tensors."""
  c = model.config
  arch = _GGUF_ARCH[c.model_type]
  gemma = arch.startswith("gemma")
  writer = _writer(c, path, arch)
  writer.add_key_length(c.head_dim)
  writer.add_value_length(c.head_dim)
  params = c.rope_parameters
  if "full_attention" in params:  # Gemma 3: one set per layer type
    writer.add_rope_freq_base_swa(params["sliding_attention"]["rope_theta"])
    params = params["full_attention"]
  writer.add_rope_freq_base(params["rope_theta"])
  rotary = int(c.head_dim * params.get("partial_rotary_factor", 1.0))
  writer.add_rope_dimension_count(rotary)
  kind = params.get("rope_type", "default")
  extra = {}
  if kind == "linear":
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(params["factor"])
  elif kind == "yarn":
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(params["factor"])
    writer.add_rope_scaling_orig_ctx_len(
      params["original_max_position_embeddings"]
    )
  elif kind == "llama3":
    extra["rope_freqs.weight"] = _llama3_rope_freqs(c)
  elif kind == "longrope":
    original = params["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    scale = c.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(
      math.sqrt(1 + math.log(scale) / math.log(original))
    )
    extra["rope_factors_long.weight"] = np.float32(params["long_factor"])
    extra["rope_factors_short.weight"] = np.float32(params["short_factor"])
  if getattr(c, "sliding_window", None) and arch != "llama":
    writer.add_sliding_window(c.sliding_window)
    types = getattr(c, "layer_types", None)
    if types is not None:
      writer.add_sliding_window_pattern(
        [t == "sliding_attention" for t in types]
      )
  if getattr(c, "attn_logit_softcapping", None):
    writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
  if getattr(c, "final_logit_softcapping", None):
    writer.add_final_logit_softcapping(c.final_logit_softcapping)
  for name, value in model.state_dict().items():
    value = value.float().numpy()
    name = name.removeprefix("model.")
    if name == "lm_head.weight" and c.tie_word_embeddings:
      continue
    if gemma and name.endswith("norm.weight"):
      value = value + 1
    if name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
      out = {
        "embed_tokens.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
      }[name]
    else:
      _, layer, rest = name.split(".", 2)
      if arch == "llama" and rest == "self_attn.q_proj.weight":
        value = permute_rows(value, c.num_attention_heads)
      elif arch == "llama" and rest == "self_attn.k_proj.weight":
        value = permute_rows(value, c.num_key_value_heads)
      if gemma and rest == "post_attention_layernorm.weight":
        short = "post_attention_norm.weight"
      elif gemma and rest == "pre_feedforward_layernorm.weight":
        short = "ffn_norm.weight"
      else:
        short = _GGUF_LAYER_NAMES[rest]
      out = f"blk.{layer}.{short}"
    writer.add_tensor(out, np.ascontiguousarray(value, np.float32))
  for name, value in extra.items():
    writer.add_tensor(name, value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
