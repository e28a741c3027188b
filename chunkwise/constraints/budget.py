"""What a schema's automaton must at least hold, read from the schema
before anything is compiled: counts that cannot fit are refused in
milliseconds, and objects too wide to compile whole start narrowed.

  budget.check(rewritten_schema, max_table_mb=256)  # ValueError or None
  budget.too_wide(rewritten_schema)                 # bool

A DFA needs a state per character a string must have and per item an
array must have: `minLength: 100000` is at least 800,000 states (a JSON
string's character takes ~10 states over UTF-8 bytes; 8 are counted),
800 MB of transitions at 1 KB a state, where compiling it took 52 s to
fail on its memory limit, and `minItems: 100000` 15 s. `floor` counts
the fewest states any value of a (rewritten, `$ref`-free) schema needs
(strings 8 a character past 2, arrays their items' floor plus one each,
objects their required properties', unions their cheapest branch); what
passes `max_table_mb` is refused, naming the keyword that needs it.

An object with many optional properties is written by outlines-core with
O(n^2) copies of them (optional integers: 128 in 0.9 s, 255 in 6.5 s,
1,000 ran 30 s into its limit before narrowing); from `WIDE` optional
properties on the schema starts at the first narrowing
(`JsonSchema.compile`), as it would after its limit.
"""

from __future__ import annotations

import json
from typing import Any

CHAR_STATES = 8  # at least, per character of a JSON string (measured ~10)
STATE_BYTES = 1024  # a state of a DFA over bytes: 256 int32 successors
WIDE = 128  # optional properties of one object from which it starts narrowed


def floor(schema: Any, path: str = "#") -> tuple[int, str]:
  """(the fewest DFA states a value of `schema` needs, the keyword's path
  that needs the most of them: "" when none stands out)."""
  if not isinstance(schema, dict):
    return 1, ""
  if "const" in schema:
    return len(json.dumps(schema["const"])) + 1, ""
  if isinstance(schema.get("enum"), list) and schema["enum"]:
    return min(len(json.dumps(v)) for v in schema["enum"]) + 1, ""
  for key in ("anyOf", "oneOf"):
    branches = schema.get(key)
    if isinstance(branches, list) and branches:
      return min(
        (floor(b, f"{path}/{key}/{i}") for i, b in enumerate(branches)),
        key=lambda f: f[0],
      )
  kind = schema.get("type")
  kinds = kind if isinstance(kind, list) else [kind]
  costs = [_floor_of(k, schema, path) for k in kinds]
  return min(costs, key=lambda f: f[0])


def _floor_of(kind, schema: dict, path: str) -> tuple[int, str]:
  if kind == "string":
    n = _count(schema.get("minLength"))
    return 2 + CHAR_STATES * n, f"{path}/minLength" if n else ""
  if kind == "array":
    n = _count(schema.get("minItems"))
    item, where = floor(schema.get("items", {}), f"{path}/items")
    return 2 + n * (item + 1), (where or f"{path}/minItems") if n else ""
  if kind == "object":
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}
    total, worst, most = 2, "", 0
    for name in schema.get("required", ()):
      if name in props:
        cost, where = floor(props[name], f"{path}/properties/{name}")
        total += len(name) + 3 + cost
        if cost > most:
          most, worst = cost, where
    return total, worst
  return 2, ""  # numbers, booleans, null, anything


def _count(value) -> int:
  return value if isinstance(value, int) and not isinstance(value, bool) else 0


def check(schema: Any, *, max_table_mb: float) -> None:
  """ValueError where a value of `schema` needs more states than
  `max_table_mb` holds (the module docstring)."""
  states, where = floor(schema)
  mb = states * STATE_BYTES / 2**20
  if mb > max_table_mb:
    where = where or "#"
    raise ValueError(
      f"{where}: a value of this schema needs at least {states:,} automaton "
      f"states ({mb:.0f} MB at 1 KB a state), over max_table_mb="
      f"{max_table_mb:g}; lower the count there or raise max_table_mb"
    )


def too_wide(schema: Any) -> bool:
  """Whether some object of `schema` has `WIDE` or more optional
  properties."""
  if isinstance(schema, list):
    return any(too_wide(v) for v in schema)
  if not isinstance(schema, dict):
    return False
  props = schema.get("properties")
  if isinstance(props, dict):
    required = set(schema.get("required", ()))
    if sum(name not in required for name in props) >= WIDE:
      return True
  return any(too_wide(v) for v in schema.values())
