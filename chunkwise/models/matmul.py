"""`weight_matmul(eq, x, w)`: activations times a weight, the weight read in
its own dtype on CPU.

XLA:CPU computes an int8 or bf16 weight's matmul by converting the whole
weight to the activations' dtype first (a copy of f32 bytes per call) and
then running its f32 dot, so decode, which is bound by weight bytes,
gained nothing from smaller weights (docs/performance.md
measures what the kernel changes). On the CPU backend, a matmul with few rows
(at most `MAX_ROWS`: decode steps, short chunks) whose weight's contracted
dims lead it ("k-major": q, k, v, o, gate, up, down, an untied
unembedding) or end it ("n-major": a tied embedding table unembedding)
calls `chunkwise.cpu_kernels.matmul` (through `jax.ffi`), which reads
each int8, bf16 or f32 weight element once and converts it in registers.
Under invariant numerics (`chunkwise.numerics`) every matmul on the CPU,
whatever its rows, runs `numerics.matmul` instead. Everything else, and
every other backend, takes the plain twin `plain`:
`contract(eq, x, w.astype(x.dtype))`, which tests compare the kernel
with. The kernel's f32 sums are cast to x's dtype. With int8 weights
(and AVX2) the kernel rounds x to int16 once per call, one scale per row
and weight group, and sums products in int32: each output differs from
the twin by at most sum_k |w_k| * max|x over k's group| / 65534
(`tests/test_cpu_kernels.py` asserts that bound).

  y = weight_matmul("bte,ehd->bthd", x, layer.q)     # QArray, bf16 or f32

A GGUF block-quantized weight (`models.blocks.BlockArray`) takes the
kernel on the CPU whatever its rows (4-bit codes unpacked in registers,
f16 scales and offsets widened per block of outputs: `_blocked`), a
dot per block on a TPU (`by_block`, below), the dequantizing twin
elsewhere (XLA:GPU's own fusion decides there).

On a TPU a quantized weight (int8 or GGUF blocks) in a k-major form
takes the Pallas kernel `tpu_kernels.matmul`: each tile of codes read
once, scaled group by group in VMEM, one MXU product per tile. XLA:TPU
does not fuse the dequantization (codes times their group scales) into
the dot, so `plain` materialised a dequantized copy of the weight at
every step (a 283 MiB f32 buffer for PaLM 540B's int8 embedding shard
on v4 4x4x4: `scripts/simulate.py --target=tpu-...`). The n-major forms
(a tied table's unembedding) take `grouped` (or `by_block`): each scale
group of the codes contracted on its own (exact in bf16, f32 sums), then
the per-group sums scaled and added; no weight-sized buffer either, but
one small dot per group, which made int8 decode slower than bf16.
An f32 weight at precision "highest" takes the kernel at any rows, from
`weight_matmul` and from the layouts' `contract` alike (`on_tpu`):
XLA:TPU runs that dot as six bf16 passes, and its backend's scheduling
of them made a 2-layer f32 prefill take 56 s to compile; with the kernel
(Mosaic's fp32 contraction of one tile) 5.6 s, at the same estimated
time (docs/planner.md, "Compile time"). A float [K, H, D] weight (q, k,
v) is read in its stored 3-D layout (`_heads_as_stored`): reshaped to
[K, H·D], XLA:TPU laid a few heads out again at every step. One head
([K, 1, D]: a multiquery k or v) goes 2-D, which is free.
"""

from __future__ import annotations

import functools
import math
import string

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise import contract as contract_lib
from chunkwise import cpu_kernels, numerics, tpu_kernels
from chunkwise.contract import contract, contract_dims
from chunkwise.models import schedule
from chunkwise.models.blocks import BlockArray
from chunkwise.models.quantized import QArray, is_grouped
from chunkwise.tpu_kernels import stored as stored_weights

# Rows (product of x's free dims) up to which the kernel runs: beyond, the
# matmul is bound by FLOPs, not bytes, and XLA's GEMM of the dequantized
# weight catches up (a one-off timing of f32 SmolLM2 MLP shapes on the
# 2-core CI machine had the two level at 1 and 16 rows, the kernel ahead
# at 4; not a script in this repository).
MAX_ROWS = 16
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Rows from which `plain` casts a weight in its layer's turn (see there).
AFTER_ROWS = 256


def plain(eq: str, x: jax.Array, w) -> jax.Array:
  """The XLA twin: the weight cast (a QArray dequantized) to x's dtype.

  On the CPU, a matmul of at least `AFTER_ROWS` rows (a prefill's) casts
  its weight only once x is there (`schedule.after`): else XLA casts every
  layer's weights at the program's start, all live at once. Fewer rows
  (decode, inside a loop) keep XLA's cast hoisted out of the loop, made
  once per call: tied to x, it would be a select over the cast weight at
  every step."""
  cast = w.astype(x.dtype)
  lhs = contract_dims(eq)[0]
  rows = math.prod(n for d, n in enumerate(x.shape) if d not in lhs)
  if (
    jax.default_backend() == "cpu"
    and (is_grouped(w) or w.dtype != x.dtype)
    and rows >= AFTER_ROWS
  ):
    cast = schedule.after(x, cast)
  return contract(eq, x, cast)


def grouped(eq: str, x: jax.Array, w: QArray) -> jax.Array:
  """`plain(eq, x, w)` for an int8 `w` without its dequantized copy: one
  dot per scale group of the int8 values (converted inside the dot), the
  group sums scaled and added. A contracted axis split into groups
  becomes (group, entry); one with a scale per entry (o's heads) is kept
  apart like a group; free axes take their scale after the sums."""
  ins, out = eq.replace(" ", "").split("->")
  xs, ws = ins.split(",")
  if math.prod(n for c, n in zip(xs, x.shape, strict=True) if c in out) == 1:
    # One row: XLA rewrites the dot as multiply-and-reduce and converts
    # the whole weight first, a weight-sized f32 buffer; two rows (one of
    # zeros) keep the dot.
    i = next((j for j, c in enumerate(xs) if c in out), None)
    if i is not None:
      two = jnp.concatenate([x, jnp.zeros_like(x)], axis=i)
      return lax.slice_in_dim(grouped(eq, two, w), 0, 1, axis=out.index(xs[i]))
  spare = (c for c in string.ascii_letters if c not in eq)
  values, scale = w.values, w.scale.astype(jnp.float32)
  x_labels, x_shape = list(xs), list(x.shape)
  w_labels, w_shape, s_labels, s_shape, summed = [], [], [], [], []
  for label, n, g in zip(ws, values.shape, scale.shape, strict=True):
    contracted = label in xs and label not in out
    if contracted and 1 < g < n:  # groups of n // g entries
      k = next(spare)
      w_labels += [k, label]
      w_shape += [g, n // g]
      i = x_labels.index(label)
      x_labels[i : i + 1] = [k, label]
      x_shape[i : i + 1] = [g, n // g]
      s_labels.append(k)
      summed.append(k)
    else:
      w_labels.append(label)
      w_shape.append(n)
      if g != 1:
        s_labels.append(label)
        if contracted:  # a scale per entry: summed after scaling
          summed.append(label)
    if g != 1:
      s_shape.append(g)
  wide = out + "".join(summed)
  part = jnp.einsum(
    f"{''.join(x_labels)},{''.join(w_labels)}->{wide}",
    x.reshape(x_shape),
    values.reshape(w_shape).astype(x.dtype),
    preferred_element_type=jnp.float32,
  )
  scaled = jnp.einsum(
    f"{wide},{''.join(s_labels)}->{out}",
    part,
    scale.reshape(s_shape),
    precision=lax.Precision.HIGHEST,
  )
  return scaled.astype(x.dtype)


def by_block(eq: str, x: jax.Array, w: BlockArray) -> jax.Array:
  """`plain(eq, x, w)` for GGUF blocks without their dequantized copy (a
  TPU's path, like `grouped` for int8): the codes contracted block by
  block, converted inside the dots, each block's sum times its scale;
  4-bit codes as two dots over the bytes as they are (low nibbles with
  x's even entries, high ones with its odd: no interleaving copy); then,
  where the format has offsets, each block's sum of x times its offset
  (the same contraction over a ones weight, a constant XLA broadcasts
  inside the dot)."""
  if w.bits == 4:
    lhs, rhs, _ = contract_dims(eq)
    i = lhs[rhs.index(w.axis)]  # x's axis the blocks run along
    n = x.shape[i]
    even = lax.slice_in_dim(x, 0, n, stride=2, axis=i)
    odd = lax.slice_in_dim(x, 1, n, stride=2, axis=i)
    out = grouped(eq, even, QArray(values=w.values & 15, scale=w.scale))
    out = out + grouped(eq, odd, QArray(values=w.values >> 4, scale=w.scale))
  else:
    out = grouped(eq, x, QArray(values=w.values, scale=w.scale))
  if w.offset is None:
    return out
  ones = jnp.ones(w.shape, jnp.int8)
  return out + grouped(eq, x, QArray(values=ones, scale=w.offset))


def _form(eq: str, x, w, max_rows: int | None = MAX_ROWS) -> bool | None:
  """n-major (True), k-major (False), or None where the kernel does not
  apply to `eq` and these operands (more than `max_rows` rows)."""
  if not is_grouped(w) and jnp.dtype(w.dtype) not in _DTYPES:
    return None
  shape = tuple(w.shape)  # a QArray's or BlockArray's: the weight's
  lhs, rhs, order = contract_dims(eq)
  c = len(rhs)
  if order is not None or c == 0:
    return None
  if lhs != tuple(range(x.ndim - c, x.ndim)):
    return None
  nw = len(shape)
  if rhs == tuple(range(c)):
    nmajor = False
  elif rhs == tuple(range(nw - c, nw)):
    nmajor = True
  else:
    return None
  if max_rows is not None and math.prod(x.shape[: x.ndim - c]) > max_rows:
    return None
  if isinstance(w, BlockArray) and w.axis != (nw - 1 if nmajor else c - 1):
    return None  # blocks along the last contracted dim only
  if is_grouped(w):  # free dims of the scale must be whole
    free = range(c, nw) if not nmajor else range(nw - c)
    if any(w.scale.shape[i] != shape[i] for i in free):
      return None
  return nmajor


def _on_tpu(eq: str, x, w) -> jax.Array:
  """A matmul on a TPU: a quantized weight's k-major forms (any rows),
  and a float weight's up to `MAX_ROWS` rows (decode, where XLA turns a
  one-row dot into a multiply-and-reduce), through the Pallas kernel
  (`tpu_kernels.matmul`: the weight read once, scaled in VMEM); a
  quantized n-major form (a tied table's unembedding) through `grouped`
  / `by_block`; the rest XLA's dot (`plain`)."""
  whole = is_grouped(w) or _six_passes(x, w)
  nmajor = _form(eq, x, w, max_rows=None if whole else MAX_ROWS)
  if nmajor is False or (nmajor and not is_grouped(w)):
    kernel = functools.partial(tpu_kernels.matmul, nmajor=nmajor)
    return _kernel(eq, x, w, nmajor, kernel)
  if isinstance(w, BlockArray):
    return by_block(eq, x, w)
  if isinstance(w, QArray):
    return grouped(eq, x, w)
  return plain(eq, x, w)


def _six_passes(x, w) -> bool:
  """An f32 product at precision "highest": XLA:TPU runs its dot as six
  bf16 passes and its backend's scheduling of them is what made a 2-layer
  f32 prefill take 46-56 s to compile (docs/planner.md); the Pallas kernel's
  one tile compiles in a fraction of it (Mosaic's fp32 contraction)."""
  return (
    jnp.dtype(x.dtype) == jnp.float32
    and not is_grouped(w)
    and jnp.dtype(w.dtype) == jnp.float32
    and jax.config.jax_default_matmul_precision == "highest"
  )


def invariant_on_tpu(eq: str, x: jax.Array, w) -> jax.Array:
  """A TPU program's matmul under invariant numerics
  (`numerics.tpu_invariant`): `tpu_kernels.invariant_matmul`, whose rows
  are tiled by a fixed count whatever the batch, so a row's bits do not
  depend on the rows beside it. The weight is read as the fast kernel
  reads it (`_kernel`: k-major codes and scales, a float n-major table,
  [K, H, D] heads as stored). Other forms are brought to one first: an
  output in another order is computed in its own and transposed (an
  activation), x's contracted dims moved to its end, a weight's moved to
  its front (a copy, as `numerics.matmul` makes), and an n-major
  quantized weight (a tied int8 or block table's unembedding: the kernel
  scales k-major codes only) dequantized to x's dtype, a weight-sized
  copy per call."""
  lhs, rhs, order = contract_dims(eq)
  ins, out = eq.replace(" ", "").split("->")
  xs, ws = ins.split(",")
  if order is not None:  # the free letters in their own order, then moved
    own = "".join(c for c in xs + ws if c in out)
    y = invariant_on_tpu(f"{xs},{ws}->{own}", x, w)
    return jnp.transpose(y, [own.index(c) for c in out])
  c = len(rhs)
  if lhs != tuple(range(x.ndim - c, x.ndim)):
    perm = [d for d in range(x.ndim) if d not in lhs] + list(lhs)
    moved = "".join(xs[d] for d in perm)
    return invariant_on_tpu(f"{moved},{ws}->{out}", jnp.transpose(x, perm), w)
  nw = len(w.shape)
  if rhs not in (tuple(range(c)), tuple(range(nw - c, nw))):
    perm = [*rhs, *(d for d in range(nw) if d not in rhs)]
    moved = "".join(ws[d] for d in perm)
    w = w.astype(x.dtype) if is_grouped(w) else w
    return invariant_on_tpu(f"{xs},{moved}->{out}", x, jnp.transpose(w, perm))
  nmajor = _form(eq, x, w, max_rows=None)
  if nmajor is None or (nmajor and is_grouped(w)):
    w = w.astype(x.dtype)  # a dtype the kernel does not read, or n-major codes
    nmajor = _form(eq, x, w, max_rows=None)
  kernel = functools.partial(
    tpu_kernels.invariant_matmul, nmajor=nmajor, interpret=numerics.interpret()
  )
  return _kernel(eq, x, w, nmajor, kernel)


def on_tpu(eq: str, x: jax.Array, w: jax.Array) -> jax.Array | None:
  """`contract`'s product of a float weight (the layouts' collective
  matmuls call it on weight shards) in a program an engine runs on a TPU
  (`numerics.runs_on`), where the kernel applies: an f32 weight at
  precision "highest", whatever the rows (`_six_passes`), or a k-major
  bf16 / f32 weight at up to `MAX_ROWS` rows, as `weight_matmul` takes
  it (XLA:TPU's dot of one row is a multiply-and-reduce: Llama-3.1-8B's
  bf16 step on v5e 2x2 estimated at 2.45x the time with it,
  docs/planner.md). None elsewhere (XLA's dot)."""
  if numerics.tpu_invariant():
    return invariant_on_tpu(eq, x, w)
  if not numerics.runs_on("tpu") or is_grouped(w):
    return None
  six = _six_passes(x, w)
  if _form(eq, x, w, max_rows=None if six else MAX_ROWS) is not False:
    return None
  return _on_tpu(eq, x, w)  # (the kernel: k-major, rows within reach)


def _kernel(eq: str, x, w, nmajor: bool, tpu=None) -> jax.Array:
  """The CPU kernel on `eq`'s operands as [rows, K] x [K, N] (or [N, K]);
  with `tpu` (`tpu_kernels.matmul`), that Pallas kernel instead."""
  _, rhs, _ = contract_dims(eq)
  c = len(rhs)
  shape = tuple(w.shape)  # a QArray's or BlockArray's: the weight's
  free_x = x.shape[: x.ndim - c]
  if nmajor:
    free_w = shape[: len(shape) - c]
    k = math.prod(shape[len(shape) - c :])
  else:
    free_w = shape[c:]
    k = math.prod(shape[:c])
  rows, n = math.prod(free_x), math.prod(free_w)
  kw = k // 2 if isinstance(w, BlockArray) and w.bits == 4 else k
  codes = w.values if is_grouped(w) else w
  w2 = codes.reshape((n, kw) if nmajor else (kw, n))

  def per_group(a):  # f16 ones are widened inside the kernel's call
    return a.reshape((n, -1) if nmajor else (-1, n))

  scale = per_group(w.scale) if is_grouped(w) else None
  offset = None
  if isinstance(w, BlockArray) and w.offset is not None:
    offset = per_group(w.offset)
  if tpu is not None:
    if _heads_as_stored(w, nmajor, c):
      w2 = w  # [K, H, D]: the kernel reads whole heads in place
    elif isinstance(w, BlockArray):
      w2 = w.replace(values=w2, scale=scale, offset=offset, axis=0)
    elif isinstance(w, QArray):
      w2 = QArray(values=w2, scale=scale)
    out = tpu(x.reshape(rows, k), w2, out_dtype=x.dtype)
    return out.reshape(*free_x, *free_w)
  out = cpu_kernels.matmul(
    x.reshape(rows, k),
    w2,
    scale,
    nmajor=nmajor,
    offset=offset,
    act8=numerics.act8(),  # (cpu_kernels.matmul: int8 and 4-bit weights only)
  )
  return out.reshape(*free_x, *free_w).astype(x.dtype)


def _heads_as_stored(w, nmajor: bool, contracted: int) -> bool:
  """A k-major weight [K, H, D] (q, k, v; float, or int8 with f32 scales
  [G, H, D]) that the Pallas kernel reads in its stored 3-D layout
  (`stored_weights.heads_as_stored`): reshaped to [K, H·D], a TPU laid a
  few heads (fewer than its sublanes) out again at every step
  (`compile_depth`'s `weight_relayouts`)."""
  return contracted == 1 and stored_weights.heads_as_stored(w, nmajor)


def _blocked(eq: str, x: jax.Array, w: BlockArray) -> jax.Array:
  """A block-quantized weight's matmul: on the CPU the kernel reads its
  codes in place, whatever the rows (its fixed chains serve invariant
  numerics too); on a TPU `by_block`; elsewhere, or where its form does
  not fit the kernel, the codes are dequantized inside the jit (the plain
  twin; under invariant numerics through `numerics.matmul`)."""
  nmajor = _form(eq, x, w, max_rows=None)
  on_cpu = jax.default_backend() == "cpu" and numerics.may_run("cpu")
  branches = {}
  if numerics.may_run("tpu"):
    branches["tpu"] = lambda x, w: _on_tpu(eq, x, w)
  if nmajor is None or not on_cpu or not cpu_kernels.load():
    if numerics.invariant():
      return numerics.matmul(eq, x, w.astype(jnp.float32))
  else:
    branches["cpu"] = lambda x, w: _kernel(eq, x, w, nmajor)
  return lax.platform_dependent(
    x, w, default=lambda x, w: plain(eq, x, w), **branches
  )


def weight_matmul(eq: str, x: jax.Array, w) -> jax.Array:
  """`plain(eq, x, w)`, through the CPU kernel where it applies (module
  doc). `w`: an array or a `QArray`."""
  if numerics.tpu_invariant():
    return invariant_on_tpu(eq, x, w)
  if isinstance(w, BlockArray):
    return _blocked(eq, x, w)
  if numerics.invariant():
    return numerics.matmul(eq, x, w)
  nmajor = _form(eq, x, w)
  branches = {}
  # Only a CPU-backed process builds the kernel (none on a GPU host).
  on_cpu = jax.default_backend() == "cpu" and numerics.may_run("cpu")
  if nmajor is not None and on_cpu and cpu_kernels.load():
    branches["cpu"] = lambda x, w: _kernel(eq, x, w, nmajor)
  on_tpu = isinstance(w, QArray) or nmajor is not None
  on_tpu = on_tpu or (_six_passes(x, w) and _form(eq, x, w, None) is not None)
  if on_tpu and numerics.may_run("tpu"):
    branches["tpu"] = lambda x, w: _on_tpu(eq, x, w)
  if not branches:
    return plain(eq, x, w)
  return lax.platform_dependent(
    x, w, default=lambda x, w: plain(eq, x, w), **branches
  )


contract_lib._quantized = weight_matmul
contract_lib._tpu = on_tpu
