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
  config = CONFIGS[kind](
    vocab_size=vocab,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=heads,
    num_key_value_heads=kv_heads,
    head_dim=16,
    rope_theta=500.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    tie_word_embeddings=tied,
    **kw,
  )
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=generator)
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.1 * noise)
      elif name.endswith(".bias"):
        p.copy_(0.1 * noise)
      else:
        p.copy_(noise / math.sqrt(p.shape[-1]))
  return model


def logits(model, rows):
  """f32[batch, time, vocab] of a right-padded batch (attention mask set)."""
  width = max(len(r) for r in rows)
  ids = torch.zeros((len(rows), width), dtype=torch.long)
  mask = torch.zeros((len(rows), width), dtype=torch.long)
  for i, row in enumerate(rows):
    ids[i, : len(row)] = torch.tensor(row)
    mask[i, : len(row)] = 1
  with torch.no_grad():
    return model(input_ids=ids, attention_mask=mask).logits.numpy()


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


def write_gguf(
  model,
  path,
  qtype=QType.F32,
  vocab_tokens=None,
  *,
  edit_metadata=None,
  drop=(),
  rows=None,
):
  """Writes `model` as a llama-architecture GGUF; matrices in `qtype`,
  norms in F32. `vocab_tokens`: optional byte-level token list (tokenizer
  model "gpt2", no merges). To write broken files: `edit_metadata(writer)`
  adds fields or tensors, `drop` leaves tensors out, `rows` ({name: n})
  keeps only a tensor's first n rows."""
  c = model.config
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(c.num_hidden_layers)
  writer.add_context_length(c.max_position_embeddings)
  writer.add_embedding_length(c.hidden_size)
  writer.add_feed_forward_length(c.intermediate_size)
  writer.add_head_count(c.num_attention_heads)
  writer.add_head_count_kv(c.num_key_value_heads)
  writer.add_rope_dimension_count(c.head_dim)
  writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
  writer.add_layer_norm_rms_eps(c.rms_norm_eps)
  writer.add_vocab_size(c.vocab_size)
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
    if value.ndim == 2 and qtype != QType.F32:
      writer.add_tensor(name, quants.quantize(value, qtype), raw_dtype=qtype)
    else:
      writer.add_tensor(name, np.ascontiguousarray(value, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
