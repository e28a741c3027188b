r"""A real-world JSON schema -> what the token automaton enforces, and what
is left to check after generation.

  out = rewrite(schema, max_recursion_depth=3)
  out.schema       # for outlines-core's regex builder, placeholders in it
  out.pieces       # placeholder -> our regex of that JSON value
  out.unenforced   # ("#/properties/tags: uniqueItems", ...) checked after
  rewrite(schema, keep=8).narrowed   # what a narrower try leaves out

outlines-core builds exact regexes for a subset of JSON Schema (see
`schema.ALLOWED`). This pass keeps that subset as it is (so a schema it
accepted before compiles to the same regex) and rewrites the rest. It
walks the schema; one value's keywords (types, strings, integers,
formats) are `schema_values`'s, `allOf` merging and `$ref` resolution
`schema_merge`'s.

* annotations, draft-4 `id`, `x-...` keys and keywords JSON Schema does
  not define are dropped (validators ignore them too);
* local `$ref`s are inlined, at most `max_recursion_depth` + 1 deep
  (outlines-core's rule, kept so a recursive schema or a deep chain of
  definitions stays a few levels deep): deeper values are not generated
  (optional properties and union branches are left out, arrays end),
  while a required value is (outlines-core dropped a required property
  whose value went too deep, and its object then matched only `{}`);
  definitions nothing refers to are not read;
* objects generate their declared properties: `additionalProperties`
  true / absent / a schema allows what they generate, and required names
  missing from `properties` are generated from `patternProperties` or
  `additionalProperties` (any JSON value where it is absent); `allOf` is
  merged where the merge is exact, and a union beside other keywords is
  generated as one branch per member merged with them; `oneOf` becomes
  `anyOf`, exact where its branches are made exclusive
  (`schema_exclusive`); draft-4 tuple `items` become `prefixItems`;
* what a regex cannot say exactly, or only at a cost out of proportion,
  is dropped and listed in `unenforced` (`oneOf`'s exclusivity where
  branches may overlap, `not`, `if`/`then`/`else`, `uniqueItems`,
  `contains`, `multipleOf`, `patternProperties`, `propertyNames`,
  `dependencies`, `min/maxProperties`, and the value keywords
  `schema_values` names):
  every output is validated after generation (`JsonSchema.validate`), so
  nothing invalid goes unflagged;
* with `keep` (`JsonSchema.compile`'s narrower tries, for schemas whose
  full automaton runs past a compile limit) objects generate only their
  first `keep` optional properties, and one declared property (as many as
  `minProperties` asks) is always generated where none is required;
  `narrowed` lists each place. Fewer outputs are possible; each is valid.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from chunkwise.constraints import schema_exclusive, schema_merge
from chunkwise.constraints import schema_values as sv
from chunkwise.constraints.schema import ANNOTATIONS, MAX_DEPTH
from chunkwise.constraints.schema_objects import ObjectKeywords

# Subschemas a rewrite may visit (its $refs inlined), so a schema whose
# references fan out is refused in a moment instead of after the compile
# limit.
MAX_NODES = 200_000


@dataclasses.dataclass(frozen=True)
class Rewritten:
  schema: dict
  pieces: dict[str, str]
  unenforced: tuple[str, ...]
  # "path: what" of each place where fewer values are generated than the
  # schema allows (every one of them valid), to keep the automaton small.
  narrowed: tuple[str, ...] = ()


class _Never(Exception):
  """No value of this subschema is generated: a `$ref` inside more than
  `max_recursion_depth` others being inlined. Absorbed where a value may
  be left out (an optional property, a union's branch, array items);
  anywhere else the parent cannot be generated either."""


class _Rewriter(sv.ValueKeywords, ObjectKeywords):
  def __init__(self, root: Mapping[str, Any], recursion: int, keep: int | None):
    self.root = root
    self.recursion = recursion
    self.keep = keep
    self.pieces: dict[str, str] = {}
    self.unenforced: list[str] = []
    self.narrowed: list[str] = []
    self.expanding: list[str] = []  # $refs being inlined, outermost first
    self.nodes = 0

  def piece(self, regex: str) -> dict:
    name = sv.PLACEHOLDER.format(len(self.pieces))
    self.pieces[name] = regex
    return {"const": name}

  def after(self, path: str, keyword: str) -> None:
    self.unenforced.append(f"{path}: {keyword}")

  def optional(self, make, *args):
    """`make(*args)`, or `_NEVER` (with nothing it recorded kept) where it
    raised `_Never`."""
    saved = len(self.unenforced), len(self.narrowed)
    try:
      return make(*args)
    except (_Never, schema_merge.NoValue):
      del self.unenforced[saved[0] :]
      del self.narrowed[saved[1] :]
      return _NEVER

  def value(self, schema: Any, path: str, depth: int) -> Any:
    """A property's, item's or object value's subschema rewritten."""
    return sv.value_schema(self.node(schema, path, depth))

  def node(self, schema: Any, path: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
      raise ValueError(f"{path}: subschemas nest more than {MAX_DEPTH} levels")
    self.nodes += 1
    if self.nodes > MAX_NODES:
      raise ValueError(
        f"{path}: the schema expands to more than {MAX_NODES} subschemas "
        "with its $refs inlined; lower max_recursion_depth or simplify it"
      )
    if schema is True:
      return {}
    if schema is False:
      raise ValueError(f"{path}: the schema false admits no value")
    if not isinstance(schema, Mapping):
      raise ValueError(f"{path}: a schema must be an object, got {schema!r}")
    schema = dict(schema)
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
      return self.reference(schema, path, depth)
    if "allOf" in schema:
      schema = schema_merge.merge(
        self.root, schema, path, sv.MERGED, dropped=sv.DROPPED
      )
    union = [k for k in ("anyOf", "oneOf") if isinstance(schema.get(k), list)]
    if len(union) == 1 and sv.CONSTRAINING.intersection(schema):
      distributed = self.distribute(schema, union[0], path, depth)
      if distributed is not None:
        return distributed
    out: dict[str, Any] = {}
    for key, value in schema.items():
      where = f"{path}/{key}"
      if key in ANNOTATIONS or key in sv.IGNORED or key.startswith("x-"):
        continue
      if key == "additionalItems" and isinstance(schema.get("items"), list):
        continue  # with the tuple, below
      if key in sv.AFTER:
        self.after(path, key)
        if key == "patternProperties" and _one_pattern(schema):
          # The values of an object whose keys one pattern describes:
          # generated from its schema, which makes every key valid (keys
          # it does not match are allowed by additionalProperties).
          (sub,) = value.values()
          try:
            extra = self.optional(self.value, sub, f"{where}/*", depth + 1)
          except ValueError:
            # Values it cannot generate (e.g. no value is valid): no keys,
            # which every pattern allows.
            extra = _NEVER
          out["additionalProperties"] = False if extra is _NEVER else extra
      elif key in ("$defs", "definitions"):
        continue  # read where a $ref inlines them
      elif key == "properties":
        if not isinstance(value, Mapping):
          raise ValueError(f"{where} must map names to schemas")
        required = schema.get("required")
        required = set(required) if isinstance(required, list) else set()
        props = {}
        for name, sub in value.items():
          # A property whose schema is false must be absent: not generated
          # (required() refuses it when it is required).
          if sub is False:
            continue
          args = (sub, f"{where}/{name}", depth + 1)
          sub = (
            self.value(*args)
            if name in required
            else self.optional(self.value, *args)
          )
          if sub is not _NEVER:
            props[name] = sub
        out[key] = props
      elif key in ("anyOf", "oneOf"):
        if not isinstance(value, list) or not value:
          raise ValueError(f"{where} must be a non-empty list of schemas")
        subs = [
          self.optional(self.node, s, f"{where}/{i}", depth + 1)
          for i, s in enumerate(value)
        ]
        subs = [sub for sub in subs if sub is not _NEVER]
        if not subs:
          raise _Never
        if key == "oneOf":
          subs = self.one_of(subs, path)
          key = "anyOf"
        out[key] = out.get(key, []) + subs
      elif key == "prefixItems" or (key == "items" and isinstance(value, list)):
        if not isinstance(value, list) or not value:
          raise ValueError(f"{where} must be a non-empty list of schemas")
        out["prefixItems"] = self.tuple(schema, value, where, depth, out)
        if key == "items":  # draft-4 tuple
          if schema.get("additionalItems") is False:
            limit = min(len(value), schema.get("maxItems", len(value)))
            out["maxItems"] = min(limit, out.get("maxItems", limit))
          else:
            self.after(path, "items after the tuple")
      elif key == "items" and value is False:
        out["maxItems"] = 0
      elif key == "items":
        items = self.optional(self.value, value, where, depth + 1)
        if items is _NEVER:  # no item at this depth: the empty array
          if schema.get("minItems", 0) > 0:
            raise _Never
          out["maxItems"] = 0
        else:
          out["items"] = items
      elif key == "additionalProperties":
        if value is False:
          out[key] = False
        elif not schema.get("properties") and not schema.get(
          "patternProperties"
        ):  # the values of an object without declared properties
          extra = self.optional(self.value, value, where, depth + 1)
          out[key] = False if extra is _NEVER else extra
      elif key in sv.KEPT:
        out.setdefault(key, value)
      elif key in sv.BOUNDS:
        continue  # below
      # Keywords JSON Schema does not define: validators ignore them.
    return self.special(schema, out, path)

  def distribute(self, schema: dict, key: str, path: str, depth: int):
    """`{properties: P, oneOf: [A, B]}` as `anyOf: [P and A, P and B]`,
    each branch merged as `allOf` is (so each branch's values meet the
    keywords beside the union too); None, with nothing recorded, where a
    branch does not merge exactly (the union is then generated beside
    them, as outlines-core reads it, and checked after)."""
    beside = {
      k: v for k, v in schema.items() if k not in (key, "$defs", "definitions")
    }
    saved = (len(self.unenforced), dict(self.pieces), len(self.narrowed))
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
      del self.narrowed[saved[2] :]
      return None
    if key == "oneOf" and isinstance(out, dict) and "anyOf" in out:
      out["anyOf"] = self.one_of(out["anyOf"], path)
    elif key == "oneOf":
      self.after(path, "oneOf (one branch only)")
    return out

  def one_of(self, branches: list, path: str) -> list:
    """`oneOf`'s branches made exclusive, or as they are, checked after."""
    apart = schema_exclusive.exclusive(branches)
    if apart is None:
      self.after(path, "oneOf (one branch only)")
    return branches if apart is None else apart

  def tuple(self, schema, items, where, depth, out) -> list:
    """Tuple items rewritten; where item i has no value at this depth,
    arrays end before it (maxItems i; none if minItems needs it)."""
    subs = []
    for i, s in enumerate(items):
      sub = self.optional(self.value, s, f"{where}/{i}", depth + 1)
      if sub is _NEVER:
        if schema.get("minItems", 0) > i:
          raise _Never
        out["maxItems"] = min(i, out.get("maxItems", i))
        break
      subs.append(sub)
    return subs

  def reference(self, schema: dict, path: str, depth: int) -> Any:
    """A local `$ref`, inlined (with keywords beside it merged in as
    `allOf` where that is exact, else left to the check after); one inside
    more than `recursion` others being inlined raises `_Never` (outlines-
    core's depth rule, which keeps a recursive schema's automaton, and a
    deep chain of definitions, to a few levels).
    A target that cannot be rewritten (no value satisfies it, an allOf
    that does not merge) is generated as any value and listed, so the
    outputs are flagged after, instead of refusing the schema."""
    ref = schema["$ref"]
    if len(self.expanding) > self.recursion:
      raise _Never
    target = schema_merge.resolve(self.root, {"$ref": ref}, path)
    beside = {
      k: v
      for k, v in schema.items()
      if k in sv.KNOWN and k not in ("$ref", "$defs", "definitions")
    }
    self.expanding.append(ref)
    try:
      if beside:
        merged = self.optional_merge({"allOf": [target, beside]}, path)
        if merged is not None:
          return self.node(merged, path, depth + 1)
        self.after(path, "keywords beside $ref")
      try:
        return self.node(target, ref, depth + 1)
      except ValueError as e:
        self.after(ref, f"generated as any value ({e})")
        return copy.deepcopy(sv.ANY)
    finally:
      self.expanding.pop()

  def optional_merge(self, schema: dict, path: str) -> dict | None:
    try:
      return schema_merge.merge(
        self.root, schema, path, sv.MERGED, dropped=sv.DROPPED
      )
    except ValueError:
      return None


# The value of `optional` where there is none.
_NEVER = object()


def _one_pattern(schema: dict) -> bool:
  """An object whose declared keys are one `patternProperties` pattern
  and whose other keys are allowed with any value."""
  patterns = schema.get("patternProperties")
  return (
    isinstance(patterns, Mapping)
    and len(patterns) == 1
    and not schema.get("properties")
    and schema.get("additionalProperties", True) in (True, {})
  )


def rewrite(
  schema: Mapping[str, Any],
  max_recursion_depth: int = 3,
  keep: int | None = None,
) -> Rewritten:
  """`schema` (parsed) as outlines-core builds it, our regex pieces, and
  the keywords checked only after generation; ValueError names what no
  generation could satisfy or what cannot be merged. Local `$ref`s are
  inlined at most `max_recursion_depth` + 1 deep (outlines-core's rule):
  deeper values are not generated (optional properties and union branches
  are left out, arrays end), while a required value is (outlines-core
  dropped a required property whose value went too deep, and its object
  then matched only {}). With `keep`, objects are narrowed to keep the
  automaton small (`_Rewriter.narrow`; listed in `narrowed`)."""
  r = _Rewriter(schema, max_recursion_depth, keep)
  try:
    out = r.node(schema, "#", 0)
  except _Never:
    raise ValueError(
      f"no value is shorter than max_recursion_depth={max_recursion_depth} "
      "levels of the schema's recursion"
    ) from None
  return Rewritten(
    out,
    r.pieces,
    tuple(dict.fromkeys(r.unenforced)),
    tuple(dict.fromkeys(r.narrowed)),
  )
