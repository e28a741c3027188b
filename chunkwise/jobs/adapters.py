"""LoRA adapters in batch jobs: the `--adapters` mapping, read before any
device work, and the shared prefix computed once per adapter.

  named = parse("math=/ad/math,chat=/ad/chat")  # {"math": "/ad/math", ...}
  loaded = load(named, hparams)                  # {name: lora.Adapter}
  model = model.with_adapters(loaded)
  shared = SharedPrefix.prefill(model, prefix_tokens, {"math", None})
  prefix = shared.rows(["math", None, "math"])  # a call's prefix list

A job serves every adapter `--adapters` names; each example runs one (its
JSON "adapter" field, else `--adapter`, else the base model: None), and
examples of different adapters share batches: a call passes its rows'
names (`adapters=[...]`). A prefix's K/V cache is valid only for the
adapter that computed it, so the shared prefix is prefilled once per
adapter the examples run (batch 1 each); a call whose rows all run one
adapter continues that result, and a call that mixes adapters a result
of one row per call row, copied from them (`rows`), never recomputed.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from chunkwise.checkpoints import load_adapter
from chunkwise.configs import HParams
from chunkwise.inference import Chunk, ChunkResult, InferenceModel, KVCache
from chunkwise.models import lora

# An adapter's name: what a JSON line's "adapter" field and `--adapter`
# give; the flag's syntax (name=path,...) rules out "=" and ",".
NAME = re.compile(r"[\w.\-]+")


def parse(value) -> dict[str, str]:
  """{name: path} of `--adapters`: "name=path,name2=path2" (or a mapping
  already; None or "" for none). ValueError names the bad entry: a
  missing "=", an empty or odd name, an empty path, a name given twice."""
  if value is None or (isinstance(value, str) and not value.strip()):
    return {}
  if isinstance(value, str):
    pairs = []
    for item in value.split(","):
      name, sep, path = item.partition("=")
      if not sep:
        raise ValueError(
          f"--adapters={value!r}: {item.strip()!r} is not name=path"
        )
      pairs.append((name.strip(), path.strip()))
  elif isinstance(value, Mapping):
    pairs = list(value.items())
  else:
    raise ValueError(
      f"adapters={value!r}: expected 'name=path,...' or a {{name: path}} "
      "mapping"
    )
  named: dict[str, str] = {}
  for name, path in pairs:
    if not isinstance(name, str) or not NAME.fullmatch(name):
      raise ValueError(
        f"--adapters: adapter name {name!r} must be letters, digits, "
        "'_', '.' or '-'"
      )
    if isinstance(path, os.PathLike):
      path = os.fspath(path)
    if not isinstance(path, str):
      raise ValueError(
        f"--adapters: adapter {name!r}: path {path!r} is not a string"
      )
    if not path:
      raise ValueError(f"--adapters: adapter {name!r} has no path")
    if name in named:
      raise ValueError(
        f"--adapters: adapter name {name!r} is given twice ({named[name]} "
        f"and {path})"
      )
    named[name] = path
  return named


def load(named: Mapping[str, str], hparams: HParams) -> dict[str, lora.Adapter]:
  """Reads every adapter of `named` for a model of `hparams` (host arrays
  only); ValueError names the adapter whose directory is missing or
  does not fit."""
  loaded = {}
  for name, path in named.items():
    try:
      loaded[name] = load_adapter(path, hparams)
    except (ValueError, OSError) as e:
      raise ValueError(f"--adapters: adapter {name!r}: {e}") from None
  return loaded


def checksums(loaded: Mapping[str, lora.Adapter]) -> dict[str, str]:
  """{name: `Adapter.checksum`}: what a resumed job must serve again."""
  return {name: a.checksum for name, a in loaded.items()}


def of_rows(rows: Sequence) -> list[str | None]:
  """The adapter of each row of a batch (`examples.Prepared` or None for
  a padding row, which repeats the first row and so runs its adapter)."""
  fill = rows[0].example.adapter
  return [fill if r is None else r.example.adapter for r in rows]


def call_arg(names: Sequence[str | None]):
  """What a model call takes as `adapters=`: None when every row runs
  the base model (the call a job without adapters makes), else the
  list of names."""
  return None if all(n is None for n in names) else list(names)


def record_field(row) -> dict:
  """{"adapter": name} for an output record of `row` (a Prepared), {} for
  the base model (records of jobs without adapters are unchanged)."""
  name = row.example.adapter
  return {} if name is None else {"adapter": name}


@dataclasses.dataclass(frozen=True)
class SharedPrefix:
  """The job's shared prefix, prefilled once per adapter its examples run
  (empty without a shared prefix)."""

  results: Mapping[str | None, ChunkResult]  # batch 1 each
  mesh: object = None  # the model's (None: JAX's default device)

  @classmethod
  def prefill(
    cls,
    model: InferenceModel,
    tokens: Sequence[int],
    names: Iterable[str | None],
  ) -> SharedPrefix:
    """`tokens` prefilled once for each adapter of `names` (None: the
    base model), in a fixed order (the base model first, then by name)
    so that every process runs the same programs."""
    if not tokens:
      return cls({})
    chunk = Chunk.from_lists([list(tokens)])
    order = sorted(set(names), key=lambda n: (n is not None, n or ""))
    return cls({n: model.prefill(chunk, adapters=n) for n in order}, model.mesh)

  def rows(self, names: Sequence[str | None]) -> list[ChunkResult]:
    """The prefix list of a call whose rows run `names`: [] without a
    shared prefix; the batch-1 result of their adapter when all run one;
    else a result of one row per call row, row r copied from the result
    of adapter names[r]."""
    if not self.results:
      return []
    if len(set(names)) == 1:
      return [self.results[names[0]]]
    order = list(self.results)
    index = np.asarray([order.index(n) for n in names], np.int32)
    if self.mesh is not None:  # every process holds the same index
      index = jax.device_put(index, NamedSharding(self.mesh, P()))
    untagged = tuple(r.replace(adapters=None) for r in self.results.values())
    return [_gather(untagged, index).replace(adapters=tuple(names))]


@jax.jit  # one program per (number of adapters, call batch)
def _gather(results: tuple[ChunkResult, ...], index: jax.Array) -> ChunkResult:
  """Row r: the single row of results[index[r]]."""

  def take(leaves, axis: int):
    return jnp.take(jnp.concatenate(leaves, axis=axis), index, axis=axis)

  cache = KVCache(
    k=take([r.kv_cache.k for r in results], 1),  # [layers, batch, ...]
    v=take([r.kv_cache.v for r in results], 1),
    lengths=take([r.kv_cache.lengths for r in results], 0),
  )
  return ChunkResult(
    per_token_scores=take([r.per_token_scores for r in results], 0),
    top_ids=take([r.top_ids for r in results], 0),
    top_logprobs=take([r.top_logprobs for r in results], 0),
    next_token_logits=take([r.next_token_logits for r in results], 0),
    kv_cache=cache,
  )
