"""The benchmark suite's optional families: each measured by its own
module of `chunkwise.bench` into one configuration's report, and every
table printed (`suite.measure` calls `measure`, the script `tables`).

  families.measure(settings, config, model, prompt_ids, first=True)
  print(families.tables(result))
"""

from __future__ import annotations

from chunkwise.bench import adapters as bench_adapters
from chunkwise.bench import chunked_prefill as bench_chunked
from chunkwise.bench import continuous as bench_continuous
from chunkwise.bench import fast_forward as bench_fast_forward
from chunkwise.bench import kv_dtype as bench_kv_dtype
from chunkwise.bench import numerics as bench_numerics
from chunkwise.bench import paged as bench_paged
from chunkwise.bench import report
from chunkwise.bench import slot_step as bench_slot_step
from chunkwise.bench import speculation as bench_speculation


def measure(s, config: dict, model, prompt, first: bool) -> None:
  """The optional families, into `config`: speculation and chunked
  prefill for every configuration, the others for the first only."""
  h, runs = model.hparams, max(s.runs, 1)
  # The int8 draft of int8 weights would be the weights themselves.
  drafts = {
    sp.drafter: sp
    for sp in s.speculate
    if sp.drafter != "draft" or config["weights"] != "int8"
  }
  if drafts:
    config["speculation"] = bench_speculation.compare(
      model,
      drafts,
      batches=s.speculate_batches,
      steps=s.steps,
      rounds=s.speculate_rounds,
    )
  if s.fast_forward_batches:
    config["fast_forward"] = bench_fast_forward.compare(
      model,
      batches=s.fast_forward_batches,
      rounds=s.speculate_rounds,
    )
  if s.chunked_prefill_length:
    config["chunked_prefill"] = bench_chunked.compare(
      model,
      prompt,
      long_length=s.chunked_prefill_length,
      steps=s.steps,
      piece=s.chunked_prefill_piece or None,
    )
  if not first:
    return
  if s.paged_attention_contexts:
    config["paged_attention"] = bench_paged.compare(
      h, rows=s.slots, contexts=list(s.paged_attention_contexts), runs=runs
    )
  if s.kv_dtype_contexts:
    config["kv_dtype"] = bench_kv_dtype.compare(
      model,
      rows=s.slots,
      contexts=list(s.kv_dtype_contexts),
      steps=s.steps,
      runs=runs,
    )
  if s.slot_step_capacity:
    config["slot_step"] = bench_slot_step.compare(
      model, prompt, slots=s.slots, capacity=s.slot_step_capacity, runs=runs
    )
  if s.continuous or s.paged_slots:
    requests = bench_continuous.workload(
      model, s.continuous_requests, long=s.continuous_long, seed=s.seed
    )
  if s.continuous:
    config["continuous"] = bench_continuous.compare(
      model, prompt, requests, slots=s.slots, runs=s.runs
    )
  if s.paged_slots:
    config["paged"] = bench_continuous.compare_paged(
      model,
      prompt,
      requests,
      slots=s.slots,
      paged_slots=s.paged_slots,
      runs=runs,
    )
  if s.adapters:
    config["adapters"] = bench_adapters.compare(
      model,
      prompt,
      adapters=s.adapters,
      rank=s.adapter_rank,
      batch=s.adapter_batch,
      steps=s.steps,
      runs=s.runs,
      seed=s.seed,
    )


def tables(result: dict) -> str:
  """The printed tables: the main one, constraints, then each family's."""
  out = [report.table(result)]
  if result["constraint_tables"]:
    out.append(report.constraint_table(result))
  for c in result["configs"]:
    name = c["name"]
    if "numerics" in c:
      out.append(f"{name}, numerics side by side:")
      out.append(bench_numerics.table(c["numerics"], c["numerics"]["drift"]))
    if "speculation" in c:
      out.append(f"{name}, speculation side by side:")
      out.append(bench_speculation.table(c["speculation"]))
    if "fast_forward" in c:
      out.append(f"{name}, constrained JSON against free text:")
      out.append(bench_fast_forward.table(c["fast_forward"]))
    if "continuous" in c:
      out.append(bench_continuous.table(c["continuous"]))
    if "adapters" in c:
      out.append(bench_adapters.table(c["adapters"]))
    if "paged" in c:
      out.append(bench_continuous.paged_table(c["paged"]))
    if "paged_attention" in c:
      out.extend(bench_paged.lines(c["paged_attention"]))
    for key, lines in (
      ("kv_dtype", bench_kv_dtype.lines),
      ("slot_step", bench_slot_step.lines),
      ("chunked_prefill", bench_chunked.lines),
    ):
      if key in c:
        out.append(f"{name}, " + "\n".join(lines(c[key])))
  return "\n".join(out)
