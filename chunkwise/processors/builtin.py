"""Built-in logits processors: bans, allow-lists, bias, penalties, min tokens.

  cw.processors.ban_tokens([13, 42])           # never draw these ids
  cw.processors.allow_tokens(digit_ids)        # draw only these ids
  cw.processors.logit_bias({13: -2.0, 7: 1.5})   # add to the raw logits
  cw.processors.penalties(repetition=1.2, presence=0.5, frequency=0.1,
                          context=prompt_chunk)
  cw.processors.min_tokens(8)                  # no stop id before 8 tokens

Penalties follow vLLM: the repetition penalty (CTRL / Hugging Face: a seen
token's logit is divided by it when positive, multiplied when negative)
counts the `context` tokens (e.g. the prompt Chunk, one row per generated
row) and the generated ones; presence (a flat amount once a token was
generated) and frequency (an amount per time it was generated) count the
generated tokens only. Settings are scalars or one value per row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from chunkwise.processors.base import LogitsProcessor


def _ids(name: str, ids) -> np.ndarray:
  arr = np.asarray(ids)
  if arr.dtype == object or (
    arr.size and not np.issubdtype(arr.dtype, np.integer)
  ):
    raise ValueError(f"{name} must be integer token ids, got {ids!r}")
  if arr.ndim != 1:
    raise ValueError(f"{name} must be a flat list of token ids, got {ids!r}")
  return arr.astype(np.int32)


def _check_range(name: str, ids: np.ndarray, vocab: int) -> None:
  bad = ids[(ids < 0) | (ids >= vocab)]
  if bad.size:
    raise ValueError(
      f"{name}: token id {int(bad[0])} is outside the model's vocabulary "
      f"[0, {vocab})"
    )


def _per_row(name: str, value, batch: int, dtype) -> np.ndarray:
  arr = np.asarray(value, dtype=np.float64)
  if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != batch):
    raise ValueError(
      f"{name} must be a scalar or have shape ({batch},) (one per row), got "
      f"shape {arr.shape}"
    )
  return np.broadcast_to(arr, (batch,)).astype(dtype)


class TokenBan(LogitsProcessor):
  """Forbids `ids` in every row."""

  ids: jax.Array

  def validate(self, vocab):
    _check_range("ban_tokens", np.asarray(self.ids), vocab)

  def apply(self, state, logits, info):
    return logits.at[:, self.ids].set(-jnp.inf)


class TokenAllow(LogitsProcessor):
  """Allows only `ids` (plus, when `stops` is set, the stop ids)."""

  ids: jax.Array
  stops: bool = struct.field(pytree_node=False, default=True)

  def validate(self, vocab):
    _check_range("allow_tokens", np.asarray(self.ids), vocab)

  def apply(self, state, logits, info):
    allowed = jnp.zeros(logits.shape[-1], bool).at[self.ids].set(True)[None]
    if self.stops:
      allowed = allowed | info.stop_rows(logits.shape[-1])
    return jnp.where(allowed, logits, -jnp.inf)


class LogitBias(LogitsProcessor):
  """Adds `values[i]` to the logit of `ids[i]` in every row."""

  ids: jax.Array
  values: jax.Array

  def validate(self, vocab):
    _check_range("logit_bias", np.asarray(self.ids), vocab)

  def apply(self, state, logits, info):
    return logits.at[:, self.ids].add(self.values[None, :])


class Penalties(LogitsProcessor):
  """Repetition, presence and frequency penalties (module docstring).

  State per row: the three settings, `seen` bool[V] (context or generated)
  and `counts` int32[V] (generated).
  """

  repetition: np.ndarray | float = struct.field(pytree_node=False, default=1.0)
  presence: np.ndarray | float = struct.field(pytree_node=False, default=0.0)
  frequency: np.ndarray | float = struct.field(pytree_node=False, default=0.0)
  context: tuple = struct.field(pytree_node=False, default=None)

  def init(self, batch, vocab):
    rep = _per_row("penalties.repetition", self.repetition, batch, np.float32)
    pres = _per_row("penalties.presence", self.presence, batch, np.float32)
    freq = _per_row("penalties.frequency", self.frequency, batch, np.float32)
    if np.any(rep <= 0) or not np.all(np.isfinite(rep)):
      raise ValueError(
        f"penalties.repetition must be finite and > 0 (1 is off), got "
        f"{self.repetition!r}"
      )
    for name, v in (("presence", pres), ("frequency", freq)):
      if not np.all(np.isfinite(v)):
        raise ValueError(f"penalties.{name} must be finite, got {v!r}")
    seen = np.zeros((batch, vocab), bool)
    if self.context is not None:
      tokens, lengths = self.context
      if tokens.shape[0] != batch:
        raise ValueError(
          f"penalties.context has {tokens.shape[0]} rows, the call has "
          f"{batch}: give one context row per generated row"
        )
      _check_range("penalties.context", tokens.reshape(-1), vocab)
      for b in range(batch):
        seen[b, tokens[b, : lengths[b]]] = True
    counts = np.zeros((batch, vocab), np.int32)
    return (rep, pres, freq, seen, counts)

  def for_loop(self):
    return Penalties()

  def apply(self, state, logits, info):
    rep, pres, freq, seen, counts = state
    seen = seen | (counts > 0)
    r = rep[:, None]
    penalized = jnp.where(logits > 0, logits / r, logits * r)
    logits = jnp.where(seen & (r != 1), penalized, logits)
    logits = logits - pres[:, None] * (counts > 0)
    return logits - freq[:, None] * counts

  def update(self, state, tokens, info):
    rep, pres, freq, seen, counts = state
    rows = jnp.arange(tokens.shape[0])
    counts = jnp.asarray(counts).at[rows, tokens].add(1)
    return (rep, pres, freq, seen, counts)


class MinTokens(LogitsProcessor):
  """Forbids every stop id until a row has generated `count` tokens."""

  count: np.ndarray | int = struct.field(pytree_node=False, default=0)

  def init(self, batch, vocab):
    count = _per_row("min_tokens", self.count, batch, np.float64)
    if np.any(count < 0) or np.any(count != np.round(count)):
      raise ValueError(
        f"min_tokens must be a non-negative integer, got {self.count!r}"
      )
    return (count.astype(np.int32),)

  def for_loop(self):
    return MinTokens()

  def apply(self, state, logits, info):
    (count,) = state
    early = (info.generated < count)[:, None]
    is_stop = info.stop_rows(logits.shape[-1])
    return jnp.where(early & is_stop, -jnp.inf, logits)


def ban_tokens(ids: Sequence[int]) -> TokenBan:
  """A processor that never lets any row draw `ids`."""
  return TokenBan(ids=_ids("ban_tokens", ids))


def allow_tokens(ids: Sequence[int], *, stops: bool = True) -> TokenAllow:
  """A processor that lets rows draw only `ids` (and the stop ids unless
  `stops=False`)."""
  return TokenAllow(ids=_ids("allow_tokens", ids), stops=bool(stops))


def logit_bias(bias: Mapping[int, float]) -> LogitBias:
  """A processor adding `bias[id]` to the raw logit of each id."""
  if not isinstance(bias, Mapping):
    raise ValueError(
      f"logit_bias takes a {{token id: bias}} dict, got {bias!r}"
    )
  ids = _ids("logit_bias", list(bias))
  values = np.asarray(list(bias.values()), np.float64)
  if not np.all(np.isfinite(values) | (values == -np.inf)):
    raise ValueError(
      f"logit_bias values must be finite (or -inf to ban), got {bias!r}"
    )
  return LogitBias(ids=ids, values=values.astype(np.float32))


def penalties(
  *, repetition=1.0, presence=0.0, frequency=0.0, context=None
) -> Penalties:
  """Repetition / presence / frequency penalties (module docstring).

  Args:
    repetition: > 0, 1 is off; scalar or one per row.
    presence, frequency: subtracted from logits; scalar or one per row.
    context: a Chunk (e.g. the prompt, one row per generated row) whose
      tokens count as seen for the repetition penalty.
  """
  ctx = None
  if context is not None:
    tokens = getattr(context, "tokens", None)
    lengths = getattr(context, "lengths", None)
    if tokens is None or lengths is None:
      raise ValueError(f"penalties.context must be a Chunk, got {context!r}")
    ctx = (np.asarray(tokens, np.int32), np.asarray(lengths, np.int32))

  def host(value):
    arr = np.asarray(value, np.float64)
    return float(arr) if arr.ndim == 0 else tuple(arr.tolist())

  return Penalties(
    repetition=host(repetition),
    presence=host(presence),
    frequency=host(frequency),
    context=ctx,
  )


def min_tokens(count) -> MinTokens:
  """No stop id (EOS included) until a row has `count` tokens (scalar or one
  per row)."""
  arr = np.asarray(count)
  return MinTokens(count=int(arr) if arr.ndim == 0 else tuple(arr.tolist()))
