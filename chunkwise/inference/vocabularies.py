"""The vocabulary protocol (seqio's surface) and a byte-level vocabulary.

Anything with seqio.Vocabulary's host-side surface works unchanged:
`encode(str) -> Sequence[int]`, `decode(Sequence[int]) -> str` and the
properties `bos_id`, `eos_id`, `pad_id`, `vocab_size`. A `bos_id` of -1 (or
None) means "no BOS"; chunkwise then uses the model's BOS id, 0 by default,
as T5 and the original code do.

  vocab = ByteVocabulary()
  vocab.encode("hé")       # [107, 198, 172]: UTF-8 bytes shifted by 3
  vocab.decode([107, 198, 172])  # "hé"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Vocabulary(Protocol):
  """What chunkwise needs of a tokenizer (a subset of seqio.Vocabulary)."""

  @property
  def bos_id(self) -> int | None: ...

  @property
  def eos_id(self) -> int | None: ...

  @property
  def pad_id(self) -> int: ...

  @property
  def vocab_size(self) -> int: ...

  def encode(self, s: str) -> Sequence[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


def bos_id_of(vocab: Vocabulary | None, default: int = 0) -> int:
  """The vocabulary's BOS id, or `default` where it has none (-1 or None)."""
  bos = getattr(vocab, "bos_id", None) if vocab is not None else None
  return default if bos is None or bos < 0 else int(bos)


def eos_id_of(vocab: Vocabulary | None) -> int | None:
  """The vocabulary's EOS id, or None where it has none."""
  eos = getattr(vocab, "eos_id", None) if vocab is not None else None
  return None if eos is None or eos < 0 else int(eos)


def eos_ids_of(vocab: Vocabulary | None) -> tuple[int, ...]:
  """Every id that ends a sequence: the vocabulary's `eos_ids` where it
  has them (Llama 3 instruct: <|end_of_text|>, <|eot_id|>, ...), else its
  EOS id, else none."""
  ids = getattr(vocab, "eos_ids", None) if vocab is not None else None
  if ids:
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None and i >= 0))
  eos = eos_id_of(vocab)
  return () if eos is None else (eos,)


def special_ids(
  vocab: Vocabulary | None, bos_id, eos_id, *, size: int, eos_ids=None
) -> tuple[int, tuple[int, ...]]:
  """(BOS id, EOS ids): the given ones, else the vocabulary's (BOS 0 where
  it has none). `eos_id` alone gives (eos_id,); `eos_ids` lists every EOS
  (the first is the model's `eos_id`). Raises ValueError for an id
  outside [0, size)."""
  bos = bos_id_of(vocab) if bos_id is None else int(bos_id)
  if eos_ids is not None:
    eos = tuple(dict.fromkeys(int(i) for i in eos_ids))
    if eos_id is not None and eos[:1] != (int(eos_id),):
      raise ValueError(
        f"eos_id={eos_id} must be the first of eos_ids={list(eos)}"
      )
  elif eos_id is not None:
    eos = (int(eos_id),)
  else:
    eos = eos_ids_of(vocab)
  names = ["bos_id", "eos_id", *["eos_ids"] * (len(eos) - 1)]
  for name, value in zip(names, (bos, *eos), strict=False):
    if not 0 <= value < size:
      raise ValueError(
        f"{name}={value} is outside the model's vocabulary [0, {size})"
      )
  return bos, eos


class ByteVocabulary:
  """UTF-8 bytes as tokens: pad 0, BOS 1, EOS 2, byte b is id b + 3.

  For tests and demos with random models: every string round-trips. Ids that
  are not bytes (specials, or ids beyond 258 that a model with a larger
  vocabulary may produce) decode to nothing and to U+FFFD respectively.
  """

  PAD, BOS, EOS = 0, 1, 2
  OFFSET = 3

  @property
  def bos_id(self) -> int:
    return self.BOS

  @property
  def eos_id(self) -> int:
    return self.EOS

  @property
  def pad_id(self) -> int:
    return self.PAD

  @property
  def unk_id(self) -> None:
    return None

  @property
  def vocab_size(self) -> int:
    return 256 + self.OFFSET

  def encode(self, s: str) -> list[int]:
    if not isinstance(s, str):
      raise ValueError(f"ByteVocabulary.encode expects a str, got {s!r}")
    return [b + self.OFFSET for b in s.encode("utf-8")]

  def decode(self, ids: Sequence[int]) -> str:
    out = bytearray()
    for i in ids:
      i = int(i)
      if self.OFFSET <= i < self.vocab_size:
        out.append(i - self.OFFSET)
      elif i >= self.vocab_size:
        out += "\ufffd".encode()
    return out.decode("utf-8", errors="replace")

  def token_bytes(self) -> list[bytes | None]:
    """Each id's bytes (None for pad, BOS and EOS)."""
    return [None] * self.OFFSET + [bytes([b]) for b in range(256)]

  def __repr__(self) -> str:
    return "ByteVocabulary()"

  def __eq__(self, other: object) -> bool:
    return isinstance(other, ByteVocabulary)

  def __hash__(self) -> int:
    return hash(ByteVocabulary)


def random_model_vocab(vocab_size: int) -> ByteVocabulary | None:
  """The vocabulary a random-weight model gets: bytes when its table holds
  all of `ByteVocabulary`'s ids, else none."""
  byte = ByteVocabulary()
  return byte if vocab_size >= byte.vocab_size else None
