"""The OpenAI wire format (../shared/SERVING.md §3-6).

  POST /v1/completions        prompt(s), n, logprobs, echo (max_tokens 0 +
                              echo scores a prompt), stream
  POST /v1/chat/completions   messages through the model's chat template,
                              logprobs / top_logprobs, response_format
  GET  /v1/models[/{id}]      the base model, then one card per adapter

`model` is the base model's id or a served adapter's name (404 otherwise).
`parse_completion` / `parse_chat` turn a body into `Choice`s (one
`Generation` each: prompt index x n); `completion` / `chat` write finished
streams; `CompletionChunks` / `ChatChunks` write running ones. Stop
strings are cut from the text, and a streamed text never shows the start
of one before it is known not to be a stop (`StopStrings.safe`).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict

from chunkwise.serving import api
from chunkwise.serving.api import ApiError, Context
from chunkwise.serving.stream import (
  LENGTH,
  STOP_SEQUENCE,
  Generation,
  Token,
  TokenStream,
  finite,
)
from chunkwise.serving.text import Detokenizer, StopStrings

MAX_LOGPROBS = 20


class _Common(BaseModel):
  model_config = ConfigDict(extra="ignore")

  model: str
  n: int | None = None
  temperature: float | None = None
  top_p: float | None = None
  stream: bool | None = None
  stream_options: dict | None = None
  stop: str | list[str] | None = None
  seed: int | None = None
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  logit_bias: dict | None = None
  user: str | None = None
  # vLLM / LoRAX extensions (extra_body)
  top_k: int | None = None
  min_p: float | None = None
  repetition_penalty: float | None = None
  ignore_eos: bool | None = None
  response_format: dict | None = None
  structured_outputs: dict | None = None
  guided_json: Any = None
  guided_regex: str | None = None
  guided_choice: list[str] | None = None
  adapter_source: str | None = None


class CompletionBody(_Common):
  prompt: str | list[str]
  max_tokens: int | None = 16
  best_of: int | None = None
  logprobs: int | None = None
  echo: bool | None = None
  suffix: str | None = None
  prompt_logprobs: int | None = None


class ChatBody(_Common):
  messages: list[dict]
  max_tokens: int | None = None
  max_completion_tokens: int | None = None
  logprobs: bool | None = None
  top_logprobs: int | None = None
  tools: list | None = None
  tool_choice: Any = None


@dataclasses.dataclass(frozen=True)
class Choice:
  index: int
  generation: Generation | None  # None: score the prompt only (max_tokens 0)
  prompt_index: int


@dataclasses.dataclass(frozen=True)
class Call:
  """A parsed request: its choices and what shapes the response."""

  model: str
  choices: list[Choice]
  prompts: list[list[int]]
  texts: list[str]
  stream: bool
  include_usage: bool
  logprobs: int | None  # completions: top-k per token; chat: top_logprobs
  adapter: str | None = None
  echo: bool = False


def _validate(model: type[BaseModel], raw: Any) -> BaseModel:
  try:
    return model.model_validate(raw)
  except pydantic.ValidationError as e:
    raise ApiError(400, api.pydantic_message(e)) from None


def _bad(message: str) -> ApiError:
  return ApiError(400, message)


def _sampling(b: _Common, ctx: Context) -> dict:
  """Generation fields every OpenAI route shares."""
  if b.n is not None and not 1 <= b.n <= ctx.max_n:
    raise _bad(f"n must be between 1 and {ctx.max_n}, got {b.n}")
  if b.temperature is not None and not 0 <= b.temperature <= 2:
    raise _bad(f"temperature must be in [0, 2], got {b.temperature}")
  if b.top_p is not None and not 0 < b.top_p <= 1:
    raise _bad(f"top_p must be in (0, 1], got {b.top_p}")
  if b.top_k is not None and b.top_k < -1:
    raise _bad(f"top_k must be -1 (off) or >= 0, got {b.top_k}")
  if b.min_p is not None and not 0 <= b.min_p <= 1:
    raise _bad(f"min_p must be in [0, 1], got {b.min_p}")
  if b.seed is not None and not 0 <= b.seed < 2**32:
    raise _bad(f"seed must be in [0, 2**32), got {b.seed}")
  if b.repetition_penalty is not None and b.repetition_penalty <= 0:
    raise _bad(f"repetition_penalty must be > 0, got {b.repetition_penalty}")
  for name in ("presence_penalty", "frequency_penalty"):
    value = getattr(b, name)
    if value is not None and not -2 <= value <= 2:
      raise _bad(f"{name} must be in [-2, 2], got {value}")
  if b.logit_bias:
    raise _bad("logit_bias is not supported by this server")
  if b.ignore_eos:
    raise _bad("ignore_eos is not supported by this server")
  stops = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
  stops = ctx.check_stops(stops, 400)
  return dict(
    temperature=1.0 if b.temperature is None else b.temperature,
    top_p=1.0 if b.top_p is None else b.top_p,
    top_k=max(0, b.top_k or 0),
    min_p=b.min_p or 0.0,
    seed=b.seed,
    stop=stops,
    repetition_penalty=b.repetition_penalty or 1.0,
    presence_penalty=b.presence_penalty or 0.0,
    frequency_penalty=b.frequency_penalty or 0.0,
    constraint=_constraint(b),
  )


def _constraint(b: _Common):
  given = [
    name
    for name in (
      "response_format",
      "structured_outputs",
      "guided_json",
      "guided_regex",
      "guided_choice",
    )
    if getattr(b, name) is not None
  ]
  f = b.response_format
  if f is not None and f.get("type") == "text":
    given.remove("response_format")
  if len(given) > 1:
    raise _bad(f"give one of {', '.join(given)}, not several")
  try:
    if "response_format" in given:
      kind = f.get("type")
      if kind == "json_object":
        return api.json_constraint(f.get("schema"), "response_format")
      if kind == "json_schema":
        spec = f.get("json_schema") or {}
        if not isinstance(spec, dict) or "schema" not in spec:
          raise _bad("response_format.json_schema must hold a 'schema'")
        return api.json_constraint(
          spec["schema"], "response_format.json_schema.schema"
        )
      raise _bad(
        "response_format.type must be 'text', 'json_object' or "
        f"'json_schema', got {kind!r}"
      )
    if "structured_outputs" in given:
      so = b.structured_outputs
      kinds = [k for k in ("json", "regex", "choice", "grammar") if k in so]
      if len(kinds) != 1:
        raise _bad(
          "structured_outputs must hold one of 'json', 'regex', 'choice'"
        )
      return _guided(kinds[0], so[kinds[0]], f"structured_outputs.{kinds[0]}")
    if "guided_json" in given:
      return _guided("json", b.guided_json, "guided_json")
    if "guided_regex" in given:
      return _guided("regex", b.guided_regex, "guided_regex")
    if "guided_choice" in given:
      return _guided("choice", b.guided_choice, "guided_choice")
  except ApiError as e:
    raise _bad(e.message) from None
  return None


def _guided(kind: str, value, where: str):
  if kind == "json":
    return api.json_constraint(value, where)
  if kind == "regex":
    return api.regex_constraint(value, where)
  if kind == "choice":
    return api.choice_constraint(value, where)
  raise _bad(f"{where}: grammars are not supported by this server")


def parse_completion(raw: Any, ctx: Context) -> Call:
  b = _validate(CompletionBody, raw)
  adapter = ctx.adapter(b.model, status=404)
  if b.suffix:
    raise _bad("suffix is not supported by this server")
  if b.best_of is not None and b.best_of != (b.n or 1):
    raise _bad("best_of other than n is not supported by this server")
  if b.logprobs is not None and not 0 <= b.logprobs <= MAX_LOGPROBS:
    raise _bad(
      f"logprobs must be between 0 and {MAX_LOGPROBS}, got {b.logprobs}"
    )
  if b.logprobs:
    ctx.top_n(b.logprobs, "logprobs", 400)
  texts = [b.prompt] if isinstance(b.prompt, str) else list(b.prompt)
  if not texts or any(not isinstance(t, str) or not t for t in texts):
    raise _bad("prompt must be a non-empty string or list of them")
  shared = _sampling(b, ctx)
  n = b.n or 1
  if b.max_tokens is not None and b.max_tokens < 0:
    raise _bad(f"max_tokens must be >= 0, got {b.max_tokens}")
  if b.max_tokens == 0 and not b.echo:
    raise _bad("max_tokens=0 needs echo=true (it scores the prompt)")
  if b.max_tokens == 0 and b.stream:
    raise _bad("max_tokens=0 (scoring) cannot stream")
  prompts = [ctx.encode(t, status=400) for t in texts]
  choices = []
  for p, ids in enumerate(prompts):
    for j in range(n):
      g = None
      if b.max_tokens != 0:
        g = Generation(
          prompt=ids,
          max_new_tokens=ctx.new_tokens(len(ids), b.max_tokens, 400),
          sample_id=j,
          adapter=adapter,
          top_n=b.logprobs or 0,
          **shared,
        )
      choices.append(Choice(p * n + j, g, p))
  return Call(
    model=b.model,
    choices=choices,
    prompts=prompts,
    texts=texts,
    stream=bool(b.stream),
    include_usage=bool((b.stream_options or {}).get("include_usage")),
    logprobs=b.logprobs,
    adapter=adapter,
    echo=bool(b.echo),
  )


def _content(message: dict, i: int) -> dict:
  """A message with its content as one string."""
  if not isinstance(message, dict) or "role" not in message:
    raise _bad(f"messages[{i}] must be an object with a 'role'")
  content = message.get("content")
  if isinstance(content, list):
    parts = []
    for k, part in enumerate(content):
      if not isinstance(part, dict) or part.get("type") != "text":
        raise _bad(
          f"messages[{i}].content[{k}]: only text parts are supported, got "
          f"{part!r:.80}"
        )
      parts.append(str(part.get("text", "")))
    content = "".join(parts)
  if content is not None and not isinstance(content, str):
    raise _bad(f"messages[{i}].content must be a string or a list of parts")
  return {**message, "content": content or ""}


def chat_prompt(ctx: Context, messages: list[dict]) -> list[int]:
  """The chat template's text for `messages`, tokenized (BOS first)."""
  vocab = ctx.model.vocab
  if not messages:
    raise _bad("messages must not be empty")
  if getattr(vocab, "chat_template", None) is None:
    raise _bad("this model has no chat template: use /v1/completions")
  messages = [_content(m, i) for i, m in enumerate(messages)]
  try:
    text = vocab.apply_chat_template(messages, add_generation_prompt=True)
  except ValueError as e:
    raise _bad(f"the chat template failed: {e}") from None
  ids = vocab.encode(text)
  if not ids or ids[0] != ctx.model.bos_id:
    ids = [ctx.model.bos_id, *ids]
  if len(ids) > ctx.max_input_tokens:
    raise _bad(
      f"the conversation has {len(ids)} tokens, over this server's "
      f"max_input_tokens={ctx.max_input_tokens}"
    )
  return ids


def parse_chat(raw: Any, ctx: Context) -> Call:
  b = _validate(ChatBody, raw)
  adapter = ctx.adapter(b.model, status=404)
  if b.tools or b.tool_choice not in (None, "none"):
    raise _bad("tools are not supported by this server")
  if b.top_logprobs is not None:
    if not b.logprobs:
      raise _bad("top_logprobs requires logprobs=true")
    if not 0 <= b.top_logprobs <= MAX_LOGPROBS:
      raise _bad(
        f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got "
        f"{b.top_logprobs}"
      )
    ctx.top_n(b.top_logprobs, "top_logprobs", 400)
  shared = _sampling(b, ctx)
  ids = chat_prompt(ctx, b.messages)
  asked = b.max_completion_tokens or b.max_tokens
  n = b.n or 1
  top = (b.top_logprobs or 0) if b.logprobs else 0
  choices = [
    Choice(
      j,
      Generation(
        prompt=ids,
        max_new_tokens=ctx.new_tokens(len(ids), asked, 400),
        sample_id=j,
        adapter=adapter,
        top_n=top,
        **shared,
      ),
      0,
    )
    for j in range(n)
  ]
  return Call(
    model=b.model,
    choices=choices,
    prompts=[ids],
    texts=[""],
    stream=bool(b.stream),
    include_usage=bool((b.stream_options or {}).get("include_usage")),
    logprobs=top if b.logprobs else None,
    adapter=adapter,
  )


# -- responses ----------------------------------------------------------------


def new_id(prefix: str) -> str:
  return f"{prefix}-{secrets.token_hex(12)}"


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
    out = {self.ctx.text_of(i): finite(lp) for i, lp in pairs[: self.k]}
    out.setdefault(self.ctx.text_of(chosen), finite(logprob))
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


def merge(entries: list[dict]) -> dict | None:
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
        entries += _generated_entries(lp, s, len(out))
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
    "id": new_id("cmpl"),
    "object": "text_completion",
    "created": int(time.time()),
    "model": call.model,
    "system_fingerprint": "chunkwise",
    "choices": choices,
    "usage": usage(prompt_tokens, generated),
  }


def _generated_entries(lp: CompletionLogprobs, s: TokenStream, chars: int):
  """Log-prob entries of the non-special tokens whose text is shown (the
  first `chars` characters; a stop string's tokens are cut)."""
  out, shown = [], 0
  for t in s.tokens:
    if t.special:
      continue
    if shown >= chars and t.text:
      break  # the rest spells the stop string
    text = t.text[: max(0, chars - shown)]
    shown += len(t.text)
    out.append(lp.token(t, text))
  return out


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
    out.append(entry)
  return out


def chat(call: Call, ctx: Context, streams: dict[int, TokenStream]) -> dict:
  choices, generated = [], 0
  for c in call.choices:
    s = streams[c.index]
    generated += len(s.tokens)
    choices.append(
      {
        "index": c.index,
        "message": {"role": "assistant", "content": visible(s)},
        "logprobs": None
        if call.logprobs is None
        else {"content": chat_logprobs(ctx, s.tokens, call.logprobs)},
        "finish_reason": reason(s),
      }
    )
  return {
    "id": new_id("chatcmpl"),
    "object": "chat.completion",
    "created": int(time.time()),
    "model": call.model,
    "system_fingerprint": "chunkwise",
    "choices": choices,
    "usage": usage(len(call.prompts[0]), generated),
  }


class Held:
  """A streamed choice's text, holding back what may start a stop string."""

  def __init__(self, stops):
    self.stops = StopStrings(stops)
    self.sent = 0

  def delta(self, s: TokenStream, final: bool) -> str:
    text = visible(s) if final else s.text
    if not final:  # the engine may have matched a stop string already
      found = self.stops.find(text, len(text))
      text = text if found is None else text[: found[0]]
    upto = len(text) if final else self.stops.safe(text)
    if upto <= self.sent:
      return ""
    out, self.sent = text[self.sent : upto], upto
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
