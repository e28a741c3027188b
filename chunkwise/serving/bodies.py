"""Request bodies: parsed off the event loop, bounded before and after.

  body = bodies.parse(raw, status=400, max_depth=64)   # in a worker thread

A body is at most `MAX_BODY_BYTES` (aiohttp refuses more with a 413). It
is parsed in a worker thread, never on the event loop, and still the
parse must not hold the interpreter long: `json.loads` keeps the GIL for
all of its work, so every other thread, the loop's included, waits. Two
things made a 4 MB body cost far more than its bytes:

- Python's cyclic collector. Each new list or dict is tracked, and every
  few hundred allocations the collector walks them again: a body of a
  million small lists took 0.3-0.6 s to parse, where the parse itself
  takes 0.05-0.08 s. The collector is paused while a body is parsed
  (`_collector_paused`, counted across threads), and so is it while the
  body is checked: the depth walk allocates as it goes.
- The number of arrays and objects: `json.loads` makes each one while
  it holds the GIL, and the depth check walks each. A body may hold at
  most `MAX_JSON_CONTAINERS` (50,000: 5 ms of parsing; a request's
  messages, tools and token lists need a few thousand), counted before
  anything is parsed (`containers`: its '[' and '{' outside strings,
  found with NumPy, which lets go of the GIL as it scans).
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
import threading
from typing import Any

import numpy as np

from chunkwise.serving import api
from chunkwise.serving.api import ApiError

MAX_BODY_BYTES = 4 << 20
MAX_JSON_DEPTH = 64
MAX_JSON_CONTAINERS = 50_000
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # a \uXXXX escape of one

_TOO_DEEP = object()
_pause_lock = threading.Lock()
_pauses = 0  # parses running with the collector paused
_paused_here = False  # whether the collector was on when the first began


@contextlib.contextmanager
def _collector_paused():
  """The cyclic collector off while any thread parses a body (it was on
  before: it is on again after the last one)."""
  global _pauses, _paused_here
  with _pause_lock:
    if _pauses == 0:
      _paused_here = gc.isenabled()
      gc.disable()
    _pauses += 1
  try:
    yield
  finally:
    with _pause_lock:
      _pauses -= 1
      if _pauses == 0 and _paused_here:
        gc.enable()


def containers(raw: bytes) -> int:
  """How many arrays and objects the JSON text `raw` opens: its '[' and
  '{' outside strings (where `raw` is not JSON, at least as many as
  `json.loads` makes before it finds out: strings are found as JSON
  finds them, a '"' not escaped by an odd run of backslashes)."""
  a = np.frombuffer(raw, np.uint8)
  opens = np.flatnonzero((a == ord("[")) | (a == ord("{")))
  quotes = np.flatnonzero(a == ord('"'))
  if raw.find(b'\\"') >= 0:  # some quotes may be escaped
    slashes = np.flatnonzero(a == ord("\\"))
    # each backslash's run so far: where a run starts, its index
    starts = np.ones(len(slashes), bool)
    starts[1:] = np.diff(slashes) != 1
    first = np.maximum.accumulate(np.where(starts, slashes, 0))
    at = np.searchsorted(slashes, quotes - 1)  # the backslash before?
    at = np.minimum(at, max(len(slashes) - 1, 0))
    escaped = np.zeros(len(quotes), bool)
    if len(slashes):
      before = slashes[at] == quotes - 1
      run = quotes - 1 - first[at] + 1
      escaped = before & (run % 2 == 1)
    quotes = quotes[~escaped]
  # a bracket is outside strings where an even number of quotes precede it
  return int(np.count_nonzero(np.searchsorted(quotes, opens) % 2 == 0))


def depth(value: Any) -> int:
  """How deep `value`'s lists and dicts nest (a scalar: 0), level by
  level: one list per level, no tuple per value."""
  deepest, level = 0, [value]
  while True:
    inner, found = [], False
    for v in level:
      if isinstance(v, dict):
        inner.extend(v.values())
      elif isinstance(v, list):
        inner.extend(v)
      else:
        continue
      found = True
    if not found:
      return deepest
    deepest, level = deepest + 1, inner


def parse(
  raw: bytes,
  *,
  status: int,
  max_depth: int = MAX_JSON_DEPTH,
  max_containers: int = MAX_JSON_CONTAINERS,
) -> dict:
  """`raw` as a JSON object; an `ApiError(status)` naming what is wrong:
  not UTF-8 (`json.loads` would take UTF-16 and UTF-32 too, whose bytes
  the counts below misread), not JSON, more than `max_containers` arrays
  and objects, nesting deeper than `max_depth`, not an object, an
  unpaired surrogate."""
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ApiError(
      status, f"the body is not UTF-8 (byte {e.start}): JSON bodies are"
    ) from None
  if raw.count(b"[") + raw.count(b"{") > max_containers:  # (strings too)
    found = containers(raw)
    if found > max_containers:
      raise ApiError(
        status,
        f"the body holds {found} JSON arrays and objects; at most "
        f"{max_containers} are parsed",
      )
  with _collector_paused():
    return _checked(raw, text, status, max_depth)


def _checked(raw: bytes, text: str, status: int, max_depth: int) -> dict:
  try:
    body = json.loads(text)
  except RecursionError:  # deeper than Python's recursion limit
    body = _TOO_DEEP
  except ValueError as e:  # not JSON, a BOM, a 5,000-digit number
    raise ApiError(status, f"the body is not valid JSON: {e}") from None
  if body is _TOO_DEEP or depth(body) > max_depth:
    raise ApiError(status, f"the JSON body nests deeper than {max_depth}")
  if not isinstance(body, dict):
    raise ApiError(status, "the body must be a JSON object")
  if _SURROGATE.search(raw) and (where := api.unpaired_surrogate(body)):
    raise ApiError(status, f"{where} holds an unpaired surrogate: not text")
  return body
