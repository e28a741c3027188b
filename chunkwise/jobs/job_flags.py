"""The flags every batch job takes, parsed into a job's fields: the
model's (`model_flags`), the input (a file or a seqio Task / Mixture) and
output, batching and lengths, the shared prefix and adapter, bad lines,
progress and multi-host start-up.

  JOB = job_flags.JobFlags()  # at import: defines the flags
  job = ScoreJob(**JOB.fields(), top_n=...)
"""

from __future__ import annotations

from absl import app, flags

from chunkwise.jobs import cli, examples
from chunkwise.jobs.config import InputFormat
from chunkwise.jobs.model_flags import ModelFlags, MultiHostFlags
from chunkwise.jobs.seqio_input import SeqioInput


class JobFlags:
  """The flags every batch job takes: the model's (`ModelFlags`), input
  and output, batching, bad lines, progress and multi-host start-up."""

  def __init__(self):
    self.model = ModelFlags()
    self.input = cli.define(
      flags.DEFINE_string,
      "input",
      None,
      "Input file: JSON lines (.jsonl) or text, one per line (or "
      "--seqio_task / --seqio_mixture).",
    )
    self.seqio_task = cli.define(
      flags.DEFINE_string,
      "seqio_task",
      None,
      "A registered seqio Task to read instead of --input: its "
      "preprocessed 'inputs' (and, scoring, 'targets') token ids, in the "
      "model's vocabulary (chunkwise/jobs/seqio_input.py).",
    )
    self.seqio_mixture = cli.define(
      flags.DEFINE_string,
      "seqio_mixture",
      None,
      "A registered seqio Mixture: each of its Tasks in turn, ids "
      '"task:index".',
    )
    self.seqio_split = cli.define(
      flags.DEFINE_string,
      "seqio_split",
      "validation",
      "The split of --seqio_task / --seqio_mixture.",
    )
    self.seqio_module = cli.define(
      flags.DEFINE_string,
      "seqio_module",
      None,
      "A Python module imported first (it registers the seqio Tasks).",
    )
    self.input_format = cli.define(
      flags.DEFINE_enum,
      "input_format",
      "auto",
      [f.value for f in InputFormat],
      "auto: .jsonl/.ndjson/.json files are JSON lines, others plain text.",
    )
    self.output = cli.define(
      flags.DEFINE_string,
      "output",
      None,
      "Output JSON-lines file; a re-run skips the ids it holds.",
    )
    self.batch_size = cli.define(
      flags.DEFINE_integer,
      "batch_size",
      8,
      "Rows per device call (over all processes).",
      lower_bound=1,
    )
    self.max_len = cli.define(
      flags.DEFINE_integer,
      "max_len",
      None,
      "Longest sequence in tokens, shared prefix included (default: the "
      "model's max_len).",
      lower_bound=1,
    )
    self.shared_prefix = cli.define(
      flags.DEFINE_string,
      "shared_prefix",
      "",
      "Text (or @file) prefilled once as the start of every example (once "
      "per LoRA adapter the examples run).",
    )
    self.adapter = cli.define(
      flags.DEFINE_string,
      "adapter",
      None,
      "The LoRA adapter (a name from --adapters) of every example that names "
      'none: each line of a text input, each JSON line without an "adapter" '
      "field. Default: the base model.",
    )
    self.skip_bad_lines = cli.define(
      flags.DEFINE_bool,
      "skip_bad_lines",
      False,
      "Log, count and skip bad input lines instead of stopping.",
    )
    self.max_line_bytes = cli.define(
      flags.DEFINE_integer,
      "max_line_bytes",
      examples.MAX_LINE_BYTES,
      "Longest input line in bytes; longer lines are bad lines.",
      lower_bound=1,
    )
    self.max_json_depth = cli.define(
      flags.DEFINE_integer,
      "max_json_depth",
      examples.MAX_JSON_DEPTH,
      "Deepest JSON nesting of an input line; deeper lines are bad lines.",
      lower_bound=1,
    )
    self.progress = cli.define(
      flags.DEFINE_bool, "progress", True, "Show a progress bar."
    )
    self.hosts = MultiHostFlags()
    self.batch_delay_s = cli.define(
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
