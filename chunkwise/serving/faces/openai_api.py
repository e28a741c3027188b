"""OpenAI responses (../shared/SERVING.md §3-6): finished and streamed
completions and chat completions, log-probs, model cards.

  body = completion(call, ctx, streams, scored)
  body = chat(call, ctx, streams)
  chunk = chat_chunk(call, rid, created, index, delta, finish, logprobs)

Stop strings are cut from the text (`visible`), and a streamed text never
shows the start of one before it is known not to be a stop (`Held`).
"""

from __future__ import annotations

import time

from chunkwise.serving import api
from chunkwise.serving.api import Context
from chunkwise.serving.faces.openai_requests import Call
from chunkwise.serving.stream import (
  LENGTH,
  STOP_SEQUENCE,
  Token,
  TokenStream,
  finite,
)
from chunkwise.serving.text import Detokenizer, StopScanner


def reason(s: TokenStream) -> str:
  return "length" if s.finish_reason == LENGTH else "stop"


def visible(s: TokenStream) -> str:
  """The text without a matched stop string."""
  text = s.text
  if s.finish_reason == STOP_SEQUENCE and s.stop_sequence:
    text = text[: len(text) - len(s.stop_sequence)]
  return text


def usage(prompts: int, completion: int) -> dict:
  return {
    "prompt_tokens": prompts,
    "completion_tokens": completion,
    "total_tokens": prompts + completion,
  }


class CompletionLogprobs:
  """The `logprobs` object of a completion choice, built token by token
  (`text_offset` absolute in the choice's text)."""

  def __init__(self, ctx: Context, k: int, offset: int = 0):
    self.ctx, self.k, self.offset = ctx, k, offset

  def entry(self, text: str, logprob, top) -> dict:
    out = {
      "tokens": [text],
      "token_logprobs": [logprob],
      "top_logprobs": [top],
      "text_offset": [self.offset],
    }
    self.offset += len(text)
    return out

  def top(self, pairs, chosen: int, logprob: float) -> dict:
    """The alternatives by spelling (`Context.key_of`); where two share
    one, the likelier is kept."""
    out = {}
    for i, lp in pairs[: self.k]:
      out.setdefault(self.ctx.key_of(i), finite(lp))
    out.setdefault(self.ctx.key_of(chosen), finite(logprob))
    return out

  def prompt(self, ids, scores, top_ids, top_lp) -> list[dict]:
    """Entries of the prompt's tokens after BOS (echo), each scored given
    the tokens before it. BOS, which the text does not spell, has no
    entry: vLLM's null first log-prob fails the openai client's strict
    validation (`List[float]`)."""
    text = Detokenizer(self.ctx.model.vocab)
    out = []
    for i, s, ti, tl in zip(
      ids[1:], scores[1:], top_ids[1:], top_lp[1:], strict=True
    ):
      pairs = list(zip(ti.tolist(), tl.tolist(), strict=True))
      out.append(
        self.entry(text.add(int(i)), finite(s), self.top(pairs, int(i), s))
      )
    return out

  def token(self, t: Token, text: str) -> dict:
    return self.entry(text, t.logprob, self.top(list(t.top), t.id, t.logprob))


def merge(entries: list[dict]) -> dict:
  if not entries:
    return {
      "tokens": [],
      "token_logprobs": [],
      "top_logprobs": [],
      "text_offset": [],
    }
  out = {key: [] for key in entries[0]}
  for e in entries:
    for key, value in e.items():
      out[key] += value
  return out


def completion(
  call: Call, ctx: Context, streams: dict[int, TokenStream], scored: dict
) -> dict:
  """A finished /v1/completions body. `scored[p]`: prompt p's (scores,
  top_ids, top_logprobs) when echo asks for its log-probs."""
  choices, generated = [], 0
  for c in call.choices:
    s = streams.get(c.index)
    text, entries = "", []
    lp = CompletionLogprobs(ctx, call.logprobs or 0)
    if call.echo:
      text = call.texts[c.prompt_index]
      if call.logprobs is not None:
        entries += lp.prompt(
          call.prompts[c.prompt_index], *scored[c.prompt_index]
        )
    if s is not None:
      out = visible(s)
      text += out
      generated += len(s.tokens)
      if call.logprobs is not None:
        entries += completion_entries(lp, s.tokens, len(out))
    choices.append(
      {
        "index": c.index,
        "text": text,
        "finish_reason": "length" if s is None else reason(s),
        "logprobs": merge(entries) if call.logprobs is not None else None,
      }
    )
  prompt_tokens = sum(len(p) for p in call.prompts)
  return {
    "id": api.new_id("cmpl"),
    "object": "text_completion",
    "created": int(time.time()),
    "model": call.model,
    "system_fingerprint": "chunkwise",
    "choices": choices,
    "usage": usage(prompt_tokens, generated),
  }


def completion_entries(lp: CompletionLogprobs, tokens, chars: int) -> list:
  """Log-prob entries of the non-special `tokens` whose text is shown (the
  first `chars` characters of theirs; a stop string's tokens are cut)."""
  return shown_entries(lp, tokens, 0, chars, final=True)[0]


def shown_entries(lp, tokens, start: int, shown: int, final: bool):
  """(entries, tokens used, characters they spell) of `tokens`, which
  start at character `start` of a choice's text, up to character `shown`.
  A token whose text goes past `shown` waits (it is held back, or still
  being detokenized), unless `final`: then it is cut there, and tokens
  past it (a stop string's) are left out. Special tokens are used with
  no entry."""
  out, used, at = [], 0, start
  for t in tokens:
    if t.special:
      used += 1
      continue
    if at + len(t.text) > shown and not final:
      break
    if at >= shown and t.text:
      break  # the rest spells the stop string
    out.append(lp.token(t, t.text[: max(0, shown - at)]))
    used, at = used + 1, at + len(t.text)
  return out, used, at


def chat_logprobs(ctx: Context, tokens: list[Token], k: int) -> list[dict]:
  def item(i: int, text: str, logprob: float) -> dict:
    return {
      "token": text,
      "logprob": finite(logprob),
      "bytes": list(text.encode("utf-8")),
    }

  out = []
  for t in tokens:
    if t.special:
      continue
    entry = item(t.id, t.text, t.logprob)
    entry["top_logprobs"] = [item(i, ctx.text_of(i), lp) for i, lp in t.top[:k]]
    if t.forced is not None:  # chunkwise's own: the constraint chose it
      entry["forced"] = t.forced
    out.append(entry)
  return out


def chat_reason(call: Call, s: TokenStream, called: bool) -> str:
  """OpenAI's finish_reason of a chat choice: "tool_calls" when it made
  calls ("stop" for a named tool_choice), unless the budget decided."""
  if not called or s.finish_reason == LENGTH:
    return reason(s)
  return "stop" if call.tools.named else "tool_calls"


def chat_message(call: Call, s: TokenStream) -> tuple[dict, bool]:
  """(The choice's message, whether it made tool calls)."""
  # `refusal` is required (nullable) in OpenAI's schema of both
  message = {"role": "assistant", "content": visible(s), "refusal": None}
  if call.tools is None:
    return message, False
  content, calls = call.tools.read(message["content"])
  message["content"] = content
  if calls:
    message["tool_calls"] = [c.wire() for c in calls]
  return message, bool(calls)


def chat(call: Call, ctx: Context, streams: dict[int, TokenStream]) -> dict:
  choices, generated = [], 0
  for c in call.choices:
    s = streams[c.index]
    generated += len(s.tokens)
    message, called = chat_message(call, s)
    choices.append(
      {
        "index": c.index,
        "message": message,
        "logprobs": None
        if call.logprobs is None
        else {
          "content": chat_logprobs(ctx, s.tokens, call.logprobs),
          "refusal": None,
        },
        "finish_reason": chat_reason(call, s, called),
      }
    )
  return {
    "id": api.new_id("chatcmpl"),
    "object": "chat.completion",
    "created": int(time.time()),
    "model": call.model,
    "system_fingerprint": "chunkwise",
    "choices": choices,
    "usage": usage(len(call.prompts[0]), generated),
  }


class Held:
  """A streamed choice's text, holding back what may start a stop string:
  each character read once, as it arrives (`TokenStream.text_after`, a
  `StopScanner`), so a chunk costs what it adds, whatever the text's
  length and the stop strings'."""

  def __init__(self, stops):
    self.stops = StopScanner(stops)
    self.sent = 0  # characters sent
    self._read = 0  # characters read
    self._pieces = 0  # the stream's pieces read
    self._pending = ""  # read, not sent: what may start a stop string
    self._stopped = False  # a stop string was read: nothing after it

  def delta(self, s: TokenStream, final: bool) -> str:
    new, self._pieces = s.text_after(self._pieces)
    self._read += len(new)
    if not self._stopped:  # the engine may have matched one already
      found = self.stops.feed(new)
      if found is not None:
        new = new[: max(0, found[0] - (self.stops.length - len(new)))]
        self._stopped = True
      self._pending += new
    upto = len(self._pending)
    if final:  # all but the stop string the engine ended on
      if s.finish_reason == STOP_SEQUENCE and s.stop_sequence:
        shown = self._read - len(s.stop_sequence)
        upto = max(0, min(upto, shown - self.sent))
    elif not self._stopped:
      upto -= min(self.stops.held, upto)
    out, self._pending = self._pending[:upto], self._pending[upto:]
    self.sent += len(out)
    return out


def completion_chunk(
  call: Call, rid: str, created: int, index: int, text: str, finish, logprobs
) -> dict:
  return {
    "id": rid,
    "object": "text_completion",
    "created": created,
    "model": call.model,
    "system_fingerprint": "chunkwise",
    "choices": [
      {
        "index": index,
        "text": text,
        "finish_reason": finish,
        "logprobs": logprobs,
      }
    ],
  }


def chat_chunk(
  call: Call, rid: str, created: int, index: int, delta: dict, finish, logprobs
) -> dict:
  return {
    "id": rid,
    "object": "chat.completion.chunk",
    "created": created,
    "model": call.model,
    "system_fingerprint": "chunkwise",
    "choices": [
      {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish,
      }
    ],
  }


def usage_chunk(call: Call, rid: str, created: int, obj: str, generated: int):
  return {
    "id": rid,
    "object": obj,
    "created": created,
    "model": call.model,
    "system_fingerprint": "chunkwise",
    "choices": [],
    "usage": usage(
      sum(len(p) for p in call.prompts)
      if obj == "text_completion"
      else len(call.prompts[0]),
      generated,
    ),
  }


def model_card(ctx: Context, name: str) -> dict:
  card = {
    "id": name,
    "object": "model",
    "created": ctx.created,
    "owned_by": "chunkwise",
    "root": ctx.model_id,
    "parent": None if name == ctx.model_id else ctx.model_id,
    "max_model_len": ctx.max_total_tokens,
  }
  return card


def models(ctx: Context) -> dict:
  return {
    "object": "list",
    "data": [model_card(ctx, n) for n in (ctx.model_id, *ctx.adapters)],
  }
