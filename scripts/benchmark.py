"""Benchmarks prefill and decode, against the machine's limits and, with
--compare_hf, against Hugging Face transformers in the same run.

  python scripts/benchmark.py                            # SmolLM2, f32
  python scripts/benchmark.py --weights=float32,int8 --compare_hf \
      --hf_dtypes=float32,bfloat16 --output=bench.json --plot=bench.png
  python scripts/benchmark.py --model=random:tiny --decode_batches=1,4

For each weights configuration (--weights: float32, bfloat16, int8, or
native: a GGUF file's blocks as they are) it
times, after a warm-up call, the median of --runs calls of
  - prefill of every --prefill_batches x --prefill_lengths grid point
    (random token ids after BOS): seconds, tokens/s, MFU;
  - greedy decode of --steps tokens after the --prompt, for every
    --decode_batches size: ms per step, tokens/s, MBU;
  - the first prefill + generate of a fresh program (compilation).
The device's read bandwidth (a sum over --bandwidth_mib) and peak matmul
FLOP/s (a --matmul_size cube, at each dtype and precision the run
multiplies in) are timed on the device in the same run (chains of 1 and
9 passes, see chunkwise/bench/machine.py) and give MBU (decode: weight +
K/V bytes per step / time / bandwidth) and MFU (prefill: matmul FLOPs /
time / the peak of its dtype and precision). --compare_hf copies the same
weights into transformers' Llama on JAX's device (one model per
--hf_dtypes), times its forward pass and `generate` on the same ids and
batch sizes, and reports tokens/s ratios. --profile_batches profiles one
decode call per batch (ops, time by kind, busy share). --model=random:
<preset> draws weights of any preset on the device when they fit.
--constraints times decode again under each named
constraint (structured generation) and reports its table build time and
size, and the per-step cost against free decode. Writes --output (JSON)
and --plot (PNG: latency per token against throughput, one curve per
configuration) and prints a table.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from chunkwise import (
  checkpoints,
  constraints,
  cpu_kernels,
  memory,
  partitioning,
)
from chunkwise.bench import adapters as bench_adapters
from chunkwise.bench import chunked_prefill as bench_chunked
from chunkwise.bench import continuous as bench_continuous
from chunkwise.bench import cpu_paths as bench_cpu_paths
from chunkwise.bench import kv_dtype as bench_kv_dtype
from chunkwise.bench import (
  long_prompts,
  machine,
  profile,
  reference,
  report,
  roofline,
  timing,
)
from chunkwise.bench import numerics as bench_numerics
from chunkwise.bench import paged as bench_paged
from chunkwise.bench import slot_step as bench_slot_step
from chunkwise.bench import speculation as bench_speculation
from chunkwise.constraints import disk_cache
from chunkwise.constraints import tables as constraint_tables
from chunkwise.inference import Chunk, InferenceModel, Speculation
from chunkwise.models import Weights, init_random
from chunkwise.models.quantized import nbytes, quantize_weights
from chunkwise.numerics import NUMERICS
from chunkwise.precision import PRECISIONS
from chunkwise.precision import resolve as resolve_precision

WEIGHTS = ("float32", "bfloat16", "int8", "native")

_MODEL = flags.DEFINE_string(
  "model",
  "smollm2-135m",
  "A model name, a .gguf file, a Hugging Face or chunkwise checkpoint "
  "directory, or random:<preset> (random weights).",
)
_WEIGHTS = flags.DEFINE_list(
  "weights", ["float32"], f"Weight configurations, any of {WEIGHTS}."
)
_LAYOUT = flags.DEFINE_string(
  "layout", "reference", "Layout, e.g. reference, ws_2d/yz, wg/x."
)
_MESH = flags.DEFINE_string(
  "mesh", None, "Mesh shape XxYxZ (default 1x1xdevices for a sharded layout)."
)
_PROMPT = flags.DEFINE_string(
  "prompt", "The capital of France is", "Decode prompt (after BOS)."
)
_STEPS = flags.DEFINE_integer(
  "steps", 128, "Greedy tokens per decode.", lower_bound=1
)
_DECODE_BATCHES = flags.DEFINE_list(
  "decode_batches", ["1", "2", "4", "8", "16", "32", "64"], "Decode batches."
)
_PREFILL_BATCHES = flags.DEFINE_list(
  "prefill_batches", ["1", "8"], "Prefill batch sizes."
)
_PREFILL_LENGTHS = flags.DEFINE_list(
  "prefill_lengths", ["6", "512"], "Prefill lengths (tokens per row)."
)
_RUNS = flags.DEFINE_integer(
  "runs", 3, "Timed calls per point (median).", lower_bound=1
)
_COMPARE_HF = flags.DEFINE_bool(
  "compare_hf", False, "Also time transformers on the same weights."
)
_HF_DTYPES = flags.DEFINE_list(
  "hf_dtypes",
  ["float32"],
  f"transformers dtypes, any of {reference.TORCH_DTYPES}.",
)
_PRECISION = flags.DEFINE_enum(
  "precision",
  None,
  list(PRECISIONS),
  "Matmul precision of our models (default: highest for f32 compute, "
  "default for bf16).",
)
_COMPUTE_DTYPE = flags.DEFINE_enum(
  "compute_dtype",
  "float32",
  ["float32", "bfloat16"],
  "Dtype of our models' activations (the residual stream).",
)
_OUTPUT = flags.DEFINE_string("output", "benchmark.json", "JSON results.")
_PLOT = flags.DEFINE_string("plot", "benchmark.png", "PNG plot ('' : none).")
_BANDWIDTH_MIB = flags.DEFINE_integer(
  "bandwidth_mib", 512, "Array summed to measure bandwidth.", lower_bound=1
)
_MATMUL_SIZE = flags.DEFINE_integer(
  "matmul_size",
  2048,
  "n of the n^3 matmul measuring peak FLOP/s.",
  lower_bound=1,
)
_PROFILE_BATCHES = flags.DEFINE_list(
  "profile_batches",
  [],
  "Decode batches to profile once per chunkwise configuration: the "
  "costliest XLA ops go to the JSON and the table.",
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of prefill ids and weights.")
_CONSTRAINTS = flags.DEFINE_list(
  "constraints",
  [],
  "Also time greedy decode under these constraints (names from "
  "CONSTRAINTS: choice, integer, date, json, text) at every decode batch, "
  "and report each one's table build time and size.",
)

_CONTINUOUS = flags.DEFINE_bool(
  "continuous",
  False,
  "Also compare continuous batching (generate_many) with static batches "
  "on a long-tailed workload of --continuous_requests requests (80% with "
  "budgets of 8-32 tokens, 20% of --continuous_long), at --slots rows, "
  "for the first --weights configuration; see chunkwise/bench/continuous.py.",
)
_CONTINUOUS_REQUESTS = flags.DEFINE_integer(
  "continuous_requests", 256, "Requests of the --continuous workload."
)
_CONTINUOUS_LONG = flags.DEFINE_integer(
  "continuous_long", 256, "Budget of the long 20% of --continuous requests."
)
_ADAPTERS = flags.DEFINE_integer(
  "adapters",
  0,
  "Also time multi-LoRA decode: this many random rank --adapter_rank "
  "adapters on every projection, the --adapter_batch rows taking them in "
  "turn, against the base model's step, side by side (first --weights "
  "configuration; see chunkwise/bench/adapters.py). 0: off.",
)
_ADAPTER_RANK = flags.DEFINE_integer("adapter_rank", 16, "Rank of --adapters.")
_ADAPTER_BATCH = flags.DEFINE_integer(
  "adapter_batch", 16, "Decode rows of --adapters."
)
_SLOTS = flags.DEFINE_integer(
  "slots", 16, "Batch width of --continuous (slots, and static batches)."
)
_NUMERICS = flags.DEFINE_list(
  "numerics",
  [],
  "Numerics modes to compare side by side (e.g. fast,invariant; see "
  "chunkwise.numerics): per --weights, decode at each --decode_batches and "
  "a prefill of the first --prefill_batches x --prefill_lengths, timed in "
  "--numerics_rounds interleaved rounds (ratios to the first mode), and "
  "each mode's drift: one row's largest score difference across batch "
  "sizes 1-64. The other measurements use the first mode.",
)
_NUMERICS_ROUNDS = flags.DEFINE_integer(
  "numerics_rounds", 5, "Interleaved rounds of --numerics."
)
_NUMERICS_DRIFT = flags.DEFINE_list(
  "numerics_drift_batches",
  ["1", "2", "4", "8", "16", "32", "64"],
  "Batch sizes over which --numerics measures a row's drift.",
)
_SPECULATE = flags.DEFINE_list(
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
_SPECULATE_BATCHES = flags.DEFINE_list(
  "speculate_batches", ["1", "16"], "Batch sizes of --speculate."
)
_SPECULATE_ROUNDS = flags.DEFINE_integer(
  "speculate_rounds", 3, "Interleaved rounds of --speculate."
)
_LONG_PROMPT = flags.DEFINE_list(
  "long_prompt_lengths",
  [],
  "Time only long-prompt prefill, one prompt of each length: chunkwise "
  "(key-blocked attention, a long chunk in pieces) against its one-chunk "
  "twin and transformers, each in its own process for its peak RSS "
  "(chunkwise/bench/long_prompts.py); writes --output and exits.",
)
_PAGED_SLOTS = flags.DEFINE_integer(
  "paged_slots",
  0,
  "Also run the --continuous workload through --slots fixed slots against "
  "this many slots sharing the same K/V memory in pages (generate_many's "
  "kv_pages; chunkwise/bench/continuous.py); 0: not run.",
  lower_bound=0,
)
_PAGED_ATTENTION = flags.DEFINE_list(
  "paged_attention_contexts",
  [],
  "Also time one layer's decode attention of --slots rows over a paged "
  "K/V pool holding these many columns per row: the Pallas GPU kernel "
  "against the plain view (chunkwise/bench/paged.py; the kernel on a GPU "
  "only).",
)
_KV_DTYPE_CONTEXTS = flags.DEFINE_list(
  "kv_dtype_contexts",
  [],
  "Also time greedy decoding of --slots rows for --steps steps after this "
  "many columns of K/V each, float32 against int8 K/V with the same "
  "weights (chunkwise/bench/kv_dtype.py).",
)
_CHUNKED_PREFILL = flags.DEFINE_integer(
  "chunked_prefill_length",
  0,
  "Also time decode inter-token latency while a prompt of this many "
  "tokens is admitted into the slot loop, prefilled whole against in "
  "pieces (chunkwise/bench/chunked_prefill.py); 0: not run.",
  lower_bound=0,
)
_CHUNKED_PIECE = flags.DEFINE_integer(
  "chunked_prefill_piece",
  0,
  "Columns per piece of --chunked_prefill_length (0: the model's default, "
  "chunkwise/inference/long_prefill.py).",
  lower_bound=0,
)
_SLOT_STEP = flags.DEFINE_integer(
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

# Named constraints: the acceptance set, plus free text (any
# character but NUL), which never forces an early stop.
CONSTRAINTS = {
  "choice": constraints.Choice(["yes", "no", "maybe"]),
  "integer": constraints.Regex(r"-?(0|[1-9][0-9]*)"),
  "date": constraints.Regex(
    r"(19|20)[0-9][0-9]-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
  ),
  "json": constraints.JsonSchema(
    {
      "type": "object",
      "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer"},
      },
      "required": ["name", "age"],
    }
  ),
  "text": constraints.Regex(r"[^\x00]*"),
}


def _positive_ints(name: str, values: Sequence[str]) -> list[int]:
  out = []
  for v in values:
    try:
      n = int(v)
    except ValueError:
      n = 0
    if n < 1:
      raise app.UsageError(
        f"--{name}: {v!r} is not a positive integer (got {list(values)})"
      )
    out.append(n)
  if not out:
    raise app.UsageError(f"--{name} is empty: expected positive integers")
  return out


def _one_of(name: str, values: Sequence[str], allowed) -> list[str]:
  bad = [v for v in values if v not in allowed]
  if bad or not values:
    raise app.UsageError(
      f"--{name}={','.join(values)}: expected a list of {allowed}"
    )
  return list(dict.fromkeys(values))


def _describe(name: str) -> checkpoints.Description:
  """What the model will be, read without loading weights."""
  try:
    if name.startswith(checkpoints.RANDOM):
      return checkpoints.describe_random(name)
    described = checkpoints.describe(name)
  except (ValueError, FileNotFoundError) as e:
    raise app.UsageError(f"--model={name}: {e}") from None
  return described


def _init_dtype(weights: str) -> str:
  """What random weights are drawn in (int8: quantized from bf16)."""
  return "float32" if weights == "float32" else "bfloat16"


def _check_fits(name: str, h, kinds: Sequence[str]) -> None:
  """Random weights are drawn on the device: refuse, in one line, a preset
  whose largest configuration would not fit in its free memory."""
  need = max(
    h.num_params() * np.dtype(_init_dtype(k)).itemsize
    + (h.num_params() if k == "int8" else 0)
    for k in kinds
  )
  try:
    memory.check_fits(
      f"{h.num_params() / 1e9:.2f}B random weights for "
      f"--weights={','.join(kinds)}",
      need,
    )
  except ValueError as e:
    raise app.UsageError(f"--model={name}: {e}") from None


def _load(
  name: str, described, weights: str, mesh, layout, numerics=None
) -> InferenceModel:
  dtype = "bfloat16" if weights == "bfloat16" else "float32"
  quantize = weights if weights in ("int8", "native") else None
  common = dict(
    mesh=mesh,
    layout=layout,
    precision=_PRECISION.value,
    compute_dtype=jnp.dtype(_COMPUTE_DTYPE.value),
    numerics=numerics,
  )
  if not name.startswith(checkpoints.RANDOM):
    return checkpoints.load(name, dtype=dtype, quantize=quantize, **common)
  if quantize == "native":
    raise app.UsageError(
      f"--weights=native keeps a GGUF file's blocks; --model={name} is random"
    )
  h = described.hparams
  # Drawn on the default device from the shapes alone, leaf by leaf.
  params = init_random(h, jax.random.key(_SEED.value), _init_dtype(weights))
  if quantize == "int8":
    params = quantize_weights(params, Weights.axes(h))
  return InferenceModel(h, params, described.vocab, **common)


def _long_prompts(described, kinds: Sequence[str], modes) -> None:
  """--long_prompt_lengths: each side of each length in a child process
  (chunkwise's in the first of --numerics, if given)."""
  lengths = _positive_ints("long_prompt_lengths", _LONG_PROMPT.value)
  sides = _one_of("long_prompt_sides", _LONG_SIDES.value, long_prompts.SIDES)
  if kinds == ["int8"]:
    raise app.UsageError("--long_prompt_lengths times float weights")
  longest = max(lengths)
  if longest > described.hparams.max_len:
    raise app.UsageError(
      f"--long_prompt_lengths: {longest} tokens exceed the model's "
      f"max_len={described.hparams.max_len}"
    )
  if "transformers" in sides:
    try:
      reference.check_supported(described.hparams)
    except ValueError as e:
      raise app.UsageError(f"--long_prompt_sides: {e}") from None
  reports = []
  for n in lengths:
    reports.append(
      long_prompts.compare(
        _MODEL.value,
        n,
        sides,
        runs=_LONG_RUNS.value,
        dtype=kinds[0],
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
  _one_of("cpu_paths", wanted, available)
  _one_of("weights", kinds, ("float32", "int8"))
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
  kinds = _one_of("weights", _WEIGHTS.value, WEIGHTS)
  hf_dtypes = _one_of("hf_dtypes", _HF_DTYPES.value, reference.TORCH_DTYPES)
  decode_batches = _positive_ints("decode_batches", _DECODE_BATCHES.value)
  profile_batches = (
    _positive_ints("profile_batches", _PROFILE_BATCHES.value)
    if _PROFILE_BATCHES.value
    else []
  )
  prefill_batches = _positive_ints("prefill_batches", _PREFILL_BATCHES.value)
  modes = (
    _one_of("numerics", _NUMERICS.value, NUMERICS) if _NUMERICS.value else []
  )
  drift_batches = _positive_ints(
    "numerics_drift_batches", _NUMERICS_DRIFT.value
  )
  if _NUMERICS_ROUNDS.value < 1:
    raise app.UsageError(
      f"--numerics_rounds={_NUMERICS_ROUNDS.value}: expected at least 1"
    )
  prefill_lengths = _positive_ints("prefill_lengths", _PREFILL_LENGTHS.value)
  drafters = (
    _one_of("speculate", _SPECULATE.value, Speculation.DRAFTERS)
    if _SPECULATE.value
    else []
  )
  speculate_batches = _positive_ints(
    "speculate_batches", _SPECULATE_BATCHES.value
  )
  try:
    speculations = {
      d: Speculation(drafter=d, k=_SPECULATE_K.value).checked()
      for d in drafters
    }
  except ValueError as e:
    raise app.UsageError(f"--speculate_k: {e}") from None
  if _SPECULATE_ROUNDS.value < 1:
    raise app.UsageError(
      f"--speculate_rounds={_SPECULATE_ROUNDS.value}: expected at least 1"
    )
  for path in (_OUTPUT.value, _PLOT.value):
    folder = os.path.dirname(os.path.abspath(path)) if path else "."
    if not os.path.isdir(folder):
      raise app.UsageError(f"{path!r}: folder {folder!r} does not exist")
  try:
    layout = partitioning.Layout.parse(_LAYOUT.value)
    shape = partitioning.parse_mesh(_MESH.value) if _MESH.value else None
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  described = _describe(_MODEL.value)
  if _LONG_PROMPT.value:
    _long_prompts(described, kinds, modes)
    return
  if _CPU_PATHS.value:
    _cpu_paths(kinds, decode_batches, prefill_lengths)
    return
  h, vocab, bos_id = described.hparams, described.vocab, described.bos_id
  if vocab is None:
    raise app.UsageError(f"--model={_MODEL.value} has no tokenizer")
  prompt = np.asarray(
    Chunk.tokenize(
      vocab, [_PROMPT.value], is_first_chunk=True, bos_id=bos_id
    ).tokens[0]
  ).tolist()
  if _CONTINUOUS.value:
    for name, flag in (
      ("continuous_requests", _CONTINUOUS_REQUESTS),
      ("continuous_long", _CONTINUOUS_LONG),
      ("slots", _SLOTS),
    ):
      if flag.value < 1:
        raise app.UsageError(f"--{name} must be >= 1, got {flag.value}")
  for name, flag in (
    ("paged_attention_contexts", _PAGED_ATTENTION),
    ("kv_dtype_contexts", _KV_DTYPE_CONTEXTS),
  ):
    for c in flag.value:
      if not c.isdigit() or int(c) < 1:
        raise app.UsageError(f"--{name}: {c!r} is not a count of columns >= 1")
      if int(c) + _STEPS.value > h.max_len:
        raise app.UsageError(
          f"--{name}: {c} columns and --steps={_STEPS.value} pass the "
          f"model's {h.max_len} positions"
        )
  if _SLOT_STEP.value:
    try:
      bench_slot_step.check(
        _SLOTS.value,
        _SLOT_STEP.value,
        len(prompt),
        h.max_len,
        max(_RUNS.value, 1),
      )
    except ValueError as e:
      raise app.UsageError(f"--slot_step_capacity: {e}") from None
  for name, flag, low in (
    ("adapters", _ADAPTERS, 0),
    ("adapter_rank", _ADAPTER_RANK, 1),
    ("adapter_batch", _ADAPTER_BATCH, 1),
  ):
    if flag.value < low:
      raise app.UsageError(f"--{name} must be >= {low}, got {flag.value}")
  longest = max(
    [
      *prefill_lengths,
      len(prompt) + _STEPS.value,
      len(prompt) + 8 + (_CONTINUOUS_LONG.value if _CONTINUOUS.value else 0),
      _CHUNKED_PREFILL.value + 4,
    ]
  )
  if longest > h.max_len:
    raise app.UsageError(
      f"{longest} tokens (longest prefill, or prompt + --steps) exceed the "
      f"model's max_len={h.max_len}"
    )
  hf_device = None
  if _COMPARE_HF.value:
    try:
      reference.check_supported(h)
      reference.threads()
      hf_device = reference.device()
    except ValueError as e:
      raise app.UsageError(f"--compare_hf: {e}") from None
  if _MODEL.value.startswith(checkpoints.RANDOM):
    _check_fits(_MODEL.value, h, kinds)
  named = (
    _one_of("constraints", _CONSTRAINTS.value, tuple(CONSTRAINTS))
    if _CONSTRAINTS.value
    else []
  )
  table_rows = [_build(name, described) for name in named]
  if shape is None and layout.kind.value != "reference":
    shape = (1, 1, jax.device_count())
  mesh = None if shape is None else partitioning.make_mesh(shape)

  # Peak FLOP/s at the dtype and precision each configuration multiplies
  # in: ours (compute dtype, --precision) and transformers' (its dtype).
  compute = _COMPUTE_DTYPE.value
  ours = (compute, resolve_precision(_PRECISION.value, compute))
  matmuls = [ours] + [
    (d, resolve_precision(None, d)) for d in (hf_dtypes if hf_device else [])
  ]
  limits = machine.measure(
    bandwidth_bytes=_BANDWIDTH_MIB.value << 20,
    matmul_size=_MATMUL_SIZE.value,
    runs=max(_RUNS.value, 3),
    matmuls=matmuls,
  )
  logging.info("machine: %s", limits.describe())
  grid = [
    timing.token_ids(
      batch=b, length=n, vocab=h.vocab, bos_id=bos_id, seed=_SEED.value
    )
    for b in prefill_batches
    for n in prefill_lengths
  ]
  results = []
  for i, kind in enumerate(kinds):
    compared = {
      mode: _load(_MODEL.value, described, kind, mesh, layout, mode)
      for mode in modes
    }
    model = (
      compared[modes[0]]
      if modes
      else _load(_MODEL.value, described, kind, mesh, layout)
    )
    size = nbytes(model.weights)  # a reordering keeps every byte
    itemsize = model.cache_dtype.itemsize
    config = {
      "name": f"chunkwise {kind}",
      "kind": "chunkwise",
      "weights": kind,
      "layout": str(model.layout),
      "weight_bytes": size,
    }
    if compared:
      config["numerics"] = bench_numerics.compare(
        compared,
        prompt,
        decode_batches=decode_batches,
        prefill_shape=(prefill_batches[0], prefill_lengths[0]),
        steps=_STEPS.value,
        rounds=_NUMERICS_ROUNDS.value,
        runs=_RUNS.value,
        seed=_SEED.value,
      )
      config["numerics"]["drift"] = {
        mode: bench_numerics.drift(
          m, prompt, batches=drift_batches, seed=_SEED.value
        )
        for mode, m in compared.items()
      }
      logging.info("%s numerics: %s", config["name"], config["numerics"])
      del compared
    # The int8 draft of int8 weights would be the weights themselves.
    runnable = {
      d: s for d, s in speculations.items() if d != "draft" or kind != "int8"
    }
    if runnable:
      config["speculation"] = bench_speculation.compare(
        model,
        runnable,
        batches=speculate_batches,
        steps=_STEPS.value,
        rounds=_SPECULATE_ROUNDS.value,
      )
      logging.info("%s speculation: %s", config["name"], config["speculation"])
    if i == 0 and _PAGED_ATTENTION.value:
      config["paged_attention"] = bench_paged.compare(
        h,
        rows=_SLOTS.value,
        contexts=[int(c) for c in _PAGED_ATTENTION.value],
        runs=max(_RUNS.value, 1),
      )
      logging.info("paged attention: %s", config["paged_attention"])
    if i == 0 and _KV_DTYPE_CONTEXTS.value:
      config["kv_dtype"] = bench_kv_dtype.compare(
        model,
        rows=_SLOTS.value,
        contexts=[int(c) for c in _KV_DTYPE_CONTEXTS.value],
        steps=_STEPS.value,
        runs=max(_RUNS.value, 1),
      )
      logging.info("kv dtype: %s", config["kv_dtype"])
    if i == 0 and _SLOT_STEP.value:
      config["slot_step"] = bench_slot_step.compare(
        model,
        prompt,
        slots=_SLOTS.value,
        capacity=_SLOT_STEP.value,
        runs=max(_RUNS.value, 1),
      )
      logging.info("%s slot step: %s", config["name"], config["slot_step"])
    if _CHUNKED_PREFILL.value:
      config["chunked_prefill"] = bench_chunked.compare(
        model,
        prompt,
        long_length=_CHUNKED_PREFILL.value,
        steps=_STEPS.value,
        piece=_CHUNKED_PIECE.value or None,
      )
      logging.info(
        "%s chunked prefill: %s", config["name"], config["chunked_prefill"]
      )
    decode = []
    for b in decode_batches:
      point = timing.decode(
        model, prompt, batch=b, steps=_STEPS.value, runs=_RUNS.value
      )
      decode.append(roofline.decode_row(point, h, size, itemsize, limits))
      logging.info("%s decode: %s", config["name"], decode[-1])
    constrained = []
    for name in named:
      for b in decode_batches:
        point = timing.decode(
          model,
          prompt,
          batch=b,
          steps=_STEPS.value,
          runs=_RUNS.value,
          constraint=CONSTRAINTS[name],
        )
        row = roofline.decode_row(point, h, size, itemsize, limits)
        constrained.append({"constraint": name} | row)
        logging.info("%s decode +%s: %s", config["name"], name, row)
    prefill = []
    for ids in grid:
      point = timing.prefill(model, ids, _RUNS.value)
      prefill.append(roofline.prefill_row(point, h, limits.peak(*ours)))
      logging.info("%s prefill: %s", config["name"], prefill[-1])
    if i == 0 and _CONTINUOUS.value:
      requests = bench_continuous.workload(
        model,
        _CONTINUOUS_REQUESTS.value,
        long=_CONTINUOUS_LONG.value,
        seed=_SEED.value,
      )
      config["continuous"] = bench_continuous.compare(
        model, prompt, requests, slots=_SLOTS.value, runs=_RUNS.value
      )
      logging.info("%s continuous: %s", config["name"], config["continuous"])
    if i == 0 and _PAGED_SLOTS.value:
      config["paged"] = bench_continuous.compare_paged(
        model,
        prompt,
        bench_continuous.workload(
          model,
          _CONTINUOUS_REQUESTS.value,
          long=_CONTINUOUS_LONG.value,
          seed=_SEED.value,
        ),
        slots=_SLOTS.value,
        paged_slots=_PAGED_SLOTS.value,
        runs=max(_RUNS.value, 1),
      )
      logging.info("%s paged: %s", config["name"], config["paged"])
    if i == 0 and _ADAPTERS.value:
      config["adapters"] = bench_adapters.compare(
        model,
        prompt,
        adapters=_ADAPTERS.value,
        rank=_ADAPTER_RANK.value,
        batch=_ADAPTER_BATCH.value,
        steps=_STEPS.value,
        runs=_RUNS.value,
        seed=_SEED.value,
      )
      logging.info("%s adapters: %s", config["name"], config["adapters"])
    profiles = {}
    for b in profile_batches:
      profiles[str(b)] = profile.measure(
        timing.greedy(
          model, timing.prompt_prefix(model, prompt, b), _STEPS.value
        )
      ).describe()
    results.append(
      config
      | {
        "prefill": prefill,
        "decode": decode,
        "constrained_decode": constrained,
        "profiles": profiles,
      }
    )
    if i == 0 and _COMPARE_HF.value:
      plain = jax.device_get(model.plain_weights())
      del model
      gc.collect()
      for dtype in hf_dtypes:
        results.append(
          _reference(
            h, plain, dtype, hf_device, prompt, grid, decode_batches, limits
          )
        )
      del plain
    else:
      del model
    gc.collect()

  result = {
    "machine": limits.describe(),
    "model": {
      "name": _MODEL.value,
      "params": h.num_params(),
      "prompt": _PROMPT.value,
      "prompt_length": len(prompt),
      "steps": _STEPS.value,
      "runs": _RUNS.value,
    },
    "configs": results,
    "ratios": report.ratios(results),
    "constraint_tables": table_rows,
  }
  report.write_json(_OUTPUT.value, result)
  if _PLOT.value:
    report.plot(_PLOT.value, result)
  print(report.table(result))
  if named:
    print(report.constraint_table(result))
  for config in results:
    if "numerics" in config:
      print(f"{config['name']}, numerics side by side:")
      print(
        bench_numerics.table(config["numerics"], config["numerics"]["drift"])
      )
    if "speculation" in config:
      print(f"{config['name']}, speculation side by side:")
      print(bench_speculation.table(config["speculation"]))
    if "continuous" in config:
      print(bench_continuous.table(config["continuous"]))
    if "adapters" in config:
      print(bench_adapters.table(config["adapters"]))
    if "paged" in config:
      print(bench_continuous.paged_table(config["paged"]))
    if "paged_attention" in config:
      print("\n".join(bench_paged.lines(config["paged_attention"])))
    if "kv_dtype" in config:
      print(
        f"{config['name']}, "
        + "\n".join(bench_kv_dtype.lines(config["kv_dtype"]))
      )
    if "slot_step" in config:
      print(
        f"{config['name']}, "
        + "\n".join(bench_slot_step.lines(config["slot_step"]))
      )
    if "chunked_prefill" in config:
      print(
        f"{config['name']}, "
        + "\n".join(bench_chunked.lines(config["chunked_prefill"]))
      )


def _build(name: str, described) -> dict:
  """Compiles a named constraint from scratch: its table size and time."""
  c = CONSTRAINTS[name]
  stops = list(described.eos_ids)
  constraint_tables.clear_cache()
  try:
    with disk_cache.off():
      t = c.compile(
        described.vocab, stop_ids=stops, width=described.hparams.vocab
      )
  except ValueError as e:
    raise app.UsageError(f"--constraints={name}: {e}") from None
  return {
    "constraint": name,
    "regex": t.regex,
    "states": t.states,
    "classes": t.classes,
    "table_bytes": t.nbytes,
    "build_s": t.build_s,
  }


def _reference(h, plain, dtype, device, prompt, grid, batches, limits):
  hf = reference.to_transformers(h, plain, dtype, device)
  peak = limits.peak(dtype, resolve_precision(None, dtype))
  size = sum(p.numel() * p.element_size() for p in hf.parameters())
  itemsize = 2 if dtype == "bfloat16" else 4
  name = f"transformers {dtype}"
  decode = []
  for b in batches:
    point = reference.decode(
      hf, prompt, batch=b, steps=_STEPS.value, runs=_RUNS.value
    )
    decode.append(roofline.decode_row(point, h, size, itemsize, limits))
    logging.info("%s decode: %s", name, decode[-1])
  prefill = []
  for ids in grid:
    point = reference.prefill(hf, ids, _RUNS.value)
    prefill.append(roofline.prefill_row(point, h, peak))
    logging.info("%s prefill: %s", name, prefill[-1])
  return {
    "name": name,
    "kind": "transformers",
    "weights": dtype,
    "device": device,
    "threads": reference.threads(),
    "weight_bytes": size,
    "prefill": prefill,
    "decode": decode,
  }


if __name__ == "__main__":
  app.run(main)
