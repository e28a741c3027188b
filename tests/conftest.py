"""Test set-up: 8 host CPU devices (set before JAX starts) and shared models."""

import os
import pathlib
import subprocess
import sys

import pytest

# XLA:CPU's older loop emitters, where this jaxlib still has them: a flag
# XLA does not know aborts the process, so a child asks first, once per
# run (xdist workers and the scripts tests start inherit the answer).
_LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if "CHUNKWISE_TEST_XLA_FLAGS" not in os.environ:
  _probe = subprocess.run(
    [sys.executable, "-c", "import jax; jax.devices('cpu')"],
    env=dict(os.environ, XLA_FLAGS=_LEGACY_EMITTERS, JAX_PLATFORMS="cpu"),
    capture_output=True,
    check=False,
  )
  os.environ["CHUNKWISE_TEST_XLA_FLAGS"] = (
    _LEGACY_EMITTERS if _probe.returncode == 0 else ""
  )
# The suite compiles thousands of small programs (every layout on every
# mesh) and runs few large ones. LLVM's -O0 compiles them about a quarter
# faster (tests/test_layouts.py), and the older emitters about half again
# (tests/test_semantics.py on a cold cache, 2 cores: 60 s, then 33 s; the
# whole suite 1544 s, then 1071 s), for SmolLM2 decode about an eighth
# slower: CI stays within its 25 minutes. XLA's semantics, and so every
# assertion, are the same either way.
os.environ["XLA_FLAGS"] = " ".join(
  [
    os.environ.get("XLA_FLAGS", ""),
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    os.environ["CHUNKWISE_TEST_XLA_FLAGS"],
  ]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Every `cw.load` builds fresh jitted functions, so a program that another
# test (or another xdist worker, or a script a test starts) already
# compiled would be compiled again: JAX's persistent compilation cache,
# keyed by the program and the compile options, serves it from disk. The
# directory is .jax_cache in the checkout unless JAX_COMPILATION_CACHE_DIR
# names another; nothing a test asserts depends on it being warm or cold.
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR",
  os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Compiled constraint tables likewise (chunkwise/constraints/disk_cache.py),
# in the checkout rather than the user's ~/.cache; tests of the cache itself
# point it at a directory of their own.
os.environ.setdefault(
  "CHUNKWISE_CONSTRAINT_CACHE",
  os.path.join(os.path.dirname(os.path.dirname(__file__)), ".constraint_cache"),
)

# JAX reads XLA_FLAGS when it starts: imported after they are set.
import jax  # noqa: E402

import chunkwise as cw  # noqa: E402

_EMPTY_MODULES: list[str] = []


def pytest_addoption(parser):
  parser.addoption(
    "--long",
    action="store_true",
    help="run the long variants (tests/test_hostile_inputs.py: thousands "
    "of fuzz cases per format) and the tests marked `long`",
  )


# The edit-test loop's tier (`pytest -m quick -n 2`, under 5 minutes on 2
# cores with a warm .jax_cache): the DESIGN semantics on the tiny presets,
# the kernels against their definitions, the collectives against their
# twins, constraints' languages, tools, the planner, layering, lint and docs.
# No SmolLM2, no server, no multi-process run.
QUICK = frozenset(
  {
    "test_chat_template",
    "test_buckets",
    "test_chunk",
    "test_collectives",
    "test_configs",
    "test_cpu_kernels",
    "test_disk_cache",
    "test_docs",
    "test_errors",
    "test_invariant_kernels",
    "test_layering",
    "test_lint",
    "test_partitioning",
    "test_planner",
    "test_processors",
    "test_results",
    "test_sampling",
    "test_schedule",
    "test_schema_rewrite",
    "test_semantics",
    "test_tools",
  }
)


# Parametrized tests whose whole matrix runs with --long only (CI's time is
# bounded). By default "cover" runs each value of each parameter at least
# once (the first case that brings a value not seen yet, in collection
# order: every layout kind, sharded axes, collective, mesh, preset and
# variant, not every combination); a number n runs the first n cases.
MATRICES = {
  (
    "test_adapters",
    "test_every_layout_gives_the_single_device_result",
  ): "cover",
  ("test_architectures", "test_every_layout_runs_every_feature"): 3,
  (
    "test_architectures",
    "test_greedy_tokens_match_transformers_past_the_window",
  ): "cover",
  (
    "test_architectures",
    "test_matches_transformers_on_a_padded_batch_and_a_prefix_split",
  ): "cover",
  ("test_blocks", "test_native_every_layout"): 2,
  ("test_engine", "test_chained_calls_do_not_wait_for_the_previous_one"): 1,
  (
    "test_invariance",
    "test_generate_many_slots_are_bit_identical_to_alone",
  ): "cover",
  ("test_invariance", "test_generated_rows_do_not_depend_on_the_batch"): 1,
  ("test_invariance", "test_on_a_mesh"): 1,
  ("test_jobs_adapters", "test_generate_job_mixes_adapters"): 1,
  ("test_layouts", "test_collectives_match_reference"): "cover",
  ("test_layouts", "test_collectives_parallel_block"): "cover",
  ("test_layouts", "test_layout_matches_reference"): "cover",
  ("test_long_prompts", "test_prefill_in_pieces_equals_one_chunk"): 1,
  ("test_quantized", "test_int8_every_layout_and_variant"): "cover",
  ("test_semantics", "test_chunk_splitting_is_invisible"): "cover",
  ("test_semantics", "test_rng_contract_independent_of_batch_packing"): 1,
  (
    "test_semantics",
    "test_rng_contract_independent_of_splitting_generation",
  ): 1,
  (
    "test_serving_tools",
    "test_required_calls_are_valid_greedy_and_sampled",
  ): "cover",
  ("test_sharded_layers", "test_layer_matches_dense"): "cover",
  (
    "test_tpu_compile",
    "test_gguf_block_matmuls_make_no_dequantized_weight",
  ): "cover",
  ("test_tpu_compile", "test_int8_matmuls_make_no_dequantized_weight"): "cover",
  ("test_weight_reads", "test_no_weight_is_copied"): "cover",
}


def _matrix_extras(items) -> list:
  """The cases of MATRICES that run with --long only."""
  cases: dict[tuple, list] = {}
  for item in items:
    key = (item.path.stem, item.originalname)
    if key in MATRICES and hasattr(item, "callspec"):
      cases.setdefault(key, []).append(item)
  extras = []
  for key, group in cases.items():
    keep = MATRICES[key]
    if keep != "cover":
      extras += group[keep:]
      continue
    seen = set()
    for item in group:
      values = set()
      for k, v in item.callspec.params.items():
        # A layout's parts each count: "wg/none/latency" brings wg, none
        # and latency.
        parts = v.split("/") if isinstance(v, str) else [repr(v)]
        values |= {(k, i, part) for i, part in enumerate(parts)}
      if values <= seen:
        extras.append(item)
      seen |= values
  return extras


# Modules holding tests of up to 2 minutes each on 2 cores (a notebook
# kernel, servers, jobs and pods in processes of their own): collected
# first. xdist's worksteal hands each worker a contiguous half of the
# collection and a worker that runs dry steals from the end of the
# other's, so a long test collected last kept one worker busy for a
# minute or two after the other had nothing left. Whole modules move, so
# no module-scoped fixture is set up twice.
FIRST = (
  "test_notebook",
  "test_serving_multihost",
  "test_serving_load",
  "test_multihost",
  "test_jobs",
  "test_serving_warmup",
)


def pytest_collection_modifyitems(config, items):
  """Tests of the QUICK modules get the `quick` mark. Tests marked `long`
  (SmolLM2 variants that others mostly cover) and MATRICES' other cases
  run with --long only: CI's time is bounded. FIRST's modules are
  collected first (a stable sort: every module keeps its order)."""
  first = {name: i for i, name in enumerate(FIRST)}
  items.sort(key=lambda item: first.get(item.path.stem, len(FIRST)))
  for item in items:
    if item.path.stem in QUICK:
      item.add_marker(pytest.mark.quick)
  if config.getoption("--long"):
    return
  skip = pytest.mark.skip(reason="long: run with --long")
  for item in items:
    if "long" in item.keywords:
      item.add_marker(skip)
  matrix = pytest.mark.skip(reason="long: the rest of a matrix (MATRICES)")
  for item in _matrix_extras(items):
    item.add_marker(matrix)


def pytest_collectreport(report):
  """Remembers test modules that define no tests (a silent no-op file)."""
  if (
    report.passed
    and report.nodeid.endswith(".py")
    and pathlib.Path(report.nodeid).name.startswith("test_")
    and not report.result
  ):
    _EMPTY_MODULES.append(report.nodeid)


def pytest_collection_finish(session):
  if _EMPTY_MODULES:
    raise pytest.UsageError(
      f"test files that collected no tests: {sorted(_EMPTY_MODULES)}"
    )


@pytest.fixture(scope="session")
def cpu_devices():
  devices = jax.devices("cpu")
  assert len(devices) >= 8, "conftest failed to force 8 host CPU devices"
  return devices


@pytest.fixture(scope="session")
def tiny():
  """The Llama-style tiny preset (grouped KV heads), f32, random weights."""
  return cw.InferenceModel.random(cw.configs.get("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_parallel():
  """The PaLM-style tiny preset (multiquery), f32, random weights."""
  return cw.InferenceModel.random(cw.configs.get("tiny-parallel"), seed=1)


@pytest.fixture(scope="session")
def smollm2_first_layers(tmp_path_factory):
  """SmolLM2-135M's first 4 of 30 layers, saved as a chunkwise checkpoint
  (its real tokenizer, chat template and embeddings), for the server
  tests whose assertions do not depend on depth: the tool calls, schemas,
  streams and APIs they check are the same code on 4 layers, with a
  seventh of the layers to compile and run (tests/test_serving_messages.py
  alone, cold caches, 2 cores: 103 s, then 47 s). Saved once per run:
  the xdist workers of a run share their base temporary directory's
  parent, under a lock.
  The whole model serves in tests/test_serving_smollm2.py, the notebook
  and the transformers comparisons."""
  import fcntl

  from tests.toy_models import first_layers

  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent
  path = base / "smollm2-135m-first-4-layers"
  with open(base / "smollm2-first-layers.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not path.exists():
      first = first_layers(cw.load("smollm2-135m"), 4)
      cw.save(first, base / "smollm2-partial", overwrite=True)
      (base / "smollm2-partial").rename(path)
  return path
