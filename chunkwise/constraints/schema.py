"""JSON schema -> regex, refusing keywords the regex would silently drop.

outlines-core's `build_regex_from_schema` ignores `minimum`, `maximum`,
`multipleOf`, `uniqueItems`, `patternProperties`, builds `allOf` as a
concatenation, treats `oneOf` as `anyOf`, and drops `pattern` next to
`minLength` / `maxLength`. Output generated under such a regex would
violate the schema it claims to follow, so `check` accepts only the
keywords below and raises ValueError naming any other (with its path).

Whitespace between tokens is at most one space (`[ ]?`, outlines-core's
default), so generation cannot run away in whitespace.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from typing import Any

from chunkwise import untrusted

# Keywords whose meaning the generated regex enforces in full.
ALLOWED = frozenset(
  {
    "type",
    "properties",
    "required",
    "additionalProperties",  # false only (the regex never allows extra keys)
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "anyOf",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "$ref",
    "$defs",
    "definitions",
  }
)
# Annotations: no effect on valid values.
ANNOTATIONS = frozenset(
  {
    "title",
    "description",
    "$comment",
    "$schema",
    "$id",
    "examples",
    "default",
  }
)
# Keywords whose values are schemas, lists of schemas or maps of schemas.
_SCHEMA = ("items", "additionalProperties")
_SCHEMA_LISTS = ("anyOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")


# Bounds on an (untrusted) schema: its JSON text and how deeply it nests.
MAX_BYTES = 16 << 20
MAX_DEPTH = 64


def parse(schema: str | Mapping[str, Any], source: str | None = None) -> dict:
  """A schema given as a JSON string or a dict, as a dict; refuses text
  over `MAX_BYTES` and nesting deeper than `MAX_DEPTH` JSON levels."""
  where = source or "the JSON schema"
  if isinstance(schema, str):
    if len(schema) > MAX_BYTES:
      raise ValueError(
        f"{where} has {len(schema)} characters, over the limit of {MAX_BYTES}"
      )
    schema = untrusted.loads(schema, source=where, max_depth=2 * MAX_DEPTH)
  elif isinstance(schema, Mapping):
    found = untrusted.depth(schema)
    if found > 2 * MAX_DEPTH:
      raise ValueError(
        f"{where} nests {found} levels deep, over the limit of {2 * MAX_DEPTH}"
      )
  if not isinstance(schema, Mapping):
    raise ValueError(f"a JSON schema must be an object, got {schema!r}")
  return dict(schema)


def check(schema: Any, path: str = "#", depth: int = 0) -> None:
  """Raises ValueError at the first keyword outside the allow-list, or
  where subschemas nest deeper than `MAX_DEPTH`."""
  if depth > MAX_DEPTH:
    raise ValueError(
      f"{path}: subschemas nest more than {MAX_DEPTH} levels deep"
    )
  if isinstance(schema, bool):
    return
  if not isinstance(schema, Mapping):
    raise ValueError(f"{path}: a schema must be an object, got {schema!r}")
  for key, value in schema.items():
    where = f"{path}/{key}"
    if key in ANNOTATIONS:
      continue
    if key not in ALLOWED:
      raise ValueError(
        f"JSON schema keyword {key!r} at {path} is not supported: "
        f"constrained generation could not enforce it (supported: "
        f"{', '.join(sorted(ALLOWED))})"
      )
    if key == "additionalProperties" and value is not False:
      raise ValueError(
        f"{where}: only additionalProperties=false is supported (generated "
        f"objects have exactly the listed properties), got {value!r}"
      )
    if key == "pattern" and ("minLength" in schema or "maxLength" in schema):
      raise ValueError(
        f"{where}: 'pattern' together with minLength/maxLength is not "
        f"supported (the length would be ignored); put the length in the "
        f"pattern, e.g. [a-z]{{1,10}}"
      )
    if key in _SCHEMA and isinstance(value, Mapping):
      check(value, where, depth + 1)
    elif key in _SCHEMA_LISTS:
      if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of schemas, got {value!r}")
      for i, sub in enumerate(value):
        check(sub, f"{where}/{i}", depth + 1)
    elif key in _SCHEMA_MAPS:
      if not isinstance(value, Mapping):
        raise ValueError(f"{where} must map names to schemas, got {value!r}")
      for name, sub in value.items():
        check(sub, f"{where}/{name}", depth + 1)


def check_meta(schema: Mapping[str, Any]) -> None:
  """Raises ValueError naming the first keyword whose value no JSON Schema
  draft allows (`"required": true`, `"minItems": "3"`, ...): the schema
  must be valid under its own draft's metaschema (`$schema`; 2020-12
  without one), or under draft 7 or 4 for undeclared older spellings."""
  import jsonschema

  first = jsonschema.validators.validator_for(
    schema, default=jsonschema.Draft202012Validator
  )
  # Valid under any one of them will do, so draft 7's is tried first: it
  # has no dynamic references, 1.9 ms a schema against 11 ms for 2020-12's
  # (the 210 JSONSchemaBench schemas of docs/structured-generation.md).
  # The error reported is the schema's own draft's.
  classes = dict.fromkeys(
    [jsonschema.Draft7Validator, first, jsonschema.Draft4Validator]
  )
  errors = {}
  for cls in classes:
    # No format checker: `pattern`s are ECMA-262, not Python, regexes.
    error = jsonschema.exceptions.best_match(
      _meta_validator(cls).iter_errors(schema)
    )
    if error is None:
      return
    errors[cls] = error
  error = errors[first]
  path = "".join(f"/{p}" for p in error.absolute_path)
  raise ValueError(
    f"#{path}: {error.message} (the schema is not valid JSON Schema: "
    f"checked against the metaschema of {first.META_SCHEMA['$schema']})"
  )


@functools.cache
def _meta_validator(cls):
  """A validator of `cls`'s metaschema (made once)."""
  return cls(cls.META_SCHEMA)


@dataclasses.dataclass(frozen=True)
class Validation:
  """A generated text checked against a schema: `valid`, and the first
  error (with its JSON path) where it is not."""

  valid: bool
  error: str | None = None


@functools.lru_cache(maxsize=64)
def _validators(schema_text: str) -> tuple:
  """Validators to try in turn: the schema's own draft (`$schema`; 2020-12
  without one), then draft 7 for undeclared older spellings (a list-valued
  `items` breaks a 2020-12 validator)."""
  import jsonschema

  schema = json.loads(schema_text)
  first = jsonschema.validators.validator_for(
    schema, default=jsonschema.Draft202012Validator
  )
  classes = dict.fromkeys([first, jsonschema.Draft7Validator])
  return tuple(
    cls(schema, format_checker=cls.FORMAT_CHECKER) for cls in classes
  )


def validate(schema_text: str, text: str) -> Validation:
  """`text` against the schema (JSON text) by a validator of the schema's
  own draft, formats asserted."""
  try:
    value = json.loads(text)
  except ValueError as e:
    return Validation(False, f"not JSON: {e}")
  problem = None
  for validator in _validators(schema_text):
    try:
      error = next(iter(validator.iter_errors(value)), None)
    except Exception as e:  # a schema this draft cannot read
      problem = e
      continue
    if error is None:
      return Validation(True)
    path = "".join(f"/{p}" for p in error.absolute_path)
    return Validation(False, f"#{path}: {error.message}")
  return Validation(False, f"the validator could not check it: {problem}")
