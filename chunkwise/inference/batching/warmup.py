"""Warm-up: every program a live loop's requests can need, compiled before
the first one arrives.

  report = loop.warm_up()            # LiveSlots.warm_up
  print(report)                      # "31 requests, 27 programs, 41.2 s ..."

A live loop's programs are fixed by its shapes (`live.py`): one segment
program per slot bucket (`buckets.py`), one admission prefill and one
admission write per prompt length bucket (`slot_requests.prompt_bucket`,
8 to the loop's piece width) and row count (short prompts that arrive
together share a call: `admission.rows_for`), the pieces of long
prompts per whole number of pieces (`admission.stage`: one buffer as
wide as a slot, whatever the prompt's length), the report of each
segment, and the constrained variant of each (the loop's grammar tables
have one shape for up to 64 constraints of 16,384 DFA states in all:
`constraints.LOOP_FLOOR_LAZY`).
Warm-up runs placeholder requests through the loop itself, so the very
programs a request takes (jitted functions, their placements and
committed inputs included) are compiled and run once: a round per bucket
size (that many requests at once, the shortest prompts, one constrained,
one on an adapter where the loop serves some), meanwhile a second thread
compiles and runs the prefill of every other length (a program's compile
overlaps another's tracing), then a request of each length (its
admission; two of each short one at once), then one long prompt in two
pieces. With a prefix cache, the placeholders' pages are stored (no two
start alike, so none is found), and a cached start of each width is
written into a slot (its write programs), then the cache is emptied.
Programs compiled before (JAX's persistent compilation cache) are loaded
instead of compiled.

What is not warmed: the prefill after a prefix-cache hit, one program per
pair of widths (a hit of a pair not compiled yet is admitted as a miss
while a background thread compiles it: `heads.py`), and a constraint whose
tables outgrow the floor, which compiles its programs the first time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise import compile_cache
from chunkwise import constraints as constraints_lib
from chunkwise.inference.batching import admission
from chunkwise.inference.batching.slot_requests import (
  Request,
  columns_needed,
  prompt_bucket,
)
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.engines.engine import compiled_programs
from chunkwise.inference.sampling import Sampling

# A constraint every vocabulary spells (one byte): the constrained variant.
_CONSTRAINT = constraints_lib.Regex("[0-9]")


@dataclasses.dataclass(frozen=True)
class Report:
  """What a warm-up ran: its placeholder requests, the programs the
  engines compiled or loaded for it, the bucket sizes and prompt lengths
  it covered, and its seconds."""

  requests: int
  programs: int  # the engines' (and the admissions')
  loaded: int  # XLA programs loaded from JAX's persistent compilation cache
  compiled: int  # XLA programs compiled (cache misses; 0 without a cache)
  slot_buckets: tuple[int, ...]
  prompt_buckets: tuple[int, ...]
  pieces: tuple[int, ...]  # long prompts' lengths
  constrained: bool
  adapters: bool
  seconds: float

  def __str__(self) -> str:
    parts = [
      f"{self.requests} requests, {self.programs} programs in "
      f"{self.seconds:.1f} s (XLA: {self.loaded} loaded from the "
      f"compilation cache, {self.compiled} compiled into it)",
      "slot buckets " + ",".join(map(str, self.slot_buckets)),
      "prompt buckets " + ",".join(map(str, self.prompt_buckets)),
    ]
    if self.pieces:
      parts.append("a long prompt in pieces")
    if self.constrained:
      parts.append("constrained")
    if self.adapters:
      parts.append("adapters")
    return "; ".join(parts)


def plan(loop) -> tuple[list[int], list[int]]:
  """(prompt lengths of one admission prefill each, long prompt lengths
  (one of two pieces: every long prompt takes the same programs)) that
  fit `loop` with one step to generate."""
  room = min(loop.capacity, loop.shape.max_len - loop.shape.start)
  short, width = [], 8
  while width <= min(loop.shape.piece, room):
    short.append(width // 2 + 1)  # prefilled `width` wide, room to generate
    width *= 2
  long_ = [loop.shape.piece + 1] if loop.shape.piece + 2 <= room else []
  return short, long_


def warm_up(loop) -> Report:
  """Runs `loop` (a `LiveSlots` with nothing in it) through every program
  its requests can take (module docstring); returns what it ran."""
  if loop.busy:
    raise ValueError("warm_up needs a loop with no request in it")
  start = time.perf_counter()
  before = _programs(loop)
  short, long_ = plan(loop)
  adapters = loop.shape.adapter_names[:1]
  constrained = _constraint(loop)
  count = 0
  cache = loop.prefix_cache
  with contextlib.ExitStack() as stack:
    counts = stack.enter_context(compile_cache.counting())
    if cache is not None:
      stack.callback(cache.clear)
    # The other lengths' prefills in a second thread (they read only the
    # weights and the shared prefix), while the rounds run the segment
    # programs with the shortest prompts.
    # On a pod every process must run the same programs in the same order
    # (they hold collectives): one thread there.
    threads = 2 if jax.process_count() == 1 else 0
    with concurrent.futures.ThreadPoolExecutor(max(threads, 1)) as pool:
      # The segment programs of the larger buckets load (or compile) in
      # their own thread while the smaller ones' rounds run.
      if threads:
        for compile_segment in reversed(_segment_compilers(loop)[1:]):
          pool.submit(compile_segment)
        prefills = pool.submit(_prefills, loop, short[1:])
      else:
        _prefills(loop, short[1:])
        prefills = None
      for variant in [None, *adapters]:
        for size in loop.buckets.sizes:
          batch = [
            _request(
              loop,
              short[0],
              constraint=constrained if j == size - 1 else None,
              adapter=variant if j == 0 else None,
            )
            for j in range(size)
          ]
          count += _run(loop, batch)
      if prefills is not None:
        prefills.result()
    # Each length's admission, alone, then two at once where prompts that
    # arrive together share a call (its row count's programs).
    paired = [
      n
      for n in short[1:]
      if len(admission.row_counts(prompt_bucket(n), loop.shape.admit_rows)) > 1
    ]
    for variant in [None, *adapters]:
      count += _run(loop, [_request(loop, n, adapter=variant) for n in short])
      for n in paired:
        count += _run(loop, [_request(loop, n, adapter=variant) for _ in "ab"])
    for length in long_:
      count += _run(loop, [_request(loop, length)])
    if cache is not None:
      widths, width = [], cache.page
      while width <= loop.capacity:
        widths.append(width)
        width *= 2
      _warm_heads(loop, widths)
  return Report(
    requests=count,
    programs=_programs(loop) - before,
    loaded=counts.hits,
    compiled=counts.misses,
    slot_buckets=loop.buckets.sizes,
    prompt_buckets=tuple(prompt_bucket(n) for n in short),
    pieces=tuple(long_),
    constrained=constrained is not None,
    adapters=bool(adapters),
    seconds=time.perf_counter() - start,
  )


def _segment_compilers(loop) -> list:
  """One callable per bucket size that compiles that size's segment
  program (or loads it from the persistent cache) without running it,
  safe to call from another thread: it reads the loop's state as it is
  now, abstractly (the loop's own `_run_args` make its other inputs)."""
  engine = loop.shape.generate_engine
  if not getattr(engine, "slot_rows", False):
    return []
  state = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
    loop._state,
  )
  out = []
  for size in loop.buckets.sizes:
    run = loop._run_args(np.arange(loop.slots) < size)
    rows = run["rows"]
    if rows is not None:
      rows = admission.replicated_like(loop._state, rows)
    out.append(
      functools.partial(
        engine.slot_run,
        loop.shape.caches,
        state,
        run["inputs"],
        jnp.int32(loop.every),
        jnp.bool_(True),
        adapters=run["adapters"],
        speculation=loop.speculation,
        rows=rows,
        compile_only=True,
      )
    )
  return out


def _warm_heads(loop, widths) -> None:
  """The write of a cached start of each of `widths` into a slot (its
  program; the prefix cache holds a page of the placeholders, the shape of
  every page), its writes dropped."""
  pages = loop.prefix_cache.pages()
  if pages:
    loop._state = admission.warm_heads(loop._state, pages[0].k, widths)


def _programs(loop) -> int:
  engines = {
    id(e): e for e in (loop.shape.prefill_engine, loop.shape.generate_engine)
  }
  return sum(map(compiled_programs, engines.values())) + (
    admission.admit_programs()
  )


def _prefills(loop, lengths) -> None:
  """The admission prefills of a prompt of each of `lengths`, as
  `admission.prefill_into` calls them (its length bucket wide, each row
  count it may take), their results dropped."""
  for n in lengths:
    width = prompt_bucket(n)
    for rows in admission.row_counts(width, loop.shape.admit_rows):
      tokens = np.full((rows, width), loop.shape.bos_id, np.int32)
      result = loop.shape.prefill_engine.prefill(
        loop.shape.caches,
        loop.shape.prev,
        Chunk(tokens=tokens, lengths=np.full(rows, n, np.int32)),
        top_n=loop.shape.admit_top_n,
        bos_id=loop.shape.bos_id,
        adapters=None,
      )
      jax.block_until_ready(result)


def _constraint(loop):
  """The placeholder constraint, if this loop's vocabulary spells it."""
  if loop.shape.vocabulary is None:
    return None
  try:
    loop.prepare(
      Request(
        tokens=[loop.shape.bos_id], sample_id=0, steps=4, constraint=_CONSTRAINT
      )
    )
  except ValueError:
    return None
  return _CONSTRAINT


_TOKENS = itertools.count()  # placeholders differ: none finds another's pages


def _request(loop, length: int, constraint=None, adapter=None) -> Request:
  steps = 2 if constraint is None else 4
  room = min(loop.capacity, loop.shape.max_len - loop.shape.start)
  while steps > 1 and columns_needed(length, steps) > room:
    steps -= 1
  token = 3 + next(_TOKENS) % max(loop.shape.vocab_size - 3, 1)
  return Request(
    tokens=[loop.shape.bos_id] + [token] * (length - 1),
    sample_id=length,
    steps=steps,
    sampling=Sampling(temperature=1.0, seed=0),
    constraint=constraint,
    adapter=adapter,
  )


def _run(loop, requests) -> int:
  """Runs `requests` at once to the end; how many ran."""
  keys = [("warm-up", k) for k in range(len(requests))]
  for key, r in zip(keys, requests, strict=True):
    loop.add(key, loop.prepare(r))
  while loop.busy:
    loop.step()
  return len(requests)
