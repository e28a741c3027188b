"""One process of the pod-fault test (test_serving_multihost.py).

  python tests/pod_fault_worker.py PORT PROCESS_ID OUT_JSON

Two JAX processes (gloo, 4 CPU devices each) serve one 2x2x2 mesh with a
serving `Engine`. Process 1 fails to admit one request (the prompt
FAULT, as if compiling it failed there alone): process 0 has admitted it
and is running another request. Process 0 writes what each request
became; both write how they ended.
"""

from __future__ import annotations

import json
import sys

FAULT = [1, 66, 66, 66]  # the prompt process 1 cannot admit


def main(argv: list[str]) -> None:
  from tests.multihost_worker import start

  process_id, out, model = start(argv)  # the runtime first, then the rest

  import jax

  from chunkwise.serving.engine import Engine
  from chunkwise.serving.stream import Generation

  engine = Engine(model, slots=4, capacity=128, top_n=0, every=1)
  result = {"process_id": process_id}
  if process_id == 1:
    prepare = engine.prepare

    def failing(g, *, seed=None):
      if list(g.prompt) == FAULT:
        raise RuntimeError("injected: this process cannot admit it")
      return prepare(g, seed=seed)

    engine.prepare = failing
    engine.follow()  # returns when process 0 closes
  else:

    def ask(prompt, steps):
      g = Generation(prompt=prompt, max_new_tokens=steps, temperature=0.0)
      return engine.submit(g)

    def ended(stream):
      stream.wait(timeout=240)
      return {
        "finish_reason": stream.finish_reason,
        "error": stream.error,
        "tokens": [t.id for t in stream.tokens],
      }

    result["before"] = ended(ask([1, 9, 8, 7], 12))
    running = ask([1, 5, 6, 7], 60)
    first = next(iter(running))  # it has a slot and has made a token
    fault = ask(FAULT, 8)
    result["running"] = ended(running) | {"first": first.id}
    result["fault"] = ended(fault)
    # Later requests run on every process's fresh loop.
    result["later"] = [ended(ask([1, 9, 8, 7], 12)) for _ in range(2)]
    result["closed_clean"] = engine.close(grace=60)
  result["finished"] = True
  with open(out, "w") as f:
    json.dump(result, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv)
