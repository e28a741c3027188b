"""The TGI / LoRAX wire format (../shared/SERVING.md §1-2).

  POST /                  {"inputs", "parameters", "stream"}: a one-element
                          array, or an SSE stream when "stream" is true
  POST /generate          the bare object
  POST /generate_stream   SSE: one event per token, no end marker

`parse` turns a body into a `Generation` (refusing what this server does
not do with a 422 that names the field); `response` and `events` write a
finished stream and a running one in the clients' shapes.
"""

from __future__ import annotations

from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict

from chunkwise.serving import api
from chunkwise.serving.api import ApiError, Context
from chunkwise.serving.stream import Generation, Token, TokenStream, finite


class Parameters(BaseModel):
  model_config = ConfigDict(extra="ignore")

  adapter_id: str | None = None
  adapter_source: str | None = api.documented(
    enum=["local", "hub", "s3", "pbase", None]
  )
  merged_adapters: dict | None = None
  api_token: str | None = None
  do_sample: bool | None = None
  max_new_tokens: int | None = api.documented(minimum=1)
  ignore_eos_token: bool | None = None
  repetition_penalty: float | None = api.documented(exclusiveMinimum=0)
  frequency_penalty: float | None = api.documented(exclusiveMinimum=0)
  return_full_text: bool | None = None
  stop: list[str] | None = api.documented(items={"minLength": 1})
  seed: int | None = api.documented(minimum=0, maximum=2**32 - 1)
  temperature: float | None = api.documented(minimum=0)
  top_k: int | None = api.documented(exclusiveMinimum=0)
  top_p: float | None = api.documented(exclusiveMinimum=0, exclusiveMaximum=1)
  typical_p: float | None = None
  truncate: int | None = api.documented(exclusiveMinimum=0)
  best_of: int | None = api.documented(maximum=1)
  watermark: bool | None = None
  details: bool | None = None
  decoder_input_details: bool | None = None
  return_k_alternatives: int | None = api.documented(minimum=0)
  top_n_tokens: int | None = api.documented(minimum=0)
  response_format: dict | None = None
  grammar: dict | None = None
  # chunkwise's extension: which sample of (inputs, seed) this is (the RNG
  # contract's sample id; batch jobs number their samples so)
  sample_id: int | None = api.documented(minimum=0, maximum=2**31 - 1)


class Body(BaseModel):
  model_config = ConfigDict(extra="ignore")

  inputs: str = api.documented(..., minLength=1, examples=["Hello"])
  parameters: Parameters | None = None
  stream: bool | None = None


class Options(BaseModel):
  """What shapes the response (not the generation)."""

  details: bool = True
  decoder_input_details: bool = False
  return_full_text: bool = False
  alternatives: int = 0  # LoRAX return_k_alternatives
  top_n_tokens: int = 0  # TGI
  stream: bool = False


def _positive(name: str, value, *, below_one: bool = False) -> None:
  if value is None:
    return
  if value <= 0 or (below_one and value >= 1):
    rule = "in (0, 1)" if below_one else "> 0"
    raise ApiError(422, f"`{name}` must be {rule}, got {value}")


def parse(
  raw: Any, ctx: Context, *, stream: bool | None = None
) -> tuple[str, Generation, Options]:
  """(inputs, Generation, Options) of a native body; `stream` overrides
  the body's flag (the /generate and /generate_stream routes)."""
  try:
    body = Body.model_validate(raw)
  except pydantic.ValidationError as e:
    raise ApiError(422, api.pydantic_message(e)) from None
  p = body.parameters or Parameters()
  streaming = bool(body.stream) if stream is None else stream
  if not body.inputs:
    raise ApiError(422, "`inputs` cannot be empty")
  if p.merged_adapters is not None:
    raise ApiError(422, "`merged_adapters` is not supported by this server")
  if p.adapter_source not in (None, "local", "hub", "s3", "pbase"):
    raise ApiError(422, f"unknown adapter_source {p.adapter_source!r}")
  if p.ignore_eos_token:
    raise ApiError(422, "`ignore_eos_token` is not supported by this server")
  if p.watermark:
    raise ApiError(422, "`watermark` is not supported by this server")
  if p.best_of is not None and p.best_of > 1:
    if streaming:
      raise ApiError(422, "`best_of` != 1 is not supported when streaming")
    raise ApiError(422, "`best_of` > 1 is not supported by this server")
  if p.decoder_input_details and streaming:
    raise ApiError(
      422, "`decoder_input_details` == true is not supported when streaming"
    )
  _positive("repetition_penalty", p.repetition_penalty)
  _positive("frequency_penalty", p.frequency_penalty)
  _positive("top_k", p.top_k)
  _positive("top_p", p.top_p, below_one=True)
  _positive("typical_p", p.typical_p, below_one=True)
  _positive("truncate", p.truncate)
  if p.typical_p is not None:
    raise ApiError(422, "`typical_p` is not supported by this server")
  if p.temperature is not None and p.temperature < 0:
    raise ApiError(422, f"`temperature` must be >= 0, got {p.temperature}")
  if p.seed is not None and not 0 <= p.seed < 2**32:
    raise ApiError(422, f"`seed` must be in [0, 2**32), got {p.seed}")
  if p.sample_id is not None and not 0 <= p.sample_id < 2**31:
    raise ApiError(422, f"`sample_id` must be in [0, 2**31), got {p.sample_id}")
  sample = bool(p.do_sample) or (
    (p.temperature is not None and p.temperature != 1.0)
    or bool(p.top_k)
    or (p.top_p is not None and p.top_p < 1.0)
  )
  temperature = 1.0 if p.temperature is None else p.temperature
  if not sample:
    temperature = 0.0
  ctx.check_sizes(422, schemas=[p.response_format, p.grammar])
  adapter = ctx.adapter(p.adapter_id)
  prompt = ctx.encode(body.inputs, truncate=p.truncate)
  constraint = _constraint(p)
  alternatives = p.return_k_alternatives or 0
  if alternatives < 0:
    raise ApiError(
      422, f"`return_k_alternatives` must be > 0, got {alternatives}"
    )
  top_n = max(
    ctx.top_n(alternatives, "return_k_alternatives"),
    ctx.top_n(p.top_n_tokens, "top_n_tokens"),
  )
  g = Generation(
    prompt=prompt,
    max_new_tokens=ctx.new_tokens(len(prompt), p.max_new_tokens),
    temperature=temperature,
    top_k=p.top_k or 0,
    top_p=p.top_p or 1.0,
    seed=p.seed,
    sample_id=p.sample_id or 0,
    stop=ctx.check_stops(p.stop),
    adapter=adapter,
    constraint=constraint,
    repetition_penalty=p.repetition_penalty or 1.0,
    frequency_penalty=p.frequency_penalty or 0.0,
    top_n=top_n,
  )
  options = Options(
    details=True if p.details is None else p.details,
    decoder_input_details=bool(p.decoder_input_details),
    return_full_text=bool(p.return_full_text),
    alternatives=alternatives,
    top_n_tokens=p.top_n_tokens or 0,
    stream=streaming,
  )
  return body.inputs, g, options


def _constraint(p: Parameters):
  if p.response_format is not None and p.grammar is not None:
    raise ApiError(422, "give `response_format` or `grammar`, not both")
  if p.response_format is not None:
    f = p.response_format
    kind = f.get("type")
    if kind not in ("json_object", "json_schema"):
      raise ApiError(
        422,
        f"response_format.type must be 'json_object' or 'json_schema', got "
        f"{kind!r}",
      )
    schema = f.get("schema", f.get("json_schema"))
    if (
      isinstance(schema, dict) and "schema" in schema and kind == "json_schema"
    ):
      schema = schema["schema"]  # the OpenAI-style {"name", "schema"} form
    return api.json_constraint(schema, "response_format.schema")
  if p.grammar is not None:
    kind, value = p.grammar.get("type"), p.grammar.get("value")
    if kind in ("json", "json_object", "json_schema"):
      return api.json_constraint(value, "grammar.value")
    if kind == "regex":
      return api.regex_constraint(value, "grammar.value")
    raise ApiError(
      422,
      f"grammar.type must be 'json', 'json_object', 'json_schema' or "
      f"'regex', got {kind!r}",
    )
  return None


def token(t: Token, options: Options, ctx: Context) -> dict:
  """A generated token in the clients' shape."""
  out = {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}
  if t.forced is not None:  # chunkwise's own: the constraint chose it
    out["forced"] = t.forced
  if options.alternatives:
    out["alternative_tokens"] = [
      {"id": i, "text": ctx.text_of(i), "logprob": lp}
      for i, lp in t.top[: options.alternatives]
    ]
  return out


def top_tokens(t: Token, options: Options, ctx: Context) -> list[dict]:
  return [
    {
      "id": i,
      "text": ctx.text_of(i),
      "logprob": lp,
      "special": ctx.is_special(i),
    }
    for i, lp in t.top[: options.top_n_tokens]
  ]


def prefill(ids, scores, ctx: Context) -> list[dict]:
  """The prompt's tokens with their log-probs (the first: null)."""
  return [
    {
      "id": int(i),
      "text": ctx.text_of(int(i)),
      "logprob": None if k == 0 else finite(s),
    }
    for k, (i, s) in enumerate(zip(ids, scores, strict=True))
  ]


def response(
  inputs: str,
  s: TokenStream,
  options: Options,
  ctx: Context,
  prompt_details=None,
) -> dict:
  """A finished request's body (`/generate`; `POST /` wraps it in a list)."""
  text = (inputs if options.return_full_text else "") + s.text
  out: dict[str, Any] = {"generated_text": text}
  if options.details:
    details = {
      "finish_reason": s.finish_reason,
      "prompt_tokens": s.prompt_tokens,
      "generated_tokens": len(s.tokens),
      "seed": s.seed,
      "prefill": prompt_details or [],
      "tokens": [token(t, options, ctx) for t in s.tokens],
    }
    if options.top_n_tokens:
      details["top_tokens"] = [top_tokens(t, options, ctx) for t in s.tokens]
    out["details"] = details
  return out


def event(
  index: int,
  t: Token,
  options: Options,
  ctx: Context,
  s: TokenStream | None = None,
  inputs: str = "",
) -> dict:
  """One stream event; the last (`s` given, finished) carries the text
  and details."""
  out: dict[str, Any] = {
    "index": index,
    "token": token(t, options, ctx),
    "generated_text": None,
    "details": None,
  }
  if options.top_n_tokens:
    out["top_tokens"] = top_tokens(t, options, ctx)
  if s is not None:
    out["generated_text"] = (
      inputs if options.return_full_text else ""
    ) + s.text
    out["details"] = {
      "finish_reason": s.finish_reason,
      "generated_tokens": len(s.tokens),
      "seed": s.seed,
      "prompt_tokens": s.prompt_tokens,
      "input_length": s.prompt_tokens,
    }
  return out
