"""Where a call's time goes, read from a `jax.profiler` trace: time per
XLA operation, per kind of work, and the share of the call the device
was busy.

  p = measure(lambda: model.generate(...), count=15)
  p.kinds          # {"matmul": ms, "copy": ms, "collective": ms, "other": ms}
  p.busy_share     # busy time / wall time of the call
  for op in p.ops: print(op.name, op.kind, op.ms, op.calls, op.share)

On a GPU or TPU the events are the first device's kernels (the trace's
"/device:GPU:0" plane: its "Stream #..." lines; TPU: its "XLA Ops" line),
named by the HLO op that launched them; kernels that XLA:GPU runs
inside a command buffer (a CUDA graph: the op is `command_buffer_N`,
the whole decode step's body) are named by the kernel itself, since one
such op holds matmuls, fusions and copies alike. On the CPU they are XLA:CPU's
thunks on its worker threads ("XLAEigen" lines of the host plane); times
are summed over threads, so an op's `share` is of all the threads' busy
time, and `busy_ms` is the time at least one thread was busy. Names are
those of the optimized HLO (dump it with XLA_FLAGS=--xla_dump_to=DIR).

Kinds are read from the op and kernel names (`kind_of`): collectives,
then matmuls (dots, GEMM kernels, custom and FFI calls: on the CPU our
matmul kernel is the only FFI call, on a GPU cuBLAS is a custom call;
XLA:CPU's YNNPACK/XNNPACK fusions are dot fusions), then copies (copy,
memcpy/memset, slices, concatenation), then everything else.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable

import jax

KINDS = ("matmul", "copy", "collective", "other")
_PATTERNS = (
  (
    "collective",
    re.compile(
      r"all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all"
      r"|nccl"
    ),
  ),
  (
    "matmul",
    re.compile(
      r"dot|gemm|matmul|cublas|cutlass|nvjet|xmma|convolution|custom-call"
      r"|ffi_call|ynn_fusion|xnn_fusion"
    ),
  ),
  ("copy", re.compile(r"copy|memcpy|memset|slice|concatenate")),
)


def kind_of(name: str) -> str:
  """ "matmul", "copy", "collective" or "other" for an op or kernel name."""
  lowered = name.lower()
  for kind, pattern in _PATTERNS:
    if pattern.search(lowered):
      return kind
  return "other"


@dataclasses.dataclass(frozen=True)
class Event:
  """One kernel or thunk: the HLO op it ran and the names to classify."""

  op: str
  kernel: str
  start_ns: float
  duration_ns: float


@dataclasses.dataclass(frozen=True)
class Op:
  name: str
  kind: str
  ms: float  # summed over calls (and CPU threads)
  calls: int
  share: float  # of all the events' time

  def describe(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Profile:
  source: str  # the plane and lines read
  ops: tuple[Op, ...]  # costliest first
  kinds: dict  # kind -> ms, every kind of KINDS
  busy_ms: float  # time some kernel (CPU: some thread) was running
  wall_ms: float  # the call, timed on the host

  @property
  def busy_share(self) -> float:
    return min(self.busy_ms / self.wall_ms, 1.0) if self.wall_ms else 0.0

  def describe(self) -> dict:
    return {
      "source": self.source,
      "wall_ms": self.wall_ms,
      "busy_ms": self.busy_ms,
      "busy_share": self.busy_share,
      "kinds_ms": dict(self.kinds),
      "ops": [op.describe() for op in self.ops],
    }


def _stats(event) -> dict:
  try:
    return dict(event.stats)
  except (TypeError, ValueError):
    return {}


def events(planes: Iterable) -> tuple[str, list[Event]]:
  """(what was read, its events) from a trace's planes: the first GPU or
  TPU plane's kernels if the trace has one, else XLA:CPU's thunks."""
  planes = list(planes)
  devices = [
    p for p in planes if p.name.startswith(("/device:GPU", "/device:TPU"))
  ]
  if devices:
    plane = min(devices, key=lambda p: p.name)
    lines = [line for line in plane.lines if line.name.startswith("Stream")]
    if not lines:
      lines = [line for line in plane.lines if line.name == "XLA Ops"]
    source = f"{plane.name}: {', '.join(sorted({x.name for x in lines}))}"
    out = []
    for line in lines:
      for e in line.events:
        op = str(_stats(e).get("hlo_op") or e.name)
        if op.startswith("command_buffer"):
          op = e.name
        out.append(Event(str(op), e.name, e.start_ns, e.duration_ns))
    return source, out
  out = []
  for plane in planes:
    for line in plane.lines:
      # XLA:CPU runs a program's thunks on its intra-op pool (XLAEigen)
      # or on the client's own threads (XLAPjRtCpuClient), call by call.
      if "XLAEigen" not in line.name and "XLAPjRtCpuClient" not in line.name:
        continue
      for e in line.events:
        op = _stats(e).get("hlo_op")
        if op:  # thunks; executor bookkeeping spans carry no op
          out.append(Event(str(op), e.name, e.start_ns, e.duration_ns))
  return "XLA:CPU thunks (XLAEigen and XLAPjRtCpuClient threads)", out


def busy_ns(found: Iterable[Event]) -> float:
  """Length of the union of the events' intervals."""
  total, end = 0.0, float("-inf")
  for e in sorted(found, key=lambda e: e.start_ns):
    stop = e.start_ns + e.duration_ns
    if stop <= end:
      continue
    total += stop - max(e.start_ns, end)
    end = stop
  return total


def summarize(
  source: str, found: list[Event], wall_ns: float, count: int = 15
) -> Profile:
  """The `count` costliest ops, time per kind and the busy share."""
  ns, calls, kinds = collections.Counter(), collections.Counter(), {}
  kinds_ns = dict.fromkeys(KINDS, 0.0)
  for e in found:
    ns[e.op] += e.duration_ns
    calls[e.op] += 1
    kind = kinds.setdefault(e.op, kind_of(f"{e.op} {e.kernel}"))
    kinds_ns[kind] += e.duration_ns
  total = sum(ns.values()) or 1
  ops = tuple(
    Op(name=k, kind=kinds[k], ms=v / 1e6, calls=calls[k], share=v / total)
    for k, v in ns.most_common(count)
  )
  return Profile(
    source=source,
    ops=ops,
    kinds={k: v / 1e6 for k, v in kinds_ns.items()},
    busy_ms=busy_ns(found) / 1e6,
    wall_ms=wall_ns / 1e6,
  )


def measure(fn: Callable[[], object], count: int = 15) -> Profile:
  """Runs `fn` once under the profiler (after a warm-up call, so nothing
  compiles in the trace) and summarizes the trace."""
  from jax.profiler import ProfileData

  jax.block_until_ready(fn())
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    try:
      start = time.perf_counter_ns()
      jax.block_until_ready(fn())
      wall = time.perf_counter_ns() - start
    finally:
      jax.profiler.stop_trace()
    pattern = os.path.join(trace_dir, "**", "*.xplane.pb")
    found = glob.glob(pattern, recursive=True)
    if not found:
      raise ValueError(f"the profiler wrote no trace under {trace_dir}")
    data = ProfileData.from_file(found[0])
  source, kernels = events(data.planes)
  if not kernels:
    raise ValueError(f"the trace holds no kernels or thunks ({source})")
  return summarize(source, kernels, wall, count)
