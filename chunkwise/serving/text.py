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

`StopStrings` finds the first stop string in the text (it may span
tokens, or end inside one), and tells how much of a streamed text may be
shown before a stop string could still begin there (OpenAI routes never
show part of one).
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
    last `new` characters, or None."""
    if not self.stops or not new:
      return None
    lo = max(0, len(text) - new - self._longest + 1)
    best = None
    for s in self.stops:
      i = text.find(s, lo)
      if i >= 0 and (best is None or i < best[0]):
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
