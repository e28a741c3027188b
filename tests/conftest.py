"""Test set-up: 8 host CPU devices (set before JAX starts) and shared models."""

import os

# The suite compiles hundreds of small programs (every layout on every mesh)
# and runs few large ones: LLVM's -O0 compiles them about a quarter faster
# (tests/test_layouts.py) for a few percent slower SmolLM2 runs, which keeps
# CI within its 40 minutes. XLA's semantics, and so every assertion, are
# the same at any optimization level.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_force_host_platform_device_count=8"
  + " --xla_backend_optimization_level=0"
)
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

import pathlib

import jax
import pytest

import chunkwise as cw

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


def pytest_collection_modifyitems(config, items):
  """Tests of the QUICK modules get the `quick` mark. Tests marked `long`
  (SmolLM2 variants that others mostly cover) run with --long only: CI's
  time is bounded."""
  for item in items:
    if item.path.stem in QUICK:
      item.add_marker(pytest.mark.quick)
  if config.getoption("--long"):
    return
  skip = pytest.mark.skip(reason="long: run with --long")
  for item in items:
    if "long" in item.keywords:
      item.add_marker(skip)


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
