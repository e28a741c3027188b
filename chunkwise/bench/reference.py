"""The Hugging Face `transformers` reference, timed like chunkwise.

The reference gets *our* weights (dequantized when they are int8), copied
into a `LlamaForCausalLM` (`Qwen2ForCausalLM` with q/k/v biases), so both
sides compute the same model whatever checkpoint format it came from:

  hf = to_transformers(model.hparams, model.plain_weights(), "bfloat16")
  point = decode(hf, prompt_ids, batch=16, steps=128, runs=3)

`generate` is greedy with `min_new_tokens=steps`: every row runs every
step. Needs `torch` (install `torch==2.13.0`, a CPU build) and
`transformers`; they are imported only here.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from chunkwise.bench.timing import Point, timed, timed_prefill
from chunkwise.configs import Activation, Block, HParams
from chunkwise.models.quantized import QArray

TORCH_DTYPES = ("float32", "bfloat16")


def _import():
  try:
    import torch
    import transformers
  except ImportError as e:
    raise ValueError(
      f"the transformers reference needs torch and transformers ({e}); "
      "install torch==2.13.0 (a CPU build) and transformers"
    ) from None
  return torch, transformers


def check_supported(h: HParams) -> None:
  """Raises unless transformers has this architecture (Llama / Qwen2)."""
  if (
    h.block != Block.SEQUENTIAL
    or h.activation != Activation.SILU
    or not h.norm_scale
  ):
    raise ValueError(
      f"the transformers reference runs Llama-style models (sequential "
      f"blocks, SiLU, scaled RMSNorm); this one has block={h.block.value}, "
      f"activation={h.activation.value}, norm_scale={h.norm_scale}"
    )


def _dense(w) -> np.ndarray:
  if isinstance(w, QArray):
    w = w.astype(np.float32)
  return np.asarray(jax.device_get(w), np.float32)


def to_transformers(h: HParams, weights, dtype: str):
  """A transformers causal LM holding `weights` (plain block order) in
  `dtype` ("float32" or "bfloat16")."""
  if dtype not in TORCH_DTYPES:
    raise ValueError(f"dtype={dtype!r}: expected one of {TORCH_DTYPES}")
  check_supported(h)
  torch, transformers = _import()
  config_class = (
    transformers.Qwen2Config if h.qkv_bias else transformers.LlamaConfig
  )
  config = config_class(
    vocab_size=h.vocab,
    hidden_size=h.d_model,
    intermediate_size=h.d_ff,
    num_hidden_layers=h.layers,
    num_attention_heads=h.heads,
    num_key_value_heads=h.kv_heads,
    head_dim=h.head_dim,
    rope_theta=h.rope_base,
    rms_norm_eps=h.norm_eps,
    max_position_embeddings=h.max_len,
    tie_word_embeddings=h.tied_embeddings,
    hidden_act="silu",
  )
  hf = transformers.AutoModelForCausalLM.from_config(
    config, dtype=getattr(torch, dtype)
  ).eval()
  e, lay = h.d_model, weights.layers
  state = {
    "model.embed_tokens.weight": _dense(weights.embedding),
    "model.norm.weight": _dense(weights.final_norm),
  }
  if not h.tied_embeddings:
    state["lm_head.weight"] = _dense(weights.unembedding).T
  for i in range(h.layers):

    def get(name, i=i):
      return _dense(getattr(lay[i], name))

    p = f"model.layers.{i}."
    state |= {
      p + "self_attn.q_proj.weight": get("q").reshape(e, -1).T,
      p + "self_attn.k_proj.weight": get("k").reshape(e, -1).T,
      p + "self_attn.v_proj.weight": get("v").reshape(e, -1).T,
      p + "self_attn.o_proj.weight": get("o").reshape(-1, e).T,
      p + "mlp.gate_proj.weight": get("gate").T,
      p + "mlp.up_proj.weight": get("up").T,
      p + "mlp.down_proj.weight": get("down").T,
      p + "input_layernorm.weight": get("attn_norm"),
      p + "post_attention_layernorm.weight": get("mlp_norm"),
    }
    if h.qkv_bias:
      for name in ("q", "k", "v"):
        state[p + f"self_attn.{name}_proj.bias"] = get(f"{name}_bias").ravel()
  tensors = {
    k: torch.from_numpy(np.array(v, np.float32)) for k, v in state.items()
  }
  missing, unexpected = hf.load_state_dict(tensors, strict=False)
  missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")]
  if h.tied_embeddings:
    missing = [m for m in missing if m != "lm_head.weight"]
  if missing or unexpected:
    raise ValueError(
      f"weights do not fit transformers' model: missing {missing}, "
      f"unexpected {unexpected}"
    )
  return hf


def threads() -> int:
  torch, _ = _import()
  return torch.get_num_threads()


def prefill(hf, ids: np.ndarray, runs: int) -> Point:
  """Times the forward pass (all positions' logits) over `ids`."""
  torch, _ = _import()
  inputs = torch.from_numpy(np.asarray(ids, np.int64))

  def run():
    with torch.inference_mode():
      return hf(input_ids=inputs).logits

  return timed_prefill(run, ids.shape, runs)


def decode(
  hf, prompt: Sequence[int], *, batch: int, steps: int, runs: int
) -> Point:
  """Times greedy `generate` of exactly `steps` tokens for `batch` copies
  of `prompt` (its prefill included, as `generate` does it)."""
  torch, _ = _import()
  ids = torch.tensor([list(prompt)] * batch, dtype=torch.long)
  mask = torch.ones_like(ids)

  def run():
    with torch.inference_mode():
      return hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        pad_token_id=0,
      )

  first, times = timed(run, runs)
  return Point(
    phase="decode",
    batch=batch,
    length=len(prompt),
    steps=steps,
    tokens=batch * steps,
    first_s=first,
    times=tuple(times),
  )
