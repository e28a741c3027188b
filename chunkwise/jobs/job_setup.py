"""Steps 1 and 2 of a job (see `driver`): the config checked, the model
described (`checkpoints.describe`: shapes, tokenizer, BOS/EOS, no
weights), the LoRA adapters read, and the input read, tokenized and
checked, all before any device work, into a `Setup`.

  setup = job_setup.setup(job, scoring.encode)
  setup.prepared  # the examples' rows, each with where its scores start

Every failure raises `JobError` with one line that names the bad value;
the later steps (`loading`, `driver`) raise it too.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from absl import logging

from chunkwise import checkpoints
from chunkwise.jobs import adapters as adapters_lib
from chunkwise.jobs import examples, seqio_input
from chunkwise.jobs.config import Job, Quantization
from chunkwise.models import lora


class JobError(ValueError):
  """A job stopped: bad config, input, output or model (one line)."""


def describe_model(name: str) -> checkpoints.Description:
  """What the model will be, read without loading weights."""
  if name.startswith(checkpoints.RANDOM):
    try:
      return checkpoints.describe_random(name)
    except ValueError as e:
      raise ValueError(f"--model={name}: {e}") from None
  described = checkpoints.describe(name)
  if described.vocab is None:
    raise ValueError(f"--model={name} has no tokenizer to encode text with")
  return described


def text_or_file(field: str, value: str) -> str:
  """A field's text, or the contents of the file it names as `@path`."""
  if value.startswith("@"):
    path = value[1:]
    try:
      with open(path, encoding="utf-8") as f:
        return f.read()
    except (OSError, UnicodeDecodeError) as e:
      raise ValueError(f"--{field}={value}: {e}") from None
  return value


# (described model, shared prefix row, example) -> (row, scored_from)
Encode = Callable[
  [checkpoints.Description, list[int], examples.Example],
  tuple[list[int], int],
]


@dataclasses.dataclass
class Setup:
  """The checked job before any device work."""

  job: Job
  described: checkpoints.Description
  found: examples.Examples
  prepared: list[examples.Prepared]
  prefix_tokens: list[int]  # the shared prefix's row (BOS first) or []
  max_len: int
  adapters: dict[str, lora.Adapter] = dataclasses.field(default_factory=dict)


def setup(
  job: Job, encode: Encode, *, reserved: int = 0, reserved_for: str = ""
) -> Setup:
  """Steps 1 and 2 (module docstring). `encode(described, prefix_tokens,
  example)` gives an example's row and where its scored tokens start;
  `reserved` tokens (generated steps) must fit after it."""
  try:
    described = describe_model(job.model.name)
    prefix_text = text_or_file("shared_prefix", job.shared_prefix)
    loaded = adapters_lib.load(job.model.adapters, described.hparams)
  except (ValueError, FileNotFoundError) as e:
    raise JobError(str(e)) from None
  h = described.hparams
  max_len = job.max_len or h.max_len
  if max_len > h.max_len:
    raise JobError(
      f"--max_len={max_len} exceeds the model's max_len {h.max_len}"
    )
  vocab = described.vocab
  prefix_tokens = (
    [described.bos_id, *vocab.encode(prefix_text)] if prefix_text else []
  )
  if len(prefix_tokens) + reserved >= max_len:
    raise JobError(
      f"--max_len={max_len} leaves no room for an example after "
      + " and ".join(
        [f"--shared_prefix ({len(prefix_tokens)} tokens)"] * bool(prefix_tokens)
        + [reserved_for] * bool(reserved)
      )
    )
  paths = (job.input, job.output)
  if job.input and all(map(os.path.exists, paths)) and os.path.samefile(*paths):
    raise JobError("--output is the --input file")
  random = job.model.name.startswith(checkpoints.RANDOM)
  if random and job.model.quantize is not Quantization.NONE:
    raise JobError("--quantize applies to checkpoints, not random:")
  what = ["the shared prefix"] * bool(prefix_tokens) + [reserved_for] * bool(
    reserved
  )
  try:
    if job.seqio is not None:
      found = seqio_input.read(
        job.seqio, kind=job.kind.value, vocab=vocab, adapter=job.adapter
      )
      examples.check(found, job.skip_bad_lines)
    else:
      found = examples.read(
        job.input,
        kind=job.kind.value,
        fmt=job.input_format.value,
        skip_bad=job.skip_bad_lines,
        max_line_bytes=job.max_line_bytes,
        max_depth=job.max_json_depth,
        adapters=tuple(loaded),
        adapter=job.adapter,
      )
    prepared = examples.prepare(
      found,
      lambda e: encode(described, prefix_tokens, e),
      limit=max_len,
      reserved=len(prefix_tokens) + reserved,
      reserved_for=" and ".join(what),
      skip_bad=job.skip_bad_lines,
    )
    for message in found.messages:
      logging.warning("skipped %s", message)
  except (examples.InputError, FileNotFoundError, ValueError) as e:
    raise JobError(str(e)) from None
  return Setup(job, described, found, prepared, prefix_tokens, max_len, loaded)
