"""Tool calling on the server with SmolLM2 (whose ChatML template has no
tools: the Hermes fallback), through the `openai` client with strict
response validation: every mode, streamed and not, greedy and sampled;
each call valid against its tool's schema; the stream helper's result
equal to the whole response; a tool result's turn; the 400s."""

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.serving_helpers import run_weather_agent, running, served_as

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
WEATHER = {
  "type": "function",
  "function": {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
      "type": "object",
      "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
      },
      "required": ["city", "unit"],
      "additionalProperties": False,
    },
  },
}
TIME = {
  "type": "function",
  "function": {
    "name": "get_time",
    "description": "The local time in a time zone.",
    "parameters": {
      "type": "object",
      "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]+$"}},
      "required": ["zone"],
      "additionalProperties": False,
    },
  },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(smollm2_first_layers):
  with running(
    *served_as(smollm2_first_layers, MODEL),
    "--slots=4",
    "--max_total_tokens=1024",
    "--warm_up=false",
  ) as s:
    yield openai.OpenAI(
      base_url=s.url + "/v1",
      api_key="-",
      max_retries=0,
      _strict_response_validation=True,
    )


def _valid_calls(message, allowed=tuple(SCHEMAS)):
  assert message.tool_calls
  assert message.content is None
  ids = set()
  for c in message.tool_calls:
    assert c.type == "function" and c.function.name in allowed
    jsonschema.validate(
      json.loads(c.function.arguments), SCHEMAS[c.function.name]
    )
    assert c.id.startswith("call_") and len(c.id) == 29
    ids.add(c.id)
  assert len(ids) == len(message.tool_calls)


def _create(client, **kw):
  return client.chat.completions.create(
    model=MODEL, messages=kw.pop("messages", ASK), tools=TOOLS, **kw
  )


@pytest.mark.parametrize(
  "seed",
  [
    None,
    1,
    # more seeds of the same sampled path: [1] above stays in CI
    pytest.param(2, marks=pytest.mark.long),
    pytest.param(3, marks=pytest.mark.long),
  ],
)
def test_required_calls_are_valid_greedy_and_sampled(client, seed):
  kw = dict(temperature=0) if seed is None else dict(temperature=1, seed=seed)
  c = _create(client, tool_choice="required", max_tokens=120, **kw)
  _valid_calls(c.choices[0].message)
  assert c.choices[0].finish_reason in ("tool_calls", "length")


def test_a_named_choice_is_exactly_that_call(client):
  c = _create(
    client,
    tool_choice={"type": "function", "function": {"name": "get_time"}},
    max_tokens=60,
    temperature=0,
  )
  message = c.choices[0].message
  _valid_calls(message, ("get_time",))
  assert len(message.tool_calls) == 1
  assert c.choices[0].finish_reason in ("stop", "length")


@pytest.mark.long  # its language: test_tools.py
def test_parallel_false_makes_one_call(client):
  for seed in (1, 2):
    c = _create(
      client,
      tool_choice="required",
      parallel_tool_calls=False,
      max_tokens=120,
      temperature=1,
      seed=seed,
    )
    assert len(c.choices[0].message.tool_calls) == 1


@pytest.mark.long  # its language: test_tools.py
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_auto_is_text_or_valid_calls(client, seed):
  c = _create(client, max_tokens=80, temperature=1, seed=seed)
  message = c.choices[0].message
  if message.tool_calls:
    _valid_calls(message)
  else:
    assert "<tool_call>" not in message.content


def test_none_is_text(client):
  c = _create(client, tool_choice="none", max_tokens=30, temperature=0)
  message = c.choices[0].message
  assert message.tool_calls is None and "<tool_call>" not in message.content


@pytest.mark.long  # deltas: test_tools.py
@pytest.mark.parametrize(
  "choice, sampling",
  [("required", dict(temperature=1, seed=7)), ("auto", dict(temperature=0))],
)
def test_the_stream_helper_adds_up_to_the_whole(client, choice, sampling):
  kw = dict(
    model=MODEL,
    messages=ASK,
    tools=TOOLS,
    tool_choice=choice,
    max_tokens=120,
    **sampling,
  )
  whole = client.chat.completions.create(**kw).choices[0]
  with client.chat.completions.stream(**kw) as stream:
    for _ in stream:
      pass
    streamed = stream.get_final_completion().choices[0]
  got, want = streamed.message, whole.message
  assert got.content == want.content
  assert [
    (c.function.name, c.function.arguments) for c in got.tool_calls or []
  ] == [(c.function.name, c.function.arguments) for c in want.tool_calls or []]
  assert streamed.finish_reason == whole.finish_reason


class Weather(pydantic.BaseModel):
  city: str
  unit: str


@pytest.mark.long  # the parse helper: test_serving_smollm2.py
def test_parse_gives_the_pydantic_arguments(client):
  c = client.chat.completions.parse(
    model=MODEL,
    messages=ASK,
    tools=[openai.pydantic_function_tool(Weather)],
    tool_choice="required",
    max_tokens=80,
    temperature=0,
  )
  call = c.choices[0].message.tool_calls[0]
  assert isinstance(call.function.parsed_arguments, Weather)


def test_a_tool_result_turn(client):
  first = _create(client, tool_choice="required", max_tokens=120, temperature=0)
  message = first.choices[0].message
  call = message.tool_calls[0]
  c = client.chat.completions.create(
    model=MODEL,
    messages=[
      *ASK,
      message.model_dump(exclude_none=True),
      {
        "role": "tool",
        "tool_call_id": call.id,
        "content": [{"type": "text", "text": "18 degrees, sunny"}],
      },
    ],
    tools=TOOLS,
    tool_choice="none",
    max_tokens=30,
    temperature=0,
  )
  assert c.choices[0].message.content


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(tool_choice="required", tools=None), r"tool_choice=.* needs tools"),
    (dict(parallel_tool_calls=False, tools=None), "needs tools"),
    (
      dict(tool_choice={"type": "function", "function": {"name": "nope"}}),
      "not in tools",
    ),
    (dict(tools=[{"type": "web_search"}]), "must be 'function'"),
    (
      dict(tools=[{"type": "function", "function": {"name": "a.b"}}]),
      "name must be",
    ),
    (
      dict(
        tools=[
          {
            "type": "function",
            "function": {
              "name": "f",
              "strict": True,
              "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 2}},
              },
            },
          }
        ]
      ),
      "keyword 'minimum'",
    ),
  ],
)
def test_bad_tool_requests_are_400s(client, kw, match):
  kw = {"tools": TOOLS, **kw}
  if kw["tools"] is None:
    del kw["tools"]
  with pytest.raises(openai.BadRequestError, match=match):
    client.chat.completions.create(
      model=MODEL, messages=ASK, max_tokens=20, **kw
    )


def test_an_openai_agents_run_completes(client):
  """`openai-agents` (its chat-completions model) runs one agent with one
  function tool against the server to completion."""
  run_weather_agent(client, "OpenAIChatCompletionsModel", MODEL)


def test_tgis_own_client_calls_tools(client):
  """`text_generation.Client.chat` (TGI's client: model "tgi", a tool's
  name alone as `tool_choice`, unstreamed) gets valid calls."""
  import text_generation
  from text_generation.types import Message, Tool

  tgi = text_generation.Client(str(client.base_url).removesuffix("/v1/"))
  tgi.timeout = 120
  for choice, allowed in (("get_time", ("get_time",)), ("required", SCHEMAS)):
    out = tgi.chat(
      [Message(role="user", content=ASK[0]["content"])],
      tools=[Tool(**t) for t in TOOLS],
      tool_choice=choice,
      max_tokens=80,
      seed=1,
      temperature=1.0,
    )
    message = out.choices[0].message
    assert message.content is None and message.tool_calls
    for c in message.tool_calls:
      name = c["function"]["name"]
      assert name in allowed
      jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[name])


# -- a template that renders tools: the model's own format ---------------------

QWEN_TEMPLATE = __file__.replace(
  "test_serving_tools.py", "data/qwen2_5_style.jinja"
)


@pytest.fixture(scope="module")
def qwen_style(smollm2_first_layers):
  """SmolLM2 served with a Qwen2.5-style template (tests/data), which
  renders the tools and past calls itself and asks for <tool_call>
  blocks: the native Hermes format, no fallback text."""
  with running(
    *served_as(smollm2_first_layers, MODEL),
    "--slots=2",
    "--max_total_tokens=1024",
    "--warm_up=false",
    f"--chat_template={QWEN_TEMPLATE}",
  ) as s:
    yield openai.OpenAI(
      base_url=s.url + "/v1",
      api_key="-",
      max_retries=0,
      _strict_response_validation=True,
    )


def test_a_native_template_calls_in_its_format(qwen_style):
  c = _create(qwen_style, tool_choice="required", max_tokens=120, temperature=0)
  _valid_calls(c.choices[0].message)
  kw = dict(
    model=MODEL,
    messages=ASK,
    tools=TOOLS,
    tool_choice="required",
    max_tokens=120,
    temperature=1,
    seed=5,
  )
  whole = qwen_style.chat.completions.create(**kw).choices[0].message
  _valid_calls(whole)  # sampled
  with qwen_style.chat.completions.stream(**kw) as stream:
    for _ in stream:
      pass
    streamed = stream.get_final_completion().choices[0].message
  assert [
    (c.function.name, c.function.arguments) for c in whole.tool_calls
  ] == [(c.function.name, c.function.arguments) for c in streamed.tool_calls]
  # The next turn: the template renders the call and its result.
  call = whole.tool_calls[0]
  c = qwen_style.chat.completions.create(
    model=MODEL,
    messages=[
      *ASK,
      whole.model_dump(exclude_none=True),
      {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ],
    tools=TOOLS,
    tool_choice="none",
    max_tokens=20,
    temperature=0,
  )
  assert c.choices[0].message.content and not c.choices[0].message.tool_calls
  # The prompt is the template's own rendering of the tools, the call (its
  # arguments as an object) and the result, token for token.
  import chunkwise as cw

  vocab = cw.checkpoints.describe(MODEL).vocab
  with open(QWEN_TEMPLATE, encoding="utf-8") as f:
    vocab = vocab.with_chat_template(f.read())
  text = vocab.apply_chat_template(
    [
      *ASK,
      {
        "role": "assistant",
        "content": "",
        "tool_calls": [
          {
            "id": call.id,
            "type": "function",
            "function": {
              "name": call.function.name,
              "arguments": json.loads(call.function.arguments),
            },
          }
        ],
      },
      {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ],
    tools=TOOLS,
  )
  assert "# Tools" in text and "<tool_response>" in text
  assert c.usage.prompt_tokens == len(vocab.encode(text))
