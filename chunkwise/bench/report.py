"""The benchmark's outputs: a JSON file, a text table and a PNG plot of
latency per token against throughput (one curve per configuration over the
decode batch sizes, as in the Pareto figures of Pope et al., 2023).

  result = {"machine": {...}, "model": {...}, "configs": [
      {"name": "chunkwise float32", "prefill": [row, ...],
       "decode": [row, ...]}, ...], "ratios": [...]}
  write_json(path, result); print(table(result)); plot(path, result)
"""

from __future__ import annotations

import json
import os
import tempfile


def ratios(configs: list[dict]) -> list[dict]:
  """tokens/s of each chunkwise configuration over each transformers one,
  for every (phase, batch, length) both measured."""
  ours = [c for c in configs if c["kind"] == "chunkwise"]
  refs = [c for c in configs if c["kind"] == "transformers"]
  out = []
  for a in ours:
    for b in refs:
      for phase in ("prefill", "decode"):
        theirs = {(r["batch"], r["length"]): r for r in b[phase]}
        for row in a[phase]:
          ref = theirs.get((row["batch"], row["length"]))
          if ref is None:
            continue
          out.append(
            {
              "ours": a["name"],
              "reference": b["name"],
              "phase": phase,
              "batch": row["batch"],
              "length": row["length"],
              "ratio": row["tokens_per_s"] / ref["tokens_per_s"],
            }
          )
  return out


def cpu() -> dict:
  """The CPU's name and the kernel path it runs (`cpu_kernels.isa`),
  recorded beside every figure."""
  from chunkwise import cpu_kernels

  return {
    "name": cpu_kernels.isa.cpu_name(),
    "kernel_path": cpu_kernels.isa.current(),
    "paths": list(cpu_kernels.isa.available()),
  }


def write_json(path: str, result: dict) -> None:
  """Writes `result` atomically (a temporary file, then a rename), with
  `cpu()` added."""
  result = {"cpu": cpu(), **result}
  directory = os.path.dirname(os.path.abspath(path))
  with tempfile.NamedTemporaryFile(
    "w", dir=directory, suffix=".tmp", delete=False
  ) as f:
    json.dump(result, f, indent=1)
    f.write("\n")
  os.replace(f.name, path)


def _fmt(value, digits=1) -> str:
  return "-" if value is None else f"{value:.{digits}f}"


def table(result: dict) -> str:
  """Plain-text tables of every measured point and every ratio."""
  m = result["machine"]
  peaks = ", ".join(f"{k} {v:.0f}" for k, v in m["peak_matmul_gflop_s"].items())
  c = cpu()
  lines = [
    f"cpu: {c['name']}, kernel path {c['kernel_path']}",
    f"machine: {m['device_kind']} ({m['backend']}, {m['cpu_count']} CPUs), "
    f"read bandwidth {m['bandwidth_gb_s']:.1f} GB/s, peak matmul GFLOP/s: "
    f"{peaks} (timed on the device)",
    "",
    "prefill        config  batch x len   compile_s   seconds     tok/s   MFU",
  ]
  for c in result["configs"]:
    for r in c["prefill"]:
      lines.append(
        f"{c['name']:>28} {r['batch']:>4} x {r['length']:<5} "
        f"{r['compile_s']:>8.2f} {r['seconds']:>9.3f} "
        f"{r['tokens_per_s']:>9.1f} {_fmt(100 * r.get('mfu', 0), 0):>4}%"
      )
  lines += [
    "",
    "decode         config  batch  steps  compile_s  ms/step     tok/s   MBU",
  ]
  for c in result["configs"]:
    for r in c["decode"]:
      lines.append(
        f"{c['name']:>28} {r['batch']:>5} {r['steps']:>6} "
        f"{r['compile_s']:>9.2f} {r['ms_per_step']:>8.2f} "
        f"{r['tokens_per_s']:>9.1f} {_fmt(100 * r.get('mbu', 0), 0):>4}%"
      )
  for c in result["configs"]:
    for batch, p in c.get("profiles", {}).items():
      kinds = ", ".join(f"{k} {v:.1f}" for k, v in p["kinds_ms"].items())
      lines += [
        "",
        f"profile: {c['name']} decode, batch {batch}: busy "
        f"{p['busy_share']:.0%} of {p['wall_ms']:.1f} ms; ms by kind: "
        f"{kinds}",
        f"  ({p['source']})",
      ]
      lines += [
        f"  {op['share']:6.1%} {op['ms']:9.1f} ms {op['calls']:7d}x  "
        f"{op['kind']:10} {op['name']}"
        for op in p["ops"]
      ]
  if result["ratios"]:
    lines += ["", "ratio (tokens/s, ours / reference)"]
    for r in result["ratios"]:
      lines.append(
        f"  {r['phase']:<7} {r['batch']:>3} x {r['length']:<5} "
        f"{r['ours']} / {r['reference']}: {r['ratio']:.2f}x"
      )
  return "\n".join(lines)


def batch_curve(ax, xs, ys, batches, label: str, style: str = "-o") -> None:
  """One curve on matplotlib axes `ax`, each point labelled with its
  batch size (the benchmark's and the planner's pictures)."""
  ax.plot(xs, ys, style, label=label)
  for batch, x, y in zip(batches, xs, ys, strict=True):
    ax.annotate(
      str(batch), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points"
    )


def plot(path: str, result: dict) -> None:
  """Latency per decode step against throughput, one curve per config."""
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 5))
  for c in result["configs"]:
    rows = sorted(c["decode"], key=lambda r: r["batch"])
    if not rows:
      continue
    xs = [r["tokens_per_s"] for r in rows]
    ys = [r["ms_per_step"] for r in rows]
    style = "-o" if c["kind"] == "chunkwise" else "--s"
    batch_curve(ax, xs, ys, [r["batch"] for r in rows], c["name"], style)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("throughput (generated tokens/s, all rows)")
  ax.set_ylabel("latency per token (ms per decode step)")
  model = result["model"]
  ax.set_title(
    f"{model['name']}: decode, prompt {model['prompt_length']} tokens, "
    f"{model['steps']} steps (labels: batch)",
    fontsize=9,
  )
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def constraint_table(result: dict) -> str:
  """Text table: each constraint's tables, and its decode cost per step
  against free decode of the same configuration and batch."""
  lines = ["constraint tables:"]
  for t in result["constraint_tables"]:
    classes = "" if t["classes"] is None else f"{t['classes']:5d} classes "
    lines.append(
      f"  {t['constraint']:8} {t['states']:6d} states {classes}"
      f"{t['table_bytes'] / 2**20:8.2f} MiB  built in "
      f"{t['build_s'] * 1e3:8.1f} ms"
    )
  lines.append("constrained decode (ms/step, against free decode):")
  for config in result["configs"]:
    free = {row["batch"]: row for row in config.get("decode", [])}
    for row in config.get("constrained_decode", []):
      base = free[row["batch"]]
      ratio = row["ms_per_step"] / base["ms_per_step"]
      lines.append(
        f"  {config['name']:24} {row['constraint']:8} batch "
        f"{row['batch']:4d}: {row['ms_per_step']:8.2f} vs "
        f"{base['ms_per_step']:8.2f} ({ratio:.2f}x), "
        f"{row['steps']} steps"
      )
  return "\n".join(lines)
