"""vLLM's `/tokenize` and `/detokenize`.

  body = tokenize(request_body, ctx)     # {"count", "max_model_len", "tokens"}
  body = detokenize(request_body, ctx)   # {"prompt"}

A prompt is tokenized as /v1/completions would run it (BOS first with
`add_special_tokens`, the default); `messages` as /v1/chat/completions
would (the served chat template, its tools, the generation prompt).
`return_token_strs` adds each token's spelling. Errors are OpenAI's shape.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from chunkwise.serving import api
from chunkwise.serving.api import Context
from chunkwise.serving.faces import openai_requests

ROUTES = ("/tokenize", "/detokenize")


class TokenizeBody(BaseModel):
  model_config = ConfigDict(extra="forbid")

  model: str | None = None
  prompt: str | None = None
  messages: list[dict] | None = None
  tools: list[dict] | None = None
  add_special_tokens: bool = True
  add_generation_prompt: bool = True
  return_token_strs: bool = False


class DetokenizeBody(BaseModel):
  model_config = ConfigDict(extra="forbid")

  model: str | None = None
  tokens: list[int] = api.documented(..., examples=[[1, 2, 3]])


_bad = api.bad_request


def _model(name: str | None, ctx: Context) -> None:
  if name is not None:
    ctx.adapter(name, status=404)


def tokenize(raw: Any, ctx: Context) -> dict:
  b = openai_requests._validate(TokenizeBody, raw)
  _model(b.model, ctx)
  if (b.prompt is None) == (b.messages is None):
    raise _bad("give prompt or messages (one of them)")
  if b.messages is not None:
    if not b.add_generation_prompt:
      raise _bad("add_generation_prompt=false is not supported")
    chat = {"model": ctx.model_id, "messages": b.messages}
    if b.tools:
      chat["tools"] = b.tools
    ids = openai_requests.parse_chat(chat, ctx).prompts[0]
  else:
    if not b.prompt:
      raise _bad("prompt must not be empty")
    ids = ctx.encode(b.prompt, status=400)
    if not b.add_special_tokens and ids and ids[0] == ctx.model.bos_id:
      ids = ids[1:]
  out = {
    "count": len(ids),
    "max_model_len": ctx.max_total_tokens,
    "tokens": ids,
  }
  if b.return_token_strs:
    out["token_strs"] = [ctx.text_of(i) for i in ids]
  return out


def detokenize(raw: Any, ctx: Context) -> dict:
  b = openai_requests._validate(DetokenizeBody, raw)
  _model(b.model, ctx)
  vocab = ctx.model.hparams.vocab
  if len(b.tokens) > ctx.max_total_tokens:
    raise _bad(
      f"{len(b.tokens)} tokens, over this server's "
      f"max_total_tokens={ctx.max_total_tokens}"
    )
  for t in b.tokens:
    if not 0 <= t < vocab:
      raise _bad(f"tokens: {t} is not a token id (0..{vocab - 1})")
  return {"prompt": ctx.model.vocab.decode(list(b.tokens))}
