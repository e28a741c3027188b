"""Starting the real server (`scripts/serve.py`) for tests: a subprocess
on a free loopback port, stopped with SIGTERM (its exit code checked)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Annotated

import pydantic

ROOT = pathlib.Path(__file__).parents[1]
_READY = re.compile(r"chunkwise serving on (http://127\.0\.0\.1:\d+)")


class Server:
  """A running `scripts/serve.py`: `url`, `log()`, `stop()`."""

  def __init__(self, *flags: str, timeout: float = 240.0, env=None):
    env = dict(env or os.environ, PYTHONUNBUFFERED="1")
    if not any(f.startswith("--state_dir") for f in flags):
      # stored responses in a directory of the test's, not ~/.cache
      self._state = tempfile.TemporaryDirectory(prefix="cw-state-")
      env.setdefault("CHUNKWISE_STATE_DIR", self._state.name)
    self.proc = subprocess.Popen(
      [sys.executable, str(ROOT / "scripts" / "serve.py"), "--port=0", *flags],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      cwd=ROOT,
      env=env,
    )
    self._lines: list[str] = []
    found = threading.Event()
    self.url = None

    def read():
      for line in self.proc.stdout:
        self._lines.append(line)
        m = _READY.search(line)
        if m and self.url is None:
          self.url = m.group(1)
          found.set()
      found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(timeout) or self.url is None:
      self.proc.kill()
      raise RuntimeError(f"the server did not start:\n{self.log()}")

  def log(self) -> str:
    return "".join(self._lines)

  def stop(self, timeout: float = 60.0) -> int:
    """SIGTERM; waits for the exit code."""
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(timeout)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    return self.proc.returncode

  def get(self, path: str, headers=None) -> tuple[int, bytes]:
    return request(self.url + path, headers=headers)

  def post(self, path: str, body, headers=None) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request(
      self.url + path,
      data=data,
      headers={"Content-Type": "application/json", **(headers or {})},
    )

  def metric(self, name: str, headers=None) -> float:
    """The first sample of `name` in /metrics."""
    _, text = self.get("/metrics", headers)
    for line in text.decode().splitlines():
      if line.startswith(name) and not line.startswith("#"):
        return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)

  def wait_for(self, name: str, value: float, headers=None, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.metric(name, headers) == value:
        return
      time.sleep(0.05)
    raise AssertionError(f"{name} != {value} after {timeout} s")


def alive(pid: int) -> bool:
  """Whether process `pid` exists (not yet reaped)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def request(url: str, data=None, headers=None) -> tuple[int, bytes]:
  req = urllib.request.Request(url, data=data, headers=headers or {})
  try:
    with urllib.request.urlopen(req, timeout=120) as r:
      return r.status, r.read()
  except urllib.error.HTTPError as e:
    return e.code, e.read()


def served_as(path, model_id: str) -> tuple[str, str]:
  """Server flags that serve the checkpoint at `path` under `model_id`
  (e.g. conftest's `smollm2_first_layers` as "smollm2-135m")."""
  return f"--model={path}", f"--model_id={model_id}"


@contextlib.contextmanager
def running(*flags: str, env=None):
  server = Server(*flags, env=env)
  try:
    yield server
  finally:
    code = server.stop()
    assert code == 0, f"the server exited {code}:\n{server.log()[-3000:]}"


def run_weather_agent(client, model_class: str, model: str) -> None:
  """`openai-agents` runs one agent with one function tool against the
  server (`client`'s) to completion, through `agents.<model_class>`
  (OpenAIChatCompletionsModel, or OpenAIResponsesModel: its default)."""
  import agents
  import openai

  agents.set_tracing_disabled(True)
  calls = []

  # (a city is short: its length is bounded, so that the call closes well
  # within max_tokens whatever the model; conftest's 4-layer SmolLM2
  # would otherwise spell a city until the budget closes it)
  @agents.function_tool
  def get_weather(city: Annotated[str, pydantic.Field(max_length=24)]) -> str:
    """The current weather in a city."""
    calls.append(city)
    return f"18 degrees and sunny in {city}"

  agent = agents.Agent(
    name="weather",
    instructions="Answer with the weather tool.",
    tools=[get_weather],
    model=getattr(agents, model_class)(
      model=model,
      openai_client=openai.AsyncOpenAI(
        base_url=str(client.base_url), api_key="-", max_retries=0
      ),
    ),
    model_settings=agents.ModelSettings(
      tool_choice="required",
      parallel_tool_calls=False,
      temperature=0,
      max_tokens=80,
    ),
    tool_use_behavior="stop_on_first_tool",
  )
  result = agents.Runner.run_sync(agent, "What is the weather in Paris?")
  assert len(calls) == 1
  assert result.final_output == f"18 degrees and sunny in {calls[0]}"
