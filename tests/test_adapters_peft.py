"""Multi-LoRA against PEFT itself: two PEFT adapters of a tiny Hugging
Face Llama (rank 4 on all seven projections; rank 2 rsLoRA on q, v and
down), read with `cw.load_adapter` and served side by side with the base
model in one batch, must give each row what transformers + PEFT give with
that row's adapter active (or disabled, for base rows): the same per-token
log-probabilities and next-token distribution, and the same greedy
tokens."""

import copy

import numpy as np
import peft
import pytest
import torch

import chunkwise as cw
from tests import hf_models

ALL = [f"{m}_proj" for m in ("q", "k", "v", "o", "gate", "up", "down")]
# (Not "a": PEFT warns about adapter names inside its prefix "lora_".)
CONFIGS = {
  "full": peft.LoraConfig(
    r=4, lora_alpha=8, target_modules=ALL, init_lora_weights=False
  ),
  "rs": peft.LoraConfig(
    r=2,
    lora_alpha=6,
    use_rslora=True,
    target_modules=["q_proj", "v_proj", "down_proj"],
    init_lora_weights=False,
  ),
}
# Right-padded rows of different lengths; each row's adapter (None: base).
ROWS = [
  [1, 5, 9, 33, 2, 7, 64, 120, 3],
  [1, 100, 3, 250],
  [1, 17, 17, 17, 90, 45],
  [1, 299, 8, 13, 21, 34, 55],
  [1, 42, 42],
]
NAMES = ["full", None, "rs", "full", "rs"]
STEPS = 5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """(the PeftModel with adapters "full" and "rs"; chunkwise's base model
  serving the same adapters, read back from PEFT's files)."""
  directory = tmp_path_factory.mktemp("peft")
  base = hf_models.tiny("llama", heads=4, kv_heads=2, vocab=300, seed=1)
  base.save_pretrained(directory / "base")
  torch.manual_seed(0)
  model = peft.get_peft_model(
    copy.deepcopy(base), CONFIGS["full"], adapter_name="full"
  )
  model.add_adapter("rs", CONFIGS["rs"])
  model.save_pretrained(directory / "adapters")  # adapters/<name>
  model.eval()
  ours = cw.load(directory / "base")
  served = ours.with_adapters(
    {
      n: cw.load_adapter(directory / "adapters" / n, ours.hparams)
      for n in CONFIGS
    }
  )
  return model, served


def _forward(model, name, ids):
  """PEFT's logits f32[time, vocab] of one row with adapter `name` active
  (None: every adapter disabled)."""
  x = torch.tensor([ids])
  with torch.no_grad():
    if name is None:
      with model.disable_adapter():
        return model(input_ids=x).logits[0].numpy()
    model.set_adapter(name)
    return model(input_ids=x).logits[0].numpy()


def _log_softmax(x):
  return torch.log_softmax(torch.tensor(x, dtype=torch.float64), -1).numpy()


def test_each_row_matches_peft_with_its_adapter(reference):
  model, served = reference
  chunk = cw.Chunk.from_lists(ROWS)
  got = served.prefill(chunk, adapters=NAMES)
  scores = np.asarray(got.per_token_scores)
  next_logits = np.asarray(got.next_token_logits)
  base = {tuple(r): _forward(model, None, r) for r in ROWS}
  for r, (row, name) in enumerate(zip(ROWS, NAMES, strict=True)):
    n = len(row)
    want = _log_softmax(_forward(model, name, row))
    np.testing.assert_allclose(
      scores[r, 1:n],
      want[np.arange(n - 1), row[1:]],
      rtol=0,
      atol=1e-4,
      err_msg=f"row {r} ({name})",
    )
    np.testing.assert_allclose(
      _log_softmax(next_logits[r]), want[n - 1], rtol=0, atol=1e-4
    )
    if name is not None:  # the adapter changes the model noticeably
      assert np.abs(want - _log_softmax(base[tuple(row)])).max() > 0.05


def test_greedy_tokens_match_peft_with_its_adapter(reference):
  """chunkwise's greedy continuation equals PEFT's argmax, step by step
  (no near ties: the best token leads by over 1e-3), and each generated
  token's score PEFT's log-probability of it."""
  model, served = reference
  prompt = served.prefill(cw.Chunk.from_lists(ROWS), adapters=NAMES)
  tokens, result = served.generate(
    [prompt],
    sample_ids=np.arange(len(ROWS)),
    steps=STEPS,
    sampling=cw.Sampling(temperature=0.0),
    adapters=NAMES,
  )
  assert result.adapters == tuple(NAMES)
  got = np.asarray(tokens.tokens)
  scores = np.asarray(result.per_token_scores)
  for r, (row, name) in enumerate(zip(ROWS, NAMES, strict=True)):
    ids, want, want_scores = list(row), [], []
    for _ in range(STEPS):
      logp = _log_softmax(_forward(model, name, ids)[-1])
      second, first = np.sort(logp)[-2:]
      assert first - second > 1e-3, "a near tie: pick other prompts"
      ids.append(int(np.argmax(logp)))
      want.append(ids[-1])
      want_scores.append(logp[ids[-1]])
    np.testing.assert_array_equal(got[r], want, err_msg=f"row {r} ({name})")
    np.testing.assert_allclose(scores[r], want_scores, rtol=0, atol=1e-4)


def test_saved_with_the_model_they_still_match(reference, tmp_path):
  """`cw.save` keeps the adapters read from PEFT, their source and PEFT
  config; the loaded model computes what the served one did."""
  _, served = reference
  loaded = cw.load(cw.save(served, tmp_path / "served"))
  assert list(loaded.adapters) == list(CONFIGS)
  for name, adapter in served.adapters.items():
    got = loaded.adapters[name]
    assert got.checksum == adapter.checksum
    assert got.source == adapter.source
    assert got.config == adapter.config
  assert loaded.adapters["rs"].config["use_rslora"] is True
  chunk = cw.Chunk.from_lists(ROWS)
  np.testing.assert_array_equal(
    np.asarray(loaded.prefill(chunk, adapters=NAMES).per_token_scores),
    np.asarray(served.prefill(chunk, adapters=NAMES).per_token_scores),
  )
