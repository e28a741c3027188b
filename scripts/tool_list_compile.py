"""Compile time of tool lists never seen, as the server compiles them
(`serving.tools`: each tool's arguments a part of the call format's
frame, `constraints.Framed`) and as one regex (the frame with every
tool's regex written in place), on a model's vocabulary.

  python scripts/tool_list_compile.py --lists=3x3,4x8,8x12,16x16 --runs=3

A list "NxP" is N tools of P properties each (strings, integers,
booleans, enums and arrays of strings in turn; the first required, the
rest optional), tools and properties renamed every run so nothing is
compiled before (the constraint disk cache is off, and no two tools
share an arguments schema). Prints the median milliseconds of each
way and the regex's length.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from absl import app, flags

import chunkwise as cw
from chunkwise import checkpoints
from chunkwise.constraints import disk_cache, lazy
from chunkwise.serving import tools

_MODEL = flags.DEFINE_string(
  "model", "smollm2-135m", "Model name or path, or random:<preset>."
)
_LISTS = flags.DEFINE_list(
  "lists", ["3x3", "4x8", "8x12", "16x16"], "Tool lists: NxP, N tools of P."
)
_RUNS = flags.DEFINE_integer("runs", 3, "Runs per list (median).", 1)

_KINDS = (
  {"type": "string", "description": "a text"},
  {"type": "integer"},
  {"type": "boolean"},
  {"type": "string", "enum": ["a", "b", "c"]},
  {"type": "array", "items": {"type": "string"}},
)


def tool(name: str, properties: int) -> dict:
  """Tool `name`, its properties named after it (no two tools, and no
  two runs, share an arguments schema: the compile worker keeps the DFAs
  of parts it compiled before)."""
  props = {f"{name}_p{j}": _KINDS[j % len(_KINDS)] for j in range(properties)}
  return {
    "type": "function",
    "function": {
      "name": name,
      "description": "a tool",
      "parameters": {
        "type": "object",
        "properties": props,
        "required": [f"{name}_p0"],
      },
    },
  }


def parse_list(text: str) -> tuple[int, int]:
  n, _, p = text.partition("x")
  if not (n.isdigit() and p.isdigit() and int(n) > 0 and int(p) > 0):
    raise app.UsageError(f"--lists: {text!r} is not NxP (e.g. 4x8)")
  return int(n), int(p)


def main(argv: Sequence[str]) -> None:
  del argv
  lists = [parse_list(t) for t in _LISTS.value]
  name = _MODEL.value
  if name.startswith(checkpoints.RANDOM):
    described = checkpoints.describe_random(name)
    model = cw.InferenceModel.random(
      described.hparams, seed=0, vocab=described.vocab
    )
  else:
    model = cw.load(name)
  stops, width = list(model.eos_ids), model.hparams.vocab
  print(
    f"{'tools':>5} {'props':>5} {'framed ms':>10} {'one regex ms':>13} "
    f"{'regex chars':>11}"
  )
  for n, p in lists:
    times = {"framed": [], "regex": []}
    for run in range(_RUNS.value):
      spec = [tool(f"t{run}_{n}x{p}_{i}", p) for i in range(n)]
      for way in times:
        lazy.clear_cache()
        start = time.perf_counter()
        plan = tools.parse(spec, "required", None)
        if way == "framed":
          constraint = plan.constraint()
        else:
          constraint = cw.constraints.Regex(plan.calls_regex())
        with disk_cache.off():
          constraint.compile(model.vocab, stop_ids=stops, width=width)
        times[way].append(time.perf_counter() - start)
    framed, regex = (1e3 * statistics.median(times[w]) for w in times)
    print(
      f"{n:>5} {p:>5} {framed:>10.1f} {regex:>13.1f} "
      f"{len(plan.calls_regex()):>11}",
      flush=True,
    )


if __name__ == "__main__":
  app.run(main)
