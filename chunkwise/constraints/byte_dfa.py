"""A constraint as a DFA over bytes: compiled with no vocabulary in it.

  dfa = byte_dfa.compile(r'"[a-z]{1,8}"')
  dfa.table      # int32[S, 256]: the state after a byte (-1: rejected)
  dfa.final      # bool[S]: the bytes so far spell a match
  dfa.run(b'"ab')  # -> a state (0 is the start; -1: no match can follow)

The regex (or a JSON schema's, `kind="schema"`) is compiled in the
worker process under the same time and memory limits as the token
tables, cached in memory and on disk (`tables.compile_dfa`): by the
native compiler (`regex_dfa`: its minimal DFA, states numbered
breadth-first), or outlines-core over a vocabulary of the 256 single
bytes where the native one does not take the regex. Either way it is
trimmed to the states from which a match can still be finished, so a
text is a live prefix exactly when its state is not -1. The work grows
with the regex and 256, never with a model's vocabulary (a median
real-world schema: ~0.2 ms natively, where the tables over SmolLM2's
49,152 tokens took seconds); masks over tokens are read from it per
state, when a state is reached (`token_trie`, `lazy`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from chunkwise.constraints import automaton
from chunkwise.constraints import tables as tables_lib

STOP = 256  # the byte vocabulary's stop id (ids 0-255 are the bytes)
BYTES = tables_lib.vocab_of(
  [bytes([b]) for b in range(256)] + [None], [STOP], 257
)


@dataclasses.dataclass(frozen=True, eq=False)
class ByteDfa:
  """A trimmed DFA over bytes (module docstring)."""

  regex: str
  table: np.ndarray  # int32[S, 256]; -1: rejected
  final: np.ndarray  # bool[S]
  build_s: float

  @property
  def states(self) -> int:
    return self.table.shape[0]

  @functools.cached_property
  def shifted(self) -> np.ndarray:
    """int32[S + 1, 256]: the table with a dead row first (state s is
    row s + 1, rejection row 0): what walks gather from."""
    out = np.zeros((self.states + 1, 256), np.int32)
    out[1:] = self.table + 1
    return out

  def run(self, data: bytes, state: int = 0) -> int:
    """The state after `data` from `state` (-1: rejected)."""
    for b in data:
      if state < 0:
        break
      state = int(self.table[state, b])
    return state

  def matches(self, data: bytes) -> bool:
    state = self.run(data)
    return state >= 0 and bool(self.final[state])

  def distance(self, usable: np.ndarray | None = None) -> np.ndarray:
    """int32[S]: fewest bytes from each state to a final one using only
    the `usable` bytes (bool[256]; default all), `tables.DEAD` where none
    does."""
    usable = np.ones(256, bool) if usable is None else np.asarray(usable, bool)
    src, b = np.nonzero(self.table[:, usable] >= 0)
    # backwards from the final states
    return automaton.hops(self.table[:, usable][src, b], src, self.final)


def of_tables(t: tables_lib.Tables) -> ByteDfa:
  """The DFA of token tables compiled over `BYTES` (tests compare it with
  `compile`'s)."""
  table = t.next_state[:, t.token_class[:256]]
  return ByteDfa(
    regex=t.regex,
    table=np.ascontiguousarray(table, np.int32),
    final=np.asarray(t.final, bool),
    build_s=t.build_s,
  )


def compile(
  text: str,
  *,
  kind: str = "regex",
  max_table_mb: float = 256.0,
  time_limit_s: float = 30.0,
  max_compile_mb: float = 4096.0,
  what: str | None = None,
) -> ByteDfa:
  """The `ByteDfa` of a regex (Rust syntax) or, with `kind="schema"`, a
  JSON schema's text; cached. ValueError as `tables.compile_regex`."""
  out = tables_lib.compile_dfa(
    text,
    BYTES,
    stop_ids=(STOP,),
    width=257,
    max_table_mb=max_table_mb,
    time_limit_s=time_limit_s,
    max_compile_mb=max_compile_mb,
    kind=kind,
    what=what,
  )
  return ByteDfa(
    regex=out["regex"],
    table=out["table"],
    final=out["final"],
    build_s=out["build_s"],
  )


def clear_cache() -> None:
  """Forgets every compiled DFA and table (`tables.clear_cache`)."""
  tables_lib.clear_cache()
