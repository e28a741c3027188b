"""Where a call's time goes: XLA:CPU thunks from a `jax.profiler` trace,
summed by operation (the fusion or custom call XLA emitted).

  ops = top_ops(lambda: model.generate(...), count=15)
  for op in ops: print(op.name, op.ms, op.calls, op.share)

Times are summed over the worker threads, so `share` is a fraction of the
threads' busy time; names are those of the optimized HLO (dump it with
XLA_FLAGS=--xla_dump_to=DIR to see what each fuses).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import tempfile
from collections.abc import Callable

import jax


@dataclasses.dataclass(frozen=True)
class Op:
  name: str
  ms: float  # summed over calls and threads
  calls: int
  share: float  # of all the threads' thunk time

  def describe(self) -> dict:
    return dataclasses.asdict(self)


# Executor bookkeeping spans that contain the operations themselves.
_CONTAINERS = ("ThunkExecutor::Execute", "end: ")


def top_ops(fn: Callable[[], object], count: int = 15) -> list[Op]:
  """Runs `fn` once under the profiler (after a warm-up call, so nothing
  compiles in the trace); its `count` costliest ops."""
  from jax.profiler import ProfileData

  jax.block_until_ready(fn())
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    try:
      jax.block_until_ready(fn())
    finally:
      jax.profiler.stop_trace()
    pattern = os.path.join(trace_dir, "**", "*.xplane.pb")
    found = glob.glob(pattern, recursive=True)
    if not found:
      raise ValueError(f"the profiler wrote no trace under {trace_dir}")
    data = ProfileData.from_file(found[0])
  ns, calls = collections.Counter(), collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      if "XLAEigen" not in line.name:  # XLA:CPU's worker threads
        continue
      for event in line.events:
        if event.name.startswith(_CONTAINERS):
          continue
        ns[event.name] += event.duration_ns
        calls[event.name] += 1
  total = sum(ns.values()) or 1
  return [
    Op(name=k, ms=v / 1e6, calls=calls[k], share=v / total)
    for k, v in ns.most_common(count)
  ]
