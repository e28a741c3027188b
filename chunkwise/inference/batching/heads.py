"""Prefix-cache hits without a wait for a compile (`LiveSlots`).

  heads = Heads(loop.shape)
  a = heads.admissible(a, cache)   # a hit of a pair not compiled: a miss

A request whose prompt starts with cached pages (`paging/prefix_cache.py`)
prefills only what follows them, after those pages joined into one head:
one prefill program per pair of widths (the head's, a power of two of
pages; the rest's length bucket, or the rest in pieces). There are too
many pairs to compile them all before a server reports ready, so `Heads`
keeps the pairs whose programs have run. A hit of another pair is
admitted as a miss (its whole prompt prefilled: the same K/V, so the same
tokens), and a background thread compiles that pair's programs (by
running them on zeros: a head of that width, a prompt of that bucket);
from then on the pair's hits use the cache. The head's own programs (its
join, its write into a slot) are one per width, compiled at warm-up.
"""

from __future__ import annotations

import dataclasses
import queue
import threading

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise.inference import long_prefill
from chunkwise.inference.batching.admission import Admission
from chunkwise.inference.batching.live_requests import LoopShape
from chunkwise.inference.batching.slot_requests import prompt_bucket
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.paging import prefix_cache


class Heads:
  """The (head width, rest) pairs whose programs have run (module
  docstring); `compiled` counts those compiled in the background."""

  def __init__(self, shape: LoopShape):
    self._shape = shape
    self._ready: set = set()
    self._queued: set = set()
    self._lock = threading.Lock()
    self._todo: queue.Queue = queue.Queue()
    self._thread: threading.Thread | None = None
    self._closed = False
    self.compiled = 0

  def key(self, a: Admission):
    """(head width, rest bucket or "pieces", adapter or not) of a hit."""
    rest = a.prompt.size - a.cached
    bucket = "pieces" if rest > self._shape.piece else prompt_bucket(rest)
    return a.hit.width, bucket, a.adapter_id >= 0

  @property
  def pending(self) -> int:
    """Pairs queued whose programs have not compiled yet."""
    with self._lock:
      return len(self._queued - self._ready)

  def ready(self, key) -> bool:
    with self._lock:
      return key in self._ready

  def admissible(self, a: Admission, cache) -> Admission:
    """`a` itself, or for a hit whose pair has not run yet, `a` as a miss
    (its hit unpinned), the pair queued for the background thread."""
    if not a.cached:
      return a
    key = self.key(a)
    if self.ready(key):
      return a
    template = a.hit.pages[0].k
    cache.forgo(a.hit)
    with self._lock:
      if key not in self._queued and not self._closed:
        self._queued.add(key)
        self._todo.put((key, template))
        if self._thread is None:
          self._thread = threading.Thread(
            target=self._work, name="chunkwise-heads", daemon=True
          )
          self._thread.start()
    return dataclasses.replace(a, hit=None)

  def close(self, timeout: float | None = 60.0) -> None:
    """Ends the background thread once its compile in progress is done
    (pairs still queued are dropped): a process must not exit while the
    thread is inside XLA (its interpreter would abort at exit)."""
    with self._lock:
      self._closed = True
      thread, self._thread = self._thread, None
      while not self._todo.empty():
        self._todo.get_nowait()
    if thread is not None:
      self._todo.put(None)
      thread.join(timeout)

  def _work(self) -> None:
    while True:
      item = self._todo.get()
      if item is None:
        return
      key, template = item
      try:
        self.compile(key, template)
      except Exception:  # a pair that cannot compile stays a miss
        continue
      with self._lock:
        self._ready.add(key)
        self.compiled += 1

  def compile(self, key, template) -> None:
    """Runs the prefill of pair `key` on zeros (a head like `template`'s
    pages, `key`'s width; a prompt of `key`'s rest), as a hit's admission
    calls it: its programs compiled."""
    s = self._shape
    width, rest, adapter = key
    blank = jnp.zeros_like(template)
    pages = (blank,) * (width // template.shape[2])
    head = prefix_cache.join(pages, pages, 1)
    caches = (*s.caches, head)
    if rest == "pieces":
      ids = np.int32([0 if adapter else -1])
      chunk = Chunk(
        tokens=np.zeros((1, 2 * s.piece), np.int32),
        lengths=np.int32([s.piece + 1]),
      )
      staged = long_prefill.Staged(
        lambda caches, prev, piece: s.prefill_engine.prefill(
          caches,
          prev,
          piece,
          top_n=s.admit_top_n,
          bos_id=s.bos_id,
          adapters=s.adapters_of(s.prefill_engine, ids),
        ),
        caches,
        None,
        chunk,
        width=s.piece,
        columns=max(s.capacity, chunk.time),
        scores=False,
      )
      while (result := staged.advance()) is None:
        pass
    else:
      rows = s.admit_rows[0]  # a hit's (`admission.prefill_into`)
      ids = np.full(rows, 0 if adapter else -1, np.int32)
      result = s.prefill_engine.prefill(
        caches,
        None,
        Chunk(
          tokens=np.zeros((rows, rest), np.int32),
          lengths=np.full(rows, rest, np.int32),
        ),
        top_n=s.admit_top_n,
        bos_id=s.bos_id,
        adapters=s.adapters_of(s.prefill_engine, ids),
      )
    jax.block_until_ready(result)
