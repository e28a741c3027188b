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

  def replace(self, **changes) -> HParams:
    return dataclasses.replace(self, **changes)

  def num_params(self) -> int:
    """Parameter count, the embedding (and unembedding) included."""
    d, h = self.d_model, self.head_dim
    attn = d * h * (2 * self.heads + 2 * self.kv_heads)
    attn += self.qkv_bias * h * (self.heads + 2 * self.kv_heads)
    mlp = 3 * d * self.d_ff
    norms = (2 if self.block == Block.SEQUENTIAL else 1) * d * self.norm_scale
    embed = self.vocab * d * (1 if self.tied_embeddings else 2)
    return self.layers * (attn + mlp + norms) + embed + d * self.norm_scale
