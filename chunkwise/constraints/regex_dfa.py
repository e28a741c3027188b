"""A regex -> its trimmed, minimal DFA over bytes, natively (`regex_dfa.cc`).

  out = regex_dfa.build(r'"[a-z]{1,8}"', max_states=10_000)
  out.table   # int32[S, 256]: the state after a byte (-1: rejected), 0 first
  out.final   # bool[S]
  regex_dfa.build(r"(?i)abc", 10)   # None: outside the subset

The C++ side parses the subset of Rust's regex syntax that JSON schemas
compile to (and most hand-written patterns): literals and escapes,
classes, `.`, groups, alternation and every repetition. It builds a
Thompson NFA over UTF-8 bytes, determinizes it over byte classes,
drops the states that reach no match, minimizes (Hopcroft) and numbers
the states breadth-first. A median JSONSchemaBench schema takes well
under a millisecond, where outlines-core's index over the 256 bytes took
5 ms; a DFA of 10,000 states, tens of milliseconds.

`automaton.py` (the compile worker) tries this first and falls back to
outlines-core, its plain twin, whenever `build` answers None: a regex
outside the subset, an NFA past `max_nfa` states, or no C++ compiler
(logged once). `\\d`, `\\s` and `\\w` are Unicode classes in Rust; their
code points are read from outlines-core's own DFAs (`classes`), so both
engines agree on them by construction. Tests compare the two languages
over a corpus (`tests/test_regex_dfa.py`).

`CHUNKWISE_NATIVE_REGEX=0` turns it off. No JAX and no chunkwise import:
the worker loads this file by its path.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.util
import logging
import os
import pathlib
import re
import sys
from collections.abc import Callable

import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden")

OK, UNSUPPORTED, TOO_MANY_STATES, TOO_LARGE, NO_MEMORY = range(5)
# NFA states past which the regex goes to outlines-core (its limits and
# errors then decide).
MAX_NFA = 20_000_000
# \d, \s, \w: their number in the library.
CLASSES = {"d": 0, "s": 1, "w": 2}
_USES_CLASS = re.compile(r"\\[dswDSW]")

log = logging.getLogger(__name__)


class TooManyStates(Exception):
  """The DFA has more states than allowed."""


@dataclasses.dataclass(frozen=True, eq=False)
class Dfa:
  table: np.ndarray  # int32[S, 256]
  final: np.ndarray  # bool[S]


def enabled() -> bool:
  value = os.environ.get("CHUNKWISE_NATIVE_REGEX", "1").strip().lower()
  return value not in ("0", "false", "off", "no")


def _toolchain():
  if __package__:
    from chunkwise.cpu_kernels import toolchain

    return toolchain
  name = "chunkwise_toolchain"
  if name not in sys.modules:
    path = _HERE.parent / "cpu_kernels" / "toolchain.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
  return sys.modules[name]


_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
_STATUS = ctypes.POINTER(ctypes.c_int32)
# The library's functions: (result, arguments).
_SIGNATURES = {
  "cw_regex_dfa": (_P, [ctypes.c_char_p, _I64, _I64, _I64, _STATUS]),
  "cw_dfa_minimize": (_P, [_P, _P, _I32, _I32, _STATUS]),
  "cw_regex_dfa_states": (_I32, [_P]),
  "cw_regex_dfa_copy": (None, [_P, _P, _P]),
  "cw_regex_dfa_free": (None, [_P]),
  "cw_regex_set_class": (None, [_I32, _P, _I64]),
  "cw_token_distance": (
    None,
    [_P, _P, _I32, _P, _P, _I64, _P, _P, _P, _I32, _P],
  ),
}


@functools.cache
def library() -> ctypes.CDLL | None:
  """The compiled library (once per machine), or None (logged)."""
  if not enabled():
    return None
  toolchain = _toolchain()
  cxx = toolchain.compiler()
  if cxx is None:
    log.warning(
      "chunkwise: no C++ compiler found; regexes compile with outlines-core"
    )
    return None
  try:
    path = toolchain.shared_library(
      "regex_dfa", [_HERE / "regex_dfa.cc"], FLAGS, cxx
    )
    lib = ctypes.CDLL(str(path))
  except (RuntimeError, OSError) as e:
    log.warning(
      "chunkwise: the native regex compiler did not build (%s); regexes "
      "compile with outlines-core",
      str(e)[-500:],
    )
    return None
  for name, (result, args) in _SIGNATURES.items():
    getattr(lib, name).restype = result
    getattr(lib, name).argtypes = args
  return lib


_CLASSES_SET: set[str] = set()


def cached_classes(
  classes: Callable[[str], np.ndarray], version: str
) -> Callable[[str], np.ndarray]:
  """`classes` read from (and written to) a file beside the compiled
  library, keyed by `version` (the engine the ranges were read from):
  each new process then skips reading them again (~0.1 s a class)."""
  path = _toolchain().cache_dir() / f"regex-classes-{version}.npz"

  def read(letter: str) -> np.ndarray:
    try:
      with np.load(path) as saved:
        return saved[letter]
    except (OSError, KeyError, ValueError):
      pass
    out = {k: np.asarray(classes(k), np.uint32) for k in CLASSES}
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      work = path.with_suffix(f".{os.getpid()}.npz")
      np.savez(work, **out)
      os.replace(work, path)
    except OSError:
      pass  # a read-only cache: computed again next time
    return out[letter]

  return read


def build(
  regex: str,
  max_states: int,
  classes: Callable[[str], np.ndarray] | None = None,
  max_nfa: int = MAX_NFA,
) -> Dfa | None:
  """The DFA of `regex` (matched in full), or None: outside the subset, an
  NFA past `max_nfa` states, or no library. `classes(letter)`: the code
  point ranges (uint32[n, 2], inclusive) of `\\d`, `\\s` or `\\w`, asked
  for once per process when a regex uses one (without it, such a regex
  is None). Raises TooManyStates past `max_states`, MemoryError."""
  lib = library()
  if lib is None:
    return None
  if _USES_CLASS.search(regex):
    if classes is None:
      return None
    for letter, number in CLASSES.items():
      if letter not in _CLASSES_SET:
        ranges = np.ascontiguousarray(classes(letter), np.uint32)
        lib.cw_regex_set_class(number, ranges.ctypes.data, len(ranges))
        _CLASSES_SET.add(letter)
  data = regex.encode("utf-8", "surrogatepass")
  status = ctypes.c_int32(-1)
  handle = lib.cw_regex_dfa(
    data, len(data), int(max_states), int(max_nfa), ctypes.byref(status)
  )
  if not handle:
    if status.value == TOO_MANY_STATES:
      raise TooManyStates(f"more than {max_states} states")
    if status.value == NO_MEMORY:
      raise MemoryError("the native regex compiler ran out of memory")
    return None  # UNSUPPORTED, TOO_LARGE: outlines-core decides
  return _take(lib, handle)


def minimal(table: np.ndarray, final: np.ndarray, start: int = 0) -> Dfa | None:
  """The minimal DFA of a DFA over bytes (`table` int32[S, 256], -1:
  rejected) from `start`: the states reached from there that reach a
  final state, equivalent ones merged, numbered breadth-first (a DFA put
  together from parts, `dfa_splice`). None without the library."""
  lib = library()
  if lib is None:
    return None
  table = np.ascontiguousarray(table, np.int32)
  final = np.ascontiguousarray(final, np.uint8)
  status = ctypes.c_int32(-1)
  handle = lib.cw_dfa_minimize(
    table.ctypes.data,
    final.ctypes.data,
    table.shape[0],
    int(start),
    ctypes.byref(status),
  )
  if not handle:
    if status.value == NO_MEMORY:
      raise MemoryError("the native DFA minimizer ran out of memory")
    if not 0 <= start < table.shape[0] or table.max(initial=-1) >= len(table):
      raise ValueError(f"not a DFA over bytes from state {start}")
    return None  # two columns' hashes collided (never seen): not minimized
  return _take(lib, handle)


def token_distance(
  table: np.ndarray,
  final: np.ndarray,
  children: tuple[np.ndarray, np.ndarray],
  spells: np.ndarray,
  forced: tuple[np.ndarray, np.ndarray] | None,
  dead: int,
) -> np.ndarray | None:
  """`lazy.token_distance` natively (that function's NumPy body is its
  twin): `children` the trie's (keys, nodes), `spells` bool[nodes]: a
  node some allowed token ends at. None without the library."""
  lib = library()
  if lib is None:
    return None
  table = np.ascontiguousarray(table, np.int32)
  final = np.ascontiguousarray(final, np.uint8)
  keys, nodes = (np.ascontiguousarray(a, np.int64) for a in children)
  spells = np.ascontiguousarray(spells, np.uint8)
  ids, ends = (None, None) if forced is None else forced
  ids = None if ids is None else np.ascontiguousarray(ids, np.int32)
  ends = None if ends is None else np.ascontiguousarray(ends, np.int32)
  out = np.empty(table.shape[0], np.int32)
  lib.cw_token_distance(
    table.ctypes.data,
    final.ctypes.data,
    table.shape[0],
    keys.ctypes.data,
    nodes.ctypes.data,
    keys.size,
    spells.ctypes.data,
    None if ids is None else ids.ctypes.data,
    None if ends is None else ends.ctypes.data,
    int(dead),
    out.ctypes.data,
  )
  return out


def _take(lib, handle) -> Dfa:
  """The library's DFA as arrays (the handle freed)."""
  try:
    n = lib.cw_regex_dfa_states(handle)
    table = np.empty((n, 256), np.int32)
    final = np.empty(n, np.uint8)
    lib.cw_regex_dfa_copy(handle, table.ctypes.data, final.ctypes.data)
  finally:
    lib.cw_regex_dfa_free(handle)
  return Dfa(table, final.astype(bool))


def code_points(table: np.ndarray, final: np.ndarray) -> np.ndarray:
  """uint32[n, 2]: the ranges of code points whose UTF-8 alone a DFA over
  bytes (state 0 first, -1: rejected) accepts (each code point checked:
  how `classes` reads outlines-core's DFA of `\\d`)."""
  cp = np.arange(0x110000, dtype=np.int64)
  cp = cp[(cp < 0xD800) | (cp > 0xDFFF)]
  n = 1 + (cp >= 0x80) + (cp >= 0x800) + (cp >= 0x10000)
  lead = np.select(
    [n == 1, n == 2, n == 3],
    [cp, 0xC0 | (cp >> 6), 0xE0 | (cp >> 12)],
    0xF0 | (cp >> 18),
  )
  state = table[0, lead]
  for k in range(1, 4):  # continuation bytes, high to low
    shift = 6 * (n - 1 - k)
    more = (n > k) & (state >= 0)
    byte = 0x80 | ((cp >> np.maximum(shift, 0)) & 0x3F)
    state = np.where(more, table[np.maximum(state, 0), byte], state)
  ok = np.zeros(cp.size, bool)
  ok[state >= 0] = final[state[state >= 0]]
  chosen = cp[ok]
  if not chosen.size:
    return np.zeros((0, 2), np.uint32)
  breaks = np.flatnonzero(np.diff(chosen) != 1)
  starts = np.concatenate([[chosen[0]], chosen[breaks + 1]])
  ends = np.concatenate([chosen[breaks], [chosen[-1]]])
  return np.stack([starts, ends], 1).astype(np.uint32)
