"""Resumable JSON-lines output of batch jobs.

  out = Output("scores.jsonl")                 # reads what is already there
  todo = [p for p in prepared if key(p) not in out.done]
  out.append(records)                          # whole lines, flushed, synced
  out.finish(order)                            # file order, shards merged

Every record is one line, written with the rest of its batch in one
`write`, flushed and fsynced. A job killed in the middle of a write can
leave a partial last line; opening the file again cuts it off (and logs
so), and the ids of complete lines count as done, so a re-run with the
same `--output` skips them and writes each remaining id once.

With several processes (multi-host jobs) process p appends its rows to
its own shard `<output>.process-<p>-of-<n>`; `finish` (every process
calls it; process 0 writes) merges the shards into `<output>`. At the end
`<output>` is rewritten once, atomically (a temporary file renamed over
it), with the records in input order: complete runs give the same file
however they were split, interrupted or resumed. `<output>.job.json`
records the settings that change results (model, shared prefix, sampling
flags, ...); resuming with other settings is refused. Resuming assumes the
same input file: plain-text ids are line numbers.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Sequence

from absl import logging

from chunkwise.jobs.examples import id_key


class OutputError(ValueError):
  """An output file this job cannot append to."""


def shard_path(path: str, index: int, count: int) -> str:
  return f"{path}.process-{index}-of-{count}"


def record_id(record: dict) -> str:
  """A scoring record's key: its id (`examples.id_key`); KeyError for a
  record that is not a score."""
  if "logprob" not in record or "num_tokens" not in record:
    raise KeyError("logprob")
  return id_key(record["id"])


def _read(path: str, key, *, repair: bool) -> list[tuple[str, bytes]]:
  """(key, line) of every complete line of `path`; with `repair`, cuts a
  partial last line off the file."""
  if not os.path.exists(path):
    return []
  with open(path, "rb") as f:
    data = f.read()
  end = data.rfind(b"\n") + 1
  if end < len(data):
    logging.warning(
      "%s ends with a partial line (%d bytes) from an interrupted run%s",
      path,
      len(data) - end,
      "; cut it off" if repair else "; ignored",
    )
    if repair:
      with open(path, "r+b") as f:
        f.truncate(end)
  lines = []
  for number, line in enumerate(data[:end].splitlines(), start=1):
    try:
      lines.append((key(json.loads(line)), line + b"\n"))
    except (ValueError, KeyError, TypeError):
      raise OutputError(
        f"{path}:{number}: not a record of this kind of job; choose "
        "another --output"
      ) from None
  return lines


class Output:
  """The output file (and shards) of one job; see the module docstring."""

  def __init__(
    self,
    path: str,
    *,
    process: int = 0,
    processes: int = 1,
    key: Callable[[dict], str] = record_id,
    settings: dict | None = None,
  ):
    """`key` names a record (its id; generation adds the sample index).
    `settings` are recorded in `<output>.job.json` by the run that begins
    the output; a later run with other settings is refused."""
    self.path = os.path.abspath(path)
    self.key = key
    self.order: list[str] | None = None
    self.process, self.processes = process, processes
    if os.path.isdir(self.path):
      raise OutputError(f"--output={path} is a directory, expected a file")
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    self.mine = (
      self.path if processes == 1 else shard_path(self.path, process, processes)
    )
    self._check_settings(settings)
    self.lines: dict[str, bytes] = {}
    for name in [self.path, *self._shards()]:
      for k, line in _read(name, key, repair=name == self.mine):
        self.lines.setdefault(k, line)
    try:  # fails now, not after the first batch, if it cannot be written
      with open(self.mine, "ab"):
        pass
    except OSError as e:
      raise OutputError(f"cannot write --output={path}: {e}") from None

  @property
  def done(self) -> set[str]:
    """Keys of the records already written by any process."""
    return set(self.lines)

  def append(self, records: Sequence[dict]) -> None:
    """Writes `records` as whole lines, flushed and synced to disk; a
    record whose key is already written is left out (a resumed batch
    recomputes the same records)."""
    new = {}
    for r in records:
      k = self.key(r)
      if k not in self.lines and k not in new:
        new[k] = json.dumps(r, ensure_ascii=False).encode() + b"\n"
    if not new:
      return
    with open(self.mine, "ab") as f:
      f.write(b"".join(new.values()))
      f.flush()
      os.fsync(f.fileno())
    self.lines.update(new)

  def finish(self, order: Sequence[str]) -> None:
    """Rewrites `<output>` with every record, those of `order` (keys)
    first in that order, then any others it held; removes the shards.
    Process 0 writes; callers synchronise processes before and after."""
    if self.process != 0:
      return
    shards = self._shards()
    for name in shards:  # other processes' rows
      for k, line in _read(name, self.key, repair=False):
        self.lines.setdefault(k, line)
    missing = [k for k in order if k not in self.lines]
    if missing:
      raise OutputError(
        f"{len(missing)} records are missing from {self.path} and its "
        f"shards (first: {missing[0]}); is --output on a filesystem every "
        "process sees? Re-run to compute them"
      )
    ordered = set(order)
    first = list(order)
    rest = [k for k in self.lines if k not in ordered]
    if rest:
      logging.warning(
        "%s keeps %d records of ids not in this input (at its end)",
        self.path,
        len(rest),
      )
    self.order = first
    tmp = f"{self.path}.tmp"
    with open(tmp, "wb") as f:
      f.writelines(self.lines[k] for k in first + rest)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.path)
    for name in shards:
      os.remove(name)

  def records(self) -> list[dict]:
    """The records of this input (after `finish`; before: all held)."""
    keys = self.lines if self.order is None else self.order
    return [json.loads(self.lines[k]) for k in keys]

  def _shards(self) -> list[str]:
    return sorted(glob.glob(f"{glob.escape(self.path)}.process-*"))

  def check_shards(self) -> None:
    """Every process's shard must be visible here (once all created
    theirs): the output is on a filesystem all processes share."""
    for i in range(self.processes):
      name = shard_path(self.path, i, self.processes)
      if self.processes > 1 and not os.path.exists(name):
        raise OutputError(
          f"process {self.process} cannot see {name}, which process {i} "
          "created: put --output on a filesystem every process sees"
        )

  def _check_settings(self, settings: dict | None) -> None:
    """Compares `settings` with `<output>.job.json`, or writes it."""
    if settings is None:
      return
    path = f"{self.path}.job.json"
    settings = json.loads(json.dumps(settings))
    if os.path.exists(path):
      with open(path) as f:
        before = json.load(f)
      changed = sorted(
        k
        for k in before.keys() | settings.keys()
        if before.get(k) != settings.get(k)
      )
      if changed:
        diffs = ", ".join(
          f"{k}: {before.get(k)!r} then, {settings.get(k)!r} now"
          for k in changed
        )
        raise OutputError(
          f"{self.path} was begun with other settings ({diffs}); resume "
          "with the same flags, or choose another --output"
        )
    elif self.process == 0:
      with open(f"{path}.tmp", "w") as f:
        json.dump(settings, f, indent=1, sort_keys=True)
      os.replace(f"{path}.tmp", path)
