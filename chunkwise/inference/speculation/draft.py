"""The "draft" drafter: the target's own weights in int8 propose its tokens.

  drafts = draft.propose(infer, shards, draft_weights, caches, buffer,
                         inputs, rows, y0, keep0, width=k, steps=w)

`steps` single-position steps of the draft weights: y0 -> d1, d1 -> d2,
..., each attending to the target's own K/V of everything kept (the
prefix caches and the loop's buffer, exact) and to the draft's K/V of the
tokens it fed in this iteration (a scratch buffer of `width` columns,
dropped afterwards). So the draft needs no prefill and no catch-up of its
own: what it reads of the past is the target's, and what it writes lives
one iteration. Each d_j is drawn with the key of its position and the
row's sampling settings (DESIGN.md §4.5), as the target draws there:
where the int8 and f32 distributions are close, the same key draws the
same token. Processors are not applied (`verify.forced` puts their forced
tokens in afterwards). The steps run with "fast" numerics: only the
verify pass decides tokens, so a draft's bits never reach a result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from chunkwise import numerics
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.kv_cache import LayerKV
from chunkwise.inference.logits import LogitsShards


def propose(
  infer,
  shards: LogitsShards,
  weights,
  caches: tuple,
  buffer: LayerKV,
  inputs,
  rows,
  y0: jax.Array,
  keep0: jax.Array,
  *,
  width: int,
  steps: jax.Array,
) -> jax.Array:
  """int32[rows, width]: the first `steps` (traced, <= width) drafts after
  each row's y0 (module docstring); later columns are zeros. Rows that
  do not keep y0 (`keep0` false) compute nothing that is used."""
  here = buffer.k[0]  # [rows here, kv_heads, time, head_dim]
  # (the loop's rows: some of the buffer's, `LayerKV.rows`)
  n = here.shape[0] if buffer.rows is None else buffer.rows.shape[0]
  shape = (n, here.shape[1], width, here.shape[3])
  blank = tuple(jnp.zeros(shape, here.dtype) for _ in buffer.k)
  lengths = keep0.astype(jnp.int32)

  def step(j, carry):
    token, scratch, drafts = carry
    scratch = scratch.replace(lengths=jnp.full_like(lengths, j))
    chunk = Chunk(tokens=token[:, None], lengths=lengths)
    with numerics.scope("fast"):
      full = infer(weights, (*caches, buffer, scratch), chunk)
    scratch = scratch.write(full.kv_cache.k, full.kv_cache.v, j)
    token, *_ = shards.sample(
      full.logits[:, 0],
      inputs.sampling,
      inputs.sample_ids,
      rows.positions + j + 1,
      0,
    )
    token = token.astype(jnp.int32)
    drafts = lax.dynamic_update_slice_in_dim(drafts, token[:, None], j, axis=1)
    return token, scratch, drafts

  scratch = LayerKV(k=blank, v=blank, lengths=jnp.zeros_like(lengths))
  drafts = jnp.zeros((y0.shape[0], width), jnp.int32)
  _, _, drafts = lax.fori_loop(
    0, steps, step, (y0.astype(jnp.int32), scratch, drafts)
  )
  return drafts
