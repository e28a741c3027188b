"""scripts/schema_coverage.py on a directory of schemas written here (the
benchmark's own files are read only during development: no license)."""

import json
import os
import subprocess
import sys

import pytest

from chunkwise.bench import schema_coverage

SCRIPT = os.path.join(
  os.path.dirname(os.path.dirname(__file__)), "scripts", "schema_coverage.py"
)

SCHEMAS = {
  "simple": {
    "small.json": {
      "type": "object",
      "properties": {"ok": {"type": "boolean"}},
      "required": ["ok"],
      "additionalProperties": False,
    },
    "refused.json": {
      "type": "object",
      "required": ["missing"],
      "additionalProperties": False,
    },
  },
  "arrays": {
    "unique.json": {
      "type": "array",
      "items": {"enum": [1, 2]},
      "minItems": 2,
      "maxItems": 2,
      "uniqueItems": True,
    },
  },
}


def _run(tmp_path, *flags):
  for category, files in SCHEMAS.items():
    (tmp_path / category).mkdir()
    for name, schema in files.items():
      (tmp_path / category / name).write_text(json.dumps(schema))
  report_path = tmp_path / "report.json"
  proc = subprocess.run(
    [
      sys.executable,
      SCRIPT,
      f"--data={tmp_path}",
      "--steps=24",
      "--batch=2",
      f"--output={report_path}",
      *flags,
    ],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(report_path.read_text())
  assert (report["seed"], report["limit"]) == (0, 30)
  assert sorted(report["categories"]) == ["arrays", "simple"]
  assert "simple" in proc.stdout and "arrays" in proc.stdout
  assert "seed=0" in proc.stdout
  return report


@pytest.mark.long  # covered by others: run with --long
def test_the_peers_run_the_same_schemas(tmp_path):
  """xgrammar and llguidance on SmolLM2 (the same script, model and
  files): refused.json admits no value, so each engine refuses it or its
  output is flagged; the counts agree with the outcomes."""
  report = _run(tmp_path, "--engines=xgrammar,llguidance")
  for engine in ("xgrammar", "llguidance"):
    for category, files in SCHEMAS.items():
      r = report["categories"][category][engine]
      assert r["schemas"] == len(files)
      assert r["accepted"] == sum("text" in o for o in r["outcomes"])
      assert r["valid"] == sum(o.get("error", 1) is None for o in r["outcomes"])
    for o in report["categories"]["simple"][engine]["outcomes"]:
      if o["file"].endswith("refused.json"):
        assert "refused" in o or o["error"], o
      elif "text" in o:  # small.json: an object holding a boolean
        json.loads(o["text"])


def test_reports_accepted_valid_and_causes(tmp_path):
  report = _run(tmp_path, "--model=random:tiny")
  for category in report["categories"].values():
    assert sorted(category) == ["chunkwise"]
  simple = report["categories"]["simple"]["chunkwise"]
  arrays = report["categories"]["arrays"]["chunkwise"]
  assert (simple["schemas"], simple["accepted"]) == (2, 1)
  ((cause, count),) = simple["refusals"]
  assert count == 1 and "neither in properties" in cause
  # Budget forcing closes the object within 24 steps: it is valid.
  assert simple["valid"] == 1
  (outcome,) = [o for o in arrays["outcomes"] if "text" in o]
  values = json.loads(outcome["text"])
  # uniqueItems is checked after generation, and the check is reported.
  assert arrays["valid"] == (len(set(values)) == 2)
  assert (outcome["error"] is None) == (len(set(values)) == 2)

  for flag, message in (
    ("--categories=nope", "--categories: no schemas in nope"),
    ("--engines=outlines", "--engines=outlines: expected some of chunkwise"),
  ):
    bad = subprocess.run(
      [sys.executable, SCRIPT, f"--data={tmp_path}", flag],
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert bad.returncode != 0
    assert message in bad.stderr


def test_sample_is_seeded_per_category():
  files = [f"{i:03d}.json" for i in range(100)]
  a = schema_coverage.sample(files, 10, 0, "Snowplow")
  assert a == schema_coverage.sample(files, 10, 0, "Snowplow")
  assert a == sorted(a) and len(set(a)) == 10 and set(a) <= set(files)
  assert a != files[:10]  # not the first ten by name
  assert a != schema_coverage.sample(files, 10, 1, "Snowplow")
  assert a != schema_coverage.sample(files, 10, 0, "Kubernetes")
  assert schema_coverage.sample(files[:5], 10, 0, "x") == files[:5]


def test_tool_list_compile_times_both_ways():
  script = os.path.join(os.path.dirname(SCRIPT), "tool_list_compile.py")
  out = subprocess.run(
    [
      sys.executable,
      script,
      "--model=random:tiny",
      "--lists=2x3,1x9",
      "--runs=1",
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [line.split() for line in out.stdout.splitlines()[1:]]
  assert [r[:2] for r in rows] == [["2", "3"], ["1", "9"]]
  for r in rows:
    assert float(r[2]) > 0 and float(r[3]) > 0 and int(r[4]) > 100
  bad = subprocess.run(
    [sys.executable, script, "--lists=3y3"], capture_output=True, text=True
  )
  assert bad.returncode != 0 and "'3y3' is not NxP" in bad.stderr
