"""`InferenceModel`: validates each call on the host, then hands it to the
engine of its phase (`engine.py`), which owns the compiled programs. What
a model is made of (its settings resolved at construction, its engines,
properties and variants) and the checks its calls share are in
`model_setup.py`; here are the calls.

  model = InferenceModel.random(configs.get("tiny"), seed=0)
  few_shot = model.prefill(Chunk.tokenize(model.vocab, ["Q: 2+2? A: 4."],
                                          is_first_chunk=True))
  tasks = model.prefill(Chunk.tokenize(model.vocab, [" Q: 3+3? A:"]),
                        prefix=[few_shot], top_n=5)
  tokens, result = model.generate([few_shot, tasks], sample_ids=range(4),
                                  steps=8, sampling=Sampling(temperature=0.7))
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise import numerics as numerics_lib
from chunkwise import processors as processors_lib
from chunkwise.inference import checks, long_prefill
from chunkwise.inference import speculation as speculation_lib
from chunkwise.inference.adapters import tagged
from chunkwise.inference.batching import admission, continuous, live
from chunkwise.inference.batching.buckets import Buckets
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.engines.engine import (
  compiled_programs,
  finished,
  prefix_inputs,
  stream,
)
from chunkwise.inference.model_setup import ModelSetup
from chunkwise.inference.paging import prefix_cache
from chunkwise.inference.results import ChunkResult
from chunkwise.inference.sampling import Sampling
from chunkwise.inference.speculation import Speculation
from chunkwise.inference.speculation.calibration import Calibration


class InferenceModel(ModelSetup):
  """A model ready to prefill and generate.

  Args:
    hparams: the model's shapes.
    weights: a `Weights` pytree matching `hparams`.
    vocab: a tokenizer with seqio.Vocabulary's surface (optional).
    bos_id: BOS id; default: the vocabulary's, else 0.
    eos_id: stop token of `generate`; default: the vocabulary's, else none.
    eos_ids: every stop token of `generate` (e.g. Llama 3 instruct's
      <|end_of_text|> and <|eot_id|>), the first being `eos_id`; default:
      (eos_id,) if given, else the vocabulary's `eos_ids` / `eos_id`.
    mesh: a mesh with axes ("x", "y", "z") (`partitioning.make_mesh`), or
      None: JAX's default device.
    layout: a `Layout` or its string ("ws_2d/yz"); None is the reference
      layout (replicated). `prefill_layout` / `generate_layout` override it
      per phase (e.g. a weight-gathered prefill feeding a ws_2d generate);
      results made in one layout are resharded for the other. "auto" (for
      either) asks `chunkwise.planner` for the fastest layouts on `mesh`
      for `workload`; the choice is logged and kept in `layout_choice`.
    workload: a `planner.Workload` (rows per call, prompt and generated
      tokens) that "auto" plans for; None: `planner.Workload()`.
    kv_dtype: how K/V caches are stored: "float32", "bfloat16" or "int8"
      (values with an f32 scale per token and head, `models.kv_int8`: a
      quarter of f32's bytes plus 4 per head, read by every attention
      path; the chunk's own keys and values are read as stored too).
      None: `cache_dtype`.
    cache_dtype: the older name of `kv_dtype` (f32 by default).
    compute_dtype: dtype of the residual stream (f32 or bf16); attention
      softmax, norms and logits are always computed in f32.
    precision: of every matmul and einsum, "highest", "high" or "default"
      (`chunkwise.precision`); None: "highest" for f32 compute (scores
      match the CPU's on GPUs, whose default f32 matmul is TF32),
      "default" for bf16.
    numerics: "invariant" (on the CPU a row's logits, scores and tokens
      are bit-identical whatever else is in its batch and however its
      context was cut into chunks), "q8" (invariant too, int8 and GGUF
      block weights' activations rounded to 8 bits: llama.cpp's speed
      and quality) or "fast" (XLA's own reduction orders); None:
      "invariant" for float weights, "fast" for int8 weights and on a CPU
      whose kernels have no vector path. See `chunkwise.numerics`.
    infer_fn: replaces the Transformer forward pass (tests drive the loop
      machinery with hand-computable toy models through it).
    prefill_chunk: a chunk longer than this many columns is prefilled in
      pieces of that many (`long_prefill`: the same result, its logits
      bounded), and in `generate_many` and `live_slots` such a prompt is
      prefilled one piece per segment while the other slots decode; None:
      `long_prefill.columns` for `prefill` (1024 to 4096 columns by
      vocabulary and rows), `long_prefill.SLOT_COLUMNS` (512) in the slot
      loops, where a piece's time bounds the others' inter-token latency.

  A first chunk starts with `bos_id`: when it differs from the vocabulary's
  (or the vocabulary has none and it is not 0), pass it to
  `Chunk.tokenize(..., bos_id=model.bos_id)`.
  """

  def prefill(
    self,
    chunk: Chunk,
    prefix: Sequence[ChunkResult] = (),
    top_n: int = 0,
    adapters=None,
    *,
    scores: bool = True,
  ) -> ChunkResult:
    """Runs `chunk` after `prefix` and scores each of its tokens.

    Args:
      chunk: the tokens; a first chunk starts with BOS.
      prefix: earlier results of the same sequences, oldest first; batch
        sizes must divide each other and the chunk's batch.
      top_n: how many most likely alternatives to return per position.
      adapters: the LoRA adapter of every row (a name), or of each row (a
        name or None), or None: the base model (`with_adapters`).
      scores: False skips the scores: only the KV cache and next-token
        logits are computed (the logits of one position a row, not of
        every position: a prompt before `generate`, whose scores nobody
        reads, is then prefilled faster); `per_token_scores` are NaN and
        `top_n` must be 0.
    Returns:
      A ChunkResult usable as a prefix of later calls (by rows of the same
      adapters). A chunk of zero columns (e.g. one half of `split_at(0)`)
      runs nothing: its result only carries the next-token logits over.
    """
    h = self._hparams
    chunk, prefix, top_n = checks.check_prefill(h, chunk, prefix, top_n)
    if not isinstance(scores, bool | np.bool_):
      raise TypeError(f"scores={scores!r} must be True or False")
    if not scores and top_n:
      raise ValueError(
        f"top_n={top_n} asks for alternatives of every position's "
        "distribution; scores=False computes none (top_n must be 0)"
      )
    names, ids = self._rows(adapters, chunk.batch, prefix)
    caches, prev = prefix_inputs(prefix)
    if chunk.time == 0:
      result = ChunkResult.empty(
        h,
        prev,
        batch=chunk.batch,
        top_n=top_n,
        cache_dtype=self._cache_dtype,
        bos_id=self._bos_id,
      )
      return tagged(result, names)
    engine = self._prefill_engine
    run = functools.partial(
      engine.prefill,
      top_n=top_n,
      bos_id=self._bos_id,
      scores=bool(scores),
      adapters=self._adapters_for(engine, ids),
    )
    width = self._prefill_chunk or long_prefill.columns(h, chunk.batch)
    if chunk.time > width:  # in pieces: bounded logits, the same result
      result = long_prefill.prefill(run, caches, prev, chunk, width=width)
    else:
      result = run(caches, prev, chunk)
    return tagged(result, names)

  def compile_prefill(self, time: int, *, top_n: int = 0) -> None:
    """Compiles (or loads from JAX's persistent cache) what `prefill` of
    one row of `time` columns with `top_n` and no prefix runs, without
    running it; a chunk longer than the prefill's pieces is prefilled once
    on zeros instead (its pieces are several programs). A server's
    warm-up."""
    h = self._hparams
    chunk = Chunk(
      tokens=np.zeros((1, time), np.int32), lengths=np.int32([time])
    )
    if time > (self._prefill_chunk or long_prefill.columns(h, 1)):
      self.prefill(chunk, top_n=top_n)
      return
    self._prefill_engine.prefill(
      (), None, chunk, top_n=top_n, bos_id=self._bos_id, compile_only=True
    )

  def generate(
    self,
    prefix: Sequence[ChunkResult] = (),
    *,
    sample_ids,
    steps: int,
    sampling: Sampling | None = None,
    stop_ids: Sequence[int] = (),
    top_n: int = 0,
    processors: Sequence[processors_lib.LogitsProcessor] = (),
    constraint=None,
    budget_forcing: bool = False,
    adapters=None,
    speculation: Speculation | None = None,
  ) -> tuple[Chunk, ChunkResult]:
    """Samples up to `steps` tokens per row after `prefix`.

    Args:
      prefix: ChunkResults to continue, oldest first (empty: start at BOS).
      sample_ids: int[batch], one id per row; with the seed and a token's
        position it fixes the token's randomness (DESIGN.md §4.5).
      steps: most tokens to generate per row.
      sampling: temperature (0: greedy), top_k, top_p, min_p, seed;
        default `Sampling()` (temperature 1, no filters, seed 0).
      stop_ids: ids that end a row, besides the model's EOS.
      top_n: alternatives to return per generated position.
      processors: `chunkwise.processors` LogitsProcessors applied in order
        to the raw logits before sampling (bans, bias, penalties, ...).
      constraint: a `chunkwise.constraints` Regex / JsonSchema / Choice for
        every row, or a list of one (or None: free) per row. Constrained
        rows draw only tokens that keep their text a prefix of a match,
        and a stop id only once the text matches; a row whose automaton
        allows only a stop stops.
      budget_forcing: close every constrained row within `steps` (output
        steers to the shortest completion as columns run out).
      adapters: the LoRA adapter of every row or of each row (see
        `prefill`); None: the base model.
      speculation: a `cw.Speculation`: draft tokens and verify them in one
        pass (`inference/speculation/settings.py`). The tokens, scores and top-n
        are those of the call without it (bit for bit under invariant
        numerics); `result.speculation` has the counts.
    Returns:
      (Chunk of the generated tokens, its ChunkResult); a row stops at its
      first stop id, which is written after the row's last token but not
      counted in its length. The result is a valid prefix for later calls.
      Scores and top-n are always those of the raw logits, whatever the
      processors and constraints did (DESIGN.md §4.1).
    """
    caches, state, inputs, on, names, spec = self._start(prefix, locals())
    engine = self._generate_engine

    def run(state):
      return engine.run(
        caches, state, inputs, jnp.int32(steps), adapters=on, speculation=spec
      )

    if spec is None:
      state = run(state)
    else:
      rows = state.tokens.shape[0]
      calibration = self._calibrations.setdefault(
        (spec, rows), Calibration(spec, rows)
      )
      state = calibration.run(state, run, lambda: compiled_programs(engine))
    tokens, result = finished(state, 0, steps)
    return tokens, tagged(result, names)

  def live_slots(
    self,
    *,
    slots: int,
    capacity: int,
    top_n: int = 0,
    every: int = 8,
    processors: Sequence[processors_lib.LogitsProcessor] = (),
    prefix: Sequence[ChunkResult] = (),
    stop_width: int = live.STOP_WIDTH,
    speculation: Speculation | None = None,
    prefix_cache_bytes: int = 0,
    kv_pages: int = 0,
    budget_forcing: bool = False,
    slot_buckets: Sequence[int] | None = None,
    background_hits: bool = False,
  ) -> live.LiveSlots:
    """An always-on continuous-batching loop (`inference/batching/live.py`): add
    requests at any time, `step` it, get each request's tokens as they are
    produced. Each request's tokens and scores are those of `generate` run
    alone on it.

    Args:
      slots: rows decoded side by side (a multiple of the layout's
        attention batch split on a mesh).
      capacity: columns of each slot (prompt padded to a power of two, at
        least 8, plus steps); at most `max_len`.
      top_n: alternatives computed per generated token (requests read the
        first n they want).
      every: most decode steps per `step` (a request that finishes ends a
        step early).
      processors: run for every request; each may bring its own instances
        (e.g. its penalties) to `prepare`.
      prefix: ChunkResults of batch 1 every request continues.
      stop_width: most stop ids (EOS included) of one request.
      speculation: a `cw.Speculation` (without `context`): each request
        drafts from its prompt and tokens; finished requests' updates
        carry their counts, `speculation_totals` all of them.
      prefix_cache_bytes: keep up to this many bytes of K/V of prompts'
        full pages (`inference/paging/prefix_cache.py`): a request prefills only
        what follows its longest cached start (0: no cache). Its counts
        are the loop's `prefix_cache.stats`.
      kv_pages: the slots share one pool of this many K/V pages (as in
        `generate_many`; one device): `slots` may then exceed what fixed
        rows of `capacity` columns would fit. The loop's `pages` and
        `preempted` show its use. Under invariant numerics a request
        that outgrows the pool is preempted and rerun (it reports only
        new tokens: the rerun's are the same); elsewhere a rerun could
        differ from tokens already reported, so a request is admitted
        only once pages for all of its steps fit. 0: fixed slots.
      budget_forcing: every constrained request closes its match within
        its own steps (as `generate_many`'s; a request whose steps cannot
        hold its constraint's shortest match and a stop is refused by
        `prepare`).
      slot_buckets: the row counts a segment may run (`batching/
        buckets.py`): each runs the smallest that holds the running
        requests, so a step costs them, not `slots`. None: powers of two
        up to `slots` (one device; a sharded loop runs every slot).
      background_hits: a prefix-cache hit whose prefill program (one per
        pair of widths: the cached start's, the rest's) has not run yet is
        admitted as a miss, the same tokens, while a background thread
        compiles it (`batching/heads.py`); False: it compiles when the hit
        comes. The schedule then depends on timing, so one process only.
    """
    if background_hits and jax.process_count() > 1:
      raise ValueError(
        "background_hits=True makes the schedule depend on timing: it "
        "needs one process, not "
        f"{jax.process_count()}"
      )
    cache = prefix_cache.make(prefix_cache_bytes)
    n, capacity, top_n, every, stop_width, processors, prefix = (
      checks.check_live(
        self._hparams,
        slots_n=slots,
        capacity=capacity,
        top_n=top_n,
        every=every,
        stop_width=stop_width,
        processors=processors,
        prefix=prefix,
        batch_split=self._batch_split(),
      )
    )
    kv_pages = self._check_pages(kv_pages, capacity, speculation)
    speculation = self._drafting(speculation_lib.for_requests(speculation))
    invariant = numerics_lib.rows_invariant(self._numerics)
    return live.LiveSlots(
      speculation=speculation,
      hparams=self._hparams,
      prefill_engine=self._prefill_engine,
      generate_engine=self._generate_engine,
      vocabulary=self._vocab,
      eos_ids=self._eos_ids,
      bos_id=self._bos_id,
      served=self._served,
      slots_n=n,
      capacity=capacity,
      top_n=top_n,
      every=every,
      processors=processors,
      prefix=prefix,
      stop_width=stop_width,
      piece=self._prefill_chunk,
      prefix_cache=cache,
      kv_pages=kv_pages,
      budget_forcing=bool(budget_forcing),
      # A preempted request reruns to the same tokens only where every sum
      # is fixed whatever the batch and pages: invariant numerics (CPU).
      preempt=invariant,
      # Short prompts arriving together share an admission prefill only
      # there too: elsewhere a prompt's K/V could depend on its neighbours.
      admit_rows=(1, admission.admit_rows(n)) if invariant else (1,),
      slot_buckets=slot_buckets,
      background_hits=bool(background_hits),
    )

  def generate_many(
    self,
    requests: Sequence[continuous.Request],
    *,
    slots: int,
    prefix: Sequence[ChunkResult] = (),
    top_n: int = 0,
    processors: Sequence[processors_lib.LogitsProcessor] = (),
    budget_forcing: bool = False,
    every: int = 64,
    capacity: int | None = None,
    progress: bool = False,
    trace=None,
    speculation: Speculation | None = None,
    prefix_cache_bytes: int = 0,
    kv_pages: int = 0,
    slot_buckets: Sequence[int] | None = None,
  ) -> Iterator[continuous.RequestResult]:
    """Generates every request through `slots` rows (continuous batching):
    a finished row's slot takes the next waiting request.

    Args:
      requests: `cw.Request`s (prompt continuing `prefix`, sample id,
        steps, sampling, stop ids, constraint).
      slots: rows decoded side by side (a multiple of the layout's
        attention batch split on a mesh).
      prefix: ChunkResults of batch 1 that every request continues, read
        in place by every slot (e.g. a few-shot prompt).
      top_n: alternatives to return per generated position.
      processors: applied to every request (their state restarts with
        each request).
      budget_forcing: close every constrained request within its steps.
      every: most decode steps between two looks from the host (a slot
        that finishes also ends the run early).
      capacity: columns of each slot's K/V and result buffers: at least
        any request's prompt (padded to a power of two, at least 8) plus
        its steps. Default: what the longest request needs, rounded up to
        a multiple of 64; programs compile once per capacity.
      progress: show a progress bar (process 0).
      trace: for benchmarks, a callable told ("first_token", request
        indices) when their first tokens have been computed.
      speculation: a `cw.Speculation` (without `context`: each request
        drafts from its own prompt and tokens); each result's
        `speculation` has its counts.
      prefix_cache_bytes: keep up to this many bytes of K/V of the
        requests' full prompt pages during the call: a request prefills
        only what follows its longest start cached by an earlier one
        (`inference/paging/prefix_cache.py`; 0: none).
      kv_pages: hold the slots' K/V in one pool of this many pages of
        `paged_kv.PAGE` columns (paged K/V, one device) instead of
        `capacity` columns per slot: requests are admitted as their pages
        fit, so more slots share the same memory; a request that runs out
        is preempted and run again later (the same result under
        invariant numerics). 0: fixed slots.
      slot_buckets: the row counts a segment may run, the smallest that
        holds the running requests (`batching/buckets.py`; None: powers
        of two up to `slots`): as the last requests finish, a step costs
        the rows still running.
    Yields:
      `cw.RequestResult`s as requests finish. Each equals what `generate`
      gives for that request alone (DESIGN.md §4): same tokens, same
      scores up to float rounding. Everything is validated before any
      device work (ValueError names the request).
    """
    split = self._batch_split()
    call, prefix, slots, top_n = continuous.check_many(
      self._hparams,
      requests,
      slots_n=slots,
      prefix=prefix,
      top_n=top_n,
      processors=processors,
      budget_forcing=budget_forcing,
      eos_ids=self._eos_ids,
      vocabulary=self._vocab,
      batch_split=split,
      capacity=capacity,
      adapter_names=() if self._served is None else self._served.names,
    )
    every = checks.check_count("every", every, minimum=1)
    kv_pages = self._check_pages(kv_pages, call.capacity, speculation)
    buckets = Buckets(slots, slot_buckets, self._generate_engine)
    cache = prefix_cache.make(prefix_cache_bytes)
    speculation = self._drafting(speculation_lib.for_requests(speculation))
    return continuous.run_many(
      call,
      prefix,
      prefill_engine=self._prefill_engine,
      generate_engine=self._generate_engine,
      hparams=self._hparams,
      slots_n=slots,
      top_n=top_n,
      bos_id=self._bos_id,
      every=every,
      progress=progress,
      trace=trace,
      served=self._served,
      speculation=speculation,
      piece=self._prefill_chunk,
      cache=cache,
      pages=kv_pages,
      buckets=buckets,
    )

  def generate_stream(
    self,
    prefix: Sequence[ChunkResult] = (),
    *,
    sample_ids,
    steps: int,
    sampling: Sampling | None = None,
    stop_ids: Sequence[int] = (),
    every: int = 8,
    top_n: int = 0,
    processors: Sequence[processors_lib.LogitsProcessor] = (),
    constraint=None,
    budget_forcing: bool = False,
    adapters=None,
    speculation: Speculation | None = None,
  ) -> Iterator[tuple[Chunk, ChunkResult]]:
    """Like `generate`, yielding (Chunk, ChunkResult) segments of `every`
    steps (the last may be shorter) as they are produced; their
    concatenation equals what `generate` returns, column for column. Once
    every row has stopped, nothing more runs: the remaining segments are
    empty (all lengths 0). Each segment is a valid prefix for later calls."""
    every = checks.check_count("every", every, minimum=1)
    caches, state, inputs, on, names, spec = self._start(prefix, locals())
    segments = stream(
      self._generate_engine,
      caches,
      state,
      inputs,
      steps,
      every,
      adapters=on,
      speculation=spec,
    )
    return ((tokens, tagged(r, names)) for tokens, r in segments)
