"""Tokenizers rebuilt from a GGUF file's metadata.

GGUF files describe their tokenizer by kind (`tokenizer.ggml.model`):
  * "gpt2": byte-level BPE (tokens spelled in GPT-2's byte alphabet, merges
    listed) with the pre-tokenizer split regexes that `tokenizer.ggml.pre`
    names, as llama.cpp defines them (`PRE_TOKENIZER_SPLITS`):
    `byte_level_bpe`;
  * "llama": SentencePiece BPE (pieces with "▁" for spaces, scores, byte
    fallback tokens `<0xNN>`); merges are rebuilt from the scores:
    `sentencepiece_bpe`.
Both return a `tokenizers.Tokenizer` for `TokenizerVocabulary`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# llama.cpp's GGUF token types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = (
  r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
)
_LLAMA3 = (
  r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
  r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.pre -> the regexes llama.cpp splits text with, in order
# (each piece of one split is split again by the next), before byte-level
# BPE. Names missing here are rejected rather than guessed.
PRE_TOKENIZER_SPLITS: Mapping[str, tuple[str, ...]] = {
  "gpt2": (_GPT2,),
  "gpt-2": (_GPT2,),
  # Digits one by one, then GPT-2's split (SmolLM, StarCoder, ...).
  **{
    name: (r"\p{N}", _GPT2)
    for name in (
      "smollm",
      "starcoder",
      "refact",
      "command-r",
      "codeshell",
      "exaone",
      "minerva",
    )
  },
  **{
    name: (_LLAMA3,)
    for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")
  },
  **{name: (_QWEN2,) for name in ("qwen2", "deepseek-r1-qwen")},
}
# Pre-tokenizers under which a pre-token that is itself a token is taken
# whole, without merging (llama.cpp's `ignore_merges`).
_IGNORE_MERGES = frozenset(
  ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")
)


def _add_special_tokens(tokenizer, tokens, token_types) -> None:
  """Control tokens become special added tokens and user-defined ones plain
  added tokens, so both are matched whole in text (as llama.cpp does)."""
  import tokenizers

  added = []
  for token, kind in zip(tokens, token_types, strict=True):
    if kind in (CONTROL, USER_DEFINED):
      added.append(
        tokenizers.AddedToken(token, special=kind == CONTROL, normalized=False)
      )
  if added:
    tokenizer.add_tokens(added)


def byte_level_bpe(
  tokens: Sequence[str],
  merges: Sequence[str],
  token_types: Sequence[int],
  pre: str,
) -> Any:
  """A GPT-2-style byte-level BPE `tokenizers.Tokenizer`.

  Args:
    tokens: the vocabulary, spelled in GPT-2's byte alphabet.
    merges: "left right" pairs, best first.
    token_types: llama.cpp token types, one per token.
    pre: the pre-tokenizer name (`tokenizer.ggml.pre`).
  """
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers

  if pre not in PRE_TOKENIZER_SPLITS:
    known = ", ".join(sorted(PRE_TOKENIZER_SPLITS))
    raise ValueError(
      f"unknown pre-tokenizer tokenizer.ggml.pre={pre!r}; known: {known}"
    )
  vocab = {token: i for i, token in enumerate(tokens)}
  pairs = [tuple(m.split(" ", 1)) for m in merges]
  tokenizer = tokenizers.Tokenizer(
    models.BPE(
      vocab=vocab,
      merges=pairs,
      ignore_merges=pre in _IGNORE_MERGES,
    )
  )
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
    [
      *(
        pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated")
        for r in PRE_TOKENIZER_SPLITS[pre]
      ),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
  )
  tokenizer.decoder = decoders.ByteLevel()
  _add_special_tokens(tokenizer, tokens, token_types)
  return tokenizer


def sentencepiece_merges(
  tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int]
) -> list[tuple[str, str]]:
  """BPE merges equivalent to SentencePiece BPE's greedy rule.

  SentencePiece merges, at each step, the adjacent pair whose concatenation
  is the highest-scoring piece; so every split of a piece into two pieces is
  a merge, ranked by the merged piece's score.
  """
  vocab = {t: i for i, t in enumerate(tokens)}
  ranked = []
  for token, score, kind in zip(tokens, scores, token_types, strict=True):
    if kind not in (NORMAL, USER_DEFINED) or len(token) < 2:
      continue
    for cut in range(1, len(token)):
      left, right = token[:cut], token[cut:]
      if left in vocab and right in vocab:
        ranked.append((-score, vocab[left], vocab[right], left, right))
  ranked.sort()
  return [(left, right) for *_, left, right in ranked]


def sentencepiece_bpe(
  tokens: Sequence[str],
  scores: Sequence[float],
  token_types: Sequence[int],
  *,
  unk_id: int | None,
  add_space_prefix: bool = True,
) -> Any:
  """A SentencePiece BPE (Llama 1/2 style) `tokenizers.Tokenizer`: spaces
  are "▁", unknown characters fall back to `<0xNN>` byte tokens."""
  import tokenizers
  from tokenizers import decoders, models, normalizers

  vocab = {token: i for i, token in enumerate(tokens)}
  tokenizer = tokenizers.Tokenizer(
    models.BPE(
      vocab=vocab,
      merges=sentencepiece_merges(tokens, scores, token_types),
      unk_token=None if unk_id is None else tokens[unk_id],
      fuse_unk=True,
      byte_fallback=True,
    )
  )
  space = [normalizers.Replace(" ", "▁")]
  decode = [
    decoders.Replace("▁", " "),
    decoders.ByteFallback(),
    decoders.Fuse(),
  ]
  if add_space_prefix:
    space.insert(0, normalizers.Prepend("▁"))
    decode.append(decoders.Strip(" ", 1, 0))
  tokenizer.normalizer = normalizers.Sequence(space)
  tokenizer.decoder = decoders.Sequence(decode)
  _add_special_tokens(tokenizer, tokens, token_types)
  return tokenizer
