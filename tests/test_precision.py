"""The `precision` option reaches every matmul of every program."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise import cpu_kernels, precision
from chunkwise.partitioning import make_mesh

DOT = re.compile(r"stablehlo\.(?:dot_general|dot)\b[^\n]*")


def test_resolve_defaults_and_errors():
  assert precision.resolve(None, jnp.float32) == "highest"
  assert precision.resolve(None, jnp.bfloat16) == "default"
  assert precision.resolve("high", jnp.float32) == "high"
  with pytest.raises(ValueError, match=r"'fast'.*default, high, highest"):
    precision.resolve("fast", jnp.float32)


def test_bad_precision_refused_before_any_work():
  h = cw.configs.get("tiny")
  with pytest.raises(ValueError, match="precision='tf32'"):
    cw.InferenceModel.random(h, precision="tf32")


def _dots(tmp_path, model, layout_tag) -> list[str]:
  """Every dot of the programs a prefill and a generate compile."""
  out = tmp_path / layout_tag
  out.mkdir()
  old = jax.config.read("jax_dump_ir_to")
  jax.config.update("jax_dump_ir_to", str(out))
  try:
    chunk = cw.Chunk.tokenize(model.vocab, ["ab", "c"], is_first_chunk=True)
    first = model.prefill(chunk)
    model.generate([first], sample_ids=jnp.arange(2), steps=2)
  finally:
    jax.config.update("jax_dump_ir_to", old)
  return [
    m.group(0)
    for path in pathlib.Path(out).glob("*.mlir")
    for m in DOT.finditer(path.read_text())
  ]


@pytest.mark.parametrize(
  "layout,shape",
  [
    (None, None),
    ("ws_2d/yz/latency", (2, 2, 2)),
  ],
)
def test_every_matmul_carries_the_precision(
  tmp_path, monkeypatch, layout, shape
):
  """Every XLA dot, the fused collective matmuls' included (ws_2d's
  latency form). The CPU kernel (which computes in f32 whatever the
  setting) is switched off so that every weight matmul is an XLA dot, as
  on the accelerators the option is for."""
  monkeypatch.setattr(cpu_kernels, "load", lambda: False)
  h = cw.configs.get("tiny")
  weights = cw.InferenceModel.random(h, seed=0).weights
  mesh = None if shape is None else make_mesh(shape)
  results = {}
  for p in ("highest", "default"):
    model = cw.InferenceModel(
      h, weights, cw.ByteVocabulary(), mesh=mesh, layout=layout, precision=p
    )
    assert model.precision == p
    dots = _dots(tmp_path, model, f"{p}")
    # prefill, init and run each contract weights (q/k/v, o, MLP, logits).
    assert len(dots) >= 3 * 7, dots
    tagged = [d for d in dots if "precision = [HIGHEST, HIGHEST]" in d]
    assert len(tagged) == (len(dots) if p == "highest" else 0), dots
    chunk = cw.Chunk.tokenize(model.vocab, ["ab", "c"], is_first_chunk=True)
    results[p] = model.prefill(chunk).per_token_scores
  # On the CPU every precision computes in f32.
  np.testing.assert_allclose(results["highest"], results["default"], atol=1e-6)
