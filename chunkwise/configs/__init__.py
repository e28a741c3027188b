"""Model hyperparameters (`HParams`) and named presets (`get`, `names`)."""

from chunkwise.configs.hparams import Activation, Block, HParams
from chunkwise.configs.presets import PRESETS, get, names
from chunkwise.configs.rope import RopeKind, RopeScaling

__all__ = [
  "PRESETS",
  "Activation",
  "Block",
  "HParams",
  "RopeKind",
  "RopeScaling",
  "get",
  "names",
]
