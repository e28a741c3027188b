"""`invariant_matmul(x, w, ...)`: the kernels called through `jax.ffi`.

Every output is one fixed sequence of f32 operations that depends only on
its row of x and the weight (`portable.cc` defines it): not on the number
of rows, the row's index, the tiling, the threads or the instruction set.
A float weight's output, in either order, is one FMA chain over the
inputs in order; a row sum (`invariant_row_sum`) is 16 lane chains and a
fixed tree.

  x: [G, M, K] (cast to f32); w: f32, bf16 or int8, [..., K, N]
  (k-major) or [..., N, K] (n-major), or uint8 4-bit codes two to a byte
  along K ([1, K / 2, N] or [1, N, K / 2]: `models.blocks`, scaled like
  int8), its leading dims' product 1 or G (a
  [b, kv, S, D] cache is read as it is: a reshape made XLA copy a loop's
  buffer every step); scale: f32 [1 or G, K / group, N] or
  [1 or G, N, K / group] for an int8 weight (whose product rounds x to
  int16 per row and group: `common.h`), None for a float one; acc: f32
  [G, M, N'] the chains start from (or None: +0); shift: f32 [G, M]
  (float weights): x enters as exp(x - shift[..., None]), exactly
  `invariant_unary(x - shift[..., None], "exp")` (attention's weights
  from its logits and their max, without writing them out); ones: a
  column N of
  weight 1 (the chained sum of x's row; k-major float only); isa: the
  instruction set to run (`isa.NAMES`; None: the process's default);
  offset: like scale (int8 and 4-bit weights: w = code * scale + offset;
  the rounded x's group sums times offset * its scale, chained after
  every code chunk: `common.h`);
  heads: (first int32[1], count) reads the heads [first, first + count)
  of a w [b, kv, ...] in place, for G = b * count.
  rows: int32[n], an attention cache w [b, kv, S, D] (f32 or bf16) read
  by row: batch g of row r = g // (count or kv) reads w's row rows[r]
  (clamped into [0, b)), for G = n * (count or kv) (a slot loop's
  running rows, read where they are among all its slots).
  valid: int32[n] (n: rows', else w's b): only the first valid[r] keys of
  row r enter, the rest being masked (attention over a cache's filled
  columns): a k-major product's chains stop after input valid[r] - 1, an
  n-major one's outputs from column valid[r] on are their starts.
  act8: an int8 or 4-bit weight's x rounded to int8 per block of 32
  inputs (the group where it is not a multiple of 32), not int16 per
  group: twice the products per instruction, llama.cpp's Q8_0 rounding
  (`common.h`; numerics "q8").
  Returns f32 [G, M, N'] with N' = N + ones.

Registered for the CPU platform only: call it under
`lax.platform_dependent` with a twin for the other backends
(`chunkwise.numerics`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from chunkwise.cpu_kernels import build
from chunkwise.cpu_kernels import isa as isa_lib


def _f32_or_f16(a):
  """Scales and offsets go as f32, or as f16 (widened in the call)."""
  return a if a.dtype == jnp.float16 else a.astype(jnp.float32)


def invariant_matmul(
  x,
  w,
  scale=None,
  acc=None,
  *,
  nmajor: bool,
  shift=None,
  ones: bool = False,
  isa: str | None = None,
  heads: tuple | None = None,
  offset=None,
  rows=None,
  valid=None,
  act8: bool = False,
) -> jax.Array:
  g, m, _ = x.shape
  n = (w.shape[-2] if nmajor else w.shape[-1]) + int(ones)
  dummy = jnp.zeros((1, 1, 1), jnp.float32)
  none = jnp.zeros((1,), jnp.int32)
  first, count = (none, 0) if heads is None else heads
  return jax.ffi.ffi_call(
    build.INVARIANT_TARGET, jax.ShapeDtypeStruct((g, m, n), jnp.float32)
  )(
    x.astype(jnp.float32),
    w,
    dummy if scale is None else _f32_or_f16(scale),
    dummy if acc is None else acc.astype(jnp.float32),
    dummy if shift is None else jnp.asarray(shift, jnp.float32),
    jnp.asarray(first, jnp.int32).reshape(1),
    dummy if offset is None else _f32_or_f16(offset),
    none if rows is None else jnp.asarray(rows, jnp.int32).reshape(-1),
    none if valid is None else jnp.asarray(valid, jnp.int32).reshape(-1),
    count=int(count),
    nmajor=int(nmajor),
    scaled=int(scale is not None),
    has_acc=int(acc is not None),
    has_shift=int(shift is not None),
    ones=int(ones),
    has_offset=int(offset is not None),
    has_rows=int(rows is not None),
    has_valid=int(valid is not None),
    act8=int(act8),
    isa=isa_lib.number(isa),
  )


def invariant_unary(x, op: str, *, isa: str | None = None) -> jax.Array:
  """exp or log (`op`) of f32 `x`, elementwise, the same operations for
  every element whatever x's shape (see `common.h`)."""
  ops = {"exp": 0, "log": 1}
  if op not in ops:
    raise ValueError(f"op={op!r}: expected 'exp' or 'log'")
  x = jnp.asarray(x, jnp.float32)
  return jax.ffi.ffi_call(
    build.UNARY_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32)
  )(x, op=ops[op], isa=isa_lib.number(isa))


def invariant_row_sum(x, *, isa: str | None = None) -> jax.Array:
  """Sums over x's last axis, each in one fixed order (16 lane chains and
  a fixed tree: `portable.cc`)."""
  x = jnp.asarray(x, jnp.float32)
  dummy = jnp.zeros((1,), jnp.float32)
  return jax.ffi.ffi_call(
    build.ROW_SUM_TARGET, jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)
  )(x, dummy, exp=0, isa=isa_lib.number(isa))


def invariant_exp_sum(x, shift, *, isa: str | None = None) -> jax.Array:
  """Row sums of exp(x - shift[..., None]) over x's last axis: equal, bit
  for bit, to `invariant_row_sum(invariant_unary(x - shift, "exp"))`, in
  one pass."""
  x = jnp.asarray(x, jnp.float32)
  return jax.ffi.ffi_call(
    build.ROW_SUM_TARGET, jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)
  )(x, jnp.asarray(shift, jnp.float32), exp=1, isa=isa_lib.number(isa))


def invariant_attend(
  q, pieces, *, group: int, isa: str | None = None
) -> jax.Array:
  """Attention under invariant numerics in one call (common.h's Attend).

  Args:
    q: f32[B, kv, T * group, D], pre-scaled (rows t * group + g).
    pieces: (k, v, first, mask) per piece in position order: k, v [b, heads,
      S, D] f32 or bf16 (b | B), first the piece's first head (int or
      int32 scalar), mask bool [mb, mr, mt, ms], each dim 1 or b, B / b,
      T, S.
    group: query heads per kv head.
  Returns:
    f32[B, kv, T * group, D + 1]: the weighted values' chains, then the
    weights' sum.
  """
  b, kv, rows, dim = q.shape
  firsts = jnp.stack(
    [jnp.asarray(first, jnp.int32).reshape(()) for _, _, first, _ in pieces]
  )
  operands = []
  for k, v, _, mask in pieces:
    operands += [k, v, jnp.asarray(mask, jnp.bool_)]
  return jax.ffi.ffi_call(
    build.ATTEND_TARGET,
    jax.ShapeDtypeStruct((b, kv, rows, dim + 1), jnp.float32),
  )(
    q.astype(jnp.float32),
    firsts,
    *operands,
    group=int(group),
    isa=isa_lib.number(isa),
  )
