"""Continuous batching: many requests through a fixed number of slots.

  slots          the device loop: `init`, `admit`, `run` over every slot.
  rows           a segment over some of the slots (a bucket), in place.
  buckets        which slots a segment runs: the smallest compiled size.
  slot_requests  `Request`, `RequestResult` and their checks on the host.
  admission      the host putting prompts into free slots (both loops).
  continuous     `generate_many`: a known list of requests, to the end.
  live           `LiveSlots`: requests that arrive and leave at any time.
  live_requests  a live loop's `Prepared` requests and `SlotUpdate`s.
  segments       a live segment and its report, queued ahead of the host.
  warmup         every program a live loop's requests take, compiled first.
  heads          prefix-cache hits whose prefill compiles in the background.

What it may import: `slots`, `rows`, `buckets`, `segments`,
`slot_requests` and `live_requests` sit on the inference core (chunks,
results, the plain loop `generate`) and `paging`; `admission`,
`continuous`, `live`, `warmup` and `heads`, the host side, sit above
`engines` (which compile `slots`' programs) and `speculation`. Nothing in
the core imports this package; `InferenceModel` does.
"""
