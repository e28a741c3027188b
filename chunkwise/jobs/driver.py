"""The batch-job driver that `run_score` and `run_generate` share.

A job runs in this order, so that a bad config, a bad input line or an
output file of another job stop it before any device work:

  1. the config checked; the model described (`checkpoints.describe`:
     shapes, tokenizer, BOS/EOS, no weights);
  2. the input read, tokenized and checked (`examples`);
  3. `jax.distributed` started (multi-host), the output opened and its
     done ids skipped (`output`); every process plans the same batches
     (`batching`), checked equal across processes;
  4. the model loaded onto the mesh (serving the LoRA adapters, read in
     step 1), the shared prefix prefilled once (per adapter the examples
     run, see `adapters`), the batches run and written as they finish,
     with a progress bar on process 0;
  5. the output finished (shards merged, input order) and a summary.

Steps 1 and 2 are `job_setup.setup`, giving a `Setup`; the processes and
the model are `loading`'s; this module's `run` does steps 3 to 5 and
`summary` the summary.

Every failure raises `job_setup.JobError` with one line that names the
bad value; with several processes, every process raises it.

Multi-host: one model spans the mesh of every process's devices, and every
process runs the same batches (JAX's multi-controller SPMD). Each batch's
rows are split between processes in contiguous blocks; process p writes
its rows to `<output>.process-p-of-n`, and process 0 merges the shards
into `<output>` at the end. The output must be on a filesystem every
process sees (checked). See `output` for resuming.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from collections.abc import Callable, Iterator

from absl import logging

from chunkwise.inference import InferenceModel
from chunkwise.jobs import adapters as adapters_lib
from chunkwise.jobs import batching, examples, output
from chunkwise.jobs.job_setup import JobError, Setup
from chunkwise.jobs.loading import check_fits, load_model, start_processes
from chunkwise.partitioning import multihost


def _progress(total: int, process: int, unit: str, show: bool):
  """A tqdm bar on process 0 (a silent one elsewhere)."""
  from tqdm import tqdm

  return tqdm(
    total=total,
    unit=unit,
    disable=process != 0 or not show,
    file=sys.stderr,
    dynamic_ncols=True,
  )


RunBatch = Callable[
  [InferenceModel, list, list, batching.Batch], list[list[dict] | None]
]


@dataclasses.dataclass
class Run:
  """What `run` did: the finished output and this run's counts."""

  output: output.Output
  todo: list[int]  # indices into `Setup.prepared` run now
  resumed: int  # examples found done in the output
  seconds: float  # of batches, compiles included
  process: int


def _agree(error: str | None) -> None:
  multihost.agree(error, raise_as=JobError)


def _plan_digest(plan, setup: Setup) -> bytes:
  digest = hashlib.sha256(repr(plan).encode())
  # The adapters' contents too: processes reading different files under
  # the same names would write different numbers.
  digest.update(repr(adapters_lib.checksums(setup.adapters)).encode())
  for p in setup.prepared:
    digest.update(
      repr((p.example.id, p.tokens, p.scored_from, p.example.adapter)).encode()
    )
  return digest.digest()


# (model, shared prefix, [(example, sample index), ...]) -> (position,
# records) as they finish, in any order.
RunItems = Callable[
  [
    InferenceModel,
    adapters_lib.SharedPrefix,
    list[tuple[examples.Prepared, int]],
  ],
  Iterator[tuple[int, list[dict]]],
]


def run(
  setup: Setup,
  *,
  keys: Callable[[examples.Prepared], list[str]],
  run_batch: RunBatch | None = None,
  run_items: RunItems | None = None,
  reserved: int = 0,
  record_key: Callable[[dict], str] = output.record_id,
  settings: dict | None = None,
) -> Run:
  """Steps 3 to 5 (module docstring). `keys(p)` are the output keys of
  example p's records; `run_batch(model, prefix, rows, batch)` gives
  each row's records (None for padding rows; `prefix` is the shared
  prefix list for the rows' adapters); `settings` (the options that
  change results) must match those of the run that began the output.

  Continuous batching gives `run_items` instead: every record not yet in
  the output (one per key, e.g. per sample) is one item, all handed over
  at once with the `adapters.SharedPrefix`; it yields (item position,
  records) as they finish, and the process numbered position % processes
  writes them."""
  job = setup.job
  m = job.model
  settings = {
    "model": m.name,
    "shared_prefix": hashlib.sha256(
      repr(setup.prefix_tokens).encode()
    ).hexdigest()[:16],
    "dtype": None if m.dtype is None else m.dtype.value,
    "quantize": m.quantize.value,
    # Absent when unset, so outputs begun before the option still resume.
    **({"precision": m.precision} if m.precision else {}),
    **({"numerics": m.numerics} if m.numerics else {}),
    # float32 is the default: an output begun without the flag resumes.
    **({"kv_dtype": m.kv_dtype} if m.kv_dtype not in (None, "float32") else {}),
    **(
      {"adapters": adapters_lib.checksums(setup.adapters)}
      if setup.adapters
      else {}
    ),
    **({"adapter": job.adapter} if job.adapter is not None else {}),
    **(settings or {}),
  }
  size = job.batch_size
  process, processes = start_processes(job.multihost)
  error = out = None
  try:  # needs the devices, so after start_processes; before any output
    check_fits(job, setup.described)
  except ValueError as e:
    error = str(e)
  _agree(error)
  try:  # opens (creates) this process's output shard
    if size % processes:
      raise output.OutputError(
        f"--batch_size={size} is not divisible by the {processes} "
        "processes, which split each batch's rows"
      )
    out = output.Output(
      job.output,
      process=process,
      processes=processes,
      key=record_key,
      settings=settings,
    )
  except output.OutputError as e:
    error = str(e)
  _agree(error)
  try:
    out.check_shards()
  except output.OutputError as e:
    error = str(e)
  _agree(error)
  done = out.done
  finished = [all(k in done for k in keys(p)) for p in setup.prepared]
  if run_items is not None:
    return _run_items(
      setup, out, done, finished, keys, run_items, process, processes
    )
  # The whole job's plan, less its finished batches: a resumed job runs
  # each batch with the rows it had at first, so its values are
  # bit-identical to an uninterrupted run's.
  limit = setup.max_len - len(setup.prefix_tokens) - reserved
  batches = [
    b
    for b in batching.batches(
      [len(p.tokens) for p in setup.prepared],
      batch_size=size,
      limit=limit,
    )
    if not all(finished[i] for i in b.rows)
  ]
  todo = [i for b in batches for i in b.rows if not finished[i]]
  multihost.same_everywhere(
    _plan_digest(batches, setup),
    "the processes planned different batches: give every process the "
    "same input and flags, and put --output on a filesystem every "
    "process sees",
    raise_as=JobError,
  )
  logging.info(
    "%d examples: %d to run in %d batches of %d, %d already in %s",
    len(setup.prepared),
    len(todo),
    len(batches),
    size,
    len(setup.prepared) - len(todo),
    out.path,
  )
  try:
    rows_of = [
      [None if i is None else setup.prepared[i] for i in b.indices]
      for b in batches
    ]
    names = {n for rows in rows_of for n in adapters_lib.of_rows(rows)}
    model, shared = _model_and_prefix(setup, names) if batches else (None, None)
    start = time.perf_counter()  # compiles count, loading does not
    with _progress(len(todo), process, "example", job.progress) as bar:
      for batch, rows in zip(batches, rows_of, strict=True):
        prefix = shared.rows(adapters_lib.of_rows(rows))
        records = run_batch(model, prefix, rows, batch)
        mine = batching.owned(batch, process, processes)
        out.append([r for b in mine for r in records[b]])
        bar.update(sum(not finished[i] for i in batch.rows))
        if job.batch_delay_s:
          time.sleep(job.batch_delay_s)
  except ValueError as e:  # e.g. a batch size the mesh cannot split
    logging.exception("the job stopped")
    raise JobError(str(e)) from None
  seconds = time.perf_counter() - start if batches else 0.0
  return _finish(setup, out, keys, todo, seconds, process)


def _model_and_prefix(setup: Setup, names):
  """The job's model, loaded (serving the job's adapters), and its shared
  prefix prefilled once per adapter of `names` (None: the base model)."""
  model = load_model(setup.job, setup.described)
  if setup.adapters:
    model = model.with_adapters(setup.adapters)
  return model, adapters_lib.SharedPrefix.prefill(
    model, setup.prefix_tokens, names
  )


def _finish(setup, out, keys, todo, seconds, process) -> Run:
  """Step 5 once every process has written: the output finished in input
  order (process 0 merges the shards)."""
  multihost.barrier("chunkwise-job-written")
  order = [k for p in setup.prepared for k in keys(p)]
  error = None
  try:
    out.finish(order)
  except (output.OutputError, OSError) as e:
    error = str(e)
  _agree(error)
  return Run(out, todo, len(setup.prepared) - len(todo), seconds, process)


def _run_items(
  setup, out, done, finished, keys, run_items, process, processes
) -> Run:
  """`run` with continuous batching (see `run`)."""
  job = setup.job
  items = [
    (i, s)
    for i, p in enumerate(setup.prepared)
    if not finished[i]
    for s, k in enumerate(keys(p))
    if k not in done
  ]
  todo = sorted({i for i, _ in items})
  multihost.same_everywhere(
    _plan_digest(items, setup),
    "the processes planned different work: give every process the same "
    "input and flags, and put --output on a filesystem every process sees",
    raise_as=JobError,
  )
  logging.info(
    "%d examples: %d records to run (%d examples), %d examples already in %s",
    len(setup.prepared),
    len(items),
    len(todo),
    len(setup.prepared) - len(todo),
    out.path,
  )
  try:
    names = {setup.prepared[i].example.adapter for i, _ in items}
    model, prefix = _model_and_prefix(setup, names) if items else (None, None)
    start = time.perf_counter()  # compiles count, loading does not
    with _progress(len(items), process, "sample", job.progress) as bar:
      if items:
        work = [(setup.prepared[i], s) for i, s in items]
        for position, records in run_items(model, prefix, work):
          if position % processes == process:
            out.append(records)
          bar.update(1)
          if job.batch_delay_s:
            time.sleep(job.batch_delay_s)
  except ValueError as e:
    logging.exception("the job stopped")
    raise JobError(str(e)) from None
  seconds = time.perf_counter() - start if items else 0.0
  return _finish(setup, out, keys, todo, seconds, process)


def summary(setup: Setup, run: Run, *, new_tokens: int, **totals) -> dict:
  """The summary: `totals` over the whole output, then this run's counts
  and speed (`new_tokens` in `run.seconds`)."""
  return {
    **totals,
    "run_now": len(run.todo),
    "resumed": run.resumed,
    "skipped_bad_lines": len(setup.found.bad),
    "tokens_per_s": round(new_tokens / run.seconds, 1) if run.seconds else None,
    "seconds": round(run.seconds, 2),
    "output": run.output.path,
  }
