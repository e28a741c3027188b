"""The vocabulary a checkpoint stores: its description in `chunkwise.json`
and, for a `TokenizerVocabulary`, `tokenizer.json`.

  desc, files = to_json(model.vocab)   # written by the save
  vocab = read(directory, desc)        # None when it was not stored
"""

from __future__ import annotations

import os

from absl import logging

from chunkwise import untrusted
from chunkwise.checkpoints.tokenizer import TokenizerVocabulary
from chunkwise.inference import ByteVocabulary

TOKENIZER = "tokenizer.json"
META = "chunkwise.json"


def to_json(vocab) -> tuple[dict, dict[str, str]]:
  """The vocabulary's description and the files that hold it."""
  if vocab is None:
    return {"kind": "none"}, {}
  if isinstance(vocab, ByteVocabulary):
    return {"kind": "bytes"}, {}
  if isinstance(vocab, TokenizerVocabulary):
    desc = {
      "kind": "tokenizer",
      "file": TOKENIZER,
      "bos_id": vocab.bos_id,
      "eos_id": vocab.eos_id,
      "eos_ids": list(vocab.eos_ids),
      "pad_id": vocab.pad_id,
      "unk_id": vocab.unk_id,
      "chat_template": vocab.chat_template,
    }
    return desc, {TOKENIZER: vocab.tokenizer.to_str()}
  logging.warning(
    "the vocabulary %r is not stored in the checkpoint (only "
    "TokenizerVocabulary and ByteVocabulary are); pass vocab= to load it",
    vocab,
  )
  return {"kind": "external", "repr": repr(vocab)}, {}


def read(directory: str, desc: dict):
  source = os.path.join(directory, META)
  if not isinstance(desc, dict):
    raise ValueError(f"{source}: 'vocabulary' is not an object")
  kind = desc.get("kind")
  if kind == "bytes":
    return ByteVocabulary()
  if kind == "tokenizer":
    if desc.get("file") != TOKENIZER:
      raise ValueError(
        f"{source}: the vocabulary file is {desc.get('file')!r}, expected "
        f"{TOKENIZER!r}"
      )
    ids = {k: desc.get(k) for k in ("bos_id", "eos_id", "pad_id", "unk_id")}
    for k, v in ids.items():
      if v is not None:
        untrusted.check_int(v, f"vocabulary.{k}", source=source)
    if desc.get("eos_ids") is not None:
      if not isinstance(desc["eos_ids"], list):
        raise ValueError(f"{source}: vocabulary.eos_ids is not a list")
      for v in desc["eos_ids"]:
        untrusted.check_int(v, "vocabulary.eos_ids", source=source)
      ids["eos_ids"] = desc["eos_ids"]
    template = desc.get("chat_template")
    if template is not None and not isinstance(template, str):
      raise ValueError(f"{source}: vocabulary.chat_template is not a string")
    return TokenizerVocabulary.from_file(
      os.path.join(directory, TOKENIZER),
      **ids,
      chat_template=template,
      chat_template_source=f"{source}: vocabulary.chat_template",
    )
  if kind == "external":
    logging.warning(
      "%s was saved with a vocabulary it does not store (%s); pass vocab= "
      "to cw.load",
      directory,
      desc.get("repr"),
    )
  return None
