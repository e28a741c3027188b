"""Compiles a model's prefill and generate programs for a pod-sized mesh of
fake host CPU devices, from abstract weights (nothing is allocated at
model size), and reports memory and collectives per device beside the
analytic planner's estimate (`chunkwise.simulation.simulate`).

  python scripts/simulate.py --model=palm-540b --devices=64 --mesh=4x4x4 \\
      --layouts=ws_2d/yzx/xla --phases=generate --batch=64 --weights=int8 \\
      --json_out=sim.json --png=sim.png
  python scripts/simulate.py --model=palm-62b --prefill_layout=wg \\
      --generate_layout=ws_2d/yzx --batch=512 --prefill_len=2048
  python scripts/simulate.py --target=tpu-v5e:2x2 --model=llama-3.1-8b \\
      --layouts=ws_2d/yz --phases=generate --batch=32 --context=8192
  python scripts/simulate.py --target=tpu-v5e:2x2 --kernels

--target=tpu-<generation>:<topology> (v4, v5e, v5p, v6e; --slices for a
multi-slice mesh, x spanning the slices) compiles with XLA:TPU for that
slice's devices, described by libtpu without a TPU (pip install
'chunkwise[tpu]'); --mesh defaults to the slice's torus and --hardware
to its chip. The report then says per program whether it fits the
chip's HBM (a program XLA:TPU refuses is reported with its message) and
how long one pass takes by the compiler's cycles plus the planner's
interconnect time.

Each program is compiled at --layers depths (2 and 4 layers; "full" is
the model's own depth) and every figure is scaled to the model's depth
(fixed + layers * per-layer: the line through two depths, or fitted to
more by least squares, which averages XLA's variation between programs);
the report says so. Heads and vocabulary
are padded to what the layouts can shard on the mesh (--pad; PaLM
540B's 48 heads become 64 on 64 devices, as Pope et al. did). Prints a
table; --json_out writes every figure, --png a bar chart of memory per
device (compiled beside predicted).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence

from absl import app, flags, logging

# XLA:CPU's memory-minimizing schedule, no hoisting out of loops (see
# --min_memory_schedule).
MIN_MEMORY_FLAGS = (
  "--xla_cpu_enable_concurrency_optimized_scheduler=false "
  "--xla_disable_hlo_passes=while-loop-invariant-code-motion"
)

_MODEL = flags.DEFINE_string("model", "palm-540b", "Model preset.")
_DEVICES = flags.DEFINE_integer(
  "devices", 64, "Fake host CPU devices (the mesh uses the first ones).", 1
)
_MESH = flags.DEFINE_string(
  "mesh", None, "Mesh shape XxYxZ (default 4x4x4, or the --target's torus)."
)
_TARGET = flags.DEFINE_string(
  "target",
  "cpu",
  "cpu (fake host devices) or tpu-<generation>:<topology>, e.g. "
  "tpu-v5e:2x2, compiled by XLA:TPU without a TPU.",
)
_KERNELS = flags.DEFINE_bool(
  "kernels",
  False,
  "Instead of a model: the Pallas TPU kernels (tpu_kernels) beside XLA's "
  "ops on one chip of --target, estimated "
  "(chunkwise.simulation.kernels), as a markdown table.",
)
_SLICES = flags.DEFINE_integer(
  "slices", 1, "TPU slices (x spans them over the data-centre network).", 1
)
_PHASES = flags.DEFINE_list(
  "phases", ["prefill", "generate"], "Phases to compile: prefill, generate."
)
_LAYOUTS = flags.DEFINE_list(
  "layouts",
  ["ws_2d/yzx/xla"],
  "Layouts, each compiled for every phase of --phases.",
)
_PREFILL_LAYOUT = flags.DEFINE_string(
  "prefill_layout", None, "The prefill's layout (instead of --layouts)."
)
_GENERATE_LAYOUT = flags.DEFINE_string(
  "generate_layout", None, "The generate loop's layout (instead of --layouts)."
)
_BATCH = flags.DEFINE_integer("batch", 1, "Rows of both phases.", 1)
_PREFILL_LEN = flags.DEFINE_integer(
  "prefill_len", 2048, "Tokens per row of the prefill.", 1
)
_CONTEXT = flags.DEFINE_integer(
  "context", None, "Prefix tokens before the generate loop (--prefill_len)."
)
_STEPS = flags.DEFINE_integer(
  "generate_steps", 8, "Decode steps (columns of the loop's K/V buffer).", 1
)
_WEIGHTS = flags.DEFINE_enum(
  "weights",
  "bf16",
  ["bf16", "int8", "f32", "Q4_0", "Q4_K", "Q8_0"],
  "How weights are stored (Q*: GGUF blocks kept as they are).",
)
_CACHE = flags.DEFINE_enum(
  "kv_dtype",
  "bfloat16",
  ["bfloat16", "float32", "int8"],
  "How K/V caches are stored (int8: values and an f32 scale per token and "
  "head, `chunkwise.models.kv_int8`).",
)
flags.DEFINE_alias("cache_dtype", "kv_dtype")  # its older name
_COMPUTE = flags.DEFINE_enum(
  "compute_dtype", "bfloat16", ["bfloat16", "float32"], "Activation dtype."
)
_DEPTHS = flags.DEFINE_list(
  "layers",
  ["2", "4"],
  "Depths compiled (at least two; 'full': the model's), scaled to the model's.",
)
_PAD = flags.DEFINE_bool(
  "pad", True, "Pad heads and vocabulary so the layouts shard the model."
)
_HARDWARE = flags.DEFINE_string(
  "hardware",
  None,
  "Planner hardware for the prediction ('' for none; default tpu-v4, or "
  "the --target's chip).",
)
_MIN_MEMORY = flags.DEFINE_bool(
  "min_memory_schedule",
  True,
  "Compile with XLA:CPU's memory-minimizing scheduler and without "
  "loop-invariant code motion, closer to an accelerator compiler that "
  "bounds memory (XLA:CPU's defaults issue every layer's all-gathers "
  "first and hoist f32 copies of every weight out of the decode loop).",
)
_XLA_FLAGS = flags.DEFINE_string(
  "xla_flags", "", "More XLA_FLAGS for the compiles."
)
_NUMERICS = flags.DEFINE_list(
  "numerics",
  ["fast"],
  "Numerics of every case, one case each: fast, or invariant (a TPU "
  "program's batch-invariant Pallas kernels; docs/numerics.md).",
)
_JSON = flags.DEFINE_string("json_out", None, "Write the report here.")
_PNG = flags.DEFINE_string("png", None, "Write the memory bar chart here.")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Before JAX starts: the host platform makes the devices
  # and reads the flags once.
  os.environ["XLA_FLAGS"] = " ".join(
    (
      os.environ.get("XLA_FLAGS", ""),
      f"--xla_force_host_platform_device_count={_DEVICES.value}",
      # XLA:CPU's; XLA:TPU bounds its memory by itself.
      MIN_MEMORY_FLAGS if _MIN_MEMORY.value and _TARGET.value == "cpu" else "",
      _XLA_FLAGS.value,
    )
  ).strip()
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax.numpy as jnp

  from chunkwise import configs
  from chunkwise.bench import figures, report
  from chunkwise.partitioning import Layout, parse_mesh
  from chunkwise.simulation import simulate
  from chunkwise.simulation.programs import WeightFormat
  from chunkwise.simulation.report import table
  from chunkwise.simulation.tpu_target import Target

  try:
    target = (
      None
      if _TARGET.value == "cpu"
      else Target.parse(_TARGET.value, _SLICES.value)
    )
    if _KERNELS.value:
      if target is None:
        raise ValueError("--kernels needs a --target=tpu-...")
      from chunkwise.simulation import kernels

      print(f"one chip of {target}")
      print(kernels.kernel_table(kernels.kernel_costs(target)))
      return
    mesh = None if _MESH.value is None else parse_mesh(_MESH.value)
    if target is None:
      mesh = mesh or (4, 4, 4)
      if math.prod(mesh) > _DEVICES.value:
        raise ValueError(
          f"mesh {mesh} needs {math.prod(mesh)} devices, "
          f"--devices={_DEVICES.value}"
        )
    hardware = _HARDWARE.value
    if hardware is None:
      hardware = "tpu-v4" if target is None else target.hardware
    layers = configs.get(_MODEL.value).layers
    depths = [layers if d == "full" else int(d) for d in _DEPTHS.value]
    per_phase = {
      "prefill": _PREFILL_LAYOUT.value,
      "generate": _GENERATE_LAYOUT.value,
    }
    cases = []
    for name in _PHASES.value:
      phase = simulate.Phase(name)
      given = per_phase[phase.value]
      for text, numerics in itertools.product(
        [given] if given else _LAYOUTS.value, _NUMERICS.value
      ):
        if numerics not in ("fast", "invariant"):
          raise ValueError(
            f"--numerics={numerics!r}: expected fast or invariant"
          )
        cases.append(
          simulate.Case(
            numerics=numerics,
            phase=phase,
            layout=Layout.parse(text),
            batch=_BATCH.value,
            length=(
              _PREFILL_LEN.value
              if phase is simulate.Phase.PREFILL or _CONTEXT.value is None
              else _CONTEXT.value
            ),
            steps=_STEPS.value,
            weights=WeightFormat(_WEIGHTS.value),
          )
        )
    result = simulate.run(
      _MODEL.value,
      mesh,
      cases,
      target=target,
      depths=depths,
      pad=_PAD.value,
      cache_dtype=jnp.dtype(_CACHE.value),
      compute_dtype=jnp.dtype(_COMPUTE.value),
      hardware=hardware or None,
      log=logging.info,
    )
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  result["xla_flags"] = os.environ["XLA_FLAGS"]
  print(table(result["reports"]))
  if result["padded"]:
    print(f"padded for the mesh (from, to): {result['padded']}")
  print(result["reports"][0]["scaling"])
  if any("error" in r for r in result["reports"]):
    print("refused programs: their 'error' in the report (--json_out)")
  if _JSON.value:
    report.write_json(_JSON.value, result)
  if _PNG.value:
    figures.memory_bars(
      _PNG.value, [r for r in result["reports"] if "error" not in r]
    )


if __name__ == "__main__":
  app.run(main)
