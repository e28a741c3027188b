"""Pallas TPU kernels, compiled by Mosaic for a TPU (on a TPU host, or
ahead of time with libtpu: `chunkwise.simulation.tpu_target`) and run in
Pallas' TPU interpret mode anywhere else (the tests, on the CPU).

`matmul` reads a weight as it is stored (bf16 / f32, int8 codes with
group scales, GGUF blocks of 4- or 8-bit codes with f16 scales and
offsets) and scales it tile by tile in VMEM: the TPU's decode matmuls
and every quantized matmul (`models.matmul`). `invariant_matmul` is the
same in tiles of fixed rows, whose rows' bits do not depend on the
batch (for invariant numerics on a TPU; the engines do not call it
yet: docs/numerics.md). `take_rows`
reads a quantized table's rows in their stored tiling (the embedding
lookup). `invariant_attend` is causal attention in tiles of fixed shape
over a heads-major cache: a query row's bits do not depend on the batch,
its chunk or the cache's length. Their plain twins are XLA's dot,
gather and softmax attention. This package imports nothing else of
chunkwise.
"""

from chunkwise.tpu_kernels.attention import (
  attend as invariant_attend,  # noqa: F401
)
from chunkwise.tpu_kernels.table_rows import take_rows as take_rows
from chunkwise.tpu_kernels.tiled_matmul import Stored as Stored
from chunkwise.tpu_kernels.tiled_matmul import cost as cost
from chunkwise.tpu_kernels.tiled_matmul import (
  invariant_matmul as invariant_matmul,
)
from chunkwise.tpu_kernels.tiled_matmul import matmul as matmul
