"""What the engine decides each segment, in a form every process can take.

  d = Decision(add=[(key, generation, seed)], cancel=[key], steps=1)
  d = share(d)          # process 0's decision on every process
  d.stop                # process 0 is shutting down
  error = agree(error)  # None where every process succeeded

On a pod (JAX's multi-controller runtime) process 0 takes the HTTP
requests and runs the schedule; every process must run the same device
programs in the same order. So each segment, process 0 broadcasts its
decision (the requests it admits to the loop, with the seeds it drew, the
keys it cancels, the steps it runs, the prompts it scores) as JSON bytes
(`partitioning.multihost.broadcast_bytes`), and every process applies it
to its own `LiveSlots`: same adds, same cancels, same steps, hence the
same programs on the same data. With one process `share` returns its
argument.

After applying it, and before the segment's step, every process says
whether it succeeded (`agree`): one failure fails the segment on all.

Constraints travel as their constructor arguments and are compiled on
each process (the compile is deterministic and cached on disk).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from chunkwise import constraints
from chunkwise.partitioning import multihost
from chunkwise.serving.stream import Generation

_CONSTRAINTS = {
  c.__name__: c
  for c in (constraints.Regex, constraints.Choice, constraints.JsonSchema)
}


@dataclasses.dataclass(frozen=True)
class Decision:
  """One segment's schedule (module docstring)."""

  add: tuple = ()  # (key, Generation, seed)
  cancel: tuple = ()  # keys
  steps: int = 0  # decode steps of the segment; 0: none
  stop: bool = False
  score: tuple = ()  # prompts to score: (ids, top_n, adapter)


def _constraint(c) -> dict | None:
  if c is None:
    return None
  fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.init}
  if "choices" in fields:
    fields["choices"] = list(fields["choices"])
  return {"kind": type(c).__name__, "fields": fields}


def _generation(g: Generation) -> dict:
  out = {
    f.name: getattr(g, f.name)
    for f in dataclasses.fields(g)
    if f.name != "constraint"
  }
  out["prompt"] = [int(t) for t in g.prompt]
  out["stop"] = list(g.stop)
  out["stop_ids"] = [int(t) for t in g.stop_ids]
  out["constraint"] = _constraint(g.constraint)
  return out


def _from_generation(d: dict) -> Generation:
  c = d.pop("constraint")
  if c is not None:
    kind = _CONSTRAINTS[c["kind"]]
    fields = dict(c["fields"])
    first = {"Regex": "pattern", "Choice": "choices", "JsonSchema": "schema"}
    c = kind(fields.pop(first[c["kind"]]), **fields)
  return Generation(**d, constraint=c)


def encode(d: Decision) -> bytes:
  return json.dumps(
    {
      "add": [[k, _generation(g), s] for k, g, s in d.add],
      "cancel": list(d.cancel),
      "steps": d.steps,
      "stop": d.stop,
      "score": [list(x) for x in d.score],
    }
  ).encode()


def decode(data: bytes) -> Decision:
  raw: Any = json.loads(data)
  return Decision(
    add=tuple((k, _from_generation(g), s) for k, g, s in raw["add"]),
    cancel=tuple(raw["cancel"]),
    steps=int(raw["steps"]),
    stop=bool(raw["stop"]),
    score=tuple(tuple(x) for x in raw["score"]),
  )


def share(d: Decision | None) -> Decision:
  """Process 0's decision on every process (others pass None)."""
  if not multihost.is_multiprocess():
    assert d is not None
    return d
  return decode(multihost.broadcast_bytes(None if d is None else encode(d)))


class _Failed(Exception):
  pass


def agree(error: str | None) -> str | None:
  """None if every process passes None (its part of the segment went
  well), else the first failing process's error, on every process: one
  small collective on a pod (`multihost.agree`), `error` itself alone."""
  if not multihost.is_multiprocess():
    return error
  try:
    multihost.agree(error, raise_as=_Failed)
  except _Failed as e:
    return str(e)
  return None
