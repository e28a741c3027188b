"""One constraint compiled to token-automaton tables (host side, numpy).

  tables = compile_regex(r"-?(0|[1-9][0-9]*)", vocab, stop_ids=(2,), width=V)
  tables.bits         # uint32[S, ceil(V/32)]: allowed tokens, packed
  tables.token_class  # int32[V]: tokens with identical columns share a class
  tables.next_state   # int32[S, C]: next state per class, -1 = rejected
  tables.final        # bool[S]: the text so far matches
  tables.distance     # int32[S]: fewest tokens to a final state

outlines-core's `Index` walks every vocabulary token through the regex's
DFA from every state and keeps the tokens that do not die. Here its states
are renumbered densely (the initial one is 0), its single-EOS self-loops
are replaced by *every* stop id in final states only, and tokens whose
next-state columns agree in every state are merged into classes (found by
hashing each column with two random 64-bit signatures; the result is
checked against every transition). Tables are sized by the logits width
`width`: ids the vocabulary does not spell (padding, control tokens) are
never allowed.

Compilation runs in a worker thread under a time limit, and the state count
is read from the index before its transitions are expanded, so an automaton
whose mask bits would exceed `max_table_mb` is refused before it is built
out. Results are cached by (regex, vocabulary bytes, stop ids, width).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import threading
import time
from collections.abc import Sequence

import numpy as np


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


def cached_vocab(vocabulary, stop_ids: Sequence[int], width: int) -> Vocab:
  """`vocab_of` the vocabulary's `token_bytes()`, cached per vocabulary."""
  key = (id(vocabulary), tuple(sorted(stop_ids)), width)
  hit = _vocab_cache.get(key)
  if hit is not None and hit[0] is vocabulary:
    return hit[1]
  token_bytes = getattr(vocabulary, "token_bytes", None)
  if token_bytes is None:
    raise ValueError(
      f"constraints need the vocabulary's token bytes, but {vocabulary!r} "
      f"has no token_bytes() method (chunkwise's TokenizerVocabulary and "
      f"ByteVocabulary have one)"
    )
  vocab = vocab_of(token_bytes(), stop_ids, width)
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
) -> Tables:
  """Compiles `regex` (Rust regex syntax) into `Tables`; cached.

  Raises ValueError when the regex is invalid, matches nothing the
  vocabulary can spell, needs more than `max_table_mb` of tables, or takes
  longer than `time_limit_s` to compile.
  """
  stops = tuple(sorted(set(int(s) for s in stop_ids)))
  if not stops:
    raise ValueError(
      "a constraint needs a stop id to end on (the model has no EOS): pass "
      "stop_ids"
    )
  return _cached(
    regex, vocab, stops, int(width), float(max_table_mb), float(time_limit_s)
  )


def _cached(regex, vocab, stops, width, max_table_mb, time_limit_s):
  key = (regex, vocab.key, stops, width, max_table_mb)
  hit = _table_cache.get(key)
  if hit is not None:
    return hit
  cancel = threading.Event()
  pool = concurrent.futures.ThreadPoolExecutor(1)
  future = pool.submit(_build, regex, vocab, stops, width, max_table_mb, cancel)
  pool.shutdown(wait=False)
  try:
    tables = future.result(timeout=time_limit_s)
  except concurrent.futures.TimeoutError:
    cancel.set()
    raise ValueError(
      f"compiling the constraint {_short(regex)} took over {time_limit_s:g} s "
      f"(time_limit_s); simplify it (fewer or shorter repetitions, smaller "
      f"maxLength / maxItems) or raise the limit"
    ) from None
  while len(_table_cache) >= _CACHE_SIZE:
    _table_cache.pop(next(iter(_table_cache)))
  _table_cache[key] = tables
  return tables


_CACHE_SIZE = 64
_table_cache: dict[tuple, Tables] = {}


def clear_cache() -> None:
  """Forgets every compiled table (benchmarks time builds from scratch)."""
  _table_cache.clear()
  _vocab_cache.clear()


def _short(regex: str) -> str:
  return repr(regex if len(regex) <= 80 else regex[:77] + "...")


class _Cancelled(Exception):
  pass


def _build(regex, vocab, stops, width, max_table_mb, cancel) -> Tables:
  import outlines_core

  start = time.perf_counter()
  try:
    index = outlines_core.Index(
      regex, outlines_core.Vocabulary(stops[0], vocab.entries)
    )
  except ValueError as e:
    message = str(e)
    if "incompatible" in message or "no transitions" in message.lower():
      raise ValueError(
        f"the constraint {_short(regex)} matches no text this vocabulary "
        f"can spell"
      ) from None
    raise ValueError(
      f"the constraint {_short(regex)} is not a supported regex: {message}"
    ) from None
  if cancel.is_set():
    raise _Cancelled
  n_states = _count_states(index)
  words = -(-width // 32)
  mb = n_states * words * 4 / 2**20
  if mb > max_table_mb:
    raise ValueError(
      f"the constraint {_short(regex)} needs {n_states} automaton states, "
      f"{mb:.0f} MB of mask bits at vocabulary width {width}, over the "
      f"limit of max_table_mb={max_table_mb:g}; simplify it (e.g. a "
      f"smaller maxLength) or raise the limit"
    )
  transitions = index.get_transitions()
  if cancel.is_set():
    raise _Cancelled
  initial = index.get_initial_state()
  finals = set(index.get_final_states())
  tables = _tables(regex, transitions, initial, finals, stops, width)
  if not tables.final[0] and tables.allowed(0).size == 0:
    raise ValueError(
      f"the constraint {_short(regex)} matches no text this vocabulary can "
      f"spell"
    )
  return dataclasses.replace(tables, build_s=time.perf_counter() - start)


def _varint(data: bytes, at: int) -> tuple[int, int]:
  """bincode's variable-length integer at `at`: (value, next offset)."""
  tag = data[at]
  if tag < 251:
    return tag, at + 1
  size = {251: 2, 252: 4, 253: 8, 254: 16}[tag]
  return int.from_bytes(data[at + 1 : at + 1 + size], "little"), at + 1 + size


def _count_states(index) -> int:
  """States with transitions, read from the index's serialized header
  (initial state, final-state set, then the transition map's length)."""
  data = index.__reduce__()[1][0]
  _, at = _varint(data, 0)
  n_final, at = _varint(data, at)
  for _ in range(n_final):
    _, at = _varint(data, at)
  n_states, _ = _varint(data, at)
  return n_states


def _tables(regex, transitions, initial, finals, stops, width) -> Tables:
  # Dense state ids, the initial state first.
  raw = sorted(set(transitions) | finals | {initial})
  raw.remove(initial)
  raw = [initial, *raw]
  number = {s: i for i, s in enumerate(raw)}
  n = len(raw)
  empty = np.zeros(0, np.int64)
  src, tok, dst = [empty], [empty], [empty]
  for s, row in transitions.items():
    tok.append(np.fromiter(row.keys(), np.int64, len(row)))
    dst.append(
      np.fromiter((number[t] for t in row.values()), np.int64, len(row))
    )
    src.append(np.full(len(row), number[s], np.int64))
  src, tok, dst = (np.concatenate(a) for a in (src, tok, dst))
  # outlines' one EOS loop goes with every other stop id (none is text here)
  # and ids past the logits width; each stop id then loops on every final
  # state.
  keep = (tok < width) & ~np.isin(tok, stops)
  src, tok, dst = src[keep], tok[keep], dst[keep]
  final = np.zeros(n, bool)
  final[[number[s] for s in finals]] = True
  f = np.flatnonzero(final)
  stop_arr = np.asarray(stops, np.int64)
  stop_arr = stop_arr[stop_arr < width]
  src = np.concatenate([src, np.repeat(f, stop_arr.size)])
  tok = np.concatenate([tok, np.tile(stop_arr, f.size)])
  dst = np.concatenate([dst, np.repeat(f, stop_arr.size)])

  token_class, n_classes = _classes(src, tok, dst, n, width)
  next_state = np.full((n, n_classes), -1, np.int32)
  next_state[src, token_class[tok]] = dst
  if not np.array_equal(next_state[src, token_class[tok]], dst) or np.any(
    next_state[:, 0] >= 0
  ):
    raise RuntimeError("token-class signatures collided; please report")

  words = -(-width // 32)
  bits = np.zeros((n, words), np.uint32)
  for lo in range(0, n, 256):  # bounded memory: 256 dense rows at a time
    dense = next_state[lo : lo + 256][:, token_class] >= 0
    dense = np.pad(dense, ((0, 0), (0, words * 32 - width)))
    packed = np.packbits(dense, axis=1, bitorder="little")
    bits[lo : lo + 256] = np.ascontiguousarray(packed).view("<u4")
  return Tables(
    regex=regex,
    bits=bits,
    token_class=token_class.astype(np.int32),
    next_state=next_state,
    final=final,
    distance=_distance(src, dst, final),
    build_s=0.0,
  )


def _classes(src, tok, dst, n_states, width):
  """Class ids of tokens with equal next-state columns; class 0 is the
  tokens no state allows (padding, control tokens, unusable text)."""
  rng = np.random.default_rng(0)  # fixed: every host builds equal tables
  signatures = []
  for _ in range(2):
    weight = rng.integers(1, 2**63, n_states, dtype=np.uint64) | np.uint64(1)
    contribution = weight[src] * (dst.astype(np.uint64) + np.uint64(1))
    sig = np.zeros(width, np.uint64)
    order = np.argsort(tok, kind="stable")
    t = tok[order]
    if t.size:
      starts = np.flatnonzero(np.r_[True, t[1:] != t[:-1]])
      sig[t[starts]] = np.add.reduceat(contribution[order], starts)
    signatures.append(sig)
  both = np.stack(signatures, axis=1)
  unique, inverse = np.unique(both, axis=0, return_inverse=True)
  if np.any(unique[0] != 0):  # every token is allowed somewhere
    inverse = inverse + 1
    return inverse.reshape(-1), unique.shape[0] + 1
  return inverse.reshape(-1), unique.shape[0]


def _distance(src, dst, final) -> np.ndarray:
  """Fewest tokens from each state to a final state (BFS backwards)."""
  n = final.shape[0]
  big = np.iinfo(np.int32).max // 2
  dist = np.where(final, 0, big).astype(np.int64)
  edges = np.unique(np.stack([src, dst], axis=1), axis=0)
  for _ in range(n):
    cand = np.full(n, big, np.int64)
    np.minimum.at(cand, edges[:, 0], dist[edges[:, 1]] + 1)
    new = np.minimum(dist, cand)
    if np.array_equal(new, dist):
      break
    dist = new
  return dist.astype(np.int32)
