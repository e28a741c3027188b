"""Structured generation on a directory of JSON schemas: what is accepted,
what comes out valid, how long compiling takes, how fast it decodes.

  python scripts/schema_coverage.py --data=DIR --limit=30 --output=cov.json

DIR holds one schema per file (`*.json`), either directly or in one
subdirectory per category (e.g. JSONSchemaBench's `data/`: Github_easy,
Kubernetes, Snowplow, ...). For each category, the first `--limit` files
in name order are each turned into a `JsonSchema` constraint and compiled
for the model's vocabulary ("accepted" when both succeed); the accepted
ones are generated greedily, `--batch` schemas per call (one constraint
per row), with budget forcing within `--steps`, after a chat prompt that
shows the schema; every output is validated against the original schema
(`JsonSchema.validate`: a validator of the schema's draft, formats
asserted). The report gives, per category: schemas, accepted, valid (of
all schemas), median compile seconds, decode tokens/s of the batched
calls, and the most common causes of refusal and of invalid outputs.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import statistics
import time
from collections.abc import Sequence

import numpy as np
from absl import app, flags

import chunkwise as cw
from chunkwise import checkpoints
from chunkwise.constraints import disk_cache

_DATA = flags.DEFINE_string(
  "data", None, "Directory of schemas.", required=True
)
_MODEL = flags.DEFINE_string(
  "model", "smollm2-135m", "Model name or path, or random:<preset>."
)
_LIMIT = flags.DEFINE_integer("limit", 30, "Schemas per category (name order).")
_CATEGORIES = flags.DEFINE_list(
  "categories", None, "Subdirectories to run (default: every one)."
)
_STEPS = flags.DEFINE_integer(
  "steps",
  256,
  "Most tokens per output (more for a batch where a schema's shortest "
  "output needs more).",
)
_BATCH = flags.DEFINE_integer("batch", 8, "Schemas generated per call.")
_TIME_LIMIT = flags.DEFINE_float("time_limit_s", 30.0, "Compile limit each.")
_PROMPT_CHARS = flags.DEFINE_integer(
  "prompt_chars", 1500, "Schema text shown in the prompt (cut beyond)."
)
_STRICT = flags.DEFINE_bool("strict", False, "JsonSchema(strict=True).")
_OUTPUT = flags.DEFINE_string("output", None, "JSON report (optional).")
_DISK_CACHE = flags.DEFINE_bool(
  "disk_cache",
  False,
  "Read compiled tables from the on-disk cache (default: time every build "
  "from scratch).",
)


def categories(root: str) -> dict[str, list[str]]:
  """{category: schema files, sorted}; files directly in `root` form one
  category named after it."""
  out = {}
  direct = sorted(f for f in os.listdir(root) if f.endswith(".json"))
  if direct:
    out[os.path.basename(os.path.normpath(root))] = [
      os.path.join(root, f) for f in direct
    ]
  for name in sorted(os.listdir(root)):
    sub = os.path.join(root, name)
    if os.path.isdir(sub):
      files = sorted(f for f in os.listdir(sub) if f.endswith(".json"))
      if files:
        out[name] = [os.path.join(sub, f) for f in files]
  return out


def cause(message: str) -> str:
  """A refusal's message reduced to its kind (paths, names and values
  dropped), so causes can be counted."""
  message = re.sub(r"#[^\s:]*", "#", message)
  message = re.sub(r"'[^']*'", "'…'", message)
  message = re.sub(r"[0-9]+", "N", message)
  return message[:160]


def _prompt(model, text: str) -> list[int]:
  shown = (
    text
    if len(text) <= _PROMPT_CHARS.value
    else (text[: _PROMPT_CHARS.value] + " ...")
  )
  ask = f"Write one JSON value valid under this JSON schema:\n{shown}"
  vocab = model.vocab
  if getattr(vocab, "chat_template", None) is not None:
    chat = vocab.apply_chat_template(
      [{"role": "user", "content": ask}], add_generation_prompt=True
    )
    return [model.bos_id, *vocab.encode(chat)]
  return [model.bos_id, *vocab.encode(ask + "\n")]


def run_category(model, files: Sequence[str]) -> dict:
  refusals = collections.Counter()
  invalid = collections.Counter()
  outcomes = []
  compile_s = []
  accepted = []
  for path in files:
    start = time.perf_counter()
    try:
      c = cw.constraints.JsonSchema.from_file(
        path, strict=_STRICT.value, time_limit_s=_TIME_LIMIT.value
      )
      with contextlib.nullcontext() if _DISK_CACHE.value else disk_cache.off():
        table = c.compile(
          model.vocab, stop_ids=list(model.eos_ids), width=model.hparams.vocab
        )
    except ValueError as e:
      refusals[cause(str(e).removeprefix(f"{path}: "))] += 1
      outcomes.append({"file": path, "refused": str(e)[:300]})
      continue
    compile_s.append(time.perf_counter() - start)
    with open(path, encoding="utf-8") as f:
      # Tokens its shortest output needs, and a stop.
      accepted.append((c, f.read(), int(table.distance[0]) + 1))
  valid = 0
  tokens = 0
  decode_s = 0.0
  for i in range(0, len(accepted), _BATCH.value):
    group = accepted[i : i + _BATCH.value]
    prompts = cw.Chunk.from_lists(
      [_prompt(model, text) for _, text, _ in group]
    )
    start = time.perf_counter()
    prefix = model.prefill(prompts)
    out, _ = model.generate(
      [prefix],
      sample_ids=np.arange(len(group)),
      # Room for the longest of the shortest outputs, and some.
      steps=max(_STEPS.value, max(need for _, _, need in group) + 32),
      sampling=cw.Sampling(temperature=0.0),
      constraint=[c for c, _, _ in group],
      budget_forcing=True,
    )
    lengths = np.asarray(out.lengths)
    decode_s += time.perf_counter() - start
    tokens += int(lengths.sum())
    for row, (c, _, _) in enumerate(group):
      ids = np.asarray(out.tokens[row, : lengths[row]]).tolist()
      text = model.vocab.decode(ids)
      check = c.validate(text)
      outcomes.append(
        {"file": c.source, "text": text[:300], "error": check.error}
      )
      if check.valid:
        valid += 1
      else:
        invalid[cause(check.error)] += 1
  return {
    "schemas": len(files),
    "accepted": len(accepted),
    "valid": valid,
    "median_compile_s": statistics.median(compile_s) if compile_s else None,
    "tokens_per_s": tokens / decode_s if decode_s else None,
    "refusals": refusals.most_common(5),
    "invalid": invalid.most_common(5),
    "outcomes": outcomes,
  }


def main(argv: Sequence[str]) -> None:
  del argv
  name = _MODEL.value
  if name.startswith(checkpoints.RANDOM):  # random weights, for tests
    described = checkpoints.describe_random(name)
    model = cw.InferenceModel.random(
      described.hparams, seed=0, vocab=described.vocab
    )
  else:
    model = cw.load(name)
  report = {}
  print(
    f"{'category':<18} {'schemas':>7} {'accepted':>9} {'valid':>7} "
    f"{'compile s':>9} {'tok/s':>7}"
  )
  found = categories(_DATA.value)
  chosen = _CATEGORIES.value or list(found)
  unknown = sorted(set(chosen) - set(found))
  if unknown:
    raise app.UsageError(
      f"--categories: no schemas in {', '.join(unknown)} under "
      f"{_DATA.value} (found: {', '.join(found) or 'none'})"
    )
  for name in chosen:
    files = found[name]
    r = run_category(model, files[: _LIMIT.value])
    report[name] = r
    n = r["schemas"]
    compile_s = r["median_compile_s"]
    rate = r["tokens_per_s"]
    print(
      f"{name:<18} {n:>7} {r['accepted'] / n:>9.0%} {r['valid'] / n:>7.0%} "
      f"{'-' if compile_s is None else f'{compile_s:.2f}':>9} "
      f"{'-' if rate is None else f'{rate:.0f}':>7}",
      flush=True,
    )
    for kind, counts in (("refused", r["refusals"]), ("invalid", r["invalid"])):
      for text, count in counts:
        print(f"    {kind} x{count}: {text}")
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  app.run(main)
