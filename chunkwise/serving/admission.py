"""Admission: what a request passes before it runs, all of it off the
event loop (which only moves bytes).

  admit = Admission(ctx)
  body = await admit.body(request, status)     # 408 / 400: read, parsed
  budget = admit.budget()                      # the request's compiles
  call = await admit.parse(parse_chat, body, budget, status)
  admit.check_room(count)                      # 429 unless all fit
  prepared = await admit.prepare(generations, status, budget)
  stream = admit.submit(generation, prepared)  # queued on the engine
  scores = await admit.score(prompt, top_n, adapter, status)
  response = await admit.work(build)           # any other heavy step

Two thread pools: `pool` parses bodies, tokenizes, and builds whole
responses; `compiles` parses and prepares the requests that carry tools,
a schema, a regex or a grammar, which may wait seconds for a compile
worker (`constraints.worker`), so that compiles never hold the threads
every request needs. The compile pool has as many threads as compiles
may run and wait; one more such request is a 429. All of a request's
compiles share one `worker.Budget` (`budget()`, --compile_budget_s), and
a client that leaves cancels the compile it waits for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from chunkwise.constraints import worker
from chunkwise.serving import api, bodies
from chunkwise.serving.api import ApiError, Context
from chunkwise.serving.stream import Closed, Generation, Overloaded, TokenStream

# A body field whose reading may compile something (OpenAI's and vLLM's;
# TGI's grammar is in "parameters").
_COMPILING = ("tools", "functions", "response_format", "structured_outputs")
# the Responses API's `text.format` and the Messages API's `output_config`
_COMPILING += ("text", "output_config")


def _may_compile(body: dict) -> bool:
  params = body.get("parameters")
  return (
    any(k in body for k in _COMPILING)
    or any(k.startswith("guided_") for k in body)
    or (isinstance(params, dict) and "grammar" in params)
  )


def _as_api_errors(status: int, fn: Callable, *args):
  """`fn(*args)`, its refusals as HTTP errors: a bad request (`status`),
  the compile workers' queue full (429), a compile cancelled (499: its
  client has left, nobody reads it)."""
  try:
    return fn(*args)
  except worker.Busy as e:
    raise ApiError(429, f"Model is overloaded: {e}", api.OVERLOADED) from None
  except worker.Cancelled as e:
    raise ApiError(499, str(e)) from None
  except ValueError as e:
    raise ApiError(status, str(e)) from None


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
    self._compiling_now = 0  # requests in `compiles`

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

  def budget(self) -> worker.Budget:
    """A request's compile budget (--compile_budget_s): everything it
    compiles, while parsed and while prepared, shares it."""
    return worker.Budget(self.ctx.compile_budget_s, name="--compile_budget_s")

  async def parse(self, fn: Callable, body: dict, budget, status: int):
    """`fn(body, ctx)`, a route's parser: where the body carries tools, a
    schema or a grammar (reading one builds its regex, in a compile
    worker), on the compile pool within `budget`; else in the pool."""
    if not _may_compile(body):
      return await self.work(fn, body, self.ctx)
    return await self._compiling(budget, status, fn, body, self.ctx)

  async def prepare(
    self, generations: Sequence[Generation], status: int, budget
  ) -> list:
    """Each generation validated and its constraint compiled, one after
    another, within the request's `budget`."""
    prepare = self.ctx.engine.prepare
    out = []
    for g in generations:
      if g.constraint is None:
        out.append(await self.work(_as_api_errors, status, prepare, g))
      else:
        out.append(await self._compiling(budget, status, prepare, g))
    return out

  async def _compiling(self, budget: worker.Budget, status, fn, *args):
    """`fn(*args)` on the compile pool within `budget`; a client that
    leaves (the handler cancelled) cancels the budget, and with it the
    compile it waits for."""
    if self._compiling_now >= self._compile_threads:
      raise ApiError(
        429,
        f"Model is overloaded: {self._compiling_now} constrained requests "
        "are compiling or waiting to (--compile_workers, "
        "--max_compiles_waiting)",
        api.OVERLOADED,
      )

    def run():
      with budget:
        return _as_api_errors(status, fn, *args)

    self._compiling_now += 1
    try:
      return await asyncio.get_running_loop().run_in_executor(
        self.compiles, run
      )
    except asyncio.CancelledError:
      budget.cancel()
      raise
    finally:
      self._compiling_now -= 1

  def submit(self, g: Generation, prepared) -> TokenStream:
    with queue_errors():
      return self.ctx.engine.submit(g, prepared)

  async def start(self, g: Generation, status: int, budget) -> TokenStream:
    """One generation checked, prepared and queued."""
    self.check_room(1)
    (prepared,) = await self.prepare([g], status, budget)
    return self.submit(g, prepared)

  async def score(self, prompt, top_n: int, adapter, status: int) -> Any:
    """The prompt's own log-probs, through the engine's queue."""

    score = functools.partial(
      self.ctx.engine.score, prompt, top_n=top_n, adapter=adapter
    )

    def run():
      with queue_errors():
        return _as_api_errors(status, score)

    return await self.work(run)
