"""A decode step's attention in a fast TPU program: the step's query
heads to every piece of its context (prefix caches, the generate loop's
buffer, the step's own key) in one call of
`tpu_kernels.decode_attention`, where XLA:TPU ran some fifteen small
ops a layer (docs/planner.md).

  out = attend(q, k, v, prefix, options)   # f32[B, 1, H, D], or None

It applies (`attention._attend` asks it first) to one position per row,
without a sliding window, where every piece is float K/V (of the
batch's rows, or of fewer shared by them: a few-shot prefix) that the
kernel reads (`decode_attention.reads`) in place: not a slot loop's
buffer, nor a long generate loop's, which a TPU stores time-major
(`_time_major`). None otherwise,
and attention takes its plain path (the pieces' sums merged), which is
this path's twin. A stacked cache is read at its layer in place (handed
a layer's slice, XLA:TPU copies it out for a Pallas call), a cache's
keys as a TPU stores them ([b, kv, D, S]), a heads-major buffer as it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from chunkwise import numerics
from chunkwise.models.prefix_layer import PrefixLayer


def _piece(layer: PrefixLayer, batch: int):
  """`layer` as the kernel's piece for `batch` query rows (in place where
  it can be; a piece of fewer rows serves batch / b rows each)."""
  from chunkwise.tpu_kernels.decode_attention import Piece

  lengths = jnp.repeat(layer.lengths, batch // layer.batch)
  # A window of kv heads (`PrefixLayer.heads`) read where it lies.
  head = 0 if layer.first is None else layer.first
  if layer.heads_major:  # a loop's buffer (its running rows where they are)
    rows = None
    if layer.rows is not None:
      rows = jnp.repeat(layer.rows, batch // layer.batch)
    return Piece(layer.k, layer.v, lengths, head=head, rows=rows)
  if layer.stacked is None:  # a cache of its own: its window cut out
    layer, head = layer.sliced().gathered(), 0
  keys, values, at = layer.as_stored()
  return Piece(keys, values, lengths, transposed=True, layer=at, head=head)


# Bytes of one layer's k (or v) of a loop's buffer up to which XLA:TPU
# keeps it in VMEM through the loop (copied in once a call in the order
# the kernel reads), where it is stored time-major.
_STAGED_BYTES = 256 << 10


def _time_major(layer: PrefixLayer) -> bool:
  """Whether `layer` is a loop's buffer that a TPU stores time-major
  (`partitioning.formats`: several kv heads a device) and the kernel,
  which reads it heads-major, would have copied whole at every step: a
  slot loop's, or a long one (the plain path reads it in place)."""
  if not layer.heads_major or layer.k.shape[1] == 1:
    return False
  return layer.rows is not None or layer.k.nbytes > _STAGED_BYTES


def attend(q, k, v, prefix, options, *, scale: float) -> jax.Array | None:
  """Attention of q [B, 1, H, D] (RoPE applied, not scaled: `scale`) to
  the float pieces `prefix` (`PrefixLayer`s, decoded) and the step's own
  k, v [B, 1, KV, D]: f32[B, 1, H, D]; None where the kernel does not
  apply (see the module docstring)."""
  from chunkwise.tpu_kernels import decode_attention

  batch, time, heads, dim = q.shape
  kv_heads = k.shape[2]
  if time != 1 or options.window is not None or heads % kv_heads:
    return None
  pieces = []
  for layer in prefix:
    if layer.width == 0:  # holds nothing to attend to
      continue
    if batch % layer.batch or _time_major(layer):
      return None
    piece = _piece(layer, batch)
    if not decode_attention.reads(piece):
      return None
    pieces.append(piece)
  own = decode_attention.Piece(
    k.reshape(batch, kv_heads, 1, dim),
    v.reshape(batch, kv_heads, 1, dim),
    jnp.ones((batch,), jnp.int32),
  )
  if not decode_attention.reads(own):
    return None
  out = decode_attention.decode(
    q.reshape(batch, kv_heads, heads // kv_heads, dim),
    [*pieces, own],
    scale=scale,
    softcap=options.softcap,
    # Rounded in the kernel to q's dtype, as its caller rounds it (a
    # bf16 layer's o-projection reads bf16): XLA drops the round trip.
    out_dtype=q.dtype,
    interpret=numerics.interpret(),
  )
  return out.reshape(batch, 1, heads, dim).astype(jnp.float32)
