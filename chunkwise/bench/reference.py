"""The Hugging Face `transformers` reference, timed like chunkwise.

The reference gets *our* weights (dequantized when they are int8), copied
into a `LlamaForCausalLM` (`Qwen2ForCausalLM` with q/k/v biases), so both
sides compute the same model whatever checkpoint format it came from:

  hf = to_transformers(model.hparams, model.plain_weights(), "bfloat16",
                       device())
  point = decode(hf, prompt_ids, batch=16, steps=128, runs=3)

It runs on the device JAX runs on (`device()`: CUDA when JAX's backend is
a GPU) and every timed call waits for torch's queue (`synchronize`) before
the clock is read. `generate` is greedy with `min_new_tokens=steps`: every
row runs every step. Needs `torch` (install `torch==2.13.0`, a CPU build,
here; a CUDA build on a GPU machine) and `transformers`; they are imported
only here.
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


def device() -> str:
  """Where transformers runs: "cuda" when JAX's backend is a GPU (so both
  sides are timed on the same device), else "cpu"."""
  torch, _ = _import()
  backend = jax.default_backend()
  if backend == "gpu":
    if not torch.cuda.is_available():
      raise ValueError(
        "JAX runs on the GPU but this torch has no CUDA: the transformers "
        "reference would run on the CPU, not the same device"
      )
    return "cuda"
  if backend != "cpu":
    raise ValueError(
      f"JAX runs on {backend!r}; the transformers reference runs on the "
      "CPU or a CUDA GPU only"
    )
  return "cpu"


def synchronize(hf) -> None:
  """Waits for the work queued on `hf`'s device (CUDA runs async)."""
  torch, _ = _import()
  if next(hf.parameters()).device.type == "cuda":
    torch.cuda.synchronize()


def _tensors(h: HParams, weights):
  """(transformers name, our weight as f32 numpy) pairs, one weight at a
  time: only one is ever converted (and held in f32) at once."""
  e, lay = h.d_model, weights.layers
  yield "model.embed_tokens.weight", lambda: _dense(weights.embedding)
  yield "model.norm.weight", lambda: _dense(weights.final_norm)
  if not h.tied_embeddings:
    yield "lm_head.weight", lambda: _dense(weights.unembedding).T
  for i in range(h.layers):

    def get(name, f=lambda w: w, i=i):
      return lambda: f(_dense(getattr(lay[i], name)))

    p = f"model.layers.{i}."
    yield p + "self_attn.q_proj.weight", get("q", lambda w: w.reshape(e, -1).T)
    yield p + "self_attn.k_proj.weight", get("k", lambda w: w.reshape(e, -1).T)
    yield p + "self_attn.v_proj.weight", get("v", lambda w: w.reshape(e, -1).T)
    yield p + "self_attn.o_proj.weight", get("o", lambda w: w.reshape(-1, e).T)
    yield p + "mlp.gate_proj.weight", get("gate", np.transpose)
    yield p + "mlp.up_proj.weight", get("up", np.transpose)
    yield p + "mlp.down_proj.weight", get("down", np.transpose)
    yield p + "input_layernorm.weight", get("attn_norm")
    yield p + "post_attention_layernorm.weight", get("mlp_norm")
    if h.qkv_bias:
      for name in ("q", "k", "v"):
        yield p + f"self_attn.{name}_proj.bias", get(f"{name}_bias", np.ravel)


def to_transformers(h: HParams, weights, dtype: str, device: str = "cpu"):
  """A transformers causal LM on `device` ("cpu" or "cuda") holding
  `weights` (plain block order) in `dtype` ("float32" or "bfloat16").

  The model is built on the device and each parameter is filled from its
  own weight, one at a time, so the host never holds more than one weight
  in f32 (an 8B model fits)."""
  if dtype not in TORCH_DTYPES:
    raise ValueError(f"dtype={dtype!r}: expected one of {TORCH_DTYPES}")
  if device not in ("cpu", "cuda"):
    raise ValueError(f"device={device!r}: expected 'cpu' or 'cuda'")
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
  with torch.device(device):
    hf = transformers.AutoModelForCausalLM.from_config(
      config, dtype=getattr(torch, dtype)
    ).eval()
  params = dict(hf.named_parameters())  # a tied lm_head is listed once
  unexpected = []
  with torch.no_grad():
    for name, value in _tensors(h, weights):
      target = params.pop(name, None)
      if target is None:
        unexpected.append(name)
        continue
      array = value()
      if tuple(target.shape) != array.shape:
        raise ValueError(
          f"{name}: our weight has shape {array.shape}, transformers' "
          f"{tuple(target.shape)}"
        )
      # torch.from_numpy wants a writable array (device_get gives read-only)
      target.copy_(torch.from_numpy(np.require(array, requirements="CW")))
      del array
  if params or unexpected:
    raise ValueError(
      f"weights do not fit transformers' model: missing {sorted(params)}, "
      f"unexpected {unexpected}"
    )
  return hf


def threads() -> int:
  torch, _ = _import()
  return torch.get_num_threads()


def prefill(hf, ids: np.ndarray, runs: int) -> Point:
  """Times the forward pass (all positions' logits) over `ids`."""
  torch, _ = _import()
  inputs = torch.from_numpy(np.asarray(ids, np.int64)).to(hf.device)

  def run():
    with torch.inference_mode():
      return hf(input_ids=inputs).logits

  return timed_prefill(run, ids.shape, runs, sync=lambda: synchronize(hf))


def decode(
  hf, prompt: Sequence[int], *, batch: int, steps: int, runs: int
) -> Point:
  """Times greedy `generate` of exactly `steps` tokens for `batch` copies
  of `prompt` (its prefill included, as `generate` does it)."""
  torch, _ = _import()
  ids = torch.tensor([list(prompt)] * batch, dtype=torch.long, device=hf.device)
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

  first, times = timed(run, runs, sync=lambda: synchronize(hf))
  return Point(
    phase="decode",
    batch=batch,
    length=len(prompt),
    steps=steps,
    tokens=batch * steps,
    first_s=first,
    times=tuple(times),
  )
