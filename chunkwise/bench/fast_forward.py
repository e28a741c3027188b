"""Constrained JSON with its forced tokens appended in one pass, against
free text of the same length, side by side.

  report = compare(model, batches=(1,), rounds=5)
  print(table(report))

Each prompt asks for a record as JSON (`SCHEMA`: six properties of
mixed types, the shape of a tool call's arguments). Every round times,
interleaved (greedy; each prompt once, in calls of `batch` rows):
  "json"          the schema as `JsonSchema`'s defaults write it
                  (flexible whitespace), one token per step;
  "json, compact" compact whitespace with `fast_forward=True` (each
                  forced run one tokenization), one token per step;
  "json, forced"  the same with `Speculation(drafter="forced")`: each run
                  of forced tokens appended in one pass;
  "text"          no constraint, as many steps as "json, compact" took
                  (its longest row), end-of-text banned: free text of the
                  same length.
A figure is the median over rounds of generated tokens / s; ratios are
to "text" of the same round. Rows where "json, forced" differs from
"json, compact" (tokens or length) are counted: 0, by construction.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from chunkwise import constraints, processors
from chunkwise.bench import speculation
from chunkwise.inference import InferenceModel, Speculation

SCHEMA = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 40},
    "category": {"enum": ["book", "music", "garden", "toy", "food"]},
    "price": {"type": "number", "minimum": 0, "maximum": 10000},
    "in_stock": {"type": "boolean"},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "tags": {
      "type": "array",
      "items": {"type": "string", "maxLength": 20},
      "maxItems": 3,
    },
  },
  "required": ["name", "category", "price", "in_stock", "rating", "tags"],
}
ITEMS = [
  "a paperback copy of a detective novel, 9.99 euro, in stock, 4 stars",
  "a bag of tomato seeds for the garden, 2.50 euro, sold out, 5 stars",
  "a wooden toy train with six carriages, 34 euro, in stock, 3 stars",
  "a vinyl record of piano sonatas, 22 euro, in stock, 5 stars",
  "a jar of wildflower honey, 7.80 euro, sold out, 4 stars",
  "a hardback atlas of the world's rivers, 45 euro, in stock, 4 stars",
  "a set of three watering cans, 18 euro, in stock, 2 stars",
  "a box of dark chocolate truffles, 12 euro, in stock, 5 stars",
]
STEPS = 96  # room for the longest record


def _chunks(model: InferenceModel, batch: int):
  """Each item's request, in calls of `batch` rows (the last cycling
  back), padded to one width."""
  asks = [
    f"Describe this product as a JSON record (name, category, price, "
    f"in_stock, rating, tags): {item}"
    for item in ITEMS
  ]
  return speculation.prompt_chunks(model, asks, batch)


def _time(model, prefixes, steps, **kwargs) -> speculation.Timed:
  """Greedy generation after each of `prefixes` ((prefill, rows))."""
  calls = [(pre, rows, kwargs) for pre, rows in prefixes]
  return speculation.timed_calls(model, calls, steps)


def calls(model: InferenceModel, k: int = 8) -> dict[str, dict]:
  """The four calls' generate arguments ("text" without its steps)."""
  flexible = constraints.JsonSchema(SCHEMA)
  compact = constraints.JsonSchema(
    SCHEMA, whitespace="compact", fast_forward=True
  )
  return {
    "json": {"constraint": flexible},
    "json, compact": {"constraint": compact},
    "json, forced": {
      "constraint": compact,
      "speculation": Speculation(drafter="forced", k=k),
    },
    "text": {"processors": [processors.ban_tokens(model.eos_ids)]},
  }


def compare(
  model: InferenceModel,
  *,
  batches: Sequence[int] = (1,),
  rounds: int = 5,
  k: int = 8,
) -> dict:
  """{"b{B}": {name: {tokens_per_s, ratio_to_text, ...}}} (module
  docstring)."""
  report = {}
  for batch in batches:
    prefixes = [(model.prefill(c), c.batch) for c in _chunks(model, batch)]
    kinds = calls(model, k)
    # Compiles, untimed (a speculative call once per pass width more,
    # which its calibration times); "text" runs as long as the JSON did.
    for name, kw in kinds.items():
      if name != "text":
        spec = kw.get("speculation")
        for _ in range(1 if spec is None else len(spec.checked().widths) + 1):
          done = _time(model, prefixes, STEPS, **kw)
        if name == "json, compact":
          text_steps = int(max(x.max() for x in done.lengths))
    _time(model, prefixes, text_steps, **kinds["text"])
    rates = {n: [] for n in kinds}
    ratios = {n: [] for n in kinds}
    diverged, stats = 0, None
    for _ in range(rounds):
      got = {
        n: _time(model, prefixes, text_steps if n == "text" else STEPS, **kw)
        for n, kw in kinds.items()
      }
      for n in kinds:
        rates[n].append(got[n].rate)
        ratios[n].append(got[n].rate / got["text"].rate)
      diverged += speculation.rows_diverged(
        got["json, compact"], got["json, forced"]
      )
      stats = got["json, forced"].stats
    report[f"b{batch}"] = {
      **{
        n: {
          "tokens_per_s": statistics.median(rates[n]),
          "ratio_to_text": statistics.median(ratios[n]),
        }
        for n in kinds
      },
      "text_steps": text_steps,
      "diverged_rows": diverged,
      "mean_acceptance_length": stats.mean_acceptance_length,
      "sample": _text(model, got["json, forced"]),
    }
  return report


def _text(model, timed: speculation.Timed) -> str:
  """The first row's text."""
  ids = timed.tokens[0][0][: timed.lengths[0][0]].tolist()
  return model.vocab.decode(ids)


def table(report: dict) -> str:
  """A Markdown table of `compare`'s report."""
  names = ["json", "json, compact", "json, forced", "text"]
  lines = [
    "| batch | " + " | ".join(names) + " | forced tokens per pass |",
    "|---" * (len(names) + 2) + "|",
  ]
  for b, cell in report.items():
    row = [
      f"{cell[n]['tokens_per_s']:.1f} tok/s ({cell[n]['ratio_to_text']:.2f}x)"
      for n in names
    ]
    lines.append(
      f"| {b[1:]} | " + " | ".join(row) + f" | "
      f"{cell['mean_acceptance_length']:.2f} |"
    )
  return "\n".join(lines)
