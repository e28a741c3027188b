"""Tiny seqio Tasks from Python data, for tests/test_jobs_seqio.py
(`--seqio_module=tests.seqio_tasks` registers them; no download)."""

from __future__ import annotations

import seqio
import tensorflow as tf

QA = "chunkwise_test_qa"
NOTES = "chunkwise_test_notes"
MIXTURE = "chunkwise_test_mixture"
OTHER_VOCAB = "chunkwise_test_other_vocab"

PAIRS = [
  ("question: what is two and two?", " four"),
  ("question: the capital of France?", " Paris"),
  ("translate to German: the house", " das Haus"),
  ("question: colour of the sky?", " blue"),
  ("complete: once upon a", " time"),
]
NOTES_PAIRS = [("note: buy milk", " today"), ("note: call home", " soon")]


def _source(pairs):
  def dataset_fn(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensor_slices(
      {"inputs": [p for p, _ in pairs], "targets": [t for _, t in pairs]}
    )

  return seqio.FunctionDataSource(dataset_fn, splits=["validation", "train"])


def _register(name, pairs, vocab):
  if name in seqio.TaskRegistry.names():
    return
  seqio.TaskRegistry.add(
    name,
    source=_source(pairs),
    preprocessors=[seqio.preprocessors.tokenize],
    output_features={
      "inputs": seqio.Feature(vocab, add_eos=False),
      "targets": seqio.Feature(vocab, add_eos=False),
    },
  )


# seqio's bytes: ids b + 3, as chunkwise's ByteVocabulary (random models).
_register(QA, PAIRS, seqio.ByteVocabulary())
_register(NOTES, NOTES_PAIRS, seqio.ByteVocabulary())
_register(OTHER_VOCAB, PAIRS, seqio.PassThroughVocabulary(size=100))
if MIXTURE not in seqio.MixtureRegistry.names():
  seqio.MixtureRegistry.add(MIXTURE, [QA, NOTES], default_rate=1.0)
