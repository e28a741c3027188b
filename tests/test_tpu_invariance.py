"""A TPU program under invariant numerics (`numerics.tpu_invariant`): its
weight matmuls, attention and row sums run the Pallas kernels of fixed
tiles (`tpu_kernels`: `invariant_matmul`, `attention.parts`,
`row_sums`), here in Pallas' interpret mode on the CPU
(`numerics.tpu_interpret`). A row's scores, top-n, next-token logits,
generated tokens and their scores are bit-identical alone and at any
place in batches of other rows of other lengths and sampling settings.
The same compositions under fast numerics differ, so the comparison can
fail. A context cut into other chunks (across the kernel's 128-key
tiles), a prefix broadcast to many rows, and decode steps against one
pass over the same tokens give the same bits too. The programs
compiled for a TPU: tests/test_tpu_compile.py.
"""

import numpy as np
import pytest

import chunkwise as cw
from chunkwise import cpu_kernels, numerics
from tests.test_invariance import _capped, _chunk, _equal, _row, _tokens

MODELS = {
  # grouped K/V heads, an untied unembedding (k-major)
  "tiny": lambda: cw.configs.get("tiny"),
  # a tied table (n-major), attention and final soft caps, a window
  "tiny-capped": lambda: _capped(cw.configs.get("tiny")),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def weights(request):
  """(hparams, weights) of a random model: each test builds its models
  (fresh programs, traced inside `tpu_interpret`)."""
  base = cw.InferenceModel.random(MODELS[request.param](), seed=3)
  return base.hparams, base.weights


def _prefill_compositions(model, seed=0):
  """(want, [(got, at)]): a row alone, and the row in two batches of other
  rows of other lengths (so other padding widths)."""
  rng = np.random.default_rng(seed)
  vocab = model.hparams.vocab
  row = _tokens(rng, vocab, 9)
  want = _row(model.prefill(_chunk([row]), top_n=3), 0, len(row))
  got = []
  for batch, at in ((3, 1), (5, 4)):
    rows = [_tokens(rng, vocab, int(rng.integers(1, 14))) for _ in range(batch)]
    rows[at] = row
    got.append((_row(model.prefill(_chunk(rows), top_n=3), at, len(row)), at))
  return want, got


def _close(got, want, what):
  """The invariant program's numbers are the fast program's (the kernels
  wired to the right operands), to f32 rounding."""
  names = ("scores", "top_ids", "top_lp", "next")
  for g, w, name in zip(got, want, names, strict=False):
    if name == "top_ids":
      continue  # near-ties may swap
    np.testing.assert_allclose(
      g, w, rtol=1e-4, atol=1e-4, err_msg=f"{what} {name}"
    )


def test_tpu_programs_rows_do_not_depend_on_the_batch(weights):
  hparams, w = weights
  with numerics.tpu_interpret():
    invariant = cw.InferenceModel(hparams, w, numerics="invariant")
    want, got = _prefill_compositions(invariant)
  for g, at in got:
    _equal(g, want, f"prefill at {at}")
  fast = cw.InferenceModel(hparams, w, numerics="fast")
  fast_want, fast_got = _prefill_compositions(fast)
  _close(want, fast_want, "prefill")
  assert any(
    not np.array_equal(a, b)
    for g, _ in fast_got
    for a, b in zip(g, fast_want, strict=True)
  ), "fast numerics gave every row's bits too: the comparison cannot fail"


def _generate(model, rows, at, sampling, ids):
  tokens, result = model.generate(
    prefix=[model.prefill(_chunk(rows))],
    sample_ids=ids,
    steps=6,
    sampling=sampling,
    top_n=2,
  )
  n = int(tokens.lengths[at])
  return tokens.tokens[at, :n], _row(result, at, n)[:3]


def test_tpu_programs_generate_rows_do_not_depend_on_the_batch():
  """On the capped model: a tied table, soft caps, and a window over the
  prefix's keys (the kernel's first key per row)."""
  base = cw.InferenceModel.random(MODELS["tiny-capped"](), seed=3)
  rng = np.random.default_rng(1)
  row = _tokens(rng, base.hparams.vocab, 7)
  sampling = cw.Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=3)
  rows = [_tokens(rng, base.hparams.vocab, n) for n in (3, 8, 2)]
  rows[1] = row
  others = cw.Sampling(
    temperature=np.array([1.0, 0.8, 0.5]),
    top_k=np.array([5, 20, 0]),
    top_p=np.array([0.5, 0.9, 1.0]),
    seed=3,
  )
  with numerics.tpu_interpret():
    model = cw.InferenceModel(base.hparams, base.weights, numerics="invariant")
    want = _generate(model, [row], 0, sampling, np.array([11]))
    got = _generate(model, rows, 1, others, np.array([4, 11, 9]))
  assert np.array_equal(got[0], want[0])
  _equal(got[1], want[1], "generated at 1")
  fast = _generate(base, [row], 0, sampling, np.array([11]))
  assert np.array_equal(fast[0], want[0])
  _close(want[1], fast[1], "generated")


def test_invariant_numerics_are_asked_for_off_the_cpu(monkeypatch):
  """The default stays "fast" on a TPU (its invariant programs cost more:
  docs/numerics.md) and "invariant" for float weights on this CPU; asked
  for, a TPU gets them; a bad name is refused."""
  on_cpu = "invariant" if cpu_kernels.isa.vector() else "fast"
  assert numerics.resolve(None) == on_cpu
  monkeypatch.setattr(numerics.jax, "default_backend", lambda: "tpu")
  assert numerics.resolve(None) == "fast"
  assert numerics.resolve("invariant") == "invariant"
  with pytest.raises(ValueError, match="'exact' is not a numerics mode"):
    numerics.resolve("exact")


def test_tpu_programs_broadcast_prefix_rows_do_not_depend_on_the_batch():
  """A one-row prefix (soft caps and a window over its keys) read by a
  chunk of one row and by a chunk of three: the row's bits are the
  same, and the fast program's numbers."""
  base = cw.InferenceModel.random(MODELS["tiny-capped"](), seed=4)
  rng = np.random.default_rng(2)
  vocab = base.hparams.vocab
  shared, row = _tokens(rng, vocab, 9), _tokens(rng, vocab, 4)[1:]
  rows = [_tokens(rng, vocab, 6)[1:], row, _tokens(rng, vocab, 2)[1:]]

  def run(model):
    prefix = [model.prefill(_chunk([shared]))]
    alone = model.prefill(_chunk([row], first=False), prefix=prefix, top_n=3)
    many = model.prefill(_chunk(rows, first=False), prefix=prefix, top_n=3)
    return _row(alone, 0, len(row)), _row(many, 1, len(row))

  with numerics.tpu_interpret():
    model = cw.InferenceModel(base.hparams, base.weights, numerics="invariant")
    alone, many = run(model)
  _equal(many, alone, "after a broadcast prefix")
  _close(alone, run(base)[0], "after a broadcast prefix")


def _cut(model, row, cuts, top_n=2):
  """prefill(row) as the chunks between `cuts`, each after the ones
  before: the whole row's result."""
  prefix, parts = [], []
  for a, b in zip([0, *cuts], [*cuts, len(row)], strict=True):
    first = not prefix
    result = model.prefill(
      _chunk([row[a:b]], first), prefix=prefix, top_n=top_n
    )
    prefix.append(result)
    parts.append(result)
  return cw.concat_results(parts), prefix


def test_tpu_programs_chunk_splits_and_decode_steps_are_invisible():
  """On the capped model (its window reaching back across pieces): a
  290-token row prefilled whole, cut within the first 128-key tile, and
  cut across tiles (a first piece read in place up to its last whole
  tile, the rest gathered behind it); then a generate loop from a
  125-token prompt cut in two, whose steps cross position 128, against
  the same prompt whole and one pass over the generated tokens."""
  base = cw.InferenceModel.random(MODELS["tiny-capped"](), seed=5)
  rng = np.random.default_rng(3)
  row = _tokens(rng, base.hparams.vocab, 290)
  with numerics.tpu_interpret():
    model = cw.InferenceModel(base.hparams, base.weights, numerics="invariant")
    whole = _row(model.prefill(_chunk([row]), top_n=2), 0, len(row))
    for cuts in ([70, 100], [150, 260]):
      got = _row(_cut(model, row, cuts)[0], 0, len(row))
      _equal(got, whole, f"cuts {cuts}")
    sampling = cw.Sampling(temperature=0.8, top_k=20, seed=3)
    runs = []
    for cuts in ([], [60]):
      prompt = _cut(model, row[:125], cuts)[1]
      runs.append(
        model.generate(
          prefix=prompt,
          sample_ids=np.array([4]),
          steps=6,
          sampling=sampling,
          top_n=2,
        )
      )
    (tokens, want), (cut_tokens, got) = runs
    n = int(tokens.lengths[0])
    assert np.array_equal(cut_tokens.tokens[0, :n], tokens.tokens[0, :n])
    _equal(_row(got, 0, n)[:3], _row(want, 0, n)[:3], "after a cut prompt")
    again = model.prefill(
      cw.Chunk(tokens=tokens.tokens[:, :n], lengths=tokens.lengths),
      prefix=[model.prefill(_chunk([row[:125]]))],
      top_n=2,
    )
    _equal(_row(again, 0, n)[:3], _row(want, 0, n)[:3], "one pass")
  fast = cw.InferenceModel(base.hparams, base.weights, numerics="fast")
  fast_got = _row(_cut(fast, row, [150, 260])[0], 0, len(row))
  _close(fast_got, whole, "cut")
