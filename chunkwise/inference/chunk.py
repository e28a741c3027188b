"""`Chunk`: a right-padded batch of token ids, the unit of text in chunkwise.

  chunk = Chunk.tokenize(vocab, ["Cows have 4 legs.", "Hi"],
                         is_first_chunk=True)   # prepends BOS to each row
  chunk.tokens        # int32[2, 18]; row 1 is [BOS, 'H', 'i', pad, ...]
  chunk.lengths       # int32[2] = [18, 3]
  head, tail = chunk.split_at(4)
  chunk.detokenize(vocab)  # ["Cows have 4 legs.", "Hi"] (BOS decodes to "")

Positions `>= lengths[b]` are padding. Only the first chunk of a sequence
starts with BOS; continuation chunks (prefilled with a prefix) do not.

Chunks built from text or lists hold numpy arrays: they stay on the host,
where `InferenceModel` validates them without a device round trip, until a
call places them (chunks that `generate` returns hold device arrays).
`split_at` and `pad_to_length` keep the arrays where they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from chunkwise.inference.vocabularies import Vocabulary, bos_id_of
from chunkwise.partitioning import axes as ax


@struct.dataclass(kw_only=True)
class Chunk:
  """Token ids int32[batch, time] with per-row valid lengths int32[batch]."""

  tokens: jax.Array | np.ndarray  # int32[batch, time]
  lengths: jax.Array | np.ndarray  # int32[batch]

  @classmethod
  def axes(cls) -> Chunk:
    return cls(tokens=P(ax.BATCH, ax.TIME), lengths=P(ax.BATCH))

  @property
  def batch(self) -> int:
    return self.tokens.shape[0]

  @property
  def time(self) -> int:
    return self.tokens.shape[1]

  @classmethod
  def from_lists(
    cls,
    rows: Sequence[Sequence[int]],
    *,
    pad_id: int = 0,
    pad_length: int | None = None,
  ) -> Chunk:
    """A chunk of the given token id rows, right-padded with `pad_id`."""
    if isinstance(rows, str | bytes) or not len(rows):
      raise ValueError(
        f"Chunk.from_lists needs a non-empty list of token id lists, got "
        f"{rows!r}"
      )
    longest = max(len(r) for r in rows)
    width = longest if pad_length is None else pad_length
    if width < longest:
      raise ValueError(
        f"pad_length={pad_length} is shorter than the longest row "
        f"({longest} tokens)"
      )
    tokens = np.full((len(rows), width), pad_id, np.int32)
    for i, row in enumerate(rows):
      tokens[i, : len(row)] = np.asarray(row, np.int64)
    lengths = np.array([len(r) for r in rows], np.int32)
    return cls(tokens=tokens, lengths=lengths)

  @classmethod
  def tokenize(
    cls,
    vocab: Vocabulary,
    texts: Sequence[str],
    *,
    is_first_chunk: bool = False,
    append_eos: bool = False,
    pad_length: int | None = None,
    bos_id: int | None = None,
  ) -> Chunk:
    """Encodes `texts` with `vocab` into one right-padded chunk.

    Args:
      vocab: any object with seqio.Vocabulary's `encode`/`pad_id`/`bos_id`/
        `eos_id` surface.
      texts: one string per row.
      is_first_chunk: prepend BOS (`bos_id`, else the vocabulary's BOS, else 0
        for vocabularies without one) to every row.
      append_eos: append the vocabulary's EOS to every row.
      pad_length: total width of the chunk (BOS included); default: the
        longest row.
      bos_id: overrides the BOS id (use the model's `bos_id`).
    """
    if isinstance(texts, str):
      raise ValueError(
        f"Chunk.tokenize expects a list of strings, got the string "
        f"{texts!r}; wrap it in a list"
      )
    texts = list(texts)
    if not texts:
      raise ValueError("Chunk.tokenize needs at least one text")
    rows = []
    for text in texts:
      if not isinstance(text, str):
        raise ValueError(f"Chunk.tokenize expects strings, got {text!r}")
      row = [int(i) for i in vocab.encode(text)]
      if append_eos:
        eos = getattr(vocab, "eos_id", None)
        if eos is None or eos < 0:
          raise ValueError(
            f"append_eos=True but the vocabulary {vocab!r} has no EOS id"
          )
        row.append(int(eos))
      if is_first_chunk:
        row.insert(0, bos_id_of(vocab) if bos_id is None else bos_id)
      rows.append(row)
    return cls.from_lists(rows, pad_id=int(vocab.pad_id), pad_length=pad_length)

  def detokenize(self, vocab: Vocabulary) -> list[str]:
    """Decodes each row's valid tokens (`tokens[b, :lengths[b]]`)."""
    tokens, lengths = np.asarray(self.tokens), np.asarray(self.lengths)
    return [
      vocab.decode([int(t) for t in row[:n]])
      for row, n in zip(tokens, lengths, strict=True)
    ]

  def to_lists(self) -> list[list[int]]:
    """Each row's valid tokens as a Python list."""
    tokens, lengths = np.asarray(self.tokens), np.asarray(self.lengths)
    return [row[:n].tolist() for row, n in zip(tokens, lengths, strict=True)]

  @property
  def token_mask(self) -> jax.Array:
    """bool[batch, time]: True where the position holds a real token."""
    return jnp.arange(self.time)[None, :] < self.lengths[:, None]

  def split_at(self, n: int) -> tuple[Chunk, Chunk]:
    """Columns [:n] and [n:]; prefilling both in turn equals the whole."""
    if not 0 <= n <= self.time:
      raise ValueError(
        f"split_at({n}) is outside the chunk's 0..{self.time} columns"
      )
    xp = _array_module(self.lengths)
    first = Chunk(
      tokens=self.tokens[:, :n], lengths=xp.minimum(self.lengths, n)
    )
    second = Chunk(
      tokens=self.tokens[:, n:], lengths=xp.maximum(self.lengths, n) - n
    )
    return first, second

  def pad_to_length(self, n: int, pad_id: int = 0) -> Chunk:
    """Adds padding columns up to width `n`; lengths are unchanged."""
    if n < self.time:
      raise ValueError(
        f"pad_to_length({n}) is shorter than the chunk's {self.time} columns"
      )
    tokens = _array_module(self.tokens).pad(
      self.tokens, ((0, 0), (0, n - self.time)), constant_values=pad_id
    )
    return Chunk(tokens=tokens, lengths=self.lengths)


def _array_module(x):
  """numpy for host arrays, jax.numpy for device ones: chunk edits stay
  where the chunk is."""
  return np if isinstance(x, np.ndarray) else jnp
