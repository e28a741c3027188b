"""A regex with holes, each a constraint compiled alone: a tool call's
frame around its arguments (`serving.tools`).

  Framed(r"<call>" + Framed.hole("a0") + r"</call>", {"a0": JsonSchema(s)})

Lazily compiled, the frame's DFA takes each part's DFA in its hole
(`dfa_splice.frame`, in the compile worker); eagerly, the frame is the
regex with every part's regex written in place.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

from chunkwise.constraints import dfa_splice
from chunkwise.constraints import tables as tables_lib
from chunkwise.constraints.constraint import Constraint, JsonSchema


@dataclasses.dataclass(frozen=True, kw_only=True)
class Framed(Constraint):
  """A regex with holes, each filled by a constraint (a JSON schema): a
  tool call's frame around its arguments.

    Framed(r'<call>' + Framed.hole("a0") + r'</call>', {"a0": JsonSchema(s)})

  `regex()` is the pattern with each hole replaced by its part's regex.
  Compiled lazily, each part is compiled alone (a large schema from its
  own parts) and put in the frame's DFA in place of its hole
  (`dfa_splice`): the regex of a schema with many optional properties
  repeats them O(n^2) times, which a part's DFA does not."""

  pattern: str
  parts: tuple[tuple[str, Constraint], ...]

  def __init__(self, pattern: str, parts: Mapping[str, Constraint], **limits):
    if not isinstance(pattern, str):
      raise ValueError(f"Framed takes a pattern string, got {pattern!r}")
    parts = tuple(dict(parts).items())
    for name, part in parts:
      if not (isinstance(name, str) and name.isalnum() and name.isascii()):
        raise ValueError(
          f"a hole's name must be ASCII letters and digits, got {name!r}"
        )
      if not isinstance(part, Constraint):
        raise ValueError(f"part {name!r} must be a constraint, got {part!r}")
      if self.hole(name) not in pattern:
        raise ValueError(f"the pattern has no hole {name!r} (Framed.hole)")
    object.__setattr__(self, "pattern", pattern)
    object.__setattr__(self, "parts", parts)
    Constraint.__init__(self, **limits)

  @staticmethod
  def hole(name: str) -> str:
    """The regex that stands for part `name` in a pattern."""
    return dfa_splice.marker_regex(name)

  def regex(self) -> str:
    out = self.pattern
    for name, part in self.parts:
      out = out.replace(self.hole(name), "(" + part.regex() + ")")
    return out

  def _text(self) -> tuple[str, str]:
    parts = {name: part._text() for name, part in self.parts}
    return "framed", json.dumps({"regex": self.pattern, "parts": parts})

  def compile(self, vocabulary, *, stop_ids: Sequence[int], width: int):
    """As `Constraint.compile`, each schema part's counts checked first
    (`budget`)."""
    self._check_limits()
    for name, part in self.parts:
      if isinstance(part, JsonSchema):
        try:
          part._check_budget(self.max_table_mb)
        except ValueError as e:
          raise ValueError(f"part {name!r}: {e}") from None
    return Constraint.compile(self, vocabulary, stop_ids=stop_ids, width=width)

  def describe(self) -> str:
    where = f" from {self.source}" if self.source else ""
    short = tables_lib._short(self.pattern)
    return f"the constraint{where} {short} (with {len(self.parts)} parts)"
