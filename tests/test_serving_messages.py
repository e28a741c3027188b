"""Anthropic's Messages API on the server with SmolLM2, through the real
`anthropic` client: text, structured outputs (`output_config.format`),
forced and chosen tool use valid against its `input_schema`, a
`tool_result` turn, `messages.stream()` against the whole message,
stop sequences, `count_tokens`, `x-api-key`, and errors in Anthropic's
shape."""

import json

import anthropic
import jsonschema
import pytest

from tests.serving_helpers import running, served_as
from tests.test_serving_tools import TOOLS as CHAT_TOOLS

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
KEY = "messages-test-key"
# test_serving_tools.py's tools, as Anthropic's (input_schema)
TOOLS = [
  {
    "name": t["function"]["name"],
    "description": t["function"]["description"],
    "input_schema": t["function"]["parameters"],
  }
  for t in CHAT_TOOLS
]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # (extra_body: anthropic 2.x has no field)
NUMBER = {
  "type": "object",
  # (bounded: a sampled answer always ends well within max_tokens)
  "properties": {
    "answer": {"type": "integer"},
    "why": {"type": "string", "maxLength": 20},
  },
  "required": ["answer", "why"],
  "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(smollm2_first_layers):
  with running(
    *served_as(smollm2_first_layers, MODEL),
    "--slots=4",
    "--max_total_tokens=1024",
    "--warm_up=false",
    f"--api_key={KEY}",
  ) as s:
    yield anthropic.Anthropic(base_url=s.url, api_key=KEY, max_retries=0)


def _create(client, **kw):
  kw.setdefault("max_tokens", 24)
  kw.setdefault("messages", ASK)
  kw.setdefault("model", MODEL)
  return client.messages.create(**kw)


def _tool_uses(message, allowed=tuple(SCHEMAS)):
  uses = [b for b in message.content if b.type == "tool_use"]
  for u in uses:
    assert u.name in allowed and u.id
    jsonschema.validate(u.input, SCHEMAS[u.name])
  return uses


def test_text_greedy_and_sampled(client):
  m = _create(client, extra_body=GREEDY)
  assert m.role == "assistant" and m.type == "message"
  assert m.content[0].type == "text" and m.content[0].text
  assert m.stop_reason in ("end_turn", "max_tokens")
  assert 0 < m.usage.output_tokens <= 24 and m.usage.input_tokens > 0
  assert _create(client, extra_body=GREEDY).content == m.content
  sampled = dict(temperature=0.9, top_p=0.95, top_k=40)
  assert _create(client, extra_body=sampled).content[0].text


def test_structured_outputs_are_valid(client):
  for extra in (GREEDY, {"temperature": 1.0}):
    m = _create(
      client,
      messages=[{"role": "user", "content": "What is 6 times 7?"}],
      output_config={"format": {"type": "json_schema", "schema": NUMBER}},
      max_tokens=200,  # a character may be several byte tokens
      extra_body=extra,
    )
    assert m.stop_reason == "end_turn", m.content
    jsonschema.validate(json.loads(m.content[0].text), NUMBER)


@pytest.mark.parametrize(
  "choice",
  [{"type": "any"}, {"type": "tool", "name": "get_time"}, {"type": "auto"}],
  ids=str,
)
def test_tool_use_is_valid_in_every_mode(client, choice):
  for temperature in (0, 0.9):
    m = _create(
      client,
      tools=TOOLS,
      tool_choice=choice,
      max_tokens=60,
      extra_body={"temperature": temperature},
    )
    if choice["type"] == "auto" and m.stop_reason != "tool_use":
      continue
    assert m.stop_reason == "tool_use"
    allowed = ("get_time",) if choice["type"] == "tool" else tuple(SCHEMAS)
    assert _tool_uses(m, allowed)


def test_none_and_one_call_without_parallel(client):
  m = _create(
    client, tools=TOOLS, tool_choice={"type": "none"}, extra_body=GREEDY
  )
  assert m.content[0].type == "text" and not _tool_uses(m)
  m = _create(
    client,
    messages=[{"role": "user", "content": "Weather in Paris and in Rome?"}],
    tools=TOOLS,
    tool_choice={"type": "any", "disable_parallel_tool_use": True},
    max_tokens=60,
    extra_body=GREEDY,
  )
  assert len(_tool_uses(m)) == 1


def test_a_tool_result_turn(client):
  m = _create(
    client,
    tools=TOOLS,
    tool_choice={"type": "tool", "name": "get_weather"},
    max_tokens=60,
    extra_body=GREEDY,
  )
  (use,) = _tool_uses(m)
  after = _create(
    client,
    tools=TOOLS,
    messages=[
      *ASK,
      {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
      {
        "role": "user",
        "content": [
          {"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}
        ],
      },
    ],
    tool_choice={"type": "none"},
    extra_body=GREEDY,
  )
  assert after.content[0].type == "text" and after.content[0].text
  assert after.usage.input_tokens > m.usage.input_tokens


@pytest.mark.parametrize("tools", [False, True])
def test_the_stream_adds_up_to_the_whole_message(client, tools):
  kw = dict(extra_body=GREEDY)
  if tools:
    kw.update(tools=TOOLS, tool_choice={"type": "any"}, max_tokens=60)
  whole = _create(client, **kw)
  with client.messages.stream(
    model=MODEL, messages=ASK, max_tokens=kw.pop("max_tokens", 24), **kw
  ) as stream:
    events = [e.type for e in stream]
    final = stream.get_final_message()
  assert events[0] == "message_start" and events[-1] == "message_stop"
  assert final.stop_reason == whole.stop_reason
  assert final.usage.output_tokens == whole.usage.output_tokens
  got = [
    (b.type, getattr(b, "text", None), getattr(b, "input", None))
    for b in final.content
  ]
  want = [
    (b.type, getattr(b, "text", None), getattr(b, "input", None))
    for b in whole.content
  ]
  assert got == want


def test_stop_sequences_end_the_turn(client):
  whole = _create(client, extra_body=GREEDY)
  text = whole.content[0].text
  word = text.split()[2]
  m = _create(client, stop_sequences=[word], extra_body=GREEDY)
  assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
  assert m.content[0].text == text[: text.index(word)]


def test_count_tokens_is_the_prompt_that_runs(client):
  counted = client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS)
  m = _create(
    client, tools=TOOLS, tool_choice={"type": "none"}, extra_body=GREEDY
  )
  assert counted.input_tokens == m.usage.input_tokens


@pytest.mark.parametrize(
  "kw, kind, match",
  [
    (dict(max_tokens=0), anthropic.BadRequestError, "max_tokens"),
    (
      dict(messages=[{"role": "system", "content": "x"}]),
      anthropic.BadRequestError,
      "role must be",
    ),
    (
      dict(tools=[{"type": "web_search_20250305", "name": "s"}]),
      anthropic.BadRequestError,
      "server tools",
    ),
    (
      dict(thinking={"type": "enabled", "budget_tokens": 1024}),
      anthropic.BadRequestError,
      "thinking",
    ),
    (
      dict(tool_choice={"type": "any"}),
      anthropic.BadRequestError,
      "tool_choice",
    ),
    (dict(model="nope"), anthropic.NotFoundError, "nope"),
  ],
  ids=lambda v: str(v)[:40],
)
def test_errors_are_anthropics_shape(client, kw, kind, match):
  with pytest.raises(kind, match=match) as e:
    _create(client, **kw)
  assert e.value.body["type"] == "error"
  assert e.value.body["error"]["type"] in (
    "invalid_request_error",
    "not_found_error",
  )


def test_keys_by_x_api_key_or_bearer(client):
  base = str(client.base_url)
  bad = anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0)
  with pytest.raises(anthropic.AuthenticationError) as e:
    bad.messages.create(model=MODEL, max_tokens=4, messages=ASK)
  assert e.value.body["error"]["type"] == "authentication_error"
  bearer = anthropic.Anthropic(base_url=base, auth_token=KEY, max_retries=0)
  assert bearer.messages.create(model=MODEL, max_tokens=4, messages=ASK).content
