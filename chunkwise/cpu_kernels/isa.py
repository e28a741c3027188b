"""Which instruction set the CPU kernels run: chosen at run time.

The kernel library holds a path per instruction set the compiler could
target (`build.VARIANTS`) beside the portable loops that define every
result; each call runs the best one this CPU reports, unless
`CHUNKWISE_CPU_ISA` names another for the process (read once, when the
kernels load) or a call names its own (`isa=`: the tests run every path
against the portable one). Every path computes the same bits
(`tests/test_invariant_kernels.py`), so the choice changes speed only.

  isa.current()     # "avx512_vnni", "avx512", "avx2_vnni", "avx2",
                    # "neon_dotprod", "neon" or "portable"
  isa.available()   # every path this CPU runs, best last
  isa.cpu_name()    # "AMD EPYC 7B13", ... (benchmarks record both)

A path is "vector" unless it is "portable": where only the portable loops
run (a CPU without AVX2 + FMA or NEON), invariant numerics would be many
times slower, so they are not the default there (`chunkwise.numerics`).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import subprocess

from chunkwise.cpu_kernels import build

NAMES = build.NAMES  # ffi.cc numbers them from 1 (0: the default)
_NUMBER = {name: i + 1 for i, name in enumerate(NAMES)}
ENV = "CHUNKWISE_CPU_ISA"

log = logging.getLogger(__name__)


def number(name: str | None) -> int:
  """ffi.cc's number of `name` (None: 0, the process's default); a
  ValueError naming anything else."""
  if name is None:
    return 0
  if name not in _NUMBER:
    raise ValueError(
      f"isa={name!r} is not an instruction set of the CPU kernels; expected "
      f"one of {', '.join(NAMES)}"
    )
  return _NUMBER[name]


def available() -> tuple[str, ...]:
  """The paths this CPU runs, compiled into the library (best last);
  empty when the kernels did not build."""
  lib = build.library()
  if lib is None:
    return ()
  return tuple(n for n in NAMES if lib.ChunkwiseIsaUsable(_NUMBER[n]))


def current() -> str | None:
  """The path calls run by default (None: no kernels)."""
  lib = _configured()
  if lib is None:
    return None
  return NAMES[lib.ChunkwiseIsaDefault() - 1]


def load() -> bool:
  """Whether the kernels are compiled and registered (once per process,
  with `CHUNKWISE_CPU_ISA` applied and the path logged)."""
  return _configured() is not None


def vector() -> bool:
  """Whether the default path is a vector one (not the portable loops)."""
  name = current()
  return name is not None and name != "portable"


@functools.cache
def _configured():
  """The library with `CHUNKWISE_CPU_ISA` applied and the path logged,
  once per process."""
  lib = build.library()
  if lib is None:
    return None
  wanted = os.environ.get(ENV, "").strip().lower()
  if wanted and wanted != "auto":
    usable = available()
    if wanted not in usable:
      raise ValueError(
        f"{ENV}={wanted!r}: this CPU ({cpu_name()}) runs "
        f"{', '.join(usable)}; expected one of those or 'auto'"
      )
    lib.ChunkwiseSetIsa(_NUMBER[wanted])
  name = NAMES[lib.ChunkwiseIsaDefault() - 1]
  others = [n for n in available() if n != name]
  log.info(
    "chunkwise: the CPU kernels run their %s path on %s (also here: %s)",
    name,
    cpu_name(),
    ", ".join(others) or "none",
  )
  if name == "portable":
    log.warning(
      "chunkwise: no vector path of the CPU kernels for %s (%s): invariant "
      "numerics run their portable loops, many times slower, and are not "
      "the default here",
      cpu_name(),
      build.machine(),
    )
  return lib


@functools.cache
def cpu_name() -> str:
  """The CPU's model name (Linux's /proc/cpuinfo, macOS's sysctl), or the
  architecture's name."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware") and value.strip():
          return value.strip()
  except OSError:
    pass
  if platform.system() == "Darwin":
    try:
      return subprocess.run(
        ["sysctl", "-n", "machdep.cpu.brand_string"],
        capture_output=True,
        text=True,
        check=True,
      ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      pass
  return platform.processor() or build.machine()
