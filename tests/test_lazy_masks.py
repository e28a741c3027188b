"""Masks read lazily from a byte-level DFA over a vocabulary's trie
(`constraints/byte_dfa.py`, `constraints/token_trie.py`,
`constraints/lazy.py`) equal the eager token tables (`constraints/
tables.py`, outlines-core's index over every token) on every state both
reach: random walks through each constraint of a corpus (regexes, JSON
schemas, a choice, a tool call's frame), on SmolLM2's vocabulary and on
bytes."""

import collections
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.checkpoints.load import embedded_path
from chunkwise.constraints import automaton, byte_dfa, lazy, tables, token_trie
from chunkwise.processors.base import StepInfo
from tests.dfa_helpers import plain_token_distance, same_language

C = cw.constraints

REGEXES = {
  "integer": r"-?(0|[1-9][0-9]*)",
  "date": r"(19|20)[0-9][0-9]-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
  "string": r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])*"',
  "bounded": r'"[a-z]{2,6}"',
  "unicode": r"[\w ]{1,5}\.",
  "classes": r"\d+(\.\d+)?[eE][+-]?\d{1,3}",
  "choice": r"(yes|no|maybe)",
  "nested": r"\[((true|false|null)(,(true|false|null)){0,3})?\]",
  "dot": r"a.{0,3}b",
  "optional": r"a(bc)?",
}
SCHEMAS = {
  "object": {
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 10},
      "age": {"type": "integer"},
      "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age"],
  },
  "enum": {"enum": ["red", "green", "blue", 3, None]},
  "number": {"type": "number"},
}


def _corpus():
  out = {name: C.Regex(r) for name, r in REGEXES.items()}
  for name, schema in SCHEMAS.items():
    out["schema-" + name] = C.JsonSchema(schema)
  out["choice-list"] = C.Choice(["yes", "no", "maybe so"])
  return out


CORPUS = _corpus()


@pytest.fixture(scope="module")
def smol_vocab():
  _, vocab = cw.checkpoints.gguf.describe(embedded_path("smollm2-135m"))
  return vocab


def _lazy(constraint, vocabulary, stops, width) -> lazy.Lazy:
  return lazy.compile(
    constraint.regex(), vocabulary, stop_ids=stops, width=width
  )


def _walks(eager, masks, stops, rng, walks=6, steps=40):
  """Random walks through both; at each state the allowed ids, the
  finality and each allowed id's next state's finality agree."""
  reached = 0
  for _ in range(walks):
    e, s = 0, 0
    for _ in range(steps):
      want, got = eager.allowed(e), masks.allowed(s)
      assert np.array_equal(got, want), (
        f"state {e}/{s}: only lazy {np.setdiff1d(got, want)[:8]}, "
        f"only eager {np.setdiff1d(want, got)[:8]}"
      )
      assert bool(eager.final[e]) == bool(masks.final[s])
      assert eager.forced(e) == masks.forced(s)
      reached += 1
      choices = np.setdiff1d(got, stops)
      if not choices.size:
        break
      t = int(rng.choice(choices))
      e, s = eager.step(e, t), masks.step(s, t)
      assert e >= 0 and s >= 0
  return reached


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_masks_equal_the_eager_tables_on_smollm2(smol_vocab, name):
  width = len(smol_vocab.token_bytes())
  stops = tuple(smol_vocab.eos_ids)
  eager = CORPUS[name].compile(smol_vocab, stop_ids=stops, width=width)
  masks = _lazy(CORPUS[name], smol_vocab, stops, width)
  rng = np.random.default_rng(len(name))
  assert _walks(eager, masks, stops, rng) > 10
  # budget forcing's distance: never below the eager (any token) one, and
  # from every state that can finish, some allowed token is one nearer
  assert masks.distance[0] >= eager.distance[0]
  d = masks.distance
  for q in np.flatnonzero((d > 0) & (d < lazy.DEAD))[:64]:
    nxt = masks.next_states(int(q))
    nearer = d[nxt[nxt >= 0]] == d[q] - 1
    assert nearer.any(), f"state {q} at {d[q]} has no token one nearer"


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_masks_equal_the_eager_tables_on_bytes(name):
  """ByteVocabulary: ids 0-2 control, byte b is id b + 3; logits padded
  to 320 columns past its 259 ids."""
  vocab = cw.ByteVocabulary()
  eager = CORPUS[name].compile(vocab, stop_ids=[2], width=320)
  masks = _lazy(CORPUS[name], vocab, [2], 320)
  assert _walks(eager, masks, (2,), np.random.default_rng(0)) > 3
  # one byte a token: the distances are the eager ones
  np.testing.assert_array_equal(masks.distance[0], eager.distance[0])


def test_the_byte_dfa_is_the_regex():
  dfa = byte_dfa.compile(r"-?(0|[1-9][0-9]*)")
  for text in ("0", "-12", "907"):
    assert dfa.matches(text.encode())
  for text in ("01", "-", "", "1a"):
    assert not dfa.matches(text.encode())
  assert dfa.run(b"\xff") == -1
  schema = byte_dfa.compile(json.dumps(SCHEMAS["object"]), kind="schema")
  text = json.dumps({"name": "Ann", "age": 3}, separators=(",", ":"))
  assert schema.matches(text.encode())
  assert schema.distance()[0] == len('{"name":"","age":0}')
  for k in range(len(text)):
    assert schema.run(text[:k].encode()) >= 0


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_token_distance_is_the_plain_walk(smol_vocab, name):
  width = len(smol_vocab.token_bytes())
  masks = _lazy(CORPUS[name], smol_vocab, tuple(smol_vocab.eos_ids), width)
  stops = masks._stops
  plain = plain_token_distance(masks.dfa, masks.trie, stops)
  for native in (True, False):  # the native walk, then its NumPy twin
    np.testing.assert_array_equal(
      lazy.token_distance(masks.dfa, masks.trie, stops, native=native), plain
    )


@pytest.mark.parametrize("name", ["integer", "string", "nested", "schema"])
def test_the_dfa_output_is_the_token_tables_over_bytes(name):
  """The worker's DFA-only output spells what the token tables over the
  byte vocabulary spell; from outlines-core (`automaton.dfa_table`,
  compiled behind a lead byte: the native compiler's twin) it is their
  transitions state for state (numbered in another order), from the
  native compiler (minimal) it has no more states."""
  kind, text = "regex", REGEXES.get(name)
  if name == "schema":
    kind, text = "schema", json.dumps(SCHEMAS["object"])
  eager = tables.compile_regex(
    text, byte_dfa.BYTES, stop_ids=(byte_dfa.STOP,), width=257, kind=kind
  )
  want = byte_dfa.of_tables(eager)
  got = byte_dfa.compile(text, kind=kind)
  want = dict(table=want.table, final=want.final)
  same_language(dict(table=got.table, final=got.final), want)
  assert got.states <= want["table"].shape[0]
  assert got.regex == eager.regex
  twin = automaton._outlines_dfa(
    got.regex, byte_dfa.BYTES.entries, (byte_dfa.STOP,), 257
  )
  pairs = same_language(twin, want)
  assert pairs == twin["table"].shape[0] == want["table"].shape[0]


def _bfs(frm, to, seed):
  """The plain twin of `automaton.hops`: a breadth-first search in
  Python."""
  out = [automaton.UNREACHED] * seed.size
  edges = collections.defaultdict(list)
  for a, b in zip(frm.tolist(), to.tolist(), strict=True):
    edges[a].append(b)
  frontier = collections.deque(np.flatnonzero(seed).tolist())
  for s in frontier:
    out[s] = 0
  while frontier:
    s = frontier.popleft()
    for t in edges[s]:
      if out[t] == automaton.UNREACHED:
        out[t] = out[s] + 1
        frontier.append(t)
  return np.array(out, np.int32)


@pytest.mark.parametrize("shape", ["random", "chain", "no seed"])
def test_hops_is_a_breadth_first_search(shape):
  rng = np.random.default_rng(len(shape))
  n = 400
  if shape == "chain":  # a key's bytes: one long path, a few shortcuts
    frm = np.concatenate([np.arange(n - 1), rng.integers(0, n, 20)])
    to = np.concatenate([np.arange(1, n), rng.integers(0, n, 20)])
  else:
    frm, to = rng.integers(0, n, 3 * n), rng.integers(0, n, 3 * n)
  seed = np.zeros(n, bool)
  if shape != "no seed":
    seed[rng.integers(0, n, 3)] = True
  got = automaton.hops(frm, to, seed)
  np.testing.assert_array_equal(got, _bfs(frm, to, seed))
  assert got.dtype == np.int32
  if shape == "chain":
    assert got.max() > 20  # deep: many levels


def test_a_new_schema_compiles_without_the_vocabulary(smol_vocab):
  """Compiling never walks the vocabulary: a schema's DFA over bytes in
  milliseconds, its masks as states are reached."""
  schema = dict(SCHEMAS["object"], title=f"never seen {time.time_ns()}")
  start = time.perf_counter()
  dfa = byte_dfa.compile(json.dumps(schema), kind="schema")
  compile_s = time.perf_counter() - start
  assert dfa.states < 400
  assert compile_s < 5.0  # generous: a shared machine (ms when quiet)
  width = len(smol_vocab.token_bytes())
  trie = token_trie.of(smol_vocab, width)
  masks = lazy.Lazy(dfa=dfa, trie=trie, stops=tuple(smol_vocab.eos_ids))
  assert masks.allowed(0).size > 0 and not masks._walks.keys() - {0}


def test_the_trie_walk_is_every_token_walked():
  """The trie's level-by-level walk equals walking each token's bytes."""
  vocab = cw.ByteVocabulary()
  tokens = [b"ab", b"a", None, b"abc", b"b", b"\xc3\xa9", b"zz"]
  trie = token_trie.build(tokens, width=8)
  assert trie.nodes == len(
    {b"a", b"ab", b"abc", b"b", b"\xc3", b"\xc3\xa9", b"z", b"zz"}
  )
  dfa = byte_dfa.compile(r"(ab?c?|é)z?")
  for state in range(dfa.states):
    rows = trie.walk(dfa.shifted, state + 1)
    for i, t in enumerate(tokens):
      want = -1 if t is None else dfa.run(t, state)
      assert rows[i] - 1 == want, (state, t)
    assert rows[7] == 0  # past the ids given
  del vocab


def _generate(model, constraint, kind, rows=6, steps=24, **kwargs):
  with C.constraint.tables_kind(kind):
    prefix = model.prefill(cw.Chunk.from_lists([[model.bos_id, 5, 9]] * rows))
    tokens, result = model.generate(
      [prefix],
      sample_ids=range(rows),
      steps=steps,
      sampling=cw.Sampling(temperature=1.0, seed=3),
      constraint=constraint,
      **kwargs,
    )
  return np.asarray(tokens.tokens), np.asarray(result.per_token_scores)


@pytest.mark.parametrize(
  "name", ["integer", "string", "nested", "schema-object", "choice-list"]
)
def test_the_device_walk_samples_what_the_eager_tables_sample(tiny, name):
  """`generate` under a constraint: the walking processor's rows (`walk.py`)
  draw the eager tables' tokens with their scores, bit for bit: every
  step's mask is the same. A row of its own constraint, and free rows,
  side by side."""
  constraint = [CORPUS[name], None, CORPUS["integer"]] * 2
  lazy_tokens, lazy_scores = _generate(tiny, constraint, "lazy")
  eager_tokens, eager_scores = _generate(tiny, constraint, "eager")
  np.testing.assert_array_equal(lazy_tokens, eager_tokens)
  np.testing.assert_array_equal(lazy_scores, eager_scores)


def test_budget_forcing_closes_every_row_by_byte_distances(tiny):
  """Forced rows close within their steps (the lazy distance counts
  tokens of one byte each: never below the fewest tokens)."""
  constraint = CORPUS["schema-object"]
  with C.constraint.tables_kind("lazy"):
    t = constraint.compile(tiny.vocab, stop_ids=[2], width=tiny.hparams.vocab)
  steps = int(t.distance[0]) + 6
  tokens, _ = _generate(
    tiny, constraint, "lazy", steps=steps, budget_forcing=True
  )
  for row in tokens:
    text = bytes(int(x) - 3 for x in row if x > 2)
    assert t.dfa.matches(text), text


def test_the_device_walk_on_smollm2_is_the_host_walk(smol_vocab):
  """SmolLM2's trie on the device (its wide levels one op each, its thin
  tail of long tokens in a loop): rows in states reached by random walks
  get the eager tables' masks from `WalkProcessor.apply`, and `update`
  moves each to the host walk's next state."""
  width = len(smol_vocab.token_bytes())
  stops = tuple(smol_vocab.eos_ids)
  constraint = CORPUS["schema-object"]
  with C.constraint.tables_kind("eager"):
    eager = constraint.compile(smol_vocab, stop_ids=stops, width=width)
  masks = constraint.compile(smol_vocab, stop_ids=stops, width=width)
  walker = C.walk.processor((), [masks], trie=masks.trie)
  assert walker.tail_parent.shape[0] > 0  # the tail loop is exercised
  rng = np.random.default_rng(0)
  pairs, tokens = [], []
  for _ in range(8):
    e, s = 0, 0
    for _ in range(int(rng.integers(0, 12))):
      t = int(rng.choice(np.setdiff1d(masks.allowed(s), stops)))
      e, s = eager.step(e, t), masks.step(s, t)
    pairs.append((e, s))
    tokens.append(int(rng.choice(masks.allowed(s))))
  g = jnp.ones(len(pairs), jnp.int32)
  s = jnp.asarray([p[1] for p in pairs], jnp.int32)
  info = StepInfo(
    generated=jnp.zeros(len(pairs), jnp.int32),
    remaining=jnp.int32(1000),
    stop_ids=jnp.asarray(stops, jnp.int32),
  )
  apply, update = jax.jit(type(walker).apply), jax.jit(type(walker).update)
  out = np.asarray(apply(walker, (g, s), jnp.zeros((len(pairs), width)), info))
  for (e, _), row in zip(pairs, out, strict=True):
    np.testing.assert_array_equal(np.flatnonzero(row == 0), eager.allowed(e))
  _, moved = update(walker, (g, s), jnp.asarray(tokens, jnp.int32), info)
  want = [
    p[1] if t in stops else masks.step(p[1], t)
    for p, t in zip(pairs, tokens, strict=True)
  ]
  np.testing.assert_array_equal(np.asarray(moved), want)
