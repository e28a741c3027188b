"""The server with SmolLM2 (the embedded model, its chat template and its
byte-level BPE) and the openai / text-generation clients: chat with
log-probs, `parse` of a Pydantic model, the stream helper, prompt scoring
equal to `prefill`, multi-byte text, and concurrent requests equal to
`generate` alone."""

import asyncio
import json

import jsonschema
import numpy as np
import openai
import pydantic
import pytest
import text_generation

import chunkwise as cw
from chunkwise import serving
from tests.serving_helpers import running
from tests.test_serving_engine import _alone

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def model():
  return cw.load(MODEL)


@pytest.fixture(scope="module")
def server():
  with running(
    f"--model={MODEL}",
    "--slots=4",
    "--max_total_tokens=512",
    "--max_top_n=5",
    # programs compile as requests need them (warm-up's own test is
    # tests/test_serving_warmup.py): most of this module's set-up time
    "--warm_up=false",
  ) as s:
    yield s


def _client(server, strict=True):
  return openai.OpenAI(
    base_url=server.url + "/v1",
    api_key="-",
    max_retries=0,
    _strict_response_validation=strict,
  )


def _chat_ids(model, messages):
  ids = model.vocab.encode(model.vocab.apply_chat_template(messages))
  assert ids[0] == model.bos_id  # the template starts with <|im_start|>
  return ids


MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_chat_with_logprobs_equals_generate_alone(model, server):
  c = _client(server).chat.completions.create(
    model=MODEL,
    messages=MESSAGES,
    max_tokens=24,
    temperature=0,
    logprobs=True,
    top_logprobs=3,
  )
  g = serving.Generation(
    prompt=_chat_ids(model, MESSAGES), max_new_tokens=24, temperature=0, top_n=3
  )
  ids, scores, top = _alone(model, g, 0)
  content = c.choices[0].logprobs.content
  assert "".join(t.token for t in content) == c.choices[0].message.content
  assert c.choices[0].message.content == model.vocab.decode(ids)
  # Invariant numerics: bit-identical to `generate` alone.
  np.testing.assert_array_equal(
    np.float32([t.logprob for t in content]), scores
  )
  assert [t.top_logprobs[0].token for t in content] == [
    model.vocab.decode([int(i)]) for i in top[:, 0]
  ]
  assert c.usage.prompt_tokens == len(g.prompt)
  assert c.usage.completion_tokens == len(ids) + (
    c.choices[0].finish_reason == "stop"
  )


class Colour(pydantic.BaseModel):
  name: str
  hex_code: str
  warm: bool


def test_parse_a_pydantic_model(server):
  """`chat.completions.parse` sends a strict JSON schema ($defs, required,
  additionalProperties false); the reply parses as the model."""
  c = _client(server).chat.completions.parse(
    model=MODEL,
    messages=[{"role": "user", "content": "Describe the colour red as JSON."}],
    response_format=Colour,
    max_tokens=120,
    temperature=0,
  )
  colour = c.choices[0].message.parsed
  assert isinstance(colour, Colour) and colour.name


PARIS = {
  "type": "object",
  "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
  "required": ["city", "population"],
  "additionalProperties": False,
}


@pytest.mark.parametrize("max_tokens, finish", [(12, "length"), (64, "stop")])
def test_a_json_answer_is_closed_within_max_tokens(server, max_tokens, finish):
  """Greedy SmolLM2 writes Paris's population as 1111111... without end.
  With 12 tokens the server's budget forcing closes the JSON, and
  finish_reason says the budget decided ("length"); with 64 the integer
  stops at its 16 digits and the model closes the JSON itself."""
  c = _client(server).chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "Describe Paris as JSON."}],
    response_format={
      "type": "json_schema",
      "json_schema": {"name": "city", "schema": PARIS},
    },
    max_tokens=max_tokens,
    temperature=0,
  )
  choice = c.choices[0]
  value = json.loads(choice.message.content)
  jsonschema.validate(value, PARIS)
  assert abs(value["population"]) < 10**16
  assert choice.finish_reason == finish
  assert choice.message.refusal is None
  assert c.usage.completion_tokens <= max_tokens


def test_a_constraint_longer_than_max_tokens_is_refused(server):
  with pytest.raises(openai.BadRequestError, match="too few for its"):
    _client(server).chat.completions.create(
      model=MODEL,
      messages=[{"role": "user", "content": "Describe Paris as JSON."}],
      response_format={
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": PARIS},
      },
      max_tokens=3,
    )


SHORT = [{"role": "user", "content": "Say hello in one word."}]


def test_chat_stream_helper_and_plain_stream(server):
  oa = _client(server)
  whole = oa.chat.completions.create(
    model=MODEL, messages=SHORT, max_tokens=40, temperature=0
  )
  assert whole.choices[0].finish_reason == "stop"  # the helper refuses length
  with oa.chat.completions.stream(
    model=MODEL, messages=SHORT, max_tokens=40, temperature=0
  ) as stream:
    final = stream.get_final_completion()
  assert final.choices[0].message.content == whole.choices[0].message.content
  assert final.choices[0].message.role == "assistant"
  chunks = list(
    oa.chat.completions.create(
      model=MODEL,
      messages=SHORT,
      max_tokens=40,
      temperature=0,
      stream=True,
      stream_options={"include_usage": True},
    )
  )
  assert chunks[0].choices[0].delta.role == "assistant"
  assert all(ch.choices[0].delta.role is None for ch in chunks[1:-1])
  text = "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1])
  assert text == whole.choices[0].message.content
  assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_echo_scores_equal_prefill_and_multibyte_text(model, server):
  text = "Les élèves aiment le café ☕ et 日本語."
  c = _client(server).completions.create(
    model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=5
  )
  lp = c.choices[0].logprobs
  assert "".join(lp.tokens) == text == c.choices[0].text
  prompt = [model.bos_id, *model.vocab.encode(text)]
  r = model.prefill(
    cw.Chunk(tokens=np.array([prompt]), lengths=np.array([len(prompt)])),
    top_n=5,
  )
  np.testing.assert_array_equal(
    np.float32(lp.token_logprobs), np.asarray(r.per_token_scores)[0, 1:]
  )
  # TGI's decoder_input_details: the same numbers.
  t = text_generation.Client(server.url, timeout=120).generate(
    text, max_new_tokens=1, decoder_input_details=True
  )
  np.testing.assert_array_equal(
    np.float32([p.logprob for p in t.details.prefill[1:]]),
    np.asarray(r.per_token_scores)[0, 1 : len(prompt)],
  )


@pytest.mark.long  # test_serving_http.py: 16 concurrent streams
def test_concurrent_sampled_and_greedy_requests(model, server):
  """Four requests at once (greedy and sampled with seeds, a JSON schema):
  each equals `generate` alone on it (tests/test_serving_http.py runs 16
  on the tiny model)."""
  prompts = [f"Q: What is {i} + {i}? A:" for i in range(4)]
  schema = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
  }

  async def one(i, p):
    client = openai.AsyncOpenAI(
      base_url=server.url + "/v1", api_key="-", max_retries=0
    )
    extra = {"structured_outputs": {"json": schema}} if i == 3 else None
    c = await client.completions.create(
      model=MODEL,
      prompt=p,
      max_tokens=16,
      temperature=[0, 0.8][i % 2],
      seed=40 + i,
      logprobs=0,
      extra_body=extra,
    )
    return c.choices[0]

  async def run_all():
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

  choices = asyncio.run(run_all())
  for i, (p, choice) in enumerate(zip(prompts, choices, strict=True)):
    g = serving.Generation(
      prompt=[model.bos_id, *model.vocab.encode(p)],
      max_new_tokens=16,
      temperature=[0, 0.8][i % 2],
      constraint=cw.constraints.JsonSchema(schema) if i == 3 else None,
    )
    ids, scores, _ = _alone(model, g, 40 + i)
    assert choice.text == model.vocab.decode(ids), i
    np.testing.assert_array_equal(
      np.float32(choice.logprobs.token_logprobs), scores, err_msg=str(i)
    )


def test_the_tgi_client_chats(server):
  """TGI's own client (`text_generation` 0.7) sends `model="tgi"` to the
  chat route: the base model answers (its streamed chat's chunk model
  does not fit OpenAI's deltas: not supported)."""
  client = text_generation.Client(server.url, timeout=120)
  r = client.chat(
    messages=[text_generation.types.Message(role="user", content="Say hi.")],
    max_tokens=8,
  )
  assert r.choices[0].message.content
  assert r.choices[0].finish_reason in ("stop", "length")


def test_tokenize_and_detokenize_in_vllms_shapes(model, server):
  """/tokenize a prompt (BOS first unless add_special_tokens is false) and
  a conversation (the prompt chat completions run), /detokenize back."""

  def post(path, body):
    status, out = server.post(path, body)
    return status, json.loads(out)

  status, out = post(
    "/tokenize",
    {"model": MODEL, "prompt": "Hello world", "return_token_strs": True},
  )
  assert status == 200
  assert out["tokens"] == [model.bos_id, *model.vocab.encode("Hello world")]
  assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 512
  assert "".join(out["token_strs"][1:]) == "Hello world"
  _, bare = post(
    "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}
  )
  assert bare["tokens"] == out["tokens"][1:]
  assert post("/detokenize", {"tokens": bare["tokens"]}) == (
    200,
    {"prompt": "Hello world"},
  )
  _, chat = post("/tokenize", {"messages": MESSAGES})
  assert chat["tokens"] == _chat_ids(model, MESSAGES)
  done = _client(server).chat.completions.create(
    model=MODEL, messages=MESSAGES, max_tokens=1
  )
  assert chat["count"] == done.usage.prompt_tokens
  status, bad = post("/detokenize", {"tokens": [model.hparams.vocab]})
  assert status == 400 and "not a token id" in bad["error"]["message"]
  status, bad = post("/tokenize", {"prompt": "a", "messages": MESSAGES})
  assert status == 400 and "one of them" in bad["error"]["message"]


def test_every_field_is_honoured_or_refused_by_name(model, server):
  """stop_token_ids end a completion at that token; unknown fields are 400s
  that name them, the harmless ones (metadata, TGI's do_sample=false) are
  taken; n > 1 streams with its usage."""
  client = _client(server)
  ask = dict(model=MODEL, prompt="The colours of the rainbow are", max_tokens=8)
  whole = client.completions.create(temperature=0, **ask)
  first = model.vocab.encode(whole.choices[0].text)[0]
  cut = client.completions.create(
    temperature=0, extra_body={"stop_token_ids": [first]}, **ask
  )
  assert cut.choices[0].finish_reason == "stop"
  assert len(cut.choices[0].text) < len(whole.choices[0].text)
  for extra, name in (
    ({"foo": 1}, "foo"),
    ({"store": True}, "store"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
  ):
    with pytest.raises(openai.BadRequestError, match=name):
      client.completions.create(extra_body=extra, **ask)
  taken = client.chat.completions.create(
    model=MODEL,
    messages=MESSAGES,
    max_tokens=2,
    metadata={"who": "test"},
    extra_body={"do_sample": False},
  )
  assert taken.choices[0].message.content is not None
  chunks = list(
    client.chat.completions.create(
      model=MODEL,
      messages=MESSAGES,
      max_tokens=4,
      n=2,
      seed=3,
      stream=True,
      stream_options={"include_usage": True},
    )
  )
  usage = chunks[-1].usage
  assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
  assert 0 < usage.completion_tokens <= 8 and usage.prompt_tokens > 0
