"""The Pallas TPU kernels (`chunkwise.tpu_kernels`) beside XLA's own ops,
compiled for one chip of a TPU target and estimated: a decode matmul of
one chip's share of a Llama-3.1-8B MLP weight (bf16 and int8) and decode
attention over an 8k-token cache, at a few batch sizes, each in the fast
form, the invariant form and XLA's plain twin.

  rows = kernel_costs(Target.parse("tpu-v5e:2x2"))
  print(kernel_table(rows))             # scripts/simulate.py --kernels

XLA:TPU estimates its own ops; a Pallas call carries its flops and bytes,
and counts at the slower of them at the chip's peak and HBM bandwidth
(`hlo.kernel_cycles`, marked "~"). XLA's estimate of a dot at a few rows
is below the time to read its weight from HBM (it does not model that
read), so the weight's read time is printed beside every matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from chunkwise import tpu_kernels
from chunkwise.models import matmul as matmul_lib
from chunkwise.models import quantized
from chunkwise.simulation import hlo, tpu_target
from chunkwise.tpu_kernels import attention


def _estimate(fn, args, device, hardware) -> dict:
  sharding = jax.sharding.SingleDeviceSharding(device)
  abstract = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args
  )
  mesh = jax.sharding.Mesh([device], ("x",))
  with tpu_target.compiling(mesh):
    compiled = jax.jit(fn).lower(*abstract).compile()
  cycles = hlo.estimated_cycles(compiled.as_text(), hardware)
  return dict(
    seconds=cycles["once"] / hardware.clock_hz,
    bounded=cycles["bounded"] > 0,
    unknown=cycles["unknown"] > 0,
  )


def kernel_costs(
  target: tpu_target.Target,
  *,
  k: int = 4096,
  n: int = 3584,
  context: int = 8192,
  heads: int = 8,
  kv_heads: int = 2,
  head_dim: int = 128,
  rows=(1, 8, 32, 128),
) -> list[dict]:
  """One row per (op, form, batch): estimated seconds on one chip of
  `target` and, for matmuls, the seconds its weight takes to read."""
  device = target.devices()[0]
  hardware = tpu_target.hardware_of(device)
  w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
  q8 = jax.eval_shape(lambda w: quantized.quantize(w, (0,)), w)
  weights = {"bf16": w, "int8": q8}
  out = []
  for b in rows:
    x = jax.ShapeDtypeStruct((b, k), jnp.bfloat16)
    for dtype, weight in weights.items():
      read_s = quantized.nbytes(weight) / hardware.hbm_bandwidth
      twin = (
        (lambda x, w: matmul_lib.grouped("bk,kn->bn", x, w))
        if dtype == "int8"
        else (lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
      )
      forms = {  # outputs in x's dtype, as the models take them
        "XLA": twin,
        "kernel": functools.partial(tpu_kernels.matmul, out_dtype=x.dtype),
        "invariant kernel": functools.partial(
          tpu_kernels.invariant_matmul, out_dtype=x.dtype
        ),
      }
      for form, fn in forms.items():
        est = _estimate(fn, (x, weight), device, hardware)
        out.append(
          dict(op=f"matmul {dtype} {k}x{n}", form=form, rows=b, read_s=read_s)
          | est
        )
    q = jax.ShapeDtypeStruct((b, heads, 1, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, kv_heads, context, head_dim), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((b, 1), jnp.int32)
    read_s = 2 * b * kv_heads * context * head_dim * 2 / hardware.hbm_bandwidth
    for form, fn in {
      "XLA": attention.reference,
      "invariant kernel": tpu_kernels.invariant_attend,
    }.items():
      est = _estimate(fn, (q, kv, kv, pos), device, hardware)
      out.append(
        dict(op=f"attention S={context}", form=form, rows=b, read_s=read_s)
        | est
      )
  return out


def kernel_table(rows: list[dict]) -> str:
  """The rows as a markdown table (µs; '~': a Pallas call's bound)."""
  lines = [
    "| op | rows | form | estimated µs | read µs |",
    "| --- | --- | --- | --- | --- |",
  ]
  for r in rows:
    mark = "~" if r["bounded"] else ("+" if r["unknown"] else "")
    lines.append(
      f"| {r['op']} | {r['rows']} | {r['form']} | "
      f"{1e6 * r['seconds']:.1f}{mark} | {1e6 * r['read_s']:.1f} |"
    )
  return "\n".join(lines)
