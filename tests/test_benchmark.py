"""scripts/benchmark.py and chunkwise.bench: the transformers copy computes
our model, the roofline arithmetic, and a smoke run on the tiny preset
(no timing asserts: speed is measured by the benchmark, not by tests)."""

import json
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import chunkwise as cw
from chunkwise.bench import machine, profile, reference, roofline, timing
from chunkwise.bench.machine import Limits
from tests.flag_checks import flag_errors

ROOT = pathlib.Path(__file__).parents[1]


def _run(tmp_path, *flags):
  return subprocess.run(
    [sys.executable, str(ROOT / "scripts" / "benchmark.py"), *flags],
    capture_output=True,
    text=True,
    check=False,
    cwd=tmp_path,
  )


@pytest.mark.parametrize("quantize", [False, True])
def test_transformers_copy_computes_the_same_model(quantize):
  h = cw.configs.get("tiny")
  model = cw.InferenceModel.random(h, seed=3)
  if quantize:
    weights = cw.models.quantized.quantize_weights(
      model.weights, cw.models.Weights.axes(h)
    )
    model = cw.InferenceModel(h, weights, model.vocab)
  ids = timing.token_ids(batch=2, length=9, vocab=h.vocab, bos_id=1, seed=4)
  chunk = cw.Chunk(tokens=jnp.asarray(ids), lengths=jnp.full((2,), 9))
  ours = model.prefill(chunk)
  hf = reference.to_transformers(h, model.plain_weights(), "float32")
  with torch.inference_mode():
    logits = hf(input_ids=torch.from_numpy(ids.astype(np.int64))).logits
  logp = torch.log_softmax(logits, -1).numpy()
  # Scores of tokens 1..8 are the log-probs of the previous position.
  theirs = np.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(
    np.asarray(ours.per_token_scores)[:, 1:], theirs, atol=2e-4
  )
  np.testing.assert_allclose(
    np.asarray(ours.next_token_logits), logits[:, -1].numpy(), atol=2e-4
  )


def test_transformers_copy_refuses_other_architectures():
  h = cw.configs.get("tiny-parallel")
  with pytest.raises(ValueError, match="block=parallel"):
    reference.check_supported(h)
  with pytest.raises(ValueError, match="dtype='float16'"):
    reference.to_transformers(cw.configs.get("tiny"), None, "float16")


def test_roofline_arithmetic():
  h = cw.configs.get("tiny")
  e, d, f = h.d_model, h.head_dim, h.d_ff
  per_layer = e * d * (2 * h.heads + 2 * h.kv_heads) + 3 * e * f
  assert roofline.matmul_params(h) == h.layers * per_layer + h.vocab * e
  # 2 x 3 tokens: dense 2 FLOPs per weight per token, attention over the
  # 6 causal pairs of each row, 2 products of heads x head_dim each.
  want = 2 * 6 * roofline.matmul_params(h) + 2 * 6 * 2 * 2 * h.heads * d * (
    h.layers
  )
  assert roofline.prefill_flops(h, 2, 3) == want
  # K/V: 2 tensors x layers x rows x tokens x kv_heads x head_dim x bytes.
  kv = roofline.kv_bytes_per_step(h, 4, 10, 2)
  assert kv == 2 * h.layers * 4 * 10 * h.kv_heads * d * 2
  point = timing.Point(
    phase="decode",
    batch=4,
    length=5,
    steps=11,
    tokens=44,
    first_s=3.0,
    times=(0.5, 0.1, 0.2),
  )
  limits = Limits(
    bandwidth=1e9,
    peaks={"float32/highest": 1e12},
    bandwidth_bytes=1,
    matmul_size=1,
  )
  row = roofline.decode_row(point, h, 1000, 2, limits)
  assert row["seconds"] == 0.2 and row["compile_s"] == pytest.approx(2.8)
  assert row["tokens_per_s"] == pytest.approx(220)
  step_bytes = 1000 + roofline.kv_bytes_per_step(h, 4, 10, 2)  # 5 + 10 / 2
  assert row["bytes_per_step"] == pytest.approx(step_bytes)
  assert row["mbu"] == pytest.approx(step_bytes / (0.2 / 11) / 1e9)
  assert row["roofline_tokens_per_s"] == pytest.approx(4e9 / step_bytes)
  prefill = timing.Point("prefill", 2, 3, 0, 6, 1.0, (0.5,))
  row = roofline.prefill_row(prefill, h, limits.peak("float32", "highest"))
  assert row["mfu"] == pytest.approx(roofline.prefill_flops(h, 2, 3) / 5e11)
  with pytest.raises(ValueError, match="no peak measured for bfloat16/def"):
    limits.peak(jnp.bfloat16, "default")


def test_machine_limits_are_timed_as_chains_on_the_device():
  # Each pass of the chain reads the whole array again: the compiled
  # program holds one reduction per pass (none merged or hoisted).
  x = jnp.ones((1024,), jnp.float32)
  for n in (1, 1 + machine.REPEATS):
    hlo = machine.chain(machine.read_step, n).lower(1.0, x).compile()
    assert hlo.as_text().count(" reduce(") == n
  limits = machine.measure(
    bandwidth_bytes=1 << 16,
    matmul_size=32,
    runs=1,
    matmuls=[("float32", "highest"), ("bfloat16", "default")] * 2,
  )
  assert sorted(limits.peaks) == ["bfloat16/default", "float32/highest"]
  assert limits.bandwidth > 0 and limits.peak("bfloat16", "default") > 0
  assert limits.describe()["device_kind"] == jax.devices()[0].device_kind
  with pytest.raises(ValueError, match="dtype='int8'"):
    machine.peak_flops(8, 1, "int8")
  with pytest.raises(ValueError, match="runs=0"):
    machine.measure(runs=0)


def _event(name, start, duration, hlo_op=None):
  stats = [] if hlo_op is None else [("hlo_op", hlo_op), ("hlo_module", "m")]
  return types.SimpleNamespace(
    name=name, start_ns=start, duration_ns=duration, stats=stats
  )


def _plane(name, lines):
  return types.SimpleNamespace(
    name=name,
    lines=[types.SimpleNamespace(name=k, events=v) for k, v in lines.items()],
  )


def test_profile_reads_gpu_kernels_by_op_and_kind():
  gpu = _plane(
    "/device:GPU:0",
    {
      "Stream #13(compute)": [
        _event("nvjet_tst_64x8_64x16", 0, 40, "custom-call.3"),
        _event("loop_fusion", 40, 10, "fusion.7"),
        _event("nvjet_tst_64x8_64x16", 100, 40, "custom-call.3"),
      ],
      "Stream #14(memcpy)": [
        _event("memcpy32_post", 30, 30, "dynamic-slice.2"),
        _event("MemcpyD2D", 200, 20),  # no op: named by the kernel
      ],
      # Kernels of a command buffer (a CUDA graph) go by their own names.
      "Stream #16(graph)": [
        _event("nvjet_tst_64x8_64x16", 300, 40, "command_buffer_9"),
        _event("memcpy32_post", 340, 5, "command_buffer_9"),
      ],
      "Stream #15(nccl)": [
        _event("ncclDevKernel_AllReduce", 60, 20, "all-reduce.1")
      ],
      # Derived per-op timelines repeat the kernels: not read.
      "XLA Ops": [_event("custom-call.3", 0, 140, "custom-call.3")],
    },
  )
  host = _plane("/host:CPU", {"tf_XLAEigen/1": [_event("dot.1", 0, 999)]})
  source, found = profile.events([host, _plane("/device:GPU:1", {}), gpu])
  assert source.startswith("/device:GPU:0: Stream #13(compute)")
  assert len(found) == 8
  p = profile.summarize(source, found, wall_ns=400, count=2)
  assert p.kinds == {
    "matmul": 120e-6,
    "copy": 55e-6,
    "collective": 20e-6,
    "other": 10e-6,
  }
  # Busy: [0, 80), [100, 140), [200, 220), [300, 345), overlaps once.
  assert p.busy_ms == pytest.approx(185e-6)
  assert p.busy_share == pytest.approx(185 / 400)
  (top, second) = p.ops
  assert (top.name, top.kind, top.calls) == ("custom-call.3", "matmul", 2)
  assert top.share == pytest.approx(80 / 205)
  assert (second.name, second.kind) == ("nvjet_tst_64x8_64x16", "matmul")
  assert p.describe()["kinds_ms"]["matmul"] == pytest.approx(120e-6)


def test_profile_reads_tpu_op_lines_and_cpu_thunks():
  tpu = _plane(
    "/device:TPU:0",
    {"XLA Ops": [_event("fusion.1", 0, 5, "fusion.1")], "Steps": []},
  )
  source, found = profile.events([tpu])
  assert source == "/device:TPU:0: XLA Ops" and len(found) == 1
  host = _plane(
    "/host:CPU",
    {
      "python": [_event("PjitFunction", 0, 100)],
      "tf_XLAEigen/1": [
        _event("ThunkExecutor::Execute", 0, 50),  # bookkeeping: no op
        _event("ffi_call.3", 0, 20, "ffi_call.3"),
        _event("ynn_fusion.2", 30, 10, "ynn_fusion.2"),
      ],
      "tf_XLAEigen/2": [_event("copy.4", 10, 30, "copy.4")],
    },
  )
  source, found = profile.events([host])
  assert "XLAEigen" in source
  assert sorted(e.op for e in found) == ["copy.4", "ffi_call.3", "ynn_fusion.2"]
  p = profile.summarize(source, found, wall_ns=100)
  assert p.kinds["matmul"] == pytest.approx(30e-6)
  assert p.busy_ms == pytest.approx(40e-6)  # [0, 40) on either thread
  assert profile.kind_of("wrapped_convert") == "other"
  assert profile.kind_of("all-gather-start.2") == "collective"
  assert profile.kind_of("dynamic-update-slice.1") == "copy"


def test_transformers_reference_runs_where_jax_runs(monkeypatch):
  assert reference.device() == "cpu"
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
  with pytest.raises(ValueError, match="this torch has no CUDA"):
    reference.device()
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  with pytest.raises(ValueError, match="runs on 'tpu'"):
    reference.device()
  with pytest.raises(ValueError, match="device='mps'"):
    reference.to_transformers(cw.configs.get("tiny"), None, "float32", "mps")
  # Every timed call waits for the other framework's queue.
  waits = []
  _, times = timing.timed(lambda: 1, 3, sync=lambda: waits.append(1))
  assert len(times) == 3 and len(waits) == 4


def test_random_presets_of_any_size_are_described_and_checked_for_fit():
  h = cw.configs.get("llama3-8b")
  assert (h.layers, h.d_model, h.heads, h.kv_heads, h.head_dim) == (
    32,
    4096,
    32,
    8,
    128,
  )
  assert (h.d_ff, h.vocab, h.rope_base) == (14_336, 128_256, 500_000.0)
  assert not h.tied_embeddings
  assert h.num_params() == pytest.approx(8.03e9, rel=1e-3)
  big = cw.checkpoints.describe_random("random:palm-540b").hparams
  assert big.num_params() > 5e11
  with pytest.raises(ValueError, match=r"too large: they need 2161\.4 GB"):
    cw.InferenceModel.random(big)


@pytest.mark.slow
# Every section of the script at once (3.5 min on 2 Zen 3 cores): --long;
# test_benchmark_times_int8_weights_beside_float32 runs it in CI.
@pytest.mark.long
def test_benchmark_smoke_on_the_tiny_preset(tmp_path):
  out, png = tmp_path / "b.json", tmp_path / "b.png"
  result = _run(
    tmp_path,
    "--model=random:tiny",
    "--weights=float32",
    "--decode_batches=1,3",
    "--steps=5",
    "--prefill_batches=2",
    "--prefill_lengths=4,16",
    "--runs=2",
    "--compare_hf",
    "--hf_dtypes=float32",
    "--bandwidth_mib=8",
    "--matmul_size=128",
    "--profile_batches=3",
    "--constraints=choice",
    "--continuous",
    "--continuous_requests=12",
    "--continuous_long=16",
    "--slots=3",
    "--numerics=fast,invariant",
    "--numerics_rounds=1",
    "--numerics_drift_batches=1,3",
    "--speculate=ngram",
    "--speculate_k=2",
    "--speculate_batches=2",
    "--speculate_rounds=1",
    "--fast_forward_batches=1",
    "--chunked_prefill_length=40",
    "--chunked_prefill_piece=16",
    "--slot_step_capacity=128",
    "--paged_slots=6",
    "--paged_attention_contexts=64",
    "--kv_dtype_contexts=48",
    f"--output={out}",
    f"--plot={png}",
  )
  assert result.returncode == 0, result.stderr
  data = json.loads(out.read_text())
  # Continuous batching: both modes kept the same tokens (the contract),
  # continuous with fuller slots.
  both = data["configs"][0]["continuous"]
  assert both["workload"]["requests"] == 12
  assert both["static"]["tokens"] == both["continuous"]["tokens"] > 0
  assert 0 < both["static"]["occupancy"] <= both["continuous"]["occupancy"]
  assert both["continuous"]["occupancy"] <= 1
  assert both["programs_compiled"] > 0 and both["speedup"] > 0
  assert "continuous / static" in result.stdout
  # --fast_forward_batches: forced runs in one pass are the same tokens
  # as stepping; every call timed.
  ff = data["configs"][0]["fast_forward"]["b1"]
  assert ff["diverged_rows"] == 0 and ff["mean_acceptance_length"] >= 1
  assert all(
    ff[n]["tokens_per_s"] > 0 for n in ("json", "json, forced", "text")
  )
  assert "constrained JSON against free text" in result.stdout
  # --chunked_prefill_length: a 40-token prompt admitted whole and in
  # pieces of 16 while a request decodes, the same tokens.
  chunked = data["configs"][0]["chunked_prefill"]
  assert chunked["same_tokens"]
  assert set(chunked["schedules"]) == {"whole", "pieces"}
  assert chunked["schedules"]["pieces"]["piece"] == 16
  assert all(r["itl_p99_ms"] > 0 for r in chunked["schedules"].values())
  assert "p99 whole / pieces" in result.stdout
  # --paged_slots: 6 slots sharing the K/V of 3 fixed ones, the same
  # tokens; more requests held at once.
  paged = data["configs"][0]["paged"]
  assert paged["workload"]["kv_columns"] == 3 * paged["workload"]["capacity"]
  assert paged["fixed"]["tokens"] == paged["paged"]["tokens"] > 0
  assert paged["fixed"]["held_max"] == 3 < paged["paged"]["held_max"] <= 6
  assert paged["speedup"] > 0 and "paged / fixed" in result.stdout
  # --paged_attention_contexts: the plain view timed (no GPU here).
  (row,) = data["configs"][0]["paged_attention"]
  assert (row["rows"], row["context"]) == (3, 64) and row["view_ms"] > 0
  assert "kernel_ms" not in row and "paged decode attention" in result.stdout
  # --kv_dtype_contexts: 3 rows after 48 columns, f32 against int8 K/V.
  (row,) = data["configs"][0]["kv_dtype"]
  assert (row["rows"], row["context"]) == (3, 48)
  assert row["float32_tokens_per_s"] > 0 and row["int8_tokens_per_s"] > 0
  assert (
    row["int8_bytes_ratio"] < 0.5 and "decode by K/V dtype" in result.stdout
  )
  # --slot_step_capacity: both step costs, 3 slots of 128 columns.
  step = data["configs"][0]["slot_step"]
  assert (step["slots"], step["capacity"]) == (3, 128)
  assert step["generate_ms"] > 0 and step["slots_ms"] > 0
  assert len(step["slots_runs_ms"]) == 2 * len(step["generate_runs_ms"]) == 4
  assert "slot loop" in result.stdout
  # --numerics: both modes timed side by side; invariant rows do not drift.
  ours = data["configs"][0]  # chunkwise's (then transformers')
  report = ours["numerics"]
  assert report["modes"] == ["fast", "invariant"]
  assert [r["workload"] for r in report["rows"]] == [
    "decode b1",
    "decode b3",
    "prefill 2x4",
  ]
  assert all(r["slowdown"]["invariant"] > 0 for r in report["rows"])
  drift = report["drift"]["invariant"]
  assert drift["batches"] == [1, 3]
  assert drift["prefill"] == drift["generate"] == 0
  assert "numerics side by side" in result.stdout
  # --speculate: both workloads side by side; under invariant numerics
  # (float32) no row diverged. (The int8 draft: tests/test_speculation.py.)
  for workload in ("copy", "chat"):
    got = ours["speculation"][workload]["b2"]
    assert got["plain"] > 0 and got["ngram"]["ratio"] > 0
    assert got["ngram"]["stats"]["steps"] > 0
    assert 0 <= got["ngram"]["diverged_rows"] <= got["ngram"]["rows"]
  copy = ours["speculation"]["copy"]["b2"]
  assert copy["ngram"]["rows"] == 8 and copy["ngram"]["diverged_rows"] == 0
  assert "speculation side by side" in result.stdout
  assert data["machine"]["bandwidth_gb_s"] > 0
  # Ours and transformers' matmuls: f32 at "highest".
  peaks = data["machine"]["peak_matmul_gflop_s"]
  assert sorted(peaks) == ["float32/highest"]
  assert all(v > 0 for v in peaks.values())
  names = [c["name"] for c in data["configs"]]
  assert names == ["chunkwise float32", "transformers float32"]
  for c in data["configs"]:
    assert [(r["batch"], r["length"]) for r in c["prefill"]] == [
      (2, 4),
      (2, 16),
    ]
    assert [r["batch"] for r in c["decode"]] == [1, 3]
    for r in c["prefill"] + c["decode"]:
      assert len(r["times"]) == 2
      assert r["seconds"] == np.median(r["times"]) > 0
      assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
    for r in c["prefill"]:
      assert r["tokens"] == 2 * r["length"] and r["mfu"] > 0
    for r in c["decode"]:
      assert 1 <= r["steps"] <= 5 and r["mbu"] > 0
      assert r["length"] == data["model"]["prompt_length"]
  # Every chunkwise point over every transformers point of the same shape.
  assert len(data["ratios"]) == 1 * 1 * (2 + 2)
  by_name = {c["name"]: c for c in data["configs"]}
  for r in data["ratios"]:
    rows = [
      {(x["batch"], x["length"]): x for x in by_name[n][r["phase"]]}
      for n in (r["ours"], r["reference"])
    ]
    key = (r["batch"], r["length"])
    want = rows[0][key]["tokens_per_s"] / rows[1][key]["tokens_per_s"]
    assert r["ratio"] == pytest.approx(want)
  _check_profile(ours["profiles"]["3"])
  assert data["configs"][1]["device"] == "cpu"
  assert "profile: chunkwise float32 decode, batch 3" in result.stdout
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "ratio (tokens/s, ours / reference)" in result.stdout
  # --constraints: the table's size and build time, and constrained decode
  # at every decode batch (every row, then one row of a larger batch).
  (table,) = data["constraint_tables"]
  assert table["constraint"] == "choice" and table["states"] > 1
  assert table["table_bytes"] > 0 and table["build_s"] > 0
  rows = ours["constrained_decode"]
  assert [(r["constraint"], r["batch"]) for r in rows] == [
    ("choice", 1),
    ("choice", 3),
    ("choice, 1 row", 3),
  ]
  assert all(1 <= r["steps"] <= 5 and r["seconds"] > 0 for r in rows)
  assert "constrained decode (ms/step, against free decode):" in result.stdout


def _check_profile(p):
  """One decode call's costliest XLA ops (`--profile_batches`)."""
  ops = p["ops"]
  assert 0 < len(ops) <= 15 and all(op["calls"] >= 1 for op in ops)
  assert 0 < sum(op["share"] for op in ops) <= 1 + 1e-9
  assert 0 < p["busy_share"] <= 1 and p["wall_ms"] > 0
  # The tiny model's weight matmuls run our CPU kernel (FFI calls).
  assert p["kinds_ms"]["matmul"] > 0 and set(p["kinds_ms"]) == set(
    profile.KINDS
  )


@pytest.mark.slow
def test_benchmark_times_int8_weights_beside_float32(tmp_path):
  """--weights=float32,int8: each configuration timed and profiled (the
  smoke run above times the families on float32 only)."""
  out = tmp_path / "b.json"
  result = _run(
    tmp_path,
    "--model=random:tiny",
    "--weights=float32,int8",
    "--decode_batches=3",
    "--steps=3",
    "--prefill_batches=1",
    "--prefill_lengths=4",
    "--runs=1",
    "--bandwidth_mib=8",
    "--matmul_size=128",
    "--profile_batches=3",
    f"--output={out}",
    "--plot=",
  )
  assert result.returncode == 0, result.stderr
  configs = json.loads(out.read_text())["configs"]
  assert [c["name"] for c in configs] == ["chunkwise float32", "chunkwise int8"]
  # Over a quarter: the tiny preset's groups are short, so scales weigh.
  assert configs[1]["weight_bytes"] < 0.5 * configs[0]["weight_bytes"]
  for c in configs:
    assert [r["batch"] for r in c["decode"]] == [3]
    assert c["prefill"][0]["tokens"] == 4 and c["prefill"][0]["mfu"] > 0
    _check_profile(c["profiles"]["3"])
  assert "profile: chunkwise int8 decode, batch 3" in result.stdout


BAD_FLAGS = [
  (["--decode_batches=1,0"], "--decode_batches: '0' is not a positive"),
  (["--weights=float16"], "--weights=float16: expected a list of"),
  (["--constraints=yaml"], "--constraints=yaml: expected a list of"),
  (["--numerics=exact"], "--numerics=exact: expected a list of"),
  (["--paged_attention_contexts=0"], "'0' is not a count of columns"),
  (["--kv_dtype_contexts=x"], "'x' is not a count of columns"),
  (["--prefill_lengths=9999"], "9999 tokens"),
  (["--output=/nonexistent/b.json"], "folder '/nonexistent' does not exist"),
  (["--model=random:nope"], "unknown preset 'nope'"),
  (["--model=random:palm-540b"], "too large: they need"),
  (["--long_prompt_lengths=0"], "not a positive integer"),
  (["--long_prompt_lengths=8", "--long_prompt_sides=vllm"], "expected a"),
  (["--long_prompt_lengths=99999"], "exceed the model's max_len"),
  (["--slot_step_capacity=40"], "--slot_step_capacity: capacity=40"),
  (["--slot_step_capacity=9999"], "within the model's max_len"),
]


def test_bad_flags_fail_before_measuring(tmp_path):
  """Every bad flag is refused by name before any weights load or
  anything is timed (nothing written); the script prints the one line
  and exits 1."""
  argvs = [["--model=random:tiny", *flags] for flags, _ in BAD_FLAGS]
  errors = flag_errors("benchmark", "run", argvs, tmp_path)
  for (flags, message), error in zip(BAD_FLAGS, errors, strict=True):
    assert error is not None and message in error, (flags, error)
  assert not list(tmp_path.iterdir())
  result = _run(tmp_path, "--model=random:tiny", "--decode_batches=1,0")
  assert result.returncode == 1
  assert result.stderr.strip() == f"benchmark.py: error: {errors[0]}"
  assert not list(tmp_path.iterdir())


@pytest.mark.long  # covered by others: run with --long
@pytest.mark.slow
def test_long_prompt_sides_each_in_their_own_process(tmp_path):
  """--long_prompt_lengths: every side a child process of its own, with
  its speed, peak RSS and chunkwise's ratios; nothing else is timed."""
  out = tmp_path / "long.json"
  result = _run(
    tmp_path,
    "--model=random:tiny",
    "--long_prompt_lengths=40",
    "--long_prompt_runs=1",
    f"--output={out}",
  )
  assert result.returncode == 0, result.stderr
  (report,) = json.loads(out.read_text())["long_prompts"]
  assert report["length"] == 40
  assert list(report["sides"]) == ["transformers", "one_chunk", "chunkwise"]
  for side in report["sides"].values():
    assert side["tokens_per_s"] > 0 and side["runs"] == 1
    assert side["peak_rss_mb"] >= side["loaded_rss_mb"] > 0
  assert set(report["ratios"]) == {"transformers", "one_chunk"}
  assert "chunkwise / transformers" in result.stdout
