"""The flags that name a model and the processes it spans, shared by the
batch-job scripts and the server: `ModelFlags` gives a `ModelConfig`
(--model, --layout, --mesh, --dtype, --quantize, --precision,
--numerics, --kv_dtype, --adapters), `MultiHostFlags` a `MultiHost`
(--coordinator_address, --num_processes, --process_id, --multihost,
--cpu_devices).

  MODEL = model_flags.ModelFlags()  # at import: defines the flags
  model = jobs.load_served(MODEL.config())
"""

from __future__ import annotations

from absl import flags

from chunkwise.jobs import cli
from chunkwise.jobs.config import (
  ModelConfig,
  MultiHost,
  Quantization,
  WeightDtype,
)
from chunkwise.models.kv_int8 import DTYPES as KV_DTYPES
from chunkwise.numerics import NUMERICS
from chunkwise.precision import PRECISIONS


class ModelFlags:
  """--model, --layout, --mesh, --dtype, --quantize, --precision,
  --numerics, --kv_dtype, --adapters."""

  def __init__(self):
    self.model = cli.define(
      flags.DEFINE_string,
      "model",
      "smollm2-135m",
      "A model name, a .gguf file, a Hugging Face or chunkwise checkpoint "
      "directory, or random:<preset> (random weights, for tests).",
    )
    self.layout = cli.define(
      flags.DEFINE_string,
      "layout",
      "reference",
      "Layout, e.g. ws_2d/yz/latency, or auto: the planner's choice for the "
      "mesh and --batch_size (see docs/planner.md).",
    )
    self.mesh = cli.define(
      flags.DEFINE_string,
      "mesh",
      None,
      "Mesh shape XxYxZ, e.g. 2x2x2 (default: 1x1x<all devices> for a "
      "sharded layout).",
    )
    self.dtype = cli.define(
      flags.DEFINE_enum,
      "dtype",
      None,
      [d.value for d in WeightDtype],
      "Float weights' dtype.",
    )
    self.quantize = cli.define(
      flags.DEFINE_enum,
      "quantize",
      "none",
      [q.value for q in Quantization],
      "Weight quantization.",
    )
    self.precision = cli.define(
      flags.DEFINE_enum,
      "precision",
      None,
      list(PRECISIONS),
      "Matmul precision (default: highest for f32, whose default is TF32 "
      "on GPUs; see chunkwise.precision).",
    )
    self.numerics = cli.define(
      flags.DEFINE_enum,
      "numerics",
      None,
      list(NUMERICS),
      "invariant: on the CPU a row's scores and tokens are bit-identical "
      "whatever shares its batch (default for float weights where the CPU "
      "kernels have a vector path; int8 weights: fast); q8: invariant too, "
      "int8 and GGUF-block weights' activations rounded to 8 bits "
      "(llama.cpp's speed and quality); fast: XLA's own reduction orders. "
      "See chunkwise.numerics.",
    )
    self.kv_dtype = cli.define(
      flags.DEFINE_enum,
      "kv_dtype",
      None,
      list(KV_DTYPES),
      "How K/V caches are stored (default: float32). int8: values with an "
      "f32 scale per token and head, 0.27x f32's bytes at head_dim 64, "
      "read by every attention path (chunkwise.models.kv_int8).",
    )
    self.adapters = cli.define(
      flags.DEFINE_string,
      "adapters",
      "",
      "LoRA adapters to serve besides the base model: name=path[,name=path"
      "...], each path a PEFT directory (adapter_config.json, "
      "adapter_model.safetensors). A JSON-lines example runs the one its "
      '"adapter" field names (null: the base model; absent: --adapter); '
      "examples of different adapters share batches. Read and checked "
      "before any device work; <output>.job.json records their checksums, "
      "so resuming with other adapter files is refused.",
    )

  def config(self) -> ModelConfig:
    return ModelConfig(
      name=self.model.value,
      layout=self.layout.value,
      mesh=self.mesh.value or None,
      dtype=self.dtype.value,
      quantize=self.quantize.value,
      precision=self.precision.value,
      numerics=self.numerics.value,
      kv_dtype=self.kv_dtype.value,
      adapters=self.adapters.value,
    )


class MultiHostFlags:
  """--coordinator_address, --num_processes, --process_id, --multihost,
  --cpu_devices: how this process joins a multi-process run."""

  def __init__(self):
    self.coordinator_address = cli.define(
      flags.DEFINE_string,
      "coordinator_address",
      None,
      "Multi-host: host:port of process 0.",
    )
    self.num_processes = cli.define(
      flags.DEFINE_integer,
      "num_processes",
      None,
      "Multi-host: how many processes.",
      lower_bound=1,
    )
    self.process_id = cli.define(
      flags.DEFINE_integer,
      "process_id",
      None,
      "Multi-host: this process's index.",
      lower_bound=0,
    )
    self.multihost = cli.define(
      flags.DEFINE_bool,
      "multihost",
      False,
      "Start jax.distributed with the platform's automatic detection (TPU "
      "pods, SLURM, ...) when --coordinator_address is not given.",
    )
    self.cpu_devices = cli.define(
      flags.DEFINE_integer,
      "cpu_devices",
      None,
      "Host CPU devices per process (tests run 2 processes x 4).",
      lower_bound=1,
    )

  def config(self) -> MultiHost:
    return MultiHost(
      coordinator_address=self.coordinator_address.value,
      num_processes=self.num_processes.value,
      process_id=self.process_id.value,
      auto=self.multihost.value,
      cpu_devices=self.cpu_devices.value,
    )
