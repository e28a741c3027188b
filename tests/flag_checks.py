"""Scripts' flags checked in one child process (a process a script spent
its seconds importing JAX): bad flag sets of one script, its entry point
run on each argv in turn after absl parses it and the error's text kept;
and the flags each of several scripts defines.

  errors = flag_errors("benchmark", "run", [["--steps=0"], ...], cwd)
  names = defined_flags(["score", "serve"], cwd)  # {"score": {...}, ...}
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


# JAX and chunkwise imported once; each script then defines its flags in a
# forked child of its own (absl's FLAGS is one registry a process, and
# scripts define flags of the same names), which writes their names back.
_DEFINED = """
import importlib.util, json, os, sys, traceback
from absl import flags
import chunkwise
out = {}
for path in json.loads(sys.argv[1]):
  read, write = os.pipe()
  if os.fork() == 0:
    try:  # the child never returns into this loop
      os.close(read)
      spec = importlib.util.spec_from_file_location("script", path)
      spec.loader.exec_module(importlib.util.module_from_spec(spec))
      names = sorted(flags.FLAGS)
    except BaseException:
      names = traceback.format_exc()
    try:
      os.write(write, json.dumps(names).encode())
    finally:
      os._exit(0)
  os.close(write)
  with os.fdopen(read) as f:
    out[path] = json.loads(f.read())
  os.wait()
print(json.dumps(out))
"""


def defined_flags(scripts, cwd) -> dict[str, set[str]]:
  """The names of the flags each of scripts/`scripts`.py defines (absl's
  own among them, as `--helpfull` lists them). Raises RuntimeError with
  the traceback of a script whose import failed."""
  paths = {str(ROOT / "scripts" / f"{s}.py"): s for s in scripts}
  result = subprocess.run(
    [sys.executable, "-c", _DEFINED, json.dumps(list(paths))],
    capture_output=True,
    text=True,
    check=True,
    cwd=cwd,
  )
  out = json.loads(result.stdout.strip().splitlines()[-1])
  failed = {paths[p]: e for p, e in out.items() if isinstance(e, str)}
  if failed:
    raise RuntimeError(f"scripts whose import failed: {failed}")
  return {paths[p]: set(names) for p, names in out.items()}
