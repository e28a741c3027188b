"""Hostile-input fuzzing of every loader chunkwise has.

  python tests/fuzz_inputs.py --cases=2000 --seed=0        # all formats
  python tests/fuzz_inputs.py --formats=gguf,schema --cases=300 --json

For each format a small valid seed is written (a GGUF file, a Hugging Face
directory, Orbax checkpoints of a model and of a result, a JSON-lines job
input, JSON schemas), then `--cases` mutants of it are loaded one by one:
truncations, byte flips and insertions, and format-aware mutations that
inflate counts, lengths, dimensions and offsets, point byte ranges outside
the file or onto each other, swap JSON types, nest JSON 100,000 deep,
and write hostile chat templates. Each case is seeded by (seed, format,
index), so any one can be replayed.

Every case must end in success or in the documented error types
(ValueError, FileNotFoundError) whose message names the file: anything
else, a case that runs past `--case_timeout_s`, or one whose Python-side
allocations (tracemalloc) exceed 32 x the case's bytes + 64 MiB is an
*unexpected* outcome. The whole process runs under an address-space cap
(RLIMIT_AS, `--max_memory_gb`), so a native allocation the size of a
hostile count fails instead of eating the machine. The report (a table,
or JSON with `--json`) counts outcomes per format and lists unexpected
cases with their replay seed; `tests/test_hostile_inputs.py` runs this
file and requires zero unexpected outcomes.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import os
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import tracemalloc

os.environ.setdefault("JAX_PLATFORMS", "cpu")

EXPECTED = (ValueError, FileNotFoundError)
HUGE = (
  0,
  1,
  2**16,
  2**31 - 1,
  2**31,
  2**32 - 1,
  2**32,
  2**40,
  2**62,
  2**63 - 1,
  2**64 - 1,
)

HOSTILE_TEMPLATES = (
  "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
  "{{ ''.__class__.__mro__[1].__subclasses__() }}",
  "{% import 'os' as os %}{{ os }}",
  "{{ self.__init__.__globals__ }}",
  "{{ 'x' * 100000000 }}",
  "{{ '%999999999d' % 1 }}",
  "{{ 'x'|center(999999999) }}",
  "{{ 2 ** 99999999 }}",
  "{% for i in range(99999) %}{% for j in range(99999) %}{{ j }}"
  "{% endfor %}{% endfor %}",
  "{{ raise_exception('no') }}",
  "{% set ns = namespace(__class__=1) %}",
  "{{ messages[0].content.__len__() }}",
  "{{ x",
  "{% generation %}{{ messages|tojson(indent=999999999) }}{% endgeneration %}",
)

CHATML = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
  "assistant\n{% endif %}"
)


class Hang(Exception):
  """A case ran past its time limit."""


# -- seeds ----------------------------------------------------------------


def _byte_tokens():
  from chunkwise.checkpoints.tokenizer import bytes_to_unicode

  alphabet = bytes_to_unicode()
  tokens = [alphabet[b] for b in range(256)]
  merges = ["Ġ t", "h e", "Ġt he", "i n"]
  tokens += ["Ġt", "he", "Ġthe", "in"]
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  return tokens, merges, specials


TINY = {
  "layers": 2,
  "d_model": 32,
  "heads": 4,
  "kv_heads": 2,
  "head_dim": 8,
  "d_ff": 64,
}


def _weights(rng, vocab, hf_names: bool):
  """Random Llama tensors in PyTorch orientation, by llama.cpp or HF name."""
  import numpy as np

  from chunkwise.checkpoints.gguf import hf_name

  d, h, kv, hd, ff = (
    TINY[k] for k in ("d_model", "heads", "kv_heads", "head_dim", "d_ff")
  )
  shapes = {
    "attn_q.weight": (h * hd, d),
    "attn_k.weight": (kv * hd, d),
    "attn_v.weight": (kv * hd, d),
    "attn_output.weight": (d, h * hd),
    "ffn_gate.weight": (ff, d),
    "ffn_up.weight": (ff, d),
    "ffn_down.weight": (d, ff),
    "attn_norm.weight": (d,),
    "ffn_norm.weight": (d,),
  }
  out = {
    "token_embd.weight": rng.normal(size=(vocab, d)).astype(np.float32) * 0.1,
    "output_norm.weight": np.ones(d, np.float32),
  }
  for i in range(TINY["layers"]):
    for name, shape in shapes.items():
      value = rng.normal(size=shape).astype(np.float32) * 0.1
      out[f"blk.{i}.{name}"] = value
  if hf_names:
    return {"model." + hf_name(k): v for k, v in out.items()}
  return out


def write_gguf(path, template: str = CHATML):
  """A tiny llama GGUF: byte-level BPE tokenizer, chat template, matrices
  in Q8_0, norms and the embedding in F32."""
  import gguf
  import numpy as np
  from gguf import GGMLQuantizationType as QType
  from gguf import quants

  tokens, merges, specials = _byte_tokens()
  all_tokens = tokens + specials
  types = [1] * len(tokens) + [3] * len(specials)
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_block_count(TINY["layers"])
  w.add_context_length(128)
  w.add_embedding_length(TINY["d_model"])
  w.add_feed_forward_length(TINY["d_ff"])
  w.add_head_count(TINY["heads"])
  w.add_head_count_kv(TINY["kv_heads"])
  w.add_rope_freq_base(10000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("smollm")
  w.add_token_list(all_tokens)
  w.add_token_types(types)
  w.add_token_merges(merges)
  w.add_bos_token_id(len(tokens) + 1)
  w.add_eos_token_id(len(tokens) + 2)
  w.add_chat_template(template)
  rng = np.random.default_rng(0)
  for name, value in _weights(rng, len(all_tokens), hf_names=False).items():
    if value.ndim == 2 and name != "token_embd.weight":
      w.add_tensor(
        name, quants.quantize(value, QType.Q8_0), raw_dtype=QType.Q8_0
      )
    else:
      w.add_tensor(name, value)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def write_safetensors(path, tensors: dict) -> None:
  header, blobs, offset = {}, [], 0
  for name, value in tensors.items():
    data = value.tobytes()
    header[name] = {
      "dtype": "F32",
      "shape": list(value.shape),
      "data_offsets": [offset, offset + len(data)],
    }
    blobs.append(data)
    offset += len(data)
  head = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def write_hf_dir(directory):
  """A tiny Llama Hugging Face directory (config, safetensors, tokenizer
  files with a chat template)."""
  import numpy as np
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers

  tokens, merges, specials = _byte_tokens()
  os.makedirs(directory, exist_ok=True)
  tok = tokenizers.Tokenizer(
    models.BPE(
      vocab={t: i for i, t in enumerate(tokens)},
      merges=[tuple(m.split(" ")) for m in merges],
    )
  )
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(specials)
  tok.save(os.path.join(directory, "tokenizer.json"))
  vocab = len(tokens) + len(specials)
  config = {
    "model_type": "llama",
    "num_hidden_layers": TINY["layers"],
    "hidden_size": TINY["d_model"],
    "num_attention_heads": TINY["heads"],
    "num_key_value_heads": TINY["kv_heads"],
    "head_dim": TINY["head_dim"],
    "intermediate_size": TINY["d_ff"],
    "vocab_size": vocab,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": len(tokens) + 1,
    "eos_token_id": [len(tokens) + 2, len(tokens)],
  }
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"chat_template": CHATML, "model_max_length": 128}, f)
  rng = np.random.default_rng(1)
  write_safetensors(
    os.path.join(directory, "model.safetensors"),
    _weights(rng, vocab, hf_names=True),
  )


def write_orbax(directory, *, result: bool):
  import chunkwise as cw

  model = _tiny_model()
  if result:
    chunk = cw.Chunk.from_lists([[1, 5, 9, 3], [1, 7]])
    cw.save(model.prefill(chunk, top_n=2), directory)
  else:
    cw.save(model, directory)


_MODEL = None


def _tiny_model():
  global _MODEL
  if _MODEL is None:
    import chunkwise as cw

    h = cw.configs.get("tiny").replace(layers=1, vocab=288)
    _MODEL = cw.InferenceModel.random(h, seed=0)
  return _MODEL


JSONL = "\n".join(
  [
    json.dumps({"id": 1, "text": "The cat sat."}),
    json.dumps({"id": "b", "context": "Q: 2+2?", "continuation": " 4"}),
    json.dumps({"id": 3, "text": "Ünïcödé ✓ and emoji 🐄"}),
    json.dumps({"id": 4, "text": "x", "meta": {"tags": ["a", "b"]}}),
  ]
)

SCHEMAS = (
  {
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 10},
      "age": {"type": "integer"},
      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
  },
  {
    "$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}}}},
    "type": "object",
    "properties": {
      "p": {"$ref": "#/$defs/p"},
      "q": {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
    },
  },
  {"type": "string", "pattern": "[a-z]{1,8}@[a-z]{1,8}\\.com"},
  {
    "type": "array",
    "prefixItems": [{"const": 1}, {"type": "string", "format": "date"}],
  },
)


# -- mutations ------------------------------------------------------------


def mutate_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
  """A generic mutation of a byte string: (mutant, description)."""
  data = bytearray(data)
  kind = rng.choice(
    ["truncate", "flip", "insert", "zero", "ones", "dup", "u64"]
  )
  n = len(data)
  if kind == "truncate" or n < 16:
    cut = rng.randrange(0, max(n, 1))
    return bytes(data[:cut]), f"truncate at {cut}"
  if kind == "flip":
    spots = [rng.randrange(n) for _ in range(rng.randint(1, 8))]
    for i in spots:
      data[i] ^= 1 << rng.randrange(8)
    return bytes(data), f"flip bits at {spots}"
  if kind == "insert":
    at, size = rng.randrange(n), rng.choice([1, 3, 8, 100])
    data[at:at] = rng.randbytes(size) if rng.random() < 0.5 else b"\0" * size
    return bytes(data), f"insert {size} bytes at {at}"
  if kind in ("zero", "ones"):
    at, size = rng.randrange(n), rng.randint(1, 64)
    data[at : at + size] = (b"\0" if kind == "zero" else b"\xff") * len(
      data[at : at + size]
    )
    return bytes(data), f"{kind} {size} bytes at {at}"
  if kind == "dup":
    at, size = rng.randrange(n), rng.randint(1, 256)
    data[at:at] = data[at : at + size] * rng.randint(2, 50)
    return bytes(data), f"duplicate {size} bytes at {at}"
  at = rng.randrange(max(n - 8, 1))
  value = rng.choice(HUGE)
  data[at : at + 8] = struct.pack("<Q", value)
  return bytes(data), f"u64 {value} at {at}"


def gguf_fields(data: bytes) -> list[tuple[int, str, str]]:
  """(offset, struct format, name) of every count, length, type and
  dimension in a well-formed GGUF file: an independent walker, so the
  fuzzer can aim at exactly the fields a parser must distrust."""
  sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
  out = [(8, "<Q", "tensor_count"), (16, "<Q", "kv_count")]
  n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
  at = 24

  def string(at, name):
    out.append((at, "<Q", f"{name}.len"))
    (n,) = struct.unpack_from("<Q", data, at)
    return at + 8 + n

  def value(at, kind, name):
    if kind in sizes:
      return at + sizes[kind]
    if kind == 8:
      return string(at, name)
    out.append((at, "<I", f"{name}.item_type"))
    out.append((at + 4, "<Q", f"{name}.count"))
    item, count = struct.unpack_from("<IQ", data, at)
    at += 12
    if item in sizes:
      return at + count * sizes[item]
    for i in range(count):
      at = value(at, item, f"{name}[{i}]") if item != 8 else string(at, name)
    return at

  for i in range(n_kv):
    (klen,) = struct.unpack_from("<Q", data, at)
    key = data[at + 8 : at + 8 + klen].decode()
    at = string(at, f"key{i}")
    out.append((at, "<I", f"{key}.type"))
    (kind,) = struct.unpack_from("<I", data, at)
    at = value(at + 4, kind, key)
  for i in range(n_tensors):
    at = string(at, f"tensor{i}.name")
    out.append((at, "<I", f"tensor{i}.n_dims"))
    (n_dims,) = struct.unpack_from("<I", data, at)
    at += 4
    for d in range(n_dims):
      out.append((at, "<Q", f"tensor{i}.dim{d}"))
      at += 8
    out.append((at, "<I", f"tensor{i}.type"))
    out.append((at + 4, "<Q", f"tensor{i}.offset"))
    at += 12
  return out


def mutate_gguf(data: bytes, rng: random.Random, fields) -> tuple[bytes, str]:
  if rng.random() < 0.35:
    return mutate_bytes(data, rng)
  at, fmt, name = rng.choice(fields)
  limit = 2 ** (8 * struct.calcsize(fmt)) - 1
  (old,) = struct.unpack_from(fmt, data, at)
  value = rng.choice(
    [
      *HUGE,
      old + 1,
      old - 1,
      old * 2,
      old + len(data),
      len(data),
      rng.randrange(limit),
    ]
  )
  value = min(max(value, 0), limit)
  out = bytearray(data)
  struct.pack_into(fmt, out, at, value)
  return bytes(out), f"{name}: {old} -> {value}"


def _json_paths(node, path=()):
  yield path
  if isinstance(node, dict):
    for k, v in node.items():
      yield from _json_paths(v, (*path, k))
  elif isinstance(node, list):
    for i, v in enumerate(node):
      yield from _json_paths(v, (*path, i))


def _replacement(rng: random.Random, old, templates: bool):
  choices = [
    *HUGE[6:],
    -1,
    -(2**63),
    10**30,
    1e308,
    -0.5,
    float("nan"),
    None,
    True,
    "",
    "x" * rng.choice([10, 100000]),
    [],
    {},
    [old, old],
    {"a": old},
    "\ud800",
  ]
  if templates:
    choices += list(HOSTILE_TEMPLATES) * 3
  return rng.choice(choices)


DEEP = "[" * 100000 + "]" * 100000


def mutate_json(
  text: str, rng: random.Random, *, templates: bool = False
) -> tuple[str, str]:
  """A structural JSON mutation (or a byte-level one), as text."""
  roll = rng.random()
  if roll < 0.2:
    data, how = mutate_bytes(text.encode(), rng)
    return data.decode("utf-8", "surrogateescape"), how
  tree = json.loads(text)
  path = rng.choice(list(_json_paths(tree)))
  parent = tree
  for p in path[:-1]:
    parent = parent[p]
  if roll < 0.35 and path:
    del parent[path[-1]]
    return json.dumps(tree), f"delete {list(path)}"
  if roll < 0.45:
    new, how = "__DEEP__", f"{list(path)} = nested 100000 deep"
  else:
    old = parent[path[-1]] if path else tree
    new = _replacement(rng, copy.deepcopy(old), templates)
    how = f"{list(path)} = {str(new)[:40]!r}"
  if path:
    parent[path[-1]] = new
  else:
    tree = new
  out = json.dumps(tree)
  return out.replace('"__DEEP__"', DEEP), how


# -- formats --------------------------------------------------------------


class Format:
  """A seed on disk, how to mutate it, and the loader to run."""

  name = ""

  def __init__(self, root: str):
    self.root = os.path.join(root, self.name)
    os.makedirs(self.root)
    self.seed = os.path.join(self.root, "seed")
    self.write_seed()

  def write_seed(self):
    raise NotImplementedError

  def case(self, rng: random.Random, work: str) -> tuple[str, str]:
    """Writes a mutant under `work`; returns (path to load, description)."""
    raise NotImplementedError

  def load(self, path: str):
    raise NotImplementedError

  def warm(self):
    """Imports and one-time caches the loader needs, before any case is
    traced (they are not what a case allocates)."""


def _copy(src: str, dst: str) -> str:
  if os.path.isdir(src):
    shutil.copytree(src, dst)
  else:
    shutil.copy(src, dst)
  return dst


class GGUF(Format):
  name = "gguf"

  def write_seed(self):
    write_gguf(self.seed)
    with open(self.seed, "rb") as f:
      self.data = f.read()
    self.fields = gguf_fields(self.data)

  def case(self, rng, work):
    data, how = mutate_gguf(self.data, rng, self.fields)
    path = os.path.join(work, "m.gguf")
    with open(path, "wb") as f:
      f.write(data)
    return path, how

  def load(self, path):
    import chunkwise as cw

    model = cw.load(path)
    if model.vocab is not None and model.vocab.chat_template is not None:
      model.vocab.apply_chat_template([{"role": "user", "content": "hi"}])


class HFFile(Format):
  """A Hugging Face directory with one of its files mutated."""

  file = ""

  def write_seed(self):
    write_hf_dir(self.seed)
    with open(os.path.join(self.seed, self.file), "rb") as f:
      self.data = f.read()

  def mutant(self, rng):
    text, how = mutate_json(self.data.decode(), rng)
    return text.encode("utf-8", "surrogateescape"), how

  def case(self, rng, work):
    path = _copy(self.seed, os.path.join(work, "hf"))
    data, how = self.mutant(rng)
    with open(os.path.join(path, self.file), "wb") as f:
      f.write(data)
    return path, how

  def load(self, path):
    import chunkwise as cw

    cw.load(path)


class Safetensors(HFFile):
  name = "safetensors"
  file = "model.safetensors"

  def mutant(self, rng):
    if rng.random() < 0.4:
      return mutate_bytes(self.data, rng)
    (n,) = struct.unpack_from("<Q", self.data)
    head, body = self.data[8 : 8 + n].decode(), self.data[8 + n :]
    roll = rng.random()
    if roll < 0.15:
      value = rng.choice(HUGE)
      return struct.pack("<Q", value) + self.data[8:], f"header_len {value}"
    header = json.loads(head)
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    field = rng.choice(
      ["shape", "data_offsets", "dtype", "offsets-swap", "overlap", "json"]
    )
    if field == "shape":
      entry["shape"][rng.randrange(len(entry["shape"]))] = rng.choice(
        [*HUGE, -1, 1.5, "x"]
      )
    elif field == "data_offsets":
      entry["data_offsets"][rng.randrange(2)] = rng.choice(
        [*HUGE, -1, len(body) + 8]
      )
    elif field == "dtype":
      entry["dtype"] = rng.choice(["F8", "I64", "BOOL", 3, None, "F64"])
    elif field == "offsets-swap":
      entry["data_offsets"] = entry["data_offsets"][::-1]
    elif field == "overlap":
      other = header[rng.choice(names)]
      entry["data_offsets"] = list(other["data_offsets"])
      entry["shape"] = list(other["shape"])
    else:
      text, how = mutate_json(head, rng)
      data = text.encode("utf-8", "surrogateescape")
      return struct.pack("<Q", len(data)) + data + body, f"header: {how}"
    data = json.dumps(header).encode()
    return struct.pack("<Q", len(data)) + data + body, f"{name}.{field}"


class Config(HFFile):
  name = "config"
  file = "config.json"


class Tokenizer(HFFile):
  name = "tokenizer"
  file = "tokenizer.json"

  def load(self, path):
    from chunkwise.checkpoints import hf

    hf.describe(path)


class TokenizerConfig(HFFile):
  name = "tokenizer_config"
  file = "tokenizer_config.json"

  def mutant(self, rng):
    text, how = mutate_json(self.data.decode(), rng, templates=True)
    return text.encode("utf-8", "surrogateescape"), how

  def load(self, path):
    from chunkwise.checkpoints import hf

    _, vocab = hf.describe(path)
    if vocab is not None and vocab.chat_template is not None:
      vocab.apply_chat_template([{"role": "user", "content": "hi"}])


class Orbax(Format):
  """A `cw.save` directory with its description, Orbax's metadata or an
  array file mutated."""

  result = False

  def write_seed(self):
    write_orbax(self.seed, result=self.result)
    self.files = sorted(
      os.path.relpath(os.path.join(p, f), self.seed)
      for p, _, fs in os.walk(self.seed)
      for f in fs
    )

  def case(self, rng, work):
    path = _copy(self.seed, os.path.join(work, "ckpt"))
    roll = rng.random()
    if roll < 0.6:
      rel = "chunkwise.json"
    elif roll < 0.8:
      rel = rng.choice(
        [
          f
          for f in self.files
          if f.endswith(("METADATA", "_sharding")) or "array_metadatas" in f
        ]
        or self.files
      )
    else:
      rel = rng.choice(self.files)
    file = os.path.join(path, rel)
    with open(file, "rb") as f:
      data = f.read()
    try:
      text = data.decode()
      json.loads(text)
      new, how = mutate_json(text, rng)
      new = new.encode("utf-8", "surrogateescape")
    except (UnicodeDecodeError, ValueError):
      new, how = mutate_bytes(data, rng)
    with open(file, "wb") as f:
      f.write(new)
    return path, f"{rel}: {how}"

  def load(self, path):
    import chunkwise as cw

    cw.load(path)


class OrbaxResult(Orbax):
  name = "orbax_result"
  result = True

  def load(self, path):
    import chunkwise as cw

    cw.load_result(path, _tiny_model())


class OrbaxModel(Orbax):
  name = "orbax_model"


class Jsonl(Format):
  name = "jsonl"

  def write_seed(self):
    with open(self.seed, "w") as f:
      f.write(JSONL)

  def case(self, rng, work):
    lines = JSONL.split("\n")
    i = rng.randrange(len(lines))
    roll = rng.random()
    if roll < 0.1:
      lines[i] = json.dumps({"id": 9, "text": "y" * rng.choice([5000, 10**6])})
      how = "long line"
    elif roll < 0.2:
      lines[i] = '{"id": 9, "text": ' + "[" * 50000 + "]" * 50000 + "}"
      how = "deep line"
    elif roll < 0.3:
      lines[i] = '{"id": "\\ud800", "text": "a\\udfff"}'
      how = "surrogates"
    elif roll < 0.4:
      lines[i] = json.dumps({"id": "../../etc/passwd", "text": "z"})
      how = "path-like id"
    else:
      text, how = mutate_json(lines[i], rng)
      lines[i] = text
    path = os.path.join(work, "in.jsonl")
    with open(path, "wb") as f:
      f.write("\n".join(lines).encode("utf-8", "surrogateescape"))
    return path, f"line {i + 1}: {how}"

  def load(self, path):
    from chunkwise.inference import ByteVocabulary
    from chunkwise.jobs import examples

    vocab = ByteVocabulary()
    found = examples.read(
      path, kind=examples.SCORE, max_line_bytes=4096, max_depth=8
    )
    examples.prepare(
      found, lambda e: ([1, *vocab.encode(e.context + e.text)], 1), limit=64
    )


class Schema(Format):
  name = "schema"

  def write_seed(self):
    with open(self.seed, "w") as f:
      json.dump(list(SCHEMAS), f)

  def case(self, rng, work):
    schema = rng.choice(SCHEMAS)
    text, how = mutate_json(json.dumps(schema), rng)
    if rng.random() < 0.15:  # inflate a size
      tree = copy.deepcopy(schema)
      key = rng.choice(["maxLength", "maxItems", "minItems", "minLength"])
      tree.setdefault("properties", {}).setdefault("big", {"type": "string"})[
        key
      ] = rng.choice([10**4, 10**9, -1])
      text, how = json.dumps(tree), f"{key} inflated"
    path = os.path.join(work, "schema.json")
    with open(path, "wb") as f:
      f.write(text.encode("utf-8", "surrogateescape"))
    return path, how

  def load(self, path):
    from chunkwise import constraints
    from chunkwise.inference import ByteVocabulary

    c = constraints.JsonSchema.from_file(
      path, time_limit_s=1, max_compile_mb=512, max_table_mb=16
    )
    c.compile(ByteVocabulary(), stop_ids=[2], width=320)

  def warm(self):
    from chunkwise.constraints import schema

    schema.check_meta(SCHEMAS[0])  # imports jsonschema, loads metaschemas


FORMATS = {
  f.name: f
  for f in (
    GGUF,
    Safetensors,
    Config,
    Tokenizer,
    TokenizerConfig,
    OrbaxModel,
    OrbaxResult,
    Jsonl,
    Schema,
  )
}


# -- running --------------------------------------------------------------


def _case_bytes(path: str) -> int:
  if os.path.isdir(path):
    return sum(
      os.path.getsize(os.path.join(p, f))
      for p, _, fs in os.walk(path)
      for f in fs
    )
  return os.path.getsize(path)


def _alarm(signum, frame):
  raise Hang()


def run_case(fmt: Format, seed: int, index: int, timeout_s: float) -> dict:
  """One mutant, loaded under a timer and tracemalloc: its outcome."""
  rng = random.Random(f"{seed}/{fmt.name}/{index}")
  work = tempfile.mkdtemp(dir=fmt.root)
  try:
    path, how = fmt.case(rng, work)
    bound = 32 * _case_bytes(path) + (64 << 20)
    tracemalloc.start()
    tracemalloc.reset_peak()
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    start = time.perf_counter()
    try:
      fmt.load(path)
      outcome, message = "loaded", ""
    except Hang:
      outcome, message = "unexpected", f"hang: over {timeout_s} s"
    except EXPECTED as e:
      outcome, message = f"rejected: {type(e).__name__}", str(e)
      if work not in message and os.path.basename(path) not in message:
        outcome = "unexpected"
        message = f"error does not name the file: {type(e).__name__}: {e}"
    except BaseException as e:
      if isinstance(e, KeyboardInterrupt):
        raise
      outcome, message = "unexpected", f"{type(e).__name__}: {e}"
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
      seconds = time.perf_counter() - start
      _, peak = tracemalloc.get_traced_memory()
      tracemalloc.stop()
    if peak > bound and outcome != "unexpected":
      outcome = "unexpected"
      message = f"allocated {peak} bytes, over {bound} for this case"
    return {
      "format": fmt.name,
      "index": index,
      "mutation": how,
      "outcome": outcome,
      "message": message[:300],
      "seconds": seconds,
      "peak_bytes": peak,
    }
  finally:
    shutil.rmtree(work, ignore_errors=True)


def run(
  formats, cases, seed: int, timeout_s: float, log=None, verbose=False
) -> dict:
  signal.signal(signal.SIGALRM, _alarm)
  root = tempfile.mkdtemp(prefix="chunkwise-fuzz-")
  cases = range(cases) if isinstance(cases, int) else cases
  report = {"seed": seed, "cases": len(cases), "formats": {}, "unexpected": []}
  cwd = os.getcwd()
  os.chdir(root)  # a template that escaped could only touch files here
  try:
    for name in formats:
      start = time.perf_counter()
      fmt = FORMATS[name](root)
      fmt.warm()
      counts = collections.Counter()
      slowest = 0.0
      for i in cases:
        if log:
          print(f"case {name} {i}", file=log, flush=True)
        result = run_case(fmt, seed, i, timeout_s)
        if verbose:
          print(json.dumps(result), file=log, flush=True)
        counts[result["outcome"]] += 1
        slowest = max(slowest, result["seconds"])
        if result["outcome"] == "unexpected":
          report["unexpected"].append(result)
      report["formats"][name] = {
        "outcomes": dict(sorted(counts.items())),
        "seconds": round(time.perf_counter() - start, 1),
        "slowest_case_s": round(slowest, 2),
      }
    report["pwned"] = os.path.exists(os.path.join(root, "PWNED"))
  finally:
    os.chdir(cwd)
    shutil.rmtree(root, ignore_errors=True)
  report["max_rss_mb"] = (
    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
  )
  return report


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--formats", default=",".join(FORMATS))
  parser.add_argument("--cases", type=int, default=200)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--only", type=int, default=None, help="Replay this one case index."
  )
  parser.add_argument("--verbose", action="store_true")
  parser.add_argument("--case_timeout_s", type=float, default=20.0)
  parser.add_argument("--max_memory_gb", type=float, default=8.0)
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args(argv)
  formats = [f for f in args.formats.split(",") if f]
  for f in formats:
    if f not in FORMATS:
      parser.error(f"unknown format {f!r}; known: {', '.join(FORMATS)}")
  limit = int(args.max_memory_gb * 2**30)
  with contextlib.suppress(ValueError, OSError):
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  )
  cases = [args.only] if args.only is not None else args.cases
  report = run(
    formats,
    cases,
    args.seed,
    args.case_timeout_s,
    log=sys.stderr,
    verbose=args.verbose,
  )
  if args.json:
    print(json.dumps(report))
  else:
    print(f"{'format':<18}{'seconds':>8}  outcomes")
    for name, r in report["formats"].items():
      print(f"{name:<18}{r['seconds']:>8}  {r['outcomes']}")
    for u in report["unexpected"]:
      where = f"{u['format']} #{u['index']} ({u['mutation']})"
      print(f"UNEXPECTED {where}: {u['message']}")
  return 1 if report["unexpected"] or report["pwned"] else 0


if __name__ == "__main__":
  sys.exit(main())
