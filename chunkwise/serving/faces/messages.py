"""Anthropic's Messages API (the `anthropic` client's `messages.create`,
`messages.stream()` and `messages.count_tokens`).

  turn = parse(body, ctx)                  # a chat-shaped Call inside
  body = message(turn, chat_body, stream)  # from chat completion's body
  events = Events(turn)                    # the stream's, from chat chunks
  n = count_tokens(body, ctx)

A request becomes a chat completion request (`openai_requests.parse_chat`:
the same template, tools, constraints and checks): `system` a system turn,
`messages` the turns (text blocks; an assistant's `tool_use` blocks its
tool calls; a user's `tool_result` blocks tool turns), `tools`
(`input_schema`) and `tool_choice` (`auto`, `any`, `tool`, `none`) chat's,
`output_config.format` the response format, `stop_sequences` the stop
strings. Errors are Anthropic's shape (`error_body`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from chunkwise.serving import api
from chunkwise.serving.api import Context
from chunkwise.serving.faces import openai_requests
from chunkwise.serving.faces.openai_requests import Call
from chunkwise.serving.stream import LENGTH, STOP_SEQUENCE, TokenStream

# Fields clients send that change nothing here.
_HARMLESS = {"metadata", "service_tier", "container", "inference_geo"}
_HARMLESS |= {"speed", "user_profile_id", "workspace_id", "cache_control"}
_HARMLESS |= {"diagnostics"}
# as Anthropic names them, by HTTP status
ERROR_TYPES = {
  400: "invalid_request_error",
  401: "authentication_error",
  403: "permission_error",
  404: "not_found_error",
  408: "timeout_error",
  413: "request_too_large",
  415: "invalid_request_error",
  429: "rate_limit_error",
  503: "overloaded_error",
}


def route(path: str) -> bool:
  """Whether `path` is a Messages route (its errors in Anthropic's shape)."""
  return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(status: int, message: str) -> dict:
  return {
    "type": "error",
    "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
  }


class MessagesBody(BaseModel):
  model_config = ConfigDict(extra="allow")

  model: str
  max_tokens: int = api.documented(..., minimum=1)
  messages: list[dict] = api.documented(
    ..., minItems=1, examples=[[{"role": "user", "content": "Hello"}]]
  )
  system: str | list[dict] | None = None
  stop_sequences: list[str] | None = None
  temperature: float | None = api.documented(minimum=0, maximum=1)
  top_p: float | None = api.documented(exclusiveMinimum=0, maximum=1)
  top_k: int | None = api.documented(minimum=0)
  stream: bool | None = None
  tools: list[dict] | None = None
  tool_choice: dict | None = None
  output_config: dict | None = None
  thinking: dict | None = None


class CountTokensBody(BaseModel):
  model_config = ConfigDict(extra="allow")

  model: str
  messages: list[dict] = api.documented(..., minItems=1)
  system: str | list[dict] | None = None
  tools: list[dict] | None = None
  tool_choice: dict | None = None


@dataclasses.dataclass
class Turn:
  """A parsed /v1/messages request."""

  id: str
  model: str
  call: Call

  @property
  def stream(self) -> bool:
    return self.call.stream


_bad = api.bad_request


def _check_extra(b: BaseModel) -> None:
  """The field policy (`openai_requests.check_extra`), and thinking off."""
  openai_requests.check_extra(b, dict.fromkeys(_HARMLESS))
  thinking = getattr(b, "thinking", None)
  if thinking and thinking.get("type") not in (None, "disabled"):
    raise _bad("thinking is not supported by this model")


def _blocks(content: Any, where: str) -> list[dict]:
  if isinstance(content, str):
    return [{"type": "text", "text": content}]
  if not isinstance(content, list):
    raise _bad(f"{where}.content must be a string or a list of blocks")
  for k, block in enumerate(content):
    if not isinstance(block, dict) or block.get("type") not in (
      "text",
      "tool_use",
      "tool_result",
    ):
      kind = block.get("type") if isinstance(block, dict) else None
      raise _bad(
        f"{where}.content[{k}].type must be text, tool_use or tool_result, "
        f"got {kind!r:.40}"
      )
  return content


def _text_of(content: Any, where: str) -> str:
  """A tool_result's or system's content as text."""
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  parts = []
  for k, block in enumerate(content if isinstance(content, list) else [None]):
    if not isinstance(block, dict) or block.get("type") != "text":
      raise _bad(f"{where}[{k}]: only text blocks are supported")
    parts.append(str(block.get("text", "")))
  return "".join(parts)


def _messages(system: Any, messages: list[dict]) -> list[dict]:
  """The conversation as chat messages."""
  out = []
  if system:
    out.append({"role": "system", "content": _text_of(system, "system")})
  for i, m in enumerate(messages):
    where = f"messages[{i}]"
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ("user", "assistant"):
      raise _bad(f"{where}.role must be 'user' or 'assistant'")
    text, calls = [], []
    for k, block in enumerate(_blocks(m.get("content"), where)):
      kind = block["type"]
      if kind == "text":
        text.append(str(block.get("text", "")))
      elif kind == "tool_use":
        if role != "assistant":
          raise _bad(f"{where}.content[{k}]: tool_use is an assistant's block")
        if not isinstance(block.get("input"), dict):
          raise _bad(f"{where}.content[{k}].input must be an object")
        calls.append(
          {
            "id": str(block.get("id", "")),
            "type": "function",
            "function": {
              "name": str(block.get("name", "")),
              "arguments": json.dumps(block["input"]),
            },
          }
        )
      else:  # tool_result
        if role != "user":
          raise _bad(f"{where}.content[{k}]: tool_result is a user's block")
        out.append(
          {
            "role": "tool",
            "tool_call_id": str(block.get("tool_use_id", "")),
            "content": _text_of(
              block.get("content"), f"{where}.content[{k}].content"
            ),
          }
        )
    if calls:
      out.append(
        {
          "role": "assistant",
          "content": "".join(text) or None,
          "tool_calls": calls,
        }
      )
    elif text or role == "assistant":
      out.append({"role": role, "content": "".join(text)})
  return out


def _tools(tools: list[dict] | None) -> list[dict] | None:
  if tools is None:
    return None
  out = []
  for i, t in enumerate(tools):
    if not isinstance(t, dict) or "input_schema" not in t:
      raise _bad(
        f"tools[{i}] must be a custom tool with an input_schema (server "
        "tools are not supported)"
      )
    if t.get("type") not in (None, "custom"):
      raise _bad(f"tools[{i}].type {t.get('type')!r:.40} is not supported")
    function = {"name": t.get("name"), "parameters": t["input_schema"]}
    if t.get("description") is not None:
      function["description"] = t["description"]
    if t.get("strict") is not None:
      function["strict"] = t["strict"]
    out.append({"type": "function", "function": function})
  return out


def _tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
  """(chat's tool_choice, parallel_tool_calls)."""
  if choice is None:
    return None, None
  kind = choice.get("type")
  parallel = False if choice.get("disable_parallel_tool_use") else None
  if kind == "auto":
    return "auto", parallel
  if kind == "any":
    return "required", parallel
  if kind == "none":
    return "none", None
  if kind == "tool":
    name = choice.get("name")
    return {"type": "function", "function": {"name": name}}, parallel
  raise _bad(
    f"tool_choice.type must be auto, any, tool or none, got {kind!r:.40}"
  )


def _response_format(config: dict | None) -> dict | None:
  if not config:
    return None
  f = config.get("format")
  unknown = set(config) - {"format"}
  if unknown:
    raise _bad(f"output_config.{sorted(unknown)[0]} is not supported")
  if f is None:
    return None
  if not isinstance(f, dict) or f.get("type") != "json_schema":
    raise _bad("output_config.format.type must be 'json_schema'")
  if not isinstance(f.get("schema"), dict):
    raise _bad("output_config.format.schema must be a JSON schema object")
  return {
    "type": "json_schema",
    "json_schema": {"name": "output", "schema": f["schema"]},
  }


def _chat_body(b, stream: bool, max_tokens: int | None) -> dict:
  choice, parallel = _tool_choice(b.tool_choice)
  body = {
    "model": b.model,
    "messages": _messages(b.system, b.messages),
    "tools": _tools(b.tools),
    "tool_choice": choice,
    "parallel_tool_calls": parallel if b.tools else None,
    "max_completion_tokens": max_tokens,
    "stream": stream,
  }
  return {k: v for k, v in body.items() if v is not None}


def parse(raw: Any, ctx: Context) -> Turn:
  """A /v1/messages body checked and turned into a chat `Call`."""
  b = openai_requests._validate(MessagesBody, raw)
  _check_extra(b)
  if b.max_tokens < 1:
    raise _bad(f"max_tokens must be at least 1, got {b.max_tokens}")
  if b.temperature is not None and not 0 <= b.temperature <= 1:
    raise _bad(f"temperature must be in [0, 1], got {b.temperature}")
  body = _chat_body(b, bool(b.stream), b.max_tokens)
  body.update(
    temperature=b.temperature,
    top_p=b.top_p,
    top_k=b.top_k,
    stop=b.stop_sequences or None,
    response_format=_response_format(b.output_config),
  )
  call = openai_requests.parse_chat(
    {k: v for k, v in body.items() if v is not None}, ctx
  )
  return Turn(id=api.new_id("msg", "_"), model=b.model, call=call)


def count_tokens(raw: Any, ctx: Context) -> dict:
  """`input_tokens` of the prompt the same body would run."""
  b = openai_requests._validate(CountTokensBody, raw)
  _check_extra(b)
  call = openai_requests.parse_chat(_chat_body(b, False, None), ctx)
  return {"input_tokens": len(call.prompts[0])}


def stop_reason(s: TokenStream, called: bool) -> tuple[str, str | None]:
  """(stop_reason, stop_sequence) of a finished stream."""
  if called:
    return "tool_use", None
  if s.finish_reason == LENGTH:
    return "max_tokens", None
  if s.finish_reason == STOP_SEQUENCE and s.stop_sequence:
    return "stop_sequence", s.stop_sequence
  return "end_turn", None


def _tool_block(call: dict) -> dict:
  return {
    "type": "tool_use",
    "id": call["id"],
    "name": call["function"]["name"],
    "input": json.loads(call["function"]["arguments"] or "{}"),
  }


def _shell(turn: Turn, usage: dict) -> dict:
  return {
    "id": turn.id,
    "type": "message",
    "role": "assistant",
    "model": turn.model,
    "content": [],
    "stop_reason": None,
    "stop_sequence": None,
    "usage": usage,
  }


def _usage(input_tokens: int, output_tokens: int) -> dict:
  return {
    "input_tokens": input_tokens,
    "output_tokens": output_tokens,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 0,
  }


def message(turn: Turn, chat: dict, s: TokenStream) -> dict:
  """The message of a finished turn, from its chat completion body."""
  m = chat["choices"][0]["message"]
  calls = m.get("tool_calls") or []
  out = _shell(
    turn,
    _usage(chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"]),
  )
  if m.get("content"):
    out["content"].append({"type": "text", "text": m["content"]})
  out["content"] += [_tool_block(c) for c in calls]
  if not out["content"]:
    out["content"].append({"type": "text", "text": ""})
  out["stop_reason"], out["stop_sequence"] = stop_reason(s, bool(calls))
  return out


class Events:
  """The stream's events, from the chat chunks of the same request
  (`sse.openai_chunks`)."""

  def __init__(self, turn: Turn):
    self.turn = turn
    self.block = -1  # index of the open content block
    self.kind: str | None = None  # its type
    self.calls: dict[int, int] = {}  # tool call index -> block index

  def start(self) -> list[dict]:
    prompt = len(self.turn.call.prompts[0])
    return [
      {
        "type": "message_start",
        "message": _shell(self.turn, _usage(prompt, 0)),
      },
      {"type": "ping"},
    ]

  def _open(self, block: dict) -> list[dict]:
    events = self._close()
    self.block += 1
    self.kind = block["type"]
    return [
      *events,
      {
        "type": "content_block_start",
        "index": self.block,
        "content_block": block,
      },
    ]

  def _close(self) -> list[dict]:
    if self.kind is None:
      return []
    self.kind = None
    return [{"type": "content_block_stop", "index": self.block}]

  def chunk(self, chunk: dict) -> list[dict]:
    if "error" in chunk:
      raise RuntimeError(chunk["error"].get("message", "generation failed"))
    events = []
    delta = chunk["choices"][0].get("delta") or {}
    text = delta.get("content")
    if text:
      if self.kind != "text":
        events += self._open({"type": "text", "text": ""})
      events.append(
        {
          "type": "content_block_delta",
          "index": self.block,
          "delta": {"type": "text_delta", "text": text},
        }
      )
    for call in delta.get("tool_calls") or []:
      k = call["index"]
      f = call.get("function") or {}
      if k not in self.calls:
        block = {
          "type": "tool_use",
          "id": call.get("id") or api.new_id("toolu", "_"),
          "name": f.get("name", ""),
          "input": {},
        }
        events += self._open(block)
        self.calls[k] = self.block
      if f.get("arguments"):
        events.append(
          {
            "type": "content_block_delta",
            "index": self.calls[k],
            "delta": {
              "type": "input_json_delta",
              "partial_json": f["arguments"],
            },
          }
        )
    return events

  def finish(self, s: TokenStream) -> list[dict]:
    events = []
    if self.block < 0:  # nothing shown: an empty text block
      events += self._open({"type": "text", "text": ""})
    events += self._close()
    reason, sequence = stop_reason(s, bool(self.calls))
    return [
      *events,
      {
        "type": "message_delta",
        "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": {"output_tokens": len(s.tokens)},
      },
      {"type": "message_stop"},
    ]
