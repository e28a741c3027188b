"""`scripts/load_test.py`, short: Poisson arrivals and a soak with clients
that leave mid-stream, against the real server (tiny model): no error,
nothing lost or truncated, every response equal to `generate_many`'s, every
slot free at the end, the server exits 0."""

import json
import subprocess
import sys

import pytest

from tests.serving_helpers import ROOT

pytestmark = pytest.mark.slow


def test_load_test_and_soak(tmp_path):
  out = tmp_path / "load.json"
  run = subprocess.run(
    [
      sys.executable,
      str(ROOT / "scripts" / "load_test.py"),
      "--model=random:tiny",
      "--slots=4",
      "--requests=12",
      "--long=24",
      "--rates=1,0.5",
      "--soak_seconds=6",
      "--soak_clients=6",
      "--disconnect_share=0.5",
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
  assert [r["rate"].split()[0] for r in report["rates"]] == [
    "saturation",
    "0.5",
  ]
  for r in report["rates"]:
    assert r["requests"] == 12 and r["tokens"] > 0
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
