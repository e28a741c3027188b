"""`matmul(x, w)`: a Pallas TPU matmul that reads a weight as it is stored
(bf16 / f32, int8 codes, or 4-bit codes two to a byte) and applies its
per-group scales (and offsets) inside the kernel.

XLA:TPU does not fuse an int8 weight's group scales into its dot: the
plain twin (`matmul.plain`) made a dequantized copy of the weight every
step, and `matmul.grouped` one dot per scale group, which made int8
decode *slower* than bf16 (docs/layouts.md). Here each (k, n) tile of
codes is read once from HBM, widened and scaled group by group into a
VMEM tile of x's dtype, and multiplied on the MXU; the f32 sums stay in
VMEM across the k tiles (the grid's last, "arbitrary" axis) and are
rounded to the output's dtype once. Nothing weight-sized is written.

  y = matmul(x, w)              # x [rows, K]; w an array [K, N], an
                                # int8 QArray or a k-major BlockArray
  y = matmul(x, w, nmajor=True) # a float w [N, K] (a tied table)
  y = invariant_matmul(x, w)    # rows in tiles of 128: invariant

How a weight is taken (`Stored.of`) and which (k, n) tiles the grid walks
over it (`tiles`) is `tpu_kernels.stored`; this module is the kernel, its
call and its cost.

**Invariance.** Every tile is the same program whatever the batch: with
`rows` fixed (the last row tile partial) a row's outputs are computed by
the same MXU and VPU operations in the same order whatever the other
rows are, how many there are, and where the row sits, so its bits do
not depend on them (`invariant_matmul`); the fast form tiles by the
rows there are. A TPU program under invariant numerics runs the
invariant form for every weight matmul (`models.matmul.invariant_on_tpu`).

The kernel's reduction order is k tile after k tile, and within a tile
the MXU's; it therefore differs from XLA's dot in the last bits
(`tests/test_tpu_kernels.py` compares it with the dequantized weight's
product in Pallas' interpret mode, on the CPU; tests/test_tpu_compile
compiles it for a TPU with libtpu).

XLA:TPU gives a Pallas call no cycle estimate of its own; the call
carries `cost_estimate` (its flops and the bytes it reads and writes),
which `cost` also returns for reports.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from chunkwise.tpu_kernels.stored import Stored, scales_per_tile, tiles

# Rows per tile of the invariant form: up to
# 128 rows the weight is read once (as the fast form's), and at decode's
# bytes per flop a v5e's MXU streams 128 rows in about the time its HBM
# delivers the weight tile (`cost`).
INVARIANT_ROWS = 128
# Rows per tile of the fast form beyond which rows are tiled too.
MAX_ROWS = 256
# Bytes of x's rows up to which they stay whole in VMEM.
_WHOLE_X_BYTES = 2 << 20


def _kernel(
  *refs,
  bits,
  per,
  tk,
  scaled,
  offset,
  per_tile,
  nmajor,
  x_tile,
  out_dtype,
  precision,
):
  """One (m, n, k) grid point: codes tile -> VMEM tile(s) of x's dtype,
  group by group (scales and offsets broadcast over a group's rows), one
  MXU product per tile (two for 4-bit codes: even and odd inputs)."""
  it = iter(refs)
  xs = [next(it)] if bits != 4 else [next(it), next(it)]
  codes = next(it)
  scale = next(it) if scaled else None
  off = next(it) if offset else None
  out = next(it)
  tiles = [next(it) for _ in xs] if scaled else []
  sums = next(it)  # f32 [tm, tn], carried across the k tiles
  k = pl.program_id(2)

  @pl.when(k == 0)
  def _():
    sums[...] = jnp.zeros(sums.shape, jnp.float32)

  if codes.ndim == 3:  # [tk, heads, D]: a head's columns at a time
    d = codes.shape[2]
    rows = xs[0][...] if x_tile is None else _x_tile(xs[0], k, x_tile)
    for h in range(codes.shape[1]):
      cols = pl.ds(h * d, d)
      if scaled:  # int8 codes, f32 scales [groups, heads, D] resident
        tile = tiles[0]
        for j in range(tk // per):
          s = scale[pl.ds(k * (tk // per) + j, 1), h, :]
          c = codes[j * per : (j + 1) * per, h, :]
          tile[j * per : (j + 1) * per, :] = (c.astype(jnp.float32) * s).astype(
            tile.dtype
          )
        w = tile[...]
      else:
        w = codes[:, h, :].astype(rows.dtype)
      sums[:, cols] += jax.lax.dot_general(
        rows,
        w,
        (((1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
      )

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
      out[...] = sums[...].astype(out_dtype)

    return
  if scaled:
    if per_tile:  # f16 as int16 bits: widened whole (`_f16_bits`)
      scales = _f16_bits(scale[...])
      offsets = _f16_bits(off[...]) if offset else None
    for j in range(tk // per):
      if per_tile:
        s = scales[j : j + 1]
        o = offsets[j : j + 1] if offset else None
      else:
        row = pl.ds(k * (tk // per) + j, 1)
        s = scale[row, :]
        o = off[row, :] if offset else None
      c = codes[j * per : (j + 1) * per, :]
      halves = [c] if bits != 4 else _nibbles(c)
      for tile, h in zip(tiles, halves, strict=True):
        w = h.astype(jnp.float32) * s
        if o is not None:
          w = w + o
        tile[j * per : (j + 1) * per, :] = w.astype(tile.dtype)
    weights = [t[...] for t in tiles]
  else:
    weights = [codes[...].astype(xs[0].dtype)]
  acc = sums[...]
  dims = (((1,), (1 if nmajor else 0,)), ((), ()))
  for x, w in zip(xs, weights, strict=True):
    rows = x[...] if x_tile is None else _x_tile(x, k, x_tile)
    acc = acc + jax.lax.dot_general(
      rows, w, dims, precision=precision, preferred_element_type=jnp.float32
    )
  sums[...] = acc

  @pl.when(k == pl.num_programs(2) - 1)
  def _():
    out[...] = acc.astype(out_dtype)


def _x_tile(x, k, x_tile):
  """x's whole rows in VMEM: the columns of k tile `k`."""
  return x[:, pl.ds(pl.multiple_of(k * x_tile, x_tile), x_tile)]


def _precision(dtype) -> jax.lax.Precision:
  """The tiles' product: f32 at full precision (Mosaic's fp32 contraction,
  six bf16 passes) where the matmul precision asks for more than one bf16
  pass ("high" too: Mosaic has no three-pass form); else the MXU's one
  pass."""
  if jnp.dtype(dtype) == jnp.float32 and _full_f32():
    return jax.lax.Precision.HIGHEST
  return jax.lax.Precision.DEFAULT


def _full_f32() -> bool:
  return jax.config.jax_default_matmul_precision in ("high", "highest")


def _f16_bits(bits):
  """f32 values of f16 numbers given as their int16 bits (Mosaic loads no
  f16 on a v5e): the exponent and mantissa moved into f32's places, times
  2**112 for the exponents' bias (exact for normal and subnormal f16)."""
  wide = bits.astype(jnp.int32)
  magnitude = jax.lax.bitcast_convert_type((wide & 0x7FFF) << 13, jnp.float32)
  magnitude = magnitude * jnp.float32(2.0**112)
  return jnp.where(wide < 0, -magnitude, magnitude)


def _nibbles(c):
  """A uint8 tile's low and high 4-bit codes (inputs 2i and 2i + 1)."""
  wide = c.astype(jnp.int32)
  return [wide & 15, wide >> 4]


def matmul(
  x: jax.Array,
  w,
  *,
  nmajor: bool = False,
  rows: int | None = None,
  out_dtype=jnp.float32,
  interpret: bool = False,
) -> jax.Array:
  """x [M, K] times the k-major weight w ([K, N] array, QArray or
  BlockArray; with `nmajor` a float [N, K]), [M, N] of `out_dtype` (f32
  sums, rounded once at the end). `rows`: rows
  per tile (the last tile partial; fixed: the invariant form); default
  min(M, MAX_ROWS) rounded up to 8. `interpret`: Pallas' interpret
  mode (any backend)."""
  if not (nmajor or hasattr(w, "scale")) and w.ndim == 2:
    k, n = w.shape
    if n % 128 and not k % 128:
      # A TPU lays such an array out column-major (its minor dim the one
      # 128 divides): read as [N, K], the transpose is free.
      return matmul(
        x, w.T, nmajor=True, rows=rows, out_dtype=out_dtype, interpret=interpret
      )
  stored = Stored.of(w, nmajor)
  if x.ndim != 2 or x.shape[1] != stored.k:
    raise ValueError(
      f"x {x.shape} must be [rows, {stored.k}] for weight "
      f"[{stored.k}, {stored.n}]"
    )
  m = x.shape[0]
  tm = rows or min(MAX_ROWS, -(-m // 8) * 8)
  # Rows that tm does not divide: the last row tile partial (Pallas pads
  # its reads and masks its writes; a row's sums never mix with another's,
  # so the padding reaches no row that is kept). No copy of x.
  padded = -(-m // tm) * tm
  tk, tn = tiles(stored)
  per = stored.group // (2 if stored.bits == 4 else 1)
  scaled = stored.scale is not None
  # 4-bit: inputs 2i with the low nibbles, 2i + 1 with the high ones
  xs = [x[:, 0::2], x[:, 1::2]] if stored.bits == 4 else [x]
  # x's whole rows stay in VMEM (read once, not once per column tile)
  # where they fit; else tiles of tk.
  whole_x = (
    tm * stored.k * x.dtype.itemsize <= _WHOLE_X_BYTES
    and tk != xs[0].shape[1]  # (one k tile: its tile is the whole row)
    and not tk % 128  # Mosaic slices lanes at 128s
  )
  if whole_x:
    x_spec = pl.BlockSpec((tm, xs[0].shape[1]), lambda i, j, k: (i, 0))
  else:
    x_spec = pl.BlockSpec((tm, tk), lambda i, j, k: (i, k))
  if stored.heads:  # whole heads of [K, H, D], as stored (no relayout)
    d = stored.codes.shape[2]
    w_spec = pl.BlockSpec((tk, tn // d, d), lambda i, j, k: (k, j, 0))
  elif nmajor:
    w_spec = pl.BlockSpec((tn, tk), lambda i, j, k: (j, k))
  else:
    w_spec = pl.BlockSpec((tk, tn), lambda i, j, k: (k, j))
  in_specs = [x_spec] * len(xs) + [w_spec]
  operands = [*xs, stored.codes]
  per_tile = scales_per_tile(stored)
  for extra in (stored.scale, stored.offset):
    if extra is None:
      continue
    if per_tile:  # the k tile's groups
      spec = pl.BlockSpec((tk // per, tn), lambda i, j, k: (k, j))
    else:  # every group of the column tile, kept resident
      spec = pl.BlockSpec((extra.shape[0], tn), lambda i, j, k: (0, j))
      if stored.heads:  # [groups, heads, D]: the column tile's heads
        d = extra.shape[2]
        spec = pl.BlockSpec(
          (extra.shape[0], tn // d, d), lambda i, j, k: (0, j, 0)
        )
    in_specs.append(spec)
    if extra.dtype == jnp.float16:
      extra = jax.lax.bitcast_convert_type(extra, jnp.int16)
    operands.append(extra)
  # a dequantized tile: the column tile's, or one head's
  tile_n = stored.codes.shape[2] if stored.heads else tn
  grid = (
    padded // tm,
    pl.cdiv(stored.n, tn),
    stored.k // (tk * (2 if stored.bits == 4 else 1)),
  )
  out = pl.pallas_call(
    functools.partial(
      _kernel,
      bits=stored.bits,
      per=per,
      tk=tk,
      scaled=scaled,
      offset=stored.offset is not None,
      per_tile=per_tile,
      nmajor=nmajor,
      x_tile=tk if whole_x else None,
      out_dtype=out_dtype,
      precision=_precision(x.dtype),
    ),
    grid=grid,
    in_specs=in_specs,
    out_specs=pl.BlockSpec((tm, tn), lambda i, j, k: (i, j)),
    out_shape=jax.ShapeDtypeStruct((m, stored.n), out_dtype),
    scratch_shapes=[
      *(pltpu.VMEM((tk, tile_n), x.dtype) for _ in (xs if scaled else ())),
      pltpu.VMEM((tm, tn), jnp.float32),
    ],
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "arbitrary")
    ),
    cost_estimate=cost(padded, stored, x.dtype, tm, out_dtype),
    interpret=bool(interpret),
    name="chunkwise_tpu_matmul",
  )(*operands)
  return out


def invariant_matmul(
  x, w, *, nmajor: bool = False, out_dtype=jnp.float32, interpret=False
) -> jax.Array:
  """`matmul` in tiles of `INVARIANT_ROWS` rows: a row's bits do not
  depend on the batch."""
  return matmul(
    x,
    w,
    nmajor=nmajor,
    rows=INVARIANT_ROWS,
    out_dtype=out_dtype,
    interpret=interpret,
  )


def cost(m: int, stored: Stored, dtype, tm=None, out_dtype=jnp.float32):
  """The call's flops and the bytes it reads (codes, scales, offsets once
  per tile of `tm` rows; x once, or once per column tile where tiles of
  `tm` of its rows do not stay whole in VMEM) and writes (outputs of
  `out_dtype`)."""
  _, tn = tiles(stored)
  tm = tm or min(m, MAX_ROWS)
  nbytes = sum(
    a.size * a.dtype.itemsize
    for a in (stored.codes, stored.scale, stored.offset)
    if a is not None
  )
  nbytes *= -(-m // tm)  # once per row tile
  x_bytes = m * stored.k * jnp.dtype(dtype).itemsize
  if tm * stored.k * jnp.dtype(dtype).itemsize > _WHOLE_X_BYTES:
    x_bytes *= -(-stored.n // tn)  # once per column tile
  nbytes += x_bytes
  nbytes += m * stored.n * jnp.dtype(out_dtype).itemsize
  # An f32 product at full precision is six bf16 passes of the MXU
  # (`_precision`): counted as six times the flops at its bf16 peak.
  passes = 6 if _precision(dtype) == jax.lax.Precision.HIGHEST else 1
  return pl.CostEstimate(
    flops=2 * m * stored.k * stored.n * passes,
    transcendentals=0,
    bytes_accessed=nbytes,
  )
