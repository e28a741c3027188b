"""First-call compile time at a given depth: random SmolLM2-shaped weights
with `layers` layers on JAX's default device, a 6-token prefill, then a
4-step greedy generate, each timed on its first call (compile + run) and
the generate again (run only). Prints one JSON object.

  python scripts/compile_time.py 30
  python scripts/compile_time.py 80
"""

from __future__ import annotations

import json
import sys
import time

import jax
import numpy as np

import chunkwise as cw


def _timed(fn):
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


def main(argv) -> None:
  if len(argv) != 2 or not argv[1].isdigit() or int(argv[1]) < 1:
    raise SystemExit(f"usage: {argv[0]} LAYERS (a positive integer)")
  layers = int(argv[1])
  h = cw.configs.get("smollm2-135m").replace(layers=layers)
  model = cw.InferenceModel.random(h, seed=0)
  chunk = cw.Chunk.from_lists([[1, 5, 9, 4, 3, 2]])
  prompt, prefill_s = _timed(lambda: model.prefill(chunk))

  def generate():
    _, result = model.generate(
      [prompt],
      sample_ids=np.arange(1),
      steps=4,
      sampling=cw.Sampling(temperature=0.0),
    )
    return result.per_token_scores

  _, generate_s = _timed(generate)
  _, again_s = _timed(generate)
  print(
    json.dumps(
      {
        "layers": layers,
        "backend": jax.default_backend(),
        "first_prefill_s": round(prefill_s, 2),
        "first_generate_s": round(generate_s, 2),
        "second_generate_s": round(again_s, 3),
      }
    )
  )


if __name__ == "__main__":
  main(sys.argv)
