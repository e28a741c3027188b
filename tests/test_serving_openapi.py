"""`GET /openapi.json` and schemathesis against the live server from it.

The document is valid OpenAPI 3.1 and lists exactly the routes of
`http.Server.app` (a new route without an entry fails here); then
schemathesis (fixed example counts, derandomized, loopback only) sends
generated valid and invalid requests to every operation of the real
server (`scripts/serve.py`, a tiny random Llama with a ChatML template,
behind an API key): no 5xx, every status and content type documented,
every error body in its API's shape (`openapi.TgiError` off `/v1/`,
`openapi.OpenAIError` on it), and afterwards the server still answers
`/health` and a plain generation.
"""

import json

import hypothesis
import jsonschema
import pydantic
import pytest
import schemathesis
from hypothesis import strategies as st
from schemathesis.specs.openapi.definitions import OPENAPI_31

from chunkwise.serving import http, openapi
from tests import fuzz_inputs
from tests.serving_helpers import running

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL_ID = "tiny"
EXAMPLES = 50  # generated requests per operation


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  """The live server; on teardown (after schemathesis), it must still
  answer /health and generate."""
  directory = tmp_path_factory.mktemp("openapi") / "tiny"
  fuzz_inputs.write_hf_dir(directory)
  with running(
    f"--model={directory}",
    f"--model_id={MODEL_ID}",
    "--slots=4",
    "--max_total_tokens=96",
    "--max_top_n=3",
    f"--api_key={KEY}",
  ) as s:
    yield s
    assert s.get("/health") == (200, b"")
    status, body = s.post(
      "/generate",
      {"inputs": "hello", "parameters": {"max_new_tokens": 4}},
      AUTH,
    )
    assert status == 200, body
    assert json.loads(body)["details"]["generated_tokens"] == 4


def _routes(app) -> set[tuple[str, str]]:
  return {
    (r.method, r.resource.canonical)
    for r in app.router.routes()
    if r.method != "HEAD"  # aiohttp's twin of each GET
  }


def test_document_is_openapi_31_with_every_route(server):
  assert server.get("/openapi.json")[0] == 401  # with a key: it too
  status, body = server.get("/openapi.json", AUTH)
  assert status == 200
  doc = json.loads(body)
  assert doc == openapi.document(models=[MODEL_ID], auth=True)
  jsonschema.Draft202012Validator(OPENAPI_31).validate(doc)
  for schema in doc["components"]["schemas"].values():
    jsonschema.Draft202012Validator.check_schema(schema)
  documented = {
    (method.upper(), path)
    for path, item in doc["paths"].items()
    for method in item
  }
  # the routes need no engine to be listed
  app = http.Server.__new__(http.Server).app()
  assert documented == _routes(app) == openapi.ROUTES
  chat = doc["components"]["schemas"]["ChatBody"]
  assert chat["properties"]["model"]["examples"] == [MODEL_ID]
  assert "messages" in chat["required"]
  generate = doc["paths"]["/generate"]["post"]
  assert generate["security"] == [{"bearer": []}]
  assert doc["paths"]["/health"]["get"]["security"] == []
  assert doc["paths"]["/openapi.json"]["get"]["security"] == [{"bearer": []}]
  assert set(generate["responses"]) == {
    "200",
    "401",
    "403",
    "408",
    "413",
    "415",
    "422",
    "424",
    "429",
    "503",
  }


def _error(path: str, body: bytes) -> str:
  """The message of an error body in the shape of `path`'s API."""
  model = openapi._error_model(path)
  try:
    error = model.model_validate_json(body).error
  except pydantic.ValidationError as e:
    raise AssertionError(
      f"not a {model.__name__}: {e}\n{body[:500]!r}"
    ) from None
  return error if model is openapi.TgiError else error.message


def test_unpaired_surrogates_are_refused(server):
  """JSON can spell an unpaired surrogate, UTF-8 cannot and no tokenizer
  encodes one: refused like any invalid field (it was a plain-text 500;
  schemathesis's generated strings hold none, so it is asked here)."""
  bodies = {
    "/generate": {"inputs": "\udc80", "parameters": {"max_new_tokens": 2}},
    "/v1/completions": {"model": MODEL_ID, "prompt": ["a", "b\ud800"]},
    "/v1/chat/completions": {
      "model": MODEL_ID,
      "messages": [
        {"role": "user", "content": [{"type": "text", "text": "\udfff"}]}
      ],
    },
  }
  where = ["inputs", "prompt[1]", "messages[0].content[0].text"]
  for (path, body), field in zip(bodies.items(), where, strict=True):
    status, out = server.post(path, json.dumps(body).encode(), AUTH)
    assert status == (400 if path.startswith("/v1/") else 422), out
    assert f"{field} holds an unpaired surrogate" in _error(path, out)
  # a pair is one character (an emoji): served
  status, _ = server.post(
    "/generate",
    {"inputs": "\U0001f600", "parameters": {"max_new_tokens": 2}},
    AUTH,
  )
  assert status == 200


def error_shape(ctx, response, case):
  """An error is JSON in its API's shape."""
  if response.status_code < 400:
    return None
  kind = response.headers.get("content-type", [""])[0]
  assert kind.startswith("application/json"), f"an error as {kind!r}"
  _error(case.path, response.content)
  return True


# Loaded from the in-process document, equal to what the live server
# serves (the first test checks that), so that pytest has one test per
# operation at collection. (schemathesis's own `@schema.parametrize()`
# names all its items alike on pytest 9.2, and its fixture-lazy loader
# does not run there: the operations' strategies drive Hypothesis here.)
schema = schemathesis.openapi.from_dict(
  openapi.document(models=[MODEL_ID], auth=True),
  config=schemathesis.Config.from_dict({"headers": AUTH}),
)

# Chat messages as a chat template reads them (the document types them
# only as objects).
MESSAGES = st.lists(
  st.fixed_dictionaries(
    {
      "role": st.sampled_from(["system", "user", "assistant"]),
      "content": st.text(max_size=20),
    }
  ),
  min_size=1,
  max_size=3,
)
REQUIRED = {"inputs", "model", "prompt", "messages", "input", "max_tokens"}


def _few(fields) -> st.SearchStrategy:
  names = sorted(fields) if isinstance(fields, dict) else []
  return st.sets(st.sampled_from(names), max_size=3) if names else st.just(())


def _shape(body: dict, keep, keep_parameters, messages) -> dict:
  out = {k: v for k, v in body.items() if k in REQUIRED or k in keep}
  if isinstance(out.get("parameters"), dict):
    p = out["parameters"]
    out["parameters"] = {k: v for k, v in p.items() if k in keep_parameters}
  if isinstance(out.get("model"), str):
    out["model"] = MODEL_ID
  if isinstance(out.get("messages"), list):
    out["messages"] = messages
  return out


@schema.hook
def before_generate_body(context, strategy):
  # Half the bodies as generated: nearly all of those set some optional
  # field to a value its route refuses, or name an unserved `model`. The
  # other half vary few fields at a time (as schemathesis's coverage
  # phase does) to get further: at most 3 optional fields (and 3
  # `parameters`), the served `model`, `messages` a conversation.
  def shaped(body):
    if not isinstance(body, dict):
      return st.just(body)
    parts = (_few(body), _few(body.get("parameters")), MESSAGES)
    return st.tuples(*parts).map(lambda t: _shape(body, *t))

  return st.one_of(strategy, strategy.flatmap(shaped))


CHECKS = [
  schemathesis.checks.not_a_server_error,
  schemathesis.checks.status_code_conformance,
  schemathesis.checks.content_type_conformance,
  schemathesis.checks.response_schema_conformance,
  error_shape,
]


OPERATIONS = sorted(openapi.ROUTES)


@pytest.mark.parametrize(
  "method, path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS]
)
def test_schemathesis(server, method, path):
  """EXAMPLES requests, valid and invalid, derandomized: no 5xx, each
  status and content type documented, errors in their API's shape."""
  operation = schema[path][method]
  modes = [
    schemathesis.GenerationMode.POSITIVE,
    schemathesis.GenerationMode.NEGATIVE,
  ]
  cases = st.one_of([operation.as_strategy(mode) for mode in modes])

  @hypothesis.settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(hypothesis.HealthCheck),
  )
  @hypothesis.given(cases)
  def run(case):
    case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)

  run()
