"""The process that compiles constraints, with real time and memory limits.

  reply = worker.run(request, time_limit_s=30, max_compile_mb=4096,
                     what="the JSON schema from schema.json")

A constraint's automaton can explode (hostile or merely complex schemas),
and a thread cannot be stopped, so compilation runs in a child process
(`automaton.py`, started with the same Python; it imports NumPy and
outlines-core, never chunkwise). One worker is kept alive between requests
and handles one at a time. When a request runs past `time_limit_s` the
worker is killed (SIGKILL) and reaped before `run` raises, so nothing keeps
running or holding memory; the next request starts a fresh worker. The
worker caps its own address space at `max_compile_mb` above its size when
the request arrives (RLIMIT_AS, enforced on Linux), so an explosion ends in
a failed allocation there, reported as a ValueError naming the limit.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

from chunkwise.constraints import automaton, regex_dfa

_SCRIPT = automaton.__file__


class _Process:
  """One live worker: its process, pipes and stderr file."""

  def __init__(self):
    # The native regex compiler is built (once per machine) here, not in
    # the worker, whose memory cap would bind the C++ compiler too.
    regex_dfa.library()
    self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in kill)
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
    self.proc = subprocess.Popen(
      [sys.executable, "-P", _SCRIPT],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=self.stderr,
      env=env,
    )
    self.vocab_key = None
    self.tail = ""

  def kill(self) -> None:
    """Kills (if alive) and reaps the process; keeps its stderr's tail."""
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait()
    if not self.stderr.closed:
      self.stderr.seek(0)
      self.tail = self.stderr.read()[-2000:].decode("utf-8", "replace")
    for stream in (self.proc.stdin, self.proc.stdout, self.stderr):
      with contextlib.suppress(OSError):
        stream.close()


_lock = threading.Lock()
_waiting_lock = threading.Lock()
_current: _Process | None = None


def _shutdown() -> None:
  global _current
  if _current is not None:
    _current.kill()
    _current = None


atexit.register(_shutdown)


def pid() -> int | None:
  """The live worker's process id (None when there is none)."""
  return None if _current is None else _current.proc.pid


_TIMEOUT = object()


def _read_reply(p: _Process, deadline: float):
  """The reply; None if the worker died; `_TIMEOUT` past the deadline."""
  out = p.proc.stdout
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      return _TIMEOUT
    ready, _, _ = select.select([out], [], [], min(left, 0.5))
    if ready:
      try:
        return automaton.read_message(out)
      except Exception:  # a partial reply from a worker that died
        return None


class LimitError(ValueError):
  """The compile ran past one of its limits (time_limit_s,
  max_compile_mb, max_table_mb)."""


class Busy(RuntimeError):
  """`MAX_WAITING` compiles already wait for the worker (HTTP 429)."""


# Compiles that may wait for the worker at once; one more is `Busy`.
MAX_WAITING = 16
# A failed compile is refused at once when asked again within this many
# seconds (the same request, limits and vocabulary): a schema that ran
# 30 s into its limit does not take the worker again for every client.
REMEMBER_FAILURES_S = 600.0
_FAILURES_KEPT = 1024
_failed: collections.OrderedDict = collections.OrderedDict()  # key -> (t, e)
_waiting = 0


def run(
  request: dict,
  *,
  vocab_key: str | None,
  vocab: dict | None,
  time_limit_s: float,
  max_compile_mb: float,
  what: str,
):
  """Sends `request` (`automaton.build`'s arguments but the vocabulary)
  to the worker and returns its result.

  Raises:
    LimitError: it ran past `time_limit_s`, `max_compile_mb` or
      `max_table_mb` (`what` names it).
    ValueError: the constraint cannot be compiled (a failure is
      remembered `REMEMBER_FAILURES_S`: asked again, it is raised at once).
    Busy: `MAX_WAITING` compiles already wait for the worker.
  """
  key = hashlib.sha256(
    pickle.dumps(
      (sorted(request.items()), vocab_key, time_limit_s, max_compile_mb)
    )
  ).hexdigest()
  with _waiting_lock:
    remembered = _failed.get(key)
  if remembered is not None:
    when, error = remembered
    if time.monotonic() - when < REMEMBER_FAILURES_S:
      raise type(error)(f"{error} (it failed the same way before)")
  try:
    return _run(request, vocab_key, vocab, time_limit_s, max_compile_mb, what)
  except ValueError as e:  # LimitError too: remembered
    with _waiting_lock:
      _failed[key] = (time.monotonic(), e)
      while len(_failed) > _FAILURES_KEPT:
        _failed.popitem(last=False)
    raise


def _run(request, vocab_key, vocab, time_limit_s, max_compile_mb, what):
  global _current, _waiting
  with _waiting_lock:
    if _waiting >= MAX_WAITING:
      raise Busy(
        f"{_waiting} constraint compiles are waiting for the compiler; "
        "try again shortly"
      )
    _waiting += 1
  try:
    _lock.acquire()
  finally:
    with _waiting_lock:
      _waiting -= 1
  with contextlib.ExitStack() as held:
    held.callback(_lock.release)
    if _current is not None and _current.proc.poll() is not None:
      _current.kill()
      _current = None
    if _current is None:
      _current = _Process()
    p = _current
    message = {
      **request,
      "vocab_key": vocab_key,
      "max_compile_mb": max_compile_mb,
    }
    if vocab_key is not None and p.vocab_key != vocab_key:
      message["vocab"] = vocab
    start = time.monotonic()
    try:
      automaton.write_message(p.proc.stdin, message)
      p.vocab_key = vocab_key
    except (BrokenPipeError, OSError):
      pass  # it died; reported below
    reply = _read_reply(p, start + time_limit_s)
    if reply is None or reply is _TIMEOUT:
      if reply is None:  # its output closed: let it finish dying
        with contextlib.suppress(subprocess.TimeoutExpired):
          p.proc.wait(timeout=10)
      p.kill()
      _current = None
      if reply is _TIMEOUT:
        raise LimitError(
          f"compiling {what} took over {time_limit_s:g} s (time_limit_s); "
          "it was stopped. Simplify it (fewer or shorter repetitions, "
          "smaller maxLength / maxItems) or raise the limit"
        )
      code, tail = p.proc.returncode, p.tail.strip()
      if "memory allocation" in tail or code == -signal.SIGABRT:
        raise LimitError(_memory_message(what, max_compile_mb))
      raise ValueError(
        f"compiling {what} crashed the compiler process (exit code {code})"
        + (f": {tail.splitlines()[-1]}" if tail else "")
      )
  if "error" in reply:
    # (the table-size check runs in the worker: its message names it)
    kind = LimitError if "max_table_mb=" in reply["error"] else ValueError
    raise kind(reply["error"])
  if "memory" in reply:
    _shutdown_after_memory_error()
    raise LimitError(_memory_message(what, max_compile_mb))
  return automaton.widened(reply["ok"])


def _shutdown_after_memory_error() -> None:
  """A worker that ran out of memory may hold on to it: replace it."""
  with _lock:
    _shutdown()


def _memory_message(what: str, max_mb: float) -> str:
  return (
    f"compiling {what} needed more than {max_mb:g} MB (max_compile_mb); it "
    "was stopped. Simplify it (e.g. a smaller maxLength) or raise the limit"
  )
