"""A constraint's token masks read lazily: a byte DFA and a vocabulary's
trie in place of (states x vocabulary) tables.

  lazy = constraint.compile(vocabulary, stop_ids=[2], width=V)   # Lazy
  lazy.allowed(0)          # the ids allowed at the start (walked once)
  lazy.step(0, token)      # the next state (-1: rejected)

`Lazy` answers what `tables.Tables` answers (the host side of a compiled
constraint: allowed ids, the next state, final states, forced tokens,
budget forcing's distances) from `byte_dfa.ByteDfa` (compiled over
bytes: milliseconds, no vocabulary) and `token_trie.Trie` (built once per
vocabulary): a state's mask is one walk of the trie, computed when the
state is first asked about and kept (a few hundred states at most).
Its states are the byte DFA's (0 is the start), and a token's mask is
exactly the eager tables' (`tests/test_lazy_masks.py` walks both).

Budget forcing's distance (`token_distance`) is the fewest tokens that
spell one shortest byte path from each state to a final one (paths that
share their ends: the path from a state on another's path is that
path's rest). It is never below the fewest tokens of any path (the eager
tables' distance), and from every state the first token of its best
spelling leads to a state one token nearer, so a forced row still closes
within its steps; it may close a little sooner than the eager tables
would have let it.

Fast-forward (`fast_forward=True`): where the DFA allows one byte only
(a key, punctuation, a call's frame), the bytes up to the next choice (a
final state or two bytes) are the state's forced run, and only one token
is allowed there: the longest that spells a prefix of the run
(`forced_tokens`; not where a token spells the whole run and goes on
with a byte allowed after it: there the model spells across the run's
end as it would). Every other spelling of those bytes is masked, so the
state allows exactly one token: it is forced, and the loop can append a
run of forced tokens in one pass (`Speculation(drafter="forced")`) with
the tokens and scores of stepping them one at a time. Distances follow
the same rule.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Iterable, Sequence

import numpy as np

from chunkwise.constraints import byte_dfa, regex_dfa, token_trie, worker
from chunkwise.constraints import tables as tables_lib
from chunkwise.constraints.byte_dfa import ByteDfa
from chunkwise.constraints.tables import DEAD  # a state that cannot finish
from chunkwise.constraints.token_trie import Trie

_WALKS = 256  # states whose walks a `Lazy` keeps


@dataclasses.dataclass(frozen=True, eq=False)
class Lazy:
  """A constraint compiled for one vocabulary (module docstring)."""

  dfa: ByteDfa
  trie: Trie
  stops: tuple[int, ...]
  fast_forward: bool = False
  _walks: dict = dataclasses.field(
    default_factory=collections.OrderedDict, repr=False
  )

  @property
  def regex(self) -> str:
    return self.dfa.regex

  @property
  def held_bytes(self) -> int:
    """Bytes of the arrays it holds in memory: its DFA's, the masks
    walked so far and what it computed from them (not the shared trie):
    what the compiled-constraint cache counts."""
    arrays = [*vars(self.dfa).values(), *self._walks.values()]
    arrays += [v for v in vars(self).values() if v is not self._walks]
    flat = []
    for a in arrays:
      flat += a if isinstance(a, tuple) else [a]
    return sum(a.nbytes for a in flat if isinstance(a, np.ndarray))

  @property
  def build_s(self) -> float:
    return self.dfa.build_s

  @property
  def states(self) -> int:
    return self.dfa.states

  @property
  def final(self) -> np.ndarray:
    return self.dfa.final

  @property
  def width(self) -> int:
    return self.trie.width

  @property
  def nbytes(self) -> int:
    """Bytes of this constraint's own tables (the trie is shared)."""
    return self.dfa.table.nbytes + self.dfa.final.nbytes

  @functools.cached_property
  def _stops(self) -> np.ndarray:
    return np.array(sorted(s for s in set(self.stops) if 0 <= s < self.width))

  @functools.cached_property
  def _forced(self) -> tuple[np.ndarray, np.ndarray]:
    """`forced_tokens` (ids, ends) with `fast_forward`; all -1 without."""
    if not self.fast_forward:
      none = np.full(self.states, -1, np.int32)
      return none, none
    return forced_tokens(self.dfa, self.trie, self._stops)

  @property
  def forced_ids(self) -> np.ndarray:
    """int32[S]: the one token each state allows under fast-forward (-1:
    none forced; all -1 without `fast_forward`)."""
    return self._forced[0]

  def next_states(self, state: int) -> np.ndarray:
    """int32[V]: each id's next state from `state` (-1: rejected; a stop
    id: -1 here, see `step`)."""
    hit = self._walks.get(state)
    if hit is None:
      ids, ends = self._forced
      if ids[state] >= 0:  # fast-forward: that token alone, nothing walked
        hit = np.full(self.width, -1, np.int32)
        hit[ids[state]] = ends[state]
      else:
        hit = self.trie.walk(self.dfa.shifted, state + 1) - 1
        hit[self._stops] = -1  # only ever a stop
      hit.setflags(write=False)
      self._walks[state] = hit
      if len(self._walks) > _WALKS:
        self._walks.popitem(last=False)
    return hit

  def allowed(self, state: int) -> np.ndarray:
    """The ids allowed in `state`, ascending (stop ids where final)."""
    ids = np.flatnonzero(self.next_states(state) >= 0)
    if self.final[state]:
      ids = np.union1d(ids, self._stops).astype(np.int64)
    return ids

  def step(self, state: int, token: int) -> int:
    """The next state after `token` (-1: rejected); a stop id in a final
    state keeps it."""
    if token in self.stops:
      return state if self.final[state] else -1
    if not 0 <= token < self.width:
      return -1
    return int(self.next_states(state)[token])

  def forced(self, state: int) -> bool:
    """Whether `state` allows exactly one token (stop ids included)."""
    return self.allowed(state).size == 1

  @functools.cached_property
  def distance(self) -> np.ndarray:
    """int32[S]: tokens to a final state along one fixed shortest path of
    bytes from each state (`DEAD`: none); see the module docstring."""
    forced = self._forced if self.fast_forward else None
    return token_distance(self.dfa, self.trie, self._stops, forced)

  @property
  def longest(self) -> int:
    """The most tokens from a state that can still finish (budget forcing
    acts within this many columns of the end, plus 2)."""
    live = self.distance[self.distance < DEAD]
    return int(live.max()) if live.size else 0

  def budget_narrows(
    self, state: int, remaining: int, stop_ids: Iterable[int]
  ) -> bool:
    """Whether budget forcing with `remaining` columns left removes a
    token `state` allows (the host twin of the device's rule,
    `distance[next] + 2 <= remaining`)."""
    stops = np.asarray(list(stop_ids))
    allowed = self.allowed(state)
    allowed = allowed[~np.isin(allowed, stops)]
    far = self.distance[self.next_states(state)[allowed]]
    far = far[far < DEAD]
    return bool(np.any(far + 2 > remaining))


def compile(
  text: str,
  vocabulary,
  *,
  stop_ids: Sequence[int],
  width: int,
  kind: str = "regex",
  max_table_mb: float = 256.0,
  time_limit_s: float = 30.0,
  max_compile_mb: float = 4096.0,
  what: str | None = None,
  fast_forward: bool = False,
) -> Lazy:
  """A regex (or, with `kind="schema"`, a JSON schema's text) compiled for
  `vocabulary` (with `token_bytes()`) and logits `width`: its byte DFA
  (`byte_dfa.compile`, cached) and the vocabulary's trie (cached); with
  `fast_forward`, a forced run's one token (module docstring).

  Raises ValueError when the regex is invalid, its DFA's table (1 KB a
  state) needs more than `max_table_mb` (a `worker.LimitError`, as past
  the other limits), compiling runs past `time_limit_s` or
  `max_compile_mb`, or no text this vocabulary can spell matches it.
  """
  stops = tables_lib.check_stops(stop_ids)
  tables_lib.check_vocabulary(vocabulary)
  trie = token_trie.of(vocabulary, width)
  key = (kind, text, trie.key, stops, float(max_table_mb), bool(fast_forward))
  hit = _CACHE.get(key)
  if hit is not None:
    _CACHE.move_to_end(key)
    return hit
  what = what or f"the constraint {tables_lib._short(text)}"
  dfa = byte_dfa.compile(
    text,
    kind=kind,
    max_table_mb=max_table_mb,
    time_limit_s=time_limit_s,
    max_compile_mb=max_compile_mb,
    what=what,
  )
  mb = dfa.table.nbytes / 2**20
  if mb > max_table_mb:
    raise worker.LimitError(
      f"{what} needs {dfa.states} automaton states, {mb:.0f} MB of "
      f"transitions, over the limit of max_table_mb={max_table_mb:g}; "
      "simplify it (e.g. a smaller maxLength) or raise the limit"
    )
  out = Lazy(dfa=dfa, trie=trie, stops=stops, fast_forward=bool(fast_forward))
  # A trimmed DFA with a byte from its start, over a vocabulary that
  # spells each byte it reads alone, matches some text the vocabulary
  # spells; otherwise the start's tokens are walked (~1 ms) to know.
  reads = (dfa.table >= 0).any(axis=0)
  spelled = (dfa.table[0] >= 0).any() and _lone_bytes(trie, stops)[reads].all()
  if not spelled and not out.allowed(0).size:
    raise ValueError(f"{what} matches no text this vocabulary can spell")
  _CACHE[key] = out
  held = sum(c.held_bytes for c in _CACHE.values())
  while len(_CACHE) > 1 and (len(_CACHE) > _CACHE_SIZE or held > CACHE_BYTES):
    held -= _CACHE.popitem(last=False)[1].held_bytes
  return out


def _lone_bytes(trie: Trie, stops: Sequence[int]) -> np.ndarray:
  """`trie.lone_bytes(stops)`, kept per vocabulary and stops."""
  key = (trie.key, tuple(stops))
  if key not in _LONE:
    _LONE.clear()  # one vocabulary at a time, in practice
    _LONE[key] = trie.lone_bytes(stops)
  return _LONE[key]


_LONE: dict = {}


def _spells(trie: Trie, stops) -> np.ndarray:
  """bool[nodes]: the trie nodes some id (not a stop) spells, kept per
  vocabulary and stops."""
  key = (trie.key, tuple(np.asarray(stops).tolist()))
  if key not in _SPELLS:
    _SPELLS.clear()  # one vocabulary at a time, in practice
    out = np.zeros(trie.nodes, bool)
    ids = np.flatnonzero(trie.token_node >= 0)
    out[trie.token_node[ids[~np.isin(ids, stops)]]] = True
    _SPELLS[key] = out
  return _SPELLS[key]


_SPELLS: dict = {}


# Compiled constraints by (kind, text, vocabulary, stops, limit): the same
# object again, so a loop's rows share its grammar id and its walks.
_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 64
# Their arrays in memory, all told, counted as each one is added
# (`Lazy.held_bytes`; a constraint's walked masks are `_WALKS` at most;
# the vocabulary's trie, shared, is not counted).
CACHE_BYTES = 1 << 30


def clear_cache() -> None:
  """Forgets every compiled constraint, lazy and eager (benchmarks time
  builds from scratch)."""
  _CACHE.clear()
  byte_dfa.clear_cache()


def token_distance(
  dfa: ByteDfa,
  trie: Trie,
  stops: np.ndarray,
  forced: tuple | None = None,
  native: bool = True,
) -> np.ndarray:
  """int32[S]: for each state, the fewest tokens (not `stops`) that spell
  its path of bytes to a final state, where each state's path is one
  shortest path that continues the path of the state after its first
  byte (`DEAD`: no such path the tokens spell); where `forced` (ids and
  ends, `forced_tokens`) names a token, that token is the path's first.

  Vectorized: every state's path is walked down the trie at once, byte
  by byte, giving the pairs (state, the state after a token that starts
  its path); then states take their best pair level by level of their
  byte distance (a pair's end is nearer). `tests/test_lazy_masks.py`
  compares it with the plain walk, state by state (13 k states of a
  Kubernetes schema: 125 ms in Python, now a few). The native compiler
  does the same walk per state (`regex_dfa.token_distance`: a median
  schema's in ~50 us, against ~1 ms here); this NumPy body is its twin
  (`native=False`)."""
  spells = _spells(trie, stops)
  if native:
    out = regex_dfa.token_distance(
      dfa.table, dfa.final, trie.children, spells, forced, DEAD
    )
    if out is not None:
      return out
  bytes_to = dfa.distance()
  n = dfa.states
  succ = dfa.table  # [S, 256]
  ok = (succ >= 0) & (bytes_to[np.maximum(succ, 0)] == bytes_to[:, None] - 1)
  first = np.argmax(ok, axis=1)  # each state's next byte along its path
  after = succ[np.arange(n), first]  # and the state after it
  out = np.full(n, DEAD, np.int32)
  out[dfa.final] = 0
  starts, ends = [], []
  q = np.flatnonzero((bytes_to < DEAD) & ~dfa.final)
  at, node = q, np.full(q.size, -1, np.int64)
  while q.size:
    # (not found: no token starts with the path so far)
    found, child = trie.child(node, first[at])
    q, at, node = q[found], after[at[found]], child[found]
    token = spells[node]
    starts.append(q[token])
    ends.append(at[token])
    on = ~dfa.final[at]  # a path ends at its final state
    q, at, node = q[on], at[on], node[on]
  start = np.concatenate(starts) if starts else np.zeros(0, np.int64)
  end = np.concatenate(ends) if ends else np.zeros(0, np.int64)
  if forced is not None:
    # A forced state's one pair: its token's (`forced`: (ids, ends); the
    # path is its forced run, so the token's end is on it; every other
    # token spelling a prefix of the run is masked there).
    ids, after_id = forced
    keep = (ids[start] < 0) | (end == after_id[start])
    start, end = start[keep], end[keep]
  order = np.argsort(bytes_to[start], kind="stable")
  start, end = start[order], end[order]
  level = bytes_to[start]
  cuts = np.flatnonzero(np.diff(level)) + 1
  for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, level.size], strict=True):
    far = out[end[lo:hi]]
    near = far < DEAD
    np.minimum.at(out, start[lo:hi][near], far[near] + 1)
  return out


def forced_tokens(
  dfa: ByteDfa, trie: Trie, stops: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """(int32[S] ids, int32[S] ends): for each state whose DFA allows one
  byte only (and is not final), the longest id (not a stop) that spells a
  prefix of its forced run (the bytes from it on while each state on the
  way allows one byte and is not final), and the state after it; -1 for
  the other states, where no id spells the run's first byte, and where
  an id spells the whole run and goes on with a byte the DFA allows
  after it (`"` before `[ ]?:`, where `":` may follow: the model's own
  spelling across the run's end stays allowed, and the state is not
  forced). Vectorized: every state's run walked down the trie at once,
  byte by byte."""
  table = dfa.table
  moves = table >= 0
  single = (np.count_nonzero(moves, axis=1) == 1) & ~dfa.final
  byte = np.argmax(moves, axis=1)
  ids = np.flatnonzero(trie.token_node >= 0)
  ids = ids[~np.isin(ids, stops)]
  token_of = np.full(trie.nodes, -1, np.int64)
  token_of[trie.token_node[ids[::-1]]] = ids[::-1]  # the lowest id per node
  out = np.full(dfa.states, -1, np.int32)
  end = np.full(dfa.states, -1, np.int32)
  whole = []  # (states, the state after the run, the run's node)
  q = np.flatnonzero(single)
  at, node = q, np.full(q.size, -1, np.int64)
  while q.size:
    found, child = trie.child(node, byte[at])  # (else no id spells it)
    q, at, node = q[found], at[found], child[found]
    at = table[at, byte[at]]
    token = token_of[node]
    spelled = token >= 0  # deeper: longer
    out[q[spelled]], end[q[spelled]] = token[spelled], at[spelled]
    on = single[at]
    whole.append((q[~on], at[~on], node[~on]))
    q, at, node = q[on], at[on], node[on]
  # Runs some id's prefix spells whole: not forced where a child of the
  # run's node reads a byte the DFA allows after the run.
  if whole:
    q, at, node = (np.concatenate(x) for x in zip(*whole, strict=True))
    crosses = trie.has_child_by(node, moves[at])
    out[q[crosses]] = end[q[crosses]] = -1
  return out, end


def vocabulary_key(vocabulary, width: int) -> str:
  """A digest of `vocabulary`'s token bytes below `width` (ValueError
  without `token_bytes()`)."""
  tables_lib.check_vocabulary(vocabulary)
  return token_trie.of(vocabulary, width).key
