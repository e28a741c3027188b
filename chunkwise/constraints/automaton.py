"""Regex or JSON schema -> token-automaton tables; runs in a child process.

Compiling a constraint can take unbounded time and memory (a schema or
regex whose automaton explodes), and a thread cannot be stopped, so
`tables.py` sends each compilation to a worker process running this file
as a script, and kills it when `time_limit_s` passes. The worker caps its
own address space at its size when the request arrives plus
`max_compile_mb` (RLIMIT_AS, where the OS enforces it: Linux), so an
explosion ends in a failed allocation (a MemoryError, or Rust's abort)
instead of eating the machine. This file imports only the standard
library, NumPy, SciPy, outlines-core and `dfa_splice.py` and
`regex_dfa.py` (by their paths),
so the worker starts in a fraction of a second; it never imports
chunkwise.

What it computes: for a DFA over bytes (`output="dfa"`, what lazy
constraints use), the native compiler's minimal DFA (`regex_dfa`), or
where that does not take the regex, outlines-core's over the 256 single
bytes (`_outlines_dfa`, its plain twin); a schema past `COMPOSE_ABOVE`
regex characters is put together from its parts (`dfa_splice`). For the
eager tables (see `tables.py` for the layout): outlines-core's `Index`
walks every vocabulary token through the regex's DFA from every state and
keeps the tokens that do not die (the regex followed by an end mark, so
that none is lost: `_marked_index`). States that reach no final state and
states nothing reaches are dropped, the rest renumbered densely (the
initial one is 0), its single-EOS self-loops are replaced by *every* stop
id in final states only, and tokens whose next-state columns agree in
every state are merged into classes (found by hashing each column with
two random 64-bit signatures; the result is checked against every
transition). The state count is read from the index's serialized header
before its transitions are expanded, so an automaton whose mask bits
would exceed `max_table_mb` is refused before it is built out.

Protocol: length-prefixed pickles on stdin / stdout. A request is a dict
(`build`'s arguments, plus `vocab_key`, and `vocab` when the worker has
not seen that key); a reply is {"ok": result} | {"error": message} |
{"memory": message}.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import json
import os
import pickle
import struct
import sys
import time

import numpy as np


class UserError(Exception):
  """A constraint that cannot be compiled (the message says why)."""


def short(text: str) -> str:
  return repr(text if len(text) <= 80 else text[:77] + "...")


def regex_of(kind: str, text: str) -> str:
  """The regex of a "regex" (itself), a "schema" (JSON text), or a
  "spliced_schema" (JSON {"schema": ..., "pieces": {placeholder: regex},
  "max_recursion_depth": n, optionally "whitespace": the regex between
  JSON's tokens}: the schema's regex with each placeholder const replaced
  by its piece)."""
  if kind == "regex":
    return text
  if kind == "framed":
    payload = json.loads(text)
    regex = payload["regex"]
    for name, (k, t) in payload["parts"].items():
      hole = _splicer().marker_regex(name)
      regex = regex.replace(hole, "(" + regex_of(k, t) + ")")
    return regex
  from outlines_core.json_schema import build_regex_from_schema

  def build(schema_text: str, depth: int = 3, whitespace=None) -> str:
    try:
      return build_regex_from_schema(schema_text, whitespace, depth)
    except Exception as e:
      raise UserError(f"unsupported JSON schema: {e}") from None

  if kind == "schema":
    return build(text)
  payload = json.loads(text)
  regex = build(
    json.dumps(payload["schema"]),
    payload["max_recursion_depth"],
    payload.get("whitespace"),
  )
  for name, piece in payload["pieces"].items():
    # A piece in a definition nothing reaches is absent: nothing to splice.
    regex = regex.replace(_const_regex(name), "(" + piece + ")")
  return regex


@functools.lru_cache(maxsize=4096)
def _const_regex(name: str) -> str:
  """outlines-core's regex of the JSON string `name` (a piece's
  placeholder): asked for once per placeholder, not once per part."""
  from outlines_core.json_schema import build_regex_from_schema

  return build_regex_from_schema(json.dumps({"const": name}), None, 3)


def _parts(kind: str, text: str):
  """(schema, its regex of a schema) of a "schema" or "spliced_schema"
  request (`regex_of`): what `dfa_splice` composes from."""
  if kind == "schema":
    return json.loads(text), lambda s: regex_of("schema", json.dumps(s))
  payload = json.loads(text)

  def of(schema):
    return regex_of("spliced_schema", json.dumps({**payload, "schema": schema}))

  return payload["schema"], of


# A schema or framed regex (`framed.Framed`: a tool list) longer than
# this (characters) has its DFA put together from its parts'
# (`dfa_splice`), where they join cleanly. Below it the native compiler
# builds the whole regex faster (JSONSchemaBench's schemas: faster whole
# up to ~90 k characters, mostly faster composed above ~100 k; 16 tools
# of 16 properties, 141 k characters: 73 ms whole, 83 ms composed).
COMPOSE_ABOVE = 100_000


def _sibling(name: str):
  """A module beside this one (`dfa_splice`, `regex_dfa`): chunkwise's, or
  in the worker (which never imports chunkwise) the file by its path."""
  if __package__:
    import importlib

    return importlib.import_module(f"chunkwise.constraints.{name}")
  import importlib.util

  key = f"chunkwise_{name}"
  if key not in sys.modules:
    path = os.path.join(
      os.path.dirname(os.path.abspath(__file__)), f"{name}.py"
    )
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[key] = module
  return sys.modules[key]


def _splicer():
  return _sibling("dfa_splice")


def byte_dfa(regex: str, max_table_mb: float, width: int) -> dict | None:
  """The trimmed DFA over bytes of `regex` (`dfa_table`'s `table` and
  `final`, 0 the start) from the native compiler (`regex_dfa`), None
  where it does not take the regex (outlines-core then compiles it).
  UserError where its states' mask bits at `width` would pass
  `max_table_mb` (as `build`'s check)."""
  native = _sibling("regex_dfa")
  max_states = int(max_table_mb * 2**20 // (-(-width // 32) * 4))
  try:
    out = native.build(regex, max_states, _cached_class_ranges())
  except native.TooManyStates:
    raise UserError(
      f"the constraint {short(regex)} needs more than {max_states} "
      f"automaton states, over the limit of max_table_mb={max_table_mb:g} "
      f"at vocabulary width {width}; simplify it (e.g. a smaller "
      "maxLength) or raise the limit"
    ) from None
  return None if out is None else {"table": out.table, "final": out.final}


def _minimal(table: np.ndarray, final: np.ndarray):
  """A spliced DFA's states reached from 0, minimized where the native
  compiler is there (`regex_dfa.minimal`), else renumbered
  (`dfa_splice.reached`, its plain twin)."""
  out = _sibling("regex_dfa").minimal(table, final)
  if out is None:
    return _splicer().reached(table, final)
  return out.table, out.final


def _class_ranges(letter: str) -> np.ndarray:
  """The code points of Rust's `\\d`, `\\s` or `\\w`, as outlines-core's
  DFA over bytes accepts them (`regex_dfa.code_points`)."""
  out = _outlines_dfa("\\" + letter, _BYTE_VOCAB, (256,), 257)
  return _sibling("regex_dfa").code_points(out["table"], out["final"])


@functools.cache
def _cached_class_ranges():
  from importlib import metadata

  try:
    version = metadata.version("outlines-core")
  except metadata.PackageNotFoundError:
    version = "unknown"
  return _sibling("regex_dfa").cached_classes(_class_ranges, version)


# The 256 single bytes as outlines-core's vocabulary (ids 0-255).
_BYTE_VOCAB = {bytes([b]): [b] for b in range(256)}


def _composed(kind, text, vocab, stops, width, max_table_mb) -> dict | None:
  """`dfa_table`'s result for a schema or a framed regex, its DFA put
  together from its parts' (`dfa_splice`); None where they do not join
  cleanly (or a part does not compile alone): then the whole regex is
  compiled."""
  splice = _splicer()

  def leaf(regex):
    key = (regex, tuple(stops), width)  # (the vocabulary: the bytes)
    hit = _LEAVES.get(key)
    if hit is not None:
      _LEAVES.move_to_end(key)
      return hit
    out = byte_dfa(regex, max_table_mb, width) or _outlines_dfa(
      regex, vocab, stops, width
    )
    if out is None or not (out["final"][0] or out["table"][0].max() >= 0):
      raise UserError("a part matches nothing")
    return _keep_leaf(key, out["table"], out["final"])

  def dfa(kind, text):
    if kind == "regex":
      return leaf(text)
    if kind == "framed":
      payload = json.loads(text)
      parts = {
        name: (
          functools.partial(dfa, k, t),
          functools.partial(regex_of, k, t),
        )
        for name, (k, t) in payload["parts"].items()
      }
      return splice.frame(payload["regex"], parts, leaf, _minimal)
    schema, of = _parts(kind, text)
    return splice.compose(schema, of, leaf, _minimal)

  try:
    table, final = dfa(kind, text)
  except (splice.Conflict, UserError, ValueError):
    return None
  return {"table": table, "final": final}


# The parts' DFAs over bytes by regex (and stops, width), kept across
# requests, `LEAVES_MB` in all (the least recently used go first): a part
# shared with schemas compiled before (a Kubernetes ObjectMeta, a tool's
# arguments under another frame) is not compiled again. Read-only.
LEAVES_MB = 128
_LEAVES: collections.OrderedDict = collections.OrderedDict()


def _keep_leaf(key, table: np.ndarray, final: np.ndarray):
  table.setflags(write=False)
  final.setflags(write=False)
  _LEAVES[key] = (table, final)
  total = sum(t.nbytes + f.nbytes for t, f in _LEAVES.values())
  while total > LEAVES_MB * 2**20 and len(_LEAVES) > 1:
    t, f = _LEAVES.popitem(last=False)[1]
    total -= t.nbytes + f.nbytes
  return table, final


def build(
  kind: str,
  text: str,
  vocab: dict | None,
  stops: tuple[int, ...],
  width: int,
  max_table_mb: float,
  output: str = "tables",
  compose_above: int | None = None,
) -> dict:
  """The regex and, with a `vocab`, its tables as NumPy arrays: the token
  tables (`output="tables"`, `tables.Tables`' fields) or, over the 256
  single bytes (`output="dfa"`), the DFA's `table` (int32[S, 256]) and
  `final` only (`byte_dfa.ByteDfa`: no classes, mask bits or distances)."""

  start = time.perf_counter()
  regex = regex_of(kind, text)
  if vocab is None:
    return {"regex": regex}
  if compose_above is None:
    compose_above = COMPOSE_ABOVE
  words = -(-width // 32)
  if output == "dfa" and kind != "regex" and len(regex) > compose_above:
    out = _composed(kind, text, vocab, stops, width, max_table_mb)
    if out is not None:
      return {**out, "regex": regex, "build_s": time.perf_counter() - start}
  if output == "dfa":
    out = byte_dfa(regex, max_table_mb, width)
    if out is not None:
      if not (out["final"][0] or out["table"][0].max() >= 0):
        raise UserError(
          f"the constraint {short(regex)} matches no text this vocabulary "
          "can spell"
        )
      return {**out, "regex": regex, "build_s": time.perf_counter() - start}
  try:
    index, transitions, finals = _marked_index(
      _led(regex) if output == "dfa" else regex, vocab, stops, width
    )
  except ValueError as e:
    message = str(e)
    if "incompatible" in message or "no transitions" in message.lower():
      raise UserError(
        f"the constraint {short(regex)} matches no text this vocabulary "
        "can spell"
      ) from None
    raise UserError(
      f"the constraint {short(regex)} is not a supported regex: {message}"
    ) from None
  n_states = count_states(index)
  mb = n_states * words * 4 / 2**20
  if mb > max_table_mb:
    raise UserError(
      f"the constraint {short(regex)} needs {n_states} automaton states, "
      f"{mb:.0f} MB of mask bits at vocabulary width {width}, over the "
      f"limit of max_table_mb={max_table_mb:g}; simplify it (e.g. a "
      "smaller maxLength) or raise the limit"
    )
  initial = index.get_initial_state()
  if output == "dfa":
    out = _unled(dfa_table(transitions, initial, finals, stops, width))
    empty = out is None or (
      not out["final"][0] and not out["table"][0].max(initial=-1) >= 0
    )
  else:
    out = tables(transitions, initial, finals, stops, width)
    empty = (
      not out["final"][0] and not out["next_state"][0].max(initial=-1) >= 0
    )
  if empty:
    raise UserError(
      f"the constraint {short(regex)} matches no text this vocabulary can spell"
    )
  return {**out, "regex": regex, "build_s": time.perf_counter() - start}


def _outlines_dfa(regex, vocab, stops, width) -> dict | None:
  """`byte_dfa`'s plain twin: outlines-core's DFA of `regex` over the
  single bytes (None: nothing matches)."""
  index, transitions, finals = _marked_index(_led(regex), vocab, stops, width)
  initial = index.get_initial_state()
  return _unled(dfa_table(transitions, initial, finals, stops, width))


# Characters that end a regex's text in `_marked_index` (noncharacters:
# no tokenizer spells them; the first no token contains is taken).
END_MARKS = ("\U0010fffe", "\U0010ffff", "\U000ffffe")


def _marked_index(regex, vocab, stops, width):
  """(index, transitions, final states) of `regex` over `vocab`.

  outlines-core's Index drops a token whose bytes pass through an
  accepting position into a non-accepting one ("a(bc)?": after "a", the
  token "b"; "(text)|(calls)": at the start, "<"), since its DFA reports
  a match one byte late. So the regex is compiled followed by an end mark
  (a noncharacter, as one more token past every id): no position before
  the mark accepts, so no token is dropped, and the final states are
  those the mark takes to an end (inside a string of a schema it is just
  a character: it goes on, not to an end). The mark's transitions are
  removed; what only the mark led to (the state after it, or a byte
  vocabulary's walk through its bytes) reaches no final state and is
  pruned by `tables`. A regex that accepts nothing before a mark (one
  ending in "$") is compiled as it is."""
  import outlines_core

  mark = next(
    (m for m in END_MARKS if not any(m.encode() in t for t in vocab)), None
  )
  if mark is not None:
    ids = (width, max(stops) + 1, *(1 + max(v) for v in vocab.values()))
    mark_id = max(ids)
    entries = {**vocab, mark.encode(): [mark_id]}
    try:
      index = outlines_core.Index(
        f"(?:{regex}){mark}", outlines_core.Vocabulary(stops[0], entries)
      )
    except ValueError:  # the plain index below says why
      index = None
    if index is not None:
      transitions, ends = index.get_transitions(), set(index.get_final_states())
      finals = {s for s, r in transitions.items() if r.get(mark_id) in ends}
      if finals:
        for s in finals:
          del transitions[s][mark_id]
        return index, transitions, finals
  index = outlines_core.Index(regex, outlines_core.Vocabulary(stops[0], vocab))
  return index, index.get_transitions(), set(index.get_final_states())


def _varint(data: bytes, at: int) -> tuple[int, int]:
  """bincode's variable-length integer at `at`: (value, next offset)."""
  tag = data[at]
  if tag < 251:
    return tag, at + 1
  size = {251: 2, 252: 4, 253: 8, 254: 16}[tag]
  return int.from_bytes(data[at + 1 : at + 1 + size], "little"), at + 1 + size


def count_states(index) -> int:
  """States with transitions, read from the index's serialized header
  (initial state, final-state set, then the transition map's length)."""
  data = index.__reduce__()[1][0]
  _, at = _varint(data, 0)
  n_final, at = _varint(data, at)
  for _ in range(n_final):
    _, at = _varint(data, at)
  n_states, _ = _varint(data, at)
  return n_states


def _edges(transitions, initial, finals, stops, width, forward=True):
  """(src, tok, dst, final, n) of outlines' transitions, states numbered
  densely (the initial one 0), without stop ids, ids past `width`,
  tokens into states that reach no final state and (with `forward`)
  states no walk reaches."""
  raw = np.array(sorted(set(transitions) | finals | {initial}), np.int64)
  # Dense numbers: the initial state 0, the others in raw order after it.
  order = np.argsort(raw != initial, kind="stable")
  number = np.empty(raw.size, np.int64)
  number[order] = np.arange(raw.size)
  n = raw.size

  def dense(states):
    return number[np.searchsorted(raw, states)]

  rows = list(transitions.values())
  sizes = np.fromiter(map(len, rows), np.int64, len(rows))
  total = int(sizes.sum())
  chain = itertools.chain.from_iterable
  tok = np.fromiter(chain(r.keys() for r in rows), np.int64, total)
  dst = dense(np.fromiter(chain(r.values() for r in rows), np.int64, total))
  src = np.repeat(dense(np.fromiter(transitions, np.int64, len(rows))), sizes)
  # outlines' one EOS loop goes with every other stop id (none is text here)
  # and ids past the logits width; each stop id then loops on every final
  # state.
  keep = (tok < width) & ~np.isin(tok, stops)
  src, tok, dst = src[keep], tok[keep], dst[keep]
  final = np.zeros(n, bool)
  final[dense(np.array(sorted(finals), np.int64))] = True
  # Tokens into states that reach no final state are dropped (a walk
  # there could never end), then the states no walk reaches.
  keep = _closure(dst, src, final)[dst]
  src, tok, dst = src[keep], tok[keep], dst[keep]
  if not forward:
    return src, tok, dst, final, n
  start = np.zeros(n, bool)
  start[0] = True
  live = _closure(src, dst, start)
  keep = live[src]
  renumber = np.cumsum(live) - 1
  src, tok, dst = renumber[src[keep]], tok[keep], renumber[dst[keep]]
  return src, tok, dst, final[live], int(live.sum())


# A byte a DFA over bytes is compiled behind (`_led`): outlines-core took
# seconds to build the index of a regex that starts with a repeated class
# (a JSON string of at most 16 characters: 4 s, 32: minutes) and 5 ms
# with any byte before it.
LEAD = 0x03


def _led(regex: str) -> str:
  return f"\\x{LEAD:02x}(?:{regex})"


def _unled(dfa: dict) -> dict | None:
  """A `dfa_table` of `_led(regex)` as the regex's own: from the state
  after the lead byte (None where there is none: nothing matches)."""
  start = int(dfa["table"][0, LEAD]) if dfa["table"].shape[0] else -1
  if start < 0:
    return None
  table, final = _splicer().reached(dfa["table"], dfa["final"], start)
  return {"table": table, "final": final}


def dfa_table(transitions, initial, finals, stops, width) -> dict:
  """`table` (int32[S, 256]: the state after each byte, -1: rejected) and
  `final` of a DFA compiled over the single bytes (ids 0-255), with the
  states no walk from 0 reaches still in it (`_unled` drops them)."""
  src, tok, dst, final, n = _edges(
    transitions, initial, finals, stops, width, forward=False
  )
  table = np.full((n, 256), -1, np.int32)
  table[src, tok] = dst
  return {"table": table, "final": final}


def tables(transitions, initial, finals, stops, width) -> dict:
  """Dense tables (`tables.Tables`' fields) from outlines' transitions."""
  src, tok, dst, final, n = _edges(transitions, initial, finals, stops, width)
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

  return {
    "bits": mask_bits(src, tok, n, width),
    "token_class": token_class.astype(np.int32),
    "next_state": next_state,
    "final": final,
    "distance": _distance(next_state, final),
  }


def _closure(frm, to, seed) -> np.ndarray:
  """`seed` and every state a transition `frm` -> `to` leads to from it,
  repeatedly (swap `frm` and `to` for the states that lead to `seed`)."""
  return hops(frm, to, seed) < UNREACHED


UNREACHED = np.iinfo(np.int32).max // 2  # tables.DEAD: no final reachable


def hops(frm, to, seed) -> np.ndarray:
  """int32[n]: fewest transitions `frm` -> `to` from a `seed` state (bool
  [n]) to each state (`UNREACHED`: none): a breadth-first search from
  all seeds at once (SciPy's, in C: a level-by-level search in NumPy
  paid a few calls per level, 36 ms along a 3,000-state chain of key
  bytes against 0.7 ms)."""
  from scipy.sparse import csr_matrix
  from scipy.sparse.csgraph import dijkstra

  n = seed.size
  out = np.full(n, UNREACHED, np.int32)
  sources = np.flatnonzero(seed)
  if not sources.size:
    return out
  frm, to = np.asarray(frm, np.int64), np.asarray(to, np.int64)
  graph = csr_matrix((np.ones(frm.size, np.float32), (frm, to)), shape=(n, n))
  far = dijkstra(graph, indices=sources, unweighted=True, min_only=True)
  reached = np.isfinite(far)
  out[reached] = far[reached]
  return out


def mask_bits(src, tok, n_states: int, width: int) -> np.ndarray:
  """[states, words] uint32: bit t % 32 of word t // 32 of row s is set
  where token t leaves state s, from the (src, tok) pairs (each once).

  One pass over the pairs: a word's bits are distinct powers of two, so
  their sum (exact in float64) is their OR. `mask_bits_dense` is the plain
  twin (the tests compare them); it gathered and packed a dense row per
  state, 7x slower on a 10k-state schema."""
  words = -(-width // 32)
  word = src.astype(np.int64) * words + (tok >> 5)
  bit = np.left_shift(1, tok & 31).astype(np.float64)
  total = np.bincount(word, weights=bit, minlength=n_states * words)
  return total.astype(np.int64).astype(np.uint32).reshape(n_states, words)


def mask_bits_dense(next_state, token_class, width: int) -> np.ndarray:
  """`mask_bits` from the dense tables, 256 state rows at a time."""
  n = next_state.shape[0]
  words = -(-width // 32)
  bits = np.zeros((n, words), np.uint32)
  for lo in range(0, n, 256):  # bounded memory: 256 dense rows at a time
    allowed = next_state[lo : lo + 256][:, token_class] >= 0
    allowed = np.pad(allowed, ((0, 0), (0, words * 32 - width)))
    packed = np.packbits(allowed, axis=1, bitorder="little")
    bits[lo : lo + 256] = np.ascontiguousarray(packed).view("<u4")
  return bits


def _classes(src, tok, dst, n_states, width):
  """Class ids of tokens with equal next-state columns; class 0 is the
  tokens no state allows (padding, control tokens, unusable text)."""
  rng = np.random.default_rng(0)  # fixed: every host builds equal tables
  signatures = []
  for _ in range(2):
    weight = rng.integers(1, 2**63, n_states, dtype=np.uint64) | np.uint64(1)
    contribution = weight[src] * (dst.astype(np.uint64) + np.uint64(1))
    sig = np.zeros(width, np.uint64)
    np.add.at(sig, tok, contribution)  # wraps modulo 2**64
    signatures.append(sig)
  both = np.stack(signatures, axis=1)
  unique, inverse = np.unique(both, axis=0, return_inverse=True)
  if np.any(unique[0] != 0):  # every token is allowed somewhere
    inverse = inverse + 1
    return inverse.reshape(-1), unique.shape[0] + 1
  return inverse.reshape(-1), unique.shape[0]


def _distance(next_state, final) -> np.ndarray:
  """Fewest tokens from each state to a final state: a breadth-first
  search backwards from the final states over the class table's edges."""
  src, cls = np.nonzero(next_state >= 0)
  return hops(next_state[src, cls], src, final)


# -- the worker process ---------------------------------------------------


def read_message(stream):
  """One length-prefixed pickle from `stream`; None at end of file."""
  head = stream.read(8)
  if len(head) < 8:
    return None
  (n,) = struct.unpack("<Q", head)
  return pickle.loads(stream.read(n))


def write_message(stream, message) -> None:
  data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
  stream.write(struct.pack("<Q", len(data)) + data)
  stream.flush()


def narrowed(out: dict) -> dict:
  """`build`'s result with a DFA's `table` as int16 where its states fit
  (half the bytes through the pipe; `widened` undoes it)."""
  table = out.get("table")
  if table is not None and table.shape[0] <= np.iinfo(np.int16).max:
    out = {**out, "table": table.astype(np.int16)}
  return out


def widened(out: dict) -> dict:
  """`narrowed`'s inverse: the table as int32 again."""
  table = out.get("table")
  if table is not None and table.dtype != np.int32:
    out = {**out, "table": table.astype(np.int32)}
  return out


def _address_space() -> int | None:
  """This process's virtual size in bytes (None where unknown)."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return None


def _cap_memory(max_mb: float) -> None:
  """RLIMIT_AS = current size + max_mb (no-op where unsupported)."""
  try:
    import resource
  except ImportError:
    return
  size = _address_space()
  if size is None:
    return
  limit = size + int(max_mb * 2**20)
  with contextlib.suppress(ValueError, OSError):
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))


def serve(requests, replies) -> None:
  """Answers requests until end of file (the module docstring)."""
  vocabs: dict[str, dict] = {}
  while (request := read_message(requests)) is not None:
    key = request.pop("vocab_key", None)
    if "vocab" in request:
      vocabs.clear()  # one vocabulary at a time: bounded memory
      vocabs[key] = request.pop("vocab")
    vocab = vocabs.get(key) if key is not None else None
    max_mb = request.pop("max_compile_mb")
    if key is not None and vocab is None:
      write_message(replies, {"error": "internal: unknown vocabulary"})
      continue
    _cap_memory(max_mb)
    try:
      reply = {"ok": narrowed(build(vocab=vocab, **request))}
    except UserError as e:
      reply = {"error": str(e)}
    except MemoryError:
      reply = {"memory": "a Python allocation failed"}
    write_message(replies, reply)


if __name__ == "__main__":
  # Started as `python -P automaton.py` (-P: this directory is not put on
  # sys.path). stdout carries replies only.
  replies = os.fdopen(os.dup(1), "wb")
  os.dup2(2, 1)
  serve(sys.stdin.buffer, replies)
