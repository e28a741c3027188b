"""Batch jobs: scoring and generation over files of examples, resumable,
multi-host, callable from Python and from scripts/score.py,
scripts/generate.py (which only parse flags into these configs).

  from chunkwise.jobs import ScoreJob, ModelConfig, run_score
  summary = run_score(ScoreJob(input="texts.jsonl", output="scores.jsonl",
                               model=ModelConfig(name="smollm2-135m")))

- `config`: `ScoreJob`, `GenerateJob`, `ModelConfig`, `MultiHost` and the
  enums (`JobKind`, `WeightDtype`, `Quantization`, `InputFormat`).
- `driver`: the job's steps in order; `run` plans, runs and finishes.
- `job_setup`: describing the model and reading the input before any
  device work (`Setup`), and `JobError`.
- `loading`: `jax.distributed` started, the model loaded onto its mesh
  (`load_served` for a server).
- `scoring`: `run_score`, and one batch's device calls and records.
- `generation`: `run_generate` (its constraint, settings and summary).
- `samples`: generation's device calls (continuous or one batch at a
  time) and its records.
- `examples`: reading and checking input lines (`file:line: reason`).
- `seqio_input`: a seqio Task or Mixture as the input (`SeqioInput`).
- `batching`: length-bucketed batches, the same on every process.
- `adapters`: LoRA adapters (`--adapters`, per-example "adapter"), read
  before any device work; the shared prefix once per adapter.
- `output`: resumable JSON-lines output, shards merged at the end.
- `cli`: the scripts' absl plumbing (flags defined once, one-line
  failures, `main`, `report`).
- `model_flags`, `job_flags`, `sampling_flags`: the absl flag groups
  (`ModelFlags` and `MultiHostFlags`, `JobFlags`, `SamplingFlags` and
  `SpeculationFlags`), parsed into the configs.
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
from chunkwise.jobs.generation import run_generate
from chunkwise.jobs.job_setup import JobError
from chunkwise.jobs.loading import load_served, start_processes
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
