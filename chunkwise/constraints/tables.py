"""One constraint compiled to token-automaton tables (host side, numpy).

  tables = compile_regex(r"-?(0|[1-9][0-9]*)", vocab, stop_ids=(2,), width=V)
  tables.bits         # uint32[S, ceil(V/32)]: allowed tokens, packed
  tables.token_class  # int32[V]: tokens with identical columns share a class
  tables.next_state   # int32[S, C]: next state per class, -1 = rejected
  tables.final        # bool[S]: the text so far matches
  tables.distance     # int32[S]: fewest tokens to a final state

Compilation (`automaton.py`: outlines-core's index, dense states, token
classes, packed bits, distances) runs in a worker process (`worker.py`)
under real limits: `time_limit_s` kills it, `max_compile_mb` caps its
memory, and the state count is checked against `max_table_mb` before the
tables are built out. Results are cached by (constraint, vocabulary bytes,
stop ids, width) in memory and on disk (`disk_cache.py`: reused across
processes and runs).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from chunkwise.constraints import automaton, disk_cache, worker


@dataclasses.dataclass(frozen=True, eq=False)
class Tables:
  """A compiled constraint (see the module docstring)."""

  regex: str
  bits: np.ndarray
  token_class: np.ndarray
  next_state: np.ndarray
  final: np.ndarray
  distance: np.ndarray
  build_s: float

  @property
  def states(self) -> int:
    return self.next_state.shape[0]

  @property
  def classes(self) -> int:
    return self.next_state.shape[1]

  @property
  def nbytes(self) -> int:
    return sum(
      a.nbytes
      for a in (
        self.bits,
        self.token_class,
        self.next_state,
        self.final,
        self.distance,
      )
    )

  def allowed(self, state: int) -> np.ndarray:
    """The ids allowed in `state` (for tests and debugging)."""
    bits = np.unpackbits(self.bits[state].view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[: self.token_class.shape[0]])

  def step(self, state: int, token: int) -> int:
    """The next state after `token` (-1: rejected)."""
    return int(self.next_state[state, self.token_class[token]])

  def budget_narrows(self, state: int, remaining: int, stop_ids) -> bool:
    """Whether budget forcing (`processor`'s `force`) with `remaining`
    columns left removes a token that `state` allows: a non-stop token
    after which no match and stop fit in the columns left. The host twin
    of the device's rule (`distance[next] + 2 <= remaining`)."""
    allowed = self.allowed(state)
    allowed = allowed[~np.isin(allowed, np.asarray(list(stop_ids)))]
    nxt = self.next_state[state, self.token_class[allowed]]
    far = self.distance[np.maximum(nxt, 0)]
    far = far[far < DEAD]  # states that cannot finish: never chosen anyway
    return bool(np.any(far + 2 > remaining))

  @property
  def longest(self) -> int:
    """The most tokens from a state that can still finish to a final one
    (budget forcing acts within this many columns of the end, plus 2)."""
    live = self.distance[self.distance < DEAD]
    return int(live.max()) if live.size else 0

  def forced(self, state: int) -> bool:
    """Whether `state` allows exactly one token (stop ids included): the
    constraint, not the model, chose it."""
    return int(np.bitwise_count(self.bits[state]).sum()) == 1


# `distance` of a state from which no final state can be reached.
DEAD = automaton.UNREACHED


@dataclasses.dataclass(frozen=True)
class Vocab:
  """A vocabulary's token bytes as outlines-core wants them.

  entries: {bytes: [ids]} without stop ids, control tokens and ids outside
  the logits width; key: a digest of the bytes, for caching.
  """

  entries: dict
  key: str


def vocab_of(
  token_bytes: Sequence[bytes | None], stop_ids: Sequence[int], width: int
) -> Vocab:
  """Token bytes (None: control token) -> outlines-core's vocabulary map."""
  stops = set(int(s) for s in stop_ids)
  entries: dict[bytes, list[int]] = {}
  digest = hashlib.sha256()
  for i, b in enumerate(token_bytes):
    if b is None or not b or i in stops or i >= width:
      continue
    entries.setdefault(b, []).append(i)
    digest.update(i.to_bytes(4, "little") + len(b).to_bytes(4, "little") + b)
  if not entries:
    raise ValueError("the vocabulary spells no token as bytes")
  return Vocab(entries=entries, key=digest.hexdigest())


_vocab_cache: dict[
  tuple, tuple[object, Vocab]
] = {}  # key -> (vocabulary, Vocab)


def check_vocabulary(vocabulary) -> None:
  """ValueError unless `vocabulary` spells its tokens (`token_bytes()`)."""
  if getattr(vocabulary, "token_bytes", None) is None:
    raise ValueError(
      f"constraints need the vocabulary's token bytes, but {vocabulary!r} "
      f"has no token_bytes() method (chunkwise's TokenizerVocabulary and "
      f"ByteVocabulary have one)"
    )


def check_stops(stop_ids: Sequence[int]) -> tuple[int, ...]:
  """The stop ids, sorted and distinct; ValueError when there are none."""
  stops = tuple(sorted(set(int(s) for s in stop_ids)))
  if not stops:
    raise ValueError(
      "a constraint needs a stop id to end on (the model has no EOS): pass "
      "stop_ids"
    )
  return stops


def cached_vocab(vocabulary, stop_ids: Sequence[int], width: int) -> Vocab:
  """`vocab_of` the vocabulary's `token_bytes()`, cached per vocabulary."""
  key = (id(vocabulary), tuple(sorted(stop_ids)), width)
  hit = _vocab_cache.get(key)
  if hit is not None and hit[0] is vocabulary:
    return hit[1]
  check_vocabulary(vocabulary)
  vocab = vocab_of(vocabulary.token_bytes(), stop_ids, width)
  if len(_vocab_cache) > 8:
    _vocab_cache.clear()
  _vocab_cache[key] = (vocabulary, vocab)
  return vocab


def compile_regex(
  regex: str,
  vocab: Vocab,
  *,
  stop_ids: Sequence[int],
  width: int,
  max_table_mb: float = 256.0,
  time_limit_s: float = 30.0,
  max_compile_mb: float = 4096.0,
  kind: str = "regex",
  what: str | None = None,
) -> Tables:
  """Compiles `regex` (Rust regex syntax; with `kind="schema"`, JSON
  schema text) into `Tables`; cached.

  Raises ValueError when it is invalid, matches nothing the vocabulary can
  spell, needs more than `max_table_mb` of tables, or takes longer than
  `time_limit_s` or more than `max_compile_mb` of memory to compile (the
  work is stopped; `what` names the constraint in the message).
  """
  out = _compiled(
    "tables",
    regex,
    vocab,
    stops=check_stops(stop_ids),
    width=int(width),
    max_table_mb=float(max_table_mb),
    time_limit_s=float(time_limit_s),
    max_compile_mb=float(max_compile_mb),
    kind=kind,
    what=what,
  )
  return out


def compile_dfa(
  regex: str,
  vocab: Vocab,
  *,
  stop_ids: Sequence[int],
  width: int,
  max_table_mb: float = 256.0,
  time_limit_s: float = 30.0,
  max_compile_mb: float = 4096.0,
  kind: str = "regex",
  what: str | None = None,
) -> dict:
  """`compile_regex` over a vocabulary of the single bytes (`byte_dfa.
  BYTES`), returning the DFA's arrays only (`automaton.dfa_table`:
  `table`, `final`, with `regex` and `build_s`); cached the same way."""
  return _compiled(
    "dfa",
    regex,
    vocab,
    stops=check_stops(stop_ids),
    width=int(width),
    max_table_mb=float(max_table_mb),
    time_limit_s=float(time_limit_s),
    max_compile_mb=float(max_compile_mb),
    kind=kind,
    what=what,
  )


_DFA_ARRAYS = ("table", "final", "regex", "build_s")


def _compiled(output, regex, vocab, *, stops, width, max_table_mb, kind, **run):
  """`automaton.build`'s result for `output` ("tables": as `Tables`;
  "dfa": its dict), from the memory cache, the disk cache, or the
  worker."""
  key = (output, kind, regex, vocab.key, stops, width, max_table_mb)
  hit = _table_cache.get(key)
  if hit is not None:
    return hit
  # (the token tables' disk keys are those from before "dfa" existed)
  on_disk = disk_cache.key(
    kind if output == "tables" else f"{output}:{kind}",
    regex,
    vocab.key,
    stops,
    width,
    max_table_mb,
  )
  if output == "tables":
    out = disk_cache.load(on_disk)
  else:
    out = disk_cache.load_arrays(on_disk, _DFA_ARRAYS)
    if out is not None and _dfa_fits(out):
      out = {
        **out,
        "regex": out["regex"].tobytes().decode(),
        "build_s": float(out["build_s"]),
      }
    else:
      out = None
  if out is None:
    out = worker.run(
      {
        "kind": kind,
        "text": regex,
        "stops": stops,
        "width": width,
        "max_table_mb": max_table_mb,
        "output": output,
      },
      vocab_key=vocab.key,
      vocab=vocab.entries,
      what=run.pop("what") or f"the constraint {_short(regex)}",
      **run,
    )
    if output == "tables":
      disk_cache.store(on_disk, out)
    else:
      disk_cache.store_arrays(
        on_disk,
        {
          **out,
          # as UTF-8 bytes: a NumPy string of a 77 M-character regex
          # took 0.3 s to make
          "regex": np.frombuffer(out["regex"].encode(), np.uint8),
          "build_s": np.array(out["build_s"]),
        },
      )
  return _keep(key, Tables(**out) if output == "tables" else out)


def _dfa_fits(a: dict) -> bool:
  """Whether a disk entry's arrays are shaped like one DFA's."""
  table, final = a["table"], a["final"]
  return (
    table.dtype == np.int32
    and final.dtype == np.bool_
    and table.ndim == 2
    and table.shape[1] == 256
    and table.shape[0] == final.shape[0] > 0
    and a["regex"].dtype == np.uint8
    and -1 <= int(table.min()) <= int(table.max()) < table.shape[0]
  )


def _keep(key, value):
  """`value`, remembered under `key` (the oldest forgotten past
  `_CACHE_SIZE` entries or `CACHE_BYTES` of arrays, all told)."""
  _table_cache[key] = value
  held = sum(map(held_bytes, _table_cache.values()))
  while len(_table_cache) > 1 and (
    len(_table_cache) > _CACHE_SIZE or held > CACHE_BYTES
  ):
    held -= held_bytes(_table_cache.pop(next(iter(_table_cache))))
  return value


def held_bytes(value) -> int:
  """Bytes of the arrays of a cached result (`Tables`, or a DFA's dict)."""
  if isinstance(value, Tables):
    return value.nbytes
  return sum(v.nbytes for v in value.values() if isinstance(v, np.ndarray))


def regex_of_schema(
  schema: str,
  *,
  kind: str = "schema",
  time_limit_s: float = 30.0,
  max_compile_mb: float = 4096.0,
  what: str = "the JSON schema",
) -> str:
  """The regex outlines-core builds for a JSON schema (text), computed in
  the worker under the same limits as tables; cached."""
  hit = _regex_cache.get((kind, schema))
  if hit is None:
    hit = worker.run(
      {
        "kind": kind,
        "text": schema,
        "stops": (),
        "width": 0,
        "max_table_mb": 0.0,
      },
      vocab_key=None,
      vocab=None,
      time_limit_s=float(time_limit_s),
      max_compile_mb=float(max_compile_mb),
      what=what,
    )["regex"]
    if len(_regex_cache) >= _CACHE_SIZE:
      _regex_cache.clear()
    _regex_cache[(kind, schema)] = hit
  return hit


_CACHE_SIZE = 64
# Compiled tables kept in memory, all told (a table may be 256 MB: 64 of
# them would hold 16 GB).
CACHE_BYTES = 1 << 30
_table_cache: dict[tuple, Tables] = {}
_regex_cache: dict[tuple[str, str], str] = {}


def clear_cache() -> None:
  """Forgets every compiled table (benchmarks time builds from scratch;
  `lazy.clear_cache` forgets lazy constraints too)."""
  _table_cache.clear()
  _regex_cache.clear()
  _vocab_cache.clear()


def _short(regex: str) -> str:
  return repr(regex if len(regex) <= 80 else regex[:77] + "...")
