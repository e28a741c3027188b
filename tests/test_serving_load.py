"""`scripts/load_test.py`, short: Poisson arrivals and a soak with clients
that leave mid-stream, against the real server (tiny model), with and
without a prefix cache for the requests' shared system prompt, int8 K/V
(`--kv_dtype`): no error,
nothing lost or truncated, every response equal to `generate_many`'s,
cache hits counted, every slot free at the end, the server exits 0."""

import json
import subprocess
import sys

import pytest

from tests.serving_helpers import ROOT

pytestmark = pytest.mark.slow


# Each rate runs REQUESTS requests: enough for a saturated batch beside a
# queue (4 slots), few enough for CI.
REQUESTS = 6


def test_load_test_and_soak(tmp_path):
  out = tmp_path / "load.json"
  run = subprocess.run(
    [
      sys.executable,
      str(ROOT / "scripts" / "load_test.py"),
      "--model=random:tiny",
      "--slots=4",
      f"--requests={REQUESTS}",
      "--long=24",
      "--rates=1,0.5",
      "--system_prompt_tokens=100",
      "--prefix_cache_mb=0,16",
      "--soak_seconds=2",  # clients leave and finish within it
      "--soak_clients=6",
      "--disconnect_share=0.5",
      "--kv_dtype=int8",  # the server's and generate_many's K/V alike
      f"--output={out}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["server_exit_code"] == 0
  assert "--kv_dtype=int8" in report["server_flags"]
  assert [
    (r["prefix_cache_mb"], r["rate"].split()[0]) for r in report["rates"]
  ] == [(0, "saturation"), (0, "0.5"), (16, "saturation"), (16, "0.5")]
  # With the cache, every timed request reuses the system prompt's pages
  # (the warm-up stored them); without it there are no counts.
  for r in report["rates"]:
    c = r["prefix_cache"]
    if r["prefix_cache_mb"]:
      assert (c["hit_requests"], c["miss_requests"]) == (REQUESTS, 0), c
      assert c["hit_tokens"] >= REQUESTS * 64  # at least a page each
    else:
      assert c is None
  for r in report["rates"]:
    assert r["requests"] == REQUESTS and r["tokens"] > 0
    assert (r["errors"], r["lost"], r["truncated"], r["mismatched"]) == (
      0,
      0,
      0,
      0,
    ), r
  soak = report["soak"]
  assert soak["errors"] == 0 and soak["left"] > 0 and soak["done"] > 0
  assert soak["slots_free_at_end"]
  assert "| saturation" in run.stdout
