"""Model hyperparameters (`HParams`) and named presets (`get`, `names`)."""

from chunkwise.configs.hparams import Activation, Block, HParams
from chunkwise.configs.presets import PRESETS, get, names

__all__ = ["PRESETS", "Activation", "Block", "HParams", "get", "names"]
