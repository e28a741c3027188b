"""Presets and HParams validation."""

import dataclasses

import jax
import pytest

import chunkwise as cw
from chunkwise.configs import Activation, Block


def test_presets_have_the_published_shapes():
  palm540 = cw.configs.get("palm-540b")
  assert (
    palm540.layers,
    palm540.d_model,
    palm540.d_ff,
    palm540.heads,
    palm540.kv_heads,
    palm540.head_dim,
    palm540.vocab,
  ) == (118, 18432, 73728, 48, 1, 256, 256128)
  palm8 = cw.configs.get("palm-8b")
  assert (palm8.layers, palm8.d_model, palm8.d_ff, palm8.heads) == (
    32,
    4096,
    16384,
    16,
  )
  palm62 = cw.configs.get("palm-62b")
  assert (palm62.layers, palm62.d_model, palm62.d_ff, palm62.heads) == (
    64,
    8192,
    32768,
    32,
  )
  for palm in (palm8, palm62, palm540):
    assert palm.block == Block.PARALLEL and palm.tied_embeddings
    assert palm.max_len == 8192
  smol = cw.configs.get("smollm2-135m")
  assert (
    smol.layers,
    smol.d_model,
    smol.heads,
    smol.kv_heads,
    smol.head_dim,
    smol.d_ff,
    smol.vocab,
    smol.rope_base,
    smol.norm_eps,
  ) == (30, 576, 9, 3, 64, 1536, 49152, 1e5, 1e-5)
  assert smol.block == Block.SEQUENTIAL and smol.tied_embeddings
  # SmolLM2-135M has about 135M parameters (tied embedding counted once).
  assert 134e6 < smol.num_params() < 135e6


def test_tiny_presets_divide_every_8_device_mesh():
  for name in ("tiny", "tiny-parallel"):
    h = cw.configs.get(name)
    assert h.heads % 8 == 0 and h.kv_heads >= 1
    assert h.vocab >= 256 and h.vocab % 8 == 0
    assert h.d_model % 8 == 0 and h.d_ff % 8 == 0
  assert cw.configs.get("tiny").block == Block.SEQUENTIAL
  assert cw.configs.get("tiny-parallel").kv_heads == 1


def test_unknown_preset_lists_known_ones():
  with pytest.raises(ValueError, match="unknown model preset 'gpt-5'") as e:
    cw.configs.get("gpt-5")
  for name in cw.configs.names():
    assert name in str(e.value)


def test_hparams_are_frozen_and_accept_strings():
  h = cw.configs.get("tiny").replace(block="parallel", activation="gelu")
  assert h.block == Block.PARALLEL and h.activation == Activation.GELU
  with pytest.raises(dataclasses.FrozenInstanceError):
    h.layers = 3  # type: ignore[misc]


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(kv_heads=3), "kv_heads=3 must divide heads=8"),
    (dict(head_dim=15), "head_dim=15 must be even"),
    (dict(layers=0), "layers must be a positive int"),
    (dict(vocab=2.5), "vocab must be a positive int"),
    (dict(block="serial"), "block='serial' is not one of"),
    (dict(norm_eps=0.0), "norm_eps must be > 0"),
  ],
)
def test_bad_hparams_raise(change, message):
  with pytest.raises(ValueError, match=message):
    cw.configs.get("tiny").replace(**change)


@pytest.mark.parametrize(
  "changes",
  [{}, {"qkv_bias": True}, {"block": "parallel", "tied_embeddings": True}],
)
def test_num_params_counts_every_weight(changes):
  h = cw.configs.get("tiny").replace(**changes)
  weights = jax.eval_shape(lambda: cw.models.init_random(h, jax.random.key(0)))
  assert h.num_params() == sum(x.size for x in jax.tree.leaves(weights))


# Published parameter counts (model cards), billions: the presets' shapes
# and features must add up to them.
PUBLISHED = {
  "llama-3.2-1b": 1.24,
  "llama-3.2-3b": 3.21,
  "llama-3.1-8b": 8.03,
  "llama-3.1-70b": 70.55,
  "qwen2.5-0.5b": 0.49,
  "qwen2.5-7b": 7.61,
  "gemma-2-2b": 2.61,
  "gemma-2-9b": 9.24,
  "gemma-3-1b": 1.00,
  "phi-3.5-mini": 3.82,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_model_presets_count_the_published_parameters(name):
  count = cw.configs.get(name).num_params() / 1e9
  assert count == pytest.approx(PUBLISHED[name], rel=0.01)
