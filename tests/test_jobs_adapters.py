"""Batch jobs with LoRA adapters (--adapters, a JSON line's "adapter",
--adapter): rows of two adapters and the base model in one batch equal
direct `with_adapters(...).prefill / generate` calls, with and without a
shared prefix (prefilled once per adapter), static and continuous; bad
adapters and unknown names are refused before any output; a resume with
another adapter file (checksum) is refused; the scripts' flags parse."""

import json
import pathlib
import re

import numpy as np
import pytest
from safetensors.numpy import save_file

import chunkwise as cw
from chunkwise import jobs
from chunkwise.jobs import adapters, driver, job_setup, samples, scoring
from tests.test_jobs import _job, _main, _records, _two_processes, _write
from tests.test_multihost import _worker_env

TINY = cw.configs.get("tiny")
GREEDY = cw.Sampling(temperature=0.0)
PREFIX = "base_model.model.model.layers."
# PEFT module -> (block, in features, out features) for `TINY`.
_MODULES = {
  "q_proj": ("self_attn", 64, 8 * 16),
  "k_proj": ("self_attn", 64, 2 * 16),
  "v_proj": ("self_attn", 64, 2 * 16),
  "o_proj": ("self_attn", 8 * 16, 64),
  "gate_proj": ("mlp", 64, 128),
  "up_proj": ("mlp", 64, 128),
  "down_proj": ("mlp", 128, 64),
}


def write_adapter(directory, *, rank, seed, modules=tuple(_MODULES)):
  """A PEFT LoRA directory of random A and B for the `tiny` preset (what
  `save_pretrained` writes: adapter_config.json, safetensors)."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  tensors = {}
  for layer in range(TINY.layers):
    for module in modules:
      block, ins, outs = _MODULES[module]
      name = f"{PREFIX}{layer}.{block}.{module}"
      a = rng.normal(scale=0.3, size=(rank, ins)).astype(np.float32)
      b = rng.normal(scale=0.3, size=(outs, rank)).astype(np.float32)
      tensors[f"{name}.lora_A.weight"] = a
      tensors[f"{name}.lora_B.weight"] = b
  save_file(tensors, str(directory / "adapter_model.safetensors"))
  config = dict(
    peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=modules
  )
  (directory / "adapter_config.json").write_text(json.dumps(config))
  return str(directory)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """(the job's random:tiny model serving "a" and "b", {name: path})."""
  root = tmp_path_factory.mktemp("adapters")
  paths = {
    "a": write_adapter(root / "a", rank=4, seed=1),
    "b": write_adapter(
      root / "b", rank=2, seed=2, modules=("q_proj", "v_proj", "down_proj")
    ),
  }
  base = cw.InferenceModel.random(TINY, seed=0)
  loaded = {n: cw.load_adapter(p, TINY) for n, p in paths.items()}
  return base.with_adapters(loaded), paths


def _flag(paths):
  return ",".join(f"{n}={p}" for n, p in paths.items())


# Four examples: "a", the default (no field), "b", the base model (null).
TEXTS = [
  {"id": 1, "text": "The cat sat on the mat today.", "adapter": "a"},
  {"id": 2, "text": "Colorless green ideas."},
  {
    "id": 3,
    "context": "Paris is in",
    "continuation": " France.",
    "adapter": "b",
  },
  {"id": 4, "text": "Hello there", "adapter": None},
]


def _score_rows(vocab, prefix):
  """(row, scored_from) of each of TEXTS, as `scoring.encode` makes them."""
  head = [] if prefix else [1]
  rows = []
  for t in TEXTS:
    context = vocab.encode(t["context"]) if "context" in t else []
    text = t.get("continuation", t.get("text"))
    rows.append(([*head, *context, *vocab.encode(text)], len(head + context)))
  return rows


def _score_job(tmp_path, paths, name, **kwargs):
  path = _write(tmp_path / "in.jsonl", [json.dumps(t) for t in TEXTS])
  return jobs.ScoreJob(
    input=path,
    output=str(tmp_path / f"{name}.jsonl"),
    model=jobs.ModelConfig(name="random:tiny", adapters=paths),
    progress=False,
    **kwargs,
  )


@pytest.mark.parametrize("shared_prefix", ["", "Q: "])
def test_score_job_mixes_adapters_in_a_batch(tmp_path, served, shared_prefix):
  """Two batches of two (longest first: "a" with the default "a"; "b"
  with the base model): one batch of one adapter, one that mixes."""
  model, paths = served
  job = _score_job(
    tmp_path,
    paths,
    "out",
    adapter="a",
    batch_size=2,
    shared_prefix=shared_prefix,
    top_n=2,
  )
  summary = jobs.run_score(job)
  assert summary["examples"] == 4
  records = _records(job.output)
  names = ["a", "a", "b", None]
  assert [r.get("adapter") for r in records] == names
  assert ["adapter" in r for r in records] == [True, True, True, False]
  vocab = model.vocab
  prefix_row = [1, *vocab.encode(shared_prefix)] if shared_prefix else []
  for record, (row, start), name in zip(
    records, _score_rows(vocab, prefix_row), names, strict=True
  ):
    prefix = []
    if prefix_row:  # the shared prefix of the row's own adapter
      chunk = cw.Chunk.from_lists([prefix_row])
      prefix = [model.prefill(chunk, adapters=name)]
    want = model.prefill(
      cw.Chunk.from_lists([row]), prefix=prefix, top_n=2, adapters=name
    )
    scores = np.asarray(want.per_token_scores[0, start:])
    np.testing.assert_allclose(record["token_logprobs"], scores, atol=2e-5)
    assert (
      record["top_n"]["ids"] == np.asarray(want.top_ids[0, start:]).tolist()
    )
  # The adapters change the numbers (else the test would prove nothing).
  if not prefix_row:
    base = model.prefill(cw.Chunk.from_lists([_score_rows(vocab, [])[0][0]]))
    assert not np.allclose(
      records[0]["token_logprobs"], np.asarray(base.per_token_scores[0, 1:])
    )
  settings = json.loads(pathlib.Path(f"{job.output}.job.json").read_text())
  assert settings["adapter"] == "a"
  assert settings["adapters"] == {
    n: a.checksum for n, a in model.adapters.items()
  }


def test_shared_prefix_rows_are_copies_of_each_adapters_prefix(served):
  model, _ = served
  shared = adapters.SharedPrefix.prefill(model, [1, 5, 6, 7], {"b", None})
  assert list(shared.results) == [None, "b"]
  (same,) = shared.rows(["b", "b"])  # one adapter: its batch-1 result
  assert same is shared.results["b"]
  (mixed,) = shared.rows(["b", None, "b"])
  assert mixed.adapters == ("b", None, "b") and mixed.batch == 3
  for r, name in enumerate(["b", None, "b"]):
    one = shared.results[name]
    np.testing.assert_array_equal(mixed.kv_cache.k[:, r], one.kv_cache.k[:, 0])
    np.testing.assert_array_equal(
      mixed.next_token_logits[r], one.next_token_logits[0]
    )
  assert adapters.SharedPrefix.prefill(model, [], {"b"}).rows(["b"]) == []


PROMPTS = [
  {"id": "p1", "prompt": "Once upon a time", "adapter": "a"},
  {"id": "p2", "prompt": "The end"},
  {"id": "p3", "prompt": "Hello", "adapter": "b"},
]


def _alone(model, shared_prefix):
  """{(id, sample): (tokens, token_logprobs)} of PROMPTS, each prompt
  generated on its own (its two samples side by side) with its adapter,
  after the shared prefix computed with that adapter."""
  vocab = model.vocab
  head = [1, *vocab.encode(shared_prefix)] if shared_prefix else []
  out = {}
  for p in PROMPTS:
    name = p.get("adapter")
    prefix = []
    if head:
      prefix = [model.prefill(cw.Chunk.from_lists([head]), adapters=name)]
    row = [*([] if head else [1]), *vocab.encode(p["prompt"])]
    # Padded like a job's rows, so every prompt reuses one program.
    chunk = cw.Chunk.from_lists([row], pad_length=32)
    prompt = model.prefill(chunk, prefix=prefix, adapters=name)
    tokens, result = model.generate(
      [*prefix, prompt],
      sample_ids=[samples.sample_id(p["id"], s) for s in (0, 1)],
      steps=5,
      sampling=GREEDY,
      adapters=name,
    )
    for s, got in enumerate(tokens.to_lists()):
      scores = np.asarray(result.per_token_scores[s, : len(got)])
      out[p["id"], s] = got, scores
  return out


@pytest.fixture(scope="module")
def alone(served):
  """`_alone(served model, shared_prefix)`, computed once per prefix."""
  cache = {}

  def get(shared_prefix):
    if shared_prefix not in cache:
      cache[shared_prefix] = _alone(served[0], shared_prefix)
    return cache[shared_prefix]

  return get


@pytest.mark.parametrize(
  "shared_prefix, static",
  [("", False), ("", True), ("Q: ", False), ("Q: ", True)],
)
def test_generate_job_mixes_adapters(
  tmp_path, served, alone, shared_prefix, static
):
  """Static batching (one batch of three adapters), continuous batching
  (two slots; with a shared prefix, one `generate_many` per adapter):
  each sample equals `generate` of its prompt alone with its adapter."""
  _, paths = served
  path = _write(tmp_path / "in.jsonl", [json.dumps(p) for p in PROMPTS])
  job = jobs.GenerateJob(
    input=path,
    output=str(tmp_path / "out.jsonl"),
    model=jobs.ModelConfig(name="random:tiny", adapters=paths),
    steps=5,
    num_samples=2,
    sampling=GREEDY,
    batch_size=4,
    slots=2,
    static_batching=static,
    shared_prefix=shared_prefix,
    progress=False,
  )
  jobs.run_generate(job)
  records = _records(job.output)
  names = ["a", "a", None, None, "b", "b"]
  assert [r.get("adapter") for r in records] == names
  want = alone(shared_prefix)
  for record in records:
    tokens, scores = want[record["id"], record["sample"]]
    assert record["tokens"] == tokens, record
    np.testing.assert_allclose(record["token_logprobs"], scores, atol=2e-5)


def test_text_input_runs_the_default_adapter(tmp_path, capsys, served):
  model, paths = served
  path = _write(tmp_path / "in.txt", ["first line", "and the second"])
  out = tmp_path / "out.jsonl"
  args = [f"--input={path}", f"--output={out}", f"--adapters={_flag(paths)}"]
  code, summary, err = _main("score", [*args, "--adapter=b"], capsys)
  assert code == 0, err
  records = _records(out)
  assert [r["adapter"] for r in records] == ["b", "b"]
  rows = [[1, *model.vocab.encode(t)] for t in ("first line", "and the second")]
  for record, row in zip(records, rows, strict=True):
    want = model.prefill(cw.Chunk.from_lists([row]), adapters="b")
    np.testing.assert_allclose(
      record["token_logprobs"],
      np.asarray(want.per_token_scores[0, 1:]),
      atol=2e-5,
    )
  # The same flags for generation.
  gen = tmp_path / "gen.jsonl"
  code, summary, err = _main(
    "generate",
    [
      f"--input={path}",
      f"--output={gen}",
      f"--adapters={_flag(paths)}",
      "--adapter=a",
      "--steps=3",
      "--temperature=0",
    ],
    capsys,
  )
  assert code == 0, err
  assert [r["adapter"] for r in _records(gen)] == ["a", "a"]
  assert summary["samples"] == 2


def test_unknown_adapters_are_refused_before_any_output(tmp_path, served):
  _, paths = served
  lines = [
    json.dumps({"id": 1, "text": "fine", "adapter": "a"}),
    json.dumps({"id": "x7", "text": "typo", "adapter": "c"}),
  ]
  path = _write(tmp_path / "in.jsonl", lines)
  out = tmp_path / "out.jsonl"
  model = jobs.ModelConfig(name="random:tiny", adapters=paths)
  job = jobs.ScoreJob(input=path, output=str(out), model=model, progress=False)
  message = (
    f"{path}:2: id 'x7' names adapter 'c', which --adapters does not give "
    "(it gives 'a', 'b')"
  )
  with pytest.raises(jobs.JobError, match=re.escape(message)):
    jobs.run_score(job)
  assert not out.exists()
  # Without --adapters, any name is unknown; null is the base model.
  bare = jobs.ScoreJob(input=path, output=str(out), progress=False)
  with pytest.raises(jobs.JobError, match=r":1: id 1 names adapter 'a'.*none"):
    jobs.run_score(bare)
  assert not out.exists()
  bad = _write(tmp_path / "bad.jsonl", ['{"id": 1, "text": "a", "adapter": 3}'])
  with pytest.raises(jobs.JobError, match="field 'adapter' is int 3"):
    jobs.run_score(jobs.ScoreJob(input=bad, output=str(out), model=model))
  # A bad line like any other: skipped with --skip_bad_lines.
  skip = jobs.ScoreJob(
    input=path,
    output=str(out),
    model=model,
    skip_bad_lines=True,
    progress=False,
  )
  summary = jobs.run_score(skip)
  assert summary["skipped_bad_lines"] == 1
  assert [r["id"] for r in _records(out)] == [1]


def test_bad_adapter_settings_are_refused(tmp_path, capsys, served):
  _, paths = served
  for value, message in (
    ("a", "--adapters='a': 'a' is not name=path"),
    (f"a={paths['a']},a={paths['b']}", "adapter name 'a' is given twice"),
    (f"={paths['a']}", "adapter name '' must be"),
    ("a=", "adapter 'a' has no path"),
    ({"a b": paths["a"]}, "adapter name 'a b' must be"),
    (3, "adapters=3: expected"),
  ):
    with pytest.raises(ValueError, match=re.escape(message)):
      jobs.ModelConfig(name="random:tiny", adapters=value)
  with pytest.raises(ValueError, match=re.escape("--adapter='c' is not one")):
    jobs.ScoreJob(
      input="i",
      output="o",
      model=jobs.ModelConfig(adapters=paths),
      adapter="c",
    )
  with pytest.raises(ValueError, match=r"--adapter='a' is not one.*\(none\)"):
    jobs.ScoreJob(input="i", output="o", adapter="a")
  # A missing directory, or one of another model: before any output.
  path = _write(tmp_path / "in.txt", ["hello"])
  out = tmp_path / "out.jsonl"
  missing = str(tmp_path / "nowhere")
  for adapters_flag, message in (
    (f"a={missing}", "--adapters: adapter 'a': no adapter directory at "),
    (f"a={tmp_path}", f"--adapters: adapter 'a': {tmp_path} is not a PEFT"),
  ):
    args = [f"--input={path}", f"--output={out}", f"--adapters={adapters_flag}"]
    code, _, err = _main("score", args, capsys)
    assert code == 1 and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()
  code, _, err = _main(
    "score", [f"--input={path}", f"--output={out}", "--adapters=a"], capsys
  )
  assert code == 1 and "'a' is not name=path" in err


def test_resume_with_other_adapters_is_refused(tmp_path):
  root = tmp_path / "adapters"
  mine = {
    "a": write_adapter(root / "a", rank=4, seed=1),
    "b": write_adapter(root / "b", rank=2, seed=2),
  }
  job = _score_job(tmp_path, mine, "out", batch_size=2)
  jobs.run_score(job)
  settings = json.loads(pathlib.Path(f"{job.output}.job.json").read_text())
  checksum = settings["adapters"]["b"]
  assert "adapter" not in settings  # absent when unset
  # The same adapters resume (nothing to run)...
  assert jobs.run_score(job)["resumed"] == 4
  # ...another file under the same name, or another default, do not.
  write_adapter(root / "b", rank=2, seed=3)
  with pytest.raises(jobs.JobError, match=f"adapters: .*'b': '{checksum}'"):
    jobs.run_score(job)
  write_adapter(root / "b", rank=2, seed=2)
  for other, changed in (
    (
      _score_job(tmp_path, {**mine, "c": mine["a"]}, "out", batch_size=2),
      "adapters",
    ),
    (_score_job(tmp_path, mine, "out", batch_size=2, adapter="b"), "adapter"),
  ):
    with pytest.raises(jobs.JobError, match=f"other settings \\({changed}: "):
      jobs.run_score(other)
  # A job begun without adapters records none, and refuses them later.
  texts = _write(tmp_path / "t.txt", ["hello"])
  bare = jobs.ScoreJob(
    input=texts, output=str(tmp_path / "bare.jsonl"), progress=False
  )
  jobs.run_score(bare)
  settings = json.loads(pathlib.Path(f"{bare.output}.job.json").read_text())
  assert "adapters" not in settings and "adapter" not in settings
  with pytest.raises(jobs.JobError, match="adapters: None then"):
    jobs.run_score(
      jobs.ScoreJob(
        input=texts,
        output=bare.output,
        model=jobs.ModelConfig(name="random:tiny", adapters=mine),
        progress=False,
      )
    )


def test_the_plan_digest_covers_adapters(tmp_path, served):
  """Processes reading other adapter files, or examples naming other
  adapters, plan different work (`multihost.same_everywhere`)."""
  _, paths = served
  job = _score_job(tmp_path, paths, "out")
  setup = job_setup.setup(job, scoring.encode)
  digest = driver._plan_digest([], setup)
  assert driver._plan_digest([], job_setup.setup(job, scoring.encode)) == digest
  texts = [dict(t) for t in TEXTS]
  texts[0]["adapter"] = "b"
  other = _write(tmp_path / "other.jsonl", [json.dumps(t) for t in texts])
  renamed = jobs.ScoreJob(input=other, output=job.output, model=job.model)
  assert driver._plan_digest([], job_setup.setup(renamed, scoring.encode)) != (
    digest
  )
  setup.adapters = {"a": setup.adapters["b"], "b": setup.adapters["a"]}
  assert driver._plan_digest([], setup) != digest


@pytest.mark.long  # covered by others: run with --long
@pytest.mark.slow
@pytest.mark.multihost
def test_two_processes_match_one_with_adapters(tmp_path, served):
  """Mixed batches after a shared prefix (rows copied from each adapter's
  prefix on a mesh that spans two processes) write the bytes one process
  of 8 devices writes."""
  _, paths = served
  names = ["a", None, "b", "a", "b"]
  lines = [
    json.dumps(
      {"id": f"e{i}", "text": "word " * (2 * i + 1), "adapter": names[i % 5]}
    )
    for i in range(11)
  ]
  path = _write(tmp_path / "in.jsonl", lines)
  args = [
    "--model=random:tiny",
    f"--input={path}",
    "--layout=wg",
    "--mesh=2x2x2",
    "--batch_size=4",
    "--progress=false",
    "--shared_prefix=Q: ",
    f"--adapters={_flag(paths)}",
    "--top_n=2",
  ]
  one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
  env = _worker_env()
  env["XLA_FLAGS"] = " ".join(
    [env.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
  ).strip()
  job = _job("score", [*args, f"--output={one}"], env=env)
  log = job.communicate(timeout=300)[0].decode()
  assert job.returncode == 0, log[-4000:]
  _two_processes("score", args, two, _worker_env())
  assert one.read_bytes() == two.read_bytes()
  assert [r.get("adapter") for r in _records(two)] == [
    names[i % 5] for i in range(11)
  ]
