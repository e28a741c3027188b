"""DFAs over bytes compared by what they spell (their states may be
numbered differently)."""

import collections

import numpy as np

from chunkwise.constraints.tables import DEAD


def same_language(a: dict, b: dict, without: bytes = b"") -> int:
  """Asserts that two trimmed DFAs over bytes accept the same texts (a
  walk of their product from both starts), or with `without` (bytes that
  are all different) the same texts that do not contain it; returns the
  triples walked (a's state, b's, how much of `without` the text ends
  with)."""
  seen, todo = {(0, 0, 0)}, [(0, 0, 0)]
  while todo:
    p, q, k = todo.pop()
    ra, rb = a["table"][p], b["table"][q]
    step = [
      k + 1 if without and byte == without[k] else 0 for byte in range(256)
    ]
    if without:
      step = [
        j if j or byte != without[0] else 1 for byte, j in enumerate(step)
      ]
    allowed = np.array([j < len(without) or not without for j in step])
    assert a["final"][p] == b["final"][q], (p, q)
    np.testing.assert_array_equal(
      (ra >= 0) & allowed, (rb >= 0) & allowed, err_msg=f"{(p, q)}"
    )
    for byte in np.flatnonzero((ra >= 0) & allowed):
      triple = (int(ra[byte]), int(rb[byte]), step[byte])
      if triple not in seen:
        seen.add(triple)
        todo.append(triple)
  return len(seen)


def plain_token_distance(dfa, trie, stops, forced=None):
  """The plain twin of `lazy.token_distance`: each state's path walked
  in Python, byte by byte, looking its prefixes up among the tokens'
  bytes; a state `forced` (int[S], -1: none) names a token for counts
  that token's end's distance, plus one."""
  bytes_to = dfa.distance()
  succ = dfa.table
  ok = (succ >= 0) & (bytes_to[np.maximum(succ, 0)] == bytes_to[:, None] - 1)
  first = np.argmax(ok, axis=1)
  nxt = succ[np.arange(dfa.states), first]
  spelled = collections.defaultdict(set)  # every token prefix -> its ids
  for i in np.flatnonzero(trie.token_node >= 0).tolist():
    text = bytes(trie.token_bytes[i, : trie.token_length[i]])
    for k in range(1, len(text)):
      spelled[text[:k]]
    spelled[text].add(i)
  out = np.full(dfa.states, DEAD, np.int32)
  out[dfa.final] = 0
  stop = set(np.asarray(stops).tolist())
  for q in np.argsort(bytes_to, kind="stable").tolist():
    if bytes_to[q] >= DEAD or dfa.final[q]:
      continue
    best, text, at = DEAD, b"", q
    if forced is not None and forced[q] >= 0:
      token = int(forced[q])
      end = dfa.run(
        bytes(trie.token_bytes[token, : trie.token_length[token]]), q
      )
      out[q] = 1 + out[end] if out[end] < DEAD else DEAD
      continue
    while True:
      text += bytes([int(first[at])])
      at = int(nxt[at])
      if text not in spelled:
        break
      if spelled[text] - stop and out[at] < DEAD:
        best = min(best, 1 + int(out[at]))
      if dfa.final[at]:
        break
    out[q] = best
  return out
