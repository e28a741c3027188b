"""A large schema's byte DFA put together from its parts' DFAs
(`constraints/dfa_splice.py`) spells exactly what the DFA of its whole
regex spells (the plain twin), and anything that would not join cleanly
falls back to the whole regex."""

import numpy as np
import pytest

import chunkwise as cw
from chunkwise.constraints import (
  automaton,
  byte_dfa,
  dfa_splice,
  lazy,
  regex_dfa,
)
from tests.dfa_helpers import same_language

WHOLE = 10**12  # compose_above: never composed


def _part(i: int, required=()) -> dict:
  """An object of six optional scalars, its JSON long enough to be a
  part."""
  return {
    "type": "object",
    "description": "a part " + "x" * 200,
    "properties": {
      f"f{j}": {"type": "string", "maxLength": 8}
      if j % 2
      else {"type": "integer"}
      for j in range(6)
    },
    "required": list(required),
  }


def _nested() -> dict:
  out = {
    "type": "object",
    "properties": {f"k{i}": _part(i, ["f0"] * (i % 2)) for i in range(6)},
  }
  props = out["properties"]
  props["list"] = {"type": "array", "items": _part(9), "minItems": 1}
  props["few"] = {"type": "array", "items": _part(8), "maxItems": 2}
  props["maybe"] = {  # nullable, with a piece (our date regex) inside
    "type": ["object", "null"],
    "description": "y" * 250,
    "properties": {
      "a": {"type": "integer"},
      "when": {"type": "string", "format": "date"},
    },
  }
  props["deep"] = {"type": "object", "properties": {"inner": _part(3)}}
  props["deep"]["description"] = "z" * 250
  return out


SCHEMAS = {
  "nested": _nested(),
  "required": {
    "type": "object",
    "properties": {f"r{i}": _part(i) for i in range(4)},
    "required": ["r1", "r3"],
  },
  "recursive": {  # $ref inlined by the rewrite, to its depth
    "$defs": {
      "node": {
        "type": "object",
        "description": "w" * 250,
        "properties": {
          "name": {"type": "string", "maxLength": 5},
          "children": {
            "type": "array",
            "items": {"$ref": "#/$defs/node"},
            "maxItems": 2,
          },
        },
      }
    },
    "$ref": "#/$defs/node",
  },
}


def _build_schema(schema, compose_above: int) -> dict:
  kind, text = cw.constraints.JsonSchema(schema)._text()
  return automaton.build(
    kind,
    text,
    byte_dfa.BYTES.entries,
    (byte_dfa.STOP,),
    257,
    256.0,
    "dfa",
    compose_above=compose_above,
  )


def _build(name: str, compose_above: int) -> dict:
  return _build_schema(SCHEMAS[name], compose_above)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_the_composed_dfa_spells_what_the_whole_regex_spells(name):
  whole = _build(name, WHOLE)
  composed = _build(name, 0)
  assert composed["regex"] == whole["regex"]
  assert same_language(composed, whole) >= whole["table"].shape[0]
  # no bigger: each part once per continuation
  assert composed["table"].shape[0] <= whole["table"].shape[0]


def test_composed_or_whole_the_dfa_is_the_same_minimal_one():
  """Both ways give the minimal DFA, its states numbered breadth-first
  from the start: the same table, whichever `COMPOSE_ABOVE` chooses."""
  if regex_dfa.library() is None:
    pytest.skip("no C++ compiler: outlines-core's DFAs are not minimal")
  for name in ("nested", "required"):
    composed, whole = _build(name, 0), _build(name, WHOLE)
    np.testing.assert_array_equal(composed["table"], whole["table"])
    np.testing.assert_array_equal(composed["final"], whole["final"])


def test_a_composed_constraint_masks_as_the_eager_tables():
  """Through the public path (the worker, a lazy constraint over bytes):
  random walks find the eager tables' masks at every state."""
  eager, masks = _walk_both(cw.constraints.JsonSchema(SCHEMAS["nested"]))
  assert masks.states < eager.states  # composed: shared continuations


def _walk_both(c, walks=8, steps=150):
  """`c` compiled eagerly and lazily over bytes; random walks find the
  same allowed ids and finality at every state. Returns both."""
  vocab = cw.ByteVocabulary()
  with cw.constraints.constraint.tables_kind("eager"):
    eager = c.compile(vocab, stop_ids=[2], width=320)
  with cw.constraints.constraint.tables_kind("lazy"):
    masks = c.compile(vocab, stop_ids=[2], width=320)
  assert isinstance(masks, lazy.Lazy)
  rng = np.random.default_rng(0)
  for _ in range(walks):
    e, s = 0, 0
    for _ in range(steps):
      want, got = eager.allowed(e), masks.allowed(s)
      np.testing.assert_array_equal(got, want)
      assert bool(eager.final[e]) == bool(masks.final[s])
      choices = want[want != 2]
      if not choices.size:
        break
      t = int(rng.choice(choices))
      e, s = eager.step(e, t), masks.step(s, t)
  return eager, masks


def _dfa(regex: str) -> tuple[np.ndarray, np.ndarray]:
  out = automaton.build(
    "regex", regex, byte_dfa.BYTES.entries, (256,), 257, 256.0, "dfa"
  )
  return out["table"], out["final"]


@pytest.mark.parametrize(
  "parent, part",
  [
    (r"a\x01p0\x02b|ac", "c"),  # the part starts with a byte `a` reads
    (r"a\x01p0\x02x", "b|bx"),  # its end reads what follows it
    (r"a\x01p0\x02b", "c?"),  # it can be empty
    (r"a\x01p0\x02b", "c*d"),  # it re-enters its start
  ],
)
def test_parts_that_do_not_join_cleanly_conflict(parent, part):
  table, final = _dfa(parent)
  with pytest.raises(dfa_splice.Conflict):
    dfa_splice.splice(table, final, {"p0": _dfa(part)})


def test_a_clean_splice_is_the_regex_with_the_part_in_place():
  table, final = _dfa(r"(a\x01p0\x02b|z)\x01p0\x02!")
  got = dfa_splice.splice(table, final, {"p0": _dfa(r"c(d|ee)*f")})
  want = _dfa(r"(ac(d|ee)*fb|z)c(d|ee)*f!")
  same_language(
    dict(table=got[0], final=got[1]), dict(table=want[0], final=want[1])
  )


def test_a_schema_whose_parts_conflict_is_compiled_whole(monkeypatch):
  def conflict(*args):
    raise dfa_splice.Conflict("p0", "say")

  monkeypatch.setattr(dfa_splice, "splice", conflict)
  got, whole = _build("nested", 0), _build("nested", WHOLE)
  np.testing.assert_array_equal(got["table"], whole["table"])


def test_parts_are_kept_across_schemas(monkeypatch):
  """A part shared with a schema compiled before is not compiled again
  (`automaton._LEAVES`: read-only arrays); past `LEAVES_MB` the least
  recently used go. The DFAs spell what their whole regexes spell."""
  monkeypatch.setattr(automaton, "_LEAVES", type(automaton._LEAVES)())
  compiled = []
  real = automaton.byte_dfa

  def counted(regex, *args):
    compiled.append(regex)
    return real(regex, *args)

  monkeypatch.setattr(automaton, "byte_dfa", counted)
  a = {
    "type": "object",
    "properties": {"x": _part(1), "y": {"type": "integer"}},
  }
  b = {
    "type": "object",
    "properties": {"z": _part(1), "w": {"type": "boolean"}},
  }
  _build_schema(a, 0)
  first = len(compiled)
  assert first == 2  # the object around its part, and the part
  got = _build_schema(b, 0)
  assert len(compiled) == first + 1  # b's own object only
  assert not any(t.flags.writeable for t, _ in automaton._LEAVES.values())
  compiled.clear()
  same_language(got, _build_schema(b, WHOLE))
  monkeypatch.setattr(automaton, "LEAVES_MB", 0)
  c = {"type": "object", "properties": {"q": _part(2, ["f0"])}}
  _build_schema(c, 0)  # c's object is kept, alone
  assert len(automaton._LEAVES) == 1


def _framed() -> cw.constraints.Framed:
  """Two tools' calls: each frame's arguments a hole."""
  hole = cw.constraints.Framed.hole
  call = r'<call>\{"name": "{name}", "arguments": {args}\}</call>'
  frames = "|".join(
    call.replace("{name}", n).replace("{args}", hole(h))
    for n, h in (("read", "a0"), ("write", "a1"))
  )
  return cw.constraints.Framed(
    f"(({frames})\n)+",
    {
      "a0": cw.constraints.JsonSchema(SCHEMAS["required"]),
      "a1": cw.constraints.JsonSchema(_part(1, ["f0", "f3"])),
    },
  )


def test_a_framed_regex_spells_its_regex_with_the_parts_in_place():
  kind, text = _framed()._text()

  def build(compose_above):
    return automaton.build(
      kind,
      text,
      byte_dfa.BYTES.entries,
      (256,),
      257,
      256.0,
      "dfa",
      compose_above=compose_above,
    )

  whole, composed = build(WHOLE), build(0)
  assert whole["regex"] == composed["regex"] == _framed().regex()
  assert same_language(composed, whole) >= whole["table"].shape[0]
  assert composed["table"].shape[0] <= whole["table"].shape[0]
  # a frame is composed by default, whatever its length
  np.testing.assert_array_equal(build(None)["table"], composed["table"])
  # the parts were put in place (nothing conflicted)
  vocab = byte_dfa.BYTES.entries
  assert automaton._composed(kind, text, vocab, (256,), 257, 256.0) is not None


def test_a_framed_constraint_masks_as_the_eager_tables():
  _walk_both(_framed())


@pytest.mark.parametrize(
  "pattern, parts, match",
  [
    ("x", {"a0": "no"}, "must be a constraint"),
    ("x", {"a0": cw.constraints.Regex("y")}, "no hole 'a0'"),
    ("x", {"a-0": cw.constraints.Regex("y")}, "letters and digits"),
  ],
)
def test_framed_checks_its_parts(pattern, parts, match):
  with pytest.raises(ValueError, match=match):
    cw.constraints.Framed(pattern, parts)
