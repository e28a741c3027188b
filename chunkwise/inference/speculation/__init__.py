"""Speculative decoding: settings, drafters, the verifying pass and the
speculative twins of both device loops.

  settings     `Speculation` (what to draft), `SpeculationStats` (its
               counts), `SpecRows` (per-row state a loop carries) and the
               choice of each pass's width; imports only `inference.chunk`.
  draft        the "draft" drafter: the target's own weights in int8.
  verify       one pass over [y0, d1..dw]: the tokens the target keeps.
  calibration  each pass width timed on this device: the costs the width
               choice uses in place of the settings' assumed ones.
  speculative  `run` and `slot_run`, `generate.run` and `batching.slots.run`
               with speculation.

What it may import: `settings` sits below the plain loops (they carry its
`SpecRows`); `draft` and `verify` import the plain loop (`generate`) and
the model's math; `speculative` imports them and `batching.slots`. Engines
and the slot loops' host side import this package, never the reverse.
This module re-exports `settings`' names, so `inference.speculation.X`
is a setting.
"""

from chunkwise.inference.speculation.settings import (
  DRAFTERS,
  DRIFT,
  PRIORS,
  RATE,
  SpecRows,
  Speculation,
  SpeculationStats,
  choose_width,
  context_rows,
  for_requests,
  ngram_drafts,
  prepare,
  update_rate,
)

__all__ = [
  "DRAFTERS",
  "DRIFT",
  "PRIORS",
  "RATE",
  "SpecRows",
  "Speculation",
  "SpeculationStats",
  "choose_width",
  "context_rows",
  "for_requests",
  "ngram_drafts",
  "prepare",
  "update_rate",
]
