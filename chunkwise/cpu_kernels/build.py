"""Compiles the CPU kernels once per machine and registers them with XLA.

The library holds every instruction set the compiler can target, and the
kernels choose among them at run time (`ffi.cc`): `kernels.cc` is compiled
once per set (`VARIANTS`: AVX2 + FMA, AVX-512, AVX-512 with VNNI on
x86-64; NEON on AArch64), each with its own flags and namespace, and
`portable.cc` (the plain loops that define every result) and `ffi.cc`
(the XLA handlers and the choice) for the architecture's baseline. No
`-march=native`: a library built on one machine runs on any other of its
architecture, using what that CPU has. They compile with the system C++
compiler (`$CXX`, else g++, c++ or clang++), against the XLA FFI headers
that jaxlib ships, in parallel, into a cache directory keyed by the
sources, the compiler, its flags and the headers' jaxlib version:
`$CHUNKWISE_KERNEL_CACHE`, else `~/.cache/chunkwise/kernels`. One process
compiles while others wait on a lock; the library is written to a
temporary name and renamed into place, so no process loads half a file.

A variant the compiler cannot target is left out (logged); without a
compiler, or when the rest fails, `load()` logs one warning and returns
False: every matmul then takes the plain XLA path. Setting
`CHUNKWISE_CPU_KERNELS=0` turns the kernels off.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jaxlib

from chunkwise.cpu_kernels.toolchain import cache_dir, compiler, locked, version

INVARIANT_TARGET = "chunkwise_invariant_matmul"
UNARY_TARGET = "chunkwise_invariant_unary"
ROW_SUM_TARGET = "chunkwise_invariant_row_sum"
ATTEND_TARGET = "chunkwise_invariant_attend"
_HERE = pathlib.Path(__file__).parent
_HEADERS = (
  "common.h",
  "vec.h",
  "kernels_int8.h",
  "kernels_q8.h",
  "kernels_attend.h",
  "pool.h",
)
# Every build's flags: no contraction of a * b + c into an FMA (the
# definition says where FMAs are), no -march (see the module doc).
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-ffp-contract=off")
# name -> extra flags of kernels.cc's build for that instruction set.
_X86 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_X86, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
VARIANTS = {
  "x86_64": {
    "avx2": ("-DCW_ISA_AVX2", *_X86),
    # AVX-VNNI (Alder Lake and later client cores, without AVX-512):
    # vpdpbusd on 256 bits for numerics="q8"; everything else as "avx2".
    "avx2_vnni": ("-DCW_ISA_AVX2", *_X86, "-mavxvnni"),
    "avx512": ("-DCW_ISA_AVX512", *_AVX512),
    "avx512_vnni": ("-DCW_ISA_AVX512", *_AVX512, "-mavx512vnni"),
  },
  "aarch64": {
    "neon": ("-DCW_ISA_NEON",),
    # ARMv8.2's dot products (sdot: 4 int8 products a lane), for
    # numerics="q8"; everything else as "neon".
    "neon_dotprod": ("-DCW_ISA_NEON", "-march=armv8.2-a+dotprod"),
  },
}

# ffi.cc's numbers of the instruction sets are 1 + their index here.
NAMES = (
  "portable",
  "avx2",
  "avx2_vnni",
  "avx512",
  "avx512_vnni",
  "neon",
  "neon_dotprod",
)
_LOADED: list = []  # the variants' libraries, kept loaded

log = logging.getLogger(__name__)


def enabled() -> bool:
  """False when `CHUNKWISE_CPU_KERNELS` is 0/false/off."""
  value = os.environ.get("CHUNKWISE_CPU_KERNELS", "1").strip().lower()
  return value not in ("0", "false", "off", "no")


def machine() -> str:
  """The architecture's name in `VARIANTS` ("x86_64", "aarch64", ...)."""
  m = platform.machine().lower()
  return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


# Each instruction set's kernels are a shared object of their own: the
# same inline function or template built with other flags is the same
# symbol, and one library would keep a single copy for every set (one
# built for AVX-512, say, reached from the AVX2 path). Each object exports
# its table alone and binds its calls to its own copies (loaded
# RTLD_LOCAL besides).
_EXPORT = "ChunkwiseKernelTable"


def _shared(work: pathlib.Path) -> tuple[str, ...]:
  if platform.system() == "Darwin":
    return (
      "-shared",
      "-fvisibility=hidden",
      f"-Wl,-exported_symbol,_{_EXPORT}",
    )
  script = work / "exports.map"
  script.write_text(f"{{ global: {_EXPORT}; local: *; }};\n")
  return (
    "-shared",
    "-fvisibility=hidden",
    "-Wl,-Bsymbolic",
    f"-Wl,--version-script={script}",
  )


def compile_variants(
  cxx: str, variants: dict, out_dir: pathlib.Path, extra: tuple = ()
) -> list[str]:
  """Builds kernels.cc once per variant into `out_dir`/<name>.so; returns
  the names of those that compiled (the others are logged). `extra`:
  flags for every compile."""

  shared = _shared(out_dir)

  def one(name, flags):
    cmd = [
      cxx,
      *FLAGS,
      *shared,
      *extra,
      *flags,
      f"-DCW_NS={name}",
      str(_HERE / "kernels.cc"),
      "-o",
      str(out_dir / f"{name}.so"),
    ]
    return name, subprocess.run(
      cmd, capture_output=True, text=True, timeout=600
    )

  built = []
  workers = max(1, min(len(variants), os.cpu_count() or 1))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    for name, result in pool.map(lambda kv: one(*kv), variants.items()):
      if result.returncode:
        log.warning(
          "chunkwise: the %s kernels did not compile (left out): %s",
          name,
          result.stderr.strip()[-500:],
        )
      else:
        built.append(name)
  return built


def _compile(cxx: str) -> pathlib.Path:
  """The directory of the built libraries: main.so (ffi.cc, portable.cc)
  and <variant>.so for each variant that compiled."""
  sources = ("kernels.cc", "portable.cc", "ffi.cc", *_HEADERS)
  text = b"\0".join((_HERE / s).read_bytes() for s in sources)
  variants = VARIANTS.get(machine(), {})
  key = hashlib.sha256(
    b"\0".join(
      s.encode() if isinstance(s, str) else s
      for s in (text, version(cxx), jaxlib.__version__, repr(variants), *FLAGS)
    )
  ).hexdigest()[:16]
  out = cache_dir() / f"kernels-{key}"
  if (out / "main.so").exists():
    return out
  with locked(out.parent):
    if (out / "main.so").exists():  # built while this process waited
      return out
    work = pathlib.Path(tempfile.mkdtemp(dir=out.parent))
    try:
      compile_variants(cxx, variants, work)
      result = subprocess.run(
        [
          cxx,
          *FLAGS,
          "-shared",
          *(("-Wl,-Bsymbolic",) if platform.system() != "Darwin" else ()),
          f"-I{jax.ffi.include_dir()}",
          str(_HERE / "ffi.cc"),
          str(_HERE / "portable.cc"),
          "-o",
          str(work / "main.so"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
      )
      if result.returncode:
        raise RuntimeError(result.stderr.strip()[-2000:])
      shutil.rmtree(out, ignore_errors=True)
      os.replace(work, out)
    finally:
      shutil.rmtree(work, ignore_errors=True)
  return out


def built_variants() -> set[str]:
  """The instruction sets whose kernels this machine's build compiled
  (whether this CPU runs them or not)."""
  cxx = compiler()
  if cxx is None or not enabled():
    return set()
  return {p.stem for p in _compile(cxx).glob("*.so")} - {"main"}


@functools.cache
def library() -> ctypes.CDLL | None:
  """The compiled library with its targets registered (once per process),
  or None (see the module doc)."""
  if not enabled():
    return None
  cxx = compiler()
  if cxx is None:
    log.warning(
      "chunkwise: no C++ compiler found ($CXX, g++, c++, clang++); the "
      "CPU kernels are off: matmuls run as XLA dots"
    )
    return None
  try:
    built = _compile(cxx)
    lib = ctypes.cdll.LoadLibrary(str(built / "main.so"))
    for name in ("ChunkwiseIsaUsable", "ChunkwiseIsaCpuHas", "ChunkwiseSetIsa"):
      getattr(lib, name).argtypes = [ctypes.c_int64]
    lib.ChunkwiseIsaDefault.restype = ctypes.c_int64
    lib.ChunkwiseRegisterIsa.argtypes = [ctypes.c_int64, ctypes.c_void_p]
    for number, name in enumerate(NAMES, start=1):
      # Only a set the CPU runs is loaded at all.
      path = built / f"{name}.so"
      if path.exists() and lib.ChunkwiseIsaCpuHas(number):
        variant = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
        variant.ChunkwiseKernelTable.restype = ctypes.c_void_p
        lib.ChunkwiseRegisterIsa(number, variant.ChunkwiseKernelTable())
        _LOADED.append(variant)
    for target, symbol in (
      (INVARIANT_TARGET, lib.ChunkwiseInvariantMatmul),
      (UNARY_TARGET, lib.ChunkwiseInvariantUnary),
      (ROW_SUM_TARGET, lib.ChunkwiseInvariantRowSum),
      (ATTEND_TARGET, lib.ChunkwiseInvariantAttend),
    ):
      jax.ffi.register_ffi_target(
        target, jax.ffi.pycapsule(symbol), platform="cpu"
      )
  except (OSError, RuntimeError, subprocess.SubprocessError) as e:
    log.warning(
      "chunkwise: the CPU kernels did not build (%s); matmuls run as XLA dots",
      str(e).splitlines()[-1] if str(e) else type(e).__name__,
    )
    return None
  return lib
