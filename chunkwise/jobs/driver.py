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

Every failure raises `JobError` with one line that names the bad value;
with several processes, every process raises it.

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
import os
import sys
import time
from collections.abc import Callable, Iterator

from absl import logging

from chunkwise import checkpoints, memory, partitioning
from chunkwise.inference import InferenceModel
from chunkwise.jobs import adapters as adapters_lib
from chunkwise.jobs import batching, examples, output, seqio_input
from chunkwise.jobs.config import Job, ModelConfig, MultiHost, Quantization
from chunkwise.models import lora
from chunkwise.partitioning import LayoutKind, multihost
from chunkwise.planner import choice as planner_choice


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


def start_processes(hosts: MultiHost) -> tuple[int, int]:
  """Starts `jax.distributed` when `hosts` asks; (process index, count)."""
  if hosts.asked:
    try:
      partitioning.initialize_multihost(
        hosts.coordinator_address,
        hosts.num_processes,
        hosts.process_id,
        local_device_count=hosts.cpu_devices,
      )
    except ValueError as e:
      raise JobError(str(e)) from None
  elif hosts.cpu_devices:
    import jax

    jax.config.update("jax_num_cpu_devices", hosts.cpu_devices)
  import jax

  return jax.process_index(), jax.process_count()


def check_fits(job: Job, described: checkpoints.Description) -> None:
  """Random weights are drawn on the device: refuse, in one line, those
  it cannot hold (checkpoints are read as they come)."""
  name = job.model.name
  if not name.startswith(checkpoints.RANDOM):
    return
  params = described.hparams.num_params()
  dtype = job.model.dtype.value if job.model.dtype else "float32"
  try:
    memory.check_random_weights(params, dtype)
  except ValueError as e:
    raise ValueError(f"--model={name}: {e}") from None


def load_model(job: Job, described: checkpoints.Description) -> InferenceModel:
  """Step 4's model on the mesh the config names."""
  auto = job.model.layout == "auto"
  workload = _workload(job, described) if auto else None
  return load_configured(job.model, described, workload=workload)


def load_configured(
  m: ModelConfig, described: checkpoints.Description, *, workload=None
) -> InferenceModel:
  """The model `m` names, on the mesh it names (`workload`: what
  `layout="auto"` plans for)."""
  import jax

  shape = m.mesh
  auto = m.layout == "auto"
  if shape is None and (auto or m.layout.kind is not LayoutKind.REFERENCE):
    shape = (1, 1, jax.device_count())
  mesh = None if shape is None else partitioning.make_mesh(shape)
  dtype = None if m.dtype is None else m.dtype.value
  extra = {"workload": workload} if auto and workload is not None else {}
  if m.name.startswith(checkpoints.RANDOM):
    return InferenceModel.random(
      described.hparams,
      seed=0,
      mesh=mesh,
      layout=m.layout,
      vocab=described.vocab,
      dtype=dtype or "float32",
      precision=m.precision,
      numerics=m.numerics,
      kv_dtype=m.kv_dtype,
      **extra,
    )
  return checkpoints.load(
    m.name,
    dtype=dtype,
    quantize=m.quantize,
    mesh=mesh,
    layout=m.layout,
    precision=m.precision,
    numerics=m.numerics,
    kv_dtype=m.kv_dtype,
    **extra,
  )


def load_served(m: ModelConfig) -> InferenceModel:
  """The model `m` names with its adapters (what a server runs); raises
  ValueError / FileNotFoundError for a bad name, file or adapter, before
  placing anything."""
  described = describe_model(m.name)
  loaded = adapters_lib.load(m.adapters, described.hparams)
  if m.name.startswith(checkpoints.RANDOM) and m.quantize is not (
    Quantization.NONE
  ):
    raise ValueError("--quantize applies to checkpoints, not random:")
  model = load_configured(m, described)
  return model.with_adapters(loaded) if loaded else model


def _workload(job: Job, described) -> planner_choice.Workload:
  """What `--layout=auto` plans for: the job's batch, its longest
  allowed prompt (max_len, else 512) and its steps (0 when scoring)."""
  steps = getattr(job, "steps", 0)
  prompt = job.max_len or min(512, described.hparams.max_len - steps - 1)
  return planner_choice.Workload(
    batch=job.batch_size, prefill_len=max(1, prompt), generate_len=steps
  )


def is_main_process() -> bool:
  import jax

  return jax.process_index() == 0


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
