"""The AArch64 (NEON) path of the CPU kernels, bit for bit against their
portable definition: tests/kernels_selftest.cc built with Debian's cross
compiler (g++-aarch64-linux-gnu) and run under qemu-user (qemu-aarch64),
as .ci/run installs them. Without them the test is skipped, except under
CI=true, where it fails. And every instruction set's build of this
machine's architecture compiles, those this CPU cannot run included."""

import os
import pathlib
import shutil
import subprocess

import pytest

from chunkwise.cpu_kernels import build

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNELS = ROOT / "chunkwise" / "cpu_kernels"
CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"


def _tools_or_skip():
  missing = [t for t in (CROSS, QEMU) if shutil.which(t) is None]
  if missing and build.machine() != "aarch64":
    if os.environ.get("CI") == "true":
      pytest.fail(f"CI needs {missing} (.ci/run installs them)")
    pytest.skip(
      f"no {missing}: apt-get install g++-aarch64-linux-gnu qemu-user"
    )


def _selftest(cxx: str, flags, out: pathlib.Path) -> None:
  result = subprocess.run(
    [
      cxx,
      *build.FLAGS,
      *flags,
      "-pthread",
      f"-I{KERNELS}",
      str(ROOT / "tests" / "kernels_selftest.cc"),
      str(KERNELS / "kernels.cc"),
      str(KERNELS / "portable.cc"),
      "-o",
      str(out),
    ],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("variant", sorted(build.VARIANTS["aarch64"]))
def test_neon_is_its_definition(tmp_path, variant):
  """Each AArch64 build (NEON; NEON with ARMv8.2's dot products, run on
  qemu's "max" CPU, which has them) against the portable loops, 8-bit
  activations included."""
  _tools_or_skip()
  native = build.machine() == "aarch64"
  binary = tmp_path / f"selftest_{variant}"
  flags = build.VARIANTS["aarch64"][variant]
  cxx = build.compiler() if native else CROSS
  # static: qemu-user then needs no AArch64 libraries
  static = () if native else ("-static",)
  _selftest(cxx, (*flags, f"-DCW_NS={variant}", *static), binary)
  run = [str(binary), "60"]
  if not native:
    run = [QEMU, "-cpu", "max", *run]
  result = subprocess.run(run, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:]
  assert f"{variant}: 0 failures" in result.stdout


def test_every_variant_of_this_architecture_compiles():
  """The library holds every instruction set the compiler targets, not
  only those of the CPU that built it (a cache is then good anywhere)."""
  assert build.library() is not None
  want = set(build.VARIANTS.get(build.machine(), {}))
  assert want and build.built_variants() == want
