"""Paged and prefix-cached K/V for the slot loops.

  paged_kv      `PagedKV`: a slot loop's K/V in one pool of fixed pages
                (device side; attention reads it as `PagedLayer`s).
  page_table    `Pages`: the host's page allocation, eviction and
                preemption for one pool.
  prefix_cache  `PrefixCache`: K/V of full pages of prompts, shared by
                later requests with the same start.

What it may import: the inference core's `kv_cache` and nothing else of
`inference`; `batching` and `InferenceModel` import it.
"""
