"""Real-world JSON schemas: each keyword family is rewritten into what the
token automaton enforces, random walks through the compiled tables spell
only valid instances, what cannot be enforced is flagged by validation
after generation, and schemas accepted before compile to the same regex."""

import decimal
import functools
import ipaddress
import json
import random
import re

import numpy as np
import pytest

import chunkwise as cw
from chunkwise.constraints import json_regex

C = cw.constraints


@pytest.mark.parametrize(
  "lo, hi",
  [
    (-5, 120),
    (0, 0),
    (7, 7),
    (-100, -3),
    (10, None),
    (None, -7),
    (None, 15),
    (999, 1001),
    (-1, 1),
    (123, 98765),
  ],
)
def test_integer_ranges_are_exact(lo, hi):
  rx = re.compile(json_regex.integer_range(lo, hi))
  rng = random.Random(0)
  for n in [
    *range(-1500, 1500),
    *(rng.randint(-(10**7), 10**7) for _ in range(2000)),
  ]:
    want = (lo is None or n >= lo) and (hi is None or n <= hi)
    assert bool(rx.fullmatch(str(n))) == want, n
  for bad in ["-0", "01", "00", "+1", "1.0", ""]:
    assert not rx.fullmatch(bad), bad


@pytest.mark.parametrize("hi", [2**31 - 1, 2**53 - 1])
def test_wide_ranges_stay_small_and_exact(hi):
  """Sanity bounds (2^31 - 1, 2^53 - 1) as short regexes: a full span of
  digits is one class repeated (it was 1.2 MB for 2^53 - 1)."""
  for make in (json_regex.integer_range, json_regex.number_range):
    regex = make(-hi, hi)
    assert len(regex) < 2000
    rx = re.compile(regex)
    for n in (hi, -hi, hi - 1, 10**9, -7, 0, hi + 1, -hi - 1, 10 * hi):
      assert bool(rx.fullmatch(str(n))) == (-hi <= n <= hi), n
  rx = re.compile(json_regex.number_range(-hi, hi))
  for text in (f"{hi}.0", f"{hi - 1}.5", "-0.25", f"{hi}.5", f"-{hi}.01"):
    assert bool(rx.fullmatch(text)) == (abs(decimal.Decimal(text)) <= hi), text


def test_ipv6_regex_spells_every_form_and_only_addresses():
  rx = re.compile(json_regex.FORMATS["ipv6"][1:-1])
  rng = random.Random(0)
  masks = [
    2**128 - 1,
    0xFFFF,
    0xFFFFFFFF << 96,
    (2**128 - 1) ^ (0xFFFF << 64),
    0,
  ]
  for _ in range(2000):
    a = ipaddress.IPv6Address(rng.getrandbits(128) & rng.choice(masks))
    assert rx.fullmatch(str(a)) and rx.fullmatch(a.exploded), a
  for text in ["::ffff:1.2.3.4", "1:2:3:4:5:6:1.2.3.4", "1:2:3:4:5:6:7::"]:
    assert rx.fullmatch(text)
  alphabet = "0123456789abcdef:."
  for _ in range(50_000):
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 12)))
    if rx.fullmatch(text):
      ipaddress.IPv6Address(text)  # raises if the regex let a non-address in


def _walks(constraint, n=60, max_bytes=400, seed=0):
  """Texts spelled by random walks through the byte-level tables (walks
  longer than `max_bytes` are dropped: strings can run long)."""
  t = constraint.compile(cw.ByteVocabulary(), stop_ids=[2], width=320)
  rng = np.random.default_rng(seed)
  out = []
  while len(out) < n:
    s, text = 0, b""
    while len(text) < max_bytes:
      allowed = t.allowed(s)
      # Closing is likelier than a uniform pick, so walks end.
      tok = (
        2 if 2 in allowed and rng.random() < 0.3 else int(rng.choice(allowed))
      )
      if tok == 2:
        out.append(text.decode())
        break
      text += bytes([tok - 3])
      s = t.step(s, tok)
  return out


# One schema per keyword family that the automaton enforces in full.
ENFORCED = {
  "annotations": {
    "$schema": "http://json-schema.org/draft-04/schema#",
    "id": "http://example.com/person",
    "title": "Person",
    "description": "someone",
    "x-order": 3,
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 6, "examples": ["Al"]},
      "kind": {"$ref": "#/definitions/kind"},
    },
    "required": ["name", "kind"],
    "additionalProperties": False,
    "definitions": {"kind": {"enum": ["cat", "dog"], "deprecated": True}},
  },
  "integer-bounds": {
    "type": "object",
    "properties": {
      "age": {"type": "integer", "minimum": 0, "maximum": 130},
      "delta": {"type": "integer", "exclusiveMinimum": -10, "maximum": -2},
    },
    "required": ["age", "delta"],
  },
  "integer-bounds-draft4": {
    "$schema": "http://json-schema.org/draft-04/schema#",
    "type": "object",
    "properties": {
      "old": {"type": "integer", "minimum": 5, "exclusiveMinimum": True},
      "young": {"type": "integer", "maximum": 3, "exclusiveMaximum": True},
    },
    "required": ["old", "young"],
  },
  "formats": {
    "type": "array",
    "prefixItems": [
      {"type": "string", "format": "ipv4"},
      {"type": "string", "format": "ipv6"},
      {"type": "string", "format": "hostname"},
      {"type": "string", "format": "duration"},
      {"type": "string", "format": "date"},
      {"type": "string", "format": "date-time"},
      {"type": "string", "format": "time"},
      {"type": "string", "format": ""},
    ],
    "minItems": 8,
    "maxItems": 8,
  },
  "open-objects": {
    "type": "object",
    "properties": {"a": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": {"type": "integer", "minimum": 1, "maximum": 9},
  },
  "allOf-merge": {
    "allOf": [
      {"type": "object", "properties": {"a": {"type": "null"}}},
      {"properties": {"b": {"const": 1}}, "required": ["a", "b"]},
    ]
  },
  # A pattern repeating one character class takes the lengths into its
  # count (any other pattern keeps them for after, see below).
  "pattern-lengths": {
    "type": "array",
    "prefixItems": [
      {"type": "string", "pattern": "^[a-c_-]+$", "minLength": 2},
      {"type": "string", "pattern": "[0-9]*", "maxLength": 3},
      {"type": "string", "pattern": "^x{1,6}$", "minLength": 2, "maxLength": 9},
    ],
    "minItems": 3,
    "maxItems": 3,
  },
  # Values without a type: any JSON value where nothing is said (a
  # property's `{}` once made outlines-core's object regex accept `{"a":
  # true` and refuse `{"a": 1}`), the type of the keywords used otherwise;
  # type lists beside our pieces become one branch per type.
  "untyped-values": {
    "type": "object",
    "properties": {
      "any": {"description": "no type"},
      "slug": {"pattern": "^[a-z]{1,4}$"},
      "pair": {"prefixItems": [{}, {"const": 1}], "minItems": 2, "maxItems": 2},
      "when": {"type": ["string", "null"], "format": "date"},
      "n": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
      "either": {"maxLength": 2, "maxItems": 1},
      "open": {"type": "object"},
      "list": {"type": "array", "items": {}},
      "ints": {"type": "object", "additionalProperties": {"type": "integer"}},
      # Object keywords on an array apply to nothing.
      "tags": {
        "type": "array",
        "items": {"type": "boolean"},
        "required": ["x"],
        "additionalProperties": False,
      },
      "none": {"type": "object", "additionalProperties": False},
    },
    "required": [
      *("any", "slug", "pair", "when", "n", "either", "extra"),
      *("open", "list", "ints", "tags", "none"),
    ],
  },
  # Shorthands read as ECMA-262's ASCII; `.` and negated classes stay
  # inside the JSON string (outlines-core once spelled `"a"b"` for `a.b`).
  "pattern-classes": {
    "type": "array",
    "prefixItems": [
      {"type": "string", "pattern": "^\\w{2}\\.\\d$"},
      {"type": "string", "pattern": "^a.b$"},
      {"type": "string", "pattern": "^[^x]{1,3}$"},
      {"type": "string", "pattern": "^[ -~]{2}$"},
      {"type": "string", "pattern": "^\\S\\s[\\d-]$"},
    ],
    "minItems": 5,
    "maxItems": 5,
  },
  # A union beside properties: each branch is merged with them (an enum
  # beside a type keeps the values the type accepts).
  "union-beside-properties": {
    "type": "object",
    "properties": {"kind": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["kind"],
    "additionalProperties": False,
    "anyOf": [
      {"properties": {"kind": {"const": "a"}, "n": {"enum": [1, 2, "x"]}}},
      {"properties": {"kind": {"enum": ["b", "c", 3]}}, "required": ["n"]},
    ],
  },
  # oneOf made exact: disjoint types, a discriminating const, and a
  # property each branch requires and the other then leaves out
  "one-of-types": {
    "oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]
  },
  "one-of-tagged": {
    "oneOf": [
      {
        "type": "object",
        "properties": {"kind": {"const": "a"}, "v": {"type": "boolean"}},
        "required": ["kind"],
      },
      {
        "type": "object",
        "properties": {"kind": {"enum": ["b", "c"]}, "v": {"type": "null"}},
        "required": ["kind"],
      },
    ]
  },
  "one-of-required": {
    "type": "object",
    "properties": {
      "url": {"type": "string", "maxLength": 4},
      "path": {"type": "string", "maxLength": 4},
      "n": {"type": "boolean"},
    },
    "oneOf": [{"required": ["url"]}, {"required": ["path"]}],
  },
  # allOf merged as a meet: the types both allow, the tighter bounds, a
  # property both constrain; a union under a $ref beside a type keeps the
  # branches of that type only
  "all-of-meets": {
    "$defs": {
      "item": {
        "oneOf": [
          {"type": "string"},
          {
            "type": "object",
            "properties": {"p": {"type": "boolean"}},
            "required": ["p"],
            "additionalProperties": False,
          },
        ]
      }
    },
    "allOf": [
      {
        "type": ["object", "null"],
        "properties": {"n": {"type": "integer", "minimum": 0}},
        "maxProperties": 4,
      },
      {
        "type": "object",
        "properties": {
          "n": {"type": "integer", "maximum": 5},
          "items": {
            "type": "array",
            "items": {"type": "object", "$ref": "#/$defs/item"},
            "maxItems": 2,
          },
        },
        "required": ["n", "items"],
        "maxProperties": 2,
      },
    ],
  },
  # numbers between whole bounds
  "number-ranges": {
    "type": "object",
    "properties": {
      "lat": {"type": "number", "minimum": -90, "maximum": 90.0},
      "p": {"type": "number", "minimum": 0, "maximum": 1},
      "t": {"type": ["number", "null"], "minimum": 0},
      "below": {"type": "number", "maximum": -3},
    },
    "required": ["lat", "p", "t", "below"],
  },
  # integer multipleOf decided by the last digits
  "multiple-of": {
    "type": "array",
    "prefixItems": [
      {"type": "integer", "multipleOf": 5},
      {"type": "integer", "multipleOf": 8},
      {"type": "integer", "multipleOf": 1},
    ],
    "items": False,
    "minItems": 3,
  },
  # minProperties 1 on undeclared properties: one property of any name
  "min-properties-open": {
    "type": "object",
    "properties": {
      "env": {
        "type": "object",
        "additionalProperties": {"type": "integer", "maximum": 9},
        "minProperties": 1,
      },
      "tags": {"type": "object", "minProperties": 1},
    },
    "required": ["env", "tags"],
  },
  "draft4-tuple": {
    "type": "array",
    "items": [
      {"type": "integer", "minimum": 1, "maximum": 3},
      {"type": "null"},
    ],
    "additionalItems": False,
    "minItems": 2,
  },
}


@functools.cache
def _constraint(name):
  return C.JsonSchema(ENFORCED[name])


@pytest.mark.parametrize("name", sorted(ENFORCED))
def test_enforced_families_spell_only_valid_instances(name):
  c = _constraint(name)
  assert c.unenforced == ()
  texts = _walks(c)
  for text in texts:
    check = c.validate(text)
    assert check.valid, (text, check.error)
  assert len(set(texts)) > 5  # the walks explore


def test_patterns_no_automaton_says_are_checked_after():
  c = C.JsonSchema(
    {
      "type": "object",
      "properties": {
        "slug": {"type": "string", "pattern": "^(?!-)[a-z-]+$"},
        "code": {"type": "string", "pattern": "^[A-Z][0-9]+$", "maxLength": 3},
      },
      "required": ["slug", "code"],
      "additionalProperties": False,
    }
  )
  assert c.unenforced == (
    "#/properties/slug: pattern (lookaround or back-reference)",
    "#/properties/code: minLength/maxLength with pattern",
  )
  assert not c.validate('{"slug": "-a", "code": "A1"}').valid
  assert not c.validate('{"slug": "a", "code": "A123"}').valid
  assert c.validate('{"slug": "a-b", "code": "A12"}').valid
  for text in _walks(c, n=10):
    json.loads(text)  # the rest is generated as JSON of the right shape


def test_all_of_branches_with_their_own_conditions_merge():
  """`if`/`then` differing between allOf branches are checked after
  (every branch's), not a reason to refuse the schema."""
  c = C.JsonSchema(
    {
      "type": "object",
      "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer"}},
      "required": ["kind"],
      "allOf": [
        {
          "if": {"properties": {"kind": {"const": "a"}}},
          "then": {"required": ["n"]},
        },
        {
          "if": {"properties": {"kind": {"const": "b"}}},
          "then": {"properties": {"n": {"maximum": 3}}},
        },
      ],
    }
  )
  assert c.unenforced == ("#: if", "#: then")
  assert not c.validate('{"kind": "a"}').valid
  assert not c.validate('{"kind": "b", "n": 4}').valid
  flagged = 0
  for text in _walks(c):
    value = json.loads(text)
    ok = ("n" in value or value["kind"] != "a") and (
      value["kind"] != "b" or value.get("n", 0) <= 3
    )
    assert c.validate(text).valid == ok, text
    flagged += not ok
  assert flagged


def test_overlapping_one_of_is_generated_as_any_of_and_listed():
  c = C.JsonSchema(
    {"oneOf": [{"type": "integer"}, {"type": "number", "maximum": 3}]}
  )
  assert c.unenforced == ("#: oneOf (one branch only)",)
  flagged = 0
  for text in _walks(c):
    value = json.loads(text)
    branches = isinstance(value, int) + (value <= 3)
    flagged += branches == 2
    assert c.validate(text).valid == (branches == 1), text
  assert flagged  # an integer up to 3 is valid under both branches


def test_what_is_not_enforced_is_flagged_after_generation():
  """uniqueItems cannot be a regex: walks spell arrays with repeats, and
  validation flags exactly those."""
  c = C.JsonSchema(
    {
      "type": "array",
      "items": {"type": "integer", "minimum": 0, "maximum": 2},
      "minItems": 2,
      "maxItems": 4,
      "uniqueItems": True,
    }
  )
  assert c.unenforced == ("#: uniqueItems",)
  flagged = 0
  for text in _walks(c, n=80):
    values = json.loads(text)
    check = c.validate(text)
    assert check.valid == (len(set(values)) == len(values)), text
    if not check.valid:
      flagged += 1
      assert "non-unique" in check.error
  assert flagged  # some walks repeated a value
  assert not C.JsonSchema({"type": "integer"}).validate("1.5").valid
  assert (
    C.JsonSchema({"type": "integer"}).validate("{").error.startswith("not JSON")
  )


def test_schemas_accepted_before_compile_to_the_same_regex():
  """Same regex, so the same tokens: the rewrite leaves the strict subset
  as it was."""
  for schema in [
    {
      "type": "object",
      "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer"},
        "id": {"type": "string", "format": "uuid"},
      },
      "required": ["name", "age"],
      "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1},
    {
      "anyOf": [{"type": "null"}, {"$ref": "#/$defs/x"}],
      "$defs": {"x": {"const": 2}},
    },
  ]:
    assert (
      C.JsonSchema(schema).regex() == C.JsonSchema(schema, strict=True).regex()
    )


@pytest.mark.parametrize(
  "schema, message",
  [
    (
      {"allOf": [{"type": "string"}, {"type": "integer"}]},
      "allOf/1/type: no value is both",
    ),
    (
      {"type": "object", "required": ["x"], "additionalProperties": False},
      "required property 'x' is neither in properties",
    ),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer lies"),
    (False, "a JSON schema must be an object"),
  ],
)
def test_what_no_generation_could_satisfy_is_refused(schema, message):
  with pytest.raises(ValueError, match=message):
    C.JsonSchema(schema)


@pytest.mark.parametrize(
  "schema, message",
  [
    ({"type": "object", "required": True}, r"#/required: True is not of type"),
    ({"required": 4294967296}, r"#/required: 4294967296 is not of type"),
    (
      {"properties": {"a": {"type": "string", "minLength": "3"}}},
      r"#/properties/a/minLength: '3' is not of type 'integer'",
    ),
    # 2020-12 refuses it, but draft 7 (tried for undeclared older
    # spellings) does not know prefixItems: the rewrite names it.
    (
      {"prefixItems": [{"type": "string", "format": {}}]},
      r"#/prefixItems/0/format must be a string",
    ),
  ],
)
@pytest.mark.parametrize("strict", [False, True])
def test_keywords_of_the_wrong_type_are_named(schema, message, strict):
  """Found by tests/fuzz_inputs.py (a TypeError escaped before)."""
  if strict and "prefixItems" in message:
    pytest.skip("strict hands the schema to outlines-core as written")
  with pytest.raises(ValueError, match=message):
    C.JsonSchema(schema, strict=strict)


def test_strict_keeps_the_allow_list():
  with pytest.raises(ValueError, match="keyword 'uniqueItems' at #"):
    C.JsonSchema({"type": "array", "uniqueItems": True}, strict=True)
  with pytest.raises(ValueError, match="keyword 'id' at #"):
    C.JsonSchema({"id": "x", "type": "null"}, strict=True)


def test_false_subschemas_forbid_what_they_guard():
  """A property whose schema is false must be absent; items false means an
  empty array; a required property whose schema is false is refused."""
  from chunkwise.constraints.schema_rewrite import rewrite

  out = rewrite(
    {
      "type": "object",
      "properties": {"a": {"type": "null"}, "gone": False},
      "required": ["a"],
    }
  )
  assert out.schema["properties"] == {"a": {"type": "null"}}
  assert rewrite({"type": "array", "items": False}).schema["maxItems"] == 0
  with pytest.raises(ValueError, match="required property 'gone'"):
    rewrite({"properties": {"gone": False}, "required": ["gone"]})


def test_all_of_refs_pattern_properties_and_unreachable_pieces():
  """allOf branches that are only $refs are resolved before merging; a
  required name that only patternProperties describe is generated from
  that schema; a definition nothing reaches is not rewritten (no error,
  nothing listed)."""
  c = C.JsonSchema(
    {
      "allOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/definitions/b"}],
      "$defs": {
        "a": {"type": "object", "properties": {"x": {"type": "null"}}},
        "unused": {"type": "integer", "minimum": 1},
        "impossible": {"required": ["y"], "additionalProperties": False},
      },
      "definitions": {
        "b": {
          "required": ["x", "n_1"],
          "patternProperties": {"^n_[0-9]$": {"type": "integer", "maximum": 3}},
        }
      },
    }
  )
  # (listed where it applies: b is merged into the root)
  assert "#: patternProperties" in c.unenforced
  assert not any("impossible" in u or "unused" in u for u in c.unenforced)
  texts = _walks(c, n=30)
  for text in texts:
    assert c.validate(text).valid, text
  assert all(json.loads(t)["n_1"] <= 3 for t in texts)


def test_recursion_is_unrolled_here_and_keeps_required_values():
  """$refs are inlined by the rewrite, a recursive one unrolled
  max_recursion_depth times: where the recursion runs out, union branches
  and optional properties are left out and arrays end, but a required
  property is still generated (outlines-core dropped a required property
  whose value recursed, and generated {})."""
  tree = {
    "$defs": {
      "value": {
        "oneOf": [
          {"type": "integer", "minimum": 0, "maximum": 9},
          {"type": "array", "items": {"$ref": "#/$defs/value"}},
          {"$ref": "#/$defs/box"},
        ]
      },
      "box": {
        "type": "object",
        "properties": {"in": {"$ref": "#/$defs/value"}},
        "additionalProperties": False,
      },
      "unused": {"$ref": "#/$defs/nowhere"},
    },
    "type": "object",
    "properties": {"id": {"$ref": "#/$defs/value"}},
    "required": ["id"],
    "additionalProperties": False,
  }

  def nesting(value):
    if isinstance(value, list):
      return 1 + max(map(nesting, value), default=0)
    if isinstance(value, dict):
      return 1 + max(map(nesting, value.values()), default=0)
    return 0

  for limit in (0, 1, 2):
    c = C.JsonSchema(tree, max_recursion_depth=limit)
    assert "$ref" not in json.dumps(c._rewritten.schema)
    texts = _walks(c, n=40, max_bytes=2000)
    for t in texts:
      assert c.validate(t).valid, t
      assert nesting(json.loads(t)["id"]) <= limit + 1, (limit, t)
    assert not re.fullmatch(c.regex(), "{}")
  # A recursion with no way out at its depth: nothing to generate.
  endless = {
    "$defs": {
      "n": {
        "type": "object",
        "properties": {"n": {"$ref": "#/$defs/n"}},
        "required": ["n"],
      }
    },
    "$ref": "#/$defs/n",
  }
  with pytest.raises(ValueError, match="max_recursion_depth=3"):
    C.JsonSchema(endless)


def test_recursion_depth_is_the_users():
  linked = {
    "$defs": {
      "node": {
        "type": "object",
        "properties": {
          "v": {"type": "integer", "minimum": 0, "maximum": 9},
          "next": {"$ref": "#/$defs/node"},
        },
        "required": ["v"],
        "additionalProperties": False,
      }
    },
    "$ref": "#/$defs/node",
  }

  def depth(value):
    return 0 if "next" not in value else 1 + depth(value["next"])

  for limit in (0, 1, 2):
    c = C.JsonSchema(linked, max_recursion_depth=limit)
    texts = _walks(c, n=40, max_bytes=2000)
    depths = {depth(json.loads(t)) for t in texts}
    assert max(depths) <= limit, (limit, depths)
    if limit:
      assert max(depths) >= 1  # the walks do recurse
    for t in texts:
      assert c.validate(t).valid, t
  # The default is outlines-core's (3): the same regex as before.
  assert (
    C.JsonSchema(linked).regex()
    == C.JsonSchema(linked, max_recursion_depth=3).regex()
  )
  for bad in (-1, 65, 1.5, True):
    with pytest.raises(ValueError, match="max_recursion_depth must be"):
      C.JsonSchema(linked, max_recursion_depth=bad)


@pytest.mark.parametrize(
  "pattern",
  [
    *(r"^\w+\.\d$", r"^a.b$", r"^[^x]+$", r"^[ -~]+$", r"^\S\s\D\W$"),
    # a `-` after a range is itself (it made `9-_` a range over `]`)
    *(r"[\]\-^]", r"^[0-9-_]+$", r"^[a-b-x]+$"),
  ],
)
def test_string_patterns_match_a_subset_inside_json_strings(pattern):
  translated = json_regex.string_pattern(pattern)
  assert translated is not None
  rng = random.Random(0)
  alphabet = 'abx.9_ -"\\\t\x85é]^\u2028'
  matched = 0
  for _ in range(20_000):
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
    if re.fullmatch(translated, text):
      matched += 1
      # Every string the translation spells matches the pattern and needs
      # no JSON escape.
      assert re.search(pattern, text), (pattern, translated, text)
      assert json.dumps(text, ensure_ascii=False)[1:-1] == text, text
  assert matched > 5


@pytest.mark.parametrize(
  "pattern", ['a"b', r"a\\b", r"\bword", r"[\W]", r"\u00e9", "[]a]", "[a"]
)
def test_string_patterns_that_need_json_escapes_are_kept(pattern):
  assert json_regex.string_pattern(pattern) is None


def test_long_length_bounds_are_checked_after():
  from chunkwise.constraints.schema_values import LONG_BOUND

  long = C.JsonSchema(
    {"type": "array", "items": {"type": "string", "maxLength": LONG_BOUND}}
  )
  assert long.unenforced == (
    f"#/items: maxLength {LONG_BOUND} (long: checked after)",
  )
  assert str(LONG_BOUND) not in long.regex()
  assert not long.validate(json.dumps(["x" * (LONG_BOUND + 1)])).valid
  short = C.JsonSchema({"type": "string", "maxLength": LONG_BOUND - 1})
  assert short.unenforced == () and f"{LONG_BOUND - 1}}}" in short.regex()


@pytest.mark.parametrize("kind", ["eager", "lazy"])
def test_a_schema_past_its_limits_is_compiled_again_narrowed(monkeypatch, kind):
  """An automaton that runs past a compile limit is built again with
  fewer optional properties per object (and the first one required where
  none is): fewer outputs, each still valid, and `narrowed` says what
  was left out. Strict schemas are not narrowed. (The limits are the
  eager tables'; a lazy constraint's table is 1 KB a state, 25.6 times
  the eager's 40 bytes at width 320.)"""
  monkeypatch.setattr(C.constraint, "TABLES", kind)
  scale = 25.6 if kind == "lazy" else 1.0
  props = {f"field_{i}": {"type": "string", "maxLength": 12} for i in range(16)}
  schema = {
    "type": "object",
    "properties": props,
    "additionalProperties": False,
  }
  # The full automaton needs ~0.084 MB of mask bits at width 320; kept to
  # 8 optional properties, ~0.042.
  c = C.JsonSchema(schema, max_table_mb=0.06 * scale)
  assert c.narrowed == ()
  texts = _walks(c, n=30)
  assert c.narrowed == (
    "#: 8 optional properties after the first 8 not generated",
    "#: field_0 always generated",
  )
  for text in texts:
    value = json.loads(text)
    assert c.validate(text).valid, text
    assert "field_0" in value and set(value) <= {f"field_{i}" for i in range(8)}
  assert max(len(json.loads(t)) for t in texts) > 1
  with pytest.raises(ValueError, match=r"max_table_mb="):
    C.JsonSchema(schema, max_table_mb=0.06 * scale, strict=True).compile(
      cw.ByteVocabulary(), stop_ids=[2], width=320
    )
  # Past the limit even at the narrowest try: the full schema's error.
  # (the native compiler stops at the limit: "more than" it)
  with pytest.raises(
    ValueError, match=r"needs (more than )?\d+ automaton states"
  ):
    C.JsonSchema(schema, max_table_mb=0.005).compile(
      cw.ByteVocabulary(), stop_ids=[2], width=320
    )


def test_pattern_values_and_min_properties_are_generated():
  """An object described only by one patternProperties schema generates
  that schema's values (any key is then valid); minProperties makes the
  first declared properties always generated until it is met."""
  services = C.JsonSchema(
    {
      "type": "object",
      "properties": {
        "services": {
          "type": "object",
          "patternProperties": {"^[a-z]+$": {"type": "integer", "maximum": 5}},
        },
        "labels": {
          "type": "object",
          "properties": {"a": {"type": "null"}, "b": {"type": "boolean"}},
          "minProperties": 1,
        },
      },
      "required": ["services", "labels"],
    }
  )
  assert "#/properties/labels: minProperties" not in services.unenforced
  assert services.narrowed == ("#/properties/labels: a always generated",)
  texts = _walks(services, n=40, max_bytes=1000)
  for text in texts:
    assert services.validate(text).valid, text
    value = json.loads(text)
    assert all(v <= 5 for v in value["services"].values())
    assert "a" in value["labels"]
  assert any(json.loads(t)["services"] for t in texts)


def test_half_anchored_patterns_and_unsatisfiable_pattern_values():
  """`^X` (or `X$`) is read as a full match of X, not kept with its lone
  anchor (which spelled nothing); pattern values no value satisfies leave
  the object without extra keys instead of refusing the schema."""
  schema = C.JsonSchema(
    {
      "type": "object",
      "properties": {
        "net": {"type": "string", "pattern": r"^\d+\.\d+/\d+"},
        "unit": {"type": "string", "pattern": "[a-z]+s$"},
        "results": {
          "type": "object",
          "patternProperties": {
            r"^\d+$": {
              "type": "object",
              "properties": {"score": {"type": "integer"}},
              "required": ["score", "rating"],
              "additionalProperties": False,
            }
          },
        },
      },
      "required": ["net", "unit", "results"],
    }
  )
  texts = _walks(schema, n=30, max_bytes=400)
  for text in texts:
    assert schema.validate(text).valid, text
    assert json.loads(text)["results"] == {}
