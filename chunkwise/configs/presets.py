"""Named model shapes, reachable with `configs.get(name)`.

configs.get("tiny")          # fast tests: Llama-style, grouped KV heads
configs.get("tiny-parallel") # fast tests: PaLM-style, multiquery
configs.get("llama3-8b")     # Llama 3 8B's shapes, for benchmarks
configs.get("palm-540b")     # shapes of "Efficiently Scaling Transformer
                             # Inference", 48 real heads, no padding
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from chunkwise.configs.hparams import Activation, Block, HParams

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
