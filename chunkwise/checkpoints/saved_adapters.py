"""The LoRA adapters a saved model serves: their description in
`chunkwise.json` and their arrays beside the weights.

  desc, flat = to_json(model.adapters)         # written by the save
  entries = parse(hparams, meta.get("adapters"), source)
  shapes(hparams, entries)                     # {array name: shape}
  served = build(hparams, entries, restored, source)  # {name: Adapter}

Each adapter's A and B are f32 arrays in `arrays/`, in the layout of the
model they fit (`lora.shapes`), named by the adapter's place in serving
order, so that its name needs no escaping:

  adapters.<i>.<layer>.<target>.a   [inputs..., rank]
  adapters.<i>.<layer>.<target>.b   [rank, outputs...]  (scale folded in)

The description's "adapters" entry lists them in serving order (the order
of the stacks, so a loaded model computes bit for bit what the saved one
did), each as {"name", "rank", "targets", "layers" (the targets of each
layer: a layer outside `layers_to_transform` has none), "checksum"
(`Adapter.checksum`), "source", "config" (the PEFT config, for
reference)}. The arrays are listed, sized and CRC-checked like the
weights; once restored, each adapter's checksum is recomputed and
compared. A checkpoint without the entry serves no adapters.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from absl import logging

from chunkwise import untrusted
from chunkwise.checkpoints.adapters import MAX_RANK
from chunkwise.configs import HParams
from chunkwise.models import lora

PREFIX = "adapters"
MAX_ADAPTERS = 1 << 12
MAX_NAME = 256  # characters of an adapter's name


def array_name(index: int, layer: int, target: str, ab: str) -> str:
  return f"{PREFIX}.{index}.{layer}.{target}.{ab}"


def is_adapter_array(name: str) -> bool:
  return name.startswith(PREFIX + ".")


def _config_json(name: str, config: Mapping) -> dict | None:
  """`config` as plain JSON, or None (logged) when it is not."""
  try:
    return json.loads(json.dumps(dict(config), allow_nan=False))
  except (TypeError, ValueError) as e:
    logging.warning(
      "adapter %r: its config is not plain JSON (%s); saved without it",
      name,
      e,
    )
    return None


def to_json(
  adapters: Mapping[str, lora.Adapter],
) -> tuple[list[dict], dict[str, np.ndarray]]:
  """(the description's "adapters" entry, {array name: f32 array}) of the
  served `adapters` (`model.adapters`: fitted to the model)."""
  desc, flat = [], {}
  for i, (name, adapter) in enumerate(adapters.items()):
    layers = []
    for j, layer in enumerate(adapter.layers):
      layers.append(list(layer))
      for target, (a, b) in layer.items():
        flat[array_name(i, j, target, "a")] = np.asarray(a, np.float32)
        flat[array_name(i, j, target, "b")] = np.asarray(b, np.float32)
    desc.append(
      {
        "name": name,
        "rank": adapter.rank,
        "targets": list(adapter.targets),
        "layers": layers,
        "checksum": adapter.checksum,
        "source": adapter.source,
        "config": _config_json(name, adapter.config),
      }
    )
  return desc, flat


def parse(h: HParams, desc: Any, source: str) -> list[dict]:
  """The checked "adapters" entry of a description (untrusted): [] when
  absent. ValueError names the field that is wrong."""
  if desc is None:
    return []
  if not isinstance(desc, list) or len(desc) > MAX_ADAPTERS:
    raise ValueError(
      f"{source}: 'adapters' is not a list of at most {MAX_ADAPTERS}"
    )
  out, names = [], set()
  for i, entry in enumerate(desc):
    where = f"adapters[{i}]"
    if not isinstance(entry, dict):
      raise ValueError(f"{source}: {where} is not an object")
    name = entry.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
      raise ValueError(
        f"{source}: {where}.name={name!r:.80} is not a name of 1 to "
        f"{MAX_NAME} characters"
      )
    if name in names:
      raise ValueError(f"{source}: adapter {name!r} is listed twice")
    names.add(name)
    where = f"adapter {name!r}"
    rank = untrusted.check_int(
      entry.get("rank"), f"{where}: rank", source=source, lo=1, hi=MAX_RANK
    )
    targets = entry.get("targets")
    if (
      not isinstance(targets, list)
      or not targets
      or not all(t in lora.TARGETS for t in targets)
      or len(set(targets)) != len(targets)
    ):
      raise ValueError(
        f"{source}: {where}: targets={targets!r:.80} is not a list of "
        f"distinct names among {lora.TARGETS}"
      )
    layers = entry.get("layers")
    if not isinstance(layers, list) or len(layers) != h.layers:
      raise ValueError(
        f"{source}: {where}: 'layers' is not a list of {h.layers} lists "
        "(one per layer of the model)"
      )
    for j, layer in enumerate(layers):
      if (
        not isinstance(layer, list)
        or not all(t in targets for t in layer)
        or len(set(layer)) != len(layer)
      ):
        raise ValueError(
          f"{source}: {where}: layers[{j}]={layer!r:.80} is not a list of "
          f"distinct targets among {targets}"
        )
    for key in ("checksum", "source"):
      if not isinstance(entry.get(key), str):
        raise ValueError(f"{source}: {where}: {key} is not a string")
    config = entry.get("config")
    if config is not None and not isinstance(config, dict):
      raise ValueError(f"{source}: {where}: config is not an object")
    out.append(
      {
        "name": name,
        "rank": rank,
        "targets": tuple(targets),
        "layers": tuple(tuple(layer) for layer in layers),
        "checksum": entry["checksum"],
        "source": entry["source"],
        "config": {} if config is None else config,
      }
    )
  return out


def shapes(h: HParams, entries: list[dict]) -> dict[str, tuple[int, ...]]:
  """{array name: shape} of the adapters `entries` describe."""
  out = {}
  for i, entry in enumerate(entries):
    for j, layer in enumerate(entry["layers"]):
      for target in layer:
        a, b = lora.shapes(h, target, entry["rank"])
        out[array_name(i, j, target, "a")] = a
        out[array_name(i, j, target, "b")] = b
  return out


def templates(h: HParams, entries: list[dict]) -> dict[str, Any]:
  """f32 `ShapeDtypeStruct`s of the adapters' arrays, on this host's CPU
  (they are stacked and placed on the engines by `with_adapters`)."""
  cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
  return {
    name: jax.ShapeDtypeStruct(shape, np.float32, sharding=cpu)
    for name, shape in shapes(h, entries).items()
  }


def _frozen(x) -> np.ndarray:
  x = np.array(x, np.float32)
  x.setflags(write=False)
  return x


def build(
  entries: list[dict], restored: Mapping[str, Any], directory: str
) -> dict[str, lora.Adapter]:
  """{name: Adapter} in serving order from the restored arrays, each
  checked against its saved checksum (ValueError names the adapter)."""
  out = {}
  for i, entry in enumerate(entries):
    layers = tuple(
      {
        t: (
          _frozen(restored[array_name(i, j, t, "a")]),
          _frozen(restored[array_name(i, j, t, "b")]),
        )
        for t in layer
      }
      for j, layer in enumerate(entry["layers"])
    )
    adapter = lora.Adapter(
      rank=entry["rank"],
      layers=layers,
      targets=entry["targets"],
      source=entry["source"],
      config=entry["config"],
    )
    if adapter.checksum != entry["checksum"]:
      raise ValueError(
        f"checkpoint {directory} is corrupt: adapter {entry['name']!r} "
        f"has checksum {adapter.checksum}, saved as {entry['checksum']!r:.40} "
        "(its arrays changed since it was saved)"
      )
    out[entry["name"]] = adapter
  return out
