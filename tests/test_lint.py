"""The house style is enforced: ruff lint and format (2 spaces, 80 cols)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]


def _ruff(*args):
  return subprocess.run(
    [sys.executable, "-m", "ruff", *args, "."],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=False,
  )


def test_ruff_check():
  result = _ruff("check", "--output-format=concise")
  assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format():
  result = _ruff("format", "--check")
  assert result.returncode == 0, result.stdout + result.stderr
