"""Counts a schema's automaton cannot hold are refused before compiling,
naming the keyword; objects too wide to compile whole start narrowed
(`constraints/budget.py`)."""

import time

import pytest

import chunkwise as cw
from chunkwise.constraints import budget, worker

C = cw.constraints


def _no_worker(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("the worker was asked to compile")

  monkeypatch.setattr(worker, "run", refuse)


@pytest.mark.parametrize(
  "schema, where",
  [
    ({"type": "string", "minLength": 100_000}, "#/minLength"),
    (
      {"type": "array", "items": {"type": "integer"}, "minItems": 100_000},
      "#/minItems",
    ),
    (
      {
        "type": "object",
        "properties": {
          "tags": {
            "type": "array",
            "items": {"type": "string", "minLength": 20},
            "minItems": 2000,
          }
        },
        "required": ["tags"],
      },
      "#/properties/tags/items/minLength",
    ),
  ],
)
def test_counts_that_cannot_fit_are_refused_at_once(monkeypatch, schema, where):
  _no_worker(monkeypatch)
  start = time.perf_counter()
  with pytest.raises(ValueError, match=f"^{where}: .* max_table_mb=256"):
    C.JsonSchema(schema).compile(cw.ByteVocabulary(), stop_ids=[2], width=320)
  assert time.perf_counter() - start < 1.0  # generous: ms when quiet


def test_what_fits_is_not_refused():
  """The floor is a lower bound: a count that fits compiles (a union
  counts its cheapest branch, an optional property nothing)."""
  schema = {
    "type": "object",
    "properties": {
      "a": {"type": "string", "minLength": 40},
      "b": {
        "anyOf": [{"type": "integer"}, {"type": "string", "minLength": 10**6}]
      },
      "c": {"type": "string", "minLength": 10**6},
    },
    "required": ["a", "b"],
  }
  states, _ = budget.floor(schema)
  assert states < 1000
  budget.check(schema, max_table_mb=1.0)


def test_a_wide_object_starts_narrowed(monkeypatch):
  """Optional properties past `WIDE`: the first try is the narrowed one
  (no full try that would run into its limit)."""
  tries = []
  real = C.lazy.compile
  monkeypatch.setattr(
    C.lazy, "compile", lambda *a, **k: tries.append(1) or real(*a, **k)
  )
  props = {f"p{i}": {"type": "integer"} for i in range(budget.WIDE)}
  c = C.JsonSchema({"type": "object", "properties": props}, time_limit_s=60)
  with C.constraint.tables_kind("lazy"):
    c.compile(cw.ByteVocabulary(), stop_ids=[2], width=320)
  assert len(tries) == 1
  assert c.narrowed[0].startswith(f"#: {budget.WIDE - 8} optional properties")
  props.pop("p0")  # one fewer: compiled whole
  assert not budget.too_wide({"type": "object", "properties": props})


def test_a_framed_part_that_cannot_fit_is_refused_at_once(monkeypatch):
  """A tool's arguments (a part of the server's frame) are checked the
  same way: the 400 names the part and the keyword."""
  _no_worker(monkeypatch)
  big = C.JsonSchema({"type": "string", "minLength": 100_000})
  framed = C.Framed("<" + C.Framed.hole("a0") + ">", {"a0": big})
  with pytest.raises(ValueError, match="part 'a0': #/minLength"):
    framed.compile(cw.ByteVocabulary(), stop_ids=[2], width=320)
