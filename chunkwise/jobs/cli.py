"""absl flags for the batch-job scripts, parsed into `chunkwise.jobs` configs.

  JOB = cli.JobFlags()           # at import: --model ... --input ... flags
  SAMPLING = cli.SamplingFlags() # --temperature --top_k --top_p ...

  def score():
    cli.report(run_score(ScoreJob(**JOB.fields(), top_n=...)))

  main = cli.main(score)         # for app.run(main, flags_parser=...)

Flags are registered when a script creates a group, never when this module
is imported. Every job error (`driver.JobError`, or a ValueError from a
config) exits 1 with one line naming the bad value; the job itself lives
in `chunkwise.jobs` and runs the same from Python.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence

from absl import app, flags, logging

from chunkwise.inference import Sampling, Speculation
from chunkwise.jobs import examples
from chunkwise.jobs.config import (
  InputFormat,
  ModelConfig,
  MultiHost,
  Quantization,
  WeightDtype,
)
from chunkwise.jobs.seqio_input import SeqioInput
from chunkwise.models.kv_int8 import DTYPES as KV_DTYPES
from chunkwise.numerics import NUMERICS
from chunkwise.precision import PRECISIONS


def fail(message: str) -> None:
  """Exits with a one-line reason."""
  print(f"{sys.argv[0].rsplit('/', 1)[-1]}: {message}", file=sys.stderr)
  sys.exit(1)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with one line for a bad flag (`app.run`'s
  `flags_parser`)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(f"bad flag: {e}")


def _define(define, name: str, default, *args, **kwargs) -> flags.FlagHolder:
  """`define(name, default, ...)`, or the flag already defined under `name`
  with the same default (two job scripts loaded in one process, as in the
  tests, share their common flags)."""
  if name not in flags.FLAGS:
    return define(name, default, *args, **kwargs)
  flag = flags.FLAGS[name]
  if flag.default != default:
    raise ValueError(
      f"flag --{name} is already defined with default {flag.default!r}, "
      f"not {default!r}"
    )
  return flags.FlagHolder(flags.FLAGS, flag)


def _validate(name: str, check, message: str) -> None:
  """Registers a validator once per flag and message."""
  key = (name, message)
  if key not in _VALIDATED:
    _VALIDATED.add(key)
    flags.register_validator(name, check, message)


_VALIDATED: set[tuple[str, str]] = set()


class ModelFlags:
  """--model, --layout, --mesh, --dtype, --quantize, --precision,
  --numerics, --kv_dtype, --adapters."""

  def __init__(self):
    self.model = _define(
      flags.DEFINE_string,
      "model",
      "smollm2-135m",
      "A model name, a .gguf file, a Hugging Face or chunkwise checkpoint "
      "directory, or random:<preset> (random weights, for tests).",
    )
    self.layout = _define(
      flags.DEFINE_string,
      "layout",
      "reference",
      "Layout, e.g. ws_2d/yz/latency, or auto: the planner's choice for the "
      "mesh and --batch_size (see README).",
    )
    self.mesh = _define(
      flags.DEFINE_string,
      "mesh",
      None,
      "Mesh shape XxYxZ, e.g. 2x2x2 (default: 1x1x<all devices> for a "
      "sharded layout).",
    )
    self.dtype = _define(
      flags.DEFINE_enum,
      "dtype",
      None,
      [d.value for d in WeightDtype],
      "Float weights' dtype.",
    )
    self.quantize = _define(
      flags.DEFINE_enum,
      "quantize",
      "none",
      [q.value for q in Quantization],
      "Weight quantization.",
    )
    self.precision = _define(
      flags.DEFINE_enum,
      "precision",
      None,
      list(PRECISIONS),
      "Matmul precision (default: highest for f32, whose default is TF32 "
      "on GPUs; see chunkwise.precision).",
    )
    self.numerics = _define(
      flags.DEFINE_enum,
      "numerics",
      None,
      list(NUMERICS),
      "invariant: on the CPU a row's scores and tokens are bit-identical "
      "whatever shares its batch (default, except int8 weights: fast); "
      "fast: XLA's own reduction orders. See chunkwise.numerics.",
    )
    self.kv_dtype = _define(
      flags.DEFINE_enum,
      "kv_dtype",
      None,
      list(KV_DTYPES),
      "How K/V caches are stored (default: float32). int8: values with an "
      "f32 scale per token and head, 0.27x f32's bytes at head_dim 64, "
      "read by every attention path (chunkwise.models.kv_int8).",
    )
    self.adapters = _define(
      flags.DEFINE_string,
      "adapters",
      "",
      "LoRA adapters to serve besides the base model: name=path[,name=path"
      "...], each path a PEFT directory (adapter_config.json, "
      "adapter_model.safetensors). A JSON-lines example runs the one its "
      '"adapter" field names (null: the base model; absent: --adapter); '
      "examples of different adapters share batches. Read and checked "
      "before any device work; <output>.job.json records their checksums, "
      "so resuming with other adapter files is refused.",
    )

  def config(self) -> ModelConfig:
    return ModelConfig(
      name=self.model.value,
      layout=self.layout.value,
      mesh=self.mesh.value or None,
      dtype=self.dtype.value,
      quantize=self.quantize.value,
      precision=self.precision.value,
      numerics=self.numerics.value,
      kv_dtype=self.kv_dtype.value,
      adapters=self.adapters.value,
    )


class MultiHostFlags:
  """--coordinator_address, --num_processes, --process_id, --multihost,
  --cpu_devices: how this process joins a multi-process run."""

  def __init__(self):
    self.coordinator_address = _define(
      flags.DEFINE_string,
      "coordinator_address",
      None,
      "Multi-host: host:port of process 0.",
    )
    self.num_processes = _define(
      flags.DEFINE_integer,
      "num_processes",
      None,
      "Multi-host: how many processes.",
      lower_bound=1,
    )
    self.process_id = _define(
      flags.DEFINE_integer,
      "process_id",
      None,
      "Multi-host: this process's index.",
      lower_bound=0,
    )
    self.multihost = _define(
      flags.DEFINE_bool,
      "multihost",
      False,
      "Start jax.distributed with the platform's automatic detection (TPU "
      "pods, SLURM, ...) when --coordinator_address is not given.",
    )
    self.cpu_devices = _define(
      flags.DEFINE_integer,
      "cpu_devices",
      None,
      "Host CPU devices per process (tests run 2 processes x 4).",
      lower_bound=1,
    )

  def config(self) -> MultiHost:
    return MultiHost(
      coordinator_address=self.coordinator_address.value,
      num_processes=self.num_processes.value,
      process_id=self.process_id.value,
      auto=self.multihost.value,
      cpu_devices=self.cpu_devices.value,
    )


class JobFlags:
  """The flags every batch job takes: the model's (`ModelFlags`), input
  and output, batching, bad lines, progress and multi-host start-up."""

  def __init__(self):
    self.model = ModelFlags()
    self.input = _define(
      flags.DEFINE_string,
      "input",
      None,
      "Input file: JSON lines (.jsonl) or text, one per line (or "
      "--seqio_task / --seqio_mixture).",
    )
    self.seqio_task = _define(
      flags.DEFINE_string,
      "seqio_task",
      None,
      "A registered seqio Task to read instead of --input: its "
      "preprocessed 'inputs' (and, scoring, 'targets') token ids, in the "
      "model's vocabulary (chunkwise/jobs/seqio_input.py).",
    )
    self.seqio_mixture = _define(
      flags.DEFINE_string,
      "seqio_mixture",
      None,
      "A registered seqio Mixture: each of its Tasks in turn, ids "
      '"task:index".',
    )
    self.seqio_split = _define(
      flags.DEFINE_string,
      "seqio_split",
      "validation",
      "The split of --seqio_task / --seqio_mixture.",
    )
    self.seqio_module = _define(
      flags.DEFINE_string,
      "seqio_module",
      None,
      "A Python module imported first (it registers the seqio Tasks).",
    )
    self.input_format = _define(
      flags.DEFINE_enum,
      "input_format",
      "auto",
      [f.value for f in InputFormat],
      "auto: .jsonl/.ndjson/.json files are JSON lines, others plain text.",
    )
    self.output = _define(
      flags.DEFINE_string,
      "output",
      None,
      "Output JSON-lines file; a re-run skips the ids it holds.",
    )
    self.batch_size = _define(
      flags.DEFINE_integer,
      "batch_size",
      8,
      "Rows per device call (over all processes).",
      lower_bound=1,
    )
    self.max_len = _define(
      flags.DEFINE_integer,
      "max_len",
      None,
      "Longest sequence in tokens, shared prefix included (default: the "
      "model's max_len).",
      lower_bound=1,
    )
    self.shared_prefix = _define(
      flags.DEFINE_string,
      "shared_prefix",
      "",
      "Text (or @file) prefilled once as the start of every example (once "
      "per LoRA adapter the examples run).",
    )
    self.adapter = _define(
      flags.DEFINE_string,
      "adapter",
      None,
      "The LoRA adapter (a name from --adapters) of every example that names "
      'none: each line of a text input, each JSON line without an "adapter" '
      "field. Default: the base model.",
    )
    self.skip_bad_lines = _define(
      flags.DEFINE_bool,
      "skip_bad_lines",
      False,
      "Log, count and skip bad input lines instead of stopping.",
    )
    self.max_line_bytes = _define(
      flags.DEFINE_integer,
      "max_line_bytes",
      examples.MAX_LINE_BYTES,
      "Longest input line in bytes; longer lines are bad lines.",
      lower_bound=1,
    )
    self.max_json_depth = _define(
      flags.DEFINE_integer,
      "max_json_depth",
      examples.MAX_JSON_DEPTH,
      "Deepest JSON nesting of an input line; deeper lines are bad lines.",
      lower_bound=1,
    )
    self.progress = _define(
      flags.DEFINE_bool, "progress", True, "Show a progress bar."
    )
    self.hosts = MultiHostFlags()
    self.batch_delay_s = _define(
      flags.DEFINE_float,
      "batch_delay_s",
      0.0,
      "Sleep after each batch (throttling; the resume test uses it).",
      lower_bound=0.0,
    )

  def fields(self) -> dict:
    """The `Job` fields the flags give (keyword arguments of `ScoreJob` /
    `GenerateJob`); raises UsageError when --input or --output is
    missing."""
    if not self.output.value:
      raise app.UsageError("--output is required")
    seqio = None
    if self.seqio_task.value or self.seqio_mixture.value:
      seqio = SeqioInput(
        task=self.seqio_task.value or None,
        mixture=self.seqio_mixture.value or None,
        split=self.seqio_split.value,
        module=self.seqio_module.value or None,
      )
    elif not self.input.value:
      raise app.UsageError(
        "--input is required (or --seqio_task / --seqio_mixture)"
      )
    return dict(
      input=self.input.value or "",
      seqio=seqio,
      output=self.output.value,
      model=self.model.config(),
      input_format=self.input_format.value,
      batch_size=self.batch_size.value,
      max_len=self.max_len.value,
      shared_prefix=self.shared_prefix.value,
      adapter=self.adapter.value or None,
      skip_bad_lines=self.skip_bad_lines.value,
      max_line_bytes=self.max_line_bytes.value,
      max_json_depth=self.max_json_depth.value,
      progress=self.progress.value,
      batch_delay_s=self.batch_delay_s.value,
      multihost=self.hosts.config(),
    )


class SamplingFlags:
  """--temperature, --top_k, --top_p, --min_p, --seed: a `Sampling`."""

  def __init__(
    self,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed_help: str = "Sampling seed, in [0, 2**32).",
  ):
    self.temperature = _define(
      flags.DEFINE_float,
      "temperature",
      temperature,
      "Sampling temperature (0: greedy).",
      lower_bound=0.0,
    )
    self.top_k = _define(
      flags.DEFINE_integer,
      "top_k",
      0,
      "Keep the k most likely tokens (0: all).",
      lower_bound=0,
    )
    self.top_p = _define(
      flags.DEFINE_float,
      "top_p",
      top_p,
      "Nucleus mass, in (0, 1].",
      upper_bound=1.0,
    )
    self.min_p = _define(
      flags.DEFINE_float,
      "min_p",
      0.0,
      "Keep tokens at least min_p times as likely as the best, in [0, 1].",
      lower_bound=0.0,
      upper_bound=1.0,
    )
    self.seed = _define(
      flags.DEFINE_integer, "seed", 0, seed_help, lower_bound=0
    )
    _validate("top_p", lambda p: p > 0, "--top_p must be > 0")
    _validate("seed", lambda s: s < 2**32, "--seed must be < 2**32")

  def sampling(self) -> Sampling:
    return Sampling(
      temperature=self.temperature.value,
      top_k=self.top_k.value,
      top_p=self.top_p.value,
      min_p=self.min_p.value,
      seed=self.seed.value,
    )


class SpeculationFlags:
  """--speculate, --speculate_k: a `Speculation` (or None)."""

  def __init__(self):
    self.drafter = _define(
      flags.DEFINE_enum,
      "speculate",
      None,
      list(Speculation.DRAFTERS),
      "Speculative decoding: draft tokens and verify them in one pass; the "
      "tokens are those without it. ngram: prompt lookup (each sample's "
      "prompt and tokens); forced: only tokens a constraint forces; draft: "
      "the model's own weights in int8 (float weights only).",
    )
    self.k = _define(
      flags.DEFINE_integer,
      "speculate_k",
      8,
      "With --speculate: most tokens drafted per pass.",
      lower_bound=1,
      upper_bound=64,
    )

  def speculation(self) -> Speculation | None:
    if self.drafter.value is None:
      return None
    return Speculation(drafter=self.drafter.value, k=self.k.value)


def main(job: Callable[[], None]) -> Callable[[Sequence[str]], None]:
  """An absl main running `job`; a bad flag or a job error exits 1 with
  one line."""

  def run_main(argv: Sequence[str]) -> None:
    try:
      if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
      job()
    except (app.UsageError, ValueError) as e:
      fail(str(e))

  return run_main


def report(summary: dict | None) -> None:
  """Prints the summary as `summary {json}` and logs it (nothing on the
  processes other than 0, whose summary is None)."""
  if summary is None:
    return
  logging.info("summary: %s", summary)
  print("summary " + json.dumps(summary), flush=True)
