"""Benchmarks: the machine's limits, timed prefill and decode, and the
Hugging Face `transformers` reference, for `scripts/benchmark.py`.

  limits = machine.measure()                     # bandwidth, peak FLOP/s
  point = timing.decode(model, prompt, batch=16, steps=128, runs=3)
  row = roofline.decode_row(point, model, limits)   # + MBU
  report.write_json(path, result); report.plot(path, result)

Nothing here is imported by the rest of chunkwise (it sits after
`checkpoints` in the dependency order); `transformers` and `torch` are
imported only when the reference runs.
"""

from chunkwise.bench import machine, roofline, timing

__all__ = ["machine", "roofline", "timing"]
