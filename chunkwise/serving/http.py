"""The HTTP server (aiohttp): TGI / LoRAX and OpenAI routes over one engine.

  app = make_app(ctx, api_key=None)          # an aiohttp Application
  serve(ctx, host="127.0.0.1", port=8080)    # runs until SIGTERM / SIGINT

Routes (../shared/SERVING.md): `POST /`, `/generate`, `/generate_stream`
(native); `/v1/completions`, `/v1/chat/completions`, `GET /v1/models[/id]`
(OpenAI); `GET /`, `/health`, `/info`, `/metrics`, `/openapi.json`
(`openapi`: generated from the request models); the token explorer
page at `GET /explore` (`explore`).

Each request is parsed and validated, its constraint compiled and (when
asked) its prompt scored in a worker thread, then queued on the engine;
a stream's tokens are written as the engine hands them over (SSE, one
event per token, flushed). A client that goes away cancels its request
(aiohttp cancels the handler; the engine frees the slot at the next
segment). Errors are JSON in each API's shape, the framework's own 404 /
405 / 413 included. With an API key every route but the health checks,
the OpenAPI document and the explorer's own files (they hold no data)
needs `Authorization: Bearer <key>`. SIGTERM stops admitting (503),
lets running requests finish within a grace period, and exits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from chunkwise.constraints import worker
from chunkwise.serving import (
  api,
  bodies,
  explore,
  native,
  openai_api,
  openai_requests,
  openapi,
  origin,
  sse,
)
from chunkwise.serving.api import ApiError, Context, dumps
from chunkwise.serving.metrics import Metrics
from chunkwise.serving.stream import (
  ERROR,
  Closed,
  Generation,
  Overloaded,
  TokenStream,
)

log = logging.getLogger("chunkwise.serving")

_STARTING = (
  "the server is starting: it compiles its programs before it takes "
  "requests (GET /health answers 200 once it is ready)"
)
_SSE_HEADERS = {
  "Content-Type": "text/event-stream",
  "Cache-Control": "no-cache",
  "X-Accel-Buffering": "no",
}


def error_body(path: str, status: int, message: str, kind: str) -> dict:
  """An error in the shape of the API that `path` belongs to."""
  if api.openai_route(path):
    names = {
      400: "BadRequestError",
      401: "AuthenticationError",
      403: "PermissionDeniedError",
      408: "APITimeoutError",
      404: "NotFoundError",
      413: "BadRequestError",
      415: "BadRequestError",
      429: "RateLimitError",
      503: "ServiceUnavailableError",
    }
    return {
      "error": {
        "message": message,
        "type": names.get(status, "InternalServerError"),
        "param": "model" if kind == api.NOT_FOUND else None,
        "code": status,
      }
    }
  text = {
    api.VALIDATION: f"Input validation error: {message}",
    api.GENERATION: f"Request failed during generation: {message}",
    api.OVERLOADED: "Model is overloaded",
  }.get(kind, message)
  native_kind = {api.NOT_FOUND: api.VALIDATION}.get(kind, kind)
  if kind == api.UNAVAILABLE:
    native_kind = "healthcheck"
  return {"error": text, "error_type": native_kind}


def _json_response(body: Any, status: int = 200, headers=None) -> web.Response:
  return web.Response(
    body=dumps(body),
    status=status,
    content_type="application/json",
    headers=headers,
  )


def _error_response(path: str, e: ApiError) -> web.Response:
  e = ApiError(e.status, api.scrub(e.message), e.kind)
  headers = {"X-Content-Type-Options": "nosniff"}
  if e.status == 429:
    headers["Retry-After"] = "1"
  if e.status in (400, 404, 413, 422):
    headers["x-should-retry"] = "false"
  return _json_response(
    error_body(path, e.status, e.message, e.kind), e.status, headers
  )


@contextlib.contextmanager
def _queue_errors():
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


class Server:
  """The routes' state: the context, metrics, a worker pool, auth."""

  def __init__(
    self,
    ctx: Context,
    *,
    api_key: str | None = None,
    max_json_depth: int = bodies.MAX_JSON_DEPTH,
    workers: int = 4,
    allowed: frozenset | None = origin.LOOPBACK_NAMES,
    public_openapi: bool = False,
  ):
    self.ctx = ctx
    self.api_key = api_key
    self.allowed_hosts = allowed  # Host names answered (None: any)
    self.public_openapi = public_openapi
    self._clients: dict[str, int] = {}  # requests running per address
    self.max_json_depth = max_json_depth
    self.metrics = Metrics(ctx.engine, model_id=ctx.model_id)
    ctx.engine.listen(self.metrics.finished)
    self.pool = concurrent.futures.ThreadPoolExecutor(
      workers, thread_name_prefix="chunkwise-http"
    )
    # Preparing a constrained request waits for a compile worker: it has
    # threads of its own, as many as compiles may run and wait, so that
    # compiles never hold the threads that parse every request.
    self._compile_threads = worker.WORKERS + worker.MAX_WAITING
    self.compiles = concurrent.futures.ThreadPoolExecutor(
      self._compile_threads, thread_name_prefix="chunkwise-compile"
    )
    self._compiling = 0
    self.draining = False
    self._openapi: bytes | None = None

  # -- helpers ---------------------------------------------------------------

  async def _work(self, fn: Callable, *args):
    """`fn(*args)` in the worker pool: parsing, preparing, and building
    a response (64 choices' logprobs are seconds of dicts and JSON)."""
    return await asyncio.get_running_loop().run_in_executor(
      self.pool, fn, *args
    )

  async def _body(self, request: web.Request) -> Any:
    """The request's JSON body, parsed and checked in the worker pool: a
    4 MB body takes seconds to walk, and the event loop only moves
    bytes."""
    status = 400 if api.openai_route(request.path) else 422
    try:
      raw = await asyncio.wait_for(request.read(), self.ctx.body_timeout_s)
    except TimeoutError:
      raise ApiError(
        408,
        f"the body did not arrive within {self.ctx.body_timeout_s:g} s "
        "(--body_timeout_s)",
      ) from None
    return await self._work(self._parse, raw, status)

  def _parse(self, raw: bytes, status: int) -> dict:
    return bodies.parse(raw, status=status, max_depth=self.max_json_depth)

  def _prepare(self, g: Generation, status: int, budget: worker.Budget):
    try:
      with budget:
        return self.ctx.engine.prepare(g)
    except ValueError as e:
      raise ApiError(status, str(e)) from None
    except worker.Busy as e:  # the constraint compiler's queue is full
      raise ApiError(429, f"Model is overloaded: {e}", api.OVERLOADED) from None
    except worker.Cancelled as e:  # (nobody reads it: the client left)
      raise ApiError(499, str(e)) from None

  async def _prepare_all(self, generations: Sequence[Generation], status):
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
      return await self._work(self._prepare, g, status, budget)
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

  def _submit(self, g: Generation, prepared) -> TokenStream:
    with _queue_errors():
      return self.ctx.engine.submit(g, prepared)

  async def _start(self, g: Generation, status: int) -> TokenStream:
    self._check_room(1)
    (prepared,) = await self._prepare_all([g], status)
    return self._submit(g, prepared)

  async def _score(self, prompt, top_n: int, adapter, status: int):
    def run():
      try:
        with _queue_errors():
          return self.ctx.engine.score(prompt, top_n=top_n, adapter=adapter)
      except ValueError as e:
        raise ApiError(status, str(e)) from None

    return await self._work(run)

  def _check_room(self, count: int) -> None:
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

  @staticmethod
  async def _finish(stream: TokenStream) -> TokenStream:
    try:
      async for _ in stream:
        pass
    except asyncio.CancelledError:
      stream.cancel()
      raise
    except Exception:
      pass  # the stream's error is read by the caller
    return stream

  # -- middleware ------------------------------------------------------------

  @web.middleware
  async def middleware(self, request: web.Request, handler):
    path = request.path
    client = request.remote or ""
    counted = False
    try:
      origin.check(request, self.allowed_hosts)
      if request.method == "POST":  # the requests that do work
        if self._clients.get(client, 0) >= self.ctx.max_client_requests:
          raise ApiError(
            429,
            f"{self.ctx.max_client_requests} requests from this address "
            "are running (--max_client_requests)",
            api.OVERLOADED,
          )
        self._clients[client] = self._clients.get(client, 0) + 1
        counted = True
      public = origin.public(request, self.public_openapi)
      if self.api_key is not None and not public:
        given = request.headers.get("Authorization", "")
        # (bytes that are not UTF-8 compare as replaced, never a 500)
        if not hmac.compare_digest(
          given.encode("utf-8", "replace"), f"Bearer {self.api_key}".encode()
        ):
          raise ApiError(
            401,
            "a valid API key is needed (Authorization: Bearer)",
            api.UNAUTHORIZED,
          )
      if request.method == "POST":
        if self.draining:
          raise ApiError(503, "the server is shutting down", api.UNAVAILABLE)
        if not self.ctx.engine.ready:
          raise ApiError(503, _STARTING, api.UNAVAILABLE)
        self.metrics.received()
      response = await handler(request)
      if not response.prepared:  # a stream's headers are already sent
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
      return response
    except ApiError as e:
      if request.method == "POST":
        self.metrics.failed(e.kind)
      return _error_response(path, e)
    except web.HTTPException as e:
      if e.status == 413:
        message = f"the body is larger than {request.client_max_size} bytes"
      else:
        message = f"{e.reason}: {request.method} {path}"
      kind = api.NOT_FOUND if e.status == 404 else api.VALIDATION
      return _error_response(path, ApiError(e.status, message, kind))
    finally:
      if counted:  # (a stream counts until it ends)
        left = self._clients[client] - 1
        if left:
          self._clients[client] = left
        else:
          del self._clients[client]

  # -- health, info, models, metrics -------------------------------------

  async def health(self, request: web.Request) -> web.Response:
    if self.draining or self.ctx.engine.closing:
      return _json_response(
        {"error": "unhealthy", "error_type": "healthcheck"}, 503
      )
    if not self.ctx.engine.ready:  # warming up: compiling its programs
      return _json_response(
        {"error": "starting", "error_type": "healthcheck"}, 503
      )
    return web.Response(status=200)

  async def info(self, request: web.Request) -> web.Response:
    ctx, model = self.ctx, self.ctx.model
    import chunkwise

    return _json_response(
      {
        "model_id": ctx.model_id,
        "model_sha": None,
        "model_dtype": str(model.compute_dtype),
        "model_device_type": _device_kind(),
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": ctx.engine.slots + ctx.engine.max_queue,
        "max_best_of": 1,
        "max_stop_sequences": ctx.max_stop_sequences,
        "max_input_tokens": ctx.max_input_tokens,
        "max_input_length": ctx.max_input_tokens,
        "max_total_tokens": ctx.max_total_tokens,
        "max_batch_total_tokens": ctx.engine.slots * ctx.engine.capacity,
        "max_client_batch_size": 1,
        "validation_workers": self.pool._max_workers,
        "max_top_n_tokens": ctx.engine.top_n,
        "slots": ctx.engine.slots,
        "adapters": list(ctx.adapters),
        "router": "chunkwise",
        "version": chunkwise.__version__,
        "sha": None,
        "docker_label": None,
      }
    )

  async def models(self, request: web.Request) -> web.Response:
    return _json_response(openai_api.models(self.ctx))

  async def model(self, request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name != self.ctx.model_id:
      self.ctx.adapter(name, status=404)
    return _json_response(openai_api.model_card(self.ctx, name))

  async def metrics_route(self, request: web.Request) -> web.Response:
    return web.Response(
      body=self.metrics.exposition(),
      headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )

  async def openapi_route(self, request: web.Request) -> web.Response:
    if self._openapi is None:  # generated once, on first use
      names = [self.ctx.model_id, *self.ctx.adapters]
      doc = openapi.document(
        models=names,
        auth=self.api_key is not None,
        public_openapi=self.public_openapi,
      )
      self._openapi = dumps(doc)
    return web.Response(body=self._openapi, content_type="application/json")

  # -- native ------------------------------------------------------------------

  async def native_root(self, request: web.Request):
    return await self._native(request, stream=None, wrap=True)

  async def native_generate(self, request: web.Request):
    return await self._native(request, stream=False, wrap=False)

  async def native_stream(self, request: web.Request):
    return await self._native(request, stream=True, wrap=False)

  async def _native(self, request, *, stream: bool | None, wrap: bool):
    body = await self._body(request)
    inputs, g, options = await self._work(
      lambda: native.parse(body, self.ctx, stream=stream)
    )
    prompt_details = None
    if options.decoder_input_details:
      scores, _, _ = await self._score(g.prompt, 0, g.adapter, 422)
      prompt_details = native.prefill(g.prompt, scores, self.ctx)
    s = await self._start(g, 422)
    if options.stream:
      return await sse.native_events(request, s, inputs, options, self.ctx)
    await self._finish(s)
    if s.finish_reason == ERROR:
      raise ApiError(424, s.error or "failed", api.GENERATION)

    def build():
      out = native.response(inputs, s, options, self.ctx, prompt_details)
      return _json_response([out] if wrap else out)

    return await self._work(build)

  # -- OpenAI ------------------------------------------------------------------

  async def completions(self, request: web.Request):
    body = await self._body(request)
    call = await self._work(
      lambda: openai_requests.parse_completion(body, self.ctx)
    )
    scored = {}
    if call.echo and call.logprobs is not None:
      generations = sum(c.generation is not None for c in call.choices)
      self._check_room(len(call.prompts) + generations)
      for p, ids in enumerate(call.prompts):
        scored[p] = await self._score(ids, call.logprobs, call.adapter, 400)
    streams = await self._start_all(call)
    if call.stream:
      return await sse.openai_events(
        request, call, streams, self.ctx, chat=False
      )
    await asyncio.gather(*(self._finish(s) for s in streams.values()))
    self._check_failed(streams)
    return await self._work(
      lambda: _json_response(
        openai_api.completion(call, self.ctx, streams, scored)
      )
    )

  async def chat(self, request: web.Request):
    body = await self._body(request)
    call = await self._work(openai_requests.parse_chat, body, self.ctx)
    streams = await self._start_all(call)
    if call.stream:
      return await sse.openai_events(
        request, call, streams, self.ctx, chat=True
      )
    await asyncio.gather(*(self._finish(s) for s in streams.values()))
    self._check_failed(streams)
    return await self._work(
      lambda: _json_response(openai_api.chat(call, self.ctx, streams))
    )

  async def _start_all(self, call) -> dict[int, TokenStream]:
    choices = [c for c in call.choices if c.generation is not None]
    self._check_room(len(choices))
    prepared = await self._prepare_all([c.generation for c in choices], 400)
    streams: dict[int, TokenStream] = {}
    try:
      for c, p in zip(choices, prepared, strict=True):
        streams[c.index] = self._submit(c.generation, p)
    except ApiError:
      for s in streams.values():
        s.cancel()
      raise
    return streams

  @staticmethod
  def _check_failed(streams: dict[int, TokenStream]) -> None:
    for s in streams.values():
      if s.finish_reason == ERROR:
        raise ApiError(500, f"generation failed: {s.error}", api.GENERATION)

  # -- the app -----------------------------------------------------------------

  def app(self, max_body_bytes: int = bodies.MAX_BODY_BYTES) -> web.Application:
    app = web.Application(
      middlewares=[self.middleware], client_max_size=max_body_bytes
    )
    app.add_routes(
      [
        web.get("/", self.health),
        web.get("/health", self.health),
        web.get("/info", self.info),
        web.get("/metrics", self.metrics_route),
        web.get("/openapi.json", self.openapi_route),
        web.get("/v1/models", self.models),
        web.get("/v1/models/{name:.+}", self.model),
        web.post("/", self.native_root),
        web.post("/generate", self.native_generate),
        web.post("/generate_stream", self.native_stream),
        web.post("/v1/completions", self.completions),
        web.post("/v1/chat/completions", self.chat),
        *explore.Explorer().routes(),
      ]
    )
    return app


def _device_kind() -> str:
  import jax

  return jax.devices()[0].platform
