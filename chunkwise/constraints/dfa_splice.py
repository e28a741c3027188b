"""A large JSON schema's DFA over bytes, put together from its parts' DFAs.

  out = dfa_splice.compose(schema, pieces, depth, leaf)  # table, final
  # leaf(regex) -> (table int32[S, 256], final bool[S]): one regex's DFA

outlines-core writes an object with n optional properties as a regex of
O(n^2) copies of their values (each property is spelled once for every
property that may come first), so nested objects multiply: a Kubernetes
schema of 24 k characters became a 337 k-character regex, and the DFA
construction took seconds (77 M characters and minutes for the largest
JSONSchemaBench schemas), although its DFA has only ~24 k states. Here
each large property value or array item is compiled once, as its own
DFA, and the parent's regex holds a marker in its place (0x01, the
part's name, 0x02: bytes no JSON text contains unescaped). The markers
are then replaced in the parent's DFA by copies of the part's DFA: one
copy for each state the marker leads to (its continuation), entered from
every state that reads the marker:

* the part's first bytes join the entering state's transitions;
* each final state of the part takes the continuation's transitions (and
  its finality).

Where a part's first bytes meet another transition of the entering state,
or a final state of the part already reads a byte its continuation reads
(the union would need a DFA built anew), or the part can be empty or
re-enter its start, `Conflict` is raised and the caller compiles the
whole regex instead. Otherwise the DFA spells exactly the text the
parent's regex with each marker replaced by its part's regex spells
(tested against it: `tests/test_lazy_masks.py`). Parts are compiled
bottom-up, each distinct one once (the same definition inlined in many
places is one DFA, copied per continuation).

Which values become parts: every property value of an object with
`MANY` or more properties (outlines-core repeats each value once per
property), and otherwise property values, array items and additional
properties' values long as JSON (`PART_CHARS`) or as regex
(`PART_REGEX`: a value of no type is a regex of thousands of characters).
Where a part conflicts, that part is written in place and the level is
compiled again.

Runs in the compile worker (`automaton.py`): NumPy, SciPy and the
standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

OPEN, CLOSE = 0x01, 0x02  # a marker: OPEN, the part's name, CLOSE
# A property value or array item of at least this many characters of
# JSON is compiled as its own part.
PART_CHARS = 256
# ... or one whose regex is at least this long; or any value of an
# object with at least `MANY` properties.
PART_REGEX = 2_000
MANY = 8
# Where a part stands in its parent's schema (a const nothing else spells;
# `schema_values.PLACEHOLDER` is the pieces').
PLACEHOLDER = "CWPART{}QX"


class Conflict(Exception):
  """Part `part` cannot be joined without building the DFA anew."""

  def __init__(self, part: str, why: str):
    super().__init__(f"part {part}: {why}")
    self.part = part


Leaf = Callable[[str], tuple[np.ndarray, np.ndarray]]


Trim = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def compose(
  schema, regex_of: Callable[[object], str], leaf: Leaf, trim: Trim = None
) -> tuple[np.ndarray, np.ndarray]:
  """(table, final) of `schema` (a parsed JSON schema without `$ref`s, as
  `schema_rewrite` leaves it), with `regex_of(schema)` its regex (pieces
  spliced in) and `leaf(regex)` a regex's DFA. `trim` renumbers each
  spliced DFA (`reached`, or a minimizer). Raises `Conflict`."""
  return _Composer(regex_of, leaf, trim or reached).dfa(schema)


class _Composer:
  def __init__(self, regex_of, leaf, trim):
    self.regex_of = regex_of
    self.leaf = leaf
    self.trim = trim
    self.done: dict[str, tuple[np.ndarray, np.ndarray]] = {}

  def dfa(self, schema) -> tuple[np.ndarray, np.ndarray]:
    """`schema`'s DFA, each distinct schema built once."""
    key = json.dumps(schema)
    hit = self.done.get(key)
    if hit is None:
      hit = self.done[key] = self._build(schema)
    return hit

  def _build(self, schema) -> tuple[np.ndarray, np.ndarray]:
    inline: set[str] = set()  # parts that conflicted: written in place
    while True:
      parts: dict[str, tuple[object, str]] = {}
      regex = self.regex_of(self._cut(schema, parts, inline))
      for name in list(parts):
        literal = self.regex_of({"const": PLACEHOLDER.format(name)})
        if literal not in regex:  # a value outlines-core does not write
          del parts[name]
        regex = regex.replace(literal, marker_regex(name))
      table, final = self.leaf(regex)
      if not parts:
        return table, final
      inner = {name: self.dfa(sub) for name, (sub, _) in parts.items()}
      try:
        return splice(table, final, inner, self.trim)
      except Conflict as e:
        inline.add(parts[e.part][1])

  def _cut(self, schema, parts: dict, inline: set):
    """`schema` with each large property value, array item and value of
    additional properties (not in `inline`: their places) replaced by
    {"const": its part's name}, recorded in `parts` as (schema,
    place)."""
    if not isinstance(schema, dict):
      return schema

    out = dict(schema)
    props = out.get("properties")
    props = props if isinstance(props, dict) else {}
    # every value of an object of many properties: its regex repeats each
    # value once per property (optional ones, O(n^2) in all)
    every = len(props) >= MANY

    def cut(sub, place, always=False):
      if (
        not isinstance(sub, dict)
        or place in inline
        or not (always or self._large(sub))
      ):
        return sub
      name = f"p{len(parts)}"
      parts[name] = (sub, place)
      return {"const": PLACEHOLDER.format(name)}

    if props:
      out["properties"] = {
        k: cut(v, f"properties/{k}", every) for k, v in props.items()
      }
    for key in ("items", "additionalProperties"):
      if isinstance(out.get(key), dict):
        out[key] = cut(out[key], key)
    return out

  def _large(self, schema) -> bool:
    """Whether `schema` is worth a part: long as JSON, or spelled by a
    long regex (a value of any type is a regex of thousands of
    characters)."""
    return (
      len(json.dumps(schema)) >= PART_CHARS
      or len(self.regex_of(schema)) >= PART_REGEX
    )


def marker_regex(name: str) -> str:
  """The regex of part `name`'s marker (`framed.Framed.hole`)."""
  return f"\\x{OPEN:02x}{name}\\x{CLOSE:02x}"


def frame(
  regex: str, parts: dict, leaf: Leaf, trim: Trim = None
) -> tuple[np.ndarray, np.ndarray]:
  """(table, final) of `regex` with each part's marker (`marker_regex`)
  replaced by it: `parts` maps a name to (a function making its DFA, a
  function making its regex). A part that conflicts is written in place
  as its regex, and the frame compiled again. `trim` as `compose`'s."""
  inline: set[str] = set()
  while True:
    text = regex
    for name in inline:
      text = text.replace(marker_regex(name), "(" + parts[name][1]() + ")")
    table, final = leaf(text)
    live = {
      name: make()
      for name, (make, _) in parts.items()
      if name not in inline and marker_regex(name) in text
    }
    if not live:
      return table, final
    try:
      return splice(table, final, live, trim or reached)
    except Conflict as e:
      inline.add(e.part)


def splice(
  table: np.ndarray,
  final: np.ndarray,
  parts: dict[str, tuple[np.ndarray, np.ndarray]],
  trim: Trim = None,
) -> tuple[np.ndarray, np.ndarray]:
  """`table`/`final` (trimmed, state 0 the start) with every marker path
  replaced by a copy of its part's DFA (the module docstring); the
  result trimmed to the states reached from 0 (`trim`: `reached`, or a
  minimizer). Raises `Conflict`."""
  trim = trim or reached
  entries = np.flatnonzero(table[:, OPEN] >= 0)
  # (entering state, part, continuation) of every marker path: each
  # part's name walked from every entering state at once, then in the
  # order of the entering states and the parts
  inside = table[entries, OPEN]
  found = []
  for i, name in enumerate(parts):
    b = inside
    for byte in name.encode() + bytes([CLOSE]):
      b = np.where(b >= 0, table[np.maximum(b, 0), byte], -1)
    hit = np.flatnonzero(b >= 0)
    found += zip(
      entries[hit].tolist(), [i] * hit.size, b[hit].tolist(), strict=True
    )
  names = list(parts)
  paths = [(a, names[i], b) for a, i, b in sorted(found)]
  if not paths:  # no marker on a path to an end
    return trim(table, final)
  # One copy of a part per continuation, its start state left out.
  copies: dict[tuple[str, int], int] = {}  # -> the copy's first state
  blocks = []
  size = table.shape[0]
  for _, name, b in paths:
    if (name, b) in copies:
      continue
    sub, sub_final = parts[name]
    if sub_final[0] or np.any(sub[1:] == 0) or np.any(sub[0] == 0):
      raise Conflict(name, "it can be empty or re-enter its start")
    copies[(name, b)] = size
    blocks.append((name, b, size, sub, sub_final[1:]))
    size += sub.shape[0] - 1
  # the parent's states first (its markers' first bytes read nothing),
  # then each copy
  out = np.empty((size, 256), np.int32)
  out[: table.shape[0]] = table
  out[entries, OPEN] = -1
  for a, name, b in paths:
    sub = parts[name][0]
    first = np.flatnonzero(sub[0] >= 0)
    mapped = sub[0, first] - 1 + copies[(name, b)]
    clash = (out[a, first] >= 0) & (out[a, first] != mapped)
    if np.any(clash):
      raise Conflict(name, "it starts with a byte its parent reads there")
    out[a, first] = mapped
  out_final = np.zeros(size, bool)
  out_final[: table.shape[0]] = final
  for _, _, lo, sub, sub_final in blocks:  # a copy's states, shifted
    copy = out[lo : lo + sub.shape[0] - 1]
    np.add(sub[1:], lo - 1, out=copy)
    copy[sub[1:] <= 0] = -1
    out_final[lo : lo + sub.shape[0] - 1] = sub_final
  for name, b, lo, _, sub_final in blocks:
    ends = lo + np.flatnonzero(sub_final)
    after = out[b]
    reads = np.flatnonzero(after >= 0)
    if np.any(out[np.ix_(ends, reads)] >= 0):
      raise Conflict(name, "its end reads a byte its continuation reads")
    out[np.ix_(ends, reads)] = after[reads]
    out_final[ends] = final[b]
  return trim(out, out_final)


def reached(table: np.ndarray, final: np.ndarray, start: int = 0):
  """(table, final) of the states reached from `start`, renumbered: the
  start first (0), the others in order (`table` itself where that is
  every state from 0: callers never write into a table)."""
  from scipy.sparse import csr_matrix
  from scipy.sparse.csgraph import breadth_first_order

  n = table.shape[0]
  ok = table >= 0
  # The graph's rows straight from the table's (no sorting: 7 ms -> 1 ms
  # at 3,000 states).
  flat = np.flatnonzero(ok)
  indptr = np.zeros(n + 1, np.int64)
  np.cumsum(np.count_nonzero(ok, axis=1), out=indptr[1:])
  graph = csr_matrix(
    (np.ones(flat.size, np.int8), table.ravel()[flat], indptr), shape=(n, n)
  )
  seen = np.zeros(n, bool)
  seen[breadth_first_order(graph, start, return_predecessors=False)] = True
  if start == 0 and seen.all():
    return table.astype(np.int32, copy=False), final
  order = np.flatnonzero(seen)
  order = np.concatenate([[start], order[order != start]])
  number = np.full(n + 1, -1, np.int32)  # by state + 1 (-1: rejected)
  number[order + 1] = np.arange(order.size, dtype=np.int32)
  return number[table[order] + 1], final[order]
