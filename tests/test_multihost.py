"""Two JAX processes of 4 CPU devices each run one 2x2x2 mesh (gloo
collectives) and agree with the single-process reference layout."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import chunkwise as cw
from tests.multihost_worker import scenario

ROOT = pathlib.Path(__file__).parents[1]
WORKER = ROOT / "tests" / "multihost_worker.py"
TIMEOUT_S = 300


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
  """This process's environment without conftest's 8 forced host devices
  (each worker asks for 4 through `initialize_multihost`)."""
  env = dict(os.environ)
  flags = [
    f
    for f in env.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
  ]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  else:
    env.pop("XLA_FLAGS", None)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), env.get("PYTHONPATH")) if p
  )
  return env


def _run_workers(tmp_path, worker=WORKER) -> list[dict]:
  port, env = _free_port(), _worker_env()
  procs, logs, outs = [], [], []
  for pid in range(2):
    out = tmp_path / f"out{pid}.json"
    log = open(tmp_path / f"stderr{pid}.txt", "w+")  # noqa: SIM115
    procs.append(
      subprocess.Popen(
        [sys.executable, str(worker), str(port), str(pid), str(out)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
      )
    )
    logs.append(log)
    outs.append(out)

  def output(pid):
    logs[pid].flush()
    logs[pid].seek(0)
    return f"--- process {pid} output ---\n{logs[pid].read()[-6000:]}"

  try:
    deadline = time.monotonic() + TIMEOUT_S
    # A failed worker leaves its peer blocked in a collective: stop waiting
    # as soon as one fails.
    while True:
      codes = [p.poll() for p in procs]
      if None not in codes or any(codes):
        break
      if time.monotonic() > deadline:
        for p in procs:
          p.kill()
        pytest.fail(
          f"workers did not finish in {TIMEOUT_S} s\n"
          + "\n".join(output(i) for i in range(2))
        )
      time.sleep(0.2)
    for p in procs:  # the peer of a failed worker
      if p.poll() is None:
        p.kill()
        p.wait()
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"worker exit codes {codes}\n" + "\n".join(
      output(i) for i in range(2)
    )
    return [json.loads(out.read_text()) for out in outs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for log in logs:
      log.close()


@pytest.mark.multihost
@pytest.mark.slow
def test_two_processes_match_the_reference(tmp_path):
  results = _run_workers(tmp_path)
  model = cw.InferenceModel.random(cw.configs.get("tiny"), seed=0)
  want = scenario(model)
  for pid, got in enumerate(results):
    assert got["process_id"] == pid
    assert got["tokens"] == want["tokens"], pid
    assert got["lengths"] == want["lengths"], pid
    np.testing.assert_allclose(
      np.asarray(got["scores"]),
      np.asarray(want["scores"]),
      atol=2e-4,
      err_msg=f"process {pid}",
    )
