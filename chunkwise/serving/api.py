"""What the HTTP faces share: the served model's limits, errors with a
status, and the translation of common request fields into a `Generation`.

  ctx = Context(engine, model_id="smollm2-135m", max_input_tokens=1024,
                max_total_tokens=2048)
  ids = ctx.encode("Hello")              # BOS + ids, length-checked
  adapter = ctx.adapter("math")          # None: the base model
  constraint = json_constraint(schema)   # a JsonSchema (any object if None)

Every refusal is an `ApiError(status, message, kind)`; each face writes
it in its own wire shape (../shared/SERVING.md §1, §5).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import secrets
from collections.abc import Sequence
from typing import Any

import pydantic

from chunkwise import constraints
from chunkwise.serving import tool_formats
from chunkwise.serving.engine import Engine
from chunkwise.serving.text import token_bytes

VALIDATION = "validation"
OVERLOADED = "overloaded"
GENERATION = "generation"
NOT_FOUND = "not_found"
UNAVAILABLE = "unavailable"
UNAUTHORIZED = "unauthorized"
FORBIDDEN = "forbidden"


# An absolute file path in an error's text (a model file's, a module's):
# the client gets its last part only.
_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.+@-]+/)+([\w.+@-]+)")


def scrub(message: str) -> str:
  """`message` without the server's file paths (each one's file name
  kept): an error tells a client what was wrong, not where this server
  keeps its files."""
  return _PATH.sub(r"\1", message)


class ApiError(Exception):
  """A refusal: HTTP `status`, a message, and its kind (one of the module
  constants above)."""

  def __init__(self, status: int, message: str, kind: str = VALIDATION):
    super().__init__(message)
    self.status, self.message, self.kind = status, message, kind


def bad_request(message: str) -> ApiError:
  """A 400 with `message` (each face's own shape wraps it)."""
  return ApiError(400, message)


def new_id(prefix: str, sep: str = "-") -> str:
  """A fresh object id: "chatcmpl-…" (OpenAI's chat), "resp_…" (with
  sep="_": Responses, Messages)."""
  return f"{prefix}{sep}{secrets.token_hex(12)}"


def documented(default: Any = None, **schema: Any) -> Any:
  """A request model's field whose JSON schema (the OpenAPI document,
  `openapi.py`) also holds `schema`'s keywords: the bounds its route
  enforces with messages of its own (validation is unchanged)."""
  return pydantic.Field(default, json_schema_extra=schema)


def unpaired_surrogate(value: Any) -> str | None:
  """Where a parsed JSON body holds text with an unpaired surrogate
  ("\\udc80": JSON can spell it, UTF-8 cannot, and no tokenizer encodes
  it), as `messages[0].content`; None if nowhere."""
  todo: list[tuple[Any, str]] = [(value, "")]
  while todo:
    v, where = todo.pop()
    if isinstance(v, str):
      try:
        v.encode("utf-8")
      except UnicodeEncodeError:
        return where or "the body"
    elif isinstance(v, dict):
      for k, x in v.items():
        todo.append((k, f"a key of {where or 'the body'}"))
        todo.append((x, f"{where}.{k}" if where else k))
    elif isinstance(v, list):
      todo += [(x, f"{where}[{i}]") for i, x in enumerate(v)]
  return None


def openai_route(path: str) -> bool:
  """Whether `path` is an OpenAI route (its errors in OpenAI's shape):
  under /v1/, and vLLM's /tokenize and /detokenize."""
  return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


def pydantic_message(e: pydantic.ValidationError) -> str:
  """One line naming each bad field and what was expected."""
  parts = []
  for err in e.errors():
    where = ".".join(str(p) for p in err["loc"]) or "body"
    parts.append(f"{where}: {err['msg']} (got {err.get('input')!r:.80})")
  return "; ".join(parts)


@dataclasses.dataclass(kw_only=True)
class Context:
  """The served model and the server's limits."""

  engine: Engine
  model_id: str
  max_input_tokens: int
  max_total_tokens: int
  max_stop_sequences: int = 8
  max_n: int = 8
  # What one request may ask for, checked before any work (`check_sizes`,
  # `check_stops`); each is a flag of scripts/serve.py of the same name.
  max_prompts: int = 32  # prompts of one /v1/completions request
  max_choices: int = 64  # its prompts x n
  max_stop_length: int = 256  # characters of one stop string
  max_messages: int = 512  # chat messages
  max_tools: int = 64  # tools offered
  max_schema_bytes: int = 256 << 10  # JSON of its schemas and tools, all told
  # Slow and greedy clients (flags of the same names)
  body_timeout_s: float = 30.0  # to read a request's body
  write_timeout_s: float = 30.0  # to hand a stream's event to the client
  max_client_requests: int = 256  # requests at once from one address
  keepalive_timeout_s: float = 15.0  # an idle connection kept open
  max_connections: int = 1024  # open at once (one more: 503, closed)
  # Seconds of constraint compiling for all of a request's choices and
  # tools together (--compile_budget_s; `worker.Budget`)
  compile_budget_s: float = 30.0
  created: int = 0
  # A chat template (Jinja text) in place of the model's own (--chat_template)
  chat_template: str | None = None
  chat_template_source: str = "--chat_template"
  # Stored Responses API responses (`response_store.ResponseStore`; None:
  # nothing kept, previous_response_id refused)
  responses_store: Any = None

  def __post_init__(self):
    self._bytes = token_bytes(self.model.vocab)
    vocab = self.model.vocab
    if self.chat_template is not None:
      vocab = vocab.with_chat_template(
        self.chat_template, self.chat_template_source
      )
    self._chat_vocab = vocab

  @property
  def model(self):
    return self.engine.model

  @property
  def chat_vocab(self):
    """The model's vocabulary with the chat template the server renders."""
    return self._chat_vocab

  @functools.cached_property
  def tool_format(self) -> tool_formats.Format:
    """How the served template writes tool calls (read once, from its
    text and the vocabulary)."""
    return tool_formats.of(self._chat_vocab)

  def text_of(self, token: int) -> str:
    """A token's own spelling (an alternative's text)."""
    return self.model.vocab.decode([token])

  def key_of(self, token: int) -> str:
    """A token's spelling as a key among alternatives (the legacy
    completions' `top_logprobs` dicts): its text, or for bytes that are
    not whole UTF-8 characters `bytes:\\xe2\\x98` (as OpenAI spells
    them), so such tokens do not all collapse into one "\ufffd" key."""
    b = self._bytes
    if b is not None and token < len(b) and b[token] is not None:
      try:
        b[token].decode("utf-8")
      except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b[token])
    return self.text_of(token)

  def is_special(self, token: int) -> bool:
    if token in self.model.eos_ids:
      return True
    b = self._bytes
    return b is not None and token < len(b) and b[token] is None

  @property
  def adapters(self) -> tuple[str, ...]:
    return tuple(self.model.adapters)

  def adapter(self, name: str | None, *, status: int = 422) -> str | None:
    """The adapter `name` asks for: None (the base) for None, "", the
    model's own id, or "tgi" (what TGI's own client sends: TGI serves one
    model) unless an adapter has that name; ApiError for an adapter that
    is not served."""
    if name in (None, "", self.model_id):
      return None
    if name == "tgi" and name not in self.model.adapters:
      return None
    if name not in self.model.adapters:
      served = ", ".join(map(repr, self.adapters)) or "none"
      known = (
        f"this server serves the base model {self.model_id!r} and adapters "
        f"{served}"
      )
      if status == 404:  # OpenAI's `model`
        raise ApiError(
          404, f"The model `{name}` does not exist ({known}).", NOT_FOUND
        )
      raise ApiError(status, f"unknown adapter {name!r}: {known}")
    return name

  def encode(
    self, text: str, *, truncate: int | None = None, status: int = 422
  ) -> list[int]:
    """BOS + the text's ids (the last `truncate` of them), checked
    against `max_input_tokens`."""
    model = self.model
    ids = model.vocab.encode(text)
    if truncate is not None:
      ids = ids[-truncate:] if truncate > 0 else []
    ids = [model.bos_id, *ids]
    if len(ids) > self.max_input_tokens:
      raise ApiError(
        status,
        f"`inputs` has {len(ids)} tokens (BOS included), over this "
        f"server's max_input_tokens={self.max_input_tokens}",
      )
    return ids

  def new_tokens(
    self, prompt: int, asked: int | None, status: int = 422
  ) -> int:
    """Tokens to generate after a prompt of `prompt` tokens: `asked`, or
    all the room left; ApiError past `max_total_tokens`."""
    room = min(self.max_total_tokens, self.engine.capacity) - prompt
    if asked is None:
      if room < 1:
        raise ApiError(
          status,
          f"the prompt's {prompt} tokens leave no room to generate within "
          f"max_total_tokens={self.max_total_tokens}",
        )
      return room
    if asked < 1:
      raise ApiError(status, f"max_new_tokens must be >= 1, got {asked}")
    if prompt + asked > self.max_total_tokens:
      raise ApiError(
        status,
        f"`inputs` tokens + `max_new_tokens` must be <= "
        f"{self.max_total_tokens}. Given: {prompt} `inputs` tokens and "
        f"{asked} `max_new_tokens`",
      )
    if asked > room:
      raise ApiError(
        status,
        f"`inputs` tokens + `max_new_tokens` must fit the server's "
        f"{self.engine.capacity} columns per request. Given: {prompt} "
        f"`inputs` tokens and {asked} `max_new_tokens`",
      )
    return asked

  def check_stops(
    self, stops: list[str] | None, status: int = 422
  ) -> list[str]:
    stops = list(stops or [])
    if len(stops) > self.max_stop_sequences:
      raise ApiError(
        status,
        f"`stop` supports up to {self.max_stop_sequences} stop sequences. "
        f"Given: {len(stops)}",
      )
    if any(not s for s in stops):
      raise ApiError(status, "`stop` sequences must be non-empty strings")
    longest = max(map(len, stops), default=0)
    if longest > self.max_stop_length:
      raise ApiError(
        status,
        f"`stop` sequences must be at most {self.max_stop_length} "
        f"characters (this server's --max_stop_length). Given: {longest}",
      )
    return stops

  def check_sizes(
    self,
    status: int,
    *,
    prompts: int = 1,
    n: int = 1,
    messages: int = 0,
    tools: int = 0,
    schemas: Sequence[Any] = (),
  ) -> None:
    """Raises ApiError naming the first of this server's per-request caps
    a request passes: what it asks for is counted before any of it is
    tokenized, rendered or compiled."""
    caps = (
      ("prompts", prompts, self.max_prompts, "prompts in `prompt`"),
      ("choices", prompts * n, self.max_choices, "choices (prompts x `n`)"),
      ("messages", messages, self.max_messages, "`messages`"),
      ("tools", tools, self.max_tools, "`tools`"),
    )
    for flag, count, cap, what in caps:
      if count > cap:
        raise ApiError(
          status,
          f"{count} {what}: this server takes at most {cap} per request "
          f"(--max_{flag})",
        )
    size = sum(len(json.dumps(s)) for s in schemas if s is not None)
    if size > self.max_schema_bytes:
      raise ApiError(
        status,
        f"the request's schemas and tools are {size} bytes of JSON: this "
        f"server takes at most {self.max_schema_bytes} per request "
        "(--max_schema_bytes)",
      )

  def top_n(self, n: int | None, field: str, status: int = 422) -> int:
    n = int(n or 0)
    if not 0 <= n <= self.engine.top_n:
      raise ApiError(
        status,
        f"`{field}` must be between 0 and {self.engine.top_n} (this "
        f"server's --max_top_n). Given: {n}",
      )
    return n


# Unbounded integers and numbers are generated with at most this many
# digits before the point (bounds +-(10^16 - 1) added where a schema has
# none): a model that repeats a digit stops there instead of spending
# max_tokens on one value (budget forcing then still closes the JSON).
MAX_DIGITS = 16
_LOWER, _UPPER = (
  ("minimum", "exclusiveMinimum"),
  ("maximum", "exclusiveMaximum"),
)
# Where a schema holds schemas: one, a list of them, a map of them.
_ONE = ("items", "additionalProperties", "contains", "propertyNames")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def digit_bounded(schema: Any) -> Any:
  """`schema` with `MAX_DIGITS` bounds on every integer and number
  (sub)schema without a bound on that side (a copy; the rest as given:
  `enum` / `const` / `multipleOf` values, and what `not` / `if` hold)."""
  if not isinstance(schema, dict):
    return schema
  out = dict(schema)
  for k in _ONE:
    if k in out:
      out[k] = digit_bounded(out[k])
  for k in _LIST:
    if isinstance(out.get(k), list):
      out[k] = [digit_bounded(s) for s in out[k]]
  for k in _MAP:
    if isinstance(out.get(k), dict):
      out[k] = {n: digit_bounded(s) for n, s in out[k].items()}
  kind = schema.get("type")
  kinds = set(kind) if isinstance(kind, list) else {kind}
  numeric = any(k in ("integer", "number") for k in kinds if isinstance(k, str))
  if not numeric or any(k in schema for k in ("enum", "const", "multipleOf")):
    return out
  top = 10**MAX_DIGITS - 1
  lower = [schema[k] for k in _LOWER if isinstance(schema.get(k), int | float)]
  upper = [schema[k] for k in _UPPER if isinstance(schema.get(k), int | float)]
  if not any(k in schema for k in _LOWER) and all(u >= -top for u in upper):
    out["minimum"] = -top
  if not any(k in schema for k in _UPPER) and all(lo <= top for lo in lower):
    out["maximum"] = top
  return out


def json_constraint(schema: Any, where: str) -> constraints.JsonSchema:
  """A JSON-schema constraint of `schema` (a dict or its JSON text); any
  JSON object when it is None or empty; unbounded integers and numbers
  get `MAX_DIGITS`."""
  if isinstance(schema, str):
    try:
      schema = json.loads(schema)
    except json.JSONDecodeError as e:
      raise ApiError(422, f"{where} is not valid JSON: {e}") from None
  if schema is None or schema == {}:
    schema = {"type": "object"}
  if not isinstance(schema, dict | bool):
    raise ApiError(
      422, f"{where} must be a JSON schema object, got {type(schema).__name__}"
    )
  try:
    return constraints.JsonSchema(digit_bounded(schema))
  except ValueError as e:
    raise ApiError(422, f"{where}: {e}") from None


def regex_constraint(pattern: Any, where: str) -> constraints.Regex:
  if not isinstance(pattern, str):
    raise ApiError(422, f"{where} must be a regex string, got {pattern!r:.80}")
  try:
    return constraints.Regex(pattern)
  except ValueError as e:
    raise ApiError(422, f"{where}: {e}") from None


def choice_constraint(choices: Any, where: str) -> constraints.Choice:
  if not isinstance(choices, list) or not all(
    isinstance(c, str) for c in choices
  ):
    raise ApiError(
      422, f"{where} must be a list of strings, got {choices!r:.80}"
    )
  try:
    return constraints.Choice(choices)
  except ValueError as e:
    raise ApiError(422, f"{where}: {e}") from None


def dumps(body: Any) -> bytes:
  """Compact JSON on one line, never NaN or Infinity."""
  return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
