"""absl plumbing for the batch-job scripts (and the server's): flags
defined once, a bad flag or a job error in one line, and the summary.

  JOB = job_flags.JobFlags()  # at import: --model ... --input ...
  SAMPLING = sampling_flags.SamplingFlags()  # --temperature --top_k ...

  def score():
    cli.report(run_score(ScoreJob(**JOB.fields(), top_n=...)))

  main = cli.main(score)   # app.run(main, flags_parser=cli.parse_flags)

The flag groups, each parsed into a `chunkwise.jobs` config, are
`model_flags` (`ModelFlags`, `MultiHostFlags`), `job_flags` (`JobFlags`)
and `sampling_flags` (`SamplingFlags`, `SpeculationFlags`); each defines
its flags with `define`. Flags are registered when a script creates a
group, never when a module is imported. Every job error
(`job_setup.JobError`, or a ValueError from a config) exits 1 with one
line naming the bad value; the job itself lives in `chunkwise.jobs` and
runs the same from Python.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence

from absl import app, flags, logging


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


def define(kind, name: str, default, *args, **kwargs) -> flags.FlagHolder:
  """`kind(name, default, ...)` (e.g. `flags.DEFINE_string`), or the flag
  already defined under `name` with the same default (two job scripts
  loaded in one process, as in the tests, share their common flags)."""
  if name not in flags.FLAGS:
    return kind(name, default, *args, **kwargs)
  flag = flags.FLAGS[name]
  if flag.default != default:
    raise ValueError(
      f"flag --{name} is already defined with default {flag.default!r}, "
      f"not {default!r}"
    )
  return flags.FlagHolder(flags.FLAGS, flag)


def validate(name: str, check, message: str) -> None:
  """Registers a validator once per flag and message."""
  key = (name, message)
  if key not in _VALIDATED:
    _VALIDATED.add(key)
    flags.register_validator(name, check, message)


_VALIDATED: set[tuple[str, str]] = set()


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
