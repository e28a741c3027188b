"""Calibration: what a speculative pass of each width costs on this device,
timed, so that the width choice does not rest on assumed constants.

  calibration = Calibration(spec, rows=16)
  state = calibration.run(state, lambda s: engine.run(..., s, ...), compiled)

A loop's width choice (`settings.choose_width`) weighs each pass's expected
tokens against its cost: a vector f32[widths] the loop state carries
(`SpecRows.cost`), first `Speculation.prior_costs` (the settings'
`weight_rows` and `draft_cost`, figures of one 2-core CPU). `run` wraps
one device call of a loop (a whole `generate`, or one segment of a slot
loop). The first call runs on the prior (it compiles the program); then,
until every width has been timed, each call forces one width on every
iteration (`SpecRows.force`), the narrowest untimed first, and times the
call on the host; its iterations are the most any row took
(`SpecRows.steps`). A call that compiled a program is not counted, and
that width is timed again. Once all are timed, the loop uses the
measured seconds per iteration of each width as its costs, and stops
forcing. Forcing a width changes how fast tokens come, never which tokens
(speculation is drafter-invariant: `settings.py`).

What it may import: `settings` only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise.inference.speculation.settings import Speculation


class Calibration:
  """Pass costs of one loop shape (`rows` rows of checked `spec`)."""

  def __init__(
    self,
    spec: Speculation,
    rows: int,
    clock: Callable[[], float] = time.perf_counter,
  ):
    self.spec, self.rows, self.clock = spec, rows, clock
    self.prior = spec.prior_costs(rows)
    # Seconds per iteration of each width; NaN: not timed yet.
    self.seconds = np.full(len(spec.widths), np.nan)
    self.warm = False  # a first call ran (it compiles: never timed)

  @property
  def done(self) -> bool:
    """Every width is timed (or calibration is off)."""
    return not self.spec.calibrate or not np.isnan(self.seconds).any()

  def costs(self) -> tuple[np.ndarray, int]:
    """(cost f32[widths], force) for the next call: the measured costs
    once every width is timed, else the prior's and the width to time."""
    if not self.spec.calibrate or not self.warm:
      return self.prior, -1
    if self.done:
      return self.seconds.astype(np.float32), -1
    return self.prior, int(np.flatnonzero(np.isnan(self.seconds))[0])

  def run(self, state, call: Callable, compiled: Callable[[], int]):
    """`call(state)` with `state.spec`'s costs and force set (a loop state
    with speculation rows), timed when a width is forced; `compiled()`
    counts the programs compiled so far."""
    cost, force = self.costs()
    spec = state.spec.replace(
      cost=jnp.asarray(cost, jnp.float32), force=jnp.int32(force)
    )
    self.warm = True
    if force < 0:
      return call(state.replace(spec=spec))
    before = np.asarray(jax.device_get(state.spec.steps))  # waits for it
    programs = compiled()
    start = self.clock()
    state = call(state.replace(spec=spec))
    after = np.asarray(jax.device_get(state.spec.steps))
    seconds = self.clock() - start
    iterations = int(np.max(after - before, initial=0))
    if iterations > 0 and compiled() == programs:
      self.seconds[force] = seconds / iterations
    return state
