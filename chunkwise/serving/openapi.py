"""The server's OpenAPI 3.1 document, served at `GET /openapi.json`.

  doc = document(models=["smollm2-135m", "math"], auth=True)
  ROUTES                  # (method, path) of every documented operation

Request bodies are the JSON schemas of the pydantic models the routes
parse with (`native.Body`, `openai_requests.CompletionBody` /
`ChatBody`, `faces.responses.ResponsesBody`, `faces.messages.MessagesBody`
/ `CountTokensBody`), as pydantic writes them
(`model_json_schema`), under
`#/components/schemas`: nothing here restates a field. The fields
declare the fixed bounds their route enforces with messages of its own
(`api.documented`); declared types can still be looser than what a
route accepts (`messages` is a list of objects, the flags' limits are
not in it): the route answers the rest with an error in its API's shape
(`TgiError` off `/v1/`, `OpenAIError` on it, `AnthropicError` on
`/v1/messages`, as `http.error_body` writes them), which every operation
documents per status.
`models` (the served names) become the examples of the OpenAI bodies'
`model`; with `auth`, every operation but the health checks and the
explorer's files (and this document, with `public_openapi`) needs
`Authorization: Bearer <key>`. Every operation may answer 403 (a Host
or Origin not allowed), every POST 415 (a body declared other than
JSON).
Each GET route also answers HEAD (aiohttp's), not listed.
`tests/test_serving_openapi.py` checks the document against the app's
router and runs schemathesis against the live server from it.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, json_schema

import chunkwise
from chunkwise.serving import api
from chunkwise.serving.faces import (
  messages,
  native,
  openai_requests,
  responses,
  tokens,
)

_REF = "#/components/schemas/{model}"


class TgiError(BaseModel):
  """An error on the TGI / LoRAX routes (everything off `/v1/`)."""

  error: str
  error_type: Literal[
    "validation", "generation", "overloaded", "healthcheck", "unauthorized"
  ]


class OpenAIErrorDetail(BaseModel):
  message: str
  type: Literal[
    "BadRequestError",
    "AuthenticationError",
    "NotFoundError",
    "RateLimitError",
    "ServiceUnavailableError",
    "InternalServerError",
  ]
  param: str | None
  code: int


class OpenAIError(BaseModel):
  """An error on the OpenAI routes (`/v1/...`)."""

  error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
  type: Literal[tuple(sorted({*messages.ERROR_TYPES.values(), "api_error"}))]
  message: str


class AnthropicError(BaseModel):
  """An error on the Messages routes (`/v1/messages...`)."""

  type: Literal["error"]
  error: AnthropicErrorDetail


_STATUS = {
  301: "moved (to `/explore`)",
  400: "invalid request (the message names the field)",
  401: "no valid API key (`Authorization: Bearer <key>`)",
  403: "a Host or Origin this server does not answer to (`--allowed_hosts`)",
  408: "the body did not arrive in time (`--body_timeout_s`)",
  404: "no such model or adapter (OpenAI), or no such file",
  413: "the body is over the server's size limit",
  415: "a body declared other than JSON",
  422: "invalid request (the message names the field)",
  424: "the generation failed",
  429: "overloaded: the queue is full (retry after `Retry-After`)",
  500: "the generation failed",
  503: "shutting down (or unhealthy)",
}
_JSON = "application/json"
# one event (as OpenAPI 3.2's `itemSchema` of an SSE stream has it)
_EVENT = {
  "type": "object",
  "properties": {
    "data": {"type": "string"},
    "event": {"type": "string"},
    "id": {"type": "string"},
    "retry": {"type": "integer"},
  },
  "required": ["data"],
}
_SSE = {"text/event-stream": {"schema": _EVENT}}
_OBJECT = {_JSON: {"schema": {"type": "object"}}}
_NATIVE = (413, 422, 424, 429, 503)
_OPENAI = (400, 404, 413, 429, 500, 503)


@dataclasses.dataclass(frozen=True)
class Operation:
  """One route's entry (the request body's schema is `body`'s)."""

  method: str
  path: str  # OpenAPI's form: /v1/models/{name}
  summary: str
  ok: dict  # media type -> {"schema": ...} of the 200 (or 301) answer
  errors: tuple[int, ...] = ()
  body: type[BaseModel] | None = None
  public: bool = False  # needs no API key
  tag: str = "server"
  ok_status: int = 200


OPERATIONS = (
  Operation("get", "/", "Health check (as `/health`)", {}, (503,), public=True),
  Operation("get", "/health", "Health check", {}, (503,), public=True),
  Operation("get", "/info", "The model and the server's limits", _OBJECT),
  Operation(
    "get",
    "/metrics",
    "Prometheus metrics",
    {"text/plain": {"schema": {"type": "string"}}},
  ),
  Operation(
    "get",
    "/openapi.json",
    "This document",
    _OBJECT,
    public=True,
  ),
  Operation(
    "post",
    "/",
    "Generate: a one-element array, or an SSE stream when `stream` is true",
    {_JSON: {"schema": {"type": "array"}}, **_SSE},
    _NATIVE,
    native.Body,
    tag="tgi",
  ),
  Operation(
    "post",
    "/generate",
    "Generate (TGI / LoRAX)",
    _OBJECT,
    _NATIVE,
    native.Body,
    tag="tgi",
  ),
  Operation(
    "post",
    "/generate_stream",
    "Generate, one SSE event per token (TGI / LoRAX)",
    _SSE,
    _NATIVE,
    native.Body,
    tag="tgi",
  ),
  Operation(
    "get", "/v1/models", "The served models (OpenAI)", _OBJECT, tag="openai"
  ),
  Operation(
    "get",
    "/v1/models/{name}",
    "One served model: the base model or an adapter (OpenAI)",
    _OBJECT,
    (404,),
    tag="openai",
  ),
  Operation(
    "post",
    "/v1/completions",
    "Completions (OpenAI); an SSE stream when `stream` is true",
    {**_OBJECT, **_SSE},
    _OPENAI,
    openai_requests.CompletionBody,
    tag="openai",
  ),
  Operation(
    "post",
    "/v1/chat/completions",
    "Chat completions (OpenAI); an SSE stream when `stream` is true",
    {**_OBJECT, **_SSE},
    _OPENAI,
    openai_requests.ChatBody,
    tag="openai",
  ),
  Operation(
    "post",
    "/v1/responses",
    "Responses (OpenAI's Responses API); an SSE stream of its events when "
    "`stream` is true",
    {**_OBJECT, **_SSE},
    _OPENAI,
    responses.ResponsesBody,
    tag="openai",
  ),
  Operation(
    "get",
    "/v1/responses/{rid}",
    "A stored response (OpenAI)",
    _OBJECT,
    (404,),
    tag="openai",
  ),
  Operation(
    "get",
    "/v1/responses/{rid}/input_items",
    "A stored response's input items (OpenAI)",
    _OBJECT,
    (404,),
    tag="openai",
  ),
  Operation(
    "delete",
    "/v1/responses/{rid}",
    "Deletes a stored response (OpenAI)",
    _OBJECT,
    (404,),
    tag="openai",
  ),
  Operation(
    "post",
    "/tokenize",
    "A prompt's or a conversation's token ids (vLLM's)",
    _OBJECT,
    _OPENAI,
    tokens.TokenizeBody,
    tag="openai",
  ),
  Operation(
    "post",
    "/detokenize",
    "The text of token ids (vLLM's)",
    _OBJECT,
    _OPENAI,
    tokens.DetokenizeBody,
    tag="openai",
  ),
  Operation(
    "post",
    "/v1/messages",
    "Messages (Anthropic's Messages API); an SSE stream of its events when "
    "`stream` is true",
    {**_OBJECT, **_SSE},
    _OPENAI,
    messages.MessagesBody,
    tag="anthropic",
  ),
  Operation(
    "post",
    "/v1/messages/count_tokens",
    "The input tokens of a Messages request (Anthropic)",
    _OBJECT,
    _OPENAI,
    messages.CountTokensBody,
    tag="anthropic",
  ),
  Operation(
    "get",
    "/explore",
    "The token explorer page",
    {"text/html": {"schema": {"type": "string"}}},
    public=True,
    tag="explore",
  ),
  Operation(
    "get",
    "/explore/",
    "Redirects to `/explore`",
    {},
    public=True,
    tag="explore",
    ok_status=301,
  ),
  Operation(
    "get",
    "/explore/{name}",
    "The page's script (`explore.js`) and style (`explore.css`)",
    {
      "text/javascript": {"schema": {"type": "string"}},
      "text/css": {"schema": {"type": "string"}},
    },
    (404,),
    public=True,
    tag="explore",
  ),
)
ROUTES = frozenset((op.method.upper(), op.path) for op in OPERATIONS)


def _error_model(path: str) -> type[BaseModel]:
  # as `http.error_body` chooses
  if messages.route(path):
    return AnthropicError
  return OpenAIError if api.openai_route(path) else TgiError


def _schemas() -> tuple[dict, dict]:
  """(model -> {"$ref"}, components' schemas) of the bodies and errors."""
  models = {op.body for op in OPERATIONS if op.body is not None}
  models |= {TgiError, OpenAIError, AnthropicError}
  refs, top = json_schema.models_json_schema(
    [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
    ref_template=_REF,
  )
  return {m: ref for (m, _), ref in refs.items()}, top.get("$defs", {})


def _name(ref: dict) -> str:
  return ref["$ref"].rsplit("/", 1)[1]


def _operation(
  op: Operation, refs: dict, auth: bool, public_openapi: bool
) -> dict:
  out: dict[str, Any] = {
    "operationId": re.sub(r"\W+", "_", op.method + op.path).strip("_"),
    "summary": op.summary,
    "tags": [op.tag],
  }
  names = [p[1:-1] for p in op.path.split("/") if p.startswith("{")]
  if names:
    out["parameters"] = [
      {"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
      for n in names
    ]
  if op.body is not None:
    out["requestBody"] = {
      "required": True,
      "content": {_JSON: {"schema": refs[op.body]}},
    }
  ok: dict[str, Any] = {"description": _STATUS.get(op.ok_status, "OK")}
  if op.ok:
    ok["content"] = op.ok
  if op.ok_status == 301:
    ok["headers"] = {"Location": {"schema": {"type": "string"}}}
  responses = {str(op.ok_status): ok}
  public = op.public and (op.path != "/openapi.json" or public_openapi)
  errors = set(op.errors) | {403} | ({401} if auth and not public else set())
  if op.method == "post":  # (and one address's requests at once: 429)
    errors |= {408, 415, 429}
  error = {_JSON: {"schema": refs[_error_model(op.path)]}}
  for status in sorted(errors):
    responses[str(status)] = {"description": _STATUS[status], "content": error}
  out["responses"] = responses
  if auth:
    out["security"] = [] if public else [{"bearer": []}]
  return out


def document(
  *,
  models: Sequence[str] = (),
  auth: bool = False,
  public_openapi: bool = False,
) -> dict:
  """The OpenAPI 3.1 document of every route `http.Server.app` serves;
  `models`: the names the OpenAI routes' `model` takes (examples); `auth`:
  whether the server wants an API key (`public_openapi`: not for this
  document)."""
  refs, schemas = _schemas()
  for body in (openai_requests.CompletionBody, openai_requests.ChatBody):
    model = schemas[_name(refs[body])]["properties"]["model"]
    if models:
      model["examples"] = list(models)
  paths: dict[str, dict] = {}
  for op in OPERATIONS:
    paths.setdefault(op.path, {})[op.method] = _operation(
      op, refs, auth, public_openapi
    )
  doc: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
      "title": "chunkwise",
      "version": chunkwise.__version__,
      "description": (
        "TGI / LoRAX and OpenAI routes over one engine. Errors are JSON "
        "in each API's shape: TgiError off /v1/, OpenAIError on it."
      ),
    },
    "paths": paths,
    "components": {"schemas": schemas},
  }
  if auth:
    doc["components"]["securitySchemes"] = {
      "bearer": {"type": "http", "scheme": "bearer"}
    }
  return copy.deepcopy(doc)  # no module constant shared with the caller
