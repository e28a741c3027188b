"""Samples continuations of a file of prompts: resumable, on one machine or
many.

  python scripts/generate.py --input=prompts.jsonl --output=samples.jsonl \\
      --num_samples=4 --temperature=0.7 --top_p=0.95 --steps=128
  python scripts/generate.py --input=questions.txt --output=a.jsonl \\
      --shared_prefix=@fewshot.txt --stop='\\n' --temperature=0 --stream
  python scripts/generate.py --input=texts.txt --output=people.jsonl \\
      --json_schema=@person.json --budget_forcing --steps=64
  python scripts/generate.py --input=prompts.txt --output=chat.jsonl \\
      --adapters=chat=/ad/chat --adapter=chat

Constraints (one of --regex, --json_schema, --choices) are compiled once,
before any device work, and mask every sample's tokens on device (see
chunkwise/constraints); --budget_forcing closes each sample within --steps.

Input (see chunkwise/jobs/examples.py): JSON lines {"id", "prompt"}
("text" works too), or plain text, one prompt per line, its id the line
number. A prompt is the start of a sequence (after BOS), or continues
--shared_prefix, which is prefilled once for the whole job and read in
place by every sample. Samples run with continuous batching: --slots rows
decode side by side and a finished sample's row takes the next waiting
one, so long samples do not hold short ones back; --static_batching runs
batches of --batch_size prompts (each prefilled once, its --num_samples
rows attending to its KV cache) until their last sample stops. --stream
prints the first prompt's first sample when it finishes (as it grows
with --static_batching).

--speculate=ngram drafts tokens from each sample's prompt and tokens
(prompt lookup) and verifies --speculate_k of them in one pass: the samples
are those without it (bit for bit under invariant numerics), only sooner;
the summary reports drafts, accepted tokens and the acceptance rate
(--speculate=forced drafts only the tokens a constraint forces;
--speculate=draft drafts with the model's own weights in int8).

LoRA adapters (--adapters, a JSON line's "adapter", --adapter) work as in
scripts/score.py; samples of different adapters share the slots (with
--shared_prefix, continuous batching runs each adapter's samples in turn,
since one shared prefix serves one adapter).

Output: one JSON line per sample: id, sample, text, tokens, token_logprobs
(raw log-probs), finish_reason ("stop": a stop id, EOS included, or a
--stop string, which is cut off the text; "length": --steps ran out).
Samples follow the RNG contract: a sample's tokens depend only on
--seed, its example id and sample index, never on batching or processes.
Resuming and multi-host work as in scripts/score.py; from Python:
chunkwise.jobs.run_generate(GenerateJob(...)).
"""

from __future__ import annotations

from absl import app, flags

from chunkwise.constraints.constraint import WHITESPACE
from chunkwise.jobs import (
  GenerateJob,
  cli,
  job_flags,
  run_generate,
  sampling_flags,
)

JOB = job_flags.JobFlags()
SAMPLING = sampling_flags.SamplingFlags()
_NUM_SAMPLES = flags.DEFINE_integer(
  "num_samples", 1, "Samples per prompt.", lower_bound=1
)
_STEPS = flags.DEFINE_integer(
  "steps", 64, "Most tokens to generate per sample.", lower_bound=1
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
_SCHEMA_STRICT = flags.DEFINE_bool(
  "schema_strict",
  False,
  "With --json_schema: refuse any keyword generation cannot enforce in full "
  "(by default such keywords are checked after generation: each record "
  "says schema_valid and schema_error).",
)
_SCHEMA_WHITESPACE = flags.DEFINE_enum(
  "schema_whitespace",
  "flexible",
  list(WHITESPACE),
  "With --json_schema: the whitespace between JSON's tokens: flexible (one "
  "optional space) or compact (none: every key and separator a forced run).",
)
_FAST_FORWARD = flags.DEFINE_bool(
  "fast_forward",
  False,
  "With a constraint: one spelling of each run of forced bytes, so its "
  "tokens are forced; with --speculate, each run is appended in one pass "
  "(the same tokens as stepping).",
)
_CHOICES = flags.DEFINE_list(
  "choices", None, "Constrain every sample to one of these strings."
)
_BUDGET_FORCING = flags.DEFINE_bool(
  "budget_forcing",
  False,
  "With a constraint: steer each sample to close (and stop) within --steps.",
)

_SLOTS = flags.DEFINE_integer(
  "slots",
  None,
  "Continuous batching (the default): samples decode in this many rows "
  "(default: --batch_size), a finished sample's row taking the next one.",
  lower_bound=1,
)
_STATIC_BATCHING = flags.DEFINE_bool(
  "static_batching",
  False,
  "Run batches of --batch_size prompts until their last sample stops "
  "(before continuous batching, the only way; --stream then prints the "
  "first sample as it grows, not when it finishes).",
)
_KV_PAGES = flags.DEFINE_integer(
  "kv_pages",
  0,
  "Hold the slots' K/V in one pool of this many pages (paged K/V, one "
  "device): samples are admitted as their pages fit, so --slots can exceed "
  "what fixed rows of the longest sample's columns would fit (0: fixed "
  "slots).",
  lower_bound=0,
)
_PREFIX_CACHE_MB = flags.DEFINE_integer(
  "prefix_cache_mb",
  0,
  "MiB of K/V of prompts' full pages kept during the run: a prompt (or "
  "another sample of it) that starts like an earlier one prefills only the "
  "rest (continuous batching; 0: none).",
  lower_bound=0,
)


SPECULATE = sampling_flags.SpeculationFlags()


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


def stop_ids() -> list[int]:
  ids = []
  for value in _STOP_IDS.value:
    try:
      ids.append(int(value))
    except ValueError:
      raise app.UsageError(f"--stop_ids: {value!r} is not an integer") from None
  return ids


def generate() -> None:
  fields = JOB.fields()
  job = GenerateJob(
    **fields,
    num_samples=_NUM_SAMPLES.value,
    steps=_STEPS.value,
    sampling=SAMPLING.sampling(),
    stop=stop_strings(),
    stop_ids=stop_ids(),
    stream=_STREAM.value,
    regex=_REGEX.value,
    json_schema=_JSON_SCHEMA.value,
    choices=_CHOICES.value,
    budget_forcing=_BUDGET_FORCING.value,
    schema_strict=_SCHEMA_STRICT.value,
    schema_whitespace=_SCHEMA_WHITESPACE.value,
    fast_forward=_FAST_FORWARD.value,
    slots=_SLOTS.value,
    static_batching=_STATIC_BATCHING.value,
    speculation=SPECULATE.speculation(),
    prefix_cache_mb=_PREFIX_CACHE_MB.value,
    kv_pages=_KV_PAGES.value,
  )
  cli.report(run_generate(job))


main = cli.main(generate)

if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
