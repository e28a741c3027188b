"""What a user constrains output to: a regex, a JSON schema, or a choice.

  cw.constraints.Regex(r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]")
  cw.constraints.JsonSchema({"type": "object", "properties": {...}})
  cw.constraints.Choice(["yes", "no", "maybe"])

Regexes use Rust's `regex` syntax (outlines-core builds their DFA): Python
syntax mostly works, but `\\d`, `\\w` and `\\s` are Unicode classes (a
much larger automaton than `[0-9]`), and look-around and `\\b` are
unsupported. A constraint matches the *whole* generated text, up to the
stop token that ends the row.

Each carries its compile limits: `max_table_mb` (its DFA's table, 1 KB a
state; the eager tables': mask bits at the model's vocabulary width),
`time_limit_s` and `max_compile_mb` (wall time and memory of the
compiling process, which is stopped when it runs past either: see
`worker.py`), and optionally `source`, where it came from (e.g. the
schema's file), for messages.

`fast_forward=True`: where the constraint allows one byte sequence only
(a key, punctuation, a tool call's frame), only one tokenization of it is
allowed (the longest token spelling a prefix of it, step after step; the
run's end is left to the model where a token crosses it:
`lazy.forced_tokens`), so those tokens are forced, and a loop with
`Speculation(drafter="forced")` appends a run of them in one pass, with
the tokens and scores of stepping them one at a time. The text allowed
is the same; the model's choice among spellings of forced bytes is not
(lazy tables only).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from collections.abc import Mapping, Sequence
from contextlib import nullcontext

from chunkwise import untrusted
from chunkwise.constraints import (
  budget,
  narrowing,
  schema_rewrite,
  worker,
)
from chunkwise.constraints import lazy as lazy_lib
from chunkwise.constraints import schema as schema_lib
from chunkwise.constraints import tables as tables_lib

# How `Constraint.compile` builds a constraint: "lazy" (a DFA over bytes,
# masks walked per state: `lazy.py`, `walk.py`) or "eager" (a table over
# states x vocabulary: `tables.py`, the plain twin tests compare it with).
TABLES = "lazy"


@contextlib.contextmanager
def tables_kind(kind: str):
  """Constraints compile to `kind` ("lazy" or "eager") inside (tests and
  benchmarks compare the two)."""
  global TABLES
  if kind not in ("lazy", "eager"):
    raise ValueError(f"tables_kind takes 'lazy' or 'eager', got {kind!r}")
  old, TABLES = TABLES, kind
  try:
    yield
  finally:
    TABLES = old


# Characters Rust's regex syntax treats as meta (escaping them is allowed).
_META = frozenset("\\.+*?()|[]{}^$#&-~")


def escape(text: str) -> str:
  """`text` as a regex matching exactly it (Rust syntax)."""
  return "".join("\\" + c if c in _META else c for c in text)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Constraint:
  """Base class: a regular language over the generated text."""

  max_table_mb: float = 256.0
  time_limit_s: float = 30.0
  max_compile_mb: float = 4096.0
  source: str | None = None
  fast_forward: bool = False

  def __post_init__(self):
    if not isinstance(self.fast_forward, bool):
      raise ValueError(
        f"fast_forward must be True or False, got {self.fast_forward!r}"
      )

  def fast_forwarded(self) -> Constraint:
    """This constraint with `fast_forward=True` (itself if it has it): a
    copy, nothing compiled again."""
    return self if self.fast_forward else self._copy_with(fast_forward=True)

  def _copy_with(self, **fields) -> Constraint:
    """A copy of this (frozen) constraint with `fields` set: what it holds
    already parsed or rewritten is shared, not made again."""
    out = copy.copy(self)
    for name, value in fields.items():
      object.__setattr__(out, name, value)
    return out

  def regex(self) -> str:
    raise NotImplementedError

  def _text(self) -> tuple[str, str]:
    """(kind, text) the compiler takes: ("regex", the regex)."""
    return "regex", self.regex()

  def describe(self) -> str:
    """The constraint as messages name it."""
    kind, text = self._text()
    name = "JSON schema" if kind == "schema" else "constraint"
    where = f" from {self.source}" if self.source else ""
    return f"the {name}{where} {tables_lib._short(text)}"

  def _check_limits(self) -> None:
    for name in ("max_table_mb", "time_limit_s", "max_compile_mb"):
      value = getattr(self, name)
      if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not value > 0
      ):
        raise ValueError(f"{name} must be a positive number, got {value!r}")

  def compile(
    self, vocabulary, *, stop_ids: Sequence[int], width: int
  ) -> lazy_lib.Lazy | tables_lib.Tables:
    """This constraint for `vocabulary` (with `token_bytes()`) and a model
    whose logits have `width` columns: a `lazy.Lazy` (its DFA over bytes;
    masks walked as states are reached), or with `TABLES = "eager"` its
    eager `tables.Tables` (the plain twin); cached. Raises ValueError (see
    `lazy.compile`, `tables.compile_regex`)."""
    self._check_limits()
    kind, text = self._text()
    with self._named():
      return self._build(kind, text, vocabulary, stop_ids, width)

  def _build(self, kind, text, vocabulary, stop_ids, width, time_limit_s=None):
    limits = dict(
      stop_ids=stop_ids,
      width=width,
      max_table_mb=self.max_table_mb,
      time_limit_s=time_limit_s or self.time_limit_s,
      max_compile_mb=self.max_compile_mb,
      kind=kind,
      what=self.describe(),
    )
    if TABLES == "lazy":
      return lazy_lib.compile(
        text, vocabulary, fast_forward=self.fast_forward, **limits
      )
    if self.fast_forward:
      raise ValueError(
        "fast_forward=True needs lazy tables (tables_kind('lazy'), the "
        "default); the eager tables do not fast-forward"
      )
    vocab = tables_lib.cached_vocab(vocabulary, stop_ids, width)
    return tables_lib.compile_regex(text, vocab, **limits)

  def _named(self):
    """ValueErrors raised inside name `source` (when set)."""
    return untrusted.named(self.source) if self.source else nullcontext()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Regex(Constraint):
  """Text matching `pattern` in full (Rust regex syntax)."""

  pattern: str

  def __init__(self, pattern: str, **limits):
    if not isinstance(pattern, str):
      raise ValueError(f"Regex takes a pattern string, got {pattern!r}")
    object.__setattr__(self, "pattern", pattern)
    Constraint.__init__(self, **limits)

  def regex(self) -> str:
    return self.pattern


@dataclasses.dataclass(frozen=True, kw_only=True)
class Choice(Constraint):
  """Exactly one of `choices` (strings, matched literally)."""

  choices: tuple[str, ...]

  def __init__(self, choices: Sequence[str], **limits):
    if isinstance(choices, str) or not isinstance(choices, Sequence):
      raise ValueError(f"Choice takes a list of strings, got {choices!r}")
    choices = tuple(choices)
    if not choices or not all(isinstance(c, str) for c in choices):
      raise ValueError(
        f"Choice takes a non-empty list of strings, got {choices!r}"
      )
    object.__setattr__(self, "choices", choices)
    Constraint.__init__(self, **limits)

  def regex(self) -> str:
    return "(" + "|".join(escape(c) for c in self.choices) + ")"


# `JsonSchema(whitespace=...)`: the regex between JSON's tokens (None:
# outlines-core's default, `[ ]?`).
WHITESPACE = {"flexible": None, "compact": ""}


def check_whitespace(whitespace) -> None:
  """ValueError unless `whitespace` is a key of `WHITESPACE`."""
  if whitespace not in WHITESPACE:
    raise ValueError(
      f"whitespace must be one of {', '.join(map(repr, WHITESPACE))}, "
      f"got {whitespace!r}"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class JsonSchema(Constraint):
  """JSON text valid under `schema` (a dict or a JSON string).

  By default the schema is rewritten into what the token automaton
  enforces exactly (`schema_rewrite`: annotations dropped, bounded
  integers and more formats as exact regexes, `allOf` merged, ...); the
  keywords it cannot enforce are listed in `unenforced` and every output
  is to be checked with `validate`. With `strict=True` only the keywords
  in `schema.ALLOWED` are accepted, all enforced in full (others raise
  ValueError naming them).

  A `$ref` that refers back to itself is unrolled `max_recursion_depth`
  times (deeper values are not generated).

  `whitespace`: "flexible" (default: at most one space around each
  brace, bracket, colon and comma, outlines-core's `[ ]?`) or "compact"
  (none: `{"a":1,"b":[2,3]}`, every key and separator a forced run, which
  `fast_forward=True` appends without a forward pass each).

  The schema is untrusted: nesting deeper than `schema.MAX_DEPTH` is
  refused, and its regex is built in the compile worker under the
  constraint's limits (see `worker.py`).
  """

  schema: str  # canonical JSON
  strict: bool = False
  max_recursion_depth: int = 3
  whitespace: str = "flexible"

  def __init__(
    self,
    schema: str | Mapping,
    *,
    strict: bool = False,
    max_recursion_depth: int = 3,
    whitespace: str = "flexible",
    **limits,
  ):
    check_whitespace(whitespace)
    object.__setattr__(self, "whitespace", whitespace)
    depth = max_recursion_depth
    if (
      isinstance(depth, bool)
      or not isinstance(depth, int)
      or not 0 <= depth <= schema_lib.MAX_DEPTH
    ):
      raise ValueError(
        "max_recursion_depth must be an integer from 0 to "
        f"{schema_lib.MAX_DEPTH}, got {depth!r}"
      )
    source = limits.get("source")
    parsed = schema_lib.parse(schema, source=source)
    with untrusted.named(source) if source else nullcontext():
      schema_lib.check_meta(parsed)
      if strict:
        schema_lib.check(parsed)
      rewritten = None if strict else schema_rewrite.rewrite(parsed, depth)
    # Key order matters: properties are generated in the order given.
    object.__setattr__(self, "schema", json.dumps(parsed))
    object.__setattr__(self, "strict", bool(strict))
    object.__setattr__(self, "max_recursion_depth", depth)
    object.__setattr__(self, "_rewritten", rewritten)
    Constraint.__init__(self, **limits)

  def compile(
    self, vocabulary, *, stop_ids: Sequence[int], width: int
  ) -> tables_lib.Tables:
    """As `Constraint.compile`; a schema whose automaton runs past a limit
    (`time_limit_s`, `max_compile_mb`, `max_table_mb`) is compiled again
    narrowed, keeping the first `narrowing.NARROWER[i]` optional
    properties of each object (and one declared property required where
    none is), each try within half of `time_limit_s`; `narrowed` then says
    what was left out.
    Every output is still valid: fewer are possible. Not with
    `strict=True`."""
    self._check_limits()
    memo = (
      self.schema,
      self.strict,
      self.max_recursion_depth,
      self.whitespace,
      TABLES,
      lazy_lib.vocabulary_key(vocabulary, width),
      tuple(stop_ids),
      width,
      self.max_table_mb,
      self.time_limit_s,
      self.max_compile_mb,
    )
    written = self._check_budget(self.max_table_mb)
    # Strict schemas compile as written or not at all.
    last = 0 if self._rewritten is None else len(narrowing.NARROWER)
    first = narrowing.level(memo)
    if last and not first and budget.too_wide(written):
      first = 1
    first_error = None
    for level in range(first, last + 1):
      rewritten = (
        self._rewritten
        if not level
        else schema_rewrite.rewrite(
          json.loads(self.schema),
          self.max_recursion_depth,
          narrowing.NARROWER[level - 1],
        )
      )
      kind, text = self._text_of(rewritten)
      try:
        with self._named():
          tables = self._build(
            kind,
            text,
            vocabulary,
            stop_ids,
            width,
            time_limit_s=self.time_limit_s / (2 if level else 1),
          )
      except worker.LimitError as e:
        first_error = first_error or e
        continue
      narrowing.remember(memo, level)
      object.__setattr__(self, "_used", rewritten)
      return tables
    raise first_error

  def with_whitespace(self, whitespace: str) -> JsonSchema:
    """This schema written with `whitespace` ("flexible" or "compact"): a
    copy, nothing parsed or rewritten again."""
    check_whitespace(whitespace)
    return self._copy_with(whitespace=whitespace)

  def _check_budget(self, max_table_mb: float):
    """What cannot fit is refused before any compiling (`budget.check`;
    an object too wide to compile whole starts narrowed: `compile`).
    Returns the schema as compiled."""
    if self._rewritten is None:
      written = json.loads(self.schema)
    else:
      written = self._rewritten.schema
    with self._named():
      budget.check(written, max_table_mb=max_table_mb)
    return written

  @property
  def _active(self):
    """The rewrite in use: narrowed once `compile` had to, else the full
    one (None with `strict=True`)."""
    return getattr(self, "_used", None) or self._rewritten

  @property
  def unenforced(self) -> tuple[str, ...]:
    """ "path: keyword" of every keyword generation does not enforce (they
    are checked by `validate`); empty with `strict=True`."""
    return () if self._active is None else self._active.unenforced

  @property
  def narrowed(self) -> tuple[str, ...]:
    """ "path: what" of every place where generation produces fewer values
    than the schema allows (all of them valid): objects whose
    `minProperties` is met by always generating their first declared
    properties, and, once `compile` had to narrow the schema to stay
    within its limits, what that left out."""
    return () if self._active is None else self._active.narrowed

  def validate(self, text: str) -> schema_lib.Validation:
    """`text` checked against the original schema by a JSON Schema
    validator of the schema's own draft, formats asserted."""
    return schema_lib.validate(self.schema, text)

  @classmethod
  def from_file(cls, path: str, **limits) -> JsonSchema:
    """The schema in a JSON file (at most `schema.MAX_BYTES`); messages
    name the file."""
    text = untrusted.read_bytes(
      path, max_bytes=schema_lib.MAX_BYTES, what="JSON schema"
    )
    try:
      text = text.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}: not valid UTF-8 ({e.reason})") from None
    limits = {"source": str(path), **limits}
    with untrusted.named(limits["source"]):
      return cls(text, **limits)

  def _text(self) -> tuple[str, str]:
    return self._text_of(self._active)

  def _text_of(self, r) -> tuple[str, str]:
    schema = json.loads(self.schema) if r is None else r.schema
    pieces = {} if r is None else r.pieces
    flexible = self.whitespace == "flexible"
    if not pieces and self.max_recursion_depth == 3 and flexible:
      return "schema", self.schema if r is None else json.dumps(r.schema)
    payload = {
      "schema": schema,
      "pieces": pieces,
      "max_recursion_depth": self.max_recursion_depth,
    }
    if not flexible:
      payload["whitespace"] = WHITESPACE[self.whitespace]
    return "spliced_schema", json.dumps(payload)

  def regex(self) -> str:
    self._check_limits()
    with self._named():
      kind, text = self._text()
      return tables_lib.regex_of_schema(
        text,
        kind=kind,
        time_limit_s=self.time_limit_s,
        max_compile_mb=self.max_compile_mb,
        what=self.describe(),
      )
