"""What a batch job is: frozen, keyword-only configs with enums.

  job = ScoreJob(input="texts.jsonl", output="scores.jsonl",
                 model=ModelConfig(name="random:tiny"), top_n=5)
  summary = run_score(job)             # chunkwise.jobs; the same output and
                                       # summary as scripts/score.py
  job = GenerateJob(input="prompts.txt", output="samples.jsonl", steps=32,
                    sampling=Sampling(temperature=0.7), num_samples=4)
  job = ScoreJob(input="mixed.jsonl", output="out.jsonl", adapter="math",
                 model=ModelConfig(adapters={"math": "/ad/math"}))

Strings are accepted where an enum or a `Layout` is expected ("int8",
"ws_2d/yz") and converted, or refused with a ValueError naming the value.
Every field's meaning is that of the absl flag of the same name (the
scripts only parse flags into these configs).
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Mapping
from typing import ClassVar

from chunkwise.constraints.constraint import check_whitespace
from chunkwise.inference import Sampling, Speculation
from chunkwise.jobs import adapters as adapters_lib
from chunkwise.jobs import examples
from chunkwise.jobs.seqio_input import SeqioInput
from chunkwise.models.kv_int8 import DTYPES as KV_DTYPES
from chunkwise.models.quantized import Quantization
from chunkwise.numerics import NUMERICS
from chunkwise.partitioning import Layout, parse_mesh
from chunkwise.precision import PRECISIONS


class JobKind(enum.Enum):
  SCORE = examples.SCORE
  GENERATE = examples.GENERATE


class WeightDtype(enum.Enum):
  """Float weights' dtype (None in a config: the checkpoint's own)."""

  FLOAT32 = "float32"
  BFLOAT16 = "bfloat16"


class InputFormat(enum.Enum):
  """AUTO: .jsonl / .ndjson / .json files are JSON lines, others text."""

  AUTO = "auto"
  JSONL = "jsonl"
  TEXT = "text"


def _enum(kind: type[enum.Enum], value, field: str):
  """`value` as a member of `kind` (members and their values accepted)."""
  if isinstance(value, kind):
    return value
  try:
    return kind(value)
  except ValueError:
    choices = ", ".join(repr(m.value) for m in kind)
    raise ValueError(f"{field}={value!r}: expected one of {choices}") from None


def _set(config, name: str, value) -> None:
  object.__setattr__(config, name, value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """The model and where it runs."""

  name: str = "smollm2-135m"  # a preset name, a .gguf file, a checkpoint
  # directory, or random:<preset>
  layout: Layout | str = dataclasses.field(default_factory=Layout)  # or a
  # string; "auto": the planner's choice for the mesh and the job's batch
  mesh: tuple[int, int, int] | None = None  # or "2x2x2"; None: 1x1x<all
  # devices> for a sharded layout
  dtype: WeightDtype | None = None
  quantize: Quantization = Quantization.NONE
  precision: str | None = None  # "highest", "high", "default"
  numerics: str | None = None  # "invariant", "q8", "fast" (chunkwise.numerics)
  kv_dtype: str | None = None  # "float32", "bfloat16", "int8" (None: f32)
  # LoRA adapters served besides the base model: {name: PEFT directory}
  # (or "name=path,name2=path2"); examples pick one by name.
  adapters: Mapping[str, str] = dataclasses.field(
    default_factory=lambda: types.MappingProxyType({})
  )

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"model name must be a non-empty string: {self.name!r}")
    named = adapters_lib.parse(self.adapters)
    _set(self, "adapters", types.MappingProxyType(named))
    if not (isinstance(self.layout, str) and self.layout.lower() == "auto"):
      _set(self, "layout", Layout.parse(self.layout))
    else:
      _set(self, "layout", "auto")
    if isinstance(self.mesh, str):
      _set(self, "mesh", parse_mesh(self.mesh))
    if self.dtype is not None:
      _set(self, "dtype", _enum(WeightDtype, self.dtype, "dtype"))
    _set(self, "quantize", _enum(Quantization, self.quantize, "quantize"))
    if self.precision is not None and self.precision not in PRECISIONS:
      raise ValueError(
        f"precision={self.precision!r}: expected one of {list(PRECISIONS)}"
      )
    if self.numerics is not None and self.numerics not in NUMERICS:
      raise ValueError(
        f"numerics={self.numerics!r}: expected one of {list(NUMERICS)}"
      )
    if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
      raise ValueError(
        f"kv_dtype={self.kv_dtype!r}: expected one of {list(KV_DTYPES)}"
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiHost:
  """How this process joins a multi-process job (all None / False: one
  process, or `jax.distributed` already started by the caller)."""

  coordinator_address: str | None = None  # host:port of process 0
  num_processes: int | None = None
  process_id: int | None = None
  auto: bool = False  # the platform's detection (TPU pods, SLURM, ...)
  cpu_devices: int | None = None  # host CPU devices per process

  @property
  def asked(self) -> bool:
    given = (self.coordinator_address, self.num_processes, self.process_id)
    return self.auto or any(v is not None for v in given)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
  """What scoring and generation jobs share."""

  kind: ClassVar[JobKind]
  input: str = ""  # JSON lines or text, one example per line
  output: str  # JSON lines; a re-run skips the ids it holds
  seqio: SeqioInput | None = None  # a seqio Task or Mixture instead of
  # --input (`chunkwise.jobs.seqio_input`)
  model: ModelConfig = ModelConfig()
  input_format: InputFormat = InputFormat.AUTO
  batch_size: int = 8  # rows per device call, over all processes
  max_len: int | None = None  # tokens, shared prefix included (None: the
  # model's)
  shared_prefix: str = ""  # text (or @file) prefilled once for every example
  # (once per adapter the examples run)
  adapter: str | None = None  # of the examples that name none (a text
  # input's: all); one of model.adapters; None: the base model
  skip_bad_lines: bool = False  # log, count and skip them instead of stopping
  max_line_bytes: int = examples.MAX_LINE_BYTES
  max_json_depth: int = examples.MAX_JSON_DEPTH
  progress: bool = True  # a progress bar on process 0
  batch_delay_s: float = 0.0  # sleep after each batch or, with continuous
  # batching, each finished sample (throttling)
  multihost: MultiHost = MultiHost()

  def __post_init__(self):
    if not isinstance(self.output, str) or not self.output:
      raise ValueError("--output is required")
    if self.seqio is not None and not isinstance(self.seqio, SeqioInput):
      raise ValueError(f"seqio must be a SeqioInput, got {self.seqio!r}")
    if not isinstance(self.input, str):
      raise ValueError(f"--input={self.input!r} must be a path")
    if not self.input and self.seqio is None:
      raise ValueError(
        "--input is required (or --seqio_task / --seqio_mixture)"
      )
    if self.input and self.seqio is not None:
      raise ValueError(
        f"give one input: --input={self.input!r} or {self.seqio.name}, not both"
      )
    if not isinstance(self.model, ModelConfig):
      raise ValueError(f"model must be a ModelConfig, got {self.model!r}")
    _set(
      self,
      "input_format",
      _enum(InputFormat, self.input_format, "input_format"),
    )
    for name in ("batch_size", "max_line_bytes", "max_json_depth"):
      _positive(name, getattr(self, name))
    if self.max_len is not None:
      _positive("max_len", self.max_len)
    if self.batch_delay_s < 0:
      raise ValueError(f"batch_delay_s={self.batch_delay_s} must be >= 0")
    if self.adapter is not None and self.adapter not in self.model.adapters:
      served = ", ".join(map(repr, self.model.adapters)) or "none"
      raise ValueError(
        f"--adapter={self.adapter!r} is not one of --adapters ({served})"
      )


def _positive(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"--{name}={value!r} must be an integer >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoreJob(Job):
  """Scores every example: per-token log-probs, their sum, top-n."""

  kind: ClassVar[JobKind] = JobKind.SCORE
  top_n: int = 0  # most likely alternatives per scored token
  tokens: bool = False  # write each example's token ids

  def __post_init__(self):
    super().__post_init__()
    if isinstance(self.top_n, bool) or not isinstance(self.top_n, int):
      raise ValueError(f"--top_n={self.top_n!r} must be an integer")
    if self.top_n < 0:
      raise ValueError(f"--top_n={self.top_n} must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateJob(Job):
  """Samples `num_samples` continuations of every prompt."""

  kind: ClassVar[JobKind] = JobKind.GENERATE
  num_samples: int = 1
  steps: int = 64  # most tokens per sample
  sampling: Sampling = dataclasses.field(default_factory=Sampling)
  stop: tuple[str, ...] = ()  # strings that end a sample (cut off the text)
  stop_ids: tuple[int, ...] = ()  # ids that end a sample (EOS always does)
  stream: bool = False  # print the first prompt's first sample as it grows
  # At most one constraint (compiled before any device work):
  regex: str | None = None
  json_schema: str | None = None  # JSON text, or @file
  # Refuse JSON-schema keywords not enforced in full (else: checked after,
  # records say schema_valid / schema_error).
  schema_strict: bool = False
  # JSON's whitespace: "flexible" (one optional space) or "compact".
  schema_whitespace: str = "flexible"
  # One spelling of each forced run (`Constraint.fast_forward`): with
  # `speculation`'s forced drafts, each run is appended in one pass.
  fast_forward: bool = False
  choices: tuple[str, ...] | None = None
  budget_forcing: bool = False  # close each constrained sample in `steps`
  # Continuous batching (`generate_many`): samples decode in `slots` rows
  # (None: batch_size), a finished one's row taking the next sample.
  # `static_batching` runs batches of prompts to their end instead.
  slots: int | None = None
  static_batching: bool = False
  # Speculative decoding (`cw.Speculation`, no context: each sample drafts
  # from its prompt). It changes no token, so resuming ignores it.
  speculation: Speculation | None = None
  # MiB of K/V of prompts' full pages kept during a continuous run: a
  # prompt (or another sample of it) that starts like an earlier one
  # prefills only the rest (`prefix_cache`; 0: none).
  prefix_cache_mb: int = 0
  # Pages (`generate_many(kv_pages=)`) of one K/V pool the slots share
  # instead of fixed rows of `capacity` columns (0: fixed slots). Under
  # invariant numerics it changes no byte, so resuming ignores it.
  kv_pages: int = 0

  def __post_init__(self):
    super().__post_init__()
    _positive("num_samples", self.num_samples)
    pages = self.kv_pages
    if isinstance(pages, bool) or not isinstance(pages, int) or pages < 0:
      raise ValueError(
        f"kv_pages={pages!r}: expected a non-negative number of pages "
        "(0: fixed slots)"
      )
    if pages and self.static_batching:
      raise ValueError(
        f"kv_pages={pages} needs continuous batching: drop static_batching"
      )
    mb = self.prefix_cache_mb
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
      raise ValueError(
        f"prefix_cache_mb={mb!r}: expected a non-negative number of MiB "
        "(0: no prefix cache)"
      )
    if mb and self.static_batching:
      raise ValueError(
        f"prefix_cache_mb={mb} needs continuous batching: drop "
        "static_batching (a static batch prefills its prompts together)"
      )
    if self.speculation is not None:
      if not isinstance(self.speculation, Speculation):
        raise ValueError(
          f"speculation must be a chunkwise Speculation, got "
          f"{self.speculation!r}"
        )
      if self.speculation.context is not None:
        raise ValueError(
          "speculation.context must be None: each sample drafts from its "
          "own prompt"
        )
      try:
        self.speculation.checked()
      except ValueError as e:
        raise ValueError(f"--speculate: {e}") from None
    try:
      check_whitespace(self.schema_whitespace)
    except ValueError as e:
      raise ValueError(f"schema_whitespace: {e}") from None
    if self.slots is not None:
      _positive("slots", self.slots)
    _positive("steps", self.steps)
    if not isinstance(self.sampling, Sampling):
      raise ValueError(
        f"sampling must be a chunkwise Sampling, got {self.sampling!r}"
      )
    for name in ("temperature", "top_k", "top_p", "min_p", "seed"):
      value = getattr(self.sampling, name)
      if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(
          f"sampling.{name}={value!r}: a job samples every row alike, so "
          "give one number"
        )
    self.sampling.for_batch(1)  # its values' checks
    _set(self, "stop", tuple(self.stop))
    _set(self, "stop_ids", tuple(self.stop_ids))
    for s in self.stop:
      if not isinstance(s, str) or not s:
        raise ValueError(f"--stop={s!r} is empty")
    if self.choices is not None:
      _set(self, "choices", tuple(self.choices))
