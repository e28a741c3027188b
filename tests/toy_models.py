"""Hand-computable models that drive prefill and the generate loop.

`successor_model(p_next)`: after token t, the next token is t + 1 with
probability p_next and t itself with probability 1 - p_next (nothing else).
With p_next = 0.8 this is the reference code's 0.8/0.2 toy; greedy decoding
from t yields t+1, t+2, ... each scored ln 0.8.

`first_layers(model, n)`: a real model cut to its first n layers (its
tokenizer, embeddings and special ids kept), for tests whose assertions
do not depend on depth.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import chunkwise as cw
from chunkwise.inference.results import FullChunkResult

VOCAB = 32
HPARAMS = cw.HParams(
  layers=1,
  d_model=8,
  heads=1,
  kv_heads=1,
  head_dim=2,
  d_ff=8,
  vocab=VOCAB,
  max_len=64,
)


def successor_infer(p_next, counter=None):
  """An InferFn: logits ln(p_next) at t+1, ln(1-p_next) at t, -inf else.

  `counter` (a list) gets one entry per forward pass actually executed,
  through a host callback, so tests can see the loop exit early.
  """

  def infer(weights, prefix, chunk):
    del weights, prefix
    ids = jnp.arange(VOCAB)
    tokens = chunk.tokens[..., None]
    logits = jnp.where(ids == (tokens + 1) % VOCAB, np.log(p_next), -jnp.inf)
    if p_next < 1:
      logits = jnp.where(ids == tokens, np.log(1 - p_next), logits)
    if counter is not None:
      jax.debug.callback(lambda: counter.append(1))
    shape = (
      HPARAMS.layers,
      *chunk.tokens.shape,
      HPARAMS.kv_heads,
      HPARAMS.head_dim,
    )
    cache = cw.KVCache(
      k=jnp.zeros(shape), v=jnp.zeros(shape), lengths=chunk.lengths
    )
    return FullChunkResult(logits=logits.astype(jnp.float32), kv_cache=cache)

  return infer


def successor_model(p_next=0.8, *, eos_id=None, counter=None):
  return cw.InferenceModel(
    HPARAMS,
    None,
    bos_id=0,
    eos_id=eos_id,
    infer_fn=successor_infer(p_next, counter),
  )


def first_layers(model: cw.InferenceModel, n: int) -> cw.InferenceModel:
  """`model` with only its first `n` layers (SmolLM2's first 4 of 30: a
  seventh of the compile and run time)."""
  return cw.InferenceModel(
    model.hparams.replace(layers=n),
    dataclasses.replace(model.weights, layers=model.weights.layers[:n]),
    model.vocab,
    bos_id=model.bos_id,
    eos_id=model.eos_id,
  )
