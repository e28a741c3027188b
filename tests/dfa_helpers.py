"""DFAs over bytes compared by what they spell (their states may be
numbered differently)."""

import numpy as np


def same_language(a: dict, b: dict) -> int:
  """Asserts that two trimmed DFAs over bytes accept the same texts (a
  walk of their product from both starts); returns the pairs walked."""
  seen, todo = {(0, 0)}, [(0, 0)]
  while todo:
    p, q = todo.pop()
    assert a["final"][p] == b["final"][q], (p, q)
    ra, rb = a["table"][p], b["table"][q]
    np.testing.assert_array_equal(ra >= 0, rb >= 0, err_msg=f"{(p, q)}")
    for byte in np.flatnonzero(ra >= 0):
      pair = (int(ra[byte]), int(rb[byte]))
      if pair not in seen:
        seen.add(pair)
        todo.append(pair)
  return len(seen)
