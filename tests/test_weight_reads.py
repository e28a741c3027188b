"""Decode and prefill read every weight once, in place (DESIGN §6): the
compiled programs of every layout and collective variant hold no copy,
slice or dequantized twin of a weight outside a matmul. Checked on the
optimized HLO (`chunkwise.simulation.weight_reads`), whose checker is itself
checked on programs that do copy."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import chunkwise as cw
from chunkwise.partitioning import make_mesh
from chunkwise.simulation import hlo, weight_reads

# Every layout and collective variant: the ring forms read their weight
# pieces (`fused.Pieces`) in place.
LAYOUTS = [
  "reference",
  "ws_1d",
  "ws_1d/none/one_way",
  "ws_1d/none/latency",
  "ws_1d/none/throughput",
  "ws_2d",
  "ws_2d/yz",
  "ws_2d/none/one_way",
  "ws_2d/none/latency",
  "ws_2d/none/throughput",
  "wg",
  "wg/none/one_way",
  "wg/none/latency",
  "wg/none/throughput",
]


def _programs(model):
  with weight_reads.recording(model) as programs:
    prompt = model.prefill(cw.Chunk.from_lists([[1, 5, 9], [1, 7, 0]]))
    model.generate(
      [prompt],
      sample_ids=np.arange(2),
      steps=3,
      sampling=cw.Sampling(temperature=0.0),
    )
  return programs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_weight_is_copied(layout):
  h = cw.configs.get("tiny")
  mesh = None if layout == "reference" else make_mesh((2, 2, 2))
  model = cw.InferenceModel.random(h, seed=0, mesh=mesh, layout=layout)
  programs = _programs(model)
  assert {name for name, _, _ in programs} >= {"prefill", "init", "run"}
  for name, n_weights, text in programs:
    assert weight_reads.weight_copies(text, n_weights) == [], name


def test_the_checker_sees_copies():
  """A scan over stacked weights slices each layer out; a weight scaled
  or dequantized before its matmul is written anew; a per-layer unrolled
  loop reads in place."""
  x = jnp.ones((2, 64))
  stacked = jnp.ones((3, 64, 64))
  layers = tuple(stacked)

  def scanned(ws, x):
    return lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

  def unrolled(ws, x):
    for w in ws:
      x = jnp.tanh(x @ w.astype(x.dtype))
    return x

  def text(fn, ws):
    return jax.jit(fn).lower(ws, x).compile().as_text()

  assert weight_reads.weight_copies(text(unrolled, layers), 3) == []
  (found,) = weight_reads.weight_copies(text(scanned, stacked), 1)
  assert "f32[64,64] from weight parameter 0" in found
  scaled = weight_reads.weight_copies(
    text(lambda ws, x: unrolled([w * 2 for w in ws], x), layers), 3
  )
  assert len(scaled) == 3
  int8 = tuple(w.astype(jnp.int8) for w in layers)
  assert len(weight_reads.weight_copies(text(unrolled, int8), 3)) == 3
  # Small weights (norm scales) are not followed.
  assert (
    weight_reads.weight_copies(text(unrolled, layers), 3, min_elements=10**6)
    == []
  )


@pytest.mark.parametrize("layout", ["reference", "ws_2d"])
def test_generate_writes_its_kv_buffer_in_place(layout):
  """The decode loop's K/V buffer (per layer [batch, kv_heads, steps,
  head_dim]) is written in place: no step copies it (written after the
  reads of the same step, XLA copied it twice a step)."""
  h = cw.configs.get("tiny")
  mesh = None if layout == "reference" else make_mesh((2, 2, 2))
  model = cw.InferenceModel.random(h, seed=0, mesh=mesh, layout=layout)
  steps = 7
  with weight_reads.recording(model) as programs:
    prompt = model.prefill(cw.Chunk.from_lists([[1, 5, 9], [1, 7, 0]]))
    model.generate([prompt], sample_ids=np.arange(2), steps=steps)
  (text,) = [text for name, _, text in programs if name == "run"]
  buffers = [
    i
    for instrs in hlo.parse(text).computations.values()
    for i in instrs
    if _is_kv_buffer(i.shape, h.head_dim, steps)
  ]
  assert [i for i in buffers if i.op == "copy"] == []
  writes = [i for i in buffers if i.op in ("dynamic-update-slice", "fusion")]
  assert writes  # the pattern matches the buffer's shape


def _is_kv_buffer(shape: str, head_dim: int, steps: int) -> bool:
  dims = re.fullmatch(r"[a-z]+\d*\[([\d,]*)\]\{[\d,]*\}", shape)
  if dims is None:
    return False
  d = [int(x) for x in dims.group(1).split(",") if x]
  return len(d) == 4 and d[2] == steps and d[3] == head_dim
