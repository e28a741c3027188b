"""Model hyperparameters: one frozen dataclass that fixes every shape.

`HParams` says what the model *is* (widths, depth, block kind, norms, RoPE);
how it is stored (dtype, int8, pre-shuffled) and run (mesh, layout) live
elsewhere. Every field is static: changing one means a different program.

  h = HParams(layers=2, d_model=64, heads=8, kv_heads=2, head_dim=8,
              d_ff=128, vocab=320, max_len=512, block=Block.SEQUENTIAL)
  h.replace(layers=30)
"""

from __future__ import annotations

import dataclasses
import enum
import math

from chunkwise.configs.rope import RopeKind, RopeScaling


class Block(enum.Enum):
  """How attention and the MLP are combined in one layer."""

  # PaLM: x + attn(norm(x)) + mlp(norm(x)), one norm shared by both branches.
  PARALLEL = "parallel"
  # Llama: h = x + attn(norm1(x)); h + mlp(norm2(h)).
  SEQUENTIAL = "sequential"


class Activation(enum.Enum):
  """Gate nonlinearity of the gated MLP: act(x @ gate) * (x @ up)."""

  SILU = "silu"  # SwiGLU (PaLM, Llama)
  GELU = "gelu"  # GeGLU with the tanh approximation (Gemma)


# Most layers a model may have (the deepest public models have ~200): every
# layer is an array of its own, so a hostile count must fail here.
MAX_LAYERS = 1 << 16


def _positive(name: str, value: object) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"HParams.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HParams:
  """Shapes and architecture of a decoder-only Transformer.

  Attributes:
    layers: number of Transformer layers (stacked on a leading axis).
    d_model: width of the residual stream.
    heads: query heads.
    kv_heads: key/value heads; 1 is multiquery, `heads` is multihead and
      anything in between (a divisor of `heads`) is grouped-query attention.
    head_dim: width of one attention head (even: RoPE rotates halves).
    d_ff: width of each of the two MLP input projections (gate and up).
    vocab: rows of the embedding table; may exceed the tokenizer's size.
    max_len: longest sequence (prefixes included) the model accepts.
    block: `Block.PARALLEL` (PaLM) or `Block.SEQUENTIAL` (Llama); the strings
      "parallel" / "sequential" are accepted too.
    norm_eps: epsilon inside RMSNorm's rsqrt.
    norm_scale: whether RMSNorms have a learned per-channel scale.
    rope_base: RoPE wavelength base (1e4 in PaLM, 1e5 in SmolLM2).
    tied_embeddings: unembed with the transposed embedding table.
    activation: gate nonlinearity of the MLP (`Activation` or its string).
    qkv_bias: whether the query, key and value projections add a learned
      bias (Qwen2) before RoPE.
    rope_scaling: a `RopeScaling` (or its dict) stretching RoPE past the
      pretraining context (Llama 3.1, YaRN, Phi-3's longrope, ...); None:
      plain RoPE.
    rotary_dim: leading dims of each head that RoPE rotates (partial
      rotary embeddings; the rest pass through); None: all of head_dim.
    sliding_window: a query attends to the keys of the last
      `sliding_window` positions (itself included) in sliding layers, in
      prefill, generate and across prefixes; None: no window.
    sliding_layers: the layers that slide (Gemma 2/3 alternate); None with
      a window: every layer (Mistral).
    local_rope_base: RoPE base of sliding layers, which then use plain RoPE
      (Gemma 3); None: the same RoPE as every layer.
    query_scale: multiplies queries before attention; None: head_dim^-1/2
      (Gemma: query_pre_attn_scalar^-1/2).
    attn_softcap: attention logits become cap * tanh(logits / cap)
      (Gemma 2); None: no cap.
    final_softcap: the same for the output logits (Gemma 2).
    embed_scale: multiplies the embedded tokens, rounded to the residual
      stream's dtype (Gemma: sqrt(d_model)); None: 1.
    post_norms: RMSNorms after the attention and MLP branches, before the
      residual add ("sandwich" norms, Gemma 2/3).
    qk_norm: RMSNorm (learned, over head_dim) of each query and key head
      before RoPE (Gemma 3).

  Gemma's `(1 + w)` norm scales are stored with the 1 added (as llama.cpp
  stores them), so they are plain scales here.
  """

  layers: int
  d_model: int
  heads: int
  kv_heads: int
  head_dim: int
  d_ff: int
  vocab: int
  max_len: int
  block: Block = Block.SEQUENTIAL
  norm_eps: float = 1e-5
  norm_scale: bool = True
  rope_base: float = 10_000.0
  tied_embeddings: bool = True
  activation: Activation = Activation.SILU
  qkv_bias: bool = False
  rope_scaling: RopeScaling | None = None
  rotary_dim: int | None = None
  sliding_window: int | None = None
  sliding_layers: tuple[int, ...] | None = None
  local_rope_base: float | None = None
  query_scale: float | None = None
  attn_softcap: float | None = None
  final_softcap: float | None = None
  embed_scale: float | None = None
  post_norms: bool = False
  qk_norm: bool = False

  def __post_init__(self) -> None:
    for name in (
      "layers",
      "d_model",
      "heads",
      "kv_heads",
      "head_dim",
      "d_ff",
      "vocab",
      "max_len",
    ):
      _positive(name, getattr(self, name))
    if self.layers > MAX_LAYERS:
      raise ValueError(
        f"HParams.layers={self.layers} exceeds the most chunkwise builds "
        f"({MAX_LAYERS})"
      )
    if self.heads % self.kv_heads:
      raise ValueError(
        f"HParams.kv_heads={self.kv_heads} must divide heads={self.heads}"
      )
    if self.head_dim % 2:
      raise ValueError(
        f"HParams.head_dim={self.head_dim} must be even (RoPE rotates "
        "halves of each head)"
      )
    if not self.norm_eps > 0:
      raise ValueError(f"HParams.norm_eps must be > 0, got {self.norm_eps!r}")
    if not self.rope_base > 1:
      raise ValueError(f"HParams.rope_base must be > 1, got {self.rope_base!r}")
    # Accept the enum values' strings, so configs can come from JSON or flags.
    for name, kind in (("block", Block), ("activation", Activation)):
      value = getattr(self, name)
      if not isinstance(value, kind):
        try:
          object.__setattr__(self, name, kind(value))
        except ValueError:
          known = ", ".join(repr(k.value) for k in kind)
          raise ValueError(
            f"HParams.{name}={value!r} is not one of {known}"
          ) from None

    self._check_architecture()

  def _check_architecture(self) -> None:
    if isinstance(self.rope_scaling, dict):
      try:
        scaling = RopeScaling(**self.rope_scaling)
      except TypeError as e:
        raise ValueError(f"HParams.rope_scaling: {e}") from None
      object.__setattr__(self, "rope_scaling", scaling)
    if self.rope_scaling is not None and not isinstance(
      self.rope_scaling, RopeScaling
    ):
      raise ValueError(
        f"HParams.rope_scaling must be a RopeScaling, got {self.rope_scaling!r}"
      )
    rotary = self.rotary_dim
    if rotary is not None and (
      not isinstance(rotary, int)
      or isinstance(rotary, bool)
      or rotary < 2
      or rotary % 2
      or rotary > self.head_dim
    ):
      raise ValueError(
        f"HParams.rotary_dim={rotary!r} must be an even int in [2, "
        f"head_dim={self.head_dim}]"
      )
    scaling = self.rope_scaling
    if scaling is not None and scaling.kind in (
      RopeKind.LONGROPE,
      RopeKind.FACTORS,
    ):
      want = self.rotary_width // 2
      if len(scaling.short_factors) != want:
        raise ValueError(
          f"HParams.rope_scaling has {len(scaling.short_factors)} factors, "
          f"expected rotary width / 2 = {want}"
        )
    if self.sliding_window is not None:
      _positive("sliding_window", self.sliding_window)
    if self.sliding_layers is not None:
      layers = tuple(self.sliding_layers)
      if self.sliding_window is None:
        raise ValueError("HParams.sliding_layers needs a sliding_window")
      if not all(
        isinstance(i, int) and 0 <= i < self.layers for i in layers
      ) or len(set(layers)) != len(layers):
        raise ValueError(
          f"HParams.sliding_layers={layers!r} must be distinct layer "
          f"indices below layers={self.layers}"
        )
      object.__setattr__(self, "sliding_layers", tuple(sorted(layers)))
    if self.local_rope_base is not None and not self.local_rope_base > 1:
      raise ValueError(
        f"HParams.local_rope_base must be > 1, got {self.local_rope_base!r}"
      )
    for name in ("query_scale", "attn_softcap", "final_softcap", "embed_scale"):
      value = getattr(self, name)
      if value is not None and not (
        isinstance(value, (int, float)) and math.isfinite(value) and value > 0
      ):
        raise ValueError(f"HParams.{name} must be > 0 or None, got {value!r}")
    if self.qk_norm and not self.norm_scale:
      raise ValueError("HParams.qk_norm needs learned norm scales (norm_scale)")
    if self.post_norms and self.block != Block.SEQUENTIAL:
      raise ValueError("HParams.post_norms needs the sequential block")

  @property
  def rotary_width(self) -> int:
    """How many dims of each head RoPE rotates."""
    return self.head_dim if self.rotary_dim is None else self.rotary_dim

  def window(self, layer: int) -> int | None:
    """The sliding window of `layer`, or None where it attends to all."""
    if self.sliding_window is None:
      return None
    if self.sliding_layers is None or layer in self.sliding_layers:
      return self.sliding_window
    return None

  def rope(self, layer: int) -> tuple[float, RopeScaling | None]:
    """(base, scaling) of `layer`'s RoPE."""
    if self.local_rope_base is not None and self.window(layer) is not None:
      return self.local_rope_base, None
    return self.rope_base, self.rope_scaling

  def to_json(self) -> dict:
    """A JSON object that `HParams(**obj)` reads back."""
    out = {}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if isinstance(value, enum.Enum):
        value = value.value
      elif isinstance(value, RopeScaling):
        value = value.to_json()
      elif isinstance(value, tuple):
        value = list(value)
      out[f.name] = value
    return out

  def replace(self, **changes) -> HParams:
    return dataclasses.replace(self, **changes)

  def num_params(self) -> int:
    """Parameter count, the embedding (and unembedding) included."""
    d, h = self.d_model, self.head_dim
    attn = d * h * (2 * self.heads + 2 * self.kv_heads)
    attn += self.qkv_bias * h * (self.heads + 2 * self.kv_heads)
    mlp = 3 * d * self.d_ff
    norms = (2 if self.block == Block.SEQUENTIAL else 1) * d * self.norm_scale
    norms += 2 * d * self.post_norms + 2 * h * self.qk_norm
    embed = self.vocab * d * (1 if self.tied_embeddings else 2)
    return self.layers * (attn + mlp + norms) + embed + d * self.norm_scale
