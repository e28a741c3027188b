"""Tool calls that are valid by construction, against calls parsed after
the fact: a fixed set of tool-calling prompts (three tools with nested
argument schemas: enums, patterns, bounds) sent to `scripts/serve.py`,
sampled at temperature 1 over `--seeds` seeds, for each of

  required       tool_choice "required" (the automaton's language)
  auto           tool_choice "auto" (text, or calls)
  unconstrained  the same prompt (the fallback's tool text in the system
                 turn) decoded freely, then its <tool_call> blocks parsed
                 as parser-based servers do

and the calls made, the calls valid (JSON, a defined tool, arguments
valid against its schema with `jsonschema`), and answers with no call.
Then the wait before a request's first streamed token (its tools'
constraint compiled: cold, a tool set never seen; cached, the same again).

  python scripts/tool_calls_quality.py --seeds=50 --output=tools.json

The server runs on 127.0.0.1 with the constraint disk cache off (cold
means cold), `--slots` requests at a time; it stops when the run ends.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request

import jsonschema
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from chunkwise.serving import tools as tool_plans

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "The served model.")
_SEEDS = flags.DEFINE_integer("seeds", 50, "Seeds per prompt and mode.", 1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 160, "max_tokens.", 16)
_SLOTS = flags.DEFINE_integer("slots", 8, "Requests at a time.", 1)
_COLD = flags.DEFINE_integer("compile_runs", 3, "Cold and cached waits.", 1)
_PROMPTS = flags.DEFINE_integer(
  "prompts", 4, "How many of the fixed prompts to send (at most 4).", 1, 4
)
_MODES = flags.DEFINE_list(
  "modes", ["required", "auto", "unconstrained"], "Which modes to run."
)
_OUTPUT = flags.DEFINE_string("output", "", "JSON results ('': none).")


def _function(name, description, parameters):
  return {
    "type": "function",
    "function": {
      "name": name,
      "description": description,
      "parameters": {
        "type": "object",
        "additionalProperties": False,
        **parameters,
      },
    },
  }


TOOLS = [
  _function(
    "get_weather",
    "The weather forecast for a city.",
    {
      "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
      },
      "required": ["city", "unit"],
    },
  ),
  _function(
    "book_flight",
    "Books a flight between two airports (IATA codes).",
    {
      "properties": {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
        "passengers": {
          "type": "object",
          "additionalProperties": False,
          "properties": {
            "adults": {"type": "integer", "minimum": 1, "maximum": 9},
            "children": {"type": "integer", "minimum": 0, "maximum": 9},
          },
          "required": ["adults"],
        },
      },
      "required": ["origin", "destination", "date", "passengers"],
    },
  ),
  _function(
    "search_products",
    "Searches the shop's catalogue.",
    {
      "properties": {
        "query": {"type": "string", "maxLength": 60},
        "filters": {
          "type": "object",
          "additionalProperties": False,
          "properties": {
            "category": {"enum": ["books", "music", "garden", "toys"]},
            "max_price": {"type": "number", "minimum": 0, "maximum": 10000},
          },
        },
        "limit": {"type": "integer", "minimum": 1, "maximum": 50},
      },
      "required": ["query"],
    },
  ),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
  "What will the weather be in Lyon for the next three days?",
  "Book me a flight from Paris CDG to New York JFK on 2026-12-20 for two "
  "adults and a child.",
  "Find me gardening books under 30 dollars.",
  "What is the weather in Tokyo, and find toys for a 5 year old.",
]
_COUNTS = ("calls", "valid", "loose_calls", "loose_valid")
BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def valid(name: str, arguments) -> bool:
  """A defined tool, and its arguments valid against its schema."""
  if name not in SCHEMAS:
    return False
  try:
    if isinstance(arguments, str):
      arguments = json.loads(arguments)
    jsonschema.validate(arguments, SCHEMAS[name])
  except (json.JSONDecodeError, jsonschema.ValidationError):
    return False
  return True


def parsed_after(text: str) -> list[bool]:
  """A parser-based server's reading of free text: each <tool_call>
  block (or an unclosed last one) JSON-decoded; valid or not."""
  starts = text.count("<tool_call>")
  out = []
  for body in BLOCK.findall(text):
    try:
      call = json.loads(body)
    except json.JSONDecodeError:
      out.append(False)
      continue
    ok = isinstance(call, dict) and isinstance(call.get("name"), str)
    out.append(ok and valid(call["name"], call.get("arguments")))
  return out + [False] * (starts - len(out))


def written_anywhere(text: str) -> list[bool]:
  """A lenient reading of free text: every JSON object in it with a
  "name" (tags or none, "arguments" or "parameters"); valid or not."""
  decoder, out, at = json.JSONDecoder(), [], text.find("{")
  while at >= 0:
    try:
      call, end = decoder.raw_decode(text, at)
    except json.JSONDecodeError:
      at = text.find("{", at + 1)
      continue
    if isinstance(call, dict) and isinstance(call.get("name"), str):
      args = call.get("arguments", call.get("parameters", {}))
      out.append(valid(call["name"], args))
    at = text.find("{", end)
  return out


def one(client, mode: str, prompt: str, seed: int) -> dict:
  messages = [{"role": "user", "content": prompt}]
  kw = dict(
    model=_MODEL.value,
    max_tokens=_MAX_TOKENS.value,
    temperature=1.0,
    seed=seed,
  )
  if mode == "unconstrained":
    plan = tool_plans.parse(TOOLS, None, None)
    c = client.chat.completions.create(messages=plan.messages(messages), **kw)
    text = c.choices[0].message.content or ""
    calls = parsed_after(text)
    loose = written_anywhere(text)
  else:
    c = client.chat.completions.create(
      messages=messages, tools=TOOLS, tool_choice=mode, **kw
    )
    calls = [
      valid(t.function.name, t.function.arguments)
      for t in c.choices[0].message.tool_calls or []
    ]
    text = c.choices[0].message.content or ""
    loose = calls
  return {
    "mode": mode,
    "seed": seed,
    "prompt": prompt,
    "calls": len(calls),
    "valid": sum(calls),
    "loose_calls": len(loose),
    "loose_valid": sum(loose),
    "finish_reason": c.choices[0].finish_reason,
    "text": text,
  }


def compile_total(url: str) -> float:
  """The server's `chunkwise:constraint_compile_seconds_sum`."""
  with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
    for line in r.read().decode().splitlines():
      if line.startswith("chunkwise:constraint_compile_seconds_sum"):
        return float(line.rsplit(" ", 1)[1])
  return 0.0


def first_token_s(client, url: str, suffix: str) -> tuple[float, float]:
  """Seconds to a request's first streamed token (the first chunk with a
  tool call), its tools and their properties renamed with `suffix` (a
  new suffix: a constraint never compiled), and the server's seconds
  compiling its tools (from /metrics, once the request has ended)."""
  before = compile_total(url)
  renamed = json.loads(json.dumps(TOOLS))
  for t in renamed:
    # Properties too: the compile worker keeps the DFAs of arguments
    # schemas it compiled before.
    f = t["function"]
    f["name"] += suffix
    f["parameters"] = _renamed(f["parameters"], suffix)
  start = time.perf_counter()
  stream = client.chat.completions.create(
    model=_MODEL.value,
    messages=[{"role": "user", "content": PROMPTS[0]}],
    tools=renamed,
    tool_choice="required",
    max_tokens=_MAX_TOKENS.value,
    temperature=0,
    stream=True,
  )
  for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.tool_calls:
      took = time.perf_counter() - start
      break
  stream.close()
  deadline = time.monotonic() + 30  # the cancelled stream is recorded
  while (compiled := compile_total(url) - before) <= 0:
    if time.monotonic() > deadline:
      raise RuntimeError("the server never recorded the compile")
    time.sleep(0.05)
  return took, compiled


def _renamed(schema: dict, suffix: str) -> dict:
  """`schema` with its properties (and nested ones) renamed + `suffix`."""
  out = dict(schema)
  if isinstance(out.get("properties"), dict):
    out["properties"] = {
      k + suffix: _renamed(v, suffix) for k, v in out["properties"].items()
    }
  if isinstance(out.get("required"), list):
    out["required"] = [k + suffix for k in out["required"]]
  return out


def serve() -> tuple[subprocess.Popen, str]:
  env = {**os.environ, "CHUNKWISE_CONSTRAINT_CACHE": "off"}
  script = os.path.join(os.path.dirname(__file__), "serve.py")
  proc = subprocess.Popen(
    [
      sys.executable,
      script,
      f"--model={_MODEL.value}",
      f"--slots={_SLOTS.value}",
      "--host=127.0.0.1",
      "--port=0",
      "--max_total_tokens=1024",
    ],
    stdout=subprocess.PIPE,
    text=True,
    env=env,
  )
  for line in proc.stdout:
    m = re.match(r"chunkwise serving on (\S+)", line)
    if m:
      return proc, m.group(1)
  raise RuntimeError(f"the server did not start (exit {proc.wait()})")


def main(argv):
  del argv
  import openai

  proc, url = serve()
  try:
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    first_token_s(client, url, "_warm")  # the decode programs compiled
    cold = [first_token_s(client, url, f"_{k}") for k in range(_COLD.value)]
    cached = [first_token_s(client, url, "_0") for _ in range(_COLD.value)]
    jobs = [
      (mode, prompt, seed)
      for mode in _MODES.value
      for prompt in PROMPTS[: _PROMPTS.value]
      for seed in range(_SEEDS.value)
    ]
    with concurrent.futures.ThreadPoolExecutor(_SLOTS.value) as pool:
      rows = list(pool.map(lambda j: one(client, *j), jobs))
  finally:
    proc.terminate()
    proc.wait(timeout=120)
  cpu = _cpu()
  print(
    f"cpu: {cpu}; model {_MODEL.value}; {_SEEDS.value} seeds x "
    f"{_PROMPTS.value} prompts per mode, temperature 1"
  )
  print(
    f"{'mode':>14} {'answers':>8} {'no call':>8} {'calls':>6} "
    f"{'valid':>6} {'valid %':>8}   any JSON object with a name: "
    "objects, valid"
  )
  summary = {}
  for mode in _MODES.value:
    mine = [r for r in rows if r["mode"] == mode]
    count = {k: sum(r[k] for r in mine) for k in _COUNTS}
    none = sum(r["calls"] == 0 for r in mine)
    calls, ok = count["calls"], count["valid"]
    share = 100 * ok / calls if calls else float("nan")
    summary[mode] = dict(answers=len(mine), no_call=none, **count)
    print(
      f"{mode:>14} {len(mine):>8} {none:>8} {calls:>6} {ok:>6} "
      f"{share:>7.1f}%   {count['loose_calls']}, {count['loose_valid']}"
    )
  for name, runs in (("tools never seen", cold), ("tools seen", cached)):
    first, compiled = zip(*runs, strict=True)
    print(
      f"{name}: first token median {statistics.median(first):.2f} s "
      f"{[round(x, 2) for x in first]}, of which compiling (the server's "
      f"/metrics) median {1e3 * statistics.median(compiled):.1f} ms "
      f"{[round(1e3 * x, 1) for x in compiled]}"
    )
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as f:
      json.dump(
        dict(cpu=cpu, summary=summary, rows=rows, cold_s=cold, cached_s=cached),
        f,
        indent=1,
      )


def _cpu() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return "unknown"


if __name__ == "__main__":
  app.run(main)
