"""Pallas TPU kernels, compiled by Mosaic for a TPU (on a TPU host, or
ahead of time with libtpu: `chunkwise.simulation.tpu_target`) and run in
Pallas' interpret mode anywhere else (the tests, on the CPU).

`matmul` reads a weight as it is stored (bf16 / f32, int8 codes with
group scales, GGUF blocks of 4- or 8-bit codes with f16 scales and
offsets) and scales it tile by tile in VMEM: the TPU's decode matmuls
and every quantized matmul (`models.matmul`). `take_rows` reads a
quantized table's rows in their stored tiling (the embedding lookup).
`decode_attention.decode` runs a fast decode step's attention to every
piece of its context (prefix caches, the loop's buffer, its own key) in
one call (`models.tpu_decode`).

A TPU program under invariant numerics (`numerics.tpu_invariant`) runs
three kernels whose tiles have one shape whatever the batch, so a row's
bits do not depend on the rows beside it: `invariant_matmul` (`matmul`
in tiles of fixed rows: every weight matmul, `models.matmul`),
`attention.parts` (a piece of context's unnormalised attention in tiles
of 8 query rows and 128 keys, going on from the sums of the keys before
it: `models.tpu_attention`; `invariant_attend`
the same over one causal cache) and `row_sums.row_sum` (norms and
softmax totals: `numerics.row_sum`). Their plain twins are XLA's dot,
gather, softmax attention and sums. This package imports nothing else
of chunkwise, and its modules (with Pallas) load when first used.
"""

import importlib

# Loaded when first used (PEP 562): Pallas' TPU modules take half a
# second to import, which every process paid, CPU-only or not.
_NAMES = {
  "invariant_attend": ("attention", "attend"),
  "take_rows": ("table_rows", "take_rows"),
  "Stored": ("stored", "Stored"),
  "cost": ("tiled_matmul", "cost"),
  "invariant_matmul": ("tiled_matmul", "invariant_matmul"),
  "matmul": ("tiled_matmul", "matmul"),
}
_MODULES = (
  "attention",
  "decode_attention",
  "row_sums",
  "stored",
  "table_rows",
  "tiled_matmul",
)


def __getattr__(name: str):
  if name in _MODULES:
    return importlib.import_module(f"{__name__}.{name}")
  if name in _NAMES:
    module, attr = _NAMES[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  return sorted([*globals(), *_NAMES, *_MODULES])
