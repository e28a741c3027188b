"""Tool calling's pieces without a server (`serving/tools.py`,
`serving/tool_calls.py`): the
request checks (400s), the languages of each mode, the fallback prompt and
reading calls back."""

import json
import pathlib
import re

import pytest

from chunkwise.serving import tool_calls, tool_formats, tools
from chunkwise.serving.api import ApiError

WEATHER = {
  "type": "function",
  "function": {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
      "type": "object",
      "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["C", "F"]},
      },
      "required": ["city", "unit"],
      "additionalProperties": False,
    },
  },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(
  "args, match",
  [
    (([], "required", None), r"tool_choice=.* needs tools"),
    (([], None, False), "parallel_tool_calls needs tools"),
    (([{"type": "code"}], None, None), r"tools\[0\].type must be 'function'"),
    (
      ([{"type": "function", "function": {"name": "a b"}}], None, None),
      r"name must be 1 to 64",
    ),
    (
      ([WEATHER], {"type": "function", "function": {"name": "x"}}, None),
      "names function 'x', which is not in tools",
    ),
    (([WEATHER], "sometimes", None), "tool_choice must be one of"),
    (([WEATHER, WEATHER], None, None), "define a name twice"),
  ],
)
def test_bad_requests_are_named(args, match):
  with pytest.raises(ApiError, match=match) as e:
    tools.parse(*args)
  assert e.value.status == 400


def test_modes():
  assert tools.parse(None, None, None) is None
  auto = tools.parse([WEATHER, TIME], None, None)
  assert (auto.mode, auto.allowed, auto.parallel) == (
    "auto",
    ("get_weather", "get_time"),
    True,
  )
  named = tools.parse(
    [WEATHER, TIME],
    {"type": "function", "function": {"name": "get_time"}},
    False,
  )
  assert (named.mode, named.named, named.parallel) == (
    "named",
    "get_time",
    False,
  )
  allowed = tools.parse(
    [WEATHER, TIME],
    {
      "type": "allowed_tools",
      "allowed_tools": {
        "mode": "required",
        "tools": [{"type": "function", "function": {"name": "get_time"}}],
      },
    },
    None,
  )
  assert (allowed.mode, allowed.allowed) == ("required", ("get_time",))


def test_text_without_a_call():
  r = re.compile(tools.without(tool_formats.HERMES.marker))
  for ok in ("", "hello", "a < b", "<tool>", "<tool_cal x", "<tool_call)"):
    assert r.fullmatch(ok), ok
  for bad in ("<tool_call>", "x<tool_call>y", "<<tool_call>", "<tool_cal"):
    assert not r.fullmatch(bad), bad


def test_each_mode_is_one_language():
  plan = tools.parse([WEATHER, TIME], "required", None)
  calls = re.compile(plan.calls_regex())
  one = (
    '<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "unit": "C"}}\n</tool_call>'
  )
  two = (
    one + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
  )
  assert calls.fullmatch(one) and calls.fullmatch(two)
  assert not calls.fullmatch(one.replace('"C"', '"K"'))  # the enum
  assert not calls.fullmatch(one.replace("get_weather", "get_wether"))
  single = tools.parse([WEATHER, TIME], "required", False)
  assert not re.fullmatch(single.calls_regex(), two)
  auto = tools.parse([WEATHER, TIME], "auto", None).constraint()
  assert re.fullmatch(auto.regex(), "It is sunny.")
  assert re.fullmatch(auto.regex(), one)
  assert not re.fullmatch(auto.regex(), "Sure: " + one)
  none = tools.parse([WEATHER], "none", None).constraint()
  assert not re.fullmatch(none.regex(), one)


def test_strict_schemas_are_refused_by_keyword():
  bad = json.loads(json.dumps(WEATHER))
  bad["function"]["strict"] = True
  bad["function"]["parameters"]["properties"]["n"] = {
    "type": "integer",
    "minimum": 3,
  }
  with pytest.raises(ApiError, match=r"get_weather.*keyword 'minimum'"):
    tools.parse([bad], "required", None).constraint()


def test_calls_read_back_exactly():
  text = (
    '<tool_call>\n{"name": "say", "arguments": {"text": "a </tool_call> b"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    "</tool_call>"
  )
  calls = tool_calls.read_calls(text, tool_formats.HERMES)
  assert [c.name for c in calls] == ["say", "get_time"]
  assert calls[0].arguments == '{"text": "a </tool_call> b"}'
  assert calls[1].arguments == "{}"
  ids = {c.id for c in calls}
  assert len(ids) == 2 and all(
    re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids
  )


def test_the_fallback_prompt_renders_calls_and_results():
  plan = tools.parse([WEATHER], None, None)
  msgs = plan.messages(
    [
      {"role": "user", "content": "Weather in Paris?"},
      {
        "role": "assistant",
        "content": None,
        "tool_calls": [
          {
            "id": "call_1",
            "type": "function",
            "function": {
              "name": "get_weather",
              "arguments": '{"city": "Paris"}',
            },
          }
        ],
      },
      {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
  )
  assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"]
  assert msgs[2]["content"] == (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
  )
  assert msgs[3] == {"role": "tool", "content": "18 C"}


def _accumulate(plan, text, step):
  """The deltas of `text` handed over `step` characters at a time, joined
  by the openai client's own accumulation."""
  from openai.lib.streaming._deltas import accumulate_delta

  deltas = tool_calls.Deltas(plan.mode, plan.fmt)
  acc: dict = {}
  headers = []
  for end in range(step, len(text) + step, step):
    for d in deltas(text[:end], end >= len(text)):
      for c in d.get("tool_calls", []):
        assert "function" in c  # every tool-call delta carries one
        if "id" in c:
          headers.append(c["index"])
      acc = accumulate_delta(acc, d)
  return acc, headers


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_calls_add_up_to_the_whole(step):
  plan = tools.parse([WEATHER, TIME], None, None)
  text = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a \\"}\\" '
    '</tool_call>", "unit": "C"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_time", "arguments": {}}\n</tool_call>'
  )
  acc, headers = _accumulate(plan, text, step)
  whole = tool_calls.read_calls(text, tool_formats.HERMES)
  assert headers == [0, 1]  # each call's id, type and name once, in order
  got = acc["tool_calls"]
  assert [c["function"]["name"] for c in got] == ["get_weather", "get_time"]
  assert [c["function"]["arguments"] for c in got] == [
    c.arguments for c in whole
  ]
  assert [c["type"] for c in got] == ["function"] * 2
  assert "content" not in acc


@pytest.mark.parametrize("text", ["<to be or not>", "<tool_cal", "plain"])
def test_streamed_text_in_auto_is_held_until_it_cannot_be_a_call(text):
  plan = tools.parse([WEATHER], "auto", None)
  acc, headers = _accumulate(plan, text, 1)
  assert acc == {"content": text} and headers == []


def test_tools_with_a_response_format():
  """`tools` + `response_format`: the answer's text follows the schema
  when the model does not call."""
  from chunkwise import constraints

  answer = constraints.JsonSchema(
    {
      "type": "object",
      "properties": {"a": {"type": "integer"}},
      "required": ["a"],
    }
  )
  call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
  auto = tools.parse([WEATHER, TIME], "auto", None).constraint(answer)
  assert re.fullmatch(auto.regex(), '{"a": 1}')
  assert re.fullmatch(auto.regex(), call)
  assert not re.fullmatch(auto.regex(), "hello")
  none = tools.parse([WEATHER, TIME], "none", None).constraint(answer)
  assert re.fullmatch(none.regex(), '{"a": 1}')
  assert not re.fullmatch(none.regex(), call)


def test_review_cases():
  """Tools from a nested pydantic model ($defs and $ref), a tool named
  "arguments", parameters {}, a regex answer with tools."""
  from chunkwise import constraints

  nested = {
    "type": "function",
    "function": {
      "name": "arguments",
      "parameters": {
        "$defs": {
          "Inner": {
            "type": "object",
            "properties": {"x": {"type": "integer"}},
            "required": ["x"],
          }
        },
        "type": "object",
        "properties": {"inner": {"$ref": "#/$defs/Inner"}},
        "required": ["inner"],
      },
    },
  }
  anything = {"type": "function", "function": {"name": "f", "parameters": {}}}
  plan = tools.parse([nested, anything], "required", None)
  calls = re.compile(plan.calls_regex())
  one = (
    '<tool_call>\n{"name": "arguments", "arguments": {"inner": {"x": 3}}}'
    "\n</tool_call>"
  )
  assert calls.fullmatch(one)
  assert not calls.fullmatch(one.replace('{"x": 3}', '{"y": 3}'))
  assert not calls.fullmatch(
    '<tool_call>\n{"name": "f", "arguments": true}\n</tool_call>'
  )
  (call,) = tool_calls.read_calls(one, tool_formats.HERMES)
  assert (call.name, call.arguments) == ("arguments", '{"inner": {"x": 3}}')
  with pytest.raises(ApiError, match="not a regex or a choice"):
    plan.constraint(constraints.Regex("a+"))


# -- the model's own format ---------------------------------------------------

QWEN_STYLE = (
  pathlib.Path(__file__)
  .with_name("data")
  .joinpath("qwen2_5_style.jinja")
  .read_text(encoding="utf-8")
)
# The parts of Llama 3.1's and Mistral v0.3's templates a format is read by.
LLAMA3_LIKE = (
  '{%- if tools %}Respond in the format {"name": function name, '
  '"parameters": dictionary of argument name and its value}.{% endif %}'
)
MISTRAL_LIKE = "{%- if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"
CHATML = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}"


@pytest.mark.parametrize(
  "template, fmt",
  [
    (QWEN_STYLE, tool_formats.HERMES),
    (LLAMA3_LIKE, tool_formats.LLAMA3_JSON),
    (MISTRAL_LIKE, tool_formats.MISTRAL),
    (CHATML, tool_formats.FALLBACK),
    (None, tool_formats.FALLBACK),
  ],
)
def test_the_format_is_read_from_the_template(template, fmt):
  assert tool_formats.from_template(template) == fmt
  assert fmt.native == (template not in (CHATML, None))


class _Vocab:
  """A vocabulary whose every character is a token; `control` ones have
  no text (as a control token [TOOL_CALLS] in some Mistral files)."""

  def __init__(self, template, control=()):
    self.chat_template, self.control = template, control

  def encode(self, text):
    for c in self.control:
      text = text.replace(c, "\0")
    return [ord(c) for c in text]

  def token_bytes(self):
    return [None if i == 0 else chr(i).encode() for i in range(256)]


def test_a_marker_the_vocabulary_cannot_write_falls_back():
  assert tool_formats.of(_Vocab(MISTRAL_LIKE)) == tool_formats.MISTRAL
  control = _Vocab(MISTRAL_LIKE, control=("[TOOL_CALLS]",))
  assert tool_formats.of(control) == tool_formats.FALLBACK


def _engine_accepts(regex, text):
  """The constraint engine's tables (`automaton.build`, one token per
  printable character) take `text` from the start to a final state."""
  import string

  from chunkwise.constraints import automaton

  chars = string.printable
  vocab = {c.encode(): [i] for i, c in enumerate(chars)}
  t = automaton.build("regex", regex, vocab, (len(chars),), len(chars) + 1, 64)
  state = 0
  for c in text:
    state = t["next_state"][state, t["token_class"][chars.index(c)]]
    assert state >= 0, (c, text)
  assert t["final"][state]


def _answer(fmt, calls):
  return (
    fmt.start
    + fmt.sep.join(f"{fmt.head(n)}{a}{fmt.tail}" for n, a in calls)
    + fmt.end
  )


@pytest.mark.parametrize("fmt", tool_formats.FORMATS, ids=lambda f: f.name)
def test_each_format_is_one_language_read_back_and_streamed(fmt):
  calls = [
    ("get_weather", '{"city": "a \\"}]\\" [TOOL_CALLS]", "unit": "C"}'),
    ("get_time", "{}"),
  ]
  calls = calls if fmt.parallel else calls[:1]
  text = _answer(fmt, calls)
  plan = tools.parse([WEATHER, TIME], "required", None).written(fmt)
  assert re.fullmatch(plan.calls_regex(), text)
  assert not re.fullmatch(plan.calls_regex(), text.replace('"C"', '"K"'))
  auto = tools.parse([WEATHER, TIME], "auto", None).written(fmt).constraint()
  assert re.fullmatch(auto.regex(), text)
  assert re.fullmatch(auto.regex(), "It is sunny.")
  assert not re.fullmatch(auto.regex(), "Sure: " + text)
  _engine_accepts(auto.regex(), text)
  got = tool_calls.read_calls(text, fmt)
  assert [(c.name, c.arguments) for c in got] == calls
  assert plan.read(text)[0] is None
  for step in (1, 4):
    acc, headers = _accumulate(plan, text, step)
    assert headers == list(range(len(calls)))
    assert [
      (c["function"]["name"], c["function"]["arguments"])
      for c in acc["tool_calls"]
    ] == calls
  two = _answer(fmt, [("get_time", "{}")] * 2)
  one = tools.parse([WEATHER, TIME], "required", False).written(fmt)
  assert not re.fullmatch(one.calls_regex(), two)
  assert bool(re.fullmatch(plan.calls_regex(), two)) == fmt.parallel


PAST = [
  {"role": "user", "content": "Weather in Paris?"},
  {
    "role": "assistant",
    "content": None,
    "tool_calls": [
      {
        "id": "call_abcdefghijklmnopqrstuvwx",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
      }
    ],
  },
  {
    "role": "tool",
    "tool_call_id": "call_abcdefghijklmnopqrstuvwx",
    "content": "18 C",
  },
]


def test_a_native_template_renders_the_tools_and_past_turns():
  from chunkwise.checkpoints.chat_template import ChatTemplate

  plan = tools.parse([WEATHER], None, None).written(tool_formats.HERMES)
  messages = plan.messages(PAST)
  assert messages[1]["content"] == ""  # content None: empty
  args = messages[1]["tool_calls"][0]["function"]["arguments"]
  assert args == {"city": "Paris"}  # an object, as templates expect
  text = ChatTemplate(QWEN_STYLE).render(messages, tools=plan.specs())
  assert json.dumps(plan.specs()[0], ensure_ascii=False) in text
  assert (
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
  ) in text
  assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>" in text
  assert text.endswith("<|im_start|>assistant\n")
  mistral = tools.parse([WEATHER], None, None).written(tool_formats.MISTRAL)
  cut = mistral.messages(PAST)
  assert cut[1]["tool_calls"][0]["id"] == "pqrstuvwx"  # the last 9
  assert cut[2]["tool_call_id"] == cut[1]["tool_calls"][0]["id"]
