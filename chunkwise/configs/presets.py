"""Named model shapes, reachable with `configs.get(name)`.

configs.get("tiny")          # fast tests: Llama-style, grouped KV heads
configs.get("tiny-parallel") # fast tests: PaLM-style, multiquery
configs.get("llama3-8b")     # Llama 3 8B's shapes, for benchmarks
configs.get("gemma-2-2b")    # public checkpoints' shapes and features:
                             # llama-3.2-1b/3b, llama-3.1-8b/70b, qwen2.5-0.5b/
                             # 7b, gemma-2-2b/9b, gemma-3-1b/4b, phi-3.5-mini
configs.get("palm-540b")     # shapes of "Efficiently Scaling Transformer
                             # Inference", 48 real heads, no padding
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from chunkwise.configs.hparams import Activation, Block, HParams
from chunkwise.configs.rope import RopeKind, RopeScaling

# Tiny models for tests: widths that divide every mesh of 8 devices (heads,
# d_ff, vocab and d_model are multiples of 8), a vocabulary that holds the
# byte vocabulary (259 ids), and a few layers so scan is exercised.
_TINY = HParams(
  layers=2,
  d_model=64,
  heads=8,
  kv_heads=2,
  head_dim=16,
  d_ff=128,
  vocab=320,
  max_len=512,
  block=Block.SEQUENTIAL,
  norm_eps=1e-5,
  rope_base=10_000.0,
  tied_embeddings=False,
)

# PaLM (Chowdhery et al., 2022) as used by Pope et al.: parallel block,
# multiquery attention, SwiGLU with two full-width input projections, tied
# embeddings. max_len is 8192 (the original's 8096 is a typo).
_PALM = dict(
  kv_heads=1,
  head_dim=256,
  vocab=256_128,
  max_len=8192,
  block=Block.PARALLEL,
  norm_eps=1e-6,
  rope_base=10_000.0,
  tied_embeddings=True,
  activation=Activation.SILU,
)


def _llama3(factor: float) -> RopeScaling:
  return RopeScaling(
    kind=RopeKind.LLAMA3,
    factor=factor,
    original_max_len=8192,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
  )


# The shapes (and architecture features) of public checkpoints, for
# benchmarks and simulations with random weights. Phi-3.5-mini's LongRoPE
# factors come with its checkpoint and are not repeated here: its preset
# has plain RoPE (the same cost).
_REAL = dict(
  block=Block.SEQUENTIAL,
  norm_eps=1e-5,
)
_LLAMA3 = dict(
  _REAL, vocab=128_256, max_len=131_072, rope_base=500_000.0, kv_heads=8
)
_QWEN25 = dict(_REAL, norm_eps=1e-6, rope_base=1e6, qkv_bias=True)
_GEMMA = dict(
  _REAL,
  norm_eps=1e-6,
  head_dim=256,
  tied_embeddings=True,
  activation=Activation.GELU,
  query_scale=256**-0.5,
  post_norms=True,
)
_GEMMA2 = dict(
  _GEMMA,
  vocab=256_000,
  max_len=8192,
  sliding_window=4096,
  attn_softcap=50.0,
  final_softcap=30.0,
)


def _gemma2(layers: int, d_model: int, **kw) -> HParams:
  return HParams(
    layers=layers,
    d_model=d_model,
    embed_scale=d_model**0.5,
    sliding_layers=tuple(range(0, layers, 2)),
    **_GEMMA2,
    **kw,
  )


def _gemma3(layers: int, d_model: int, **kw) -> HParams:
  return HParams(
    layers=layers,
    d_model=d_model,
    embed_scale=d_model**0.5,
    sliding_layers=tuple(i for i in range(layers) if (i + 1) % 6),
    rope_base=1e6,
    local_rope_base=10_000.0,
    qk_norm=True,
    **_GEMMA,
    **kw,
  )


PRESETS: Mapping[str, HParams] = types.MappingProxyType(
  {
    "tiny": _TINY,
    "tiny-parallel": _TINY.replace(
      block=Block.PARALLEL, kv_heads=1, tied_embeddings=True, norm_eps=1e-6
    ),
    # SmolLM2-135M(-Instruct), the embedded default model (DESIGN.md §7).
    "smollm2-135m": HParams(
      layers=30,
      d_model=576,
      heads=9,
      kv_heads=3,
      head_dim=64,
      d_ff=1536,
      vocab=49_152,
      max_len=8192,
      block=Block.SEQUENTIAL,
      norm_eps=1e-5,
      rope_base=100_000.0,
      tied_embeddings=True,
    ),
    # Llama 3 8B's shapes (Meta, 2024): grouped K/V heads, untied
    # embeddings, RoPE base 500000 (its llama3 RoPE scaling is not modelled:
    # for benchmarks with random weights).
    "llama3-8b": HParams(
      layers=32,
      d_model=4096,
      heads=32,
      kv_heads=8,
      head_dim=128,
      d_ff=14_336,
      vocab=128_256,
      max_len=8192,
      block=Block.SEQUENTIAL,
      norm_eps=1e-5,
      rope_base=500_000.0,
      tied_embeddings=False,
    ),
    "llama-3.2-1b": HParams(
      layers=16,
      d_model=2048,
      heads=32,
      head_dim=64,
      d_ff=8192,
      tied_embeddings=True,
      rope_scaling=_llama3(32.0),
      **_LLAMA3,
    ),
    "llama-3.2-3b": HParams(
      layers=28,
      d_model=3072,
      heads=24,
      head_dim=128,
      d_ff=8192,
      tied_embeddings=True,
      rope_scaling=_llama3(32.0),
      **_LLAMA3,
    ),
    "llama-3.1-8b": HParams(
      layers=32,
      d_model=4096,
      heads=32,
      head_dim=128,
      d_ff=14_336,
      tied_embeddings=False,
      rope_scaling=_llama3(8.0),
      **_LLAMA3,
    ),
    "llama-3.1-70b": HParams(
      layers=80,
      d_model=8192,
      heads=64,
      head_dim=128,
      d_ff=28_672,
      tied_embeddings=False,
      rope_scaling=_llama3(8.0),
      **_LLAMA3,
    ),
    "qwen2.5-0.5b": HParams(
      layers=24,
      d_model=896,
      heads=14,
      kv_heads=2,
      head_dim=64,
      d_ff=4864,
      vocab=151_936,
      max_len=32_768,
      tied_embeddings=True,
      **_QWEN25,
    ),
    "qwen2.5-7b": HParams(
      layers=28,
      d_model=3584,
      heads=28,
      kv_heads=4,
      head_dim=128,
      d_ff=18_944,
      vocab=152_064,
      max_len=32_768,
      tied_embeddings=False,
      **_QWEN25,
    ),
    "gemma-2-2b": _gemma2(26, 2304, heads=8, kv_heads=4, d_ff=9216),
    "gemma-2-9b": _gemma2(42, 3584, heads=16, kv_heads=8, d_ff=14_336),
    "gemma-3-1b": _gemma3(
      26,
      1152,
      heads=4,
      kv_heads=1,
      d_ff=6912,
      vocab=262_144,
      max_len=32_768,
      sliding_window=512,
    ),
    "gemma-3-4b": _gemma3(
      34,
      2560,
      heads=8,
      kv_heads=4,
      d_ff=10_240,
      vocab=262_208,
      max_len=131_072,
      sliding_window=1024,
      rope_scaling=RopeScaling(kind=RopeKind.LINEAR, factor=8.0),
    ),
    "phi-3.5-mini": HParams(
      layers=32,
      d_model=3072,
      heads=32,
      kv_heads=32,
      head_dim=96,
      d_ff=8192,
      vocab=32_064,
      max_len=131_072,
      rope_base=10_000.0,
      tied_embeddings=False,
      **_REAL,
    ),
    "palm-8b": HParams(layers=32, d_model=4096, heads=16, d_ff=16_384, **_PALM),
    "palm-62b": HParams(
      layers=64, d_model=8192, heads=32, d_ff=32_768, **_PALM
    ),
    "palm-540b": HParams(
      layers=118, d_model=18_432, heads=48, d_ff=73_728, **_PALM
    ),
  }
)


def names() -> list[str]:
  """The known preset names, sorted."""
  return sorted(PRESETS)


def get(name: str) -> HParams:
  """The preset called `name`; unknown names raise and list the known ones."""
  try:
    return PRESETS[name]
  except (KeyError, TypeError):
    raise ValueError(
      f"unknown model preset {name!r}; known presets: {', '.join(names())}"
    ) from None
