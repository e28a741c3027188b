"""scripts/schema_coverage.py on a directory of schemas written here (the
benchmark's own files are read only during development: no license)."""

import json
import os
import subprocess
import sys

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


def test_reports_accepted_valid_and_causes(tmp_path):
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
      "--model=random:tiny",
      "--steps=24",
      "--batch=2",
      f"--output={report_path}",
    ],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(report_path.read_text())
  assert sorted(report) == ["arrays", "simple"]
  simple, arrays = report["simple"], report["arrays"]
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
  assert "simple" in proc.stdout and "arrays" in proc.stdout

  bad = subprocess.run(
    [sys.executable, SCRIPT, f"--data={tmp_path}", "--categories=nope"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert bad.returncode != 0
  assert "--categories: no schemas in nope" in bad.stderr
