"""Structured generation: regex, JSON-schema and choice constraints.

  tokens, _ = model.generate(
      [prompt], sample_ids=range(8), steps=40,
      constraint=cw.constraints.JsonSchema(
          {"type": "object",
           "properties": {"name": {"type": "string", "maxLength": 10},
                          "age": {"type": "integer"}},
           "required": ["name", "age"]}))

Each constraint is compiled once (cached) into a DFA over bytes
(`byte_dfa`: no vocabulary in it, milliseconds), and masks the logits
inside the device loop by walking the vocabulary's byte trie from each
row's state (`token_trie`, `lazy`, `walk`), with no host round trip per
token; `constraint.tables_kind("eager")` compiles the old (states x
vocabulary) tables instead (`tables`, `processor`), the plain twin.
JSON schemas are rewritten into what the automaton enforces exactly
(`schema_rewrite`); `JsonSchema.validate` checks each output against the
original schema, so what the automaton cannot enforce is flagged.
"""

from chunkwise.constraints import json_regex, schema, schema_rewrite
from chunkwise.constraints.constraint import (
  Choice,
  Constraint,
  JsonSchema,
  Regex,
  escape,
)
from chunkwise.constraints.framed import Framed
from chunkwise.constraints.processor import (
  ConstraintProcessor,
  GrammarSet,
  check_room,
  compile_rows,
  for_call,
  for_rows,
  loop_trie,
  processor,
)
from chunkwise.constraints.schema import Validation
from chunkwise.constraints.tables import Tables, compile_regex, vocab_of

__all__ = [
  "Choice",
  "Constraint",
  "ConstraintProcessor",
  "Framed",
  "GrammarSet",
  "JsonSchema",
  "Regex",
  "Tables",
  "Validation",
  "check_room",
  "compile_regex",
  "compile_rows",
  "escape",
  "for_call",
  "for_rows",
  "json_regex",
  "loop_trie",
  "processor",
  "schema",
  "schema_rewrite",
  "vocab_of",
]
