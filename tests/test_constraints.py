"""Structured generation: constraint tables, constrained rows in the device
loop (alone, mixed with free rows, on a mesh), budget forcing and errors."""

import functools
import json
import os
import re
import time

import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.constraints import automaton
from chunkwise.partitioning import make_mesh
from tests import toy_models
from tests.serving_helpers import alive

C = cw.constraints
SMALL_SCHEMA = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer"},
  },
  "required": ["name", "age"],
}
DATE = r"(19|20)[0-9][0-9]-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CONSTRAINTS = {
  "choice": C.Choice(["yes", "no", "maybe"]),
  "integer": C.Regex(r"-?(0|[1-9][0-9]*)"),
  "date": C.Regex(DATE),
  "json": C.JsonSchema(SMALL_SCHEMA),
}


def _valid(name, text):
  if name != "json":
    return re.fullmatch(CONSTRAINTS[name].regex(), text) is not None
  try:
    value = json.loads(text)
  except json.JSONDecodeError:
    return False
  return (
    set(value) == {"name", "age"}
    and isinstance(value["name"], str)
    and len(value["name"]) <= 10
    and type(value["age"]) is int
  )


@functools.cache
def _byte_tables(name, kind="eager"):
  # ByteVocabulary ids: 0 pad, 1 BOS, 2 EOS, byte b = b + 3; width 320
  # emulates a model whose logits are padded past the tokenizer (259).
  with C.constraint.tables_kind(kind):
    return CONSTRAINTS[name].compile(
      cw.ByteVocabulary(), stop_ids=[2], width=320
    )


@pytest.mark.parametrize("kind", ["lazy", "eager"])
@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_tables_walks_match(name, kind):
  """Random walks through the tables only ever spell matches, stop ids are
  allowed exactly in final states, padding and specials never."""
  t = _byte_tables(name, kind)
  rng = np.random.default_rng(0)
  for s in range(t.states):
    allowed = t.allowed(s)
    assert not np.isin(allowed, [0, 1]).any() and (allowed < 259).all()
    assert (2 in allowed) == bool(t.final[s])
  for _ in range(200):
    s, text = 0, b""
    while True:
      allowed = t.allowed(s)
      assert allowed.size, "a live state allows nothing"
      tok = int(rng.choice(allowed))
      if tok == 2:
        break
      text += bytes([tok - 3])
      s = t.step(s, tok)
      assert s >= 0
    assert _valid(name, text.decode())
  # The mask bits equal their plain twin's, read from the dense tables.
  if kind == "eager":
    assert np.array_equal(
      t.bits, automaton.mask_bits_dense(t.next_state, t.token_class, 320)
    )
  # distance: the fewest tokens to a final state (a date takes 10 bytes).
  assert t.distance[0] == {"choice": 2, "integer": 1, "date": 10}.get(
    name, t.distance[0]
  )


@pytest.mark.parametrize(
  "pattern, texts",
  [
    ("a(bc)?", ["a", "abc"]),
    ("yes|yes please", ["yes", "yes please"]),
    ("[0-9]+(\\.[0-9]+)?", ["12", "1.5"]),
    ("(ab)*", ["", "abab"]),
    ("ab$", ["ab"]),  # a regex that ends in "$" compiles as it is
  ],
)
def test_every_match_is_spelled_one_byte_at_a_time(pattern, texts):
  """outlines-core's Index alone drops a token that leaves an accepting
  position for a non-accepting one (after "yes", the byte " "); the end
  mark of `automaton._marked_index` keeps it."""
  t = C.Regex(pattern).compile(cw.ByteVocabulary(), stop_ids=[2], width=320)
  for text in texts:
    s = 0
    for b in text.encode():
      s = t.step(s, b + 3)
      assert s >= 0, (pattern, text)
    assert t.final[s], (pattern, text)
    assert 2 in t.allowed(s)


def test_mask_bits_match_the_dense_twin_at_any_width():
  rng = np.random.default_rng(1)
  for width in (31, 32, 301):
    pairs = rng.random((7, width)) < 0.3
    src, tok = np.nonzero(pairs)
    token_class = np.arange(width, dtype=np.int32)  # one class per token
    next_state = np.where(pairs, 0, -1).astype(np.int32)
    bits = automaton.mask_bits(src, tok, 7, width)
    assert np.array_equal(
      bits, automaton.mask_bits_dense(next_state, token_class, width)
    )
    unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
    assert np.array_equal(unpacked[:, :width].astype(bool), pairs)


def test_tables_are_small_and_cached():
  t = _byte_tables("json")
  with C.constraint.tables_kind("eager"):
    again = C.JsonSchema(SMALL_SCHEMA).compile(
      cw.ByteVocabulary(), stop_ids=[2], width=320
    )
  assert again is t
  assert t.bits.shape == (t.states, 10)  # ceil(320 / 32) words
  assert t.classes < 40 and t.nbytes < 100_000
  lazy = _byte_tables("json", "lazy")
  again = C.JsonSchema(SMALL_SCHEMA).compile(
    cw.ByteVocabulary(), stop_ids=[2], width=320
  )
  assert again is lazy and lazy.nbytes < 300_000  # its DFA: 1 KB a state


def _run(model, prefix, rows, constraint, steps, seed=0, **kwargs):
  tokens, result = model.generate(
    prefix,
    sample_ids=jnp.arange(rows),
    steps=steps,
    sampling=cw.Sampling(temperature=1.0, seed=seed),
    constraint=constraint,
    **kwargs,
  )
  return tokens, result


@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_generate_tiny_every_row_matches(tiny, name):
  """Random weights, 32 sampled rows, budget forcing: every row stops with
  a match; no padded (>= 259) or special id is ever drawn."""
  tokens, _ = _run(tiny, (), 32, CONSTRAINTS[name], 40, budget_forcing=True)
  lengths = np.asarray(tokens.lengths)
  ids = np.asarray(tokens.tokens)
  for b, text in enumerate(tokens.detokenize(tiny.vocab)):
    # Column 0 is BOS (no prefix); the stop id sits at column lengths[b].
    row = ids[b, 1 : lengths[b]]
    assert ids[b, 0] == 1 and ids[b, lengths[b]] == 2
    assert ((row >= 3) & (row < 259)).all()
    assert _valid(name, text), text


def test_mixed_rows_keep_free_rows_bit_identical(tiny):
  """Free rows of a mixed batch equal the same rows generated without any
  constraint (the RNG contract holds); constrained rows match."""
  pre = tiny.prefill(cw.Chunk.tokenize(tiny.vocab, ["q"], is_first_chunk=True))
  per_row = [CONSTRAINTS["date"], None, CONSTRAINTS["choice"], None] * 2
  mixed, mixed_r = _run(tiny, [pre], 8, per_row, 24, budget_forcing=True)
  free, free_r = _run(tiny, [pre], 8, None, 24)
  texts = mixed.detokenize(tiny.vocab)
  for b, c in enumerate(per_row):
    if c is None:
      n = int(free.lengths[b])
      assert int(mixed.lengths[b]) == n
      np.testing.assert_array_equal(mixed.tokens[b, :n], free.tokens[b, :n])
      np.testing.assert_array_equal(
        mixed_r.per_token_scores[b, :n], free_r.per_token_scores[b, :n]
      )
    else:
      assert re.fullmatch(c.regex(), texts[b]), texts[b]


def test_scores_stay_raw_and_new_constraint_does_not_recompile(tiny):
  pre = tiny.prefill(cw.Chunk.tokenize(tiny.vocab, ["q"], is_first_chunk=True))
  tokens, result = _run(tiny, [pre], 4, CONSTRAINTS["integer"], 12)
  rescored = tiny.prefill(tokens, prefix=[pre])
  mask = np.asarray(tokens.token_mask)
  np.testing.assert_allclose(
    np.where(mask, result.per_token_scores, 0),
    np.where(mask, rescored.per_token_scores, 0),
    atol=1e-5,
  )
  run = tiny._generate_engine._run
  before = run._cache_size()
  other, _ = _run(tiny, [pre], 4, C.Choice(["0", "1"]), 12)  # same buckets
  assert run._cache_size() == before
  assert set(other.detokenize(tiny.vocab)) <= {"0", "1"}


def test_budget_forcing_closes_rows(tiny):
  words = C.Regex(r"[a-z]{2,40}")
  pre = tiny.prefill(cw.Chunk.tokenize(tiny.vocab, ["q"], is_first_chunk=True))
  loose, _ = _run(tiny, [pre], 16, words, 6)
  assert (np.asarray(loose.lengths) == 6).any()  # cut: finish "length"
  tight, _ = _run(tiny, [pre], 16, words, 6, budget_forcing=True)
  lengths = np.asarray(tight.lengths)
  assert (lengths < 6).all()  # every row emitted its stop within 6 columns
  for text in tight.detokenize(tiny.vocab):
    assert re.fullmatch(words.regex(), text), text
  with pytest.raises(ValueError, match="steps=8 is too few"):
    _run(tiny, [pre], 2, CONSTRAINTS["date"], 8, budget_forcing=True)


def test_stream_equals_generate(tiny):
  kwargs = dict(
    sample_ids=jnp.arange(4),
    steps=30,
    sampling=cw.Sampling(temperature=1.0, seed=5),
    constraint=CONSTRAINTS["json"],
    budget_forcing=True,
  )
  whole, _ = tiny.generate(**kwargs)
  pieces = [t for t, _ in tiny.generate_stream(every=6, **kwargs)]
  got = np.concatenate([np.asarray(p.tokens) for p in pieces], axis=1)
  np.testing.assert_array_equal(got, whole.tokens)


def test_errors_before_device_work(tiny):
  kwargs = dict(sample_ids=jnp.arange(2), steps=8)
  # strict=True: only keywords enforced in full (the default rewrites the
  # rest, see tests/test_schema_rewrite.py).
  with pytest.raises(ValueError, match="keyword 'minimum' at #/properties/a"):
    C.JsonSchema(
      {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 3}},
      },
      strict=True,
    )
  for bad, value in (
    ("allOf", [{}]),
    ("oneOf", [{}]),
    ("multipleOf", 2),
    ("uniqueItems", True),
  ):
    with pytest.raises(ValueError, match=f"keyword '{bad}'"):
      C.JsonSchema({bad: value}, strict=True)
  with pytest.raises(ValueError, match="additionalProperties=false"):
    C.JsonSchema({"type": "object", "additionalProperties": True}, strict=True)
  with pytest.raises(ValueError, match="pattern' together with"):
    C.JsonSchema(
      {"type": "string", "pattern": "a+", "maxLength": 3}, strict=True
    )
  with pytest.raises(ValueError, match="#/oneOf: \\[\\] should be non-empty"):
    C.JsonSchema({"oneOf": []})
  with pytest.raises(ValueError, match="matches no text"):
    tiny.generate(constraint=C.Regex(r"a[^\x00-\x{10FFFF}]"), **kwargs)
  with pytest.raises(ValueError, match="not a supported regex"):
    tiny.generate(constraint=C.Regex("(ab"), **kwargs)
  with pytest.raises(ValueError, match="over the limit of max_table_mb"):
    tiny.generate(
      constraint=C.Regex("[a-z]{0,500}", max_table_mb=0.01), **kwargs
    )
  with pytest.raises(ValueError, match=r"took over 1e-06 s"):
    tiny.generate(
      constraint=C.Regex("[a-f]{0,999}", time_limit_s=1e-6), **kwargs
    )
  with pytest.raises(ValueError, match="one entry per row: got 3 for 2"):
    tiny.generate(constraint=[None, None, None], **kwargs)
  with pytest.raises(ValueError, match="Regex / JsonSchema / Choice or None"):
    tiny.generate(constraint=["[ab]"], sample_ids=jnp.arange(1), steps=4)
  with pytest.raises(ValueError, match="Choice takes a list"):
    C.Choice("yes")
  no_bytes = cw.InferenceModel(tiny.hparams, tiny.weights, vocab=None)
  with pytest.raises(ValueError, match="need a model with a vocabulary"):
    no_bytes.generate(constraint=C.Regex("a"), **kwargs)


@pytest.mark.slow
def test_tiny_mesh_layouts_match_one_device(tiny):
  pre_chunk = cw.Chunk.tokenize(tiny.vocab, ["q", "rs"], is_first_chunk=True)
  per_row = [CONSTRAINTS["json"], None, CONSTRAINTS["date"], None]
  kwargs = dict(
    sample_ids=jnp.arange(4),
    steps=24,
    sampling=cw.Sampling(temperature=1.0, seed=2),
    constraint=per_row,
    budget_forcing=True,
  )
  want, _ = tiny.generate([tiny.prefill(pre_chunk)], **kwargs)
  for layout in ("ws_1d", "ws_2d/yz", "wg"):
    model = cw.InferenceModel(
      tiny.hparams,
      tiny.weights,
      tiny.vocab,
      mesh=make_mesh((2, 2, 2)),
      layout=layout,
    )
    got, _ = model.generate([model.prefill(pre_chunk)], **kwargs)
    np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=layout)
    np.testing.assert_array_equal(got.lengths, want.lengths, err_msg=layout)


@pytest.fixture(scope="module")
def smol():
  return cw.load("smollm2-135m")


@pytest.mark.slow
@pytest.mark.parametrize(
  "name",
  [
    # All three are `long` (40 s of CI time each): the tiny model's tests
    # cover each table and loop, and SmolLM2's tokenizer runs JSON schemas
    # through the servers (tests/test_serving_messages.py and the others
    # on its first 4 layers, tests/test_serving_smollm2.py whole).
    pytest.param("choice", marks=pytest.mark.long),
    pytest.param("date", marks=pytest.mark.long),
    pytest.param("json", marks=pytest.mark.long),
  ],
)
def test_smollm2_64_sampled_rows_match(smol, name):
  """The acceptance run: 64 rows at temperature 1.0 under a choice, a
  regex and a JSON schema all match; no control token (ids 0-16) is drawn
  before the stop. (The integer regex runs on the tiny model's rows.)"""
  prompt = {
    "choice": "Is the sky blue? Answer yes, no or maybe:",
    "date": "The first moon landing happened on",
    "json": "Extract the person as JSON: Ana is 31 years old.\n",
  }[name]
  pre = smol.prefill(
    cw.Chunk.tokenize(smol.vocab, [prompt], is_first_chunk=True)
  )
  tokens, _ = _run(smol, [pre], 64, CONSTRAINTS[name], 48, budget_forcing=True)
  ids = np.asarray(tokens.tokens)
  lengths = np.asarray(tokens.lengths)
  for b, text in enumerate(tokens.detokenize(smol.vocab)):
    assert (ids[b, : lengths[b]] > 16).all()
    assert ids[b, lengths[b]] in (0, 2)  # <|endoftext|> / <|im_end|>
    assert _valid(name, text), text


def test_smollm2_forced_runs_in_one_pass_are_stepping(smol):
  """Compact JSON with fast-forward: every forced run appended in one
  pass (`Speculation(drafter="forced")`) gives the tokens, scores and
  top-n of stepping one token at a time, bit for bit, sampled rows and
  budget forcing included; each pass appends several forced tokens, and
  every row is valid JSON under the schema."""
  schema = {
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 12},
      "age": {"type": "integer", "minimum": 0, "maximum": 120},
      "city": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "age", "city"],
  }
  c = cw.constraints.JsonSchema(schema, whitespace="compact", fast_forward=True)
  # SmolLM2's first 4 of 30 layers: its tokenizer (forced runs of several
  # characters a token), at a seventh of the compile and run time.
  # Forcing and stepping agree bit for bit whatever the weights, and
  # the constraint with budget forcing makes any model's rows valid.
  smol = toy_models.first_layers(smol, 4)
  pre = smol.prefill(
    cw.Chunk.tokenize(
      smol.vocab,
      ["Ana, 31, lives in Lyon. As JSON:", "Bo is 7 and lives in Oslo:"],
      is_first_chunk=True,
    )
  )
  kwargs = dict(
    sample_ids=[0, 1],
    steps=40,
    sampling=cw.Sampling(temperature=[0.0, 1.0], seed=5),
    constraint=c,
    budget_forcing=True,
    top_n=2,
  )
  plain = smol.generate([pre], **kwargs)
  fast = smol.generate(
    [pre],
    speculation=cw.Speculation(drafter="forced", k=4, calibrate=False),
    **kwargs,
  )
  for a, b in zip(plain, fast, strict=True):
    for field in ("tokens", "lengths", "per_token_scores", "top_ids"):
      if hasattr(a, field):
        np.testing.assert_array_equal(
          np.asarray(getattr(a, field)), np.asarray(getattr(b, field))
        )
  assert fast[1].speculation.mean_acceptance_length > 2.5
  for text in plain[0].detokenize(smol.vocab):
    assert c.validate(text).valid, text
    compact = json.dumps(
      json.loads(text), separators=(",", ":"), ensure_ascii=False
    )
    assert text == compact, text


# Constraints on a mesh are test_tiny_mesh_layouts_match_one_device's (the
# tables are replicated, rows masked where the sampler holds them whole);
# SmolLM2 on a 3-device ws_2d mesh is tests/test_smollm2.py's.


# -- compile limits (the compiler runs in a worker process) -----------------


def _rss_mb() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# 2^22 DFA states over bytes: seconds and GBs to compile (outlines-core
# took as long at 2^18; the native compiler builds that in 0.6 s).
RUNAWAY = "[ab]*a[ab]{21}"


def test_runaway_compile_is_stopped_at_its_time_limit():
  from chunkwise.constraints import disk_cache, worker

  vocab = cw.ByteVocabulary()
  with disk_cache.off():  # built, not read from disk: the worker is up
    C.Regex("[ab]").compile(vocab, stop_ids=[2], width=320)
  pid = worker.pid()
  before = _rss_mb()
  start = time.monotonic()
  with pytest.raises(ValueError, match=r"took over 2 s \(time_limit_s\)"):
    C.Regex(RUNAWAY, time_limit_s=2, max_compile_mb=1e6).compile(
      vocab, stop_ids=[2], width=320
    )
  assert time.monotonic() - start < 4
  assert not alive(pid) and worker.pid() is None  # killed and reaped
  time.sleep(1)
  assert _rss_mb() - before < 50  # nothing keeps growing here
  t = C.Regex("[ab]{2}").compile(vocab, stop_ids=[2], width=320)
  assert t.states == 3  # a fresh worker serves the next request


def test_compile_memory_cap_holds():
  with pytest.raises(ValueError, match=r"more than 150 MB \(max_compile_mb\)"):
    C.Regex(RUNAWAY, time_limit_s=60, max_compile_mb=150).compile(
      cw.ByteVocabulary(), stop_ids=[2], width=320
    )


def test_schema_errors_name_its_file(tmp_path):
  path = tmp_path / "person.json"
  deep = {"type": "string"}
  for _ in range(70):
    deep = {"type": "array", "items": deep}
  path.write_text(json.dumps(deep))
  with pytest.raises(ValueError, match=f"{path}: .*nest more than 64"):
    C.JsonSchema.from_file(path)
  path.write_text('{"type": "object", "properties": ' + "[" * 10**5)
  with pytest.raises(ValueError, match=f"{path}: JSON nested too deeply"):
    C.JsonSchema.from_file(path)
  # (a maxLength this long is checked after generation, not compiled; a
  # pattern's own count is compiled)
  path.write_text(
    json.dumps({"type": "string", "pattern": "^[a-z]{0,999999}$"})
  )
  with pytest.raises(ValueError, match=f"JSON schema from {path} .*took over"):
    C.JsonSchema.from_file(path, time_limit_s=1).compile(
      cw.ByteVocabulary(), stop_ids=[2], width=320
    )
  with pytest.raises(FileNotFoundError):
    C.JsonSchema.from_file(tmp_path / "missing.json")


def test_live_slots_budget_forcing_equals_generate_many(tiny):
  """The always-on loop (the server's) with budget forcing: each request
  closes its match within its steps, with `generate_many`'s tokens; a
  request whose steps cannot hold its shortest match is refused."""
  words = C.Regex(r"[a-z]{2,40}")
  requests = [
    cw.Request(
      tokens=[1, 20 + i],
      sample_id=i,
      steps=6,
      sampling=cw.Sampling(temperature=1.0, seed=3),
      constraint=words,
    )
    for i in range(4)
  ]
  loose = tiny.generate_many(requests, slots=4)
  assert "length" in {r.finish_reason for r in loose}  # else nothing shown
  want = tiny.generate_many(requests, slots=4, budget_forcing=True)
  loop = tiny.live_slots(slots=2, capacity=64, every=4, budget_forcing=True)
  for i, r in enumerate(requests):
    loop.add(i, loop.prepare(r))
  got, reasons = {}, {}
  while loop.busy:
    for u in loop.step():
      got[u.key] = [*got.get(u.key, []), *u.tokens.tolist()]
      reasons[u.key] = u.finish_reason or reasons.get(u.key)
  for r in want:
    assert got[r.index] == r.tokens.tolist()
    assert reasons[r.index] == r.finish_reason == "stop"
    text = tiny.vocab.decode(r.tokens.tolist())
    assert re.fullmatch(words.regex(), text), text
  date = cw.Request(tokens=[1], sample_id=9, steps=2, constraint=C.Regex(DATE))
  with pytest.raises(ValueError, match=r"steps=2 is too few .* needs 10"):
    loop.prepare(date)


def test_host_twin_of_budget_forcing():
  """`Tables.budget_narrows` (the server's finish_reason "length" for an
  answer the budget closed): a choice is removed exactly when it would
  leave no room for the rest of a match and a stop."""
  t = C.Regex(r"[a-z]{2,40}").compile(
    cw.ByteVocabulary(), stop_ids=[2], width=259
  )
  a, b = 3 + ord("a"), 3 + ord("b")
  two = t.step(t.step(0, a), b)  # "ab": a match, more letters allowed
  assert t.budget_narrows(two, 1, [2])  # a letter leaves no room to stop
  assert not t.budget_narrows(two, 2, [2])  # a letter, then the stop
  assert t.budget_narrows(0, 2, [2])  # "a" then the stop: no match yet
  assert not t.budget_narrows(0, 3, [2])
