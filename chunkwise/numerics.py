"""Numerics: whether a row's numbers depend on what it is computed beside.

A model's `numerics` is one of

  "invariant"  on the CPU, a row's logits, scores, top-n and tokens are
               bit-identical whatever the batch, the row's index in it, the
               other rows, the slot count, and how its context was cut into
               chunks and prefixes (a decode step equals a multi-position
               pass). Every sum a row's numbers go through has one fixed
               order that depends only on the row:
               - activation x weight matmuls, and row sums (norms, the
                 log-softmax's and the softmax's totals), run in
                 `cpu_kernels.invariant_matmul`: one FMA chain per output
                 in input order (k-major weights), or 16 lane chains and a
                 fixed tree (n-major weights, row sums);
               - attention (`models.attention`) takes the exact max of
                 every key's logit over all pieces of context first, then
                 chains exp(logit - max) * value over the keys in absolute
                 position order, piece after piece (an accumulator carried
                 from one kernel call to the next), so where a piece ends
                 changes no operation; masked keys add exact zeros;
               - the top-p filter's cumulative sum is a fixed scan.
               A TPU program keeps rows invariant across batches through
               Pallas kernels of fixed tiles (`tpu_invariant`); a GPU's
               runs XLA's dots (the twin): the property is not kept
               there (docs/numerics.md).
  "q8"         "invariant", with the activations of int8 and GGUF-block
               weights rounded to int8 per block of 32 inputs (llama.cpp's
               Q8_0 activations) instead of int16 per weight group: the
               integer sums are exact in any order, so it is invariant
               too, at four products per 32-bit lane (VNNI's vpdpbusd,
               AVX2's vpmaddubsw). Float weights run as "invariant". Its
               quality: docs/numerics.md.
  "fast"       XLA's own dots and reductions, whose order depends on the
               shapes (a row's scores move by ~3e-5 between batch sizes),
               and the decode kernel `cpu_kernels.matmul` up to 16 rows.

The setting applies while a program is traced (like `precision`):

  with numerics.scope("invariant"):
    ...                                 # traced code asks numerics.invariant()
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise import contract as contract_lib
from chunkwise import cpu_kernels, tpu_kernels
from chunkwise.contract import contract_dims

NUMERICS = ("invariant", "fast", "q8")
_INVARIANT = ("invariant", "q8")

_CURRENT = contextvars.ContextVar("chunkwise_numerics", default="fast")
# The platform a program being traced runs on, where its engine knows it:
# a kernel call then traces only that platform's branch (None: both, under
# `lax.platform_dependent`, as a program lowered for another platform
# needs; tracing both cost half of a SmolLM2 program's tracing).
_PLATFORM = contextvars.ContextVar("chunkwise_platform", default=None)
# Whether programs traced now run as on a TPU under invariant numerics, their
# Pallas kernels in TPU interpret mode (`tpu_interpret`: tests, on the CPU).
_TPU_INTERPRET = contextvars.ContextVar(
  "chunkwise_tpu_interpret", default=False
)


def resolve(numerics: str | None, quantized: bool = False) -> str:
  """`numerics` checked, or the default: "invariant" for float weights
  wherever it runs at full speed. "fast" for int8 weights (`quantized`):
  their invariant decode is the fast kernel's own, but their invariant
  prefill runs the integer kernel over every row, 0.39x-0.76x the speed
  of XLA's dot of the dequantized weight (docs/numerics.md). "fast" too
  on a CPU whose kernels have no vector path (`cpu_kernels.isa.vector()`:
  no AVX2 + FMA or NEON, or no compiler): the portable loops would be many
  times slower (said once, by `cpu_kernels.isa`); and "fast" on any other
  backend (a TPU's invariant programs cost 1.3x: docs/numerics.md). Asked
  for explicitly, invariant numerics run everywhere all the same (on a
  GPU, XLA's own dots: not invariant)."""
  if numerics is None:
    if quantized or jax.default_backend() != "cpu":
      return "fast"
    if not cpu_kernels.isa.vector():
      return "fast"
    return "invariant"
  if numerics not in NUMERICS:
    raise ValueError(
      f"numerics={numerics!r} is not a numerics mode; expected None or one "
      f"of {', '.join(NUMERICS)}"
    )
  return numerics


@contextlib.contextmanager
def scope(numerics: str):
  """Code traced inside computes with `numerics`."""
  token = _CURRENT.set(resolve(numerics))
  try:
    yield
  finally:
    _CURRENT.reset(token)


def traced(fn, numerics: str, platform: str | None = None):
  """`fn` traced under `scope(numerics)` (the engines wrap their programs'
  functions, beside `precision.with_precision`); with `platform` (the
  devices' platform, where the program runs on no other), kernel calls
  trace that platform's branch only."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    token = _PLATFORM.set(platform)
    try:
      with scope(numerics):
        return fn(*args, **kwargs)
    finally:
      _PLATFORM.reset(token)

  return wrapped


def may_run(platform: str) -> bool:
  """Whether the program being traced may run on `platform`: its engine
  named that platform or none (`traced`). A branch for a platform is
  traced only then (a CPU engine's programs trace no Pallas TPU kernel)."""
  return _PLATFORM.get() in (None, platform)


def runs_on(platform: str) -> bool:
  """Whether the program being traced runs on `platform` alone: its
  engine named it (`traced`). Code traced outside an engine (a layout's
  collective matmul called on its own, under shard_map's varying-axes
  check, which a Pallas call's result fails) gets False."""
  return _PLATFORM.get() == platform


def invariant() -> bool:
  """Whether the code being traced keeps rows invariant on the CPU (its
  kernels); a TPU program's invariance is `tpu_invariant`."""
  return _CURRENT.get() in _INVARIANT and _kernels() and not tpu_invariant()


def tpu_invariant() -> bool:
  """Whether the code being traced keeps rows invariant as a TPU program:
  invariant numerics in a program that runs on a TPU (`runs_on`), or
  inside `tpu_interpret`. Its weight matmuls then run
  `tpu_kernels.invariant_matmul` (`models.matmul`); everything else is
  XLA's (docs/numerics.md says what that keeps)."""
  if _CURRENT.get() not in _INVARIANT:
    return False
  return runs_on("tpu") or _TPU_INTERPRET.get()


def interpret() -> bool:
  """Whether a Pallas TPU kernel traced now runs in TPU interpret mode
  (`tpu_interpret`)."""
  return _TPU_INTERPRET.get()


@contextlib.contextmanager
def tpu_interpret():
  """Programs traced inside under invariant numerics run as a TPU's would
  (`tpu_invariant`), their Pallas kernels in Pallas' TPU interpret mode,
  on any backend: tests check a TPU program's invariance on the CPU.

    with numerics.tpu_interpret():
      result = model.prefill(chunk)     # traced (and run) inside
  """
  token = _TPU_INTERPRET.set(True)
  try:
    yield
  finally:
    _TPU_INTERPRET.reset(token)


def act8() -> bool:
  """Whether the code being traced rounds int8 and block weights'
  activations to int8 ("q8"), not int16."""
  return _CURRENT.get() == "q8" and _kernels()


def rows_invariant(numerics: str) -> bool:
  """Whether programs run under `numerics` keep rows invariant here (the
  host-side twin of `invariant`, outside any trace)."""
  return numerics in _INVARIANT and _kernels()


def _kernels() -> bool:
  return jax.default_backend() == "cpu" and cpu_kernels.load()


def _on_cpu(args, cpu, default):
  """`cpu(*args)` on the CPU backend, `default(*args)` elsewhere (only
  the one of the platform `traced` names, if it names one)."""
  platform = _PLATFORM.get()
  if platform is not None:
    return cpu(*args) if platform == "cpu" else default(*args)
  return lax.platform_dependent(*args, cpu=cpu, default=default)


def fixed_sums() -> bool:
  """Whether the code being traced sums a row's values in one fixed order
  (`invariant` or `tpu_invariant`): `row_sum`, `last_sum`, `exp_sum`."""
  return invariant() or tpu_invariant()


def _tpu_row_sum(x: jax.Array, shift: jax.Array | None = None) -> jax.Array:
  """`tpu_kernels.row_sums.row_sum` over x's last axis (of exp(x -
  shift), shift [..., 1]): a TPU program's fixed-order row sums."""
  rows = x.reshape(-1, x.shape[-1])
  if shift is not None:
    shift = shift.reshape(-1)
  out = tpu_kernels.row_sums.row_sum(rows, shift, interpret=interpret())
  return out.reshape(x.shape[:-1]).astype(x.dtype)


def row_sum(x: jax.Array) -> jax.Array:
  """The sum over x's last axis, in one fixed order per row (16 lane
  chains and a tree: `cpu_kernels.invariant_row_sum`; in a TPU program,
  `tpu_kernels.row_sums`)."""
  if tpu_invariant():
    return _tpu_row_sum(x)

  def kernel(x):
    return cpu_kernels.invariant_row_sum(x).astype(x.dtype)

  return _on_cpu((x,), kernel, lambda x: jnp.sum(x, axis=-1))


def _unary(x: jax.Array, op: str, twin) -> jax.Array:
  if not invariant():
    return twin(x)

  def kernel(x):
    return cpu_kernels.invariant_unary(x, op).astype(x.dtype)

  return _on_cpu((x,), kernel, twin)


def exp(x: jax.Array) -> jax.Array:
  """`jnp.exp`; under invariant numerics the kernel's, the same operations
  for every element (XLA:CPU's exp of an element depended on the array's
  shape: one routine in a loop's vector body, another in its remainder)."""
  return _unary(x, "exp", jnp.exp)


def log(x: jax.Array) -> jax.Array:
  """`jnp.log`; under invariant numerics the kernel's (see `exp`)."""
  return _unary(x, "log", jnp.log)


def tanh(x: jax.Array) -> jax.Array:
  """`jnp.tanh`; under invariant numerics 1 - 2 / (exp(2x) + 1)."""
  if not invariant():
    return jnp.tanh(x)
  return 1 - 2 / (exp(2 * x) + 1)


def silu(x: jax.Array) -> jax.Array:
  """`jax.nn.silu`; under invariant numerics x / (1 + exp(-x))."""
  if not invariant():
    return jax.nn.silu(x)
  return x * (1 / (1 + exp(-x)))


def gelu_tanh(x: jax.Array) -> jax.Array:
  """`jax.nn.gelu(x, approximate=True)` (with `tanh` above)."""
  if not invariant():
    return jax.nn.gelu(x, approximate=True)
  inner = math.sqrt(2 / math.pi) * (x + 0.044715 * (x * x * x))
  return 0.5 * x * (1 + tanh(inner))


def categorical(keys: jax.Array, logits: jax.Array) -> jax.Array:
  """`jax.vmap(jax.random.categorical)(keys, logits)` (one key per row of
  logits [rows, n]): the argmax of logits plus Gumbel noise -log(-log(u)),
  whose logs are `log`'s under invariant numerics."""
  if not invariant():
    return jax.vmap(jax.random.categorical)(keys, logits)
  tiny = jnp.finfo(logits.dtype).tiny
  n = logits.shape[-1]
  u = jax.vmap(
    lambda k: jax.random.uniform(k, (n,), logits.dtype, minval=tiny, maxval=1.0)
  )(keys)
  return jnp.argmax(logits - log(-log(u)), axis=-1)


def exp_sum(x: jax.Array, shift: jax.Array) -> jax.Array:
  """`row_sum(exp(x - shift))` keeping the last axis (shift [..., 1]), bit
  for bit, in one pass (`cpu_kernels.invariant_exp_sum`; in a TPU
  program, `tpu_kernels.row_sums`)."""
  if tpu_invariant():
    return _tpu_row_sum(x, shift)[..., None]

  def kernel(x, shift):
    return cpu_kernels.invariant_exp_sum(x, shift[..., 0])[..., None]

  def twin(x, shift):
    return jnp.sum(jnp.exp(x - shift), axis=-1, keepdims=True)

  return _on_cpu((x, shift), kernel, twin)


def last_sum(x: jax.Array) -> jax.Array:
  """`jnp.sum(x, axis=-1, keepdims=True)`; `row_sum` under invariant
  numerics (or a TPU program's under them)."""
  if fixed_sums():
    return row_sum(x)[..., None]
  return jnp.sum(x, axis=-1, keepdims=True)


def cumsum(x: jax.Array) -> jax.Array:
  """Cumulative sum over the last axis as a fixed scan (elementwise adds
  in an order set by the axis length alone)."""
  return lax.associative_scan(jnp.add, x, axis=x.ndim - 1)


def _quantized(w) -> bool:
  """A `models.quantized.QArray` (int8 values and scales), duck-typed:
  this module sits below models."""
  return hasattr(w, "values") and hasattr(w, "scale")


def _twin(eq: str, x, w) -> jax.Array:
  """XLA's dot of the weight cast to x's dtype (the non-CPU twin)."""
  lhs, rhs, order = contract_dims(eq)
  w = w.astype(x.dtype)
  out = lax.dot_general(x, w, ((lhs, rhs), ((), ())))
  return out if order is None else out.transpose(order)


def matmul(eq: str, x: jax.Array, w) -> jax.Array:
  """`contract(eq, x, w)` (w: an array or a `QArray`) with every output
  one fixed chain (`cpu_kernels.invariant_matmul`); the result has x's
  dtype. A weight whose contracted letters neither lead nor end it is
  first transposed so they lead."""
  lhs, rhs, order = contract_dims(eq)
  c = len(rhs)
  values = w.values if _quantized(w) else w
  nw = values.ndim
  if lhs != tuple(range(x.ndim - c, x.ndim)):
    raise ValueError(f"matmul {eq!r}: x's contracted letters must end it")
  if rhs == tuple(range(c)):
    nmajor = False
  elif rhs == tuple(range(nw - c, nw)):
    nmajor = True
  else:  # rare: bring the contracted dims to the front (a copy)
    rest = [d for d in range(nw) if d not in rhs]
    perm = (*rhs, *rest)
    letters = eq.split("->")[0].split(",")[1]
    moved = "".join(letters[d] for d in perm)
    eq = eq.replace(f",{letters}->", f",{moved}->")
    if _quantized(w):
      w = w.astype(x.dtype)
    return matmul(eq, x, jnp.transpose(w, perm))
  free_x = x.shape[: x.ndim - c]
  if nmajor:
    free_w = values.shape[: nw - c]
    k = math.prod(values.shape[nw - c :])
  else:
    free_w = values.shape[c:]
    k = math.prod(values.shape[:c])
  n = math.prod(free_w)

  def kernel(x, w):
    values = w.values if _quantized(w) else w
    w2 = values.reshape((1, n, k) if nmajor else (1, k, n))
    scale = None
    if _quantized(w):
      s = w.scale.astype(jnp.float32)
      scale = s.reshape((1, n, -1) if nmajor else (1, -1, n))
    rows = x.reshape(1, -1, k)
    out = cpu_kernels.invariant_matmul(
      rows, w2, scale, nmajor=nmajor, act8=scale is not None and act8()
    )
    out = out.reshape(*free_x, *free_w)
    return (out if order is None else out.transpose(order)).astype(x.dtype)

  return _on_cpu((x, w), kernel, lambda x, w: _twin(eq, x, w))


def batched(
  x: jax.Array,
  w: jax.Array,
  acc: jax.Array | None = None,
  *,
  nmajor: bool,
  ones: bool = False,
  heads: tuple | None = None,
  shift: jax.Array | None = None,
  rows: jax.Array | None = None,
  valid: jax.Array | None = None,
) -> jax.Array:
  """`cpu_kernels.invariant_matmul` of per-group operands (attention):
  x f32[G, M, K], w [..., K, N] (k-major) or [..., N, K] (n-major) whose
  leading dims multiply to G, acc f32[G, M, N + ones]; elsewhere the same
  sums by XLA (not invariant). heads: (first, count) reads heads [first,
  first + count) of w [b, kv, ..] (G = b * count) in place. shift
  f32[G, M]: x enters as `exp(x - shift[..., None])` (computed in the
  kernel, bit for bit that of `exp`). rows int32[n]: w [b', kv, S, D] is
  read at those rows (G = n * (count or kv)); valid int32[n or b]: a
  row's keys past valid[r] are masked by the caller and not read (the
  kernel's chains stop there; XLA's twin reads them all)."""
  if heads is not None:
    first = jnp.asarray(heads[0], jnp.int32).reshape(1)
    count = heads[1]
  operands = [x, w]
  if acc is not None:
    operands.append(acc)
  if shift is not None:
    operands.append(shift)

  def split(rest):
    acc = rest[0] if len(rest) > (shift is not None) else None
    return acc, (rest[-1] if shift is not None else None)

  def kernel(x, w, *rest):
    acc, sh = split(rest)
    return cpu_kernels.invariant_matmul(
      x,
      w,
      None,
      acc,
      nmajor=nmajor,
      ones=ones,
      shift=sh,
      heads=None if heads is None else (first, count),
      rows=rows,
      valid=valid,
    )

  def twin(x, w, *rest):
    acc, sh = split(rest)
    if sh is not None:
      x = exp(x - sh[..., None])
    if rows is not None:
      w = jnp.take(w, rows, axis=0, mode="clip")
    if heads is not None:
      w = lax.dynamic_slice_in_dim(w, first[0], count, axis=1)
    w = w.astype(jnp.float32).reshape(x.shape[0], *w.shape[-2:])
    if ones:
      w = jnp.concatenate([w, jnp.ones((*w.shape[:2], 1), w.dtype)], axis=2)
    out = jnp.einsum("gmk,gnk->gmn" if nmajor else "gmk,gkn->gmn", x, w)
    return out if acc is None else acc + out

  return _on_cpu(tuple(operands), kernel, twin)


def attend(queries: jax.Array, pieces: list, *, group: int, twin) -> jax.Array:
  """Attention's chains in one call (`cpu_kernels.invariant_attend`,
  `models.invariant_attention._fused`): queries f32[B, kv, T * group, D],
  pieces (k, v, first head, mask [mb, mr, mt, ms]) in position order;
  returns f32[B, kv, T * group, D + 1], the weighted values and the
  weights' sum. Elsewhere `twin()`, the same sums by the per-piece
  kernels."""

  def kernel(queries):
    return cpu_kernels.invariant_attend(queries, pieces, group=group)

  return _on_cpu((queries,), kernel, lambda queries: twin())


def _contract_override(eq: str, x, w):
  """`contract`'s product under invariant numerics (None: XLA's dot)."""
  return matmul(eq, x, w) if invariant() else None


contract_lib._override = _contract_override
