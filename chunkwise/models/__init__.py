"""Per-device Transformer math and the `Weights` pytree."""

from chunkwise.models import rope
from chunkwise.models.fused import ShuffledWeights
from chunkwise.models.quantized import QArray, Quantization, quantize_weights
from chunkwise.models.transformer import (
  AttendFn,
  Site,
  block,
  embed,
  forward,
  mlp,
  rms_norm,
  sites,
  unembed,
)
from chunkwise.models.weights import Layer, Weights, check_shapes, init_random

__all__ = [
  "AttendFn",
  "Layer",
  "QArray",
  "Quantization",
  "ShuffledWeights",
  "Site",
  "Weights",
  "block",
  "check_shapes",
  "embed",
  "forward",
  "init_random",
  "mlp",
  "quantize_weights",
  "rms_norm",
  "rope",
  "sites",
  "unembed",
]
