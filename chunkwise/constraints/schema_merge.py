"""Local `$ref`s resolved and `allOf` merged, for `schema_rewrite`.

  target = resolve(root, {"$ref": "#/$defs/a"}, "#/properties/x")
  merged = merge(root, {"allOf": [A, B], ...}, "#")   # or ValueError

A merge is exact or refused: keys that are disjoint or equal are folded
into the parent; `properties` and `required` are unions; a property that
two branches describe differently is merged only where one lists its
values (`enum` / `const`) and the other can check them. Anything else is a
ValueError naming the keyword, and the caller decides what to do with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chunkwise.constraints.schema import ANNOTATIONS, MAX_DEPTH


def resolve(root: Mapping[str, Any], schema: Any, path: str) -> Any:
  """`schema` if it is anything but a local `$ref` ("#/..."), else what
  the reference (followed through chains of them) points to."""
  seen = 0
  while (
    isinstance(schema, Mapping)
    and set(schema) - ANNOTATIONS == {"$ref"}
    and isinstance(schema["$ref"], str)
    and schema["$ref"].startswith("#")
  ):
    seen += 1
    if seen > MAX_DEPTH:
      raise ValueError(f"{path}: $ref chains more than {MAX_DEPTH} deep")
    target: Any = root
    for part in schema["$ref"][1:].split("/")[1:]:
      part = part.replace("~1", "/").replace("~0", "~")
      if not isinstance(target, Mapping) or part not in target:
        raise ValueError(f"{path}: $ref {schema['$ref']!r} points nowhere")
      target = target[part]
    schema = target
  return schema


class NoValue(ValueError):
  """`allOf` branches no value satisfies together (types or values with
  nothing in common): a union's branch that is left out."""


def merge(
  root: Mapping[str, Any],
  schema: dict,
  path: str,
  known: frozenset,
  depth: int = 0,
  dropped: frozenset = frozenset(),
) -> dict:
  """`schema` with its `allOf` folded in where every key of every branch
  is disjoint from or equal to the others' (`properties` and `required`
  are unions). Keys outside `known` (annotations, unknown keywords) are
  dropped from the branches; of keys in `dropped` (ones the caller never
  generates, checked after against the original schema) the first
  branch's value is kept where branches differ."""
  if depth > MAX_DEPTH:
    raise ValueError(f"{path}: allOf nests more than {MAX_DEPTH} levels")
  parts = schema.pop("allOf")
  if not isinstance(parts, list):
    raise ValueError(f"{path}/allOf must be a list of schemas")
  merged = dict(schema)
  for i, part in enumerate(parts):
    where = f"{path}/allOf/{i}"
    part = resolve(root, part, where)
    if part is True:
      continue
    if not isinstance(part, Mapping):
      raise ValueError(f"{where}: a schema must be an object")
    if "allOf" in part:
      part = merge(root, dict(part), where, known, depth + 1, dropped)
    for key, value in part.items():
      if key not in known:
        continue
      if key == "properties" and key in merged:
        props = dict(merged[key])
        for name, sub in value.items():
          if name in props and props[name] != sub:
            # Both apply: merged where the property's own value is read.
            sub = conjoin(props[name], sub) or {"allOf": [props[name], sub]}
          props[name] = sub
        merged[key] = props
      elif key == "required" and key in merged:
        merged[key] = list(dict.fromkeys([*merged[key], *value]))
      elif key in merged and merged[key] != value and key in dropped:
        continue
      elif (
        key in merged and (both := meet(key, merged[key], value)) is not None
      ):
        merged[key] = both
      elif key in ("type", "enum") and key in merged and merged[key] != value:
        raise NoValue(
          f"{where}/{key}: no value is both {merged[key]!r} and {value!r}"
        )
      elif key in merged and merged[key] != value:
        raise ValueError(
          f"{where}/{key}: differs from another branch's "
          f"({merged[key]!r} vs {value!r}); allOf is merged only where the "
          "merge is exact"
        )
      else:
        merged[key] = value
  return merged


def conjoin(a: Any, b: Any) -> Any:
  """A schema exactly equal to `a` and `b` where one lists its values
  (`enum` / `const`) and the other has no `$ref`: the values the other
  accepts; else None."""
  import jsonschema

  for values, other in ((a, b), (b, a)):
    if not isinstance(values, Mapping) or "$ref" in str(other):
      continue
    if set(values) - ANNOTATIONS not in ({"enum"}, {"const"}):
      continue
    listed = values["enum"] if "enum" in values else [values["const"]]
    if not isinstance(listed, list):
      return None
    try:
      check = jsonschema.Draft202012Validator(other)
      kept = [v for v in listed if check.is_valid(v)]
    except jsonschema.exceptions.SchemaError:
      return None
    return {"enum": kept} if kept else None
  return None


_LOWER = ("minimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "maxLength", "maxItems", "maxProperties")


def _number(v: Any) -> bool:
  return isinstance(v, int | float) and not isinstance(v, bool)


def _same(a: Any, b: Any) -> bool:
  """JSON equality: true is not 1 (1.0 is)."""
  return a == b and isinstance(a, bool) == isinstance(b, bool)


def meet(key: str, a: Any, b: Any) -> Any:
  """One value of `key` exactly as strict as both `a` and `b`: the
  tighter bound, the types both allow (an integer is a number), the
  values both list; None where there is none (or no value satisfies
  both)."""
  if a == b:
    return a
  if key in _LOWER + _UPPER and _number(a) and _number(b):
    return max(a, b) if key in _LOWER else min(a, b)
  if key == "type":
    kinds = [k if isinstance(k, list) else [k] for k in (a, b)]
    both = [t for t in kinds[0] if t in kinds[1]]
    if "integer" in kinds[0] and "number" in kinds[1]:
      both.append("integer")
    if "number" in kinds[0] and "integer" in kinds[1]:
      both.append("integer")
    both = list(dict.fromkeys(both))
    return None if not both else both[0] if len(both) == 1 else both
  if key == "enum" and isinstance(a, list) and isinstance(b, list):
    both = [v for v in a if any(_same(v, w) for w in b)]
    return both or None
  return None
