"""The narrowing level a JSON schema compiled at, remembered in this
process and on disk (`JsonSchema.compile`): a schema that ran past its
limits once is compiled at that level straight away next time, in this
process or another, instead of running past them again.
"""

from __future__ import annotations

import json

import numpy as np

from chunkwise.constraints import disk_cache

# Optional properties kept per object by each narrower try of
# `JsonSchema.compile`.
NARROWER = (8, 4, 2)
# (schema, vocabulary, limits) -> the narrowing level that compiled, so a
# schema is not tried in full again in this process.
_levels: dict = {}


def _key(memo: tuple) -> str:
  """The disk cache's key of a schema's narrowing level."""
  text = json.dumps(memo, default=int)
  return "narrowing-" + disk_cache.key("narrowing", text, "", (), 0, 0)


def level(memo: tuple) -> int:
  """The narrowing level that compiled `memo` last (in this process, or
  in another: on disk, so a schema that runs past its limits does not
  cost them again in every new process); 0 when none did."""
  if memo not in _levels:
    found = disk_cache.load_arrays(_key(memo), ("level",))
    at = 0 if found is None else int(found["level"])
    _levels[memo] = at if 0 <= at <= len(NARROWER) else 0
  return _levels[memo]


def remember(memo: tuple, at: int) -> None:
  """`memo` compiled at narrowing level `at`."""
  if _levels.get(memo) != at:
    _levels[memo] = at
    if at:  # level 0 is the default: nothing to keep
      disk_cache.store_arrays(_key(memo), {"level": np.array(at)})
