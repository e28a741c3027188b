"""Constraints in the generate loop, masks walked per step: the device side
of `lazy.Lazy` constraints (`processor.processor` builds it for them).

Every constraint's byte DFA is concatenated into one table of rows, with
one rejecting row first (`ByteDfa.shifted`): grammar g's state s is row
`offset[g] + s`, and every entry is a row (0: rejected). Each row of the
batch carries (grammar g, state s); grammar 0 is unconstrained. Per step,
for the rows of the batch:

  at[level 1] = table[row, byte[level 1 nodes]]            # [rows, n1]
  at[level d] = table[at[level d-1][parent], byte[level d nodes]]
  ends = at[token_node]                                      # [rows, V]
  allowed = (ends > 0 and not a stop) | (a stop and final[row])

one vectorized gather per level of the vocabulary's trie (`token_trie`:
~100k nodes and 82 levels for SmolLM2's 49,152 tokens), skipped when no
row is constrained. After sampling, each row walks its token's bytes (one
gather per byte, rows side by side). So a constraint costs its DFA's
rows (256 entries each) on the device, never a table over the vocabulary,
and its mask is exactly the eager tables' (`tests/test_lazy_masks.py`).

The trie is the loop's (one per vocabulary, the same arrays whatever the
constraints), and the table is padded to power-of-two rows (at least
`floor`'s), so a new constraint of the same bucket reuses the compiled
loop. Budget forcing (`force=True`) is `forcing.py`'s rule, with
`lazy.Lazy.distance` per row.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from chunkwise.constraints import forcing
from chunkwise.constraints.lazy import Lazy
from chunkwise.constraints.tables import DEAD
from chunkwise.constraints.token_trie import Trie
from chunkwise.processors import LogitsProcessor


class WalkProcessor(forcing.RowGrammars, LogitsProcessor):
  """The device side of one batch's lazy constraints (module docstring)."""

  table: jax.Array  # int32[R * 256]: rows' successors (0: rejected)
  final: jax.Array  # bool[R]
  distance: jax.Array  # int32[R]
  forced: jax.Array  # int32[R]: the one id a row allows (-1: walked)
  offset: jax.Array  # int32[G]: grammar g's state 0 is row offset[g]
  parent: jax.Array  # int32[N]: a node's parent, within its level
  byte: jax.Array  # int32[N]
  token_node: jax.Array  # int32[V]: each id's node (N: none)
  token_bytes: jax.Array  # uint8[V, L]: each id's bytes (walked in update)
  token_length: jax.Array  # int32[V]
  tail_parent: jax.Array  # int32[T, W]: the thin levels' parents (padded)
  tail_byte: jax.Array  # int32[T, W]
  max_distance: jax.Array  # int32[]
  levels: tuple = struct.field(pytree_node=False, default=())
  force: bool = struct.field(pytree_node=False, default=False)
  row_grammar: tuple = struct.field(pytree_node=False, default=())

  def rows(self, g: jax.Array, s: jax.Array) -> jax.Array:
    """int32[rows]: each batch row's table row."""
    return jnp.where(g > 0, self.offset[g] + s, 0)

  def ends(self, row: jax.Array) -> jax.Array:
    """int32[rows, V]: the table row after each id from `row` (0: the id
    is rejected there, or has no bytes). The trie's wide levels are walked
    one op each; its long thin tail (the few long tokens) in a loop over
    levels padded to one width, so the program stays small."""
    levels = self.levels
    parts, prev = [], None
    for d in range(len(levels) - 1):
      lo, hi = levels[d], levels[d + 1]
      at = row[:, None] if d == 0 else prev[:, self.parent[lo:hi]]
      prev = self.table[at * 256 + self.byte[lo:hi][None, :]]
      parts.append(prev)
    tail, width = self.tail_parent.shape
    if tail:
      # Node-major ([width, rows]): a level gathers whole rows of it.
      start = jnp.pad(prev.T, ((0, width - prev.shape[1]), (0, 0)))

      def level(prev, nodes):
        parent, byte = nodes
        cur = self.table[prev[parent] * 256 + byte[:, None]]
        return cur, cur

      _, out = lax.scan(level, start, (self.tail_parent, self.tail_byte))
      parts.append(out.transpose(2, 0, 1).reshape(row.shape[0], -1))
    parts.append(jnp.zeros((row.shape[0], 1), jnp.int32))  # no node
    return jnp.concatenate(parts, axis=1)[:, self.token_node]

  def _few(self, walk: jax.Array, row: jax.Array) -> jax.Array:
    """`ends` when at most `FEW` rows need a `walk` (bool[rows]): only
    those walk (the others' ends stay 0: free rows allow every id, and a
    forced row's one id is filled in by `allowed`)."""
    pick = jnp.argsort(~walk, stable=True)[:FEW]  # walking rows first
    out = jnp.zeros((row.shape[0], self.token_node.shape[0]), jnp.int32)
    return out.at[pick].set(self.ends(row[pick]))

  def allowed(self, g, s, info, vocab: int) -> tuple[jax.Array, jax.Array]:
    """(bool[rows, vocab] the ids rows in states (g, s) may draw,
    int32[rows, vocab] the rows they lead to). A row in a fast-forward
    state (`lazy.forced_tokens`) allows its one id and does not walk the
    trie; nor do free rows; while no row needs it, nothing walks."""
    row = self.rows(g, s)
    forced = jnp.where(g > 0, self.forced[row], -1)
    one = jnp.arange(vocab)[None, :] == forced[:, None]  # [rows, vocab]
    walk = (g > 0) & (forced < 0)

    def walked(row):
      if row.shape[0] > FEW:
        few = jnp.sum(walk) <= FEW
        ends = lax.cond(few, functools.partial(self._few, walk), self.ends, row)
      else:
        ends = self.ends(row)
      return _width(ends, vocab)

    def skipped(row):
      return jnp.zeros((row.shape[0], vocab), jnp.int32)

    ends = lax.cond(jnp.any(walk), walked, skipped, row)
    after = self.after(row, jnp.maximum(forced, 0))  # a forced id's end
    ends = jnp.where(one, after[:, None], ends)
    is_stop = info.stop_rows(vocab)
    ok = jnp.where(is_stop, self.final[row][:, None], ends > 0)
    ok = jnp.where((forced >= 0)[:, None], one, ok)
    return ok | (g == 0)[:, None], ends

  def apply(self, state, logits, info):
    g, s = state
    # Nothing to do (and nothing walked) while no row is constrained.
    return lax.cond(
      jnp.any(g > 0),
      functools.partial(self._masked, g, s, info),
      lambda logits: logits,
      logits,
    )

  def _masked(self, g, s, info, logits):
    allowed, ends = self.allowed(g, s, info, logits.shape[-1])
    if self.force:
      allowed = forcing.close_within(
        allowed, lambda: self.distance[ends], g, info, self.max_distance
      )
    return jnp.where(allowed, logits, -jnp.inf)

  def after(self, row: jax.Array, tokens: jax.Array) -> jax.Array:
    """int32[rows]: the row after each row's token's bytes (0: rejected;
    `row` itself for an id without bytes), as many steps as the longest
    token (not the vocabulary's)."""
    t = jnp.clip(tokens, 0, self.token_node.shape[0] - 1)
    n = self.token_length[t]
    spelled = self.token_bytes[t].astype(jnp.int32)  # [rows, L]

    def byte(i, end):
      return jnp.where(i < n, self.table[end * 256 + spelled[:, i]], end)

    return lax.fori_loop(0, jnp.max(n), byte, row)

  def update(self, state, tokens, info):
    g, s = state
    row = self.rows(g, s)
    t = jnp.clip(tokens, 0, self.token_node.shape[0] - 1)
    n = self.token_length[t]
    end = self.after(row, tokens)
    stop_ids = info.stop_ids if info.stop_ids.ndim == 2 else info.stop_ids[None]
    stop = jnp.any(stop_ids == tokens[:, None], axis=1)
    moved = (g > 0) & (end > 0) & ~stop & (n > 0)
    return (g, jnp.where(moved, end - self.offset[g], s))


def _width(ends: jax.Array, vocab: int) -> jax.Array:
  """`ends` cut or padded (rejected) to `vocab` columns."""
  if ends.shape[1] >= vocab:
    return ends[:, :vocab]
  return jnp.pad(ends, ((0, 0), (0, vocab - ends.shape[1])))


# With at most this many constrained rows in a larger batch, only they
# walk the trie (a batch of 16 with one tool call pays for one row).
FEW = 4

# The trie's levels from the first no wider than this on are walked in a
# loop (`WalkProcessor.ends`); the wider ones before it, one op each.
THIN = 256


def trie_arrays(trie: Trie) -> dict:
  """The trie as the processor's arrays: the wide levels (each level's
  parents relative to the level before), then the thin tail's levels
  padded to one width (parents relative to the padded level before); ids
  without bytes point past the last position."""
  sizes = np.diff(trie.levels)
  head = len(sizes)
  while head > 1 and sizes[head - 2 :].max(initial=0) <= THIN:
    head -= 1
  head = len(sizes) if len(sizes) - head < 2 else head
  levels = trie.levels[: head + 1]
  parent = trie.parent[: levels[-1]].copy()
  for lo, hi, before in zip(levels[1:-1], levels[2:], levels[:-2], strict=True):
    parent[lo:hi] -= before
  parent[: levels[1] if len(levels) > 1 else 0] = 0
  # Each node's position in the walk's output: the head's nodes in order,
  # then the tail's level by level, `width` slots each.
  tail = sizes[head:]
  width = int(max(tail.max(initial=0), sizes[head - 1] if head else 0))
  position = np.arange(trie.nodes, dtype=np.int64)
  tail_parent = np.zeros((len(tail), width), np.int32)
  tail_byte = np.zeros((len(tail), width), np.int32)
  for i in range(len(tail)):
    lo, hi = trie.levels[head + i], trie.levels[head + i + 1]
    before = trie.levels[head + i - 1]
    tail_parent[i, : hi - lo] = trie.parent[lo:hi] - before
    tail_byte[i, : hi - lo] = trie.byte[lo:hi]
    position[lo:hi] = levels[-1] + i * width + np.arange(hi - lo)
  none = levels[-1] + len(tail) * width
  node = np.where(trie.token_node >= 0, position[trie.token_node], none)
  return {
    "parent": parent.astype(np.int32),
    "byte": trie.byte[: levels[-1]].astype(np.int32),
    "token_node": node.astype(np.int32),
    "token_bytes": trie.token_bytes,
    "token_length": trie.token_length,
    "tail_parent": tail_parent,
    "tail_byte": tail_byte,
    "levels": tuple(int(x) for x in levels),
  }


def processor(
  row_grammar: Sequence[int],
  tables: Sequence[Lazy | None],
  *,
  trie: Trie,
  force: bool = False,
  floor: dict | None = None,
) -> WalkProcessor:
  """Concatenates the DFAs of `tables` (grammar i + 1) behind the
  rejecting row, padded to power-of-two rows (at least `floor["states"]`)
  and grammars (at least `floor["grammars"]`); a None entry leaves its
  grammar id unused."""
  floor = floor or {}
  n_grammars = forcing.bucket(len(tables) + 1, floor.get("grammars", 2))
  offset = np.zeros(n_grammars, np.int32)
  rows = 1
  for i, t in enumerate(tables, start=1):
    if t is None:
      continue
    if t.trie is not trie and t.trie.key != trie.key:
      raise ValueError("a constraint compiled for another vocabulary")
    offset[i] = rows
    rows += t.states
  n_rows = forcing.bucket(rows, floor.get("states", 16))
  table = np.zeros((n_rows, 256), np.int32)
  final = np.zeros(n_rows, bool)
  distance = np.full(n_rows, DEAD, np.int32)
  forced = np.full(n_rows, -1, np.int32)
  for i, t in enumerate(tables, start=1):
    if t is None:
      continue
    lo = offset[i]
    table[lo : lo + t.states] = np.where(t.dfa.table >= 0, t.dfa.table + lo, 0)
    final[lo : lo + t.states] = t.final
    distance[lo : lo + t.states] = t.distance
    forced[lo : lo + t.states] = t.forced_ids
  max_distance = max((t.longest for t in tables if t is not None), default=0)
  return WalkProcessor(
    table=table.reshape(-1),
    final=final,
    distance=distance,
    forced=forced,
    offset=offset,
    max_distance=np.int32(max_distance),
    force=bool(force),
    row_grammar=tuple(int(g) for g in row_grammar),
    **trie_arrays(trie),
  )
