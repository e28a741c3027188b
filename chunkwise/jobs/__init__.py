"""Batch jobs: scoring and generation over files of examples, resumable,
multi-host (scripts/score.py, scripts/generate.py).

- `examples`: reading and checking input lines (`file:line: reason`).
- `batching`: length-bucketed batches, the same on every process.
- `output`: resumable JSON-lines output, shards merged at the end.
- `scoring`, `generation`: one batch's device calls and records.
- `cli`: the common absl flags and the job driver.
"""

from chunkwise.jobs import batching, examples, generation, output, scoring

__all__ = ["batching", "examples", "generation", "output", "scoring"]
