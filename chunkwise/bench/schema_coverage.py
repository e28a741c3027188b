"""`scripts/schema_coverage.py`'s sample, and its peer engines.

`sample(files, 30, seed, category)` draws a category's schemas at random:
the draw depends only on the seed and the category's name, so adding a
category or an engine changes no other category's sample.

XGrammar and LLGuidance, the peers, each compute a token mask per step
from a JSON schema; here they drive `transformers` running *our* weights
(`reference.to_transformers`, so all engines sample the same model), with
the same prompt ids, greedy, for the same number of steps:

  peer = XGrammar(tokenizer, vocab_size, eos_ids)   # or LLGuidance(...)
  grammar = peer.compile(schema_text)               # ValueError: refused
  ids = hf_generate(hf, prompts, peer, [grammar, ...], steps=256,
                    eos_ids=eos_ids)

A row ends when the mask's engine lets the model pick a stop token (only
once the value is complete) or when the steps run out; what it wrote so
far is its output either way. The peers have no budget forcing: a value
cut off by the step limit is invalid. Needs `torch`, `transformers`,
`xgrammar` and `llguidance` (the `peers` extra), imported only here.
"""

from __future__ import annotations

import inspect
import os
import random
from collections.abc import Sequence

import numpy as np

from chunkwise import checkpoints


def sample(
  files: Sequence[str], limit: int, seed: int, category: str
) -> list[str]:
  """`limit` of `files` drawn at random, in name order (all of them when
  there are no more)."""
  if len(files) <= limit:
    return list(files)
  draw = random.Random(f"{seed}:{category}").sample(list(files), limit)
  return sorted(draw)


def hf_tokenizer(name: str):
  """`transformers`' tokenizer of a model name or path (GGUF file or
  Hugging Face directory), the one the peers read their vocabulary from."""
  import transformers

  path = name
  if not os.path.exists(path):
    path = checkpoints.embedded_path(name)
  if path.endswith(".gguf"):
    directory, file = os.path.split(path)
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=file)
  return transformers.AutoTokenizer.from_pretrained(path)


class XGrammar:
  """xgrammar's `GrammarCompiler` (JSON schema, its defaults)."""

  name = "xgrammar"

  def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
    import xgrammar

    self._xgr = xgrammar
    info = xgrammar.TokenizerInfo.from_huggingface(
      tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids)
    )
    # One thread and no cache: each schema is compiled from scratch.
    self._compiler = xgrammar.GrammarCompiler(
      info, max_threads=1, cache_enabled=False
    )

  def compile(self, schema_text: str):
    try:
      return self._compiler.compile_json_schema(schema_text)
    except Exception as e:  # xgrammar raises RuntimeError or ValueError
      raise ValueError(f"xgrammar: {e}") from e

  def matcher(self, grammar):
    return self._xgr.GrammarMatcher(grammar)

  @staticmethod
  def fill(matcher, bitmask, row: int) -> None:
    matcher.fill_next_token_bitmask(bitmask, row)

  @staticmethod
  def accept(matcher, token: int) -> bool:
    return bool(matcher.accept_token(token))


class LLGuidance:
  """llguidance's `LLMatcher` on `grammar_from_json_schema` (its
  defaults). Building the matcher is its compile; lexer states are built
  lazily, per step, as in its servers."""

  name = "llguidance"

  def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    self._llg = llguidance
    self._tokenizer = llguidance.hf.from_tokenizer(
      tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids)
    )

  def compile(self, schema_text: str):
    try:
      grammar = self._llg.LLMatcher.grammar_from_json_schema(schema_text)
    except Exception as e:
      raise ValueError(f"llguidance: {e}") from e
    matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
    if matcher.is_error():
      raise ValueError(f"llguidance: {matcher.get_error()}")
    return matcher

  @staticmethod
  def matcher(grammar):
    return grammar.deep_copy()

  def fill(self, matcher, bitmask, row: int) -> None:
    self._llg.torch.fill_next_token_bitmask(matcher, bitmask, row)

  @staticmethod
  def accept(matcher, token: int) -> bool:
    return bool(matcher.consume_token(token))


PEERS = {"xgrammar": XGrammar, "llguidance": LLGuidance}


def allowed(bitmask, vocab_size: int) -> np.ndarray:
  """[rows, vocab] bool from a peer's [rows, vocab/32] int32 bitmask (bit
  j of word i: token 32 i + j)."""
  bits = np.unpackbits(
    np.ascontiguousarray(bitmask.numpy()).view(np.uint8), bitorder="little"
  )
  return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)


def hf_generate(
  hf,
  prompts: Sequence[Sequence[int]],
  peer,
  grammars: Sequence,
  *,
  steps: int,
  eos_ids: Sequence[int],
) -> list[list[int]]:
  """Greedy decode of `prompts` (left-padded into one batch), each row
  masked by its own matcher of `grammars`: the ids each row wrote."""
  import torch

  # transformers 5.24 renamed `past_key_values` to `cache`
  params = inspect.signature(type(hf).forward).parameters
  cache_name = "cache" if "cache" in params else "past_key_values"
  rows = len(prompts)
  vocab_size = hf.config.vocab_size
  width = max(len(p) for p in prompts)
  ids = torch.zeros((rows, width), dtype=torch.long)
  mask = torch.zeros((rows, width), dtype=torch.long)
  for r, p in enumerate(prompts):
    ids[r, width - len(p) :] = torch.tensor(list(p))
    mask[r, width - len(p) :] = 1
  positions = (mask.cumsum(-1) - 1).clamp(min=0)
  matchers = [peer.matcher(g) for g in grammars]
  bitmask = torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
  stops = set(int(e) for e in eos_ids)
  out: list[list[int]] = [[] for _ in range(rows)]
  done = [False] * rows
  cache = None
  with torch.inference_mode():
    for _ in range(steps):
      result = hf(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{cache_name: cache},
      )
      cache = getattr(result, cache_name)
      logits = result.logits[:, -1].float().numpy().copy()
      for r in range(rows):
        if not done[r]:
          peer.fill(matchers[r], bitmask, r)
      logits[~allowed(bitmask, vocab_size)] = -np.inf
      picked = logits.argmax(-1)
      for r in range(rows):
        if done[r]:
          continue
        token = int(picked[r])
        if not np.isfinite(logits[r, token]) or not peer.accept(
          matchers[r], token
        ):
          done[r] = True  # nothing allowed: the matcher is in error
        elif token in stops:
          done[r] = True
        else:
          out[r].append(token)
      if all(done):
        break
      ids = torch.as_tensor(picked, dtype=torch.long)[:, None]
      mask = torch.cat([mask, torch.ones((rows, 1), dtype=torch.long)], -1)
      positions = positions[:, -1:] + 1
  return out
