"""The HTTP server with the clients users have (lorax-client,
text-generation, openai), as a user runs them: `scripts/serve.py` in a
subprocess on a loopback port, a tiny random model with two LoRA adapters
saved by `cw.save`. Every response is checked against `generate` (or
`prefill`) run offline on the same request."""

import asyncio
import json
import re
import signal
import time

import jsonschema
import lorax
import numpy as np
import openai
import pytest
import text_generation

import chunkwise as cw
from chunkwise import serving
from tests.serving_helpers import running
from tests.test_adapters import random_adapter
from tests.test_serving_engine import _alone

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCHEMA = {
  "type": "object",
  "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
  "required": ["ok", "n"],
  "additionalProperties": False,
}
ENUM = {
  "type": "object",
  "properties": {"k": {"enum": ["ab", "cd"]}},
  "required": ["k"],
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """The tiny model with adapters "a" and "b", saved and loaded back (what
  the server loads)."""
  h = cw.configs.get("tiny")
  model = cw.InferenceModel.random(h, seed=0).with_adapters(
    {"a": random_adapter(h, 4, 1), "b": random_adapter(h, 2, 2)}
  )
  directory = tmp_path_factory.mktemp("served") / "tiny"
  cw.save(model, directory)
  return directory, cw.load(str(directory))


@pytest.fixture(scope="module")
def server(saved):
  directory, _ = saved
  with running(
    f"--model={directory}",
    "--model_id=tiny",
    "--slots=4",
    "--max_total_tokens=160",
    "--max_top_n=5",
    f"--api_key={KEY}",
    "--every=4",
  ) as s:
    yield s


def _g(model, text, **kw):
  return serving.Generation(
    prompt=[model.bos_id, *model.vocab.encode(text)], **kw
  )


def _offline(model, text, *, seed=None, **kw):
  g = _g(model, text, **kw)
  return _alone(model, g, 0 if seed is None else seed)


def test_lorax_generate_with_adapter_details_and_prefill(saved, server):
  _, model = saved
  client = lorax.Client(server.url, headers=AUTH)
  r = client.generate(
    "hello there",
    adapter_id="a",
    max_new_tokens=12,
    return_k_alternatives=3,
    decoder_input_details=True,
  )
  ids, scores, top = _offline(
    model, "hello there", max_new_tokens=12, temperature=0, adapter="a", top_n=3
  )
  d = r.details
  got = [t for t in d.tokens if not t.special]
  assert [t.id for t in got] == ids
  np.testing.assert_array_equal(np.float32([t.logprob for t in got]), scores)
  assert [[a.id for a in t.alternative_tokens] for t in got] == top.tolist()
  assert r.generated_text == "".join(t.text for t in got)
  assert d.prompt_tokens == len(model.vocab.encode("hello there")) + 1
  assert d.seed is None  # greedy
  # decoder_input_details: the prompt's log-probs, first one null.
  prompt = [model.bos_id, *model.vocab.encode("hello there")]
  want = model.prefill(
    cw.Chunk(tokens=np.array([prompt]), lengths=np.array([len(prompt)])),
    adapters="a",
  ).per_token_scores[0]
  assert [t.id for t in d.prefill] == prompt
  assert d.prefill[0].logprob is None
  np.testing.assert_array_equal(
    np.float32([t.logprob for t in d.prefill[1:]]), np.asarray(want)[1:]
  )


def test_tgi_sampled_with_seed_and_top_n_tokens(saved, server):
  _, model = saved
  client = text_generation.Client(server.url, headers=AUTH, timeout=60)
  r = client.generate(
    "abc",
    max_new_tokens=10,
    do_sample=True,
    temperature=0.8,
    top_k=40,
    seed=77,
    top_n_tokens=2,
    repetition_penalty=1.3,
  )
  ids, _, top = _offline(
    model,
    "abc",
    seed=77,
    max_new_tokens=10,
    temperature=0.8,
    top_k=40,
    repetition_penalty=1.3,
    top_n=2,
  )
  got = [t for t in r.details.tokens if not t.special]
  assert [t.id for t in got] == ids
  assert r.details.seed == 77
  assert [[t.id for t in tt] for tt in r.details.top_tokens[: len(ids)]] == (
    top.tolist()
  )
  # Without a seed one is drawn and reported: replaying it gives the same.
  first = client.generate("abc", max_new_tokens=8, do_sample=True)
  again = client.generate(
    "abc", max_new_tokens=8, do_sample=True, seed=first.details.seed
  )
  assert again.generated_text == first.generated_text


def test_requests_that_start_alike_reuse_the_cached_pages(saved, server):
  """Prompts with one system prompt: the next of each adapter reuses the
  first's cached pages (/metrics counts them), once the prefill after a
  cached start of that width has compiled (meanwhile a hit is served as a
  miss, never waiting for it: `batching/heads.py`), and every response is
  still `generate` alone on its request."""
  _, model = saved
  system = (
    "You are a terse assistant: answer each question in one word, "
    "lower case, and never explain. "
  )
  client = lorax.Client(server.url, headers=AUTH)

  def hits():
    return server.metric("vllm:prefix_cache_hits", AUTH)

  def requests_hit():
    return server.metric(
      'chunkwise_prefix_cache_requests_total{model_name="tiny",result="hit"}',
      AUTH,
    )

  n = 1 + len(model.vocab.encode(system + "sky?"))
  assert 80 < n <= 128  # one full page of the default 64 tokens

  def ask(q, adapter):
    r = client.generate(
      system + q, max_new_tokens=6, adapter_id=adapter, details=True
    )
    ids, _, _ = _offline(
      model, system + q, max_new_tokens=6, temperature=0, adapter=adapter
    )
    assert [t.id for t in r.details.tokens if not t.special] == ids, q

  for first, then, adapter in (("sky?", "sea?", None), ("sun?", "x?", "a")):
    ask(first, adapter)
    before = hits(), requests_hit()
    deadline = time.monotonic() + 120
    while hits() == before[0]:  # a miss until its program compiled
      assert time.monotonic() < deadline, "no hit within 120 s"
      ask(then, adapter)
    assert hits() - before[0] == 64
    assert requests_hit() - before[1] == 1


def test_streams_equal_the_whole_response(saved, server):
  _, model = saved
  tgi = text_generation.Client(server.url, headers=AUTH, timeout=60)
  whole = tgi.generate("stream me", max_new_tokens=15)
  events = list(tgi.generate_stream("stream me", max_new_tokens=15))
  assert [e.token.id for e in events] == [t.id for t in whole.details.tokens]
  assert all(e.generated_text is None for e in events[:-1])
  assert events[-1].generated_text == whole.generated_text
  assert events[-1].details.generated_tokens == len(events)
  joined = "".join(e.token.text for e in events if not e.token.special)
  assert joined == whole.generated_text

  lx = lorax.Client(server.url, headers=AUTH)
  events = list(
    lx.generate_stream("stream me", max_new_tokens=15, adapter_id="b")
  )
  ids, _, _ = _offline(
    model, "stream me", max_new_tokens=15, temperature=0, adapter="b"
  )
  assert [e.token.id for e in events if not e.token.special] == ids
  assert events[-1].details.prompt_tokens == len("stream me") + 1

  async def read():
    out = []
    async for e in lorax.AsyncClient(server.url, headers=AUTH).generate_stream(
      "stream me", max_new_tokens=15, adapter_id="b"
    ):
      out.append(e.token.id)
    return out

  assert asyncio.run(read()) == [e.token.id for e in events]


def test_response_format_and_grammar_constrain(saved, server):
  lx = lorax.Client(server.url, headers=AUTH)
  r = lx.generate(
    "json:",
    max_new_tokens=60,
    response_format={"type": "json_object", "schema": SCHEMA},
  )
  if r.details.finish_reason == "eos_token":
    jsonschema.validate(json.loads(r.generated_text), SCHEMA)
  else:  # cut by max_new_tokens: still a prefix of a valid document
    assert r.generated_text.startswith("{")
  tgi = text_generation.Client(server.url, headers=AUTH, timeout=60)
  r = tgi.generate(
    "code:",
    max_new_tokens=20,
    grammar=text_generation.types.Grammar(
      type="regex", value="[0-9]{3}-[a-z]{2}"
    ),
  )
  assert r.details.finish_reason == "eos_token"
  import re

  assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.generated_text)


def test_vllm_whitespace_pattern_writes_compact_json(saved, server):
  """vLLM's `guided_whitespace_pattern` / `structured_outputs.
  whitespace_pattern`: "" writes JSON with no whitespace between tokens;
  a pattern this server does not take, or one without a JSON schema, is
  a 400 naming it."""
  oa = _openai(server)
  # The same greedy request with the default pattern writes a space.
  r = oa.completions.create(
    model="tiny",
    prompt="json:",
    max_tokens=60,
    temperature=0,
    extra_body={"guided_json": SCHEMA},
  )
  assert " " in r.choices[0].text, r.choices[0].text
  for extra in (
    {"guided_json": SCHEMA, "guided_whitespace_pattern": ""},
    {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": ""}},
  ):
    r = oa.completions.create(
      model="tiny",
      prompt="json:",
      max_tokens=60,
      temperature=0,
      extra_body=extra,
    )
    text = r.choices[0].text
    assert " " not in text and text.startswith('{"ok":'), text
    if r.choices[0].finish_reason == "stop":
      jsonschema.validate(json.loads(text), SCHEMA)
  for extra, match in (
    (
      {"guided_json": SCHEMA, "guided_whitespace_pattern": "[ \\n]*"},
      "guided_whitespace_pattern=",
    ),
    (
      {"guided_regex": "[a-c]+", "guided_whitespace_pattern": ""},
      "applies to a JSON schema",
    ),
  ):
    with pytest.raises(openai.BadRequestError, match=re.escape(match)):
      oa.completions.create(
        model="tiny", prompt="x", max_tokens=3, extra_body=extra
      )


def test_stop_strings_native_keep_openai_cut(saved, server):
  _, model = saved
  ids, _, _ = _offline(model, "q", max_new_tokens=30, temperature=0)
  text = _text(model, ids)
  stop = next(
    text[k : k + 2]
    for k in range(2, len(text) - 2)
    if text[k : k + 2] not in text[: k + 1] and "\ufffd" not in text[k : k + 2]
  )
  tgi = text_generation.Client(server.url, headers=AUTH, timeout=60)
  r = tgi.generate("q", max_new_tokens=30, stop_sequences=[stop])
  assert r.details.finish_reason == "stop_sequence"
  assert r.generated_text == text[: text.index(stop) + len(stop)]
  oa = openai.OpenAI(
    base_url=server.url + "/v1",
    api_key=KEY,
    max_retries=0,
    _strict_response_validation=True,
  )
  c = oa.completions.create(
    model="tiny", prompt="q", max_tokens=30, stop=stop, temperature=0
  )
  assert c.choices[0].text == text[: text.index(stop)]
  assert c.choices[0].finish_reason == "stop"
  pieces = [
    ch.choices[0].text
    for ch in openai.OpenAI(
      base_url=server.url + "/v1", api_key=KEY, max_retries=0
    ).completions.create(
      model="tiny",
      prompt="q",
      max_tokens=30,
      stop=[stop],
      stream=True,
      temperature=0,
    )
  ]
  assert "".join(pieces) == text[: text.index(stop)]


def _openai(server, **kw):
  return openai.OpenAI(
    base_url=server.url + "/v1",
    api_key=KEY,
    max_retries=0,
    _strict_response_validation=True,
    **kw,
  )


def test_openai_completions_echo_scores_and_adapters(saved, server):
  _, model = saved
  oa = _openai(server)
  prompt = [model.bos_id, *model.vocab.encode("score this")]
  for name, adapter in (("tiny", None), ("a", "a")):
    c = oa.completions.create(
      model=name, prompt="score this", max_tokens=0, echo=True, logprobs=3
    )
    lp = c.choices[0].logprobs
    r = model.prefill(
      cw.Chunk(tokens=np.array([prompt]), lengths=np.array([len(prompt)])),
      top_n=3,
      adapters=adapter,
    )
    assert c.choices[0].text == "score this"
    assert "".join(lp.tokens) == "score this"
    np.testing.assert_array_equal(
      np.float32(lp.token_logprobs), np.asarray(r.per_token_scores)[0, 1:]
    )
    assert c.model == name and c.usage.prompt_tokens == len(prompt)
  # n samples of one seed: sample ids 0 .. n-1.
  c = oa.completions.create(
    model="b", prompt="n", max_tokens=9, n=3, seed=5, temperature=1.0
  )
  for j, choice in enumerate(c.choices):
    g = _g(
      model, "n", max_new_tokens=9, temperature=1.0, sample_id=j, adapter="b"
    )
    assert choice.text == _text(model, _alone(model, g, 5)[0])
  assert [m.id for m in oa.models.list().data] == ["tiny", "a", "b"]
  assert oa.models.retrieve("b").parent == "tiny"
  # Streaming (the openai client's stream type has no null finish_reason
  # in strict mode, which OpenAI itself sends until the last chunk).
  stream = openai.OpenAI(
    base_url=server.url + "/v1", api_key=KEY, max_retries=0
  ).completions.create(
    model="a",
    prompt="x",
    max_tokens=7,
    seed=3,
    stream=True,
    stream_options={"include_usage": True},
    logprobs=2,
  )
  chunks = list(stream)
  assert chunks[-1].usage.completion_tokens == 7 and not chunks[-1].choices
  assert chunks[-2].choices[0].finish_reason == "length"
  ids, scores, _ = _offline(
    model, "x", seed=3, max_new_tokens=7, temperature=1, adapter="a"
  )
  text = "".join(ch.choices[0].text for ch in chunks[:-1])
  assert text == _text(model, ids)
  logprobs = [
    lp
    for ch in chunks[:-1]
    if ch.choices[0].logprobs  # the last: only the finish reason
    for lp in ch.choices[0].logprobs.token_logprobs
  ]
  np.testing.assert_array_equal(np.float32(logprobs), scores)


def _text(model, ids):
  d = serving.text.Detokenizer(model.vocab, specials=model.eos_ids)
  return "".join(d.add(i) for i in ids) + d.flush()


def test_errors_reach_each_client_as_its_exception(saved, server):
  lx = lorax.Client(server.url, headers=AUTH)
  with pytest.raises(lorax.errors.ValidationError, match="max_new_tokens"):
    lx.generate("x", max_new_tokens=100000)
  with pytest.raises(lorax.errors.ValidationError, match="unknown adapter"):
    lx.generate("x", max_new_tokens=3, adapter_id="nope")
  with pytest.raises(lorax.errors.ValidationError, match=r"grammar|schema"):
    lx.generate(
      "x",
      max_new_tokens=3,
      response_format={"type": "json_object", "schema": {"type": "nonsense"}},
    )
  tgi = text_generation.Client(server.url, headers=AUTH, timeout=60)
  with pytest.raises(text_generation.errors.ValidationError, match="stop"):
    tgi.generate("x", max_new_tokens=3, stop_sequences=["a"] * 20)
  with pytest.raises(text_generation.errors.ValidationError, match="top_n"):
    tgi.generate("x", max_new_tokens=3, top_n_tokens=50)
  status, body = server.post(
    "/generate_stream",
    {"inputs": "x", "parameters": {"decoder_input_details": True}},
    AUTH,
  )
  assert status == 422 and "decoder_input_details" in json.loads(body)["error"]
  oa = _openai(server)
  with pytest.raises(openai.NotFoundError, match="does not exist"):
    oa.completions.create(model="nope", prompt="x", max_tokens=3)
  with pytest.raises(openai.BadRequestError, match="top_logprobs"):
    oa.chat.completions.create(
      model="tiny", messages=[{"role": "user", "content": "x"}], top_logprobs=3
    )
  with pytest.raises(openai.BadRequestError, match="max_input_tokens"):
    oa.completions.create(model="tiny", prompt="x" * 500, max_tokens=3)
  with pytest.raises(openai.AuthenticationError):
    openai.OpenAI(
      base_url=server.url + "/v1", api_key="wrong", max_retries=0
    ).models.list()
  # Raw HTTP: every error is JSON in its API's shape.
  for path in ("/generate", "/"):  # POST / generates: it needs the key too
    status, body = server.post(path, {"inputs": "x"})
    assert status == 401 and "API key" in json.loads(body)["error"]
  assert server.get("/")[0] == server.get("/health")[0] == 200
  status, body = server.post("/generate", b"{" * 100, AUTH)
  assert status == 422 and json.loads(body)["error_type"] == "validation"
  status, body = server.post("/generate", b"[" * 200 + b"]" * 200, AUTH)
  assert status == 422 and "deeper" in json.loads(body)["error"]
  status, body = server.post("/generate", b"x" * (5 << 20), AUTH)
  assert status == 413 and "larger" in json.loads(body)["error"]
  status, body = server.post("/v1/nothing", {}, AUTH)
  assert status == 404 and json.loads(body)["error"]["code"] == 404
  status, body = server.get("/generate", AUTH)
  assert status == 405 and "error" in json.loads(body)
  assert server.get("/health")[0] == 200 and server.get("/")[0] == 200
  status, body = server.get("/info", AUTH)
  assert json.loads(body)["max_total_tokens"] == 160


def test_sixteen_concurrent_streams_equal_generate_alone(saved, server):
  """16 streaming requests at once through the async clients (native and
  OpenAI), mixing adapters, constraints, greedy and sampled: each one's
  tokens equal `generate` alone on it."""
  _, model = saved
  cases = []
  for i in range(16):
    cases.append(
      dict(
        text=f"req {i:02d}",  # one prompt length: fewer offline compiles
        adapter=[None, "a", "b"][i % 3],
        temperature=[0.0, 0.9][i % 2],
        seed=100 + i,
        regex="[a-d]{2,6}!" if i % 5 == 3 else None,
        steps=[6, 13, 20][i % 3],
        native=i % 2 == 0,
      )
    )

  async def one(c):
    if c["native"]:
      client = lorax.AsyncClient(server.url, headers=AUTH, timeout=120)
      kw = dict(
        max_new_tokens=c["steps"],
        adapter_id=c["adapter"],
        seed=c["seed"],
      )
      if c["temperature"]:
        kw.update(do_sample=True, temperature=c["temperature"])
      if c["regex"]:  # the native clients' constraint: a JSON schema
        kw.update(response_format={"type": "json_object", "schema": ENUM})
      out = []
      async for e in client.generate_stream(c["text"], **kw):
        if not e.token.special:
          out.append(e.token.id)
      return out
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY)
    extra = (
      {"structured_outputs": {"regex": c["regex"]}} if c["regex"] else None
    )
    stream = await client.completions.create(
      model=c["adapter"] or "tiny",
      prompt=c["text"],
      max_tokens=c["steps"],
      temperature=c["temperature"],
      seed=c["seed"],
      stream=True,
      logprobs=0,
      extra_body=extra,
    )
    out = []
    async for chunk in stream:
      for choice in chunk.choices:
        if choice.logprobs and choice.logprobs.tokens:
          out.append("".join(choice.logprobs.tokens))
    return "".join(out)

  async def run_all():
    return await asyncio.gather(*(one(c) for c in cases))

  results = asyncio.run(run_all())
  for c, got in zip(cases, results, strict=True):
    constraint = None
    if c["regex"]:
      constraint = (
        cw.constraints.JsonSchema(ENUM)
        if c["native"]
        else cw.constraints.Regex(c["regex"])
      )
    ids, _, _ = _offline(
      model,
      c["text"],
      seed=c["seed"],
      max_new_tokens=c["steps"],
      temperature=c["temperature"],
      adapter=c["adapter"],
      constraint=constraint,
    )
    assert got == (ids if c["native"] else _text(model, ids)), c
  server.wait_for("vllm:num_requests_running", 0.0, AUTH)
  # each constrained request's compile was timed (before it was queued)
  compiled = server.metric("chunkwise:constraint_compile_seconds_count", AUTH)
  assert compiled >= sum(bool(c["regex"]) for c in cases)
  assert server.metric("chunkwise:constraint_compile_seconds_sum", AUTH) > 0


def test_a_client_that_goes_away_frees_its_slot(saved, server):
  import http.client
  import urllib.parse

  # One request that finishes, with adapter "a" (the metrics below).
  lorax.Client(server.url, headers=AUTH).generate(
    "x", max_new_tokens=3, adapter_id="a"
  )
  u = urllib.parse.urlparse(server.url)
  conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
  body = json.dumps(
    {"inputs": "long", "parameters": {"max_new_tokens": 150}, "stream": True}
  )
  conn.request(
    "POST",
    "/generate_stream",
    body,
    {"Content-Type": "application/json", **AUTH},
  )
  response = conn.getresponse()
  assert response.status == 200
  assert response.readline().startswith(b"data:")
  assert server.metric("vllm:num_requests_running", AUTH) >= 1
  conn.sock.close()
  conn.close()
  server.wait_for("vllm:num_requests_running", 0.0, AUTH)
  _, text = server.get("/metrics", AUTH)
  text = text.decode()
  for name in (
    "tgi_request_count",
    "tgi_request_failure",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:prefix_cache_queries_total",
    "chunkwise_prefix_cache_bytes",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "tgi_queue_size",
    'chunkwise_adapter_requests{adapter="a"',
  ):
    assert name in text, name
  assert 'err="cancelled"' in text


def _read_events(response, into: list):
  for line in response:
    if line.startswith(b"data:"):
      into.append(json.loads(line[5:]))


def test_overload_429_then_sigterm_drains_and_exits_0():
  """One slot and a queue of one: a third request is refused with 429
  (each client's overload exception, Retry-After set); SIGTERM refuses new
  requests with 503, lets the running and the waiting one finish, exits 0."""
  import http.client
  import threading
  import urllib.parse

  with running(
    "--model=random:tiny",
    "--slots=1",
    "--max_queue=1",
    "--every=1",
    "--max_total_tokens=512",
    "--grace=60",
  ) as s:
    u = urllib.parse.urlparse(s.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request(
      "POST",
      "/generate_stream",
      json.dumps({"inputs": "a", "parameters": {"max_new_tokens": 500}}),
      {"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    events: list = []
    reader = threading.Thread(target=_read_events, args=(response, events))
    reader.start()
    waiting: list = []
    queued = threading.Thread(
      target=lambda: waiting.append(
        lorax.Client(s.url, timeout=120).generate("b", max_new_tokens=20)
      )
    )
    queued.start()
    s.wait_for("tgi_queue_size", 1.0)
    with pytest.raises(lorax.errors.OverloadedError):
      lorax.Client(s.url).generate("c", max_new_tokens=2)
    with pytest.raises(openai.RateLimitError) as e:
      openai.OpenAI(
        base_url=s.url + "/v1", api_key="-", max_retries=0
      ).completions.create(model="random:tiny", prompt="c", max_tokens=2)
    assert e.value.response.headers["Retry-After"] == "1"
    assert len(events) < 450, "the stream ended before SIGTERM"
    s.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while s.get("/health")[0] != 503 and time.monotonic() < deadline:
      time.sleep(0.01)
    status, body = s.post("/generate", {"inputs": "d"})
    assert status == 503 and json.loads(body)["error_type"] == "healthcheck"
    assert len(events) < 500, "the stream ended before the 503"
    code = s.stop()
    reader.join(60)
    queued.join(60)
    assert code == 0, s.log()[-2000:]
    assert events[-1]["details"]["finish_reason"] in ("length", "eos_token")
    assert len(events) == events[-1]["details"]["generated_tokens"]
    assert waiting and waiting[0].details.generated_tokens >= 1
    assert "shutting down" in s.log()


def test_unbounded_numbers_get_a_digit_limit():
  from chunkwise.serving.api import MAX_DIGITS, digit_bounded

  big = 10**MAX_DIGITS - 1
  schema = {
    "type": "object",
    "properties": {
      "n": {"type": "integer"},
      "x": {"type": ["number", "null"]},
      "kept": {"type": "integer", "minimum": 0, "maximum": big},
      "step": {"type": "integer", "multipleOf": 5},
      "items": {"type": "array", "items": {"type": "number"}},
      "type": {"type": "string"},  # a property named "type"
      "half": {"type": "integer", "minimum": 0},
      "huge": {"type": "integer", "minimum": 10**20},
    },
    "$defs": {"d": {"type": "integer"}},
    "enum": [{"type": "integer"}],
  }
  out = digit_bounded(schema)
  p = out["properties"]
  for got in (p["n"], p["x"], p["items"]["items"], out["$defs"]["d"]):
    assert (got["minimum"], got["maximum"]) == (-big, big)
  assert p["kept"] == {"type": "integer", "minimum": 0, "maximum": big}
  assert p["half"] == {"type": "integer", "minimum": 0, "maximum": big}
  assert p["huge"] == {"type": "integer", "minimum": 10**20}  # not emptied
  assert p["type"] == {"type": "string"}
  assert p["step"] == {"type": "integer", "multipleOf": 5}
  assert out["enum"] == [{"type": "integer"}]  # data, untouched
  assert "minimum" not in schema["properties"]["n"]  # a copy
