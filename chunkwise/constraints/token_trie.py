"""A vocabulary's tokens as a trie of bytes: what a mask walks.

  trie = token_trie.of(vocabulary, width=V)  # once per vocabulary
  rows = trie.walk(dfa.shifted, state + 1)   # int32[V]: each token's state + 1
  allowed = rows != 0                        # + stop ids where final

Every distinct prefix of a token's bytes is one node, numbered level by
level (all one-byte prefixes, then all two-byte ones, ...), each with its
parent node and last byte. Walking a DFA over the trie from one state
costs one table lookup per node (SmolLM2's 49,152 tokens make ~100k
nodes), where walking every token costs one per byte (~330k), and a
whole level is one vectorized gather: so a mask is computed exactly, when
a state is reached, from the byte DFA and this trie alone, with no table
over (states x vocabulary) built beforehand. Control tokens (no bytes),
ids past the logits width are in no node (stop ids are in theirs: a
constraint allows them by its own rule, `lazy`).

The trie depends only on the vocabulary; it is built once per vocabulary
(a few hundred ms for 49k tokens) and cached in memory and on disk
(`disk_cache`, beside the compiled constraints).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence

import numpy as np

from chunkwise.constraints import disk_cache


@dataclasses.dataclass(frozen=True, eq=False)
class Trie:
  """A vocabulary's byte trie (module docstring)."""

  parent: np.ndarray  # int32[N]: parent node (-1: a one-byte prefix)
  byte: np.ndarray  # int32[N]: the node's last byte
  levels: tuple[int, ...]  # node index where each level starts, + N
  token_node: np.ndarray  # int32[V]: each id's node (-1: none)
  token_bytes: np.ndarray  # uint8[V, L]: each id's bytes, zero-padded
  token_length: np.ndarray  # int32[V]: 0 for an id without bytes
  key: str  # digest of the token bytes and width

  @functools.cached_property
  def children(self) -> tuple[np.ndarray, np.ndarray]:
    """(keys, nodes): node `nodes[i]` is the child of node p by byte b
    where keys[i] == (p + 1) * 256 + b (p = -1: the root); keys sorted."""
    keys = (self.parent.astype(np.int64) + 1) * 256 + self.byte
    order = np.argsort(keys, kind="stable")
    return keys[order], order.astype(np.int64)

  def child(self, node: np.ndarray, byte: np.ndarray):
    """(found bool[n], child int64[n]): each node's child by its byte
    (node -1: the root; `child` is meaningless where not `found`)."""
    keys, nodes = self.children
    key = (node + 1) * 256 + byte
    i = np.minimum(np.searchsorted(keys, key), keys.size - 1)
    return keys[i] == key, nodes[i]

  def has_child_by(self, node: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """bool[n]: whether node `node[i]` has a child by a byte `allowed[i]`
    (bool[256]) allows."""
    keys, _ = self.children
    lo = np.searchsorted(keys, (node + 1) * 256)
    count = np.searchsorted(keys, (node + 2) * 256) - lo
    owner = np.repeat(np.arange(node.size), count)
    first = np.repeat(lo - (np.cumsum(count) - count), count)
    child_byte = keys[first + np.arange(owner.size)] % 256
    out = np.zeros(node.size, bool)
    out[owner[allowed[owner, child_byte]]] = True
    return out

  def lone_bytes(self, stops=()) -> np.ndarray:
    """bool[256]: the bytes an id (not one of `stops`) spells alone."""
    lone = (self.token_length == 1) & (self.token_node >= 0)
    lone[[s for s in stops if 0 <= s < lone.size]] = False
    out = np.zeros(256, bool)
    out[self.token_bytes[lone, 0]] = True
    return out

  @property
  def nodes(self) -> int:
    return self.parent.shape[0]

  @property
  def width(self) -> int:
    return self.token_node.shape[0]

  def walk(self, shifted: np.ndarray, row: int) -> np.ndarray:
    """int32[V]: the row of the state after each token, walking a DFA
    whose rows are `shifted` (`ByteDfa.shifted`: row 0 rejects, and stays)
    from `row` (0: the token is rejected there, or has no bytes)."""
    at = np.zeros(self.nodes, np.int32)
    flat = np.asarray(shifted).reshape(-1)
    for lo, hi in zip(self.levels[:-1], self.levels[1:], strict=True):
      prev = (
        np.full(hi - lo, row, np.int64)
        if lo == 0
        else at[self.parent[lo:hi]].astype(np.int64)
      )
      at[lo:hi] = flat[prev * 256 + self.byte[lo:hi]]
    out = np.where(self.token_node >= 0, at[np.maximum(self.token_node, 0)], 0)
    return out.astype(np.int32)


def digest(token_bytes: Sequence[bytes | None], width: int) -> str:
  """A digest of the token bytes below `width` (and of this file: a trie
  built by other code is another entry on disk)."""
  h = hashlib.sha256(repr((width, _code())).encode())
  for b in token_bytes[:width]:
    h.update(b"\x00" if b is None else b"\x01" + len(b).to_bytes(4) + b)
  return h.hexdigest()


@functools.cache
def _code() -> str:
  with open(__file__, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()[:16]


def build(token_bytes: Sequence[bytes | None], width: int) -> Trie:
  """The trie of `token_bytes` (None: a control token) for ids below
  `width`."""
  words: dict[bytes, int] = {}  # every prefix -> a provisional id
  ids = np.full(width, -1, np.int64)
  for i, b in enumerate(token_bytes[:width]):
    if not b:
      continue
    for k in range(1, len(b) + 1):
      words.setdefault(b[:k], len(words))
    ids[i] = words[b]
  prefixes = sorted(words, key=lambda p: (len(p), p))
  number = {p: j for j, p in enumerate(prefixes)}
  parent = np.array(
    [number[p[:-1]] if len(p) > 1 else -1 for p in prefixes], np.int32
  )
  byte = np.array([p[-1] for p in prefixes], np.int32)
  lengths = np.array([len(p) for p in prefixes], np.int64)
  top = int(lengths.max()) if lengths.size else 0
  levels = tuple(
    int(x) for x in np.searchsorted(lengths, np.arange(1, top + 2))
  )
  provisional = np.full(len(words), -1, np.int64)
  for p, j in words.items():
    provisional[j] = number[p]
  token_node = np.where(ids >= 0, provisional[np.maximum(ids, 0)], -1)
  length = np.zeros(width, np.int32)
  for i, b in enumerate(token_bytes[:width]):
    length[i] = len(b) if b else 0
  spelled = np.zeros((width, max(int(length.max(initial=0)), 1)), np.uint8)
  for i, b in enumerate(token_bytes[:width]):
    if b:
      spelled[i, : len(b)] = np.frombuffer(b, np.uint8)
  return Trie(
    parent=parent,
    byte=byte,
    levels=levels,
    token_node=token_node.astype(np.int32),
    token_bytes=spelled,
    token_length=length,
    key=digest(token_bytes, width),
  )


_CACHE: dict[tuple, tuple[object, Trie]] = {}


def of(vocabulary, width: int) -> Trie:
  """`build` of a vocabulary's `token_bytes()`, cached per vocabulary."""
  key = (id(vocabulary), int(width))
  hit = _CACHE.get(key)
  if hit is not None and hit[0] is vocabulary:
    return hit[1]
  token_bytes = vocabulary.token_bytes()
  trie = _load_or_build(token_bytes, width)
  if len(_CACHE) > 8:
    _CACHE.clear()
  _CACHE[key] = (vocabulary, trie)
  return trie


_ARRAYS = (
  "parent",
  "byte",
  "levels",
  "token_node",
  "token_bytes",
  "token_length",
)


def _load_or_build(token_bytes, width: int) -> Trie:
  """The trie from the constraint disk cache (`disk_cache`), else built
  and stored there."""
  key = digest(token_bytes, width)
  found = disk_cache.load_arrays("trie-" + key, _ARRAYS)
  if found is not None:
    try:
      trie = Trie(
        **{n: found[n] for n in _ARRAYS if n != "levels"},
        levels=tuple(int(x) for x in found["levels"]),
        key=key,
      )
      if _consistent(trie, width):
        return trie
    except (TypeError, ValueError):
      pass
  trie = build(token_bytes, width)
  disk_cache.store_arrays(
    "trie-" + key,
    {n: np.asarray(getattr(trie, n)) for n in _ARRAYS},
  )
  return trie


def _consistent(t: Trie, width: int) -> bool:
  n = t.parent.shape[0]
  return (
    t.parent.dtype == np.int32
    and t.byte.dtype == np.int32
    and t.token_node.dtype == np.int32
    and t.token_bytes.dtype == np.uint8
    and t.token_length.dtype == np.int32
    and t.byte.shape == (n,)
    and t.token_node.shape == t.token_length.shape == (width,)
    and t.token_bytes.shape[0] == width
    and len(t.levels) >= 1
    and t.levels[0] == 0
    and t.levels[-1] == n
    and list(t.levels) == sorted(t.levels)
    and (n == 0 or (t.parent.min() >= -1 and t.parent.max() < n))
    and (n == 0 or (t.byte.min() >= 0 and t.byte.max() < 256))
    and int(t.token_node.max(initial=-1)) < n
    and int(t.token_length.max(initial=0)) <= t.token_bytes.shape[1]
  )
