"""Serves a model over HTTP to TGI / LoRAX and OpenAI clients.

  python scripts/serve.py                           # SmolLM2 on 127.0.0.1:8080
  python scripts/serve.py --model=path/to/base --adapters=math=/ad/math \\
      --slots=16 --port=8080 --api_key=secret --max_total_tokens=2048

Then point a client at it:

  from lorax import Client                 # or text_generation.Client
  Client("http://127.0.0.1:8080").generate("Hello", max_new_tokens=16)
  from openai import OpenAI
  OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="-").completions...

Open http://127.0.0.1:8080/explore in a browser for the token explorer
(each token shaded by its probability, its alternatives on hover; texts
scored and compared across adapters). Routes, wire formats and limits:
docs/serving.md and chunkwise/serving.
On a pod (--coordinator_address, --num_processes, --process_id, or
--multihost) process 0 takes HTTP and the others follow its schedule in
lockstep. Requests run with continuous batching (--slots rows side by
side), each token streamed as it is produced; a response's tokens are those of
`model.generate` run alone on the same request, whatever else is
running; each step runs only the slots in use (--slot_buckets). Before it
says it serves, the server compiles every program a request can need
(/health answers 503 "starting" meanwhile; the log says what it compiled
and how long it took), kept in JAX's persistent compilation cache
(--compilation_cache, by default ~/.cache/chunkwise/jax) so that a
restart loads them instead. Binds 127.0.0.1 unless --host says otherwise.
SIGTERM (or Ctrl-C) stops admitting, lets running requests finish within
--grace seconds, and exits 0.
"""

from __future__ import annotations

import logging
import os
import sys

from absl import app, flags

from chunkwise import compile_cache, jobs, serving
from chunkwise.checkpoints.chat_template import ChatTemplate
from chunkwise.constraints import worker
from chunkwise.jobs import cli, model_flags, sampling_flags
from chunkwise.serving import response_store

MODEL = model_flags.ModelFlags()
HOSTS = model_flags.MultiHostFlags()
SPECULATE = sampling_flags.SpeculationFlags()
_HOST = flags.DEFINE_string(
  "host", "127.0.0.1", "Address to listen on (loopback by default)."
)
_PORT = flags.DEFINE_integer(
  "port", 8080, "Port to listen on (0: a free one, printed).", lower_bound=0
)
_SLOTS = flags.DEFINE_integer(
  "slots", 16, "Requests decoded side by side.", lower_bound=1
)
_SLOT_BUCKETS = flags.DEFINE_list(
  "slot_buckets",
  [],
  "The row counts a decode step may run, e.g. 1,4,16: each step runs the "
  "smallest that holds the requests in slots (default: powers of two up "
  "to --slots). Each is one program to compile at start-up.",
)
_WARM_UP = flags.DEFINE_bool(
  "warm_up",
  True,
  "Compile every program a request can need before serving (/health "
  "answers 503 'starting' until then); false: each compiles when a "
  "request first needs it.",
)
_COMPILATION_CACHE = flags.DEFINE_string(
  "compilation_cache",
  None,
  "Directory of JAX's persistent compilation cache (default: "
  "$CHUNKWISE_COMPILATION_CACHE, else ~/.cache/chunkwise/jax); '' turns "
  "it off.",
)
_EVERY = flags.DEFINE_integer(
  "every",
  serving.DEFAULT_EVERY,
  "Decode steps between two hand-overs of tokens to the clients while no "
  "request waits for a slot.",
  lower_bound=1,
)
_BUSY_EVERY = flags.DEFINE_integer(
  "busy_every",
  serving.DEFAULT_BUSY_EVERY,
  "Decode steps between hand-overs while requests wait for a slot.",
  lower_bound=1,
)
_MAX_INPUT = flags.DEFINE_integer(
  "max_input_tokens", None, "Most prompt tokens (default: max_total - 1)."
)
_MAX_TOTAL = flags.DEFINE_integer(
  "max_total_tokens",
  2048,
  "Most prompt + generated tokens of a request (at most the model's "
  "max_len); each slot holds this many.",
  lower_bound=2,
)
_MAX_TOP_N = flags.DEFINE_integer(
  "max_top_n",
  5,
  "Most alternatives per token a request may ask for.",
  lower_bound=0,
)
_MAX_QUEUE = flags.DEFINE_integer(
  "max_queue",
  256,
  "Waiting requests before 429 Model is overloaded.",
  lower_bound=1,
)
_MAX_STOP = flags.DEFINE_integer(
  "max_stop_sequences", 8, "Most stop strings per request.", lower_bound=0
)
_CLIENT_LIMITS = {
  name: flags.DEFINE_float(name, default, help_text, lower_bound=0.1)
  for name, default, help_text in (
    ("body_timeout_s", 30.0, "Seconds to read a request's body (else 408)."),
    (
      "write_timeout_s",
      30.0,
      "Seconds a stream's event may wait on a client that reads nothing "
      "before the request is cancelled and its slot freed.",
    ),
    ("keepalive_timeout_s", 15.0, "Seconds an idle connection is kept."),
  )
}
_COMPILE_BUDGET = flags.DEFINE_float(
  "compile_budget_s",
  30.0,
  "Seconds of constraint compiling one request gets for all its schemas, "
  "tools and choices together (a constraint's own limit is 30 s).",
  lower_bound=0.1,
)
_COMPILE_WORKERS = flags.DEFINE_integer(
  "compile_workers",
  worker.WORKERS,
  "Constraint compiles run at once, each in a process of its own at a "
  "lower CPU priority.",
  lower_bound=1,
)
_MAX_COMPILES_WAITING = flags.DEFINE_integer(
  "max_compiles_waiting",
  worker.MAX_WAITING,
  "Constraint compiles that may wait for a --compile_workers process "
  "(one more is a 429).",
  lower_bound=0,
)
_MAX_CLIENT_REQUESTS = flags.DEFINE_integer(
  "max_client_requests",
  256,
  "Requests at once from one address (else 429).",
  lower_bound=1,
)
_MAX_CONNECTIONS = flags.DEFINE_integer(
  "max_connections",
  1024,
  "Connections open at once; one more is answered 503 and closed.",
  lower_bound=1,
)
# Per-request caps, each a 400/422 naming its flag, checked before any
# work (serving.Context.check_sizes).
_CAPS = {
  name: flags.DEFINE_integer(name, default, help_text, lower_bound=1)
  for name, default, help_text in (
    ("max_n", 8, "Most choices per prompt (OpenAI's n)."),
    ("max_stop_length", 256, "Most characters of one stop string."),
    ("max_prompts", 32, "Most prompts in one /v1/completions request."),
    ("max_choices", 64, "Most choices (prompts x n) in one request."),
    ("max_messages", 512, "Most chat messages in one request."),
    ("max_tools", 64, "Most tools offered in one request."),
    (
      "max_schema_bytes",
      256 << 10,
      "Most bytes of JSON of one request's schemas and tools, all told.",
    ),
  )
}
_API_KEY = flags.DEFINE_string(
  "api_key",
  None,
  "Require 'Authorization: Bearer <key>' on every route but /health "
  "(default: $CHUNKWISE_API_KEY; on the command line it shows in `ps`: "
  "prefer the variable or --api_key_file).",
)
_API_KEY_FILE = flags.DEFINE_string(
  "api_key_file", None, "Read --api_key from this file (its first line)."
)
_ALLOWED_HOSTS = flags.DEFINE_list(
  "allowed_hosts",
  [],
  "Host names the server answers to besides the loopback names and "
  "--host (a browser page elsewhere that resolves to this address is "
  "refused: DNS rebinding); '*': any. Set it to the names clients use "
  "when serving beyond loopback.",
)
_PUBLIC_OPENAPI = flags.DEFINE_bool(
  "public_openapi", False, "Serve /openapi.json without the API key."
)
_GRACE = flags.DEFINE_float(
  "grace", 30.0, "Seconds running requests get to finish on SIGTERM."
)
_PREFIX_CACHE_MB = flags.DEFINE_integer(
  "prefix_cache_mb",
  serving.DEFAULT_PREFIX_CACHE_BYTES >> 20,
  "MiB of K/V of prompts' full pages kept for requests that start alike "
  "(a system prompt): each prefills only what follows its longest cached "
  "start (0: no prefix cache). Hits and misses are in /metrics.",
  lower_bound=0,
)
_KV_PAGES = flags.DEFINE_integer(
  "kv_pages",
  0,
  "Hold the slots' K/V in one pool of this many pages of 32 columns "
  "(paged K/V, one device; at least --max_total_tokens / 32): --slots may "
  "then exceed what fixed rows of --max_total_tokens columns fit, requests "
  "taking a slot as their pages fit (0: fixed slots). Use and preemptions "
  "are in /metrics.",
  lower_bound=0,
)
_CHAT_TEMPLATE = flags.DEFINE_string(
  "chat_template",
  None,
  "A Jinja chat template file rendered in place of the model's own (as "
  "transformers renders it, sandboxed). Tool calls take the format it "
  "asks for (docs/serving.md#tools).",
)
_STATE_DIR = flags.DEFINE_string(
  "state_dir",
  None,
  "Directory of the server's state: the Responses API's stored responses "
  "(responses.sqlite3; default: $CHUNKWISE_STATE_DIR, else "
  "$XDG_STATE_HOME/chunkwise, else $XDG_CACHE_HOME/chunkwise/state, else "
  "~/.cache/chunkwise/state); '' keeps none (store is then ignored and "
  "previous_response_id refused).",
)
_RESPONSES_MAX_MB = flags.DEFINE_float(
  "responses_max_mb",
  256.0,
  "Most megabytes of stored responses; past it the oldest are deleted.",
  lower_bound=0.001,
)
_RESPONSES_MAX_DAYS = flags.DEFINE_float(
  "responses_max_days",
  30.0,
  "Stored responses older than this many days are deleted.",
  lower_bound=0.0001,
)
_MODEL_ID = flags.DEFINE_string(
  "model_id", None, "The base model's name in the APIs (default: --model)."
)


def main(argv):
  del argv
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
  api_key = _api_key()  # checked before any model is loaded
  try:
    buckets = [int(b) for b in _SLOT_BUCKETS.value] or None
  except ValueError:
    cli.fail(f"--slot_buckets={','.join(_SLOT_BUCKETS.value)}: not integers")
  cache = compile_cache.enable(_COMPILATION_CACHE.value)
  logging.info("compilation cache: %s", cache or "off")
  chat_template = None
  if _CHAT_TEMPLATE.value:  # checked before any model is loaded
    try:
      with open(_CHAT_TEMPLATE.value, encoding="utf-8") as f:
        chat_template = f.read()
      ChatTemplate(chat_template, _CHAT_TEMPLATE.value).check()
    except (OSError, UnicodeDecodeError, ValueError) as e:
      cli.fail(f"--chat_template={_CHAT_TEMPLATE.value}: {e}")
  store = None
  state_dir = _STATE_DIR.value
  if state_dir is None:
    state_dir = response_store.default_dir()
  if state_dir:  # opened before any model is loaded: a bad one fails fast
    try:
      store = response_store.ResponseStore(
        state_dir,
        max_mb=_RESPONSES_MAX_MB.value,
        max_days=_RESPONSES_MAX_DAYS.value,
      )
    except ValueError as e:
      cli.fail(f"--state_dir={state_dir}: {e}")
    logging.info("stored responses: %s", store.path)
  try:
    process, _ = jobs.start_processes(HOSTS.config())
    model = jobs.load_served(MODEL.config())
  except (ValueError, FileNotFoundError) as e:
    cli.fail(str(e))
  total = min(_MAX_TOTAL.value, model.hparams.max_len)
  max_input = _MAX_INPUT.value or total - 1
  if max_input >= total:
    cli.fail(
      f"--max_input_tokens={max_input} leaves no room to generate "
      f"within --max_total_tokens={total}"
    )
  try:
    engine = serving.Engine(
      model,
      slots=_SLOTS.value,
      capacity=total,
      top_n=_MAX_TOP_N.value,
      every=_EVERY.value,
      busy_every=_BUSY_EVERY.value,
      max_queue=_MAX_QUEUE.value,
      speculation=SPECULATE.speculation(),
      prefix_cache_bytes=_PREFIX_CACHE_MB.value << 20,
      kv_pages=_KV_PAGES.value,
      slot_buckets=buckets,
      warm_up=_WARM_UP.value,
    )
  except ValueError as e:
    cli.fail(str(e))
  if process != 0:  # a pod: process 0 takes HTTP, this one follows it
    logging.info("process %d follows process 0's schedule", process)
    engine.follow()
    logging.info("process %d: process 0 stopped", process)
    sys.exit(0)
  worker.WORKERS = _COMPILE_WORKERS.value
  worker.MAX_WAITING = _MAX_COMPILES_WAITING.value
  ctx = serving.Context(
    engine=engine,
    model_id=_MODEL_ID.value or MODEL.model.value,
    max_input_tokens=max_input,
    max_total_tokens=total,
    max_stop_sequences=_MAX_STOP.value,
    **{name: flag.value for name, flag in _CAPS.items()},
    **{name: flag.value for name, flag in _CLIENT_LIMITS.items()},
    max_client_requests=_MAX_CLIENT_REQUESTS.value,
    max_connections=_MAX_CONNECTIONS.value,
    compile_budget_s=_COMPILE_BUDGET.value,
    chat_template=chat_template,
    chat_template_source=_CHAT_TEMPLATE.value or "--chat_template",
    responses_store=store,
  )

  def ready(port):
    url = f"http://{_HOST.value}:{port}"
    print(
      f"chunkwise serving on {url} (token explorer: {url}/explore)", flush=True
    )

  serving.serve(
    ctx,
    host=_HOST.value,
    port=_PORT.value,
    api_key=api_key,
    grace=_GRACE.value,
    ready=ready,
    extra_hosts=_ALLOWED_HOSTS.value,
    public_openapi=_PUBLIC_OPENAPI.value,
  )
  sys.exit(0)


def _api_key() -> str | None:
  """--api_key, else --api_key_file's first line, else $CHUNKWISE_API_KEY."""
  if _API_KEY.value and _API_KEY_FILE.value:
    cli.fail("give --api_key or --api_key_file, not both")
  if _API_KEY_FILE.value:
    try:
      with open(_API_KEY_FILE.value, encoding="utf-8") as f:
        key = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
      cli.fail(f"--api_key_file={_API_KEY_FILE.value}: {e}")
    if not key:
      cli.fail(f"--api_key_file={_API_KEY_FILE.value} holds no key")
    return key
  return _API_KEY.value or os.environ.get("CHUNKWISE_API_KEY") or None


if __name__ == "__main__":
  app.run(main)
