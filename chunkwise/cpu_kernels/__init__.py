"""CPU kernels called through `jax.ffi`, compiled on first use (`build`),
with a path per instruction set chosen at run time (`isa`).

`invariant_matmul` is every matmul of invariant numerics (one fixed chain
per output, `portable.cc`), and with few rows the decode matmul of fast
numerics too (`matmul`, reading int8, bf16 and f32 weights in place,
and GGUF's blocks: 4-bit codes two to a byte, f16 scales and offsets);
`invariant_unary`, `invariant_row_sum` and `invariant_exp_sum` are exp,
log, norms' sums and a log-softmax's total; `invariant_attend` is
attention's chains in one call. Their plain twins are XLA's
(`chunkwise.numerics`, `chunkwise.models.matmul`). This package imports
nothing else of chunkwise.
"""

from chunkwise.cpu_kernels import isa as isa
from chunkwise.cpu_kernels.invariant import (
  invariant_attend as invariant_attend,
)
from chunkwise.cpu_kernels.invariant import (
  invariant_exp_sum as invariant_exp_sum,
)
from chunkwise.cpu_kernels.invariant import (
  invariant_matmul as invariant_matmul,
)
from chunkwise.cpu_kernels.invariant import (
  invariant_row_sum as invariant_row_sum,
)
from chunkwise.cpu_kernels.invariant import (
  invariant_unary as invariant_unary,
)
from chunkwise.cpu_kernels.isa import load as load
from chunkwise.cpu_kernels.matmul import matmul as matmul
