"""`oneOf` branches made exclusive, so generating them as `anyOf` is exact.

  branches = exclusive(branches)   # None where some pair may overlap

A `oneOf` value must be valid under exactly one branch; the automaton
generates a value of some branch (`anyOf`), which is exact when no value
it generates for one branch is also valid under another. For each pair of
rewritten branches (outlines-core's subset: what the rewrite generates)
that holds when:

* their types are disjoint (an integer is also a number);
* both are objects requiring a property whose `const` / `enum` values
  differ between them (a discriminator, as in tagged unions);
* both are objects and each requires a property the other does not: that
  property is then left out of the other branch's generated properties
  (generated objects hold only their declared properties), so each
  branch's values lack a property the other requires. Fewer values are
  generated, all of them valid.

Anything else (two string branches, say) may overlap: `exclusive` returns
None and the union stays checked after generation.
"""

from __future__ import annotations

import copy
from typing import Any

from chunkwise.constraints.schema_values import PLACEHOLDER

_PLACEHOLDER_PREFIX = PLACEHOLDER.split("{")[0]

_JSON_TYPES = {
  bool: "boolean",
  int: "integer",
  float: "number",
  str: "string",
  list: "array",
  dict: "object",
  type(None): "null",
}


def _types(schema: Any) -> frozenset[str] | None:
  """The JSON types a rewritten schema generates; None when unknown."""
  if not isinstance(schema, dict):
    return None
  if "anyOf" in schema:
    parts = [_types(s) for s in schema["anyOf"]]
    if any(p is None for p in parts):
      return None
    return frozenset().union(*parts)
  values = _values(schema)
  if values is not None:
    kinds = {_JSON_TYPES.get(type(v)) for v in values}
    return None if None in kinds else frozenset(kinds)
  kind = schema.get("type")
  if isinstance(kind, str):
    return frozenset({kind})
  if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
    return frozenset(kind)
  return None


def _values(schema: Any) -> list | None:
  """The values a `const` / `enum` schema allows; None for others (and for
  the rewrite's placeholders, whose values are a regex's)."""
  if not isinstance(schema, dict):
    return None
  if "const" in schema:
    value = schema["const"]
    if isinstance(value, str) and value.startswith(_PLACEHOLDER_PREFIX):
      return None
    return [value]
  if isinstance(schema.get("enum"), list):
    return list(schema["enum"])
  return None


def _disjoint_types(a: frozenset[str], b: frozenset[str]) -> bool:
  widen = {"integer": "number"}
  return not {widen.get(t, t) for t in a} & {widen.get(t, t) for t in b}


def _objects(a: dict, b: dict) -> bool:
  return all(
    s.get("type") == "object" and isinstance(s.get("properties"), dict)
    for s in (a, b)
  )


def _required(schema: dict) -> list[str]:
  return [n for n in schema.get("required") or [] if n in schema["properties"]]


def _discriminated(a: dict, b: dict) -> bool:
  for name in set(_required(a)) & set(_required(b)):
    va = _values(a["properties"][name])
    vb = _values(b["properties"][name])
    if va is not None and vb is not None and not any(v in vb for v in va):
      return True
  return False


def _apart(a: dict, b: dict) -> bool:
  """Whether no value `a` generates is valid under `b` or the reverse,
  leaving an optional property out of `a` and `b` (in place) where that
  makes it so."""
  ta, tb = _types(a), _types(b)
  if ta is not None and tb is not None and _disjoint_types(ta, tb):
    return True
  if not _objects(a, b):
    return False
  if _discriminated(a, b):
    return True
  only_a = [n for n in _required(a) if n not in _required(b)]
  only_b = [n for n in _required(b) if n not in _required(a)]
  if not only_a or not only_b:
    return False
  b["properties"].pop(only_a[0], None)
  a["properties"].pop(only_b[0], None)
  return True


def exclusive(branches: list) -> list | None:
  """`branches` (rewritten `oneOf` members) made pairwise exclusive, as
  copies; None where some pair may share a value."""
  out = copy.deepcopy(branches)
  for i in range(len(out)):
    for j in range(i + 1, len(out)):
      if not _apart(out[i], out[j]):
        return None
  return out
