"""Scores a file of texts with a model: per-example log-probs, resumable,
on one machine or many.

  python scripts/score.py --input=texts.jsonl --output=scores.jsonl
  python scripts/score.py --model=/ckpt/m8 --input=mc.jsonl \\
      --output=out.jsonl --shared_prefix=@fewshot.txt --top_n=5 \\
      --layout=ws_2d --mesh=2x2x2 --batch_size=16
  python scripts/score.py --input=mixed.jsonl --output=out.jsonl \\
      --adapters=math=/ad/math,chat=/ad/chat

Input (see chunkwise/jobs/examples.py): JSON lines {"id", "text"} (every
token after BOS is scored) or {"id", "context", "continuation"} (only the
continuation is scored, given the context), or plain text, one example
per line, its id the line number. With --shared_prefix the text (or
@file) is prefilled once and every example continues it.

LoRA adapters: --adapters=math=/ad/math,chat=/ad/chat serves PEFT
adapters besides the base model; a JSON line picks one with "adapter"
(a name, or null for the base model), and --adapter=name is the choice
of every example that makes none (every line of a text input). Examples
of different adapters share batches; the shared prefix is prefilled once
per adapter used; records name their adapter ("adapter"; absent for the
base model).

Output: one JSON line per example: id, num_tokens, logprob (the sum,
natural log), token_logprobs, with --tokens the token ids, with --top_n
the n most likely tokens per position (ids, logprobs, decoded tokens).
Lines are written batch by batch; re-running with the same --output
skips the ids already there, so a killed job resumes. At the end the file
holds every example once, in input order, and a summary line is printed:
examples, tokens, mean NLL per token, perplexity, tokens/s.

Multi-host: pass --coordinator_address, --num_processes, --process_id to
every process (or --multihost for the platform's detection); see
chunkwise/jobs/driver.py for how examples and output are split. The same
job runs from Python: chunkwise.jobs.run_score(ScoreJob(...)).
"""

from __future__ import annotations

from absl import app, flags

from chunkwise.jobs import ScoreJob, cli, job_flags, run_score

JOB = job_flags.JobFlags()
_TOP_N = flags.DEFINE_integer(
  "top_n", 0, "Most likely alternatives per scored token.", lower_bound=0
)
_TOKENS = flags.DEFINE_bool("tokens", False, "Write each example's token ids.")


def score() -> None:
  job = ScoreJob(**JOB.fields(), top_n=_TOP_N.value, tokens=_TOKENS.value)
  cli.report(run_score(job))


main = cli.main(score)

if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
