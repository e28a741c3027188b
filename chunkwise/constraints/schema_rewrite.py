r"""A real-world JSON schema -> what the token automaton enforces, and what
is left to check after generation.

  out = rewrite(schema)
  out.schema       # for outlines-core's regex builder, placeholders in it
  out.pieces       # placeholder -> our regex of that JSON value
  out.unenforced   # ("#/properties/tags: uniqueItems", ...) checked after

outlines-core builds exact regexes for a subset of JSON Schema (see
`schema.ALLOWED`). This pass keeps that subset as it is (so a schema it
accepted before compiles to the same regex) and rewrites the rest:

* annotations, draft-4 `id`, `x-...` keys and keywords JSON Schema does
  not define are dropped (validators ignore them too), as are formats
  nobody asserts (unknown or empty);
* integers with `minimum` / `maximum` / `exclusive*` (both drafts'
  spellings) become exact digit automata, and the formats date, time,
  date-time, uri, uri-reference, ipv4, ipv6, hostname and duration our
  regexes (`json_regex`; outlines-core's date took any Unicode digit and
  its times no offset, so outputs could fail the format): each
  replaces the value's subschema by a const placeholder, spliced back into
  outlines-core's regex by the compile worker;
* objects generate their declared properties: `additionalProperties`
  true / absent / a schema allows what they generate, and required names
  missing from `properties` are generated from `additionalProperties`
  (any JSON value where it is absent); `allOf` is merged where the merge
  is exact (disjoint keys, or equal values); `oneOf` becomes `anyOf`; draft-4
  tuple `items` become `prefixItems`; a `pattern` that repeats one
  character (class) takes `minLength` / `maxLength` into its count;
  patterns read `\d`, `\w` as ASCII (as ECMA-262 does) and `\s` as a
  space, and their `.` and negated classes skip what JSON strings escape
  (`json_regex.string_pattern`); a value without a type generates the type
  its keywords apply to, and a value that may be anything (a property,
  item or object value without constraints, an object without properties,
  an array without items) generates any JSON value one level deep
  (scalars, arrays and objects of scalars);
* what a regex cannot say exactly, or only at a cost out of proportion,
  is dropped and listed in `unenforced` (`oneOf`'s exclusivity, `not`,
  `if`/`then`/`else`, `uniqueItems`, `maxLength` / `maxItems` of 100 or
  more (`LONG_BOUND`: a state per character, copied per optional
  property, for a bound outputs rarely reach), `contains`, `multipleOf`,
  number bounds, `patternProperties`, `propertyNames`, `dependencies`,
  `min/maxProperties`, string lengths
  beside any other `pattern` or a format, patterns with lookarounds or
  back-references, ...): every output is validated after
  generation (`JsonSchema.validate`), so nothing invalid goes unflagged.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from chunkwise.constraints import json_regex
from chunkwise.constraints.schema import ANNOTATIONS, MAX_DEPTH

# Keywords that hold no constraint (beyond schema.ANNOTATIONS).
_IGNORED = frozenset(
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
_AFTER = frozenset(
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
_KEPT = frozenset(
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
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Every keyword the rewrite reads (others are annotations or unknown).
_KNOWN = (
  _AFTER
  | _KEPT
  | frozenset(_BOUNDS)
  | frozenset(
    {
      *("properties", "$defs", "definitions", "anyOf", "oneOf", "allOf"),
      *("prefixItems", "items", "additionalProperties"),
    }
  )
)
# Keywords beside anyOf / oneOf that constrain its values.
_CONSTRAINING = (_KNOWN - {"anyOf", "oneOf", "$defs", "definitions"}) | {
  "allOf"
}
# Keywords that apply to values of one type only, as kept in the output.
_FAMILIES = {
  "string": frozenset({"pattern", "minLength", "maxLength", "format"}),
  "array": frozenset({"items", "prefixItems", "minItems", "maxItems"}),
  "object": frozenset({"properties", "required", "additionalProperties"}),
}
_FAMILY_KEYS = frozenset().union(*_FAMILIES.values())
# Keywords that decide a value's type themselves.
_TYPED = frozenset({"type", "enum", "const", "$ref", "anyOf"})
# Formats outlines-core builds itself, exactly.
_OUTLINES_FORMATS = frozenset({"uuid", "email"})
PLACEHOLDER = "CWPIECE{}QX"


@dataclasses.dataclass(frozen=True)
class Rewritten:
  schema: dict
  pieces: dict[str, str]
  unenforced: tuple[str, ...]


class _Rewriter:
  def __init__(self, root: Mapping[str, Any]):
    self.root = root
    self.pieces: dict[str, str] = {}
    self.unenforced: list[str] = []

  def resolve(self, schema: Any, path: str) -> Any:
    """A subschema that is only a local `$ref` ("#/..."), resolved (for
    merging `allOf`); anything else unchanged."""
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
      target: Any = self.root
      for part in schema["$ref"][1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, Mapping) or part not in target:
          raise ValueError(f"{path}: $ref {schema['$ref']!r} points nowhere")
        target = target[part]
      schema = target
    return schema

  def piece(self, regex: str) -> dict:
    name = PLACEHOLDER.format(len(self.pieces))
    self.pieces[name] = regex
    return {"const": name}

  def after(self, path: str, keyword: str) -> None:
    self.unenforced.append(f"{path}: {keyword}")

  def node(self, schema: Any, path: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
      raise ValueError(f"{path}: subschemas nest more than {MAX_DEPTH} levels")
    if schema is True:
      return {}
    if schema is False:
      raise ValueError(f"{path}: the schema false admits no value")
    if not isinstance(schema, Mapping):
      raise ValueError(f"{path}: a schema must be an object, got {schema!r}")
    schema = dict(schema)
    if "allOf" in schema:
      schema = self.merge(schema, path)
    union = [k for k in ("anyOf", "oneOf") if isinstance(schema.get(k), list)]
    if len(union) == 1 and _CONSTRAINING.intersection(schema):
      distributed = self.distribute(schema, union[0], path, depth)
      if distributed is not None:
        return distributed
    out: dict[str, Any] = {}
    for key, value in schema.items():
      where = f"{path}/{key}"
      if key in ANNOTATIONS or key in _IGNORED or key.startswith("x-"):
        continue
      if key == "additionalItems" and isinstance(schema.get("items"), list):
        continue  # with the tuple, below
      if key in _AFTER:
        self.after(path, key)
      elif key in ("properties", "$defs", "definitions"):
        if not isinstance(value, Mapping):
          raise ValueError(f"{where} must map names to schemas")
        # A property whose schema is false must be absent: not generated
        # (required() refuses it when it is required).
        out[key] = {
          name: self.definition(sub, f"{where}/{name}", depth + 1)
          if key != "properties"
          else _value(self.node(sub, f"{where}/{name}", depth + 1))
          for name, sub in value.items()
          if not (key == "properties" and sub is False)
        }
      elif key in ("anyOf", "oneOf", "prefixItems"):
        if not isinstance(value, list) or not value:
          raise ValueError(f"{where} must be a non-empty list of schemas")
        subs = [
          self.node(s, f"{where}/{i}", depth + 1) for i, s in enumerate(value)
        ]
        if key == "prefixItems":
          subs = [_value(sub) for sub in subs]
        if key == "oneOf":
          self.after(path, "oneOf (one branch only)")
          key = "anyOf"
        out[key] = out.get(key, []) + subs
      elif key == "items" and value is False:
        out["maxItems"] = 0
      elif key == "items":
        if isinstance(value, list):  # draft-4 tuple
          out["prefixItems"] = [
            _value(self.node(s, f"{where}/{i}", depth + 1))
            for i, s in enumerate(value)
          ]
          if schema.get("additionalItems") is False:
            limit = min(len(value), schema.get("maxItems", len(value)))
            out["maxItems"] = limit
          else:
            self.after(path, "items after the tuple")
        else:
          out["items"] = _value(self.node(value, where, depth + 1))
      elif key == "additionalProperties":
        if value is False:
          out[key] = False
        elif not schema.get("properties") and not schema.get(
          "patternProperties"
        ):  # the values of an object without declared properties
          out[key] = _value(self.node(value, where, depth + 1))
      elif key in _KEPT:
        out.setdefault(key, value)
      elif key in _BOUNDS:
        continue  # below
      # Keywords JSON Schema does not define: validators ignore them.
    return self.special(schema, out, path)

  def special(self, schema: dict, out: dict, path: str) -> dict:
    kind = schema.get("type")
    bounds = {k: schema[k] for k in _BOUNDS if k in schema}
    if kind is None and not _TYPED.intersection(out):
      # outlines-core reads these keywords only beside a type; they apply
      # only to values of their type, so generating that type is exact.
      kinds = [k for k, keys in _FAMILIES.items() if keys.intersection(out)]
      if len(kinds) == 1:
        kind = out["type"] = kinds[0]
      elif kinds:
        return self.by_type(schema, out, path, kinds)
    if isinstance(kind, str):
      # Keywords of another type's family do not apply to this one.
      for other, keys in _FAMILIES.items():
        if other != kind:
          for key in keys.intersection(out):
            del out[key]
    if isinstance(kind, list) and (
      ("integer" in kind and bounds)
      or ("string" in kind and out.get("format") in json_regex.FORMATS)
    ):
      # Our pieces stand for one type: one branch per type.
      return self.by_type(schema, out, path, kind)
    if (
      kind == "integer" and bounds and "enum" not in out and "const" not in out
    ):
      lo, hi = _integer_bounds(schema, path)
      return self.piece(json_regex.integer_range(lo, hi))
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
    if fmt is not None and fmt not in _OUTLINES_FORMATS:
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
    if "pattern" in out and _NOT_REGULAR.search(str(out["pattern"])):
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
      both = _repeat_with_lengths(out["pattern"], *lengths)
      if both is None:
        self.after(path, "minLength/maxLength with pattern")
      else:
        out["pattern"] = both
    if "properties" in out or "required" in out:
      self.required(schema, out, path)
    elif out.get("type") == "object" and "additionalProperties" not in out:
      out["additionalProperties"] = copy.deepcopy(_ANY)
    elif out.get("additionalProperties") is False:
      out["properties"] = {}  # the empty object (outlines-core reads false
      # as a schema for the values where no properties are declared)
    if out.get("type") == "array" and not {"items", "prefixItems"} & set(out):
      out["items"] = copy.deepcopy(_ANY)
    return out

  def by_type(self, schema: dict, out: dict, path: str, kinds) -> dict:
    """`anyOf` of one branch per type in `kinds`, each with the keywords
    that apply to its type."""
    branches = []
    for kind in kinds:
      own = _FAMILIES.get(kind, frozenset())
      part = {k: v for k, v in out.items() if k in own or k not in _FAMILY_KEYS}
      part["type"] = kind
      sub = {**schema, "type": kind}
      if kind not in ("integer", "number"):  # bounds apply to numbers only
        sub = {k: v for k, v in sub.items() if k not in _BOUNDS}
      branches.append(self.special(sub, part, path))
    return {"anyOf": branches}

  def required(self, schema: dict, out: dict, path: str) -> None:
    required = out.get("required") or []
    if not isinstance(required, list):
      raise ValueError(f"{path}/required must be a list of names")
    props = out.setdefault("properties", {})
    extra = schema.get("additionalProperties", True)
    for name in required:
      if not isinstance(name, str):
        raise ValueError(f"{path}/required lists {name!r}, not a name")
      if name in props:
        continue
      matching = [
        sub
        for pattern, sub in (schema.get("patternProperties") or {}).items()
        if isinstance(pattern, str) and _search(pattern, name)
      ]
      if matching:
        props[name] = _value(
          self.node(matching[0], f"{path}/patternProperties", 1)
        )
        continue
      if extra is False or (schema.get("properties") or {}).get(name) is False:
        raise ValueError(
          f"{path}: required property {name!r} is neither in properties nor "
          "allowed by additionalProperties=false: no value is valid"
        )
      props[name] = _value(
        self.node(extra, f"{path}/additionalProperties", 1)
        if isinstance(extra, Mapping)
        else {}
      )

  def distribute(self, schema: dict, key: str, path: str, depth: int):
    """`{properties: P, oneOf: [A, B]}` as `anyOf: [P and A, P and B]`,
    each branch merged as `allOf` is (so each branch's values meet the
    keywords beside the union too); None, with nothing recorded, where a
    branch does not merge exactly (the union is then generated beside
    them, as outlines-core reads it, and checked after)."""
    beside = {
      k: v for k, v in schema.items() if k not in (key, "$defs", "definitions")
    }
    saved = (len(self.unenforced), dict(self.pieces))
    try:
      out = self.node(
        {
          **{k: schema[k] for k in ("$defs", "definitions") if k in schema},
          "anyOf": [{"allOf": [beside, branch]} for branch in schema[key]],
        },
        path,
        depth,
      )
    except ValueError:
      del self.unenforced[saved[0] :]
      self.pieces = saved[1]
      return None
    if key == "oneOf":
      self.after(path, "oneOf (one branch only)")
    return out

  def definition(self, schema: Any, path: str, depth: int) -> Any:
    """A `$defs` entry rewritten; one that cannot be (no value satisfies
    it, or an allOf that does not merge) is generated as any value (and
    listed) instead of refusing the schema, since nothing may refer to it:
    where something does, its outputs are flagged after."""
    try:
      return self.node(schema, path, depth)
    except ValueError as e:
      self.after(path, f"generated as any value ({e})")
      return copy.deepcopy(_ANY)

  def merge(self, schema: dict, path: str) -> dict:
    """`allOf` folded into its parent where every key is disjoint or equal
    (properties and required are unions)."""
    parts = schema.pop("allOf")
    if not isinstance(parts, list):
      raise ValueError(f"{path}/allOf must be a list of schemas")
    merged = dict(schema)
    for i, part in enumerate(parts):
      part = self.resolve(part, f"{path}/allOf/{i}")
      if part is True:
        continue
      if not isinstance(part, Mapping):
        raise ValueError(f"{path}/allOf/{i}: a schema must be an object")
      if "allOf" in part:
        part = self.merge(dict(part), f"{path}/allOf/{i}")
      for key, value in part.items():
        if key not in _KNOWN or key in _IGNORED:
          continue  # annotations, x- and unknown keys: dropped below
        if key == "properties" and key in merged:
          props = dict(merged[key])
          for name, sub in value.items():
            if name in props and props[name] != sub:
              both = _conjoin(props[name], sub)
              if both is None:
                raise ValueError(
                  f"{path}/allOf/{i}/properties/{name}: differs from another "
                  "branch's; allOf is merged only where the merge is exact"
                )
              sub = both
            props[name] = sub
          merged[key] = props
        elif key == "required" and key in merged:
          merged[key] = list(dict.fromkeys([*merged[key], *value]))
        elif key in merged and merged[key] != value:
          raise ValueError(
            f"{path}/allOf/{i}/{key}: differs from another branch's "
            f"({merged[key]!r} vs {value!r}); allOf is merged only where the "
            "merge is exact"
          )
        else:
          merged[key] = value
    return merged


# Any JSON value, as a property's or tuple item's schema, one level deep
# (scalars, or arrays and objects of scalars): outlines-core writes `{}`
# there as an alternation without parentheses, so an object's regex matched
# `{"a": true` or a bare `null` and not `{"a": 1}`; and its nested any-value
# regex is 19x larger, copied once per optional property.
_SCALARS = {
  "anyOf": [{"type": t} for t in ("string", "number", "boolean", "null")]
}
_ANY = {
  "anyOf": [
    *_SCALARS["anyOf"],
    {"type": "array", "items": _SCALARS},
    {"type": "object", "additionalProperties": _SCALARS},
  ]
}


def _value(schema: Any) -> Any:
  return copy.deepcopy(_ANY) if schema == {} else schema


_NOT_REGULAR = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<")
# One character (class) repeated: ^[a-z0-9_-]+$, \d{3,}, .*, x{2}, ...
_REPEAT = re.compile(
  r"\^?(?P<atom>\[(?:\\.|[^\]\\\[])+\]|\\[dwsDWS]|\.|[^\\\[\](){}|*+?.^$])"
  r"(?P<count>[*+?]|\{(?P<lo>\d+)(?P<comma>,(?P<hi>\d*))?\})?\$?"
)


def _repeat_with_lengths(pattern: str, lo: int | None, hi: int | None):
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


def _conjoin(a: Any, b: Any) -> Any:
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


def _search(pattern: str, name: str) -> bool:
  """Whether ECMA-262 `pattern` matches somewhere in `name` (Python's re
  for the common subset; a pattern it cannot read matches nothing)."""
  try:
    return re.search(pattern, name) is not None
  except re.error:
    return False


def _integer_bounds(schema: dict, path: str) -> tuple[int | None, int | None]:
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


def rewrite(schema: Mapping[str, Any]) -> Rewritten:
  """`schema` (parsed) as outlines-core builds it, our regex pieces, and
  the keywords checked only after generation; ValueError names what no
  generation could satisfy or what cannot be merged."""
  r = _Rewriter(schema)
  out = r.node(schema, "#", 0)
  return Rewritten(out, r.pieces, tuple(dict.fromkeys(r.unenforced)))
