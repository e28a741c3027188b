"""seqio Tasks and Mixtures as the jobs' input (`jobs.seqio_input`): the
scoring job scores targets after inputs as a file of the same texts does,
the generation script continues inputs and resumes, a Mixture reads each
Task in turn, and a Task in another vocabulary is refused."""

from __future__ import annotations

import json

import pytest

from chunkwise import jobs
from tests import seqio_tasks
from tests.test_jobs import _main, _records

MODULE = "tests.seqio_tasks"


def test_scoring_a_task_equals_scoring_its_texts(tmp_path):
  """Each example's log-prob of its targets given its inputs, id its
  index, equals the job over a JSON-lines file of the same (context,
  continuation) texts; a Mixture scores each of its Tasks in turn."""
  model = jobs.ModelConfig(name="random:tiny")
  seqio_out = tmp_path / "seqio.jsonl"
  jobs.run_score(
    jobs.ScoreJob(
      seqio=jobs.SeqioInput(task=seqio_tasks.QA, module=MODULE),
      output=str(seqio_out),
      model=model,
      progress=False,
    )
  )
  texts = tmp_path / "texts.jsonl"
  texts.write_text(
    "".join(
      json.dumps({"id": i, "context": q, "continuation": a}) + "\n"
      for i, (q, a) in enumerate(seqio_tasks.PAIRS)
    )
  )
  file_out = tmp_path / "file.jsonl"
  jobs.run_score(
    jobs.ScoreJob(
      input=str(texts), output=str(file_out), model=model, progress=False
    )
  )
  got, want = _records(seqio_out), _records(file_out)
  assert [r["id"] for r in got] == list(range(len(seqio_tasks.PAIRS)))
  assert [(r["logprob"], r["num_tokens"]) for r in got] == [
    (r["logprob"], r["num_tokens"]) for r in want
  ]
  mixed = tmp_path / "mixture.jsonl"
  jobs.run_score(
    jobs.ScoreJob(
      seqio=jobs.SeqioInput(mixture=seqio_tasks.MIXTURE, module=MODULE),
      output=str(mixed),
      model=model,
      progress=False,
    )
  )
  records = {r["id"]: r["logprob"] for r in _records(mixed)}
  assert sorted(records) == sorted(
    [f"{seqio_tasks.QA}:{i}" for i in range(len(seqio_tasks.PAIRS))]
    + [f"{seqio_tasks.NOTES}:{i}" for i in range(len(seqio_tasks.NOTES_PAIRS))]
  )
  for r in got:
    assert records[f"{seqio_tasks.QA}:{r['id']}"] == r["logprob"]


def test_generate_script_continues_a_task_and_resumes(tmp_path, capsys):
  out = tmp_path / "g.jsonl"
  args = [
    f"--seqio_task={seqio_tasks.QA}",
    f"--seqio_module={MODULE}",
    "--seqio_split=train",
    f"--output={out}",
    "--steps=12",
    "--temperature=0",
  ]
  code, summary, _ = _main("generate", args, capsys)
  assert code == 0 and summary["samples"] == len(seqio_tasks.PAIRS)
  records = _records(out)
  assert [r["id"] for r in records] == list(range(len(seqio_tasks.PAIRS)))
  # The same prompts as text give the same samples.
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(
    "".join(
      json.dumps({"id": i, "prompt": q}) + "\n"
      for i, (q, _) in enumerate(seqio_tasks.PAIRS)
    )
  )
  text_out = tmp_path / "t.jsonl"
  code, _, _ = _main(
    "generate",
    [f"--input={prompts}", f"--output={text_out}", *args[4:]],
    capsys,
  )
  assert [r["tokens"] for r in _records(text_out)] == [
    r["tokens"] for r in records
  ]
  before = out.read_bytes()
  out.write_bytes(b"".join(before.splitlines(keepends=True)[:2]))
  code, summary, _ = _main("generate", args, capsys)
  assert code == 0 and summary["resumed"] == 2
  assert out.read_bytes() == before


def test_bad_seqio_inputs_are_refused(tmp_path, capsys):
  out = str(tmp_path / "o.jsonl")
  for source, message in (
    (
      jobs.SeqioInput(task=seqio_tasks.OTHER_VOCAB, module=MODULE),
      r"is not the model's.*vocab_size 100 against 259",
    ),
    (jobs.SeqioInput(task="no_such_task", module=MODULE), "no such task"),
    (
      jobs.SeqioInput(task=seqio_tasks.QA, split="test", module=MODULE),
      "has no split 'test'",
    ),
  ):
    with pytest.raises(jobs.JobError, match=message):
      jobs.run_score(
        jobs.ScoreJob(
          seqio=source,
          output=out,
          model=jobs.ModelConfig(name="random:tiny"),
          progress=False,
        )
      )
  with pytest.raises(ValueError, match="give one input"):
    jobs.ScoreJob(
      input="x.txt", seqio=jobs.SeqioInput(task=seqio_tasks.QA), output=out
    )
  with pytest.raises(ValueError, match="give one of --seqio_task"):
    jobs.SeqioInput(task="a", mixture="b")
  code, _, err = _main(
    "score",
    ["--seqio_module=no.such.module", "--seqio_task=x", f"--output={out}"],
    capsys,
  )
  assert (
    code == 1 and "--seqio_module='no.such.module' cannot be imported" in err
  )
