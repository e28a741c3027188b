"""Server-sent events: the streaming responses of both APIs.

  response = await native_events(request, stream, inputs, options, ctx)
  response = await openai_events(request, call, streams, ctx, chat=True)

One event is `data: <compact JSON on one line>` and a blank line, flushed
as written (chunked, no compression). Native streams end without a
marker; OpenAI streams end with `data: [DONE]`. A client that goes away
(the write fails, or aiohttp cancels the handler) cancels its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiohttp import web

from chunkwise.serving import api, tool_calls
from chunkwise.serving.api import Context, dumps
from chunkwise.serving.faces import native, openai_api
from chunkwise.serving.stream import ERROR, LENGTH, TokenStream

_SSE_HEADERS = {
  "Content-Type": "text/event-stream",
  "Cache-Control": "no-cache",
  "X-Accel-Buffering": "no",
}


class Events(web.StreamResponse):
  """An SSE response whose writes time out (`write_timeout_s`): a client
  that stops reading is dropped, its generation cancelled and its slot
  freed, instead of holding both while `drain()` waits forever."""

  write_timeout_s: float | None = None


async def write(response: web.StreamResponse, data: bytes) -> None:
  """`response.write(data)`, a `ConnectionResetError` (what a client that
  left raises, so the callers cancel its streams) past the response's
  write timeout."""
  timeout = getattr(response, "write_timeout_s", None)
  try:
    await asyncio.wait_for(response.write(data), timeout)
  except TimeoutError:
    raise ConnectionResetError(
      f"the client read nothing for {timeout:g} s (--write_timeout_s)"
    ) from None


async def send(response: web.StreamResponse, body: Any) -> None:
  await write(response, b"data: " + dumps(body) + b"\n\n")


async def close(response: web.StreamResponse) -> None:
  with contextlib.suppress(ConnectionResetError):
    await response.write_eof()


async def native_events(
  request, s: TokenStream, inputs: str, options, ctx: Context
) -> web.StreamResponse:
  """Streams a native request: one event per token, sent as soon as it is
  handed over; the last carries the text and details (a stream's last
  tokens and its finish are handed over together, so the last token is
  known when it comes); an in-stream error event if it fails."""
  response = await open_sse(request, ctx.write_timeout_s)
  index = 0
  try:
    async for token in s:
      index += 1
      last = s.done and index == len(s.tokens)
      await send(
        response,
        native.event(
          index, token, options, ctx, *((s, inputs) if last else ())
        ),
      )
  except (asyncio.CancelledError, ConnectionResetError):
    s.cancel()
    raise
  except Exception as e:  # the request failed mid-stream
    message = api.scrub(f"Request failed during generation: {e}")
    with contextlib.suppress(ConnectionResetError):
      await send(response, {"error": message, "error_type": "generation"})
  await close(response)
  return response


async def open_sse(request, timeout: float | None = None) -> web.StreamResponse:
  response = Events(status=200, headers=_SSE_HEADERS)
  response.write_timeout_s = timeout
  response.enable_chunked_encoding()
  await response.prepare(request)
  return response


async def openai_events(
  request, call, streams: dict[int, TokenStream], ctx: Context, *, chat: bool
) -> web.StreamResponse:
  """Streams an OpenAI request: chunks per choice as text is safe to show
  (a stop string is never shown in part), the usage chunk if asked, then
  [DONE]."""
  response = await open_sse(request, ctx.write_timeout_s)
  rid = api.new_id("chatcmpl" if chat else "cmpl")
  created = int(time.time())
  try:
    async for chunk in openai_chunks(call, streams, ctx, chat, rid, created):
      await send(response, chunk)
    if call.include_usage:
      generated = sum(len(s.tokens) for s in streams.values())
      obj = "chat.completion.chunk" if chat else "text_completion"
      await send(
        response, openai_api.usage_chunk(call, rid, created, obj, generated)
      )
    await write(response, b"data: [DONE]\n\n")
  except (asyncio.CancelledError, ConnectionResetError):
    for s in streams.values():
      s.cancel()
    raise
  await close(response)
  return response


async def openai_chunks(
  call, streams: dict[int, TokenStream], ctx: Context, chat: bool, rid, created
):
  """The chunks of an OpenAI stream (chat or completion objects, or an
  error object for a choice that failed), as each choice's text is safe
  to show; what every OpenAI-shaped stream (the Responses API's too) is
  written from. Closing it early stops its pumps, not the streams."""
  queue: asyncio.Queue = asyncio.Queue()

  async def pump(index: int, s: TokenStream):
    try:
      async for _ in s:
        await queue.put((index, s, False))
    except Exception:
      pass
    await queue.put((index, s, True))

  tasks = [asyncio.create_task(pump(i, s)) for i, s in streams.items()]
  held = {i: openai_api.Held(s.generation.stop) for i, s in streams.items()}
  calls = (
    {i: tool_calls.Deltas(call.tools.mode, call.tools.fmt) for i in streams}
    if call.tools
    else {}
  )
  called = dict.fromkeys(streams, False)
  sent_tokens = dict.fromkeys(streams, 0)
  shown_chars = dict.fromkeys(streams, 0)  # what the sent tokens spell
  lp = {
    i: openai_api.CompletionLogprobs(ctx, call.logprobs or 0) for i in streams
  }
  open_ = set(streams)
  try:
    if chat:
      for i in sorted(streams):
        yield openai_api.chat_chunk(
          call,
          rid,
          created,
          i,
          # with tools: null until the answer is text (else calls)
          {"role": "assistant", "content": None if calls else ""},
          None,
          None,
        )
    while open_:
      index, s, final = await queue.get()
      if index not in open_:
        continue
      if final and s.finish_reason == ERROR:
        yield {
          "error": {
            "message": api.scrub(f"generation failed: {s.error}"),
            "type": "InternalServerError",
            "param": None,
            "code": 500,
          }
        }
        open_.discard(index)
        continue
      if index in calls:  # tools: content or calls, as they come
        deltas = calls[index](openai_api.visible(s) if final else s.text, final)
        called[index] |= any("tool_calls" in d for d in deltas)
        text = "".join(d.get("content", "") for d in deltas)
      else:
        text = held[index].delta(s, final)
        deltas = [{"content": text}] if text else []
      if chat:
        tokens = s.tokens[sent_tokens[index] :] if final or deltas else []
        sent_tokens[index] += len(tokens)
        logprobs = _chat_logprobs(ctx, call, tokens)
      else:  # the tokens whose text is shown so far (it may run ahead)
        logprobs = None
        if call.logprobs is not None:
          entries, used, shown_chars[index] = openai_api.shown_entries(
            lp[index],
            s.tokens[sent_tokens[index] :],
            shown_chars[index],
            held[index].sent,
            final,
          )
          sent_tokens[index] += used
          logprobs = openai_api.merge(entries) if entries else None
      finish = None
      if final:
        finish = (
          openai_api.chat_reason(call, s, called[index])
          if chat
          else openai_api.reason(s)
        )
      if not chat:
        if text or finish or logprobs:
          yield openai_api.completion_chunk(
            call, rid, created, index, text, finish, logprobs
          )
      else:
        if not deltas and (finish or logprobs):
          deltas = [{}]
        last = len(deltas) - 1
        for k, delta in enumerate(deltas):
          yield openai_api.chat_chunk(
            call,
            rid,
            created,
            index,
            delta,
            finish if k >= last else None,
            logprobs if k == 0 else None,
          )
      if final:
        open_.discard(index)
  finally:
    for t in tasks:
      t.cancel()


async def responses_events(
  request, turn, streams: dict[int, TokenStream], ctx: Context
) -> web.StreamResponse:
  """Streams a Responses API turn: `event: <type>` and its data, from the
  chat chunks of the same request (`faces.responses.Events`); the whole
  response is stored (when asked) before `response.completed` is sent."""
  from chunkwise.serving.faces import responses

  response = await open_sse(request, ctx.write_timeout_s)
  events = responses.Events(turn)
  rid, created = turn.id, turn.created_at
  (s,) = streams.values()

  async def emit(batch):
    await send_events(response, batch)

  try:
    await emit(events.start())
    try:
      async for chunk in openai_chunks(
        turn.call, streams, ctx, True, rid, created
      ):
        await emit(events.chunk(chunk))
    except RuntimeError as e:  # the generation failed
      await emit(
        [
          {
            "type": "error",
            "sequence_number": events.seq,
            "code": "server_error",
            "message": api.scrub(str(e)),
            "param": None,
          }
        ]
      )
      await close(response)
      return response
    usage = responses.usage_of(turn, len(s.tokens))
    final, body = events.finish(s.finish_reason == LENGTH, usage)
    await asyncio.get_running_loop().run_in_executor(
      None, responses.keep, turn, body, ctx.responses_store
    )
    await emit(final)
  except (asyncio.CancelledError, ConnectionResetError):
    s.cancel()
    raise
  await close(response)
  return response


async def send_events(response: web.StreamResponse, batch) -> None:
  """Named events: `event: <its type>` and its data (the Responses and
  Messages APIs' streams)."""
  for e in batch:
    await write(
      response,
      b"event: " + e["type"].encode() + b"\ndata: " + dumps(e) + b"\n\n",
    )


async def messages_events(
  request, turn, streams: dict[int, TokenStream], ctx: Context
) -> web.StreamResponse:
  """Streams a Messages API turn (`faces.messages.Events`), from the chat
  chunks of the same request; an `error` event if it fails."""
  from chunkwise.serving.faces import messages

  response = await open_sse(request, ctx.write_timeout_s)
  events = messages.Events(turn)
  (s,) = streams.values()
  try:
    await send_events(response, events.start())
    try:
      async for chunk in openai_chunks(
        turn.call, streams, ctx, True, turn.id, 0
      ):
        await send_events(response, events.chunk(chunk))
    except RuntimeError as e:  # the generation failed
      body = messages.error_body(500, api.scrub(str(e)))
      await send_events(response, [body])
      await close(response)
      return response
    await send_events(response, events.finish(s))
  except (asyncio.CancelledError, ConnectionResetError):
    s.cancel()
    raise
  await close(response)
  return response


def _chat_logprobs(ctx, call, tokens):
  if call.logprobs is None or not tokens:
    return None
  content = openai_api.chat_logprobs(ctx, tokens, call.logprobs)
  return {"content": content, "refusal": None} if content else None
