"""A server compiles before it serves: /health answers 503 "starting"
until the engine has warmed up (generation routes too), and after that no
request compiles anything, whatever its length, company, constraint or
scoring; a restart loads every program from the persistent compilation
cache (scripts/serve.py, `serving.Engine`, `LiveSlots.warm_up`)."""

import concurrent.futures
import json
import os
import re
import threading

import numpy as np
import openai
import pytest

import chunkwise as cw
from chunkwise import serving
from chunkwise.inference.batching import admission
from chunkwise.inference.engines.engine import compiled_programs
from tests.serving_helpers import Server, request


def test_health_says_starting_until_the_engine_is_ready(monkeypatch, tiny):
  """While the warm-up runs (held here), /health is 503 "starting" and a
  generation is refused with 503; then 200, and the request runs."""
  from chunkwise.inference.batching import live

  go = threading.Event()
  warm = live.LiveSlots.warm_up

  def held(self):
    go.wait(60)
    return warm(self)

  monkeypatch.setattr(live.LiveSlots, "warm_up", held)
  engine = serving.Engine(tiny, slots=2, capacity=64, top_n=0)
  ctx = serving.Context(
    engine=engine, model_id="tiny", max_input_tokens=32, max_total_tokens=64
  )
  running = serving.Background(ctx, wait_ready=False)
  try:
    status, body = request(running.url + "/health")
    assert status == 503 and json.loads(body)["error"] == "starting"
    status, body = request(
      running.url + "/generate",
      data=json.dumps(
        {"inputs": "a", "parameters": {"max_new_tokens": 2}}
      ).encode(),
      headers={"Content-Type": "application/json"},
    )
    assert status == 503 and b"starting" in body
    go.set()
    assert engine.wait_ready(120) and engine.warmup.requests > 0
    assert request(running.url + "/health")[0] == 200
    status, _ = request(
      running.url + "/generate",
      data=json.dumps(
        {"inputs": "a", "parameters": {"max_new_tokens": 2}}
      ).encode(),
      headers={"Content-Type": "application/json"},
    )
    assert status == 200
  finally:
    go.set()
    running.stop()


def test_after_warm_up_the_live_loop_compiles_nothing(tiny):
  """`LiveSlots.warm_up`, then requests of every prompt bucket, alone and
  together, constrained or not, a long one in pieces: the engines compile
  no new program (the library's loop, as the server's)."""
  model = tiny.with_prefill_chunk(64)
  loop = model.live_slots(slots=4, capacity=256, every=2, top_n=2)
  report = loop.warm_up()
  assert report.slot_buckets == (1, 2, 4)
  assert report.prompt_buckets == (8, 16, 32, 64) and report.pieces
  engines = (loop.shape.prefill_engine, loop.shape.generate_engine)
  before = [compiled_programs(e) for e in engines]
  admits = admission.admit_programs()
  rng = np.random.default_rng(0)
  vocab = model.hparams.vocab
  lengths = [3, 9, 20, 40, 64, 150, 5, 30, 10, 12, 33, 50, 6, 7, 8]
  # alone; three buckets at once; mixed; two pairs (a call each); three
  # of one bucket (one call)
  for n in (
    lengths[:1],
    lengths[1:4],
    lengths[4:8],
    lengths[8:12],
    lengths[12:],
  ):
    for j, length in enumerate(n):
      loop.add(
        (length, j),
        loop.prepare(
          cw.Request(
            tokens=rng.integers(3, vocab, length).tolist(),
            sample_id=length,
            steps=5,
            constraint=cw.constraints.Regex("[0-9]+") if j == 1 else None,
          )
        ),
      )
    while loop.busy:
      loop.step()
  assert [compiled_programs(e) for e in engines] == before
  assert admission.admit_programs() == admits


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("compilation_cache"))


FLAGS = ("--model=random:tiny", "--slots=3", "--max_total_tokens=512")


def _server(cache_dir):
  env = dict(os.environ, JAX_LOG_COMPILES="1")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the flag's, not the tests'
  return Server(*FLAGS, f"--compilation_cache={cache_dir}", env=env)


def _warm_up_line(log: str) -> str:
  lines = [line for line in log.splitlines() if "warm-up done" in line]
  assert len(lines) == 1, log[-3000:]
  return lines[0]


def test_a_served_request_compiles_nothing_and_a_restart_loads_it_all(
  cache_dir,
):
  """scripts/serve.py on a fresh compilation cache: once it says it
  serves, requests of every length, three at once, a JSON schema, and
  echo scoring log no compile (JAX_LOG_COMPILES); started again on the
  same cache, its warm-up compiles nothing: every program is loaded."""
  s = _server(cache_dir)
  try:
    first = _warm_up_line(s.log())
    assert re.search(r", [1-9]\d* compiled into it", first), first
    mark = len(s.log())
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="-")

    def ask(prompt, **kw):
      kw = {"max_tokens": 6, **kw}
      return client.completions.create(
        model="random:tiny", prompt=prompt, seed=1, **kw
      )

    ask("a")
    # (no two start alike: a prefix-cache hit's prefill compiles in the
    # background, logged too; tests/test_prefix_cache.py checks it)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
      list(pool.map(lambda n: ask(f"{n} " * n), (3, 30, 90)))
    ask("x" * 400, max_tokens=2)
    ask("abc", max_tokens=0, echo=True, logprobs=2)
    status, _ = s.post(
      "/generate",
      {
        "inputs": "json:",
        "parameters": {
          "max_new_tokens": 24,
          "grammar": {
            "type": "json",
            "value": {
              "type": "object",
              "properties": {"a": {"type": "integer"}},
              "required": ["a"],
            },
          },
        },
      },
    )
    assert status == 200
    compiles = [
      line for line in s.log()[mark:].splitlines() if "Compiling" in line
    ]
    assert not compiles, "\n".join(compiles)
  finally:
    assert s.stop() == 0
  again = _server(cache_dir)
  try:
    line = _warm_up_line(again.log())
    assert ", 0 compiled into it" in line, line
    assert re.search(r"XLA: [1-9]\d* loaded", line), line
  finally:
    assert again.stop() == 0
