"""Long-prompt prefill: speed and peak memory, each side in its own process.

  sides = compare("smollm2-135m", 8192, ["transformers", "one_chunk",
                  "chunkwise"], runs=2)

One prompt of `length` random ids after BOS, prefilled by
- `chunkwise`: `InferenceModel.prefill` as it is (key-blocked attention,
  a long chunk in pieces, `chunkwise.inference.long_prefill`);
- `one_chunk`: its plain twin, the path before them: one chunk, each
  query block's logits over every key at once;
- `transformers`: the same weights in transformers' Llama, its forward
  pass (every position's logits, as scoring needs).

Peak RSS is a process's own, so each side runs in a fresh child process
(`python -m chunkwise.bench.long_prompts --side=...`): the model is loaded
(transformers: converted, and the JAX copy dropped), the kernel's peak
counter reset (/proc/self/clear_refs), and the prefill timed: the first
call (with compilation), then the median of `runs` more (with no more
runs, the first call's time is the figure). `peak_rss_mb` is the
process's peak during the prefills, the loaded model included.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

import jax

SIDES = ("transformers", "one_chunk", "chunkwise")


def _status_mb(field: str) -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024
  raise ValueError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
  """Resets VmHWM to the current RSS (Linux's clear_refs, value 5)."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def _load(model: str, dtype: str, numerics: str | None):
  from chunkwise import checkpoints
  from chunkwise.inference import InferenceModel

  if model.startswith(checkpoints.RANDOM):
    described = checkpoints.describe_random(model)
    return InferenceModel.random(
      described.hparams, dtype=dtype, numerics=numerics
    )
  return checkpoints.load(model, dtype=dtype, numerics=numerics)


def _child(args) -> dict:
  from chunkwise.bench import timing
  from chunkwise.models import blocked_attention

  model = _load(args.model, args.dtype, args.numerics)
  h = model.hparams
  ids = timing.token_ids(
    batch=1, length=args.length, vocab=h.vocab, bos_id=model.bos_id
  )
  if args.side == "transformers":
    from chunkwise.bench import reference

    hf = reference.to_transformers(h, model.plain_weights(), args.dtype)
    del model
    gc.collect()
    prefill = lambda: reference.prefill(hf, ids, args.runs)
  else:
    if args.side == "one_chunk":
      from chunkwise.inference import InferenceModel

      blocked_attention.MIN_TIME = 1 << 62
      model = InferenceModel(
        h,
        model.weights,
        model.vocab,
        bos_id=model.bos_id,
        prefill_chunk=args.length,
        numerics=model.numerics,
      )
    prefill = lambda: timing.prefill(model, ids, args.runs)
  loaded = _status_mb("VmRSS")
  _reset_peak()
  point = prefill()
  seconds = point.seconds if args.runs else point.first_s
  return {
    "side": args.side,
    "length": args.length,
    "runs": args.runs,
    "first_s": point.first_s,
    "seconds": seconds,
    "tokens_per_s": args.length / seconds,
    "loaded_rss_mb": loaded,
    "peak_rss_mb": _status_mb("VmHWM"),
    "numerics": None if args.side == "transformers" else model.numerics,
    "backend": jax.default_backend(),
  }


def measure(
  model: str,
  length: int,
  side: str,
  runs: int,
  dtype: str = "float32",
  numerics: str | None = None,
) -> dict:
  """One side's figures, from a fresh child process."""
  if side not in SIDES:
    raise ValueError(f"side {side!r}: expected one of {SIDES}")
  cmd = [
    sys.executable,
    "-m",
    "chunkwise.bench.long_prompts",
    f"--model={model}",
    f"--length={length}",
    f"--side={side}",
    f"--runs={runs}",
    f"--dtype={dtype}",
  ]
  if numerics:
    cmd.append(f"--numerics={numerics}")
  start = time.perf_counter()
  done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
  if done.returncode != 0:
    raise RuntimeError(
      f"long-prompt {side} run failed ({done.returncode}):\n"
      + done.stderr[-3000:]
    )
  result = json.loads(done.stdout.strip().splitlines()[-1])
  result["wall_s"] = time.perf_counter() - start
  return result


def check(h, lengths: Sequence[int], sides: Sequence[str], weights) -> None:
  """What `compare` needs of the model `h`, checked before anything runs:
  a ValueError names the flag (`scripts/benchmark.py`'s)."""
  if list(weights) == ["int8"]:
    raise ValueError("--long_prompt_lengths times float weights")
  if max(lengths) > h.max_len:
    raise ValueError(
      f"--long_prompt_lengths: {max(lengths)} tokens exceed the model's "
      f"max_len={h.max_len}"
    )
  if "transformers" in sides:
    from chunkwise.bench import reference  # torch only where it runs

    try:
      reference.check_supported(h)
    except ValueError as e:
      raise ValueError(f"--long_prompt_sides: {e}") from None


def compare(
  model: str,
  length: int,
  sides: Sequence[str],
  runs: int,
  dtype: str = "float32",
  numerics: str | None = None,
) -> dict:
  """Every side's figures, and chunkwise's ratios to the others."""
  got = {
    side: measure(model, length, side, runs, dtype, numerics) for side in sides
  }
  report = {
    "model": model,
    "length": length,
    "dtype": dtype,
    "numerics": got.get("chunkwise", {}).get("numerics"),
    "sides": got,
  }
  if "chunkwise" in got:
    ours = got["chunkwise"]
    report["ratios"] = {
      other: {
        "speed": ours["tokens_per_s"] / got[other]["tokens_per_s"],
        "peak_rss": ours["peak_rss_mb"] / got[other]["peak_rss_mb"],
      }
      for other in got
      if other != "chunkwise"
    }
  return report


def lines(report: dict) -> list[str]:
  """The report as printed lines."""
  out = [
    f"long prompt: {report['model']}, {report['length']} tokens, "
    f"{report['dtype']} weights, {report['numerics']} numerics"
  ]
  for side, r in report["sides"].items():
    out.append(
      f"  {side:<13} {r['tokens_per_s']:8.1f} tok/s "
      f"(median {r['seconds']:.2f} s, first call {r['first_s']:.2f} s)  "
      f"peak RSS {r['peak_rss_mb'] / 1024:.2f} GiB "
      f"(loaded {r['loaded_rss_mb'] / 1024:.2f})"
    )
  for other, r in report.get("ratios", {}).items():
    out.append(
      f"  chunkwise / {other}: {r['speed']:.2f}x speed, "
      f"{r['peak_rss']:.2f}x peak RSS"
    )
  return out


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--model", required=True)
  parser.add_argument("--length", type=int, required=True)
  parser.add_argument("--side", choices=SIDES, required=True)
  parser.add_argument("--runs", type=int, default=2)
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--numerics", default=None)
  args = parser.parse_args(argv)
  print(json.dumps(_child(args)))


if __name__ == "__main__":
  main()
