"""chunkwise's own checkpoints: Orbax arrays and a JSON description.

  cw.save(model, "ckpt/smollm2")                  # weights, HParams, vocab
  model = cw.load("ckpt/smollm2", mesh=make_mesh((2, 2, 2)), layout="ws_2d")
  cw.save(few_shot, "ckpt/few_shot")              # a prefilled ChunkResult
  few_shot = cw.load_result("ckpt/few_shot", model)

A checkpoint is a directory:

  arrays/          the arrays, saved with orbax-checkpoint, named by their
                   pytree paths ("layers.q", "layers.q.values" for int8)
  tokenizer.json   the vocabulary, when it is a `TokenizerVocabulary`
  chunkwise.json   written last: what it holds ("model" or "result"), the
                   HParams, BOS/EOS ids, the vocabulary's kind and ids, each
                   array's shape and dtype, and the size of every file.

Saving writes `<dir>.partial` and renames it to `<dir>` once complete, so
an interrupted save leaves nothing at `<dir>` (and a failed one removes
its partial directory). Loading first checks the file list (a missing or
truncated file is named), then every array's shape in Orbax's metadata
against what the HParams (or the target model) expect, before reading
any array data; then it restores each array straight into the sharding
the target mesh and layout give it (`ShapeDtypeStruct` targets), so a
checkpoint saved from one layout loads onto any other, and no host ever
holds more than its own shards. Weights are saved in plain block order
(shuffled weights are reordered back first). Only local file systems are
supported.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import re
import shutil
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.sharding import SingleDeviceSharding

from chunkwise import untrusted
from chunkwise.checkpoints.tokenizer import TokenizerVocabulary
from chunkwise.configs import HParams
from chunkwise.inference import (
  ByteVocabulary,
  ChunkResult,
  InferenceModel,
)
from chunkwise.models import Weights, quantized
from chunkwise.models.weights import shape_of, stack_layers, unstack_layers
from chunkwise.partitioning import LayoutKind
from chunkwise.partitioning.multihost import barrier
from chunkwise.partitioning.placement import check_placement, shardings_for

META = "chunkwise.json"
ARRAYS = "arrays"
TOKENIZER = "tokenizer.json"
FORMAT = "chunkwise-checkpoint"
VERSION = 3
# Version 1 stored each layer weight stacked over layers ("layers.q");
# version 2 stores one array per layer ("layers.0.q"); version 3 int8
# scales per group of inputs (`quantized.group_size`), not per output
# channel as before. All are read.
READS = (1, 2, 3)
QUANTIZATIONS = (None, *quantized.SCHEMES)
# Array dtypes a checkpoint may hold.
_DTYPES = ("float32", "bfloat16", "float16", "int8", "int32")
# Restored arrays may take this many times the bytes of their files.
MAX_EXPANSION = 256
EXPANSION_FLOOR = 64 << 20  # bytes always allowed


def is_checkpoint(path: str | os.PathLike) -> bool:
  """Whether `path` is a directory saved by `save`."""
  return os.path.isfile(os.path.join(os.fspath(path), META))


# -- names ----------------------------------------------------------------


def _flatten(tree) -> dict[str, Any]:
  """{"layers.0.q": leaf, ...}: every leaf by its pytree path."""
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  return {
    ".".join(quantized.key_name(k) for k in path): leaf for path, leaf in leaves
  }


def _unflatten(like, flat: dict[str, Any]):
  """`like`'s tree with its leaves taken from `flat` by path."""
  names = list(_flatten(like))
  return jax.tree.unflatten(jax.tree.structure(like), [flat[n] for n in names])


def _nest(flat: dict[str, Any]) -> dict:
  """{"a.b": x} -> {"a": {"b": x}}: the tree Orbax stores."""
  out: dict = {}
  for name, leaf in flat.items():
    *parents, last = name.split(".")
    node = out
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = leaf
  return out


# -- saving ---------------------------------------------------------------


def _hparams_json(h: HParams) -> dict:
  out = {}
  for f in dataclasses.fields(h):
    value = getattr(h, f.name)
    out[f.name] = value.value if isinstance(value, enum.Enum) else value
  return out


def _vocab_json(vocab) -> tuple[dict, dict[str, str]]:
  """The vocabulary's description and the files that hold it."""
  if vocab is None:
    return {"kind": "none"}, {}
  if isinstance(vocab, ByteVocabulary):
    return {"kind": "bytes"}, {}
  if isinstance(vocab, TokenizerVocabulary):
    desc = {
      "kind": "tokenizer",
      "file": TOKENIZER,
      "bos_id": vocab.bos_id,
      "eos_id": vocab.eos_id,
      "pad_id": vocab.pad_id,
      "unk_id": vocab.unk_id,
      "chat_template": vocab.chat_template,
    }
    return desc, {TOKENIZER: vocab.tokenizer.to_str()}
  logging.warning(
    "the vocabulary %r is not stored in the checkpoint (only "
    "TokenizerVocabulary and ByteVocabulary are); pass vocab= to load it",
    vocab,
  )
  return {"kind": "external", "repr": repr(vocab)}, {}


def _describe(flat: dict[str, Any]) -> dict:
  return {
    name: {"shape": list(x.shape), "dtype": jnp.dtype(x.dtype).name}
    for name, x in flat.items()
  }


def _crc32(path: str) -> int:
  """CRC-32 of a file, read in 16 MiB pieces."""
  crc = 0
  with open(path, "rb") as f:
    while piece := f.read(16 << 20):
      crc = zlib.crc32(piece, crc)
  return crc


def _file_sizes(root: str) -> dict[str, int]:
  """Every file under `root` but the description itself, with its size."""
  out = {}
  for parent, _, files in os.walk(root):
    for f in files:
      path = os.path.join(parent, f)
      rel = os.path.relpath(path, root)
      if rel != META:
        out[rel] = os.path.getsize(path)
  return dict(sorted(out.items()))


def _write(
  directory, tree, meta: dict, files: dict[str, str], overwrite: bool
) -> str:
  """Saves `tree` and `meta` at `directory` all or nothing (see module)."""
  directory = os.path.abspath(os.fspath(directory))
  if os.path.exists(directory):
    if not overwrite:
      raise FileExistsError(
        f"{directory} already exists; pass overwrite=True to replace it"
      )
    if not is_checkpoint(directory) and (
      not os.path.isdir(directory) or os.listdir(directory)
    ):
      raise ValueError(
        f"{directory} exists and is not a chunkwise checkpoint (no {META}); "
        "refusing to overwrite it"
      )
  partial = directory + ".partial"
  leader = jax.process_index() == 0
  if leader and os.path.exists(partial):
    shutil.rmtree(partial)
  barrier("chunkwise_save_start")
  flat = _flatten(tree)
  # Orbax refuses empty arrays (e.g. top-n of n = 0); their shapes are
  # recorded in the description and they are made again on loading.
  stored = {n: x for n, x in flat.items() if x.size}
  try:
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.join(partial, ARRAYS), _nest(stored))
    ckpt.wait_until_finished()
    ckpt.close()
    if leader:
      for name, text in files.items():
        with open(os.path.join(partial, name), "w") as f:
          f.write(text)
      meta = {
        "format": FORMAT,
        "version": VERSION,
        **meta,
        "arrays": _describe(flat),
        "files": (sizes := _file_sizes(partial)),
        "checksums": {rel: _crc32(os.path.join(partial, rel)) for rel in sizes},
      }
      # Written last: a directory without it is not a checkpoint.
      with open(os.path.join(partial, META), "w") as f:
        json.dump(meta, f, indent=1)
    barrier("chunkwise_save_written")
    if leader:
      if os.path.exists(directory):
        old = directory + ".replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(directory, old)
        os.rename(partial, directory)
        shutil.rmtree(old)
      else:
        os.rename(partial, directory)
  except BaseException:
    if leader:
      shutil.rmtree(partial, ignore_errors=True)
    raise
  barrier("chunkwise_save_done")
  return directory


def save(obj, directory: str | os.PathLike, *, overwrite: bool = False):
  """Saves a model (weights, HParams, vocabulary, BOS/EOS) or a
  `ChunkResult` (e.g. a prefilled few-shot prefix) as an Orbax checkpoint.

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
    vocab, files = _vocab_json(obj.vocab)
    meta = {
      "kind": "model",
      "hparams": _hparams_json(obj.hparams),
      "quantization": "int8" if quantized.is_quantized(weights) else None,
      "bos_id": obj.bos_id,
      "eos_id": obj.eos_id,
      "vocabulary": vocab,
    }
    return _write(directory, weights, meta, files, overwrite)
  if isinstance(obj, ChunkResult):
    meta = {
      "kind": "result",
      "batch": obj.batch,
      "time": obj.time,
      "top_n": obj.top_n,
    }
    return _write(directory, obj, meta, {}, overwrite)
  raise ValueError(
    f"save takes an InferenceModel or a ChunkResult, got {type(obj).__name__}"
  )


# -- loading --------------------------------------------------------------


def read_meta(
  directory: str | os.PathLike, kind: str, *, verify: bool = True
) -> dict:
  """The checkpoint's description, once every file it lists is present
  with its recorded size and (with `verify`) its CRC-32, and no other file
  sits among the arrays: Orbax never parses a byte chunkwise did not
  write (accidental corruption and naive tampering end here).

  Raises:
    FileNotFoundError: no such directory.
    ValueError: not a chunkwise checkpoint, another kind, or a missing or
      truncated file (named).
  """
  directory = os.fspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint directory {directory}")
  path = os.path.join(directory, META)
  if not os.path.isfile(path):
    raise ValueError(
      f"{directory} is not a chunkwise checkpoint: it has no {META} (a save "
      "that did not finish leaves none)"
    )
  meta = untrusted.read_json(path, what="checkpoint description")
  if meta.get("format") != FORMAT:
    raise ValueError(f"{path} does not describe a {FORMAT}")
  if meta.get("version") not in READS:
    raise ValueError(
      f"{path} has format version {meta.get('version')!r}; this chunkwise "
      f"reads versions {', '.join(map(str, READS))}"
    )
  if meta.get("kind") != kind:
    raise ValueError(
      f"{directory} holds a saved {meta.get('kind')}, expected a {kind}"
    )
  _check_description(path, meta)
  for rel, size in meta["files"].items():
    file = os.path.join(directory, rel)
    if not os.path.isfile(file):
      raise ValueError(
        f"checkpoint {directory} is incomplete: {rel} is missing (expected "
        f"{size} bytes)"
      )
    found = os.path.getsize(file)
    if found != size:
      raise ValueError(
        f"checkpoint {directory} is corrupt: {rel} has {found} bytes, "
        f"expected {size} (truncated or overwritten)"
      )
  if verify:
    _verify_files(directory, meta)
  return meta


def _verify_files(directory: str, meta: dict) -> None:
  """No unlisted file among the arrays, and every file's CRC-32 as saved
  (checkpoints saved before checksums were recorded are only warned
  about)."""
  listed = set(meta["files"])
  found = _file_sizes(os.path.join(directory, ARRAYS))
  extra = sorted(
    os.path.join(ARRAYS, rel)
    for rel in found
    if os.path.join(ARRAYS, rel) not in listed
  )
  if extra:
    raise ValueError(
      f"checkpoint {directory} holds files it did not save: "
      f"{', '.join(extra[:3])}"
    )
  sums = meta.get("checksums")
  if sums is None:
    logging.warning("%s was saved without checksums: not verified", directory)
    return
  if not isinstance(sums, dict) or set(sums) != listed:
    raise ValueError(
      f"{os.path.join(directory, META)}: 'checksums' does not list every file"
    )
  for rel, want in sums.items():
    if _crc32(os.path.join(directory, rel)) != want:
      raise ValueError(
        f"checkpoint {directory} is corrupt: {rel} does not have its saved "
        "CRC-32 (changed since it was saved)"
      )


def _check_description(path: str, meta: dict) -> None:
  """The description's own fields: file sizes under relative paths inside
  the checkpoint, array shapes and dtypes (ValueError naming the field)."""
  files, arrays = meta.get("files"), meta.get("arrays")
  if not isinstance(files, dict) or not isinstance(arrays, dict):
    raise ValueError(f"{path}: 'files' and 'arrays' must be objects")
  for rel, size in files.items():
    parts = rel.replace("\\", "/").split("/")
    if os.path.isabs(rel) or ".." in parts or rel in ("", META):
      raise ValueError(
        f"{path}: file {rel!r} is not a path inside the checkpoint"
      )
    untrusted.check_int(size, f"files[{rel!r}]", source=path)
  for name, desc in arrays.items():
    where = f"arrays[{name!r}]"
    if not isinstance(desc, dict) or not isinstance(desc.get("shape"), list):
      raise ValueError(f"{path}: {where} has no shape list")
    for d in desc["shape"]:
      untrusted.check_int(d, f"{where}.shape", source=path)
    if desc.get("dtype") not in _DTYPES:
      raise ValueError(
        f"{path}: {where}.dtype={desc.get('dtype')!r} is not one of "
        f"{', '.join(_DTYPES)}"
      )


def _check_bytes(directory: str, meta: dict, targets) -> None:
  """Refuses to allocate far more than the checkpoint stores: restored
  arrays may take at most `MAX_EXPANSION` times the bytes of the array
  files (plus `EXPANSION_FLOOR`); real weights and caches compress by
  under 2x, so more means a tampered description."""
  stored = sum(
    size for rel, size in meta["files"].items() if rel.startswith(ARRAYS)
  )
  need = sum(
    math.prod(t.shape) * jnp.dtype(t.dtype).itemsize
    for t in jax.tree.leaves(targets)
  )
  if need > EXPANSION_FLOOR + MAX_EXPANSION * stored:
    raise ValueError(
      f"checkpoint {directory} would restore {need} bytes of arrays from "
      f"{stored} bytes of files (over {MAX_EXPANSION}x): its description "
      "does not match its data (tampered or corrupt)"
    )


def _stored_shapes(directory: str) -> dict[str, tuple[int, ...]]:
  """Each array's shape as Orbax's own metadata records it."""
  path = os.path.join(directory, ARRAYS)
  try:
    with ocp.StandardCheckpointer() as ckpt:
      tree = ckpt.metadata(path).item_metadata.tree
  except Exception as e:  # Orbax raises many kinds
    raise ValueError(
      f"checkpoint {directory}: cannot read the arrays' metadata: {e}"
    ) from e
  return {n: tuple(m.shape) for n, m in _flatten(tree).items()}


def _check_arrays(
  directory: str, meta: dict, want: dict[str, tuple], what: str
) -> None:
  """Raises ValueError naming the first array whose stored shape is not
  the one `what` (e.g. "HParams(layers=2, ...)") expects."""
  stored = _stored_shapes(directory)
  for name, desc in meta["arrays"].items():  # empty arrays are not stored
    if 0 in desc["shape"]:
      stored[name] = tuple(desc["shape"])
  for name, shape in want.items():
    if name not in stored:
      raise ValueError(
        f"checkpoint {directory} has no array {name}: {what} expect one of "
        f"shape {shape}"
      )
    if stored[name] != tuple(shape):
      raise ValueError(
        f"checkpoint {directory}: array {name} has shape {stored[name]}, "
        f"but {what} expect {tuple(shape)}"
      )
  extra = sorted(set(stored) - set(want))
  if extra:
    more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
    raise ValueError(
      f"checkpoint {directory} holds arrays {', '.join(extra[:5])}{more} "
      f"that {what} do not have"
    )


def _restore(directory: str, targets):
  """Orbax restore of every array into its `ShapeDtypeStruct` target."""
  flat = _flatten(targets)
  stored = {n: t for n, t in flat.items() if np.prod(t.shape)}
  try:
    with ocp.StandardCheckpointer() as ckpt:
      restored = ckpt.restore(os.path.join(directory, ARRAYS), _nest(stored))
  except Exception as e:  # Orbax raises many kinds
    raise ValueError(
      f"checkpoint {directory}: cannot read its arrays: {e}"
    ) from e
  out = {
    n: jax.device_put(jnp.zeros(t.shape, t.dtype), t.sharding)
    for n, t in flat.items()
    if n not in stored
  }
  return _unflatten(targets, {**out, **_flatten(restored)})


def _brief(h: HParams) -> str:
  keys = ("layers", "d_model", "heads", "kv_heads", "head_dim", "d_ff")
  return f"HParams({', '.join(f'{k}={getattr(h, k)}' for k in keys)}, ...)"


def _template(
  h: HParams,
  quantized_names: set[str],
  dtype,
  *,
  stacked: bool = False,
  grouped: bool = True,
) -> Weights:
  """ShapeDtypeStructs of the weights: QArray leaves for the names saved
  as int8 (scales per group, or per output channel without `grouped`),
  `dtype` for the float ones; with `stacked`, the layers stacked as
  format version 1 stored them (names "layers.q", not "layers.0.q")."""

  def one(path, spec):
    shape = shape_of(h, spec)
    name = ".".join(quantized.key_name(k) for k in path)
    if stacked:
      name = re.sub(r"^layers\.\d+\.", "layers.", name)
    if name in quantized_names:
      leaf = quantized.key_name(path[-1])
      return quantized.QArray(
        values=jax.ShapeDtypeStruct(shape, jnp.int8),
        scale=jax.ShapeDtypeStruct(
          quantized.shape_like(shape, spec, leaf, grouped=grouped),
          jnp.float32,
        ),
      )
    return jax.ShapeDtypeStruct(shape, dtype)

  out = jax.tree_util.tree_map_with_path(
    one,
    Weights.axes(h),
    is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec),
  )
  if stacked:
    out = out.replace(layers=jax.eval_shape(stack_layers, out.layers))
  return out


def _with_shardings(template, shardings):
  """`template`'s ShapeDtypeStructs with `shardings` (one, or a tree)."""
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, template)
  return jax.tree.map(
    lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=s),
    template,
    shardings,
  )


def _weight_shardings(h: HParams, mesh, layout, like):
  """Where `layout` keeps weights shaped like `like`: JAX's default device
  for the reference layout, else the layout's shardings on `mesh`."""
  if layout.kind is LayoutKind.REFERENCE:
    return SingleDeviceSharding(jax.devices()[0])
  axes = quantized.specs_like(Weights.axes(h), like)
  return shardings_for(axes, layout, mesh, h)


def _read_vocab(directory: str, desc: dict):
  source = os.path.join(directory, META)
  if not isinstance(desc, dict):
    raise ValueError(f"{source}: 'vocabulary' is not an object")
  kind = desc.get("kind")
  if kind == "bytes":
    return ByteVocabulary()
  if kind == "tokenizer":
    if desc.get("file") != TOKENIZER:
      raise ValueError(
        f"{source}: the vocabulary file is {desc.get('file')!r}, expected "
        f"{TOKENIZER!r}"
      )
    ids = {k: desc.get(k) for k in ("bos_id", "eos_id", "pad_id", "unk_id")}
    for k, v in ids.items():
      if v is not None:
        untrusted.check_int(v, f"vocabulary.{k}", source=source)
    template = desc.get("chat_template")
    if template is not None and not isinstance(template, str):
      raise ValueError(f"{source}: vocabulary.chat_template is not a string")
    return TokenizerVocabulary.from_file(
      os.path.join(directory, TOKENIZER),
      **ids,
      chat_template=template,
      chat_template_source=f"{source}: vocabulary.chat_template",
    )
  if kind == "external":
    logging.warning(
      "%s was saved with a vocabulary it does not store (%s); pass vocab= "
      "to cw.load",
      directory,
      desc.get("repr"),
    )
  return None


def _model_meta(directory: str, verify: bool = True) -> tuple[dict, HParams]:
  meta = read_meta(directory, "model", verify=verify)
  hparams = meta.get("hparams")
  try:
    if not isinstance(hparams, dict):
      raise TypeError(f"expected an object, got {hparams!r}")
    h = HParams(**hparams)
  except (TypeError, ValueError) as e:
    raise ValueError(f"checkpoint {directory}: bad HParams: {e}") from None
  for k in ("bos_id", "eos_id"):
    if meta.get(k) is not None:
      untrusted.check_int(
        meta[k], k, source=os.path.join(directory, META), hi=h.vocab - 1
      )
  return meta, h


def describe(directory: str | os.PathLike) -> tuple[HParams, Any, dict]:
  """(HParams, vocabulary, {"bos_id", "eos_id"}) of a saved model, without
  reading its arrays (their files are checked for presence and size)."""
  directory = os.path.abspath(os.fspath(directory))
  meta, h = _model_meta(directory, verify=False)
  ids = {k: meta.get(k) for k in ("bos_id", "eos_id")}
  return h, _read_vocab(directory, meta.get("vocabulary")), ids


def load_model(
  directory: str | os.PathLike,
  *,
  dtype=None,
  quantize: str | None = None,
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
      no-op for an int8 checkpoint).
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
  names = {
    n[: -len(".values")] for n in meta["arrays"] if n.endswith(".values")
  }
  saved = {
    jnp.dtype(a["dtype"]).name
    for n, a in meta["arrays"].items()
    if not n.endswith((".values", ".scale"))
  }
  if dtype is None:
    dtype = saved.pop() if len(saved) == 1 else jnp.float32
  if jnp.dtype(dtype).name not in ("float32", "bfloat16"):
    raise ValueError(
      f"checkpoint {directory}: weights of dtype {jnp.dtype(dtype).name}; "
      "expected float32 or bfloat16"
    )
  legacy = meta["version"] == 1
  template = _template(
    h, names, jnp.dtype(dtype), stacked=legacy, grouped=meta["version"] >= 3
  )
  _check_arrays(
    directory,
    meta,
    {n: t.shape for n, t in _flatten(template).items()},
    f"its {_brief(h)}",
  )
  _check_bytes(directory, meta, template)
  if vocab is None:
    vocab = _read_vocab(directory, meta.get("vocabulary"))
  if legacy:
    weights = _restore_stacked(directory, template)
    weights = jax.device_put(
      weights, _weight_shardings(h, mesh, phases[0], weights)
    )
  else:
    shardings = _weight_shardings(h, mesh, phases[0], template)
    weights = _restore(directory, _with_shardings(template, shardings))
  if quantize == "int8":
    weights = _quantize_placed(h, mesh, phases[0], weights)
  ids = {k: meta.get(k) for k in ("bos_id", "eos_id")}
  return InferenceModel(
    h, weights, vocab, mesh=mesh, layout=layout, **{**ids, **model_kwargs}
  )


def _restore_stacked(directory: str, template: Weights) -> Weights:
  """A version-1 checkpoint's weights, layers split into arrays of their
  own (restored on the host, to be placed by the caller)."""
  local = SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
  stacked = jax.device_get(
    _restore(directory, _with_shardings(template, local))
  )
  return stacked.replace(layers=unstack_layers(stacked.layers))


def _quantize_placed(h: HParams, mesh, layout, weights):
  """int8 weights from placed float ones, computed where they live."""
  specs = Weights.axes(h)
  fn = lambda w: quantized.quantize_weights(w, specs)
  out = _weight_shardings(h, mesh, layout, jax.eval_shape(fn, weights))
  return jax.jit(fn, out_shardings=out)(weights)


def load_result(directory: str | os.PathLike, model: InferenceModel):
  """A `ChunkResult` saved by `save`, restored where `model`'s prefill puts
  results (its mesh and layout), KV caches in the model's cache dtype.

  Raises:
    ValueError: the result does not fit `model` (layers, K/V heads, head
      width or vocabulary differ: the array and both shapes are named), or
      the checkpoint is incomplete.
  """
  directory = os.path.abspath(os.fspath(directory))
  if not isinstance(model, InferenceModel):
    raise ValueError(f"model must be an InferenceModel, got {model!r}")
  meta = read_meta(directory, "result")
  h = model.hparams
  b, t, n = (
    untrusted.check_int(meta.get(k), k, source=os.path.join(directory, META))
    for k in ("batch", "time", "top_n")
  )
  saved = {k: jnp.dtype(a["dtype"]) for k, a in meta["arrays"].items()}
  template = ChunkResult.shapes(
    h, batch=b, time=t, top_n=n, cache_dtype=model.cache_dtype
  )
  _check_arrays(
    directory,
    meta,
    {k: s.shape for k, s in _flatten(template).items()},
    f"the model's {_brief(h)} with vocab={h.vocab}",
  )
  for k, s in _flatten(template).items():
    if not k.startswith("kv_cache.") and saved.get(k) != s.dtype:
      raise ValueError(
        f"checkpoint {directory}: array {k} has dtype {saved.get(k)}, "
        f"expected {s.dtype.name}"
      )
  _check_bytes(directory, meta, template)
  targets = _with_shardings(template, model.result_shardings(b))
  return _restore(directory, targets)
