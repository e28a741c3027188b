"""What scripts/score.py and scripts/generate.py share: their common absl
flags, multi-host start-up, the model, and the batch loop.

A job runs in this order, so that bad flags, a bad input line or an
output file of another job stop it before any device work:

  1. flags checked; the model described (`checkpoints.describe`: shapes,
     tokenizer, BOS/EOS, no weights);
  2. the input read, tokenized and checked (`examples`);
  3. `jax.distributed` started (multi-host), the output opened and its
     done ids skipped (`output`); every process plans the same batches
     (`batching`), checked equal across processes;
  4. the model loaded onto the mesh, the shared prefix prefilled once,
     the batches run and written as they finish, with a progress bar on
     process 0;
  5. the output finished (shards merged, input order) and a summary.

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
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

from absl import app, flags, logging

from chunkwise import checkpoints, memory, partitioning
from chunkwise.inference import InferenceModel
from chunkwise.jobs import batching, examples, output
from chunkwise.partitioning import Layout
from chunkwise.precision import PRECISIONS

_MODEL = flags.DEFINE_string(
  "model",
  "smollm2-135m",
  "A model name, a .gguf file, a Hugging Face or chunkwise checkpoint "
  "directory, or random:<preset> (random weights, for tests).",
)
_INPUT = flags.DEFINE_string(
  "input", None, "Input file: JSON lines (.jsonl) or text, one per line."
)
_INPUT_FORMAT = flags.DEFINE_enum(
  "input_format",
  "auto",
  ["auto", "jsonl", "text"],
  "auto: .jsonl/.ndjson/.json files are JSON lines, others plain text.",
)
_OUTPUT = flags.DEFINE_string(
  "output", None, "Output JSON-lines file; a re-run skips the ids it holds."
)
_BATCH_SIZE = flags.DEFINE_integer(
  "batch_size", 8, "Rows per device call (over all processes).", lower_bound=1
)
_MAX_LEN = flags.DEFINE_integer(
  "max_len",
  None,
  "Longest sequence in tokens, shared prefix included (default: the "
  "model's max_len).",
  lower_bound=1,
)
_SHARED_PREFIX = flags.DEFINE_string(
  "shared_prefix",
  "",
  "Text (or @file) prefilled once as the start of every example.",
)
_LAYOUT = flags.DEFINE_string(
  "layout", "reference", "Layout, e.g. ws_2d/yz/latency (see README)."
)
_MESH = flags.DEFINE_string(
  "mesh",
  None,
  "Mesh shape XxYxZ, e.g. 2x2x2 (default: 1x1x<all devices> for a "
  "sharded layout).",
)
_DTYPE = flags.DEFINE_enum(
  "dtype", None, ["float32", "bfloat16"], "Float weights' dtype."
)
_QUANTIZE = flags.DEFINE_enum(
  "quantize", "none", ["none", "int8"], "Weight quantization."
)
_PRECISION = flags.DEFINE_enum(
  "precision",
  None,
  list(PRECISIONS),
  "Matmul precision (default: highest for f32, whose default is TF32 on "
  "GPUs; see chunkwise.precision).",
)
_SKIP_BAD_LINES = flags.DEFINE_bool(
  "skip_bad_lines",
  False,
  "Log, count and skip bad input lines instead of stopping.",
)
_MAX_LINE_BYTES = flags.DEFINE_integer(
  "max_line_bytes",
  examples.MAX_LINE_BYTES,
  "Longest input line in bytes; longer lines are bad lines.",
  lower_bound=1,
)
_MAX_JSON_DEPTH = flags.DEFINE_integer(
  "max_json_depth",
  examples.MAX_JSON_DEPTH,
  "Deepest JSON nesting of an input line; deeper lines are bad lines.",
  lower_bound=1,
)
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address", None, "Multi-host: host:port of process 0."
)
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", None, "Multi-host: how many processes.", lower_bound=1
)
_PROCESS_ID = flags.DEFINE_integer(
  "process_id", None, "Multi-host: this process's index.", lower_bound=0
)
_MULTIHOST = flags.DEFINE_bool(
  "multihost",
  False,
  "Start jax.distributed with the platform's automatic detection (TPU "
  "pods, SLURM, ...) when --coordinator_address is not given.",
)
_CPU_DEVICES = flags.DEFINE_integer(
  "cpu_devices",
  None,
  "Host CPU devices per process (tests run 2 processes x 4).",
  lower_bound=1,
)
_BATCH_DELAY = flags.DEFINE_float(
  "batch_delay_s",
  0.0,
  "Sleep after each batch (throttling; the resume test uses it).",
  lower_bound=0.0,
)


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


def require(*names: str) -> None:
  for name in names:
    if not flags.FLAGS[name].value:
      raise app.UsageError(f"--{name} is required")


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


def text_or_file(flag: str, value: str) -> str:
  """A flag's text, or the contents of the file it names as `@path`."""
  if value.startswith("@"):
    path = value[1:]
    try:
      with open(path, encoding="utf-8") as f:
        return f.read()
    except (OSError, UnicodeDecodeError) as e:
      raise ValueError(f"--{flag}={value}: {e}") from None
  return value


def shared_prefix_text() -> str:
  return text_or_file("shared_prefix", _SHARED_PREFIX.value)


# (described model, shared prefix row, example) -> (row, scored_from)
Encode = Callable[
  [checkpoints.Description, list[int], examples.Example],
  tuple[list[int], int],
]


@dataclasses.dataclass
class Setup:
  """The checked job before any device work."""

  described: checkpoints.Description
  found: examples.Examples
  prepared: list[examples.Prepared]
  prefix_tokens: list[int]  # the shared prefix's row (BOS first) or []
  layout: Layout
  mesh_shape: tuple[int, int, int] | None
  max_len: int


def setup(
  kind: str,
  encode: Encode,
  *,
  reserved: int = 0,
  reserved_for: str = "",
) -> Setup:
  """Steps 1 and 2 (module docstring). `encode(described, prefix_tokens,
  example)` gives an example's row and where its scored tokens start;
  `reserved` tokens (generated steps) must fit after it."""
  require("input", "output")
  try:
    layout = Layout.parse(_LAYOUT.value)
    shape = partitioning.parse_mesh(_MESH.value) if _MESH.value else None
    described = describe_model(_MODEL.value)
    prefix_text = shared_prefix_text()
  except (ValueError, FileNotFoundError) as e:
    raise app.UsageError(str(e)) from None
  h = described.hparams
  max_len = _MAX_LEN.value or h.max_len
  if max_len > h.max_len:
    raise app.UsageError(
      f"--max_len={max_len} exceeds the model's max_len {h.max_len}"
    )
  vocab = described.vocab
  prefix_tokens = (
    [described.bos_id, *vocab.encode(prefix_text)] if prefix_text else []
  )
  if len(prefix_tokens) + reserved >= max_len:
    raise app.UsageError(
      f"--max_len={max_len} leaves no room for an example after "
      + " and ".join(
        [f"--shared_prefix ({len(prefix_tokens)} tokens)"] * bool(prefix_tokens)
        + [reserved_for] * bool(reserved)
      )
    )
  paths = (_INPUT.value, _OUTPUT.value)
  if all(map(os.path.exists, paths)) and os.path.samefile(*paths):
    raise app.UsageError("--output is the --input file")
  if _MODEL.value.startswith("random:") and _QUANTIZE.value != "none":
    raise app.UsageError("--quantize applies to checkpoints, not random:")
  what = ["the shared prefix"] * bool(prefix_tokens) + [reserved_for] * bool(
    reserved
  )
  try:
    found = examples.read(
      _INPUT.value,
      kind=kind,
      fmt=_INPUT_FORMAT.value,
      skip_bad=_SKIP_BAD_LINES.value,
      max_line_bytes=_MAX_LINE_BYTES.value,
      max_depth=_MAX_JSON_DEPTH.value,
    )
    prepared = examples.prepare(
      found,
      lambda e: encode(described, prefix_tokens, e),
      limit=max_len,
      reserved=len(prefix_tokens) + reserved,
      reserved_for=" and ".join(what),
      skip_bad=_SKIP_BAD_LINES.value,
    )
    for message in found.messages:
      logging.warning("skipped %s", message)
  except (examples.InputError, FileNotFoundError) as e:
    fail(str(e))
  return Setup(
    described, found, prepared, prefix_tokens, layout, shape, max_len
  )


def start_processes() -> tuple[int, int]:
  """Starts `jax.distributed` when asked; (process index, count)."""
  given = (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  if any(v is not None for v in given) or _MULTIHOST.value:
    try:
      partitioning.initialize_multihost(
        *given, local_device_count=_CPU_DEVICES.value
      )
    except ValueError as e:
      raise app.UsageError(str(e)) from None
  elif _CPU_DEVICES.value:
    import jax

    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  import jax

  return jax.process_index(), jax.process_count()


def open_output(processes: int, process: int, **kw) -> output.Output:
  if _BATCH_SIZE.value % processes:
    raise app.UsageError(
      f"--batch_size={_BATCH_SIZE.value} is not divisible by the "
      f"{processes} processes, which split each batch's rows"
    )
  return output.Output(
    _OUTPUT.value, process=process, processes=processes, **kw
  )


def agree(error: str | None, processes: int) -> None:
  """Exits on every process (with the first failing process's message)
  if any process failed, so that none waits forever in a collective."""
  if processes > 1:
    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.zeros(1024, np.uint8)
    data = (error or "").encode()[:1024]
    mine[: len(data)] = np.frombuffer(data, np.uint8)
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    failed = [row for row in everyone if row.any()]
    if failed and error is None:
      error = bytes(failed[0]).rstrip(b"\0").decode(errors="replace")
  if error is not None:
    fail(error)


def check_same_plan(plan: Sequence, setup: Setup, processes: int) -> None:
  """Every process must plan the same batches of the same tokens."""
  if processes == 1:
    return
  import numpy as np
  from jax.experimental import multihost_utils

  digest = hashlib.sha256(repr(plan).encode())
  for p in setup.prepared:
    digest.update(repr((p.example.id, p.tokens, p.scored_from)).encode())
  mine = np.frombuffer(digest.digest(), np.uint8)
  everyone = np.asarray(multihost_utils.process_allgather(mine))
  if not (everyone == mine).all():
    raise output.OutputError(
      "the processes planned different batches: give every process the "
      "same input and flags, and put --output on a filesystem every "
      "process sees"
    )


def check_fits(setup: Setup) -> None:
  """Random weights are drawn on the device: refuse, in one line, those
  it cannot hold (checkpoints are read as they come)."""
  if not _MODEL.value.startswith(checkpoints.RANDOM):
    return
  params = setup.described.hparams.num_params()
  try:
    memory.check_random_weights(params, _DTYPE.value or "float32")
  except ValueError as e:
    raise ValueError(f"--model={_MODEL.value}: {e}") from None


def load_model(setup: Setup) -> InferenceModel:
  """Step 4's model on the mesh the flags name."""
  import jax

  shape = setup.mesh_shape
  if shape is None and setup.layout.kind.value != "reference":
    shape = (1, 1, jax.device_count())
  mesh = None if shape is None else partitioning.make_mesh(shape)
  name = _MODEL.value
  quantize = None if _QUANTIZE.value == "none" else _QUANTIZE.value
  if name.startswith("random:"):
    d = setup.described
    return InferenceModel.random(
      d.hparams,
      seed=0,
      mesh=mesh,
      layout=setup.layout,
      vocab=d.vocab,
      dtype=_DTYPE.value or "float32",
      precision=_PRECISION.value,
    )
  return checkpoints.load(
    name,
    dtype=_DTYPE.value,
    quantize=quantize,
    mesh=mesh,
    layout=setup.layout,
    precision=_PRECISION.value,
  )


def is_main_process() -> bool:
  import jax

  return jax.process_index() == 0


def progress(total: int, process: int, unit: str):
  """A tqdm bar on process 0 (a silent one elsewhere)."""
  from tqdm import tqdm

  return tqdm(
    total=total,
    unit=unit,
    disable=process != 0 or not _PROGRESS.value,
    file=sys.stderr,
    dynamic_ncols=True,
  )


def pause() -> None:
  if _BATCH_DELAY.value:
    time.sleep(_BATCH_DELAY.value)


def barrier(name: str, processes: int) -> None:
  if processes > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


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


def run(
  setup: Setup,
  *,
  keys: Callable[[examples.Prepared], list[str]],
  run_batch: RunBatch,
  reserved: int = 0,
  record_key: Callable[[dict], str] = output.record_id,
  settings: dict | None = None,
) -> Run:
  """Steps 3 to 5 (module docstring). `keys(p)` are the output keys of
  example p's records; `run_batch(model, prefix, rows, batch)` gives
  each row's records (None for padding rows); `settings` (the flags that
  change results) must match those of the run that began the output."""
  settings = {
    "model": _MODEL.value,
    "shared_prefix": hashlib.sha256(
      repr(setup.prefix_tokens).encode()
    ).hexdigest()[:16],
    "dtype": _DTYPE.value,
    "quantize": _QUANTIZE.value,
    # Absent when unset, so outputs begun before the flag still resume.
    **({"precision": _PRECISION.value} if _PRECISION.value else {}),
    **(settings or {}),
  }
  size = _BATCH_SIZE.value
  process, processes = start_processes()
  error = out = None
  try:  # needs the devices, so after start_processes; before any output
    check_fits(setup)
  except ValueError as e:
    error = str(e)
  agree(error, processes)
  try:  # opens (creates) this process's output shard
    out = open_output(processes, process, key=record_key, settings=settings)
  except output.OutputError as e:
    error = str(e)
  agree(error, processes)
  try:
    out.check_shards()
  except output.OutputError as e:
    error = str(e)
  agree(error, processes)
  done = out.done
  finished = [all(k in done for k in keys(p)) for p in setup.prepared]
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
  try:
    check_same_plan(batches, setup, processes)
  except output.OutputError as e:
    fail(str(e))  # every process found the mismatch
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
    model = load_model(setup) if batches else None
    prefix = []
    if batches and setup.prefix_tokens:
      from chunkwise.inference import Chunk

      prefix = [model.prefill(Chunk.from_lists([setup.prefix_tokens]))]
    start = time.perf_counter()  # compiles count, loading does not
    with progress(len(todo), process, "example") as bar:
      for batch in batches:
        rows = [None if i is None else setup.prepared[i] for i in batch.indices]
        records = run_batch(model, prefix, rows, batch)
        mine = batching.owned(batch, process, processes)
        out.append([r for b in mine for r in records[b]])
        bar.update(sum(not finished[i] for i in batch.rows))
        pause()
  except ValueError as e:  # e.g. a batch size the mesh cannot split
    logging.exception("the job stopped")
    fail(str(e))
  seconds = time.perf_counter() - start if batches else 0.0
  barrier("chunkwise-job-written", processes)
  order = [k for p in setup.prepared for k in keys(p)]
  try:
    out.finish(order)
  except (output.OutputError, OSError) as e:
    error = str(e)
  agree(error, processes)
  return Run(out, todo, len(setup.prepared) - len(todo), seconds, process)


def summary(setup: Setup, run: Run, *, new_tokens: int, **totals) -> dict:
  """The summary line: `totals` over the whole output, then this run's
  counts and speed (`new_tokens` in `run.seconds`)."""
  return {
    **totals,
    "run_now": len(run.todo),
    "resumed": run.resumed,
    "skipped_bad_lines": len(setup.found.bad),
    "tokens_per_s": round(new_tokens / run.seconds, 1) if run.seconds else None,
    "seconds": round(run.seconds, 2),
    "output": run.output.path,
  }


def main(job: Callable[[], None]) -> Callable[[Sequence[str]], None]:
  """An absl main running `job`; bad flags exit 1 with one line."""

  def run_main(argv: Sequence[str]) -> None:
    try:
      if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
      job()
    except app.UsageError as e:
      fail(str(e))

  return run_main


def report(summary: dict) -> None:
  """Prints the summary as `summary {json}` and logs it (process 0 calls
  it)."""
  logging.info("summary: %s", summary)
  print("summary " + json.dumps(summary), flush=True)
