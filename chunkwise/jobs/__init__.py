"""Batch jobs: scoring and generation over files of examples, resumable,
multi-host, callable from Python and from scripts/score.py,
scripts/generate.py (which only parse flags into these configs).

  from chunkwise.jobs import ScoreJob, ModelConfig, run_score
  summary = run_score(ScoreJob(input="texts.jsonl", output="scores.jsonl",
                               model=ModelConfig(name="smollm2-135m")))

- `config`: `ScoreJob`, `GenerateJob`, `ModelConfig`, `MultiHost` and the
  enums (`JobKind`, `WeightDtype`, `Quantization`, `InputFormat`).
- `driver`: the job's steps (describe, read, plan, run, finish) and
  `JobError`.
- `scoring`, `generation`: `run_score` / `run_generate`, and one batch's
  device calls and records.
- `examples`: reading and checking input lines (`file:line: reason`).
- `seqio_input`: a seqio Task or Mixture as the input (`SeqioInput`).
- `batching`: length-bucketed batches, the same on every process.
- `adapters`: LoRA adapters (`--adapters`, per-example "adapter"), read
  before any device work; the shared prefix once per adapter.
- `output`: resumable JSON-lines output, shards merged at the end.
- `cli`: the scripts' absl flag groups, parsed into the configs.
"""

from chunkwise.jobs import (
  adapters,
  batching,
  examples,
  generation,
  output,
  scoring,
  seqio_input,
)
from chunkwise.jobs.config import (
  GenerateJob,
  InputFormat,
  JobKind,
  ModelConfig,
  MultiHost,
  Quantization,
  ScoreJob,
  WeightDtype,
)
from chunkwise.jobs.driver import JobError, load_served, start_processes
from chunkwise.jobs.generation import run_generate
from chunkwise.jobs.scoring import run_score
from chunkwise.jobs.seqio_input import SeqioInput

__all__ = [
  "GenerateJob",
  "InputFormat",
  "JobError",
  "JobKind",
  "ModelConfig",
  "MultiHost",
  "Quantization",
  "ScoreJob",
  "SeqioInput",
  "WeightDtype",
  "adapters",
  "batching",
  "examples",
  "generation",
  "load_served",
  "output",
  "run_generate",
  "run_score",
  "scoring",
  "seqio_input",
  "start_processes",
]
