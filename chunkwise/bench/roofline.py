"""What a configuration would take at the machine's limits.

Decode is bound by memory: every step reads every weight once and each
row's K/V so far, so

  MBU = (weight bytes + K/V bytes) per step / seconds per step / bandwidth.

Prefill is bound by compute: 2 FLOPs per weight per token in the matmuls
(the unembedding included), plus causal attention's two products, so

  MFU = FLOPs / seconds / peak matmul FLOP/s,

the peak measured at the dtype and precision the configuration's matmuls
run at (`machine.Limits.peak`): a bf16 model against the bf16 peak.
"""

from __future__ import annotations

from chunkwise.configs import HParams


def matmul_params(h: HParams) -> int:
  """Weights that multiply each token: projections, MLP, unembedding."""
  attn = h.d_model * h.head_dim * (2 * h.heads + 2 * h.kv_heads)
  return h.layers * (attn + 3 * h.d_model * h.d_ff) + h.vocab * h.d_model


def prefill_flops(h: HParams, batch: int, length: int) -> float:
  """Matmul FLOPs of one prefill of `batch` rows of `length` tokens."""
  dense = 2.0 * batch * length * matmul_params(h)
  # QK^T and PV over the causal triangle (length (length + 1) / 2 pairs).
  pairs = length * (length + 1) / 2
  attention = 4.0 * batch * pairs * h.heads * h.head_dim * h.layers
  return dense + attention


def kv_bytes_per_step(
  h: HParams, batch: int, context: float, itemsize: int
) -> float:
  """K/V read by one decode step of `batch` rows holding `context`
  tokens each."""
  return 2.0 * h.layers * batch * context * h.kv_heads * h.head_dim * itemsize


def decode_bytes_per_step(
  h: HParams,
  weight_bytes: int,
  batch: int,
  prompt: int,
  steps: int,
  itemsize: int,
) -> float:
  """Weights plus the K/V of the average step (the context grows from
  `prompt` to `prompt + steps - 1`)."""
  context = prompt + (steps - 1) / 2
  return weight_bytes + kv_bytes_per_step(h, batch, context, itemsize)


def decode_row(
  point, h: HParams, weight_bytes: int, itemsize: int, limits
) -> dict:
  """`point.describe()` plus bytes per step, MBU and the roofline
  (`itemsize`: bytes per K/V element)."""
  step_bytes = decode_bytes_per_step(
    h, weight_bytes, point.batch, point.length, point.steps, itemsize
  )
  seconds = point.seconds / max(point.steps, 1)
  return {
    **point.describe(),
    "bytes_per_step": step_bytes,
    "mbu": step_bytes / seconds / limits.bandwidth,
    "roofline_tokens_per_s": point.batch * limits.bandwidth / step_bytes,
  }


def prefill_row(point, h: HParams, peak_flops: float) -> dict:
  """`point.describe()` plus FLOPs and MFU against `peak_flops` (FLOP/s
  of the matmuls' dtype and precision)."""
  flops = prefill_flops(h, point.batch, point.length)
  return {
    **point.describe(),
    "flops": flops,
    "peak_gflop_s": peak_flops / 1e9,
    "mfu": flops / point.seconds / peak_flops,
  }
