"""The benchmark's settings: what one run measures (`suite.measure`), read
from the command line's flags and checked before anything loads.

  s = settings.from_flags(flags.FLAGS.flag_values_dict())
  s.check(described.hparams, len(prompt_ids))

Every `Settings` field is named as the flag that sets it
(`scripts/benchmark.py`), and every ValueError here names that flag and
the bad value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from chunkwise import checkpoints, constraints, memory
from chunkwise.bench import reference
from chunkwise.bench import slot_step as bench_slot_step
from chunkwise.inference import Speculation
from chunkwise.numerics import NUMERICS

WEIGHTS = ("float32", "bfloat16", "int8", "native")

# Named constraints: the acceptance set, plus free text (any
# character but NUL), which never forces an early stop.
CONSTRAINTS = {
  "choice": constraints.Choice(["yes", "no", "maybe"]),
  "integer": constraints.Regex(r"-?(0|[1-9][0-9]*)"),
  "date": constraints.Regex(
    r"(19|20)[0-9][0-9]-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
  ),
  "json": constraints.JsonSchema(
    {
      "type": "object",
      "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer"},
      },
      "required": ["name", "age"],
    }
  ),
  "text": constraints.Regex(r"[^\x00]*"),
}


@dataclasses.dataclass(frozen=True)
class Settings:
  """One run's settings, each named as the flag that sets it."""

  model: str
  prompt: str = "The capital of France is"  # the decode prompt, after BOS
  weights: tuple[str, ...] = ("float32",)
  steps: int = 128
  runs: int = 3
  seed: int = 0
  precision: str | None = None
  compute_dtype: str = "float32"
  decode_batches: tuple[int, ...] = (1,)
  prefill_batches: tuple[int, ...] = (1,)
  prefill_lengths: tuple[int, ...] = (6,)
  profile_batches: tuple[int, ...] = ()
  hf_dtypes: tuple[str, ...] = ()  # empty: transformers not timed
  bandwidth_mib: int = 512
  matmul_size: int = 2048
  constraints: tuple[str, ...] = ()
  numerics: tuple[str, ...] = ()
  numerics_rounds: int = 5
  numerics_drift_batches: tuple[int, ...] = (1,)
  speculate: tuple[Speculation, ...] = ()
  speculate_batches: tuple[int, ...] = (1,)
  speculate_rounds: int = 3
  fast_forward_batches: tuple[int, ...] = ()  # empty: not run
  continuous: bool = False
  continuous_requests: int = 256
  continuous_long: int = 256
  slots: int = 16
  paged_slots: int = 0
  adapters: int = 0
  adapter_rank: int = 16
  adapter_batch: int = 16
  paged_attention_contexts: tuple[int, ...] = ()
  kv_dtype_contexts: tuple[int, ...] = ()
  slot_step_capacity: int = 0
  chunked_prefill_length: int = 0
  chunked_prefill_piece: int = 0

  def check(self, h, prompt_length: int) -> None:
    """What the settings ask of the model `h`, checked before anything
    loads: a ValueError names the flag and the value."""
    if self.continuous or self.paged_slots:
      for name in ("continuous_requests", "continuous_long", "slots"):
        if getattr(self, name) < 1:
          raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
    for name in ("paged_attention_contexts", "kv_dtype_contexts"):
      for c in getattr(self, name):
        if c + self.steps > h.max_len:
          raise ValueError(
            f"--{name}: {c} columns and --steps={self.steps} pass the "
            f"model's {h.max_len} positions"
          )
    if self.slot_step_capacity:
      try:
        bench_slot_step.check(
          self.slots,
          self.slot_step_capacity,
          prompt_length,
          h.max_len,
          self.runs,
        )
      except ValueError as e:
        raise ValueError(f"--slot_step_capacity: {e}") from None
    for name, low in (
      ("adapters", 0),
      ("adapter_rank", 1),
      ("adapter_batch", 1),
    ):
      if getattr(self, name) < low:
        raise ValueError(
          f"--{name} must be >= {low}, got {getattr(self, name)}"
        )
    longest = max(
      *self.prefill_lengths,
      prompt_length + self.steps,
      prompt_length + 8 + (self.continuous_long if self.continuous else 0),
      self.chunked_prefill_length + 4,
    )
    if longest > h.max_len:
      raise ValueError(
        f"{longest} tokens (longest prefill, or prompt + --steps) exceed the "
        f"model's max_len={h.max_len}"
      )
    if self.model.startswith(checkpoints.RANDOM):
      if "native" in self.weights:
        raise ValueError(
          f"--weights=native keeps a GGUF file's blocks; --model={self.model} "
          "is random"
        )
      check_fits(self.model, h, self.weights)


def init_dtype(weights: str) -> str:
  """What random weights are drawn in (int8: quantized from bf16)."""
  return "float32" if weights == "float32" else "bfloat16"


def check_fits(name: str, h, kinds) -> None:
  """Random weights are drawn on the device: refuse, in one line, a preset
  whose largest configuration would not fit in its free memory."""
  need = max(
    h.num_params() * np.dtype(init_dtype(k)).itemsize
    + (h.num_params() if k == "int8" else 0)
    for k in kinds
  )
  try:
    memory.check_fits(
      f"{h.num_params() / 1e9:.2f}B random weights for "
      f"--weights={','.join(kinds)}",
      need,
    )
  except ValueError as e:
    raise ValueError(f"--model={name}: {e}") from None


# How each flag's value becomes the field of the same name.
_INT_LISTS = (
  "decode_batches",
  "prefill_batches",
  "prefill_lengths",
  "numerics_drift_batches",
  "speculate_batches",
)
_COLUMN_LISTS = ("paged_attention_contexts", "kv_dtype_contexts")


# Lists of names; empty (but for --weights) means "not run".
_CHOICES = {
  "weights": WEIGHTS,
  "hf_dtypes": reference.TORCH_DTYPES,
  "constraints": tuple(CONSTRAINTS),
  "numerics": NUMERICS,
}


def positive_ints(name: str, values) -> list[int]:
  out = []
  for v in values:
    try:
      n = int(v)
    except ValueError:
      n = 0
    if n < 1:
      raise ValueError(
        f"--{name}: {v!r} is not a positive integer (got {list(values)})"
      )
    out.append(n)
  if not out:
    raise ValueError(f"--{name} is empty: expected positive integers")
  return out


def one_of(name: str, values, allowed) -> list[str]:
  bad = [v for v in values if v not in allowed]
  if bad or not values:
    raise ValueError(
      f"--{name}={','.join(values)}: expected a list of {allowed}"
    )
  return list(dict.fromkeys(values))


def _columns(name: str, values) -> tuple[int, ...]:
  for c in values:
    if not c.isdigit() or int(c) < 1:
      raise ValueError(f"--{name}: {c!r} is not a count of columns >= 1")
  return tuple(int(c) for c in values)


def from_flags(flags: Mapping[str, Any]) -> Settings:
  """Settings from the flags' values (absl's: lists of strings for lists),
  each checked; `compare_hf` and `speculate_k` shape two fields."""
  values = {}
  for field in dataclasses.fields(Settings):
    name = field.name
    v = flags[name]
    optional = name in ("profile_batches", "fast_forward_batches")
    if name in _INT_LISTS or (optional and v):
      v = tuple(positive_ints(name, v))
    elif name in _COLUMN_LISTS:
      v = _columns(name, v)
    elif name in _CHOICES and (v or name == "weights"):
      v = tuple(one_of(name, v, _CHOICES[name]))
    elif name == "speculate" and v:
      drafters = one_of(name, v, Speculation.DRAFTERS)
      try:
        common = dict(
          k=flags["speculate_k"], calibrate=flags["speculate_calibrate"]
        )
        if flags["speculate_weight_rows"] is not None:
          common["weight_rows"] = flags["speculate_weight_rows"]
        v = tuple(Speculation(drafter=d, **common).checked() for d in drafters)
      except ValueError as e:
        raise ValueError(f"--speculate_k / _weight_rows: {e}") from None
    elif isinstance(v, list):
      v = tuple(v)
    values[name] = v
  if not flags["compare_hf"]:
    values["hf_dtypes"] = ()
  for name in ("numerics_rounds", "speculate_rounds"):
    if values[name] < 1:
      raise ValueError(f"--{name}={values[name]}: expected at least 1")
  return Settings(**values)
