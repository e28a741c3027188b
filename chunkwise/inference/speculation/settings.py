"""`Speculation`: what speculative decoding drafts, and its counts.

  tokens, result = model.generate(
      [prompt], sample_ids=[0], steps=256,
      speculation=cw.Speculation(context=prompt_chunk))  # prompt lookup
  result.speculation.mean_acceptance_length

Each iteration of a speculative loop samples the row's next token y0 as a
plain step would, drafts up to k tokens that may follow it, runs one
forward pass over [y0, d1..dk] and draws, at every drafted position, the
token the target itself draws there: with the same key (DESIGN.md §4.5),
the same processors' states advanced over the drafts before it, from the
logits of that pass. Drafts are kept while they equal those tokens
(`verify.py`). So every token is the one the call without speculation
draws, whatever was drafted ("drafter-invariant" speculative decoding;
Daliri, Musco, Suresh, arXiv 2408.07978): bit for bit under invariant
numerics, where a pass over k + 1 positions computes each position's
logits exactly as a one-position step does (`chunkwise.numerics`).

Drafters (all on device, in the loop):
  "ngram"   prompt lookup: the latest earlier occurrence of the row's last
            n tokens (n from `ngram_max` down to `ngram_min`) in its own
            context (`context` tokens, then everything it generated)
            proposes the tokens that followed it. Per row, never shared.
  "forced"  only the tokens the processors force (below).
  "draft"   the target's own weights in int8 (`draft.py`): w single-token
            steps that read the target's K/V of the past and draw each
            draft with its position's key, so a close distribution draws
            the same token. Dense models with float weights only.
With `forced` (default), wherever the processors (a constraint's automaton,
bans) allow exactly one token, that token is drafted, whatever the drafter
proposed: it is always accepted.

How many positions a pass verifies is chosen per iteration among compiled
widths (`widths`: 0, the plain step, then powers of two up to `k`): the
width that maximises expected tokens per cost, where each row's drafts are
expected to be accepted at its running acceptance rate. A pass's cost is
measured on the device (`calibration.py`: the first calls or segments of
a loop time a pass of each width in turn, then use those times); until
then, and with `calibrate=False`, the prior says a pass over B rows of
w + 1 positions costs `weight_rows` + B (w + 1): reading the weights costs
as much as computing `weight_rows` positions (the machine's ridge point,
in rows; about 20 for SmolLM2 on a 2-core CPU, hundreds on accelerators).
So batch 1 drafts freely, while a wide batch drafts only where acceptance
pays for the extra positions. The "draft" drafter adds w draft steps,
each `draft_cost` times a plain step. Rows whose drafts stop paying fall
back to plain steps; their rate drifts back towards the prior, so they
try again later.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from chunkwise.partitioning import axes as ax

DRAFTERS = ("ngram", "forced", "draft")
# A row's acceptance rate before it has drafted anything, per drafter: the
# int8 draft of the same weights agrees with it most of the time (0.9 on
# SmolLM2's chat workload, docs/performance.md).
PRIORS = {"ngram": 0.5, "forced": 0.5, "draft": 0.8}
RATE = 0.3  # weight of a pass's observed acceptance in the running rate
DRIFT = 0.05  # how far a skipped row's rate moves back to the prior


@dataclasses.dataclass(frozen=True, kw_only=True)
class Speculation:
  """Speculative decoding settings (module docstring).

  Attributes:
    drafter: "ngram" (prompt lookup), "forced" (processor-forced tokens
      only) or "draft" (the target's weights in int8).
    k: most tokens drafted per pass (the widest compiled pass).
    ngram_min, ngram_max: lengths of the suffix matched by "ngram".
    forced: draft the tokens the processors force.
    widths: drafted positions of the compiled passes (0, the plain step,
      is always one); default: powers of two from 2 up to `k`, and `k`.
    weight_rows: the cost of one pass's weight reads, in computed
      positions (module docstring): the prior of a pass's cost.
    draft_cost: for "draft": one draft step's cost over a plain step's
      (int8 at batch 1 on a 2-core CPU: ~0.5): the prior too.
    calibrate: time the passes of each width on this device and use
      those costs instead of the prior's (`calibration.py`); False: the
      prior's always.
    context: for `generate`: the tokens before the call (a `Chunk` or a
      list of them, oldest first; batches divide the call's, rows repeat
      each as prefixes do) that "ngram" searches with the generated ones.
      `generate_many` and the server search each request's prompt.
  """

  DRAFTERS: ClassVar[tuple[str, ...]] = DRAFTERS
  drafter: str = "ngram"
  k: int = 8
  ngram_min: int = 1
  ngram_max: int = 4
  forced: bool = True
  widths: tuple[int, ...] | None = None
  weight_rows: float = 20.0
  draft_cost: float = 0.5
  calibrate: bool = dataclasses.field(default=True, compare=False)
  context: Any = dataclasses.field(default=None, compare=False, hash=False)

  def checked(self) -> Speculation:
    """Validated, with `widths` filled in and no context (the compiled
    programs' key). Raises ValueError naming the bad field."""
    if self.drafter not in DRAFTERS:
      raise ValueError(
        f"Speculation.drafter must be one of {DRAFTERS}, got {self.drafter!r}"
      )

    def count(name, value, lo, hi):
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise ValueError(f"Speculation.{name} must be an int, got {value!r}")
      if not lo <= value <= hi:
        raise ValueError(
          f"Speculation.{name} must be in [{lo}, {hi}], got {value!r}"
        )
      return int(value)

    k = count("k", self.k, 1, 64)
    lo = count("ngram_min", self.ngram_min, 1, 16)
    hi = count("ngram_max", self.ngram_max, lo, 16)
    widths = self.widths
    if widths is None:
      widths = sorted({w for w in (2, 4, 8, 16, 32, 64) if w < k} | {k})
    widths = tuple(sorted({count("widths", w, 0, k) for w in widths} | {0}))
    if widths[-1] != k:
      raise ValueError(
        f"Speculation.widths must include k={k} (the widest pass), got "
        f"{self.widths!r}"
      )

    def number(name, value, hi):
      if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 <= value <= hi
      ):
        raise ValueError(
          f"Speculation.{name} must be a number in [0, {hi:g}], got {value!r}"
        )
      return float(value)

    cost = number("weight_rows", self.weight_rows, 1e6)
    draft_cost = number("draft_cost", self.draft_cost, 100)
    return Speculation(
      drafter=self.drafter,
      k=k,
      ngram_min=lo,
      ngram_max=hi,
      forced=bool(self.forced),
      widths=widths,
      weight_rows=cost,
      draft_cost=draft_cost,
      calibrate=bool(self.calibrate),
    )

  def prior_costs(self, rows: int) -> np.ndarray:
    """f32[len(widths)]: each compiled pass's cost over `rows` rows as the
    settings assume it (checked settings; module docstring): weight reads
    plus rows * (w + 1) positions, plus the "draft" drafter's w steps."""
    draft = self.draft_cost if self.drafter == "draft" else 0.0
    w = np.asarray(self.widths, np.float32)
    read = self.weight_rows
    return (read + rows * (w + 1) + w * draft * (read + rows)).astype(
      np.float32
    )


@dataclasses.dataclass(frozen=True)
class SpeculationStats:
  """Counts of one call (or request), as vLLM defines them.

  drafts: (row, pass) pairs that verified at least one drafted token;
  draft_tokens: drafted tokens verified; accepted_tokens: those kept.
  passes: (row, iteration) pairs in a pass of width > 0; steps: all (row,
  iteration) pairs, plain steps included (each drew one token as y0).
  """

  drafts: int = 0
  draft_tokens: int = 0
  accepted_tokens: int = 0
  passes: int = 0
  steps: int = 0

  @property
  def mean_acceptance_length(self) -> float:
    """1 + accepted / drafts: tokens per verify pass of a drafting row."""
    return 1.0 + self.accepted_tokens / max(self.drafts, 1)

  @property
  def acceptance_rate(self) -> float:
    """accepted / drafted tokens (0 when nothing was drafted)."""
    return self.accepted_tokens / max(self.draft_tokens, 1)

  def __add__(self, other: SpeculationStats) -> SpeculationStats:
    return SpeculationStats(
      *(a + b for a, b in zip(_values(self), _values(other), strict=True))
    )


def _values(stats: SpeculationStats) -> tuple[int, ...]:
  return tuple(getattr(stats, f.name) for f in dataclasses.fields(stats))


@struct.dataclass(kw_only=True)
class SpecRows:
  """What a speculative loop carries per row besides the plain loop's."""

  history: jax.Array  # int32[rows, H]: context, then the kept tokens
  filled: jax.Array  # int32[rows]: tokens in `history`
  rate: jax.Array  # f32[rows]: running acceptance rate of drafts
  prior: jax.Array  # f32[]: the drafter's rate before any draft (PRIORS)
  drafts: jax.Array  # int32[rows]: the counts of `SpeculationStats`
  draft_tokens: jax.Array
  accepted_tokens: jax.Array
  passes: jax.Array  # int32[rows]: iterations in a pass of width > 0
  steps: jax.Array  # int32[rows]: iterations (tokens drawn as y0)
  cost: jax.Array  # f32[widths]: each pass's cost (`choose_width`)
  force: jax.Array  # int32[]: the pass every iteration takes; -1: chosen

  # The fields with a leading row axis (a slot loop's `take` and `put`).
  PER_ROW = (
    "history",
    "filled",
    "rate",
    "drafts",
    "draft_tokens",
    "accepted_tokens",
    "passes",
    "steps",
  )

  @classmethod
  def axes(cls) -> SpecRows:
    """Small per-row arrays: replicated, like the loop's tokens."""
    rows = P(ax.BATCH)
    return cls(
      history=P(ax.BATCH, ax.TIME),
      filled=rows,
      rate=rows,
      prior=P(),
      drafts=rows,
      draft_tokens=rows,
      accepted_tokens=rows,
      passes=rows,
      steps=rows,
      cost=P(),
      force=P(),
    )

  @classmethod
  def start(
    cls, history: np.ndarray, filled: np.ndarray, spec: Speculation
  ) -> SpecRows:
    """Rows with `history` (int32[rows, H]) of `filled` tokens each, at
    the drafter's prior rate, passes costed as `spec` (checked) assumes."""
    rows = history.shape[0]
    zeros = np.zeros(rows, np.int32)
    prior = PRIORS[spec.drafter]
    return cls(
      history=np.asarray(history, np.int32),
      filled=np.asarray(filled, np.int32),
      rate=np.full(rows, prior, np.float32),
      prior=np.float32(prior),
      drafts=zeros,
      draft_tokens=zeros,
      accepted_tokens=zeros,
      passes=zeros,
      steps=zeros,
      cost=spec.prior_costs(rows),
      force=np.int32(-1),
    )

  def stats(self, rows=slice(None)) -> SpeculationStats:
    """The counts (host), summed over `rows`."""
    got = jax.device_get(
      (
        self.drafts[rows],
        self.draft_tokens[rows],
        self.accepted_tokens[rows],
        self.passes,
        self.steps,
      )
    )
    return SpeculationStats(*(int(np.sum(x)) for x in got))


def prepare(
  speculation, batch: int, width: int
) -> tuple[Speculation | None, SpecRows | None]:
  """A call's `speculation=` argument, validated on the host: (the checked
  settings, the rows' initial state with `width` free history columns
  after the context) or (None, None). Raises ValueError."""
  if speculation is None:
    return None, None
  if not isinstance(speculation, Speculation):
    raise ValueError(
      f"speculation must be a chunkwise.Speculation, got "
      f"{type(speculation).__name__}"
    )
  checked = speculation.checked()
  history, filled = context_rows(speculation.context, batch, width)
  rows = SpecRows.start(history, filled, checked)
  return checked, jax.tree.map(jnp.asarray, rows)


def for_requests(speculation) -> Speculation | None:
  """`speculation=` of `generate_many` and live slots, checked: each
  request's prompt is its context, so `context` must be None."""
  if speculation is None:
    return None
  checked, _ = prepare(speculation, 1, 1)
  if speculation.context is not None:
    raise ValueError(
      "Speculation.context is for generate and generate_stream; requests "
      "draft from their own prompts"
    )
  return checked


def context_rows(context, batch: int, width: int) -> tuple[np.ndarray, ...]:
  """(history int32[batch, C + width], filled int32[batch]) from a
  `Speculation.context` (a Chunk, a list of them or None): each row's
  context tokens packed left, `width` free columns after the chunks'.
  Raises ValueError for batches that do not divide `batch`."""
  from chunkwise.inference.chunk import Chunk  # a leaf module; no cycle

  chunks = (
    []
    if context is None
    else [context]
    if isinstance(context, Chunk)
    else list(context)
  )
  parts = []
  for i, c in enumerate(chunks):
    if not isinstance(c, Chunk):
      raise ValueError(
        f"Speculation.context must be a Chunk or a list of Chunks, got "
        f"{type(c).__name__} at {i}"
      )
    tokens, lengths = np.asarray(c.tokens), np.asarray(c.lengths)
    if batch % tokens.shape[0]:
      raise ValueError(
        f"Speculation.context[{i}] has batch {tokens.shape[0]}, which does "
        f"not divide the call's batch {batch}"
      )
    parts.append((tokens, lengths, batch // tokens.shape[0]))
  filled = np.zeros(batch, np.int32)
  for _, lengths, rep in parts:
    filled += np.repeat(lengths, rep).astype(np.int32)
  # As wide as the chunks' columns (not their lengths): calls of the same
  # shapes share one compiled loop.
  columns = sum(tokens.shape[1] for tokens, _, _ in parts)
  history = np.zeros((batch, columns + width), np.int32)
  at = np.zeros(batch, np.int64)
  for tokens, lengths, rep in parts:
    for b in range(batch):
      n = int(lengths[b // rep])
      history[b, at[b] : at[b] + n] = tokens[b // rep, :n]
      at[b] += n
  return history, filled


def ngram_drafts(
  history: jax.Array, filled: jax.Array, width: int, lo: int, hi: int
) -> tuple[jax.Array, jax.Array]:
  """Prompt lookup: for each row, the latest earlier occurrence of its last
  n tokens (n = hi down to lo; the longest found wins) proposes the (up to
  `width`) tokens that followed it.

  Returns (drafts int32[rows, width], count int32[rows]): a row's first
  `count` drafts are proposals (0: nothing matched)."""
  rows, h = history.shape
  start = jnp.full((rows,), -1, jnp.int32)
  end = filled[:, None]
  for n in range(min(hi, h - 1), lo - 1, -1):
    at = jnp.clip(end - n + jnp.arange(n)[None, :], 0, h - 1)
    suffix = jnp.take_along_axis(history, at, axis=1)  # [rows, n]
    match = (jnp.arange(h - n + 1)[None, :] + n < end) & (end >= n)
    for t in range(n):
      match &= history[:, t : h - n + 1 + t] == suffix[:, t : t + 1]
    last = jnp.max(jnp.where(match, jnp.arange(h - n + 1)[None, :], -1), axis=1)
    start = jnp.where((start < 0) & (last >= 0), last + n, start)
  count = jnp.where(start >= 0, jnp.minimum(width, filled - start), 0)
  at = jnp.clip(start[:, None] + jnp.arange(width)[None, :], 0, h - 1)
  return jnp.take_along_axis(history, at, axis=1), count.astype(jnp.int32)


def choose_width(
  spec: Speculation,
  live: jax.Array,
  counts: jax.Array,
  rate: jax.Array,
  sure: jax.Array | None = None,
  cost: jax.Array | None = None,
  force: jax.Array | None = None,
) -> jax.Array:
  """The index into `spec.widths` (checked settings) of the pass with the
  most expected tokens per cost: each `live` row gives its next token, and
  a row with c drafts, the first s of them `sure` (forced), at acceptance
  rate a expects min(s, w) + sum_{s<j<=min(c, w)} a^(j-s) more from a pass
  of width w. `cost` (f32[widths]): each pass's cost, measured or the
  prior's (`Speculation.prior_costs`, the default); `force` >= 0: that
  pass, whatever it is worth (calibration)."""
  widths = spec.widths
  if cost is None:
    cost = jnp.asarray(spec.prior_costs(counts.shape[0]))
  live = jnp.sum(live).astype(jnp.float32)
  sure = jnp.zeros_like(counts) if sure is None else sure
  j = jnp.arange(1, widths[-1] + 1)[None, :]
  # Each position's chance to be accepted: 1 while forced, then a^(j-s).
  chance = jnp.where(
    j <= sure[:, None], 1.0, rate[:, None] ** (j - sure[:, None])
  )
  scores = []
  for i, w in enumerate(widths):
    taken = j[:, :w] <= counts[:, None]
    gain = jnp.sum(jnp.where(taken, chance[:, :w], 0.0))
    scores.append((live + gain) / cost[i])
  pick = jnp.argmax(jnp.stack(scores)).astype(jnp.int32)
  if force is not None:
    pick = jnp.where(force >= 0, force, pick).astype(jnp.int32)
  return pick


def update_rate(
  rate: jax.Array, offered: jax.Array, accepted: jax.Array, prior: jax.Array
) -> jax.Array:
  """Rows that had drafts verified: a step towards what they saw (accepted
  over the trials until the first rejection); rows that had drafts but no
  pass (offered < 0): a step back towards the prior."""
  trials = accepted + (accepted < offered).astype(jnp.int32)
  seen = accepted / jnp.maximum(trials, 1)
  verified = (1 - RATE) * rate + RATE * seen
  return jnp.where(
    offered > 0,
    verified,
    jnp.where(offered < 0, rate + DRIFT * (prior - rate), rate),
  ).astype(jnp.float32)
