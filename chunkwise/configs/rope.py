"""RoPE scaling: how a checkpoint stretches rotary embeddings past the
context it was trained on.

`RopeScaling` holds a checkpoint's parameters as its config states them;
`chunkwise.models.rope` turns them into inverse frequencies (and a cos/sin
multiplier) with Hugging Face's formulas:

  RopeScaling(kind="llama3", factor=8.0, original_max_len=8192,
              low_freq_factor=1.0, high_freq_factor=4.0)   # Llama 3.1+
  RopeScaling(kind="yarn", factor=4.0, original_max_len=32768)
  RopeScaling(kind="longrope", original_max_len=4096,
              short_factors=(...), long_factors=(...))     # Phi-3

Kinds:
  * linear: positions divided by `factor`;
  * dynamic: NTK-aware base, grown with the longest position of a call
    once it passes `original_max_len` (transformers' "dynamic");
  * llama3: low frequencies divided by `factor`, high ones kept, a smooth
    ramp between (wavelengths against `original_max_len / *_freq_factor`);
  * yarn: interpolation and extrapolation blended per frequency by a ramp
    between `beta_fast` and `beta_slow` rotations, cos/sin times
    `attention_factor` (default from `factor`, `mscale`, `mscale_all_dim`);
  * longrope: frequencies divided by `short_factors`, or by `long_factors`
    when a call's longest position passes `original_max_len`; cos/sin times
    `attention_factor` (default sqrt(1 + ln(factor) / ln(original_max_len)));
  * factors: frequencies divided by `short_factors` (llama.cpp's
    `rope_freqs` tensor, which GGUF files carry for Llama 3.1+).
"""

from __future__ import annotations

import dataclasses
import enum
import math


class RopeKind(enum.Enum):
  LINEAR = "linear"
  DYNAMIC = "dynamic"
  LLAMA3 = "llama3"
  YARN = "yarn"
  LONGROPE = "longrope"
  FACTORS = "factors"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """A RoPE scaling rule (see the module docstring for each kind).

  Attributes:
    kind: a `RopeKind` or its string.
    factor: the context's stretch (linear, dynamic, llama3, yarn; longrope
      only for its default attention factor).
    original_max_len: the pretraining context (llama3, yarn, longrope,
      dynamic).
    low_freq_factor, high_freq_factor: llama3's ramp ends.
    beta_fast, beta_slow, truncate, mscale, mscale_all_dim: yarn's ramp and
      attention factor.
    attention_factor: cos/sin multiplier (yarn, longrope); None: derived.
    short_factors, long_factors: per-frequency divisors (head_dim / 2 of
      them, or rotary_dim / 2), longrope and factors.
  """

  kind: RopeKind
  factor: float = 1.0
  original_max_len: int = 0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True
  mscale: float | None = None
  mscale_all_dim: float | None = None
  attention_factor: float | None = None
  short_factors: tuple[float, ...] = ()
  long_factors: tuple[float, ...] = ()

  def __post_init__(self) -> None:
    if not isinstance(self.kind, RopeKind):
      try:
        object.__setattr__(self, "kind", RopeKind(self.kind))
      except ValueError:
        known = ", ".join(repr(k.value) for k in RopeKind)
        raise ValueError(
          f"RopeScaling.kind={self.kind!r} is not one of {known}"
        ) from None
    for name in ("short_factors", "long_factors"):
      value = tuple(float(v) for v in getattr(self, name))
      if not all(math.isfinite(v) and v > 0 for v in value):
        raise ValueError(f"RopeScaling.{name} must be positive numbers")
      object.__setattr__(self, name, value)
    if not (math.isfinite(self.factor) and self.factor > 0):
      raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor!r}")
    needs_length = (
      RopeKind.DYNAMIC,
      RopeKind.LLAMA3,
      RopeKind.YARN,
      RopeKind.LONGROPE,
    )
    if self.kind in needs_length and (
      not isinstance(self.original_max_len, int) or self.original_max_len < 1
    ):
      raise ValueError(
        f"RopeScaling(kind={self.kind.value!r}) needs original_max_len >= 1, "
        f"got {self.original_max_len!r}"
      )
    if self.kind == RopeKind.LLAMA3 and not (
      self.high_freq_factor > self.low_freq_factor > 0
    ):
      raise ValueError(
        "RopeScaling(kind='llama3') needs high_freq_factor > low_freq_factor "
        f"> 0, got {self.high_freq_factor!r} and {self.low_freq_factor!r}"
      )
    if self.kind == RopeKind.LONGROPE and (
      not self.short_factors
      or len(self.short_factors) != len(self.long_factors)
    ):
      raise ValueError(
        "RopeScaling(kind='longrope') needs short_factors and long_factors "
        "of one length"
      )
    if self.kind == RopeKind.FACTORS and not self.short_factors:
      raise ValueError("RopeScaling(kind='factors') needs short_factors")

  def to_json(self) -> dict:
    out = dataclasses.asdict(self)
    out["kind"] = self.kind.value
    return out

  def replace(self, **changes) -> RopeScaling:
    return dataclasses.replace(self, **changes)
