"""CPU kernels called through `jax.ffi`, compiled on first use (`build`).

`matmul` reads int8, bf16 and f32 weights in place; the models call it for
decode-sized matmuls through `chunkwise.models.matmul.weight_matmul`,
whose plain twin is XLA's dot of the weight cast to the activations' dtype.
This package imports nothing else of chunkwise.
"""

from chunkwise.cpu_kernels.build import load as load
from chunkwise.cpu_kernels.invariant import (
  invariant_exp_sum as invariant_exp_sum,
)
from chunkwise.cpu_kernels.invariant import (
  invariant_matmul as invariant_matmul,
)
from chunkwise.cpu_kernels.invariant import (
  invariant_unary as invariant_unary,
)
from chunkwise.cpu_kernels.matmul import matmul as matmul
