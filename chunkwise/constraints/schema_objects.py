"""The keywords of one object: which properties it generates (used by
`schema_rewrite`, which walks the whole schema).

  class _Rewriter(ValueKeywords, ObjectKeywords): ...   # required(), ...

* required names missing from `properties` are generated from
  `patternProperties` or `additionalProperties` (any JSON value where it
  is absent); a required name neither allows is refused;
* `minProperties` is met by always generating the first declared
  properties, and `minProperties: 1` without declared properties by one
  property of any name;
* `maxProperties` holds where at most that many properties are declared
  (generated objects hold only those); with more, only the first optional
  ones are generated;
* with `keep` (`JsonSchema.compile`'s narrower tries), only the first
  `keep` optional properties are generated.

Every place that generates fewer values than the schema allows is listed
in `narrowed`; the outputs are all valid.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from chunkwise.constraints import json_regex
from chunkwise.constraints import schema_values as sv

# A property name: any JSON string, as outlines-core writes one.
KEY = r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])*"'


class ObjectKeywords:
  """`required`, `narrow` and `one_property`, for a rewriter with
  `node(schema, path, depth)`, `piece(regex)`, `unenforced`, `narrowed`
  and `keep`."""

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
        if isinstance(pattern, str) and json_regex.search(pattern, name)
      ]
      if matching:
        props[name] = sv.value_schema(
          self.node(matching[0], f"{path}/patternProperties", 1)
        )
        continue
      if extra is False or (schema.get("properties") or {}).get(name) is False:
        raise ValueError(
          f"{path}: required property {name!r} is neither in properties nor "
          "allowed by additionalProperties=false: no value is valid"
        )
      props[name] = sv.value_schema(
        self.node(extra, f"{path}/additionalProperties", 1)
        if isinstance(extra, Mapping)
        else {}
      )
    self.narrow(schema, out, path)

  def narrow(self, schema: dict, out: dict, path: str) -> None:
    """Declared properties made required, first first, until
    `minProperties` of them are, and optional ones past `maxProperties`
    left out (its outputs would otherwise be flagged after). With `keep`,
    also: only the first `keep` optional properties
    are generated, and one is required where none is. Both shrink what
    outlines-core builds: its index holds a state per string value in
    which nearly every token is allowed (Kubernetes and GitHub schemas ran
    past 4 GB), and it writes an object with no required property as one
    alternative per first property present (its regex grows with the
    square of their number, and copies of copies when they nest)."""
    props = out["properties"]
    required = [n for n in out.get("required") or [] if n in props]
    optional = [n for n in props if n not in required]
    if self.keep is not None and len(optional) > self.keep:
      dropped = optional[self.keep :]
      for name in dropped:
        del props[name]
      self.narrowed.append(
        f"{path}: {len(dropped)} optional properties after the first "
        f"{self.keep} not generated"
      )
    most = schema.get("maxProperties")
    if type(most) is int and len(required) <= most < len(props):
      dropped = [n for n in props if n not in required][most - len(required) :]
      for name in dropped:
        del props[name]
      self.narrowed.append(
        f"{path}: {', '.join(dropped)} not generated (maxProperties)"
      )
    if type(most) is int and len(props) <= most:
      self.checked(f"{path}: maxProperties")
    least = schema.get("minProperties")
    least = (
      least if isinstance(least, int) and not isinstance(least, bool) else 0
    )
    anchor = self.keep is not None and not required and props
    need = max(least, 1 if anchor else 0)
    added = [n for n in props if n not in required][
      : max(0, need - len(required))
    ]
    if added:
      out["required"] = [*required, *added]
      self.narrowed.append(f"{path}: {', '.join(added)} always generated")
    if len(required) + len(added) >= least:
      self.checked(f"{path}: minProperties")

  def one_property(self, out: dict, path: str) -> None:
    """An object of undeclared properties with `minProperties: 1` as one
    property of any name (a placeholder key, spliced as a JSON string)
    whose value is `additionalProperties`' (outlines-core generated `{}`)."""
    value = out.pop("additionalProperties", None) or copy.deepcopy(sv.ANY)
    key = self.piece(KEY)["const"]
    out["properties"], out["required"] = {key: value}, [key]
    self.narrowed.append(f"{path}: one property always generated")
    self.checked(f"{path}: minProperties")

  def checked(self, entry: str) -> None:
    """`entry` (recorded as unenforced) enforced after all."""
    if entry in self.unenforced:
      self.unenforced.remove(entry)
