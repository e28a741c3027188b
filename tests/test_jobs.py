"""Batch jobs (chunkwise.jobs, scripts/score.py, scripts/generate.py): input
checks, batching, resumable output, the scripts' mains on the tiny preset,
a SIGKILLed job resumed, and two processes x 4 devices against one x 8."""

import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from absl import flags

import chunkwise as cw
from chunkwise import jobs
from chunkwise.jobs import batching, examples, output, samples
from tests.test_multihost import _free_port, _worker_env

ROOT = pathlib.Path(__file__).parents[1]


def _write(path, lines):
  path.write_text("".join(line + "\n" for line in lines))
  return str(path)


def _records(path):
  return [json.loads(line) for line in open(path)]


# -- input -------------------------------------------------------------------


def test_reads_jsonl_and_text(tmp_path):
  path = _write(
    tmp_path / "in.jsonl",
    [
      '{"id": 1, "text": "a b"}',
      '{"id": "x", "context": "c", "continuation": " d"}',
    ],
  )
  found = examples.read(path, kind=examples.SCORE)
  assert found.items == [
    examples.Example(1, 1, "a b"),
    examples.Example("x", 2, " d", "c"),
  ]
  text = _write(tmp_path / "in.txt", ["first line", "  second"])
  found = examples.read(text, kind=examples.GENERATE)
  assert [(e.id, e.text) for e in found.items] == [
    (1, "first line"),
    (2, "  second"),
  ]


@pytest.mark.parametrize(
  "line, reason",
  [
    ('{"id": 2, "text": "b"', "invalid JSON"),
    ('{"text": "b"}', "missing field 'id'"),
    ('{"id": 2}', "missing field 'text'"),
    ('{"id": 2, "text": "   "}', "field 'text' is empty"),
    ('{"id": 2, "text": 5}', "field 'text' is int 5, expected a string"),
    ('{"id": [2], "text": "b"}', "id [2] is not a string or an integer"),
    ('{"id": 1, "text": "b"}', "duplicate id 1 (first on line 1)"),
    ('{"id": 2, "context": "a"}', "missing field 'continuation'"),
    ("[1, 2]", "expected a JSON object"),
    ("", "empty line"),
  ],
)
def test_bad_lines_are_named(tmp_path, line, reason):
  path = _write(
    tmp_path / "in.jsonl",
    ['{"id": 1, "text": "a"}', line, '{"id": 3, "text": "c"}'],
  )
  with pytest.raises(examples.InputError) as e:
    examples.read(path, kind=examples.SCORE)
  assert str(e.value).startswith(f"{path}:2: {reason}")
  found = examples.read(path, kind=examples.SCORE, skip_bad=True)
  assert [e.id for e in found.items] == [1, 3]
  assert [m.split(": ", 1)[0] for m in found.messages] == [f"{path}:2"]


def test_invalid_utf8_and_length_limits(tmp_path):
  path = tmp_path / "in.txt"
  path.write_bytes(b"ok\n\xff\xfe\nfine and long\n")
  found = examples.read(path, kind=examples.SCORE, skip_bad=True)
  assert "not valid UTF-8" in found.messages[0]
  vocab = cw.ByteVocabulary()
  encode = lambda e: ([1, *vocab.encode(e.text)], 1)
  with pytest.raises(examples.InputError, match=r"in.txt:2: .*1 more bad"):
    examples.prepare(found, encode, limit=10, reserved=2, reserved_for="x")
  assert found.messages[1].endswith(
    "in.txt:3: 14 tokens + 2 for x exceed --max_len=10"
  )
  found = examples.read(path, kind=examples.SCORE, skip_bad=True)
  kept = examples.prepare(found, encode, limit=10, skip_bad=True)
  assert [p.example.id for p in kept] == [1]
  assert len(found.bad) == 2


def test_hostile_lines_are_bad_lines(tmp_path):
  deep = "[" * 40 + "]" * 40
  lines = [
    '{"id": 1, "text": "ok"}',
    '{"id": 2, "text": "' + "x" * 5000 + '"}',
    '{"id": 3, "text": "a", "meta": ' + deep + "}",
    '{"id": 4, "text": "a\\ud800"}',
    '{"id": "\\udfff", "text": "a"}',
    '{"id": "../../escape", "text": "b"}',
  ]
  path = _write(tmp_path / "in.jsonl", lines)
  found = examples.read(
    path, kind=examples.SCORE, skip_bad=True, max_line_bytes=1000
  )
  assert [e.id for e in found.items] == [1, "../../escape"]
  assert found.messages == [
    f"{path}:2: line longer than --max_line_bytes=1000 bytes",
    f"{path}:3: JSON nested deeper than --max_json_depth=32",
    f"{path}:4: field 'text' holds an unpaired surrogate '\\ud800' at "
    "character 1",
    f"{path}:5: id holds an unpaired surrogate '\\udfff' at character 0",
  ]
  # Nesting past Python's recursion limit, on a line within the limit.
  path = _write(tmp_path / "deep.jsonl", ["[" * 10**5 + "]" * 10**5])
  with pytest.raises(examples.InputError, match=":1: JSON nested deeper"):
    examples.read(path, kind=examples.SCORE)


def test_ids_are_data_never_file_names(tmp_path, capsys):
  work = tmp_path / "a" / "b"
  work.mkdir(parents=True)
  lines = [
    json.dumps({"id": "../../escape", "text": "x y"}),
    json.dumps({"id": "/tmp/abs", "text": "z"}),
    json.dumps({"id": 3, "text": "w" * 300}),
  ]
  path = _write(work / "in.jsonl", lines)
  out = work / "out.jsonl"
  code, summary, _ = _main(
    "score",
    [
      f"--input={path}",
      f"--output={out}",
      "--max_line_bytes=100",
      "--skip_bad_lines",
    ],
    capsys,
  )
  assert code == 0 and summary["skipped_bad_lines"] == 1
  assert [r["id"] for r in _records(out)] == ["../../escape", "/tmp/abs"]
  assert sorted(p.name for p in work.iterdir()) == [
    "in.jsonl",
    "out.jsonl",
    "out.jsonl.job.json",
  ]
  assert not (tmp_path / "escape").exists()


# -- batching ----------------------------------------------------------------


def test_batches_are_bucketed_longest_first_and_padded():
  lengths = [5, 40, 17, 3, 40]
  plan = batching.batches(lengths, batch_size=2, limit=48)
  assert [b.indices for b in plan] == [(1, 4), (2, 0), (3, None)]
  assert [b.time for b in plan] == [48, 32, 16]
  assert batching.bucket(100, limit=64) == 100  # never below the row
  assert batching.owned(plan[2], 0, 2) == [0]
  assert batching.owned(plan[2], 1, 2) == []
  assert batching.owned(plan[0], 1, 2) == [1]


# -- output ------------------------------------------------------------------


def _ids(record):
  return examples.id_key(record["id"])


def test_output_repairs_a_partial_line_and_skips_written_ids(tmp_path):
  path = tmp_path / "out.jsonl"
  out = output.Output(str(path), key=_ids)
  out.append([{"id": 1, "v": 1}, {"id": "1", "v": 2}])
  with open(path, "ab") as f:
    f.write(b'{"id": 2, "v"')  # a write cut by a kill
  out = output.Output(str(path), key=_ids)
  assert out.done == {"1", '"1"'}
  assert path.read_bytes().endswith(b"}\n")
  out.append([{"id": 1, "v": 9}, {"id": 2, "v": 3}])  # 1 is not rewritten
  out.finish(["2", '"1"', "1"])
  assert [r["id"] for r in _records(path)] == [2, "1", 1]
  assert _records(path)[2]["v"] == 1


def test_output_shards_merge_and_foreign_files_refused(tmp_path):
  path = str(tmp_path / "out.jsonl")
  one = output.Output(path, process=1, processes=2, key=_ids)
  one.append([{"id": 5}])
  zero = output.Output(path, process=0, processes=2, key=_ids)
  assert zero.done == {"5"}
  zero.append([{"id": 4}])
  zero.finish(["4", "5"])
  assert [r["id"] for r in _records(path)] == [4, 5]
  assert not [f for f in os.listdir(tmp_path) if "process" in f]
  bad = _write(tmp_path / "other.jsonl", ["not json"])
  with pytest.raises(output.OutputError, match=r"other.jsonl:1: not a record"):
    output.Output(bad)
  samples = _write(tmp_path / "s.jsonl", ['{"id": 1, "sample": 0}'])
  with pytest.raises(output.OutputError, match=r"s.jsonl:1: not a record"):
    output.Output(samples)  # scoring keys need num_tokens and logprob
  lost = output.Output(str(tmp_path / "lost.jsonl"), process=0, processes=2)
  with pytest.raises(output.OutputError, match=r"cannot see .*process-1-of-2"):
    lost.check_shards()
  lost.append([{"id": 1, "num_tokens": 1, "logprob": 0.0}])
  with pytest.raises(output.OutputError, match="1 records are missing"):
    lost.finish(["1", "2"])


def test_output_refuses_other_settings(tmp_path):
  path = str(tmp_path / "out.jsonl")
  output.Output(path, settings={"top_n": 2, "model": "m"})
  output.Output(path, settings={"model": "m", "top_n": 2})
  with pytest.raises(
    output.OutputError, match=r"other settings \(top_n: 2 then, 3 now\)"
  ):
    output.Output(path, settings={"top_n": 3, "model": "m"})


def test_describe_reads_a_checkpoint_without_its_weights(tmp_path):
  model = cw.InferenceModel.random(cw.configs.get("tiny"), seed=0)
  path = cw.save(model, tmp_path / "ckpt")
  described = cw.checkpoints.describe(path)
  assert described.hparams == model.hparams
  assert (described.bos_id, described.eos_id) == (model.bos_id, model.eos_id)
  assert described.vocab == model.vocab
  with pytest.raises(FileNotFoundError, match="neither a known model"):
    cw.checkpoints.describe(tmp_path / "nothing")


def test_stop_strings_and_sample_ids():
  vocab = cw.ByteVocabulary()
  tokens = vocab.encode("yes.\nno")
  kept, text, stopped = samples.cut_at_stop(vocab, tokens, ["\n"])
  assert (text, stopped, vocab.decode(kept)) == ("yes.", True, "yes.\n")
  assert samples.cut_at_stop(vocab, tokens, ["zz"])[1:] == (
    "yes.\nno",
    False,
  )
  assert samples.sample_id("a", 0) == samples.sample_id("a", 0)
  assert len({samples.sample_id(i, s) for i in (1, "1") for s in (0, 1)}) == 4


# -- the scripts' mains, in this process --------------------------------------


def _script(name):
  module = f"chunkwise_script_{name}"
  if module not in sys.modules:
    spec = importlib.util.spec_from_file_location(
      module, ROOT / "scripts" / f"{name}.py"
    )
    sys.modules[module] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[module])
  return sys.modules[module]


def _main(name, args, capsys=None):
  """Runs scripts/<name>.py's main with `args`; returns (exit code, the
  summary dict or None, stderr)."""
  script = _script(name)
  flags.FLAGS.unparse_flags()
  flags.FLAGS([f"{name}.py", "--model=random:tiny", "--progress=false", *args])
  code = 0
  try:
    script.main([f"{name}.py"])
  except SystemExit as e:
    code = e.code
  finally:
    flags.FLAGS.unparse_flags()
  out, err = capsys.readouterr() if capsys else ("", "")
  _main.stdout = out
  summary = [line for line in out.splitlines() if line.startswith("summary ")]
  return code, json.loads(summary[-1][8:]) if summary else None, err


TEXTS = [
  {"id": 1, "text": "The cat sat on the mat."},
  {"id": "two", "context": "Paris is in", "continuation": " France."},
  {"id": 3, "text": "Colorless green ideas sleep furiously."},
]


def test_score_main_matches_prefill(tmp_path, capsys):
  path = _write(tmp_path / "in.jsonl", [json.dumps(t) for t in TEXTS])
  out = tmp_path / "out.jsonl"
  args = [f"--input={path}", f"--output={out}", "--batch_size=2"]
  code, summary, _ = _main("score", [*args, "--top_n=3", "--tokens"], capsys)
  assert code == 0
  got = {r["id"]: r for r in _records(out)}
  assert list(got) == [1, "two", 3]  # input order
  model = cw.InferenceModel.random(cw.configs.get("tiny"), seed=0)
  vocab = model.vocab
  rows = [
    [1, *vocab.encode(TEXTS[0]["text"])],
    [1, *vocab.encode("Paris is in"), *vocab.encode(" France.")],
    [1, *vocab.encode(TEXTS[2]["text"])],
  ]
  result = model.prefill(cw.Chunk.from_lists(rows), top_n=3)
  starts = [1, 1 + len(vocab.encode("Paris is in")), 1]
  for (key, record), row, start, b in zip(
    got.items(), rows, starts, range(3), strict=True
  ):
    want = np.asarray(result.per_token_scores[b, start : len(row)])
    np.testing.assert_allclose(record["token_logprobs"], want, atol=2e-5)
    assert record["num_tokens"] == len(row) - start, key
    assert record["tokens"] == row[start:]
    assert abs(record["logprob"] - want.sum()) < 1e-4
    assert (
      record["top_n"]["ids"]
      == np.asarray(result.top_ids[b, start : len(row)]).tolist()
    )
    assert record["top_n"]["tokens"][0][0] == vocab.decode(
      [record["top_n"]["ids"][0][0]]
    )
  assert summary["examples"] == 3 and summary["skipped_bad_lines"] == 0
  tokens = sum(r["num_tokens"] for r in got.values())
  assert summary["tokens"] == tokens
  nll = -sum(r["logprob"] for r in got.values()) / tokens
  assert abs(summary["perplexity"] - np.exp(nll)) < 1e-2 * np.exp(nll)
  # A shared prefix: the same as prefilling it, then each text after it.
  prefixed = tmp_path / "prefixed.jsonl"
  code, _, _ = _main(
    "score",
    [
      f"--input={path}",
      f"--output={prefixed}",
      "--shared_prefix=Q: ",
      "--batch_size=3",
    ],
    capsys,
  )
  first = model.prefill(cw.Chunk.from_lists([[1, *vocab.encode("Q: ")]]))
  after = model.prefill(
    cw.Chunk.from_lists([vocab.encode(TEXTS[2]["text"])]), prefix=[first]
  )
  np.testing.assert_allclose(
    _records(prefixed)[2]["token_logprobs"],
    np.asarray(after.per_token_scores[0]),
    atol=2e-5,
  )


def test_jobs_from_python_write_what_the_scripts_write(tmp_path, capsys):
  """`run_score` / `run_generate` on configs give byte-identical output
  files (settings included) and the summary the scripts print."""
  path = _write(tmp_path / "in.jsonl", [json.dumps(t) for t in TEXTS])
  prompts = _write(tmp_path / "prompts.txt", ["Hello", "The end"])
  model = jobs.ModelConfig(name="random:tiny")
  for name, job, args in (
    (
      "score",
      jobs.ScoreJob(
        input=path,
        output=str(tmp_path / "py-score.jsonl"),
        model=model,
        top_n=2,
        batch_size=2,
        progress=False,
      ),
      ["--top_n=2", "--batch_size=2"],
    ),
    (
      "generate",
      jobs.GenerateJob(
        input=prompts,
        output=str(tmp_path / "py-generate.jsonl"),
        model=model,
        num_samples=2,
        steps=6,
        sampling=cw.Sampling(temperature=0.8, top_k=20, seed=3),
        stop=("e",),
        progress=False,
      ),
      [
        "--num_samples=2",
        "--steps=6",
        "--temperature=0.8",
        "--top_k=20",
        "--seed=3",
        "--stop=e",
      ],
    ),
  ):
    run = jobs.run_score if name == "score" else jobs.run_generate
    summary = run(job)
    out = tmp_path / f"cli-{name}.jsonl"
    code, printed, _ = _main(
      name, [f"--input={job.input}", f"--output={out}", *args], capsys
    )
    assert code == 0
    assert pathlib.Path(job.output).read_bytes() == out.read_bytes(), name
    settings = [pathlib.Path(f"{p}.job.json") for p in (job.output, out)]
    if all(s.exists() for s in settings):
      assert settings[0].read_bytes() == settings[1].read_bytes(), name
    drop = ("output", "seconds", "tokens_per_s")
    assert {k: v for k, v in summary.items() if k not in drop} == {
      k: v for k, v in printed.items() if k not in drop
    }


def test_job_configs_check_their_values(tmp_path):
  path = _write(tmp_path / "in.txt", ["hello"])
  base = dict(input=path, output=str(tmp_path / "o.jsonl"))
  cfg = jobs.ModelConfig(name="random:tiny", layout="ws_1d", mesh="1x2x4")
  assert cfg.layout == cw.Layout.parse("ws_1d") and cfg.mesh == (1, 2, 4)
  assert jobs.ModelConfig(quantize="int8").quantize is jobs.Quantization.INT8
  job = jobs.ScoreJob(**base, input_format="text")
  assert job.input_format is jobs.InputFormat.TEXT
  assert job.kind is jobs.JobKind.SCORE
  assert jobs.GenerateJob(**base).kind is jobs.JobKind.GENERATE
  for make, message in (
    (lambda: jobs.ModelConfig(quantize="int4"), "quantize='int4'"),
    (lambda: jobs.ModelConfig(dtype="float16"), "dtype='float16'"),
    (lambda: jobs.ModelConfig(layout="ws_9d"), "ws_9d"),
    (lambda: jobs.ScoreJob(input="", output="o"), "--input is required"),
    (lambda: jobs.ScoreJob(**base, batch_size=0), "--batch_size=0"),
    (lambda: jobs.ScoreJob(**base, input_format="csv"), "input_format='csv'"),
    (
      lambda: jobs.GenerateJob(**base, sampling=cw.Sampling(top_p=0.0)),
      "top_p",
    ),
    (lambda: jobs.GenerateJob(**base, stop=("",)), "--stop='' is empty"),
  ):
    with pytest.raises(ValueError, match=re.escape(message)):
      make()
  # A job that is fine as a config but not for its model: JobError, one
  # line, nothing written.
  bad = jobs.ScoreJob(
    **base, model=jobs.ModelConfig(name="random:tiny"), top_n=10**6
  )
  with pytest.raises(jobs.JobError, match="--top_n=1000000 exceeds"):
    jobs.run_score(bad)
  assert not (tmp_path / "o.jsonl").exists()


def test_broken_line_fails_before_writing_or_is_skipped(tmp_path, capsys):
  lines = [json.dumps(t) for t in TEXTS]
  lines.insert(2, '{"id": 9, "text": ""}')
  path = _write(tmp_path / "in.jsonl", lines)
  out = tmp_path / "out.jsonl"
  args = [f"--input={path}", f"--output={out}", "--batch_size=2"]
  code, summary, err = _main("score", args, capsys)
  assert code == 1 and summary is None
  assert f"{path}:3: field 'text' is empty" in err
  assert not out.exists()
  code, summary, _ = _main("score", [*args, "--skip_bad_lines"], capsys)
  assert code == 0
  assert summary["skipped_bad_lines"] == 1 and summary["examples"] == 3
  assert [r["id"] for r in _records(out)] == [1, "two", 3]


def test_bad_flags_exit_with_one_line(tmp_path, capsys):
  path = _write(tmp_path / "in.txt", ["hello"])
  out = tmp_path / "o.jsonl"
  base = [f"--input={path}", f"--output={out}"]
  long = "x" * 600
  long_path = _write(tmp_path / "long.txt", [long])
  cases = {
    "score": [
      ([*base, "--top_n=99999"], "--top_n=99999 exceeds the vocabulary"),
      ([*base, "--max_len=99999"], "exceeds the model's max_len 512"),
      ([*base, "--layout=ws_9d"], "ws_9d"),
      ([f"--input={long_path}", f"--output={out}"], "long.txt:1: 601 tokens"),
      # Random weights are drawn on the device: one that cannot hold them
      # is refused before any output exists.
      ([*base, "--model=random:palm-540b"], "too large: they need 2161"),
    ],
    "generate": [
      ([*base, "--stop_ids=7,x"], "--stop_ids: 'x' is not an integer"),
      ([*base, "--steps=508"], "1: 6 tokens + 508 for --steps=508 exceed"),
      ([*base, "--steps=600"], "--max_len=512 leaves no room for an example"),
      ([*base, "--stop=\\x"], "--stop='\\\\x': bad escape"),
      ([f"--input={path}", f"--output={path}"], "--output is the --input"),
    ],
  }
  for name, runs in cases.items():
    for args, message in runs:
      code, _, err = _main(name, args, capsys)
      assert code == 1 and message in err, (args, err)
      assert len(err.strip().splitlines()) == 1, err
      assert not out.exists()


def test_generate_main_samples_and_resumes(tmp_path, capsys):
  path = _write(tmp_path / "p.txt", ["Hello", "Once upon a time", "The end"])
  out = tmp_path / "g.jsonl"
  args = [
    f"--input={path}",
    f"--output={out}",
    "--batch_size=2",
    "--num_samples=2",
    "--steps=20",
    "--temperature=0.8",
    "--stream",
  ]
  code, summary, _ = _main("generate", args, capsys)
  assert code == 0
  records = _records(out)
  assert [(r["id"], r["sample"]) for r in records] == [
    (i, s) for i in (1, 2, 3) for s in (0, 1)
  ]
  assert summary["samples"] == 6
  assert _main.stdout.startswith(records[0]["text"] + "\n")  # --stream
  model = cw.InferenceModel.random(cw.configs.get("tiny"), seed=0)
  vocab = model.vocab
  # Sample ids make each record independent of its batch: regenerate the
  # second prompt's samples alone.
  prompt = model.prefill(
    cw.Chunk.from_lists([[1, *vocab.encode("Once upon a time")]])
  )
  ids = [samples.sample_id(2, s) for s in (0, 1)]
  tokens, result = model.generate(
    [prompt],
    sample_ids=np.asarray(ids),
    steps=20,
    sampling=cw.Sampling(temperature=0.8),
  )
  for s, row in enumerate(tokens.to_lists()):
    assert records[2 + s]["tokens"] == row
    assert records[2 + s]["text"] == vocab.decode(row)
    np.testing.assert_allclose(
      records[2 + s]["token_logprobs"],
      np.asarray(result.per_token_scores[s, : len(row)]),
      atol=2e-5,
    )
    assert records[2 + s]["finish_reason"] == (
      "length" if len(row) == 20 else "stop"
    )
  # Drop the last example's lines: a re-run writes only those, the same.
  before = out.read_bytes()
  out.write_bytes(b"".join(before.splitlines(keepends=True)[:4]))
  code, summary, _ = _main("generate", args, capsys)
  assert summary["run_now"] == 1 and summary["resumed"] == 2
  assert out.read_bytes() == before
  # Speculation changes no sample, in slots or static batches; the
  # summary has its counts.
  for extra in (
    ["--speculate=ngram", "--speculate_k=4"],
    ["--speculate=draft", "--static_batching"],
  ):
    spec_out = tmp_path / f"spec-{extra[1][2:8]}.jsonl"
    code, summary, _ = _main(
      "generate",
      [
        *args[:1],
        f"--output={spec_out}",
        *args[2:],
        *extra,
      ],
      capsys,
    )
    assert code == 0
    key = lambda r: (str(r["id"]), r["sample"])
    assert sorted(_records(spec_out), key=key) == sorted(records, key=key)
    counts = summary["speculation"]
    assert counts["steps"] > 0 and counts["draft_tokens"] >= 0
  # Other sampling flags cannot resume this output.
  code, _, err = _main("generate", [*args, "--seed=1"], capsys)
  assert code == 1 and "seed: 0 then, 1 now" in err
  # A stop string: each sample is cut where the text first holds it.
  row = next(r for r in records if any(c.isalnum() for c in r["text"][1:]))
  stop = next(c for c in row["text"][1:] if c.isalnum())
  stopped = tmp_path / "stopped.jsonl"
  args = [a for a in args if not a.startswith("--output")]
  code, _, _ = _main(
    "generate", [*args, f"--output={stopped}", f"--stop={stop}"], capsys
  )
  for full, cut in zip(records, _records(stopped), strict=True):
    if stop in full["text"]:
      assert cut["text"] == full["text"][: full["text"].index(stop)]
      assert cut["finish_reason"] == "stop"
      assert stop in vocab.decode(cut["tokens"])
      assert stop not in vocab.decode(cut["tokens"][:-1])
      n = len(cut["tokens"])
      assert cut["tokens"] == full["tokens"][:n]
      assert cut["token_logprobs"] == full["token_logprobs"][:n]
    else:
      assert cut == full


# -- subprocesses: a killed job, several processes --------------------------


def test_bad_flag_values_exit_with_one_line(tmp_path):
  path = _write(tmp_path / "in.txt", ["hello"])
  job = subprocess.run(
    [
      sys.executable,
      str(ROOT / "scripts" / "score.py"),
      f"--input={path}",
      f"--output={tmp_path / 'o.jsonl'}",
      "--batch_size=0",
    ],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert job.returncode == 1
  assert (
    job.stderr.strip().splitlines()
    == ["score.py: bad flag: flag --batch_size=0: 0 is not a positive integer"]
    or "--batch_size=0" in job.stderr.strip()
  ), job.stderr
  assert len(job.stderr.strip().splitlines()) == 1, job.stderr


def _job(name, args, env=None, **kwargs):
  return subprocess.Popen(
    [sys.executable, str(ROOT / "scripts" / f"{name}.py"), *args],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    **kwargs,
  )


@pytest.mark.slow
def _whole_then_killed(name, args, whole, cut, *, lines: int, delay: float):
  """Runs job `name` whole into `whole`, then again (throttled by `delay`)
  into `cut`, SIGKILLed once `cut` holds `lines` lines; returns the lines
  it holds then."""
  job = _job(name, [*args, f"--output={whole}"])
  assert job.wait(timeout=300) == 0, job.stdout.read().decode()[-3000:]
  job = _job(name, [*args, f"--output={cut}", f"--batch_delay_s={delay}"])
  deadline = time.monotonic() + 300
  while not cut.exists() or cut.read_bytes().count(b"\n") < lines:
    assert job.poll() is None, job.stdout.read().decode()[-3000:]
    assert time.monotonic() < deadline
    time.sleep(0.05)
  job.send_signal(signal.SIGKILL)
  job.wait()
  return cut.read_bytes().count(b"\n")


def test_killed_scoring_job_resumes(tmp_path):
  texts = [
    {"id": f"t{i}", "text": "word " * (i % 7 + 1) + str(i)} for i in range(40)
  ]
  path = _write(tmp_path / "in.jsonl", [json.dumps(t) for t in texts])
  args = [
    "--model=random:tiny",
    f"--input={path}",
    "--batch_size=2",
    "--progress=false",
    "--top_n=2",
  ]
  whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
  written = _whole_then_killed("score", args, whole, cut, lines=6, delay=0.3)
  assert 6 <= written < len(texts)
  with open(cut, "ab") as f:
    f.write(b'{"id": "t3", "num_tok')  # as if killed inside a write
  job = _job("score", [*args, f"--output={cut}"])
  log = job.communicate(timeout=300)[0].decode()
  assert job.returncode == 0, log[-3000:]
  assert "partial line" in log
  summary = json.loads(log.split("summary ", 1)[1].splitlines()[0])
  assert summary["resumed"] == written
  assert summary["run_now"] == len(texts) - written
  assert [r["id"] for r in _records(cut)] == [t["id"] for t in texts]
  assert cut.read_bytes() == whole.read_bytes()


def test_killed_continuous_generation_resumes(tmp_path, capsys):
  """Continuous batching (the default): a job killed mid-way resumes to the
  bytes of an uninterrupted run; --static_batching gives the same tokens
  (it and the refusal below run in this process: a job process spends
  seconds importing JAX)."""
  prompts = [
    {"id": f"p{i}", "prompt": "word " * (i % 5) + str(i)} for i in range(24)
  ]
  path = _write(tmp_path / "in.jsonl", [json.dumps(p) for p in prompts])
  args = [
    "--model=random:tiny",
    f"--input={path}",
    "--batch_size=4",
    "--slots=3",
    "--num_samples=2",
    "--steps=24",
    "--temperature=0.9",
    "--stop_ids=" + ",".join(str(i) for i in range(40, 80)),
    "--progress=false",
  ]
  whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
  written = _whole_then_killed("generate", args, whole, cut, lines=8, delay=0.2)
  assert 8 <= written < 2 * len(prompts)
  job = _job("generate", [*args, f"--output={cut}"])
  log = job.communicate(timeout=300)[0].decode()
  assert job.returncode == 0, log[-3000:]
  assert cut.read_bytes() == whole.read_bytes()
  records = _records(whole)
  assert {r["finish_reason"] for r in records} == {"stop", "length"}
  static = tmp_path / "static.jsonl"
  code, _, err = _main(
    "generate", [*args, f"--output={static}", "--static_batching"], capsys
  )
  assert code == 0, err[-3000:]
  for a, b in zip(records, _records(static), strict=True):
    assert a["tokens"] == b["tokens"] and a["text"] == b["text"]
    np.testing.assert_allclose(
      a["token_logprobs"], b["token_logprobs"], atol=1e-5
    )
  # Other slots would round differently: that output does not resume.
  code, _, err = _main(
    "generate", [*args, f"--output={cut}", "--slots=2"], capsys
  )
  assert code == 1 and "slots: 3 then, 2 now" in err, err[-2000:]


def _two_processes(name, args, out, env):
  port = _free_port()
  jobs = [
    _job(
      name,
      [
        *args,
        f"--output={out}",
        "--cpu_devices=4",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        f"--process_id={i}",
      ],
      env=env,
    )
    for i in range(2)
  ]
  logs = [j.communicate(timeout=300)[0].decode() for j in jobs]
  for job, log in zip(jobs, logs, strict=True):
    assert job.returncode == 0, log[-4000:]


@pytest.mark.slow
@pytest.mark.multihost
# The scoring job over two processes is tests/test_jobs_adapters.py's
# test_two_processes_match_one_with_adapters (base rows among adapters').
@pytest.mark.parametrize("name", ["generate"])
def test_two_processes_match_one(tmp_path, name):
  lines = [
    json.dumps({"id": f"e{i}", "text": "word " * (3 * i + 1) + str(i)})
    for i in range(11)
  ]
  path = _write(tmp_path / "in.jsonl", lines)
  args = [
    "--model=random:tiny",
    f"--input={path}",
    "--layout=wg",
    "--mesh=2x2x2",
    "--batch_size=8",
    "--progress=false",
    "--shared_prefix=Q: ",
  ]
  args += (
    ["--top_n=3"]
    if name == "score"
    else ["--num_samples=2", "--steps=12", "--temperature=0.9", "--stream"]
  )
  one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
  # One process with all 8 devices, compiled with the same XLA flags as
  # the two workers (bit-identical output needs identical code).
  env = _worker_env()
  env["XLA_FLAGS"] = " ".join(
    [
      env.get("XLA_FLAGS", ""),
      "--xla_force_host_platform_device_count=8",
    ]
  ).strip()
  job = _job(name, [*args, f"--output={one}"], env=env)
  log = job.communicate(timeout=300)[0].decode()
  assert job.returncode == 0, log[-4000:]
  _two_processes(name, args, two, _worker_env())
  assert sorted(one.read_bytes().splitlines()) == sorted(
    two.read_bytes().splitlines()
  )
  assert one.read_bytes() == two.read_bytes()  # both in input order
  assert len(_records(two)) == 11 * (2 if name == "generate" else 1)
  assert not [f for f in os.listdir(tmp_path) if ".process-" in f]


def test_generate_main_constraints(tmp_path, capsys):
  """--choices / --json_schema=@file / --regex constrain every sample;
  conflicting or unsupported ones are usage errors before any work."""
  path = _write(tmp_path / "p.txt", ["Yes or no?", "Maybe?"])
  schema = tmp_path / "s.json"
  schema.write_text(
    json.dumps(
      {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
      }
    )
  )
  common = [f"--input={path}", "--num_samples=3", "--steps=24"]
  for flag, valid in (
    ("--choices=yes,no", lambda t: t in ("yes", "no")),
    (f"--json_schema=@{schema}", lambda t: type(json.loads(t)["n"]) is int),
    ("--regex=[a-c]{3}", lambda t: re.fullmatch("[a-c]{3}", t)),
    (
      f"--json_schema=@{schema} --schema_whitespace=compact --fast_forward",
      lambda t: re.fullmatch(r'\{"n":-?[0-9]+\}', t),
    ),
  ):
    out = tmp_path / f"{flag[2:6]}{len(flag)}.jsonl"
    code, summary, _ = _main(
      "generate",
      [*common, f"--output={out}", *flag.split(" "), "--budget_forcing"],
      capsys,
    )
    assert code == 0, flag
    records = _records(out)
    assert len(records) == 6 and summary["finish_reasons"] == {"stop": 6}
    assert all(valid(r["text"]) for r in records), records
    # JSON-schema rows are validated after generation, and say so.
    schema_rows = flag.startswith("--json_schema")
    assert all(("schema_valid" in r) == schema_rows for r in records)
    assert all(r["schema_valid"] for r in records if schema_rows)
  out = f"--output={tmp_path / 'bad.jsonl'}"
  for args, message in (
    (["--regex=a", "--choices=a"], "give one of --regex, --json_schema"),
    (
      ['--json_schema={"type": "integer", "minimum": 1}', "--schema_strict"],
      "'minimum'",
    ),
    (["--regex=(a"], "--regex: the constraint '(a' is not a supported"),
    (["--budget_forcing"], "--budget_forcing needs --regex"),
    (["--fast_forward"], "--fast_forward needs --regex"),
    (
      ["--regex=a", "--schema_whitespace=compact"],
      "--schema_whitespace=compact needs --json_schema",
    ),
  ):
    code, _, err = _main("generate", [*common, out, *args], capsys)
    assert code == 1 and message in err, (args, err)
  assert not (tmp_path / "bad.jsonl").exists()
