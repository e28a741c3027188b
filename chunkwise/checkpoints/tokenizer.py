"""Tokenizers of real checkpoints, behind seqio's Vocabulary surface.

`TokenizerVocabulary` wraps a Hugging Face `tokenizers.Tokenizer` (from a
`tokenizer.json`, or rebuilt from a GGUF file's metadata by
`gguf_tokenizer`) so `Chunk.tokenize` / `Chunk.detokenize` use it unchanged:

  vocab = TokenizerVocabulary.from_file("tokenizer.json", bos_id=1, eos_id=2)
  vocab.encode(" Hello\tworld")     # ids; special tokens such as
                                    # "<|im_end|>" in the text stay whole
  vocab.decode(vocab.encode(s)) == s

`token_bytes` spells each token as the bytes it decodes to, for
constrained generation.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from chunkwise import untrusted
from chunkwise.checkpoints.chat_template import ChatTemplate

# Largest tokenizer.json read (Gemma 3's is 33 MB).
MAX_TOKENIZER_BYTES = 1 << 30


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible map from bytes to printable characters.

  Printable Latin-1 bytes map to themselves; the other 68 bytes (controls,
  space, ...) map to U+0100 onwards, so " " is "Ġ" and "\\n" is "Ċ".
  """
  printable = [
    *range(ord("!"), ord("~") + 1),
    *range(ord("¡"), ord("¬") + 1),
    *range(ord("®"), ord("ÿ") + 1),
  ]
  out = {b: chr(b) for b in printable}
  extra = 0
  for b in range(256):
    if b not in out:
      out[b] = chr(256 + extra)
      extra += 1
  return out


class TokenizerVocabulary:
  """A `tokenizers.Tokenizer` with seqio.Vocabulary's host-side surface.

  Args:
    tokenizer: the `tokenizers.Tokenizer`.
    bos_id, eos_id: BOS / EOS token ids; None when the model has none.
    eos_ids: every id that ends a sequence (the first is `eos_id`);
      default: (eos_id,).
    pad_id: id used to pad chunks; default: `pad_id` else EOS else 0.
    unk_id: the unknown token's id, if any.
    chat_template: the model's Jinja chat template, if it ships one
      (untrusted: rendered in a sandbox, see `chat_template.py`).
    chat_template_source: where the template came from, for messages
      (e.g. "model.gguf: tokenizer.chat_template").

  Encoding adds no special tokens (chunkwise adds BOS itself, see
  `Chunk.tokenize`); control tokens written in the text are matched whole.
  Decoding keeps special tokens and drops ids the tokenizer does not know
  (a model's embedding table may be padded past the tokenizer).
  """

  def __init__(
    self,
    tokenizer: Any,
    *,
    bos_id: int | None = None,
    eos_id: int | None = None,
    eos_ids: Sequence[int] | None = None,
    pad_id: int | None = None,
    unk_id: int | None = None,
    chat_template: str | None = None,
    chat_template_source: str = "the checkpoint",
  ):
    self._tokenizer = tokenizer
    self._size = tokenizer.get_vocab_size(with_added_tokens=True)
    for name, value in (
      ("bos_id", bos_id),
      ("eos_id", eos_id),
      ("pad_id", pad_id),
      ("unk_id", unk_id),
    ):
      if value is not None and not 0 <= value < self._size:
        raise ValueError(
          f"{name}={value} is outside the tokenizer's {self._size} ids"
        )
    if eos_ids is not None:
      eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
      for i in eos_ids:
        if not 0 <= i < self._size:
          raise ValueError(
            f"eos_ids holds {i}, outside the tokenizer's {self._size} ids"
          )
      if eos_ids and eos_id is None:
        eos_id = eos_ids[0]
      elif eos_ids and eos_ids[0] != eos_id:
        raise ValueError(
          f"eos_id={eos_id} must be the first of eos_ids={list(eos_ids)}"
        )
      elif not eos_ids and eos_id is not None:
        eos_ids = (eos_id,)
    self._bos_id = bos_id
    self._eos_id = eos_id
    self._eos_ids = (
      eos_ids if eos_ids is not None else (() if eos_id is None else (eos_id,))
    )
    self._pad_id = pad_id if pad_id is not None else (eos_id or 0)
    self._unk_id = unk_id
    self._chat_template = (
      None
      if chat_template is None
      else ChatTemplate(chat_template, chat_template_source)
    )
    self._token_bytes = None
    self._text_tokenizer = None  # `encode_text`'s
    self._controls = None

  @classmethod
  def from_file(cls, path: str, **kwargs) -> TokenizerVocabulary:
    """Reads a Hugging Face `tokenizer.json`; kwargs as the constructor.

    The file is untrusted: one over `MAX_TOKENIZER_BYTES` is refused
    before it is read, and the tokenizers library's errors (and panics)
    become a ValueError naming it.
    """
    import tokenizers

    path = os.fspath(path)
    data = untrusted.read_bytes(
      path, max_bytes=MAX_TOKENIZER_BYTES, what="tokenizer"
    )
    try:
      tokenizer = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}: not valid UTF-8 ({e.reason})") from None
    except Exception as e:  # the tokenizers library raises plain Exception
      raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from None
    except BaseException as e:  # a Rust panic (pyo3's PanicException)
      if type(e).__name__ != "PanicException":
        raise
      raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from None
    try:
      return cls(tokenizer, **kwargs)
    except ValueError as e:
      raise ValueError(f"{path}: {e}") from None

  @property
  def tokenizer(self) -> Any:
    return self._tokenizer

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def eos_id(self) -> int | None:
    return self._eos_id

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """Every id that ends a sequence, `eos_id` first."""
    return self._eos_ids

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def unk_id(self) -> int | None:
    return self._unk_id

  @property
  def vocab_size(self) -> int:
    return self._size

  @property
  def chat_template(self) -> str | None:
    """The Jinja chat template string the checkpoint ships, or None."""
    return None if self._chat_template is None else self._chat_template.text

  def with_chat_template(
    self, text: str, source: str = "the caller"
  ) -> TokenizerVocabulary:
    """This vocabulary with `text` as its chat template (checked to
    parse now: a ChatTemplateError names `source`)."""
    out = copy.copy(self)
    out._chat_template = ChatTemplate(text, source).check()
    return out

  @property
  def chat_template_source(self) -> str | None:
    """Where the chat template came from (file and field), or None."""
    return None if self._chat_template is None else self._chat_template.source

  def encode(self, s: str) -> list[int]:
    if not isinstance(s, str):
      raise ValueError(f"encode expects a str, got {s!r}")
    return self._tokenizer.encode(s, add_special_tokens=False).ids

  def encode_text(self, s: str) -> list[int]:
    """`encode`, but a control token's name written in `s`
    ("<|im_end|>") is text, not the control token: what text a user
    wrote is (`serving`'s chat prompts)."""
    if not isinstance(s, str):
      raise ValueError(f"encode_text expects a str, got {s!r}")
    if self._text_tokenizer is None:
      from tokenizers import Tokenizer

      plain = Tokenizer.from_str(self._tokenizer.to_str())
      plain.encode_special_tokens = True
      self._text_tokenizer = plain
    return self._text_tokenizer.encode(s, add_special_tokens=False).ids

  def control_texts(self) -> tuple[str, ...]:
    """The names of the control (special) tokens, as text may spell them."""
    if self._controls is None:
      added = self._tokenizer.get_added_tokens_decoder().values()
      self._controls = tuple(
        a.content for a in added if a.special and a.content
      )
    return self._controls

  def decode(self, ids: Sequence[int]) -> str:
    known = [int(i) for i in ids if 0 <= int(i) < self._size]
    return self._tokenizer.decode(known, skip_special_tokens=False)

  def token_bytes(self) -> list[bytes | None]:
    """Every id's text as bytes, None for special (control) tokens.

    Byte-level BPE tokens are read through GPT-2's byte map; SentencePiece
    pieces turn "▁" into a space and `<0xNN>` into byte NN. Constrained
    generation builds its automata from these bytes (never from decoded
    strings, which lose partial UTF-8 sequences).
    """
    if self._token_bytes is None:
      self._token_bytes = _token_bytes(self._tokenizer, self._size)
    return list(self._token_bytes)

  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **variables: Any,
  ) -> str:
    """Renders `messages` ([{"role", "content"}, ...]) with the model's
    template, in a sandbox (`chat_template.py`), as transformers does:
    `bos_token` / `eos_token` (and `tools`, `documents`, any `variables`
    such as `enable_thinking`) are passed to it.

    Raises:
      ValueError: no template; `ChatTemplateError` (a ValueError naming
        the template's source) when it fails to parse, breaks the
        sandbox, calls `raise_exception` or runs past a limit.
    """
    if self._chat_template is None:
      raise ValueError("this vocabulary has no chat template")
    token = self._tokenizer.id_to_token
    specials = {
      "bos_token": self._bos_id,
      "eos_token": self._eos_id,
      "unk_token": self._unk_id,
    }
    for name, i in specials.items():
      variables.setdefault(name, "" if i is None else token(i) or "")
    return self._chat_template.render(
      messages,
      add_generation_prompt=add_generation_prompt,
      tools=tools,
      **variables,
    )

  def __repr__(self) -> str:
    return (
      f"TokenizerVocabulary(size={self._size}, bos_id={self._bos_id}, "
      f"eos_id={self._eos_id})"
    )


def _token_kind(tokenizer) -> str:
  """'byte_level' or 'sentencepiece': how token strings spell bytes."""
  import json

  config = json.loads(tokenizer.to_str())
  text = json.dumps([config.get("decoder"), config.get("pre_tokenizer")])
  if '"ByteLevel"' in text:
    return "byte_level"
  if "\u2581" in text or "▁" in text or '"ByteFallback"' in text:
    return "sentencepiece"
  raise ValueError(
    "cannot tell how this tokenizer's tokens map to bytes (neither a "
    "byte-level BPE decoder nor SentencePiece '▁' pieces); constrained "
    "generation needs token bytes"
  )


def _token_bytes(tokenizer, size: int) -> tuple[bytes | None, ...]:
  kind = _token_kind(tokenizer)
  special = {
    i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
  }
  added = {
    i: t.content
    for i, t in tokenizer.get_added_tokens_decoder().items()
    if not t.special
  }
  to_byte = {c: b for b, c in bytes_to_unicode().items()}
  out: list[bytes | None] = []
  for i in range(size):
    token = tokenizer.id_to_token(i)
    if i in special or token is None:
      out.append(None)
    elif i in added:
      out.append(added[i].encode("utf-8"))
    elif kind == "byte_level":
      if all(c in to_byte for c in token):
        out.append(bytes(to_byte[c] for c in token))
      else:
        out.append(token.encode("utf-8"))
    elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
      out.append(bytes([int(token[3:5], 16)]))
    else:
      out.append(token.replace("▁", " ").encode("utf-8"))
  return tuple(out)
