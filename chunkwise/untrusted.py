"""Reading untrusted input: JSON with bounds on size and nesting.

Model files, batch-job inputs and JSON schemas come from people other
than the user. Every reader of such data goes through these helpers so
that a hostile file ends in a `ValueError` naming the file and what is
wrong, before anything large is allocated:

  config = read_json("ckpt/config.json", max_bytes=64 << 20)  # dict
  record = loads(line, source="data.jsonl:3", max_depth=32)

Limits: a file larger than `max_bytes` is refused before it is read;
nesting deeper than `max_depth` (or than Python's recursion limit) is
refused; `expect` checks the top-level type. Imports nothing else of
chunkwise.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
from typing import Any

# Default bounds for small JSON files (configs, descriptions).
CONFIG_BYTES = 64 << 20
MAX_DEPTH = 256


def depth(value: Any) -> int:
  """How deeply lists and dicts nest in `value` (a scalar is 0); walked
  without recursion."""
  deepest, stack = 0, [(value, 0)]
  while stack:
    node, d = stack.pop()
    if isinstance(node, dict):
      node = node.values()
    elif not isinstance(node, list):
      continue
    deepest = max(deepest, d + 1)
    stack.extend((child, d + 1) for child in node)
  return deepest


def loads(
  text: str | bytes,
  *,
  source: str,
  max_depth: int = MAX_DEPTH,
  expect: type | None = None,
) -> Any:
  """`json.loads(text)`, refusing nesting deeper than `max_depth`.

  Raises:
    ValueError: invalid JSON or UTF-8, too deep, or not of type `expect`
      (the message starts with `source`).
  """
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(
      f"{source}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    ) from None
  except UnicodeDecodeError as e:
    raise ValueError(
      f"{source}: not valid UTF-8 ({e.reason} at byte {e.start})"
    ) from None
  except RecursionError:
    raise ValueError(
      f"{source}: JSON nested too deeply (more than Python's recursion limit)"
    ) from None
  found = depth(value)
  if found > max_depth:
    raise ValueError(
      f"{source}: JSON nested {found} levels deep, over the limit of "
      f"{max_depth}"
    )
  if expect is not None and not isinstance(value, expect):
    raise ValueError(
      f"{source}: expected a JSON {_json_type(expect)}, got "
      f"{_json_type(type(value))}"
    )
  return value


def _json_type(t: type) -> str:
  return {dict: "object", list: "array", str: "string"}.get(t, t.__name__)


def read_bytes(path: str | os.PathLike, *, max_bytes: int, what: str) -> bytes:
  """The file's bytes, refusing one larger than `max_bytes` before
  reading it.

  Raises:
    FileNotFoundError: no such file.
    ValueError: too large, or not a regular file.
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no {what} at {path}")
  if not os.path.isfile(path):
    raise ValueError(f"{path}: {what} is not a regular file")
  size = os.path.getsize(path)
  if size > max_bytes:
    raise ValueError(
      f"{path}: {what} has {size} bytes, over the limit of {max_bytes}"
    )
  with open(path, "rb") as f:
    data = f.read(size + 1)  # read(n) allocates n bytes up front
  if len(data) > max_bytes:
    raise ValueError(f"{path}: {what} grew past {max_bytes} bytes")
  return data


def read_json(
  path: str | os.PathLike,
  *,
  max_bytes: int = CONFIG_BYTES,
  max_depth: int = MAX_DEPTH,
  expect: type | None = dict,
  what: str = "JSON file",
) -> Any:
  """The JSON value in `path` (see `read_bytes` and `loads`)."""
  path = os.fspath(path)
  data = read_bytes(path, max_bytes=max_bytes, what=what)
  return loads(data, source=path, max_depth=max_depth, expect=expect)


def check_int(
  value: Any,
  name: str,
  *,
  source: str,
  lo: int = 0,
  hi: int = 2**62,
) -> int:
  """`value` if it is an int (not a bool) in [lo, hi]; else ValueError
  naming `source`, `name`, the value and the range."""
  if (
    isinstance(value, bool)
    or not isinstance(value, int)
    or not (lo <= value <= hi)
  ):
    raise ValueError(
      f"{source}: {name}={_brief(value)} is not an integer in [{lo}, {hi}]"
    )
  return value


@contextlib.contextmanager
def named(source: str):
  """ValueErrors raised inside start with `source`, unless they already
  name it."""
  try:
    yield
  except ValueError as e:
    if source in str(e):
      raise
    raise ValueError(f"{source}: {e}") from None


def overlap(spans) -> tuple[str, str] | None:
  """The names of the first two of `spans` ([(start, end, name)], byte
  ranges of a file) that overlap, or None."""
  spans = sorted(s for s in spans if s[1] > s[0])
  for (_, end, first), (start, _, second) in itertools.pairwise(spans):
    if start < end:
      return first, second
  return None


def check_float(value: Any, name: str, *, source: str) -> float:
  """`value` as a float if it is a finite int or float (not a bool); else
  ValueError naming `source`, `name` and the value."""
  if (
    isinstance(value, bool)
    or not isinstance(value, int | float)
    or not math.isfinite(value)
  ):
    raise ValueError(f"{source}: {name}={_brief(value)} is not a finite number")
  return float(value)


def _brief(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."
