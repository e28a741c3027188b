"""PEFT LoRA adapters -> `lora.Adapter`, in chunkwise's weight layout.

A PEFT adapter directory holds `adapter_config.json` and
`adapter_model.safetensors` with, per adapted module, lora_A [r, in] and
lora_B [out, r] (PyTorch's y = x Wᵀ), the update being
ΔW = scale · B @ A, scale = lora_alpha / r (rsLoRA: / sqrt(r)). Read with
`hparams`, each pair comes back as the Hugging Face import
(`hf_tensors.to_weights`) lays out the base weight it adapts, so
`lora.merged(W, A, B)` is the import of PEFT's `merge_and_unload()`:

  q_proj  A [r, d]   B [h*dh, r]  -> A [d, r]      B [r, h, dh]
  k/v     A [r, d]   B [kv*dh, r] -> A [d, r]      B [r, kv, dh]
  o_proj  A [r, h*dh] B [d, r]    -> A [h, dh, r]  B [r, d]
  gate/up A [r, d]   B [f, r]     -> A [d, r]      B [r, f]
  down    A [r, f]   B [d, r]     -> A [f, r]      B [r, d]

that is A ← Aᵀ and B ← scale · Bᵀ, split into heads like the base weight
(no row permutation: Hugging Face's q/k rows are already in the order
chunkwise's RoPE reads). Phi-3's fused `qkv_proj` / `gate_up_proj` share
one A; their B is cut by rows like the base tensor (`hf_tensors.unfuse`).

  adapter = load_adapter("path/to/adapter", model.hparams)
  adapter.targets                      # ("q", "v")
  adapter = load_adapter("path/to/adapter")   # without the model:
  adapter = fit(adapter, model.hparams)       # 2-D until fitted

Without `hparams` the heads cannot be told apart, so every A is [in, r]
and every B [r, out] (the same numbers, flat; `fit` reshapes them and
pads the layer list to the model's), and fused attention is refused.

Everything read is untrusted: the config is bounded JSON, the tensors
are checked against r (and `hparams`) before they are converted, and
pickles (`adapter_model.bin`) are never loaded.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from absl import logging

from chunkwise import untrusted
from chunkwise.checkpoints import safetensors
from chunkwise.configs import HParams
from chunkwise.models import lora

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "fit", "load_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_RANK = 1 << 16
MAX_LAYERS = 1 << 16
MAX_TARGETS = 1 << 12  # entries of a target_modules list

# PEFT module -> (its block, chunkwise targets; fused modules list their
# parts in row order).
_MODULES = {
  "q_proj": ("self_attn", ("q",)),
  "k_proj": ("self_attn", ("k",)),
  "v_proj": ("self_attn", ("v",)),
  "o_proj": ("self_attn", ("o",)),
  "qkv_proj": ("self_attn", ("q", "k", "v")),
  "gate_proj": ("mlp", ("gate",)),
  "up_proj": ("mlp", ("up",)),
  "down_proj": ("mlp", ("down",)),
  "gate_up_proj": ("mlp", ("gate", "up")),
}
_TENSOR = re.compile(
  r"(?P<module>(?P<prefix>(?:model\.)?layers\.)(?P<layer>\d{1,6})\."
  r"(?P<block>self_attn|mlp)\.(?P<kind>\w+))\.lora_(?P<ab>[AB])\.weight"
)
# Config keys that turn on a LoRA variant whose forward pass is not
# x @ A @ B (or whose tensors are not only A and B): refused when set.
_VARIANTS = (
  "lora_bias",
  "layer_replication",
  "target_parameters",
  "trainable_token_indices",
  "alora_invocation_tokens",
  "use_qalora",
  "use_bdlora",
  "arrow_config",
  "kasa_config",
  "monteclora_config",
  "velora_config",
)
# Initialisations that also rewrite the base weights (the adapter then
# applies to the rewritten model, not the published one).
_REWRITE_BASE = ("pissa", "olora", "corda", "loftq")


class AdapterFileMissing(FileNotFoundError, ValueError):
  """A file the adapter needs is absent (both a FileNotFoundError, like the
  checkpoint readers', and a ValueError, like every other refusal)."""


def _brief(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


@dataclasses.dataclass(frozen=True)
class _Config:
  rank: int
  scale: float
  layers: frozenset[int] | None  # layers_to_transform
  modules: tuple[str, ...] | None  # target_modules as a list


def _check_config(config: Mapping[str, Any], source: str) -> _Config:
  def refuse(key: str, why: str):
    raise ValueError(f"{source}: {key}={_brief(config.get(key))} {why}")

  if config.get("peft_type") != "LORA":
    refuse("peft_type", 'is not supported: only LoRA ("LORA") adapters are')
  if config.get("use_dora"):
    refuse("use_dora", "is not supported: DoRA rescales each weight column")
  for key in ("rank_pattern", "alpha_pattern"):
    value = config.get(key)
    if value is not None and not isinstance(value, dict):
      refuse(key, "is not an object")
    if value:
      refuse(
        key,
        f"is unsupported: per-module {key.split('_')[0]}s (for "
        f"{', '.join(map(repr, list(value)[:5]))}) are not read",
      )
  if config.get("bias", "none") != "none":
    refuse("bias", 'is not supported: only "none" (no trained biases)')
  if config.get("modules_to_save"):
    refuse(
      "modules_to_save",
      "is not supported: an adapter may only add LoRA to q/k/v/o and "
      "gate/up/down, not replace whole modules",
    )
  if config.get("fan_in_fan_out"):
    refuse("fan_in_fan_out", "is not supported (GPT-2 style Conv1D weights)")
  for key in _VARIANTS:
    if config.get(key):
      refuse(key, "is not supported: a LoRA variant chunkwise lacks")
  init = config.get("init_lora_weights")
  if isinstance(init, str) and init.startswith(_REWRITE_BASE):
    logging.warning(
      "%s: init_lora_weights=%r also rewrites the base weights: the adapter "
      "is right only on the base model it was trained with",
      source,
      init,
    )
  rank = untrusted.check_int(
    config.get("r", 8), "r", source=source, lo=1, hi=MAX_RANK
  )
  alpha = untrusted.check_float(
    config.get("lora_alpha", 8), "lora_alpha", source=source
  )
  rslora = config.get("use_rslora", False)
  if not isinstance(rslora, bool):
    refuse("use_rslora", "is not true or false")
  scale = alpha / (math.sqrt(rank) if rslora else rank)
  layers = config.get("layers_to_transform")
  if layers is not None:
    listed = layers if isinstance(layers, list) else [layers]
    layers = frozenset(
      untrusted.check_int(
        i, "layers_to_transform", source=source, hi=MAX_LAYERS - 1
      )
      for i in listed
    )
  targets = config.get("target_modules")
  if isinstance(targets, list):
    if len(targets) > MAX_TARGETS or not all(
      isinstance(t, str) for t in targets
    ):
      refuse("target_modules", f"is not a list of <= {MAX_TARGETS} names")
    other = [t for t in targets if t.rsplit(".", 1)[-1] not in _MODULES]
    if other:
      raise ValueError(
        f"{source}: target_modules names {_brief(other)[1:-1]}, "
        f"which chunkwise cannot adapt: only {', '.join(_MODULES)}"
      )
    targets = tuple(targets)
  elif targets is not None and not isinstance(targets, str):
    refuse("target_modules", "is neither a list of names nor a regex")
  else:  # a regex (or "all-linear"): the tensors say what it matched
    targets = None
  return _Config(rank, scale, layers, targets)


def _named(module: str, targets: tuple[str, ...]) -> bool:
  """PEFT's rule for a list of target modules: the name or a suffix."""
  return any(module == t or module.endswith("." + t) for t in targets)


def _files(directory: str) -> tuple[str, str]:
  if not os.path.isdir(directory):
    raise AdapterFileMissing(f"no adapter directory at {directory}")
  config = os.path.join(directory, CONFIG_FILE)
  weights = os.path.join(directory, WEIGHTS_FILE)
  if not os.path.isfile(config):
    raise AdapterFileMissing(
      f"{directory} is not a PEFT adapter: no {CONFIG_FILE}"
    )
  if not os.path.isfile(weights):
    pickles = [
      f
      for f in ("adapter_model.bin", "adapter_model.pt")
      if os.path.exists(os.path.join(directory, f))
    ]
    if pickles:
      raise ValueError(
        f"{directory}: {pickles[0]} is a pickle, which chunkwise never "
        "loads (unpickling can run code); save the adapter with "
        "save_pretrained(safe_serialization=True)"
      )
    raise AdapterFileMissing(f"{directory} has no {WEIGHTS_FILE}")
  return config, weights


def _pairs(tensors, path: str, hparams: HParams | None):
  """{(layer, PEFT module kind): {"module": its name, "A": (tensor name,
  array), "B": ...}}, every name, layer and dtype checked."""
  found: dict[tuple[int, str], dict[str, Any]] = {}
  limit = hparams.layers if hparams is not None else MAX_LAYERS
  for key, value in tensors.items():
    m = _TENSOR.fullmatch(key.removeprefix("base_model.model."))
    kind = m and m["kind"]
    if not m or kind not in _MODULES or _MODULES[kind][0] != m["block"]:
      module = key.split(".lora_")[0].removeprefix("base_model.model.")
      raise ValueError(
        f"{path}: tensor {key} adapts {module}, which chunkwise cannot "
        f"adapt (only LoRA A/B of {', '.join(_MODULES)} in the layers)"
        if ".lora_" in key
        else f"{path}: tensor {key} is not a LoRA A or B weight"
      )
    layer = int(m["layer"])
    if layer >= limit:
      raise ValueError(
        f"{path}: tensor {key} is for layer {layer}; the model has "
        f"{limit} layers"
      )
    if value.dtype.kind != "f" and value.dtype.name != "bfloat16":
      raise ValueError(f"{path}: tensor {key} has dtype {value.dtype}")
    entry = found.setdefault((layer, kind), {"module": m["module"]})
    if m["ab"] in entry:
      raise ValueError(f"{path}: tensor {key} appears twice")
    entry[m["ab"]] = (key, value)
  for (layer, kind), entry in found.items():
    for ab in "AB":
      if ab not in entry:
        raise ValueError(
          f"{path}: lora_{ab} of layer {layer}'s {kind} is missing "
          f"(only {entry['A' if ab == 'B' else 'B'][0]} is there)"
        )
  return found


def _sizes(hparams: HParams, kind: str) -> tuple[int, tuple[int, ...]]:
  """(in features, out features of each part) of a PEFT module."""
  d, f = hparams.d_model, hparams.d_ff
  q, kv = hparams.heads * hparams.head_dim, hparams.kv_heads * hparams.head_dim
  return {
    "q_proj": (d, (q,)),
    "k_proj": (d, (kv,)),
    "v_proj": (d, (kv,)),
    "o_proj": (q, (d,)),
    "qkv_proj": (d, (q, kv, kv)),
    "gate_proj": (d, (f,)),
    "up_proj": (d, (f,)),
    "down_proj": (f, (d,)),
    "gate_up_proj": (d, (f, f)),
  }[kind]


def _convert(entry, kind: str, cfg: _Config, hparams, path: str):
  """{target: (A [in, r], B [r, out])}: PEFT's pair transposed, the scale
  folded into B, a fused module's B cut into its parts."""
  (a_key, a), (b_key, b) = entry["A"], entry["B"]
  r, parts = cfg.rank, len(_MODULES[kind][1])
  if hparams is not None:
    ins, outs = _sizes(hparams, kind)
    checks = ((a_key, a, (r, ins)), (b_key, b, (sum(outs), r)))
  elif kind == "qkv_proj":
    raise ValueError(
      f"{path}: a fused qkv_proj adapter needs the model's hparams to be "
      "cut into q, k and v (load_adapter(path, hparams))"
    )
  else:  # any sizes, but a rank of r (and halves for gate_up)
    ins = a.shape[-1] if a.ndim == 2 else 0
    out = b.shape[0] if b.ndim == 2 else 0
    outs = (out // parts,) * parts
    checks = ((a_key, a, (r, ins or "in")), (b_key, b, (out or "out", r)))
    if out % parts:
      raise ValueError(
        f"{path}: tensor {b_key} has {out} rows, which do not split into "
        f"{parts} equal parts"
      )
  for key, value, want in checks:
    if tuple(value.shape) != want:
      raise ValueError(
        f"{path}: tensor {key} has shape {tuple(value.shape)}, expected "
        f"{want} (r={r}{'' if hparams is None else f', {hparams}'})"
      )
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  for key, value in ((a_key, a), (b_key, b)):
    if not np.isfinite(value).all():
      raise ValueError(f"{path}: tensor {key} holds NaN or infinity")
  a, b = a.T, b.T * np.float32(cfg.scale)
  out, start = {}, 0
  for target, n in zip(_MODULES[kind][1], outs, strict=True):
    out[target] = (_frozen(a), _frozen(b[:, start : start + n]))
    start += n
  return out


def _frozen(x: np.ndarray) -> np.ndarray:
  x = np.ascontiguousarray(x, np.float32)
  x.setflags(write=False)
  return x


def _check_coverage(found, cfg: _Config, count: int, path: str) -> None:
  """Every module the config selects has tensors, and no other has: each
  layer outside `layers_to_transform`, each module `target_modules` does
  not name, and each layer lacking a kind another layer has is refused."""
  selected = range(count) if cfg.layers is None else sorted(cfg.layers)
  for (layer, _), entry in sorted(found.items()):
    if cfg.layers is not None and layer not in cfg.layers:
      raise ValueError(
        f"{path}: tensor {entry['A'][0]} is for layer {layer}, outside "
        f"layers_to_transform {sorted(cfg.layers)}"
      )
    if cfg.modules is not None and not _named(entry["module"], cfg.modules):
      raise ValueError(
        f"{path}: tensor {entry['A'][0]} adapts {entry['module']}, which "
        f"target_modules {list(cfg.modules)} does not name"
      )
  for kind in sorted({k for _, k in found}):
    sample = next(e["module"] for (_, k), e in found.items() if k == kind)
    prefix = _TENSOR.fullmatch(sample + ".lora_A.weight")["prefix"]
    block = _MODULES[kind][0]
    for layer in selected:
      module = f"{prefix}{layer}.{block}.{kind}"
      named = cfg.modules is None or _named(module, cfg.modules)
      if named and (layer, kind) not in found:
        raise ValueError(
          f"{path}: no LoRA tensors for {module} (layer {layer}), which "
          "the config selects (an adapter of another model, or a truncated "
          "file?)"
        )


def load_adapter(
  path: str | os.PathLike, hparams: HParams | None = None
) -> lora.Adapter:
  """Reads a PEFT LoRA adapter directory.

  Args:
    path: a directory with `adapter_config.json` and
      `adapter_model.safetensors` (as PEFT's `save_pretrained` writes).
    hparams: the model it adapts; the adapter then comes in that model's
      layout (`lora.shapes`) with one entry per model layer, checked with
      `Adapter.check`. Without it, A is [in, r] and B [r, out] (see
      `fit`), and the layers run to the last one the adapter touches.

  Returns:
    A `lora.Adapter` with `source=str(path)` and the parsed config; a
    layer outside `layers_to_transform` has no entry.

  Raises:
    FileNotFoundError (also a ValueError): no directory, config or
      safetensors file.
    ValueError: a pickled adapter; a config chunkwise does not support
      (not LoRA, DoRA, rank_pattern / alpha_pattern, biases,
      modules_to_save, fan_in_fan_out, other LoRA variants, target
      modules other than q/k/v/o/gate/up/down); tensors that are
      misnamed, misshapen for r or the model, missing or not finite.
      The message names the value or tensor.
  """
  directory = os.fspath(path)
  config_path, weights_path = _files(directory)
  config = untrusted.read_json(config_path, what="adapter config")
  cfg = _check_config(config, config_path)
  if hparams is not None and cfg.layers and max(cfg.layers) >= hparams.layers:
    raise ValueError(
      f"{config_path}: layers_to_transform {sorted(cfg.layers)} reaches "
      f"past the model's {hparams.layers} layers"
    )
  found = _pairs(safetensors.read(weights_path), weights_path, hparams)
  if not found:
    raise ValueError(f"{weights_path} holds no LoRA tensors")
  if hparams is not None:
    count = hparams.layers
  else:
    count = 1 + max([i for i, _ in found] + list(cfg.layers or ()))
  _check_coverage(found, cfg, count, weights_path)
  layers = [{} for _ in range(count)]
  for (layer, kind), entry in sorted(found.items()):
    layers[layer].update(_convert(entry, kind, cfg, hparams, weights_path))
  adapter = lora.Adapter(
    rank=cfg.rank,
    layers=tuple(layers),
    targets=tuple(t for t in lora.TARGETS if any(t in ly for ly in layers)),
    source=directory,
    config=config,
  )
  return adapter if hparams is None else fit(adapter, hparams)


def fit(adapter: lora.Adapter, hparams: HParams) -> lora.Adapter:
  """`lora.fit`: the adapter in the layout of a model of `hparams`."""
  return lora.fit(adapter, hparams)
