"""OpenAI's Responses API (the `openai` client's `types/responses`).

  turn = parse(body, ctx, store)          # a chat-shaped Call inside
  body = response(turn, chat_body)        # from chat completion's body
  async for event in events(turn, chunks): ...   # the stream's events

A request becomes a chat completion request (`openai_requests.parse_chat`:
the same template, tools, constraints and checks): `instructions` a system
turn, `input` items the turns (messages; `function_call` items an
assistant's tool calls; `function_call_output` items tool turns),
`text.format` the response format, function `tools` and `tool_choice`
chat's. With `previous_response_id` the stored conversation (its input
and output items, function calls included) comes first. The result is
shaped back into output items: a message with `output_text` (and its
log-probs with `include: ["message.output_text.logprobs"]`), or
`function_call` items.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from chunkwise.serving import api
from chunkwise.serving.api import ApiError, Context
from chunkwise.serving.faces import openai_requests
from chunkwise.serving.faces.openai_requests import MAX_LOGPROBS, Call

LOGPROBS = "message.output_text.logprobs"
# Fields clients send that change nothing here (their values checked
# where one could ask for something this server does not do).
_HARMLESS = {"metadata", "user", "service_tier", "safety_identifier"}
_HARMLESS |= {"prompt_cache_key", "truncation", "reasoning", "background"}
_HARMLESS |= {"stream_options", "max_tool_calls"}


class ResponsesBody(BaseModel):
  model_config = ConfigDict(extra="allow")

  model: str
  input: str | list[dict] = api.documented(..., minLength=1, examples=["Hello"])
  instructions: str | None = None
  max_output_tokens: int | None = api.documented(minimum=1)
  temperature: float | None = api.documented(minimum=0, maximum=2)
  top_p: float | None = api.documented(exclusiveMinimum=0, maximum=1)
  text: dict | None = None
  tools: list[dict] | None = None
  tool_choice: Any = None
  parallel_tool_calls: bool | None = None
  include: list[str] | None = None
  top_logprobs: int | None = api.documented(minimum=0, maximum=MAX_LOGPROBS)
  stream: bool | None = None
  store: bool | None = None
  previous_response_id: str | None = None
  # vLLM-style extensions (extra_body)
  top_k: int | None = api.documented(minimum=-1)
  min_p: float | None = api.documented(minimum=0, maximum=1)
  seed: int | None = api.documented(minimum=0, maximum=2**32 - 1)


@dataclasses.dataclass
class Turn:
  """A parsed /v1/responses request."""

  id: str
  created_at: int
  body: ResponsesBody
  call: Call
  input_items: list[dict]  # this turn's, with ids
  history: list[dict]  # the conversation before it (previous turns)
  store: bool

  @property
  def stream(self) -> bool:
    return self.call.stream


_bad = api.bad_request


def _check_extra(b: ResponsesBody) -> None:
  """The field policy (`openai_requests.check_extra`), then the values of
  the harmless fields that are harmless only unset."""
  openai_requests.check_extra(b, dict.fromkeys(_HARMLESS))
  for name, value in (b.model_extra or {}).items():
    if name == "truncation" and value not in (None, "disabled"):
      raise _bad(f"truncation={value!r:.40} is not supported (only 'disabled')")
    if name == "background" and value:
      raise _bad("background responses are not supported by this server")
    if (
      name == "reasoning"
      and value
      and (
        not isinstance(value, dict)
        or any(v is not None for v in value.values())
      )
    ):
      raise _bad("reasoning is not supported by this model")


def _input_items(given: str | list[dict]) -> list[dict]:
  """The request's input as items, each with an id (as OpenAI lists them)."""
  if isinstance(given, str):
    given = [{"type": "message", "role": "user", "content": given}]
  items = []
  for i, item in enumerate(given):
    if not isinstance(item, dict):
      raise _bad(f"input[{i}] must be an object")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
      prefix = "msg"
    elif kind in ("function_call", "function_call_output"):
      prefix = "fc" if kind == "function_call" else "fco"
    elif kind == "item_reference":
      raise _bad(f"input[{i}]: item references are not supported")
    else:
      raise _bad(
        f"input[{i}].type must be 'message', 'function_call' or "
        f"'function_call_output', got {kind!r:.40}"
      )
    items.append(_listed(item, kind, item.get("id") or api.new_id(prefix), i))
  return items


def _listed(item: dict, kind: str, iid: str, i: int) -> dict:
  """An input item as `input_items` lists it (the client's item types)."""
  where = f"input[{i}]"
  if kind == "message":
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
      raise _bad(f"{where}.role must be user, assistant, system or developer")
    text = _text(item.get("content"), where)
    part = {"type": "output_text" if role == "assistant" else "input_text"}
    part["text"] = text
    if role == "assistant":
      part["annotations"] = []
    return {
      "id": iid,
      "type": "message",
      "role": role,
      "content": [part],
      "status": "completed",
    }
  keys = ("call_id", "name", "arguments")
  if kind == "function_call_output":
    keys = ("call_id", "output")
  out = {"id": iid, "type": kind, "status": "completed"}
  for key in keys:
    value = item.get(key)
    if key == "output" and not isinstance(value, str):
      value = _text(value, where)
    if not isinstance(value, str):
      raise _bad(f"{where}.{key} must be a string")
    out[key] = value
  return out


def _text(content: Any, where: str) -> str:
  if isinstance(content, str):
    return content
  if not isinstance(content, list):
    raise _bad(f"{where}.content must be a string or a list of parts")
  parts = []
  for k, part in enumerate(content):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in ("input_text", "output_text", "text"):
      raise _bad(
        f"{where}.content[{k}]: only text parts are supported, got {kind!r:.40}"
      )
    parts.append(str(part.get("text", "")))
  return "".join(parts)


def _messages(instructions: str | None, items: list[dict]) -> list[dict]:
  """The conversation (items as `_listed` makes them) as chat messages:
  consecutive function calls one assistant turn with several tool
  calls."""
  out = []
  if instructions:
    out.append({"role": "system", "content": instructions})
  for item in items:
    if item["type"] == "message":
      role = "system" if item["role"] == "developer" else item["role"]
      text = "".join(p["text"] for p in item["content"])
      out.append({"role": role, "content": text})
    elif item["type"] == "function_call":
      call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
      }
      last = out[-1] if out else None
      if last and last["role"] == "assistant" and last.get("tool_calls"):
        last["tool_calls"].append(call)
      else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    else:  # function_call_output
      out.append(
        {
          "role": "tool",
          "tool_call_id": item["call_id"],
          "content": item["output"],
        }
      )
  return out


def _tools(tools: list[dict] | None) -> list[dict] | None:
  """Responses' function tools as chat's."""
  if tools is None:
    return None
  out = []
  for i, t in enumerate(tools):
    if not isinstance(t, dict) or t.get("type") != "function":
      kind = t.get("type") if isinstance(t, dict) else None
      raise _bad(
        f"tools[{i}].type must be 'function' (built-in tools are not "
        f"supported), got {kind!r:.40}"
      )
    function = {
      k: t[k] for k in ("name", "description", "parameters") if k in t
    }
    if t.get("strict") is not None:
      function["strict"] = t["strict"]
    out.append({"type": "function", "function": function})
  return out


def _tool_choice(choice: Any) -> Any:
  if isinstance(choice, dict) and choice.get("type") == "function":
    return {"type": "function", "function": {"name": choice.get("name")}}
  if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
    raise _bad("tool_choice allowed_tools is not supported by this server")
  return choice


def _response_format(text: dict | None) -> dict | None:
  if not text:
    return None
  if not isinstance(text, dict):
    raise _bad("text must be an object")
  f = text.get("format")
  if f is None:
    return None
  kind = f.get("type") if isinstance(f, dict) else None
  if kind == "text":
    return None
  if kind == "json_object":
    return {"type": "json_object"}
  if kind == "json_schema":
    if not isinstance(f.get("schema"), dict):
      raise _bad("text.format.schema must be a JSON schema object")
    return {
      "type": "json_schema",
      "json_schema": {
        "name": f.get("name", "answer"),
        "schema": f["schema"],
        "strict": f.get("strict"),
      },
    }
  raise _bad(
    "text.format.type must be 'text', 'json_object' or 'json_schema', got "
    f"{kind!r:.40}"
  )


def parse(raw: Any, ctx: Context, store) -> Turn:
  """A /v1/responses body checked and turned into a chat `Call` (400s name
  the field; 404 for an unknown previous_response_id)."""
  b = openai_requests._validate(ResponsesBody, raw)
  _check_extra(b)
  if b.max_output_tokens is not None and b.max_output_tokens < 1:
    raise _bad(
      f"max_output_tokens must be at least 1, got {b.max_output_tokens}"
    )
  include = b.include or []
  unknown = [x for x in include if x != LOGPROBS]
  if unknown:
    raise _bad(f"include {unknown[0]!r:.60} is not supported (only {LOGPROBS})")
  keep = b.store is not False
  if keep and store is None:
    keep = False  # a server without a state directory: nothing kept
  history = []
  if b.previous_response_id is not None:
    if store is None:
      raise _bad("previous_response_id needs the server's response store")
    history = store.history(b.previous_response_id)
    if history is None:
      raise ApiError(
        404,
        f"no stored response {b.previous_response_id!r:.80}",
        api.NOT_FOUND,
      )
  items = _input_items(b.input)
  logprobs = LOGPROBS in include
  chat = {
    "model": b.model,
    "messages": _messages(b.instructions, [*history, *items]),
    "max_completion_tokens": b.max_output_tokens,
    "temperature": b.temperature,
    "top_p": b.top_p,
    "top_k": b.top_k,
    "min_p": b.min_p,
    "seed": b.seed,
    "stream": b.stream,
    "response_format": _response_format(b.text),
    "tools": _tools(b.tools),
    "tool_choice": _tool_choice(b.tool_choice),
    "parallel_tool_calls": b.parallel_tool_calls,
    "logprobs": logprobs or None,
    "top_logprobs": (b.top_logprobs or 0) if logprobs else None,
  }
  if b.top_logprobs and not logprobs:
    raise _bad(f"top_logprobs needs include: [{LOGPROBS!r}]")
  call = openai_requests.parse_chat(
    {k: v for k, v in chat.items() if v is not None}, ctx
  )
  return Turn(
    id=api.new_id("resp", "_"),
    created_at=int(time.time()),
    body=b,
    call=call,
    input_items=items,
    history=history,
    store=keep,
  )


def _usage(prompt: int, generated: int) -> dict:
  return {
    "input_tokens": prompt,
    "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
    "output_tokens": generated,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": prompt + generated,
  }


def _logprobs(entries: list[dict] | None) -> list[dict]:
  return [
    {
      "token": e["token"],
      "bytes": e["bytes"],
      "logprob": e["logprob"],
      "top_logprobs": [
        {k: t[k] for k in ("token", "bytes", "logprob")}
        for t in e["top_logprobs"]
      ],
    }
    for e in entries or []
  ]


def message_item(text: str, logprobs: list[dict] | None, status: str) -> dict:
  part = {"type": "output_text", "text": text, "annotations": []}
  if logprobs is not None:
    part["logprobs"] = logprobs
  return {
    "id": api.new_id("msg", "_"),
    "type": "message",
    "role": "assistant",
    "status": status,
    "content": [part],
  }


def call_item(call: dict, status: str = "completed") -> dict:
  return {
    "id": api.new_id("fc", "_"),
    "type": "function_call",
    "call_id": call["id"],
    "name": call["function"]["name"],
    "arguments": call["function"]["arguments"],
    "status": status,
  }


def skeleton(turn: Turn, status: str) -> dict:
  """The response object without its output (what a stream starts with)."""
  b = turn.body
  fmt = (b.text or {}).get("format") or {"type": "text"}
  return {
    "id": turn.id,
    "object": "response",
    "created_at": turn.created_at,
    "status": status,
    "error": None,
    "incomplete_details": None,
    "instructions": b.instructions,
    "max_output_tokens": b.max_output_tokens,
    "model": b.model,
    "output": [],
    "parallel_tool_calls": b.parallel_tool_calls is not False,
    "previous_response_id": b.previous_response_id,
    "store": turn.store,
    "temperature": 1.0 if b.temperature is None else b.temperature,
    "text": {"format": fmt},
    "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
    "tools": [
      {"strict": None, "description": None, **t} for t in (b.tools or [])
    ],
    "top_logprobs": b.top_logprobs,
    "top_p": 1.0 if b.top_p is None else b.top_p,
    "truncation": "disabled",
    "usage": None,
    "metadata": (b.model_extra or {}).get("metadata") or {},
  }


def finished(turn: Turn, output: list[dict], length: bool, usage) -> dict:
  """The whole response: `output` items, "incomplete" when the token
  budget ended it."""
  out = skeleton(turn, "incomplete" if length else "completed")
  out["output"] = output
  out["usage"] = usage
  if length:
    out["incomplete_details"] = {"reason": "max_output_tokens"}
  return out


def response(turn: Turn, chat: dict) -> dict:
  """The response of a finished turn, from its chat completion body."""
  choice = chat["choices"][0]
  message = choice["message"]
  length = choice["finish_reason"] == "length"
  status = "incomplete" if length else "completed"
  if message.get("tool_calls"):
    output = [call_item(c) for c in message["tool_calls"]]
  else:
    lp = choice.get("logprobs")
    logprobs = _logprobs(lp["content"]) if lp is not None else None
    output = [message_item(message.get("content") or "", logprobs, status)]
  u = chat["usage"]
  usage = _usage(u["prompt_tokens"], u["completion_tokens"])
  return finished(turn, output, length, usage)


def as_input(item: dict) -> dict:
  """An output item as the next turn's input item (`_listed`'s form)."""
  if item["type"] == "message":
    text = "".join(p.get("text", "") for p in item["content"])
    return _listed(
      {"role": "assistant", "content": text}, "message", item["id"], 0
    )
  return _listed(item, "function_call", item["id"], 0)


def keep(turn: Turn, body: dict, store) -> None:
  """Stores a finished turn (one committed row) when it asked to be."""
  if not turn.store:
    return
  history = [
    *turn.history,
    *turn.input_items,
    *(as_input(x) for x in body["output"]),
  ]
  store.put(turn.id, body, turn.input_items, history)


# -- streaming -------------------------------------------------------------


class Events:
  """The stream's events, from the chat chunks of the same request
  (`sse.openai_chunks`), numbered by `sequence_number`."""

  def __init__(self, turn: Turn):
    self.turn = turn
    self.seq = 0
    self.items: list[dict] = []  # finished output items
    self.text: dict | None = None  # the message item being written
    self.calls: dict[int, dict] = {}  # tool call index -> its item
    self.logprobs: list[dict] = []

  def _event(self, kind: str, **fields) -> dict:
    event = {"type": kind, "sequence_number": self.seq, **fields}
    self.seq += 1
    return event

  def start(self) -> list[dict]:
    body = skeleton(self.turn, "in_progress")
    return [
      self._event("response.created", response=body),
      self._event("response.in_progress", response=body),
    ]

  def _open_text(self) -> list[dict]:
    self.text = message_item("", None, "in_progress")
    self.text["content"] = []
    index = len(self.items)
    part = {"type": "output_text", "text": "", "annotations": []}
    if self.turn.call.logprobs is not None:
      part["logprobs"] = []
    return [
      self._event(
        "response.output_item.added",
        output_index=index,
        item=dict(self.text, content=[]),
      ),
      self._event(
        "response.content_part.added",
        item_id=self.text["id"],
        output_index=index,
        content_index=0,
        part=part,
      ),
    ]

  def chunk(self, chunk: dict) -> list[dict]:
    """The events of one chat chunk."""
    if "error" in chunk:
      raise RuntimeError(chunk["error"].get("message", "generation failed"))
    events = []
    choice = chunk["choices"][0]
    delta = choice.get("delta") or {}
    content = delta.get("content")
    lp = choice.get("logprobs")
    if content or (lp and lp.get("content") and not self.calls):
      if self.text is None:
        events += self._open_text()
      entries = _logprobs(lp["content"]) if lp else []
      self.logprobs += entries
      if content or entries:
        event = dict(
          item_id=self.text["id"],
          output_index=len(self.items),
          content_index=0,
          delta=content or "",
          logprobs=entries,
        )
        events.append(self._event("response.output_text.delta", **event))
      if content:
        self.text.setdefault("_text", [])
        self.text["_text"].append(content)
    for call in delta.get("tool_calls") or []:
      events += self._tool_delta(call)
    return events

  def _tool_delta(self, call: dict) -> list[dict]:
    events = []
    k = call["index"]
    if k not in self.calls:
      f = call.get("function") or {}
      item = {
        "id": api.new_id("fc", "_"),
        "type": "function_call",
        "call_id": call.get("id") or api.new_id("call", "_"),
        "name": f.get("name", ""),
        "arguments": "",
        "status": "in_progress",
      }
      self.calls[k] = item
      events.append(
        self._event(
          "response.output_item.added",
          output_index=len(self.items) + len(self.calls) - 1,
          item=dict(item),
        )
      )
    item = self.calls[k]
    args = (call.get("function") or {}).get("arguments")
    if args:
      item["arguments"] += args
      events.append(
        self._event(
          "response.function_call_arguments.delta",
          item_id=item["id"],
          output_index=len(self.items) + list(self.calls).index(k),
          delta=args,
        )
      )
    return events

  def finish(self, length: bool, usage: dict) -> tuple[list[dict], dict]:
    """The closing events and the whole response."""
    events = []
    status = "incomplete" if length else "completed"
    if self.calls:
      base = len(self.items)
      for j, item in enumerate(self.calls.values()):
        item["status"] = "completed"
        events.append(
          self._event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=base + j,
            arguments=item["arguments"],
          )
        )
        events.append(
          self._event(
            "response.output_item.done", output_index=base + j, item=item
          )
        )
        self.items.append(item)
    else:
      if self.text is None:
        events += self._open_text()
      text = "".join(self.text.pop("_text", []))
      index = len(self.items)
      logprobs = self.logprobs if self.turn.call.logprobs is not None else None
      item = message_item(text, logprobs, status)
      item["id"] = self.text["id"]
      part = item["content"][0]
      done = dict(item_id=item["id"], output_index=index, content_index=0)
      text_done = dict(done, text=text, logprobs=logprobs or [])
      events.append(self._event("response.output_text.done", **text_done))
      events.append(
        self._event("response.content_part.done", **done, part=part)
      )
      events.append(
        self._event("response.output_item.done", output_index=index, item=item)
      )
      self.items.append(item)
    body = finished(self.turn, self.items, length, usage)
    kind = "response.incomplete" if length else "response.completed"
    events.append(self._event(kind, response=body))
    return events, body


def usage_of(turn: Turn, generated: int) -> dict:
  return _usage(len(turn.call.prompts[0]), generated)
