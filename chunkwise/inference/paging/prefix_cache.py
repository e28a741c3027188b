"""A prefix cache: K/V of full pages of prompts, shared across requests.

  cache = PrefixCache(max_bytes=256 << 20, page=64)
  hit = cache.lookup(space, prompt)      # longest cached run of full pages
  head = hit.head                        # their K/V, a batch-1 `KVCache`
  ...                                    # prefill the rest after head
  cache.insert(space, prompt, kv, row=j, offset=hit.tokens)
  cache.release(hit)

The slot loops (`generate_many`, `live_slots`, the server) look up each
admitted prompt here and prefill only what follows its longest cached
prefix, then store the full pages of what they computed. A page is
`page` tokens of one prompt; it is found by the exact tokens of every page
before it and its own (a trie: a page's key is its parent page and its
tokens, so two prompts share pages only as far as they agree token for
token, whole pages only), within a `space` (the loop's adapter: the same
tokens under two adapters have different K/V). Everything in one cache
belongs to one model, one shared prefix and one placement: a loop makes its
own.

Counting and eviction: a page's `refs` are its cached children plus the
lookups that pinned it (until `release`); at most `max_bytes` of K/V are
held, and when a new page does not fit, pages with no refs go, least
recently used first (leaves, so a cached page's whole path stays cached).
A page that still cannot fit is not stored. A lookup never returns the
prompt's last token (its next-token logits must be computed), so a hit
covers at most `len(prompt) - 1` tokens.

Exactness: the cached K/V are those a cold prefill computes, and the rest
of the prompt is prefilled after them as `InferenceModel.prefill` runs a
long chunk in pieces (`long_prefill`); under invariant numerics a hit's
tokens and scores are bit for bit a cold run's (tests/test_prefix_cache.py),
under fast numerics they are within a chunk split's rounding.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import itertools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from chunkwise.inference.kv_cache import KVCache

PAGE = 64  # tokens per page, by default


@dataclasses.dataclass(eq=False)
class _Page:
  key: tuple  # (parent's id or the space, this page's tokens as bytes)
  id: int
  parent: _Page | None
  k: jax.Array  # [layers, 1, page, kv_heads, head_dim]
  v: jax.Array
  refs: int = 0  # cached children + pins
  used: int = 0  # the lookup clock at its last use

  @property
  def nbytes(self) -> int:
    return self.k.nbytes + self.v.nbytes


@dataclasses.dataclass(frozen=True)
class Hit:
  """The cached prefix of one prompt: `pages` (pinned until `release`) of
  `tokens` tokens in all (0: a miss)."""

  pages: tuple
  tokens: int

  @property
  def key(self) -> int | None:
    """The last page's id (prompts with the same key share the head)."""
    return self.pages[-1].id if self.pages else None

  @functools.cached_property
  def head(self) -> KVCache:
    """The pages' K/V as one batch-1 `KVCache`, padded to a power of two
    of pages (masked: its lengths are `tokens`), so few prefill programs
    compile: zero pages fill the rest, so the join is one program per
    width too."""
    blank = jnp.zeros_like(self.pages[0].k)
    pad = (blank,) * (_bucket(len(self.pages)) - len(self.pages))
    return join(
      tuple(p.k for p in self.pages) + pad,
      tuple(p.v for p in self.pages) + pad,
      self.tokens,
    )

  @property
  def width(self) -> int:
    """Columns of `head` (0 for a miss)."""
    if not self.pages:
      return 0
    return _bucket(len(self.pages)) * self.pages[0].k.shape[2]


@dataclasses.dataclass(frozen=True)
class Stats:
  """What a cache did so far: prompt tokens looked up (`queries`) and
  found (`hits`, vLLM's `prefix_cache_queries`/`_hits` counters), prompts
  that found some (`hit_requests`) or none (`miss_requests`), pages stored
  and evicted, and the pages and bytes held now."""

  queries: int = 0
  hits: int = 0
  hit_requests: int = 0
  miss_requests: int = 0
  stored: int = 0
  evicted: int = 0
  pages: int = 0
  bytes: int = 0


class PrefixCache:
  """Full pages of prompts' K/V by their exact token prefixes (module
  docstring), at most `max_bytes` of them."""

  def __init__(self, max_bytes: int, page: int = PAGE):
    self.max_bytes = check_bytes(max_bytes)
    if isinstance(page, bool) or not isinstance(page, int) or page < 1:
      raise ValueError(
        f"prefix cache page={page!r}: expected a positive number of tokens"
      )
    self.page = page
    self._pages: dict[tuple, _Page] = {}
    self._ids = itertools.count()
    self._clock = itertools.count(1)
    self._bytes = 0
    self._counts = dict.fromkeys(
      ("queries", "hits", "hit_requests", "miss_requests", "stored", "evicted"),
      0,
    )

  @property
  def stats(self) -> Stats:
    return Stats(**self._counts, pages=len(self._pages), bytes=self._bytes)

  def _key(self, space: Hashable, parent: _Page | None, tokens: np.ndarray):
    return (
      ("space", space) if parent is None else parent.id,
      np.asarray(tokens, np.int32).tobytes(),
    )

  def lookup(self, space: Hashable, prompt: np.ndarray) -> Hit:
    """The longest run of cached full pages that `prompt` starts with (at
    most len(prompt) - 1 tokens), pinned; counted in `stats`."""
    prompt = np.asarray(prompt)
    now = next(self._clock)
    pages, parent = [], None
    for i in range((prompt.size - 1) // self.page):
      chunk = prompt[i * self.page : (i + 1) * self.page]
      found = self._pages.get(self._key(space, parent, chunk))
      if found is None:
        break
      found.refs += 1
      found.used = now
      pages.append(found)
      parent = found
    tokens = len(pages) * self.page
    self._counts["queries"] += int(prompt.size)
    self._counts["hits"] += tokens
    self._counts["hit_requests" if pages else "miss_requests"] += 1
    return Hit(pages=tuple(pages), tokens=tokens)

  def pages(self) -> tuple:
    """The pages held (each with its k and v)."""
    return tuple(self._pages.values())

  def clear(self) -> None:
    """Forgets every page and count (what a warm-up stored and looked
    up); no page may be pinned."""
    children = collections.Counter(
      p.parent.id for p in self._pages.values() if p.parent is not None
    )
    if any(p.refs > children[p.id] for p in self._pages.values()):
      raise ValueError("clear() with pages pinned by a lookup")
    self._pages.clear()
    self._bytes = 0
    self._counts = dict.fromkeys(self._counts, 0)

  def forgo(self, hit: Hit) -> None:
    """Unpins a hit that is not used (its prompt prefilled whole): it
    counts as a miss."""
    self.release(hit)
    if hit.pages:
      self._counts["hits"] -= hit.tokens
      self._counts["hit_requests"] -= 1
      self._counts["miss_requests"] += 1

  def release(self, hit: Hit) -> None:
    """Unpins what `lookup` pinned."""
    for p in hit.pages:
      p.refs -= 1

  def insert(
    self,
    space: Hashable,
    prompt: np.ndarray,
    kv: KVCache,
    *,
    row: int,
    offset: int,
  ) -> None:
    """Stores the full pages of `prompt` that row `row` of `kv` holds (its
    columns are prompt positions offset, offset + 1, ...), after those
    already cached; stops at the first that does not fit."""
    prompt = np.asarray(prompt)
    full = prompt.size // self.page
    parent, todo = None, []
    for i in range(full):
      chunk = prompt[i * self.page : (i + 1) * self.page]
      key = self._key(space, parent, chunk)
      found = self._pages.get(key)
      if found is None:
        if i * self.page < offset:
          return  # an earlier page was evicted since: nothing to hang on
        todo = list(range(i, full))
        break
      parent = found
    if not todo:
      return
    start = todo[0] * self.page - offset
    # One program per width of `kv`, a call per page.
    cut = [
      _cut(
        kv.k, kv.v, jnp.int32(row), jnp.int32(start + j * self.page), self.page
      )
      for j in range(len(todo))
    ]
    now = next(self._clock)
    for i, (k, v) in zip(todo, cut, strict=True):
      chunk = prompt[i * self.page : (i + 1) * self.page]
      page = _Page(
        key=self._key(space, parent, chunk),
        id=next(self._ids),
        parent=parent,
        k=k,
        v=v,
        used=now,
      )
      if parent is not None:
        parent.refs += 1  # held while the new page is being placed
      if not self._make_room(page.nbytes):
        if parent is not None:
          parent.refs -= 1
        return
      self._pages[page.key] = page
      self._bytes += page.nbytes
      self._counts["stored"] += 1
      parent = page

  def _make_room(self, nbytes: int) -> bool:
    """Evicts unreferenced pages, least recently used first, until
    `nbytes` more fit; False (nothing evicted) when they cannot."""
    victims = self._victims(self._bytes + nbytes - self.max_bytes)
    if victims is None:
      return False
    for p in victims:
      del self._pages[p.key]
      self._bytes -= p.nbytes
      self._counts["evicted"] += 1
      if p.parent is not None:
        p.parent.refs -= 1
    return True

  def _victims(self, need: int) -> list[_Page] | None:
    """The pages to evict to free `need` bytes, least recently used first
    (a parent joins once its last child is chosen); None if all of them
    would not free enough."""
    refs = {p.id: p.refs for p in self._pages.values()}
    ready = [(p.used, p.id, p) for p in self._pages.values() if not p.refs]
    heapq.heapify(ready)
    out, freed = [], 0
    while freed < need and ready:
      _, _, p = heapq.heappop(ready)
      out.append(p)
      freed += p.nbytes
      if p.parent is not None:
        refs[p.parent.id] -= 1
        if not refs[p.parent.id]:
          heapq.heappush(ready, (p.parent.used, p.parent.id, p.parent))
    return out if freed >= need else None


def check_bytes(value) -> int:
  """A cache size in bytes: a non-negative int (0: no cache)."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(
      f"prefix cache max_bytes={value!r}: expected a non-negative number "
      "of bytes (0: no prefix cache)"
    )
  return value


def make(max_bytes: int, page: int | None = None) -> PrefixCache | None:
  """A cache of `max_bytes` in pages of `page` tokens (default `PAGE`);
  None for 0 bytes."""
  check_bytes(max_bytes)
  return PrefixCache(max_bytes, page or PAGE) if max_bytes else None


def _bucket(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


@functools.partial(jax.jit, static_argnums=4)
def _cut(k, v, row, start, page: int):
  """(k, v) of columns [start, start + page) of row `row`, each [layers, 1,
  page, kv_heads, head_dim]."""

  def one(x):
    x = lax.dynamic_slice_in_dim(x, row, 1, axis=1)
    return lax.dynamic_slice_in_dim(x, start, page, axis=2)

  return one(k), one(v)


def join(ks, vs, tokens: int) -> KVCache:
  """Pages (k, v each [layers, 1, page, ...]) as one batch-1 `KVCache`
  of `tokens` tokens: a `Hit.head` (one program per number of pages)."""
  return _join(tuple(ks), tuple(vs), jnp.int32(tokens))


@jax.jit
def _join(ks, vs, tokens) -> KVCache:
  return KVCache(
    k=jnp.concatenate(ks, axis=2),
    v=jnp.concatenate(vs, axis=2),
    lengths=tokens[None],
  )
