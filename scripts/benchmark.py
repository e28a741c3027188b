"""Benchmarks prefill and decode, against the machine's limits and, with
--compare_hf, against Hugging Face transformers in the same run.

  python scripts/benchmark.py                            # SmolLM2, f32
  python scripts/benchmark.py --weights=float32,int8 --compare_hf \
      --hf_dtypes=float32,bfloat16 --output=bench.json --plot=bench.png
  python scripts/benchmark.py --model=random:tiny --decode_batches=1,4

The flags become a `chunkwise.bench.suite.Settings` (each field named as
its flag), checked before anything loads; `suite.measure` times every
configuration (its docstring says what and how) and this writes --output
(JSON) and --plot (PNG: latency per token against throughput, one curve
per configuration) and prints the tables. --long_prompt_lengths and
--cpu_paths instead run their own child processes
(`chunkwise/bench/long_prompts.py`, `cpu_paths.py`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import jax
import numpy as np
from absl import app, flags

from chunkwise import checkpoints, cpu_kernels, partitioning
from chunkwise.bench import cpu_paths as bench_cpu_paths
from chunkwise.bench import (
  families,
  long_prompts,
  reference,
  report,
  settings,
  suite,
)
from chunkwise.constraints.constraint import tables_kind
from chunkwise.inference import Chunk
from chunkwise.precision import PRECISIONS

_MODEL = flags.DEFINE_string(
  "model",
  "smollm2-135m",
  "A model name, a .gguf file, a Hugging Face or chunkwise checkpoint "
  "directory, or random:<preset> (random weights).",
)
flags.DEFINE_list(
  "weights", ["float32"], f"Weight configurations, any of {settings.WEIGHTS}."
)
_LAYOUT = flags.DEFINE_string(
  "layout", "reference", "Layout, e.g. reference, ws_2d/yz, wg/x."
)
_MESH = flags.DEFINE_string(
  "mesh", None, "Mesh shape XxYxZ (default 1x1xdevices for a sharded layout)."
)
flags.DEFINE_string(
  "prompt", "The capital of France is", "Decode prompt (after BOS)."
)
_STEPS = flags.DEFINE_integer(
  "steps", 128, "Greedy tokens per decode.", lower_bound=1
)
flags.DEFINE_list(
  "decode_batches", ["1", "2", "4", "8", "16", "32", "64"], "Decode batches."
)
flags.DEFINE_list("prefill_batches", ["1", "8"], "Prefill batch sizes.")
flags.DEFINE_list(
  "prefill_lengths", ["6", "512"], "Prefill lengths (tokens per row)."
)
_RUNS = flags.DEFINE_integer(
  "runs", 3, "Timed calls per point (median).", lower_bound=1
)
_COMPARE_HF = flags.DEFINE_bool(
  "compare_hf", False, "Also time transformers on the same weights."
)
flags.DEFINE_list(
  "hf_dtypes",
  ["float32"],
  f"transformers dtypes, any of {reference.TORCH_DTYPES}.",
)
flags.DEFINE_enum(
  "precision",
  None,
  list(PRECISIONS),
  "Matmul precision of our models (default: highest for f32 compute, "
  "default for bf16).",
)
flags.DEFINE_enum(
  "compute_dtype",
  "float32",
  ["float32", "bfloat16"],
  "Dtype of our models' activations (the residual stream).",
)
_OUTPUT = flags.DEFINE_string("output", "benchmark.json", "JSON results.")
_PLOT = flags.DEFINE_string("plot", "benchmark.png", "PNG plot ('' : none).")
flags.DEFINE_integer(
  "bandwidth_mib", 512, "Array summed to measure bandwidth.", lower_bound=1
)
flags.DEFINE_integer(
  "matmul_size",
  2048,
  "n of the n^3 matmul measuring peak FLOP/s.",
  lower_bound=1,
)
flags.DEFINE_list(
  "profile_batches",
  [],
  "Decode batches to profile once per chunkwise configuration: the "
  "costliest XLA ops go to the JSON and the table.",
)
flags.DEFINE_integer("seed", 0, "Seed of prefill ids and weights.")
flags.DEFINE_list(
  "constraints",
  [],
  "Also time greedy decode under these constraints (any of "
  f"{tuple(settings.CONSTRAINTS)}) at every decode batch, and report each "
  "one's table build time and size.",
)
flags.DEFINE_enum(
  "constraint_tables",
  "lazy",
  ["lazy", "eager"],
  "How --constraints compile: lazy (a DFA over bytes, masks walked per "
  "step: the default) or eager (the old states x vocabulary tables, "
  "their plain twin), to compare the two.",
)

flags.DEFINE_bool(
  "continuous",
  False,
  "Also compare continuous batching (generate_many) with static batches "
  "on a long-tailed workload of --continuous_requests requests (80% with "
  "budgets of 8-32 tokens, 20% of --continuous_long), at --slots rows, "
  "for the first --weights configuration; see chunkwise/bench/continuous.py.",
)
flags.DEFINE_integer(
  "continuous_requests", 256, "Requests of the --continuous workload."
)
flags.DEFINE_integer(
  "continuous_long", 256, "Budget of the long 20% of --continuous requests."
)
flags.DEFINE_integer(
  "adapters",
  0,
  "Also time multi-LoRA decode: this many random rank --adapter_rank "
  "adapters on every projection, the --adapter_batch rows taking them in "
  "turn, against the base model's step, side by side (first --weights "
  "configuration; see chunkwise/bench/adapters.py). 0: off.",
)
flags.DEFINE_integer("adapter_rank", 16, "Rank of --adapters.")
flags.DEFINE_integer("adapter_batch", 16, "Decode rows of --adapters.")
flags.DEFINE_integer(
  "slots", 16, "Batch width of --continuous (slots, and static batches)."
)
flags.DEFINE_list(
  "numerics",
  [],
  "Numerics modes to compare side by side (e.g. fast,invariant; see "
  "chunkwise.numerics): per --weights, decode at each --decode_batches and "
  "a prefill of the first --prefill_batches x --prefill_lengths, timed in "
  "--numerics_rounds interleaved rounds (ratios to the first mode), and "
  "each mode's drift: one row's largest score difference across batch "
  "sizes 1-64. The other measurements use the first mode.",
)
flags.DEFINE_integer("numerics_rounds", 5, "Interleaved rounds of --numerics.")
flags.DEFINE_list(
  "numerics_drift_batches",
  ["1", "2", "4", "8", "16", "32", "64"],
  "Batch sizes over which --numerics measures a row's drift.",
)
flags.DEFINE_list(
  "speculate",
  [],
  "Speculative decoding drafters to compare with plain steps side by side "
  "(ngram, forced, draft; see chunkwise.bench.speculation): per --weights "
  "(draft, the int8 copy, with float weights only), "
  "greedy --steps tokens on a copy-heavy and an open-ended chat workload "
  "at each --speculate_batches, --speculate_rounds interleaved rounds.",
)
_SPECULATE_K = flags.DEFINE_integer(
  "speculate_k", 8, "Most drafted tokens per pass of --speculate."
)
flags.DEFINE_float(
  "speculate_weight_rows",
  None,
  "The cost prior of --speculate's passes (Speculation.weight_rows; "
  "default: the settings' own, a 2-core CPU's).",
)
flags.DEFINE_bool(
  "speculate_calibrate",
  True,
  "Time --speculate's passes on this device and use those costs "
  "(Speculation.calibrate); false: the prior's always.",
)
flags.DEFINE_list(
  "speculate_batches", ["1", "16"], "Batch sizes of --speculate."
)
flags.DEFINE_integer(
  "speculate_rounds", 3, "Interleaved rounds of --speculate."
)
flags.DEFINE_list(
  "fast_forward_batches",
  [],
  "Batch sizes at which to time constrained JSON (compact, fast_forward) "
  "with its forced runs appended in one pass, against stepping and against "
  "free text of the same length (chunkwise.bench.fast_forward), "
  "--speculate_rounds interleaved rounds; empty: not run.",
)
_LONG_PROMPT = flags.DEFINE_list(
  "long_prompt_lengths",
  [],
  "Time only long-prompt prefill, one prompt of each length: chunkwise "
  "(key-blocked attention, a long chunk in pieces) against its one-chunk "
  "twin and transformers, each in its own process for its peak RSS "
  "(chunkwise/bench/long_prompts.py); writes --output and exits.",
)
flags.DEFINE_integer(
  "paged_slots",
  0,
  "Also run the --continuous workload through --slots fixed slots against "
  "this many slots sharing the same K/V memory in pages (generate_many's "
  "kv_pages; chunkwise/bench/continuous.py); 0: not run.",
  lower_bound=0,
)
flags.DEFINE_list(
  "paged_attention_contexts",
  [],
  "Also time one layer's decode attention of --slots rows over a paged "
  "K/V pool holding these many columns per row: the Pallas GPU kernel "
  "against the plain view (chunkwise/bench/paged.py; the kernel on a GPU "
  "only).",
)
flags.DEFINE_list(
  "kv_dtype_contexts",
  [],
  "Also time greedy decoding of --slots rows for --steps steps after this "
  "many columns of K/V each, float32 against int8 K/V with the same "
  "weights (chunkwise/bench/kv_dtype.py).",
)
flags.DEFINE_integer(
  "chunked_prefill_length",
  0,
  "Also time decode inter-token latency while a prompt of this many "
  "tokens is admitted into the slot loop, prefilled whole against in "
  "pieces (chunkwise/bench/chunked_prefill.py); 0: not run.",
  lower_bound=0,
)
flags.DEFINE_integer(
  "chunked_prefill_piece",
  0,
  "Columns per piece of --chunked_prefill_length (0: the model's default, "
  "chunkwise/inference/long_prefill.py).",
  lower_bound=0,
)
flags.DEFINE_integer(
  "slot_step_capacity",
  0,
  "Also time a decode step of the slot loop (--slots slots of this many "
  "columns) against plain generate at the same batch and context "
  "(chunkwise/bench/slot_step.py); 0: not run.",
  lower_bound=0,
)
_LONG_RUNS = flags.DEFINE_integer(
  "long_prompt_runs",
  2,
  "Timed --long_prompt_lengths prefills after the first (median); 0: the "
  "first call only, compilation included.",
  lower_bound=0,
)
_CPU_PATHS = flags.DEFINE_list(
  "cpu_paths",
  [],
  "CPU kernel paths to time side by side (chunkwise/bench/cpu_paths.py; "
  "'all': every path this CPU runs), each in a child process with torch "
  "held to the same instruction set: decode at --decode_batches, prefill "
  "of --prefill_lengths, the scoring job on a mixed-length file, under "
  "invariant and fast numerics and in transformers, per --weights.",
)
_CPU_PATHS_ROUNDS = flags.DEFINE_integer(
  "cpu_paths_rounds", 3, "Interleaved rounds of --cpu_paths.", lower_bound=1
)
_CPU_PATHS_TEXTS = flags.DEFINE_integer(
  "cpu_paths_score_texts",
  64,
  "Texts of the --cpu_paths scoring file (16 to 1024 tokens); 0: no scoring.",
  lower_bound=0,
)
_LONG_SIDES = flags.DEFINE_list(
  "long_prompt_sides",
  list(long_prompts.SIDES),
  f"Which of {long_prompts.SIDES} --long_prompt_lengths runs.",
)


def _describe(name: str) -> checkpoints.Description:
  """What the model will be, read without loading weights."""
  try:
    if name.startswith(checkpoints.RANDOM):
      return checkpoints.describe_random(name)
    return checkpoints.describe(name)
  except (ValueError, FileNotFoundError) as e:
    raise app.UsageError(f"--model={name}: {e}") from None


def _long_prompts(described, weights: Sequence[str], modes) -> None:
  """--long_prompt_lengths: each side of each length in a child process
  (chunkwise's in the first of --numerics, if given)."""
  try:
    lengths = settings.positive_ints("long_prompt_lengths", _LONG_PROMPT.value)
    sides = settings.one_of(
      "long_prompt_sides", _LONG_SIDES.value, long_prompts.SIDES
    )
    long_prompts.check(described.hparams, lengths, sides, weights)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  reports = []
  for n in lengths:
    reports.append(
      long_prompts.compare(
        _MODEL.value,
        n,
        sides,
        runs=_LONG_RUNS.value,
        dtype=weights[0],
        numerics=modes[0] if modes else None,
      )
    )
    print("\n".join(long_prompts.lines(reports[-1])), flush=True)
  report.write_json(_OUTPUT.value, {"long_prompts": reports})


def _cpu_paths(kinds, decode_batches, prefill_lengths) -> None:
  """--cpu_paths: each path's side-by-side figures, in child processes."""
  available = cpu_kernels.isa.available()
  if not available:
    raise app.UsageError("--cpu_paths: the CPU kernels did not build here")
  wanted = list(available) if _CPU_PATHS.value == ["all"] else _CPU_PATHS.value
  try:
    settings.one_of("cpu_paths", wanted, available)
    settings.one_of("weights", kinds, ("float32", "int8"))
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  result = bench_cpu_paths.compare(
    _MODEL.value,
    wanted,
    weights=kinds,
    decode_batches=decode_batches,
    prefill_lengths=prefill_lengths,
    score_texts=_CPU_PATHS_TEXTS.value,
    steps=_STEPS.value,
    rounds=_CPU_PATHS_ROUNDS.value,
    runs=_RUNS.value,
  )
  report.write_json(_OUTPUT.value, {"cpu_paths": result})
  print(bench_cpu_paths.table(result))


def main(argv: Sequence[str]) -> None:
  try:
    run(argv)
  except app.UsageError as e:  # one line, not the whole usage text
    print(f"benchmark.py: error: {e}", file=sys.stderr)
    sys.exit(1)


def run(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Every flag is checked before any weights load or anything is timed.
  try:
    s = settings.from_flags(flags.FLAGS.flag_values_dict())
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  for path in (_OUTPUT.value, _PLOT.value):
    folder = os.path.dirname(os.path.abspath(path)) if path else "."
    if not os.path.isdir(folder):
      raise app.UsageError(f"{path!r}: folder {folder!r} does not exist")
  try:
    layout = partitioning.Layout.parse(_LAYOUT.value)
    shape = partitioning.parse_mesh(_MESH.value) if _MESH.value else None
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  described = _describe(s.model)
  if _LONG_PROMPT.value:
    return _long_prompts(described, list(s.weights), s.numerics)
  if _CPU_PATHS.value:
    return _cpu_paths(list(s.weights), s.decode_batches, s.prefill_lengths)
  h, vocab = described.hparams, described.vocab
  if vocab is None:
    raise app.UsageError(f"--model={s.model} has no tokenizer")
  prompt = np.asarray(
    Chunk.tokenize(
      vocab, [s.prompt], is_first_chunk=True, bos_id=described.bos_id
    ).tokens[0]
  ).tolist()
  hf_device = None
  try:
    s.check(h, len(prompt))
    if s.hf_dtypes:
      reference.check_supported(h)
      reference.threads()
      hf_device = reference.device()
    # The named constraints compile before anything is timed.
    with tables_kind(flags.FLAGS.constraint_tables):
      rows = [suite.constraint_row(name, described) for name in s.constraints]
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if shape is None and layout.kind.value != "reference":
    shape = (1, 1, jax.device_count())
  mesh = None if shape is None else partitioning.make_mesh(shape)
  for row in rows:
    row["tables"] = flags.FLAGS.constraint_tables
  with tables_kind(flags.FLAGS.constraint_tables):
    result = suite.measure(s, described, prompt, mesh, layout, hf_device, rows)
  report.write_json(_OUTPUT.value, result)
  if _PLOT.value:
    report.plot(_PLOT.value, result)
  print(families.tables(result))


if __name__ == "__main__":
  app.run(main)
