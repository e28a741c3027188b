"""Constraints in the generate loop: one processor over concatenated tables.

Every constraint in a batch is compiled (`tables`) and the tables are
concatenated into one set; each row carries (grammar g, state s). Grammar 0
is "unconstrained": its rows are never masked, so constrained and free rows
share a batch. Per step, for this device's rows:

  bits = bits_all[state_offset[g] + s]            # [rows, W] uint32
  allowed = unpacked bits[:, :V]                  # padded ids stay 0
  logits = where(allowed, logits, -inf)

and after sampling, for every row (one scalar gather each):

  s = next_all[class_offset[g] + s * classes[g] + token_class[g, token]]

All tables are traced arguments, padded to power-of-two buckets, so a new
constraint of the same bucket sizes reuses the compiled loop. They are
replicated on a mesh: masking happens where the sampler holds whole rows.

Budget forcing (`force=True`, `forcing.py`): once few columns remain, a
token is allowed only if the automaton can still reach a final state and
emit a stop id in the columns left, so every constrained row ends with a
stop (finish_reason "stop") within `steps`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from chunkwise.constraints import constraint as constraint_lib
from chunkwise.constraints import forcing, token_trie, walk
from chunkwise.constraints.constraint import Constraint
from chunkwise.constraints.lazy import Lazy
from chunkwise.constraints.tables import DEAD, Tables
from chunkwise.constraints.token_trie import Trie
from chunkwise.processors import LogitsProcessor

# A long-running loop's tables are at least this large (`GrammarSet`): the
# same shapes, so the same compiled loop, serve unconstrained rows and any
# few small constraints (a JSON object of a few fields: ~60 states and
# ~7k transitions on SmolLM2's vocabulary), compiled once at warm-up. At
# SmolLM2's vocabulary the floor holds ~2 MB of mask bits.
LOOP_FLOOR = {"grammars": 4, "states": 256, "transitions": 1 << 15}
# Lazy constraints (`walk.py`): rows of byte DFAs (a JSON object of a few
# fields: ~100-200; a string's maxLength of 100: ~1,000), 1 KB each; a
# grammar id per slot (16 slots, each its own tool list: no recompile).
LOOP_FLOOR_LAZY = {"grammars": 64, "states": 16384}


class ConstraintProcessor(forcing.RowGrammars, LogitsProcessor):
  """The device side of one batch's constraints (module docstring)."""

  bits: jax.Array  # uint32[S_total, W]
  distance: jax.Array  # int32[S_total]
  token_class: jax.Array  # int32[G, V]
  next_state: jax.Array  # int32[N]: every grammar's [S_g, C_g], flattened
  state_offset: jax.Array  # int32[G]
  class_offset: jax.Array  # int32[G]
  classes: jax.Array  # int32[G]
  max_distance: jax.Array  # int32[]
  force: bool = struct.field(pytree_node=False, default=False)
  row_grammar: tuple = struct.field(pytree_node=False, default=())

  def allowed(self, g: jax.Array, s: jax.Array, vocab: int) -> jax.Array:
    """bool[rows, vocab]: the tokens rows in states (g, s) may draw."""
    words = self.bits[self.state_offset[g] + s]
    shifts = jnp.arange(32, dtype=jnp.uint32)
    unpacked = (words[:, :, None] >> shifts) & jnp.uint32(1)
    allowed = unpacked.reshape(words.shape[0], -1)[:, :vocab] > 0
    return allowed | (g == 0)[:, None]

  def _row(self, g: jax.Array, s: jax.Array) -> jax.Array:
    """Where state s of grammar g starts in the flat next-state table."""
    return self.class_offset[g] + s * self.classes[g]

  def next_states(self, g: jax.Array, s: jax.Array) -> jax.Array:
    """int32[rows, V]: each token's next state (-1: rejected)."""
    return self.next_state[self._row(g, s)[:, None] + self.token_class[g]]

  def apply(self, state, logits, info):
    g, s = state
    allowed = self.allowed(g, s, logits.shape[-1])
    if self.force:

      def far():
        nxt = self.next_states(g, s)
        return self.distance[
          self.state_offset[g][:, None] + jnp.maximum(nxt, 0)
        ]

      allowed = forcing.close_within(allowed, far, g, info, self.max_distance)
    return jnp.where(allowed, logits, -jnp.inf)

  def update(self, state, tokens, info):
    g, s = state
    nxt = self.next_state[self._row(g, s) + self.token_class[g, tokens]]
    return (g, jnp.where(nxt >= 0, nxt, s))


def compile_rows(
  constraints: Constraint | Sequence[Constraint | None],
  *,
  batch: int,
  vocabulary,
  stop_ids: Sequence[int],
  width: int,
) -> tuple[tuple[int, ...], list[Tables]]:
  """Compiles one constraint for all rows, or one (or None) per row.

  Returns (grammar id per row, 0 = unconstrained; the distinct tables).
  Raises ValueError for a wrong row count or anything not a Constraint.
  """
  if isinstance(constraints, Constraint):
    constraints = [constraints] * batch
  if isinstance(constraints, (str, bytes)) or not isinstance(
    constraints, Sequence
  ):
    raise ValueError(
      f"constraint must be a chunkwise.constraints Constraint or a list of "
      f"one (or None) per row, got {constraints!r}"
    )
  if len(constraints) != batch:
    raise ValueError(
      f"constraint lists one entry per row: got {len(constraints)} for "
      f"{batch} rows"
    )
  if vocabulary is None:
    raise ValueError("constraints need a model with a vocabulary")
  grammar, tables, seen = [], [], {}
  for c in constraints:
    if c is None:
      grammar.append(0)
      continue
    if not isinstance(c, Constraint):
      raise ValueError(
        f"constraint entries must be chunkwise.constraints Regex / "
        f"JsonSchema / Choice or None, got {c!r}"
      )
    t = c.compile(vocabulary, stop_ids=stop_ids, width=width)
    if id(t) not in seen:
      seen[id(t)] = len(tables) + 1
      tables.append(t)
    grammar.append(seen[id(t)])
  return tuple(grammar), tables


def processor(
  row_grammar: Sequence[int],
  tables: Sequence[Tables | Lazy | None],
  *,
  width: int,
  force: bool = False,
  floor: dict | None = None,
  trie: Trie | None = None,
):
  """Concatenates `tables` (grammar i + 1) behind the unconstrained grammar
  0, padded to power-of-two buckets (at least `floor`'s grammars, states
  and transitions); a None entry leaves its grammar id unused (no row may
  be in it). Lazy constraints (`lazy.Lazy`), or none with a vocabulary's
  `trie`, give the walking processor (`walk.py`); eager `Tables` this
  module's."""
  lazy_ones = [t for t in tables if isinstance(t, Lazy)]
  if lazy_ones or trie is not None:
    if len(lazy_ones) != sum(t is not None for t in tables):
      raise ValueError("eager and lazy constraint tables in one batch")
    return walk.processor(
      row_grammar,
      tables,
      trie=trie if trie is not None else lazy_ones[0].trie,
      force=force,
      floor=floor,
    )
  floor = floor or {}
  words = -(-width // 32)
  n_grammars = forcing.bucket(len(tables) + 1, floor.get("grammars", 2))
  state_offset = np.zeros(n_grammars, np.int32)
  class_offset = np.zeros(n_grammars, np.int32)
  classes = np.ones(n_grammars, np.int32)
  token_class = np.zeros((n_grammars, width), np.int32)
  s_total, n_total = 1, 1  # grammar 0: one state, one class, next = 0
  for i, t in enumerate(tables, start=1):
    state_offset[i], class_offset[i] = s_total, n_total
    if t is None:  # a free grammar id (no row uses it)
      continue
    classes[i] = t.classes
    token_class[i] = t.token_class
    s_total += t.states
    n_total += t.next_state.size
  bits = np.zeros(
    (forcing.bucket(s_total, floor.get("states", 16)), words), np.uint32
  )
  distance = np.zeros(bits.shape[0], np.int32)
  next_state = np.zeros(
    forcing.bucket(n_total, floor.get("transitions", 64)), np.int32
  )
  for i, t in enumerate(tables, start=1):
    if t is None:
      continue
    lo = state_offset[i]
    bits[lo : lo + t.states] = t.bits
    distance[lo : lo + t.states] = t.distance
    next_state[class_offset[i] : class_offset[i] + t.next_state.size] = (
      t.next_state.reshape(-1)
    )
  max_distance = max(
    (int(t.distance.max()) for t in tables if t is not None), default=0
  )
  return ConstraintProcessor(
    bits=bits,
    distance=distance,
    token_class=token_class,
    next_state=next_state,
    state_offset=state_offset,
    class_offset=class_offset,
    classes=classes,
    max_distance=np.int32(max_distance),
    force=bool(force),
    row_grammar=tuple(int(g) for g in row_grammar),
  )


def loop_trie(vocabulary, width: int) -> Trie | None:
  """The trie a long-running loop's constraint processor holds (its
  shapes fixed before any constraint arrives): None where constraints are
  eager (`constraint.TABLES`) or the vocabulary spells no bytes."""
  if constraint_lib.TABLES != "lazy" or vocabulary is None:
    return None
  if getattr(vocabulary, "token_bytes", None) is None:
    return None
  return token_trie.of(vocabulary, width)


def for_call(
  constraint,
  *,
  batch: int,
  steps: int,
  stop_ids: Sequence[int],
  vocabulary,
  width: int,
  budget_forcing: bool = False,
  has_prefix: bool = True,
) -> ConstraintProcessor | None:
  """The processor of a generate call's `constraint` (one for every row, or
  one or None per row), compiled; None without a constraint.

  With `budget_forcing`, raises ValueError, before anything runs, when
  `steps` cannot hold a constraint's shortest match and a stop (a row
  without prefix spends its first column on BOS).
  """
  if constraint is None:
    if budget_forcing:
      raise ValueError("budget_forcing=True needs a constraint")
    return None
  grammar, tables = compile_rows(
    constraint,
    batch=batch,
    vocabulary=vocabulary,
    stop_ids=list(stop_ids),
    width=width,
  )
  if budget_forcing:
    room = steps - (0 if has_prefix else 1)
    for t in tables:
      check_room(t, room, f"budget_forcing: steps={steps}")
  return processor(grammar, tables, width=width, force=budget_forcing)


def check_room(tables: Tables, room: int, what: str) -> None:
  """ValueError (`what` first) unless `room` columns hold the shortest
  match of `tables` and a stop: what budget forcing needs to close it."""
  need = int(tables.distance[0])
  if need >= DEAD:
    raise ValueError(
      f"{what}: budget forcing cannot close the constraint "
      f"{tables.regex[:60]!r}: its matches need bytes this vocabulary "
      "spells only inside longer tokens"
    )
  if need + 1 > room:
    raise ValueError(
      f"{what} is too few for its constraint {tables.regex[:60]!r}, whose "
      f"shortest match needs {need} tokens and a stop ({room} columns left)"
    )


def for_rows(
  constraints: Sequence[Constraint | None],
  *,
  stop_ids: Sequence[Sequence[int]],
  steps: Sequence[int],
  has_prefix: Sequence[bool],
  vocabulary,
  width: int,
  budget_forcing: bool = False,
) -> ConstraintProcessor | None:
  """`for_call` with one constraint (or None), stop set, step budget and
  prefix flag per row (continuous batching's requests): each constraint
  is compiled with its row's stop ids; None when no row has one.

  Raises ValueError naming the row whose entry is not a Constraint or
  whose `steps` cannot hold its shortest match and a stop.
  """
  if all(c is None for c in constraints):
    if budget_forcing:
      raise ValueError("budget_forcing=True needs a constraint")
    return None
  grammar, tables, seen = [], [], {}
  for i, c in enumerate(constraints):
    if c is None:
      grammar.append(0)
      continue
    try:
      (_,), (t,) = compile_rows(
        [c],
        batch=1,
        vocabulary=vocabulary,
        stop_ids=list(stop_ids[i]),
        width=width,
      )
    except ValueError as e:
      raise ValueError(f"requests[{i}].constraint: {e}") from e
    room = steps[i] - (0 if has_prefix[i] else 1)
    if budget_forcing:
      check_room(t, room, f"budget_forcing: requests[{i}].steps={steps[i]}")
    if id(t) not in seen:
      seen[id(t)] = len(tables) + 1
      tables.append(t)
    grammar.append(seen[id(t)])
  return processor(grammar, tables, width=width, force=budget_forcing)


class GrammarSet:
  """The tables of a long-running loop's constrained rows under stable
  grammar ids (1, 2, ...; 0 is unconstrained), each shared while any row
  uses it (`take` / `give_back`); `processor()` concatenates the current
  set again only after it changed (a freed id stays empty until reused,
  so running rows keep theirs). With `force`, every constrained row is
  budget-forced (module docstring) within its own steps."""

  def __init__(self, width: int, *, force: bool = False, trie=None):
    self._width = width
    self._force = force
    self._trie = trie  # lazy constraints' vocabulary (None: eager)
    self._tables: list = []  # id i + 1; None: free
    self._users: list[int] = []
    self._processor = None
    self._dirty = True

  def take(self, tables) -> int:
    if tables is None:
      return 0
    for i, t in enumerate(self._tables):
      if t is tables:
        self._users[i] += 1
        return i + 1
    i = self._tables.index(None) if None in self._tables else len(self._tables)
    if i == len(self._tables):
      self._tables.append(None)
      self._users.append(0)
    self._tables[i], self._users[i] = tables, 1
    self._dirty = True
    return i + 1

  def give_back(self, grammar: int) -> None:
    if grammar == 0:
      return
    self._users[grammar - 1] -= 1
    if not self._users[grammar - 1]:
      self._tables[grammar - 1] = None
      self._dirty = True

  def processor(self):
    """The concatenated tables (`LOOP_FLOOR`, or `LOOP_FLOOR_LAZY`, at
    least), on the device:
    placed once per change, not with every segment."""
    if self._dirty:
      self._processor = jax.device_put(
        processor(
          (),
          self._tables,
          width=self._width,
          force=self._force,
          floor=LOOP_FLOOR if self._trie is None else LOOP_FLOOR_LAZY,
          trie=self._trie,
        ).for_loop()
      )
      self._dirty = False
    return self._processor
