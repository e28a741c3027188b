"""Input validation on the host, before any device work (DESIGN.md §4.10).

Every check raises ValueError naming the offending value and what was
expected. They read only small arrays (token ids, lengths) back to the host.
"""

from __future__ import annotations

import itertools
import reprlib
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from chunkwise.configs import HParams
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.results import ChunkResult
from chunkwise.partitioning import Layout, LayoutKind
from chunkwise.partitioning import plan as plan_lib


def _host(x) -> np.ndarray:
  return np.asarray(x)


def check_placement(
  mesh,
  layout=None,
  prefill_layout=None,
  generate_layout=None,
  hparams: HParams | None = None,
):
  """Validates a mesh and layouts; returns (prefill layout, generate layout).

  `layout` sets both phases; `prefill_layout` / `generate_layout` override
  it per phase. Layouts may be `Layout`s or strings ("ws_2d/yz"). Without a
  mesh only the reference layout runs. With `hparams`, the mesh must divide
  every dimension each layout shards.
  """
  base = Layout() if layout is None else Layout.parse(layout)
  phases = tuple(
    base if given is None else Layout.parse(given)
    for given in (prefill_layout, generate_layout)
  )
  if mesh is not None and not isinstance(mesh, Mesh):
    raise ValueError(
      f"mesh must be a jax.sharding.Mesh (see chunkwise.partitioning."
      f"make_mesh), got {mesh!r}"
    )
  for phase, lay in zip(("prefill", "generate"), phases, strict=True):
    if lay.kind is LayoutKind.REFERENCE:
      continue
    if mesh is None:
      raise ValueError(
        f"{phase} layout {lay} shards the model and needs a mesh; pass "
        "mesh=chunkwise.partitioning.make_mesh(...)"
      )
    if hparams is not None:
      plan_lib.check(lay, mesh, hparams)
  return phases


def check_chunk(chunk: Chunk, hparams: HParams) -> Chunk:
  """Shapes, lengths in [0, time], valid token ids in [0, vocab).

  Returns the chunk with int32 device arrays (its fields may be lists or
  numpy arrays on the way in).
  """
  if not isinstance(chunk, Chunk):
    raise ValueError(f"expected a Chunk, got {type(chunk).__name__}")
  tokens, lengths = _host(chunk.tokens), _host(chunk.lengths)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(
      f"Chunk.tokens must be int[batch, time], got {tokens.dtype}"
      f"{list(tokens.shape)}"
    )
  if lengths.shape != (tokens.shape[0],) or not np.issubdtype(
    lengths.dtype, np.integer
  ):
    raise ValueError(
      f"Chunk.lengths must be int[{tokens.shape[0]}] (one per row), got "
      f"{lengths.dtype}{list(lengths.shape)}"
    )
  if tokens.shape[0] == 0:
    raise ValueError(
      f"Chunk has no rows: tokens shape {tokens.shape}; a chunk needs at "
      "least one row"
    )
  bad = (lengths < 0) | (lengths > tokens.shape[1])
  if bad.any():
    row = int(np.argmax(bad))
    raise ValueError(
      f"Chunk.lengths[{row}]={lengths[row]} is outside [0, "
      f"{tokens.shape[1]}] (the chunk's width)"
    )
  valid = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
  out = valid & ((tokens < 0) | (tokens >= hparams.vocab))
  if out.any():
    row, col = (int(i) for i in np.argwhere(out)[0])
    raise ValueError(
      f"token id {tokens[row, col]} at row {row}, position {col} is "
      f"outside the model's vocabulary [0, {hparams.vocab})"
    )
  return Chunk(
    tokens=jnp.asarray(tokens, jnp.int32),
    lengths=jnp.asarray(lengths, jnp.int32),
  )


def check_prefix(
  prefix: Sequence[ChunkResult], batch: int, hparams: HParams
) -> tuple[ChunkResult, ...]:
  """Prefix batches b0 | b1 | ... | batch; caches shaped for this model.

  Returns the prefix as a tuple.
  """
  if prefix is None:
    return ()
  if isinstance(prefix, ChunkResult):
    raise ValueError(
      "prefix must be a list of ChunkResults, got a single ChunkResult; "
      "wrap it in a list"
    )
  prefix = tuple(prefix)
  batches = []
  for i, p in enumerate(prefix):
    if not isinstance(p, ChunkResult):
      raise ValueError(
        f"prefix[{i}] must be a ChunkResult, got {type(p).__name__}"
      )
    k = p.kv_cache.k
    want = (hparams.layers, hparams.kv_heads, hparams.head_dim)
    got = (k.shape[0], k.shape[3], k.shape[4]) if k.ndim == 5 else k.shape
    if got != want or p.next_token_logits.shape[-1] != hparams.vocab:
      raise ValueError(
        f"prefix[{i}] does not fit this model: KV cache (layers, kv_heads, "
        f"head_dim) = {got}, next-token logits width "
        f"{p.next_token_logits.shape[-1]}; expected {want} and "
        f"{hparams.vocab}"
      )
    batches.append(p.batch)
  chain = [*batches, batch]
  for i, (small, big) in enumerate(itertools.pairwise(chain)):
    if small == 0 or big % small:
      what = f"prefix[{i + 1}]" if i + 1 < len(batches) else "the call"
      raise ValueError(
        f"prefix batch sizes must divide each other and the batch: "
        f"prefix[{i}] has batch {small}, which does not divide {what}'s "
        f"batch {big} (prefix batches {batches}, batch {batch})"
      )
  return prefix


def check_total_length(
  prefix: Sequence[ChunkResult],
  batch: int,
  new_tokens: np.ndarray | int,
  hparams: HParams,
  what: str,
) -> None:
  """Every row's prefix tokens plus `new_tokens` must fit in max_len."""
  total = np.zeros((batch,), np.int64)
  for p in prefix:
    total += np.repeat(_host(p.lengths).astype(np.int64), batch // p.batch)
  total += new_tokens
  if total.max() > hparams.max_len:
    row = int(np.argmax(total))
    raise ValueError(
      f"row {row} would reach {int(total[row])} tokens (prefixes plus "
      f"{what}), over the model's max_len={hparams.max_len}"
    )


def check_count(
  name: str, value, *, minimum: int, maximum: int | None = None
) -> int:
  """An int within [minimum, maximum]; returns it as a Python int."""
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise ValueError(f"{name} must be an int, got {value!r}")
  if value < minimum or (maximum is not None and value > maximum):
    bound = (
      f">= {minimum}" if maximum is None else (f"in [{minimum}, {maximum}]")
    )
    raise ValueError(f"{name} must be {bound}, got {value}")
  return int(value)


def check_ids(name: str, ids, hparams: HParams, *, vocab: bool) -> np.ndarray:
  """A 1-D array of non-negative ints (below vocab when `vocab`)."""
  arr = _host(ids)
  if arr.ndim != 1 or not (
    np.issubdtype(arr.dtype, np.integer) or arr.size == 0
  ):
    raise ValueError(
      f"{name} must be a 1-D sequence of ints, got "
      f"{reprlib.repr(ids)} ({arr.dtype}{list(arr.shape)})"
    )
  limit = hparams.vocab if vocab else 2**31
  bad = (arr < 0) | (arr >= limit)
  if bad.any():
    value = arr[np.argmax(bad)]
    raise ValueError(f"{name} contains {value}, outside [0, {limit})")
  return arr.astype(np.int32)
