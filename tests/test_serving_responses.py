"""OpenAI's Responses API on the server with SmolLM2, through the real
`openai` client with strict response validation (and `openai-agents`,
whose default model speaks it): text, JSON schemas, function tools in
every `tool_choice` mode, log-probs, the stream's events against the
whole response, stored conversations by `previous_response_id` across a
restart and a SIGKILL, retrieve / input items / delete, and the 400s."""

import json
import signal
import sqlite3
import threading

import jsonschema
import openai
import pydantic
import pytest

from tests.serving_helpers import (
  Server,
  run_weather_agent,
  running,
  served_as,
)
from tests.test_serving_tools import TOOLS as CHAT_TOOLS

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
# test_serving_tools.py's tools, in the Responses API's flat form; strict
# where every keyword is enforced (get_weather's `minimum` is not: strict,
# it is refused)
WEATHER, TIME = (dict(t["function"], type="function") for t in CHAT_TOOLS)
TIME["strict"] = True
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
CITY = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 30},
    "population": {"type": "integer", "minimum": 0},
  },
  "required": ["name", "population"],
  "additionalProperties": False,
}
FLAGS = ("--slots=4", "--max_total_tokens=1024", "--warm_up=false")


def _client(url: str) -> openai.OpenAI:
  return openai.OpenAI(
    base_url=url + "/v1",
    api_key="-",
    max_retries=0,
    _strict_response_validation=True,
  )


@pytest.fixture(scope="module")
def client(tmp_path_factory, smollm2_first_layers):
  state = tmp_path_factory.mktemp("state")
  model = served_as(smollm2_first_layers, MODEL)
  with running(*model, *FLAGS, f"--state_dir={state}") as s:
    yield _client(s.url)


def _create(client, **kw):
  kw.setdefault("max_output_tokens", 24)
  return client.responses.create(model=MODEL, **kw)


def _calls(response, allowed=tuple(SCHEMAS)):
  calls = [o for o in response.output if o.type == "function_call"]
  for c in calls:
    assert c.name in allowed
    jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    assert c.call_id
  return calls


def _final(stream):
  """The stream's last event (completed or incomplete), checked in order:
  sequence numbers 0, 1, 2, ...; created, in_progress first."""
  events = list(stream)
  assert [e.sequence_number for e in events] == list(range(len(events)))
  assert [e.type for e in events[:2]] == [
    "response.created",
    "response.in_progress",
  ]
  assert events[-1].type in ("response.completed", "response.incomplete")
  return events, events[-1].response


@pytest.mark.parametrize("sampled", [False, True])
def test_text(client, sampled):
  kw = dict(temperature=0.8, extra_body={"seed": 5}) if sampled else {}
  kw.setdefault("temperature", 0)
  r = _create(client, input="Write a sentence about rivers.", **kw)
  assert r.status in ("completed", "incomplete") and r.output_text
  assert r.output[0].type == "message" and r.output[0].role == "assistant"
  assert 0 < r.usage.output_tokens <= 24
  if r.status == "incomplete":
    assert r.incomplete_details.reason == "max_output_tokens"
  again = _create(client, input="Write a sentence about rivers.", **kw)
  assert again.output_text == r.output_text  # greedy, or the same seed


def test_json_schema_answers_are_valid(client):
  for temperature in (0, 1.0):
    r = _create(
      client,
      input="Name a big city and its population, as JSON.",
      text={
        "format": {
          "type": "json_schema",
          "name": "city",
          "schema": CITY,
          "strict": True,
        }
      },
      temperature=temperature,
      max_output_tokens=150,  # a character may be several byte tokens
    )
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), CITY)


def test_parse_gives_the_pydantic_model(client):
  class City(pydantic.BaseModel):
    name: str
    population: int

  r = client.responses.parse(
    model=MODEL,
    input="Name a big city and its population.",
    text_format=City,
    temperature=0,
    max_output_tokens=60,
  )
  assert isinstance(r.output_parsed, City)


@pytest.mark.parametrize(
  "choice",
  ["required", {"type": "function", "name": "get_time"}, "auto"],
  ids=str,
)
def test_tool_calls_are_valid_in_every_mode(client, choice):
  # The constraint makes every call valid, whatever the seed: one answer
  # with calls is checked (a second seed only where "auto" answered text).
  for seed in (0, 1):
    r = _create(
      client,
      input="What is the weather in Paris?",
      tools=TOOLS,
      tool_choice=choice,
      temperature=0.9,
      extra_body={"seed": seed},
      max_output_tokens=60,
    )
    if choice == "auto" and r.output[0].type == "message":
      continue  # text is allowed
    # (the calls are closed within the budget: valid even if it ran out)
    allowed = ("get_time",) if isinstance(choice, dict) else tuple(SCHEMAS)
    assert _calls(r, allowed)
    break


def test_none_answers_in_text_and_one_call_without_parallel(client):
  r = _create(
    client,
    input="What is the weather in Paris?",
    tools=TOOLS,
    tool_choice="none",
    temperature=0,
  )
  assert r.output[0].type == "message" and r.output_text
  r = _create(
    client,
    input="Weather in Paris and in Rome?",
    tools=TOOLS,
    tool_choice="required",
    parallel_tool_calls=False,
    temperature=0,
    max_output_tokens=60,
  )
  assert len(_calls(r)) == 1


@pytest.mark.parametrize("tools", [False, True])
def test_the_stream_adds_up_to_the_whole_response(client, tools):
  kw = dict(input="What is the weather in Paris?", temperature=0)
  if tools:
    kw.update(tools=TOOLS, tool_choice="required", max_output_tokens=60)
  whole = _create(client, **kw)
  with client.responses.stream(
    model=MODEL, max_output_tokens=kw.pop("max_output_tokens", 24), **kw
  ) as stream:
    events, final = _final(stream)
  assert final.status == whole.status
  assert final.usage.output_tokens == whole.usage.output_tokens
  if tools:
    got = [(c.name, c.arguments) for c in _calls(final)]
    assert got == [(c.name, c.arguments) for c in _calls(whole)]
    kinds = {e.type for e in events}
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
  else:
    assert final.output_text == whole.output_text
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert [e.text for e in done] == [whole.output_text]
  if final.status == "completed":  # the helper's own accumulation
    with client.responses.stream(model=MODEL, **kw) as stream:
      helper = stream.get_final_response()
    assert helper.output_text == whole.output_text
    got = [(c.name, c.arguments) for c in _calls(helper)]
    assert got == [(c.name, c.arguments) for c in _calls(whole)]


def test_logprobs_with_alternatives(client):
  r = _create(
    client,
    input="Say hello.",
    temperature=0,
    include=["message.output_text.logprobs"],
    top_logprobs=3,
  )
  entries = r.output[0].content[0].logprobs
  assert entries and all(len(e.top_logprobs) == 3 for e in entries)
  for e in entries:  # greedy: the chosen token is the likeliest
    assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)
  assert "".join(e.token for e in entries) == r.output_text


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(tools=[{"type": "web_search"}]), "tools\\[0\\].type must be"),
    (dict(include=["reasoning.encrypted_content"]), "include"),
    (dict(top_logprobs=2), "top_logprobs needs include"),
    (dict(input=[{"type": "image", "url": "x"}]), "input\\[0\\].type"),
    (dict(extra_body={"background": True}), "background"),
    (dict(extra_body={"conversation": "c1"}), "conversation is not"),
    (dict(reasoning={"effort": "high"}), "reasoning"),
    (dict(extra_body={"reasoning": "high"}), "reasoning"),
    (
      dict(text={"format": {"type": "json_schema", "name": "x"}}),
      "text.format.schema",
    ),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[dict(WEATHER, strict=True)]), "'minimum' at #days"),
  ],
  ids=lambda v: str(v)[:40],
)
def test_bad_requests_are_400s_naming_the_field(client, kw, match):
  kw.setdefault("input", "Hello")
  with pytest.raises(openai.BadRequestError, match=match):
    client.responses.create(model=MODEL, max_output_tokens=4, **kw)


def test_unknown_ids_are_404s(client):
  with pytest.raises(openai.NotFoundError):
    client.responses.retrieve("resp_nope")
  with pytest.raises(openai.NotFoundError):
    _create(client, input="Hi", previous_response_id="resp_nope")


def test_an_openai_agents_run_completes(client):
  """`openai-agents`' default model (the Responses API) runs an agent
  with one function tool to completion."""
  run_weather_agent(client, "OpenAIResponsesModel", MODEL)


def test_conversations_survive_a_restart_and_a_sigkill(
  tmp_path, smollm2_first_layers
):
  """Three turns by previous_response_id, the third after a restart: the
  second had a tool call and its output in its input. Responses
  acknowledged before a SIGKILL (others in flight) are all there after
  it, and the database is intact."""
  model = served_as(smollm2_first_layers, MODEL)
  flags = (*model, *FLAGS, f"--state_dir={tmp_path}")
  # Durability does not depend on an answer's length: only the tool call
  # gets the budget that closes it, the other turns a few tokens (SmolLM2
  # decodes slowly on CI's CPUs).
  ask = dict(model=MODEL, temperature=0, max_output_tokens=6)
  s = Server(*flags)  # killed below, not stopped
  try:
    c = _client(s.url)
    first = c.responses.create(
      input="What is the weather in Paris?",
      tools=[WEATHER],
      tool_choice="required",
      instructions="Use the tools.",
      **(ask | dict(max_output_tokens=60)),
    )
    (call,) = _calls(first)
    second = c.responses.create(
      previous_response_id=first.id,
      input=[
        {
          "type": "function_call_output",
          "call_id": call.call_id,
          "output": "18 degrees",
        }
      ],
      tools=[WEATHER],
      **ask,
    )
    assert second.usage.input_tokens > first.usage.input_tokens
    acknowledged, stop = [first.id, second.id], threading.Event()

    def keep_asking():
      while not stop.is_set():
        try:
          r = c.responses.create(input="Count to ten.", **ask)
          acknowledged.append(r.id)
        except openai.APIError:
          return

    threads = [threading.Thread(target=keep_asking) for _ in range(3)]
    for t in threads:
      t.start()
    while len(acknowledged) < 4:  # two of them beside others in flight
      threading.Event().wait(0.2)
    s.proc.send_signal(signal.SIGKILL)
    stop.set()
    for t in threads:
      t.join(60)
  finally:
    s.proc.kill()
    s.proc.wait(30)
  db = sqlite3.connect(tmp_path / "responses.sqlite3")
  assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
  db.close()
  with running(*flags) as s:
    c = _client(s.url)
    for rid in acknowledged:  # every acknowledged turn was committed
      assert c.responses.retrieve(rid).id == rid
    third = c.responses.create(
      previous_response_id=second.id, input="And in Rome?", **ask
    )
    alone = c.responses.create(input="And in Rome?", store=False, **ask)
    # the conversation's turns (not its instructions or tools) came first
    assert third.usage.input_tokens > alone.usage.input_tokens + 20
    with pytest.raises(openai.NotFoundError):  # store=False kept nothing
      c.responses.retrieve(alone.id)
    assert c.responses.retrieve(second.id).output_text == second.output_text
    items = list(c.responses.input_items.list(second.id))
    assert [i.type for i in items] == ["function_call_output"]
    assert [i.type for i in c.responses.input_items.list(third.id)] == [
      "message"
    ]
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
      c.responses.retrieve(first.id)
    # the conversation it started still continues: each turn keeps its
    # history whole
    c.responses.create(previous_response_id=third.id, input="Thanks.", **ask)
