"""The flags of how tokens are sampled: `SamplingFlags` gives a
`Sampling` (--temperature, --top_k, --top_p, --min_p, --seed),
`SpeculationFlags` a `Speculation` or None (--speculate, --speculate_k).
The generation script, the demo and the server share them.

  SAMPLING = sampling_flags.SamplingFlags(temperature=0.7)
  job = GenerateJob(**JOB.fields(), sampling=SAMPLING.sampling(), ...)
"""

from __future__ import annotations

from absl import flags

from chunkwise.inference import Sampling, Speculation
from chunkwise.jobs import cli


class SamplingFlags:
  """--temperature, --top_k, --top_p, --min_p, --seed: a `Sampling`."""

  def __init__(
    self,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed_help: str = "Sampling seed, in [0, 2**32).",
  ):
    self.temperature = cli.define(
      flags.DEFINE_float,
      "temperature",
      temperature,
      "Sampling temperature (0: greedy).",
      lower_bound=0.0,
    )
    self.top_k = cli.define(
      flags.DEFINE_integer,
      "top_k",
      0,
      "Keep the k most likely tokens (0: all).",
      lower_bound=0,
    )
    self.top_p = cli.define(
      flags.DEFINE_float,
      "top_p",
      top_p,
      "Nucleus mass, in (0, 1].",
      upper_bound=1.0,
    )
    self.min_p = cli.define(
      flags.DEFINE_float,
      "min_p",
      0.0,
      "Keep tokens at least min_p times as likely as the best, in [0, 1].",
      lower_bound=0.0,
      upper_bound=1.0,
    )
    self.seed = cli.define(
      flags.DEFINE_integer, "seed", 0, seed_help, lower_bound=0
    )
    cli.validate("top_p", lambda p: p > 0, "--top_p must be > 0")
    cli.validate("seed", lambda s: s < 2**32, "--seed must be < 2**32")

  def sampling(self) -> Sampling:
    return Sampling(
      temperature=self.temperature.value,
      top_k=self.top_k.value,
      top_p=self.top_p.value,
      min_p=self.min_p.value,
      seed=self.seed.value,
    )


class SpeculationFlags:
  """--speculate, --speculate_k: a `Speculation` (or None)."""

  def __init__(self):
    self.drafter = cli.define(
      flags.DEFINE_enum,
      "speculate",
      None,
      list(Speculation.DRAFTERS),
      "Speculative decoding: draft tokens and verify them in one pass; the "
      "tokens are those without it. ngram: prompt lookup (each sample's "
      "prompt and tokens); forced: only tokens a constraint forces; draft: "
      "the model's own weights in int8 (float weights only).",
    )
    self.k = cli.define(
      flags.DEFINE_integer,
      "speculate_k",
      8,
      "With --speculate: most tokens drafted per pass.",
      lower_bound=1,
      upper_bound=64,
    )

  def speculation(self) -> Speculation | None:
    if self.drafter.value is None:
      return None
    return Speculation(drafter=self.drafter.value, k=self.k.value)
