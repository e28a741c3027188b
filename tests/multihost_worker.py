"""One process of the two-process multi-host smoke test (test_multihost.py).

  python tests/multihost_worker.py PORT PROCESS_ID OUT_JSON

Starts JAX's multi-controller runtime on CPU (gloo collectives, 4 host
devices per process), runs a prefill / prefill / generate on a 2x2x2 mesh
spanning both processes, and writes the replicated outputs to OUT_JSON.
"""

from __future__ import annotations

import json
import sys


def scenario(model):
  """The calls under test; the test repeats them on a single-process model.

  Returns JSON-ready lists: generated tokens and lengths, and the prefill
  scores of the batch-2 chunk.
  """
  import jax.numpy as jnp
  import numpy as np

  import chunkwise as cw

  first = model.prefill(
    cw.Chunk.tokenize(
      model.vocab, ["Cows have four legs."], is_first_chunk=True
    )
  )
  second = model.prefill(
    cw.Chunk.tokenize(model.vocab, ["Humans have", "Fish have"]),
    prefix=[first],
  )
  tokens, _ = model.generate(
    [first, second],
    sample_ids=jnp.arange(8),
    steps=12,
    sampling=cw.Sampling(temperature=0.7, top_p=0.9),
  )
  return {
    "tokens": np.asarray(tokens.tokens).tolist(),
    "lengths": np.asarray(tokens.lengths).tolist(),
    "scores": np.asarray(second.per_token_scores).tolist(),
  }


def start(argv: list[str]):
  """Joins the two-process runtime from `PORT PROCESS_ID OUT_JSON`;
  returns (process id, output path, the tiny model on the 2x2x2 mesh)."""
  port, process_id, out = int(argv[1]), int(argv[2]), argv[3]

  from chunkwise import partitioning

  partitioning.initialize_multihost(
    f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    cpu_collectives="gloo",
    local_device_count=4,
  )

  import jax

  import chunkwise as cw

  assert jax.process_count() == 2, jax.process_count()
  assert jax.device_count() == 8, jax.devices()
  assert jax.local_device_count() == 4, jax.local_devices()

  mesh = partitioning.make_mesh((2, 2, 2))
  model = cw.InferenceModel.random(
    cw.configs.get("tiny"), seed=0, mesh=mesh, layout="ws_2d"
  )
  return process_id, out, model


def main(argv: list[str]) -> None:
  import jax

  process_id, out, model = start(argv)
  result = scenario(model)
  result["process_id"] = process_id
  with open(out, "w") as f:
    json.dump(result, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv)
