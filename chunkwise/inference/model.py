"""`InferenceModel`: weights, vocabulary and compiled prefill / generate.

  model = InferenceModel.random(configs.get("tiny"), seed=0)
  few_shot = model.prefill(Chunk.tokenize(model.vocab, ["Q: 2+2? A: 4."],
                                          is_first_chunk=True))
  tasks = model.prefill(Chunk.tokenize(model.vocab, [" Q: 3+3? A:"]),
                        prefix=[few_shot], top_n=5)
  tokens, result = model.generate([few_shot, tasks], sample_ids=jnp.arange(4),
                                  steps=8, sampling=Sampling(temperature=0.7))
  for chunk, piece in model.generate_stream([few_shot, tasks],
                                            sample_ids=jnp.arange(4), steps=8,
                                            sampling=Sampling(), every=2):
    print(chunk.detokenize(model.vocab))

The model owns its compiled programs: one per phase, cached by input shapes
and static options (number of prefixes, top_n, steps) inside `jax.jit`.
Inputs are validated on the host before anything runs on the device.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise import constraints as constraints_lib
from chunkwise import memory
from chunkwise import processors as processors_lib
from chunkwise.configs import HParams
from chunkwise.inference import checks, generate, prefill
from chunkwise.inference.chunk import Chunk
from chunkwise.inference.forward import InferFn, transformer_infer
from chunkwise.inference.kv_cache import KVCache
from chunkwise.inference.results import ChunkResult, carried_logits
from chunkwise.inference.sampling import Sampling
from chunkwise.inference.sharded import ShardedEngine
from chunkwise.inference.vocabularies import (
  Vocabulary,
  bos_id_of,
  eos_id_of,
  random_model_vocab,
)
from chunkwise.models import Weights, check_shapes, fused, init_random
from chunkwise.partitioning import Layout, LayoutKind
from chunkwise.precision import resolve as resolve_precision
from chunkwise.precision import with_precision


class _ReferenceEngine:
  """The reference layout: plain jitted prefill / generate, no mesh."""

  def __init__(self, infer_fn: InferFn, weights, *, precision: str):
    self.weights = weights

    def traced(fn):
      return with_precision(functools.partial(fn, infer_fn), precision)

    self._prefill = jax.jit(
      traced(prefill.prefill), static_argnames=("top_n", "bos_id")
    )
    self._init = jax.jit(
      traced(generate.init),
      static_argnames=("batch", "steps", "top_n", "vocab", "bos_id"),
    )
    # The loop state is donated: segments of generate_stream reuse buffers.
    self._run = jax.jit(traced(generate.run), donate_argnames=("state",))

  def plain_weights(self):
    return self.weights

  def result_shardings(self, batch: int):
    """Where results live: JAX's default device."""
    del batch
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def prefill(self, caches, prev, chunk, *, top_n, bos_id):
    return self._prefill(
      self.weights, caches, prev, chunk, top_n=top_n, bos_id=bos_id
    )

  def init(self, caches, prev, **static):
    return self._init(self.weights, caches, prev, **static)

  def run(self, caches, state, inputs, stop_at):
    return self._run(self.weights, caches, state, inputs, stop_at)


class InferenceModel:
  """A model ready to prefill and generate.

  Args:
    hparams: the model's shapes.
    weights: a `Weights` pytree matching `hparams`.
    vocab: a tokenizer with seqio.Vocabulary's surface (optional).
    bos_id: BOS id; default: the vocabulary's, else 0.
    eos_id: stop token of `generate`; default: the vocabulary's, else none.
    mesh: a mesh with axes ("x", "y", "z") (`partitioning.make_mesh`), or
      None: JAX's default device.
    layout: a `Layout` or its string ("ws_2d/yz"); None is the reference
      layout (replicated). `prefill_layout` / `generate_layout` override it
      per phase (e.g. a weight-gathered prefill feeding a ws_2d generate);
      results made in one layout are resharded for the other.
    cache_dtype: dtype of KV caches (f32 or bf16).
    compute_dtype: dtype of the residual stream (f32 or bf16); attention
      softmax, norms and logits are always computed in f32.
    precision: of every matmul and einsum, "highest", "high" or "default"
      (`chunkwise.precision`); None: "highest" for f32 compute (scores
      match the CPU's on GPUs, whose default f32 matmul is TF32),
      "default" for bf16.
    infer_fn: replaces the Transformer forward pass (tests drive the loop
      machinery with hand-computable toy models through it).

  A first chunk starts with `bos_id`: when it differs from the vocabulary's
  (or the vocabulary has none and it is not 0), pass it to
  `Chunk.tokenize(..., bos_id=model.bos_id)`.
  """

  def __init__(
    self,
    hparams: HParams,
    weights,
    vocab: Vocabulary | None = None,
    *,
    bos_id: int | None = None,
    eos_id: int | None = None,
    mesh=None,
    layout=None,
    prefill_layout=None,
    generate_layout=None,
    cache_dtype=jnp.float32,
    compute_dtype=jnp.float32,
    precision: str | None = None,
    infer_fn: InferFn | None = None,
  ):
    if not isinstance(hparams, HParams):
      raise ValueError(f"hparams must be an HParams, got {hparams!r}")
    self._precision = resolve_precision(precision, compute_dtype)
    phases = checks.check_placement(
      mesh, layout, prefill_layout, generate_layout, hparams
    )
    sharded_phases = [p for p in phases if p.kind is not LayoutKind.REFERENCE]
    if infer_fn is not None and sharded_phases:
      raise ValueError(
        f"infer_fn replaces the reference forward pass only; layouts "
        f"{[str(p) for p in sharded_phases]} need the Transformer's"
      )
    shuffled = isinstance(weights, fused.ShuffledWeights)
    if shuffled and len(sharded_phases) < len(phases):
      raise ValueError(
        f"weights shuffled for {weights.tag} cannot run the reference "
        "layout, which needs plain weights"
      )
    if infer_fn is None:
      check_shapes(
        hparams,
        jax.eval_shape(fused.joined, weights.weights) if shuffled else weights,
      )
      infer_fn = functools.partial(
        transformer_infer,
        hparams,
        cache_dtype=cache_dtype,
        compute_dtype=compute_dtype,
      )
    self._cache_dtype = jnp.dtype(cache_dtype)
    self._hparams = hparams
    self._vocab = vocab
    self._bos_id = bos_id_of(vocab) if bos_id is None else int(bos_id)
    self._eos_id = eos_id_of(vocab) if eos_id is None else int(eos_id)
    for name, value in (("bos_id", self._bos_id), ("eos_id", self._eos_id)):
      if value is not None and not 0 <= value < hparams.vocab:
        raise ValueError(
          f"{name}={value} is outside the model's vocabulary "
          f"[0, {hparams.vocab})"
        )
    self._mesh = mesh
    self._layouts = phases
    engines: dict = {}
    for lay in phases:
      if lay in engines:
        continue
      if lay.kind is LayoutKind.REFERENCE:
        engines[lay] = _ReferenceEngine(
          infer_fn, weights, precision=self._precision
        )
      else:  # weights already placed by another layout are reused
        placed = [
          e.weights
          for e in engines.values()
          if not isinstance(e.weights, fused.ShuffledWeights)
          or e.weights.tag == _shuffle_tag(lay, mesh)
        ]
        engines[lay] = ShardedEngine(
          hparams,
          placed[0] if placed else weights,
          mesh,
          lay,
          cache_dtype=cache_dtype,
          compute_dtype=compute_dtype,
          precision=self._precision,
        )
    self._prefill_engine = engines[phases[0]]
    self._generate_engine = engines[phases[1]]

  @classmethod
  def random(
    cls,
    hparams: HParams,
    seed: int = 0,
    mesh=None,
    layout=None,
    *,
    vocab: Vocabulary | None = None,
    dtype=jnp.float32,
    **kwargs,
  ) -> InferenceModel:
    """Random weights of `dtype` (see `models.init_random`). Without `vocab`,
    models whose vocabulary holds 259 ids get a `ByteVocabulary`; other
    keyword arguments go to the constructor. Raises ValueError, before
    drawing anything, when the weights would not fit on the device."""
    memory.check_random_weights(hparams.num_params(), dtype)
    weights = init_random(hparams, jax.random.key(seed), dtype)
    if vocab is None:
      vocab = random_model_vocab(hparams.vocab)
    return cls(hparams, weights, vocab, mesh=mesh, layout=layout, **kwargs)

  @property
  def hparams(self) -> HParams:
    return self._hparams

  @property
  def weights(self) -> Weights:
    """The weights (as placed for prefill: `ShuffledWeights` when its
    layout's collective matmuls read reordered blocks)."""
    return self._prefill_engine.weights

  def plain_weights(self) -> Weights:
    """The weights in plain block order, as placed for prefill (shuffled
    weights are reordered back on the mesh, e.g. to save them)."""
    return self._prefill_engine.plain_weights()

  def result_shardings(self, batch: int):
    """The sharding (one, or a ChunkResult tree of them) that `prefill` of
    `batch` rows gives its result: where a saved prefix is restored."""
    return self._prefill_engine.result_shardings(batch)

  @property
  def precision(self) -> str:
    """Of every matmul and einsum ("highest", "high" or "default")."""
    return self._precision

  @property
  def cache_dtype(self):
    """The KV caches' dtype."""
    return self._cache_dtype

  @property
  def vocab(self) -> Vocabulary | None:
    return self._vocab

  @property
  def mesh(self):
    """The device mesh (None: JAX's default device)."""
    return self._mesh

  @property
  def layout(self) -> Layout:
    """The layout of both phases (the generate layout when they differ)."""
    return self._layouts[1]

  @property
  def prefill_layout(self) -> Layout:
    return self._layouts[0]

  @property
  def generate_layout(self) -> Layout:
    return self._layouts[1]

  @property
  def bos_id(self) -> int:
    return self._bos_id

  @property
  def eos_id(self) -> int | None:
    return self._eos_id

  def _prefix_inputs(self, prefix: Sequence[ChunkResult]):
    caches = tuple(p.kv_cache for p in prefix)
    prev = prefix[-1].next_token_logits if prefix else None
    return caches, prev

  def prefill(
    self, chunk: Chunk, prefix: Sequence[ChunkResult] = (), top_n: int = 0
  ) -> ChunkResult:
    """Runs `chunk` after `prefix` and scores each of its tokens.

    Args:
      chunk: the tokens; a first chunk starts with BOS.
      prefix: earlier results of the same sequences, oldest first; batch
        sizes must divide each other and the chunk's batch.
      top_n: how many most likely alternatives to return per position.
    Returns:
      A ChunkResult usable as a prefix of later calls. A chunk of zero
      columns (e.g. one half of `split_at(0)`) runs nothing: its result only
      carries the next-token logits over.
    """
    h = self._hparams
    chunk = checks.check_chunk(chunk, h)
    prefix = checks.check_prefix(prefix, chunk.batch, h)
    top_n = checks.check_count("top_n", top_n, minimum=0, maximum=h.vocab)
    checks.check_total_length(
      prefix, chunk.batch, np.asarray(chunk.lengths), h, "the chunk"
    )
    caches, prev = self._prefix_inputs(prefix)
    if chunk.time == 0:
      return self._empty_result(prev, chunk.batch, top_n)
    return self._prefill_engine.prefill(
      caches, prev, chunk, top_n=top_n, bos_id=self._bos_id
    )

  def _empty_result(self, prev_logits, batch: int, top_n: int) -> ChunkResult:
    h = self._hparams
    kv_shape = (h.layers, batch, 0, h.kv_heads, h.head_dim)
    return ChunkResult(
      per_token_scores=jnp.zeros((batch, 0), jnp.float32),
      top_ids=jnp.zeros((batch, 0, top_n), jnp.int32),
      top_logprobs=jnp.zeros((batch, 0, top_n), jnp.float32),
      next_token_logits=carried_logits(
        prev_logits, batch, vocab=h.vocab, bos_id=self._bos_id
      ),
      kv_cache=KVCache(
        k=jnp.zeros(kv_shape, self._cache_dtype),
        v=jnp.zeros(kv_shape, self._cache_dtype),
        lengths=jnp.zeros((batch,), jnp.int32),
      ),
    )

  def _start(
    self,
    prefix,
    sample_ids,
    steps,
    sampling,
    stop_ids,
    top_n,
    processors=(),
    constraint=None,
    budget_forcing=False,
  ):
    """Validates a generate call (constraints compiled, processors traced)
    before any device work; returns (caches, state, loop inputs)."""
    h = self._hparams
    sample_ids = checks.check_ids("sample_ids", sample_ids, h, vocab=False)
    batch = sample_ids.shape[0]
    if batch == 0:
      raise ValueError("sample_ids is empty: generate needs at least one row")
    steps = checks.check_count("steps", steps, minimum=1)
    top_n = checks.check_count("top_n", top_n, minimum=0, maximum=h.vocab)
    prefix = checks.check_prefix(prefix, batch, h)
    if sampling is None:
      sampling = Sampling()
    if not isinstance(sampling, Sampling):
      raise ValueError(
        f"sampling must be a chunkwise Sampling, got {sampling!r}"
      )
    sampling = sampling.for_batch(batch)
    stop = checks.check_ids("stop_ids", stop_ids, h, vocab=True)
    if self._eos_id is not None:
      stop = np.unique(np.append(stop, self._eos_id)).astype(np.int32)
    checks.check_total_length(prefix, batch, steps, h, f"{steps} steps")
    procs = self._processors(
      processors, constraint, budget_forcing, batch, steps, stop, prefix
    )
    procs, proc_states = processors_lib.check(
      procs, batch=batch, vocab=h.vocab, n_stop=stop.shape[0]
    )
    caches, prev = self._prefix_inputs(prefix)
    state = self._generate_engine.init(
      caches,
      prev,
      batch=batch,
      steps=steps,
      top_n=top_n,
      vocab=h.vocab,
      bos_id=self._bos_id,
    )
    state = state.replace(
      processor_states=jax.tree.map(jnp.asarray, proc_states)
    )
    inputs = generate.loop_inputs(caches, sample_ids, sampling, stop, procs)
    return caches, state, inputs

  def _processors(
    self, processors, constraint, budget_forcing, batch, steps, stop, prefix
  ):
    """The call's processors, the constraint's (compiled) last."""
    if isinstance(processors, processors_lib.LogitsProcessor):
      processors = (processors,)
    if isinstance(processors, (str, bytes)) or not isinstance(
      processors, Sequence
    ):
      raise ValueError(
        f"processors must be a list of chunkwise LogitsProcessors, got "
        f"{processors!r}"
      )
    procs = list(processors)
    if constraint is None:
      if budget_forcing:
        raise ValueError("budget_forcing=True needs a constraint")
      return procs
    width = self._hparams.vocab
    grammar, tables = constraints_lib.compile_rows(
      constraint,
      batch=batch,
      vocabulary=self._vocab,
      stop_ids=stop.tolist(),
      width=width,
    )
    if budget_forcing:
      # A row without prefix spends its first column on BOS.
      room = steps - (0 if prefix else 1)
      for t in tables:
        if int(t.distance[0]) + 1 > room:
          raise ValueError(
            f"budget_forcing: steps={steps} is too few for the constraint "
            f"{t.regex[:60]!r}, whose shortest match needs "
            f"{int(t.distance[0])} tokens and a stop ({room} columns left)"
          )
    procs.append(
      constraints_lib.processor(
        grammar, tables, width=width, force=budget_forcing
      )
    )
    return procs

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
    Returns:
      (Chunk of the generated tokens, its ChunkResult); a row stops at its
      first stop id, which is written after the row's last token but not
      counted in its length. The result is a valid prefix for later calls.
      Scores and top-n are always those of the raw logits, whatever the
      processors and constraints did (DESIGN.md §4.1).
    """
    caches, state, inputs = self._start(
      prefix,
      sample_ids,
      steps,
      sampling,
      stop_ids,
      top_n,
      processors,
      constraint,
      budget_forcing,
    )
    state = self._generate_engine.run(caches, state, inputs, jnp.int32(steps))
    return generate.finish(state)

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
  ) -> Iterator[tuple[Chunk, ChunkResult]]:
    """Like `generate`, yielding (Chunk, ChunkResult) segments of `every`
    steps (the last may be shorter) as they are produced; their
    concatenation equals what `generate` returns, column for column. Once
    every row has stopped, nothing more runs: the remaining segments are
    empty (all lengths 0). Each segment is a valid prefix for later calls."""
    every = checks.check_count("every", every, minimum=1)
    caches, state, inputs = self._start(
      prefix,
      sample_ids,
      steps,
      sampling,
      stop_ids,
      top_n,
      processors,
      constraint,
      budget_forcing,
    )
    return self._stream(caches, state, inputs, steps, every)

  def _stream(self, caches, state, inputs, steps, every):
    done = False
    for begin in range(0, steps, every):
      end = min(begin + every, steps)
      if not done:
        state = self._generate_engine.run(caches, state, inputs, jnp.int32(end))
        done = bool(jnp.all(state.done))
      # Once every row has stopped, the remaining (empty) segments are cut
      # from the final state without running anything.
      yield generate.segment(state, begin, end)


def _shuffle_tag(layout: Layout, mesh) -> str:
  """The `ShuffledWeights.tag` that `layout` on `mesh` reads."""
  sizes = tuple((a, int(mesh.shape[a])) for a in mesh.axis_names)
  return fused.tag(layout.kind, layout.collectives, sizes)
