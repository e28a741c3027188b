"""Generation jobs: `run_generate` runs a whole `GenerateJob`, sampling
every prompt `num_samples` times (`samples`: continuous batching by
default, one batch at a time with `static_batching`; the records) into a
resumable output (`driver`).

  summary = run_generate(GenerateJob(input="prompts.txt", output="s.jsonl",
                                     num_samples=4, steps=64))

Before any device work the job's `--regex` / `--json_schema` /
`--choices` constraint is compiled (`constraint_of`) and its sampling
flags checked against the vocabulary. With `stream`, process 0 prints the
first prompt's first sample as it grows. The summary counts examples,
samples, tokens and finish reasons (with `--speculate`, the drafts'
acceptance too).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from chunkwise import constraints
from chunkwise.inference import Request, SpeculationStats, slot_capacity
from chunkwise.jobs import driver, examples, job_setup, loading
from chunkwise.jobs.config import GenerateJob
from chunkwise.jobs.examples import id_key
from chunkwise.jobs.samples import generate_batch, generate_items, record_key


def encode(described, prefix: list[int], example: examples.Example):
  """(row, 0): BOS (unless a shared prefix holds it), then the prompt."""
  head = [] if prefix else [described.bos_id]
  if example.ids is not None:  # seqio: the inputs' ids
    return head + list(example.ids), 0
  return head + list(described.vocab.encode(example.text)), 0


def constraint_of(job: GenerateJob, described):
  """The job's regex / json_schema / choices constraint (or None),
  compiled now so that a bad one stops the job before any device work."""
  given = [
    (name, value)
    for name, value in (
      ("regex", job.regex),
      ("json_schema", job.json_schema),
      ("choices", None if job.choices is None else list(job.choices)),
    )
    if value is not None
  ]
  if not given:
    for flag, on in (
      ("budget_forcing", job.budget_forcing),
      ("fast_forward", job.fast_forward),
    ):
      if on:
        raise job_setup.JobError(
          f"--{flag} needs --regex, --json_schema or --choices"
        )
    return None
  if len(given) > 1:
    raise job_setup.JobError(
      f"give one of --regex, --json_schema, --choices, got "
      f"{', '.join('--' + n for n, _ in given)}"
    )
  name, value = given[0]
  if job.schema_whitespace != "flexible" and name != "json_schema":
    raise job_setup.JobError(
      f"--schema_whitespace={job.schema_whitespace} needs --json_schema"
    )
  options = {"fast_forward": job.fast_forward}
  schema = {"strict": job.schema_strict, "whitespace": job.schema_whitespace}
  try:
    if name == "regex":
      c = constraints.Regex(value, **options)
    elif name == "json_schema" and value.startswith("@"):
      c = constraints.JsonSchema.from_file(value[1:], **schema, **options)
    elif name == "json_schema":
      c = constraints.JsonSchema(value, **schema, **options)
    else:
      c = constraints.Choice(value, **options)
    eos = list(described.eos_ids)
    c.compile(
      described.vocab,
      stop_ids=sorted(set(job.stop_ids) | set(eos)),
      width=described.hparams.vocab,
    )
  except (ValueError, FileNotFoundError) as e:
    raise job_setup.JobError(f"--{name}: {e}") from None
  return c


def summarize(
  setup: job_setup.Setup, run: driver.Run, speculation=None
) -> dict:
  """The job's summary; with `speculation` (this run's
  `SpeculationStats`), its counts, acceptance rate and length."""
  records = run.output.records()
  reasons = collections.Counter(r["finish_reason"] for r in records)
  mine = {id_key(setup.prepared[i].example.id) for i in run.todo}
  new = sum(len(r["tokens"]) for r in records if id_key(r["id"]) in mine)
  return driver.summary(
    setup,
    run,
    new_tokens=new,
    examples=len({id_key(r["id"]) for r in records}),
    samples=len(records),
    tokens=sum(len(r["tokens"]) for r in records),
    finish_reasons=dict(sorted(reasons.items())),
    **(
      {}
      if speculation is None
      else {
        "speculation": {
          **dataclasses.asdict(speculation),
          "acceptance_rate": round(speculation.acceptance_rate, 4),
          "mean_acceptance_length": round(
            speculation.mean_acceptance_length, 4
          ),
        }
      }
    ),
  )


def _print(text: str) -> None:
  print(text, end="", flush=True)


def run_generate(
  job: GenerateJob, *, emit: Callable[[str], None] = _print
) -> dict | None:
  """Samples every prompt of `job.input` into `job.output` (resumable,
  multi-host; see `driver`). With `job.stream`, process 0 passes the first
  prompt's first sample to `emit` as it grows (default: standard output).
  Returns the summary on process 0 (None on the others): examples,
  samples, tokens, finish reasons, and this run's counts and tokens/s.
  Raises `job_setup.JobError` (one line) before any device work for a bad
  job, input, constraint or output."""
  if not isinstance(job, GenerateJob):
    raise job_setup.JobError(f"run_generate needs a GenerateJob, got {job!r}")
  steps = job.steps
  setup = job_setup.setup(
    job, encode, reserved=steps, reserved_for=f"--steps={steps}"
  )
  vocab_size = setup.described.hparams.vocab
  if job.sampling.top_k > vocab_size:
    raise job_setup.JobError(
      f"--top_k={job.sampling.top_k} exceeds the vocabulary ({vocab_size})"
    )
  for i in job.stop_ids:
    if not 0 <= i < vocab_size:
      raise job_setup.JobError(
        f"--stop_ids: {i} is outside the vocabulary [0, {vocab_size})"
      )
  constrain = constraint_of(job, setup.described)
  first = setup.prepared[0].example.id
  counted = [SpeculationStats()]  # this run's speculation counts

  def on_stats(stats: SpeculationStats) -> None:
    counted[0] += stats

  def shown(text: str) -> None:
    if loading.is_main_process():
      emit(text)

  def run_batch(model, prefix, rows, batch):
    lead = [i for i, r in enumerate(rows) if r and r.example.id == first]
    # Every process runs the same (streamed) program; process 0 prints.
    stream = (lead[0], shown) if job.stream and lead else None
    out = generate_batch(
      model,
      rows,
      time=batch.time,
      num_samples=job.num_samples,
      steps=steps,
      sampling=job.sampling,
      prefix=prefix,
      stop_ids=list(job.stop_ids),
      stop_strings=list(job.stop),
      stream=stream,
      constraint=constrain,
      budget_forcing=job.budget_forcing,
      speculation=job.speculation,
      on_stats=on_stats,
    )
    if stream:
      shown("\n")
    return out

  slots = job.slots or job.batch_size
  capacity = slot_capacity(
    [Request(tokens=p.tokens, sample_id=0, steps=steps) for p in setup.prepared]
  )

  def run_items(model, prefix, work):
    return generate_items(
      model,
      prefix,
      work,
      slots=slots,
      capacity=capacity,
      steps=steps,
      sampling=job.sampling,
      stop_ids=list(job.stop_ids),
      stop_strings=list(job.stop),
      constraint=constrain,
      budget_forcing=job.budget_forcing,
      stream=(first, shown) if job.stream else None,
      speculation=job.speculation,
      on_stats=on_stats,
      prefix_cache_bytes=job.prefix_cache_mb << 20,
      kv_pages=job.kv_pages,
    )

  continuous = not job.static_batching
  sampling = job.sampling
  run = driver.run(
    setup,
    keys=lambda p: [id_key([p.example.id, s]) for s in range(job.num_samples)],
    run_batch=None if continuous else run_batch,
    run_items=run_items if continuous else None,
    reserved=steps,
    record_key=record_key,
    settings={
      # Absent with static batching, so its outputs begun before
      # continuous batching still resume.
      **({"slots": slots} if continuous else {}),
      "script": "generate",
      "num_samples": job.num_samples,
      "steps": steps,
      "temperature": sampling.temperature,
      "top_k": sampling.top_k,
      "top_p": sampling.top_p,
      "min_p": sampling.min_p,
      "seed": sampling.seed,
      "stop": list(job.stop),
      "stop_ids": list(job.stop_ids),
      "constraint": None if constrain is None else constrain.regex(),
      "budget_forcing": job.budget_forcing,
      # Absent when off, so outputs begun before the option still resume.
      **({"fast_forward": True} if job.fast_forward else {}),
    },
  )
  if run.process:
    return None
  return summarize(setup, run, job.speculation and counted[0])
