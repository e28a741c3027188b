"""Multi-LoRA decode against the base model, side by side.

  report = compare(model, prompt, adapters=4, rank=16, batch=16, steps=64,
                   runs=5)
  report["step_ratio"]          # adapters' step time / the base model's

`adapters` random LoRA adapters of `rank` on all seven projections
(`random_adapter`: small values, so the rows stay language-like) are
served by `model.with_adapters`; the batch's rows take them in turn
(row r runs adapter r mod n). The base model decodes the same rows.
Each run times one greedy `generate` of `steps` tokens of each, the two
alternating (the machine's noise lands on both); per-step times are the
medians over runs divided by the steps run (a row stopping at EOS ends
early). Memory per adapter: its A and B in the compute dtype as stacked
on the device (the stacks hold a power-of-two count of adapters, so the
padding is reported too).
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from chunkwise.bench.timing import prompt_prefix
from chunkwise.inference import InferenceModel, Sampling
from chunkwise.models import lora


def random_adapter(hparams, rank: int, seed: int, scale: float = 0.02):
  """A random adapter on every target: A ~ N(0, 1/fan_in), B ~ N(0,
  scale²/rank) (small deltas, as trained adapters are)."""
  rng = np.random.default_rng(seed)
  layers = []
  for _ in range(hparams.layers):
    pairs = {}
    for t in lora.TARGETS:
      sa, sb = lora.shapes(hparams, t, rank)
      fan_in = int(np.prod(sa[:-1]))
      pairs[t] = (
        (rng.normal(size=sa) / np.sqrt(fan_in)).astype(np.float32),
        (scale * rng.normal(size=sb) / np.sqrt(rank)).astype(np.float32),
      )
    layers.append(pairs)
  return lora.Adapter(
    rank=rank, layers=tuple(layers), targets=lora.TARGETS, source="random"
  )


def _run_steps(tokens, steps: int) -> int:
  kept = np.asarray(tokens.lengths)
  return int(min(steps, kept.max() + (kept.max() < steps)))


def compare(
  model: InferenceModel,
  prompt,
  *,
  adapters: int,
  rank: int,
  batch: int,
  steps: int,
  runs: int,
  seed: int = 0,
) -> dict:
  """See the module docstring; returns a JSON-ready report."""
  h = model.hparams
  made = {
    f"adapter{i}": random_adapter(h, rank, seed + i) for i in range(adapters)
  }
  served = model.with_adapters(made)
  names = list(made)
  rows = [names[r % adapters] for r in range(batch)]
  greedy = Sampling(temperature=0.0)
  ids = np.arange(batch, dtype=np.int32)
  base_prefix = jax.block_until_ready(prompt_prefix(model, prompt, batch))
  lora_prefix = jax.block_until_ready(
    prompt_prefix(served, prompt, batch, adapters=rows)
  )

  def base():
    return model.generate(
      [base_prefix], sample_ids=ids, steps=steps, sampling=greedy
    )

  def adapted():
    return served.generate(
      [lora_prefix], sample_ids=ids, steps=steps, sampling=greedy, adapters=rows
    )

  def once(fn):
    start = time.perf_counter()
    tokens, result = fn()
    jax.block_until_ready(result.per_token_scores)
    return time.perf_counter() - start, tokens

  first = {"base": once(base)[0], "adapters": once(adapted)[0]}
  times = {"base": [], "adapters": []}
  ran = {}
  for _ in range(runs):
    for key, fn in (("base", base), ("adapters", adapted)):
      seconds, tokens = once(fn)
      times[key].append(seconds)
      ran[key] = _run_steps(tokens, steps)
  per_step = {
    k: statistics.median(v) / max(ran[k], 1) for k, v in times.items()
  }
  stacks = lora.stack(h, list(made.values()), dtype=model.compute_dtype)
  stack_bytes = sum(x.nbytes for x in jax.tree.leaves(stacks))
  count = lora.bucket(adapters)
  return {
    "adapters": adapters,
    "rank": rank,
    "batch": batch,
    "steps": ran,
    "runs": runs,
    "first_call_s": first,
    "base_ms_per_step": 1e3 * per_step["base"],
    "adapters_ms_per_step": 1e3 * per_step["adapters"],
    "step_ratio": per_step["adapters"] / per_step["base"],
    "bytes_per_adapter": stack_bytes / count,
    "stacked_adapters": count,
    "host_bytes_per_adapter": next(iter(made.values())).nbytes,
  }


def table(report: dict) -> str:
  r = report
  return (
    f"multi-LoRA decode, batch {r['batch']}, {r['adapters']} adapters of "
    f"rank {r['rank']} (rows take them in turn), medians of {r['runs']} "
    f"alternating runs:\n"
    f"  base      {r['base_ms_per_step']:8.2f} ms/step\n"
    f"  adapters  {r['adapters_ms_per_step']:8.2f} ms/step   "
    f"x{r['step_ratio']:.3f} the base\n"
    f"  memory per adapter: {r['bytes_per_adapter'] / 2**20:.2f} MiB on "
    f"the device (stacks of {r['stacked_adapters']})"
  )
