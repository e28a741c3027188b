"""Bad flag sets of one script checked in one child process: its entry
point run on each argv in turn, after absl parses it, and the error's
text kept (a process a set spent its seconds importing JAX).

  errors = flag_errors("benchmark", "run", [["--steps=0"], ...], cwd)
"""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]

_DRIVER = """
import importlib.util, json, sys
from absl import app, flags
path, entry, argvs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
spec = importlib.util.spec_from_file_location("script", path)
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
out = []
for argv in argvs:
  flags.FLAGS.unparse_flags()
  try:
    getattr(script, entry)(flags.FLAGS([path, *argv]))
    out.append(None)
  except (app.UsageError, flags.Error, ValueError) as e:
    out.append(str(e))
print(json.dumps(out))
"""


def flag_errors(script: str, entry: str, argvs, cwd) -> list:
  """scripts/`script`.py's function `entry` (main or its like, taking
  absl's remaining argv) on each of `argvs`: the message of the error
  it raised (a UsageError, a flag's validator, a ValueError), or None
  where it raised none."""
  result = subprocess.run(
    [
      sys.executable,
      "-c",
      _DRIVER,
      str(ROOT / "scripts" / f"{script}.py"),
      entry,
      json.dumps(argvs),
    ],
    capture_output=True,
    text=True,
    check=True,
    cwd=cwd,
  )
  return json.loads(result.stdout.strip().splitlines()[-1])
