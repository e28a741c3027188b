"""Admission: what a request passes before it runs, all of it off the
event loop (which only moves bytes).

  admit = Admission(ctx)
  body = await admit.body(request, status)     # 408 / 400: read, parsed
  admit.check_room(count)                      # 429 unless all fit
  prepared = await admit.prepare(generations, status)
  stream = admit.submit(generation, prepared)  # queued on the engine
  scores = await admit.score(prompt, top_n, adapter, status)
  response = await admit.work(build)           # any other heavy step

Two thread pools: `pool` parses bodies, tokenizes, and builds whole
responses; `compiles` prepares the requests that carry a constraint,
which may wait seconds for a compile worker (`constraints.worker`), so
that compiles never hold the threads every request needs. The compile
pool has as many threads as compiles may run and wait; one more
constrained request is a 429. All of a request's compiles share one
`worker.Budget` (--compile_budget_s), and a client that leaves cancels
the compile it waits for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from chunkwise.constraints import worker
from chunkwise.serving import api, bodies
from chunkwise.serving.api import ApiError, Context
from chunkwise.serving.stream import Closed, Generation, Overloaded, TokenStream


@contextlib.contextmanager
def queue_errors():
  """The engine's queue refusals as HTTP errors: full (429), closing
  (503)."""
  try:
    yield
  except Overloaded:
    raise ApiError(429, "Model is overloaded", api.OVERLOADED) from None
  except Closed:
    raise ApiError(
      503, "the server is shutting down", api.UNAVAILABLE
    ) from None


class Admission:
  """A server's pools and the steps before a request runs (module doc)."""

  def __init__(
    self,
    ctx: Context,
    *,
    workers: int = 4,
    max_json_depth: int = bodies.MAX_JSON_DEPTH,
  ):
    self.ctx = ctx
    self.max_json_depth = max_json_depth
    self.pool = concurrent.futures.ThreadPoolExecutor(
      workers, thread_name_prefix="chunkwise-http"
    )
    self._compile_threads = worker.WORKERS + worker.MAX_WAITING
    self.compiles = concurrent.futures.ThreadPoolExecutor(
      self._compile_threads, thread_name_prefix="chunkwise-compile"
    )
    self._compiling = 0  # constrained requests in `compiles`

  def shutdown(self) -> None:
    self.pool.shutdown(wait=False)
    self.compiles.shutdown(wait=False, cancel_futures=True)

  async def work(self, fn: Callable, *args):
    """`fn(*args)` in the worker pool: parsing, tokenizing, building a
    whole response (64 choices' logprobs are seconds of dicts and JSON)."""
    return await asyncio.get_running_loop().run_in_executor(
      self.pool, fn, *args
    )

  async def body(self, request: web.Request, status: int) -> dict:
    """The request's JSON body, read within --body_timeout_s (else 408),
    then parsed and checked in the worker pool (`bodies.parse`)."""
    limit = self.ctx.body_timeout_s
    try:
      raw = await asyncio.wait_for(request.read(), limit)
    except TimeoutError:
      raise ApiError(
        408, f"the body did not arrive within {limit:g} s (--body_timeout_s)"
      ) from None
    return await self.work(self._parse, raw, status)

  def _parse(self, raw: bytes, status: int) -> dict:
    return bodies.parse(raw, status=status, max_depth=self.max_json_depth)

  def check_room(self, count: int) -> None:
    """429 where a request's `count` choices would not all fit the queue:
    refused whole, before any is prepared (its constraint compiled)."""
    engine = self.ctx.engine
    if engine.waiting + count > engine.max_queue:
      raise ApiError(
        429,
        f"Model is overloaded: {engine.waiting} waiting, and the request's "
        f"{count} choice{'s' * (count != 1)} would pass --max_queue="
        f"{engine.max_queue}",
        api.OVERLOADED,
      )

  async def prepare(self, generations: Sequence[Generation], status: int):
    """Each generation validated and its constraint compiled, one after
    another, within one compile budget (--compile_budget_s); a client
    that leaves cancels the compile it waits for."""
    budget = worker.Budget(self.ctx.compile_budget_s, name="--compile_budget_s")
    try:
      return [await self._prepare_one(g, status, budget) for g in generations]
    except asyncio.CancelledError:
      budget.cancel()
      raise

  async def _prepare_one(self, g: Generation, status, budget: worker.Budget):
    if g.constraint is None:
      return await self.work(self._prepare, g, status, budget)
    if self._compiling >= self._compile_threads:
      raise ApiError(
        429,
        f"Model is overloaded: {self._compiling} constrained requests are "
        "compiling or waiting to (--compile_workers, "
        "--max_compiles_waiting)",
        api.OVERLOADED,
      )
    self._compiling += 1
    try:
      return await asyncio.get_running_loop().run_in_executor(
        self.compiles, self._prepare, g, status, budget
      )
    finally:
      self._compiling -= 1

  def _prepare(self, g: Generation, status: int, budget: worker.Budget):
    try:
      with budget:
        return self.ctx.engine.prepare(g)
    except ValueError as e:
      raise ApiError(status, str(e)) from None
    except worker.Busy as e:  # the compile workers' queue is full
      raise ApiError(429, f"Model is overloaded: {e}", api.OVERLOADED) from None
    except worker.Cancelled as e:  # (nobody reads it: the client left)
      raise ApiError(499, str(e)) from None

  def submit(self, g: Generation, prepared) -> TokenStream:
    with queue_errors():
      return self.ctx.engine.submit(g, prepared)

  async def start(self, g: Generation, status: int) -> TokenStream:
    """One generation checked, prepared and queued."""
    self.check_room(1)
    (prepared,) = await self.prepare([g], status)
    return self.submit(g, prepared)

  async def score(self, prompt, top_n: int, adapter, status: int) -> Any:
    """The prompt's own log-probs, through the engine's queue."""

    def run():
      try:
        with queue_errors():
          return self.ctx.engine.score(prompt, top_n=top_n, adapter=adapter)
      except ValueError as e:
        raise ApiError(status, str(e)) from None

    return await self.work(run)
