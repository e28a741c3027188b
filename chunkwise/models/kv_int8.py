"""int8 K/V: keys and values stored as int8 with a scale per token and head.

A stored K/V vector of `head_dim` floats becomes `head_dim` int8 values and
the 4 bytes of its f32 scale, packed on the last axis:

  packed[..., :head_dim]   round(y / scale), in [-127, 127]
  packed[..., head_dim:]   scale = max |y| / 127, bitcast to 4 int8

where y = H x, x rotated by the orthonormal Walsh-Hadamard matrix H (over
blocks of the largest power of two dividing head_dim; `rotate`). Keys have
a few channels far larger than the rest, and one scale per vector left
the others a handful of levels; rotated, every channel carries a share of
them. On SmolLM2 (scripts/int8_quality.py, docs/performance.md) the
rotation cut the mean KL against f32 K/V from 0.0008 to 0.0002 nats.
Attention then runs in the rotated space: q·k = Hq·Hk and
softmax(..)·Hv = H(softmax(..)·v), so `attention.attend` rotates the
queries in and its output back (H is its own inverse), a head_dim-wide
butterfly per query row; the keys and values it reads are never rotated
back.

Every K/V array keeps its shape but the last axis (head_dim + 4), so every
cache, buffer, pool, slice, write and sharding that moves K/V works on it
unchanged; only writing (`encode`) and reading (`decode`) know. A 64-wide
SmolLM2 head takes 68 bytes instead of 256 (f32) or 128 (bf16).

Every attention reads keys and values as they are stored, the chunk's own
included (`as_stored` rounds them before the chunk attends to itself,
inside the forward passes that `storing` marks): a token's key is the same
numbers whether it is read from its own chunk, a prefix cache, the decode
loop's buffer or a page of the pool, so cutting a context into chunks, a
prefix-cache hit and chunked prefill keep their results (bit for bit under
invariant numerics). Rotation and rounding are elementwise and the scale a
max (exact in any order): they depend on nothing but the token's own
vector.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax import lax

INT8 = jnp.dtype(jnp.int8)
SCALE_BYTES = 4  # the f32 scale, bitcast
DTYPES = ("float32", "bfloat16", "float16", "int8")

_STORED = contextvars.ContextVar("chunkwise_kv_dtype", default=None)


def check_dtype(kv_dtype) -> jnp.dtype:
  """`kv_dtype` (a name or dtype) as a dtype, or a ValueError naming it."""
  try:
    dtype = jnp.dtype(kv_dtype)
  except TypeError:
    dtype = None
  if dtype is None or dtype.name not in DTYPES:
    raise ValueError(
      f"kv_dtype={kv_dtype!r} is not a K/V dtype; expected one of "
      f"{', '.join(DTYPES)}"
    )
  return dtype


def resolve(kv_dtype, cache_dtype) -> jnp.dtype:
  """The K/V storage dtype from `kv_dtype` or its older name `cache_dtype`
  (float32 when neither is given); ValueError when both are given and
  differ, or either is not a K/V dtype."""
  if kv_dtype is None:
    return check_dtype(jnp.float32 if cache_dtype is None else cache_dtype)
  dtype = check_dtype(kv_dtype)
  if cache_dtype is not None and check_dtype(cache_dtype) != dtype:
    raise ValueError(
      f"kv_dtype={kv_dtype!r} and cache_dtype={cache_dtype!r} disagree; "
      "give one (cache_dtype is kv_dtype's older name)"
    )
  return dtype


def is_int8(dtype) -> bool:
  return jnp.dtype(dtype) == INT8


def width(head_dim: int, dtype) -> int:
  """The last axis of stored K/V of `dtype`."""
  return head_dim + SCALE_BYTES if is_int8(dtype) else head_dim


def bytes_per_vector(head_dim: int, dtype) -> int:
  """Bytes of one stored key (or value) of one head."""
  return width(head_dim, dtype) * jnp.dtype(dtype).itemsize


def rotate(x: jax.Array) -> jax.Array:
  """H x over the last axis (f32): the orthonormal Walsh-Hadamard
  transform of each block of b values, b the largest power of two
  dividing it (a butterfly of adds and subtracts, log2 b stages). H is
  symmetric and orthonormal, so rotate(rotate(x)) == x up to rounding."""
  x = x.astype(jnp.float32)
  *lead, d = x.shape
  b = d & -d
  h = 1
  while h < b:  # pairs h apart: (a, c) -> (a + c, a - c)
    y = x.reshape(*lead, d // (2 * h), 2, h)
    a, c = y[..., 0, :], y[..., 1, :]
    x = jnp.stack([a + c, a - c], axis=-2).reshape(*lead, d)
    h *= 2
  return x * (b**-0.5)


def encode(x: jax.Array, dtype) -> jax.Array:
  """K/V `x` [..., head_dim] as stored in `dtype`: a cast, or for int8 the
  rotated, packed values and scale (`x` already packed int8 is returned
  as it is)."""
  if not is_int8(dtype):
    return x.astype(dtype)
  if x.dtype == INT8:
    return x
  y = rotate(x)
  scale = jnp.max(jnp.abs(y), axis=-1, keepdims=True) / 127.0
  safe = jnp.where(scale > 0, scale, 1.0)
  values = jnp.clip(jnp.round(y / safe), -127, 127).astype(INT8)
  scale_bytes = lax.bitcast_convert_type(scale, INT8)  # [..., 1, 4]
  return jnp.concatenate(
    [values, scale_bytes.reshape(*y.shape[:-1], SCALE_BYTES)], axis=-1
  )


def decode(a: jax.Array) -> jax.Array:
  """Packed int8 K/V as f32 [..., head_dim] in the rotated space (values
  times scale); any other dtype as it is."""
  if a.dtype != INT8:
    return a
  scale = lax.bitcast_convert_type(a[..., -SCALE_BYTES:], jnp.float32)
  return a[..., :-SCALE_BYTES].astype(jnp.float32) * scale[..., None]


@contextlib.contextmanager
def storing(dtype):
  """Code traced inside is a forward pass whose K/V will be stored in
  `dtype`: for int8, `attention.attend` reads the chunk's own keys and
  values as they will read back (`as_stored`), in the rotated space."""
  token = _STORED.set(jnp.dtype(dtype))
  try:
    yield
  finally:
    _STORED.reset(token)


def rotating() -> bool:
  """Whether attention traced here runs in the rotated space (its
  forward stores int8 K/V)."""
  dtype = _STORED.get()
  return dtype is not None and is_int8(dtype)


def as_stored(x: jax.Array) -> jax.Array:
  """The chunk's own K/V `x` as attention reads it: rotated and rounded as
  it will be stored where `rotating`, else as it is."""
  return decode(encode(x, INT8)) if rotating() else x


def as_read(k: jax.Array, v: jax.Array, rotated: bool):
  """A prefix piece's stored k, v decoded into attention's space: rotated
  when `rotated`, plain otherwise (int8 pieces are stored rotated)."""
  if (k.dtype == INT8) == rotated:
    return decode(k), decode(v)
  if rotated:
    return rotate(k), rotate(v)
  return rotate(decode(k)), rotate(decode(v))
