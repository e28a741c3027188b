"""Scores a file of texts with a model: per-example log-probs, resumable,
on one machine or many.

  python scripts/score.py --input=texts.jsonl --output=scores.jsonl
  python scripts/score.py --model=/ckpt/m8 --input=mc.jsonl \\
      --output=out.jsonl --shared_prefix=@fewshot.txt --top_n=5 \\
      --layout=ws_2d --mesh=2x2x2 --batch_size=16

Input (see chunkwise/jobs/examples.py): JSON lines {"id", "text"} (every
token after BOS is scored) or {"id", "context", "continuation"} (only the
continuation is scored, given the context), or plain text, one example
per line, its id the line number. With --shared_prefix the text (or
@file) is prefilled once and every example continues it.

Output: one JSON line per example: id, num_tokens, logprob (the sum,
natural log), token_logprobs, with --tokens the token ids, with --top_n
the n most likely tokens per position (ids, logprobs, decoded tokens).
Lines are written batch by batch; re-running with the same --output
skips the ids already there, so a killed job resumes. At the end the file
holds every example once, in input order, and a summary line is printed:
examples, tokens, mean NLL per token, perplexity, tokens/s.

Multi-host: pass --coordinator_address, --num_processes, --process_id to
every process (or --multihost for the platform's detection); see
chunkwise/jobs/cli.py for how examples and output are split.
"""

from __future__ import annotations

import math

from absl import app, flags

from chunkwise.jobs import cli, examples, scoring

_TOP_N = flags.DEFINE_integer(
  "top_n", 0, "Most likely alternatives per scored token.", lower_bound=0
)
_TOKENS = flags.DEFINE_bool("tokens", False, "Write each example's token ids.")


def encode(described, prefix: list[int], example: examples.Example):
  """(row, scored_from): BOS (unless a shared prefix holds it), the
  context, then the scored text."""
  vocab = described.vocab
  head = [] if prefix else [described.bos_id]
  if example.context:
    head += vocab.encode(example.context)
  return head + list(vocab.encode(example.text)), len(head)


def summarize(setup: cli.Setup, run: cli.Run) -> dict:
  """Totals over the whole output; speed over this run's examples."""
  records = run.output.records()
  tokens = sum(r["num_tokens"] for r in records)
  nll = -sum(r["logprob"] for r in records) / max(tokens, 1)
  new = sum(
    len(p.tokens) - p.scored_from
    for p in map(setup.prepared.__getitem__, run.todo)
  )
  return cli.summary(
    setup,
    run,
    new_tokens=new,
    examples=len(records),
    tokens=tokens,
    mean_nll=round(nll, 6),
    perplexity=round(math.exp(nll), 4),
  )


def score() -> None:
  setup = cli.setup(examples.SCORE, encode)
  top_n, vocab = _TOP_N.value, setup.described.hparams.vocab
  if top_n > vocab:
    raise app.UsageError(f"--top_n={top_n} exceeds the vocabulary ({vocab})")

  def run_batch(model, prefix, rows, batch):
    records = scoring.score_batch(
      model,
      rows,
      time=batch.time,
      prefix=prefix,
      top_n=top_n,
      with_tokens=_TOKENS.value,
    )
    return [None if r is None else [r] for r in records]

  run = cli.run(
    setup,
    keys=lambda p: [examples.id_key(p.example.id)],
    run_batch=run_batch,
    settings={"script": "score", "top_n": top_n, "tokens": _TOKENS.value},
  )
  if run.process == 0:
    cli.report(summarize(setup, run))


main = cli.main(score)

if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
