"""The processes that compile constraints, with real time and memory limits.

  reply = worker.run(request, vocab_key=key, vocab=vocab, time_limit_s=30,
                     max_compile_mb=4096, what="the JSON schema from x.json")

  with worker.Budget(30, name="--compile_budget_s") as budget:
    ...                    # this thread's compiles share 30 s in all
  budget.cancel()          # (another thread) its compile is stopped now

A constraint's automaton can explode (hostile or merely complex schemas),
and a thread cannot be stopped, so compilation runs in child processes
(`automaton.py`, started with the same Python; it imports NumPy and
outlines-core, never chunkwise). Up to `WORKERS` of them are kept alive
between requests, each compiling one at a time, at a lower CPU priority
(`NICE`) than the process that generates; at most `MAX_WAITING` compiles
wait for one (one more is `Busy`). When a compile runs past its time
limit its worker is killed (SIGKILL) and reaped before `run` raises, so
nothing keeps running or holding memory; the next compile starts a fresh
worker. A worker caps its own address space at `max_compile_mb` above its
size when the request arrives (RLIMIT_AS, enforced on Linux), so an
explosion ends in a failed allocation there, reported as a ValueError
naming the limit.

A `Budget` bounds all the compiles of one request together (a request
with many tools, or a schema compiled again narrowed, gets no more time
than one), and `cancel` stops its compile, waiting or running, when the
client that asked has gone. A compile that failed is refused at once
when asked again (`REMEMBER_FAILURES_S`), unless a budget cut it short.
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

# Worker processes compiling at once (the server's --compile_workers).
WORKERS = 2
# How much lower their CPU priority is than this process's: a compile
# takes what generation leaves of the cores, not half of them.
NICE = 10
# Compiles that may wait for a worker at once; one more is `Busy`.
MAX_WAITING = 16
# A failed compile is refused at once when asked again within this many
# seconds (the same request, limits and vocabulary): a schema that ran
# 30 s into its limit does not take a worker again for every client.
REMEMBER_FAILURES_S = 600.0
_FAILURES_KEPT = 1024


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
    with contextlib.suppress(OSError, AttributeError):  # (not POSIX)
      mine = os.getpriority(os.PRIO_PROCESS, 0)
      os.setpriority(os.PRIO_PROCESS, self.proc.pid, min(19, mine + NICE))
    self.vocab_key = None
    self.tail = ""
    self.killed = False
    self.busy = False  # a request sent, its reply not read whole

  def kill(self) -> None:
    """Kills (if alive) and reaps the process; keeps its stderr's tail."""
    self.killed = True
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait()
    if not self.stderr.closed:
      self.stderr.seek(0)
      self.tail = self.stderr.read()[-2000:].decode("utf-8", "replace")
    for stream in (self.proc.stdin, self.proc.stdout, self.stderr):
      with contextlib.suppress(OSError):
        stream.close()


class LimitError(ValueError):
  """The compile ran past one of its limits (time_limit_s,
  max_compile_mb, max_table_mb, or its request's `Budget`)."""


class Busy(RuntimeError):
  """`MAX_WAITING` compiles already wait for a worker (HTTP 429)."""


class Crashed(ValueError):
  """The compiler process died (not remembered: it may be the machine's
  doing, an OOM kill)."""


class Cancelled(RuntimeError):
  """The compile's `Budget` was cancelled: its client has gone."""


class Budget:
  """The compiles of one request: `seconds` of compiling for all of them
  together (time in a worker; waiting for one is bounded by
  `MAX_WAITING`), and `cancel` to stop them. Entered (`with budget:`) in
  each thread whose compiles it bounds; `name` is how messages call it."""

  def __init__(self, seconds: float, *, name: str = "the compile budget"):
    if isinstance(seconds, bool) or not (
      isinstance(seconds, int | float) and seconds > 0
    ):
      raise ValueError(f"{name} must be a positive number, got {seconds!r}")
    self.seconds = self.left = float(seconds)
    self.name = name
    self._cancelled = threading.Event()
    self._lock = threading.Lock()

  def cancel(self) -> None:
    """Stops this budget's compile (waiting or running: its worker is
    killed) and refuses any more: they raise `Cancelled`."""
    self._cancelled.set()

  @property
  def cancelled(self) -> bool:
    return self._cancelled.is_set()

  def spend(self, seconds: float) -> None:
    with self._lock:
      self.left -= seconds

  def __enter__(self) -> Budget:
    _local.__dict__.setdefault("budgets", []).append(self)
    return self

  def __exit__(self, *exc) -> None:
    _local.budgets.pop()


_local = threading.local()


def _budget() -> Budget | None:
  """The budget this thread's compiles are in (the innermost)."""
  budgets = getattr(_local, "budgets", None)
  return budgets[-1] if budgets else None


_cv = threading.Condition()
_idle: list[_Process] = []  # live workers compiling nothing
_live: set[_Process] = set()
_last: _Process | None = None  # the worker used last
_running = 0  # compiles in a worker now
_waiting = 0  # compiles waiting for one
_failed: collections.OrderedDict = collections.OrderedDict()  # key -> (t, e)


def _shutdown() -> None:
  with _cv:
    doomed = list(_live)
    _live.clear()
    _idle.clear()
  for p in doomed:
    p.kill()


atexit.register(_shutdown)


def pid() -> int | None:
  """The process id of the worker used last, while it lives (else None)."""
  p = _last
  return p.proc.pid if p is not None and p in _live else None


_TIMEOUT = object()
_CANCELLED = object()


def _read_reply(p: _Process, deadline: float, budget: Budget | None):
  """The reply; None if the worker died; `_TIMEOUT` past the deadline,
  `_CANCELLED` once `budget` is cancelled."""
  out = p.proc.stdout
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      return _TIMEOUT
    if budget is not None and budget.cancelled:
      return _CANCELLED
    ready, _, _ = select.select([out], [], [], min(left, 0.1))
    if ready:
      try:
        return automaton.read_message(out)
      except Exception:  # a partial reply from a worker that died
        return None


def _key(request, vocab_key, time_limit_s, max_compile_mb) -> str:
  return hashlib.sha256(
    pickle.dumps(
      (sorted(request.items()), vocab_key, time_limit_s, max_compile_mb)
    )
  ).hexdigest()


def _check_remembered(key: str) -> None:
  with _cv:
    remembered = _failed.get(key)
  if remembered is not None:
    when, error = remembered
    if time.monotonic() - when < REMEMBER_FAILURES_S:
      again = type(error)(f"{error} (it failed the same way before)")
      again.remembered = True  # (not stored again: `run`)
      raise again


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
  to a worker and returns its result; within this thread's `Budget`
  (if any), its time limit is what is left of that.

  Raises:
    LimitError: it ran past `time_limit_s`, `max_compile_mb`,
      `max_table_mb` or its budget (`what` names it).
    ValueError: the constraint cannot be compiled (a failure is
      remembered `REMEMBER_FAILURES_S`: asked again, it is raised at once).
    Busy: `MAX_WAITING` compiles already wait for a worker.
    Cancelled: its budget was cancelled.
  """
  key = _key(request, vocab_key, time_limit_s, max_compile_mb)
  _check_remembered(key)
  budget, limit = _budget(), time_limit_s
  if budget is not None:
    if budget.cancelled:
      raise Cancelled(f"compiling {what} was cancelled: its client left")
    if budget.left <= 0:
      raise LimitError(
        f"compiling {what}: the request's other compiles took all of its "
        f"{budget.seconds:g} s ({budget.name})"
      )
    limit = min(time_limit_s, budget.left)
  cut = limit < time_limit_s
  try:
    return _run(
      request, vocab_key, vocab, limit, max_compile_mb, what, key, budget, cut
    )
  except ValueError as e:  # LimitError too: remembered, unless cut short,
    # a crash (not the constraint's doing: an OOM kill), or remembered
    if not (cut or isinstance(e, Crashed) or getattr(e, "remembered", False)):
      with _cv:
        _failed[key] = (time.monotonic(), e)
        while len(_failed) > _FAILURES_KEPT:
          _failed.popitem(last=False)
    raise


def _acquire(budget: Budget | None, vocab_key, what: str) -> _Process | None:
  """A worker's turn: an idle worker (one holding `vocab_key` first), or
  None where a new one is to be started. Waits while `WORKERS` compile."""
  global _running, _waiting
  with _cv:
    if _running >= WORKERS:
      if _waiting >= MAX_WAITING:
        raise Busy(
          f"{_waiting} constraint compiles are waiting for the compiler; "
          "try again shortly"
        )
      _waiting += 1
      try:
        while _running >= WORKERS:
          if budget is not None and budget.cancelled:
            raise Cancelled(f"compiling {what} was cancelled: its client left")
          _cv.wait(0.1)
      finally:
        _waiting -= 1
    _running += 1
    for i, p in enumerate(_idle):
      if p.vocab_key == vocab_key:
        return _idle.pop(i)
    return _idle.pop() if _idle else None


def _release(p: _Process | None) -> None:
  """The worker's turn back; a worker whose reply was not read whole (the
  thread was interrupted: KeyboardInterrupt, MemoryError) is killed, or
  its stale reply would answer the next compile."""
  global _running
  if p is not None and p.busy and not p.killed:
    _forget(p)
  with _cv:
    _running -= 1
    if p is not None and not p.killed and p in _live:
      _idle.append(p)
    _cv.notify()


def _run(
  request, vocab_key, vocab, limit, max_compile_mb, what, key, budget, cut
):
  global _last
  p = _acquire(budget, vocab_key, what)
  try:
    _check_remembered(key)  # (it may have failed while this waited)
    if p is not None and p.proc.poll() is not None:
      _forget(p)
      p = None
    if p is None:
      p = _Process()
      with _cv:
        _live.add(p)
    _last = p
    start = time.monotonic()
    try:
      return _compile(
        p, request, vocab_key, vocab, limit, max_compile_mb, what, budget, cut
      )
    finally:
      if budget is not None:
        budget.spend(time.monotonic() - start)
  finally:
    _release(p)


def _forget(p: _Process) -> None:
  """Kills `p` and drops it from the live workers."""
  p.kill()
  with _cv:
    _live.discard(p)


def _compile(
  p, request, vocab_key, vocab, limit, max_compile_mb, what, budget, cut
):
  message = {
    **request,
    "vocab_key": vocab_key,
    "max_compile_mb": max_compile_mb,
  }
  if vocab_key is not None and p.vocab_key != vocab_key:
    message["vocab"] = vocab
  start = time.monotonic()
  p.busy = True  # until its reply is read whole (`_release`)
  try:
    automaton.write_message(p.proc.stdin, message)
    p.vocab_key = vocab_key
  except (BrokenPipeError, OSError):
    pass  # it died; reported below
  reply = _read_reply(p, start + limit, budget)
  if isinstance(reply, dict):
    p.busy = False
  if reply is _CANCELLED:
    _forget(p)
    raise Cancelled(f"compiling {what} was cancelled: its client left")
  if reply is None or reply is _TIMEOUT:
    if reply is None:  # its output closed: let it finish dying
      with contextlib.suppress(subprocess.TimeoutExpired):
        p.proc.wait(timeout=10)
    _forget(p)
    if reply is _TIMEOUT:
      raise LimitError(_time_message(what, limit, budget if cut else None))
    code, tail = p.proc.returncode, p.tail.strip()
    if "memory allocation" in tail or code == -signal.SIGABRT:
      raise LimitError(_memory_message(what, max_compile_mb))
    raise Crashed(
      f"compiling {what} crashed the compiler process (exit code {code})"
      + (f": {tail.splitlines()[-1]}" if tail else "")
    )
  if "error" in reply:
    # (the table-size check runs in the worker: its message names it)
    kind = LimitError if "max_table_mb=" in reply["error"] else ValueError
    raise kind(reply["error"])
  if "memory" in reply:  # a worker that ran out of memory may hold on to it
    _forget(p)
    raise LimitError(_memory_message(what, max_compile_mb))
  return automaton.widened(reply["ok"])


def _time_message(what: str, limit: float, budget: Budget | None) -> str:
  """`limit` is the compile's own time_limit_s, or (given the `budget`
  that cut it) what was left of that."""
  cause = "time_limit_s"
  if budget is not None:
    cause = (
      f"what was left of its request's {budget.seconds:g} s of compiling, "
      f"{budget.name}"
    )
  return (
    f"compiling {what} took over {limit:g} s ({cause}); it was stopped. "
    "Simplify it (fewer or shorter repetitions, smaller maxLength / "
    "maxItems) or raise the limit"
  )


def _memory_message(what: str, max_mb: float) -> str:
  return (
    f"compiling {what} needed more than {max_mb:g} MB (max_compile_mb); it "
    "was stopped. Simplify it (e.g. a smaller maxLength) or raise the limit"
  )
