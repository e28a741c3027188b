"""The compile workers (`chunkwise.constraints.worker`): several at once,
at a lower CPU priority, one budget per request, stopped when the request
is cancelled, waiting bounded."""

import os
import threading
import time

import pytest

import chunkwise as cw
from chunkwise import constraints as C
from chunkwise.constraints import disk_cache, worker
from tests.serving_helpers import alive

VOCAB = cw.ByteVocabulary()


def _runaway(letter: str) -> C.Regex:
  """A regex the native compiler needs seconds for (2^22 states), a
  distinct one per `letter` (none is cached or remembered by another)."""
  return C.Regex(f"[{letter}z]*{letter}[{letter}z]{{21}}", time_limit_s=30)


def _compile(c: C.Constraint):
  return c.compile(VOCAB, stop_ids=[2], width=320)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
  monkeypatch.setattr(worker, "_failed", type(worker._failed)())
  with disk_cache.off():
    yield


class _Background:
  """`fn` in a thread, inside `budget`: what it returned or raised."""

  def __init__(self, fn, budget: worker.Budget | None = None):
    self.out = self.error = None

    def run():
      try:
        if budget is None:
          self.out = fn()
        else:
          with budget:
            self.out = fn()
      except Exception as e:
        self.error = e

    self.thread = threading.Thread(target=run)
    self.thread.start()

  def join(self, timeout: float = 60.0):
    self.thread.join(timeout)
    assert not self.thread.is_alive()
    return self


def _wait_for(predicate, timeout: float = 10.0) -> None:
  deadline = time.monotonic() + timeout
  while not predicate():
    assert time.monotonic() < deadline
    time.sleep(0.02)


def test_a_long_compile_takes_one_worker_not_all_of_them():
  assert worker.WORKERS >= 2
  slow_budget = worker.Budget(60)
  slow = _Background(lambda: _compile(_runaway("a")), slow_budget)
  _wait_for(lambda: worker._running == 1)
  start = time.monotonic()
  t = _compile(C.Regex("[0-9]{3}"))
  assert time.monotonic() - start < 5 and slow.thread.is_alive()
  assert t.states == 4
  slow_budget.cancel()
  assert isinstance(slow.join().error, worker.Cancelled)


def test_workers_run_at_a_lower_priority():
  _compile(C.Regex("[0-9]{4}"))
  mine = os.getpriority(os.PRIO_PROCESS, 0)
  theirs = os.getpriority(os.PRIO_PROCESS, worker.pid())
  assert theirs == min(19, mine + worker.NICE)


def test_a_requests_compiles_share_one_budget():
  """Two slow compiles in one budget of 2 s: the first is stopped when the
  budget runs out (its message names the budget, and it is not
  remembered as the constraint's failure); the second is refused at
  once; a small one too."""
  budget = worker.Budget(2, name="--compile_budget_s")
  start = time.monotonic()
  with budget, pytest.raises(worker.LimitError) as e:
    _compile(_runaway("b"))
  assert 2 <= time.monotonic() - start < 6
  assert "--compile_budget_s" in str(e.value) and "2 s" in str(e.value)
  assert not worker._failed  # cut short by the budget: not remembered
  for c in (_runaway("c"), C.Regex("[0-9]{5}")):
    start = time.monotonic()
    with budget, pytest.raises(worker.LimitError, match="took all of its 2 s"):
      _compile(c)
    assert time.monotonic() - start < 1


def test_a_cancelled_compile_is_stopped_running_or_waiting(monkeypatch):
  """With one worker: a compile running and another waiting for it; the
  waiting one is cancelled at once and the running one goes on, then the
  running one is cancelled: its worker is killed, and the next compile
  starts a fresh one."""
  monkeypatch.setattr(worker, "WORKERS", 1)
  running_budget, waiting_budget = worker.Budget(60), worker.Budget(60)
  running = _Background(lambda: _compile(_runaway("d")), running_budget)
  _wait_for(lambda: worker._running == 1 and worker.pid() is not None)
  pid = worker.pid()
  waiting = _Background(lambda: _compile(C.Regex("[0-9]{6}")), waiting_budget)
  _wait_for(lambda: worker._waiting == 1)
  start = time.monotonic()
  waiting_budget.cancel()
  assert isinstance(waiting.join().error, worker.Cancelled)
  assert time.monotonic() - start < 1 and running.thread.is_alive()
  start = time.monotonic()
  running_budget.cancel()
  assert isinstance(running.join().error, worker.Cancelled)
  assert time.monotonic() - start < 1
  _wait_for(lambda: not alive(pid))  # killed and reaped
  assert not worker._failed and worker._running == 0
  assert _compile(C.Regex("[0-9]{7}")).states == 8
  assert worker.pid() not in (None, pid)
  with worker.Budget(60) as done:
    done.cancel()
    with pytest.raises(worker.Cancelled):
      _compile(C.Regex("[0-9]{8}"))


def test_budgets_are_positive_numbers():
  for bad in (0, -1, True, "30", float("nan")):
    with pytest.raises(ValueError, match="compile budget must be a positive"):
      worker.Budget(bad)


class _Interrupt(BaseException):  # what a KeyboardInterrupt would do
  pass


def test_an_interrupted_compile_never_answers_the_next(monkeypatch):
  """A thread interrupted while its worker compiles leaves that worker
  with a reply nobody read: it is killed, not handed the next compile
  (which would read the stale reply as its own)."""
  real, calls = worker._read_reply, []

  def interrupted(*args):
    if not calls:
      calls.append(1)
      raise _Interrupt
    return real(*args)

  monkeypatch.setattr(worker, "_read_reply", interrupted)
  with pytest.raises(_Interrupt):
    _compile(C.Regex("[0-9]{9}"))  # 10 states
  assert worker._running == 0 and not worker._idle
  assert _compile(C.Regex("x{3}")).states == 4


def test_a_remembered_failure_is_not_remembered_again(monkeypatch):
  """Refused from memory, a failure keeps its first time and message,
  also where it is found once a worker is free (it failed while this
  compile waited: the check before waiting passes here)."""
  bad = C.Regex("[0-9]{3}", max_table_mb=1e-9)
  with pytest.raises(worker.LimitError):
    _compile(bad)
  ((key, (when, _)),) = worker._failed.items()
  real, checks = worker._check_remembered, []

  def found_after_waiting(key):
    checks.append(key)
    if len(checks) % 2 == 0:  # the second check of each compile
      real(key)

  monkeypatch.setattr(worker, "_check_remembered", found_after_waiting)
  for _ in range(2):
    with pytest.raises(worker.LimitError) as e:
      _compile(bad)
    assert str(e.value).count("failed the same way before") == 1
  assert len(checks) == 4 and worker._failed[key][0] == when
