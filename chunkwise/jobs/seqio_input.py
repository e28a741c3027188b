"""seqio Tasks and Mixtures as the input of batch jobs.

  found = read(SeqioInput(task="my_task", split="validation",
                          module="my_tasks"), kind=SCORE, vocab=model_vocab)

T5X users keep their evaluation data as seqio Tasks. A job reads a Task's
(or each Task of a Mixture's) `split` once, in order, unshuffled, from its
preprocessed `inputs` and `targets` features: token ids in the Task's own
vocabulary. Scoring scores `targets` after `inputs` (the log-prob of the
target given the input, as T5X's scoring does); generation continues
`inputs`. The ids go to the model as they are, so the Task's vocabulary
must be the model's: the same size, the same ids for a probe text, and,
where a feature appends EOS, the same EOS id. Otherwise the job refuses,
naming both, before any device work.

An example's id is its index in the split (a Task), or "task:index" (a
Mixture's Tasks, each in turn): records carry it and a re-run resumes
after the ids the output holds, as with files. `module` names a Python
module to import first (it registers the Tasks), found on sys.path or in
the working directory.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys

from chunkwise.jobs import examples

# Text whose encoding must agree between the Task's vocabulary and the
# model's (letters, digits, punctuation, a space run and a non-ASCII word).
PROBE = "The quick brown fox, 42 times: jumps!  Ünïcode café."


@dataclasses.dataclass(frozen=True, kw_only=True)
class SeqioInput:
  """A Task or Mixture (one of the two) and the split to read."""

  task: str | None = None
  mixture: str | None = None
  split: str = "validation"
  module: str | None = None  # imported first: it registers the Tasks

  def __post_init__(self):
    if (self.task is None) == (self.mixture is None):
      raise ValueError(
        "give one of --seqio_task and --seqio_mixture, got "
        f"task={self.task!r}, mixture={self.mixture!r}"
      )
    for name in ("task", "mixture", "split", "module"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"--seqio_{name}={value!r} must be a non-empty name")

  @property
  def name(self) -> str:
    """What messages call it: "seqio task NAME/SPLIT"."""
    kind = "task" if self.task else "mixture"
    return f"seqio {kind} {self.task or self.mixture}/{self.split}"


def _seqio():
  try:
    import seqio
  except ImportError:
    raise ValueError(
      "--seqio_task / --seqio_mixture need seqio: pip install chunkwise[seqio]"
    ) from None
  return seqio


def _import(module: str) -> None:
  """Imports `module`, from the working directory too (as `python -m`
  would): a script's own directory is first on sys.path, not the one it
  is run from."""
  here = os.getcwd()
  added = here not in sys.path
  if added:
    sys.path.append(here)
  try:
    importlib.import_module(module)
  except ImportError as e:
    raise ValueError(
      f"--seqio_module={module!r} cannot be imported: {e}"
    ) from None
  finally:
    if added:
      sys.path.remove(here)


def tasks(source: SeqioInput) -> list:
  """The Tasks `source` reads, in order (after importing its module)."""
  seqio = _seqio()
  if source.module:
    _import(source.module)
  registry, name = (
    (seqio.TaskRegistry, source.task)
    if source.task
    else (seqio.MixtureRegistry, source.mixture)
  )
  if name not in registry.names():
    known = ", ".join(sorted(registry.names())[:20]) or "none"
    raise ValueError(
      f"{source.name}: no such {'task' if source.task else 'mixture'} "
      f"registered (known: {known}); --seqio_module imports the module "
      "that registers it"
    )
  found = registry.get(name)
  tasks = [found] if source.task else list(found.tasks)
  for task in tasks:
    if source.split not in task.splits:
      raise ValueError(
        f"{source.name}: task {task.name} has no split {source.split!r} "
        f"(it has {', '.join(task.splits)})"
      )
  return tasks


def check_vocabulary(task, vocab, kind: str) -> None:
  """Raises ValueError unless the features `kind` reads use `vocab`'s ids
  (the model's vocabulary)."""
  names = ("inputs", "targets") if kind == examples.SCORE else ("inputs",)
  for name in names:
    feature = task.output_features.get(name)
    if feature is None:
      raise ValueError(
        f"seqio task {task.name} has no {name!r} feature (it has "
        f"{', '.join(task.output_features)})"
      )
    theirs = feature.vocabulary
    differences = []
    if theirs.vocab_size != vocab.vocab_size:
      differences.append(
        f"vocab_size {theirs.vocab_size} against {vocab.vocab_size}"
      )
    elif list(theirs.encode(PROBE)) != list(vocab.encode(PROBE)):
      differences.append(f"other ids for the text {PROBE!r}")
    if feature.add_eos and theirs.eos_id != vocab.eos_id:
      differences.append(
        f"EOS {theirs.eos_id} (appended) against {vocab.eos_id}"
      )
    if differences:
      raise ValueError(
        f"seqio task {task.name}'s {name!r} vocabulary "
        f"({type(theirs).__name__}) is not the model's "
        f"({type(vocab).__name__}): {'; '.join(differences)}"
      )


def read(source: SeqioInput, *, kind: str, vocab, adapter=None):
  """Every example of `source` as `examples.Examples` whose items carry
  token ids (`Example.ids`, `Example.context_ids`); the line number is
  the example's position in the whole input (from 1)."""
  found = examples.Examples(source.name, [], [])
  every = tasks(source)
  for task in every:
    check_vocabulary(task, vocab, kind)
  line = 0
  for task in every:
    dataset = task.get_dataset(
      sequence_length=None, split=source.split, shuffle=False, num_epochs=1
    )
    for index, features in enumerate(dataset.as_numpy_iterator()):
      line += 1
      example_id = index if source.task else f"{task.name}:{index}"
      inputs = [int(t) for t in features["inputs"]]
      targets = (
        [int(t) for t in features["targets"]] if kind == examples.SCORE else []
      )
      if kind == examples.SCORE and not targets:
        found.bad.append((line, f"{source.name}:{example_id}: empty targets"))
        continue
      if kind == examples.GENERATE and not inputs:
        found.bad.append((line, f"{source.name}:{example_id}: empty inputs"))
        continue
      found.items.append(
        examples.Example(
          example_id,
          line,
          "",
          adapter=adapter,
          ids=tuple(targets) if kind == examples.SCORE else tuple(inputs),
          context_ids=tuple(inputs) if kind == examples.SCORE else (),
        )
      )
  return found
