"""The benchmark suite: every configuration's measurements in one run
(`scripts/benchmark.py` is its command line, `settings.py` its settings).

  s = settings.from_flags(flags.FLAGS.flag_values_dict())
  s.check(described.hparams, len(prompt_ids))   # a ValueError names a flag
  result = measure(s, described, prompt_ids, mesh, layout, hf_device)
  print(families.tables(result))

Each weights configuration (`weights`: float32, bfloat16, int8, or
native: a GGUF file's blocks as they are) is loaded once. Its prefill
grid (random ids after BOS) and greedy decode after the prompt at each
batch are timed, the median of `runs` calls after a warm-up, free and
under each named constraint (`settings.CONSTRAINTS`, beside its table's
build time and size); numerics modes side by side and profiles (the
costliest XLA ops of one decode call) when asked; then the optional
families (`families.py`: speculation, paged attention, K/V dtype, slot
step, chunked prefill, continuous batching, paged slots, adapters), each
from its own module. With `hf_dtypes`, transformers' copies of the first
configuration's weights are timed on the same ids. The device's read
bandwidth and peak matmul FLOP/s (at each dtype and precision the run
multiplies in) are timed in the same run (`machine.measure`): MBU is
decode's weight and K/V bytes per step over time and bandwidth, MFU
prefill's matmul FLOPs over time and that peak.
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
from absl import logging

from chunkwise import checkpoints
from chunkwise.bench import (
  families,
  machine,
  profile,
  reference,
  report,
  roofline,
  settings,
  timing,
)
from chunkwise.bench import numerics as bench_numerics
from chunkwise.constraints import disk_cache, lazy
from chunkwise.inference import InferenceModel
from chunkwise.models import Weights, init_random
from chunkwise.models.quantized import nbytes, quantize_weights
from chunkwise.precision import resolve as resolve_precision


def load(
  s: settings.Settings, described, weights: str, mesh, layout, numerics=None
):
  """The model of one weights configuration (random weights drawn on the
  default device from the shapes alone, leaf by leaf)."""
  dtype = "bfloat16" if weights == "bfloat16" else "float32"
  quantize = weights if weights in ("int8", "native") else None
  common = dict(
    mesh=mesh,
    layout=layout,
    precision=s.precision,
    compute_dtype=jnp.dtype(s.compute_dtype),
    numerics=numerics,
  )
  if not s.model.startswith(checkpoints.RANDOM):
    return checkpoints.load(s.model, dtype=dtype, quantize=quantize, **common)
  h = described.hparams
  params = init_random(h, jax.random.key(s.seed), settings.init_dtype(weights))
  if quantize == "int8":
    params = quantize_weights(params, Weights.axes(h))
  return InferenceModel(h, params, described.vocab, **common)


def constraint_row(name: str, described) -> dict:
  """Compiles a named constraint from scratch: its table size and time."""
  c = settings.CONSTRAINTS[name]
  lazy.clear_cache()
  try:
    with disk_cache.off():
      t = c.compile(
        described.vocab,
        stop_ids=list(described.eos_ids),
        width=described.hparams.vocab,
      )
  except ValueError as e:
    raise ValueError(f"--constraints={name}: {e}") from None
  return {
    "constraint": name,
    "regex": t.regex,
    "states": t.states,
    "classes": getattr(t, "classes", None),  # eager tables' token classes
    "table_bytes": t.nbytes,
    "build_s": t.build_s,
  }


def measure(
  s: settings.Settings,
  described,
  prompt,
  mesh,
  layout,
  hf_device,
  table_rows=None,
) -> dict:
  """Every configuration of `s`, timed; the JSON `report` writes.
  `prompt`: `s.prompt`'s token ids, BOS first; `table_rows`: the named
  constraints' `constraint_row`s, if already built."""
  h, bos_id = described.hparams, described.bos_id
  if table_rows is None:
    table_rows = [constraint_row(name, described) for name in s.constraints]
  # Peak FLOP/s at the dtype and precision each configuration multiplies
  # in: ours (compute dtype, precision) and transformers' (its dtype).
  ours = (s.compute_dtype, resolve_precision(s.precision, s.compute_dtype))
  hf_dtypes = s.hf_dtypes if hf_device else ()
  limits = machine.measure(
    bandwidth_bytes=s.bandwidth_mib << 20,
    matmul_size=s.matmul_size,
    runs=max(s.runs, 3),
    matmuls=[ours] + [(d, resolve_precision(None, d)) for d in hf_dtypes],
  )
  logging.info("machine: %s", limits.describe())
  grid = [
    timing.token_ids(
      batch=b, length=n, vocab=h.vocab, bos_id=bos_id, seed=s.seed
    )
    for b in s.prefill_batches
    for n in s.prefill_lengths
  ]
  results = []
  for i, kind in enumerate(s.weights):
    compared = {
      m: load(s, described, kind, mesh, layout, m) for m in s.numerics
    }
    model = (
      compared[s.numerics[0]]
      if compared
      else load(s, described, kind, mesh, layout)
    )
    size = nbytes(model.weights)  # a reordering keeps every byte
    config = {
      "name": f"chunkwise {kind}",
      "kind": "chunkwise",
      "weights": kind,
      "layout": str(model.layout),
      "weight_bytes": size,
    }
    if compared:
      config["numerics"] = _numerics(s, compared, prompt)
      del compared
    families.measure(s, config, model, prompt, first=i == 0)
    itemsize = model.cache_dtype.itemsize
    config["decode"] = [
      roofline.decode_row(
        timing.decode(model, prompt, batch=b, steps=s.steps, runs=s.runs),
        h,
        size,
        itemsize,
        limits,
      )
      for b in s.decode_batches
    ]
    # Every row constrained, then (batches past one) one row of the batch:
    # a server's tool call among free requests.
    config["constrained_decode"] = [
      {"constraint": name if rows == b else f"{name}, 1 row"}
      | roofline.decode_row(
        timing.decode(
          model,
          prompt,
          batch=b,
          steps=s.steps,
          runs=s.runs,
          constraint=[settings.CONSTRAINTS[name]] * rows + [None] * (b - rows),
        ),
        h,
        size,
        itemsize,
        limits,
      )
      for name in s.constraints
      for b in s.decode_batches
      for rows in sorted({b, 1})[::-1]
    ]
    config["prefill"] = [
      roofline.prefill_row(
        timing.prefill(model, ids, s.runs), h, limits.peak(*ours)
      )
      for ids in grid
    ]
    config["profiles"] = {
      str(b): profile.measure(
        timing.greedy(model, timing.prompt_prefix(model, prompt, b), s.steps)
      ).describe()
      for b in s.profile_batches
    }
    logging.info("%s: %s", config["name"], config)
    results.append(config)
    if i == 0 and hf_dtypes:
      plain = jax.device_get(model.plain_weights())
      del model
      gc.collect()
      for dtype in hf_dtypes:
        results.append(
          _reference(s, h, plain, dtype, hf_device, prompt, grid, limits)
        )
      del plain
    else:
      del model
    gc.collect()
  return {
    "machine": limits.describe(),
    "model": {
      "name": s.model,
      "params": h.num_params(),
      "prompt": s.prompt,
      "prompt_length": len(prompt),
      "steps": s.steps,
      "runs": s.runs,
    },
    "configs": results,
    "ratios": report.ratios(results),
    "constraint_tables": table_rows,
  }


def _numerics(s: settings.Settings, compared: dict, prompt) -> dict:
  out = bench_numerics.compare(
    compared,
    prompt,
    decode_batches=s.decode_batches,
    prefill_shape=(s.prefill_batches[0], s.prefill_lengths[0]),
    steps=s.steps,
    rounds=s.numerics_rounds,
    runs=s.runs,
    seed=s.seed,
  )
  out["drift"] = {
    mode: bench_numerics.drift(
      m, prompt, batches=s.numerics_drift_batches, seed=s.seed
    )
    for mode, m in compared.items()
  }
  return out


def _reference(s, h, plain, dtype, device, prompt, grid, limits) -> dict:
  """transformers' copy of `plain` in `dtype`, timed on the same ids."""
  hf = reference.to_transformers(h, plain, dtype, device)
  peak = limits.peak(dtype, resolve_precision(None, dtype))
  size = sum(p.numel() * p.element_size() for p in hf.parameters())
  itemsize = 2 if dtype == "bfloat16" else 4
  return {
    "name": f"transformers {dtype}",
    "kind": "transformers",
    "weights": dtype,
    "device": device,
    "threads": reference.threads(),
    "weight_bytes": size,
    "prefill": [
      roofline.prefill_row(reference.prefill(hf, ids, s.runs), h, peak)
      for ids in grid
    ],
    "decode": [
      roofline.decode_row(
        reference.decode(hf, prompt, batch=b, steps=s.steps, runs=s.runs),
        h,
        size,
        itemsize,
        limits,
      )
      for b in s.decode_batches
    ],
  }
