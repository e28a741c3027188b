"""chunkwise's own checkpoints: Orbax arrays and a JSON description.

  cw.save(model, "ckpt/smollm2")                  # weights, HParams, vocab
  model = cw.load("ckpt/smollm2", mesh=make_mesh((2, 2, 2)), layout="ws_2d")
  cw.save(few_shot, "ckpt/few_shot")              # a prefilled ChunkResult
  few_shot = cw.load_result("ckpt/few_shot", model)
  cw.save(model.with_adapters({"math": a}), "ckpt/served")
  cw.load("ckpt/served").adapters                  # {"math": Adapter}

The directory, its description and the save protocol are `manifest.py`'s,
the arrays `arrays.py`'s, the stored vocabulary `saved_vocab.py`'s, the
served LoRA adapters `saved_adapters.py`'s, and where weights go on a mesh
`placed.py`'s; this module says what a model and a result store and checks
what they restore into. Loading first checks the file list (a missing or
truncated file is named), then every array's shape in Orbax's metadata
against what the HParams (or the target model) expect, before reading any
array data; then it restores each array
straight into the sharding the target mesh and layout give it
(`ShapeDtypeStruct` targets), so a checkpoint saved from one layout loads
onto any other, and no host ever holds more than its own shards. Weights
are saved in plain block order (shuffled weights are reordered back
first). A model serving LoRA adapters (`with_adapters`) stores them
beside its weights and is restored serving them; GGUF blocks
(quantize="native") are stored as their codes, scales and offsets, each
weight's block type and grouped axis in the description, and restored as
blocks; a saved result keeps the
adapter of each of its rows, so a restored prefix still serves only rows
of its own adapters. Only local file systems are supported.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from chunkwise import untrusted
from chunkwise.checkpoints import (
  arrays,
  manifest,
  placed,
  saved_adapters,
  saved_vocab,
)
from chunkwise.checkpoints.manifest import META
from chunkwise.configs import HParams
from chunkwise.inference import (
  ChunkResult,
  InferenceModel,
)
from chunkwise.models import Weights, quantized
from chunkwise.models.weights import unstack_layers
from chunkwise.partitioning.placement import check_placement

# -- saving ---------------------------------------------------------------


def save(obj, directory: str | os.PathLike, *, overwrite: bool = False):
  """Saves a model (weights, HParams, vocabulary, BOS/EOS, the LoRA
  adapters it serves) or a `ChunkResult` (e.g. a prefilled few-shot
  prefix, with its rows' adapters) as an Orbax checkpoint.

  Args:
    obj: an `InferenceModel` or a `ChunkResult`.
    directory: where to write; must not exist unless `overwrite`.
    overwrite: replace an existing chunkwise checkpoint.
  Returns:
    The absolute path written.
  Raises:
    FileExistsError: `directory` exists and `overwrite` is False.
    ValueError: `obj` is neither a model nor a result.
  """
  if isinstance(obj, InferenceModel):
    weights = obj.plain_weights()
    vocab, files = saved_vocab.to_json(obj.vocab)
    blocked = placed.block_formats(weights)
    meta = {
      "kind": "model",
      "hparams": obj.hparams.to_json(),
      "quantization": (
        quantized.Quantization.NATIVE.value
        if blocked
        else quantized.Quantization.INT8.value
        if quantized.is_quantized(weights)
        else None
      ),
      "bos_id": obj.bos_id,
      "eos_id": obj.eos_id,
      "eos_ids": list(obj.eos_ids),
      "vocabulary": vocab,
    }
    tree = weights
    if blocked:  # each GGUF block weight's type and grouped axis
      meta["blocks"] = blocked
    if obj.adapters:  # beside the weights (absent: none, as before)
      meta["adapters"], flat = saved_adapters.to_json(obj.adapters)
      tree = {**arrays.flatten(weights), **flat}
    return manifest.write(directory, tree, meta, files, overwrite)
  if isinstance(obj, ChunkResult):
    meta = {
      "kind": "result",
      "batch": obj.batch,
      "time": obj.time,
      "top_n": obj.top_n,
    }
    if obj.adapters is not None:  # each row's adapter name or None
      meta["adapters"] = list(obj.adapters)
    return manifest.write(directory, obj, meta, {}, overwrite)
  raise ValueError(
    f"save takes an InferenceModel or a ChunkResult, got {type(obj).__name__}"
  )


# -- loading --------------------------------------------------------------


def _brief(h: HParams) -> str:
  keys = ("layers", "d_model", "heads", "kv_heads", "head_dim", "d_ff")
  return f"HParams({', '.join(f'{k}={getattr(h, k)}' for k in keys)}, ...)"


def _model_meta(directory: str, verify: bool = True) -> tuple[dict, HParams]:
  meta = manifest.read_meta(directory, "model", verify=verify)
  hparams = meta.get("hparams")
  try:
    if not isinstance(hparams, dict):
      raise TypeError(f"expected an object, got {hparams!r}")
    h = HParams(**hparams)
  except (TypeError, ValueError) as e:
    raise ValueError(f"checkpoint {directory}: bad HParams: {e}") from None
  source = os.path.join(directory, META)
  for k in ("bos_id", "eos_id"):
    if meta.get(k) is not None:
      untrusted.check_int(meta[k], k, source=source, hi=h.vocab - 1)
  eos_ids = meta.get("eos_ids")
  if eos_ids is not None:
    if not isinstance(eos_ids, list):
      raise ValueError(f"{source}: eos_ids is not a list")
    for i in eos_ids:
      untrusted.check_int(i, "eos_ids", source=source, hi=h.vocab - 1)
  return meta, h


def _special_ids(meta: dict) -> dict:
  """The saved BOS / EOS ids, as `InferenceModel` takes them."""
  ids = {k: meta.get(k) for k in ("bos_id", "eos_id")}
  if meta.get("eos_ids") is not None:
    ids["eos_ids"] = tuple(meta["eos_ids"])
  return ids


def describe(directory: str | os.PathLike) -> tuple[HParams, Any, dict]:
  """(HParams, vocabulary, {"bos_id", "eos_id"[, "eos_ids"]}) of a saved
  model, without reading its arrays (their files are checked for presence
  and size)."""
  directory = os.path.abspath(os.fspath(directory))
  meta, h = _model_meta(directory, verify=False)
  ids = _special_ids(meta)
  return h, saved_vocab.read(directory, meta.get("vocabulary")), ids


def load_model(
  directory: str | os.PathLike,
  *,
  dtype=None,
  quantize: quantized.Quantization | str | None = None,
  mesh=None,
  layout=None,
  vocab=None,
  **model_kwargs,
) -> InferenceModel:
  """Loads a model saved by `save` onto `mesh` with `layout`; called by
  `checkpoints.load` (which checks the arguments) for checkpoint
  directories.

  Args:
    dtype: the float weights' dtype (None: as saved); int8 values and
      their f32 scales stay as they are.
    quantize: "int8" quantizes float weights after restoring them (a
      no-op for an int8 checkpoint; refused for saved GGUF blocks);
      "native" only for a checkpoint of GGUF blocks, which load as
      blocks with None too.
    vocab: replaces the saved vocabulary.
  """
  directory = os.path.abspath(os.fspath(directory))
  meta, h = _model_meta(directory)
  phases = check_placement(
    mesh,
    layout,
    model_kwargs.get("prefill_layout"),
    model_kwargs.get("generate_layout"),
    h,
  )
  legacy = meta["version"] == 1
  served = saved_adapters.parse(
    h, meta.get("adapters"), os.path.join(directory, META)
  )
  if served and legacy:
    raise ValueError(
      f"checkpoint {directory}: format version 1 lists adapters, which "
      "only later versions store"
    )
  blocked = placed.parse_block_formats(
    meta.get("blocks"), os.path.join(directory, META)
  )
  quantize = quantized.Quantization.of(quantize)
  if blocked and quantize is quantized.Quantization.INT8:
    raise ValueError(
      f"checkpoint {directory} holds GGUF blocks (saved with "
      "quantize='native'); load it with quantize='native' or None"
    )
  if not blocked and quantize is quantized.Quantization.NATIVE:
    raise ValueError(
      f"quantize='native' keeps GGUF blocks; checkpoint {directory} holds "
      f"{meta.get('quantization') or 'float'} weights (use 'int8' or None)"
    )
  names = {
    n[: -len(".values")] for n in meta["arrays"] if n.endswith(".values")
  } - set(blocked)
  saved = {
    jnp.dtype(a["dtype"]).name
    for n, a in meta["arrays"].items()
    if not n.endswith((".values", ".scale", ".offset"))
    and not saved_adapters.is_adapter_array(n)
  }
  if dtype is None:
    dtype = saved.pop() if len(saved) == 1 else jnp.float32
  if jnp.dtype(dtype).name not in ("float32", "bfloat16"):
    raise ValueError(
      f"checkpoint {directory}: weights of dtype {jnp.dtype(dtype).name}; "
      "expected float32 or bfloat16"
    )
  template = placed.abstract_weights(
    h,
    names,
    jnp.dtype(dtype),
    stacked=legacy,
    grouped=meta["version"] >= 3,
    blocked=blocked,
  )
  adapter_targets = saved_adapters.templates(h, served)
  arrays.check_arrays(
    directory,
    meta,
    {
      **{n: t.shape for n, t in arrays.flatten(template).items()},
      **{n: t.shape for n, t in adapter_targets.items()},
    },
    f"its {_brief(h)}" + (f" and {len(served)} adapters" if served else ""),
  )
  manifest.check_bytes(directory, meta, (template, adapter_targets))
  if vocab is None:
    vocab = saved_vocab.read(directory, meta.get("vocabulary"))
  if legacy:
    weights = _restore_stacked(directory, template)
    weights = jax.device_put(
      weights, placed.weight_shardings(h, mesh, phases[0], weights)
    )
  else:
    shardings = placed.weight_shardings(h, mesh, phases[0], template)
    targets = placed.with_shardings(template, shardings)
    # One restore of the weights and the adapters' arrays (Orbax restores
    # a checkpoint's whole tree).
    restored = arrays.restore(
      directory, {**arrays.flatten(targets), **adapter_targets}
    )
    weights = arrays.unflatten(targets, restored)
  if quantize is quantized.Quantization.INT8:
    weights = placed.quantize_placed(h, mesh, phases[0], weights)
  ids = _special_ids(meta)
  model = InferenceModel(
    h, weights, vocab, mesh=mesh, layout=layout, **{**ids, **model_kwargs}
  )
  if served:
    model = model.with_adapters(
      saved_adapters.build(served, restored, directory)
    )
  return model


def _restore_stacked(directory: str, template: Weights) -> Weights:
  """A version-1 checkpoint's weights, layers split into arrays of their
  own (restored on the host, to be placed by the caller)."""
  local = SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
  stacked = jax.device_get(
    arrays.restore(directory, placed.with_shardings(template, local))
  )
  return stacked.replace(layers=unstack_layers(stacked.layers))


def load_result(directory: str | os.PathLike, model: InferenceModel):
  """A `ChunkResult` saved by `save`, restored where `model`'s prefill puts
  results (its mesh and layout), KV caches in the model's cache dtype,
  remembering its rows' adapters (as a prefix it serves only rows of the
  same adapters, which `model` must then serve).

  Raises:
    ValueError: the result does not fit `model` (layers, K/V heads, head
      width or vocabulary differ: the array and both shapes are named), or
      the checkpoint is incomplete.
  """
  directory = os.path.abspath(os.fspath(directory))
  if not isinstance(model, InferenceModel):
    raise ValueError(f"model must be an InferenceModel, got {model!r}")
  meta = manifest.read_meta(directory, "result")
  h = model.hparams
  b, t, n = (
    untrusted.check_int(meta.get(k), k, source=os.path.join(directory, META))
    for k in ("batch", "time", "top_n")
  )
  saved = {k: jnp.dtype(a["dtype"]) for k, a in meta["arrays"].items()}
  template = ChunkResult.shapes(
    h, batch=b, time=t, top_n=n, cache_dtype=model.cache_dtype
  )
  arrays.check_arrays(
    directory,
    meta,
    {k: s.shape for k, s in arrays.flatten(template).items()},
    f"the model's {_brief(h)} with vocab={h.vocab}",
  )
  for k, s in arrays.flatten(template).items():
    if not k.startswith("kv_cache.") and saved.get(k) != s.dtype:
      raise ValueError(
        f"checkpoint {directory}: array {k} has dtype {saved.get(k)}, "
        f"expected {s.dtype.name}"
      )
  manifest.check_bytes(directory, meta, template)
  adapters = _result_adapters(meta.get("adapters"), b, directory)
  targets = placed.with_shardings(template, model.result_shardings(b))
  return arrays.restore(directory, targets).replace(adapters=adapters)


def _result_adapters(names, batch: int, directory: str) -> tuple | None:
  """A saved result's per-row adapter names (None: every row the base
  model, as in results saved before adapters were recorded)."""
  if names is None:
    return None
  if (
    not isinstance(names, list)
    or len(names) != batch
    or not all(n is None or (isinstance(n, str) and n) for n in names)
  ):
    raise ValueError(
      f"{os.path.join(directory, META)}: 'adapters' is not a list of "
      f"{batch} adapter names or nulls (one per row)"
    )
  return None if all(n is None for n in names) else tuple(names)
