"""What an `InferenceModel` is made of, and the checks of its calls.

`ModelSetup`, the base of `InferenceModel` (`model.py`, whose docstring
has the constructor's arguments), resolves and checks what the
constructor is given: K/V and compute dtypes, matmul precision, numerics,
the layouts of both phases (planned by `chunkwise.planner` when "auto")
and their placement on the mesh, BOS and EOS ids; then it places the
weights in the engines (`engine.py`). It keeps the read-only properties
over all of that, the variants sharing its engines (`with_adapters`,
`with_prefill_chunk`), and what every call checks against the model
before any device work: each row's adapter, the drafter, a generate
call's start, the rows a mesh splits slots into, the pages of paged K/V.
`model.py` holds the calls themselves.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Self

import jax
import jax.numpy as jnp
import numpy as np

from chunkwise import memory
from chunkwise import numerics as numerics_lib
from chunkwise.configs import HParams
from chunkwise.inference import checks, long_prefill
from chunkwise.inference import speculation as speculation_lib
from chunkwise.inference.adapters import AdapterSet, check_prefix, rows_of
from chunkwise.inference.engines.engine import make_engines, start_loop
from chunkwise.inference.infer import InferFn
from chunkwise.inference.paging import paged_kv
from chunkwise.inference.results import ChunkResult
from chunkwise.inference.speculation import Speculation
from chunkwise.inference.vocabularies import (
  Vocabulary,
  random_model_vocab,
  special_ids,
)
from chunkwise.models import Weights, init_random, kv_int8
from chunkwise.partitioning import Layout
from chunkwise.partitioning.placement import check_placement
from chunkwise.planner import choice as planner_choice
from chunkwise.precision import resolve as resolve_precision


class ModelSetup:
  """An `InferenceModel`'s parts and settings (module docstring); its
  constructor takes `InferenceModel`'s arguments."""

  def __init__(
    self,
    hparams: HParams,
    weights,
    vocab: Vocabulary | None = None,
    *,
    bos_id: int | None = None,
    eos_id: int | None = None,
    eos_ids: Sequence[int] | None = None,
    mesh=None,
    layout=None,
    prefill_layout=None,
    generate_layout=None,
    kv_dtype=None,
    cache_dtype=None,
    compute_dtype=jnp.float32,
    precision: str | None = None,
    infer_fn: InferFn | None = None,
    workload=None,
    numerics: str | None = None,
    prefill_chunk: int | None = None,
  ):
    if not isinstance(hparams, HParams):
      raise ValueError(f"hparams must be an HParams, got {hparams!r}")
    self._prefill_chunk = long_prefill.check_columns(prefill_chunk)
    cache_dtype = kv_int8.resolve(kv_dtype, cache_dtype)
    if infer_fn is not None and kv_int8.is_int8(cache_dtype):
      raise ValueError(
        "kv_dtype='int8' needs the Transformer's own forward pass (its "
        "attention reads the packed K/V); a custom infer_fn stores floats"
      )
    self._precision = resolve_precision(precision, compute_dtype)
    self._numerics = numerics_lib.resolve(
      numerics, planner_choice.weights_name(weights) == "int8"
    )
    layout, prefill_layout, generate_layout, self._choice = (
      planner_choice.resolve(
        hparams,
        mesh,
        layout,
        prefill_layout,
        generate_layout,
        workload=workload,
        weights=planner_choice.weights_name(weights),
        cache_dtype=cache_dtype.name,
      )
    )
    phases = check_placement(
      mesh, layout, prefill_layout, generate_layout, hparams
    )
    self._cache_dtype = cache_dtype
    self._compute_dtype = jnp.dtype(compute_dtype)
    self._hparams = hparams
    self._vocab = vocab
    self._bos_id, self._eos_ids = special_ids(
      vocab, bos_id, eos_id, size=hparams.vocab, eos_ids=eos_ids
    )
    self._mesh = mesh
    self._layouts = phases
    self._served = None  # adapters.AdapterSet (with_adapters)
    # Speculative passes' measured costs, per (settings, batch) of generate.
    self._calibrations: dict = {}
    self._prefill_engine, self._generate_engine = make_engines(
      hparams,
      weights,
      mesh,
      phases,
      infer_fn=infer_fn,
      cache_dtype=cache_dtype,
      compute_dtype=compute_dtype,
      precision=self._precision,
      numerics=self._numerics,
      # The reference engine runs on JAX's default device, and on nothing
      # else: its programs trace that platform's kernels only.
      platform=jax.devices()[0].platform,
    )

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
  ) -> Self:
    """Random weights of `dtype` (see `models.init_random`). Without `vocab`,
    models whose vocabulary holds 259 ids get a `ByteVocabulary`; other
    keyword arguments go to the constructor. Raises ValueError, before
    drawing anything, when the weights would not fit on the device."""
    memory.check_random_weights(hparams.num_params(), dtype)
    long_prefill.check_columns(kwargs.get("prefill_chunk"))  # before drawing
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
  def engines(self) -> tuple:
    """The (prefill, generate) engines (one object when the phases share a
    layout)."""
    return self._prefill_engine, self._generate_engine

  @property
  def numerics(self) -> str:
    """ "invariant", "q8" or "fast" (`chunkwise.numerics`)."""
    return self._numerics

  @property
  def precision(self) -> str:
    """Of every matmul and einsum ("highest", "high" or "default")."""
    return self._precision

  @property
  def compute_dtype(self):
    """The residual stream's dtype (and the adapters' stacks')."""
    return self._compute_dtype

  @property
  def cache_dtype(self):
    """The KV caches' dtype (int8: packed with scales, `models.kv_int8`)."""
    return self._cache_dtype

  @property
  def kv_dtype(self) -> str:
    """How K/V caches are stored: "float32", "bfloat16" or "int8"."""
    return self._cache_dtype.name

  @property
  def vocab(self) -> Vocabulary | None:
    return self._vocab

  @property
  def mesh(self):
    """The device mesh (None: JAX's default device)."""
    return self._mesh

  @property
  def layout_choice(self):
    """The planner's `Choice` when a layout was "auto" (print it for the
    ranked table), else None."""
    return self._choice

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
    """The first of `eos_ids` (None without any)."""
    return self._eos_ids[0] if self._eos_ids else None

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """Every id that stops `generate` (besides its `stop_ids`)."""
    return self._eos_ids

  def with_adapters(self, adapters) -> Self:
    """This model serving LoRA `adapters` ({name: `cw.load_adapter(...)`})
    besides itself: `prefill`, `generate`, `generate_stream` take
    `adapters=` (a name, or one name or None per row; None is this base
    model) and `generate_many` each `Request.adapter`. Rows of different
    adapters share a batch and one compiled program per batch shape; the
    base weights and compiled programs are shared with this model (the
    adapters' stacks, [n, ...] per layer and target split like their base
    weight, come on top). ValueError, before placing anything, for an
    adapter that does not fit the model."""
    served = AdapterSet.make(
      self._hparams,
      adapters,
      (self._prefill_engine, self._generate_engine),
      dtype=self._compute_dtype,
    )
    model = copy.copy(self)
    model._served = served
    return model

  def with_prefill_chunk(self, prefill_chunk: int | None) -> Self:
    """This model (its weights, engines and compiled programs) cutting
    chunks longer than `prefill_chunk` columns (see the class)."""
    model = copy.copy(self)
    model._prefill_chunk = long_prefill.check_columns(prefill_chunk)
    return model

  @property
  def adapters(self) -> dict:
    """The LoRA adapters served ({name: Adapter}; empty without)."""
    return {} if self._served is None else dict(self._served.adapters)

  # -- checks and set-up of the calls (model.py) ---------------------------

  def _rows(self, adapters, batch: int, prefix: Sequence[ChunkResult]):
    """(per-row adapter names, int32 ids), checked against `prefix`."""
    known = () if self._served is None else self._served.names
    names, ids = rows_of(adapters, batch, known)
    check_prefix(prefix, names)
    return names, ids

  def _adapters_for(self, engine, ids):
    return None if self._served is None else self._served.call(engine, ids)

  def _drafting(self, spec: Speculation | None) -> Speculation | None:
    """`spec` (checked), once its drafter can run here: the "draft"
    drafter's int8 weights are made now, before any other work.
    ValueError for int8 weights (nothing cheaper to draft with) or a
    custom infer_fn."""
    if spec is not None and spec.drafter == "draft":
      if planner_choice.weights_name(self.weights) == "int8":
        raise ValueError(
          'Speculation(drafter="draft") drafts with the int8 copy of float '
          "weights; this model's weights are int8 already"
        )
      self._generate_engine.draft_weights()
    return spec

  def _start(self, prefix, args: dict):
    """(caches, state, inputs, engine adapters, per-row names, checked
    speculation) of a validated generate call."""
    shape = np.shape(args["sample_ids"])
    batch = shape[0] if len(shape) == 1 else 1  # else check_generate raises
    names, ids = self._rows(args["adapters"], batch, prefix)
    steps = args["steps"]
    spec, spec_rows = speculation_lib.prepare(
      args["speculation"],
      batch,
      steps if isinstance(steps, (int, np.integer)) and steps > 0 else 1,
    )
    self._drafting(spec)
    on = self._adapters_for(self._generate_engine, ids)
    caches, state, inputs = start_loop(
      self._generate_engine,
      self._hparams,
      prefix,
      args,
      eos_ids=self._eos_ids,
      bos_id=self._bos_id,
      vocabulary=self._vocab,
      adapters=on,
    )
    return caches, state.replace(spec=spec_rows), inputs, on, names, spec

  def _batch_split(self) -> int:
    """Rows the generate layout splits attention's batch into."""
    if self._mesh is None:
      return 1
    return math.prod(
      int(self._mesh.shape[a]) for a in self.generate_layout.attn_batch.axes
    )

  def _check_pages(self, kv_pages, capacity: int, speculation=None) -> int:
    """`kv_pages`, checked: 0, or enough pages for one request of
    `capacity` columns, on a model without a mesh, without the "draft"
    drafter (its scratch buffer is laid out like fixed slots)."""
    kv_pages = checks.check_count("kv_pages", kv_pages, minimum=0)
    if not kv_pages:
      return 0
    if speculation is not None and speculation.drafter == "draft":
      raise ValueError(
        f'kv_pages={kv_pages} with Speculation(drafter="draft"): the int8 '
        "draft reads fixed slots; use another drafter or kv_pages=0"
      )
    if self._mesh is not None:
      raise ValueError(
        f"kv_pages={kv_pages}: paged K/V runs on a model without a mesh "
        "(the pool is not split across devices); pass kv_pages=0"
      )
    least = -(-capacity // paged_kv.PAGE)
    if kv_pages < least:
      raise ValueError(
        f"kv_pages={kv_pages} cannot hold one request of {capacity} "
        f"columns: at least {least} pages of {paged_kv.PAGE} are needed"
      )
    return kv_pages
