"""Invariant against fast numerics: what invariance costs, and the drift it
removes.

  report = compare({"invariant": a, "fast": b}, prompt, rounds=5)
  print(table(report))

`compare` times the same workload on models that differ only in
`numerics`, interleaved round by round (each round times every mode once,
so the machine's drift falls on all of them alike): greedy decode at each
of `decode_batches` (ms per step) and a prefill of `prefill_shape`
(tokens/s), each round's figure the median of `runs` calls; the report
holds per mode the median over rounds, and each mode's ratio to the first.

`drift` measures, per mode, how far a row's numbers move with what shares
its batch: one row's prefill scores alone against the same row among
B - 1 random others (at a random index) for every B of `batches`, and its
greedy generation's scores likewise; the largest |difference| over all B.
Under invariant numerics both are 0.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

from chunkwise.bench import timing
from chunkwise.inference import Chunk, InferenceModel, Sampling


def compare(
  models: dict[str, InferenceModel],
  prompt: Sequence[int],
  *,
  decode_batches: Sequence[int] = (1, 16),
  prefill_shape: tuple[int, int] = (1, 512),
  steps: int = 32,
  rounds: int = 5,
  runs: int = 3,
  seed: int = 0,
) -> dict:
  """Interleaved timings of `models` (module doc)."""
  first = next(iter(models.values()))
  h = first.hparams
  ids = timing.token_ids(
    batch=prefill_shape[0],
    length=prefill_shape[1],
    vocab=h.vocab,
    bos_id=first.bos_id,
    seed=seed,
  )
  samples: dict[tuple[str, str], list[float]] = {}
  for _ in range(rounds):
    for name, model in models.items():
      for b in decode_batches:
        p = timing.decode(model, prompt, batch=b, steps=steps, runs=runs)
        ms = statistics.median(p.times) / max(p.steps, 1) * 1e3
        samples.setdefault((name, f"decode b{b}"), []).append(ms)
      p = timing.prefill(model, ids, runs)
      tps = p.tokens / statistics.median(p.times)
      shape = f"prefill {prefill_shape[0]}x{prefill_shape[1]}"
      samples.setdefault((name, shape), []).append(tps)
  names = list(models)
  rows = []
  for what in dict.fromkeys(w for _, w in samples):
    unit = "ms/step" if what.startswith("decode") else "tokens/s"
    medians = {n: statistics.median(samples[(n, what)]) for n in names}
    base = medians[names[0]]
    rows.append(
      {
        "workload": what,
        "unit": unit,
        "median": medians,
        "samples": {n: samples[(n, what)] for n in names},
        # > 1: slower than the first mode (time ratio, or tokens/s inverted)
        "slowdown": {
          n: (m / base if unit == "ms/step" else base / m)
          for n, m in medians.items()
        },
      }
    )
  return {"modes": names, "rounds": rounds, "runs": runs, "rows": rows}


def _rows(rng, vocab: int, batch: int, length: int) -> list[list[int]]:
  return [
    [1, *rng.integers(3, vocab, int(rng.integers(1, length))).tolist()]
    for _ in range(batch)
  ]


def _chunk(rows: list[list[int]]) -> Chunk:
  width = max(len(r) for r in rows)
  tokens = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    tokens[i, : len(r)] = r
  return Chunk(tokens=tokens, lengths=np.array([len(r) for r in rows]))


def drift(
  model: InferenceModel,
  prompt: Sequence[int],
  *,
  batches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
  steps: int = 16,
  seed: int = 0,
) -> dict:
  """The largest |score difference| of one row between batch sizes."""
  rng = np.random.default_rng(seed)
  row = [int(t) for t in prompt]
  greedy = Sampling(temperature=0.0)
  base_scores = base_gen = None
  prefill_drift = generate_drift = 0.0
  for b in batches:
    rows = _rows(rng, model.hparams.vocab, b, len(row) + 8)
    at = int(rng.integers(b))
    rows[at] = row
    prefix = model.prefill(_chunk(rows))
    scores = np.asarray(prefix.per_token_scores[at, : len(row)])
    _, result = model.generate(
      prefix=[prefix], sample_ids=np.arange(b), steps=steps, sampling=greedy
    )
    gen = np.asarray(result.per_token_scores[at])
    if base_scores is None:
      base_scores, base_gen = scores, gen
      continue
    prefill_drift = max(
      prefill_drift, float(np.abs(scores - base_scores).max())
    )
    n = min(len(gen), len(base_gen))
    generate_drift = max(
      generate_drift, float(np.abs(gen[:n] - base_gen[:n]).max())
    )
  return {
    "batches": list(batches),
    "prefill": prefill_drift,
    "generate": generate_drift,
  }


def table(report: dict, drifts: dict | None = None) -> str:
  """The comparison as text: medians per mode and slowdowns against the
  first; then each mode's drift across batch sizes, when given."""
  names = report["modes"]
  head = ["workload", *names, *(f"{n}/{names[0]}" for n in names[1:])]
  lines = [" | ".join(head)]
  for r in report["rows"]:
    cells = [f"{r['workload']} ({r['unit']})"]
    cells += [f"{r['median'][n]:.2f}" for n in names]
    cells += [f"{r['slowdown'][n]:.3f}x" for n in names[1:]]
    lines.append(" | ".join(cells))
  if drifts:
    lines.append("")
    lines.append("max |score difference| of one row across batch sizes:")
    for n, d in drifts.items():
      lines.append(
        f"  {n}: prefill {d['prefill']:.3g}, generate {d['generate']:.3g} "
        f"(batches {', '.join(map(str, d['batches']))})"
      )
  return "\n".join(lines)
