"""OpenAI requests (../shared/SERVING.md §3-4): bodies parsed into
`Choice`s, one `Generation` each (prompt index x n).

  call = parse_completion(body, ctx)   # /v1/completions
  call = parse_chat(body, ctx)         # /v1/chat/completions

`model` is the base model's id or a served adapter's name (404
otherwise); every other refusal is a 400 naming the field. Chat messages
go through the model's chat template (sandboxed). `response_format`,
vLLM's `structured_outputs` and the older `guided_*` become constraints.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict

from chunkwise import constraints
from chunkwise.serving import api, tools
from chunkwise.serving.api import ApiError, Context
from chunkwise.serving.stream import (
  Generation,
)

MAX_LOGPROBS = 20


def _penalty() -> Any:
  return api.documented(minimum=-2, maximum=2)


class _Common(BaseModel):
  # unknown fields are kept to be refused by name (`_check_extra`), never
  # silently ignored
  model_config = ConfigDict(extra="allow")

  model: str
  n: int | None = api.documented(minimum=1)
  temperature: float | None = api.documented(minimum=0, maximum=2)
  top_p: float | None = api.documented(exclusiveMinimum=0, maximum=1)
  stream: bool | None = None
  stream_options: dict | None = None
  stop: str | list[str] | None = api.documented(
    minLength=1, items={"minLength": 1}
  )
  seed: int | None = api.documented(minimum=0, maximum=2**32 - 1)
  presence_penalty: float | None = _penalty()
  frequency_penalty: float | None = _penalty()
  logit_bias: dict | None = None
  user: str | None = None
  # vLLM / LoRAX extensions (extra_body)
  top_k: int | None = api.documented(minimum=-1)
  min_p: float | None = api.documented(minimum=0, maximum=1)
  repetition_penalty: float | None = api.documented(exclusiveMinimum=0)
  ignore_eos: bool | None = None
  response_format: dict | None = None
  structured_outputs: dict | None = None
  guided_json: Any = None
  guided_regex: str | None = None
  guided_choice: list[str] | None = None
  guided_whitespace_pattern: str | None = None
  adapter_source: str | None = None
  stop_token_ids: list[int] | None = None


class CompletionBody(_Common):
  prompt: str | list[str] = api.documented(
    ..., minLength=1, minItems=1, items={"minLength": 1}, examples=["Hello"]
  )
  max_tokens: int | None = api.documented(16, minimum=0)
  best_of: int | None = None
  logprobs: int | None = api.documented(minimum=0, maximum=MAX_LOGPROBS)
  echo: bool | None = None
  suffix: str | None = None
  prompt_logprobs: int | None = None


class ChatBody(_Common):
  messages: list[dict] = api.documented(
    ..., minItems=1, examples=[[{"role": "user", "content": "Hello"}]]
  )
  max_tokens: int | None = api.documented(minimum=1)
  max_completion_tokens: int | None = api.documented(minimum=1)
  logprobs: bool | None = None
  top_logprobs: int | None = api.documented(minimum=0, maximum=MAX_LOGPROBS)
  tools: list | None = None
  tool_choice: Any = None
  parallel_tool_calls: Any = None


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
  tools: Any = None  # chat: a `tools.Plan`, or None


def _validate(model: type[BaseModel], raw: Any) -> BaseModel:
  try:
    return model.model_validate(raw)
  except pydantic.ValidationError as e:
    raise ApiError(400, api.pydantic_message(e)) from None


_bad = api.bad_request


# Fields clients send that change nothing here (with these values):
# OpenAI's bookkeeping, and TGI's client's `do_sample: false` (its
# default; sampling follows `temperature`).
_HARMLESS = {
  "metadata": None,
  "service_tier": None,
  "safety_identifier": None,
  "prompt_cache_key": None,
  "store": False,
  "do_sample": False,
}


def check_extra(b: BaseModel, harmless: dict = _HARMLESS) -> None:
  """A 400 naming the first field of `b` this server does not know (or
  knows and does not do), unless it is null or `harmless`: a name with
  the one value that changes nothing here, or with None (any value: the
  face checks it). Every face's unknown-field policy (docs/serving.md)."""
  for name, value in (b.model_extra or {}).items():
    if value is None:  # (clients send unset fields as null)
      continue
    if name not in harmless:
      raise _bad(f"{name} is not supported by this server")
    if harmless[name] not in (None, value):
      raise _bad(f"{name}={value!r:.40} is not supported by this server")


def _sampling(b: _Common, ctx: Context) -> dict:
  """Generation fields every OpenAI route shares."""
  check_extra(b)
  if b.n is not None and not 1 <= b.n <= ctx.max_n:
    raise _bad(f"n must be between 1 and {ctx.max_n} (--max_n), got {b.n}")
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
  stop_ids = list(b.stop_token_ids or [])
  vocab_size = ctx.model.hparams.vocab
  for t in stop_ids:
    if not 0 <= t < vocab_size:
      raise _bad(f"stop_token_ids: {t} is not a token id (0..{vocab_size - 1})")
  if len(stop_ids) > ctx.max_stop_sequences:
    raise _bad(
      f"{len(stop_ids)} stop_token_ids, over this server's "
      f"--max_stop_sequences={ctx.max_stop_sequences}"
    )
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
    stop_ids=stop_ids,
  )


# vLLM's whitespace patterns (`guided_whitespace_pattern`,
# `structured_outputs.whitespace_pattern`) this server takes, as
# `JsonSchema(whitespace=...)`: none ("" : compact JSON, whose keys and
# separators are forced runs) or outlines-core's default (at most one
# space). Any other pattern is refused (unbounded whitespace runs away).
WHITESPACE_PATTERNS = {"": "compact", "[ ]?": "flexible"}


def _whitespace(b: _Common) -> tuple[str, str | None]:
  """(`JsonSchema`'s whitespace, the field that set it or None)."""
  given = [("guided_whitespace_pattern", b.guided_whitespace_pattern)]
  so = b.structured_outputs
  if isinstance(so, dict) and so.get("whitespace_pattern") is not None:
    given.append(
      ("structured_outputs.whitespace_pattern", so["whitespace_pattern"])
    )
  given = [(w, v) for w, v in given if v is not None]
  if not given:
    return "flexible", None
  where, value = given[0]
  if value not in WHITESPACE_PATTERNS:
    raise _bad(
      f"{where}={value!r}: this server takes '' (compact JSON) or "
      f"'[ ]?' (the default: at most one space)"
    )
  return WHITESPACE_PATTERNS[value], where


def _constraint(b: _Common):
  out = _constraint_of(b)
  whitespace, where = _whitespace(b)
  if where is None:
    return out
  if not isinstance(out, constraints.JsonSchema):
    raise _bad(
      f"{where} applies to a JSON schema (response_format, guided_json)"
    )
  return out.with_whitespace(whitespace)


def _constraint_of(b: _Common):
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


def _schemas(b: _Common) -> list:
  """The request's constraint fields (what `check_sizes` weighs)."""
  return [
    b.response_format,
    b.structured_outputs,
    b.guided_json,
    b.guided_regex,
    b.guided_choice,
  ]


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
  ctx.check_sizes(400, prompts=len(texts), n=b.n or 1, schemas=_schemas(b))
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


def _render(vocab, messages, tools) -> str:
  try:
    return vocab.apply_chat_template(
      messages, add_generation_prompt=True, tools=tools
    )
  except ValueError as e:
    raise _bad(f"the chat template failed: {e}") from None


def _chat_ids(vocab, messages: list[dict], tools) -> list[int]:
  """The rendered conversation's ids, where a control token comes only
  from the template, never from a message's content: content that spells
  one ("hi<|im_end|>\n<|im_start|>system") is tokenized as text. Such
  content is rare, so only then is the template rendered with a marker
  in each content's place, and the text between markers (the template's)
  and each content (as text, `encode_text`) tokenized apart; otherwise
  the whole text is tokenized at once, as the model's own tokenizer
  would."""
  controls = getattr(vocab, "control_texts", tuple)()
  forged = controls and any(
    c in m["content"] for m in messages for c in controls if m["content"]
  )
  if not forged:
    return vocab.encode(_render(vocab, messages, tools))
  nonce = secrets.token_hex(8)
  marks, marked = {}, []
  for i, m in enumerate(messages):
    if m["content"]:
      mark = f"\ue000{nonce}.{i}\ue001"
      marks[mark] = m["content"]
      m = {**m, "content": mark}
    marked.append(m)
  rendered = _render(vocab, marked, tools)
  ids = []
  for piece in re.split(f"(\ue000{nonce}\\.\\d+\ue001)", rendered):
    if piece in marks:
      ids += vocab.encode_text(marks[piece])
    elif piece:
      ids += vocab.encode(piece)
  return ids


def chat_prompt(
  ctx: Context, messages: list[dict], tools: list[dict] | None = None
) -> list[int]:
  """The chat template's text for `messages` (and `tools`, for a template
  that renders them), tokenized (BOS first)."""
  vocab = ctx.chat_vocab
  if not messages:
    raise _bad("messages must not be empty")
  if getattr(vocab, "chat_template", None) is None:
    raise _bad("this model has no chat template: use /v1/completions")
  messages = [_content(m, i) for i, m in enumerate(messages)]
  ids = _chat_ids(vocab, messages, tools)
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
  ctx.check_sizes(
    400,
    n=b.n or 1,
    messages=len(b.messages),
    tools=len(b.tools or ()),
    schemas=[*_schemas(b), b.tools],
  )
  plan = tools.parse(b.tools, b.tool_choice, b.parallel_tool_calls)
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
  messages, specs = b.messages, None
  if plan is not None:
    plan = plan.written(ctx.tool_format)
    specs = plan.specs() if plan.fmt.native else None
    if shared["stop"]:
      raise _bad("stop strings with tools are not supported by this server")
    # text parts joined first (their indices as the client sent them)
    messages = [_content(m, i) for i, m in enumerate(messages)]
    try:
      messages = plan.messages(messages)
    except ValueError as e:
      raise _bad(f"messages: {e}") from None
    shared["constraint"] = plan.constraint(shared["constraint"])
  ids = chat_prompt(ctx, messages, specs)
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
    tools=plan,
  )
