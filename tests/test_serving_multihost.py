"""The server on a pod: two JAX processes of 4 CPU devices (gloo) serve one
2x2x2 mesh; process 0 takes HTTP and shares each segment's schedule,
process 1 follows in lockstep. Responses equal one process's on the same
mesh and layout; SIGTERM to process 0 stops both; a failure on process 1
alone fails the same requests on both, and both go on serving."""

import subprocess
import sys

import numpy as np
import pytest
import text_generation

from tests.serving_helpers import ROOT, running
from tests.test_multihost import _free_port, _run_workers, _worker_env

pytestmark = [pytest.mark.multihost, pytest.mark.slow]
FLAGS = (
  "--model=random:tiny",
  "--layout=ws_2d/yz",
  "--mesh=2x2x2",
  "--slots=4",
  "--max_total_tokens=128",
  "--max_top_n=3",
)


def _requests(url):
  """Greedy, sampled and constrained requests, four at once."""
  import concurrent.futures

  client = text_generation.Client(url, timeout=240)
  cases = [
    dict(max_new_tokens=12),
    dict(max_new_tokens=20, do_sample=True, temperature=0.9, seed=4),
    dict(max_new_tokens=9, do_sample=True, top_k=20, seed=11, top_n_tokens=3),
    dict(
      max_new_tokens=16,
      grammar=text_generation.types.Grammar(type="regex", value="[a-c]{3}x"),
    ),
    dict(max_new_tokens=4, decoder_input_details=True),  # scores the prompt
  ]
  with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
    futures = [
      pool.submit(client.generate, f"pod {i}", **kw)
      for i, kw in enumerate(cases)
    ]
    return [f.result() for f in futures]


def test_two_processes_answer_as_one():
  # The reference compiles only what the requests need: the pod warms up
  # (its own path), one process's warm-up is tests/test_serving_warmup.py's.
  with running(*FLAGS, "--warm_up=false") as one:
    want = _requests(one.url)
  env = _worker_env()
  port = _free_port()
  hosts = [
    f"--coordinator_address=127.0.0.1:{port}",
    "--num_processes=2",
    "--cpu_devices=4",
  ]
  follower = subprocess.Popen(
    [
      sys.executable,
      str(ROOT / "scripts" / "serve.py"),
      *FLAGS,
      *hosts,
      "--process_id=1",
    ],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  try:
    with running(*FLAGS, *hosts, "--process_id=0", env=env) as pod:
      got = _requests(pod.url)
      again = _requests(pod.url)  # after an idle moment too
    out, _ = follower.communicate(timeout=120)
    assert follower.returncode == 0, out[-3000:]
    assert "process 1 follows process 0's schedule" in out
  finally:
    if follower.poll() is None:
      follower.kill()
  for w, g, a in zip(want, got, again, strict=True):
    ids = [t.id for t in w.details.tokens]
    assert [t.id for t in g.details.tokens] == ids
    assert [t.id for t in a.details.tokens] == ids
    assert g.generated_text == w.generated_text
    np.testing.assert_allclose(
      [t.logprob for t in g.details.tokens],
      [t.logprob for t in w.details.tokens],
      atol=1e-5,
    )
    assert g.details.seed == w.details.seed
    assert [t.id for t in g.details.prefill] == [
      t.id for t in w.details.prefill
    ]
    if w.details.prefill:  # gloo's sums round a little differently
      np.testing.assert_allclose(
        [t.logprob for t in g.details.prefill[1:]],
        [t.logprob for t in w.details.prefill[1:]],
        atol=1e-5,
      )


def test_a_follower_failing_alone_fails_the_same_requests_everywhere(
  tmp_path,
):
  """Process 1 cannot admit one request (tests/pod_fault_worker.py): the
  segment fails on both processes, the request and the one running beside
  it end with process 1's error, every process restarts its loop, later
  requests get the tokens they got before, and nothing hangs."""
  leader, follower = _run_workers(
    tmp_path, ROOT / "tests" / "pod_fault_worker.py"
  )
  assert follower == {"process_id": 1, "finished": True}
  for name in ("running", "fault"):
    ended = leader[name]
    assert ended["finish_reason"] == "error", ended
    assert "process 1: RuntimeError: injected" in ended["error"], ended
  # The running request had begun, and did not reach its 60 tokens.
  assert 1 <= len(leader["running"]["tokens"]) < 60
  before = leader["before"]
  assert before["finish_reason"] == "length" and len(before["tokens"]) == 12
  for later in leader["later"]:
    assert later == before
  assert leader["closed_clean"]
