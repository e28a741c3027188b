"""Structured generation on a directory of JSON schemas: what is accepted,
what comes out valid, how long compiling takes, how fast it decodes;
chunkwise beside xgrammar and llguidance on the same sample and model.

  python scripts/schema_coverage.py --data=DIR --limit=30 --seed=0 \
    --engines=chunkwise,xgrammar,llguidance --output=cov.json

DIR holds one schema per file (`*.json`), either directly or in one
subdirectory per category (e.g. JSONSchemaBench's `data/`: Github_easy,
Kubernetes, Snowplow, ...). For each category, `--limit` files are drawn
at random (`random.Random(f"{seed}:{category}")`, so a category's sample
depends only on the seed, which is printed) and each engine turns each
into its constraint ("accepted" when that succeeds):

* chunkwise: a `JsonSchema` compiled for the model's vocabulary, then
  generated greedily, `--batch` schemas per call (one constraint per
  row), with budget forcing within `--steps`;
* xgrammar / llguidance (`chunkwise.bench.schema_coverage`): their JSON
  schema compilers with default options, masking `transformers` running
  the same weights, greedy, `--batch` rows per call, `--steps` tokens.

Every engine gets the same chat prompt showing the schema, and every
output is validated against the original schema (`schema.validate`: a
validator of the schema's draft, formats asserted). The report gives,
per category and engine: schemas, accepted, valid (of all schemas),
median compile seconds, decode tokens/s (chunkwise's JAX loop against
the peers' transformers loop: not a like-for-like speed comparison), and
the most common causes of refusal and of invalid outputs.
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
from chunkwise.bench import schema_coverage
from chunkwise.constraints import constraint as constraint_lib
from chunkwise.constraints import disk_cache
from chunkwise.constraints import schema as schema_lib

ENGINES = ("chunkwise", "xgrammar", "llguidance")

_DATA = flags.DEFINE_string(
  "data", None, "Directory of schemas.", required=True
)
_MODEL = flags.DEFINE_string(
  "model", "smollm2-135m", "Model name or path, or random:<preset>."
)
_ENGINES = flags.DEFINE_list(
  "engines",
  ["chunkwise"],
  f"Engines to run, each on the same sample: any of {', '.join(ENGINES)}.",
)
_LIMIT = flags.DEFINE_integer(
  "limit", 30, "Schemas per category: a random sample (all when fewer)."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the sample.")
_CATEGORIES = flags.DEFINE_list(
  "categories", None, "Subdirectories to run (default: every one)."
)
_STEPS = flags.DEFINE_integer(
  "steps",
  256,
  "Most tokens per output (chunkwise: more for a batch where a schema's "
  "shortest output needs more).",
)
_BATCH = flags.DEFINE_integer("batch", 8, "Schemas generated per call.")
_TIME_LIMIT = flags.DEFINE_float(
  "time_limit_s", 30.0, "chunkwise's compile limit each."
)
_PROMPT_CHARS = flags.DEFINE_integer(
  "prompt_chars", 1500, "Schema text shown in the prompt (cut beyond)."
)
_STRICT = flags.DEFINE_bool("strict", False, "JsonSchema(strict=True).")
_OUTPUT = flags.DEFINE_string("output", None, "JSON report (optional).")
_COMPILE_ONLY = flags.DEFINE_bool(
  "compile_only",
  False,
  "Compile every schema and report compile times only (no generation).",
)
_TABLES = flags.DEFINE_enum(
  "constraint_tables",
  "lazy",
  ["lazy", "eager"],
  "How chunkwise compiles: lazy (a DFA over bytes, the default) or eager "
  "(the old states x vocabulary tables), to compare the two.",
)
_DISK_CACHE = flags.DEFINE_bool(
  "disk_cache",
  False,
  "Read chunkwise's compiled tables from the on-disk cache (default: time "
  "every build from scratch).",
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


class Chunkwise:
  """`JsonSchema` tables and `model.generate` with budget forcing."""

  name = "chunkwise"

  def __init__(self, model):
    self.model = model

  def compile(self, path: str, text: str):
    model = self.model
    c = cw.constraints.JsonSchema(
      text, source=path, strict=_STRICT.value, time_limit_s=_TIME_LIMIT.value
    )
    with contextlib.nullcontext() if _DISK_CACHE.value else disk_cache.off():
      table = c.compile(
        model.vocab, stop_ids=list(model.eos_ids), width=model.hparams.vocab
      )
    # The constraint, and the tokens its shortest output needs and a stop.
    return c, int(table.distance[0]) + 1

  def generate(self, prompts, compiled) -> list[list[int]]:
    model = self.model
    prefix = model.prefill(cw.Chunk.from_lists(prompts))
    out, _ = model.generate(
      [prefix],
      sample_ids=np.arange(len(prompts)),
      # Room for the longest of the shortest outputs, and some.
      steps=max(_STEPS.value, max(need for _, need in compiled) + 32),
      sampling=cw.Sampling(temperature=0.0),
      constraint=[c for c, _ in compiled],
      budget_forcing=True,
    )
    lengths = np.asarray(out.lengths)
    tokens = np.asarray(out.tokens)
    return [tokens[r, : lengths[r]].tolist() for r in range(len(prompts))]


class Peer:
  """xgrammar or llguidance masking `transformers` on the same weights."""

  def __init__(self, kind, model, hf, tokenizer):
    self.peer = kind(tokenizer, model.hparams.vocab, model.eos_ids)
    self.name = self.peer.name
    self.model, self.hf = model, hf

  def compile(self, path: str, text: str):
    del path
    return self.peer.compile(text)

  def generate(self, prompts, compiled) -> list[list[int]]:
    return schema_coverage.hf_generate(
      self.hf,
      prompts,
      self.peer,
      compiled,
      steps=_STEPS.value,
      eos_ids=self.model.eos_ids,
    )


def engines(model, names: Sequence[str]) -> list:
  out = []
  peers = [n for n in names if n != "chunkwise"]
  if peers:
    from chunkwise.bench import reference

    hf = reference.to_transformers(
      model.hparams, model.plain_weights(), "float32"
    )
    tokenizer = schema_coverage.hf_tokenizer(_MODEL.value)
  for name in names:
    if name == "chunkwise":
      out.append(Chunkwise(model))
    else:
      out.append(Peer(schema_coverage.PEERS[name], model, hf, tokenizer))
    # What a process does once (chunkwise: start its compile worker and
    # read the vocabulary's trie; a peer: its tokenizer's tables) is no
    # schema's compile: every engine compiles one trivial schema first.
    out[-1].compile("warm-up", '{"type": "integer"}')
  return out


def run_category(engine, model, files: Sequence[str]) -> dict:
  refusals = collections.Counter()
  invalid = collections.Counter()
  outcomes = []
  compile_s = []
  accepted = []
  for path in files:
    with open(path, encoding="utf-8") as f:
      text = f.read()
    start = time.perf_counter()
    try:
      compiled = engine.compile(path, text)
    except ValueError as e:
      refusals[cause(str(e).removeprefix(f"{path}: "))] += 1
      outcomes.append(
        {
          "file": path,
          "refused": str(e)[:300],
          "refuse_s": time.perf_counter() - start,
        }
      )
      continue
    compile_s.append(time.perf_counter() - start)
    accepted.append((path, text, compiled))
  valid = 0
  tokens = 0
  decode_s = 0.0
  if _COMPILE_ONLY.value:
    accepted_only = len(accepted)
    accepted = []
  for i in range(0, len(accepted), _BATCH.value):
    group = accepted[i : i + _BATCH.value]
    start = time.perf_counter()
    outputs = engine.generate(
      [_prompt(model, text) for _, text, _ in group],
      [compiled for _, _, compiled in group],
    )
    decode_s += time.perf_counter() - start
    for (path, schema_text, _), ids in zip(group, outputs, strict=True):
      tokens += len(ids)
      text = model.vocab.decode(ids)
      check = schema_lib.validate(schema_text, text)
      outcomes.append({"file": path, "text": text[:300], "error": check.error})
      if check.valid:
        valid += 1
      else:
        invalid[cause(check.error)] += 1
  if _COMPILE_ONLY.value:
    accepted = [None] * accepted_only
  return {
    "schemas": len(files),
    "accepted": len(accepted),
    "valid": valid,
    "median_compile_s": statistics.median(compile_s) if compile_s else None,
    "compile_s": compile_s,
    "tokens_per_s": tokens / decode_s if decode_s else None,
    "refusals": refusals.most_common(5),
    "invalid": invalid.most_common(5),
    "outcomes": outcomes,
  }


def main(argv: Sequence[str]) -> None:
  del argv
  unknown = sorted(set(_ENGINES.value) - set(ENGINES))
  if unknown or not _ENGINES.value:
    raise app.UsageError(
      f"--engines={','.join(_ENGINES.value)}: expected some of "
      f"{', '.join(ENGINES)}"
    )
  if _LIMIT.value < 1:
    raise app.UsageError(f"--limit={_LIMIT.value}: expected at least 1")
  found = categories(_DATA.value)
  chosen = _CATEGORIES.value or list(found)
  unknown = sorted(set(chosen) - set(found))
  if unknown:
    raise app.UsageError(
      f"--categories: no schemas in {', '.join(unknown)} under "
      f"{_DATA.value} (found: {', '.join(found) or 'none'})"
    )
  name = _MODEL.value
  if name.startswith(checkpoints.RANDOM):  # random weights, for tests
    described = checkpoints.describe_random(name)
    model = cw.InferenceModel.random(
      described.hparams, seed=0, vocab=described.vocab
    )
  else:
    model = cw.load(name)
  runners = engines(model, _ENGINES.value)
  with constraint_lib.tables_kind(_TABLES.value):
    run(runners, model, found, chosen)


def run(runners, model, found: dict, chosen: Sequence[str]) -> None:
  """Every engine on each chosen category's sample; prints the tables."""
  print(f"seed={_SEED.value}, {_LIMIT.value} schemas per category")
  print(
    f"{'category':<16} {'engine':<11} {'schemas':>7} {'accepted':>9} "
    f"{'valid':>7} {'compile s':>9} {'tok/s':>7}"
  )
  report = {"seed": _SEED.value, "limit": _LIMIT.value, "categories": {}}
  for category in chosen:
    files = schema_coverage.sample(
      found[category], _LIMIT.value, _SEED.value, category
    )
    report["categories"][category] = {}
    for engine in runners:
      r = run_category(engine, model, files)
      report["categories"][category][engine.name] = r
      n = r["schemas"]
      compile_s = r["median_compile_s"]
      rate = r["tokens_per_s"]
      print(
        f"{category:<16} {engine.name:<11} {n:>7} {r['accepted'] / n:>9.0%} "
        f"{r['valid'] / n:>7.0%} "
        f"{'-' if compile_s is None else f'{compile_s:.3f}':>9} "
        f"{'-' if rate is None else f'{rate:.0f}':>7}",
        flush=True,
      )
      for kind, counts in (
        ("refused", r["refusals"]),
        ("invalid", r["invalid"]),
      ):
        for text, count in counts:
          print(f"    {kind} x{count}: {text}")
      if _OUTPUT.value:  # after each category: a long run keeps its part
        with open(_OUTPUT.value, "w") as f:
          json.dump(report, f, indent=1)
  print(compile_table(report, runners))


def compile_table(report: dict, runners) -> str:
  """Compile seconds over every accepted schema of the run, per engine
  (p50 / p90 / p99 / max), and the seconds to each refusal."""
  lines = [
    f"{'engine':<11} {'compiled':>8} {'p50 ms':>8} {'p90 ms':>8} "
    f"{'p99 ms':>8} {'max ms':>8} {'refused':>7} {'max refusal ms':>14}"
  ]
  for engine in runners:
    rows = [c[engine.name] for c in report["categories"].values()]
    times = sorted(t for r in rows for t in r["compile_s"])
    refusals = [
      o["refuse_s"] for r in rows for o in r["outcomes"] if "refuse_s" in o
    ]
    if not times:
      continue
    q = np.quantile(np.asarray(times) * 1e3, [0.5, 0.9, 0.99, 1.0])
    worst = f"{max(refusals) * 1e3:.0f}" if refusals else "-"
    lines.append(
      f"{engine.name:<11} {len(times):>8} {q[0]:>8.1f} {q[1]:>8.1f} "
      f"{q[2]:>8.1f} {q[3]:>8.1f} {len(refusals):>7} {worst:>14}"
    )
  return "\n".join(lines)


if __name__ == "__main__":
  app.run(main)
