"""Input validation on the host, before any device work (DESIGN.md §4.10).

Every check raises ValueError naming the offending value and what was
expected. Checks read host arrays (the chunks and ids a caller built) and
the static shapes of device arrays; they never wait for a device result
unless it is all they have to go by: a chunk whose tokens live on the
device is read back, and prefix lengths only when the prefixes' widths
allow a row to overflow `max_len`. So chained calls on device-resident
results (prefill -> generate -> prefill) dispatch without blocking.
"""

from __future__ import annotations

import itertools
import reprlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise import constraints as constraints_lib
from chunkwise import processors as processors_lib
from chunkwise.configs import HParams
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.results import ChunkResult
from chunkwise.inference.sampling import Sampling
from chunkwise.models import kv_int8
from chunkwise.processors import LogitsProcessor


def _host(x) -> np.ndarray:
  return np.asarray(x)


def check_chunk(chunk: Chunk, hparams: HParams) -> Chunk:
  """Shapes, lengths in [0, time], valid token ids in [0, vocab).

  Returns the chunk with int32 arrays, host arrays (or lists) as numpy and
  device arrays left on the device.
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
    tokens=_int32(chunk.tokens, tokens), lengths=_int32(chunk.lengths, lengths)
  )


def _int32(given, host: np.ndarray):
  """`given` as int32 where it lives: device arrays stay on the device."""
  if isinstance(given, jax.Array):
    return given if given.dtype == jnp.int32 else given.astype(jnp.int32)
  return host.astype(np.int32, copy=False)


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
    dim = kv_int8.width(hparams.head_dim, k.dtype)  # int8: with its scale
    want = (hparams.layers, hparams.kv_heads, dim)
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
  """Every row's prefix tokens plus `new_tokens` must fit in max_len.

  A prefix's width bounds its rows' lengths: when the widths allow no
  overflow, no length is read back from the device."""
  widest = sum(p.kv_cache.time for p in prefix) + int(np.max(new_tokens))
  if widest <= hparams.max_len:
    return
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


def check_prefill(
  hparams: HParams, chunk: Chunk, prefix: Sequence[ChunkResult], top_n
) -> tuple[Chunk, tuple[ChunkResult, ...], int]:
  """Validates the arguments of `InferenceModel.prefill`; returns them as
  the engine takes them."""
  chunk = check_chunk(chunk, hparams)
  prefix = check_prefix(prefix, chunk.batch, hparams)
  top_n = check_count("top_n", top_n, minimum=0, maximum=hparams.vocab)
  lengths = np.asarray(chunk.lengths)  # on the host unless given on device
  check_total_length(prefix, chunk.batch, lengths, hparams, "the chunk")
  return chunk, prefix, top_n


class GenerateCall(NamedTuple):
  """A validated generate call: what the engine's loop is built from."""

  prefix: tuple[ChunkResult, ...]
  sample_ids: np.ndarray  # int32[batch]
  steps: int
  top_n: int
  sampling: Sampling  # per-row arrays
  stop_ids: np.ndarray  # int32[n_stop], the model's EOS included
  processors: tuple[LogitsProcessor, ...]  # the constraint's last
  processor_states: tuple[Any, ...]  # their initial states (host arrays)

  @property
  def batch(self) -> int:
    return self.sample_ids.shape[0]


def check_generate(
  hparams: HParams,
  prefix: Sequence[ChunkResult],
  *,
  sample_ids,
  steps,
  sampling: Sampling | None,
  stop_ids,
  eos_ids: Sequence[int],
  top_n,
  processors,
  constraint,
  budget_forcing: bool,
  vocabulary,
) -> GenerateCall:
  """Validates every argument of `InferenceModel.generate` on the host,
  compiling the constraint and tracing the processors; raises ValueError
  naming the first bad value."""
  h = hparams
  sample_ids = check_ids("sample_ids", sample_ids, h, vocab=False)
  batch = sample_ids.shape[0]
  if batch == 0:
    raise ValueError("sample_ids is empty: generate needs at least one row")
  steps = check_count("steps", steps, minimum=1)
  top_n = check_count("top_n", top_n, minimum=0, maximum=h.vocab)
  prefix = check_prefix(prefix, batch, h)
  if sampling is None:
    sampling = Sampling()
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a chunkwise Sampling, got {sampling!r}")
  sampling = sampling.for_batch(batch)
  stop = check_ids("stop_ids", stop_ids, h, vocab=True)
  if eos_ids:
    stop = np.unique(np.append(stop, eos_ids)).astype(np.int32)
  check_total_length(prefix, batch, steps, h, f"{steps} steps")
  procs = processors_lib.as_tuple(processors)
  masking = constraints_lib.for_call(
    constraint,
    batch=batch,
    steps=steps,
    stop_ids=stop.tolist(),
    vocabulary=vocabulary,
    width=h.vocab,
    budget_forcing=budget_forcing,
    has_prefix=bool(prefix),
  )
  if masking is not None:  # the constraint's processor runs last
    procs = (*procs, masking)
  procs, states = processors_lib.check(
    procs, batch=batch, vocab=h.vocab, n_stop=stop.shape[0]
  )
  return GenerateCall(
    prefix=prefix,
    sample_ids=sample_ids,
    steps=steps,
    top_n=top_n,
    sampling=sampling,
    stop_ids=stop,
    processors=procs,
    processor_states=states,
  )


def check_live(
  hparams: HParams,
  *,
  slots_n,
  capacity,
  top_n,
  every,
  stop_width,
  processors,
  prefix,
  batch_split: int,
) -> tuple:
  """Validates `InferenceModel.live_slots`' arguments before any device
  work; returns them checked."""
  h = hparams
  n = check_count("slots", slots_n, minimum=1)
  if n % batch_split:
    raise ValueError(
      f"slots={n} must be a multiple of the layout's batch split "
      f"{batch_split} (the mesh axes that split attention's rows)"
    )
  capacity = check_count("capacity", capacity, minimum=1, maximum=h.max_len)
  top_n = check_count("top_n", top_n, minimum=0, maximum=h.vocab)
  every = check_count("every", every, minimum=1)
  stop_width = check_count("stop_width", stop_width, minimum=1)
  prefix = check_prefix(prefix, 1, h)
  if any(p.batch != 1 for p in prefix):
    raise ValueError(
      f"live_slots' prefix is shared by every request: each of its results "
      f"must have batch 1, got batches {[p.batch for p in prefix]}"
    )
  return (
    n,
    capacity,
    top_n,
    every,
    stop_width,
    processors_lib.as_tuple(processors),
    prefix,
  )
