"""Input files of batch jobs: one example per line, read and checked whole
before any device work.

  examples = read("data.jsonl", kind=SCORE)         # or kind=GENERATE
  prepared = prepare(examples, encode, limit=2048)  # token rows, checked

Formats (by file suffix: .jsonl / .ndjson / .json are JSON lines; anything
else is plain text):
- JSON lines, scoring: {"id", "text"} (every token after BOS is scored) or
  {"id", "context", "continuation"} (only the continuation is scored,
  conditioned on the context).
- JSON lines, generation: {"id", "prompt"} ("text" is accepted too).
- Plain text: one example per line, its id the line number (from 1).

A JSON line may name its LoRA adapter: "adapter": a name the job serves
(`read(adapters=...)`), or null for the base model; a line without the
field, and every plain-text line, runs the job's default (`adapter=`).

Ids are strings or integers, unique in the file; they are data only
(never part of a file name). A bad line (invalid JSON or UTF-8, a missing
or mistyped field, an empty text, a duplicate id, an unpaired surrogate,
too many tokens, longer than `max_line_bytes`, JSON nested deeper than
`max_depth`) is reported as `file:line: reason`: `InputError` for the
first one, or with `skip_bad=True` a list of such messages while the rest
goes on. Lines end with "\n" (or "\r\n"); the file is read line by line,
so an over-long line is never held in memory whole.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from chunkwise import untrusted

SCORE = "score"
GENERATE = "generate"
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
# Defaults of the jobs' --max_line_bytes and --max_json_depth.
MAX_LINE_BYTES = 4 << 20
MAX_JSON_DEPTH = 32


class InputError(ValueError):
  """A bad input file or line; the message starts with `file:line:`."""


@dataclasses.dataclass(frozen=True)
class Example:
  """One input line.

  id: from the file, or the line number for plain text.
  line: the line number (from 1), for messages.
  text: scored text, continuation or prompt.
  context: conditioning text that is not scored ("" if none).
  ids, context_ids: the same as token ids (seqio inputs; `ids` None: text).
  adapter: the LoRA adapter it runs (None: the base model).
  """

  id: int | str
  line: int
  text: str
  context: str = ""
  adapter: str | None = None
  # Token ids instead of text (a seqio Task's features, `seqio_input`):
  # `ids` for `text`, `context_ids` for `context`; None: text.
  ids: tuple[int, ...] | None = None
  context_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Prepared:
  """An example's tokens: `tokens[scored_from:]` are scored (scoring) or
  the whole row is the prompt (generation)."""

  example: Example
  tokens: list[int]
  scored_from: int


@dataclasses.dataclass
class Examples:
  """What `read` found: good examples in file order, and bad lines as
  `file:line: reason` messages."""

  path: str
  items: list[Example]
  bad: list[tuple[int, str]]  # (line, "file:line: reason")

  @property
  def messages(self) -> list[str]:
    return [message for _, message in sorted(self.bad)]


def id_key(value: Any) -> str:
  """An id as a set key: 3 and "3" are different ids."""
  return json.dumps(value)


def _is_json(path: str, fmt: str) -> bool:
  if fmt == "auto":
    return path.lower().endswith(JSON_SUFFIXES)
  if fmt not in ("jsonl", "text"):
    raise ValueError(f"input format {fmt!r}: expected auto, jsonl or text")
  return fmt == "jsonl"


def _field(record: dict, name: str, *, required: bool = True) -> str:
  if name not in record:
    if required:
      raise ValueError(f"missing field {name!r}")
    return ""
  value = record[name]
  if not isinstance(value, str):
    raise ValueError(
      f"field {name!r} is {type(value).__name__} {_brief(value)}, expected "
      "a string"
    )
  _check_text(value, f"field {name!r}")
  if required and not value.strip():
    raise ValueError(f"field {name!r} is empty")
  return value


def _brief(value) -> str:
  text = repr(value)
  return text if len(text) <= 40 else text[:37] + "..."


def _check_text(value: str, what: str) -> None:
  """Text from JSON may hold unpaired surrogates ("\\ud800"), which no
  tokenizer can encode."""
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(
      f"{what} holds an unpaired surrogate {value[e.start]!r} at "
      f"character {e.start}"
    ) from None


def _adapter(record: dict, known, default: str | None) -> str | None:
  """The line's "adapter": a served name, null (the base model), or
  `default` when the field is absent."""
  if "adapter" not in record:
    return default
  name = record["adapter"]
  if name is None:
    return None
  if not isinstance(name, str):
    raise ValueError(
      f"field 'adapter' is {type(name).__name__} {_brief(name)}, expected "
      "a name or null"
    )
  if name not in known:
    served = ", ".join(map(repr, known)) if known else "none"
    raise ValueError(
      f"id {_brief(record['id'])} names adapter {_brief(name)}, which "
      f"--adapters does not give (it gives {served})"
    )
  return name


def _from_json(
  text: str,
  line: int,
  kind: str,
  max_depth: int,
  known: tuple[str, ...] = (),
  default: str | None = None,
) -> Example:
  try:
    record = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"invalid JSON: {e.msg} at column {e.colno}") from None
  except RecursionError:
    record = None
  found = untrusted.depth(record) if record is not None else max_depth + 1
  if found > max_depth:
    raise ValueError(f"JSON nested deeper than --max_json_depth={max_depth}")
  if not isinstance(record, dict):
    raise ValueError(
      f"expected a JSON object, got {type(record).__name__} {text[:40]!r}"
    )
  if "id" not in record:
    raise ValueError("missing field 'id'")
  ident = record["id"]
  if isinstance(ident, bool) or not isinstance(ident, int | str):
    raise ValueError(f"id {_brief(ident)} is not a string or an integer")
  if isinstance(ident, str):
    _check_text(ident, "id")
  adapter = _adapter(record, known, default)
  if kind == GENERATE:
    name = "prompt" if "prompt" in record or "text" not in record else "text"
    return Example(ident, line, _field(record, name), adapter=adapter)
  if "continuation" in record or "context" in record:
    return Example(
      ident,
      line,
      _field(record, "continuation"),
      _field(record, "context", required=False),
      adapter,
    )
  return Example(ident, line, _field(record, "text"), adapter=adapter)


def _lines(f, max_bytes: int):
  """(number, bytes or None) per line of binary file `f`; None for a line
  longer than `max_bytes`, whose rest is skipped without being held."""
  number = 0
  while True:
    data = f.readline(max_bytes + 2)  # room for "\r\n"
    if not data:
      return
    number += 1
    if len(data) > max_bytes + (data.endswith(b"\n") + data.endswith(b"\r\n")):
      while data and not data.endswith(b"\n"):
        data = f.readline(1 << 20)
      yield number, None
      continue
    yield number, data.rstrip(b"\n").rstrip(b"\r")


def read(
  path: str | os.PathLike,
  *,
  kind: str,
  fmt: str = "auto",
  skip_bad: bool = False,
  max_line_bytes: int = MAX_LINE_BYTES,
  max_depth: int = MAX_JSON_DEPTH,
  adapters: Sequence[str] = (),
  adapter: str | None = None,
) -> Examples:
  """Reads every example of `path` (see the module docstring). A JSON
  line may name one of `adapters` (another name is a bad line); the
  others run `adapter` (None: the base model).

  Raises:
    FileNotFoundError: no such file.
    InputError: a bad line (unless `skip_bad`) or a file with no examples.
  """
  path = os.fspath(path)
  if kind not in (SCORE, GENERATE):
    raise ValueError(f"kind {kind!r}: expected {SCORE!r} or {GENERATE!r}")
  json_lines = _is_json(path, fmt)
  known = tuple(adapters)
  if adapter is not None and adapter not in known:
    raise ValueError(f"default adapter {adapter!r} is not one of {known}")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no input file {path}")
  found = Examples(path, [], [])
  first_line: dict[str, int] = {}
  with open(path, "rb") as f:
    for number, data in _lines(f, max_line_bytes):
      try:
        if data is None:
          raise ValueError(
            f"line longer than --max_line_bytes={max_line_bytes} bytes"
          )
        try:
          text = data.decode("utf-8")
        except UnicodeDecodeError as e:
          raise ValueError(
            f"not valid UTF-8 ({e.reason} at byte {e.start})"
          ) from None
        if not text.strip():
          raise ValueError("empty line" if json_lines else "empty text")
        if json_lines:
          example = _from_json(text, number, kind, max_depth, known, adapter)
        else:
          example = Example(number, number, text, adapter=adapter)
        key = id_key(example.id)
        if key in first_line:
          raise ValueError(
            f"duplicate id {_brief(example.id)} (first on line "
            f"{first_line[key]})"
          )
        first_line[key] = number
        found.items.append(example)
      except ValueError as e:
        found.bad.append((number, f"{path}:{number}: {e}"))
  _check_bad(found, skip_bad)
  if not found.items:
    raise InputError(_nothing_left(found, "no examples"))
  return found


def check(found: Examples, skip_bad: bool) -> None:
  """Raises `InputError` for a bad example (unless `skip_bad`) or when
  there is none (a reader other than `read`: `seqio_input`)."""
  _check_bad(found, skip_bad)
  if not found.items:
    raise InputError(_nothing_left(found, "no examples"))


def _nothing_left(found: Examples, what: str) -> str:
  if not found.bad:
    return f"{found.path}: {what} to run (the file is empty)"
  return (
    f"{found.path}: {what} to run: all {len(found.bad)} are bad lines; "
    f"the first: {found.messages[0]}"
  )


def _check_bad(found: Examples, skip_bad: bool) -> None:
  if found.bad and not skip_bad:
    more = len(found.bad) - 1
    raise InputError(
      found.messages[0]
      + (f" (and {more} more bad line{'s' * (more > 1)})" if more else "")
      + "; fix the input or pass --skip_bad_lines"
    )


def prepare(
  found: Examples,
  encode: Callable[[Example], tuple[list[int], int]],
  *,
  limit: int,
  reserved: int = 0,
  reserved_for: str = "",
  what: str = "--max_len",
  skip_bad: bool = False,
) -> list[Prepared]:
  """Tokenizes every example with `encode` (returns the row and where its
  scored tokens start) and checks its length: `reserved` (a shared
  prefix, generated steps) plus the row must fit in `limit`. Over-long
  lines join `found.bad`; they raise `InputError` unless `skip_bad`."""
  kept = []
  for example in found.items:
    tokens, scored_from = encode(example)
    if reserved + len(tokens) > limit:
      found.bad.append(
        (
          example.line,
          f"{found.path}:{example.line}: {len(tokens)} tokens"
          + (f" + {reserved} for {reserved_for}" if reserved else "")
          + f" exceed {what}={limit}",
        )
      )
      continue
    kept.append(Prepared(example, list(tokens), scored_from))
  _check_bad(found, skip_bad)
  if not kept:
    raise InputError(_nothing_left(found, "no examples left"))
  return kept
