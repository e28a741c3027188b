r"""Regexes for JSON values that outlines-core's schema compiler cannot
build: bounded integers (exact digit automata) and string formats.

  integer_range(-5, 120)   # -[1-5]|[0-9]|[1-9][0-9]|1[01][0-9]|120
  integer_range(10, None)  # every integer >= 10
  integer_bounds(schema, path)           # (lo, hi) of minimum, maximum, ...
  FORMATS["ipv4"]          # a quoted JSON string of that format
  string_pattern(r"^\w+$")               # a pattern kept inside JSON strings
  repeat_with_lengths("^[a-z]+$", 2, 8)  # "^[a-z]{2,8}$"

Integers are spelled as JSON spells them (no leading zeros, "-0" never
generated); Rust regex syntax, as `Regex` constraints take.
"""

from __future__ import annotations

import math
import re


def _digits_between(lo: str, hi: str) -> list[str]:
  """Regexes for the decimal strings of one length between lo and hi
  (inclusive, same length, no sign)."""
  if lo == hi:
    return [lo]
  if len(lo) == 1:
    return [f"[{lo}-{hi}]"]
  if set(lo) == {"0"} and set(hi) == {"9"}:
    # Every string of this length (recursing would double per digit).
    return [f"[0-9]{{{len(lo)}}}"]
  # Common leading digit: recurse on the rest.
  if lo[0] == hi[0]:
    return [lo[0] + r for r in _alternation(_digits_between(lo[1:], hi[1:]))]
  out = []
  rest = len(lo) - 1
  # lo[0] followed by anything >= lo[1:].
  out += [lo[0] + r for r in _alternation(_digits_between(lo[1:], "9" * rest))]
  # Whole middle digits.
  first, last = int(lo[0]) + 1, int(hi[0]) - 1
  if first <= last:
    middle = f"{first}" if first == last else f"[{first}-{last}]"
    out.append(middle + f"[0-9]{{{rest}}}" if rest > 1 else middle + "[0-9]")
  # hi[0] followed by anything <= hi[1:].
  out += [hi[0] + r for r in _alternation(_digits_between("0" * rest, hi[1:]))]
  return out


def _alternation(parts: list[str]) -> list[str]:
  """`parts` as one group when there are several (so a prefix applies to
  all of them)."""
  return parts if len(parts) == 1 else ["(" + "|".join(parts) + ")"]


def _naturals(lo: int, hi: int | None) -> list[str]:
  """Regexes of the naturals in [lo, hi] (hi None: unbounded), lo >= 0."""
  out = []
  if lo == 0:
    out.append("0")
    lo = 1
  if hi is not None and lo > hi:
    return out
  length = len(str(lo))
  while hi is None or length <= len(str(hi)):
    top = "9" * length if hi is None or length < len(str(hi)) else str(hi)
    bottom = str(lo) if length == len(str(lo)) else "1" + "0" * (length - 1)
    out += _digits_between(bottom, top)
    if hi is None:
      # Every longer number.
      out.append(f"[1-9][0-9]{{{length},}}")
      break
    length += 1
  return out


def integer_range(lo: int | None, hi: int | None) -> str:
  """A regex of the integers in [lo, hi] as JSON writes them (None: no
  bound on that side). Raises ValueError for an empty range."""
  if lo is not None and hi is not None and lo > hi:
    raise ValueError(f"no integer lies in [{lo}, {hi}]")
  parts = []
  # Negative numbers: -n for n in [max(1, -hi), -lo].
  if lo is None or lo < 0:
    small = 1 if hi is None or hi >= 0 else -hi
    big = None if lo is None else -lo
    parts += ["-" + p for p in _alternation(_naturals(small, big))]
  if hi is None or hi >= 0:
    parts += _naturals(0 if lo is None else max(lo, 0), hi)
  return "(" + "|".join(parts) + ")"


def number_range(lo: int | None, hi: int | None) -> str:
  """A regex of the JSON numbers in [lo, hi] (whole bounds; None: none on
  that side), written without an exponent. Raises ValueError for an
  empty range."""
  if lo is not None and hi is not None and lo > hi:
    raise ValueError(f"no number lies in [{lo}, {hi}]")
  frac, zeros = r"(\.[0-9]+)?", r"(\.0+)?"

  def magnitudes(least: int, most: int | None) -> list[str]:
    # |x| from `least` (any fraction) up to `most` (whole only at it)
    if most is None:
      return [integer_range(least, None) + frac]
    out = [integer_range(least, most - 1) + frac] if least < most else []
    return [*out, str(most) + zeros]

  parts = []
  if hi is None or hi >= 0:
    parts += magnitudes(0 if lo is None else max(lo, 0), hi)
  if lo is None or lo < 0:  # -|x|, with |x| in [max(-hi, 0), -lo]
    least = 0 if hi is None or hi >= 0 else -hi
    parts += ["-" + p for p in magnitudes(least, None if lo is None else -lo)]
  return "(" + "|".join(parts) + ")"


def integer_multiple(k: int) -> str | None:
  """A regex of the integers that are multiples of `k` (at least 1) as
  JSON writes them, where the last m <= 3 digits decide (k divides 10^m:
  2, 4, 5, 8, 10, 25, 100, ...); None for other k."""
  m = next((m for m in range(4) if 10**m % k == 0), None)
  if m is None:
    return None
  if m == 0:
    return "(-?(0|[1-9][0-9]*))"
  below = [str(v) for v in range(k, 10**m, k)]  # fewer than m + 1 digits
  tails = [f"{v:0{m}d}" for v in range(0, 10**m, k)]
  return f"(-?(0|{'|'.join(below)}|[1-9][0-9]*({'|'.join(tails)})))"


_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_H16 = r"[0-9a-fA-F]{1,4}"
_IPV4 = rf"{_OCTET}(\.{_OCTET}){{3}}"
_LABEL = r"[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
# RFC 4291 text forms: 8 groups; or k groups, "::" (one or more zero
# groups), and at most 7 - k more; or the same ending in an IPv4 address in
# place of the last two groups.


def _groups(n: int) -> str:
  """Exactly n colon-separated groups ("" for none)."""
  return "" if n == 0 else rf"({_H16}:){{{n - 1}}}{_H16}"


def _at_most(n: int) -> str:
  """Up to n colon-separated groups."""
  return "" if n == 0 else rf"(({_H16}:){{0,{n - 1}}}{_H16})?"


_IPV6 = "|".join(
  [
    _groups(8),
    *(_groups(k) + "::" + _at_most(7 - k) for k in range(0, 8)),
    rf"({_H16}:){{6}}{_IPV4}",
    *(_groups(k) + rf"::({_H16}:){{0,{5 - k}}}{_IPV4}" for k in range(0, 6)),
  ]
)
_URI_CHAR = r"([A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})"
# RFC 3339 full-date: ASCII digits, each month's days (February to 28:
# the 29th only exists in leap years, which a short regex cannot tell).
_DATE = (
  r"[0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
  r"|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
)
# RFC 3339 full-time: the offset is required.
_TIME = (
  r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?"
  r"(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
)

# Formats outlines-core does not build, or builds inexactly (its date
# takes any Unicode digit, its times an optional offset, its uri non-ASCII
# characters), as quoted JSON strings. It builds uuid and email itself.
FORMATS = {
  "date": f'"{_DATE}"',
  "time": f'"{_TIME}"',
  "date-time": f'"{_DATE}T{_TIME}"',
  "uri": rf'"[a-zA-Z][a-zA-Z0-9+.\-]*:{_URI_CHAR}*"',
  "ipv4": rf'"{_IPV4}"',
  "ipv6": rf'"({_IPV6})"',
  "hostname": rf'"{_LABEL}(\.{_LABEL}){{0,126}}"',
  # ISO 8601 as RFC 3339's appendix: weeks alone, or date and/or time
  # parts, each with at least one component.
  "duration": (
    r'"P([0-9]+W|([0-9]+Y([0-9]+M)?([0-9]+D)?|[0-9]+M([0-9]+D)?|[0-9]+D)'
    r"(T([0-9]+H([0-9]+M)?([0-9]+S)?|[0-9]+M([0-9]+S)?|[0-9]+S))?"
    r'|T([0-9]+H([0-9]+M)?([0-9]+S)?|[0-9]+M([0-9]+S)?|[0-9]+S))"'
  ),
  "uri-reference": rf'"{_URI_CHAR}*"',
}


# Characters a JSON string holds only escaped (outlines-core's string body
# excludes the same), as the inside of a regex class.
_ESCAPED_IN_JSON = r'"\\\x00-\x1F\x7F-\x9F'
_CLASS_SHORTHANDS = {"d": "0-9", "w": "A-Za-z0-9_", "s": " "}
# \D, \W, \S as printable ASCII outside 0-9, the word characters and space
# (ASCII only, so the subset holds under Python's Unicode classes too).
_NEGATED_SHORTHANDS = {
  "D": r" !#-/:-\[\]-~",
  "W": r" !#-/:-@\[\]^`{-~",
  "S": r"!#-\[\]-~",
}
# Escapes that stand for the character itself in both dialects.
_LITERAL_ESCAPES = frozenset(".-^$*+?()[]{}|/")


def string_pattern(pattern: str) -> str | None:
  """An ECMA-262 `pattern` as a regex over the characters of a JSON string
  body, matching a subset of what `pattern` matches under ECMA-262 and
  under Python's `re` (the validator's): `\\d`, `\\w` are ASCII (a far
  smaller automaton than Unicode's), `\\s` is a space, `\\D`, `\\W`, `\\S`
  printable ASCII, and `.`, negated classes and class ranges never match a
  character JSON must escape (outlines-core put them in the string as is:
  `"a"b"` for `^a.b$`). None where a literal quote, backslash or control
  character, another escape or a nested class would need more: the caller
  keeps the pattern (checked after generation).
  """
  out = []
  i, n = 0, len(pattern)
  while i < n:
    c = pattern[i]
    if c == "\\":
      e = pattern[i + 1 : i + 2]
      if e in _CLASS_SHORTHANDS:
        out.append(f"[{_CLASS_SHORTHANDS[e]}]")
      elif e in _NEGATED_SHORTHANDS:
        out.append(f"[{_NEGATED_SHORTHANDS[e]}]")
      elif e and e in _LITERAL_ESCAPES:
        out.append(c + e)
      else:
        return None
      i += 2
    elif c == "[":
      end, body = _class(pattern, i)
      if body is None:
        return None
      out.append(body)
      i = end
    elif c == ".":  # line separators: ECMA-262's `.` skips them
      out.append(f"[^{_ESCAPED_IN_JSON}\u2028\u2029]")
      i += 1
    elif c == '"' or ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F:
      return None
    else:
      out.append(c)
      i += 1
  return _anchored("".join(out))


def _anchored(body: str) -> str:
  """`^body$`. A pattern anchored at one end only (`^X`: strings that
  start with X) is read as anchored at both (the strings X matches, a
  subset): its lone anchor, left inside the JSON string, matched nothing;
  one anchored at neither end was already read as a full match."""
  start = body.startswith("^")
  end = body.endswith("$") and not body.endswith("\\$")
  if start and end:
    return body
  if start:
    return body + "$"
  if end:
    return "^" + body
  return body


def _class(pattern: str, start: int) -> tuple[int, str | None]:
  """The class opening at `start`: (index after it, its translation or
  None). A positive class loses the characters JSON must escape."""
  i = start + 1
  negated = pattern[i : i + 1] == "^"
  i += negated
  if pattern[i : i + 1] == "]":
    return i, None  # ECMA-262's empty class
  shorthands: list[str] = []
  spans: list[list[int]] = []  # [lo, hi] code points
  # Whether the last member was one character (a `-` after it makes a
  # range; after a range or a shorthand it is itself: `[0-9-_]`).
  single = False
  while i < len(pattern) and pattern[i] != "]":
    c = pattern[i]
    if c == "[":
      return i, None  # nested classes: Rust syntax only
    if c == "\\":
      e = pattern[i + 1 : i + 2]
      if e in _CLASS_SHORTHANDS:
        shorthands.append(_CLASS_SHORTHANDS[e])
        single = False
        i += 2
        continue
      if not (e and e in _LITERAL_ESCAPES):
        return i, None
      c, i = e, i + 1
    if (
      c == "-"
      and single
      and pattern[i - 1 : i] != "\\"
      and i + 1 < len(pattern)
      and pattern[i + 1] != "]"
    ):
      hi = pattern[i + 1]
      if hi in "\\[":
        return i, None
      spans[-1][1] = ord(hi)
      single = False
      i += 2
      continue
    spans.append([ord(c), ord(c)])
    single = True
    i += 1
  if i >= len(pattern):
    return i, None  # unclosed
  if any(lo > hi for lo, hi in spans):
    return i, None
  if not negated:
    spans = [part for span in spans for part in _outside_escaped(*span)]
  body = "".join(shorthands) + "".join(
    _member(lo) if lo == hi else f"{_member(lo)}-{_member(hi)}"
    for lo, hi in spans
  )
  if negated:
    return i + 1, f"[^{body}{_ESCAPED_IN_JSON}]"
  return i + 1, f"[{body}]" if body else None


# Code points a JSON string holds only escaped.
_ESCAPED_SPANS = ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x9F))


def _outside_escaped(lo: int, hi: int) -> list[tuple[int, int]]:
  """lo..hi without the code points JSON must escape."""
  out = []
  for a, b in _ESCAPED_SPANS:
    if lo < a:
      out.append((lo, min(hi, a - 1)))
    lo = max(lo, b + 1)
    if lo > hi:
      return out
  return [*out, (lo, hi)]


def _member(code: int) -> str:
  c = chr(code)
  return "\\" + c if c in "]\\^-[" else c


NOT_REGULAR = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<")
# One character (class) repeated: ^[a-z0-9_-]+$, \d{3,}, .*, x{2}, ...
_REPEAT = re.compile(
  r"\^?(?P<atom>\[(?:\\.|[^\]\\\[])+\]|\\[dwsDWS]|\.|[^\\\[\](){}|*+?.^$])"
  r"(?P<count>[*+?]|\{(?P<lo>\d+)(?P<comma>,(?P<hi>\d*))?\})?\$?"
)


def repeat_with_lengths(pattern: str, lo: int | None, hi: int | None):
  """A pattern that repeats one character class, with its count narrowed
  to the string lengths (every string it matches satisfies both); None
  for any other pattern, or when no count satisfies both."""
  m = _REPEAT.fullmatch(pattern)
  if m is None:
    return None
  count = m["count"]
  if count is None:
    low, high = 1, 1
  elif count in "*+?":
    low, high = (1 if count == "+" else 0), (1 if count == "?" else None)
  else:
    low = int(m["lo"])
    high = None if m["comma"] and not m["hi"] else int(m["hi"] or m["lo"])
  anchored = pattern.startswith("^") and pattern.endswith("$")
  if not anchored and count is not None and count not in "*+":
    return None  # a search for a bounded run: longer strings match too
  low = max(low, lo or 0)
  high = hi if high is None else high if hi is None else min(high, hi)
  if high is not None and low > high:
    return None
  return f"^{m['atom']}{{{low},{'' if high is None else high}}}$"


def integer_bounds(schema: dict, path: str) -> tuple[int | None, int | None]:
  def number(key):
    value = schema[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
      raise ValueError(f"{path}/{key} must be a number, got {value!r}")
    if not math.isfinite(value):
      raise ValueError(f"{path}/{key} must be finite, got {value!r}")
    return value

  lo = hi = None
  if "minimum" in schema:
    m = number("minimum")
    lo = math.ceil(m)
    if schema.get("exclusiveMinimum") is True and m == lo:  # draft 4
      lo += 1
  if "maximum" in schema:
    m = number("maximum")
    hi = math.floor(m)
    if schema.get("exclusiveMaximum") is True and m == hi:
      hi -= 1
  for key in ("exclusiveMinimum", "exclusiveMaximum"):
    if isinstance(schema.get(key), bool) or key not in schema:
      continue
    e = number(key)
    if key == "exclusiveMinimum":
      lo = math.floor(e) + 1 if lo is None else max(lo, math.floor(e) + 1)
    else:
      hi = math.ceil(e) - 1 if hi is None else min(hi, math.ceil(e) - 1)
  if lo is not None and hi is not None and lo > hi:
    raise ValueError(f"{path}: no integer lies between its bounds")
  return lo, hi


def search(pattern: str, name: str) -> bool:
  """Whether ECMA-262 `pattern` matches somewhere in `name` (Python's re
  for the common subset; a pattern it cannot read matches nothing)."""
  try:
    return re.search(pattern, name) is not None
  except re.error:
    return False
