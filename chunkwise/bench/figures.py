"""Figures of simulation reports (`chunkwise.simulation`) and of the planner's
latency-vs-cost curves (`planner.pareto`); matplotlib is imported only
when one is drawn.

  figures.memory_bars("sim.png", reports)
  figures.pareto_png([("generate", curves)], "plan.png", "PaLM 540B")
"""

from __future__ import annotations

from collections.abc import Sequence

from chunkwise.bench import report

GiB = 1 << 30

# (key of `held`, label, colour).
_COMPILED = (
  ("weights", "weights", "#4c72b0"),
  ("kv_cache", "K/V cache", "#55a868"),
  ("temp", "temporaries", "#dd8452"),
  ("other", "other arguments / outputs", "#8c8c8c"),
)
_PREDICTED = (
  ("weight_bytes", "#4c72b0"),
  ("kv_bytes", "#55a868"),
  ("temp", "#dd8452"),
)


def _label(r: dict) -> str:
  what = (
    f"L={r['length']}"
    if r["phase"] == "prefill"
    else f"C={r['length']}+{r['steps']}"
  )
  layout = r["layout"].removesuffix("/xla").removesuffix("/none")
  return (
    f"{r['model']} {'x'.join(map(str, r['mesh']))}\n{r['phase']} {layout}\n"
    f"B={r['batch']} {what} {r['weights']}"
  )


def memory_bars(path: str, reports: Sequence[dict]) -> None:
  """A bar chart of memory per device at full depth, one pair of stacked
  bars per report: compiled (weights, K/V cache, temporaries, other) and
  the planner's prediction (weights, K/V, activations + gathered
  weights) where the report has one."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  width = 0.38
  fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(reports)), 5.5))
  for i, r in enumerate(reports):
    held = r["held"]
    bottom = 0.0
    for key, label, colour in _COMPILED:
      value = max(held[key], 0.0) / GiB
      ax.bar(
        i - width / 2,
        value,
        width,
        bottom=bottom,
        color=colour,
        edgecolor="white",
        label=label if i == 0 else None,
      )
      bottom += value
    pred = r.get("predicted")
    if not pred:
      continue
    pred = dict(pred, temp=pred["activation_bytes"] + pred["gathered_bytes"])
    bottom = 0.0
    for key, colour in _PREDICTED:
      value = pred[key] / GiB
      ax.bar(
        i + width / 2,
        value,
        width,
        bottom=bottom,
        color=colour,
        alpha=0.55,
        edgecolor="black",
        linewidth=0.5,
        label="planner (right bar)"
        if i == 0 and key == "weight_bytes"
        else None,
      )
      bottom += value
  ax.set_xticks(range(len(reports)))
  ax.set_xticklabels([_label(r) for r in reports], fontsize=8)
  ax.set_ylabel("GiB per device")
  ax.set_title(
    "Memory per device at full depth: compiled on fake CPU devices (left) "
    "vs planner (right)",
    fontsize=10,
  )
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def pareto_png(panels, path: str, title: str) -> None:
  """Latency against cost, one curve per layout family and each point
  labelled with its batch: `panels` is [(panel title, {family: points
  with .batch, .latency_s, .cost}), ...] (`planner.pareto.frontier`)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5))
  axes = [axes] if len(panels) == 1 else list(axes)
  for ax, (name, curves) in zip(axes, panels, strict=True):
    for family, points in curves.items():
      xs = [p.latency_s * 1e3 for p in points]
      ys = [p.cost * 1e3 for p in points]
      report.batch_curve(ax, xs, ys, [p.batch for p in points], family)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("cost (chip-ms per token)")
    ax.set_title(name)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
