"""The main job (scripts/demo.py) runs end to end and prints scores."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]


def test_demo_runs(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      str(ROOT / "scripts" / "demo.py"),
      "--samples=2",
      "--steps=5",
      "--tasks=A,B",
    ],
    capture_output=True,
    text=True,
    check=False,
    cwd=tmp_path,
  )
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert any("prefilled once" in line for line in lines)
  # Two tasks x two samples; each is followed by its tokens' scores, which
  # add up to the printed total (up to the rounding of the printout).
  starts = [i for i, line in enumerate(lines) if line.startswith("task ")]
  assert len(starts) == 4
  for i in starts:
    total = float(re.search(r"log-prob (-?[\d.]+)\)$", lines[i]).group(1))
    scores = [float(s) for s in re.findall(r":(-?\d+\.\d\d)", lines[i + 1])]
    assert 1 <= len(scores) <= 5
    assert abs(sum(scores) - total) <= 0.006 * len(scores) + 0.006


def test_demo_rejects_bad_flags(tmp_path):
  result = subprocess.run(
    [sys.executable, str(ROOT / "scripts" / "demo.py"), "--preset=huge"],
    capture_output=True,
    text=True,
    check=False,
    cwd=tmp_path,
  )
  assert result.returncode != 0
  assert "huge" in result.stderr
