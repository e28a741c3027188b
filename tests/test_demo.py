"""The main job (scripts/demo.py) runs end to end and prints scores."""

import pathlib
import re
import subprocess
import sys

from tests.flag_checks import flag_errors

ROOT = pathlib.Path(__file__).parents[1]


def _run(tmp_path, *flags):
  return subprocess.run(
    [sys.executable, str(ROOT / "scripts" / "demo.py"), *flags],
    capture_output=True,
    text=True,
    check=False,
    cwd=tmp_path,
  )


def _check_scores(lines, header, count, max_tokens):
  """`count` lines starting with `header`, each followed by its tokens'
  scores, which add up to the printed total (up to rounding)."""
  starts = [i for i, line in enumerate(lines) if line.startswith(header)]
  assert len(starts) == count, lines
  for i in starts:
    total = float(re.search(r"log-prob (-?[\d.]+)", lines[i]).group(1))
    scores = [float(s) for s in re.findall(r":(-?\d+\.\d\d)", lines[i + 1])]
    assert 1 <= len(scores) <= max_tokens
    assert abs(sum(scores) - total) <= 0.006 * len(scores) + 0.006


# The job on SmolLM2 itself (it prefers the sensible sentence, knows Rome
# and Paris) is the notebook's: tests/test_notebook.py runs the same API
# on the same model; here the job's own code runs on random weights.


def test_main_job_with_random_weights(tmp_path):
  result = _run(
    tmp_path, "--model=random:tiny", "--samples=1", "--steps=3", "--task=A"
  )
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  _check_scores(lines, "task ", 1, 3)
  assert "Chat" not in result.stdout  # a byte vocabulary has no template


BAD_FLAGS = [
  ("--model=random:huge", "unknown preset 'huge'"),
  ("--model=random:palm-540b", "too large: they need"),
  ("--model=/no/such/model.gguf", "neither a known model name"),
  ("--top_p=0", "--top_p must be > 0"),
]


def test_main_job_rejects_bad_flags(tmp_path):
  """Each bad flag refused by name (in one process: `flag_checks`); the
  script exits non-zero with the message."""
  errors = flag_errors("demo", "main", [[f] for f, _ in BAD_FLAGS], tmp_path)
  for (flag, message), error in zip(BAD_FLAGS, errors, strict=True):
    assert error is not None and message in error, (flag, error)
  result = _run(tmp_path, BAD_FLAGS[0][0])
  assert result.returncode != 0
  assert BAD_FLAGS[0][1] in result.stderr
