"""Token ids to text as they arrive: incremental detokenization and stop
strings.

  text = Detokenizer(model.vocab, specials=model.eos_ids)
  piece = text.add(token_id)       # "" until a UTF-8 character completes
  rest = text.flush()              # what an unfinished character leaves

Each token's text is its bytes (`vocab.token_bytes()`) run through one
incremental UTF-8 decoder, so the pieces of a request join to exactly the
decoded text of its tokens and a multi-byte character is never split
(its bytes' earlier tokens get ""). Special tokens (EOS, control tokens)
spell their name and add nothing to the text.

`StopScanner` finds the first stop string in the text (it may span
tokens, or end inside one) as the text grows, and tells how much of it
may be shown before a stop string could still begin there (OpenAI
routes never show part of one): an Aho-Corasick automaton over
characters, so the work is one step per character, whatever the stop
strings' length and number. `StopStrings` is its plain twin, searching
the text again each time (the tests compare them).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class Detokenizer:
  """One request's incremental detokenizer (module docstring)."""

  def __init__(self, vocab, *, specials: Sequence[int] = ()):
    self._vocab = vocab
    self._bytes = token_bytes(vocab)
    self._specials = set(specials)
    self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

  def is_special(self, token: int) -> bool:
    if token in self._specials:
      return True
    return self._bytes is not None and (
      token < len(self._bytes) and self._bytes[token] is None
    )

  def name(self, token: int) -> str:
    """A token's own spelling (special tokens: their name)."""
    return self._vocab.decode([token])

  def add(self, token: int) -> str:
    """The text `token` completes ("" for a special token, or while a
    character's bytes are incomplete)."""
    if self.is_special(token):
      return ""
    if self._bytes is None:
      return self._decoder.decode(self.name(token).encode("utf-8"))
    raw = self._bytes[token] if token < len(self._bytes) else None
    if raw is None:  # an id past the tokenizer's table
      raw = "\ufffd".encode()
    return self._decoder.decode(raw)

  def flush(self) -> str:
    """What the bytes of an unfinished character spell (U+FFFD)."""
    return self._decoder.decode(b"", final=True)


def token_bytes(vocab) -> list | None:
  """Every id's bytes (None: special), or None for a vocabulary that
  cannot say (its tokens then decode one by one)."""
  get = getattr(vocab, "token_bytes", None)
  return None if get is None else list(get())


class StopStrings:
  """The stop strings of one request."""

  def __init__(self, stops: Sequence[str]):
    self.stops = tuple(s for s in stops if s)
    self._longest = max((len(s) for s in self.stops), default=0)

  def find(self, text: str, new: int) -> tuple[int, str] | None:
    """(index, stop) of the first stop string in `text` that ends in its
    last `new` characters (of two that start at one index, the shorter),
    or None."""
    if not self.stops or not new:
      return None
    lo = max(0, len(text) - new - self._longest + 1)
    best = None
    for s in self.stops:
      i = text.find(s, lo)
      if i >= 0 and (best is None or (i, len(s)) < (best[0], len(best[1]))):
        best = (i, s)
    return best

  def safe(self, text: str) -> int:
    """Characters of `text` that no stop string can still begin in: a
    suffix that is a prefix of a stop string is held back."""
    for k in range(min(self._longest - 1, len(text)), 0, -1):
      tail = text[-k:]
      if any(s.startswith(tail) for s in self.stops):
        return len(text) - k
    return len(text)


class StopScanner:
  """One request's stop strings, matched as its text grows (module
  docstring):

    scan = StopScanner(["END", "\\n\\n"])
    scan.feed("abc EN")     # None: no stop string yet
    scan.held               # 2: "EN" may begin "END", hold it back
    scan.feed("D!")         # (4, "END"): where it starts, which one
  """

  def __init__(self, stops: Sequence[str]):
    stops = tuple(dict.fromkeys(s for s in stops if s))
    self.stops = stops
    # the trie of the stop strings: state -> {character: state}
    self._goto: list[dict[str, int]] = [{}]
    self._depth = [0]
    self._ends: list[str | None] = [None]  # the stop string ending here
    for stop in stops:
      at = 0
      for ch in stop:
        nxt = self._goto[at].get(ch)
        if nxt is None:
          nxt = len(self._goto)
          self._goto[at][ch] = nxt
          self._goto.append({})
          self._depth.append(self._depth[at] + 1)
          self._ends.append(None)
        at = nxt
      self._ends[at] = stop
    # failure links, breadth-first; `_ends` then names the longest stop
    # string ending at each state, itself or through its failure chain
    self._fail = [0] * len(self._goto)
    queue = list(self._goto[0].values())
    for at in queue:
      for ch, nxt in self._goto[at].items():
        f = self._fail[at]
        while f and ch not in self._goto[f]:
          f = self._fail[f]
        back = self._goto[f].get(ch, 0)
        self._fail[nxt] = back if back != nxt else 0
        if self._ends[nxt] is None:
          self._ends[nxt] = self._ends[self._fail[nxt]]
        queue.append(nxt)
    self._state = 0
    self.length = 0  # characters fed

  def feed(self, text: str) -> tuple[int, str] | None:
    """Takes the text's next characters; returns (index in the whole
    text, stop string) of the stop string that starts first among those
    that end in them, or None."""
    best = None
    goto, fail, ends = self._goto, self._fail, self._ends
    at = self._state
    for ch in text:
      while at and ch not in goto[at]:
        at = fail[at]
      at = goto[at].get(ch, 0)
      self.length += 1
      stop = ends[at]
      if stop is not None:
        start = self.length - len(stop)
        if best is None or start < best[0]:
          best = (start, stop)
    self._state = at
    return best

  @property
  def held(self) -> int:
    """Characters at the end of the text fed that a stop string may still
    begin with (the longest such suffix): what a stream holds back."""
    return self._depth[self._state]
