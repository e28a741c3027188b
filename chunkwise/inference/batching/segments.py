"""A live loop's segments, queued on the device ahead of the host.

  seg = Segment(live, run, report(state, start, width))
  ...                    # the next segment queued behind it (same `run`)
  jax.device_get(seg.report)   # then read this one's tokens

A segment is one `slot_run` of a live loop (`live.py`) and a small
program right behind it, `report`, that copies what the host reads: each
slot's done and stopped flags and token count, and the window of its
results from its first unreported token. Reading a report waits for its
segment only, so the loop can queue the next segment first (when nothing
on the host would change its start): the device computes it while the
host hands the last one's tokens to their requests, and a step costs the
device's time alone.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise.inference.batching import slots

# What a segment reports, in one program and one transfer: every slot's
# done, stopped and generated count, and the window of its results from
# its first unreported token (dispatched right behind the segment). Copies,
# not the state's own arrays: the next segment takes those (donated).
report = jax.jit(
  lambda state, start, width: (
    jnp.copy(state.done),
    jnp.copy(state.stopped),
    jnp.copy(state.generated),
    slots.window(state, start, width),
  ),
  static_argnums=2,
)


@dataclasses.dataclass(frozen=True)
class Segment:
  """A segment queued on the device: the slots it runs (bool[slots]), how
  (`run`, reused by the segment queued behind it) and its report
  (`report`'s device arrays)."""

  live: np.ndarray
  run: dict
  report: tuple

  @property
  def generated(self) -> jax.Array:
    """Each slot's tokens after this segment (on device): where the next
    segment's report starts."""
    return self.report[2]
