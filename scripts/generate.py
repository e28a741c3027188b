"""Samples continuations of a file of prompts: resumable, on one machine or
many.

  python scripts/generate.py --input=prompts.jsonl --output=samples.jsonl \\
      --num_samples=4 --temperature=0.7 --top_p=0.95 --steps=128
  python scripts/generate.py --input=questions.txt --output=a.jsonl \\
      --shared_prefix=@fewshot.txt --stop='\\n' --temperature=0 --stream
  python scripts/generate.py --input=texts.txt --output=people.jsonl \\
      --json_schema=@person.json --budget_forcing --steps=64

Constraints (one of --regex, --json_schema, --choices) are compiled once,
before any device work, and mask every sample's tokens on device (see
chunkwise/constraints); --budget_forcing closes each sample within --steps.

Input (see chunkwise/jobs/examples.py): JSON lines {"id", "prompt"}
("text" works too), or plain text, one prompt per line, its id the line
number. A prompt is the start of a sequence (after BOS), or continues
--shared_prefix, which is prefilled once for the whole job. Each prompt is
prefilled once and its --num_samples rows attend to its KV cache.

Output: one JSON line per sample: id, sample, text, tokens, token_logprobs
(raw log-probs), finish_reason ("stop": a stop id, EOS included, or a
--stop string, which is cut off the text; "length": --steps ran out).
Samples follow the RNG contract: a sample's tokens depend only on
--seed, its example id and sample index, never on batching or processes.
Resuming and multi-host work as in scripts/score.py.
"""

from __future__ import annotations

import collections

from absl import app, flags

from chunkwise import constraints
from chunkwise.inference import Sampling
from chunkwise.jobs import cli, examples, generation

_NUM_SAMPLES = flags.DEFINE_integer(
  "num_samples", 1, "Samples per prompt.", lower_bound=1
)
_STEPS = flags.DEFINE_integer(
  "steps", 64, "Most tokens to generate per sample.", lower_bound=1
)
_TEMPERATURE = flags.DEFINE_float(
  "temperature", 1.0, "Sampling temperature (0: greedy).", lower_bound=0.0
)
_TOP_K = flags.DEFINE_integer(
  "top_k", 0, "Keep the k most likely tokens (0: all).", lower_bound=0
)
_TOP_P = flags.DEFINE_float(
  "top_p", 1.0, "Nucleus mass, in (0, 1].", upper_bound=1.0
)
_MIN_P = flags.DEFINE_float(
  "min_p",
  0.0,
  "Keep tokens at least min_p times as likely as the best, in [0, 1].",
  lower_bound=0.0,
  upper_bound=1.0,
)
_SEED = flags.DEFINE_integer(
  "seed", 0, "Sampling seed, in [0, 2**32).", lower_bound=0
)
_STOP = flags.DEFINE_multi_string(
  "stop", [], "A string that ends a sample (repeat the flag); '\\n' etc."
)
_STOP_IDS = flags.DEFINE_list(
  "stop_ids", [], "Token ids that end a sample (EOS always does)."
)
_STREAM = flags.DEFINE_bool(
  "stream", False, "Print the first prompt's first sample as it grows."
)
_REGEX = flags.DEFINE_string(
  "regex", None, "Constrain every sample to match this regex (Rust syntax)."
)
_JSON_SCHEMA = flags.DEFINE_string(
  "json_schema",
  None,
  "Constrain every sample to JSON valid under this schema (text or @file).",
)
_CHOICES = flags.DEFINE_list(
  "choices", None, "Constrain every sample to one of these strings."
)
_BUDGET_FORCING = flags.DEFINE_bool(
  "budget_forcing",
  False,
  "With a constraint: steer each sample to close (and stop) within --steps.",
)
flags.register_validator("top_p", lambda p: p > 0, "--top_p must be > 0")
flags.register_validator("seed", lambda s: s < 2**32, "--seed must be < 2**32")


def encode(described, prefix: list[int], example: examples.Example):
  """(row, 0): BOS (unless a shared prefix holds it), then the prompt."""
  head = [] if prefix else [described.bos_id]
  return head + list(described.vocab.encode(example.text)), 0


def keys(p: examples.Prepared) -> list[str]:
  return [examples.id_key([p.example.id, s]) for s in range(_NUM_SAMPLES.value)]


def record_key(record: dict) -> str:
  """(id, sample); KeyError for a record that is not a sample."""
  if "finish_reason" not in record:
    raise KeyError("finish_reason")
  return examples.id_key([record["id"], record["sample"]])


def stop_strings() -> list[str]:
  """--stop values, with backslash escapes (\\n, \\t) decoded."""
  out = []
  for value in _STOP.value:
    try:
      text = value.encode("latin-1", "backslashreplace").decode(
        "unicode_escape"
      )
    except UnicodeDecodeError as e:
      raise app.UsageError(
        f"--stop={value!r}: bad escape ({e.reason})"
      ) from None
    if not text:
      raise app.UsageError(f"--stop={value!r} is empty")
    out.append(text)
  return out


def stop_ids(vocab_size: int) -> list[int]:
  ids = []
  for value in _STOP_IDS.value:
    try:
      ids.append(int(value))
    except ValueError:
      raise app.UsageError(f"--stop_ids: {value!r} is not an integer") from None
    if not 0 <= ids[-1] < vocab_size:
      raise app.UsageError(
        f"--stop_ids: {value} is outside the vocabulary [0, {vocab_size})"
      )
  return ids


def constraint(described, stops: list[int]):
  """The --regex / --json_schema / --choices constraint (or None), compiled
  now so that a bad one is a usage error before any device work."""
  given = [
    (name, value)
    for name, value in (
      ("regex", _REGEX.value),
      ("json_schema", _JSON_SCHEMA.value),
      ("choices", _CHOICES.value),
    )
    if value is not None
  ]
  if not given:
    if _BUDGET_FORCING.value:
      raise app.UsageError(
        "--budget_forcing needs --regex, --json_schema or --choices"
      )
    return None
  if len(given) > 1:
    raise app.UsageError(
      f"give one of --regex, --json_schema, --choices, got "
      f"{', '.join('--' + n for n, _ in given)}"
    )
  name, value = given[0]
  try:
    if name == "regex":
      c = constraints.Regex(value)
    elif name == "json_schema" and value.startswith("@"):
      c = constraints.JsonSchema.from_file(value[1:])
    elif name == "json_schema":
      c = constraints.JsonSchema(value)
    else:
      c = constraints.Choice(value)
    eos = [] if described.eos_id is None else [described.eos_id]
    c.compile(
      described.vocab,
      stop_ids=sorted(set(stops + eos)),
      width=described.hparams.vocab,
    )
  except (ValueError, FileNotFoundError) as e:
    raise app.UsageError(f"--{name}: {e}") from None
  return c


def summarize(setup: cli.Setup, run: cli.Run) -> dict:
  records = run.output.records()
  reasons = collections.Counter(r["finish_reason"] for r in records)
  mine = {examples.id_key(setup.prepared[i].example.id) for i in run.todo}
  new = sum(
    len(r["tokens"]) for r in records if examples.id_key(r["id"]) in mine
  )
  return cli.summary(
    setup,
    run,
    new_tokens=new,
    examples=len({examples.id_key(r["id"]) for r in records}),
    samples=len(records),
    tokens=sum(len(r["tokens"]) for r in records),
    finish_reasons=dict(sorted(reasons.items())),
  )


def generate() -> None:
  steps = _STEPS.value
  setup = cli.setup(
    examples.GENERATE,
    encode,
    reserved=steps,
    reserved_for=f"--steps={steps}",
  )
  vocab_size = setup.described.hparams.vocab
  if _TOP_K.value > vocab_size:
    raise app.UsageError(
      f"--top_k={_TOP_K.value} exceeds the vocabulary ({vocab_size})"
    )
  stops, ids = stop_strings(), stop_ids(vocab_size)
  constrain = constraint(setup.described, ids)
  sampling = Sampling(
    temperature=_TEMPERATURE.value,
    top_k=_TOP_K.value,
    top_p=_TOP_P.value,
    min_p=_MIN_P.value,
    seed=_SEED.value,
  )
  first = setup.prepared[0].example.id

  def emit(text: str) -> None:
    if cli.is_main_process():
      print(text, end="", flush=True)

  def run_batch(model, prefix, rows, batch):
    lead = [i for i, r in enumerate(rows) if r and r.example.id == first]
    # Every process runs the same (streamed) program; process 0 prints.
    stream = (lead[0], emit) if _STREAM.value and lead else None
    out = generation.generate_batch(
      model,
      rows,
      time=batch.time,
      num_samples=_NUM_SAMPLES.value,
      steps=steps,
      sampling=sampling,
      prefix=prefix,
      stop_ids=ids,
      stop_strings=stops,
      stream=stream,
      constraint=constrain,
      budget_forcing=_BUDGET_FORCING.value,
    )
    if stream:
      emit("\n")
    return out

  run = cli.run(
    setup,
    keys=keys,
    run_batch=run_batch,
    reserved=steps,
    record_key=record_key,
    settings={
      "script": "generate",
      "num_samples": _NUM_SAMPLES.value,
      "steps": steps,
      "temperature": _TEMPERATURE.value,
      "top_k": _TOP_K.value,
      "top_p": _TOP_P.value,
      "min_p": _MIN_P.value,
      "seed": _SEED.value,
      "stop": stops,
      "stop_ids": ids,
      "constraint": None if constrain is None else constrain.regex(),
      "budget_forcing": _BUDGET_FORCING.value,
    },
  )
  if run.process == 0:
    cli.report(summarize(setup, run))


main = cli.main(generate)

if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
