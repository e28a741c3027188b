"""Prefill a shared few-shot prefix once, then sample from several tasks.

  python scripts/demo.py                       # tiny random model
  python scripts/demo.py --preset=tiny-parallel --samples=3 --steps=24

Prints every prompt token's score, then each sample with its tokens'
log-probabilities (natural log). With random weights the text is noise; the
point is the machinery: one prefill of the shared prefix serves every task,
and every task's prefill serves all of its samples.
"""

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from absl import app, flags

import chunkwise as cw

# Random weights of the PaLM presets would not fit in memory.
_SMALL_PRESETS = [
  name for name in cw.configs.names() if cw.configs.get(name).num_params() < 1e9
]
_PRESET = flags.DEFINE_enum(
  "preset", "tiny", _SMALL_PRESETS, "Model shape (random weights)."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random weights.")
_PREFIX = flags.DEFINE_string(
  "prefix",
  "Cows have 4 legs. Ants have 6 legs.",
  "Shared few-shot prefix, prefilled once.",
)
_TASKS = flags.DEFINE_list(
  "tasks",
  ["Humans have", "Fish have"],
  "Comma-separated tasks continuing the prefix.",
)
_SAMPLES = flags.DEFINE_integer(
  "samples", 2, "Samples per task.", lower_bound=1
)
_STEPS = flags.DEFINE_integer(
  "steps", 12, "Tokens to generate per sample.", lower_bound=1
)
_TEMPERATURE = flags.DEFINE_float(
  "temperature", 0.7, "Sampling temperature (0: greedy).", lower_bound=0.0
)
_TOP_P = flags.DEFINE_float(
  "top_p", 0.95, "Nucleus sampling mass, in (0, 1].", upper_bound=1.0
)
flags.register_validator("top_p", lambda p: p > 0, "--top_p must be > 0")
_SAMPLE_SEED = flags.DEFINE_integer("sample_seed", 0, "Sampling seed.")


def _pieces(vocab: cw.Vocabulary, tokens: list[int], scores: np.ndarray) -> str:
  return " ".join(
    f"{vocab.decode([t])!r}:{s:.2f}"
    for t, s in zip(tokens, scores, strict=True)
  )


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  hparams = cw.configs.get(_PRESET.value)
  model = cw.InferenceModel.random(hparams, seed=_SEED.value)
  vocab = model.vocab
  print(
    f"model: {_PRESET.value}, random weights (seed {_SEED.value}), "
    f"{hparams.num_params():,} parameters"
  )

  prefix_chunk = cw.Chunk.tokenize(vocab, [_PREFIX.value], is_first_chunk=True)
  prefix = model.prefill(prefix_chunk)
  scores = np.asarray(prefix.per_token_scores)[0]
  print(
    f"\nprefix {_PREFIX.value!r}: {prefix_chunk.time} tokens, prefilled "
    f"once; total log-prob {scores.sum():.2f}"
  )
  print("  " + _pieces(vocab, prefix_chunk.to_lists()[0], scores))

  tasks_chunk = cw.Chunk.tokenize(vocab, [" " + t for t in _TASKS.value])
  tasks = model.prefill(tasks_chunk, prefix=[prefix], top_n=3)
  samples = _SAMPLES.value * len(_TASKS.value)
  tokens, result = model.generate(
    [prefix, tasks],
    sample_ids=jnp.arange(samples),
    steps=_STEPS.value,
    sampling=cw.Sampling(
      temperature=_TEMPERATURE.value,
      top_p=_TOP_P.value,
      seed=_SAMPLE_SEED.value,
    ),
  )
  texts = tokens.detokenize(vocab)
  scores = np.asarray(result.per_token_scores)
  for i, (text, row) in enumerate(zip(texts, tokens.to_lists(), strict=True)):
    task = _TASKS.value[i // _SAMPLES.value]
    print(
      f"\ntask {task!r}, sample {i}: {text!r} "
      f"(log-prob {scores[i, : len(row)].sum():.2f})"
    )
    print("  " + _pieces(vocab, row, scores[i, : len(row)]))


if __name__ == "__main__":
  app.run(main)
