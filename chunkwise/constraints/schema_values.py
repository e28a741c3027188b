r"""The keywords of one JSON value, as outlines-core or our regex pieces
build them (used by `schema_rewrite`, which walks the whole schema).

  class _Rewriter(ValueKeywords): ...   # special(), by_type()
  AFTER, KEPT, KNOWN, FAMILIES          # which keyword goes where

* integers with `minimum` / `maximum` / `exclusive*` (both drafts'
  spellings), or a `multipleOf` whose last digits decide (2, 5, 10, 25,
  100, ...), and numbers between whole `minimum` / `maximum` become exact
  digit automata, and the formats date, time,
  date-time, uri, uri-reference, ipv4, ipv6, hostname and duration our
  regexes (`json_regex`; outlines-core's date took any Unicode digit and
  its times no offset, so outputs could fail the format): each replaces
  the value's subschema by a const placeholder, spliced back into
  outlines-core's regex by the compile worker;
* a `pattern` that repeats one character (class) takes `minLength` /
  `maxLength` into its count; patterns read `\d`, `\w` as ASCII (as
  ECMA-262 does) and `\s` as a space, and their `.` and negated classes
  skip what JSON strings escape (`json_regex.string_pattern`);
* a value without a type generates the type its keywords apply to (one
  branch per type where several apply), keywords of another type's
  family are dropped, and a value that may be anything generates any JSON
  value one level deep (`ANY`: scalars, arrays and objects of scalars);
* other number bounds, `maxLength` / `maxItems` of `LONG_BOUND` or more, string
  lengths beside any other pattern or a format, and patterns with
  lookarounds or back-references are left to the check after generation.
"""

from __future__ import annotations

import copy
from typing import Any

from chunkwise.constraints import json_regex

# Keywords that hold no constraint (beyond schema.ANNOTATIONS).
IGNORED = frozenset(
  {
    "id",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$anchor",
    "$dynamicAnchor",
    "$vocabulary",
    "contentMediaType",
    "contentEncoding",
    "contentSchema",
  }
)
# Dropped here and checked after generation.
AFTER = frozenset(
  {
    "not",
    "if",
    "then",
    "else",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "multipleOf",
    "patternProperties",
    "propertyNames",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "minProperties",
    "maxProperties",
    "additionalItems",
    "unevaluatedItems",
    "unevaluatedProperties",
  }
)
# Of those, the ones never generated at all (read nowhere else).
DROPPED = AFTER - {
  "multipleOf",
  "patternProperties",
  "minProperties",
  "additionalItems",
}
KEPT = frozenset(
  {
    "type",
    "enum",
    "const",
    "required",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "$ref",
  }
)
# maxLength / maxItems from which the bound is checked after generation.
LONG_BOUND = 100
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Every keyword the rewrite reads (others are annotations or unknown).
KNOWN = (
  AFTER
  | KEPT
  | frozenset(BOUNDS)
  | frozenset(
    {
      *("properties", "$defs", "definitions", "anyOf", "oneOf", "allOf"),
      *("prefixItems", "items", "additionalProperties"),
    }
  )
)
# Keywords an allOf branch contributes to the merge.
MERGED = KNOWN

# Keywords beside anyOf / oneOf that constrain its values.
CONSTRAINING = (KNOWN - {"anyOf", "oneOf", "$defs", "definitions"}) | {"allOf"}
# Keywords that apply to values of one type only, as kept in the output.
FAMILIES = {
  "string": frozenset({"pattern", "minLength", "maxLength", "format"}),
  "array": frozenset({"items", "prefixItems", "minItems", "maxItems"}),
  "object": frozenset({"properties", "required", "additionalProperties"}),
}
FAMILY_KEYS = frozenset().union(*FAMILIES.values())
# Keywords that decide a value's type themselves.
TYPED = frozenset({"type", "enum", "const", "$ref", "anyOf"})
# Formats outlines-core builds itself, exactly.
OUTLINES_FORMATS = frozenset({"uuid", "email"})
PLACEHOLDER = "CWPIECE{}QX"


class ValueKeywords:
  """`special` and `by_type`, for a rewriter that has `piece(regex)`,
  `after(path, keyword)` and `required(schema, out, path)`."""

  def special(self, schema: dict, out: dict, path: str) -> dict:
    kind = schema.get("type")
    bounds = {k: schema[k] for k in BOUNDS if k in schema}
    if kind is None and not TYPED.intersection(out):
      # outlines-core reads these keywords only beside a type; they apply
      # only to values of their type, so generating that type is exact.
      kinds = [k for k, keys in FAMILIES.items() if keys.intersection(out)]
      if len(kinds) == 1:
        kind = out["type"] = kinds[0]
      elif kinds:
        return self.by_type(schema, out, path, kinds)
    if isinstance(kind, str):
      # Keywords of another type's family do not apply to this one.
      for other, keys in FAMILIES.items():
        if other != kind:
          for key in keys.intersection(out):
            del out[key]
    if isinstance(kind, list) and (
      ({"integer", "number"} & set(kind) and bounds)
      or ("string" in kind and out.get("format") in json_regex.FORMATS)
    ):
      # Our pieces stand for one type: one branch per type.
      return self.by_type(schema, out, path, kind)
    if (
      kind == "integer" and bounds and "enum" not in out and "const" not in out
    ):
      lo, hi = json_regex.integer_bounds(schema, path)
      return self.piece(json_regex.integer_range(lo, hi))
    step = schema.get("multipleOf")
    if (
      kind == "integer"
      and type(step) is int
      and step >= 1
      and not bounds
      and not {"enum", "const"} & set(out)
      and json_regex.integer_multiple(step) is not None
    ):
      self.checked(f"{path}: multipleOf")
      return self.piece(json_regex.integer_multiple(step))
    whole = [v for v in bounds.values() if _whole(v)]
    if (
      kind == "number"
      and bounds
      and set(bounds) <= {"minimum", "maximum"}
      and len(whole) == len(bounds)
      and not {"enum", "const"} & set(out)
    ):
      lo, hi = (bounds.get(k) for k in ("minimum", "maximum"))
      lo, hi = (None if v is None else int(v) for v in (lo, hi))
      return self.piece(json_regex.number_range(lo, hi))
    if bounds:
      self.after(path, "/".join(bounds))
    for key in ("maxLength", "maxItems"):
      # One automaton state per character or item, copied per optional
      # property: a sanity bound this long is checked after instead.
      if isinstance(out.get(key), int) and out[key] >= LONG_BOUND:
        self.after(path, f"{key} {out.pop(key)} (long: checked after)")
    fmt = out.get("format")
    if fmt is not None and not isinstance(fmt, str):
      raise ValueError(f"{path}/format must be a string, got {fmt!r}")
    if fmt is not None and fmt not in OUTLINES_FORMATS:
      del out["format"]
      if fmt in json_regex.FORMATS and kind in ("string", None):
        for k in ("minLength", "maxLength", "pattern"):
          if k in out:
            self.after(path, f"{k} with format {fmt}")
        return self.piece(json_regex.FORMATS[fmt])
    elif fmt is not None:
      for k in ("minLength", "maxLength", "pattern"):
        if k in out:
          self.after(path, f"{k} with format {fmt}")
          del out[k]
    if "pattern" in out and json_regex.NOT_REGULAR.search(str(out["pattern"])):
      # Lookarounds and back-references: no automaton says them.
      self.after(path, "pattern (lookaround or back-reference)")
      del out["pattern"]
    if "pattern" in out:
      # ASCII shorthands; `.` and negated classes kept inside JSON strings.
      out["pattern"] = (
        json_regex.string_pattern(out["pattern"]) or out["pattern"]
      )
    if "pattern" in out and ("minLength" in out or "maxLength" in out):
      lengths = (out.pop("minLength", None), out.pop("maxLength", None))
      both = json_regex.repeat_with_lengths(out["pattern"], *lengths)
      if both is None:
        self.after(path, "minLength/maxLength with pattern")
      else:
        out["pattern"] = both
    if "properties" in out or "required" in out:
      self.required(schema, out, path)
    elif out.get("type") == "object" and "additionalProperties" not in out:
      out["additionalProperties"] = copy.deepcopy(ANY)
    elif out.get("additionalProperties") is False:
      out["properties"] = {}  # the empty object (outlines-core reads false
      # as a schema for the values where no properties are declared)
    if (
      out.get("type") == "object"
      and "properties" not in out
      and schema.get("minProperties") == 1
    ):
      self.one_property(out, path)  # schema_objects
    if out.get("type") == "array" and not {"items", "prefixItems"} & set(out):
      out["items"] = copy.deepcopy(ANY)
    return out

  def by_type(self, schema: dict, out: dict, path: str, kinds) -> dict:
    """`anyOf` of one branch per type in `kinds`, each with the keywords
    that apply to its type."""
    branches = []
    for kind in kinds:
      own = FAMILIES.get(kind, frozenset())
      part = {k: v for k, v in out.items() if k in own or k not in FAMILY_KEYS}
      part["type"] = kind
      sub = {**schema, "type": kind}
      if kind not in ("integer", "number"):  # bounds apply to numbers only
        sub = {k: v for k, v in sub.items() if k not in BOUNDS}
      branches.append(self.special(sub, part, path))
    return {"anyOf": branches}


# Any JSON value, as a property's or tuple item's schema, one level deep
# (scalars, or arrays and objects of scalars): outlines-core writes `{}`
# there as an alternation without parentheses, so an object's regex matched
# `{"a": true` or a bare `null` and not `{"a": 1}`; and its nested any-value
# regex is 19x larger, copied once per optional property.
SCALARS = {
  "anyOf": [{"type": t} for t in ("string", "number", "boolean", "null")]
}
ANY = {
  "anyOf": [
    *SCALARS["anyOf"],
    {"type": "array", "items": SCALARS},
    {"type": "object", "additionalProperties": SCALARS},
  ]
}


def _whole(v: Any) -> bool:
  return type(v) is int or (type(v) is float and v.is_integer())


def value_schema(schema: Any) -> Any:
  return copy.deepcopy(ANY) if schema == {} else schema
