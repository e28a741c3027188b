"""The HTTP server (aiohttp): TGI / LoRAX and OpenAI routes over one engine.

  app = make_app(ctx, api_key=None)          # an aiohttp Application
  serve(ctx, host="127.0.0.1", port=8080)    # runs until SIGTERM / SIGINT

Routes (../shared/SERVING.md): `POST /`, `/generate`, `/generate_stream`
(native); `/v1/completions`, `/v1/chat/completions`, `GET /v1/models[/id]`
(OpenAI); `GET /`, `/health`, `/info`, `/metrics`, `/openapi.json`
(`openapi`: generated from the request models); the token explorer
page at `GET /explore` (`explore`).

Each request is parsed and validated, its constraint compiled and (when
asked) its prompt scored in a worker thread (`admission`), then queued
on the engine; a stream's tokens are written as the engine hands them
over (SSE, one event per token, flushed). A client that goes away
cancels its request (aiohttp cancels the handler; the engine frees the
slot at the next segment). Errors are JSON in each API's shape, the
framework's own 404 / 405 / 413 included. Who may call is `origin`'s:
the Host and Origin answered, and with an API key every route but the
health checks and the explorer's own files (they hold no data; the
OpenAPI document too with `public_openapi`) needs `Authorization:
Bearer <key>`. SIGTERM stops admitting (503), lets running requests
finish within a grace period, and exits.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from aiohttp import web

from chunkwise.serving import (
  api,
  bodies,
  explore,
  openapi,
  origin,
  sse,
)
from chunkwise.serving.admission import Admission
from chunkwise.serving.api import ApiError, Context, dumps
from chunkwise.serving.faces import messages as faces_messages
from chunkwise.serving.faces import native, openai_api, openai_requests
from chunkwise.serving.faces import responses as faces_responses
from chunkwise.serving.faces import tokens as faces_tokens
from chunkwise.serving.metrics import Metrics
from chunkwise.serving.stream import (
  ERROR,
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
  if faces_messages.route(path):
    return faces_messages.error_body(status, message)
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


def _status(request: web.Request) -> int:
  """A bad request's status: 400 on the OpenAI routes, 422 on TGI's."""
  return 400 if api.openai_route(request.path) else 422


class Server:
  """The routes' state: the context, metrics, admission (its pools),
  auth."""

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
    self.metrics = Metrics(ctx.engine, model_id=ctx.model_id)
    ctx.engine.listen(self.metrics.finished)
    self.admit = Admission(ctx, workers=workers, max_json_depth=max_json_depth)
    self.draining = False
    self.opened = False  # set once ready (`launch`: after the heap froze)
    self._openapi: bytes | None = None

  @property
  def ready(self) -> bool:
    """Taking requests: the engine warmed up and the server opened."""
    return self.opened and self.ctx.engine.ready

  # -- helpers ---------------------------------------------------------------

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
        # `Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>`
        # (bytes that are not UTF-8 compare as replaced, never a 500)
        given = request.headers.get("Authorization", "")
        keyed = request.headers.get("x-api-key")
        if keyed is not None:
          given = f"Bearer {keyed}"
        if not hmac.compare_digest(
          given.encode("utf-8", "replace"), f"Bearer {self.api_key}".encode()
        ):
          raise ApiError(
            401,
            "a valid API key is needed (Authorization: Bearer, or x-api-key)",
            api.UNAUTHORIZED,
          )
      if request.method == "POST":
        if self.draining:
          raise ApiError(503, "the server is shutting down", api.UNAVAILABLE)
        if not self.ready:
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
    if not self.ready:  # warming up: compiling its programs
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
        "validation_workers": self.admit.pool._max_workers,
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
    body = await self.admit.body(request, _status(request))
    budget = self.admit.budget()
    inputs, g, options = await self.admit.parse(
      lambda b, ctx: native.parse(b, ctx, stream=stream), body, budget, 422
    )
    prompt_details = None
    if options.decoder_input_details:
      scores, _, _ = await self.admit.score(g.prompt, 0, g.adapter, 422)
      prompt_details = native.prefill(g.prompt, scores, self.ctx)
    s = await self.admit.start(g, 422, budget)
    if options.stream:
      return await sse.native_events(request, s, inputs, options, self.ctx)
    await self._finish(s)
    if s.finish_reason == ERROR:
      raise ApiError(424, s.error or "failed", api.GENERATION)

    def build():
      out = native.response(inputs, s, options, self.ctx, prompt_details)
      return _json_response([out] if wrap else out)

    return await self.admit.work(build)

  # -- OpenAI ------------------------------------------------------------------

  async def completions(self, request: web.Request):
    body = await self.admit.body(request, _status(request))
    budget = self.admit.budget()
    call = await self.admit.parse(
      openai_requests.parse_completion, body, budget, 400
    )
    scored = {}
    if call.echo and call.logprobs is not None:
      generations = sum(c.generation is not None for c in call.choices)
      self.admit.check_room(len(call.prompts) + generations)
      for p, ids in enumerate(call.prompts):
        scored[p] = await self.admit.score(
          ids, call.logprobs, call.adapter, 400
        )
    streams = await self._start_all(call, budget)
    if call.stream:
      return await sse.openai_events(
        request, call, streams, self.ctx, chat=False
      )
    await asyncio.gather(*(self._finish(s) for s in streams.values()))
    self._check_failed(streams)
    return await self.admit.work(
      lambda: _json_response(
        openai_api.completion(call, self.ctx, streams, scored)
      )
    )

  async def chat(self, request: web.Request):
    body = await self.admit.body(request, _status(request))
    budget = self.admit.budget()
    call = await self.admit.parse(openai_requests.parse_chat, body, budget, 400)
    streams = await self._start_all(call, budget)
    if call.stream:
      return await sse.openai_events(
        request, call, streams, self.ctx, chat=True
      )
    await asyncio.gather(*(self._finish(s) for s in streams.values()))
    self._check_failed(streams)
    return await self.admit.work(
      lambda: _json_response(openai_api.chat(call, self.ctx, streams))
    )

  # -- Responses API (faces/responses.py) -----------------------------------

  async def responses(self, request: web.Request):
    body = await self.admit.body(request, _status(request))
    budget = self.admit.budget()
    store = self.ctx.responses_store
    turn = await self.admit.parse(
      lambda b, ctx: faces_responses.parse(b, ctx, store), body, budget, 400
    )
    streams = await self._start_all(turn.call, budget)
    if turn.stream:
      return await sse.responses_events(request, turn, streams, self.ctx)
    await asyncio.gather(*(self._finish(s) for s in streams.values()))
    self._check_failed(streams)

    def build():
      chat = openai_api.chat(turn.call, self.ctx, streams)
      out = faces_responses.response(turn, chat)
      faces_responses.keep(turn, out, store)
      return _json_response(out)

    return await self.admit.work(build)

  # -- Messages API (faces/messages.py) ------------------------------------

  async def messages(self, request: web.Request):
    body = await self.admit.body(request, 400)
    budget = self.admit.budget()
    turn = await self.admit.parse(faces_messages.parse, body, budget, 400)
    streams = await self._start_all(turn.call, budget)
    if turn.stream:
      return await sse.messages_events(request, turn, streams, self.ctx)
    await asyncio.gather(*(self._finish(s) for s in streams.values()))
    self._check_failed(streams)
    (s,) = streams.values()

    def build():
      chat = openai_api.chat(turn.call, self.ctx, streams)
      return _json_response(faces_messages.message(turn, chat, s))

    return await self.admit.work(build)

  async def count_tokens(self, request: web.Request):
    body = await self.admit.body(request, 400)
    budget = self.admit.budget()
    out = await self.admit.parse(faces_messages.count_tokens, body, budget, 400)
    return _json_response(out)

  # -- vLLM's /tokenize and /detokenize (faces/tokens.py) -------------------

  async def tokenize(self, request: web.Request):
    body = await self.admit.body(request, 400)
    budget = self.admit.budget()
    out = await self.admit.parse(faces_tokens.tokenize, body, budget, 400)
    return _json_response(out)

  async def detokenize(self, request: web.Request):
    body = await self.admit.body(request, 400)
    out = await self.admit.work(faces_tokens.detokenize, body, self.ctx)
    return _json_response(out)

  def _stored(self, request: web.Request):
    store = self.ctx.responses_store
    rid = request.match_info["rid"]
    if store is None:
      raise ApiError(404, "this server keeps no responses", api.NOT_FOUND)
    return store, rid

  async def response_get(self, request: web.Request):
    store, rid = self._stored(request)
    out = await self.admit.work(lambda: store.get(rid))
    if out is None:
      raise ApiError(404, f"no stored response {rid!r:.80}", api.NOT_FOUND)
    return _json_response(out)

  async def response_input_items(self, request: web.Request):
    store, rid = self._stored(request)
    items = await self.admit.work(lambda: store.input_items(rid))
    if items is None:
      raise ApiError(404, f"no stored response {rid!r:.80}", api.NOT_FOUND)
    if request.query.get("order", "desc") == "desc":
      items = items[::-1]
    return _json_response(
      {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": False,
      }
    )

  async def response_delete(self, request: web.Request):
    store, rid = self._stored(request)
    if not await self.admit.work(lambda: store.delete(rid)):
      raise ApiError(404, f"no stored response {rid!r:.80}", api.NOT_FOUND)
    return _json_response({"id": rid, "object": "response", "deleted": True})

  async def _start_all(self, call, budget) -> dict[int, TokenStream]:
    choices = [c for c in call.choices if c.generation is not None]
    self.admit.check_room(len(choices))
    generations = [c.generation for c in choices]
    prepared = await self.admit.prepare(generations, 400, budget)
    streams: dict[int, TokenStream] = {}
    try:
      for c, p in zip(choices, prepared, strict=True):
        streams[c.index] = self.admit.submit(c.generation, p)
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
        web.post("/v1/responses", self.responses),
        web.get("/v1/responses/{rid}", self.response_get),
        web.get("/v1/responses/{rid}/input_items", self.response_input_items),
        web.delete("/v1/responses/{rid}", self.response_delete),
        web.post("/tokenize", self.tokenize),
        web.post("/detokenize", self.detokenize),
        web.post("/v1/messages", self.messages),
        web.post("/v1/messages/count_tokens", self.count_tokens),
        *explore.Explorer().routes(),
      ]
    )
    return app


def _device_kind() -> str:
  import jax

  return jax.devices()[0].platform
