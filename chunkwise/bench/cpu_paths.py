"""Each CPU kernel path side by side: chunkwise under invariant and fast
numerics against transformers, on one machine, one path at a time.

  report = compare("smollm2-135m", ["avx2", "avx512_vnni"], weights=["float32"])
  print(table(report))

Every path runs in a child process of its own (`python -m
chunkwise.bench.cpu_paths`) with `CHUNKWISE_CPU_ISA` naming it, so a
machine with AVX-512 also measures its AVX2 (and portable) path. torch is
held to the same instruction set in that child (`TORCH_CAPS`: MKL's,
oneDNN's and ATen's own switches), so a forced path stands in for a CPU
that has only that set; the child records what torch reports using.

In the child, each round times every side once, interleaved (so the
machine's drift falls on all of them alike), after a warm-up call of each
(it compiles): greedy decode at each of `decode_batches` (ms per step,
`steps` steps after a 6-token prompt), a prefill of one row of each of
`prefill_lengths` (tokens/s), and the scoring job's batches over a file
of `score_texts` texts of mixed lengths (`mixed_texts`: 16 to 1024 tokens,
log-uniform, cut from scripts/data/eval_texts.jsonl), as `scripts/score.py`
runs them (`jobs.batching.batches` of `jobs.scoring.score_batch`, 8 rows,
power-of-two lengths; tokens/s of scored tokens). transformers scores the
same batches padded to their longest row: its forward pass, then each
token's log-prob (the logit minus the row's logsumexp). A figure is the
median over rounds of each round's median of `runs` calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

# The instruction set torch is held to beside each path.
TORCH_CAPS = {
  "portable": {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
  },
  "avx2": {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
  },
  "avx2_vnni": {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI",
  },
  "avx512": {
    "ATEN_CPU_CAPABILITY": "avx512",
    "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
  },
  "avx512_vnni": {},  # everything torch has
  "neon": {},
  "neon_dotprod": {},
}
SIDES = ("invariant", "fast", "transformers")
PROMPT = (1, 504, 3458, 282, 4649, 314)  # BOS + "The capital of France is"
SCORE_BATCH = 8


def mixed_texts(vocab, count: int, seed: int = 0) -> list[list[int]]:
  """`count` token lists of 16 to 1024 tokens (log-uniform, seeded), cut
  one after another from the eval texts repeated."""
  here = os.path.dirname(os.path.abspath(__file__))
  path = os.path.join(here, "..", "..", "scripts", "data", "eval_texts.jsonl")
  with open(path) as f:
    ids = [t for line in f for t in vocab.encode(json.loads(line)["text"])]
  rng = np.random.default_rng(seed)
  lengths = np.exp(rng.uniform(np.log(16), np.log(1024), count)).astype(int)
  out, at = [], 0
  for n in lengths:
    out.append([ids[(at + i) % len(ids)] for i in range(n)])
    at += n
  return out


def _median_of(fn, runs: int) -> float:
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _chunkwise_side(model, args, texts):
  """{workload: callable timing it once (seconds)} for a chunkwise model,
  each called once first (compiles)."""
  import jax

  from chunkwise.bench import timing
  from chunkwise.jobs import batching, examples, scoring

  work = {}
  for b in args.decode_batches:
    prefix = jax.block_until_ready(timing.prompt_prefix(model, PROMPT, b))
    call = timing.greedy(model, prefix, args.steps)
    work[f"decode b{b}"] = (
      lambda c=call: jax.block_until_ready(c()),
      args.steps,
    )
  for n in args.prefill_lengths:
    ids = timing.token_ids(
      batch=1, length=n, vocab=model.hparams.vocab, bos_id=model.bos_id
    )
    chunk = timing._chunk(ids)
    call = lambda c=chunk: jax.block_until_ready(model.prefill(c))
    work[f"prefill {n}"] = (call, n)
  if texts:
    rows = [
      examples.Prepared(
        examples.Example(id=str(i), line=i + 1, text=""), [model.bos_id, *t], 1
      )
      for i, t in enumerate(texts)
    ]
    plan = batching.batches(
      [len(r.tokens) for r in rows], batch_size=SCORE_BATCH, limit=2048
    )

    def score():
      for batch in plan:
        scoring.score_batch(
          model,
          [None if i is None else rows[i] for i in batch.indices],
          time=batch.time,
        )

    work["score"] = (score, sum(len(t) for t in texts))
  return work


def _transformers_side(hf, args, texts):
  import torch

  from chunkwise.bench import reference, timing
  from chunkwise.jobs import batching

  def sync():
    reference.synchronize(hf)

  work = {}
  for b in args.decode_batches:
    ids = torch.tensor([list(PROMPT)] * b, dtype=torch.long)

    def decode(ids=ids):
      with torch.inference_mode():
        hf.generate(
          ids,
          attention_mask=torch.ones_like(ids),
          max_new_tokens=args.steps,
          min_new_tokens=args.steps,
          do_sample=False,
          pad_token_id=0,
        )

    work[f"decode b{b}"] = (decode, args.steps)
  vocab = hf.config.vocab_size
  for n in args.prefill_lengths:
    ids = torch.from_numpy(
      timing.token_ids(batch=1, length=n, vocab=vocab, bos_id=PROMPT[0]).astype(
        np.int64
      )
    )

    def prefill(ids=ids):
      with torch.inference_mode():
        hf(input_ids=ids)
      sync()

    work[f"prefill {n}"] = (prefill, n)
  if texts:
    rows = [[PROMPT[0], *t] for t in texts]
    plan = batching.batches(
      [len(r) for r in rows], batch_size=SCORE_BATCH, limit=2048
    )

    def score():
      for batch in plan:
        real = [rows[i] for i in batch.rows]
        longest = max(map(len, real))
        ids = torch.zeros((len(real), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, row in enumerate(real):
          ids[r, : len(row)] = torch.tensor(row)
          mask[r, : len(row)] = 1
        with torch.inference_mode():
          logits = hf(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
          picked = torch.gather(logits, -1, ids[:, 1:, None])[..., 0]
          (picked - torch.logsumexp(logits, -1)).masked_fill(
            mask[:, 1:] == 0, 0
          ).numpy()

    work["score"] = (score, sum(len(t) for t in texts))
  return work


def _child(args) -> dict:
  """Times every side of one path (this process's CHUNKWISE_CPU_ISA)."""
  import torch

  import chunkwise as cw
  from chunkwise import cpu_kernels
  from chunkwise.bench import reference

  cpu_kernels.load()
  sides = {}
  texts = None
  for weights in args.weights:
    quantize = "int8" if weights == "int8" else None
    for numerics in ("invariant", "fast"):
      model = cw.load(args.model, quantize=quantize, numerics=numerics)
      if texts is None and args.score_texts:
        texts = mixed_texts(model.vocab, args.score_texts)
      sides[(weights, numerics)] = _chunkwise_side(model, args, texts or [])
      if weights == "float32" and numerics == "invariant":
        hf = reference.to_transformers(model.hparams, model.weights, "float32")
        sides[("float32", "transformers")] = _transformers_side(
          hf, args, texts or []
        )
  for work in sides.values():  # warm-up: compiles
    for fn, _ in work.values():
      fn()
  samples: dict = {}
  for _ in range(args.rounds):
    for side, work in sides.items():
      for what, (fn, count) in work.items():
        seconds = _median_of(fn, args.runs)
        if what.startswith("decode"):
          value = seconds / count * 1e3  # ms per step
        else:
          value = count / seconds  # tokens/s
        samples.setdefault("/".join(side), {}).setdefault(what, []).append(
          value
        )
  return {
    "path": cpu_kernels.isa.current(),
    "cpu": cpu_kernels.isa.cpu_name(),
    "torch_capability": torch.backends.cpu.get_cpu_capability(),
    "torch_threads": torch.get_num_threads(),
    "score_tokens": sum(len(t) for t in texts) if texts else 0,
    "medians": {
      side: {what: statistics.median(v) for what, v in work.items()}
      for side, work in samples.items()
    },
    "samples": samples,
  }


def compare(
  model: str,
  paths,
  *,
  weights=("float32",),
  decode_batches=(1, 16),
  prefill_lengths=(512, 8192),
  score_texts: int = 64,
  steps: int = 32,
  rounds: int = 3,
  runs: int = 1,
) -> dict:
  """Each path's figures, each path in a child process (module doc)."""
  from chunkwise import cpu_kernels

  out = {"cpu": cpu_kernels.isa.cpu_name(), "paths": []}
  for path in paths:
    env = {**os.environ, "CHUNKWISE_CPU_ISA": path, **TORCH_CAPS.get(path, {})}
    cmd = [
      sys.executable,
      "-m",
      "chunkwise.bench.cpu_paths",
      f"--model={model}",
      f"--weights={','.join(weights)}",
      f"--decode_batches={','.join(map(str, decode_batches))}",
      f"--prefill_lengths={','.join(map(str, prefill_lengths))}",
      f"--score_texts={score_texts}",
      f"--steps={steps}",
      f"--rounds={rounds}",
      f"--runs={runs}",
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode:
      raise RuntimeError(
        f"the {path} path's child failed:\n{result.stderr[-3000:]}"
      )
    out["paths"].append(json.loads(result.stdout.strip().splitlines()[-1]))
  return out


def table(report: dict) -> str:
  """One table per path: each workload's figure per side, and the ratios
  the targets are about (invariant against transformers and fast)."""
  lines = []
  for p in report["paths"]:
    lines.append(
      f"path {p['path']} on {p['cpu']} (torch: {p['torch_capability']}, "
      f"{p['torch_threads']} threads; score: {p['score_tokens']} tokens)"
    )
    med = p["medians"]
    for weights in dict.fromkeys(s.split("/")[0] for s in med):
      inv, fast = med.get(f"{weights}/invariant"), med.get(f"{weights}/fast")
      ref = med.get(f"{weights}/transformers")
      lines.append(
        f"  {weights:9} {'workload':12} {'invariant':>10} {'fast':>10} "
        f"{'transformers':>13} {'inv/hf':>7} {'inv/fast':>9}"
      )
      for what in inv:
        unit_ms = what.startswith("decode")

        def speed(a, b, unit_ms=unit_ms):  # > 1: a is faster
          if a is None or b is None:
            return "-"
          return f"{(b / a if unit_ms else a / b):.2f}x"

        r = ref.get(what) if ref else None
        lines.append(
          f"  {'':9} {what:12} {inv[what]:>10.1f} {fast[what]:>10.1f} "
          f"{'-' if r is None else f'{r:.1f}':>13} {speed(inv[what], r):>7} "
          f"{speed(inv[what], fast[what]):>9}"
          + ("  (ms/step)" if unit_ms else "  (tokens/s)")
        )
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="smollm2-135m")
  parser.add_argument("--weights", default="float32")
  parser.add_argument("--decode_batches", default="1,16")
  parser.add_argument("--prefill_lengths", default="512,8192")
  parser.add_argument("--score_texts", type=int, default=64)
  parser.add_argument("--steps", type=int, default=32)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--runs", type=int, default=1)
  args = parser.parse_args(argv)
  args.weights = args.weights.split(",")
  args.decode_batches = [int(b) for b in args.decode_batches.split(",") if b]
  args.prefill_lengths = [int(n) for n in args.prefill_lengths.split(",") if n]
  print(json.dumps(_child(args)), flush=True)


if __name__ == "__main__":
  main()
