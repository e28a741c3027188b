"""Speculative decoding against plain steps, side by side.

  report = compare(model, {"ngram": cw.Speculation()}, batches=(1, 16))
  print(table(report))

Two workloads, each a list of chat prompts (the model's template):
  "copy"  extracting the fields of a given document into JSON, and
          summarizing it with quotes: the answer copies spans of the
          prompt, which prompt lookup drafts;
  "chat"  open-ended questions: little to copy.
Before any call is timed, each speculation's first calls time its passes
(calibration: `inference/speculation/calibration.py`), so the rounds run
on the costs measured on this device unless its settings say
`calibrate=False`. For each workload and batch size, every round times
the plain calls and
each speculation's once, interleaved (greedy, `steps` tokens; every
prompt of the workload once, in calls of `batch` rows, the last cycling
back; each call's prompts its drafting context), so the machine's drift
falls on all alike. A figure is the median over
rounds of generated tokens / s; ratios are to the plain call of the same
round. Rows whose tokens differ from the plain call's are counted
(`diverged`: 0 under invariant numerics, by construction), and the
counts of the last round are kept (`SpeculationStats`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

import jax
import numpy as np

from chunkwise.inference import (
  Chunk,
  InferenceModel,
  Sampling,
  Speculation,
  SpeculationStats,
)

DOCUMENTS = [
  (
    "Order 4471 was placed on 12 March 2025 by Helena Marsh of Dunmore "
    "Bakery, 18 Quay Street, Galway. She ordered 40 bags of stone-ground "
    "rye flour at 3.20 euro each and 6 tins of malt extract at 11.50 euro "
    "each. Delivery is by Corrib Freight, tracking number CF-88213-IE, and "
    "payment is due within 30 days."
  ),
  (
    "The Linden Street library reopens on Monday 2 June after a four-month "
    "renovation. The new reading room seats 120 people and has 36 public "
    "computers. Opening hours are 9am to 8pm on weekdays and 10am to 4pm "
    "on Saturdays. The head librarian, Tomas Okafor, said the building now "
    "has step-free access to every floor."
  ),
  (
    "Patient visit summary: Arjun Mehta, aged 52, attended the Riverside "
    "clinic on 3 September with a persistent dry cough lasting three "
    "weeks. Blood pressure was 138 over 86. Dr. Ines Duarte prescribed "
    "a five-day course of azithromycin 250 mg and booked a follow-up "
    "appointment for 17 September at 10:30."
  ),
  (
    "The Harbour Lights 10K will start at 8:15am on Sunday 14 July from "
    "the East Pier car park. Registration costs 25 pounds and closes on "
    "30 June. Water stations are at 3 km and 7 km, and the course record "
    "of 29 minutes 41 seconds was set by Moira Kell in 2019. Results will "
    "be posted on the club website by 6pm."
  ),
]
TASKS = [
  "Extract every name, date, place, number and price in this document "
  "into a JSON object, copying the values exactly as written.",
  "Summarize this document in three sentences, quoting its exact words "
  "wherever you can.",
]
CHAT = [
  "Write a short story about a lighthouse keeper who finds a message in a "
  "bottle.",
  "What are some good ways to learn a new language as an adult?",
  "Explain why the sky is blue to a ten-year-old.",
  "Give me ideas for a birthday party for someone who loves astronomy.",
  "What should I think about before adopting a dog?",
  "Describe a perfect autumn day in the countryside.",
  "How do I start running if I have never exercised before?",
  "Write a poem about the sea at night.",
]


def workloads() -> dict[str, list[str]]:
  """{"copy": [...], "chat": [...]}: each a list of user messages."""
  copy = [f"{task}\n\n{doc}" for doc in DOCUMENTS for task in TASKS]
  return {"copy": copy, "chat": list(CHAT)}


def prompt_chunks(
  model: InferenceModel, messages: Sequence[str], batch: int
) -> list[Chunk]:
  """The workload's prompts in calls of `batch` rows: every prompt once
  (the last call's rows cycle back to the first prompts), padded to one
  width."""
  vocab = model.vocab
  chat = getattr(vocab, "chat_template", None) is not None
  texts = [
    vocab.apply_chat_template([{"role": "user", "content": m}]) if chat else m
    for m in messages
  ]
  calls = -(-len(texts) // batch)
  chunks = [
    Chunk.tokenize(
      vocab,
      [texts[(c * batch + b) % len(texts)] for b in range(batch)],
      is_first_chunk=True,
      bos_id=model.bos_id,
    )
    for c in range(calls)
  ]
  # One width for all: every call runs the same compiled programs.
  width = -(-max(c.time for c in chunks) // 64) * 64
  return [c.pad_to_length(width) for c in chunks]


@dataclasses.dataclass
class Timed:
  rate: float  # generated tokens / s over the calls
  tokens: list[np.ndarray]
  lengths: list[np.ndarray]
  stats: SpeculationStats | None


def timed_calls(model, calls, steps: int) -> Timed:
  """Greedy generation of `steps` tokens for each of `calls` ((prefix,
  rows, more `generate` arguments)), timed together."""
  tokens, lengths, stats, seconds = [], [], None, 0.0
  for pre, rows, kwargs in calls:
    start = time.perf_counter()
    out, result = model.generate(
      [pre],
      sample_ids=np.arange(rows),
      steps=steps,
      sampling=Sampling(temperature=0.0),
      **kwargs,
    )
    jax.block_until_ready(out.tokens)
    seconds += time.perf_counter() - start
    tokens.append(np.asarray(out.tokens))
    lengths.append(np.asarray(out.lengths))
    if result.speculation is not None:
      stats = result.speculation + (stats or SpeculationStats())
  total = float(sum(x.sum() for x in lengths))
  return Timed(total / seconds, tokens, lengths, stats)


def _time(model, prefixes, chunks, steps, speculation) -> Timed:
  """Greedy generation after each of `prefixes` (the prefills of
  `chunks`, each its call's drafting context)."""
  return timed_calls(
    model,
    [
      (
        pre,
        chunk.batch,
        {
          "speculation": speculation
          and dataclasses.replace(speculation, context=chunk)
        },
      )
      for pre, chunk in zip(prefixes, chunks, strict=True)
    ],
    steps,
  )


def rows_diverged(a: Timed, b: Timed) -> int:
  """Rows whose tokens or length differ."""
  count = 0
  for ta, la, tb, lb in zip(
    a.tokens, a.lengths, b.tokens, b.lengths, strict=True
  ):
    keep = np.arange(ta.shape[1])[None, :] < la[:, None]
    same = (la == lb) & np.all(np.where(keep, ta == tb, True), axis=1)
    count += int(np.sum(~same))
  return count


def compare(
  model: InferenceModel,
  speculations: dict[str, Speculation],
  *,
  batches: Sequence[int] = (1, 16),
  steps: int = 128,
  rounds: int = 3,
) -> dict:
  """{workload: {"b{B}": {"plain": tok/s, name: {tok/s, ratio, diverged,
  stats}}}} (module docstring)."""
  report: dict = {}
  for workload, messages in workloads().items():
    for batch in batches:
      chunks = prompt_chunks(model, messages, batch)
      prefixes = [model.prefill(c) for c in chunks]
      # Compiles, untimed; a speculative call once more per pass width,
      # which its calibration times (`speculation/calibration.py`).
      for s in [None, *speculations.values()]:
        for _ in range(1 if s is None else len(s.checked().widths) + 1):
          _time(model, prefixes[:1], chunks[:1], steps, s)
      rates: dict[str, list[float]] = {"plain": []}
      ratios: dict[str, list[float]] = {n: [] for n in speculations}
      diverged = dict.fromkeys(speculations, 0)
      stats: dict[str, SpeculationStats] = {}
      for _ in range(rounds):
        plain = _time(model, prefixes, chunks, steps, None)
        rates["plain"].append(plain.rate)
        for n, s in speculations.items():
          got = _time(model, prefixes, chunks, steps, s)
          rates.setdefault(n, []).append(got.rate)
          ratios[n].append(got.rate / plain.rate)
          diverged[n] += rows_diverged(plain, got)
          stats[n] = got.stats
      cell: dict = {"plain": statistics.median(rates["plain"])}
      for n in speculations:
        st = stats[n]
        cell[n] = {
          "tokens_per_s": statistics.median(rates[n]),
          "ratio": statistics.median(ratios[n]),
          "diverged_rows": diverged[n],
          "rows": sum(c.batch for c in chunks) * rounds,
          "acceptance_rate": st.acceptance_rate,
          "mean_acceptance_length": st.mean_acceptance_length,
          "stats": dataclasses.asdict(st),
        }
      report.setdefault(workload, {})[f"b{batch}"] = cell
  return report


def table(report: dict) -> str:
  """A Markdown table of `compare`'s report."""
  lines = [
    "| workload | batch | drafter | plain tok/s | speculative tok/s | "
    "ratio | acceptance rate | mean acceptance length | rows diverged |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for workload, cells in report.items():
    for batch, cell in cells.items():
      for name, got in cell.items():
        if name == "plain":
          continue
        lines.append(
          f"| {workload} | {batch[1:]} | {name} | {cell['plain']:.1f} | "
          f"{got['tokens_per_s']:.1f} | {got['ratio']:.2f}x | "
          f"{got['acceptance_rate']:.2f} | "
          f"{got['mean_acceptance_length']:.2f} | "
          f"{got['diverged_rows']}/{got['rows']} |"
        )
  return "\n".join(lines)
