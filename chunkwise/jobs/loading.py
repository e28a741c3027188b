"""Step 4's model and the processes it spans: `jax.distributed` started
(multi-host), and the model a config names loaded onto the mesh it names
(`layout="auto"`: the planner's choice for the job's batch and lengths).
A server loads its model here too (`load_served`, with its adapters).

  process, processes = loading.start_processes(job.multihost)
  model = loading.load_model(job, setup.described)

Multi-host: one model spans the mesh of every process's devices (JAX's
multi-controller SPMD); see `driver` for how the processes split a job.
"""

from __future__ import annotations

from chunkwise import checkpoints, memory, partitioning
from chunkwise.inference import InferenceModel
from chunkwise.jobs import adapters as adapters_lib
from chunkwise.jobs.config import Job, ModelConfig, MultiHost, Quantization
from chunkwise.jobs.job_setup import JobError, describe_model
from chunkwise.partitioning import LayoutKind
from chunkwise.planner import choice as planner_choice


def start_processes(hosts: MultiHost) -> tuple[int, int]:
  """Starts `jax.distributed` when `hosts` asks; (process index, count)."""
  if hosts.asked:
    try:
      partitioning.initialize_multihost(
        hosts.coordinator_address,
        hosts.num_processes,
        hosts.process_id,
        local_device_count=hosts.cpu_devices,
      )
    except ValueError as e:
      raise JobError(str(e)) from None
  elif hosts.cpu_devices:
    import jax

    jax.config.update("jax_num_cpu_devices", hosts.cpu_devices)
  import jax

  return jax.process_index(), jax.process_count()


def check_fits(job: Job, described: checkpoints.Description) -> None:
  """Random weights are drawn on the device: refuse, in one line, those
  it cannot hold (checkpoints are read as they come)."""
  name = job.model.name
  if not name.startswith(checkpoints.RANDOM):
    return
  params = described.hparams.num_params()
  dtype = job.model.dtype.value if job.model.dtype else "float32"
  try:
    memory.check_random_weights(params, dtype)
  except ValueError as e:
    raise ValueError(f"--model={name}: {e}") from None


def load_model(job: Job, described: checkpoints.Description) -> InferenceModel:
  """Step 4's model on the mesh the config names."""
  auto = job.model.layout == "auto"
  workload = _workload(job, described) if auto else None
  return load_configured(job.model, described, workload=workload)


def load_configured(
  m: ModelConfig, described: checkpoints.Description, *, workload=None
) -> InferenceModel:
  """The model `m` names, on the mesh it names (`workload`: what
  `layout="auto"` plans for)."""
  import jax

  shape = m.mesh
  auto = m.layout == "auto"
  if shape is None and (auto or m.layout.kind is not LayoutKind.REFERENCE):
    shape = (1, 1, jax.device_count())
  mesh = None if shape is None else partitioning.make_mesh(shape)
  dtype = None if m.dtype is None else m.dtype.value
  extra = {"workload": workload} if auto and workload is not None else {}
  if m.name.startswith(checkpoints.RANDOM):
    return InferenceModel.random(
      described.hparams,
      seed=0,
      mesh=mesh,
      layout=m.layout,
      vocab=described.vocab,
      dtype=dtype or "float32",
      precision=m.precision,
      numerics=m.numerics,
      kv_dtype=m.kv_dtype,
      **extra,
    )
  return checkpoints.load(
    m.name,
    dtype=dtype,
    quantize=m.quantize,
    mesh=mesh,
    layout=m.layout,
    precision=m.precision,
    numerics=m.numerics,
    kv_dtype=m.kv_dtype,
    **extra,
  )


def load_served(m: ModelConfig) -> InferenceModel:
  """The model `m` names with its adapters (what a server runs); raises
  ValueError / FileNotFoundError for a bad name, file or adapter, before
  placing anything."""
  described = describe_model(m.name)
  loaded = adapters_lib.load(m.adapters, described.hparams)
  if m.name.startswith(checkpoints.RANDOM) and m.quantize is not (
    Quantization.NONE
  ):
    raise ValueError("--quantize applies to checkpoints, not random:")
  model = load_configured(m, described)
  return model.with_adapters(loaded) if loaded else model


def _workload(job: Job, described) -> planner_choice.Workload:
  """What `--layout=auto` plans for: the job's batch, its longest
  allowed prompt (max_len, else 512) and its steps (0 when scoring)."""
  steps = getattr(job, "steps", 0)
  prompt = job.max_len or min(512, described.hparams.max_len - steps - 1)
  return planner_choice.Workload(
    batch=job.batch_size, prefill_len=max(1, prompt), generate_len=steps
  )


def is_main_process() -> bool:
  import jax

  return jax.process_index() == 0
