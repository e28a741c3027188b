"""The main job: score sentences, then sample tasks from a shared few-shot
prefix, then stream a chat answer, all with the real default model.

  python scripts/demo.py                        # SmolLM2-135M-Instruct
  python scripts/demo.py --model=path/to/model.gguf --samples=3
  python scripts/demo.py --model=random:tiny    # random weights, no download

1. Scoring: each sentence's total log-probability (natural log), perplexity
   and per-token scores.
2. Few-shot: the prefix is prefilled once; each task's prefill attends to
   it, and every sample of a task reuses that task's KV cache.
3. Chat: the model's chat template, answered greedily, printed as the
   tokens stream out of the device loop.
"""

import time
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from absl import app, flags

import chunkwise as cw
from chunkwise.jobs import sampling_flags

_MODEL = flags.DEFINE_string(
  "model",
  "smollm2-135m",
  "A model name, a .gguf file, a Hugging Face directory, or random:<preset> "
  f"(random weights; presets: {', '.join(cw.configs.names())}).",
)
_SENTENCES = flags.DEFINE_multi_string(
  "sentence",
  [
    "The cat sat on the mat.",
    "The mat sat on the cat.",
    "Colorless green ideas sleep furiously.",
  ],
  "Sentences to score (repeat the flag).",
)
_PREFIX = flags.DEFINE_string(
  "prefix",
  "Q: What do cows eat?\nA: Grass.\n\n"
  "Q: How many legs does a spider have?\nA: Eight.\n\n",
  "Shared few-shot prefix, prefilled once.",
)
_TASKS = flags.DEFINE_multi_string(
  "task",
  ["Q: What do bees make?\nA:", "Q: What is the capital of Italy?\nA:"],
  "Tasks continuing the prefix (repeat the flag).",
)
_SAMPLES = flags.DEFINE_integer(
  "samples", 2, "Samples per task.", lower_bound=1
)
_STEPS = flags.DEFINE_integer(
  "steps", 12, "Tokens to generate per sample.", lower_bound=1
)
SAMPLING = sampling_flags.SamplingFlags(
  temperature=0.7, top_p=0.95, seed_help="Sampling (and random weight) seed."
)
_CHAT = flags.DEFINE_string(
  "chat",
  "What is the capital of France?",
  "A user message answered with the chat template ('' to skip).",
)
_CHAT_STEPS = flags.DEFINE_integer(
  "chat_steps", 48, "Longest chat answer, in tokens.", lower_bound=1
)


def _load(name: str) -> cw.InferenceModel:
  try:
    if name.startswith(cw.checkpoints.RANDOM):
      hparams = cw.checkpoints.describe_random(name).hparams
      return cw.InferenceModel.random(hparams, seed=SAMPLING.seed.value)
    return cw.load(name)
  except (FileNotFoundError, ValueError) as e:
    raise app.UsageError(f"--model={name}: {e}") from None


def _pieces(vocab: cw.Vocabulary, tokens: list[int], scores: np.ndarray) -> str:
  return " ".join(
    f"{vocab.decode([t])!r}:{s:.2f}"
    for t, s in zip(tokens, scores, strict=True)
  )


def _stop_ids(model: cw.InferenceModel) -> list[int]:
  """End of answer: a line break (one token for "\\n" or "\\n\\n")."""
  ids = list(model.eos_ids)
  for text in ("\n", "\n\n"):
    encoded = model.vocab.encode(text)
    if len(encoded) == 1:
      ids += encoded
  return ids


def score(model: cw.InferenceModel) -> None:
  vocab = model.vocab
  chunk = cw.Chunk.tokenize(vocab, _SENTENCES.value, is_first_chunk=True)
  result = model.prefill(chunk)
  scores = np.asarray(result.per_token_scores)
  print("\n== 1. Scoring (log-prob, natural log; BOS scores 0)")
  for text, row, s in zip(
    _SENTENCES.value, chunk.to_lists(), scores, strict=True
  ):
    s = s[: len(row)]
    print(
      f"{text!r}: log-prob {s.sum():.2f}, perplexity "
      f"{np.exp(-s[1:].mean()):.1f}"
    )
    print("  " + _pieces(vocab, row, s))


def few_shot(model: cw.InferenceModel) -> None:
  vocab = model.vocab
  prefix_chunk = cw.Chunk.tokenize(vocab, [_PREFIX.value], is_first_chunk=True)
  prefix = model.prefill(prefix_chunk)
  print(
    f"\n== 2. Few-shot: prefix of {prefix_chunk.time} tokens prefilled once, "
    f"{len(_TASKS.value)} tasks x {_SAMPLES.value} samples"
  )
  tasks = model.prefill(
    cw.Chunk.tokenize(vocab, _TASKS.value), prefix=[prefix], top_n=3
  )
  samples = _SAMPLES.value * len(_TASKS.value)
  tokens, result = model.generate(
    [prefix, tasks],
    sample_ids=jnp.arange(samples),
    steps=_STEPS.value,
    sampling=SAMPLING.sampling(),
    stop_ids=_stop_ids(model),
  )
  texts = tokens.detokenize(vocab)
  scores = np.asarray(result.per_token_scores)
  for i, (text, row) in enumerate(zip(texts, tokens.to_lists(), strict=True)):
    task = _TASKS.value[i // _SAMPLES.value]
    print(
      f"task {task!r}, sample {i}: {text!r} "
      f"(log-prob {scores[i, : len(row)].sum():.2f})"
    )
    print("  " + _pieces(vocab, row, scores[i, : len(row)]))


def chat(model: cw.InferenceModel) -> None:
  vocab = model.vocab
  if not _CHAT.value or getattr(vocab, "chat_template", None) is None:
    return
  try:
    prompt = vocab.apply_chat_template(
      [{"role": "user", "content": _CHAT.value}]
    )
  except ValueError as e:  # the model file's template failed or was refused
    print(f"\n== 3. Chat skipped: {e}")
    return
  # The template starts with the BOS (<|im_start|>) itself.
  chunk = cw.Chunk.from_lists([vocab.encode(prompt)])
  print(f"\n== 3. Chat (greedy, streamed)\nuser: {_CHAT.value}\nassistant: ")
  answer: list[int] = []
  for piece, _ in model.generate_stream(
    [model.prefill(chunk)],
    sample_ids=jnp.arange(1),
    steps=_CHAT_STEPS.value,
    sampling=cw.Sampling(temperature=0.0),
    every=8,
  ):
    before = vocab.decode(answer)
    answer += piece.to_lists()[0]
    print(vocab.decode(answer)[len(before) :], end="", flush=True)
  print()


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  start = time.perf_counter()
  model = _load(_MODEL.value)
  print(
    f"model: {_MODEL.value}, {model.hparams.num_params() / 1e6:.1f}M "
    f"parameters, loaded in {time.perf_counter() - start:.1f} s"
  )
  score(model)
  few_shot(model)
  chat(model)
  print(f"\ndone in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  app.run(main)
