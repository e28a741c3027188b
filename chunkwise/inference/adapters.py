"""Per-row LoRA adapters of a call: which adapter each row runs, checked
against the prefixes it continues.

  served = AdapterSet.make(hparams, {"math": a, "chat": b}, engines)
  names, ids = served.rows("math", batch=4)       # every row "math"
  names, ids = served.rows(["math", None, "chat", None], batch=4)
  check_prefix(prefix, names)    # a prefix serves only its own adapter
  result = tagged(result, names)

A row's name is an adapter's or None (the base model); `ids` index the
stacks (`models.lora.stack`), -1 for the base model. The stacks are
placed once per engine, split like their base weights; their count is a
power of two (`lora.bucket`), so serving one more adapter within it
reuses every compiled program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from chunkwise.configs import HParams
from chunkwise.inference.results import ChunkResult
from chunkwise.models import lora


@dataclasses.dataclass(frozen=True)
class AdapterSet:
  """The adapters a model serves, stacked and placed on its engines."""

  adapters: Mapping[str, lora.Adapter]  # name -> adapter, in stack order
  placed: Mapping[int, tuple]  # id(engine) -> its placed stacks

  @classmethod
  def make(
    cls, hparams: HParams, adapters, engines, dtype=np.float32
  ) -> AdapterSet:
    """Checks `adapters` ({name: Adapter}) against `hparams` and places
    their stacks (in `dtype`) on each engine; ValueError names what does
    not fit."""
    if not isinstance(adapters, Mapping) or not adapters:
      raise ValueError(
        f"adapters must be a non-empty {{name: Adapter}} mapping, got "
        f"{adapters!r}"
      )
    for name, adapter in adapters.items():
      if not isinstance(name, str) or not name:
        raise ValueError(f"adapter names must be non-empty strings: {name!r}")
      if not isinstance(adapter, lora.Adapter):
        raise ValueError(
          f"adapter {name!r} must be a chunkwise Adapter "
          f"(cw.load_adapter), got {type(adapter).__name__}"
        )
    fitted = {}
    for name, adapter in adapters.items():
      try:
        fitted[name] = lora.fit(adapter, hparams)
      except ValueError as e:
        raise ValueError(f"adapter {name!r}: {e}") from None
    adapters = fitted
    stacks = lora.stack(hparams, list(adapters.values()), dtype)
    placed = {}
    for engine in engines:
      if id(engine) not in placed:
        placed[id(engine)] = engine.place_adapters(stacks)
    return cls(dict(adapters), placed)

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(self.adapters)

  def rows(self, adapters, batch: int):
    """(names per row, int32 ids per row) of a call's `adapters`: None
    (every row the base model), one name (every row), or one name or None
    per row."""
    return rows_of(adapters, batch, self.names)

  def call(self, engine, ids: np.ndarray):
    """What `engine`'s methods take as `adapters=`: None when every row
    runs the base model (the base model's programs), else (its stacks,
    ids)."""
    if np.all(ids < 0):
      return None
    return self.placed[id(engine)], ids


def rows_of(adapters, batch: int, known: Sequence[str]):
  """See `AdapterSet.rows`; `known` are the served names (empty for a
  model without adapters). ValueError names an unknown adapter."""
  if adapters is None or isinstance(adapters, str):
    names = (adapters,) * batch
  else:
    try:
      names = tuple(adapters)
    except TypeError:
      raise ValueError(
        f"adapters must be None, a name or one name (or None) per row, "
        f"got {adapters!r}"
      ) from None
    if len(names) != batch:
      raise ValueError(
        f"adapters has {len(names)} entries for a batch of {batch} rows"
      )
  ids = np.full((batch,), -1, np.int32)
  for r, name in enumerate(names):
    if name is None:
      continue
    if not isinstance(name, str) or name not in known:
      served = ", ".join(map(repr, known)) if known else "none"
      hint = "" if known else " (model.with_adapters({name: adapter}) first)"
      raise ValueError(
        f"row {r}: unknown adapter {name!r}; this model serves {served}{hint}"
      )
    ids[r] = known.index(name)
  return names, ids


def names_of(result: ChunkResult) -> tuple:
  """The adapter of each row of `result` (None: the base model)."""
  if result.adapters is None:
    return (None,) * result.batch
  return tuple(result.adapters)


def check_prefix(prefix: Sequence[ChunkResult], names: Sequence) -> None:
  """Raises ValueError when a call row would continue a prefix row made
  with another adapter (prefix row r serves rows r·k .. r·k + k - 1, k =
  batch / prefix batch)."""
  batch = len(names)
  for i, p in enumerate(prefix):
    if not batch or batch % p.batch:
      continue  # the call's own checks name the bad prefix batch
    made = names_of(p)
    k = batch // p.batch
    for r, name in enumerate(names):
      if made[r // k] != name:
        raise ValueError(
          f"row {r} runs {_label(name)} but continues prefix {i}, row "
          f"{r // k}, computed with {_label(made[r // k])}: a prefix's K/V "
          "cache is valid only for the adapter that made it"
        )


def _label(name) -> str:
  return "the base model" if name is None else f"adapter {name!r}"


def tagged(result: ChunkResult, names: Sequence) -> ChunkResult:
  """`result` remembering each row's adapter (None rows: the base)."""
  names = tuple(names)
  if all(n is None for n in names):
    return result.replace(adapters=None)
  return result.replace(adapters=names)
