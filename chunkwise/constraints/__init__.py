"""Structured generation: regex, JSON-schema and choice constraints.

  tokens, _ = model.generate(
      [prompt], sample_ids=range(8), steps=40,
      constraint=cw.constraints.JsonSchema(
          {"type": "object",
           "properties": {"name": {"type": "string", "maxLength": 10},
                          "age": {"type": "integer"}},
           "required": ["name", "age"]}))

Each constraint is compiled once (per vocabulary, stop ids and logits
width; cached) into token-automaton tables (`tables`), and masks the logits
inside the device loop (`processor`), with no host round trip per token.
"""

from chunkwise.constraints import schema
from chunkwise.constraints.constraint import (
  Choice,
  Constraint,
  JsonSchema,
  Regex,
  escape,
)
from chunkwise.constraints.processor import (
  ConstraintProcessor,
  compile_rows,
  for_call,
  processor,
)
from chunkwise.constraints.tables import Tables, compile_regex, vocab_of

__all__ = [
  "Choice",
  "Constraint",
  "ConstraintProcessor",
  "JsonSchema",
  "Regex",
  "Tables",
  "compile_regex",
  "compile_rows",
  "escape",
  "for_call",
  "processor",
  "schema",
  "vocab_of",
]
